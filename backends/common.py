"""Small @triton.jit math helpers shared by the CUDA and NPU kernels.

Only device-neutral math lives here (the common Triton subset both compilers accept); kernels and
launch choices stay in each backend's own files.
"""

import triton
import triton.language as tl


@triton.jit
def as_col(v, ROWS: tl.constexpr):
    """``v[:, None]``: a value a row of a (ROWS, BLOCK_N) tile, set against the tile's columns; ``v``
    itself where ROWS == 1 and the tile is one row in 1-D (its values a row are scalars)."""
    if ROWS != 1:
        v = v[:, None]
    return v


@triton.jit
def exact_eps(eps, eps_tail, ACC: tl.constexpr):
    """eps in the math dtype from its fp32 head and tail (the CUDA launchers' ``config.eps_tail``)."""
    if ACC == tl.float64:
        return tl.cast(eps_tail, tl.float64) + eps  # the fp64 tail first: fp32 + fp32 would round
    else:
        return eps


@triton.jit
def reciprocal(n, ACC: tl.constexpr):
    """1 / n correctly rounded, for the CUDA kernels. Triton's fp32 `/` is approximate
    (div.full.f32): sum / 1 could be off by an ulp, which rstd = 1 / sqrt(eps) then amplifies
    (N = 1 gave dx != 0). The NPU kernels get 1 / n from the host instead (div_rn is not in the
    subset triton-ascend is known to accept)."""
    if ACC == tl.float64:
        return 1.0 / tl.cast(n, tl.float64)
    else:
        return tl.math.div_rn(1.0, tl.cast(n, tl.float32))


@triton.jit
def normalize(x, mean, rstd, mask, IS_RMS: tl.constexpr):
    """Normalized x, zero where ``mask`` is off (so masked lanes add nothing to reductions)."""
    if IS_RMS:
        return x * rstd
    return tl.where(mask, (x - mean) * rstd, 0.0)


@triton.jit
def chan_merge(mean, m2, x, mask, seen, count):
    """Fold one tile into running (mean, M2) statistics with Chan's parallel formula.

    ``x``: the tile (masked lanes hold 0), ``count`` valid values in it, ``seen`` values before it
    (both in the math dtype). The tile's own M2 is taken around its own mean, so the merge stays
    exact for large means, where E[x^2] - E[x]^2 would cancel.
    """
    tile_mean = tl.sum(x, axis=0) / count
    d = tl.where(mask, x - tile_mean, 0.0)
    delta = tile_mean - mean
    total = seen + count
    mean = mean + delta * (count / total)
    m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (seen * count / total)
    return mean, m2


