"""LayerNorm and RMSNorm on NVIDIA GPUs: kernels, then launchers.

RMSNorm is LayerNorm without centring (no mean, no bias), so both share these kernels through the
``IS_RMS`` constexpr; Triton compiles each variant separately, so neither pays for the other.

The kernels, chosen by ``config.forward`` / ``config.backward`` from the row length (and dtype,
alignment):
- fused: whole rows in registers, ``ROWS`` rows per program; x is read once. The backward runs a
  persistent grid whose programs keep their dweight/dbias partial sums in registers.
- shared memory (16-bit, aligned rows; Gluon, smem.py): one program per SM streams its rows
  through shared-memory buffers: the forward for rows up to ~114 K elements, the backward (x and dy
  together, its dweight/dbias partials in registers) up to 24576. Longer rows are shared by K
  programs ("rows in parts"), each streaming its part of the rows and holding its part of the
  weight (and bias) in shared memory, exchanging tagged row terms (smem.publish / collect): the
  forward (the add-norms' too) from 65536-131072 columns (LayerNorm's part moments in one read,
  each thread's own merged with Chan's formula), the backward from 32768 (the add-LayerNorm
  backward that writes the residual's gradient from 8193, in one part up to 16384).
- split rows (coop.py): K programs share a row and exchange partial statistics; a row group that
  does not fill at once (SMs held by others) runs solo instead of waiting (coop.join).
- looped: rows longer than the register budget loop over column tiles. Forward: one program per
  row, a statistics sweep (Chan's merge of per-tile mean/M2) then a normalize sweep. Backward: a
  per-row sweep for the two dx reduction terms, then a (row chunk x column tile) grid computing dx
  and the dweight/dbias partials.
Partials are summed in a fixed order by ``reduce.sum_partials`` (dweight and dbias in one launch):
deterministic, no atomics.

The fused residual path (``add_layer_norm`` / ``add_rms_norm``) runs the same kernels with ``ADD``
on: the forward forms h = dropout(x) + residual in registers, stores h (the residual stream, in
its own dtype) and normalizes h; the backward reads h, adds h's own incoming gradient, stores the
residual's gradient and passes x's gradient through the dropout mask, regenerated from the seed
(``common.row_key`` / ``hash_uniform``: the NPU kernels' and the reference's bits, docs/numerics.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import (
    as_col,
    exact_eps,
    normalize,
    reciprocal,
    residual_add,
    residual_grad,
    residual_in,
    row_key,
    row_norm_bwd_terms,
    row_norm_bwd_tile,
    row_norm_fwd_tiles,
)
from normkit.backends.cuda import config, coop, reduce, smem
from normkit.backends.cuda.launch import Bound, int_spec, launch, tensor_spec
from normkit.backends.cuda.coop import arrive, join, load_chunk, wait
from normkit.backends.cuda.smem import cp, gl
from normkit.backends.row_norm_contract import row_norm_contract


VAR_RATIO = tl.constexpr(8.0)  # one-read variance kept where E[(x - shift)^2] <= VAR_RATIO * var


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _fwd_fused_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    R,  # (M, N) residual rows; row stride stride_r (read when ADD and HAS_R)
    H,  # (M, N) out: h = dropout(x) + residual, residual dtype (written when ADD)
    Y,  # (M, N) output rows; row stride stride_y
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Mean,  # (M,) out: row means in ACC (unwritten when IS_RMS)
    Rstd,  # (M,) out: 1 / sqrt(var + eps) in ACC
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    M,
    N,
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    seed,  # dropout: keep (row, col) where the hash of (seed ^ (row << 32), col) >= p, times scale
    p,
    scale,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N: a whole row per tile
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ADD: tl.constexpr,  # fused residual add (+ dropout): normalize h instead of x
    HAS_R: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,  # math dtype: fp32, fp64 for fp64 inputs
    STATS: tl.constexpr = True,  # write Mean / Rstd (False: an inference plan, nothing saved)
    ONE_READ: tl.constexpr = False,  # LayerNorm's moments in one reduction (config.one_read_moments)
):
    # ROWS == 1: the row is a 1-D tile, its statistics scalars and no row mask (grid = M). The
    # [1, BLOCK_N] form, or a row mask, spills under ptxas at 32768 fp32 (12-24 bytes;
    # docs/tuning-log.md T27).
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if ROWS == 1:
        rows = tl.program_id(0)
        row_mask = True
        mask = col_mask
    else:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask
    rows64 = rows.to(tl.int64)
    # evict_last on x, the weight and the bias (each read once a program): +0.003-0.01 of copy at
    # N = 1024-16384, fp32 LayerNorm 32768 0.939 against 0.924 (H100, docs/tuning-log.md T28); not with
    # ONE_READ, where it read 0.924-0.929 against 0.938-0.946 (16-bit LayerNorm 32768). Why a hint
    # on a streamed read helps is not established.
    evict: tl.constexpr = "" if ONE_READ else "evict_last"
    x = tl.load(X + as_col(rows64 * stride_x, ROWS) + cols, mask=mask, other=0.0,
                eviction_policy=evict).to(ACC)  # fmt: skip
    if ADD:
        key = as_col(row_key(seed, rows), ROWS)  # dropout: each row's hash key
        h = residual_in(x, R + as_col(rows64 * stride_r, ROWS) + cols, mask, key, cols, p, scale,
                        HAS_R, DROPOUT)  # fmt: skip
        h = h.to(H.dtype.element_ty)
        tl.store(H + as_col(rows64 * stride_h, ROWS) + cols, h, mask=mask)
        x = h.to(ACC)  # normalize h as stored, so the backward (which reads h) sees the same row
    if not IS_RMS:
        # Statistics of x - shift with shift = x[row, 0] (+ residual[row, 0]): exact differences,
        # so the mean (and y) stay accurate for rows whose mean dwarfs their spread
        # (x = 1e4 + randn). Any value near the row's values serves; dropout is ignored here.
        shift = tl.load(X + rows64 * stride_x, mask=row_mask, other=0.0).to(ACC)
        if ADD and HAS_R:
            shift += tl.load(R + rows64 * stride_r, mask=row_mask, other=0.0).to(ACC)
        xs = tl.where(mask, x - as_col(shift, ROWS), 0.0)
        if ONE_READ:
            # One cross-warp reduction for both moments of x - shift (a whole row a program: its
            # barriers are what it waits on, docs/tuning-log.md T29), var = E[xs^2] - E[xs]^2. That
            # difference loses ~ E[xs^2] / var ulps, so where E[xs^2] > VAR_RATIO * var (the shift
            # an outlier: |x[row, 0] - mean| > 2.6 std) the variance is taken again about the mean.
            # Scalars (the one row's): the test is a branch, not another reduction.
            tl.static_assert(ROWS == 1)
            s1, s2 = tl.reduce((xs, xs * xs), 0, _add_pair)
            mean = s1 * reciprocal(N, ACC)
            ms2 = s2 * reciprocal(N, ACC)
            var = ms2 - mean * mean
            if ms2 > VAR_RATIO * var:
                xc = tl.where(mask, x - shift - mean, 0.0)
                var = tl.sum(xc * xc) * reciprocal(N, ACC)
        else:
            mean = tl.sum(xs, axis=-1) * reciprocal(N, ACC)
            xc = tl.where(mask, xs - as_col(mean, ROWS), 0.0)
            # Two-pass variance over registers: no E[x^2] - E[x]^2 cancellation for large means.
            var = tl.sum(xc * xc, axis=-1) * reciprocal(N, ACC)
        if STATS:
            tl.store(Mean + rows, shift + mean, mask=row_mask)
    if IS_RMS:
        var = tl.sum(x * x, axis=-1) * reciprocal(N, ACC)
    rstd = 1.0 / tl.sqrt(var + exact_eps(eps, eps_lo, ACC))
    if STATS:
        tl.store(Rstd + rows, rstd, mask=row_mask)
    if IS_RMS:
        y = x * as_col(rstd, ROWS)
    else:
        # From x again, not from xc (the same values): ptxas keeps x and fits 64 registers a
        # thread where holding xc spilled 12 bytes (32768 fp32, 32 warps; docs/tuning-log.md T27).
        y = (x - as_col(shift, ROWS) - as_col(mean, ROWS)) * as_col(rstd, ROWS)
    if HAS_W:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy=evict).to(ACC)
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy=evict).to(ACC)
    tl.store(Y + as_col(rows64 * stride_y, ROWS) + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_looped_kernel(
    X,  # (M, N) input rows; row stride stride_x
    R,  # (M, N) residual rows (read when ADD and HAS_R)
    H,  # (M, N) out: h (written when ADD)
    Y,  # (M, N) output rows; row stride stride_y
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Mean,  # (M,) out (unwritten when IS_RMS)
    Rstd,  # (M,) out
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    N,
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    seed,
    p,
    scale,
    BLOCK_N: tl.constexpr,  # column tile; one program per row loops over cdiv(N, BLOCK_N) tiles
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ADD: tl.constexpr,
    HAS_R: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
):
    # one program a row (common.row_norm_fwd_tiles: the NPU forward's row body too)
    row_norm_fwd_tiles(X, R, H, Y, W, B, Mean, Rstd, tl.program_id(0), stride_x, stride_r, stride_h, stride_y,
                       N, reciprocal(N, ACC), exact_eps(eps, eps_lo, ACC), seed, p, scale, BLOCK_N, IS_RMS,
                       HAS_W, HAS_B, ADD, HAS_R, DROPOUT, ACC)  # fmt: skip


@triton.jit
def _row_shift(X, R, r64, stride_x, stride_r, ADD: tl.constexpr, HAS_R: tl.constexpr, ACC: tl.constexpr):
    """The shift of the split statistics, the same in every chunk of the row: x[row, 0] (plus
    residual[row, 0] for the add-norm). Any shift gives the same mean and variance; one near the
    data keeps the chunk sums small."""
    shift = tl.load(X + r64 * stride_x).to(ACC)
    if ADD and HAS_R:
        shift += tl.load(R + r64 * stride_r).to(ACC)
    return shift


@triton.jit
def _fwd_split_load(X, R, row, stride_x, stride_r, cols, mask, M, ADD: tl.constexpr, HAS_R: tl.constexpr):
    """Row ``row``'s chunk of x and of the residual (x again when there is none), in their dtypes;
    nothing is computed from them here, so that the loads stay in flight until first used."""
    x = load_chunk(X, row, stride_x, cols, mask, M, 0.0)
    if ADD and HAS_R:
        r = load_chunk(R, row, stride_r, cols, mask, M, 0.0)
    else:
        r = x
    return x, r


@triton.jit
def _fwd_split_publish(x, r, X, R, H, row, stride_x, stride_r, stride_h, Part, Count, k, cols, mask, N,
                       seed, p, scale, CHUNK: tl.constexpr, KP: tl.constexpr, IS_RMS: tl.constexpr,
                       ADD: tl.constexpr, HAS_R: tl.constexpr, DROPOUT: tl.constexpr,
                       ACC: tl.constexpr):  # fmt: skip
    """From this chunk of ``row`` (x, r: from ``_fwd_split_load``) form and store h for the
    add-norm, write the chunk's partial statistics to Part and arrive at the row's counter.
    Returns the chunk that is normalized (x, or h), in ACC."""
    r64 = tl.cast(row, tl.int64)
    x = x.to(ACC)
    if ADD:
        h = residual_add(x, r, row_key(seed, row), cols, p, scale, HAS_R, DROPOUT).to(H.dtype.element_ty)
        tl.store(H + r64 * stride_h + cols, h, mask=mask)
        x = h.to(ACC)
    part = Part + r64 * (2 * KP)
    if IS_RMS:
        tl.store(part + k, tl.sum(x * x, axis=0))
    else:
        # Chunk statistics of x - shift (shift = the row's first value, as in the looped kernel):
        # mean and M2 about the chunk's own mean, merged after the barrier with Chan's formula.
        xs = tl.where(mask, x - _row_shift(X, R, r64, stride_x, stride_r, ADD, HAS_R, ACC), 0.0)
        mean_k = tl.sum(xs, axis=0) * reciprocal(tl.minimum(N - k * CHUNK, CHUNK), ACC)
        d = tl.where(mask, xs - mean_k, 0.0)
        tl.store(part + k, mean_k)
        tl.store(part + KP + k, tl.sum(d * d, axis=0))
    arrive(Count + row)
    return x


@triton.jit
def _fwd_split_solo(X, R, H, row, stride_x, stride_r, stride_h, Part, Count, K, N, M, seed, p, scale,
                    CHUNK: tl.constexpr, KP: tl.constexpr, IS_RMS: tl.constexpr, ADD: tl.constexpr,
                    HAS_R: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``row`` before its row loop: publish every chunk of ``row``
    itself, as the K partners would (the same values, h included)."""
    for j in range(K):
        cols = j * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        x, r = _fwd_split_load(X, R, row, stride_x, stride_r, cols, mask, M, ADD, HAS_R)
        _fwd_split_publish(x, r, X, R, H, row, stride_x, stride_r, stride_h, Part, Count, j, cols, mask, N,
                           seed, p, scale, CHUNK, KP, IS_RMS, ADD, HAS_R, DROPOUT, ACC)  # fmt: skip


