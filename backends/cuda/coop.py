"""Split rows: K co-resident programs share one long row and exchange partial statistics.

A row too long for one program's registers (N > the fused limit) is cut into K chunks of CHUNK
elements; program k of a row group holds chunk k in registers, writes its partial statistics,
waits at a per-row counter until all K partials are written, merges them (in a fixed order, so
the result is bitwise reproducible) and finishes its chunk from registers. x is read from HBM
once, where the looped kernels read it twice.

The wait is a spin on a global counter, so all K programs of a row must be resident at the same
time. ``config.split_row`` guarantees it: the kernel is compiled with a register cap (``maxnreg``)
and the grid never exceeds the programs per SM that the register file holds at that cap (64 K
registers // (threads x cap), within 64 warps) times the SMs. Programs of other kernels running at
the same time only delay ours. Pipelined kernels load the next row's chunk and publish its partials
(``arrive``) before waiting on this row (``wait``), so a row's barrier latency overlaps the next
row's load and reductions; the programs of a group still arrive at their rows in the same order.
Not for the Triton interpreter (programs run one after another there): ``config.split_row`` returns
None for CPU tensors, and the looped kernels serve.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def arrive(Count):
    """Count this program's partials of a row as written (``Count``: the row's int32 counter, zeroed
    before the launch). The CTA barrier first makes every thread's partial-sum stores happen before
    the release increment."""
    tl.debug_barrier()
    tl.atomic_add(Count, 1, sem="release", scope="gpu")


@triton.jit
def wait(Count, K):
    """Wait until all K programs of the row have arrived; the acquire poll makes their partials
    visible to the loads that follow (which read through L2: ``.cg``)."""
    while tl.atomic_add(Count, 0, sem="acquire", scope="gpu") < K:
        pass


@triton.jit
def load_chunk(PTR, row, stride, cols, mask, M, other):
    """Row ``row``'s chunk ``cols`` of a (M, N) tensor in its dtype; ``other`` outside the mask or
    past the last row (the prefetch of the row after a group's last)."""
    return tl.load(PTR + tl.cast(row, tl.int64) * stride + cols, mask=mask & (row < M), other=other)


def workspace(M: int, parts: int, chunks: int, acc: torch.dtype, device):
    """(partials (M, parts, KP) in ``acc``, zeroed int32 counters (M,)) for one launch of rows cut
    into ``chunks`` (KP = :func:`chunks_pow2` of it)."""
    part = torch.empty((M, parts, chunks_pow2(chunks)), dtype=acc, device=device)
    count = torch.zeros(M, dtype=torch.int32, device=device)
    return part, count


def chunks_pow2(chunks: int) -> int:
    return triton.next_power_of_2(chunks)


def split_meta(cfg) -> dict:
    """The launch keywords every split-row kernel takes from its ``config.split_row`` config: the
    chunk, KP (:func:`chunks_pow2` of the chunks), whether it prefetches, its register cap."""
    return dict(CHUNK=cfg.block_size, KP=chunks_pow2(cfg.split), PREFETCH=cfg.prefetch, maxnreg=cfg.maxnreg)
