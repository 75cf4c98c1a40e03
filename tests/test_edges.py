"""Edge-case semantics like torch, on every executor: empty tensors, NaN / +-inf inputs, constant
rows with eps = 0, huge fp16 magnitudes (statistics in fp32), subnormal inputs.

Each case runs the public op on the executor and torch.nn.functional on the same (rounded) inputs
in fp64 on the CPU, forward and backward, and compares them with normkit.testing's tolerances;
NaN and +-inf must sit at the same places (assert_close(equal_nan=True) compares infinities
exactly). docs/testing.md lists the cases decided differently from torch.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, INTERPRETER

import normkit
from normkit.testing import Executor, assert_close

EXECUTORS = [pytest.param(Executor("reference", "cpu"), id="reference")]
EXECUTORS += [pytest.param(ex, id=ex.name) for ex in INTERPRETER]
EXECUTORS += [pytest.param(ex, id=ex.name, marks=mark) for ex, mark in DEVICE]

ROW_OPS = ["layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm", "add_rms_norm"]
CHANNEL_OPS = ["group_norm", "instance_norm", "batch_norm", "batch_norm-eval"]


def _call(lib, op, x, w=None, b=None, eps=1e-5, residual=None, stats=None):
    """One op of ``lib`` (normkit or torch.nn.functional); the add-norms are h = x + residual then
    the norm on torch's side. Rows are normalized over the last dim; channel ops take (N, C, *)."""
    n = x.shape[-1]
    if op in ("softmax", "log_softmax"):
        return getattr(lib, op)(x, -1)
    if op.startswith("add_"):
        if lib is normkit:
            kw = dict(weight=w, bias=b) if op == "add_layer_norm" else dict(weight=w)
            return getattr(normkit, op)(x, residual, (n,), **kw, eps=eps)
        op, x = op[4:], x + residual
    if op == "layer_norm":
        return lib.layer_norm(x, (n,), w, b, eps)
    if op == "rms_norm":
        return lib.rms_norm(x, (n,), w, eps)
    if op == "group_norm":
        return lib.group_norm(x, 2, w, b, eps)
    if op == "instance_norm":
        rm, rv = (None, None) if stats is None else stats
        return lib.instance_norm(x, rm, rv, w, b, eps=eps)
    rm, rv = stats
    return lib.batch_norm(x, rm, rv, w, b, training=op == "batch_norm", eps=eps)


def _param_shape(op, x):
    return (x.shape[1],) if op in CHANNEL_OPS else (x.shape[-1],)


def _both(executor, op, x, dy, *, eps=1e-5, affine=True, residual=None, stats=None, dtype=None):
    """-> (normkit's results on the executor, torch's fp64 results on the CPU): y, dx, dweight,
    dbias, dresidual and the running statistics (where the op has them)."""
    dtype = dtype or x.dtype
    dev = executor.device
    g = torch.Generator().manual_seed(1)
    shape = _param_shape(op, x)
    has_w = affine and op not in ("softmax", "log_softmax")
    has_b = has_w and "rms" not in op
    w = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.5 + 1).to(dtype) if has_w else None
    b = (torch.randn(shape, generator=g, dtype=torch.float64) * 0.5).to(dtype) if has_b else None
    results = []
    for lib, device, cast in ((normkit, dev, lambda t: t), (F, "cpu", lambda t: t.double())):
        def leaf(t, cast=cast, device=device):
            return None if t is None else cast(t.detach()).to(device).requires_grad_(True)
        xl, wl, bl, rl = leaf(x), leaf(w), leaf(b), leaf(residual)
        st = None if stats is None else [cast(s.clone()).to(device) for s in stats]
        if lib is normkit:
            with executor.activate():
                y = _call(lib, op, xl, wl, bl, eps, rl, st)
                y.backward(dy.to(dev))
        else:
            y = _call(lib, op, xl, wl, bl, eps, rl, st)
            y.backward(dy.double())
        grad = lambda t: None if t is None else t.grad  # noqa: E731
        results.append(dict(y=y.detach(), dx=xl.grad, dweight=grad(wl), dbias=grad(bl),
                            dresidual=grad(rl), stats=st))  # fmt: skip
    return results


