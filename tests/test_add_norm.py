"""Fused residual add + dropout + LayerNorm/RMSNorm on every backend vs fp64 autograd."""

import zlib

import pytest
import torch
from conftest import DEVICE, executor_params

import normkit
from normkit import dispatch, reference
from normkit.testing import (ADD_OPS, Executor, add_norm_public, assert_close, check_add_norm_case,
                             dropout_keep_mask)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICE_SHAPES = [(1, 1), (3, 7), (128, 1023), (1151, 1024), (1, 4096), (128, 4096), (3, 40999)]
INTERPRETER_SHAPES = [(1, 1), (3, 7), (130, 1023), (2, 4096), (2, 40999)]


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor,shape", executor_params(
    [(s,) for s in INTERPRETER_SHAPES], [(s,) for s in DEVICE_SHAPES]))  # fmt: skip
def test_matches_reference(run_on, executor, shape, dtype, op):
    """x + residual, prenorm=True with both y and h used downstream (h's gradient path too)."""
    with run_on(executor, dtype):
        check_add_norm_case(op, shape, dtype, executor.device, seed=_seed(shape, op))


VARIANTS = {
    "no-residual": dict(residual=False),
    "fp32-residual-stream": dict(residual_dtype=torch.float32),
    "no-affine": dict(weight=False, bias=False),
}


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("executor,shape", executor_params(
    [((3, 1025),), ((2, 40999),)], [((1151, 4096),), ((5, 40999),)]))  # fmt: skip
def test_variants(run_on, executor, shape, variant, op):
    with run_on(executor, torch.bfloat16):
        check_add_norm_case(op, shape, torch.bfloat16, executor.device, **VARIANTS[variant])


