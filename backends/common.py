"""Small @triton.jit math helpers shared by the CUDA and NPU kernels.

Only device-neutral math lives here (the common Triton subset both compilers accept); kernels and
launch choices stay in each backend's own files.
"""

import triton
import triton.language as tl


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
def residual_in(x, r_ptrs, mask, seed, offsets, p, scale, HAS_R: tl.constexpr, DROPOUT: tl.constexpr):
    """h = dropout(x) + residual for the fused add-norm (``x`` already in the math dtype).

    The dropout mask is regenerated, never stored: element (row, col) is kept where
    ``tl.rand(seed, row * N + col) >= p`` and then scaled by ``scale = 1 / (1 - p)``.
    """
    if DROPOUT:
        x = tl.where(tl.rand(seed, offsets) >= p, x * scale, 0.0)
    if HAS_R:
        x = x + tl.load(r_ptrs, mask=mask, other=0.0).to(x.dtype)
    return x


@triton.jit
def residual_grad(dh, dh_ptrs, dres_ptrs, mask, seed, offsets, p, scale,
                  HAS_DH: tl.constexpr, HAS_DRES: tl.constexpr, DROPOUT: tl.constexpr):
    """From the norm's gradient w.r.t. h: add h's own incoming gradient (``dh_ptrs``), store the
    residual's gradient (= dh), and return x's gradient (dh through the regenerated dropout mask).
    With every flag off it returns ``dh`` unchanged (the plain norms)."""  # fmt: skip
    if HAS_DH:
        dh = dh + tl.load(dh_ptrs, mask=mask, other=0.0).to(dh.dtype)
    if HAS_DRES:
        tl.store(dres_ptrs, dh.to(dres_ptrs.dtype.element_ty), mask=mask)
    if DROPOUT:
        dh = tl.where(tl.rand(seed, offsets) >= p, dh * scale, 0.0)
    return dh