@triton.jit
def online_max_sum(m, s, x):
    """Fold a tile ``x`` (masked lanes -inf) into a running max ``m`` and sum of exp(x - m) ``s``.

    While every value seen is -inf the max is -inf; the shift then uses 0 so that no -inf - -inf
    (NaN) enters the sum, which stays 0. A row of all -inf ends with s = 0 and yields NaN, as in
    torch.
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
    return m_new, s


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def row_key(seed, row):
    """The dropout hash's per-row word (scalar ``row``, or a vector of rows): for the 64-bit key
    seed ^ (row << 32), K = fmix32(key_hi ^ 0x5BD1E995) ^ key_lo, in uint32 (the 64-bit seed is
    split once; no 64-bit vector math, which Ascend's compiler runs as scalar loops)."""
    seed = tl.cast(seed, tl.int64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32) ^ tl.cast(row, tl.uint32)
    return _fmix32(hi ^ 0x5BD1E995) ^ lo


@triton.jit
def hash_uniform(key, col):
    """A uniform draw in [0, 1) (fp32, multiples of 2^-24) for element ``col`` of the row whose
    :func:`row_key` is ``key``: u = (fmix32(col * 0x9E3779B1 ^ K) >> 8) / 2^24 (docs/numerics.md,
    "Dropout"; ``normkit.rng`` computes the same in torch). 32-bit low multiplies, xors and shifts
    only, which Ascend's compiler keeps as vector code (Philox's high multiply becomes scalar loops
    there)."""
    h = _fmix32((col.to(tl.uint32) * 0x9E3779B1) ^ key)
    return (h >> 8).to(tl.int32).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _keep(key, cols, p):
    """Dropout's keep decision for columns ``cols`` of the row whose :func:`row_key` is ``key``:
    the hash's draw >= p (every backend and the reference draw the same bits)."""
    return hash_uniform(key, cols) >= p


@triton.jit
def residual_in(x, r_ptrs, mask, key, cols, p, scale, HAS_R: tl.constexpr, DROPOUT: tl.constexpr):
    """h = dropout(x) + residual for the fused add-norm (``x`` already in the math dtype).

    The dropout mask is regenerated, never stored: element (row, col) kept where :func:`_keep`
    says so for the row's ``key`` (:func:`row_key`) and ``cols``, then scaled by ``scale = 1 / (1 - p)``.
    """
    if HAS_R:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
    else:
        r = x
    return residual_add(x, r, key, cols, p, scale, HAS_R, DROPOUT)


@triton.jit
def residual_add(x, r, key, cols, p, scale, HAS_R: tl.constexpr, DROPOUT: tl.constexpr):
    """:func:`residual_in` with the residual ``r`` already loaded (any dtype; unread unless HAS_R)."""
    if DROPOUT:
        x = tl.where(_keep(key, cols, p), x * scale, 0.0)
    if HAS_R:
        x = x + r.to(x.dtype)
    return x


@triton.jit
def residual_grad(dh, dh_ptrs, dres_ptrs, mask, key, cols, p, scale,
                  HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, DROPOUT: tl.constexpr):  # fmt: skip
    """From the norm's gradient w.r.t. h: add h's own incoming gradient (``dh_ptrs``), store the
    residual's gradient (= dh), and return x's gradient (dh through the regenerated dropout mask).
    With every flag off it returns ``dh`` unchanged (the plain norms)."""  # fmt: skip
    if HAS_DH:
        dh = dh + tl.load(dh_ptrs, mask=mask, other=0.0).to(dh.dtype)
    if HAS_DRES:
        tl.store(dres_ptrs, dh.to(dres_ptrs.dtype.element_ty), mask=mask)
    if DROPOUT:
        dh = tl.where(_keep(key, cols, p), dh * scale, 0.0)
    return dh


# --- Row norms in column tiles: the looped kernels' bodies, shared by the CUDA and NPU kernels -------
# Each backend's kernel picks the rows (CUDA: one program a row / a grid of (row chunk, column tile);
# NPU: persistent programs over the same items) and hands in what it computes its own way: 1 / N
# (CUDA: correctly rounded in the kernel, common.reciprocal; NPU: from the host) and eps in ACC.


@triton.jit
def row_norm_fwd_tiles(X, R, H, Y, W, B, Mean, Rstd, row, stride_x, stride_r, stride_h, stride_y, N, inv_n,
                       eps, seed, p, scale, BLOCK: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
                       HAS_B: tl.constexpr, ADD: tl.constexpr, HAS_R: tl.constexpr, DROPOUT: tl.constexpr,
                       ACC: tl.constexpr):  # fmt: skip
    """LayerNorm / RMSNorm forward of row ``row`` in column tiles of BLOCK, x read twice; with ADD of
    h = dropout(x) + residual (stored to H in sweep 1, recomputed bitwise the same in sweep 2).
    Writes Rstd[row] and (LayerNorm) Mean[row]."""
    row64 = tl.cast(row, tl.int64)
    x_row = X + row64 * stride_x
    r_row = R + row64 * stride_r
    cols = tl.arange(0, BLOCK)
    key = row_key(seed, row)  # dropout: the row's hash key
    # Sweep 1: statistics. LayerNorm merges per-tile (mean, M2) pairs of x - shift with Chan's
    # formula (exact differences; accurate for large means); RMSNorm sums squares.
    if IS_RMS:
        shift = 0.0
    else:
        shift = tl.load(x_row).to(ACC)
        if ADD and HAS_R:
            shift += tl.load(r_row).to(ACC)
    mean = tl.zeros((), ACC)
    m2 = tl.zeros((), ACC)
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
        if ADD:
            h = residual_in(x, r_row + offs, mask, key, offs, p, scale, HAS_R, DROPOUT).to(H.dtype.element_ty)
            tl.store(H + row64 * stride_h + offs, h, mask=mask)
            x = h.to(ACC)
        if IS_RMS:
            m2 += tl.sum(x * x, axis=0)
        else:
            count = tl.cast(tl.minimum(N - start, BLOCK), ACC)
            xs = tl.where(mask, x - shift, 0.0)
            mean, m2 = chan_merge(mean, m2, xs, mask, tl.cast(start, ACC), count)
    rstd = 1.0 / tl.sqrt(m2 * inv_n + eps)
    tl.store(Rstd + row, rstd)
    if not IS_RMS:
        tl.store(Mean + row, shift + mean)
    # Sweep 2: normalize.
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
        if ADD:
            x = residual_in(x, r_row + offs, mask, key, offs, p, scale, HAS_R,
                            DROPOUT).to(H.dtype.element_ty).to(ACC)  # fmt: skip
        y = normalize(x - shift, mean, rstd, mask, IS_RMS)
        if HAS_W:
            y = y * tl.load(W + offs, mask=mask, other=0.0).to(ACC)
        if HAS_B:
            y = y + tl.load(B + offs, mask=mask, other=0.0).to(ACC)
        tl.store(Y + row64 * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def row_norm_bwd_terms(X, DY, W, Mean, Rstd, C1, C2, row, stride_x, stride_dy, N, inv_n, BLOCK: tl.constexpr,
                       IS_RMS: tl.constexpr, HAS_W: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The backward's row terms of row ``row`` in column tiles of BLOCK: C1[row] = mean of
    xhat * w * dy, C2[row] = mean of w * dy (LayerNorm only)."""
    x_row = X + tl.cast(row, tl.int64) * stride_x
    dy_row = DY + tl.cast(row, tl.int64) * stride_dy
    rstd = tl.load(Rstd + row)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(Mean + row)
    cols = tl.arange(0, BLOCK)
    c1 = tl.zeros((), ACC)
    c2 = tl.zeros((), ACC)
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
        wdy = tl.load(dy_row + offs, mask=mask, other=0.0).to(ACC)
        if HAS_W:
            wdy = wdy * tl.load(W + offs, mask=mask, other=0.0).to(ACC)
        c1 += tl.sum(normalize(x, mean, rstd, mask, IS_RMS) * wdy, axis=0)
        c2 += tl.sum(wdy, axis=0)
    tl.store(C1 + row, c1 * inv_n)
    if not IS_RMS:
        tl.store(C2 + row, c2 * inv_n)


@triton.jit
def row_norm_bwd_tile(X, DY, DH, DX, DRES, W, Mean, Rstd, C1, C2, DW_part, DB_part, chunk, cols, stride_x,
                      stride_dy, stride_dh, stride_dx, stride_dres, M, N, rows_per_chunk, seed, p, scale,
                      BLOCK: tl.constexpr, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
                      HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, DROPOUT: tl.constexpr,
                      ACC: tl.constexpr):  # fmt: skip
    """dx (and the add-norm's dresidual) of the rows of chunk ``chunk`` (rows_per_chunk rows) at
    columns ``cols`` (BLOCK of them), from the row terms C1, C2 (:func:`row_norm_bwd_terms`); row
    ``chunk`` of DW_part / DB_part = the chunk's column sums of dy * xhat / dy there."""
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(ACC)
    dw = tl.zeros([BLOCK], ACC)
    db = tl.zeros([BLOCK], ACC)
    row_start = chunk * rows_per_chunk
    for row in range(row_start, tl.minimum(row_start + rows_per_chunk, M)):
        r64 = tl.cast(row, tl.int64)
        x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(ACC)
        dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(ACC)
        rstd = tl.load(Rstd + row)
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.load(Mean + row)
        xhat = normalize(x, mean, rstd, mask, IS_RMS)
        if HAS_W:
            wdy = dy * w
        else:
            wdy = dy
        if IS_RMS:
            dx = (wdy - xhat * tl.load(C1 + row)) * rstd
        else:
            dx = (wdy - (xhat * tl.load(C1 + row) + tl.load(C2 + row))) * rstd
        dx = residual_grad(dx, DH + r64 * stride_dh + cols, DRES + r64 * stride_dres + cols, mask,
                           row_key(seed, row), cols, p, scale, HAS_DH, HAS_DRES, DROPOUT)  # fmt: skip
        tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            dw += dy * xhat
        if HAS_DB:
            db += dy
    part = tl.cast(chunk, tl.int64) * N + cols
    if HAS_W:
        tl.store(DW_part + part, dw, mask=mask)
    if HAS_DB:
        tl.store(DB_part + part, db, mask=mask)


@triton.jit
def softmax_fwd_tiles(X, Y, row, stride_x, stride_y, N, BLOCK: tl.constexpr, LOG: tl.constexpr,
                      ACC: tl.constexpr):  # fmt: skip
    """softmax (log_softmax where LOG) of row ``row`` in column tiles of BLOCK: the row's max and sum
    of exp(x - max) online in one sweep, the outputs in a second (the looped forwards of both
    backends; their backwards differ: CUDA's orders its tiles for L2 and sets eviction hints)."""
    x_row = X + tl.cast(row, tl.int64) * stride_x
    y_row = Y + tl.cast(row, tl.int64) * stride_y
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    for start in range(0, N, BLOCK):
        offs = start + cols
        x = tl.load(x_row + offs, mask=offs < N, other=float("-inf")).to(ACC)
        m, s = online_max_sum(m, s, x)
    for start in range(0, N, BLOCK):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(ACC)
        if LOG:
            y = (x - m) - tl.log(s)
        else:
            y = tl.exp(x - m) / s
        tl.store(y_row + offs, y.to(Y.dtype.element_ty), mask=mask)


# --- GroupNorm: one (sample, group) row of L = (C / G) * HW elements -------------------------------
# A row is contiguous in an (N, C, HW) input; in a channels-last one (memory (N, HW, C): NHWC,
# NDHWC) it is HW runs of Cg contiguous channels, C apart. ``CL`` picks the layout; in it the row's
# element j is (position j // Cg, channel j % Cg), so consecutive j stay contiguous in memory.


def channels_last(x) -> bool:
    """Whether an (N, C, HW) input of the channel norms' contract is channels-last (strides
    (HW * C, 1, C)) rather than contiguous: the front end hands the kernels one of the two."""
    return not x.is_contiguous()


@triton.jit
def group_norm_at(row, j, G, C, HW, Cg, CL: tl.constexpr):
    """Offsets and channels (within the group) of elements ``j`` of row ``row`` = (n, g)."""
    if CL:
        base = tl.cast(row // G, tl.int64) * HW * C + (row % G) * Cg
        return base + (j // Cg) * C + j % Cg, j % Cg
    else:
        return tl.cast(row, tl.int64) * (Cg * HW) + j, j // HW


@triton.jit
def group_norm_channel_at(row, cl, p, G, C, HW, Cg, CL: tl.constexpr):
    """Offsets of positions ``p`` (of HW) of channel ``cl`` (within the group) of row ``row``."""
    if CL:
        return tl.cast(row // G, tl.int64) * HW * C + (row % G) * Cg + cl + p * C
    else:
        return tl.cast(row, tl.int64) * (Cg * HW) + cl * HW + p


@triton.jit
def group_norm_row_fwd(X, Y, W, B, Mean, Rstd, row, G, C, L, HW, Cg, inv_l, eps,
                       BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                       ACC: tl.constexpr, CL: tl.constexpr, PER_CHANNEL: tl.constexpr):  # fmt: skip
    """Normalize row ``row`` = (n, g) of an (N, C, HW) input, contiguous or channels-last (``CL``).
    Statistics of x - (the row's first element) merged tile by tile (Chan). ``inv_l`` = 1 / L,
    correctly rounded by the caller. The output sweep walks the row's tiles and loads each element's
    weight / bias (a gather), or with ``PER_CHANNEL`` walks it channel by channel with one weight /
    bias per channel, as the backward does: Ascend's compiler turns the gather into scalar loops
    (ci/npu_stage2.py: 2 a tile), so the NPU kernels take PER_CHANNEL."""
    cols = tl.arange(0, BLOCK)
    shift = tl.load(X + group_norm_at(row, 0, G, C, HW, Cg, CL)[0]).to(ACC)
    mean = tl.zeros((), ACC)
    m2 = tl.zeros((), ACC)
    for start in range(0, L, BLOCK):
        offs = start + cols
        mask = offs < L
        at, _ = group_norm_at(row, offs, G, C, HW, Cg, CL)
        xs = tl.where(mask, tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift, 0.0)
        count = tl.cast(tl.minimum(L - start, BLOCK), ACC)
        mean, m2 = chan_merge(mean, m2, xs, mask, tl.cast(start, ACC), count)
    rstd = 1.0 / tl.sqrt(m2 * inv_l + eps)
    tl.store(Mean + row, shift + mean)
    tl.store(Rstd + row, rstd)
    c0 = (row % G) * Cg
    if PER_CHANNEL:
        for cl in range(0, Cg):
            for start in range(0, HW, BLOCK):
                offs = start + cols
                mask = offs < HW
                at = group_norm_channel_at(row, cl, offs, G, C, HW, Cg, CL)
                y = (tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift - mean) * rstd
                if HAS_W:
                    y = y * tl.load(W + c0 + cl).to(ACC)
                if HAS_B:
                    y = y + tl.load(B + c0 + cl).to(ACC)
                tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)
    else:
        for start in range(0, L, BLOCK):
            offs = start + cols
            mask = offs < L
            at, ch = group_norm_at(row, offs, G, C, HW, Cg, CL)
            y = (tl.load(X + at, mask=mask, other=0.0).to(ACC) - shift - mean) * rstd
            if HAS_W:
                y = y * tl.load(W + c0 + ch, mask=mask, other=0.0).to(ACC)
            if HAS_B:
                y = y + tl.load(B + c0 + ch, mask=mask, other=0.0).to(ACC)
            tl.store(Y + at, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def group_norm_row_bwd(X, DY, DX, W, Mean, Rstd, DW_part, DB_part, row, G, C, L, HW, Cg, inv_l,
                       BLOCK: tl.constexpr, HAS_W: tl.constexpr, HAS_DB: tl.constexpr,
                       ACC: tl.constexpr, CL: tl.constexpr):  # fmt: skip
    """Backward of one (n, g) row. Sweep 1 walks the row channel by channel: the per-channel sums
    of dy * xhat and dy are the dweight / dbias partials of sample n (row n of the (N, C) partial
    buffers), and weighted by w_c they add up to the row's two dx terms. Sweep 2 writes dx."""
    n = row // G
    c0 = (row % G) * Cg
    mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    cols = tl.arange(0, BLOCK)
    c1 = tl.zeros((), ACC)
    c2 = tl.zeros((), ACC)
    for cl in range(0, Cg):
        sum_dyx = tl.zeros((), ACC)
        sum_dy = tl.zeros((), ACC)
        for start in range(0, HW, BLOCK):
            offs = start + cols
            mask = offs < HW
            at = group_norm_channel_at(row, cl, offs, G, C, HW, Cg, CL)
            x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
            dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
            sum_dyx += tl.sum(tl.where(mask, (x - mean) * rstd, 0.0) * dy, axis=0)
            sum_dy += tl.sum(dy, axis=0)
        part = tl.cast(n, tl.int64) * C + c0 + cl
        if HAS_W:
            tl.store(DW_part + part, sum_dyx)
            w = tl.load(W + c0 + cl).to(ACC)
            c1 += w * sum_dyx
            c2 += w * sum_dy
        else:
            c1 += sum_dyx
            c2 += sum_dy
        if HAS_DB:
            tl.store(DB_part + part, sum_dy)
    c1 = c1 * inv_l
    c2 = c2 * inv_l
    for cl in range(0, Cg):
        if HAS_W:
            w = tl.load(W + c0 + cl).to(ACC)
        else:
            w = 1.0
        for start in range(0, HW, BLOCK):
            offs = start + cols
            mask = offs < HW
            at = group_norm_channel_at(row, cl, offs, G, C, HW, Cg, CL)
            x = tl.load(X + at, mask=mask, other=0.0).to(ACC)
            dy = tl.load(DY + at, mask=mask, other=0.0).to(ACC)
            dx = (w * dy - ((x - mean) * rstd * c1 + c2)) * rstd
            tl.store(DX + at, dx.to(DX.dtype.element_ty), mask=mask)


# --- BatchNorm: per-channel statistics over (N, HW) of a contiguous (N, C, HW) input ---------------


@triton.jit
def batch_norm_channel_stats(X, Mean, Var, c, N, C, HW, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Mean and biased variance of channel ``c`` over N samples x HW: Chan merging of tiles of
    x - x[0, c, 0], samples in order (deterministic)."""
    cols = tl.arange(0, BLOCK)
    shift = tl.load(X + tl.cast(c, tl.int64) * HW).to(ACC)
    mean = tl.zeros((), ACC)
    m2 = tl.zeros((), ACC)
    seen = tl.zeros((), ACC)
    for n in range(0, N):
        base = (tl.cast(n, tl.int64) * C + c) * HW
        for start in range(0, HW, BLOCK):
            offs = start + cols
            mask = offs < HW
            xs = tl.where(mask, tl.load(X + base + offs, mask=mask, other=0.0).to(ACC) - shift, 0.0)
            count = tl.cast(tl.minimum(HW - start, BLOCK), ACC)
            mean, m2 = chan_merge(mean, m2, xs, mask, seen, count)
            seen += count
    tl.store(Mean + c, shift + mean)
    tl.store(Var + c, m2 / seen)


@triton.jit
def batch_norm_row_apply(X, Y, W, B, Mean, Rstd, row, C, HW, BLOCK: tl.constexpr,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """y = (x - mean_c) * rstd_c * w_c + b_c over row ``row`` = (n, c) of HW elements."""
    c = row % C
    base = tl.cast(row, tl.int64) * HW
    scale = tl.load(Rstd + c).to(ACC)
    if HAS_W:
        scale = scale * tl.load(W + c).to(ACC)
    shift = -tl.load(Mean + c).to(ACC) * scale
    if HAS_B:
        shift = shift + tl.load(B + c).to(ACC)
    cols = tl.arange(0, BLOCK)
    for start in range(0, HW, BLOCK):
        offs = start + cols
        mask = offs < HW
        x = tl.load(X + base + offs, mask=mask, other=0.0).to(ACC)
        tl.store(Y + base + offs, (x * scale + shift).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def batch_norm_channel_grad_sums(X, DY, Mean, Rstd, Sum_dy, Sum_dy_xhat, c, N, C, HW,
                                 BLOCK: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """sum(dy) and sum(dy * xhat) of channel ``c`` (dbias, dweight and the dx terms)."""
    cols = tl.arange(0, BLOCK)
    mean = tl.load(Mean + c).to(ACC)
    rstd = tl.load(Rstd + c).to(ACC)
    s_dy = tl.zeros((), ACC)
    s_dyx = tl.zeros((), ACC)
    for n in range(0, N):
        base = (tl.cast(n, tl.int64) * C + c) * HW
        for start in range(0, HW, BLOCK):
            offs = start + cols
            mask = offs < HW
            x = tl.load(X + base + offs, mask=mask, other=0.0).to(ACC)
            dy = tl.load(DY + base + offs, mask=mask, other=0.0).to(ACC)
            s_dy += tl.sum(dy, axis=0)
            s_dyx += tl.sum(tl.where(mask, (x - mean) * rstd, 0.0) * dy, axis=0)
    tl.store(Sum_dy + c, s_dy)
    tl.store(Sum_dy_xhat + c, s_dyx)


@triton.jit
def batch_norm_row_dx(X, DY, DX, W, Mean, Rstd, Sum_dy, Sum_dy_xhat, row, C, HW, inv_count,
                      BLOCK: tl.constexpr, HAS_W: tl.constexpr, TRAINING: tl.constexpr,
                      ACC: tl.constexpr):  # fmt: skip
    """dx over row (n, c). Training: w * rstd * (dy - (sum_dy + xhat * sum_dy_xhat) / count);
    eval (fixed running statistics): w * rstd * dy."""
    c = row % C
    base = tl.cast(row, tl.int64) * HW
    rstd = tl.load(Rstd + c).to(ACC)
    scale = rstd
    if HAS_W:
        scale = scale * tl.load(W + c).to(ACC)
    if TRAINING:
        mean = tl.load(Mean + c).to(ACC)
        a = tl.load(Sum_dy + c).to(ACC) * inv_count
        b = tl.load(Sum_dy_xhat + c).to(ACC) * inv_count
    cols = tl.arange(0, BLOCK)
    for start in range(0, HW, BLOCK):
        offs = start + cols
        mask = offs < HW
        dy = tl.load(DY + base + offs, mask=mask, other=0.0).to(ACC)
        if TRAINING:
            x = tl.load(X + base + offs, mask=mask, other=0.0).to(ACC)
            dy = dy - (a + (x - mean) * rstd * b)
        tl.store(DX + base + offs, (dy * scale).to(DX.dtype.element_ty), mask=mask)
