"""Softmax and log-softmax along the last dim for Ascend NPUs (triton-ascend).

Persistent grid of vector-core count programs. Rows of at most ``config.SOFTMAX_WIDTH`` (4096)
elements (``config.resident_rows``) are held whole in UB, several to a tile when short: each row is
read from HBM once in the forward (max, sum and output from the tile) and once in the backward. Longer
rows are swept in 1024-wide tiles: an online max/sum pass, then the output pass (backward: a
dot-product pass, then dx). fp32 math. Rows of all -inf give NaN, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import softmax_fwd_tiles
from normkit.backends.npu import config


@triton.jit
def _fwd_rows_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    M,
    N,  # at most config.SOFTMAX_WIDTH: whole rows in one tile (config.resident_rows)
    ROWS: tl.constexpr,  # rows a tile
    WIDTH: tl.constexpr,  # columns a tile (N rounded up to a power of two); ROWS * WIDTH >= 1024
    LOG: tl.constexpr,  # log_softmax
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py): see the stage 2 table in docs/backends.md.
    cols = tl.arange(0, WIDTH)
    cmask = cols < N
    for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rows64 = tl.cast(rows, tl.int64)
        mask = (rows < M)[:, None] & cmask[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        xs = x - tl.max(x, axis=1)[:, None]  # a row of all -inf: NaN, as in torch
        e = tl.exp(xs)
        s = tl.sum(e, axis=1)
        if LOG:
            y = xs - tl.log(s)[:, None]
        else:
            y = e / s[:, None]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    M,
    N,  # at most config.SOFTMAX_WIDTH (config.resident_rows)
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    LOG: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py): see the stage 2 table in docs/backends.md.
    cols = tl.arange(0, WIDTH)
    cmask = cols < N
    for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rows64 = tl.cast(rows, tl.int64)
        mask = (rows < M)[:, None] & cmask[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
        else:
            dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    M,
    N,
    BLOCK_SIZE: tl.constexpr,  # column tile (1024)
    LOG: tl.constexpr,  # log_softmax
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 22.7 KB.
    for row in range(tl.program_id(0), M, tl.num_programs(0)):  # common.softmax_fwd_tiles: CUDA's too
        softmax_fwd_tiles(X, Y, row, stride_x, stride_y, N, BLOCK_SIZE, LOG, tl.float32)


@triton.jit
def _bwd_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    M,
    N,
    BLOCK_SIZE: tl.constexpr,
    LOG: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 38.0 KB.
    cols = tl.arange(0, BLOCK_SIZE)
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        c = 0.0
        for start in range(0, N, BLOCK_SIZE):
            offs = start + cols
            mask = offs < N
            dy = tl.load(DY + row64 * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                c += tl.sum(dy, axis=0)
            else:
                y = tl.load(Y + row64 * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
                c += tl.sum(dy * y, axis=0)
        for start in range(0, N, BLOCK_SIZE):
            offs = start + cols
            mask = offs < N
            dy = tl.load(DY + row64 * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + row64 * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                dx = dy - tl.exp(y) * c
            else:
                dx = y * (dy - c)
            tl.store(DX + row64 * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)


def softmax_fwd(x, log):
    """x: (M, N) rows -> softmax (log_softmax when ``log``) of each row, in x.dtype."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    args = (x, y, x.stride(0), y.stride(0), M, N)
    held = config.resident_rows(M, N, config.SOFTMAX_WIDTH, x.device)
    if held is not None:
        _fwd_rows_kernel[held.grid](*args, ROWS=held.rows, WIDTH=held.width, LOG=log)
    else:
        cfg = config.rows(M, x.device)
        _fwd_kernel[cfg.grid](*args, BLOCK_SIZE=cfg.block_size, LOG=log)
    return y


def softmax_bwd(dy, y, log):
    """dy, y: (M, N) -> dx, in y.dtype."""
    M, N = y.shape
    dx = torch.empty((M, N), dtype=y.dtype, device=y.device)
    args = (dy, y, dx, dy.stride(0), y.stride(0), dx.stride(0), M, N)
    held = config.resident_rows(M, N, config.SOFTMAX_WIDTH, y.device)
    if held is not None:
        _bwd_rows_kernel[held.grid](*args, ROWS=held.rows, WIDTH=held.width, LOG=log)
    else:
        cfg = config.rows(M, y.device)
        _bwd_kernel[cfg.grid](*args, BLOCK_SIZE=cfg.block_size, LOG=log)
    return dx