def _compare(ours, ref, dtype, rows, keys=("y", "dx", "dweight", "dbias", "dresidual")):
    kinds = dict(y="fwd", dx="bwd", dweight="param", dbias="param", dresidual="bwd")
    for key in keys:
        if ref[key] is None:
            assert ours[key] is None, key
            continue
        assert ours[key].shape == ref[key].shape, f"{key}: {ours[key].shape} != {ref[key].shape}"
        assert_close(ours[key].cpu(), ref[key], dtype, kinds[key], key, rows, equal_nan=True)
    if ref["stats"] is not None:
        for name, got, want in zip(("running_mean", "running_var"), ours["stats"], ref["stats"]):
            torch.testing.assert_close(got.cpu().double(), want, atol=1e-5, rtol=1e-5, equal_nan=True,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def _activate_or_skip(executor, dtype):
    ok, reason = executor.status()
    if not ok:
        pytest.skip(f"{executor.name}: {reason}")
    if dtype not in executor.dtypes:
        pytest.skip(f"{executor.name}: {dtype} not served")


def _inputs(shape, dtype, seed=0, scale=1.0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    r = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, dy, r


def _stats(op, C):
    if op.startswith("batch_norm") or op == "instance_norm":
        return [torch.randn(C, dtype=torch.float64).float() * 0.1, torch.rand(C).float() + 0.5]
    return None


# --- empty tensors ----------------------------------------------------------------------------------

EMPTY_ROW_SHAPES = [(0, 8), (2, 0, 8), (0, 3, 5), (3, 0)]
EMPTY_CHANNEL_SHAPES = [(0, 4, 3), (0, 4, 2, 2), (2, 4, 0), (3, 4, 0, 5)]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op,shape", [(op, s) for op in ROW_OPS for s in EMPTY_ROW_SHAPES]
                         + [(op, s) for op in CHANNEL_OPS for s in EMPTY_CHANNEL_SHAPES
                            if not (op == "instance_norm" and s[0] == 0)], ids=str)  # fmt: skip
def test_empty_like_torch(executor, op, shape):
    """M = 0 and zero-size leading (or spatial) dims: empty outputs and gradients of the right
    shapes, dweight / dbias zero (or what torch gives), running statistics as torch leaves them."""
    _activate_or_skip(executor, torch.float32)
    x, dy, r = _inputs(shape, torch.float32)
    # instance_norm: torch raises IndexError for N = 0 with running statistics (a torch bug), so
    # those are checked without them (test_instance_norm_empty_keeps_running_stats).
    stats = None if op == "instance_norm" else _stats(op, shape[1])
    ours, ref = _both(executor, op, x, dy, residual=r if op.startswith("add_") else None, stats=stats)
    # dweight / dbias of GroupNorm / InstanceNorm over groups with no elements: torch gives NaN
    # (0 * the NaN statistics), normkit the empty sum, 0 (docs/testing.md).
    if op in ("group_norm", "instance_norm") and math.prod(shape[2:]) == 0:
        for key in ("dweight", "dbias"):
            assert torch.equal(ours[key], torch.zeros_like(ours[key])), key
            ours[key] = ref[key] = None
    _compare(ours, ref, torch.float32, 1)


@pytest.mark.parametrize("shape", [(0, 4, 3), (0, 4, 2, 2), (2, 4, 0)], ids=str)
def test_instance_norm_empty_keeps_running_stats(shape):
    """torch's instance_norm raises IndexError for N = 0 (a torch bug); normkit returns the empty
    result, a zero-size gradient, and leaves the running statistics as they were."""
    rm, rv = torch.randn(4), torch.rand(4) + 0.5
    before = rm.clone(), rv.clone()
    x = torch.randn(shape, requires_grad=True)
    y = normkit.instance_norm(x, rm, rv)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


# --- NaN / +-inf ------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("n", [7, 1025])
def test_nan_inf_stay_in_their_row(executor, op, value, n):
    """One NaN / +-inf in row 1 (and an all-NaN row 3): those rows give what torch gives (NaN
    for LayerNorm; 0 and NaN for RMSNorm with inf; ...), every other row stays finite and correct.
    dweight / dbias are NaN wherever torch's are."""
    dtype = torch.float32
    _activate_or_skip(executor, dtype)
    x, dy, r = _inputs((5, n), dtype)
    x[1, n // 2] = value
    x[3] = float("nan")
    ours, ref = _both(executor, op, x, dy, residual=r if op.startswith("add_") else None)
    _compare(ours, ref, dtype, 5)
    for key in ("y", "dx"):
        clean = torch.ones(5, dtype=torch.bool)
        clean[[1, 3]] = False
        assert ours[key][clean].isfinite().all(), f"{key}: non-finite values outside the bad rows"


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=str)
@pytest.mark.parametrize("op", CHANNEL_OPS)
def test_nan_inf_in_channel_ops(executor, op, value):
    """GroupNorm / InstanceNorm: a NaN in sample 1 poisons only its group (channel); BatchNorm:
    only its channel, across samples (as torch)."""
    dtype = torch.float32
    _activate_or_skip(executor, dtype)
    x, dy, _ = _inputs((3, 4, 6), dtype)
    x[1, 2, 3] = value
    ours, ref = _both(executor, op, x, dy, stats=_stats(op, 4))
    if op == "batch_norm" and value == float("inf"):
        # The Triton kernels' shifted / Chan-merged batch mean of a channel holding +inf is NaN
        # where torch's plain mean is +inf: running_mean[2] is poisoned either way (docs/testing.md).
        assert ours["stats"][0][2].isnan() or ours["stats"][0][2] == float("inf")
        ours["stats"][0][2] = ref["stats"][0][2] = 0.0
    _compare(ours, ref, dtype, 18)
    assert ours["y"][0].isfinite().all() or op.startswith("batch_norm")
    assert ours["y"][:, 0].isfinite().all()


# --- constant rows with eps = 0 ---------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm",
                                "add_rms_norm"])  # fmt: skip
