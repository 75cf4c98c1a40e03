"""GroupNorm (and InstanceNorm) for Ascend NPUs (triton-ascend): kernels, then launchers.

Same row decomposition as the CUDA twin (each (sample, group) is a row of L = (C / G) * HW
elements: contiguous, or HW runs of C / G channels in a channels-last input), on Ascend's terms: a
persistent grid of vector-core count programs looping over rows, 1024-element tiles, fp32 math,
1 / L from the host. Row bodies: ``backends/common.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import channels_last, group_norm_row_bwd, group_norm_row_fwd
from normkit.backends.npu import config
from normkit.backends.npu.reduce import param_sums


@triton.jit
def _fwd_kernel(
    X,  # (N, C, HW) input, contiguous or channels-last (CL)
    Y,  # (N, C, HW) out, X's layout
    W,  # (C,) weight (unread unless HAS_W)
    B,  # (C,) bias (unread unless HAS_B)
    Mean,  # (N * G,) out, fp32
    Rstd,  # (N * G,) out, fp32
    R,  # rows: N * G
    G,
    C,
    L,
    HW,
    Cg,
    inv_l,  # 1 / L from the host
    eps,
    BLOCK_SIZE: tl.constexpr,  # 1024
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    CL: tl.constexpr,  # X / Y channels-last: memory (N, HW, C)
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 40.8 KB, no scalar loop
    # (one weight / bias per channel: PER_CHANNEL; the per-element gather took 64.8 KB and 2 loops).
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        group_norm_row_fwd(X, Y, W, B, Mean, Rstd, row, G, C, L, HW, Cg, inv_l, eps, BLOCK_SIZE, HAS_W,
                           HAS_B, tl.float32, CL, True)  # fmt: skip


@triton.jit
def _bwd_kernel(
    X,  # (N, C, HW) forward input
    DY,  # (N, C, HW) output gradient, X's layout
    DX,  # (N, C, HW) out, X's layout
    W,  # (C,) weight (unread unless HAS_W)
    Mean,  # (N * G,)
    Rstd,  # (N * G,)
    DW_part,  # (N, C) out, fp32 (written when HAS_W)
    DB_part,  # (N, C) out, fp32 (written when HAS_DB)
    R,
    G,
    C,
    L,
    HW,
    Cg,
    inv_l,
    BLOCK_SIZE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DB: tl.constexpr,
    CL: tl.constexpr,  # X / DY / DX channels-last: memory (N, HW, C)
):
    # UB (planned by bishengir-compile, ci/npu_stage2.py, 2026-11-26): up to 56.2 KB.
    for row in range(tl.program_id(0), R, tl.num_programs(0)):
        group_norm_row_bwd(X, DY, DX, W, Mean, Rstd, DW_part, DB_part, row, G, C, L, HW, Cg, inv_l,
                           BLOCK_SIZE, HAS_W, HAS_DB, tl.float32, CL)  # fmt: skip


def group_norm_fwd(x, weight, bias, num_groups, eps):
    """x: (N, C, HW), contiguous or channels-last (``common.channels_last``) -> (y in x's layout,
    mean, rstd), statistics per (n, g): shape (N * G,)."""
    N, C, HW = x.shape
    rows, L = N * num_groups, C // num_groups * HW
    cfg = config.rows(rows, x.device)
    y = torch.empty_like(x)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _fwd_kernel[cfg.grid](
        x, y, weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
        rows, num_groups, C, L, HW, C // num_groups, 1.0 / L, eps,
        BLOCK_SIZE=cfg.block_size, HAS_W=weight is not None, HAS_B=bias is not None, CL=channels_last(x),
    )  # fmt: skip
    return y, mean, rstd


def group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    """-> (dx in x's layout, dweight, dbias), None where the forward had no weight / bias; dy in
    x's layout."""
    N, C, HW = x.shape
    rows, L = N * num_groups, C // num_groups * HW
    cfg = config.rows(rows, x.device)
    dx = torch.empty_like(x)
    has_w, has_db = weight is not None, bias_dtype is not None
    dw_part = torch.empty((N, C), dtype=torch.float32, device=x.device) if has_w else mean
    db_part = torch.empty((N, C), dtype=torch.float32, device=x.device) if has_db else mean
    _bwd_kernel[cfg.grid](
        x, dy, dx, weight if has_w else x, mean, rstd, dw_part, db_part, rows, num_groups, C, L, HW,
        C // num_groups, 1.0 / L, BLOCK_SIZE=cfg.block_size, HAS_W=has_w, HAS_DB=has_db, CL=channels_last(x),
    )  # fmt: skip
    dweight, dbias = param_sums(dw_part if has_w else None, weight.dtype if has_w else None,
                                db_part if has_db else None, bias_dtype)  # fmt: skip
    return dx, dweight, dbias
