"""Fixed-order sum of per-program partials: the deterministic second half of dweight/dbias.

Backward kernels write one fp32 row of partial sums per program (no atomics); this kernel adds
those rows in program order, so the result is bitwise identical run to run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.cuda import config


@triton.jit
def _sum_partials_kernel(
    P,  # (G, N) partial sums, fp32 (fp64 for fp64 inputs), contiguous
    Out,  # (N,) result, in the parameter's dtype
    G,  # number of partial rows
    N,  # columns
    BLOCK_G: tl.constexpr,  # partial rows loaded per step (summed by a fixed-shape tree)
    BLOCK_N: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros([BLOCK_N], P.dtype.element_ty)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_mask[None, :]
        tile = tl.load(P + g.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(Out + cols, acc.to(Out.dtype.element_ty), mask=col_mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G, N) partials -> (N,) column sums in ``dtype``, in a fixed order (bitwise reproducible)."""
    G, N = partials.shape
    out = torch.empty(N, dtype=dtype, device=partials.device)
    cfg = config.reduce(G, N, partials.device)
    _sum_partials_kernel[cfg.grid](
        partials, out, G, N, BLOCK_G=cfg.rows_per_program, BLOCK_N=cfg.block_size,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return out
