"""GroupNorm (and InstanceNorm, its C-groups case) on NVIDIA GPUs: kernels, then launchers.

A contiguous (N, C, HW) input holds each (sample, group) as one contiguous row of
L = (C / G) * HW elements, so one program per row computes its statistics (Chan merging of
tiles) and normalizes it with the per-channel affine. The backward's per-channel sums give both the
dx reduction terms and the dweight/dbias partials of that sample ((N, C) buffers, summed over N in
a fixed order). Row bodies: ``backends/common.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import (
    exact_eps,
    group_norm_row_bwd,
    group_norm_row_fwd,
    reciprocal,
)
from normkit.backends.cuda import config, reduce
from normkit.backends.cuda.launch import launch


@triton.jit
def _fwd_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (N * G,) out, ACC
    Rstd,  # (N * G,) out, ACC
    G,  # groups
    L,  # row length (C / G) * HW
    HW,
    Cg,  # channels per group
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    BLOCK: tl.constexpr,  # column tile; one program per (n, g) row
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    group_norm_row_fwd(X, Y, W, B, Mean, Rstd, tl.program_id(0), G, L, HW, Cg, reciprocal(L, ACC),
                       exact_eps(eps, eps_lo, ACC),
                       BLOCK, HAS_W, HAS_B, ACC)  # fmt: skip


@triton.jit
def _bwd_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (N * G,)
    Rstd,  # (N * G,)
    DW_part,  # (N, C) out, ACC: sample n's sum of dy * xhat per channel (written when HAS_W)
    DB_part,  # (N, C) out, ACC: sample n's sum of dy per channel (written when HAS_DB)
    G,
    C,
    L,
    HW,
    Cg,
    BLOCK: tl.constexpr,  # tile over HW; one program per (n, g) row
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    ACC: tl.constexpr,
):
    group_norm_row_bwd(X, DY, DX, W, Mean, Rstd, DW_part, DB_part, tl.program_id(0), G, C, L, HW, Cg,
                       reciprocal(L, ACC), BLOCK, HAS_W, HAS_DB, ACC)  # fmt: skip


def group_norm_fwd(x, weight, bias, num_groups, eps):
    """x: (N, C, HW) contiguous -> (y, mean, rstd), statistics per (n, g): shape (N * G,)."""
    N, C, HW = x.shape
    L = C // num_groups * HW
    cfg = config.group_norm(N * num_groups, L, x.dtype)
    y = torch.empty_like(x)
    mean = torch.empty(N * num_groups, dtype=config.acc_dtype(x.dtype), device=x.device)
    rstd = torch.empty_like(mean)
    launch(_fwd_kernel, cfg.grid,
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
        num_groups, L, HW, C // num_groups, eps, config.eps_tail(eps, x.device), BLOCK=cfg.block_size,
        HAS_W=weight is not None, HAS_B=bias is not None, ACC=config.tl_acc_dtype(x.dtype),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return y, mean, rstd


def group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    """-> (dx, dweight, dbias), None where the forward had no weight / bias."""
    N, C, HW = x.shape
    L = C // num_groups * HW
    cfg = config.group_norm_backward(N * num_groups, HW, x.dtype)
    dx = torch.empty_like(x)
    acc = config.acc_dtype(x.dtype)
    has_w, has_db = weight is not None, bias_dtype is not None
    grad_dtypes = (weight.dtype if has_w else None, bias_dtype)
    part_buf, (dw_part, db_part) = reduce.partials(grad_dtypes, N, C, acc, x.device)
    dw_part = mean if dw_part is None else dw_part  # a placeholder pointer when unused
    db_part = mean if db_part is None else db_part
    launch(_bwd_kernel, cfg.grid,
        x, dy, dx, weight if has_w else x, mean, rstd, dw_part, db_part, num_groups, C, L, HW,
        C // num_groups, BLOCK=cfg.block_size, HAS_W=has_w, HAS_DB=has_db,
        ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps,
    )  # fmt: skip
    dweight, dbias = reduce.sum_partials(part_buf, grad_dtypes)
    return dx, dweight, dbias
