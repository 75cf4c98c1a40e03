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
