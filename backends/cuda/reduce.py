"""Fixed-order sum of per-program partials: the deterministic second half of dweight/dbias.

Backward kernels write one fp32 row of partial sums per program (no atomics); this kernel adds
those rows in program order, so the result is bitwise identical run to run. dweight's and dbias's
partials live in one (K, G, N) buffer and are summed by one launch (one launch less per backward:
~35 us of host time on the H100 host, docs/tuning-log.md T10).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.cuda import config
from normkit.backends.cuda.launch import Bound, launch


@triton.jit
def _sum_partials_kernel(
    P,  # (K, G, N) partial sums, fp32 (fp64 for fp64 inputs), contiguous; K = 1 or 2
    Out0,  # (N,) sum of P[0], in its parameter's dtype
    Out1,  # (N,) sum of P[1] (unwritten when K == 1)
    G,  # number of partial rows
    N,  # columns
    BLOCK_G: tl.constexpr,  # partial rows loaded per step (summed by a fixed-shape tree)
    BLOCK_N: tl.constexpr,  # columns per program
):
    k = tl.program_id(1)  # which output
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    P += k.to(tl.int64) * G * N
    acc = tl.zeros([BLOCK_N], P.dtype.element_ty)
    for g0 in range(0, G, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask = (g < G)[:, None] & col_mask[None, :]
        tile = tl.load(P + g.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
        acc += tl.sum(tile, axis=0)
    if k == 0:
        tl.store(Out0 + cols, acc.to(Out0.dtype.element_ty), mask=col_mask)
    else:
        tl.store(Out1 + cols, acc.to(Out1.dtype.element_ty), mask=col_mask)


def partials(dtypes, G: int, N: int, acc: torch.dtype, device) -> tuple[torch.Tensor, list]:
    """One (K, G, N) buffer of partial rows for the K entries of ``dtypes`` that are not None (the
    parameters that have a gradient), and its (G, N) views in ``dtypes``' order (None elsewhere)."""
    buf = torch.empty((max(1, sum(d is not None for d in dtypes)), G, N), dtype=acc, device=device)
    slices = iter(buf)
    return buf, [None if d is None else next(slices) for d in dtypes]


def targets(dtypes, G: int, N: int, acc: torch.dtype, device, direct: bool = False):
    """Where a backward writes dweight / dbias: ``(buffer, [dweight's, dbias's])``, in ``dtypes``'
    order (None entries stay None). With ``direct`` (a grid of one program, whose partial row is the
    sum) or no gradient wanted: no buffer, and the (N,) gradients themselves in ``dtypes``. Else
    :func:`partials`' buffer and views, to be summed by :func:`sum_partials` or a :func:`plan_sum`."""
    if direct or all(d is None for d in dtypes):
        return None, [None if d is None else torch.empty(N, dtype=d, device=device) for d in dtypes]
    return partials(dtypes, G, N, acc, device)


def sum_partials(buf: torch.Tensor, dtypes) -> list:
    """Column sums of ``buf``'s (G, N) slices (from :func:`partials`), each in its entry of
    ``dtypes`` (None entries stay None), in a fixed order (bitwise reproducible), by one launch."""
    wanted = [d for d in dtypes if d is not None]
    if not wanted:
        return [None] * len(dtypes)
    _, G, N = buf.shape
    outs = [torch.empty(N, dtype=d, device=buf.device) for d in wanted]
    cfg = config.reduce(G, N, buf.device)
    launch(_sum_partials_kernel, (cfg.grid[0], len(outs)),
        buf, outs[0], outs[-1], G, N, key=(G, N, buf.dtype, outs[0].dtype, outs[-1].dtype),
        BLOCK_G=cfg.rows_per_program, BLOCK_N=cfg.block_size, num_warps=cfg.num_warps,
    )  # fmt: skip
    it = iter(outs)
    return [None if d is None else next(it) for d in dtypes]


def plan_sum(G: int, N: int, dtypes: tuple, device: torch.device):
    """:func:`sum_partials` for one buffer shape, as a plan (the row norms' training plans):
    ``run(buf)`` -> (sum of the first slice or None, sum of the last or None) for the two entries
    of ``dtypes`` (dweight's, dbias's; at least one not None), by a direct launch (launch.Bound)."""
    first, second = dtypes
    cfg = config.reduce(G, N, device)
    bound = Bound(_sum_partials_kernel, (cfg.grid[0], (first is not None) + (second is not None)),
                  device.index, BLOCK_G=cfg.rows_per_program, BLOCK_N=cfg.block_size,
                  num_warps=cfg.num_warps)  # fmt: skip

    def run(buf):
        out0 = None if first is None else torch.empty(N, dtype=first, device=buf.device)
        out1 = None if second is None else torch.empty(N, dtype=second, device=buf.device)
        bound(buf, out1 if out0 is None else out0, out0 if out1 is None else out1, G, N)
        return out0, out1

    return run
