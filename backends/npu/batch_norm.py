"""BatchNorm for Ascend NPUs (triton-ascend), training and eval: kernels, then launchers.

The CUDA twin's decomposition (per-channel statistics and gradient sums, per-(n, c)-row apply and
dx) on Ascend's terms: persistent grids of vector-core count programs looping over channels or
rows, 1024-element tiles, fp32 math. Bodies: backends/common.py.
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
)
from normkit.backends.npu import config
from normkit.reference import train_fwd_from, update_running_stats


@triton.jit
def _stats_kernel(
    X,  # (N, C, HW) contiguous input
    Mean,  # (C,) out, fp32
    Var,  # (C,) out, fp32: biased variance
    N,
    C,
    HW,
    BLOCK_SIZE: tl.constexpr,  # 1024
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 32.5 KB.
    for c in range(tl.program_id(0), C, tl.num_programs(0)):
        batch_norm_channel_stats(X, Mean, Var, c, N, C, HW, BLOCK_SIZE, tl.float32)


@triton.jit
def _apply_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (C,)
    Rstd,  # (C,)
    R,  # rows: N * C
    C,
    HW,
    BLOCK_SIZE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 12.0 KB.
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        batch_norm_row_apply(X, Y, W, B, Mean, Rstd, row, C, HW, BLOCK_SIZE, HAS_W, HAS_B, tl.float32)


@triton.jit
def _grad_sums_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy,  # (C,) out, fp32
    Sum_dy_xhat,  # (C,) out, fp32
    N,
    C,
    HW,
    BLOCK_SIZE: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 36.2 KB.
    for c in range(tl.program_id(0), C, tl.num_programs(0)):
        batch_norm_channel_grad_sums(X, DY, Mean, Rstd, Sum_dy, Sum_dy_xhat, c, N, C, HW, BLOCK_SIZE,
                                     tl.float32)  # fmt: skip


@triton.jit
def _dx_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy,  # (C,)
    Sum_dy_xhat,  # (C,)
    R,  # rows: N * C
    C,
    HW,
    inv_count,  # 1 / (N * HW)
    BLOCK_SIZE: tl.constexpr,
    HAS_W: tl.constexpr,
    TRAINING: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 20.0 KB.
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        batch_norm_row_dx(X, DY, DX, W, Mean, Rstd, Sum_dy, Sum_dy_xhat, row, C, HW, inv_count,
                          BLOCK_SIZE, HAS_W, TRAINING, tl.float32)  # fmt: skip


def batch_norm_stats(x, eps, momentum=0.0, running_mean=None, running_var=None):
    """x: (N, C, HW) contiguous -> (mean, rstd), each (C,) fp32; running statistics, when given,
    updated in place (``reference.update_running_stats``, torch ops)."""
    N, C, HW = x.shape
    cfg = config.rows(C, x.device)
    mean = torch.empty(C, dtype=torch.float32, device=x.device)
    var = torch.empty_like(mean)
    _stats_kernel[cfg.grid](x, mean, var, N, C, HW, BLOCK_SIZE=cfg.block_size)
    update_running_stats(mean, var, N * HW, momentum, running_mean, running_var)
    return mean, torch.rsqrt(var + eps)


def batch_norm_apply(x, weight, bias, mean, rstd):
    """y = (x - mean_c) * rstd_c * weight_c + bias_c, in x.dtype."""
    N, C, HW = x.shape
    cfg = config.rows(N * C, x.device)
    y = torch.empty_like(x)
    _apply_kernel[cfg.grid](
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
        N * C, C, HW, BLOCK_SIZE=cfg.block_size, HAS_W=weight is not None, HAS_B=bias is not None,
    )  # fmt: skip
    return y


batch_norm_train_fwd = train_fwd_from(batch_norm_stats, batch_norm_apply)


def batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype):
    """-> (dx, dweight, dbias); training: the statistics were this batch's."""
    N, C, HW = x.shape
    sum_dy = torch.empty(C, dtype=torch.float32, device=x.device)
    sum_dy_xhat = torch.empty_like(sum_dy)
    cfg = config.rows(C, x.device)
    _grad_sums_kernel[cfg.grid](x, dy, mean, rstd, sum_dy, sum_dy_xhat, N, C, HW,
                                BLOCK_SIZE=cfg.block_size)  # fmt: skip
    dx = torch.empty_like(x)
    cfg = config.rows(N * C, x.device)
    _dx_kernel[cfg.grid](
        x, dy, dx, weight if weight is not None else x, mean, rstd, sum_dy, sum_dy_xhat, N * C, C, HW,
        1.0 / (N * HW), BLOCK_SIZE=cfg.block_size, HAS_W=weight is not None, TRAINING=training,
    )  # fmt: skip
    dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
    dbias = sum_dy.to(bias_dtype) if bias_dtype is not None else None
    return dx, dweight, dbias
