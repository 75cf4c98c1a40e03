"""Fixed-order sum of per-chunk partials on Ascend: the deterministic half of dweight/dbias."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.npu import config


@triton.jit
def _sum_partials_kernel(
    P,  # (G, N) fp32 partial sums, contiguous
    Out,  # (N,) result in the parameter's dtype
    G,
    N,
    BLOCK_SIZE: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 18.0 KB.
    # Rows are added in order 0..G-1.
    for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_SIZE), tl.num_programs(0)):
        cols = tile * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < N
        acc = tl.zeros([BLOCK_SIZE], tl.float32)
        for g in range(0, G):
            acc += tl.load(P + tl.cast(g, tl.int64) * N + cols, mask=mask, other=0.0)
        tl.store(Out + cols, acc.to(Out.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G, N) fp32 partials -> (N,) column sums in ``dtype``, added in row order (deterministic)."""
    G, N = partials.shape
    out = torch.empty(N, dtype=dtype, device=partials.device)
    cfg = config.column_tiles(N, partials.device)
    _sum_partials_kernel[cfg.grid](partials, out, G, N, BLOCK_SIZE=cfg.block_size)
    return out
