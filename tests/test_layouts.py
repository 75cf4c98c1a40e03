"""Channels-last inputs of the channel norms (issue 41): channels_last / channels_last_3d in,
the same layout out (y and dx), values and gradients as torch in fp64, and the kernels reading the
input's own memory (no layout copy on the way)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import executor_params

import normkit
from normkit import dispatch
from normkit.testing import Executor, assert_close

NATIVE = Executor("cpu", "cpu")  # CPU tensors with no override: torch's own operators
# (shape, groups): 4-D and 5-D; groups of one channel (InstanceNorm's case), of several, all channels
# CUDA GroupNorm forward, channels-last: runs of Cg channels under 64 bytes (Cg 2, 4, 8) take the
# [channels, HW] tiles (group_norm._fwd_cl_kernel), 64 bytes and more (Cg 32) the fused kernel
# (config.GROUP_NORM_CL_FUSED_MIN_RUN); (8, 256, 14, 14) in one group is past the fused limit.
INTERPRETER_CASES = [((2, 6, 5, 3), 3), ((2, 4, 3, 2, 3), 2), ((1, 8, 4, 4), 1), ((1, 32, 3, 3), 1)]
DEVICE_CASES = [((4, 64, 28, 28), 32), ((2, 32, 8, 16, 16), 8), ((8, 256, 14, 14), 1), ((2, 6, 33, 35), 6),
                ((4, 64, 8, 8), 2)]
OPS = ["group_norm", "instance_norm", "batch_norm-train", "batch_norm-eval"]


def _call(lib, op, x, w, b, groups, stats):
    if op == "group_norm":
        return lib.group_norm(x, groups, w, b, eps=1e-5)
    if op == "instance_norm":
        return lib.instance_norm(x, None, None, w, b, eps=1e-5)
    rm, rv = stats
    return lib.batch_norm(x, rm, rv, w, b, training=op == "batch_norm-train", momentum=0.1, eps=1e-5)


def _format(shape):
    return torch.channels_last if len(shape) == 4 else torch.channels_last_3d


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("executor,shape,groups", executor_params(INTERPRETER_CASES, DEVICE_CASES)
                         + [pytest.param(NATIVE, s, g, id=f"cpu-{s}") for s, g in INTERPRETER_CASES])
def test_channels_last_kept(run_on, monkeypatch, executor, shape, groups, dtype, op):
    context = contextlib.nullcontext() if executor is NATIVE else run_on(executor, dtype)  # (or skip)
    dev = executor.device
    fmt = _format(shape)
    C = shape[1]
    g = torch.Generator().manual_seed(sum(shape))
    x0 = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)
    w0, b0 = torch.rand(C, generator=g).to(dtype) + 0.5, torch.randn(C, generator=g).to(dtype)
    dy0 = torch.randn(shape, generator=g).to(dtype)
    stats0 = (torch.randn(C, generator=g), torch.rand(C, generator=g) + 0.5)

    x = x0.to(dev).contiguous(memory_format=fmt).requires_grad_()
    w, b = w0.to(dev, copy=True).requires_grad_(), b0.to(dev, copy=True).requires_grad_()
    dy = dy0.to(dev).contiguous(memory_format=fmt)
    stats = tuple(s.to(dev, copy=True) for s in stats0)
    seen = []
    if executor is not NATIVE:  # the kernels get the input's own memory, not a copy
        module = __import__(executor.module, fromlist=["_"])
        for name in ("group_norm_fwd", "batch_norm_train_fwd", "batch_norm_apply"):
            real = getattr(module, name)
            monkeypatch.setattr(module, name,
                                lambda t, *a, real=real, **k: seen.append(t.data_ptr()) or real(t, *a, **k))
    with context:
        y = _call(normkit, op, x, w, b, groups, stats)
        y.backward(dy)
    if executor is not NATIVE:
        assert seen and all(p == x.data_ptr() for p in seen), "the input was copied on its way to a kernel"
    assert y.is_contiguous(memory_format=fmt), y.stride()
    assert x.grad.is_contiguous(memory_format=fmt), x.grad.stride()

    x64 = x0.double().requires_grad_()  # fp64 references on the CPU (the inputs' CPU originals)
    w64, b64 = w0.double().requires_grad_(), b0.double().requires_grad_()
    stats64 = tuple(s.double() for s in stats0)
    e = _call(F, op, x64, w64, b64, groups, stats64)
    e.backward(dy0.double())
    rows = x0.numel() // C
    assert_close(y, e, dtype, "fwd", f"{op}: y")
    assert_close(x.grad, x64.grad, dtype, "bwd", f"{op}: dx")
    assert_close(w.grad, w64.grad, dtype, "param", f"{op}: dweight", rows=rows)
    assert_close(b.grad, b64.grad, dtype, "param", f"{op}: dbias", rows=rows)
    if op == "batch_norm-train":
        for got, want in zip(stats, stats64):
            assert_close(got, want, torch.float32, "fwd", f"{op}: running statistics")


def test_other_layouts_are_copied_once():
    """A permuted input that is neither contiguous nor channels-last: one copy, right values."""
    x = torch.randn(2, 5, 3, 4).permute(0, 1, 3, 2)  # (2, 5, 4, 3), HW transposed
    with dispatch.use_backend("cpu", "normkit.reference"):
        y = normkit.group_norm(x, 5)
    torch.testing.assert_close(y, F.group_norm(x, 5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("executor,shape,groups",
                         executor_params([((1, 32, 33, 33), 1)], [((2, 512, 28, 28), 2)]))  # fmt: skip
def test_channels_last_rows_past_the_fused_forward(run_on, monkeypatch, executor, shape, groups):
    """GroupNorm rows too long for the fused forward (CUDA: group_norm._fwd_cl_kernel), fp32."""
    test_channels_last_kept(run_on, monkeypatch, executor, shape, groups, torch.float32, "group_norm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_channels_last_group_norm_paths(dtype):
    """Which CUDA forward a channels-last GroupNorm takes (the choice, no kernel run): the fused one
    for runs of channels of 64 bytes or more, the [channels, HW] tiles below; contiguous inputs fused."""
    from normkit.backends.cuda import config

    size = dtype.itemsize
    assert config.group_norm(4 * 2, 64 // size, 64, dtype, cl=True).fused
    assert not config.group_norm(4 * 32, 32 // size, 64, dtype, cl=True).fused
    assert config.group_norm(4 * 32, 32 // size, 64, dtype).fused
    cpu = torch.device("cpu")  # the whole forward's strategy: as the tiles say
    assert config.group_norm_fwd_strategy(4, 64 // size * 2, 64, 2, dtype, cpu, True).kernel == "fused"
    cl_tiles = config.group_norm_fwd_strategy(4, 32 // size * 32, 64, 32, dtype, cpu, True)
    assert cl_tiles.kernel == "channels_last"
    assert config.group_norm_fwd_strategy(4, 32 // size * 32, 64, 32, dtype, cpu).kernel == "fused"
    long = config.group_norm_fwd_strategy(2, 64, 128 * 128, 2, dtype, cpu)  # 2^19 values a row
    assert long.kernel in ("looped", "split") and not long.tiles.fused
