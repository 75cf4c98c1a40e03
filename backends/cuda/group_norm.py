"""GroupNorm (and InstanceNorm, its C-groups case) on NVIDIA GPUs: kernels, then launchers.

A contiguous (N, C, HW) input holds each (sample, group) as one contiguous row of L = (C / G) * HW
elements. Forward: rows up to the row norms' fused limit are held in registers (one HBM read;
several short rows to a program); longer rows go through the row norms' split forward
(``layer_norm._fwd_split_kernel`` with one weight row per group: co-resident programs share a row
and read it once; ``config.group_norm_split_forward``), or where that cannot run (CPU, too many
chunks) are walked twice by one program (Chan merging of tiles, ``backends/common.py``). Backward:
the per-channel sums of dy * xhat and dy of a row are the dweight / dbias partials of that sample
((N, C) buffers, summed over N in a fixed order) and, weighted by w_c, the row's two dx terms. Long
16-bit rows of few channels are held in shared memory by a persistent program (Gluon,
``_bwd_smem_kernel``, ``config.group_norm_smem_backward``: x and dy read from HBM once,
docs/tuning-log.md T70); long fp32 rows go through the row norms' split backward kernel
(``layer_norm._bwd_split_kernel``: co-resident programs share a row and read it once;
``config.group_norm_split_backward``, T69); other rows
are walked twice by one program per row in [channels, HW] tiles (sums, then dx; the second walk
mostly from L2 for short rows, from HBM for rows of 100 KB: docs/tuning-log.md T67).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import channels_last, exact_eps, group_norm_row_fwd, reciprocal
from normkit.backends.cuda import config, coop, layer_norm, reduce, smem
from normkit.backends.cuda.launch import Bound, launch
from normkit.backends.cuda.smem import cp, gl


@triton.jit
def _fwd_fused_kernel(
    X,  # (N, C, HW) input, contiguous (rows = N * G rows of L = Cg * HW) or channels-last (CL)
    Y,  # (N, C, HW) out, X's layout
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (N * G,) out, ACC
    Rstd,  # (N * G,) out, ACC
    rows,  # N * G
    G,  # groups
    HW,
    Cg,  # channels per group
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    ROWS: tl.constexpr,  # rows per program; a [ROWS, CB, HWB] tile holds them whole
    CB: tl.constexpr,  # >= Cg
    HWB: tl.constexpr,  # >= HW
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
    STATS: tl.constexpr = True,  # write Mean / Rstd (False: an inference plan, nothing saved)
    CL: tl.constexpr = False,  # X / Y channels-last: memory (N, HW, C); C = G * Cg
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ch = tl.arange(0, CB)
    hw = tl.arange(0, HWB)
    L = Cg * HW
    row_mask = r < rows
    ch_mask = row_mask[:, None] & (ch < Cg)[None, :]  # [ROWS, CB]
    mask = ch_mask[:, :, None] & (hw < HW)[None, None, :]
    if CL:
        first = (r // G).to(tl.int64) * HW * (G * Cg) + (r % G) * Cg
        at = first[:, None, None] + ch[None, :, None] + (hw * (G * Cg))[None, None, :]
    else:
        first = r.to(tl.int64) * L
        at = first[:, None, None] + (ch * HW)[None, :, None] + hw[None, None, :]
    # statistics of x - (the row's first element): exact sums for rows with a large mean
    shift = tl.load(X + first, mask=row_mask, other=0.0).to(ACC)
    x = tl.where(mask, tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift[:, None, None], 0.0)
    inv_l = reciprocal(L, ACC)
    mean = tl.sum(tl.sum(x, axis=2), axis=1) * inv_l
    d = tl.where(mask, x - mean[:, None, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(d * d, axis=2), axis=1) * inv_l + exact_eps(eps, eps_lo, ACC))
    if STATS:
        tl.store(Mean + r, shift + mean, mask=row_mask)
        tl.store(Rstd + r, rstd, mask=row_mask)
    c = (r % G)[:, None] * Cg + ch[None, :]  # [ROWS, CB]: per-channel scale and shift
    scale = tl.zeros([ROWS, CB], ACC) + rstd[:, None]
    if HAS_W:
        scale = scale * tl.load(W + c, mask=ch_mask, other=0.0).to(ACC)
    y = d * scale[:, :, None]
    if HAS_B:
        y = y + tl.load(B + c, mask=ch_mask, other=0.0).to(ACC)[:, :, None]
    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_looped_kernel(
    X,  # (N, C, HW) contiguous input
    Y,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (N * G,) out, ACC
    Rstd,  # (N * G,) out, ACC
    G,  # groups
    C,
    L,  # row length (C / G) * HW
    HW,
    Cg,  # channels per group
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    BLOCK: tl.constexpr,  # column tile; one program per (n, g) row (rows longer than the fused limit)
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    group_norm_row_fwd(X, Y, W, B, Mean, Rstd, tl.program_id(0), G, C, L, HW, Cg, reciprocal(L, ACC),
                       exact_eps(eps, eps_lo, ACC),
                       BLOCK, HAS_W, HAS_B, ACC, False, False)  # fmt: skip


@triton.jit
def _bwd_tile(X, DY, base, ch, ch_mask, hs, C, HW, HWB: tl.constexpr, ACC: tl.constexpr, CL: tl.constexpr):
    """Offsets, mask, x and dy of the [channels, HWB] tile at column ``hs`` of a row whose first
    element is at ``base`` (channels-last: channels contiguous, positions C apart)."""
    hw = hs + tl.arange(0, HWB)
    mask = ch_mask[:, None] & (hw < HW)[None, :]
    if CL:
        at = base + ch[:, None] + hw[None, :] * C
    else:
        at = base + ch[:, None] * HW + hw[None, :]
    x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
    return at, mask, x, dy


@triton.jit
def _fwd_cl_kernel(
    X,  # (N, C, HW) channels-last input: memory (N, HW, C)
    Y,  # (N, C, HW) out, channels-last
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (N * G,) out, ACC
    Rstd,  # (N * G,) out, ACC
    G,
    C,
    HW,
    Cg,
    eps,
    eps_lo,  # eps - fp32(eps): fp64 kernels add it back (exact_eps)
    CB: tl.constexpr,  # channels per tile; one program per (n, g) row
    HWB: tl.constexpr,  # positions (of HW) per tile
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    """Forward of channels-last rows too long for the fused kernel: one program per (n, g) row
    walks it twice in the backward's [channels, HW] tiles (channels contiguous in memory): sums of
    x - (the row's first element) and its square in tile-shaped accumulators (exact enough once the
    shift has taken the mean out, as BatchNorm's sums), then y."""
    row = tl.program_id(0)
    c0 = (row % G) * Cg
    base = (row // G).to(tl.int64) * HW * C + c0
    ci = tl.arange(0, CB)
    shift = tl.load(X + base).to(ACC)
    s1 = tl.zeros([CB, HWB], ACC)
    s2 = tl.zeros([CB, HWB], ACC)
    for cs in range(0, Cg, CB):
        ch = cs + ci
        for hs in range(0, HW, HWB):
            at, mask, x, _ = _bwd_tile(X, X, base, ch, ch < Cg, hs, C, HW, HWB, ACC, True)
            xs = tl.where(mask, x - shift, 0.0)
            s1 += xs
            s2 += xs * xs
    inv_l = reciprocal(Cg * HW, ACC)
    sum1 = tl.sum(tl.sum(s1, axis=1), axis=0)
    mean = sum1 * inv_l
    m2 = tl.maximum(tl.sum(tl.sum(s2, axis=1), axis=0) - sum1 * mean, 0.0, propagate_nan=tl.PropagateNan.ALL)
    rstd = 1.0 / tl.sqrt(m2 * inv_l + exact_eps(eps, eps_lo, ACC))
    tl.store(Mean + row, shift + mean)
    tl.store(Rstd + row, rstd)
    for cs in range(0, Cg, CB):
        ch = cs + ci
        ch_mask = ch < Cg
        scale = tl.zeros([CB], ACC) + rstd
        if HAS_W:
            scale = scale * tl.load(W + c0 + ch, mask=ch_mask, other=0.0).to(ACC)
        for hs in range(0, HW, HWB):
            at, mask, x, _ = _bwd_tile(X, X, base, ch, ch_mask, hs, C, HW, HWB, ACC, True)
            y = (x - shift - mean) * scale[:, None]
            if HAS_B:
                y = y + tl.load(B + c0 + ch, mask=ch_mask, other=0.0).to(ACC)[:, None]
            tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(
    X,  # (N, C, HW) forward input, contiguous or channels-last (CL)
    DY,  # (N, C, HW) output gradient, X's layout
    DX,  # (N, C, HW) out, X's layout
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (N * G,)
    Rstd,  # (N * G,)
    DW_part,  # (N, C) out, ACC: sample n's sum of dy * xhat per channel (written when HAS_W)
    DB_part,  # (N, C) out, ACC: sample n's sum of dy per channel (written when HAS_DB)
    G,
    C,
    HW,
    Cg,
    CB: tl.constexpr,  # channels per tile; one program per (n, g) row
    HWB: tl.constexpr,  # columns (of HW) per tile
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    ACC: tl.constexpr,
    CL: tl.constexpr = False,  # X / DY / DX channels-last: memory (N, HW, C)
):
    row = tl.program_id(0)
    n = row // G
    c0 = (row % G) * Cg
    base = n.to(tl.int64) * HW * C + c0 if CL else row.to(tl.int64) * Cg * HW
    mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    ci = tl.arange(0, CB)
    c1 = tl.zeros([CB], ACC)  # per channel slot: sum of w_c * dy * xhat over the row
    c2 = tl.zeros([CB], ACC)  # sum of w_c * dy
    for cs in range(0, Cg, CB):
        ch = cs + ci
        ch_mask = ch < Cg
        t_dyx = tl.zeros([CB, HWB], ACC)  # tile accumulators, reduced once per channel block
        t_dy = tl.zeros([CB, HWB], ACC)
        for hs in range(0, HW, HWB):
            _, mask, x, dy = _bwd_tile(X, DY, base, ch, ch_mask, hs, C, HW, HWB, ACC, CL)
            t_dyx += tl.where(mask, (x - mean) * rstd, 0.0) * dy
            t_dy += dy
        s_dyx = tl.sum(t_dyx, axis=1)
        s_dy = tl.sum(t_dy, axis=1)
        part = n.to(tl.int64) * C + c0 + ch
        if HAS_W:
            tl.store(DW_part + part, s_dyx, mask=ch_mask)
            w = tl.load(W + c0 + ch, mask=ch_mask, other=0.0).to(ACC)
            c1 += w * s_dyx
            c2 += w * s_dy
        else:
            c1 += s_dyx
            c2 += s_dy
        if HAS_DB:
            tl.store(DB_part + part, s_dy, mask=ch_mask)
    inv_l = reciprocal(Cg * HW, ACC)
    c1_row = tl.sum(c1, axis=0) * inv_l
    c2_row = tl.sum(c2, axis=0) * inv_l
    for cs in range(0, Cg, CB):  # second walk (mostly from HBM at 100 KB rows: docs/tuning-log.md T67)
        ch = cs + ci
        ch_mask = ch < Cg
        if HAS_W:
            w = tl.load(W + c0 + ch, mask=ch_mask, other=0.0).to(ACC)
        else:
            w = tl.full([CB], 1.0, ACC)
        for hs in range(0, HW, HWB):
            at, mask, x, dy = _bwd_tile(X, DY, base, ch, ch_mask, hs, C, HW, HWB, ACC, CL)
            dx = (w[:, None] * dy - ((x - mean) * rstd * c1_row + c2_row)) * rstd
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)


@smem.jit
def _runs(v, R: gl.constexpr, VEC: gl.constexpr, runs: gl.constexpr):
    """A chunk read back in the copies' layout (VEC consecutive values a thread) as fp32 [R, VEC] in
    ``runs``: the same registers, one run of VEC values of one channel a row (HW % VEC == 0)."""
    return gl.convert_layout(gl.reshape(v.to(gl.float32), [R, VEC]), runs, assert_trivial=True)


@smem.jit
def _bwd_smem_kernel(
    X,  # (N, C, HW) 16-bit forward input, contiguous, 16-byte aligned: rows = N * G rows of L = Cg * HW
    DY,  # (N, C, HW) output gradient, X's dtype, contiguous, aligned alike
    DX,  # (N, C, HW) out
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (N * G,) fp32
    Rstd,  # (N * G,) fp32
    DW_part,  # (N, C) out, fp32: sample n's sum of dy * xhat per channel (written when HAS_W)
    DB_part,  # (N, C) out, fp32: sample n's sum of dy per channel (written when HAS_DB)
    rows,  # N * G
    G,
    C,
    HW,  # a multiple of 8: each thread's 8 values of a copy lie in one channel
    Cg,  # channels per group, <= CB
    L,  # Cg * HW, a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]
    CHUNK: gl.constexpr,  # values per shared-memory buffer (>= 8 x 32 x num_warps)
    CHUNKS: gl.constexpr,  # buffers a row (of x, and of dy)
    SPARE: gl.constexpr,  # extra buffers (0 or 1) of each: the row after next starts landing early
    CB: gl.constexpr,  # next_pow2(Cg)
    HAS_W: gl.constexpr,
    HAS_DB: gl.constexpr,
):
    """Persistent grid, one program per SM, rows pid, pid + programs, ... (the row norms'
    ``layer_norm._bwd_smem_kernel`` with a channel's weight for a column's): each (n, g) row of x
    and dy streams through the program's shared memory once (smem.open_pair), where the
    one-program-per-row kernel reads it twice. Per row: as the chunks land, each thread sums its
    runs of 8 values (one channel each) of (x - mean) * dy and of dy, adding them into its [runs,
    channels] sums; one reduction over the runs gives the row's per-channel sums (sample n's dweight
    / dbias partials, and weighted by w_c the two dx terms); then per chunk: read x and dy back,
    start the stream's next copy into their buffers, store dx."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 8  # 16 bytes of 16-bit values per thread and copy
    R: gl.constexpr = CHUNK // VEC  # runs of VEC a chunk
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    runs: gl.constexpr = gl.BlockedLayout([1, VEC], [32, 1], [NW, 1], [1, 0])
    # the [runs, channels] sums' reduction: lanes across the channels, each thread summing many runs
    LC: gl.constexpr = min(CB, 32)
    red: gl.constexpr = gl.BlockedLayout([R // (32 // LC * NW), 1], [32 // LC, LC], [NW, 1], [0, 1])
    bx, bdy, offs = smem.open_pair(X, DY, rows, L, L, L, layout, CHUNK, CHUNKS, SPARE)
    r8 = gl.arange(0, R, layout=gl.SliceLayout(1, runs)) * VEC  # a run's first column in its chunk
    at = gl.expand_dims(r8, 1) + gl.expand_dims(gl.arange(0, VEC, layout=gl.SliceLayout(0, runs)), 0)
    cb = gl.arange(0, CB, layout=gl.SliceLayout(0, runs))
    cr = gl.arange(0, CB, layout=gl.SliceLayout(0, red))
    inv_l = 1.0 / L.to(gl.float32)
    base = gl.program_id(0) * 0  # buffer of the row's chunk 0
    for row in range(gl.program_id(0), rows, gl.num_programs(0)):
        mean = gl.load(Mean + row)
        rstd = gl.load(Rstd + row)
        c0 = row % G * Cg
        s1 = gl.zeros([R, CB], gl.float32, runs)  # [run, channel]: sums of (x - mean) * dy
        s2 = gl.zeros([R, CB], gl.float32, runs)  # sums of dy
        for c in gl.static_range(CHUNKS):  # columns past L landed as zeros: they add nothing
            smem.wait(c, CHUNKS, SPARE)
            x = _runs(smem.slot(bx, base, c, CHUNKS, SPARE).load(layout), R, VEC, runs)
            dy = _runs(smem.slot(bdy, base, c, CHUNKS, SPARE).load(layout), R, VEC, runs)
            hit = gl.expand_dims((c * CHUNK + r8) // HW, 1) == gl.expand_dims(cb, 0)  # [R, CB]
            s1 += gl.where(hit, gl.expand_dims(gl.sum((x - mean) * dy, axis=1), 1), 0.0)
            s2 += gl.where(hit, gl.expand_dims(gl.sum(dy, axis=1), 1), 0.0)
        a1 = gl.sum(gl.convert_layout(s1, red), axis=0)  # [CB]: per channel of the group
        a2 = gl.sum(gl.convert_layout(s2, red), axis=0)
        ch_ok = cr < Cg
        part = (row // G).to(gl.int64) * C + c0 + cr
        if HAS_W:
            gl.store(DW_part + part, a1 * rstd, mask=ch_ok)
        if HAS_DB:
            gl.store(DB_part + part, a2, mask=ch_ok)
        if HAS_W:
            wc = gl.load(W + c0 + cr, mask=ch_ok, other=0.0).to(gl.float32)
            a1 = a1 * wc
            a2 = a2 * wc
        c1 = gl.sum(a1, axis=0) * rstd * inv_l  # mean of w * dy * xhat over the row
        c2 = gl.sum(a2, axis=0) * inv_l  # mean of w * dy
        out = DX + row.to(gl.int64) * L
        for c in gl.static_range(CHUNKS):
            ch = (c * CHUNK + r8) // HW
            if HAS_W:
                w = gl.expand_dims(gl.load(W + c0 + ch, mask=ch < Cg, other=0.0).to(gl.float32), 1)
            else:
                w = 1.0
            sx = smem.slot(bx, base, c, CHUNKS, SPARE)
            sdy = smem.slot(bdy, base, c, CHUNKS, SPARE)
            xv = sx.load(layout)
            dyv = sdy.load(layout)
            # both buffers are free once read: the stream's next chunks land during this chunk's work
            smem.refill(sx, X, row, rows, L, L, offs, c, CHUNK, CHUNKS, SPARE, sdy, DY, L)
            x = _runs(xv, R, VEC, runs)
            dy = _runs(dyv, R, VEC, runs)
            dx = (w * dy - ((x - mean) * rstd * c1 + c2)) * rstd
            cols = c * CHUNK + at
            gl.store(out + cols, dx.to(DX.dtype.element_ty), mask=cols < L)
        base = smem.next_base(base, CHUNKS, SPARE)
    cp.wait_group(0)


# --- launches: each kernel's arguments spelled once, for the eager launchers and the plans -----------


def _fwd_kernel(cfg, flags, cl=False, stats=None):
    """(kernel, launch keywords) of the fused or looped forward config ``cfg``; ``stats`` False: the
    fused kernel writes no statistics (inference plans)."""
    if not cfg.fused:
        return _fwd_looped_kernel, dict(BLOCK=cfg.hw_block, **flags)
    meta = dict(ROWS=cfg.rows, CB=cfg.row_block, HWB=cfg.hw_block)
    if stats is not None:
        meta["STATS"] = stats
    return _fwd_fused_kernel, dict(meta, **flags, **({"CL": True} if cl else {}))


def _fwd_args(cfg, shape, G, eps, eps_lo) -> tuple:
    """The trailing (scalar) arguments of :func:`_fwd_kernel`'s kernel for x of ``shape`` (N, C, HW);
    its leading ones are (x, y, weight, bias, mean, rstd), placeholders where there is no weight / bias."""
    N, C, HW = shape
    Cg = C // G
    if cfg.fused:
        return (N * G, G, HW, Cg, eps, eps_lo)
    return (G, C, Cg * HW, HW, Cg, eps, eps_lo)


def _bwd_launch(how, shape, G, dtype, has_w, has_db, cl=False):
    """(kernel, grid, launch keywords, trailing arguments) of the backward ``how`` (a
    ``config.GroupNormBackward``, "smem" or "rows"). Its arguments: (x, dy, dx, weight, mean, rstd,
    dweight partials, dbias partials, *trailing)."""
    N, C, HW = shape
    Cg = C // G
    if how.kernel == "smem":
        meta = _bwd_smem_meta(how.smem, Cg, has_w, has_db)
        return _bwd_smem_kernel, how.smem.grid, meta, (N * G, G, C, HW, Cg, Cg * HW)
    cfg = how.tiles
    meta = dict(CB=cfg.row_block, HWB=cfg.hw_block, HAS_W=has_w, HAS_DB=has_db,
                ACC=config.tl_acc_dtype(dtype), num_warps=cfg.num_warps)  # fmt: skip
    if cl:
        meta["CL"] = True
    return _bwd_kernel, cfg.grid, meta, (G, C, HW, Cg)


def group_norm_fwd(x, weight, bias, num_groups, eps):
    """x: (N, C, HW), contiguous or channels-last (``common.channels_last``) -> (y in x's layout,
    mean, rstd), statistics per (n, g): shape (N * G,). Channels-last inputs take the fused kernel or
    ``_fwd_cl_kernel`` (read in place)."""
    N, C, HW = x.shape
    cl = channels_last(x)
    how = config.group_norm_fwd_strategy(N, C, HW, num_groups, x.dtype, x.device, cl,
                                         weight is not None or bias is not None)  # fmt: skip
    y = torch.empty_like(x)
    mean = torch.empty(N * num_groups, dtype=config.acc_dtype(x.dtype), device=x.device)
    rstd = torch.empty_like(mean)
    w = weight if weight is not None else x
    b = bias if bias is not None else x
    eps_lo = config.eps_tail(eps, x.device)
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, ACC=config.tl_acc_dtype(x.dtype),
                 num_warps=how.tiles.num_warps)  # fmt: skip
    if how.kernel == "split":
        _split_forward(how.split, x.shape, x.dtype, x.device, weight is not None, bias is not None,
                       num_groups, eps)(x, y, w, b, mean, rstd)  # fmt: skip
    elif how.kernel == "channels_last":  # the backward's tiles (channels contiguous), walked twice
        tile = how.tiles
        launch(_fwd_cl_kernel, tile.grid, x, y, w, b, mean, rstd, num_groups, C, HW, C // num_groups, eps,
               eps_lo, CB=tile.row_block, HWB=tile.hw_block, **flags)  # fmt: skip
    else:  # fused or looped
        kernel, meta = _fwd_kernel(how.tiles, flags, cl)
        tail = _fwd_args(how.tiles, x.shape, num_groups, eps, eps_lo)
        launch(kernel, how.tiles.grid, x, y, w, b, mean, rstd, *tail, **meta)
    return y, mean, rstd


def plan_group_norm(x, weight, bias, num_groups, eps, grad=False):
    """A plan for GroupNorm calls shaped like this one (contract extension, see
    layer_norm.plan_row_norm, whose call protocol it follows), for contiguous inputs of x's (N, C,
    HW) elements with the parameters of the same presence, dtypes and alignment; the compiled kernels
    are called directly (launch.Bound). None off the GPU. The forward is the fused kernel or, for
    rows over its limit, the split (:func:`_split_forward`) or looped one (both write the
    statistics, also for inference); the training backward is the shared-memory kernel
    (where :func:`_smem_ok`) or the one-program-per-row kernel, with planned partial sums, or for
    long fp32 rows the split backward (:func:`_split_backward`, a fresh workspace each call).

    Inference: ``run(input, None, weight, bias)`` -> y, one launch (no statistics written by the
    fused kernel). Training (``grad``): ``(forward, backward)``: ``forward(input, None, weight,
    bias)`` -> (y, None, mean, rstd); ``backward(dy, None, input, weight, mean, rstd)`` -> (dx, None,
    dweight, dbias), dy contiguous and 16-byte aligned, None where there is no weight / bias."""
    N, C, HW = x.shape
    rows = N * num_groups
    if x.device.type != "cuda":
        return None
    backward = None
    if grad:  # the plan's dy comes 16-byte aligned, in x's dtype
        back = config.group_norm_bwd_strategy(N, C, HW, num_groups, x.dtype, x.device, False,
                                              _smem_ok(x, num_groups))  # fmt: skip
        dtypes = (None if weight is None else weight.dtype, None if bias is None else bias.dtype)
        if back.kernel == "split":
            backward = _split_backward(back.split, x.shape, x.dtype, x.device, dtypes, num_groups)
        else:
            backward = _plan_backward(back, x, weight, bias, num_groups)
    acc = config.acc_dtype(x.dtype)
    how = config.group_norm_fwd_strategy(N, C, HW, num_groups, x.dtype, x.device, False,
                                         weight is not None or bias is not None)  # fmt: skip
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None, ACC=config.tl_acc_dtype(x.dtype),
                 num_warps=how.tiles.num_warps)  # fmt: skip
    eps_lo = config.eps_tail(eps, x.device)
    if how.kernel == "split":
        launch_fwd = _split_forward(how.split, x.shape, x.dtype, x.device, weight is not None,
                                    bias is not None, num_groups, eps)  # fmt: skip
    else:
        kernel, meta = _fwd_kernel(how.tiles, flags, stats=grad)
        bound = Bound(kernel, how.tiles.grid, x.device.index, **meta)
        tail = _fwd_args(how.tiles, x.shape, num_groups, eps, eps_lo)

        def launch_fwd(x, y, w, b, mean, rstd):
            bound(x, y, w, b, mean, rstd, *tail)

    def forward(x, r, w, b):
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=acc, device=x.device)
        rstd = torch.empty_like(mean)
        launch_fwd(x, y, x if w is None else w, x if b is None else b, mean, rstd)
        return y, None, mean, rstd

    def run(x, r, w, b):
        y = torch.empty_like(x)
        launch_fwd(x, y, x if w is None else w, x if b is None else b, y, y)
        return y

    if grad:
        return forward, backward
    return run if how.kernel == "fused" else (lambda x, r, w, b: forward(x, r, w, b)[0])


def _plan_backward(how, x, weight, bias, G):
    """The training plan's backward (see :func:`plan_group_norm`) ``how`` ("smem" or "rows"), then
    the per-sample partials summed by one launch (``reduce.plan_sum``)."""
    N, C, HW = x.shape
    has_w, has_db = weight is not None, bias is not None
    dtypes = (weight.dtype if has_w else None, bias.dtype if has_db else None)
    parts = has_w + has_db
    kernel, grid, meta, tail = _bwd_launch(how, x.shape, G, x.dtype, has_w, has_db)
    bound = Bound(kernel, grid, x.device.index, **meta)
    summed = reduce.plan_sum(N, C, dtypes, x.device) if parts else None
    acc = config.acc_dtype(x.dtype)

    def backward(dy, dh, x, w, mean, rstd):
        dx = torch.empty_like(x)
        buf, (dw, db) = reduce.targets(dtypes, N, C, acc, x.device)
        bound(x, dy, dx, x if w is None else w, mean, rstd, mean if dw is None else dw,
              mean if db is None else db, *tail)  # fmt: skip
        if buf is not None:
            dw, db = summed(buf)
        return dx, None, dw, db

    return backward


def group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    """-> (dx in x's layout, dweight, dbias), None where the forward had no weight / bias; dy in x's
    layout. Channels-last inputs take the one-program-per-row kernel (read in place)."""
    N, C, HW = x.shape
    cl = channels_last(x)
    how = config.group_norm_bwd_strategy(N, C, HW, num_groups, x.dtype, x.device, cl,
                                         not cl and _smem_ok(x, num_groups, dy))  # fmt: skip
    if how.kernel == "split":
        dtypes = (None if weight is None else weight.dtype, bias_dtype)
        dx, _, dweight, dbias = _split_backward(how.split, x.shape, x.dtype, x.device, dtypes, num_groups)(
            dy, None, x, weight, mean, rstd)
        return dx, dweight, dbias
    dx = torch.empty_like(x)
    acc = config.acc_dtype(x.dtype)
    has_w, has_db = weight is not None, bias_dtype is not None
    grad_dtypes = (weight.dtype if has_w else None, bias_dtype)
    part_buf, (dw_part, db_part) = reduce.targets(grad_dtypes, N, C, acc, x.device)
    args = (x, dy, dx, weight if has_w else x, mean, rstd, mean if dw_part is None else dw_part,
            mean if db_part is None else db_part)  # fmt: skip
    kernel, grid, meta, tail = _bwd_launch(how, x.shape, num_groups, x.dtype, has_w, has_db, cl)
    launch(kernel, grid, *args, *tail, **meta)
    if part_buf is None:
        return dx, None, None
    dweight, dbias = reduce.sum_partials(part_buf, grad_dtypes)
    return dx, dweight, dbias


def _smem_ok(x, G, dy=None) -> bool:
    """Whether the shared-memory backward may take x (N, C, HW) and dy, contiguous: x's and dy's rows
    16-byte aligned and dy in x's dtype (its buffers are sized for it). ``dy`` None: a plan's, which
    comes so. Whether it does is ``config.group_norm_bwd_strategy``'s choice."""
    N, C, HW = x.shape
    L = C // G * HW
    dy_ok = dy is None or (dy.dtype == x.dtype and dy.data_ptr() % 16 == 0)
    return dy_ok and smem.fits(L, L, x.data_ptr())


def _bwd_smem_meta(cfg, Cg, has_w, has_db) -> dict:
    """Launch keywords of ``_bwd_smem_kernel`` from its config."""
    cb = triton.next_power_of_2(Cg)
    return dict(CHUNK=cfg.block_size, CHUNKS=cfg.buffers, SPARE=int(cfg.prefetch), CB=cb, HAS_W=has_w,
                HAS_DB=has_db, num_warps=cfg.num_warps)  # fmt: skip


def _rows_of(t, HW):
    """(C,) per-channel values each repeated HW times, (C * HW,) contiguous: the split kernels' weight
    rows. One copy of an expanded view (``repeat_interleave``, several launches, took ~40 us of a
    ~250 us fp32 backward call's host time in cProfile on the H100's host: docs/tuning-log.md T21)."""
    return t.view(-1, 1).expand(t.numel(), HW).reshape(-1)


def _split_forward(cfg, shape, dtype, device, has_w, has_b, G, eps):
    """The forward of rows over the fused limit (``cfg`` from ``config.group_norm_split_forward``)
    for contiguous (N, C, HW) inputs of ``dtype``, as ``launch_fwd(x, y, weight, bias, mean, rstd)``
    (the full path and the plans call it): the row norms' split forward (LayerNorm) over the (N * G,
    L) rows by a direct launch (launch.Bound), with weight / bias row g = weight[g * Cg + j // HW]
    (j < L), a fresh workspace each call. Writes y and the (N * G,) statistics."""
    N, C, HW = shape
    M, L = N * G, C // G * HW
    acc = config.acc_dtype(dtype)
    bound = Bound(layer_norm._fwd_split_kernel, cfg.grid, device.index, IS_RMS=False, HAS_W=has_w,
                  HAS_B=has_b, ADD=False, HAS_R=False, DROPOUT=False, ACC=config.tl_acc_dtype(dtype),
                  num_warps=cfg.num_warps, **coop.split_meta(cfg))  # fmt: skip
    eps_lo = config.eps_tail(eps, device)

    def launch_fwd(x, y, w, b, mean, rstd):
        w_rows = _rows_of(w, HW) if has_w else x  # (G * L,): G weight rows of L
        b_rows = _rows_of(b, HW) if has_b else x
        work = coop.workspace(M, 2, cfg.split, acc, x.device)
        bound(x, x, y, y, w_rows, b_rows, mean, rstd, L, L, L, L, *work, M, L, cfg.split, G, eps, eps_lo, 0,
              0.0, 1.0)  # fmt: skip

    return launch_fwd


def _split_backward(cfg, shape, dtype, device, dtypes, G):
    """The backward of long rows (``cfg`` from ``config.group_norm_split_backward``) for (N, C, HW)
    inputs of ``dtype``, as a plan's ``backward(dy, None, x, weight, mean, rstd)`` -> (dx, None,
    dweight, dbias) (plan_group_norm's protocol; the full path calls it too): the row norms' split
    backward over the (N * G, L) rows by a direct launch (launch.Bound), with weight row g =
    weight[g * Cg + j // HW] (j < L); its (row groups, L) dweight / dbias partials (``dtypes``, None
    for none) are summed over the row groups of each g and over HW (torch.sum: a fixed order)."""
    N, C, HW = shape
    M, L = N * G, C // G * HW
    has_w, has_db = dtypes[0] is not None, dtypes[1] is not None
    groups = cfg.grid[0] // cfg.split
    acc = config.acc_dtype(dtype)
    bound = Bound(layer_norm._bwd_split_kernel, cfg.grid, device.index, IS_RMS=False, HAS_W=has_w,
                  HAS_DB=has_db, HAS_DH=False, HAS_DRES=False, DROPOUT=False, ACC=config.tl_acc_dtype(dtype),
                  num_warps=cfg.num_warps, **coop.split_meta(cfg))  # fmt: skip

    def backward(dy, dh, x, w, mean, rstd):
        dx = torch.empty_like(x)
        rows, drows = x.view(M, L), dx.view(M, L)
        buf, (dw_part, db_part) = reduce.targets(dtypes, groups, L, acc, x.device)
        w_rows = _rows_of(w, HW).view(G, L) if has_w else rows
        parts = (mean if dw_part is None else dw_part, mean if db_part is None else db_part)
        work = coop.workspace(M, 2, cfg.split, acc, x.device)
        bound(rows, dy.view(M, L), rows, drows, drows, w_rows, mean, rstd, *work, *parts, L, L, L, L, L, M, L,
              cfg.split, G, 0, 0.0, 1.0)  # fmt: skip
        if buf is None:
            return dx, None, None, None
        sums = iter(buf.view(-1, groups // G, G, C // G, HW).sum(dim=(1, 4)).view(-1, C))
        dw = next(sums).to(dtypes[0]) if has_w else None
        db = next(sums).to(dtypes[1]) if has_db else None
        return dx, None, dw, db

    return backward
