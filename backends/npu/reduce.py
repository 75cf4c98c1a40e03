"""Fixed-order sum of per-chunk partials on Ascend: the deterministic half of dweight/dbias."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.npu import config


@triton.jit
def _sum_partials_kernel(
    P,  # (G, N) fp32 partial sums, contiguous
    Q,  # (G, N) a second set of partial sums (read when TWO)
    Out,  # (N,) P's column sums in the parameter's dtype
    OutQ,  # (N,) Q's column sums (written when TWO)
    G,
    N,
    BLOCK_SIZE: tl.constexpr,
    TWO: tl.constexpr,  # dweight and dbias in one launch
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 34.0 KB (two sets).
    # Rows are added in order 0..G-1.
    for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_SIZE), tl.num_programs(0)):
        cols = tile * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < N
        acc = tl.zeros([BLOCK_SIZE], tl.float32)
        acc_q = tl.zeros([BLOCK_SIZE], tl.float32)
        for g in range(0, G):
            acc += tl.load(P + tl.cast(g, tl.int64) * N + cols, mask=mask, other=0.0)
            if TWO:
                acc_q += tl.load(Q + tl.cast(g, tl.int64) * N + cols, mask=mask, other=0.0)
        tl.store(Out + cols, acc.to(Out.dtype.element_ty), mask=mask)
        if TWO:
            tl.store(OutQ + cols, acc_q.to(OutQ.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype, second: torch.Tensor | None = None,
                 second_dtype: torch.dtype | None = None):  # fmt: skip
    """(G, N) fp32 partials -> (N,) column sums in ``dtype``, added in row order (deterministic).
    With ``second`` (G, N), its sums in ``second_dtype`` too, in the same launch: -> (sums, second's)."""
    G, N = partials.shape
    out = torch.empty(N, dtype=dtype, device=partials.device)
    two = second is not None
    out_q = torch.empty(N, dtype=second_dtype, device=partials.device) if two else out
    cfg = config.column_tiles(N, partials.device)
    _sum_partials_kernel[cfg.grid](partials, second if two else partials, out, out_q, G, N,
                                   BLOCK_SIZE=cfg.block_size, TWO=two)  # fmt: skip
    return (out, out_q) if two else out


def param_sums(dw_part, weight_dtype, db_part, bias_dtype):
    """(dweight, dbias) from their (G, N) partials, None where the partials are None; one launch."""
    if dw_part is not None and db_part is not None:
        return sum_partials(dw_part, weight_dtype, db_part, bias_dtype)
    return (None if dw_part is None else sum_partials(dw_part, weight_dtype),
            None if db_part is None else sum_partials(db_part, bias_dtype))  # fmt: skip
