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
    BLOCK: tl.constexpr,  # columns per program
):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], P.dtype.element_ty)
    for g in range(0, G):
        acc += tl.load(P + tl.cast(g, tl.int64) * N + cols, mask=mask, other=0.0)
    tl.store(Out + cols, acc.to(Out.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(G, N) partials -> (N,) column sums in ``dtype``, added in row order."""
    G, N = partials.shape
    out = torch.empty(N, dtype=dtype, device=partials.device)
    cfg = config.reduce(N)
    _sum_partials_kernel[cfg.grid](partials, out, G, N, BLOCK=cfg.block_size, num_warps=cfg.num_warps)
    return out
