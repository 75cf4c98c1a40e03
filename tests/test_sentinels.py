"""Outputs written into sentinel-padded buffers: every buffer a backend allocates with torch.empty /
torch.empty_like is a view into a larger one whose padding (PAD elements on each side, more than a
tile) holds a sentinel; after forward and backward the padding must be unchanged. An unmasked
store past a row's or a tensor's end lands there and fails an assertion (the interpreter would
otherwise write it into whatever memory follows, or crash)."""

import math

import pytest
import torch
from conftest import executor_params

from normkit.testing import ADD_OPS, CHANNEL_OPS, SOFTMAX_OPS, check_case

PAD = 8192  # elements each side: more than the widest tile a kernel stores (CUDA looped: 8192)
ROW_OPS = ["layer_norm", "rms_norm", *SOFTMAX_OPS, *ADD_OPS]


@pytest.fixture
def padded(monkeypatch):
    """Patch torch.empty / torch.empty_like (plain, contiguous requests) to return views into
    sentinel-padded buffers; yields a function asserting that every padding is untouched."""
    real_empty, real_like = torch.empty, torch.empty_like
    buffers = []

    def alloc(shape, dtype, device):
        n = math.prod(shape)
        flat = real_empty(n + 2 * PAD, dtype=dtype, device=device)
        flat.fill_(True if dtype == torch.bool else -77)
        buffers.append((flat, n, flat[:PAD].clone(), flat[PAD + n :].clone()))
        return flat[PAD : PAD + n].view(shape)

    def empty(*size, dtype=None, device=None, requires_grad=False, **kw):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
        if kw or not all(type(d) is int for d in shape):
            return real_empty(*size, dtype=dtype, device=device, requires_grad=requires_grad, **kw)
        t = alloc(tuple(shape), dtype or torch.get_default_dtype(), torch.device(device or "cpu"))
        return t.requires_grad_(requires_grad)

    def empty_like(t, *, dtype=None, device=None, **kw):
        if kw or not t.is_contiguous():
            return real_like(t, dtype=dtype, device=device, **kw)
        return alloc(tuple(t.shape), dtype or t.dtype, torch.device(device or t.device))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)

    def check():
        assert buffers, "no buffer went through torch.empty / torch.empty_like"
        for flat, n, before, after in buffers:
            for where, old, new in (("before", before, flat[:PAD]), ("after", after, flat[PAD + n :])):
                changed = bool(old.numel()) and not torch.equal(old.view(torch.uint8), new.view(torch.uint8))
                assert not changed, f"a {flat.dtype} output of {n} elements was written {where} its end"

    return check


@pytest.mark.parametrize("op", ROW_OPS + list(CHANNEL_OPS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
# NPU: rows held in UB (1100, 7: packed) and rows longer than config.ROW_NORM_WIDTH (2100)
@pytest.mark.parametrize("executor,shape", executor_params(
    [((3, 1100),), ((5, 7),)], [((3, 1100),), ((65, 40999),)],
    [((3, 1100),), ((3, 2100),), ((5, 7),)]))  # fmt: skip
def test_outputs_stay_inside_their_buffers(run_on, padded, executor, shape, dtype, op):
    """Forward and backward against fp64, every output buffer's padding unchanged (rows with a
    ragged last tile: 1100 = 1024 + 76 on the NPU kernels, a masked tile on CUDA's)."""
    with run_on(executor, dtype):
        check_case(op, shape, 1, dtype, executor.device, seed=len(shape) + shape[-1])
    padded()
