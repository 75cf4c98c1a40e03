"""Split rows: K programs share one long row and exchange partial statistics.

A row too long for one program's registers (N > the fused limit) is cut into K chunks of CHUNK
elements; program k of a row group holds chunk k in registers, writes its partial statistics,
waits at a per-row counter until all K partials are written, merges them (in a fixed order, so
the result is bitwise reproducible) and finishes its chunk from registers. x is read from HBM
once, where the looped kernels read it twice.

The row wait is a spin on a global counter, so it is only safe among programs that are all resident.
A grid sized to the SMs' register files is no guarantee: another stream's kernel (or an MPS / green-
context limit) can hold most SMs, and if it waits for work queued after ours, a spin on a partner
that never gets an SM hangs both. So a row group first *joins* (:func:`join`): each program counts
itself in at its group's start word and waits, at most ``SPIN`` polls, for the other K - 1. A
program that is running stays resident until it exits, so a group whose K programs all joined waits
only on running programs and always makes progress. A group that did not fill in time is closed (one
compare-and-swap decides, so every member, early or late, sees the same outcome) and its programs
run *solo*: before its row loop, each writes the partials of every chunk of its rows itself (the
kernels' ``_*_split_solo``: the same code and values a partner would write, so the merge, and the
result, are bitwise the same), then runs the loop without waiting. (Inside the loop the solo branch
kept the loop's registers live across it: ptxas spilled up to 288 B more.) Solo costs K reads of the
row instead of one; it happens only when SMs are held by others (or under the interpreter, which
runs programs one after another: CI runs the split kernels solo).

Pipelined kernels load the next row's chunk and publish its partials (``arrive``) before waiting
on this row (``wait``), so a row's barrier latency overlaps the next row's load and reductions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Polls a program makes for its row group to fill before the group runs solo. Programs of one
# launch start within microseconds of each other on free SMs; a poll is an L2 round trip (~0.5 us):
# 4096 polls is ~2 ms, paid once a program and only where partners did not start.
SPIN = 4096
_CLOSED = tl.constexpr(1 << 30)  # a closed group's start word (joins after it only add to it)


@triton.jit
def join(Start, K, SPIN: tl.constexpr):
    """Count this program in at its row group's start word ``Start`` (int32, zeroed) and return
    whether all K programs of the group joined (True: wait on partners; False: run solo). Waits at
    most SPIN polls; then closes the group with a compare-and-swap unless the last partner joined
    first, so all K programs get the same answer."""
    seen = tl.atomic_add(Start, 1, sem="relaxed", scope="gpu") + 1
    polls = 0
    while (seen < K) & (polls < SPIN):
        seen = tl.atomic_add(Start, 0, sem="relaxed", scope="gpu")
        polls += 1
    while seen < K:
        old = tl.atomic_cas(Start, seen, _CLOSED, sem="relaxed", scope="gpu")
        seen = tl.where(old == seen, _CLOSED, old)
    return seen < _CLOSED


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
    past the last row (the prefetch of the row after a group's last). The row test as a select, not
    ``mask & (row < M)``: Triton 3.9's interpreter gives that an integer mask it cannot load with."""
    inside = tl.where(row < M, mask, False)
    return tl.load(PTR + tl.cast(row, tl.int64) * stride + cols, mask=inside, other=other)


def workspace(M: int, parts: int, chunks: int, acc: torch.dtype, device):
    """(partials (M, parts, KP) in ``acc``, zeroed int32 counters (2 M,)) for one launch of rows cut
    into ``chunks`` (KP = :func:`chunks_pow2` of it): counters [0, M) are the row barriers, [M, M +
    groups) the row groups' start words (:func:`join`; groups <= M)."""
    part = torch.empty((M, parts, chunks_pow2(chunks)), dtype=acc, device=device)
    count = torch.zeros(2 * M, dtype=torch.int32, device=device)
    return part, count


def chunks_pow2(chunks: int) -> int:
    return triton.next_power_of_2(chunks)


def split_meta(cfg) -> dict:
    """The launch keywords every split-row kernel takes from its ``config.split_row`` config: the
    chunk, KP (:func:`chunks_pow2` of the chunks), whether it prefetches, the polls of its
    :func:`join`, its register cap."""
    return dict(CHUNK=cfg.block_size, KP=chunks_pow2(cfg.split), PREFETCH=cfg.prefetch, SPIN=cfg.spin,
                maxnreg=cfg.maxnreg)
