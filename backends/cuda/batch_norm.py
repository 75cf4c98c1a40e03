"""BatchNorm on NVIDIA GPUs (training and eval): kernels, then launchers.

A column reduction, unlike the row norms: channel c's statistics run over N samples x HW of a
contiguous (N, C, HW) input. One program per channel walks its samples in order (Chan merging of
tiles: deterministic, exact for large means); one program per (n, c) row applies the per-channel
scale and shift. The backward mirrors it: per-channel sums of dy and dy * xhat (= dbias, dweight),
then dx per row. Running statistics are updated by the front end. Bodies: backends/common.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import (
    batch_norm_channel_grad_sums,
    batch_norm_channel_stats,
    batch_norm_row_apply,
    batch_norm_row_dx,
    reciprocal,
)
from normkit.backends.cuda import config
from normkit.backends.cuda.launch import launch


@triton.jit
def _stats_kernel(
    X,  # (N, C, HW) contiguous input
    Mean,  # (C,) out, ACC
    Var,  # (C,) out, ACC: biased variance
    N,
    C,
    HW,
    BLOCK: tl.constexpr,  # tile over HW; one program per channel
    ACC: tl.constexpr,
):
    batch_norm_channel_stats(X, Mean, Var, tl.program_id(0), N, C, HW, BLOCK, ACC)


@triton.jit
def _apply_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (C,) batch or running mean
    Rstd,  # (C,) 1 / sqrt(var + eps)
    C,
    HW,
    BLOCK: tl.constexpr,  # tile over HW; one program per (n, c) row
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    batch_norm_row_apply(X, Y, W, B, Mean, Rstd, tl.program_id(0), C, HW, BLOCK, HAS_W, HAS_B, ACC)


@triton.jit
def _grad_sums_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy,  # (C,) out, ACC
    Sum_dy_xhat,  # (C,) out, ACC
    N,
    C,
    HW,
    BLOCK: tl.constexpr,  # one program per channel
    ACC: tl.constexpr,
):
    batch_norm_channel_grad_sums(X, DY, Mean, Rstd, Sum_dy, Sum_dy_xhat, tl.program_id(0), N, C, HW,
                                 BLOCK, ACC)  # fmt: skip


@triton.jit
def _dx_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy,  # (C,) from _grad_sums_kernel
    Sum_dy_xhat,  # (C,)
    C,
    HW,
    count,  # N * HW: values per channel (1 / count is formed here, exact in fp64)
    BLOCK: tl.constexpr,  # one program per (n, c) row
    HAS_W: tl.constexpr,
    TRAINING: tl.constexpr,  # statistics came from this batch (their gradient flows to x)
    ACC: tl.constexpr,
):
    batch_norm_row_dx(X, DY, DX, W, Mean, Rstd, Sum_dy, Sum_dy_xhat, tl.program_id(0), C, HW,
                      reciprocal(count, ACC), BLOCK, HAS_W, TRAINING, ACC)  # fmt: skip


def batch_norm_stats(x):
    """x: (N, C, HW) contiguous -> (mean, biased var), each (C,) in the math dtype."""
    N, C, HW = x.shape
    cfg = config.batch_norm(C, HW, x.dtype)
    mean = torch.empty(C, dtype=config.acc_dtype(x.dtype), device=x.device)
    var = torch.empty_like(mean)
    launch(_stats_kernel, cfg.grid, x, mean, var, N, C, HW, BLOCK=cfg.block_size,
                            ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps)  # fmt: skip
    return mean, var


def batch_norm_apply(x, weight, bias, mean, rstd):
    """y = (x - mean_c) * rstd_c * weight_c + bias_c, in x.dtype."""
    N, C, HW = x.shape
    cfg = config.batch_norm(N * C, HW, x.dtype)
    y = torch.empty_like(x)
    launch(_apply_kernel, cfg.grid,
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd, C, HW,
        BLOCK=cfg.block_size, HAS_W=weight is not None, HAS_B=bias is not None,
        ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps,
    )  # fmt: skip
    return y


def batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype):
    """-> (dx, dweight, dbias); training: the statistics were this batch's."""
    N, C, HW = x.shape
    acc = config.acc_dtype(x.dtype)
    sum_dy = torch.empty(C, dtype=acc, device=x.device)
    sum_dy_xhat = torch.empty_like(sum_dy)
    cfg = config.batch_norm(C, HW, x.dtype)
    launch(_grad_sums_kernel, cfg.grid, x, dy, mean, rstd, sum_dy, sum_dy_xhat, N, C, HW,
           BLOCK=cfg.block_size,
                                ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps)  # fmt: skip
    dx = torch.empty_like(x)
    cfg = config.batch_norm(N * C, HW, x.dtype)
    launch(_dx_kernel, cfg.grid,
        x, dy, dx, weight if weight is not None else x, mean, rstd, sum_dy, sum_dy_xhat, C, HW,
        N * HW, BLOCK=cfg.block_size, HAS_W=weight is not None, TRAINING=training,
        ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps,
    )  # fmt: skip
    dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
    dbias = sum_dy.to(bias_dtype) if bias_dtype is not None else None
    return dx, dweight, dbias