@triton.jit
def _fwd_split_kernel(
    X,  # (M, N) input rows; row stride stride_x
    R,  # (M, N) residual rows (read when ADD and HAS_R)
    H,  # (M, N) out: h (written when ADD)
    Y,  # (M, N) output rows; row stride stride_y
    W,  # (WG, N) weight rows (unread unless HAS_W)
    B,  # (WG, N) bias rows (unread unless HAS_B)
    Mean,  # (M,) out (unwritten when IS_RMS)
    Rstd,  # (M,) out
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    Part,  # (M, 2, KP) ACC workspace: per-chunk (mean of x - shift, M2) (RMSNorm: sum of squares)
    Count,  # (2 M,) int32, zeroed: the row barriers, then the row groups' start words (coop.join)
    M,
    N,
    K,  # chunks per row; program pid holds chunk pid % K of the rows of group pid // K
    WG,  # rows of W / B: row r uses W[r % WG] (GroupNorm: one (N,) weight row per group); 1 otherwise
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    seed,
    p,
    scale,
    CHUNK: tl.constexpr,  # columns per program
    KP: tl.constexpr,  # power of two >= K
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ADD: tl.constexpr,
    HAS_R: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PREFETCH: tl.constexpr,  # chunk held through the barrier, the next row's chunk loaded early
    SPIN: tl.constexpr,  # polls to wait for the row group to fill (coop.join)
):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    k = pid % K
    together = join(Count + M + pid // K, K, SPIN)
    # A solo program (its row group did not fill: coop.join) publishes every chunk of its rows
    # first, where little else is live, so the row loop keeps its registers.
    if together == 0:
        for row in range(pid // K, M, groups):
            _fwd_split_solo(X, R, H, row, stride_x, stride_r, stride_h, Part, Count, K, N, M, seed, p, scale,
                            CHUNK, KP, IS_RMS, ADD, HAS_R, DROPOUT, ACC)  # fmt: skip
    cols = k * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    ks = tl.arange(0, KP)
    counts = tl.cast(tl.maximum(tl.minimum(N - ks * CHUNK, CHUNK), 0), ACC)  # values per chunk
    inv_n = reciprocal(N, ACC)
    # PREFETCH: the chunk stays in registers through the barrier, and the next row's chunk is loaded
    # before this row's reductions, so its loads are in flight through them, the barrier and the
    # stores. Otherwise the chunk is read again from L2 after the barrier, which needs fewer
    # registers. Publishing the next row's partials before this row's wait, as the backward does,
    # was level or slower here (docs/tuning-log.md T33).
    if PREFETCH:
        x_next, r_next = _fwd_split_load(X, R, pid // K, stride_x, stride_r, cols, mask, M, ADD, HAS_R)
    for row in range(pid // K, M, groups):
        r64 = tl.cast(row, tl.int64)
        if PREFETCH:
            x, r = x_next, r_next
            x_next, r_next = _fwd_split_load(X, R, row + groups, stride_x, stride_r, cols, mask, M, ADD,
                                             HAS_R)  # fmt: skip
        else:
            x, r = _fwd_split_load(X, R, row, stride_x, stride_r, cols, mask, M, ADD, HAS_R)
        x = _fwd_split_publish(x, r, X, R, H, row, stride_x, stride_r, stride_h, Part, Count, k, cols,
                               mask, N, seed, p, scale, CHUNK, KP, IS_RMS, ADD, HAS_R, DROPOUT,
                               ACC)  # fmt: skip
        if together:
            wait(Count + row, K)
        part = Part + r64 * (2 * KP)
        p1 = tl.load(part + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        if IS_RMS:
            shift = 0.0
            mean = 0.0
            rstd = 1.0 / tl.sqrt(tl.sum(p1, axis=0) * inv_n + exact_eps(eps, eps_lo, ACC))
        else:
            shift = _row_shift(X, R, r64, stride_x, stride_r, ADD, HAS_R, ACC)
            p2 = tl.load(part + KP + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
            mean = tl.sum(p1 * counts, axis=0) * inv_n
            dm = p1 - mean
            m2 = tl.sum(p2, axis=0) + tl.sum(tl.where(ks < K, counts * dm * dm, 0.0), axis=0)
            rstd = 1.0 / tl.sqrt(m2 * inv_n + exact_eps(eps, eps_lo, ACC))
        if k == 0:
            tl.store(Rstd + row, rstd)
            if not IS_RMS:
                tl.store(Mean + row, shift + mean)
        if not PREFETCH:
            # The chunk again, from L2 (read or written just before the barrier): registers stay
            # free for more programs per SM, which hide each other's wait.
            if ADD:
                x = tl.load(H + r64 * stride_h + cols, mask=mask, other=0.0).to(ACC)
            else:
                x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(ACC)
        y = normalize(x - shift, mean, rstd, mask, IS_RMS)
        w_row = (row % WG) * N
        if HAS_W:
            y = y * tl.load(W + w_row + cols, mask=mask, other=0.0).to(ACC)
        if HAS_B:
            y = y + tl.load(B + w_row + cols, mask=mask, other=0.0).to(ACC)
        tl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@smem.jit
def _fwd_smem_kernel(
    X,  # (M, N) 16-bit input rows, 16-byte aligned; row stride stride_x (a multiple of 16)
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Y,  # (M, N) output rows; row stride stride_y
    Mean,  # (M,) fp32 out (unwritten when IS_RMS)
    Rstd,  # (M,) fp32 out
    stride_x,
    stride_y,
    M,
    N,  # a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]
    eps,
    CHUNK: gl.constexpr,  # columns per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a row
    SPARE: gl.constexpr,  # extra buffers (0 or 1): the row after next starts landing a chunk early
    ONE_PASS: gl.constexpr,  # LayerNorm: Welford's update as the chunks land, else a second pass
    IS_RMS: gl.constexpr,
    HAS_W: gl.constexpr,
    HAS_B: gl.constexpr,
):
    """Persistent grid, one program per SM; each program's rows stream through its shared memory
    (smem.py): statistics from the buffers as the chunks land, then per chunk: read it back, start
    the stream's next copy into its buffer, normalize, store. W / B load one chunk ahead.

    LayerNorm's statistics: with ONE_PASS, each thread's running mean and squared deviations over its
    columns of the chunks (Welford's update), combined over the row at the end: one read of each
    buffer, but two more arrays of registers; otherwise the mean, then the squared deviations about
    it from a second read of the buffers (config.smem_row chooses)."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 8  # 16 bytes of 16-bit values per thread and copy
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    buf, offs = smem.open_stream(X, M, N, stride_x, layout, CHUNK, CHUNKS, SPARE)
    nprog = gl.num_programs(0)
    inv_n = 1.0 / N.to(gl.float32)
    base = gl.program_id(0) * 0  # buffer of the row's chunk 0
    for row in range(gl.program_id(0), M, nprog):
        if IS_RMS or not ONE_PASS:
            acc = gl.zeros([CHUNK], gl.float32, layout)
            for c in gl.static_range(CHUNKS):
                x = smem.landed(buf, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
                acc += x * x if IS_RMS else x  # columns past N landed as zeros
        if IS_RMS:
            mean = 0.0
            rstd = gl.rsqrt(gl.sum(acc, axis=0) * inv_n + eps)
        elif ONE_PASS:
            # per column slot of a chunk: the mean and squared deviations of its values so far (the
            # first CHUNKS - 1 chunks are full, the last holds N - (CHUNKS - 1) * CHUNK columns)
            m = gl.zeros([CHUNK], gl.float32, layout)
            m2 = gl.zeros([CHUNK], gl.float32, layout)
            for c in gl.static_range(CHUNKS):
                x = smem.landed(buf, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
                d = x - m
                if c + 1 == CHUNKS:
                    d = gl.where(c * CHUNK + offs < N, d, 0.0)
                m += d * (1.0 / (c + 1))
                m2 += d * (x - m)
            count = gl.where((CHUNKS - 1) * CHUNK + offs < N, CHUNKS, CHUNKS - 1).to(gl.float32)
            mean = gl.sum(count * m, axis=0) * inv_n
            dm = m - mean
            rstd = gl.rsqrt(gl.sum(m2 + count * dm * dm, axis=0) * inv_n + eps)
        else:
            mean = gl.sum(acc, axis=0) * inv_n
            acc = gl.zeros([CHUNK], gl.float32, layout)
            for c in gl.static_range(CHUNKS):
                x = smem.slot(buf, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
                d = gl.where(c * CHUNK + offs < N, x - mean, 0.0)
                acc += d * d
            rstd = gl.rsqrt(gl.sum(acc, axis=0) * inv_n + eps)
        if not IS_RMS:
            gl.store(Mean + row, mean)
        gl.store(Rstd + row, rstd)
        if HAS_W:
            w = gl.load(W + offs, mask=offs < N, other=0.0)
        if HAS_B:
            b = gl.load(B + offs, mask=offs < N, other=0.0)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            mask = cols < N
            dst = smem.slot(buf, base, c, CHUNKS, SPARE)
            x = dst.load(layout)
            if c + 1 < CHUNKS:
                if HAS_W:
                    w_next = gl.load(W + cols + CHUNK, mask=cols + CHUNK < N, other=0.0)
                if HAS_B:
                    b_next = gl.load(B + cols + CHUNK, mask=cols + CHUNK < N, other=0.0)
            # the buffer is free once read: the stream's next chunk starts landing during this store
            smem.refill(dst, X, row, M, N, stride_x, offs, c, CHUNK, CHUNKS, SPARE)
            y = (x.to(gl.float32) - mean) * rstd
            if HAS_W:
                y = y * w.to(gl.float32)
            if HAS_B:
                y = y + b.to(gl.float32)
            gl.store(Y + row.to(gl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
            if c + 1 < CHUNKS:
                if HAS_W:
                    w = w_next
                if HAS_B:
                    b = b_next
        base = smem.next_base(base, CHUNKS, SPARE)
    cp.wait_group(0)


@smem.jit
def _part_values(bx, br, H, at, layout: gl.constexpr, ADD: gl.constexpr, HAS_R: gl.constexpr):
    """The values normalized from buffer ``at``, fp32: x, or for the add-norms h = x + residual
    rounded to h's dtype (as stored), formed again at each read."""
    v = bx.index(at).load(layout).to(gl.float32)
    if ADD:
        if HAS_R:
            v = v + br.index(at).load(layout).to(gl.float32)
        v = v.to(H.dtype.element_ty).to(gl.float32)
    return v


@smem.jit
def _part_shift(X, R, H, row, M, stride_x, stride_r, ADD: gl.constexpr, HAS_R: gl.constexpr):
    """The shift of a row's statistics in parts (fp32 LayerNorm): its first value, formed as
    :func:`_part_values` forms it (h for the add-norms), the same in every part. Rows past M read
    row M - 1's (unused)."""
    r64 = gl.minimum(row, M - 1).to(gl.int64)
    v = gl.load(X + r64 * stride_x).to(gl.float32)
    if ADD:
        if HAS_R:
            v = v + gl.load(R + r64 * stride_r).to(gl.float32)
        v = v.to(H.dtype.element_ty).to(gl.float32)
    return v


@smem.jit
def _thread_moments(v, n, mean, m2, inside, lay3: gl.constexpr, T: gl.constexpr, VEC: gl.constexpr,
                    FIRST: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Fold chunk ``v`` ([CHUNK] fp32 in the copies' layout: VEC values a thread, T threads) into each
    thread's running count ``n``, mean ``mean`` and squared deviations about it ``m2`` ([T] each):
    the chunk's mean and squared deviations over the thread's own values (in registers: no shuffle,
    no barrier), merged by Chan's formula. FIRST: the first chunk (n, mean, m2 unread). MASKED: only
    the columns where ``inside`` ([CHUNK] int, copies' layout) > 0 count (v is 0 elsewhere), else all."""
    REPS: gl.constexpr = v.shape[0] // (T * VEC)
    v3 = gl.convert_layout(gl.reshape(v, [REPS, T, VEC]), lay3, assert_trivial=True)
    s = gl.sum(gl.sum(v3, axis=2), axis=0)
    if MASKED:
        in3 = gl.convert_layout(gl.reshape(inside, [REPS, T, VEC]), lay3, assert_trivial=True) > 0
        nc = gl.sum(gl.sum(gl.where(in3, 1.0, 0.0), axis=2), axis=0)
        lm = s / gl.maximum(nc, 1.0)
        d = gl.where(in3, v3 - gl.expand_dims(gl.expand_dims(lm, 0), 2), 0.0)
    else:
        nc = gl.full_like(s, REPS * VEC)
        lm = s * (1.0 / (REPS * VEC))
        d = v3 - gl.expand_dims(gl.expand_dims(lm, 0), 2)
    q = gl.sum(gl.sum(d * d, axis=2), axis=0)
    if FIRST:
        return nc, lm, q
    total = n + nc
    delta = lm - mean
    f = nc / gl.maximum(total, 1.0)
    return total, mean + delta * f, m2 + q + delta * delta * n * f


@smem.jit
def _chan(n1, m1, q1, n2, m2, q2):
    """Chan's merge of two subsets' (count, mean, squared deviations about the mean)."""
    n = n1 + n2
    d = m2 - m1
    f = n2 / gl.maximum(n, 1.0)
    return n, m1 + d * f, q1 + q2 + d * d * n1 * f


@smem.jit
def _merge_moments(n, mean, m2):
    """The mean and the squared deviations about it of values whose subsets (one a thread) have
    counts ``n``, means ``mean`` and squared deviations ``m2`` ([T] each): one reduction of the three
    by Chan's formula (one barrier, a fixed tree)."""
    _, total_mean, total_m2 = gl.reduce((n, mean, m2), 0, _chan)
    return total_mean, total_m2


@smem.jit
def _fwd_part_terms(bx, br, H, base, valid, shift, layout: gl.constexpr, lay3: gl.constexpr,
                    T: gl.constexpr, VEC: gl.constexpr, WAIT: gl.constexpr, CHUNK: gl.constexpr,
                    CHUNKS: gl.constexpr, NBUF: gl.constexpr, IS_RMS: gl.constexpr, ADD: gl.constexpr,
                    HAS_R: gl.constexpr, MASK: gl.constexpr, SHIFT: gl.constexpr):  # fmt: skip
    """A row part's terms from its CHUNKS buffers (chunk c in buffer (base + c) % NBUF; ``valid``:
    chunk 0's columns inside the part, shifted by c * CHUNK for chunk c), waiting for each to land
    (WAIT - c copy groups may still be pending after chunk c), in one read: RMSNorm the sum of
    squares (and 0.0); LayerNorm the part's mean and its squared deviations about it (each thread's
    own, :func:`_thread_moments`, merged), of the values less ``shift`` where SHIFT. ``MASK``
    (smem.parts_mask): 0 no chunk, 1 the last, 2 every chunk may hold columns past the part (they
    landed as zeros; h: 0 + 0)."""
    per_thread: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, lay3))
    acc = gl.zeros([CHUNK], gl.float32, layout)
    n = gl.zeros([T], gl.float32, per_thread)
    mean = gl.zeros([T], gl.float32, per_thread)
    m2 = gl.zeros([T], gl.float32, per_thread)
    for c in gl.static_range(CHUNKS):
        cp.wait_group(WAIT - c)
        v = _part_values(bx, br, H, (base + c) % NBUF, layout, ADD, HAS_R)
        if SHIFT:
            v = v - shift
            if smem.chunk_masked(MASK, c, CHUNKS):  # columns past the part stay 0
                v = gl.where(valid - c * CHUNK > 0, v, 0.0)
        if IS_RMS:
            acc += v * v
        else:
            n, mean, m2 = _thread_moments(v, n, mean, m2, valid - c * CHUNK, lay3, T, VEC, c == 0,
                                          smem.chunk_masked(MASK, c, CHUNKS))  # fmt: skip
    if IS_RMS:
        return gl.sum(acc, axis=0), 0.0
    return _merge_moments(n, mean, m2)


@smem.jit
def _parts_moments(w1, w2, words, K, KP: gl.constexpr, layout: gl.constexpr, tag, counts, inv_n):
    """A row's mean and biased variance from its K parts' (mean, squared deviations) at ``words``
    (``w1``, ``w2``: their first loads, smem.request_pair; ``counts``: each part's values, [KP] in
    ``layout``; ``inv_n``: 1 / the row's values): Chan's merge, in k's order."""
    means = smem.collect(w1, words, K, KP, layout, tag)
    m2 = smem.gather(w2, words + KP, K, KP, layout, tag)
    mean = gl.sum(counts * means, axis=0) * inv_n
    dm = means - mean
    return mean, (m2 + gl.sum(counts * dm * dm, axis=0)) * inv_n


@smem.jit
def _fwd_smem_split_kernel(
    X,  # (M, N) 16-bit or fp32 input rows, 16-byte aligned; row stride stride_x (a multiple of 16)
    R,  # (M, N) residual rows, X's dtype, aligned alike (read when ADD and HAS_R)
    H,  # (M, N) out: h (written when ADD); row stride stride_h
    Y,  # (M, N) out: the output rows; row stride stride_y
    W,  # (N,) weight (unread unless HAS_W)
    B,  # (N,) bias (unread unless HAS_B)
    Mean,  # (M,) fp32 out (unwritten when IS_RMS)
    Rstd,  # (M,) fp32 out
    Terms,  # (groups, RING, 2, KP) int64, zeroed: part k's row terms, tagged (smem.row_terms)
    Done,  # (groups,) int64 counters, zero: a group's last program done zeroes its Terms (smem.release)
    stride_x,
    stride_r,
    stride_h,
    stride_y,
    M,
    N,  # a multiple of 16
    K,  # parts a row: program pid holds part pid % K (columns [k * P, min(N, (k + 1) * P))) of group pid // K
    P,  # columns a part, a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]; N <= K * P
    eps,
    CHUNK: gl.constexpr,  # columns per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a row part
    SPARE: gl.constexpr,  # extra buffers (0 or 1)
    DEPTH: gl.constexpr,  # rows of buffers (2 or 3): a row's copies start DEPTH - 1 row steps early
    KP: gl.constexpr,  # next_pow2(K)
    RING: gl.constexpr,  # term slots a row group (>= smem.MIN_RING)
    IS_RMS: gl.constexpr,
    HAS_W: gl.constexpr,
    HAS_B: gl.constexpr,
    ADD: gl.constexpr,  # normalize h = x + residual, stored to H
    HAS_R: gl.constexpr,
    MASK: gl.constexpr,  # which chunks may hold columns past their part (smem.parts_mask)
):
    """Row forward for rows past one program's room: K co-resident programs share a row (grid =
    groups x K <= SMs, one program per SM), each streaming its part of the rows (and of the
    residual's) through shared memory DEPTH rows deep (smem.open_parts) and holding its part of the
    weight and bias there (loaded once). Per row step: the next row's part terms are taken as its
    chunks land and published (smem.publish); this row's K terms (published by the partners a
    step earlier, their load started before) are gathered and merged (Chan's formula for
    LayerNorm), and the row part is normalized and stored while its buffers take the row after
    next. Every part merges the same words in the same order: the same statistics bitwise. fp32
    LayerNorm takes the statistics of x - x[row, 0] (SHIFT; exact differences, as the split rows'),
    each row's shift loaded two row steps before its normalization."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # 16 bytes a thread and copy
    SHIFT: gl.constexpr = not IS_RMS and X.dtype.element_ty.primitive_bitwidth == 32
    T: gl.constexpr = 32 * NW
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    lay3: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    NBUF: gl.constexpr = DEPTH * CHUNKS + SPARE
    PAIR: gl.constexpr = ADD and HAS_R
    pid, group, groups, k, offs, end, col0 = smem.part_of(N, K, P, CHUNK, layout)
    valid = end - col0  # > c * CHUNK: chunk c's column is in the part
    bx, br = smem.open_parts(X, M, stride_x, group, groups, end, col0, CHUNK, CHUNKS, NBUF,
                             R if PAIR else None, stride_r)  # fmt: skip
    bw = bx  # unread without a weight (bias)
    if HAS_W:
        bw = smem.hold(W, col0, end, CHUNK, CHUNKS)
    bb = bx
    if HAS_B:
        bb = smem.hold(B, col0, end, CHUNK, CHUNKS)
    ks = gl.arange(0, KP, layout=small)
    counts = gl.minimum(gl.maximum(N - ks * P, 0), P).to(gl.float32)  # columns of each part
    inv_n = 1.0 / N.to(gl.float32)
    shift = 0.0  # this row's shift (SHIFT), and the next row's: loaded a row step before their use
    shift_next = 0.0
    if SHIFT:
        shift = _part_shift(X, R, H, group, M, stride_x, stride_r, ADD, HAS_R)
        shift_next = _part_shift(X, R, H, group + groups, M, stride_x, stride_r, ADD, HAS_R)
    # the group's first row: its terms from the prologue's copies (NBUF groups committed)
    t1, t2 = _fwd_part_terms(bx, br, H, 0, valid, shift, layout, lay3, T, VEC, NBUF - 1, CHUNK, CHUNKS,
                             NBUF, IS_RMS, ADD, HAS_R, MASK, SHIFT)  # fmt: skip
    smem.publish_pair(smem.row_terms(Terms, group, groups, KP, RING), k, t1, t2, KP, not IS_RMS, group + 1)
    base = pid * 0  # buffer of this row's chunk 0
    for row in range(group, M, groups):
        r64 = row.to(gl.int64)
        mine = smem.row_terms(Terms, row, groups, KP, RING)
        # this row's terms: their load in flight during the next row's terms
        w1, w2 = smem.request_pair(mine, K, KP, small, not IS_RMS, row + 1)
        nxt = row + groups
        shift_after = shift_next  # the row after next's shift, used a row step on
        if SHIFT:
            shift_after = _part_shift(X, R, H, nxt + groups, M, stride_x, stride_r, ADD, HAS_R)
        if nxt < M:
            # committed: NBUF + CHUNKS a row done; after the next row's chunk c: (DEPTH - 1) * CHUNKS
            # + SPARE - 1 - c
            n1, n2 = _fwd_part_terms(bx, br, H, (base + CHUNKS) % NBUF, valid, shift_next, layout, lay3, T,
                                     VEC, (DEPTH - 1) * CHUNKS + SPARE - 1, CHUNK, CHUNKS, NBUF, IS_RMS, ADD,
                                     HAS_R, MASK, SHIFT)  # fmt: skip
            words = smem.row_terms(Terms, nxt, groups, KP, RING)
            smem.publish_pair(words, k, n1, n2, KP, not IS_RMS, nxt + 1)
        if IS_RMS:
            mean = 0.0
            rstd = gl.rsqrt(smem.gather(w1, mine, K, KP, small, row + 1) * inv_n + eps)
        else:
            mean, var = _parts_moments(w1, w2, mine, K, KP, small, row + 1, counts, inv_n)
            rstd = gl.rsqrt(var + eps)
        if k == 0:
            gl.store(Rstd + row, rstd)
            if SHIFT:
                gl.store(Mean + row, mean + shift)
            elif not IS_RMS:
                gl.store(Mean + row, mean)
        for c in gl.static_range(CHUNKS):
            cols = col0 + c * CHUNK
            mask = cols < end
            at = (base + c) % NBUF
            v = _part_values(bx, br, H, at, layout, ADD, HAS_R)
            smem.refill_part(bx, at, X, row, groups, M, end, stride_x, col0, c, CHUNK, CHUNKS, SPARE,
                             DEPTH, br if PAIR else None, R if PAIR else None, stride_r)  # fmt: skip
            if ADD:
                gl.store(H + r64 * stride_h + cols, v.to(H.dtype.element_ty), mask=mask)
            if SHIFT:
                v = v - shift
            y = (v - mean) * rstd
            if HAS_W:
                y = y * bw.index(c).load(layout).to(gl.float32)
            if HAS_B:
                y = y + bb.index(c).load(layout).to(gl.float32)
            gl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
        base = (base + CHUNKS) % NBUF
        if SHIFT:
            shift = shift_next
            shift_next = shift_after
    cp.wait_group(0)
    smem.release(Done + group, Terms + group * (RING * 2 * KP), RING * 2 * KP, K, small)


@triton.jit
def _load_rows(X, DY, rows, cols, col_mask, M, stride_x, stride_dy):
    """x and dy of ``rows`` ([ROWS]) x ``cols`` ([BLOCK_N]), in their dtypes; 0 outside M x N."""
    mask = (rows < M)[:, None] & col_mask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _bwd_fused_kernel(
    X,  # (M, N) forward input rows (h for the add-norm); row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH); row stride stride_dh
    DX,  # (M, N) out: gradient of the forward's x, in x's dtype; row stride stride_dx
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES); row stride stride_dres
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,) forward 1 / sqrt(var + eps)
    DW_part,  # (G, N) out, ACC: row g = program g's sum of dy * xhat (written when HAS_W); G = 1: dweight
    DB_part,  # (G, N) out, ACC: row g = program g's sum of dy (written when HAS_DB); G = 1: dbias
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,
    seed,  # dropout, as in the forward
    p,
    scale,
    ROWS: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # power of two >= N
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PREFETCH: tl.constexpr,  # load the next row tile during this one (config.backward)
    SAME_STRIDE: tl.constexpr,  # every row stride equals stride_x (the launchers check)
):
    if SAME_STRIDE:
        # One offset for every tensor's element: five runtime strides (five 64-bit offsets a row)
        # read fp32 RMSNorm 1024 0.92 of copy against 0.98 (H100, docs/tuning-log.md T45).
        stride_dy = stride_x
        stride_dh = stride_x
        stride_dx = stride_x
        stride_dres = stride_x
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    # Tile-shaped partials: summed over the tile's rows once, after the loop (an in-loop
    # tl.sum(axis=0) is a cross-warp reduction through shared memory for every row tile).
    dw = tl.zeros([ROWS, BLOCK_N], ACC)
    db = tl.zeros([ROWS, BLOCK_N], ACC)
    inv_n = reciprocal(N, ACC)
    # Persistent: program pid takes row tiles pid, pid + G, pid + 2G, ... (a fixed assignment, so
    # the partial sums, and hence dweight/dbias, are the same on every run).
    # PREFETCH: the next tile's x and dy are loaded before this tile's reductions, so their HBM
    # latency overlaps this tile's work (one program then keeps two tiles of loads in flight).
    tile_rows = tl.arange(0, ROWS)
    step = tl.num_programs(0) * ROWS
    if PREFETCH:
        x_next, dy_next = _load_rows(X, DY, pid * ROWS + tile_rows, cols, col_mask, M, stride_x, stride_dy)
    for tile in range(pid, tl.cdiv(M, ROWS), tl.num_programs(0)):
        rows = tile * ROWS + tile_rows
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        if PREFETCH:
            x, dy = x_next, dy_next
            x_next, dy_next = _load_rows(X, DY, rows + step, cols, col_mask, M, stride_x, stride_dy)
        else:
            x, dy = _load_rows(X, DY, rows, cols, col_mask, M, stride_x, stride_dy)
        x = x.to(ACC)
        dy = dy.to(ACC)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)[:, None]
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)[:, None]
        xhat = normalize(x, mean, rstd, mask, IS_RMS)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1)[:, None] * inv_n
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=1)[:, None] * inv_n
            dx = (wdy - (xhat * c1 + c2)) * rstd
        dx = residual_grad(dx, DH + r64 * stride_dh + cols[None, :],
                           DRES + r64 * stride_dres + cols[None, :],
                           mask, row_key(seed, rows)[:, None], cols[None, :], p, scale,
                           HAS_DH, HAS_DRES, DROPOUT)  # fmt: skip
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_DB:
            db += dy
    if HAS_W:
        tl.store(DW_part + pid * N + cols, tl.sum(dw, axis=0).to(DW_part.dtype.element_ty), mask=col_mask)
    if HAS_DB:
        tl.store(DB_part + pid * N + cols, tl.sum(db, axis=0).to(DB_part.dtype.element_ty), mask=col_mask)


@triton.jit
def _bwd_row_terms_kernel(
    X,  # (M, N) forward input rows; row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,)
    C1,  # (M,) out, ACC: mean over the row of xhat * w * dy
    C2,  # (M,) out, ACC: mean over the row of w * dy (unwritten when IS_RMS)
    stride_x,
    stride_dy,
    N,
    BLOCK_N: tl.constexpr,  # column tile; one program per row
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    ACC: tl.constexpr,
):
    row_norm_bwd_terms(X, DY, W, Mean, Rstd, C1, C2, tl.program_id(0), stride_x, stride_dy, N,
                       reciprocal(N, ACC), BLOCK_N, IS_RMS, HAS_W, ACC)  # fmt: skip


@triton.jit
def _bwd_looped_kernel(
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
    DW_part,  # (G, N) out, ACC: row g = chunk g's sum of dy * xhat (written when HAS_W)
    DB_part,  # (G, N) out, ACC: row g = chunk g's sum of dy (written when HAS_DB)
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,
    rows_per_chunk,  # grid axis 0 = G row chunks of this many rows
    seed,
    p,
    scale,
    BLOCK_N: tl.constexpr,  # grid axis 1 = column tiles of BLOCK_N
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_norm_bwd_tile(X, DY, DH, DX, DRES, W, Mean, Rstd, C1, C2, DW_part, DB_part, tl.program_id(0), cols,
                      stride_x, stride_dy, stride_dh, stride_dx, stride_dres, M, N, rows_per_chunk, seed, p,
                      scale, BLOCK_N, IS_RMS, HAS_W, HAS_DB, HAS_DH, HAS_DRES, DROPOUT, ACC)  # fmt: skip


@triton.jit
def _bwd_split_publish(x, dy, w, row, Mean, Rstd, Part, Count, k, mask, KP: tl.constexpr,
                       IS_RMS: tl.constexpr, HAS_W: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Write this chunk's partial sums of ``row`` (x, dy: the chunk in its dtype) to Part and arrive
    at the row's counter."""
    rstd = tl.load(Rstd + row)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(Mean + row)
    xhat = normalize(x.to(ACC), mean, rstd, mask, IS_RMS)
    wdy = dy.to(ACC)
    if HAS_W:
        wdy = wdy * w.to(ACC)
    part = Part + tl.cast(row, tl.int64) * (2 * KP)
    tl.store(part + k, tl.sum(xhat * wdy, axis=0))
    if not IS_RMS:
        tl.store(part + KP + k, tl.sum(wdy, axis=0))
    arrive(Count + row)


@triton.jit
def _bwd_split_solo(X, DY, W, row, group, Mean, Rstd, Part, Count, K, N, M, WG, stride_x, stride_dy,
                    CHUNK: tl.constexpr, KP: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
                    ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``row`` before its row loop: publish every chunk's partial
    sums of ``row`` itself, as the K partners would."""
    for j in range(K):
        cols = j * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        x = load_chunk(X, row, stride_x, cols, mask, M, 0.0)
        dy = load_chunk(DY, row, stride_dy, cols, mask, M, 0.0)
        if HAS_W:
            w = tl.load(W + (group % WG) * N + cols, mask=mask, other=0.0)
        else:
            w = 1.0
        _bwd_split_publish(x, dy, w, row, Mean, Rstd, Part, Count, j, mask, KP, IS_RMS, HAS_W, ACC)


@triton.jit
def _bwd_split_kernel(
    X,  # (M, N) forward input rows (h for the add-norm); row stride stride_x
    DY,  # (M, N) output gradient rows; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH)
    DX,  # (M, N) out: gradient of the forward's x, in x's dtype
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES)
    W,  # (WG, N) weight rows (unread unless HAS_W)
    Mean,  # (M,) forward row means (unread when IS_RMS)
    Rstd,  # (M,)
    Part,  # (M, 2, KP) ACC workspace: per-chunk sums of xhat * w * dy and of w * dy
    Count,  # (2 M,) int32, zeroed: the row barriers, then the row groups' start words (coop.join)
    DW_part,  # (G, N) out, ACC: row g = row group g's sum of dy * xhat (written when HAS_W)
    DB_part,  # (G, N) out, ACC: row g = row group g's sum of dy (written when HAS_DB)
    stride_x,
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,
    K,  # chunks per row; program pid holds chunk pid % K of the rows of group pid // K
    WG,  # rows of W: row r uses W[r % WG] (GroupNorm: one (L,) weight row per group); 1 otherwise
    seed,
    p,
    scale,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_DRES: tl.constexpr,
    DROPOUT: tl.constexpr,
    ACC: tl.constexpr,
    PREFETCH: tl.constexpr,  # pipelined: the next row's partials published before this row's wait
    SPIN: tl.constexpr,  # polls to wait for the row group to fill (coop.join)
):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    group = pid // K
    k = pid % K
    together = join(Count + M + group, K, SPIN)
    # A solo program (its row group did not fill: coop.join) publishes every chunk of its rows
    # first, where little else is live, so the row loop keeps its registers.
    if together == 0:
        for row in range(group, M, groups):
            _bwd_split_solo(X, DY, W, row, group, Mean, Rstd, Part, Count, K, N, M, WG, stride_x, stride_dy,
                            CHUNK, KP, IS_RMS, HAS_W, ACC)  # fmt: skip
    cols = k * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    if HAS_W:
        # A group's rows are group, group + groups, ...; the launcher makes groups a multiple of
        # WG, so they share one weight row and the partials below belong to it alone.
        w = tl.load(W + (group % WG) * N + cols, mask=mask, other=0.0)
    else:
        w = 1.0
    dw = tl.zeros([CHUNK], ACC)
    db = tl.zeros([CHUNK], ACC)
    ks = tl.arange(0, KP)
    inv_n = reciprocal(N, ACC)
    # PREFETCH: the next row's chunk is loaded and its partials published before waiting on this
    # row's barrier, so the barrier's latency overlaps a row of loads and reductions (two rows'
    # chunks live in registers).
    if PREFETCH:
        x_next = load_chunk(X, group, stride_x, cols, mask, M, 0.0)
        dy_next = load_chunk(DY, group, stride_dy, cols, mask, M, 0.0)
        _bwd_split_publish(x_next, dy_next, w, group, Mean, Rstd, Part, Count, k, mask, KP, IS_RMS,
                           HAS_W, ACC)  # fmt: skip
    for row in range(group, M, groups):
        r64 = tl.cast(row, tl.int64)
        if PREFETCH:
            x, dy = x_next, dy_next
            nxt = row + groups
            x_next = load_chunk(X, nxt, stride_x, cols, mask, M, 0.0)
            dy_next = load_chunk(DY, nxt, stride_dy, cols, mask, M, 0.0)
            if nxt < M:
                _bwd_split_publish(x_next, dy_next, w, nxt, Mean, Rstd, Part, Count, k, mask, KP,
                                   IS_RMS, HAS_W, ACC)  # fmt: skip
        else:
            x = load_chunk(X, row, stride_x, cols, mask, M, 0.0)
            dy = load_chunk(DY, row, stride_dy, cols, mask, M, 0.0)
            _bwd_split_publish(x, dy, w, row, Mean, Rstd, Part, Count, k, mask, KP, IS_RMS, HAS_W, ACC)
        if together:
            wait(Count + row, K)
        x = x.to(ACC)
        dy = dy.to(ACC)
        rstd = tl.load(Rstd + row)
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(Mean + row)
        xhat = normalize(x, mean, rstd, mask, IS_RMS)
        if HAS_W:
            wdy = dy * w.to(ACC)
        else:
            wdy = dy
        part = Part + r64 * (2 * KP)
        c1 = tl.sum(tl.load(part + ks, mask=ks < K, other=0.0, cache_modifier=".cg"), axis=0) * inv_n
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(tl.load(part + KP + ks, mask=ks < K, other=0.0, cache_modifier=".cg"), axis=0)
            dx = (wdy - (xhat * c1 + c2 * inv_n)) * rstd
        dx = residual_grad(dx, DH + r64 * stride_dh + cols, DRES + r64 * stride_dres + cols, mask,
                           row_key(seed, row), cols, p, scale, HAS_DH, HAS_DRES, DROPOUT)  # fmt: skip
        tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_DB:
            db += dy
    out = tl.cast(group, tl.int64) * N + cols
    if HAS_W:
        tl.store(DW_part + out, dw, mask=mask)
    if HAS_DB:
        tl.store(DB_part + out, db, mask=mask)


@smem.jit
def _smem_dx_chunk(x, dy, w, mean, rstd, c1, c2, DH, DX, DRES, r64, stride_dh, stride_dx, stride_dres, cols,
                   mask, dw, db, chunk_of, c: gl.constexpr, HAS_W: gl.constexpr, HAS_DB: gl.constexpr,
                   HAS_DH: gl.constexpr, HAS_DRES: gl.constexpr):  # fmt: skip
    """The shared-memory backwards' step for chunk ``c`` of row ``r64`` (x, dy, w: its 16-bit values
    read back; c1, c2: the row terms): dx (plus h's gradient) stored, the residual's gradient stored,
    dy * xhat and dy added into chunk c's row of the [ROWS, CHUNK] partials dw / db, returned."""
    xhat = (x.to(gl.float32) - mean) * rstd
    dy = dy.to(gl.float32)
    if HAS_W:
        wdy = dy * w.to(gl.float32)
    else:
        wdy = dy
    d = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DH:
        d += gl.load(DH + r64 * stride_dh + cols, mask=mask, other=0.0).to(gl.float32)
    if HAS_DRES:
        gl.store(DRES + r64 * stride_dres + cols, d.to(DRES.dtype.element_ty), mask=mask)
    gl.store(DX + r64 * stride_dx + cols, d.to(DX.dtype.element_ty), mask=mask)
    # chunk c's row of the partials (a select per register, resolved at compile time)
    if HAS_W:
        dw = gl.where(chunk_of == c, dw + gl.expand_dims(dy * xhat, 0), dw)
    if HAS_DB:
        db = gl.where(chunk_of == c, db + gl.expand_dims(dy, 0), db)
    return dw, db


@smem.jit
def _bwd_smem_kernel(
    X,  # (M, N) 16-bit normalized rows (h for the add-norms), 16-byte aligned; row stride stride_x
    DY,  # (M, N) output gradient rows, X's dtype, aligned alike; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH); row stride stride_dh
    DX,  # (M, N) out: gradient of the forward's x; row stride stride_dx
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES); row stride stride_dres
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) fp32 forward row means (unread when IS_RMS)
    Rstd,  # (M,) fp32
    DW_part,  # (G, N) out: row g = program g's sum of dy * xhat (written when HAS_W); G = 1: dweight
    DB_part,  # (G, N) out: row g = program g's sum of dy (written when HAS_DB); G = 1: dbias
    stride_x,  # a multiple of 16, as stride_dy
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,  # a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]
    CHUNK: gl.constexpr,  # columns per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a row (of x, and of dy)
    SPARE: gl.constexpr,  # extra buffers (0 or 1) of each: the row after next starts landing early
    IS_RMS: gl.constexpr,
    HAS_W: gl.constexpr,
    HAS_DB: gl.constexpr,
    HAS_DH: gl.constexpr,
    HAS_DRES: gl.constexpr,
):
    """Persistent grid, one program per SM. Each program's rows of x and dy stream through its
    shared memory together (smem.open_pair), so neither the row nor the next one costs registers;
    the registers hold the program's dweight / dbias partials, fp32 [CHUNKS, CHUNK] (config bounds
    their size). Per row: the two row terms (c1, c2) from the buffers as the chunks land, then per
    chunk: read x and dy back, start the stream's next copy into their buffers, compute and store
    dx, add dy * xhat and dy into the chunk's row of the partials. The partial rows are written once,
    at the end (reduce.py sums them over the programs, in a fixed order)."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 8  # 16 bytes of 16-bit values per thread and copy
    # the partials: [CHUNKS, CHUNK] in registers (rows past CHUNKS stay zero), a thread holding its
    # columns of every chunk
    ROWS: gl.constexpr = smem.next_pow2(CHUNKS)
    parts: gl.constexpr = gl.BlockedLayout([ROWS, VEC], [1, 32], [1, NW], [1, 0])
    layout: gl.constexpr = gl.SliceLayout(0, parts)  # a chunk: VEC columns a thread
    bx, bdy, offs = smem.open_pair(X, DY, M, N, stride_x, stride_dy, layout, CHUNK, CHUNKS, SPARE)
    zero = gl.zeros([CHUNK], gl.float32, layout)
    chunk_of = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, parts)), 1)  # [ROWS, 1]
    dw = gl.zeros([ROWS, CHUNK], gl.float32, parts)
    db = gl.zeros([ROWS, CHUNK], gl.float32, parts)
    nprog = gl.num_programs(0)
    inv_n = 1.0 / N.to(gl.float32)
    base = gl.program_id(0) * 0  # buffer of the row's chunk 0
    for row in range(gl.program_id(0), M, nprog):
        rstd = gl.load(Rstd + row)
        if IS_RMS:
            mean = 0.0
        else:
            mean = gl.load(Mean + row)
        # c1 = mean of xhat * w * dy, c2 = mean of w * dy (LayerNorm); columns past N landed as zeros
        a1 = zero
        a2 = zero
        if HAS_W:
            w = gl.load(W + offs, mask=offs < N, other=0.0)
        for c in gl.static_range(CHUNKS):
            if HAS_W and c + 1 < CHUNKS:
                w_next = gl.load(W + offs + (c + 1) * CHUNK, mask=offs + (c + 1) * CHUNK < N, other=0.0)
            smem.wait(c, CHUNKS, SPARE)
            x = smem.slot(bx, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
            wdy = smem.slot(bdy, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
            if HAS_W:
                wdy = wdy * w.to(gl.float32)
            a1 += (x - mean) * wdy
            if not IS_RMS:
                a2 += wdy
            if HAS_W and c + 1 < CHUNKS:
                w = w_next
        c1 = gl.sum(a1, axis=0) * rstd * inv_n
        if IS_RMS:
            c2 = 0.0
        else:
            c2 = gl.sum(a2, axis=0) * inv_n
        w = zero  # unread without a weight
        if HAS_W:
            w = gl.load(W + offs, mask=offs < N, other=0.0)
        r64 = row.to(gl.int64)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            mask = cols < N
            sx = smem.slot(bx, base, c, CHUNKS, SPARE)
            sdy = smem.slot(bdy, base, c, CHUNKS, SPARE)
            x = sx.load(layout)
            dy = sdy.load(layout)
            if HAS_W and c + 1 < CHUNKS:
                w_next = gl.load(W + cols + CHUNK, mask=cols + CHUNK < N, other=0.0)
            # both buffers are free once read: the stream's next chunks land during this chunk's work
            smem.refill(sx, X, row, M, N, stride_x, offs, c, CHUNK, CHUNKS, SPARE, sdy, DY, stride_dy)
            dw, db = _smem_dx_chunk(x, dy, w, mean, rstd, c1, c2, DH, DX, DRES, r64, stride_dh, stride_dx,
                                    stride_dres, cols, mask, dw, db, chunk_of, c, HAS_W, HAS_DB, HAS_DH,
                                    HAS_DRES)  # fmt: skip
            if HAS_W and c + 1 < CHUNKS:
                w = w_next
        base = smem.next_base(base, CHUNKS, SPARE)
    cp.wait_group(0)
    cols = chunk_of * CHUNK + gl.expand_dims(offs, 0)
    out = gl.program_id(0) * N + cols
    if HAS_W:
        gl.store(DW_part + out, dw.to(DW_part.dtype.element_ty), mask=cols < N)
    if HAS_DB:
        gl.store(DB_part + out, db.to(DB_part.dtype.element_ty), mask=cols < N)


@smem.jit
def _smem_row_terms(bx, bdy, bw, mean, base, layout: gl.constexpr, WAIT: gl.constexpr,
                    CHUNK: gl.constexpr, CHUNKS: gl.constexpr, NBUF: gl.constexpr, IS_RMS: gl.constexpr,
                    HAS_W: gl.constexpr):  # fmt: skip
    """A row part's sums of (x - mean) * w * dy and of w * dy (LayerNorm; 0.0 for RMSNorm) over its
    CHUNKS buffers (chunk c in buffer (base + c) % NBUF; w's chunk c in bw's buffer c), waiting for
    each to land: WAIT - c copy groups may still be pending after chunk c."""
    a1 = gl.zeros([CHUNK], gl.float32, layout)
    a2 = a1
    for c in gl.static_range(CHUNKS):
        cp.wait_group(WAIT - c)
        at = (base + c) % NBUF
        x = bx.index(at).load(layout).to(gl.float32)
        wdy = bdy.index(at).load(layout).to(gl.float32)
        if HAS_W:
            wdy = wdy * bw.index(c).load(layout).to(gl.float32)
        a1 += (x - mean) * wdy
        if not IS_RMS:
            a2 += wdy
    s2 = 0.0
    if not IS_RMS:
        s2 = gl.sum(a2, axis=0)
    return gl.sum(a1, axis=0), s2


@smem.jit
def _bwd_smem_split_kernel(
    X,  # (M, N) 16-bit normalized rows (h for the add-norms), 16-byte aligned; row stride stride_x
    DY,  # (M, N) output gradient rows, X's dtype, aligned alike; row stride stride_dy
    DH,  # (M, N) incoming gradient of h (read when HAS_DH); row stride stride_dh
    DX,  # (M, N) out: gradient of the forward's x; row stride stride_dx
    DRES,  # (M, N) out: gradient of the residual (written when HAS_DRES); row stride stride_dres
    W,  # (N,) weight (unread unless HAS_W)
    Mean,  # (M,) fp32 forward row means (unread when IS_RMS)
    Rstd,  # (M,) fp32
    Terms,  # (groups, RING, 2, KP) int64, zeroed: part k's two row terms, tagged (smem.row_terms)
    Done,  # (groups,) int64 counters, zero: a group's last program done zeroes its Terms (smem.release)
    DW_part,  # (G, N) out: row g = row group g's sum of dy * xhat (written when HAS_W)
    DB_part,  # (G, N) out: row g = row group g's sum of dy (written when HAS_DB)
    stride_x,  # a multiple of 16, as stride_dy
    stride_dy,
    stride_dh,
    stride_dx,
    stride_dres,
    M,
    N,  # a multiple of 16 in ((K - 1) * CHUNKS * CHUNK, K * CHUNKS * CHUNK]
    K,  # parts a row: program pid holds part pid % K (from column k * CHUNKS * CHUNK) of group pid // K
    CHUNK: gl.constexpr,  # columns per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a row part (of x, and of dy)
    SPARE: gl.constexpr,  # extra buffers (0 or 1) of each
    KP: gl.constexpr,  # next_pow2(K)
    RING: gl.constexpr,  # term slots a row group (>= smem.MIN_RING)
    IS_RMS: gl.constexpr,
    HAS_W: gl.constexpr,
    HAS_DB: gl.constexpr,
    HAS_DH: gl.constexpr,
    HAS_DRES: gl.constexpr,
):
    """``_bwd_smem_kernel`` for rows past one program's room: K co-resident programs share a row
    (grid = groups x K <= SMs, one program per SM), each streaming its part of x and dy through
    shared memory two rows deep (2 * CHUNKS + SPARE buffers), holding its part of the weight there
    (loaded once) and its part's dweight / dbias partials in registers. Per row step: the next
    row's part terms are summed as its chunks land and published (smem.publish), then this row's K
    terms (published by the partners a step earlier; their load started before the next row's
    terms) are gathered, and dx of this row is written while its buffers take the row after next."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 8  # 16 bytes of 16-bit values per thread and copy
    ROWS: gl.constexpr = smem.next_pow2(CHUNKS)
    parts: gl.constexpr = gl.BlockedLayout([ROWS, VEC], [1, 32], [1, NW], [1, 0])
    layout: gl.constexpr = gl.SliceLayout(0, parts)
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    NBUF: gl.constexpr = 2 * CHUNKS + SPARE
    pid = gl.program_id(0)
    groups = gl.num_programs(0) // K
    group = pid // K
    k = pid % K
    offs = gl.arange(0, CHUNK, layout=layout)
    col0 = k * (CHUNKS * CHUNK) + offs  # chunk 0's columns of this program's part
    bx = smem.buffers(X.dtype.element_ty, NBUF, CHUNK)
    bdy = smem.buffers(DY.dtype.element_ty, NBUF, CHUNK)
    bw = bx  # unread without a weight
    if HAS_W:  # the part's weight, read every row: held in shared memory, not re-read from L2
        bw = smem.buffers(W.dtype.element_ty, CHUNKS, CHUNK)
        for c in gl.static_range(CHUNKS):
            bw.index(c).store(gl.load(W + col0 + c * CHUNK, mask=col0 + c * CHUNK < N, other=0.0))
    # the stream: chunk g (g // CHUNKS-th row of the group, its chunk g % CHUNKS) in buffer g % NBUF
    for g in gl.static_range(NBUF):
        smem.copy_chunk(bx.index(g), X, group + g // CHUNKS * groups, M, N, stride_x,
                        col0 + g % CHUNKS * CHUNK, bdy.index(g), DY, stride_dy)  # fmt: skip
    chunk_of = gl.expand_dims(gl.arange(0, ROWS, layout=gl.SliceLayout(1, parts)), 1)  # [ROWS, 1]
    dw = gl.zeros([ROWS, CHUNK], gl.float32, parts)
    db = gl.zeros([ROWS, CHUNK], gl.float32, parts)
    inv_n = 1.0 / N.to(gl.float32)
    # the group's first row: its terms from the prologue's copies (NBUF groups committed)
    mean = 0.0
    if not IS_RMS:
        mean = gl.load(Mean + group)
    t1, t2 = _smem_row_terms(bx, bdy, bw, mean, 0, layout, NBUF - 1, CHUNK, CHUNKS, NBUF, IS_RMS, HAS_W)
    smem.publish_pair(smem.row_terms(Terms, group, groups, KP, RING), k, t1, t2, KP, not IS_RMS, group + 1)
    base = pid * 0  # buffer of this row's chunk 0
    for row in range(group, M, groups):
        r64 = row.to(gl.int64)
        mine = smem.row_terms(Terms, row, groups, KP, RING)
        # this row's terms: their load in flight during the next row's terms
        w1, w2 = smem.request_pair(mine, K, KP, small, not IS_RMS, row + 1)
        rstd = gl.load(Rstd + row)
        if not IS_RMS:
            mean = gl.load(Mean + row)
        nxt = row + groups
        if nxt < M:
            mean_n = 0.0
            if not IS_RMS:
                mean_n = gl.load(Mean + nxt)
            # committed: NBUF + CHUNKS a row done; after the next row's chunk c: CHUNKS + SPARE - 1 - c
            n1, n2 = _smem_row_terms(bx, bdy, bw, mean_n, (base + CHUNKS) % NBUF, layout, CHUNKS + SPARE - 1,
                                     CHUNK, CHUNKS, NBUF, IS_RMS, HAS_W)  # fmt: skip
            words = smem.row_terms(Terms, nxt, groups, KP, RING)
            smem.publish_pair(words, k, n1, n2, KP, not IS_RMS, nxt + 1)
        c1 = smem.gather(w1, mine, K, KP, small, row + 1) * rstd * inv_n
        if IS_RMS:
            c2 = 0.0
        else:
            c2 = smem.gather(w2, mine + KP, K, KP, small, row + 1) * inv_n
        for c in gl.static_range(CHUNKS):
            cols = col0 + c * CHUNK
            mask = cols < N
            at = (base + c) % NBUF
            x = bx.index(at).load(layout)
            dy = bdy.index(at).load(layout)
            # the stream's chunk NBUF later takes this buffer: chunk (c + SPARE) % CHUNKS of the row
            # 2 + (c + SPARE) // CHUNKS rows on
            smem.copy_chunk(bx.index(at), X, row + (2 + (c + SPARE) // CHUNKS) * groups, M, N, stride_x,
                            col0 + (c + SPARE) % CHUNKS * CHUNK, bdy.index(at), DY, stride_dy)  # fmt: skip
            w = x  # unread without a weight
            if HAS_W:
                w = bw.index(c).load(layout)
            dw, db = _smem_dx_chunk(x, dy, w, mean, rstd, c1, c2, DH, DX, DRES, r64, stride_dh, stride_dx,
                                    stride_dres, cols, mask, dw, db, chunk_of, c, HAS_W, HAS_DB, HAS_DH,
                                    HAS_DRES)  # fmt: skip
        base = (base + CHUNKS) % NBUF
    cp.wait_group(0)
    smem.release(Done + group, Terms + group * (RING * 2 * KP), RING * 2 * KP, K, small)
    cols = chunk_of * CHUNK + gl.expand_dims(col0, 0)
    out = group * N + cols
    if HAS_W:
        gl.store(DW_part + out, dw.to(DW_part.dtype.element_ty), mask=cols < N)
    if HAS_DB:
        gl.store(DB_part + out, db.to(DB_part.dtype.element_ty), mask=cols < N)


def _dropout_args(dropout_p, seed):
    """(seed, p, scale) kernel arguments; dropout is compiled out when p == 0."""
    return (seed, dropout_p, 1.0 / (1.0 - dropout_p)) if dropout_p > 0 else (0, 0.0, 1.0)


# --- launches: each kernel's arguments spelled once, for the eager launchers and the plans -----------
# A forward kernel takes the twelve ``head`` values (x, r, h, y, w, b, mean, rstd and the strides of
# x, r, h, y; placeholders where a tensor is absent), a backward kernel its eight (x, dy, dh, dx,
# dres, w, mean, rstd) and the dweight / dbias partials; :func:`_fwd_kernel` / :func:`_bwd_kernel`
# give the kernel and its launch keywords for a config (once per plan), :func:`_fwd_args` /
# :func:`_bwd_args` its positional arguments for a call.


def _fwd_kernel(cfg, flags, N, dtype, device, is_rms, add, stats=None):
    """(kernel, launch keywords) of the forward config ``cfg``: its strategy's keywords and the
    forward's ``flags``; ``stats`` False: the fused kernel writes no statistics (inference plans)."""
    if cfg.fused:
        meta = dict(ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size)
        if stats is not None:
            meta["STATS"] = stats
        one_read = config.one_read_moments(cfg, dtype, device, is_rms, add)
        return _fwd_fused_kernel, dict(meta, ONE_READ=one_read, **flags)
    if cfg.smem:
        return (_fwd_smem_split_kernel if cfg.in_parts else _fwd_smem_kernel), _smem_meta(cfg, flags, N)
    if cfg.split > 1:
        return _fwd_split_kernel, dict(coop.split_meta(cfg), **flags)
    return _fwd_looped_kernel, dict(BLOCK_N=cfg.block_size, **flags)


def _fwd_args(cfg, head, M, N, eps, tail, drop, device) -> tuple:
    """The positional arguments of :func:`_fwd_kernel`'s kernel for one call (fresh workspaces for
    the split rows and the rows in parts)."""
    if cfg.fused:
        return (*head, M, N, eps, tail, *drop)
    if cfg.smem and cfg.in_parts:
        terms = smem.terms_workspace(cfg.grid[0] // cfg.parts, cfg.parts, cfg.ring, device)
        return (*head[:8], *terms, *head[8:], M, N, cfg.parts, cfg.part, eps)
    if cfg.smem:  # x, w, b, y, mean, rstd, the strides of x and y
        return (head[0], head[4], head[5], head[3], head[6], head[7], head[8], head[11], M, N, eps)
    if cfg.split > 1:
        work = coop.workspace(M, 2, cfg.split, config.acc_dtype(head[0].dtype), device)
        return (*head, *work, M, N, cfg.split, 1, eps, tail, *drop)
    return (*head, N, eps, tail, *drop)


def _bwd_kernel(cfg, flags, has_dh, same_stride=True):
    """(kernel, launch keywords) of the backward config ``cfg`` (fused, shared memory, split rows)
    with h's gradient or not; ``flags`` without HAS_DH."""
    if cfg.fused:
        meta = dict(ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, PREFETCH=cfg.prefetch)
        return _bwd_fused_kernel, dict(meta, SAME_STRIDE=same_stride, HAS_DH=has_dh, **flags)
    if cfg.smem:
        kernel, meta = _smem_bwd_meta(cfg, flags)
        return kernel, dict(meta, HAS_DH=has_dh)
    return _bwd_split_kernel, dict(coop.split_meta(cfg), HAS_DH=has_dh, **flags)


def _bwd_args(cfg, head, parts, strides, M, N, drop, device) -> tuple:
    """The positional arguments of :func:`_bwd_kernel`'s kernel for one call: ``head`` (x, dy, dh,
    dx, dres, w, mean, rstd), ``parts`` (the dweight, dbias partials or placeholders), the five row
    strides (fresh workspaces for the split rows)."""
    if cfg.fused:
        return (*head, *parts, *strides, M, N, *drop)
    if cfg.smem:
        return (*head, *_smem_bwd_args(cfg, device), *parts, *strides, M, N, *_smem_bwd_tail(cfg))
    work = coop.workspace(M, 2, cfg.split, config.acc_dtype(head[0].dtype), device)
    return (*head, *work, *parts, *strides, M, N, cfg.split, 1, *drop)


def _forward(x, weight, bias, eps, is_rms, add=False, residual=None, h_dtype=None, dropout_p=0.0,
             seed=0):  # fmt: skip
    """-> (y, h or None, mean, rstd); h = dropout(x) + residual is formed and normalized if add."""
    M, N = x.shape
    kind = "add_norm" if add else "rms_norm" if is_rms else "layer_norm"
    smem_ok = _smem_fwd_ok(x, residual, add, dropout_p)
    cfg = config.forward(M, N, x.dtype, x.device, kind, smem_ok, _held(weight, bias))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty((M, N), dtype=h_dtype, device=x.device) if add else None
    rstd = torch.empty(M, dtype=config.acc_dtype(x.dtype), device=x.device)
    mean = rstd if is_rms else torch.empty_like(rstd)
    r = residual if residual is not None else x
    hh = h if add else y
    flags = dict(
        IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ADD=add,
        HAS_R=residual is not None, DROPOUT=add and dropout_p > 0,
        ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps,
    )  # fmt: skip
    head = (
        x, r, hh, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
        x.stride(0), r.stride(0), hh.stride(0), y.stride(0),
    )  # fmt: skip
    drop = _dropout_args(dropout_p, seed)
    tail = config.eps_tail(eps, x.device)
    # what decides the kernels' specialization, beyond the fresh outputs (launch.py's key=)
    key = (M, N, x.stride(0), r.stride(0), tensor_spec(x), tensor_spec(residual), tensor_spec(weight),
           tensor_spec(bias), h_dtype, is_rms, add, dropout_p > 0, int_spec(drop[0]))  # fmt: skip
    kernel, meta = _fwd_kernel(cfg, flags, N, x.dtype, x.device, is_rms, add)
    launch(kernel, cfg.grid, *_fwd_args(cfg, head, M, N, eps, tail, drop, x.device), key=key, **meta)
    return y, h, mean, rstd


def _smem_meta(cfg, flags, N) -> dict:
    """Launch keywords of ``_fwd_smem_kernel`` (``_fwd_smem_split_kernel`` for rows in parts) from its
    config and the forward's flags, for rows of N."""
    meta = dict(CHUNK=cfg.block_size, CHUNKS=cfg.buffers, SPARE=int(cfg.prefetch), IS_RMS=flags["IS_RMS"],
                HAS_W=flags["HAS_W"], HAS_B=flags["HAS_B"], num_warps=cfg.num_warps)  # fmt: skip
    if cfg.in_parts:
        width = cfg.buffers * cfg.block_size  # columns of a part's buffers
        return dict(meta, KP=triton.next_power_of_2(cfg.parts), RING=cfg.ring, DEPTH=cfg.depth,
                    ADD=flags["ADD"], HAS_R=flags["HAS_R"],
                    MASK=smem.parts_mask(N, cfg.parts, cfg.part, width, cfg.block_size))  # fmt: skip
    return dict(meta, ONE_PASS=cfg.buffers <= config.SMEM_ONE_PASS_MAX_CHUNKS)


def _smem_fwd_ok(x, residual, add, dropout_p=0.0) -> bool:
    """Whether the forward's streamed rows may take the shared-memory kernels (config decides):
    x's rows fit ``smem.fits``, and for the add-norms there is no dropout and the residual (if any)
    has x's dtype and fits too."""
    if not smem.rows_fit(x):
        return False
    if not add:
        return True
    return dropout_p == 0 and (residual is None or (residual.dtype == x.dtype and smem.rows_fit(residual)))


def _held(weight, bias) -> int:
    """Bytes a column of the weight and bias (held in shared memory by the rows in parts)."""
    return sum(t.element_size() for t in (weight, bias) if t is not None)


def _smem_bwd_meta(cfg, flags) -> dict:
    """(kernel, launch keywords) of the shared-memory backward config ``cfg`` (``_bwd_smem_kernel``,
    or ``_bwd_smem_split_kernel`` for rows in parts) and the backward's flags, HAS_DH aside."""
    keep = ("IS_RMS", "HAS_W", "HAS_DB", "HAS_DRES", "num_warps")
    meta = dict(CHUNK=cfg.block_size, CHUNKS=cfg.buffers, SPARE=int(cfg.prefetch))
    meta.update({k: flags[k] for k in keep})
    if cfg.in_parts:
        return _bwd_smem_split_kernel, dict(meta, KP=triton.next_power_of_2(cfg.parts), RING=cfg.ring)
    return _bwd_smem_kernel, meta


def _smem_bwd_args(cfg, device) -> tuple:
    """The shared-memory backward's arguments between rstd and the partials: the rows in parts'
    tagged-term workspace and its counter (smem.terms_workspace), or none."""
    if cfg.in_parts:
        return smem.terms_workspace(cfg.grid[0] // cfg.parts, cfg.parts, cfg.ring, device)
    return ()


def _smem_bwd_tail(cfg) -> tuple:
    """The shared-memory backward's trailing arguments after M, N: K for rows in parts."""
    return (cfg.parts,) if cfg.in_parts else ()


def _partial_rows(cfg) -> int:
    """dweight / dbias partial rows a backward config writes: one a program (one a row group for
    split rows and for shared-memory rows in parts)."""
    return cfg.grid[0] // cfg.parts if cfg.smem else cfg.grid[0] // cfg.split


def plan_row_norm(x, weight, bias, eps, is_rms, add=False, residual=None, h_dtype=None, grad=False):
    """A plan for LayerNorm / RMSNorm calls (and the add-norms without dropout, ``add``) shaped like
    this one (contract extension, used by normkit.functional), for contiguous inputs of x's M * N
    elements with the other tensors of the same presence, dtypes and alignment; the compiled kernels
    (fused, or split rows with a fresh workspace each call) are called directly (launch.Bound). None
    where a direction takes the looped kernels, or off the GPU.

    Inference (``grad`` False): ``run(input, residual, weight, bias)`` -> y, or (y, h) for the
    add-norms: one launch with nothing allocated but the outputs (and, for split rows, the
    statistics and the workspace). Training (``grad``): ``(forward, backward)``. ``forward(input,
    residual, weight, bias)`` -> (y, h, mean, rstd), h None but for the add-norms, mean = rstd for
    RMSNorm. ``backward(dy, dh, xn, weight, mean, rstd)`` -> (dx, dresidual, dweight, dbias), None
    where there is no such input; ``xn`` is the normalized tensor (input, or h), dy in the input's
    dtype (None: zeros, add-norms only), dh h's gradient or None; both contiguous and 16-byte
    aligned. The parameter gradients have shape (N,)."""
    M, N = x.shape
    kind = "add_norm" if add else "rms_norm" if is_rms else "layer_norm"
    cfg = config.forward(M, N, x.dtype, x.device, kind, _smem_fwd_ok(x, residual, add), _held(weight, bias))
    if x.device.type != "cuda" or not (cfg.fused or cfg.smem or cfg.split > 1):
        return None
    if grad:
        backward = _plan_backward(M, N, h_dtype if add else x.dtype, x.device, weight, bias, is_rms,
                                  x.dtype, None if residual is None else residual.dtype,
                                  smem.rows_fit(x))  # fmt: skip
        if backward is None:
            return None
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_B=bias is not None, ADD=add,
                 HAS_R=residual is not None, DROPOUT=False, ACC=config.tl_acc_dtype(x.dtype),
                 num_warps=cfg.num_warps)  # fmt: skip
    kernel, meta = _fwd_kernel(cfg, flags, N, x.dtype, x.device, is_rms, add, stats=grad)
    bound = Bound(kernel, cfg.grid, x.device.index, **meta)
    tail = config.eps_tail(eps, x.device)
    stat = config.acc_dtype(x.dtype)

    def rows(x, r, h, y, w, b, mean, rstd):
        head = (x, x if r is None else r, h, y, x if w is None else w, x if b is None else b, mean, rstd,
                N, N, N, N)  # fmt: skip
        bound(*_fwd_args(cfg, head, M, N, eps, tail, (0, 0.0, 1.0), x.device))

    def forward(x, r, w, b):
        y = torch.empty_like(x)
        h = torch.empty_like(x, dtype=h_dtype) if add else None
        rstd = torch.empty(M, dtype=stat, device=x.device)
        mean = rstd if is_rms else torch.empty_like(rstd)
        rows(x, r, y if h is None else h, y, w, b, mean, rstd)
        return y, h, mean, rstd

    def run(x, r, w, b):
        if not cfg.fused:  # the split and shared-memory kernels write the statistics (fused: compiled out)
            y, h, _, _ = forward(x, r, w, b)
            return (y, h) if add else y
        y = torch.empty_like(x)
        h = torch.empty_like(x, dtype=h_dtype) if add else y
        rows(x, r, h, y, w, b, y, y)
        return (y, h) if add else y

    return (forward, backward) if grad else run


def _plan_backward(M, N, dtype, device, weight, bias, is_rms, x_dtype, residual_dtype, rows_fit):
    """The training plan's backward (see :func:`plan_row_norm`) for (M, N) normalized rows of
    ``dtype`` (the input's, or h's), None where the looped backward serves: the fused, shared-memory
    (``rows_fit``: the input's rows fit ``smem.fits``; the plan's dy is contiguous and aligned) or
    split-row kernel (compiled with and without h's gradient, as calls come), then one launch
    summing the programs' partials; a grid of one program writes dweight / dbias itself (its
    partials are the sums: same values, one launch less). dx in ``x_dtype``; dresidual in
    ``residual_dtype``, None for none."""
    has_w, has_db, has_dres = weight is not None, bias is not None, residual_dtype is not None
    smem_ok = rows_fit and x_dtype.itemsize == 2
    cfg = config.backward(M, N, dtype, device, is_rms, smem_ok, has_w + has_db, has_dres)
    if not (cfg.fused or cfg.smem or cfg.split > 1):
        return None
    grads = (weight.dtype if has_w else None, bias.dtype if has_db else None)
    G = _partial_rows(cfg)
    direct = (cfg.fused or cfg.smem) and G == 1
    flags = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DB=has_db, HAS_DRES=has_dres, DROPOUT=False,
                 ACC=config.tl_acc_dtype(dtype), num_warps=cfg.num_warps)  # fmt: skip
    # (the plan's tensors are contiguous rows of N: one stride)
    kernels = [Bound(kernel, cfg.grid, device.index, **meta)
               for kernel, meta in (_bwd_kernel(cfg, flags, has_dh) for has_dh in (False, True))]  # fmt: skip
    summed = None if direct or not any(grads) else reduce.plan_sum(G, N, grads, device)
    acc = config.acc_dtype(dtype)

    def backward(dy, dh, xn, w, mean, rstd):
        if dy is None:
            dy = torch.zeros_like(xn, dtype=x_dtype)
        dx = torch.empty_like(xn, dtype=x_dtype)
        dres = torch.empty_like(xn, dtype=residual_dtype) if has_dres else None
        buf, (dw, db) = reduce.targets(grads, G, N, acc, xn.device, direct)
        head = (xn, dy, dy if dh is None else dh, dx, dx if dres is None else dres, xn if w is None else w,
                mean, rstd)  # fmt: skip
        parts = (rstd if dw is None else dw, rstd if db is None else db)
        kernels[dh is not None](*_bwd_args(cfg, head, parts, (N,) * 5, M, N, (0, 0.0, 1.0), xn.device))
        if buf is not None:
            dw, db = summed(buf)
        return dx, dres, dw, db

    return backward


def _backward(dy, x, weight, mean, rstd, bias_dtype, is_rms, dh=None, x_dtype=None,
              residual_dtype=None, dropout_p=0.0, seed=0):  # fmt: skip
    """-> (dx, dresidual or None, dweight or None, dbias or None).

    ``x`` is the normalized tensor (h for the add-norm). dx is returned in ``x_dtype`` (default
    x.dtype); for the add-norm, h's incoming gradient ``dh`` is added first and dx goes through the
    dropout mask, and dresidual (in ``residual_dtype``) is written when there was a residual.
    """
    M, N = x.shape
    has_w, has_db, has_dres = weight is not None, bias_dtype is not None, residual_dtype is not None
    smem_ok = dropout_p == 0 and dy.dtype.itemsize == 2 and smem.rows_fit(x) and smem.rows_fit(dy)
    cfg = config.backward(M, N, x.dtype, x.device, is_rms, smem_ok, has_w + has_db, has_dres, dropout_p > 0)
    acc = config.acc_dtype(x.dtype)
    dx = torch.empty((M, N), dtype=x_dtype or x.dtype, device=x.device)
    dres = torch.empty((M, N), dtype=residual_dtype, device=x.device) if residual_dtype else None
    grad_dtypes = (weight.dtype if has_w else None, bias_dtype)
    G = _partial_rows(cfg)
    direct = (cfg.fused or cfg.smem) and G == 1  # one program: its partials are the sums, written as such
    part_buf, (dweight, dbias) = reduce.targets(grad_dtypes, G, N, acc, x.device, direct)
    dw_part = rstd if dweight is None else dweight  # a placeholder pointer when unused
    db_part = rstd if dbias is None else dbias
    w = weight if has_w else x
    dh_ = dh if dh is not None else dy
    dres_ = dres if dres is not None else dx
    flags = dict(IS_RMS=is_rms, HAS_W=has_w, HAS_DB=has_db, HAS_DRES=dres is not None, DROPOUT=dropout_p > 0,
                 ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps)  # fmt: skip
    strides = (x.stride(0), dy.stride(0), dh_.stride(0), dx.stride(0), dres_.stride(0))
    drop = _dropout_args(dropout_p, seed)
    # what decides the kernels' specialization, beyond the fresh outputs (launch.py's key=)
    key = (M, N, strides, *map(tensor_spec, (x, dy, dh, weight, mean, rstd)), x_dtype, residual_dtype,
           bias_dtype, is_rms, dropout_p > 0, int_spec(drop[0]))  # fmt: skip
    head = (x, dy, dh_, dx, dres_, w, mean, rstd)
    if cfg.fused or cfg.smem or cfg.split > 1:
        kernel, meta = _bwd_kernel(cfg, flags, dh is not None, len(set(strides)) == 1)
        args = _bwd_args(cfg, head, (dw_part, db_part), strides, M, N, drop, x.device)
        launch(kernel, cfg.grid, *args, key=key, **meta)
    else:
        c1 = torch.empty(M, dtype=acc, device=x.device)
        c2 = c1 if is_rms else torch.empty_like(c1)
        sweep = config.row_sweep(M, N, x.dtype)
        launch(_bwd_row_terms_kernel, sweep.grid,
            x, dy, w, mean, rstd, c1, c2, x.stride(0), dy.stride(0), N, key=key,
            BLOCK_N=sweep.block_size, IS_RMS=is_rms, HAS_W=has_w,
            ACC=config.tl_acc_dtype(x.dtype), num_warps=sweep.num_warps,
        )  # fmt: skip
        launch(_bwd_looped_kernel, cfg.grid,
            x, dy, dh_, dx, dres_, w, mean, rstd, c1, c2, dw_part, db_part, *strides, M, N,
            cfg.rows_per_program, *drop, key=key, BLOCK_N=cfg.block_size, HAS_DH=dh is not None, **flags,
        )  # fmt: skip
    if part_buf is not None:
        dweight, dbias = reduce.sum_partials(part_buf, grad_dtypes)
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