@pytest.mark.parametrize("n", [8, 7, 1025])
def test_constant_rows_eps_zero(executor, op, n):
    """Rows of one exactly-summable value (1, -3, 0.5, 0) with eps = 0: torch gives NaN for
    LayerNorm (0 * inf), +-1 for RMSNorm of a non-zero constant and NaN for a zero row; uniform
    softmax. normkit gives the same, forward and backward."""
    dtype = torch.float32
    _activate_or_skip(executor, dtype)
    x = torch.tensor([1.0, -3.0, 0.5, 0.0]).repeat_interleave(n).view(4, n)
    _, dy, _ = _inputs((4, n), dtype)
    residual = torch.zeros(4, n) if op.startswith("add_") else None
    ours, ref = _both(executor, op, x, dy, eps=0.0, residual=residual)
    _compare(ours, ref, dtype, 4)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_constant_channels_eps_zero(executor, op):
    """GroupNorm of constant groups with eps = 0: NaN (0 * inf), as torch. InstanceNorm: NaN as
    well, where torch gives 0 (its batch-norm path special-cases var = eps = 0 to rstd = 0; its
    group_norm and layer_norm do not): normkit is consistent with its GroupNorm (docs/testing.md).
    (BatchNorm training refuses eps = 0, as torch 2.13 does.)"""
    dtype = torch.float32
    _activate_or_skip(executor, dtype)
    x = torch.tensor([1.0, -3.0, 0.5, 0.0]).view(1, 4, 1).expand(2, 4, 5).contiguous()
    x[1] = 2.0
    _, dy, _ = _inputs((2, 4, 5), dtype)
    ours, ref = _both(executor, op, x, dy, eps=0.0)
    if op == "group_norm":
        _compare(ours, ref, dtype, 10)
    else:
        assert ours["y"].isnan().all() and ours["dx"].isnan().all()