@pytest.mark.cuda
@pytest.mark.parametrize("op,shape", [("add_layer_norm", (300, 16384)), ("add_layer_norm", (7, 12304)),
                                      ("add_rms_norm", (133, 32768)), ("add_layer_norm", (33, 24576)),
                                      ("add_rms_norm", (9, 65536))], ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.usefixtures("in_parts")
def test_backward_rows_in_shared_memory(run_on, op, shape, dtype):
    """16-bit rows the shared-memory backward takes (config.SMEM_BWD, and rows in parts past it:
    SMEM_SPLIT_BWD, and for the add-LayerNorm with a residual past 8192; asserted): h's own
    gradient added, the residual's gradient written (and not, without a residual); the first call
    of a signature and the plan-served second match fp64 (same seeds' inputs, fresh each call)."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        partials = 1 if op == "add_rms_norm" else 2
        assert config.backward(*shape, dtype, device, op == "add_rms_norm", True, partials).smem
        if op == "add_layer_norm":  # with the residual's gradient: in parts (SMEM_BWD_DRES_LONGEST)
            assert config.backward(*shape, dtype, device, False, True, partials, True).in_parts
        for residual in (True, False):
            for call in range(2):
                check_add_norm_case(op, shape, dtype, device, residual=residual, seed=_seed(shape, op, call))


@pytest.mark.cuda
@pytest.mark.parametrize("op,shape", [("add_layer_norm", (5, 65536)), ("add_layer_norm", (2, 270336)),
                                      ("add_rms_norm", (3, 140000)), ("add_rms_norm", (67, 131072))],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.usefixtures("in_parts")
def test_forward_rows_in_parts(run_on, op, shape, dtype):
    """Rows the forward shares among K programs (config.SMEM_SPLIT_FWD, fp32 SMEM_SPLIT_FWD_FP32;
    asserted), each streaming its part of x and of the residual: h stored and y match fp64, with and
    without a residual, first call and plan-served second."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        held = (1 if op == "add_rms_norm" else 2) * dtype.itemsize
        assert config.forward(*shape, dtype, device, "add_norm", True, held).parts > 1
        for residual in (True, False):
            for call in range(2):
                check_add_norm_case(op, shape, dtype, device, residual=residual,
                                    seed=_seed(shape, op, "fwd", call))  # fmt: skip


# The add-LayerNorm's fused forward of rows of 16385-32768 columns (one row a program, a 1-D tile)
# takes its moments in two reductions (config.one_read_moments is never true with the add): h far
# from zero, or with an outlier in the column the moments are shifted by (the CUDA backend's launch
# config is asserted: CUDA kernels only).
@pytest.mark.parametrize("kind", ["mean far from zero", "first column 50 std off"])
@pytest.mark.parametrize("executor,shape,dtype", [e for e in executor_params(
    [((2, 20000), torch.float32)],
    [((64, 32768), torch.float32), ((9, 20000), torch.float32), ((64, 32768), torch.bfloat16),
     ((9, 20000), torch.float16)]) if e.values[0].backend == "cuda"])  # fmt: skip
def test_add_layer_norm_long_rows_two_pass_moments(run_on, executor, shape, dtype, kind):
    """h stored equals x + residual rounded once; rstd matches fp64 of the stored h to 1e-5, the
    mean to 5e-4 std (plus its own rounding), y matches fp64 layer_norm of the stored h."""
    from normkit.backends.cuda import config

    with run_on(executor, dtype):
        m, n = shape
        device = torch.device(executor.device)
        cfg = config.forward(m, n, dtype, device, "add_norm")
        assert cfg.fused and cfg.rows_per_program == 1, cfg
        assert not config.one_read_moments(cfg, dtype, device, False, True)
        g = torch.Generator().manual_seed(_seed(shape, dtype, kind))
        x, r = torch.randn(2, m, n, generator=g, dtype=torch.float64)
        if kind == "mean far from zero":  # 16-bit: 300 (bf16 steps of 2 there)
            x += 1e4 if dtype == torch.float32 else 300
        else:
            x[:, 0] = x[:, 1:].mean(1) + 50 * x[:, 1:].std(1)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        b = torch.randn(n, generator=g, dtype=torch.float64)
        x, r, w, b = (t.to(dtype).to(device) for t in (x, r, w, b))
        out = add_norm_public("add_layer_norm", x, r, w, b, (n,))
        assert torch.equal(out["h"], (x.double() + r.double()).to(dtype)), "h is not x + residual"
        h = out["h"].double()
        _, _, mean, rstd = normkit.backend_for(x.device).add_layer_norm_fwd(x, r, w, b, 1e-5, 0.0, 0, dtype)
        var = h.var(1, unbiased=False)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
        torch.testing.assert_close(mean.double(), h.mean(1), rtol=1.2e-7, atol=5e-4 * float(var.min().sqrt()))
        want = torch.nn.functional.layer_norm(h, (n,), w.double(), b.double(), 1e-5)
        assert_close(out["y"], want, dtype, "fwd", "y", rows=m)


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("executor,shape,dtype", executor_params(
    [((3, 1025), torch.float32), ((2, 40999), torch.bfloat16)],
    [((1151, 4096), torch.bfloat16), ((5, 40999), torch.float32), ((64, 1024), torch.float16)]))  # fmt: skip
def test_dropout_matches_autograd_through_explicit_mask(run_on, executor, shape, dtype, op):
    """Forward and backward with dropout_p = 0.25 equal fp64 autograd through the kernel's mask."""
    with run_on(executor, dtype):
        check_add_norm_case(op, shape, dtype, executor.device, dropout_p=0.25, seed=_seed(shape, "drop"),
                            residual_dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("executor", [pytest.param(e, marks=m) for e, m in DEVICE] + [None],
                         ids=lambda e: e.name if e else "reference")  # fmt: skip
def test_dropout_keep_rate(run_on, executor, p):
    """Over 10^6 elements the kept fraction is within 0.5% of 1 - p. (Under the interpreter the
    kernels' masks are checked bit for bit against the formula instead:
    test_dropout_mask_is_the_documented_formula; 10^6 elements there cost ~50 s a test.)"""
    if executor is None:
        context, device = normkit.dispatch.use_backend("cpu", "normkit.reference"), "cpu"
    else:
        context, device = run_on(executor, torch.float32), executor.device
    with context:
        x = torch.randn(1000, 1000, device=device)
        rate = dropout_keep_mask("add_layer_norm", x, p, seed=1234).float().mean().item()
    assert abs(rate - (1 - p)) <= 0.005 * (1 - p), f"kept {rate:.5f}, expected {1 - p}"


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("executor,shape", executor_params([((16, 1025),)], [((1024, 4096),)]))
def test_seed_determines_the_mask(run_on, executor, shape, op):
    """Same seed: bitwise-equal outputs and gradients; another seed: a different mask."""
    with run_on(executor, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        x, r, dy = (torch.randn(shape, generator=g).to(torch.bfloat16).to(executor.device) for _ in range(3))
        w = torch.ones(shape[-1], dtype=torch.bfloat16, device=executor.device)
        runs = [add_norm_public(op, x, r, w, None, shape[-1:], dy, None, dropout_p=0.3, seed=s)
                for s in (7, 7, 8)]  # fmt: skip
        for key in ("y", "h", "dx", "dresidual", "dweight"):
            assert torch.equal(runs[0][key], runs[1][key]), f"{key} differs for one seed"
        assert not torch.equal(runs[0]["h"], runs[2]["h"]), "two seeds gave the same mask"


def test_prenorm_false_returns_y_only_and_matches():
    x, r = torch.randn(4, 16), torch.randn(4, 16)
    y = normkit.add_layer_norm(x, r, 16, dropout_p=0.2, seed=3)
    y2, h = normkit.add_layer_norm(x, r, 16, dropout_p=0.2, seed=3, prenorm=True)
    assert isinstance(y, torch.Tensor) and torch.equal(y, y2)
    assert h.shape == x.shape


@pytest.mark.parametrize("op", ADD_OPS)
def test_reference_gradcheck(op):
    """The CPU reference path, with and without dropout, through fp64 gradcheck."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    fn = getattr(normkit, op)
    for p in (0.0, 0.3):
        def f(x, r, w, p=p):
            return fn(x, r, 8, w, dropout_p=p, seed=11, prenorm=True)

        assert torch.autograd.gradcheck(f, (x, r, w))


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(dropout_p=1.5), normkit.InvalidArgument, ["dropout_p", "1.5", "[0, 1]"]),
        (dict(dropout_p=-0.1), normkit.InvalidArgument, ["dropout_p", "-0.1"]),
        (dict(dropout_p="0.1"), normkit.InvalidArgument, ["dropout_p", "'0.1'"]),
        (dict(seed=-1), normkit.InvalidArgument, ["seed", "-1"]),
        (dict(residual=torch.randn(4, 7)), normkit.InvalidArgument, ["residual", "[4, 7]", "[4, 8]"]),
        (dict(residual=torch.randn(4, 8, device="meta")), normkit.InvalidArgument, ["residual", "meta"]),
        (dict(residual_dtype=torch.int32), normkit.InvalidDtype, ["residual_dtype", "int32"]),
        (dict(x=torch.ones(4, 8, dtype=torch.long)), normkit.InvalidDtype, ["x", "int64"]),
    ],
    ids=["p-one", "p-negative", "p-type", "seed", "residual-shape", "residual-device",
         "residual-dtype", "x-dtype"],  # fmt: skip
)
def test_errors_name_the_argument(op, kwargs, error, words):
    args = dict(x=torch.randn(4, 8), residual=torch.randn(4, 8)) | kwargs
    x, r = args.pop("x"), args.pop("residual")
    with pytest.raises(error) as info:
        getattr(normkit, op)(x, r, 8, **args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_unused_h_sends_no_gradient(monkeypatch, op):
    """When h is not used (prenorm=False, or h unused), the backward passes dh=None to the backend,
    so the kernels skip reading a tensor of zeros; with h used, its gradient arrives."""
    seen = []
    real = getattr(reference, f"{op}_bwd")
    monkeypatch.setattr(reference, f"{op}_bwd", lambda dy, dh, *a: seen.append(dh) or real(dy, dh, *a))
    x, r = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    with dispatch.use_backend("cpu", "normkit.reference"):  # the contract's backend, not torch's operators
        getattr(normkit, op)(x, r, (8,)).sum().backward()
        y, h = getattr(normkit, op)(x, r, (8,), prenorm=True)
        (y.sum() + 2 * h.sum()).backward()
    assert seen[0] is None
    assert seen[1] is not None and torch.equal(seen[1], torch.full_like(h, 2.0))


# --- the dropout mask against the documented formula (docs/numerics.md, "Dropout") ----------------
# The hash every backend and the reference draw, in Python integers (independent of normkit.rng and
# of the kernels' common.row_key / hash_uniform).

_U32 = 0xFFFFFFFF


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _U32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


def _hash_uniform(key: int, col: int) -> float:
    """The NPU kernels' and the reference's draw (docs/numerics.md), in Python integers."""
    k = _fmix32(((key >> 32) & _U32) ^ 0x5BD1E995) ^ (key & _U32)
    return (_fmix32(((col * 0x9E3779B1) & _U32) ^ k) >> 8) / 2.0**24


def documented_keep(shape, p: float, seed: int) -> torch.Tensor:
    """The hash of (seed ^ (row << 32), col), kept where the draw is >= p (as fp32): the CUDA and NPU
    kernels and the reference backend alike."""
    M, N = shape
    p32 = torch.tensor(p, dtype=torch.float32).item()
    keep = torch.empty(M, N, dtype=torch.bool)
    for row in range(M):
        for col in range(N):
            keep[row, col] = _hash_uniform(seed ^ (row << 32), col) >= p32
    return keep


def test_reference_mask_is_the_documented_hash():
    """The reference backend (the CPU path's dropout) draws the NPU kernels' hash, bit for bit, for
    seeds past 2^32 too; its keep rate and row / column independence as in the kernel tests."""
    for seed, shape in ((7, (6, 150)), (2**40 + 3, (3, 1100))):
        got = reference.dropout_keep(shape, 0.4, seed, "cpu")
        want = documented_keep(shape, 0.4, seed)
        assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} mask bits differ"
    big = reference.dropout_keep((256, 4096), 0.3, 11, "cpu").float()
    assert abs(big.mean().item() - 0.7) < 0.005, big.mean().item()  # 1M draws: sd 0.00046
    rows, cols = big.mean(dim=1), big.mean(dim=0)
    assert (rows - 0.7).abs().max() < 0.04 and (cols - 0.7).abs().max() < 0.15  # per-row sd 0.0072, col 0.029
    corr = torch.corrcoef(torch.stack([big[:, :-1].flatten(), big[:, 1:].flatten()]))[0, 1].item()
    corr_rows = torch.corrcoef(torch.stack([big[:-1].flatten(), big[1:].flatten()]))[0, 1].item()
    assert abs(corr) < 0.01 and abs(corr_rows) < 0.01, (corr, corr_rows)  # sd ~0.001


@pytest.mark.parametrize("op", ADD_OPS)
# NPU: rows held in UB (150: 4 a tile; 1000: one a tile) and rows longer than
# config.ROW_NORM_DROPOUT_WIDTH (1100)
@pytest.mark.parametrize("executor,shape", executor_params(
    [((6, 150),), ((3, 1100),)], [((6, 150),), ((3, 1100),)],
    [((6, 150),), ((3, 1000),), ((3, 1100),)]))  # fmt: skip
def test_dropout_mask_is_the_documented_formula(run_on, executor, shape, op):
    """The kernels' mask element by element against the formula in docs/numerics.md, and rows /
    columns that differ (a mask drawn from one key per row, or per column, repeats)."""
    seed, p = 20261126 + len(op), 0.4
    with run_on(executor, torch.float32):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).add_(0.5).to(executor.device)
        got = dropout_keep_mask(op, x, p, seed).cpu()
    want = documented_keep(shape, p, seed)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {got.numel()} mask bits differ"
    assert len({tuple(r.tolist()) for r in got}) == shape[0], "two rows share a mask"
    same = (got[:, 1:] == got[:, :-1]).all(dim=0).float().mean().item()  # ~0.52^M by chance
    assert same < 0.5, f"{same:.0%} of adjacent columns share their mask"


@pytest.mark.parametrize("op", ADD_OPS)
# Device shapes: the CUDA kernels' packed rows, one row a program, looped and split rows (forward and
# backward); NPU: rows held in UB, packed, and looped.
@pytest.mark.parametrize("executor,shape", executor_params(
    [((40, 96),), ((2, 2100),)],
    [((1024, 512),), ((33, 8192),), ((4, 65536),), ((2, 262144),), ((3, 40999),)],
    [((40, 96),), ((2, 2100),)]))  # fmt: skip
def test_dropout_mask_is_the_same_on_every_executor(run_on, executor, shape, op):
    """One seed, one mask: the kernels' forward mask (where h is 0) and backward mask (dx with dy = 0
    and dh = 1 is the mask times 1 / (1 - p)) equal the reference backend's bit for bit, for a seed
    past 2^32. (The reference equals the documented hash: test_reference_mask_is_the_documented_hash.)"""
    seed, p = 2**40 + 977, 0.3
    want = reference.dropout_keep(shape, p, seed, "cpu")
    with run_on(executor, torch.float32):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).add_(0.5).to(executor.device)
        out = add_norm_public(op, x, None, None, None, (shape[-1],), dy=torch.zeros_like(x),
                              dh=torch.ones_like(x), dropout_p=p, seed=seed)  # fmt: skip
    for name, got in (("forward", out["h"] != 0), ("backward", out["dx"] != 0)):
        got = got.cpu()
        assert torch.equal(got, want), f"{name}: {(got != want).sum().item()} of {want.numel()} bits differ"
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32).item()
    kept = out["dx"].cpu()[want]
    assert torch.equal(kept, torch.full_like(kept, scale)), "a kept element's dx is not 1 / (1 - p)"
