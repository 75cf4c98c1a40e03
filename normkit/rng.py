"""The dropout hash of the fused add-norms, in torch: element (row, col) of an (M, N) mask is kept
where ``u(row, col) >= p`` (docs/numerics.md, "Dropout"). The CUDA and NPU kernels
(``backends/common.py``: ``row_key``, ``hash_uniform``) and the reference backend draw the same bits:

    key = seed ^ (row << 32);  K = fmix32(key_hi ^ 0x5BD1E995) ^ key_lo
    u = (fmix32(col * 0x9E3779B1 ^ K) >> 8) * 2^-24      (uint32 arithmetic, products wrap)
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on uint32 values held in int64 (products wrap; the low 32 bits kept)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform(seed: int, rows, cols: int, device=None) -> torch.Tensor:
    """(rows, cols) fp32 draws in [0, 1), multiples of 2^-24; ``rows``: a count (rows 0, 1, ...) or
    a sequence of row indices (those rows' draws)."""
    if isinstance(rows, int):
        row = torch.arange(rows, dtype=torch.int64, device=device)
    else:
        row = torch.as_tensor(rows, dtype=torch.int64, device=device)
    key = torch.bitwise_xor(torch.tensor(seed, dtype=torch.int64, device=device), row << 32)
    k = _fmix32(((key >> 32) & _M32) ^ 0x5BD1E995) ^ (key & _M32)
    col = torch.arange(cols, dtype=torch.int64, device=device)
    h = _fmix32(((col[None, :] * 0x9E3779B1) & _M32) ^ k[:, None])
    return (h >> 8).to(torch.float32) * 2.0**-24


def keep_mask(shape, p: float, seed: int, device=None) -> torch.Tensor:
    """Dropout's keep mask for an input of ``shape`` (rows = all but the last dimension)."""
    cols = shape[-1] if len(shape) else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    p32 = torch.tensor(p, dtype=torch.float32).item()
    return (uniform(seed, rows, cols, device) >= p32).reshape(shape)
