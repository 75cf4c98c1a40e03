"""Hardening on the GPU (marker `cuda`), plus the CPU halves that CI runs:

- int64 indexing: every op family on tensors of more than 2^31 elements (bf16, ~4.3 GB each),
  and a strided view whose row stride x rows exceeds 2^31; sampled rows against fp64.
- Multi-GPU: inputs on cuda:1 while cuda:0 is current (skips without two GPUs); streams: work
  issued on a side stream is ordered after that stream's earlier work.
- No leaks: 10,000 mixed calls leave torch.cuda.memory_allocated flat; launch-config caches are
  bounded; normkit called from several threads at once (GPU, and on the CPU in CI).
- Determinism: every backward (dweight / dbias, the dropout path) bitwise equal run to run.
- Split rows: each op kind's split-row forward in both kernel modes (re-read / prefetch) vs fp64;
  BatchNorm on split channels (both modes) and through the two-pass kernels vs fp64.

The > 2^31-element tests take 15-25 GB each; they hold a file lock so that pytest-xdist workers run
them one at a time, and skip (with the numbers) only if the GPU lacks the memory even then.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import threading

import pytest
import torch
import torch.nn.functional as F

import normkit
from conftest import DEVICE
from normkit import dispatch, rng
from normkit.testing import (Executor, assert_close, check_batch_norm_case, check_case, fp64, gpu_lock,
                             oracle_device)

BACKENDS = ["cuda", "npu"]  # the CUDA kernels and the NPU kernels, both on the CUDA GPU
# The > 2^31-element tests: those two, and the NPU kernels on an Ascend NPU (references in fp64 on
# the CPU there: testing.fp64).
BIG = [pytest.param(ex, id=ex.name, marks=mark) for ex, mark in DEVICE]
GiB = 1 << 30


@contextlib.contextmanager
def big_memory(device: str, need_bytes: int):
    """One > 2^31-element test at a time on this device across xdist workers; skip if it cannot
    hold it even then (torch.cuda or torch_npu's torch.npu memory queries)."""
    mod = torch.get_device_module(device)
    with gpu_lock():
        try:
            gc.collect()
            mod.empty_cache()
            free, _ = mod.mem_get_info()
            if free < need_bytes:
                pytest.skip(f"needs {need_bytes / GiB:.1f} GiB of free {device} memory, has {free / GiB:.1f}")
            yield
        finally:
            gc.collect()
            mod.empty_cache()


def _on_gpu(run_on, backend, dtype=torch.bfloat16):
    return run_on(Executor(backend, "cuda"), dtype)


def _randn(shape, dtype=torch.bfloat16, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, dtype=dtype, device=device, generator=g)


def _sample_rows(m):
    """Row indices at the start, the middle and the end (past element 2^31)."""
    return sorted({0, 1, m // 2, m - 2, m - 1})


# --- int64 indexing -------------------------------------------------------------------------------

M_BIG, N_BIG = (1 << 19) + 64, 4096  # 2^31 + 2^18 elements
assert M_BIG * N_BIG > 2**31


@pytest.mark.parametrize("ex", BIG)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_row_norm_more_than_2_31_elements_fwd_bwd(run_on, ex, op):
    """y, dx at sampled rows (start, middle, end) and the full dweight / dbias against fp64."""
    with run_on(ex, torch.bfloat16), big_memory(ex.device, 7 * M_BIG * N_BIG * 2):
        x = _randn((M_BIG, N_BIG), device=ex.device).requires_grad_()
        w = (_randn((N_BIG,), seed=1, device=ex.device) * 0.5 + 1).requires_grad_()
        b = _randn((N_BIG,), seed=2, device=ex.device) * 0.5 if op == "layer_norm" else None
        b = None if b is None else b.requires_grad_()
        y = normkit.layer_norm(x, (N_BIG,), w, b) if op == "layer_norm" else normkit.rms_norm(x, (N_BIG,), w)
        dy = _randn((M_BIG, N_BIG), seed=3, device=ex.device)
        y.backward(dy)
        dw_ref = torch.zeros(N_BIG, dtype=torch.float64, device=oracle_device(ex.device))
        db_ref = torch.zeros_like(dw_ref)
        rows = _sample_rows(M_BIG)
        chunk = 1 << 16
        for start in range(0, M_BIG, chunk):  # fp64 dweight / dbias, one chunk of rows at a time
            xs = fp64(x[start:start + chunk])
            if op == "layer_norm":
                xhat = F.layer_norm(xs, (N_BIG,), eps=1e-5)
            else:
                xhat = F.rms_norm(xs, (N_BIG,), eps=torch.finfo(torch.bfloat16).eps)
            dw_ref += (fp64(dy[start:start + chunk]) * xhat).sum(0)
            db_ref += fp64(dy[start:start + chunk]).sum(0)
            del xs, xhat
        x64 = fp64(x[rows]).requires_grad_()
        w64 = fp64(w).requires_grad_()
        b64 = None if b is None else fp64(b)
        if op == "layer_norm":
            y64 = F.layer_norm(x64, (N_BIG,), w64, b64, 1e-5)
        else:
            y64 = F.rms_norm(x64, (N_BIG,), w64, torch.finfo(torch.bfloat16).eps)
        y64.backward(fp64(dy[rows]))
        assert_close(y.detach()[rows], y64, torch.bfloat16, "fwd", f"y{rows}")
        assert_close(x.grad[rows], x64.grad, torch.bfloat16, "bwd", f"dx{rows}")
        assert_close(w.grad, dw_ref, torch.bfloat16, "param", "dweight", M_BIG)
        if b is not None:
            assert_close(b.grad, db_ref, torch.bfloat16, "param", "dbias", M_BIG)


@pytest.mark.parametrize("ex", BIG)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_more_than_2_31_elements_fwd_bwd(run_on, ex, op):
    with run_on(ex, torch.bfloat16), big_memory(ex.device, 5 * M_BIG * N_BIG * 2):
        x = _randn((M_BIG, N_BIG), device=ex.device).requires_grad_()
        y = getattr(normkit, op)(x, -1)
        dy = _randn((M_BIG, N_BIG), seed=3, device=ex.device)
        y.backward(dy)
        rows = _sample_rows(M_BIG)
        y64 = getattr(F, op)(fp64(x[rows]), -1)
        backward = torch._log_softmax_backward_data if op == "log_softmax" else torch._softmax_backward_data
        dx64 = backward(fp64(dy[rows]), fp64(y[rows]), 1, torch.float64)
        assert_close(y.detach()[rows], y64, torch.bfloat16, "fwd", f"y{rows}")
        assert_close(x.grad[rows], dx64, torch.bfloat16, "bwd", f"dx{rows}")


@pytest.mark.parametrize("ex", BIG)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_dropout_more_than_2_31_elements(run_on, ex, op):
    """h = dropout(x) (p = 0.1), y = norm(h): the mask of sampled rows, past element 2^31 too, is the
    hash's (docs/numerics.md) bit for bit; y and dx of those rows against fp64 through that mask."""
    p, seed = 0.1, 1234
    with run_on(ex, torch.bfloat16), big_memory(ex.device, 6 * M_BIG * N_BIG * 2):
        x = _randn((M_BIG, N_BIG), device=ex.device).requires_grad_()
        y, h = getattr(normkit, op)(x, None, (N_BIG,), dropout_p=p, seed=seed, prenorm=True)
        dy = _randn((M_BIG, N_BIG), seed=3, device=ex.device)
        y.backward(dy)
        rows = _sample_rows(M_BIG)
        keep = fp64(h[rows]) != 0
        want = rng.uniform(seed, rows, N_BIG, keep.device) >= torch.tensor(p, dtype=torch.float32).item()
        assert torch.equal(keep, want), f"{(keep != want).sum().item()} mask bits differ at rows {rows}"
        rate = fp64(keep).mean().item()
        assert abs(rate - (1 - p)) < 0.01, f"keep rate {rate} at rows {rows}"
        x64 = fp64(x[rows]).requires_grad_()
        h64 = x64 * keep / (1 - p)
        if op == "add_layer_norm":
            y64 = F.layer_norm(h64, (N_BIG,), eps=1e-5)
        else:
            y64 = F.rms_norm(h64, (N_BIG,), eps=torch.finfo(torch.bfloat16).eps)
        y64.backward(fp64(dy[rows]))
        assert_close(y.detach()[rows], y64, torch.bfloat16, "fwd", f"y{rows}")
        assert_close(x.grad[rows], x64.grad, torch.bfloat16, "bwd", f"dx{rows}")


@pytest.mark.parametrize("ex", BIG)
def test_group_norm_more_than_2_31_elements_fwd_bwd(run_on, ex):
    """(8193, 32, 8192) bf16 with 8 groups: y and dx of sampled samples against fp64."""
    shape, groups = (8193, 32, 8192), 8
    assert math.prod(shape) > 2**31
    with run_on(ex, torch.bfloat16), big_memory(ex.device, 5 * math.prod(shape) * 2):
        x = _randn(shape, device=ex.device).requires_grad_()
        w = (_randn((32,), seed=1, device=ex.device) * 0.5 + 1).requires_grad_()
        b = (_randn((32,), seed=2, device=ex.device) * 0.5).requires_grad_()
        y = normkit.group_norm(x, groups, w, b)
        dy = _randn(shape, seed=3, device=ex.device)
        y.backward(dy)
        samples = _sample_rows(shape[0])
        x64 = fp64(x[samples]).requires_grad_()
        y64 = F.group_norm(x64, groups, fp64(w), fp64(b))
        y64.backward(fp64(dy[samples]))
        assert_close(y.detach()[samples], y64, torch.bfloat16, "fwd", f"y{samples}")
        assert_close(x.grad[samples], x64.grad, torch.bfloat16, "bwd", f"dx{samples}")
        assert w.grad.isfinite().all()
        db64 = torch.zeros(32, dtype=torch.float64, device=oracle_device(ex.device))
        for n in range(0, shape[0], 256):
            db64 += fp64(dy[n:n + 256]).sum((0, 2))
        assert_close(b.grad, db64, torch.bfloat16, "param", "dbias", shape[0] * shape[2])


@pytest.mark.parametrize("ex", BIG)
def test_batch_norm_more_than_2_31_elements_fwd_bwd(run_on, ex):
    """(2049, 1024, 1024) bf16, training: per-channel statistics over 2^21 values, y / dx of
    sampled samples and dweight / dbias against fp64 sums taken chunk by chunk."""
    shape = (2049, 1024, 1024)
    assert math.prod(shape) > 2**31
    with run_on(ex, torch.bfloat16), big_memory(ex.device, 5 * math.prod(shape) * 2):
        x = _randn(shape, device=ex.device).requires_grad_()
        w = (_randn((1024,), seed=1, device=ex.device) * 0.5 + 1).requires_grad_()
        b = (_randn((1024,), seed=2, device=ex.device) * 0.5).requires_grad_()
        rm, rv = torch.zeros(1024, device=ex.device), torch.ones(1024, device=ex.device)
        y = normkit.batch_norm(x, rm, rv, w, b, training=True, momentum=1.0)
        dy = _randn(shape, seed=3, device=ex.device)
        y.backward(dy)
        count = shape[0] * shape[2]
        s = torch.zeros(1024, dtype=torch.float64, device=oracle_device(ex.device))
        for n in range(0, shape[0], 128):
            s += fp64(x[n:n + 128]).sum((0, 2))
        mean = s / count
        m2 = torch.zeros_like(s)
        sdy = torch.zeros_like(s)
        sdyx = torch.zeros_like(s)
        for n in range(0, shape[0], 128):
            xc = fp64(x[n:n + 128]) - mean[None, :, None]
            m2 += xc.square().sum((0, 2))
            d = fp64(dy[n:n + 128])
            sdy += d.sum((0, 2))
            sdyx += (d * xc).sum((0, 2))
        rstd = torch.rsqrt(m2 / count + 1e-5)
        sdyx *= rstd
        torch.testing.assert_close(fp64(rm), mean, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fp64(rv), m2 / (count - 1), atol=1e-4, rtol=1e-4)
        samples = _sample_rows(shape[0])
        xs = fp64(x[samples])
        xhat = (xs - mean[None, :, None]) * rstd[None, :, None]
        y64 = xhat * fp64(w)[None, :, None] + fp64(b)[None, :, None]
        d = fp64(dy[samples])
        dx64 = (d - (sdy[None, :, None] + xhat * sdyx[None, :, None]) / count) * (
            rstd * fp64(w))[None, :, None]
        assert_close(y.detach()[samples], y64, torch.bfloat16, "fwd", f"y{samples}")
        assert_close(x.grad[samples], dx64, torch.bfloat16, "bwd", f"dx{samples}")
        assert_close(w.grad, sdyx, torch.bfloat16, "param", "dweight", count)
        assert_close(b.grad, sdy, torch.bfloat16, "param", "dbias", count)


@pytest.mark.parametrize("ex", BIG)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax", "add_layer_norm"])
def test_row_stride_times_rows_beyond_2_31(run_on, ex, op):
    """A row-strided view (rows of a 2^31 + 2^23-element buffer, 1000 columns used): the element
    offset row * stride passes 2^31 while the tensors themselves are small."""
    m, stride, n = (1 << 16) + 256, 1 << 15, 1000
    assert (m - 1) * stride > 2**31
    with run_on(ex, torch.bfloat16), big_memory(ex.device, m * stride * 2 + 8 * GiB):
        base = torch.empty((m, stride), dtype=torch.bfloat16, device=ex.device)
        x = base[:, 8:8 + n]
        x.copy_(_randn((m, n), device=ex.device))
        assert x.stride(0) == stride and not x.is_contiguous()
        leaf = x.detach().requires_grad_()
        if op == "softmax":
            y = normkit.softmax(leaf, -1)
        elif op == "add_layer_norm":
            r = _randn((m, n), seed=5, device=ex.device)
            y = normkit.add_layer_norm(leaf, r, (n,))
        else:
            y = getattr(normkit, op)(leaf, (n,))
        dy = _randn((m, n), seed=3, device=ex.device)
        y.backward(dy)
        rows = _sample_rows(m)
        x64 = fp64(x[rows]).requires_grad_()
        if op == "softmax":
            y64 = F.softmax(x64, -1)
        elif op == "add_layer_norm":
            y64 = F.layer_norm(x64 + fp64(r[rows]), (n,), eps=1e-5)
        elif op == "layer_norm":
            y64 = F.layer_norm(x64, (n,), eps=1e-5)
        else:
            y64 = F.rms_norm(x64, (n,), eps=torch.finfo(torch.bfloat16).eps)
        y64.backward(fp64(dy[rows]))
        assert_close(y.detach()[rows], y64, torch.bfloat16, "fwd", f"y{rows}")
        if op != "softmax":  # softmax's dx is checked from the rounded y in the other tests
            assert_close(leaf.grad[rows], x64.grad, torch.bfloat16, "bwd", f"dx{rows}")


# --- multi-GPU and streams --------------------------------------------------------------------------


def _mixed_calls(device, seed=0):
    """One call per op family (fwd + bwd) on ``device``: name -> zero-argument function returning
    the tensors it produced (outputs and gradients)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0, offset=0.0, dtype=torch.float32):
        return (torch.randn(shape, generator=g) * scale + offset).to(dtype).to(device)

    x2, dy2, w, b = t(37, 1025), t(37, 1025), t(1025, offset=1.0), t(1025)
    x4, dy4, wc, bc = t(3, 8, 5, 7), t(3, 8, 5, 7), t(8, offset=1.0), t(8)
    xb, wb = t(9, 40999, dtype=torch.bfloat16), t(40999, dtype=torch.bfloat16)

    def grads(y, dy, *leaves):
        y.backward(dy)
        return [y.detach()] + [leaf.grad for leaf in leaves if leaf is not None]

    def leaf(*ts):
        return [x.detach().clone().requires_grad_() for x in ts]

    def layer_norm():
        x, w_, b_ = leaf(x2, w, b)
        return grads(normkit.layer_norm(x, (1025,), w_, b_), dy2, x, w_, b_)

    def rms_norm_long():
        x, w_ = leaf(xb, wb)
        return grads(normkit.rms_norm(x, (40999,), w_), xb, x, w_)

    def softmax():
        (x,) = leaf(x4)
        return grads(normkit.log_softmax(x, 1), dy4, x)

    def add_norm_dropout():
        x, r, w_ = leaf(x2, dy2, w)
        y, h = normkit.add_rms_norm(x, r, (1025,), w_, dropout_p=0.1, seed=7, prenorm=True)
        torch.autograd.backward([y, h], [dy2, x2])
        return [y.detach(), h.detach(), x.grad, r.grad, w_.grad]

    def group_norm():
        x, w_, b_ = leaf(x4, wc, bc)
        return grads(normkit.group_norm(x, 4, w_, b_), dy4, x, w_, b_)

    def instance_norm():
        x, w_ = leaf(x4, wc)
        return grads(normkit.instance_norm(x, weight=w_), dy4, x, w_)

    def batch_norm():
        x, w_, b_ = leaf(x4, wc, bc)
        rm, rv = torch.zeros(8, device=device), torch.ones(8, device=device)
        out = grads(normkit.batch_norm(x, rm, rv, w_, b_, training=True), dy4, x, w_, b_)
        return out + [rm, rv]

    return dict(layer_norm=layer_norm, rms_norm_long=rms_norm_long, softmax=softmax,
                add_norm_dropout=add_norm_dropout, group_norm=group_norm, instance_norm=instance_norm,
                batch_norm=batch_norm)  # fmt: skip


def _reference_of(name, device):
    """The same call on the CPU reference backend, in fp64-free plain torch (fp32 math)."""
    with dispatch.use_backend("cpu", "normkit.reference"):
        return [t.cpu() for t in _mixed_calls("cpu")[name]()]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_input_on_second_gpu_runs_there(run_on, backend):
    """cuda:0 current, inputs on cuda:1: launched on cuda:1 (device guard), nothing allocated on
    cuda:0, results as on the CPU reference."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    with run_on(Executor(backend, "cuda")):
        torch.cuda.set_device(0)
        torch.cuda.synchronize(0)
        before = torch.cuda.memory_allocated(0)
        for name, call in _mixed_calls("cuda:1").items():
            got = call()
            torch.cuda.synchronize(1)
            assert torch.cuda.current_device() == 0
            assert all(t.device == torch.device("cuda:1") for t in got), name
            expected = _reference_of(name, "cpu")
            if name == "add_norm_dropout":  # the mask is the backend's own: check the shapes only
                assert [t.shape for t in got] == [t.shape for t in expected]
                continue
            for i, (a, e) in enumerate(zip(got, expected)):
                assert_close(a.cpu(), e.double(), a.dtype, "bwd" if i else "fwd", f"{name}[{i}]", 64)
        assert torch.cuda.memory_allocated(0) == before, "memory was allocated on cuda:0"
        # And on a side stream of cuda:1, made current there.
        s = torch.cuda.Stream(device=1)
        with torch.cuda.device(1), torch.cuda.stream(s):
            x = _randn((64, 4096), torch.float32, device="cuda:1")
            y = normkit.layer_norm(x, (4096,))
        s.synchronize()
        assert_close(y, F.layer_norm(x.double(), (4096,)), torch.float32, "fwd", "y")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "softmax", "add_rms_norm", "group_norm", "batch_norm"])
def test_side_stream_ordering(run_on, backend, op):
    """On a side stream: a long sleep, then a copy that writes x, then the op. A launch on any other
    stream would read x before the copy (it holds NaN until then)."""
    with run_on(Executor(backend, "cuda")):
        src = _randn((8, 16, 1024), torch.float32)
        x = torch.full_like(src, float("nan"))
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the copy
            x.copy_(src)
            if op == "layer_norm":
                y = normkit.layer_norm(x, (1024,))
            elif op == "softmax":
                y = normkit.softmax(x, -1)
            elif op == "add_rms_norm":
                y = normkit.add_rms_norm(x, x, (1024,))
            elif op == "group_norm":
                y = normkit.group_norm(x, 4)
            else:
                y = normkit.batch_norm(x, None, None, training=True)
        s.synchronize()
        assert y.isfinite().all(), "the op ran before the copy on its stream"
        x64 = src.double()
        expected = dict(layer_norm=lambda: F.layer_norm(x64, (1024,)), softmax=lambda: F.softmax(x64, -1),
                        add_rms_norm=lambda: F.rms_norm(2 * x64, (1024,), eps=torch.finfo(torch.float32).eps),
                        group_norm=lambda: F.group_norm(x64, 4),
                        batch_norm=lambda: F.batch_norm(x64, None, None, training=True))[op]()  # fmt: skip
        assert_close(y, expected, torch.float32, "fwd", "y")


# --- split-row forward modes ----------------------------------------------------------------------

SPLIT_KIND_OPS = {"layer_norm": "layer_norm", "rms_norm": "rms_norm", "add_norm": "add_layer_norm",
                  "softmax": "log_softmax"}  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("prefetch", [False, True], ids=["reread", "prefetch"])
@pytest.mark.parametrize("kind", list(SPLIT_KIND_OPS))
def test_split_forward_both_modes_match_reference(run_on, kind, prefetch, dtype):
    """Every op kind's split-row forward in both kernel modes (chunk read again from L2, or held
    through the barrier with the next row's chunk prefetched), whichever ``SPLIT_FWD`` picks: 130
    rows of 40999 (several rows per program, a masked tail chunk) and 3 rows (fewer rows than row
    groups), fwd + bwd against fp64."""
    from normkit.backends.cuda import config

    with config.forced(split_prefetch=prefetch), _on_gpu(run_on, "cuda", dtype):  # skips without a GPU
        assert config.forward(130, 40999, dtype, torch.device("cuda"), kind).prefetch is prefetch
        for rows in (130, 3):
            check_case(SPLIT_KIND_OPS[kind], (rows, 40999), dtype=dtype, device="cuda", seed=rows)


BATCH_NORM_SPLIT_SHAPES = [(37, 9, 24, 40), (3, 300, 9, 15), (64, 16, 56, 56)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", ["split", "split-pipelined", "two-pass"])
def test_batch_norm_split_and_two_pass_match_reference(run_on, mode, dtype):
    """BatchNorm training forward and backward on split channels, with and without pipelining
    (the next channel published before this one's wait), and through the two-pass kernels: y,
    running statistics, dx, dweight, dbias against fp64. Shapes: a masked tail chunk (HW = 960),
    an odd HW (runs of 1 value) with more channels than channel groups, and 25-49 chunks a channel."""
    from normkit.backends.cuda import config

    # split channels, not channels in parts (which aligned 16-bit shapes of one part would take)
    force = config.forced(batch_norm_split=False) if mode == "two-pass" else \
        config.forced(batch_norm_split=True, batch_norm_pipelined=mode == "split-pipelined")  # fmt: skip
    with force, _on_gpu(run_on, "cuda", dtype):  # skips without a CUDA GPU
        for i, shape in enumerate(BATCH_NORM_SPLIT_SHAPES):
            N, C = shape[:2]
            for backward in (False, True):  # the chooser the op uses (inputs come 16-byte aligned)
                cfg = config.batch_norm_channels(N, C, math.prod(shape[2:]), dtype, torch.device("cuda"),
                                                 backward, True)  # fmt: skip
                assert (cfg is None) is (mode == "two-pass"), (shape, backward, cfg)
                if cfg is not None:
                    assert not cfg.smem, (shape, backward, cfg)
                    assert cfg.prefetch is (mode == "split-pipelined"), (shape, backward, cfg)
            check_batch_norm_case(shape, dtype, "cuda", seed=i, mean=3.0)


# --- leaks, caches, threads ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_ten_thousand_mixed_calls_leave_memory_flat(run_on, backend):
    with run_on(Executor(backend, "cuda")):
        calls = list(_mixed_calls("cuda").values())
        for call in calls:  # warm-up: compiled kernels, cached launch settings, allocator blocks
            call()
        torch.cuda.synchronize()
        gc.collect()
        before = torch.cuda.memory_allocated()
        n = 0
        while n < 10_000:
            for call in calls:
                call()
                n += 1
        torch.cuda.synchronize()
        gc.collect()
        assert torch.cuda.memory_allocated() == before, (
            f"{n} calls: allocated {torch.cuda.memory_allocated() - before} bytes more than before")


def test_launch_config_caches_are_bounded():
    """Every cache in the backends' launch code has a finite size (the per-device SM / vector-core
    queries); launch configs themselves are recomputed per call (frozen dataclasses)."""
    from normkit.backends.cuda import config as cuda_config
    from normkit.backends.npu import config as npu_config

    cached = [f for module in (cuda_config, npu_config) for f in vars(module).values()
              if hasattr(f, "cache_info")]  # fmt: skip
    assert cached, "no cached function found: update this test"
    for f in cached:
        assert f.cache_parameters()["maxsize"] is not None, f"{f.__name__} has an unbounded cache"
    for i in range(200):  # more distinct CPU keys than the cache holds: it stays at its bound
        cuda_config._sm_count("cpu", i)
    assert cuda_config._sm_count.cache_info().currsize <= cuda_config._sm_count.cache_parameters()["maxsize"]


def _thread_results(device, workers, rounds):
    """Run every mixed call ``rounds`` times in each of ``workers`` threads at once; -> per thread,
    the list of results of its last round."""
    results, errors = {}, []
    barrier = threading.Barrier(workers)
    overrides = dispatch.overrides()  # threads start with an empty context: carry the executor's

    def work(i):
        try:
            with dispatch.restore(overrides):
                barrier.wait()
                for _ in range(rounds):
                    out = {name: call() for name, call in _mixed_calls(device, seed=i % 2).items()}
                results[i] = out
        except Exception as e:  # reported below, with the thread
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def _assert_threads_agree(results, device):
    """Threads with the same seed got bitwise the same results, and they match a plain run."""
    for i, out in results.items():
        twin = results[i % 2]
        for name in out:
            for a, b in zip(out[name], twin[name]):
                assert torch.equal(a, b), f"thread {i}: {name} differs from thread {i % 2}"
    single = {name: call() for name, call in _mixed_calls(device, seed=0).items()}
    for name in single:
        for a, b in zip(single[name], results[0][name]):
            assert torch.equal(a, b), f"{name}: threaded result differs from a single-threaded run"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_on_the_gpu(run_on, backend):
    with run_on(Executor(backend, "cuda")):
        results = _thread_results("cuda", workers=8, rounds=5)
        torch.cuda.synchronize()
        _assert_threads_agree(results, "cuda")


def test_threads_on_the_cpu():
    """The front end, dispatch overrides (per-thread contexts), autograd and the launch-config
    code from 8 threads at once, on the CPU reference backend. (Triton's interpreter itself is not
    thread-safe: it patches triton.language while a kernel runs, so the interpreter executors are
    not used here.)"""
    with dispatch.use_backend("cpu", "normkit.reference"):
        results = _thread_results("cpu", workers=8, rounds=3)
        _assert_threads_agree(results, "cpu")
    from normkit.backends.cuda import config

    errors = []

    def configs(i):
        try:
            for m, n in ((1, 1), (3, 7), (1151, 4096), (7, 40999), (2, 1 << 20)):
                for dt in (torch.bfloat16, torch.float32):
                    a = config.forward(m + i, n, dt, torch.device("cpu"))
                    b = config.backward(m + i, n, dt, torch.device("cpu"), bool(i % 2))
                    assert a == config.forward(m + i, n, dt, torch.device("cpu"))
                    assert b.grid[0] >= 1
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=configs, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_backend_overrides_are_per_thread():
    """A thread's use_backend never leaks into another thread running at the same time."""
    seen, barrier = {}, threading.Barrier(2)

    def work(name, module):
        with dispatch.use_backend("cpu", module):
            barrier.wait()
            seen[name] = dispatch.backend_name_for("cpu")
            barrier.wait()

    threads = [threading.Thread(target=work, args=("a", "normkit.reference")),
               threading.Thread(target=work, args=("b", "normkit.backends.npu"))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a": "normkit.reference", "b": "normkit.backends.npu"}


# --- determinism -----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backward_is_bitwise_reproducible(run_on, backend):
    """Each op family (dropout path included) twice on the same inputs: every output and gradient
    bitwise equal. Shapes large enough for multi-program partial sums of dweight / dbias."""
    with run_on(Executor(backend, "cuda")):

        def calls():
            g = torch.Generator(device="cuda").manual_seed(0)

            def t(*shape, dtype=torch.bfloat16):
                return torch.randn(shape, generator=g, device="cuda", dtype=dtype)

            big = dict(x=t(4096, 1024), dy=t(4096, 1024), w=t(1024), b=t(1024),
                       r=t(4096, 1024, dtype=torch.float32))
            long = dict(x=t(64, 40999), dy=t(64, 40999), w=t(40999))
            img = dict(x=t(16, 64, 28, 28), dy=t(16, 64, 28, 28), w=t(64), b=t(64))
            return big, long, img

        def run():
            big, long, img = calls()
            out = {}

            def fb(name, fn, dy, **leaves):
                leaves = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
                y = fn(**leaves)
                ys = y if isinstance(y, tuple) else (y,)
                torch.autograd.backward(list(ys), [dy] + [torch.ones_like(v) for v in ys[1:]])
                out[name] = [v.detach() for v in ys] + [leaves[k].grad for k in sorted(leaves)]

            n = 1024
            fb("layer_norm", lambda x, w, b: normkit.layer_norm(x, (n,), w, b), big["dy"],
               x=big["x"], w=big["w"], b=big["b"])
            fb("rms_norm", lambda x, w: normkit.rms_norm(x, (n,), w), big["dy"], x=big["x"], w=big["w"])
            fb("layer_norm_long", lambda x, w: normkit.layer_norm(x, (40999,), w, w), long["dy"],
               x=long["x"], w=long["w"])
            fb("rms_norm_long", lambda x, w: normkit.rms_norm(x, (40999,), w), long["dy"],
               x=long["x"], w=long["w"])
            fb("softmax", lambda x: normkit.softmax(x, -1), big["dy"], x=big["x"])
            fb("log_softmax_long", lambda x: normkit.log_softmax(x, -1), long["dy"], x=long["x"])
            for p in (0.0, 0.1):
                fb(f"add_layer_norm_p{p}", lambda x, r, w, b, p=p: normkit.add_layer_norm(
                    x, r, (n,), w, b, dropout_p=p, seed=5, prenorm=True), big["dy"],
                    x=big["x"], r=big["r"], w=big["w"], b=big["b"])  # fmt: skip
                fb(f"add_rms_norm_p{p}", lambda x, w, p=p: normkit.add_rms_norm(
                    x, None, (40999,), w, dropout_p=p, seed=5, prenorm=True), long["dy"],
                    x=long["x"], w=long["w"])  # fmt: skip
            channels = dict(x=img["x"], w=img["w"], b=img["b"])
            fb("group_norm", lambda x, w, b: normkit.group_norm(x, 8, w, b), img["dy"], **channels)
            fb("instance_norm", lambda x, w, b: normkit.instance_norm(x, weight=w, bias=b), img["dy"],
               **channels)
            fb("batch_norm", lambda x, w, b: normkit.batch_norm(x, None, None, w, b, training=True),
               img["dy"], **channels)
            return out

        first, second = run(), run()
        assert first.keys() == second.keys()
        for name in first:
            for i, (a, b) in enumerate(zip(first[name], second[name])):
                assert a is not None and torch.equal(a, b), (
                    f"{name}: output/gradient {i} differs between runs")



# --- the direct-launch cache (backends/cuda/launch.py) --------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_direct_launch_never_reuses_another_specialization(run_on, dtype):
    """Calls alternate between what Triton specializes on (16-byte aligned or misaligned pointers,
    row strides divisible by 16 or not, M == 1, i32 vs i64 sizes are covered by the 2^31 tests),
    each after the cache has a kernel for the other; every result matches fp64 torch."""
    from normkit.backends.cuda import launch

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    big = _randn((65, 1040), dtype, seed=1)
    wbig, bbig = _randn(1041, dtype, seed=2), _randn(1041, dtype, seed=3)
    views = [
        ("aligned", big[:64, :1024], wbig[:1024], bbig[:1024]),
        ("misaligned x, w, b", big[:64, 1:1025], wbig[1:1025], bbig[1:1025]),
        ("aligned again", big[:64, :1024], wbig[:1024], bbig[:1024]),
        ("one row", big[:1, :1024], wbig[:1024], bbig[:1024]),
        ("one row, misaligned", big[1:2, 3:1027], wbig[1:1025], bbig[1:1025]),
        ("N = 1000", big[:64, :1000], wbig[:1000], bbig[:1000]),
        ("aligned, last", big[:64, :1024], wbig[:1024], bbig[:1024]),
    ]
    with gpu:
        for _ in range(2):  # the second round finds every key cached
            for name, xv, wv, bv in views:
                n = xv.shape[1]
                x, w, b = (t.detach().requires_grad_() for t in (xv, wv, bv))  # views: same alignment
                dy = _randn(x.shape, dtype, seed=4)
                y = normkit.layer_norm(x, (n,), w, b, 1e-5)
                grads = torch.autograd.grad(y, (x, w, b), dy)
                x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
                y64 = F.layer_norm(x64, (n,), w64, b64, 1e-5)
                expected = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
                assert_close(y, y64, dtype, "fwd", f"{name}: y")
                for g, e, kind, what in zip(grads, expected, ("bwd", "param", "param"), "xwb"):
                    assert_close(g, e, dtype, kind, f"{name}: d{what}", rows=x.shape[0])
                s = normkit.softmax(x, -1)
                assert_close(s, torch.softmax(x64, -1), dtype, "fwd", f"{name}: softmax")
    assert launch._CACHE, "the launches did not go through backends/cuda/launch.py"


@pytest.mark.cuda
def test_launch_key_checks_catch_a_key_that_misses_an_argument(run_on, monkeypatch):
    """The suite runs with launch.CHECK_KEYS (conftest): a call-site key that does not determine the
    specialization (here: the same key for an aligned and a misaligned pointer) raises instead of
    launching the kernel compiled for the other one. Keys that do (dropout seeds of every int class,
    misaligned residuals) launch and give the results of unkeyed launches."""
    from normkit.backends.cuda import launch, reduce

    gpu = _on_gpu(run_on, "cuda", torch.float32)  # skips here without a GPU
    monkeypatch.setattr(launch, "CHECK_KEYS", True)
    with gpu:
        buf, out = _randn((5, 40), torch.float32, seed=1), torch.empty(40, device="cuda")

        def run(p, o):  # the column sums of p's first 5 x 32 values, under one key whatever p is
            launch.launch(reduce._sum_partials_kernel, (1, 1), p, o, o, 5, 32, key=("same key",), BLOCK_G=8,
                          BLOCK_N=32, num_warps=1)  # fmt: skip

        for _ in range(2):  # compiled for 16-byte aligned pointers, then launched from the cache
            out.fill_(float("nan"))
            run(buf, out)
            torch.testing.assert_close(out[:32], buf.flatten()[:160].view(5, 32).sum(0))
        with pytest.raises(AssertionError, match="does not determine its specialization"):
            run(buf[:, 1:], out[1:])  # misaligned pointers: another specialization, same key
        n = 1000
        big = _randn((64, n + 1), torch.bfloat16, seed=2)
        x, r = big[:, :n], big[:, 1:]  # r misaligned
        w = _randn(n, torch.bfloat16, seed=3)
        for seed in (1, 16, 17, 2**31 + 3, 2**40, 1):
            y, h = normkit.add_layer_norm(x, r, (n,), w, None, dropout_p=0.25, seed=seed, prenorm=True)
            h2 = normkit.add_layer_norm(x, r, (n,), w, None, dropout_p=0.25, seed=seed, prenorm=True)[1]
            assert torch.equal(h, h2), f"seed {seed}: the same seed gave another mask"


# --- inference plans (normkit.plans._PLANS) ---------------------------------------------------

# the last two: split rows in the backward (12000), in both directions (40000) for 16-bit and fp32
PLAN_SHAPES = [((1, 4096), 1), ((3, 1000), 1), ((128, 8192), 1), ((2, 5, 64), 2), ((7, 1), 1),
               ((4, 12000), 1), ((3, 40000), 1)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.usefixtures("in_parts")
def test_split_rows_have_plans(run_on, dtype):
    """The split-row kernels (and, for aligned 16-bit rows, the shared-memory forward) serve plans
    (inference and training) for the long rows of PLAN_SHAPES,
    GroupNorm's fp32 split backward for (2, 8, 48, 48) of GN_PLAN_SHAPES and its split forward for
    (2, 32, 64, 64), so the plan tests below exercise them."""
    from normkit.backends.cuda import config, group_norm, layer_norm, softmax

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    with gpu:
        x, w = _randn((3, 40000), dtype), _randn(40000, dtype)
        assert config.forward(3, 40000, dtype, x.device).split > 1
        # aligned rows of 40000 are held in shared memory instead (smem.py; fp32 in parts): plans serve them
        rms = config.forward(3, 40000, dtype, x.device, "rms_norm", True)
        assert rms.smem and rms.in_parts == (dtype.itemsize == 4), rms
        assert config.backward(3, 40000, dtype, x.device, False).split > 1
        assert config.softmax(3, 40000, dtype, x.device).split > 1
        for grad in (False, True):
            assert layer_norm.plan_row_norm(x, w, w, 1e-5, False, grad=grad) is not None
            add_rms = layer_norm.plan_row_norm(x, w, None, 1e-5, True, True, x, torch.float32, grad=grad)
            assert add_rms is not None
            assert softmax.plan_softmax(x, False, grad=grad) is not None
        x12 = _randn((4, 12000), dtype)
        assert config.forward(4, 12000, dtype, x.device).fused
        assert config.backward(4, 12000, dtype, x.device, False).split > 1
        assert layer_norm.plan_row_norm(x12, w[:12000], w[:12000], 1e-5, False, grad=True) is not None
        image, cw = _randn((2, 8, 48 * 48), dtype), _randn(8, dtype)
        splits = config.group_norm_split_backward(4, 4 * 48 * 48, 2, dtype, x.device) is not None
        assert splits == (dtype == torch.float32)
        assert group_norm.plan_group_norm(image, cw, cw, 2, 1e-5, grad=True) is not None
        long = _randn((2, 32, 64 * 64), dtype)
        assert not config.group_norm(4, 16, 64 * 64, dtype).fused  # the row norms' split forward
        assert config.group_norm_split_forward(4, 16 * 64 * 64, 2, dtype, x.device, False) is not None
        for grad in (False, True):
            assert group_norm.plan_group_norm(long, None, None, 2, 1e-5, grad=grad) is not None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape, nd", PLAN_SHAPES, ids=str)
def test_inference_plans_match_reference(run_on, dtype, shape, nd):
    """No-grad calls run from a plan once their signature has been seen (plans._PLANS): three
    rounds of fresh data per signature, aligned and misaligned inputs (each its own plan), with and
    without weight / bias / residual, fp32 parameters and h with 16-bit inputs; every result matches
    fp64 torch and carries no autograd history."""
    from normkit import plans

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    pdtypes = [dtype, torch.float32] if dtype.itemsize == 2 else [dtype]
    plans._PLANS.clear()
    with gpu, torch.no_grad():
        ns, numel = shape[len(shape) - nd:], math.prod(shape)
        for rnd in range(3):
            big = _randn(numel + 8, dtype, seed=rnd)
            for offset in (0, 1):  # 16-byte aligned, then not
                x = big[offset:offset + numel].view(shape)
                x64 = x.double()
                for pd in pdtypes:
                    w, b = _randn(ns, pd, seed=10 + rnd) + 1, _randn(ns, pd, seed=20 + rnd)
                    w64, b64 = w.double(), b.double()
                    calls = {
                        "layer_norm": (normkit.layer_norm(x, ns, w, b), F.layer_norm(x64, ns, w64, b64)),
                        "layer_norm, no weight": (normkit.layer_norm(x, list(ns)), F.layer_norm(x64, ns)),
                        "rms_norm": (normkit.rms_norm(x, ns, w, 1e-5), F.rms_norm(x64, ns, w64, 1e-5)),
                        "rms_norm, no weight": (normkit.rms_norm(x, ns), F.rms_norm(
                            x64, ns, eps=torch.finfo(dtype).eps)),
                        "softmax": (normkit.softmax(x, -1), torch.softmax(x64, -1)),
                        "log_softmax": (normkit.log_softmax(x, x.dim() - 1), torch.log_softmax(x64, -1)),
                    }  # fmt: skip
                    r = _randn(shape, dtype, seed=30 + rnd)
                    for op, hd in itertools.product(("add_layer_norm", "add_rms_norm"), (None, pd)):
                        for res in (r, None):
                            y, h = getattr(normkit, op)(x, res, ns, w, residual_dtype=hd, prenorm=True)
                            h64 = x64 if res is None else x64 + res.double()
                            # y normalizes h as stored (in its dtype), as the backward sees it
                            calls[f"{op}, h dtype {hd}, residual {res is not None}: h"] = h, h64
                            calls[f"{op}, h dtype {hd}, residual {res is not None}: y"] = y, (
                                F.rms_norm(h.double(), ns, w64, torch.finfo(dtype).eps) if "rms" in op
                                else F.layer_norm(h.double(), ns, w64))  # fmt: skip
                    for name, (y, y64) in calls.items():
                        what = f"{name} {list(shape)} offset {offset} round {rnd} params {pd}"
                        assert y.shape == x.shape and not y.requires_grad, what
                        assert_close(y, y64, dtype, "fwd", what)
    own = [p for p in plans._PLANS.values() if not plans.is_contract(p)]
    assert own and len(own) == len(plans._PLANS), "a signature of this shape has no plan of the backend's"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape, nd", PLAN_SHAPES, ids=str)
def test_training_plans_match_reference(run_on, dtype, shape, nd):
    """Calls that want gradients run from a training plan once their signature has been seen
    (plans._PLANS, plans.Training / SoftmaxTraining): two rounds of fresh data per
    signature, aligned and misaligned inputs, with and without weight / bias / residual, fp32
    parameters with 16-bit inputs, the add-norms with and without h's own gradient, incoming
    gradients fresh, misaligned and expanded (copied by the plan's Function); outputs and every
    gradient (dtype and shape of its input) match fp64 torch, and a second backward gives bitwise
    equal gradients."""
    from normkit import plans

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    pdtypes = [dtype, torch.float32] if dtype.itemsize == 2 else [dtype]
    plans._PLANS.clear()
    with gpu:
        for rnd, offset, pd in itertools.product(range(2), (0, 1), pdtypes):
            ns, numel = shape[len(shape) - nd:], math.prod(shape)
            x = _randn(numel + 8, dtype, seed=rnd)[offset:offset + numel].view(shape).requires_grad_()
            w = torch.nn.Parameter(_randn(ns, pd, seed=10 + rnd) + 1)
            b = torch.nn.Parameter(_randn(ns, pd, seed=20 + rnd))
            r = _randn(shape, dtype, seed=30 + rnd).requires_grad_()
            x64, r64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, r, w, b))
            eps, hd = torch.finfo(dtype).eps, torch.float32 if dtype.itemsize == 2 else dtype  # h: exact sums
            calls = {
                "layer_norm": (normkit.layer_norm(x, ns, w, b), F.layer_norm(x64, ns, w64, b64), (x, w, b),
                               (x64, w64, b64)),
                "layer_norm, no bias": (normkit.layer_norm(x, list(ns), w), F.layer_norm(x64, ns, w64),
                                        (x, w), (x64, w64)),
                "layer_norm, no params": (normkit.layer_norm(x, ns), F.layer_norm(x64, ns), (x,), (x64,)),
                "rms_norm": (normkit.rms_norm(x, ns, w), F.rms_norm(x64, ns, w64, eps), (x, w), (x64, w64)),
                "rms_norm, no weight": (normkit.rms_norm(x, ns), F.rms_norm(x64, ns, eps=eps), (x,), (x64,)),
                "softmax": (normkit.softmax(x, -1), torch.softmax(x64, -1), (x,), (x64,)),
                "log_softmax": (normkit.log_softmax(x, -1), torch.log_softmax(x64, -1), (x,), (x64,)),
                "add_layer_norm": (normkit.add_layer_norm(x, r, ns, w, b, residual_dtype=hd),
                                   F.layer_norm(x64 + r64, ns, w64, b64), (x, r, w, b), (x64, r64, w64, b64)),
                "add_rms_norm, prenorm, no residual": (
                    (lambda y, h: y + h.to(dtype))(*normkit.add_rms_norm(x, None, ns, w, residual_dtype=hd,
                                                                         prenorm=True)),
                    F.rms_norm(x64, ns, w64, eps) + x64, (x, w), (x64, w64)),
            }  # fmt: skip
            dys = {
                "fresh": _randn(shape, dtype, seed=40 + rnd),
                "misaligned": _randn(numel + 8, dtype, seed=50 + rnd)[1:1 + numel].view(shape),
                "expanded": _randn(shape[-1], dtype, seed=60 + rnd).expand(shape),
            }
            for name, (y, y64, inputs, inputs64) in calls.items():
                what = f"{name} {list(shape)} offset {offset} round {rnd} params {pd}"
                assert y.requires_grad and y.shape == x.shape, what
                assert_close(y, y64, dtype, "fwd", what)
                for kind, dy in dys.items():
                    grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
                    again = torch.autograd.grad(y, inputs, dy, retain_graph=True)
                    expected = torch.autograd.grad(y64, inputs64, dy.double(), retain_graph=True)
                    for i, (g, g2, e, t) in enumerate(zip(grads, again, expected, inputs)):
                        label = f"{what}, {kind} dy: gradient of input {i}"
                        assert g.dtype == t.dtype and g.shape == t.shape, label
                        tol = "param" if isinstance(t, torch.nn.Parameter) else "bwd"
                        assert_close(g, e, dtype, tol, label, rows=numel // shape[-1])
                        assert torch.equal(g, g2), f"{label} differs between two runs"
    trained = [p for p in plans._PLANS.values() if isinstance(p, plans.Training) and not plans.is_contract(p)]
    kinds = {next(c for c in type(p).__mro__ if c.__module__ == plans.__name__).__name__ for p in trained}
    assert kinds == {"Training", "AddNormTraining", "SoftmaxTraining"}  # (or native.py's subclasses of them)


# (2, 8, 48, 48): rows of L = 9216, whose fp32 backward splits (config.group_norm_split_backward);
# (2, 32, 64, 64): rows of L = 65536, over the fused forward's limit (the split forward)
GN_PLAN_SHAPES = [((2, 8, 5, 7), 4), ((3, 32, 16, 16), 8), ((1, 4, 3), 2), ((4, 6, 1, 1), 3),
                  ((2, 8, 48, 48), 2), ((2, 32, 64, 64), 2)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_group_norm_plans_match_reference(run_on, dtype):
    """GroupNorm calls run from plans once their signature has been seen (plan_group_norm): two
    rounds of fresh data per signature, aligned and misaligned inputs, with and without weight /
    bias, fp32 parameters with 16-bit inputs; the no-grad output, the output with gradients and
    every gradient (dtype, shape, value) match fp64 torch, and a second backward is bitwise equal."""
    from normkit import plans

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    pdtypes = [dtype, torch.float32] if dtype.itemsize == 2 else [dtype]
    with gpu:
        cases = itertools.product(GN_PLAN_SHAPES, range(2), (0, 1), pdtypes, (True, False))
        for (shape, G), rnd, offset, pd, affine in cases:
            numel, C = math.prod(shape), shape[1]
            x = _randn(numel + 8, dtype, seed=rnd)[offset:offset + numel].view(shape).requires_grad_()
            w = torch.nn.Parameter(_randn(C, pd, seed=10 + rnd) + 1) if affine else None
            b = torch.nn.Parameter(_randn(C, pd, seed=20 + rnd)) if affine else None
            inputs = (x, w, b) if affine else (x,)
            inputs64 = tuple(t.detach().double().requires_grad_() for t in inputs)
            x64, w64, b64 = (*inputs64, None, None)[:3]
            what = f"group_norm {list(shape)} G {G} offset {offset} round {rnd} params {pd} {affine}"
            y64 = F.group_norm(x64, G, w64, b64)
            with torch.no_grad():
                y = normkit.group_norm(x, G, w, b)
            assert not y.requires_grad, what
            assert_close(y, y64, dtype, "fwd", f"{what}, no grad")
            y = normkit.group_norm(x, G, w, b)
            assert y.requires_grad, what
            assert_close(y, y64, dtype, "fwd", what)
            dy = _randn(shape, dtype, seed=40 + rnd)
            grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
            again = torch.autograd.grad(y, inputs, dy, retain_graph=True)
            expected = torch.autograd.grad(y64, inputs64, dy.double())
            for i, (g, g2, e, t) in enumerate(zip(grads, again, expected, inputs)):
                label = f"{what}: gradient of input {i}"
                assert g.dtype == t.dtype and g.shape == t.shape, label
                rows = shape[0] * math.prod(shape[2:])  # summed into each parameter gradient
                assert_close(g, e, dtype, "param" if i else "bwd", label, rows=rows)
                assert torch.equal(g, g2), f"{label} differs between two runs"
    served = {key[-1] for key, p in plans._PLANS.items()
              if key[0] == "group_norm" and not plans.is_contract(p)}  # fmt: skip
    assert served == {False, True}, "GroupNorm calls were not served by inference and training plans"


# (N, C, *spatial): split channels in both directions (one and several chunks a channel), a 1-D
# spatial dim, and HW < BATCH_NORM_SPLIT_MIN_HW (two-pass kernels: an eval plan, no training plan)
BN_PLAN_SHAPES = [(4, 8, 32, 32), (8, 4, 48, 48), (2, 6, 300), (5, 3, 7, 9)]


def _batch_norm_call(monkeypatch, x, stats, w, b, train, grad, momentum, plans):
    """normkit.batch_norm on clones of ``stats`` (None entries: none given) -> (y, the statistics
    after the call); ``plans=False``: contract plans only (none of the backend's own looked up, made
    or remembered)."""
    from normkit import plans as plan_cache

    run = [None if s is None else s.clone() for s in stats]
    make = plan_cache.make
    with monkeypatch.context() as patch:
        if not plans:
            patch.setattr(plan_cache, "stored", lambda key: None)
            patch.setattr(plan_cache, "make", lambda key, *args, **kwargs: make(None, *args, **kwargs))
        with torch.set_grad_enabled(grad):
            return normkit.batch_norm(x, *run, w, b, training=train, momentum=momentum), run


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", BN_PLAN_SHAPES, ids=str)
def test_batch_norm_plans_match_reference(run_on, monkeypatch, shape, dtype):
    """BatchNorm calls run from plans (plan_batch_norm): training with and without gradients (the
    running statistics updated in place; a new momentum each call, as nn.BatchNorm's cumulative
    average passes) and eval without gradients; three rounds of fresh data per signature, aligned
    and misaligned inputs, with and without weight / bias / running statistics, fp32 parameters
    with 16-bit inputs. The outputs, running statistics and every gradient match fp64 torch, a
    second backward is bitwise equal, and the full path (plans off) gives bitwise the same y and
    running statistics."""
    from normkit import plans
    from normkit.backends.cuda import config

    gpu = _on_gpu(run_on, "cuda", dtype)  # skips here without a GPU
    pdtypes = [dtype, torch.float32] if dtype.itemsize == 2 else [dtype]
    numel, C = math.prod(shape), shape[1]
    rows = shape[0] * math.prod(shape[2:])  # values per channel
    modes = ((True, True), (True, False), (False, False))  # (training, gradients wanted)
    with gpu:
        plans._PLANS.clear()
        cases = itertools.product(range(3), (0, 1), pdtypes, (True, False), (True, False), modes)
        for rnd, offset, pd, affine, running, (train, grad) in cases:
            what = (f"batch_norm {list(shape)} round {rnd} offset {offset} params {pd} affine {affine} "
                    f"running {running} training {train} grad {grad}")  # fmt: skip
            x = _randn(numel + 8, dtype, seed=rnd)[offset:offset + numel].view(shape).requires_grad_()
            w = torch.nn.Parameter(_randn(C, pd, seed=10 + rnd) * 0.5 + 1) if affine else None
            b = torch.nn.Parameter(_randn(C, pd, seed=20 + rnd)) if affine else None
            stats = [_randn(C, torch.float32, seed=30 + rnd), _randn(C, torch.float32, seed=31 + rnd).abs()]
            stats = [stats[0], stats[1] + 0.5] if running or not train else [None, None]
            inputs = (x, w, b) if affine else (x,)
            inputs64 = tuple(t.detach().double().requires_grad_() for t in inputs)
            x64, w64, b64 = (*inputs64, None, None)[:3]
            momentum = 0.1 + 0.2 * rnd + 0.05 * offset
            y, run = _batch_norm_call(monkeypatch, x, stats, w, b, train, grad, momentum, True)
            run64 = [None if s is None else s.double() for s in stats]
            y64 = F.batch_norm(x64, *run64, w64, b64, training=train, momentum=momentum)
            assert y.requires_grad == grad and y.shape == x.shape, what
            assert_close(y, y64, dtype, "fwd", what)
            for got, ref in zip(run, run64):
                if ref is not None:
                    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6, msg=what)
            full, full_run = _batch_norm_call(monkeypatch, x, stats, w, b, train, grad, momentum, False)
            assert torch.equal(y, full), f"{what}: plan and full path differ"
            for got, ref in zip(run, full_run):
                assert got is None or torch.equal(got, ref), f"{what}: running statistics differ"
            if not grad:
                continue
            dy = _randn(shape, dtype, seed=40 + rnd)
            grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
            again = torch.autograd.grad(y, inputs, dy)
            expected = torch.autograd.grad(y64, inputs64, dy.double())
            for i, (g, g2, e, t) in enumerate(zip(grads, again, expected, inputs)):
                label = f"{what}: gradient of input {i}"
                assert g.dtype == t.dtype and g.shape == t.shape, label
                assert_close(g, e, dtype, "param" if i else "bwd", label, rows=rows)
                assert torch.equal(g, g2), f"{label} differs between two runs"
    hw, cuda = math.prod(shape[2:]), torch.device("cuda")
    splits = all(config.batch_norm_split(shape[0], C, hw, dtype, cuda, bwd) for bwd in (False, True))
    # (the native host path wraps the backend's plans: native.BatchNormRun around an inference plan, a
    # NativeBatchNormTraining for a training one)
    kinds = {(key[-1], type(getattr(p, "plan", p)).__name__.removeprefix("Native"), plans.is_contract(p))
             for key, p in plans._PLANS.items() if key[0] == "batch_norm"}  # fmt: skip
    if splits:  # a training plan, and inference plans in training and eval mode
        assert kinds == {(True, "BatchNormTraining", False), (False, "function", False)}, kinds
    else:  # two-pass kernels: contract plans in training, the backend's inference plan in eval mode
        assert kinds == {(True, "BatchNormTraining", True), (False, "method", True),
                         (False, "function", False)}, kinds  # fmt: skip
    plans._PLANS.clear()
