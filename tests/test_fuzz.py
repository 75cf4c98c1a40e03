"""Property-based fuzzing of every public op (hypothesis), forward and backward, against torch's
own fp64 autograd on the same (already rounded) inputs, with normkit.testing's tolerance table.

Each example draws the op variant, the dtype (what the executor serves), the leading and normalized
dims (N = 1, primes, powers of two +- 1, and on the GPU large N), the memory layout of the input and
of the incoming gradient (contiguous, transposed, row-sliced, column-strided, expanded with stride
0), weight / bias presence and dtype, eps, and the op's own arguments (softmax dim and dtype,
dropout p and residual stream, GroupNorm groups, BatchNorm training / running statistics).

Profiles (hypothesis.settings.register_profile), picked per executor or by NORMKIT_FUZZ_PROFILE:
  ci   interpreter executors and the reference: 40 examples per test and executor, small shapes
       (N <= 300, at most 24 rows / 4096 elements), derandomized (the same examples every run).
  gpu  `cuda`, `npu-kernels-on-cuda` (pytest -m cuda): 150 examples, N up to 131073, up to 4096
       rows / 2^22 elements, in DEVICE_PARTS tests of 30 examples from fixed seeds 0-4.
  dev  random (not derandomized) examples at CI sizes, 300 per test and executor: bug hunting.
NORMKIT_FUZZ_PROFILE=<name> forces one profile for every executor; NORMKIT_FUZZ_EXAMPLES=<n>
overrides the example count of the profile in use.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, INTERPRETER
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import normkit
from normkit import reference
from normkit.testing import Executor, add_norm_reference, assert_close, fp64, poison_allocator

_COMMON = dict(
    deadline=None,
    database=None,  # nothing written between runs: CI sees exactly the derandomized examples
    print_blob=True,  # a failure prints @reproduce_failure(...) for the exact example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],  # fmt: skip
)
settings.register_profile("ci", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("gpu", max_examples=150, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=300, derandomize=False, **_COMMON)


@dataclass(frozen=True)
class Limits:
    max_n: int  # longest drawn row (beyond the special values)
    max_rows: int
    max_elements: int
    special_n: tuple[int, ...]  # N = 1, primes, powers of two +- 1
    max_spatial: int  # GroupNorm / BatchNorm spatial size per dim


_SMALL_N = (1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 251, 255, 256, 257)
LIMITS = {
    "ci": Limits(300, 24, 4096, _SMALL_N, 12),
    "gpu": Limits(70000, 4096, 1 << 22, _SMALL_N + (1021, 1023, 1024, 1025, 4095, 4096, 4097, 8191,
                                                    8192, 8193, 16383, 16384, 16385, 32767, 32768,
                                                    32769, 40999, 65535, 65536, 65537, 131073), 96),
}  # fmt: skip
LIMITS["dev"] = LIMITS["ci"]  # random examples at CI sizes: bug hunting on any machine

# On a device the examples are drawn in DEVICE_PARTS tests of their own seed each, which pytest-xdist
# runs side by side: most of a device example's time is compiling the kernels for its shape (a
# 150-example test took 223 s on an H200, the longest of the GPU suite).
DEVICE_PARTS = 5
EXECUTORS = [pytest.param(Executor("reference", "cpu"), 0, id="reference")]
EXECUTORS += [pytest.param(ex, 0, id=ex.name) for ex in INTERPRETER]
EXECUTORS += [pytest.param(ex, part, id=f"{ex.name}-part{part}", marks=mark) for ex, mark in DEVICE
              for part in range(DEVICE_PARTS)]  # fmt: skip


def profile_for(executor: Executor) -> str:
    return os.environ.get("NORMKIT_FUZZ_PROFILE") or ("ci" if executor.device == "cpu" else "gpu")


def fuzz(executor: Executor, part: int, run_on, strategy, body) -> None:
    """Run ``body(case)`` on ``strategy(limits)`` under the executor's profile; on a device, part
    ``part`` of DEVICE_PARTS (its share of the profile's examples, from seed ``part``)."""
    name = profile_for(executor)
    limits = LIMITS[name]
    overrides = {}
    if executor.device != "cpu":
        profile = settings.get_profile(name)
        overrides = dict(max_examples=-(-profile.max_examples // DEVICE_PARTS), derandomize=False)
    if os.environ.get("NORMKIT_FUZZ_EXAMPLES"):
        overrides["max_examples"] = int(os.environ["NORMKIT_FUZZ_EXAMPLES"])
    ok, reason = executor.status()
    if not ok:
        pytest.skip(f"{executor.name}: {reason}")

    @settings(settings.get_profile(name), **overrides)
    @given(case=strategy(limits, executor))
    def run(case):
        with run_on(executor):
            body(executor, case)

    if executor.device != "cpu":
        run = seed(part)(run)
    run()


# --- strategies -----------------------------------------------------------------------------------

LAYOUTS = ("contiguous", "transposed", "row-sliced", "column-strided", "expanded")
EPS = (1e-5, 1e-6, 1e-3, 0.1, 1.0)


def _dtypes(executor):
    return st.sampled_from([d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                            if d in executor.dtypes])  # fmt: skip


@st.composite
def _row_length(draw, lim: Limits):
    return draw(st.one_of(st.sampled_from(lim.special_n), st.integers(1, lim.max_n)))


@st.composite
def _lead(draw, budget: int, max_ndim: int = 3):
    """Leading dims whose product is at most ``budget`` (primes and 1 come up often)."""
    dims = []
    for _ in range(draw(st.integers(0, max_ndim))):
        d = draw(st.one_of(st.sampled_from([1, 2, 3, 5, 7, 13]), st.integers(1, max(1, budget))))
        d = max(1, min(d, budget))
        dims.append(d)
        budget = max(1, budget // d)
    return tuple(dims)


@st.composite
def _norm_shape(draw, lim: Limits, max_ndim: int = 2):
    n = draw(_row_length(lim))
    if max_ndim > 1 and draw(st.booleans()) and n > 1:
        divisors = [d for d in range(2, min(n, 4096) + 1) if n % d == 0]
        if divisors:
            d = draw(st.sampled_from(divisors))
            return (n // d, d)
    return (n,)


def _budget(lim: Limits, n: int) -> int:
    return max(1, min(lim.max_rows, lim.max_elements // max(n, 1)))


def _tensor(shape, dtype, device, layout, g, scale=1.0, offset=0.0) -> torch.Tensor:
    """Values randn * scale + offset (rounded to dtype) in the given memory layout."""

    def rand(s):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale + offset).to(dtype).to(device)

    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        return rand(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "row-sliced" and len(shape) >= 1:
        wide = rand(shape[:-1] + (2 * shape[-1] + 3,))
        return wide[..., 3:3 + shape[-1]]
    if layout == "column-strided" and len(shape) >= 1:
        return rand(shape[:-1] + (2 * shape[-1],))[..., ::2]
    if layout == "expanded" and len(shape) >= 2:
        return rand((1,) + shape[1:]).expand(shape)
    return rand(shape)


def _leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


def _up(t):
    return None if t is None else fp64(t).requires_grad_(True)


def _grad(t):
    return None if t is None else t.grad


def _compare(got: dict, ref: dict, kinds: dict, dtypes: dict, rows: int, tol_as=None,
             condition=1.0) -> None:
    """``tol_as``: judge every output by this dtype's tolerance instead of its own; ``condition``
    scales atol (assert_close)."""
    for key, kind in kinds.items():
        if ref.get(key) is None:
            assert got.get(key) is None, f"{key}: expected None, got a tensor"
            continue
        assert got[key] is not None, f"{key}: missing"
        assert got[key].dtype == dtypes[key], f"{key}: dtype {got[key].dtype}, expected {dtypes[key]}"
        tol_dtype = tol_as or (dtypes[key] if kind != "param" else dtypes.get("x", dtypes[key]))
        assert_close(got[key], ref[key].to(got[key].device), tol_dtype, kind, key, rows, condition=condition)


# --- LayerNorm / RMSNorm --------------------------------------------------------------------------


@st.composite
def row_norm_cases(draw, lim: Limits, executor):
    dtype = draw(_dtypes(executor))
    norm = draw(_norm_shape(lim))
    op = draw(st.sampled_from(["layer_norm", "rms_norm"]))
    half = dtype in (torch.float16, torch.bfloat16)
    return dict(
        op=op, dtype=dtype, norm=norm, lead=draw(_lead(_budget(lim, math.prod(norm)))),
        layout=draw(st.sampled_from(LAYOUTS)), dy_layout=draw(st.sampled_from(LAYOUTS[:3])),
        weight=draw(st.booleans()), bias=op == "layer_norm" and draw(st.booleans()),
        param_dtype=torch.float32 if half and draw(st.booleans()) else dtype,
        eps=draw(st.sampled_from(EPS + ((None,) if op == "rms_norm" else ()))),
        mean=draw(st.sampled_from([0.0, 0.0, 3.0])), seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def check_row_norm(executor, c):
    g = torch.Generator().manual_seed(c["seed"])
    shape, dev, dtype = c["lead"] + c["norm"], executor.device, c["dtype"]
    x = _tensor(shape, dtype, dev, c["layout"], g, offset=c["mean"])
    dy = _tensor(shape, dtype, dev, c["dy_layout"], g)
    w = _tensor(c["norm"], c["param_dtype"], dev, "contiguous", g, 0.5, 1.0) if c["weight"] else None
    b = _tensor(c["norm"], c["param_dtype"], dev, "contiguous", g, 0.5) if c["bias"] else None
    eps = torch.finfo(dtype).eps if c["eps"] is None else c["eps"]
    x64, w64, b64 = _up(x), _up(w), _up(b)
    if c["op"] == "layer_norm":
        y64 = F.layer_norm(x64, c["norm"], w64, b64, eps)
    else:
        y64 = F.rms_norm(x64, c["norm"], w64, eps)
    y64.backward(fp64(dy))
    poison_allocator(dev)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    if c["op"] == "layer_norm":
        y = normkit.layer_norm(xl, c["norm"], wl, bl, eps)
    else:
        y = normkit.rms_norm(xl, c["norm"], wl, c["eps"])
    y.backward(dy)
    rows = math.prod(c["lead"])
    _compare(dict(y=y, dx=xl.grad, dweight=_grad(wl), dbias=_grad(bl)),
             dict(y=y64, dx=x64.grad, dweight=_grad(w64), dbias=_grad(b64)),
             dict(y="fwd", dx="bwd", dweight="param", dbias="param"),
             dict(x=dtype, y=dtype, dx=dtype, dweight=c["param_dtype"], dbias=c["param_dtype"]),
             rows, condition=_row_condition(x64, c["norm"], eps) if c["op"] == "layer_norm" else 1.0,
             )  # fmt: skip


@pytest.mark.parametrize("executor, part", EXECUTORS)
def test_fuzz_layer_norm_rms_norm(executor, part, run_on):
    fuzz(executor, part, run_on, row_norm_cases, check_row_norm)


# --- softmax / log_softmax -------------------------------------------------------------------------


@st.composite
def softmax_cases(draw, lim: Limits, executor):
    n = draw(_row_length(lim))
    lead = draw(_lead(_budget(lim, n)))
    ndim = len(lead) + 1
    pos = draw(st.integers(0, ndim - 1))  # where the softmax dim sits
    shape = lead[:pos] + (n,) + lead[pos:]
    dtype = draw(_dtypes(executor))
    out_dtype = None
    if dtype != torch.float64 and draw(st.integers(0, 3)) == 0:
        out_dtype = torch.float32  # the dtype argument: cast first
    return dict(
        op=draw(st.sampled_from(["softmax", "log_softmax"])), dtype=dtype, out_dtype=out_dtype,
        shape=shape, dim=draw(st.sampled_from([pos, pos - ndim])), layout=draw(st.sampled_from(LAYOUTS)),
        dy_layout=draw(st.sampled_from(LAYOUTS[:3])), scale=draw(st.sampled_from([1.0, 3.0, 30.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def check_softmax(executor, c):
    g = torch.Generator().manual_seed(c["seed"])
    dev, dtype, dim = executor.device, c["dtype"], c["dim"]
    out = c["out_dtype"] or dtype
    x = _tensor(c["shape"], dtype, dev, c["layout"], g, scale=c["scale"])
    dy = _tensor(c["shape"], out, dev, c["dy_layout"], g)
    log = c["op"] == "log_softmax"
    y64 = getattr(F, c["op"])(fp64(x), dim)
    poison_allocator(dev)
    xl = _leaf(x)
    y = getattr(normkit, c["op"])(xl, dim, dtype=c["out_dtype"])
    y.backward(dy)
    # dx from the saved, rounded y (as torch's own backward does); see testing.check_softmax_case.
    backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    dx64 = backward(fp64(dy), fp64(y), dim % len(c["shape"]), torch.float64)
    _compare(dict(y=y, dx=xl.grad), dict(y=y64, dx=dx64), dict(y="fwd", dx="bwd"),
             dict(y=out, dx=dtype), 1)  # fmt: skip


@pytest.mark.parametrize("executor, part", EXECUTORS)
def test_fuzz_softmax(executor, part, run_on):
    fuzz(executor, part, run_on, softmax_cases, check_softmax)


# --- fused residual add + dropout + norm -----------------------------------------------------------


@st.composite
def add_norm_cases(draw, lim: Limits, executor):
    dtype = draw(_dtypes(executor))
    norm = draw(_norm_shape(lim))
    op = draw(st.sampled_from(["add_layer_norm", "add_rms_norm"]))
    half = dtype in (torch.float16, torch.bfloat16)
    wide = [torch.float32] if dtype != torch.float64 else [torch.float64]
    return dict(
        op=op, dtype=dtype, norm=norm, lead=draw(_lead(_budget(lim, math.prod(norm)))),
        layout=draw(st.sampled_from(LAYOUTS)), r_layout=draw(st.sampled_from(LAYOUTS)),
        residual=draw(st.sampled_from([None, dtype] + wide)),
        residual_dtype=draw(st.sampled_from([None, None] + wide)),
        weight=draw(st.booleans()), bias=op == "add_layer_norm" and draw(st.booleans()),
        param_dtype=torch.float32 if half and draw(st.booleans()) else dtype,
        eps=draw(st.sampled_from(EPS + ((None,) if op == "add_rms_norm" else ()))),
        p=draw(st.sampled_from([0.0, 0.1, 0.5])), use_h=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def check_add_norm(executor, c):
    g = torch.Generator().manual_seed(c["seed"])
    shape, dev, dtype, norm = c["lead"] + c["norm"], executor.device, c["dtype"], c["norm"]
    x = _tensor(shape, dtype, dev, c["layout"], g)
    r = _tensor(shape, c["residual"], dev, c["r_layout"], g) if c["residual"] else None
    w = _tensor(norm, c["param_dtype"], dev, "contiguous", g, 0.5, 1.0) if c["weight"] else None
    b = _tensor(norm, c["param_dtype"], dev, "contiguous", g, 0.5) if c["bias"] else None
    h_dtype = c["residual_dtype"] or c["residual"] or dtype
    dy = _tensor(shape, dtype, dev, "contiguous", g)
    dh = _tensor(shape, h_dtype, dev, "transposed", g) if c["use_h"] else torch.zeros(shape, dtype=h_dtype,
                                                                                      device=dev)  # fmt: skip
    fn = getattr(normkit, c["op"])
    seed = c["seed"] % 1000
    eps = c["eps"]
    if c["p"] > 0:  # the documented mask (every backend draws it; x may hold exact zeros here)
        rows_cols = (math.prod(c["lead"]), math.prod(norm))  # a row: the normalized dims
        keep = reference.dropout_keep(rows_cols, c["p"], seed, "cpu").reshape(shape).to(dev)
    else:
        keep = torch.ones(shape, dtype=torch.bool, device=dev)
    ref = add_norm_reference(c["op"], x, r, w, b, dy, dh, norm, eps, keep, c["p"], h_dtype)
    poison_allocator(dev)
    xl, rl, wl, bl = _leaf(x), _leaf(r), _leaf(w), _leaf(b)
    params = dict(weight=wl, bias=bl) if c["op"] == "add_layer_norm" else dict(weight=wl)
    if eps is None:
        eps = 1e-5 if c["op"] == "add_layer_norm" else None
    y, h = fn(xl, rl, norm, **params, eps=eps, dropout_p=c["p"], seed=seed,
              residual_dtype=c["residual_dtype"], prenorm=True)  # fmt: skip
    if c["use_h"]:
        torch.autograd.backward([y, h], [dy, dh])
    else:
        y.backward(dy)
    rows = math.prod(c["lead"])
    _compare(dict(y=y, h=h, dx=xl.grad, dresidual=_grad(rl), dweight=_grad(wl), dbias=_grad(bl)),
             {k: ref[k] for k in ("y", "h", "dx", "dresidual", "dweight", "dbias")},
             dict(y="fwd", h="fwd", dx="bwd", dresidual="bwd", dweight="param", dbias="param"),
             dict(x=dtype, y=dtype, h=h_dtype, dx=dtype, dresidual=c["residual"],
                  dweight=c["param_dtype"], dbias=c["param_dtype"]), rows,
             # fp64 dropout: the kernels' keep-scale 1 / (1 - p) is an fp32 argument (docs/testing.md)
             tol_as=torch.float32 if dtype == torch.float64 and c["p"] > 0 else None,
             condition=_row_condition(ref["h"], norm, eps) if c["op"] == "add_layer_norm" else 1.0,
             )  # fmt: skip


@pytest.mark.parametrize("executor, part", EXECUTORS)
def test_fuzz_add_norm(executor, part, run_on):
    fuzz(executor, part, run_on, add_norm_cases, check_add_norm)


# --- GroupNorm / InstanceNorm / BatchNorm ---------------------------------------------------------


@st.composite
def channel_cases(draw, lim: Limits, executor):
    op = draw(st.sampled_from(["group_norm", "instance_norm", "batch_norm", "batch_norm"]))
    groups = draw(st.sampled_from([1, 2, 3, 4, 8]))
    C = groups * draw(st.sampled_from([1, 2, 3, 5]))
    spatial = tuple(draw(st.lists(st.integers(1, lim.max_spatial), min_size=0, max_size=2)))
    most = lim.max_elements // (C * max(1, math.prod(spatial)))
    batch = draw(st.integers(1, max(1, min(8 if lim.max_rows < 100 else 32, most))))
    training = op != "batch_norm" or draw(st.booleans())
    if op == "instance_norm" and math.prod(spatial) == 1:
        spatial = spatial + (2,)
    if op == "batch_norm" and training and batch * math.prod(spatial) == 1:
        batch = 2
    if op == "group_norm" and batch * (C // groups) * math.prod(spatial) == 1:
        batch = 2  # torch rejects one value per group (tests/test_errors.py)
    dtype = draw(_dtypes(executor))
    half = dtype in (torch.float16, torch.bfloat16)
    return dict(
        op=op, groups=groups, shape=(batch, C) + spatial, dtype=dtype, training=training,
        layout=draw(st.sampled_from(LAYOUTS)), dy_layout=draw(st.sampled_from(LAYOUTS[:3])),
        weight=draw(st.booleans()), bias=draw(st.booleans()),
        param_dtype=torch.float32 if half and draw(st.booleans()) else dtype,
        running=not training or draw(st.booleans()), momentum=draw(st.sampled_from([0.1, 0.5, 1.0])),
        eps=draw(st.sampled_from(EPS)), mean=draw(st.sampled_from([0.0, 0.0, 5.0])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )  # fmt: skip


def _channel_condition(c, x64, running):
    """How much rounding in the input dtype is amplified: max |x| * rstd over the normalized
    groups, relative to a standard-normal group (|x| <= ~4, rstd ~ 1). A group of a few close
    values far from 0 (mean 5, spread 0.01: rstd ~ 170) loses digits to cancellation in any
    fp32 implementation, torch's included; the tolerance's atol grows with it (never shrinks)."""
    x = x64.detach()
    N, C = x.shape[0], x.shape[1]
    eps = 1e-5 if c["eps"] is None else c["eps"]
    if c["op"] == "batch_norm" and not c["training"]:
        var = running[1].to(x.device)
    elif c["op"] == "batch_norm":
        var = x.transpose(0, 1).reshape(C, -1).var(dim=1, unbiased=False)
    else:
        groups = c["groups"] if c["op"] == "group_norm" else C
        var = x.reshape(N * groups, -1).var(dim=1, unbiased=False)
    return _condition(var, x, eps)


def _condition(var, x, eps) -> float:
    """max(1, max rstd * max |x| / 4) from the per-row (per-group) variances ``var`` of ``x``."""
    if var.numel() == 0 or x.numel() == 0:
        return 1.0
    rstd = (fp64(var) + eps).rsqrt().max().item()
    return max(1.0, rstd * fp64(x).abs().max().item() / 4.0)


def _row_condition(x64, norm, eps) -> float:
    """:func:`_channel_condition` for LayerNorm rows (RMSNorm has no mean to cancel): rows of few
    close values (N = 2, or a large mean) lose digits to cancellation in fp32 as groups do. A GPU
    fuzz example: add_layer_norm fp32, N = 2, rstd 132, dx off by 1.2e-4 (atol 1e-4), the same
    under the interpreter with the kernels of before and after the host-time changes."""
    rows = fp64(x64).reshape(-1, math.prod(norm))
    return _condition(rows.var(dim=1, unbiased=False), rows, eps)


def check_channel(executor, c):
    g = torch.Generator().manual_seed(c["seed"])
    shape, dev, dtype, C = c["shape"], executor.device, c["dtype"], c["shape"][1]
    x = _tensor(shape, dtype, dev, c["layout"], g, offset=c["mean"])
    dy = _tensor(shape, dtype, dev, c["dy_layout"], g)
    w = _tensor((C,), c["param_dtype"], dev, "contiguous", g, 0.5, 1.0) if c["weight"] else None
    b = _tensor((C,), c["param_dtype"], dev, "contiguous", g, 0.5) if c["bias"] else None
    stats = None
    if c["running"]:
        stats = (_tensor((C,), torch.float32, dev, "contiguous", g, 0.5, c["mean"]),
                 _tensor((C,), torch.float32, dev, "contiguous", g, 0.1, 1.0).abs())  # fmt: skip
    ref_stats = None if stats is None else [fp64(s) for s in stats]
    ours_stats = None if stats is None else [s.clone() for s in stats]
    x64, w64, b64 = _up(x), _up(w), _up(b)
    kw = dict(eps=c["eps"])

    def call(lib, xx, ww, bb, st_):
        rm, rv = (None, None) if st_ is None else st_
        if lib is F and ww is None and bb is not None:
            # torch's bias-only backward fails ("tensor does not have a device": group_norm,
            # instance_norm) or returns a wrong dbias (batch_norm eval on CUDA): weight = 1 instead
            ww = torch.ones(C, dtype=torch.float64, device=xx.device)
        if c["op"] == "group_norm":
            return lib.group_norm(xx, c["groups"], ww, bb, **kw)
        if c["op"] == "instance_norm":
            return lib.instance_norm(xx, rm, rv, ww, bb, momentum=c["momentum"], **kw)
        return lib.batch_norm(xx, rm, rv, ww, bb, training=c["training"], momentum=c["momentum"], **kw)

    y64 = call(F, x64, w64, b64, ref_stats)
    # contiguous: torch's CPU batch_norm backward (eval) misreads a permuted incoming gradient
    y64.backward(fp64(dy).contiguous())
    poison_allocator(dev)
    xl, wl, bl = _leaf(x), _leaf(w), _leaf(b)
    y = call(normkit, xl, wl, bl, ours_stats)
    y.backward(dy)
    rows = shape[0] * math.prod(shape[2:])
    if c["op"] == "group_norm":
        rows = shape[0] * math.prod(shape[2:]) * C // c["groups"]
    _compare(dict(y=y, dx=xl.grad, dweight=_grad(wl), dbias=_grad(bl)),
             dict(y=y64, dx=x64.grad, dweight=_grad(w64), dbias=_grad(b64)),
             dict(y="fwd", dx="bwd", dweight="param", dbias="param"),
             dict(x=dtype, y=dtype, dx=dtype, dweight=c["param_dtype"], dbias=c["param_dtype"]), rows,
             condition=_channel_condition(c, x64, ref_stats))  # fmt: skip
    if stats is not None and c["op"] != "group_norm":
        for name, got, ref in zip(("running_mean", "running_var"), ours_stats, ref_stats):
            # fp32 statistics of the rounded input; the unbiased variance scales by count / (count - 1)
            torch.testing.assert_close(fp64(got), ref, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


@pytest.mark.parametrize("executor, part", EXECUTORS)
def test_fuzz_channel_norms(executor, part, run_on):
    fuzz(executor, part, run_on, channel_cases, check_channel)
