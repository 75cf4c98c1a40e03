"""LayerNorm and RMSNorm for Ascend NPUs (triton-ascend): kernels, then launchers.

Written to the rules in docs/backends.md: fixed column tile BLOCK_SIZE = 1024 looping over N, a
persistent grid of vector-core count programs looping over rows, fp32 math, only the Triton subset
both upstream Triton and triton-ascend accept (power-of-two aranges, no pointer selects, no atomics),
int64 row offsets. RMSNorm shares the kernels through the ``IS_RMS`` constexpr.

Rows of at most ``config.ROW_NORM_WIDTH`` (2048; 1024 with dropout) elements
(``config.resident_rows``) are held whole in UB, several to a tile when short: each row is read from
HBM once in the forward and once in the backward, whose one kernel writes dx and one fp32 dweight /
dbias partial row per program. Longer rows loop over column tiles and are read twice: the forward's
statistics, then output; the backward's row sweep computes the two dx reduction terms per row, then
programs take (row chunk, column tile) work items, write dx and one partial row per chunk.
``reduce.param_sums`` adds the partial rows in order, dweight and dbias in one launch
(deterministic, no atomics).

The fused residual path (add-norm) runs the same kernels with ``ADD`` on, as on CUDA: h =
dropout(x) + residual is formed, stored and normalized; the backward adds h's incoming gradient,
stores the residual's gradient and regenerates the dropout mask from the seed.

(*) The dropout draw of element (row, col) is the hash of (seed ^ (row << 32), col)
(``common.row_key``, ``common.hash_uniform``, docs/numerics.md): 32-bit integer operations only,
which Ascend's compiler vectorizes (``tl.rand``'s Philox became scalar loops there); the row in the
key keeps draws distinct for every (row, col) however many elements there are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import (
    normalize,
    residual_grad,
    residual_in,
    row_key,
    row_norm_bwd_terms,
    row_norm_bwd_tile,
    row_norm_fwd_tiles,
)
from normkit.backends.npu import config
from normkit.backends.npu.reduce import param_sums
from normkit.backends.row_norm_contract import row_norm_contract


@triton.jit
def _fwd_rows_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    R,  # (M, N) residual rows (read when ADD and HAS_R)
    H,  # (M, N) out: h = dropout(x) + residual, residual dtype (written when ADD)
    Y,  # (M, N) output rows; row stride stride_y
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Mean,  # (M,) out, fp32 (unwritten when IS_RMS)
    Rstd,  # (M,) out, fp32: 1 / sqrt(var + eps)
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    M,
    N,  # at most config.ROW_NORM_WIDTH (with dropout ROW_NORM_DROPOUT_WIDTH): whole rows in a tile
    inv_n,
    eps,
    seed,  # dropout, as in _fwd_kernel (*)
    p,
    scale,
    ROWS: tl.constexpr,  # rows a tile
    WIDTH: tl.constexpr,  # columns a tile (N rounded up to a power of two); ROWS * WIDTH >= BLOCK_SIZE
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ADD: tl.constexpr,
    HAS_R: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    # Each row is read once: statistics and output from the tile held in UB (planned by
    # bishengir-compile, ci/npu_stage2.py, 2026-11-26, with dropout: 106.2 KB for 64 rows of 16 a tile,
    # 118.7 KB for one row of 1024). Statistics of
    # x - x[row, 0] (exact differences, accurate for large means), then the mean-centred sum of squares.
    cols = tl.arange(0, WIDTH)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_B:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        rows64 = tl.cast(rows, tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ADD:
            key = tl.broadcast_to(row_key(seed, rows)[:, None], (ROWS, WIDTH))  # each row's key (*)
            offs = tl.broadcast_to(cols[None, :], (ROWS, WIDTH))
            h = residual_in(x, R + rows64[:, None] * stride_r + cols[None, :], mask, key, offs, p, scale,
                            HAS_R, DROPOUT).to(H.dtype.element_ty)  # fmt: skip
            tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        if IS_RMS:
            xc = x
            mean = tl.zeros([ROWS], tl.float32)
        else:
            shift = tl.sum(tl.where(cols[None, :] == 0, x, 0.0), axis=1)
            xs = tl.where(mask, x - shift[:, None], 0.0)
            mean = tl.sum(xs, axis=1) * inv_n
            xc = tl.where(mask, xs - mean[:, None], 0.0)
            tl.store(Mean + rows, shift + mean, mask=rmask)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) * inv_n + eps)
        tl.store(Rstd + rows, rstd, mask=rmask)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    R,  # (M, N) residual rows (read when ADD and HAS_R)
    H,  # (M, N) out: h = dropout(x) + residual, residual dtype (written when ADD)
    Y,  # (M, N) output rows; row stride stride_y
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Mean,  # (M,) out, fp32 (unwritten when IS_RMS)
    Rstd,  # (M,) out, fp32: 1 / sqrt(var + eps)
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    M,
    N,
    inv_n,  # 1 / N from the host: exact where N is a power of two (N = 1 must give dx = 0)
    eps,
    seed,  # dropout: keep (row, col) where rand(seed ^ (row << 32), col) >= p, times scale (*)
    p,
    scale,
    BLOCK_SIZE: tl.constexpr,  # column tile (1024)
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ADD: tl.constexpr,  # fused residual add (+ dropout): normalize h instead of x
    HAS_R: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 96.8 KB without dropout
    # (add-norm, weight and bias), 172.9 KB with dropout (the hash drawn in both sweeps).
    for row in range(tl.program_id(0), M, tl.num_programs(0)):  # common.row_norm_fwd_tiles: CUDA's too
        row_norm_fwd_tiles(X, R, H, Y, W, B, Mean, Rstd, row, stride_x, stride_r, stride_h, stride_y, N,
                           inv_n, eps, seed, p, scale, BLOCK_SIZE, IS_RMS, HAS_W, HAS_B, ADD, HAS_R, DROPOUT,
                           tl.float32)  # fmt: skip


@triton.jit
def _bwd_rows_kernel(
    X,  # (M, N) forward input rows (h for the add-norm); row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH)
    DX,  # (M, N) out: gradient of the forward's x, in x's dtype
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES)
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,)
    DW_part,  # (programs, N) out, fp32: row p = program p's sum of dy * xhat (written when HAS_W)
    DB_part,  # (programs, N) out, fp32: row p = program p's sum of dy (written when HAS_DB)
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,  # at most config.ROW_NORM_WIDTH (with dropout ROW_NORM_DROPOUT_WIDTH; config.resident_rows)
    inv_n,
    seed,  # dropout, as in the forward
    p,
    scale,
    ROWS: tl.constexpr,
    WIDTH: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    # One launch for dx and the partial parameter sums, each row of x and dy read once: the row terms
    # c1, c2 come from the tile held in UB (planned, with dropout: 116.3 KB for 64 rows of 16, 114.5 KB
    # for one row of 1024; ci/npu_stage2.py).
    # The partials are summed by one reduce launch.
    cols = tl.arange(0, WIDTH)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([WIDTH], tl.float32)
    db = tl.zeros([WIDTH], tl.float32)
    for tile in range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rmask = rows < M
        rows64 = tl.cast(rows, tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        if IS_RMS:
            mean = tl.zeros([ROWS], tl.float32)
        else:
            mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        xhat = normalize(x, mean[:, None], rstd[:, None], mask, IS_RMS)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) * inv_n
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) * inv_n
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        key = tl.broadcast_to(row_key(seed, rows)[:, None], (ROWS, WIDTH))  # each row's key (*)
        offs = tl.broadcast_to(cols[None, :], (ROWS, WIDTH))
        dx = residual_grad(dx, DH + rows64[:, None] * stride_dh + cols[None, :],
                           DRES + rows64[:, None] * stride_dres + cols[None, :], mask, key, offs, p, scale,
                           HAS_DH, HAS_DRES, DROPOUT)  # fmt: skip
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_DB:
            db += tl.sum(dy, axis=0)
    part = tl.cast(tl.program_id(0), tl.int64) * N + cols
    if HAS_W:
        tl.store(DW_part + part, dw, mask=cmask)
    if HAS_DB:
        tl.store(DB_part + part, db, mask=cmask)


@triton.jit
def _bwd_row_terms_kernel(
    X,  # (M, N) forward input rows; row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,)
    C1,  # (M,) out, fp32: mean over the row of xhat * w * dy
    C2,  # (M,) out, fp32: mean over the row of w * dy (unwritten when IS_RMS)
    stride_x,
    stride_dy,
    M,
    N,
    inv_n,  # 1 / N from the host
    BLOCK_SIZE: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 44.3 KB.
    for row in range(tl.program_id(0), M, tl.num_programs(0)):
        row_norm_bwd_terms(X, DY, W, Mean, Rstd, C1, C2, row, stride_x, stride_dy, N, inv_n, BLOCK_SIZE,
                           IS_RMS, HAS_W, tl.float32)  # fmt: skip


@triton.jit
def _bwd_dx_kernel(
    X,  # (M, N) forward input rows (h for the add-norm); row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH)
    DX,  # (M, N) out: gradient of the forward's x, in x's dtype
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES)
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,)
    C1,  # (M,) from _bwd_row_terms_kernel
    C2,  # (M,) from _bwd_row_terms_kernel (unread when IS_RMS)
    DW_part,  # (chunks, N) out, fp32: row c = chunk c's sum of dy * xhat (written when HAS_W)
    DB_part,  # (chunks, N) out, fp32: row c = chunk c's sum of dy (written when HAS_DB)
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,
    rows_per_chunk,
    num_items,  # chunks x column tiles; item i = (chunk i // tiles, column tile i % tiles)
    seed,  # dropout, as in the forward
    p,
    scale,
    BLOCK_SIZE: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    DROPOUT: tl.constexpr,
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 120.1 KB (with dropout).
    tiles = tl.cdiv(N, BLOCK_SIZE)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        cols = (item % tiles) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        row_norm_bwd_tile(X, DY, DH, DX, DRES, W, Mean, Rstd, C1, C2, DW_part, DB_part, item // tiles, cols,
                          stride_x, stride_dy, stride_dh, stride_dx, stride_dres, M, N, rows_per_chunk, seed,
                          p, scale, BLOCK_SIZE, IS_RMS, HAS_W, HAS_DB, HAS_DH, HAS_DRES, DROPOUT,
                          tl.float32)  # fmt: skip


def _held_width(dropout_p):
    """The widest row held in UB (config: the hash per element needs more UB)."""
    return config.ROW_NORM_DROPOUT_WIDTH if dropout_p > 0 else config.ROW_NORM_WIDTH


def _dropout_args(dropout_p, seed):
    """(seed, p, scale) kernel arguments; dropout is compiled out when p == 0."""
    return (seed, dropout_p, 1.0 / (1.0 - dropout_p)) if dropout_p > 0 else (0, 0.0, 1.0)


def _forward(x, weight, bias, eps, is_rms, add=False, residual=None, h_dtype=None, dropout_p=0.0,
             seed=0):  # fmt: skip
    """-> (y, h or None, mean, rstd); h = dropout(x) + residual is formed and normalized if add."""
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty((M, N), dtype=h_dtype, device=x.device) if add else None
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    mean = rstd if is_rms else torch.empty_like(rstd)
    r = residual if residual is not None else x
    hh = h if add else y
    args = (x, r, hh, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
            x.stride(0), r.stride(0), hh.stride(0), y.stride(0), M, N, 1.0 / N, eps,
            *_dropout_args(dropout_p, seed))  # fmt: skip
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ADD=add,
                 HAS_R=residual is not None, DROPOUT=add and dropout_p > 0)  # fmt: skip
    packed = config.resident_rows(M, N, _held_width(dropout_p), x.device)
    if packed is not None:
        _fwd_rows_kernel[packed.grid](*args, ROWS=packed.rows, WIDTH=packed.width, **flags)
    else:
        cfg = config.rows(M, x.device)
        _fwd_kernel[cfg.grid](*args, BLOCK_SIZE=cfg.block_size, **flags)
    return y, h, mean, rstd


def _backward(dy, x, weight, mean, rstd, bias_dtype, is_rms, dh=None, x_dtype=None,
              residual_dtype=None, dropout_p=0.0, seed=0):  # fmt: skip
    """-> (dx, dresidual or None, dweight or None, dbias or None); see the CUDA twin. Rows held in UB
    (_held_width): one launch for dx and the parameters' partial sums, one to add
    them up; longer rows: the row terms, then dx and the partial sums by (row chunk, column tile),
    then the sums (each row read twice: it does not fit in UB)."""
    M, N = x.shape
    has_w, has_db = weight is not None, bias_dtype is not None
    w = weight if has_w else x
    dx = torch.empty((M, N), dtype=x_dtype or x.dtype, device=x.device)
    dres = torch.empty((M, N), dtype=residual_dtype, device=x.device) if residual_dtype else None
    dh_ = dh if dh is not None else dy
    dres_ = dres if dres is not None else dx
    flags = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DB=has_db, HAS_DH=dh is not None, HAS_DRES=dres is not None,
                 DROPOUT=dropout_p > 0)  # fmt: skip
    packed = config.resident_rows(M, N, _held_width(dropout_p), x.device)
    if packed is not None:
        parts = packed.grid[0]
    else:
        c1 = torch.empty(M, dtype=torch.float32, device=x.device)
        c2 = c1 if is_rms else torch.empty_like(c1)
        sweep = config.rows(M, x.device)
        _bwd_row_terms_kernel[sweep.grid](
            x, dy, w, mean, rstd, c1, c2, x.stride(0), dy.stride(0), M, N, 1.0 / N,
            BLOCK_SIZE=sweep.block_size, IS_RMS=is_rms, HAS_W=has_w,
        )  # fmt: skip
        cfg, parts = config.row_chunks(M, N, x.device)
    dw_part = torch.empty((parts, N), dtype=torch.float32, device=x.device) if has_w else None
    db_part = torch.empty((parts, N), dtype=torch.float32, device=x.device) if has_db else None
    dw_, db_ = (t if t is not None else rstd for t in (dw_part, db_part))
    strides = (x.stride(0), dy.stride(0), dh_.stride(0), dx.stride(0), dres_.stride(0), M, N)
    if packed is not None:
        _bwd_rows_kernel[packed.grid](
            x, dy, dh_, dx, dres_, w, mean, rstd, dw_, db_, *strides, 1.0 / N,
            *_dropout_args(dropout_p, seed), ROWS=packed.rows, WIDTH=packed.width, **flags,
        )  # fmt: skip
    else:
        _bwd_dx_kernel[cfg.grid](
            x, dy, dh_, dx, dres_, w, mean, rstd, c1, c2, dw_, db_, *strides, cfg.rows_per_chunk,
            parts * triton.cdiv(N, cfg.block_size), *_dropout_args(dropout_p, seed),
            BLOCK_SIZE=cfg.block_size, **flags,
        )  # fmt: skip
    dweight, dbias = param_sums(dw_part, weight.dtype if has_w else None, db_part, bias_dtype)
    return dx, dres, dweight, dbias


_contract = row_norm_contract(_forward, _backward)
layer_norm_fwd = _contract.layer_norm_fwd
layer_norm_bwd = _contract.layer_norm_bwd
rms_norm_fwd = _contract.rms_norm_fwd
rms_norm_bwd = _contract.rms_norm_bwd
add_layer_norm_fwd = _contract.add_layer_norm_fwd
add_layer_norm_bwd = _contract.add_layer_norm_bwd
add_rms_norm_fwd = _contract.add_rms_norm_fwd
add_rms_norm_bwd = _contract.add_rms_norm_bwd
