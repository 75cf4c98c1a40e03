"""BatchNorm on NVIDIA GPUs (training and eval): kernels, then launchers.

A column reduction, unlike the row norms: channel c's statistics run over N samples x HW of a
contiguous (N, C, HW) input. A channels-last input (memory (N, HW, C)) comes as the contiguous
(N * HW, C, 1) batch of the same memory (the front end's view: same statistics, read in place); HW
= 1 inputs take the two-pass kernels below with [samples, channels] tiles (``_*_cols_kernel``).

Split channels (``config.batch_norm_split``; where channels in parts, below, do not serve): the
rows of coop.py applied to channels. The K programs of a channel each take a chunk of its N * HW
values (runs of whole samples' HW columns, so each chunk reads long stretches of memory), publish
the chunk's partial statistics (forward) or gradient sums (backward), meet at the channel's
counter, merge the K partials in a fixed order (bitwise reproducible) and finish their chunk: the
training forward reads x from HBM once (the chunk again from L2 after the barrier), the backward x
and dy once (held in registers), and the k = 0 program writes the channel's statistics, running
statistics or dweight / dbias. Pipelined settings publish the next channel's chunk before waiting
on this one. A channel group whose K programs did not all start in time (``coop.join``: SMs held by
another stream's kernel; always under the interpreter, CPU tensors) runs solo: each program
publishes every chunk of the channel itself (``_fwd_split_solo`` / ``_bwd_split_solo``, the same
bits) instead of waiting.

Two-pass (HW < ``config.BATCH_NORM_SPLIT_MIN_HW``, channels too long to split): each channel's
samples are cut into ``parts`` slices (``config.batch_norm_sums``) so that the whole GPU works on a
few hundred channels: program (slice, channel) walks [samples, HW] tiles and writes partial
statistics (sums of x - x[0, c, 0] and its square: accurate for large means); a small kernel merges
the slices by Chan's formula in a fixed order, computes rstd and updates the running statistics in
place. The apply and dx kernels are elementwise over [rows, HW] tiles of the (N * C, HW) rows; the
backward's per-channel sums of dy and dy * xhat (= dbias, dweight) are partial rows summed by
``reduce.sum_partials``. This reads x twice in training (statistics, then apply) and x and dy twice
in the backward: 3 / 2 and 5 / 3 of the bytes a single pass moves (docs/tuning-log.md T72, T73).

Channels in parts (``config.batch_norm_smem``; HW a multiple of 16, 16-byte aligned tensors): the
row norms' rows in parts held in shared memory with a channel for a row, for the training forward
(x read once) and the backward (x and dy read once); split channels serve the other shapes."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from normkit.backends.common import exact_eps, reciprocal
from normkit.backends.cuda import config, coop, reduce, smem
from normkit.backends.cuda import layer_norm as ln
from normkit.backends.cuda.coop import arrive, join, wait
from normkit.backends.cuda.launch import Bound, launch
from normkit.backends.cuda.smem import cp, gl
from normkit.reference import train_fwd_from


@triton.jit
def _slice_tile(s, rs, hs, N, C, HW, c, SAMPLES, RB: tl.constexpr, HWB: tl.constexpr):
    """Offsets and mask of the [RB samples, HWB columns] tile of channel ``c`` at sample
    ``s * SAMPLES + rs`` (within slice s) and column ``hs``."""
    n = s * SAMPLES + rs + tl.arange(0, RB)
    hw = hs + tl.arange(0, HWB)
    mask = ((n < N) & (n < (s + 1) * SAMPLES))[:, None] & (hw < HW)[None, :]
    at = (n.to(tl.int64) * C + c)[:, None] * HW + hw[None, :]
    return at, mask


@triton.jit
def _stats_part_kernel(
    X,  # (N, C, HW) contiguous input
    Mean_part,  # (parts, C) out, ACC: mean of x - x[0, c, 0] over slice s of channel c
    M2_part,  # (parts, C) out, ACC: sum of squared deviations from that mean (merged by Chan's formula)
    N,
    C,
    HW,
    SAMPLES,  # samples per slice; program p = s * C + c
    RB: tl.constexpr,  # samples per tile
    HWB: tl.constexpr,  # columns per tile
    ACC: tl.constexpr,
):
    p = tl.program_id(0)
    s = p // C
    c = p % C
    # Sums of x - x[0, c, 0] and its square in tile-shaped accumulators (no reduction inside the
    # loop, so loads stream); M2 = sum(d^2) - sum(d)^2 / n is exact enough once the shift has taken
    # the channel's mean out (a first version merged every tile by Chan's formula: 0.29-0.75 of
    # copy for this read-only pass on H100, docs/tuning-log.md T72).
    shift = tl.load(X + c.to(tl.int64) * HW).to(ACC)
    s1 = tl.zeros([RB, HWB], ACC)
    s2 = tl.zeros([RB, HWB], ACC)
    rows = tl.minimum(SAMPLES, N - s * SAMPLES)
    for rs in range(0, rows, RB):
        for hs in range(0, HW, HWB):
            at, mask = _slice_tile(s, rs, hs, N, C, HW, c, SAMPLES, RB, HWB)
            xs = tl.where(mask, tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift, 0.0)
            s1 += xs
            s2 += xs * xs
    sum1 = tl.sum(tl.sum(s1, axis=1), axis=0)
    mean = sum1 / tl.cast(rows * HW, ACC)
    tl.store(Mean_part + p, mean)
    m2 = tl.sum(tl.sum(s2, axis=1), axis=0) - sum1 * mean  # NaN for a slice holding +-inf, as torch
    tl.store(M2_part + p, tl.maximum(m2, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _cols(p, C, CB: tl.constexpr):
    """Program ``p`` = (slice s, channel block) of the HW = 1 sums: s, its channels and their mask."""
    blocks = tl.cdiv(C, CB)
    c = (p % blocks) * CB + tl.arange(0, CB)
    return p // blocks, c, c < C


@triton.jit
def _cols_tile(s, c, cm, N, C, SAMPLES, rs, RB: tl.constexpr):
    """Offsets and mask of the [RB samples, channels ``c``] tile at sample ``s * SAMPLES + rs`` of
    an (N, C) input (HW = 1)."""
    n = s * SAMPLES + rs + tl.arange(0, RB)
    mask = ((n < N) & (n < (s + 1) * SAMPLES))[:, None] & cm[None, :]
    return n.to(tl.int64)[:, None] * C + c[None, :], mask


@triton.jit
def _stats_part_cols_kernel(
    X,  # (N, C) contiguous input (HW = 1: BatchNorm1d, or a channels-last input as (N * HW, C))
    Mean_part,  # (parts, C) out, ACC: as _stats_part_kernel's
    M2_part,  # (parts, C) out, ACC
    N,
    C,
    SAMPLES,  # samples per slice; program p = s * cdiv(C, CB) + channel block
    RB: tl.constexpr,  # samples per tile
    CB: tl.constexpr,  # channels per tile (contiguous in memory)
    ACC: tl.constexpr,
):
    """_stats_part_kernel for HW = 1 in [samples, channels] tiles: a warp reads consecutive
    channels of a sample (one value a 32-byte sector in [samples, 1] tiles)."""
    s, c, cm = _cols(tl.program_id(0), C, CB)
    shift = tl.load(X + c, mask=cm, other=0.0).to(ACC)
    s1 = tl.zeros([RB, CB], ACC)
    s2 = tl.zeros([RB, CB], ACC)
    rows = tl.minimum(SAMPLES, N - s * SAMPLES)
    for rs in range(0, rows, RB):
        at, mask = _cols_tile(s, c, cm, N, C, SAMPLES, rs, RB)
        xs = tl.where(mask, tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift[None, :], 0.0)
        s1 += xs
        s2 += xs * xs
    sum1 = tl.sum(s1, axis=0)
    mean = sum1 / tl.cast(rows, ACC)
    tl.store(Mean_part + s * C + c, mean, mask=cm)
    m2 = tl.sum(s2, axis=0) - sum1 * mean  # NaN for a slice holding +-inf, as torch
    tl.store(M2_part + s * C + c, tl.maximum(m2, 0.0, propagate_nan=tl.PropagateNan.ALL), mask=cm)


@triton.jit
def _stats_merge_kernel(
    X,  # (N, C, HW) input (for each channel's shift x[0, c, 0])
    Mean_part,  # (parts, C) from _stats_part_kernel
    M2_part,  # (parts, C)
    Mean,  # (C,) out, ACC
    Rstd,  # (C,) out, ACC: 1 / sqrt(biased variance + eps)
    RMean,  # (C,) running mean, updated in place (unread unless HAS_RM)
    RVar,  # (C,) running variance, updated in place with the unbiased variance (unless HAS_RV)
    N,
    C,
    HW,
    SAMPLES,
    parts,
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    momentum,
    momentum_lo,  # momentum - fp32(momentum): fp64 kernels add it back (exact_eps), as the tails below
    unbias,  # count / (count - 1)
    unbias_lo,
    BLOCK: tl.constexpr,  # channels per program
    HAS_RM: tl.constexpr,
    HAS_RV: tl.constexpr,
    ACC: tl.constexpr,
):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = c < C
    mean = tl.zeros([BLOCK], ACC)
    m2 = tl.zeros([BLOCK], ACC)
    seen = tl.zeros((), ACC)
    for s in range(0, parts):  # slices in order: bitwise reproducible
        count = tl.cast(tl.minimum(SAMPLES, N - s * SAMPLES) * HW, ACC)
        pm = tl.load(Mean_part + s * C + c, mask=cm, other=0.0)
        pm2 = tl.load(M2_part + s * C + c, mask=cm, other=0.0)
        delta = pm - mean
        total = seen + count
        mean = mean + delta * (count / total)
        m2 = m2 + pm2 + delta * delta * (seen * count / total)
        seen = total
    mean += tl.load(X + tl.cast(c, tl.int64) * HW, mask=cm, other=0.0).to(ACC)  # the shift back
    var = m2 / seen
    tl.store(Mean + c, mean, mask=cm)
    tl.store(Rstd + c, 1.0 / tl.sqrt(var + exact_eps(eps, eps_lo, ACC)), mask=cm)
    m = exact_eps(momentum, momentum_lo, ACC)
    if HAS_RM:
        rm = tl.load(RMean + c, mask=cm, other=0.0).to(ACC)
        tl.store(RMean + c, ((1 - m) * rm + m * mean).to(RMean.dtype.element_ty), mask=cm)
    if HAS_RV:
        rv = tl.load(RVar + c, mask=cm, other=0.0).to(ACC)
        rv = (1 - m) * rv + m * (var * exact_eps(unbias, unbias_lo, ACC))
        tl.store(RVar + c, rv.to(RVar.dtype.element_ty), mask=cm)


@triton.jit
def _row_tile(t, rows, HW, C, RB: tl.constexpr, HWB: tl.constexpr):
    """Tile ``t`` of the (rows = N * C, HW) view: offsets, mask, and each tile row's channel."""
    col_tiles = tl.cdiv(HW, HWB)
    r = (t // col_tiles) * RB + tl.arange(0, RB)
    hw = (t % col_tiles) * HWB + tl.arange(0, HWB)
    row_mask = r < rows
    mask = row_mask[:, None] & (hw < HW)[None, :]
    return r.to(tl.int64)[:, None] * HW + hw[None, :], mask, r % C, row_mask


@triton.jit
def _apply_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (C,) batch or running mean
    Rstd,  # (C,) 1 / sqrt(var + eps)
    rows,  # N * C
    C,
    HW,
    RB: tl.constexpr,  # rows per tile; one program per [RB, HWB] tile
    HWB: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    at, mask, c, row_mask = _row_tile(tl.program_id(0), rows, HW, C, RB, HWB)
    scale = tl.load(Rstd + c, mask=row_mask, other=0.0).to(ACC)
    if HAS_W:
        scale = scale * tl.load(W + c, mask=row_mask, other=0.0).to(ACC)
    shift = -tl.load(Mean + c, mask=row_mask, other=0.0).to(ACC) * scale
    if HAS_B:
        shift = shift + tl.load(B + c, mask=row_mask, other=0.0).to(ACC)
    x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
    tl.store(Y + at, (x * scale[:, None] + shift[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _grad_sums_part_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy_xhat_part,  # (parts, C) out, ACC
    Sum_dy_part,  # (parts, C) out, ACC
    N,
    C,
    HW,
    SAMPLES,  # samples per slice; program p = s * C + c
    RB: tl.constexpr,
    HWB: tl.constexpr,
    ACC: tl.constexpr,
):
    p = tl.program_id(0)
    s = p // C
    c = p % C
    mean = tl.load(Mean + c).to(ACC)
    rstd = tl.load(Rstd + c).to(ACC)
    s_dy = tl.zeros([RB, HWB], ACC)  # tile accumulators, reduced once at the end
    s_dyx = tl.zeros([RB, HWB], ACC)
    rows = tl.minimum(SAMPLES, N - s * SAMPLES)
    for rs in range(0, rows, RB):
        for hs in range(0, HW, HWB):
            at, mask = _slice_tile(s, rs, hs, N, C, HW, c, SAMPLES, RB, HWB)
            x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
            dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
            s_dy += dy
            s_dyx += tl.where(mask, (x - mean) * rstd, 0.0) * dy
    tl.store(Sum_dy_xhat_part + p, tl.sum(tl.sum(s_dyx, axis=1), axis=0))
    tl.store(Sum_dy_part + p, tl.sum(tl.sum(s_dy, axis=1), axis=0))


@triton.jit
def _grad_sums_part_cols_kernel(
    X,  # (N, C) forward input (HW = 1)
    DY,  # (N, C) output gradient, contiguous
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy_xhat_part,  # (parts, C) out, ACC
    Sum_dy_part,  # (parts, C) out, ACC
    N,
    C,
    SAMPLES,
    RB: tl.constexpr,
    CB: tl.constexpr,
    ACC: tl.constexpr,
):
    """_grad_sums_part_kernel for HW = 1 in [samples, channels] tiles (see _stats_part_cols_kernel)."""
    s, c, cm = _cols(tl.program_id(0), C, CB)
    mean = tl.load(Mean + c, mask=cm, other=0.0).to(ACC)
    rstd = tl.load(Rstd + c, mask=cm, other=0.0).to(ACC)
    s_dy = tl.zeros([RB, CB], ACC)
    s_dyx = tl.zeros([RB, CB], ACC)
    rows = tl.minimum(SAMPLES, N - s * SAMPLES)
    for rs in range(0, rows, RB):
        at, mask = _cols_tile(s, c, cm, N, C, SAMPLES, rs, RB)
        x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
        s_dy += dy
        s_dyx += tl.where(mask, (x - mean[None, :]) * rstd[None, :], 0.0) * dy
    tl.store(Sum_dy_xhat_part + s * C + c, tl.sum(s_dyx, axis=0), mask=cm)
    tl.store(Sum_dy_part + s * C + c, tl.sum(s_dy, axis=0), mask=cm)


@triton.jit
def _dx_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (C,)
    Rstd,  # (C,)
    Sum_dy_xhat,  # (C,) ACC, from the partial sums
    Sum_dy,  # (C,) ACC
    rows,  # N * C
    C,
    HW,
    count,  # N * HW: values per channel (1 / count is formed here, exact in fp64)
    RB: tl.constexpr,  # rows per tile; one program per [RB, HWB] tile
    HWB: tl.constexpr,
    HAS_W: tl.constexpr,
    TRAINING: tl.constexpr,  # statistics came from this batch (their gradient flows to x)
    ACC: tl.constexpr,
):
    """Training: w * rstd * (dy - (sum_dy + xhat * sum_dy_xhat) / count); eval: w * rstd * dy."""
    at, mask, c, row_mask = _row_tile(tl.program_id(0), rows, HW, C, RB, HWB)
    rstd = tl.load(Rstd + c, mask=row_mask, other=0.0).to(ACC)
    scale = rstd
    if HAS_W:
        scale = scale * tl.load(W + c, mask=row_mask, other=0.0).to(ACC)
    dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
    if TRAINING:
        inv_count = reciprocal(count, ACC)
        mean = tl.load(Mean + c, mask=row_mask, other=0.0).to(ACC)
        a = tl.load(Sum_dy + c, mask=row_mask, other=0.0) * inv_count
        b = tl.load(Sum_dy_xhat + c, mask=row_mask, other=0.0) * inv_count
        x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
        dy = dy - (a[:, None] + (x - mean[:, None]) * rstd[:, None] * b[:, None])
    tl.store(DX + at, (dy * scale[:, None]).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _chunk(k, L, HW, CHW, CHUNK: tl.constexpr, VEC: tl.constexpr):
    """Offsets (from channel 0's first value) and mask of chunk ``k`` of a channel, whose L = N * HW
    values are taken in (sample, column) order: value j = n * HW + hw lies at n * C * HW + hw
    (``CHW`` = C * HW). A [CHUNK // VEC, VEC] tile of runs of VEC values; VEC divides HW, so a run
    never crosses a sample and the sample index is formed once per run, and the runs of one sample
    are contiguous: a chunk reads HW-long stretches of memory (a [samples, HW block] tile, reading
    HW-block-long ones, measured slower in both directions: docs/tuning-log.md T73)."""
    start = k * CHUNK + tl.arange(0, CHUNK // VEC) * VEC
    n = (start // HW).to(tl.int64)
    j = start[:, None] + tl.arange(0, VEC)[None, :]
    return j.to(tl.int64) + (n * (CHW - HW))[:, None], j < L


@triton.jit
def _fwd_split_publish(X, c, HW, at, mask, inv_k, Part, Count, k, KP: tl.constexpr, ACC: tl.constexpr):
    """Load this program's chunk of channel ``c``, write its statistics (mean of x - x[0, c, 0], M2
    about that mean) and arrive at the channel's counter."""
    base = tl.cast(c, tl.int64) * HW
    xs = tl.where(mask, tl.load(X + base + at, mask=mask, other=0.0).to(ACC) - tl.load(X + base).to(ACC), 0.0)
    mean_k = tl.sum(tl.sum(xs, axis=1), axis=0) * inv_k
    d = tl.where(mask, xs - mean_k, 0.0)
    part = Part + tl.cast(c, tl.int64) * (2 * KP)
    tl.store(part + k, mean_k)
    tl.store(part + KP + k, tl.sum(tl.sum(d * d, axis=1), axis=0))
    arrive(Count + c)


@triton.jit
def _fwd_split_solo(X, c, L, C, HW, Part, Count, K, CHUNK: tl.constexpr, VEC: tl.constexpr, KP: tl.constexpr,
                    ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``c`` before its channel loop: publish every chunk of channel
    ``c`` itself, as the K partners would (the same offsets, counts and code: the same bits)."""
    for j in range(K):
        at, mask = _chunk(j, L, HW, tl.cast(C, tl.int64) * HW, CHUNK, VEC)
        inv_j = reciprocal(tl.minimum(L - j * CHUNK, CHUNK), ACC)
        _fwd_split_publish(X, c, HW, at, mask, inv_j, Part, Count, j, KP, ACC)


@triton.jit
def _fwd_split_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (C,) out, ACC
    Rstd,  # (C,) out, ACC
    RMean,  # (C,) running mean (read when HAS_RM)
    RVar,  # (C,) running variance (read when HAS_RV)
    RMeanOut,  # (C,) out: the running mean after this step (written when HAS_RM)
    RVarOut,  # (C,) out: the running variance after this step, with the unbiased variance (HAS_RV)
    Part,  # (C, 2, KP) ACC workspace: per-chunk mean of x - x[0, c, 0] and M2 about it
    Count,  # (2 C,) int32, zeroed: the channel barriers, then the channel groups' start words (coop.join)
    L,  # values per channel: N * HW
    C,
    HW,
    K,  # chunks per channel; program pid holds chunk pid % K of the channels of group pid // K
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    momentum,
    momentum_lo,  # momentum - fp32(momentum): fp64 kernels add it back (exact_eps), as unbias_lo
    unbias,  # count / (count - 1)
    unbias_lo,
    CHUNK: tl.constexpr,  # values per program
    VEC: tl.constexpr,  # values per run: a power of two dividing HW
    KP: tl.constexpr,  # power of two >= K
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_RM: tl.constexpr,
    HAS_RV: tl.constexpr,
    ACC: tl.constexpr,
    PIPELINE: tl.constexpr,  # the next channel's statistics published before this channel's wait
    SPIN: tl.constexpr,  # polls to wait for the channel group to fill (coop.join)
):
    """Training forward, x read from HBM once: the K programs of a channel each publish their
    chunk's statistics, meet at the channel's barrier (coop.py), merge the K partials in a fixed
    order (Chan) and normalize their chunk, read again from L2 (holding it in registers through the
    barrier measured slower: fewer programs per SM; docs/tuning-log.md T73). The k = 0 program writes the
    channel's statistics and running statistics."""
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    k = pid % K
    together = join(Count + C + pid // K, K, SPIN)
    # A solo program (its channel group did not fill: coop.join) publishes every chunk of its
    # channels first, where little else is live, so the channel loop keeps its registers.
    if together == 0:
        for c in range(pid // K, C, groups):
            _fwd_split_solo(X, c, L, C, HW, Part, Count, K, CHUNK, VEC, KP, ACC)
    at, mask = _chunk(k, L, HW, tl.cast(C, tl.int64) * HW, CHUNK, VEC)
    ks = tl.arange(0, KP)
    counts = tl.cast(tl.maximum(tl.minimum(L - ks * CHUNK, CHUNK), 0), ACC)  # values per chunk
    inv_k = reciprocal(tl.minimum(L - k * CHUNK, CHUNK), ACC)
    inv_n = reciprocal(L, ACC)
    if PIPELINE:
        _fwd_split_publish(X, pid // K, HW, at, mask, inv_k, Part, Count, k, KP, ACC)
    for c in range(pid // K, C, groups):
        if PIPELINE:
            if c + groups < C:
                _fwd_split_publish(X, c + groups, HW, at, mask, inv_k, Part, Count, k, KP, ACC)
        else:
            _fwd_split_publish(X, c, HW, at, mask, inv_k, Part, Count, k, KP, ACC)
        if together:
            wait(Count + c, K)
        part = Part + tl.cast(c, tl.int64) * (2 * KP)
        p1 = tl.load(part + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        p2 = tl.load(part + KP + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        mean = tl.sum(p1 * counts, axis=0) * inv_n
        dm = p1 - mean
        var = (tl.sum(p2, axis=0) + tl.sum(counts * dm * dm, axis=0)) * inv_n
        rstd = 1.0 / tl.sqrt(var + exact_eps(eps, eps_lo, ACC))
        base = tl.cast(c, tl.int64) * HW
        shift = tl.load(X + base).to(ACC)
        if k == 0:
            tl.store(Mean + c, shift + mean)
            tl.store(Rstd + c, rstd)
            m = exact_eps(momentum, momentum_lo, ACC)
            if HAS_RM:
                rm = (1 - m) * tl.load(RMean + c).to(ACC) + m * (shift + mean)
                tl.store(RMeanOut + c, rm.to(RMeanOut.dtype.element_ty))
            if HAS_RV:
                rv = (1 - m) * tl.load(RVar + c).to(ACC) + m * (var * exact_eps(unbias, unbias_lo, ACC))
                tl.store(RVarOut + c, rv.to(RVarOut.dtype.element_ty))
        scale = rstd
        if HAS_W:
            scale = scale * tl.load(W + c).to(ACC)
        y = (tl.load(X + base + at, mask=mask, other=0.0).to(ACC) - shift - mean) * scale
        if HAS_B:
            y = y + tl.load(B + c).to(ACC)
        tl.store(Y + base + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_split_load(X, DY, c, C, HW, at, mask):
    """This program's chunk of x and dy of channel ``c`` (zeros past the last channel)."""
    base = tl.cast(c, tl.int64) * HW
    inside = tl.where(c < C, mask, False)  # a select: see coop.load_chunk
    x = tl.load(X + base + at, mask=inside, other=0.0)
    return x, tl.load(DY + base + at, mask=inside, other=0.0)


@triton.jit
def _bwd_split_publish(x, dy, c, Mean, Rstd, Part, Count, k, mask, KP: tl.constexpr, ACC: tl.constexpr):
    """Write this chunk's sums of dy * xhat and dy for channel ``c`` and arrive at its counter."""
    xhat = tl.where(mask, (x.to(ACC) - tl.load(Mean + c)) * tl.load(Rstd + c), 0.0)
    dy = dy.to(ACC)
    part = Part + tl.cast(c, tl.int64) * (2 * KP)
    tl.store(part + k, tl.sum(tl.sum(xhat * dy, axis=1), axis=0))
    tl.store(part + KP + k, tl.sum(tl.sum(dy, axis=1), axis=0))
    arrive(Count + c)


@triton.jit
def _bwd_split_solo(X, DY, c, Mean, Rstd, Part, Count, L, C, HW, K, CHUNK: tl.constexpr, VEC: tl.constexpr,
                    KP: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``c`` before its channel loop: publish every chunk's sums of
    channel ``c`` itself, as the K partners would."""
    for j in range(K):
        at, mask = _chunk(j, L, HW, tl.cast(C, tl.int64) * HW, CHUNK, VEC)
        x, dy = _bwd_split_load(X, DY, c, C, HW, at, mask)
        _bwd_split_publish(x, dy, c, Mean, Rstd, Part, Count, j, mask, KP, ACC)


@triton.jit
def _bwd_split_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, contiguous
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (C,) ACC
    Rstd,  # (C,) ACC
    DW,  # (C,) out: sum of dy * xhat, in its dtype (written when HAS_W)
    DB,  # (C,) out: sum of dy (written when HAS_DB)
    Part,  # (C, 2, KP) ACC workspace: per-chunk sums of dy * xhat and of dy
    Count,  # (2 C,) int32, zeroed: the channel barriers, then the channel groups' start words (coop.join)
    L,  # values per channel: N * HW
    C,
    HW,
    K,  # chunks per channel; program pid holds chunk pid % K of the channels of group pid // K
    CHUNK: tl.constexpr,
    VEC: tl.constexpr,
    KP: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    TRAINING: tl.constexpr,  # statistics came from this batch (their gradient flows to x)
    ACC: tl.constexpr,
    PIPELINE: tl.constexpr,  # the next channel's chunks loaded and published before this one's wait
    SPIN: tl.constexpr,  # polls to wait for the channel group to fill (coop.join)
):
    """Backward, x and dy read from HBM once: per-channel sums through the channel barrier as in
    the forward; dweight / dbias are those sums, written by the k = 0 program (no partial rows)."""
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    k = pid % K
    at, mask = _chunk(k, L, HW, tl.cast(C, tl.int64) * HW, CHUNK, VEC)
    ks = tl.arange(0, KP)
    inv_n = reciprocal(L, ACC)
    c0 = pid // K
    together = join(Count + C + c0, K, SPIN)
    # A solo program (its channel group did not fill: coop.join) publishes every chunk of its
    # channels first, where little else is live, so the channel loop keeps its registers.
    if together == 0:
        for c in range(c0, C, groups):
            _bwd_split_solo(X, DY, c, Mean, Rstd, Part, Count, L, C, HW, K, CHUNK, VEC, KP, ACC)
    if PIPELINE:
        x_next, dy_next = _bwd_split_load(X, DY, c0, C, HW, at, mask)
        _bwd_split_publish(x_next, dy_next, c0, Mean, Rstd, Part, Count, k, mask, KP, ACC)
    for c in range(c0, C, groups):
        if PIPELINE:
            x, dy = x_next, dy_next
            x_next, dy_next = _bwd_split_load(X, DY, c + groups, C, HW, at, mask)
            if c + groups < C:
                _bwd_split_publish(x_next, dy_next, c + groups, Mean, Rstd, Part, Count, k, mask, KP, ACC)
        else:
            x, dy = _bwd_split_load(X, DY, c, C, HW, at, mask)
            _bwd_split_publish(x, dy, c, Mean, Rstd, Part, Count, k, mask, KP, ACC)
        if together:
            wait(Count + c, K)
        part = Part + tl.cast(c, tl.int64) * (2 * KP)
        s_dyx = tl.sum(tl.load(part + ks, mask=ks < K, other=0.0, cache_modifier=".cg"), axis=0)
        s_dy = tl.sum(tl.load(part + KP + ks, mask=ks < K, other=0.0, cache_modifier=".cg"), axis=0)
        if k == 0:
            if HAS_W:
                tl.store(DW + c, s_dyx.to(DW.dtype.element_ty))
            if HAS_DB:
                tl.store(DB + c, s_dy.to(DB.dtype.element_ty))
        rstd = tl.load(Rstd + c)
        scale = rstd
        if HAS_W:
            scale = scale * tl.load(W + c).to(ACC)
        g = dy.to(ACC)
        if TRAINING:
            xhat = (x.to(ACC) - tl.load(Mean + c)) * rstd
            g = g - (s_dy + xhat * s_dyx) * inv_n
        tl.store(DX + tl.cast(c, tl.int64) * HW + at, (g * scale).to(DX.dtype.element_ty), mask=mask)


@smem.jit
def _fwd_smem_split_kernel(
    X,  # (N, C, HW) contiguous input, 16-bit or fp32, 16-byte aligned; HW a multiple of 16
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (C,) fp32 out
    Rstd,  # (C,) fp32 out
    RMean,  # (C,) running mean (read when HAS_RM)
    RVar,  # (C,) running variance (read when HAS_RV)
    RMeanOut,  # (C,) out: the running mean after this step (written when HAS_RM)
    RVarOut,  # (C,) out: the running variance after this step, with the unbiased variance (HAS_RV)
    Terms,  # (groups, RING, 2, KP) int64, zeroed: part k's channel terms, tagged (smem.row_terms)
    Done,  # (groups,) int64 counters, zero: a group's last program done zeroes its Terms (smem.release)
    L,  # values a channel: N * HW, taken in (sample, column) order
    C,
    HW,  # a multiple of 16
    GAP,  # (C - 1) * HW: from a sample's run of a channel to the next sample's (smem.run_offsets)
    K,  # parts a channel: program pid holds part pid % K (values [k * P, min(L, (k + 1) * P))) of
    # channel group pid // K
    P,  # values a part, a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]; L <= K * P
    eps,
    momentum,
    unbias,  # L / (L - 1)
    CHUNK: gl.constexpr,  # values per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a part
    SPARE: gl.constexpr,  # extra buffers (0 or 1)
    DEPTH: gl.constexpr,  # rows of buffers: a channel's copies start DEPTH - 1 channel steps early
    KP: gl.constexpr,  # next_pow2(K)
    RING: gl.constexpr,  # term slots a channel group (>= smem.MIN_RING)
    HAS_W: gl.constexpr,
    HAS_B: gl.constexpr,
    HAS_RM: gl.constexpr,
    HAS_RV: gl.constexpr,
    MASK: gl.constexpr,  # which chunks may hold values past their part (smem.parts_mask)
):
    """Training forward, x read from HBM once and held on chip: the row norms' rows in parts
    (layer_norm._fwd_smem_split_kernel) with a channel for a row. K co-resident programs share a
    channel's L = N * HW values (grid = groups x K <= SMs, one program per SM), each streaming its
    part of the channels group, group + groups, ... through shared memory DEPTH channels deep
    (runs of HW values, smem.run_offsets). Per channel step: the next channel's part moments (of x
    - x[0, c, 0], each thread's own, merged once) are published; this channel's K terms are
    gathered and merged by Chan's formula in k's order (the same bits in every part, every run),
    and the part is normalized from its buffers while they take the channel after next. The k = 0
    program writes the channel's statistics and running statistics (read before written: in place
    is safe)."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # 16 bytes a thread and copy
    T: gl.constexpr = 32 * NW
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    lay3: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    NBUF: gl.constexpr = DEPTH * CHUNKS + SPARE
    pid, group, groups, k, offs, end, col0 = smem.part_of(L, K, P, CHUNK, layout)
    valid = end - col0  # > c * CHUNK: chunk c's value is in the part
    bx, _ = smem.open_parts(X, C, HW, group, groups, end, col0, CHUNK, CHUNKS, NBUF, HW=HW, GAP=GAP)
    ks = gl.arange(0, KP, layout=small)
    counts = gl.minimum(gl.maximum(L - ks * P, 0), P).to(gl.float32)  # values of each part
    inv_n = 1.0 / L.to(gl.float32)
    # each channel's shift x[0, c, 0], loaded a channel step before its use
    shift = ln._part_shift(X, X, Y, group, C, HW, HW, False, False)
    shift_next = ln._part_shift(X, X, Y, group + groups, C, HW, HW, False, False)
    t1, t2 = ln._fwd_part_terms(bx, bx, Y, 0, valid, shift, layout, lay3, T, VEC, NBUF - 1, CHUNK, CHUNKS,
                                NBUF, False, False, False, MASK, True)  # fmt: skip
    smem.publish_pair(smem.row_terms(Terms, group, groups, KP, RING), k, t1, t2, KP, True, group + 1)
    base = pid * 0  # buffer of this channel's chunk 0
    for c in range(group, C, groups):
        mine = smem.row_terms(Terms, c, groups, KP, RING)
        w1, w2 = smem.request_pair(mine, K, KP, small, True, c + 1)
        scale = 1.0
        if HAS_W:
            scale = gl.load(W + c).to(gl.float32)
        bias = 0.0
        if HAS_B:
            bias = gl.load(B + c).to(gl.float32)
        nxt = c + groups
        shift_after = ln._part_shift(X, X, Y, nxt + groups, C, HW, HW, False, False)
        if nxt < C:
            pending: gl.constexpr = (DEPTH - 1) * CHUNKS + SPARE - 1  # copy groups after the next row's last
            n1, n2 = ln._fwd_part_terms(bx, bx, Y, (base + CHUNKS) % NBUF, valid, shift_next, layout, lay3, T,
                                        VEC, pending, CHUNK, CHUNKS, NBUF, False, False, False, MASK,
                                        True)  # fmt: skip
            smem.publish_pair(smem.row_terms(Terms, nxt, groups, KP, RING), k, n1, n2, KP, True, nxt + 1)
        mean, var = ln._parts_moments(w1, w2, mine, K, KP, small, c + 1, counts, inv_n)
        rstd = gl.rsqrt(var + eps)
        if k == 0:
            gl.store(Mean + c, mean + shift)
            gl.store(Rstd + c, rstd)
            if HAS_RM:
                rm = (1 - momentum) * gl.load(RMean + c).to(gl.float32) + momentum * (mean + shift)
                gl.store(RMeanOut + c, rm.to(RMeanOut.dtype.element_ty))
            if HAS_RV:
                rv = (1 - momentum) * gl.load(RVar + c).to(gl.float32) + momentum * (var * unbias)
                gl.store(RVarOut + c, rv.to(RVarOut.dtype.element_ty))
        scale = scale * rstd
        row = c.to(gl.int64) * HW
        for i in gl.static_range(CHUNKS):
            at = (base + i) % NBUF
            v = bx.index(at).load(layout).to(gl.float32)
            smem.refill_part(bx, at, X, c, groups, C, end, HW, col0, i, CHUNK, CHUNKS, SPARE, DEPTH, HW=HW,
                             GAP=GAP)  # fmt: skip
            cols = col0 + i * CHUNK
            y = (v - shift - mean) * scale + bias
            gl.store(Y + row + smem.run_offsets(cols, HW, GAP), y.to(Y.dtype.element_ty), mask=cols < end)
        base = (base + CHUNKS) % NBUF
        shift = shift_next
        shift_next = shift_after
    cp.wait_group(0)
    smem.release(Done + group, Terms + group * (RING * 2 * KP), RING * 2 * KP, K, small)


@smem.jit
def _bwd_smem_split_kernel(
    X,  # (N, C, HW) forward input, 16-bit or fp32, 16-byte aligned; HW a multiple of 16
    DY,  # (N, C, HW) output gradient, X's dtype, contiguous and aligned alike
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (C,) fp32 statistics the forward normalized with
    Rstd,  # (C,) fp32
    DW,  # (C,) out: sum of dy * xhat, in its dtype (written when HAS_W)
    DB,  # (C,) out: sum of dy (written when HAS_DB)
    Terms,  # (groups, RING, 2, KP) int64, zeroed: part k's channel terms, tagged (smem.row_terms)
    Done,  # (groups,) int64 counters, zero: a group's last program done zeroes its Terms (smem.release)
    L,  # values a channel: N * HW, taken in (sample, column) order
    C,
    HW,  # a multiple of 16
    GAP,  # (C - 1) * HW (smem.run_offsets)
    K,  # parts a channel: program pid holds part pid % K (values [k * P, min(L, (k + 1) * P))) of
    # channel group pid // K
    P,  # values a part, a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]; L <= K * P
    CHUNK: gl.constexpr,  # values per shared-memory buffer (of x, and of dy)
    CHUNKS: gl.constexpr,  # buffers a part
    SPARE: gl.constexpr,  # extra buffers (0 or 1) of each
    DEPTH: gl.constexpr,  # rows of buffers: a channel's copies start DEPTH - 1 channel steps early
    KP: gl.constexpr,  # next_pow2(K)
    RING: gl.constexpr,  # term slots a channel group (>= smem.MIN_RING)
    HAS_W: gl.constexpr,
    HAS_DB: gl.constexpr,
    TRAINING: gl.constexpr,  # statistics came from this batch (their gradient flows to x)
):
    """Backward, x and dy read from HBM once and held on chip: the row norms' backward in parts
    (layer_norm._bwd_smem_split_kernel) with a channel for a row, streamed as the training forward
    in parts streams x (runs of HW values, DEPTH channels deep). Per channel step: the next
    channel's part sums of (x - mean) * dy and of dy are taken as its chunks land and published;
    this channel's K pairs are gathered and summed in k's order (the same bits in every part, every
    run: dweight and dbias, written by the k = 0 program), and dx of the part is written from its
    buffers while they take the channel after next."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # 16 bytes a thread and copy
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    NBUF: gl.constexpr = DEPTH * CHUNKS + SPARE
    pid, group, groups, k, offs, end, col0 = smem.part_of(L, K, P, CHUNK, layout)
    bx, bdy = smem.open_parts(X, C, HW, group, groups, end, col0, CHUNK, CHUNKS, NBUF, DY, HW, HW=HW, GAP=GAP)
    inv_n = 1.0 / L.to(gl.float32)
    # values past the part land as zeros in x and dy: they add nothing to either sum
    t1, t2 = ln._smem_row_terms(bx, bdy, bx, gl.load(Mean + group), 0, layout, NBUF - 1, CHUNK, CHUNKS, NBUF,
                                False, False)  # fmt: skip
    smem.publish_pair(smem.row_terms(Terms, group, groups, KP, RING), k, t1, t2, KP, True, group + 1)
    base = pid * 0  # buffer of this channel's chunk 0
    for c in range(group, C, groups):
        mine = smem.row_terms(Terms, c, groups, KP, RING)
        w1, w2 = smem.request_pair(mine, K, KP, small, True, c + 1)  # in flight during the next terms
        mean = gl.load(Mean + c)
        rstd = gl.load(Rstd + c)
        scale = rstd
        if HAS_W:
            scale = scale * gl.load(W + c).to(gl.float32)
        nxt = c + groups
        if nxt < C:
            pending: gl.constexpr = (DEPTH - 1) * CHUNKS + SPARE - 1  # copy groups after the next row's last
            n1, n2 = ln._smem_row_terms(bx, bdy, bx, gl.load(Mean + nxt), (base + CHUNKS) % NBUF, layout,
                                        pending, CHUNK, CHUNKS, NBUF, False, False)  # fmt: skip
            smem.publish_pair(smem.row_terms(Terms, nxt, groups, KP, RING), k, n1, n2, KP, True, nxt + 1)
        s_dyx = smem.gather(w1, mine, K, KP, small, c + 1) * rstd
        s_dy = smem.gather(w2, mine + KP, K, KP, small, c + 1)
        if k == 0:
            if HAS_W:
                gl.store(DW + c, s_dyx.to(DW.dtype.element_ty))
            if HAS_DB:
                gl.store(DB + c, s_dy.to(DB.dtype.element_ty))
        c1 = s_dyx * rstd * inv_n  # dx = scale * (dy - c2 - (x - mean) * c1) in training
        c2 = s_dy * inv_n
        row = c.to(gl.int64) * HW
        for i in gl.static_range(CHUNKS):
            at = (base + i) % NBUF
            x = bx.index(at).load(layout).to(gl.float32)
            dy = bdy.index(at).load(layout).to(gl.float32)
            smem.refill_part(bx, at, X, c, groups, C, end, HW, col0, i, CHUNK, CHUNKS, SPARE, DEPTH, bdy, DY,
                             HW, HW=HW, GAP=GAP)  # fmt: skip
            cols = col0 + i * CHUNK
            g = dy
            if TRAINING:
                g = dy - c2 - (x - mean) * c1
            gl.store(DX + row + smem.run_offsets(cols, HW, GAP), (g * scale).to(DX.dtype.element_ty),
                     mask=cols < end)  # fmt: skip
        base = (base + CHUNKS) % NBUF
    cp.wait_group(0)
    smem.release(Done + group, Terms + group * (RING * 2 * KP), RING * 2 * KP, K, small)


def batch_norm_stats(x, eps, momentum=0.0, running_mean=None, running_var=None):
    """x: (N, C, HW) contiguous -> (mean, rstd), each (C,) in the math dtype; the running
    statistics, when given, are updated in place by the same kernel (as torch: unbiased variance)."""
    N, C, HW = x.shape
    acc = config.acc_dtype(x.dtype)
    tl_acc = config.tl_acc_dtype(x.dtype)
    cfg = config.batch_norm_sums(N, C, HW, x.dtype, x.device)
    part = torch.empty((2, cfg.parts, C), dtype=acc, device=x.device)
    if cfg.channels:
        launch(_stats_part_cols_kernel, cfg.grid, x, part[0], part[1], N, C, cfg.samples, RB=cfg.row_block,
               CB=cfg.channels, ACC=tl_acc, num_warps=cfg.num_warps)  # fmt: skip
    else:
        launch(_stats_part_kernel, cfg.grid, x, part[0], part[1], N, C, HW, cfg.samples, RB=cfg.row_block,
               HWB=cfg.hw_block, ACC=tl_acc, num_warps=cfg.num_warps)  # fmt: skip
    mean = torch.empty(C, dtype=acc, device=x.device)
    rstd = torch.empty_like(mean)
    count = N * HW
    unbias = count / max(1, count - 1)
    launch(_stats_merge_kernel, (triton.cdiv(C, config.MERGE_BLOCK),), x, part[0], part[1], mean, rstd,
           x if running_mean is None else running_mean, x if running_var is None else running_var, N, C, HW,
           cfg.samples, cfg.parts, eps, config.eps_tail(eps, x.device), float(momentum),
           config.eps_tail(float(momentum), x.device), unbias, config.eps_tail(unbias, x.device),
           BLOCK=config.MERGE_BLOCK, HAS_RM=running_mean is not None,
           HAS_RV=running_var is not None, ACC=tl_acc, num_warps=4)  # fmt: skip
    return mean, rstd


def batch_norm_train_fwd(x, weight, bias, eps, momentum, running_mean, running_var, in_place=False):
    """Training forward (contract: docs/design.md, ``reference.train_fwd_from``) -> (y, mean, rstd,
    running_mean', running_var'): this batch's statistics and the running statistics after this
    step, as new tensors (None where not given), or the given ones updated when ``in_place``. One
    read of x on split channels (``config.batch_norm_split``), else the statistics and apply
    kernels."""
    cfg = _train_config(x)
    if cfg is None:
        return _train_fwd_two_pass(x, weight, bias, eps, momentum, running_mean, running_var, in_place)
    # The k = 0 program of a channel reads its running statistics before writing them: in place is safe.
    rm = running_mean if in_place or running_mean is None else torch.empty_like(running_mean)
    rv = running_var if in_place or running_var is None else torch.empty_like(running_var)
    forward = _split_forward(cfg, x.shape, x.dtype, x.device, eps, weight is not None, bias is not None,
                             rm is not None, rv is not None)  # fmt: skip
    return (*forward(x, weight, bias, running_mean, running_var, rm, rv, momentum), rm, rv)


def _train_config(x):
    """The one-read training forward's launch for x (N, C, HW) contiguous
    (``config.batch_norm_channels``), or None (the two-pass kernels serve)."""
    N, C, HW = x.shape
    return config.batch_norm_channels(N, C, HW, x.dtype, x.device, False, smem.fits(HW, HW, x.data_ptr()))


def _split_forward(cfg, shape, dtype, device, eps, has_w, has_b, has_rm, has_rv):
    """The one-read training forward (``cfg``: :func:`_train_config`'s: channels in parts, or split
    channels) for contiguous inputs of ``shape`` (N, C, *) and ``dtype``, by a direct launch
    (launch.Bound; the full path and the plans call it): ``forward(x, weight, bias, running_mean,
    running_var, running_mean_out, running_var_out, momentum)`` -> (y in x's shape, mean, rstd), the
    running statistics after this step written to the ``_out`` tensors (the given ones for in
    place); split channels take a fresh workspace (partials, zeroed counters) each call, channels in
    parts the stream's term workspace (smem.terms_workspace, left zeroed by each launch)."""
    N, C = shape[:2]
    HW = math.prod(shape[2:])
    L, acc = N * HW, config.acc_dtype(dtype)
    if cfg.smem:
        return _parts_forward(cfg, C, HW, L, device, eps, has_w, has_b, has_rm, has_rv)
    bound = Bound(_fwd_split_kernel, cfg.grid, device.index, CHUNK=cfg.block_size,
                         VEC=config.run_length(HW, dtype), KP=coop.chunks_pow2(cfg.split), HAS_W=has_w,
                         HAS_B=has_b, HAS_RM=has_rm, HAS_RV=has_rv, ACC=config.tl_acc_dtype(dtype),
                         PIPELINE=cfg.prefetch, SPIN=cfg.spin, num_warps=cfg.num_warps,
                         maxnreg=cfg.maxnreg)  # fmt: skip
    eps_lo, unbias = config.eps_tail(eps, device), L / max(1, L - 1)
    unbias_lo = config.eps_tail(unbias, device)

    def forward(x, w, b, rm, rv, rm_out, rv_out, momentum):
        part, count = coop.workspace(C, 2, cfg.split, acc, x.device)
        y = torch.empty_like(x)
        mean = torch.empty(C, dtype=acc, device=x.device)
        rstd = torch.empty_like(mean)
        bound(x, y, x if w is None else w, x if b is None else b, mean, rstd, x if rm is None else rm,
              x if rv is None else rv, x if rm_out is None else rm_out, x if rv_out is None else rv_out, part,
              count, L, C, HW, cfg.split, eps, eps_lo, float(momentum),
              config.eps_tail(float(momentum), x.device), unbias, unbias_lo)  # fmt: skip
        return y, mean, rstd

    return forward


def _parts_forward(cfg, C, HW, L, device, eps, has_w, has_b, has_rm, has_rv):
    """:func:`_split_forward` for channels in parts (``config.batch_norm_smem``)."""
    width = cfg.buffers * cfg.block_size
    bound = Bound(_fwd_smem_split_kernel, cfg.grid, device.index, CHUNK=cfg.block_size, CHUNKS=cfg.buffers,
                  SPARE=int(cfg.prefetch), DEPTH=cfg.depth, KP=triton.next_power_of_2(cfg.parts),
                  RING=cfg.ring, HAS_W=has_w, HAS_B=has_b, HAS_RM=has_rm, HAS_RV=has_rv,
                  MASK=smem.parts_mask(L, cfg.parts, cfg.part, width, cfg.block_size),
                  num_warps=cfg.num_warps)  # fmt: skip
    unbias = L / max(1, L - 1)

    def forward(x, w, b, rm, rv, rm_out, rv_out, momentum):
        terms = smem.terms_workspace(cfg.grid[0] // cfg.parts, cfg.parts, cfg.ring, x.device)
        y = torch.empty_like(x)
        mean = torch.empty(C, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        bound(x, y, x if w is None else w, x if b is None else b, mean, rstd, x if rm is None else rm,
              x if rv is None else rv, x if rm_out is None else rm_out, x if rv_out is None else rv_out,
              *terms, L, C, HW, (C - 1) * HW, cfg.parts, cfg.part, eps, float(momentum), unbias)  # fmt: skip
        return y, mean, rstd

    return forward


def _apply_meta(shape, dtype, has_w, has_b):
    """(grid, launch keywords) of ``_apply_kernel`` for x of (N, C, HW) ``shape``; its arguments:
    (x, y, weight, bias, mean, rstd, N * C, C, HW)."""
    N, C, HW = shape
    cfg = config.batch_norm_rows(N * C, HW, dtype)
    return cfg.grid, dict(RB=cfg.row_block, HWB=cfg.hw_block, HAS_W=has_w, HAS_B=has_b,
                          ACC=config.tl_acc_dtype(dtype), num_warps=cfg.num_warps)  # fmt: skip


def batch_norm_apply(x, weight, bias, mean, rstd):
    """y = (x - mean_c) * rstd_c * weight_c + bias_c, in x.dtype."""
    N, C, HW = x.shape
    grid, meta = _apply_meta(x.shape, x.dtype, weight is not None, bias is not None)
    y = torch.empty_like(x)
    w, b = (weight if weight is not None else x), (bias if bias is not None else x)
    launch(_apply_kernel, grid, x, y, w, b, mean, rstd, N * C, C, HW, **meta)
    return y


_train_fwd_two_pass = train_fwd_from(batch_norm_stats, batch_norm_apply)


def batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype):
    """-> (dx, dweight, dbias); training: the statistics were this batch's. One read of x and dy
    (:func:`_bwd_config`: channels in parts, or split channels), else sums then dx."""
    N, C, HW = x.shape
    cfg = _bwd_config(x, dy.data_ptr())
    if cfg is not None:
        dtypes = (None if weight is None else weight.dtype, bias_dtype)
        return _split_backward(cfg, x.shape, x.dtype, x.device, dtypes, training)(dy, x, weight, mean, rstd)
    acc = config.acc_dtype(x.dtype)
    cfg = config.batch_norm_sums(N, C, HW, x.dtype, x.device)
    part, (dyx_part, dy_part) = reduce.partials((acc, acc), cfg.parts, C, acc, x.device)
    if cfg.channels:
        launch(_grad_sums_part_cols_kernel, cfg.grid, x, dy, mean, rstd, dyx_part, dy_part, N, C, cfg.samples,
               RB=cfg.row_block, CB=cfg.channels, ACC=config.tl_acc_dtype(x.dtype),
               num_warps=cfg.num_warps)  # fmt: skip
    else:
        launch(_grad_sums_part_kernel, cfg.grid, x, dy, mean, rstd, dyx_part, dy_part, N, C, HW, cfg.samples,
               RB=cfg.row_block, HWB=cfg.hw_block, ACC=config.tl_acc_dtype(x.dtype),
               num_warps=cfg.num_warps)  # fmt: skip
    sum_dy_xhat, sum_dy = reduce.sum_partials(part, (acc, acc))
    dx = torch.empty_like(x)
    cfg = config.batch_norm_rows(N * C, HW, x.dtype)
    launch(_dx_kernel, cfg.grid,
        x, dy, dx, weight if weight is not None else x, mean, rstd, sum_dy_xhat, sum_dy, N * C, C, HW,
        N * HW, RB=cfg.row_block, HWB=cfg.hw_block, HAS_W=weight is not None, TRAINING=training,
        ACC=config.tl_acc_dtype(x.dtype), num_warps=cfg.num_warps,
    )  # fmt: skip
    dweight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
    dbias = sum_dy.to(bias_dtype) if bias_dtype is not None else None
    return dx, dweight, dbias


def _bwd_config(x, dy_ptr):
    """The one-read backward's launch for x (N, C, HW) and dy contiguous (dy at ``dy_ptr``)
    (``config.batch_norm_channels``), or None (sums, then dx)."""
    N, C, HW = x.shape
    aligned = smem.fits(HW, HW, x.data_ptr()) and dy_ptr % 16 == 0
    return config.batch_norm_channels(N, C, HW, x.dtype, x.device, True, aligned)


def _split_backward(cfg, shape, dtype, device, dtypes, training):
    """The one-read backward (``cfg``: :func:`_bwd_config`'s: channels in parts, or split channels)
    for contiguous inputs of ``shape`` (N, C, *) and ``dtype``, by a direct launch (launch.Bound; the
    full path and the plans call it): ``backward(dy, x, weight, mean, rstd)`` -> (dx, dweight,
    dbias), dweight / dbias in ``dtypes`` (None for none); split channels take a fresh workspace
    each call, channels in parts the stream's term workspace."""
    N, C = shape[:2]
    HW = math.prod(shape[2:])
    if cfg.smem:
        return _parts_backward(cfg, C, HW, N * HW, device, dtypes, training)
    has_w, has_db = dtypes[0] is not None, dtypes[1] is not None
    acc = config.acc_dtype(dtype)
    bound = Bound(_bwd_split_kernel, cfg.grid, device.index, CHUNK=cfg.block_size,
                         VEC=config.run_length(HW, dtype), KP=coop.chunks_pow2(cfg.split), HAS_W=has_w,
                         HAS_DB=has_db, TRAINING=training, ACC=config.tl_acc_dtype(dtype),
                         PIPELINE=cfg.prefetch, SPIN=cfg.spin, num_warps=cfg.num_warps,
                         maxnreg=cfg.maxnreg)  # fmt: skip

    def backward(dy, x, w, mean, rstd):
        part, count = coop.workspace(C, 2, cfg.split, acc, x.device)
        dx = torch.empty_like(x)
        dw = torch.empty(C, dtype=dtypes[0], device=x.device) if has_w else None
        db = torch.empty(C, dtype=dtypes[1], device=x.device) if has_db else None
        bound(x, dy, dx, x if w is None else w, mean, rstd, x if dw is None else dw, x if db is None else db,
              part, count, N * HW, C, HW, cfg.split)  # fmt: skip
        return dx, dw, db

    return backward


def _parts_backward(cfg, C, HW, L, device, dtypes, training):
    """:func:`_split_backward` for channels in parts (``config.batch_norm_smem(..., True)``)."""
    has_w, has_db = dtypes[0] is not None, dtypes[1] is not None
    bound = Bound(_bwd_smem_split_kernel, cfg.grid, device.index, CHUNK=cfg.block_size, CHUNKS=cfg.buffers,
                  SPARE=int(cfg.prefetch), DEPTH=cfg.depth, KP=triton.next_power_of_2(cfg.parts),
                  RING=cfg.ring, HAS_W=has_w, HAS_DB=has_db, TRAINING=training,
                  num_warps=cfg.num_warps)  # fmt: skip

    def backward(dy, x, w, mean, rstd):
        terms = smem.terms_workspace(cfg.grid[0] // cfg.parts, cfg.parts, cfg.ring, x.device)
        dx = torch.empty_like(x)
        dw = torch.empty(C, dtype=dtypes[0], device=x.device) if has_w else None
        db = torch.empty(C, dtype=dtypes[1], device=x.device) if has_db else None
        bound(x, dy, dx, x if w is None else w, mean, rstd, x if dw is None else dw, x if db is None else db,
              *terms, L, C, HW, (C - 1) * HW, cfg.parts, cfg.part)  # fmt: skip
        return dx, dw, db

    return backward


def plan_batch_norm(x, weight, bias, running_mean, running_var, eps, training, grad=False):
    """A plan for BatchNorm calls shaped like this one (contract extension, docs/design.md), for
    contiguous inputs of x's (N, C, HW) elements with the parameters and running statistics of the
    same presence, dtypes and alignment; the compiled kernels are called directly (launch.Bound).
    None off the GPU, in eval mode with gradients wanted, and in training where channels are read
    twice (``config.batch_norm_channels`` None: the two-pass kernels serve).

    Inference (no gradient wanted): ``run(input, weight, bias, running_mean, running_var,
    momentum)`` -> y in input's shape; in training the running statistics are updated in place (as
    the full path does in eager mode). Training (``grad``): ``(forward, backward)``:
    ``forward(input, weight, bias, running_mean, running_var, momentum)`` -> (y, mean, rstd), the
    running statistics updated in place; ``backward(dy, input, weight, mean, rstd)`` -> (dx,
    dweight, dbias), dy contiguous and 16-byte aligned, None where there is no weight / bias."""
    N, C, HW = x.shape
    if x.device.type != "cuda" or (grad and not training):
        return None
    has_w, has_b = weight is not None, bias is not None
    if not training:
        return _plan_eval(x, has_w, has_b, eps)
    cfg = _train_config(x)
    bcfg = _bwd_config(x, 0) if grad else None  # the backward's dy comes aligned (plans._dense)
    if cfg is None or (grad and bcfg is None):
        return None
    split = _split_forward(cfg, x.shape, x.dtype, x.device, eps, has_w, has_b, running_mean is not None,
                           running_var is not None)  # fmt: skip

    def forward(x, w, b, rm, rv, momentum):
        return split(x, w, b, rm, rv, rm, rv, momentum)

    if not grad:
        return lambda *args: forward(*args)[0]
    dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
    return forward, _split_backward(bcfg, x.shape, x.dtype, x.device, dtypes, True)


def _plan_eval(x, has_w, has_b, eps):
    """:func:`plan_batch_norm`'s eval-mode inference plan: y from the running statistics, one
    launch of the apply kernel after rstd = rsqrt(running_var + eps) (as the full path)."""
    N, C, HW = x.shape
    acc = config.acc_dtype(x.dtype)
    grid, meta = _apply_meta(x.shape, x.dtype, has_w, has_b)
    bound = Bound(_apply_kernel, grid, x.device.index, **meta)

    def run(x, w, b, rm, rv, momentum):
        rstd = torch.rsqrt(rv.to(acc) + eps)
        y = torch.empty_like(x)
        bound(x, y, x if w is None else w, x if b is None else b, rm.to(acc), rstd, N * C, C, HW)
        return y

    return run
