"""Softmax and log-softmax along the last dim on NVIDIA GPUs: kernels, then launchers.

Fused: whole rows in registers, ROWS rows per program (max, exp, sum in one read of x). Looped:
rows longer than the register budget take one program each and sweep column tiles twice: an
online max/sum (rescaling the running sum when the max grows), then the output. Rows of all -inf
give NaN, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import online_max_sum
from normkit.backends.cuda import config


@triton.jit
def _fwd_fused_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    M,
    N,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N
    LOG: tl.constexpr,  # log_softmax
    ACC: tl.constexpr,  # math dtype
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf")).to(ACC)
    xm = x - tl.max(x, axis=1)[:, None]
    e = tl.exp(xm)
    s = tl.sum(e, axis=1)[:, None]
    if LOG:
        y = xm - tl.log(s)
    else:
        y = e / s
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_looped_kernel(
    X,  # (M, N) input rows; row stride stride_x
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    N,
    BLOCK_N: tl.constexpr,  # column tile; one program per row
    LOG: tl.constexpr,
    ACC: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = X + tl.cast(row, tl.int64) * stride_x
    y_row = Y + tl.cast(row, tl.int64) * stride_y
    cols = tl.arange(0, BLOCK_N)
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < N, other=float("-inf")).to(ACC)
        m, s = online_max_sum(m, s, x)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(ACC)
        if LOG:
            y = (x - m) - tl.log(s)
        else:
            y = tl.exp(x - m) / s
        tl.store(y_row + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_fused_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    M,
    N,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    ACC: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
    y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(ACC)
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_looped_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    N,
    BLOCK_N: tl.constexpr,  # column tile; one program per row
    LOG: tl.constexpr,
    ACC: tl.constexpr,
):
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK_N)
    c = tl.zeros((), ACC)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(ACC)
        if LOG:
            c += tl.sum(dy, axis=0)
        else:
            c += tl.sum(dy * tl.load(Y + row * stride_y + offs, mask=mask, other=0.0).to(ACC), axis=0)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(ACC)
        y = tl.load(Y + row * stride_y + offs, mask=mask, other=0.0).to(ACC)
        if LOG:
            dx = dy - tl.exp(y) * c
        else:
            dx = y * (dy - c)
        tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)


def softmax_fwd(x, log):
    """x: (M, N) rows -> softmax (log_softmax when ``log``) of each row, in x.dtype."""
    M, N = x.shape
    cfg = config.softmax(M, N, x.dtype, x.device)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    flags = dict(LOG=log, ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps)
    if cfg.fused:
        _fwd_fused_kernel[cfg.grid](x, y, x.stride(0), y.stride(0), M, N,
                                    ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, **flags)  # fmt: skip
    else:
        _fwd_looped_kernel[cfg.grid](x, y, x.stride(0), y.stride(0), N, BLOCK_N=cfg.block_size, **flags)
    return y


def softmax_bwd(dy, y, log):
    """dy, y: (M, N) -> dx, in y.dtype."""
    M, N = y.shape
    cfg = config.softmax(M, N, y.dtype, y.device)
    dx = torch.empty((M, N), dtype=y.dtype, device=y.device)
    strides = (dy.stride(0), y.stride(0), dx.stride(0))
    flags = dict(LOG=log, ACC=config.tl_acc_dtype(y.dtype), num_warps=cfg.num_warps)
    if cfg.fused:
        _bwd_fused_kernel[cfg.grid](dy, y, dx, *strides, M, N,
                                    ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, **flags)  # fmt: skip
    else:
        _bwd_looped_kernel[cfg.grid](dy, y, dx, *strides, N, BLOCK_N=cfg.block_size, **flags)
    return dx