def test_batch_norm_training_refuses_eps_zero():
    with pytest.raises(normkit.InvalidArgument, match="eps must be positive when training, got 0.0"):
        normkit.batch_norm(torch.randn(3, 4, 5), None, None, training=True, eps=0.0)


# --- huge magnitudes (fp16), subnormals ---------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ROW_OPS + CHANNEL_OPS)
def test_fp16_huge_magnitudes(executor, op):
    """fp16 inputs near the fp16 maximum (x^2 and sums of x overflow fp16): statistics in fp32 keep
    y and the gradients finite and correct."""
    dtype = torch.float16
    _activate_or_skip(executor, dtype)
    shape = (4, 6, 257) if op in CHANNEL_OPS else (6, 1031)
    x, dy, r = _inputs(shape, dtype, seed=3, scale=2e4, offset=3e4)
    x = x.clamp(-65000, 65000)
    assert x.abs().max() > 6e4 and x.float().square().sum() > 65504
    ours, ref = _both(executor, op, x, dy, residual=r if op.startswith("add_") else None,
                      stats=_stats(op, 6))  # fmt: skip
    rows = math.prod(shape) // shape[1] if op in CHANNEL_OPS else shape[0]
    if op in ("log_softmax", "batch_norm-eval"):  # y rounded to fp16 overflows in torch as here
        ref["y"] = ref["y"].to(dtype).double()
    # (log_softmax's and eval BatchNorm's outputs themselves exceed the fp16 range here, as in
    # torch; the statistics never do.)
    for key in ("y", "dx") if op not in ("log_softmax", "batch_norm-eval") else ("dx",):
        assert ours[key].isfinite().all(), f"{key}: overflow"
    # (eval BatchNorm with these running statistics: xhat ~ 1e5, so dweight overflows fp16 too)
    keys = ("y", "dx", "dweight", "dbias") if op != "batch_norm-eval" else ("y", "dx", "dbias")
    _compare(ours, ref, dtype, rows, keys=keys)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm", "group_norm", "batch_norm"])
def test_fp16_subnormal_inputs(executor, op):
    """fp16 subnormals (|x| < 6.1e-5) are normal numbers in fp32: with a tiny eps they normalize
    to O(1) values, exactly as torch in fp64 (nothing flushed to zero)."""
    dtype = torch.float16
    _activate_or_skip(executor, dtype)
    shape = (3, 4, 33) if op in CHANNEL_OPS else (5, 33)
    x, dy, r = _inputs(shape, dtype, seed=4, scale=2e-5)
    dy = dy * 1e-3  # dx ~ rstd * dy, rstd ~ 5e4: keep dx inside the fp16 range
    assert (x.abs() < 6.1e-5).all() and (x != 0).sum() > x.numel() // 2
    ours, ref = _both(executor, op, x, dy, eps=1e-12, residual=r * 1e-5 if op.startswith("add_") else None,
                      stats=_stats(op, 4))  # fmt: skip
    assert ref["y"].abs().max() > 0.5  # the output is O(1), so a flush to zero would show
    _compare(ours, ref, dtype, 12 if op in CHANNEL_OPS else 5)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax"])
def test_fp32_subnormal_inputs_are_not_flushed(executor, op):
    """fp32 subnormal inputs (1e-39): RMSNorm / LayerNorm scale them by rstd = 1 / sqrt(eps)
    into normal numbers; a kernel flushing subnormals to zero would return 0 instead. Compared with
    a relative tolerance only."""
    dtype = torch.float32
    _activate_or_skip(executor, dtype)
    x, dy, _ = _inputs((3, 64), dtype, seed=5, scale=1e-39)
    assert (x.abs() < torch.finfo(torch.float32).tiny).all() and (x != 0).all()
    ours, ref = _both(executor, op, x, dy, affine=False)
    torch.testing.assert_close(ours["y"].cpu().double(), ref["y"], atol=0, rtol=1e-4)
    if op != "softmax":
        assert ours["y"].abs().min() > 0, "subnormal inputs were flushed to zero"
