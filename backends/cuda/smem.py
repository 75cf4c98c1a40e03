"""Rows resident in shared memory: the helpers of the Gluon kernels that hold a whole row on chip.

A forward that must see the whole row before it can write any of it (its statistics) either holds
the row in registers (fused kernels, up to 32768 elements), splits it over co-resident programs that
exchange partial statistics through global memory (coop.py), or reads it twice. A 16-bit row of up
to 114688 elements (7 buffers of 16384) fits one SM's shared memory (227 KB a block on the H100),
so one program can hold it there without spending registers. Each program's rows (pid, pid +
programs, ...) stream through CHUNKS buffers of CHUNK elements, plus SPARE (0 or 1) spare buffers:
chunk g of the stream lands by ``cp.async`` in buffer g % (CHUNKS + SPARE). The statistics are
taken over the buffers as each chunk lands; the output pass reads each chunk back, hands its buffer
to the stream's next copy at once, then computes and stores. The next row's loads (with a spare
buffer, also the first chunk of the row after it) are therefore in flight through this row's
statistics and output, with no barrier between programs and no re-read from L2
(docs/tuning-log.md T34-T37). The row-norm backward streams x and dy the same way, as a pair
(:func:`open_pair`: one copy group a chunk of both), and keeps its dweight / dbias partials in
registers (T48). Rows longer than that can be shared by K programs (``config.IN_PARTS``, off unless forced:
they wait on each other unbounded, coop.py; T51), one part
each, that exchange their parts' row terms as tagged words (:func:`publish`, :func:`collect`;
:func:`open_parts` streams a part several rows deep; T52-T58).

Plain Triton cannot place a tensor in shared memory, so these kernels are written in Gluon
(``triton.experimental.gluon``), Triton's lower-level dialect. Gluon's API is still changing: the
names that differ between releases come from compat.py, and ``config`` chooses these kernels only
where ``compat.gluon_ok`` says Gluon compiles and runs on the device (else the plain kernels
serve). Gluon kernels do not run under Triton's interpreter: ``config`` chooses them for CUDA
tensors only, so CI's interpreter suite never launches them and the GPU suite (``pytest -m cuda``)
is what tests them.
"""

from __future__ import annotations

import torch
import triton

from normkit.backends.cuda.compat import HAS_GLUON as AVAILABLE
from normkit.backends.cuda.compat import async_copy, barrier, cp, gl, gluon


def jit(fn):
    """``gluon.jit`` where the kernels can run; elsewhere the plain function (never launched:
    ``config`` does not choose these kernels when :data:`AVAILABLE` is false)."""
    return gluon.jit(fn) if AVAILABLE else fn


def _constexpr_function(fn):
    return gluon.constexpr_function(fn) if AVAILABLE else fn


@_constexpr_function
def next_pow2(n):
    """``triton.next_power_of_2`` as a constexpr function of a kernel (a register tensor's shape),
    whatever form the installed Triton gives it."""
    return triton.next_power_of_2(int(n))


@jit
def copy_chunk(dst, X, row, M, N, stride_x, cols, dst2=None, X2=None, stride_2=None, HW=None, GAP=None):
    """Start the copy of columns ``cols`` of row ``row`` of a (M, N) tensor into the buffer ``dst``
    (and, for a pair of streams, the same columns of ``X2`` into ``dst2``) as one ``cp.async`` group.
    Columns past N and rows past the last copy nothing (zeros land). With ``HW`` (a BatchNorm
    channel's runs, :func:`run_offsets`) column j of the row lies at ``run_offsets(j, HW, GAP)`` (of
    both tensors of a pair)."""
    mask = (cols < N) & (row < M)
    at = cols
    if HW is not None:
        at = run_offsets(cols, HW, GAP)
    async_copy(dst, X + row.to(gl.int64) * stride_x + at, mask=mask)
    if X2 is not None:
        async_copy(dst2, X2 + row.to(gl.int64) * stride_2 + at, mask=mask)
    cp.commit_group()


@jit
def run_offsets(cols, HW, GAP):
    """Offsets of values ``cols`` of a row made of runs of HW values GAP apart (a BatchNorm channel
    of a contiguous (N, C, HW) tensor: value j = n * HW + hw at j + n * (C - 1) * HW, GAP = (C - 1) *
    HW), from the row's first value. With HW a multiple of 16 (specialized so), Triton sees 16 values
    in a row contiguous, and the copies stay 16 bytes wide."""
    return cols + cols // HW * GAP


@jit
def open_stream(X, M, N, stride_x, layout: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr,
                SPARE: gl.constexpr):  # fmt: skip
    """The shared-memory kernels' prologue: allocate the CHUNKS + SPARE buffers of CHUNK elements
    (unswizzled: with ``layout`` for the copies and the reads, each thread reads what it copied),
    start the stream (:func:`start`). Returns (buffers, column offsets of a chunk in ``layout``)."""
    buf = buffers(X.dtype.element_ty, CHUNKS + SPARE, CHUNK)
    offs = gl.arange(0, CHUNK, layout=layout)
    start(buf, X, M, N, stride_x, offs, CHUNK, CHUNKS, SPARE)
    return buf, offs


@jit
def open_pair(X, Y, M, N, stride_x, stride_y, layout: gl.constexpr, CHUNK: gl.constexpr,
              CHUNKS: gl.constexpr, SPARE: gl.constexpr):  # fmt: skip
    """:func:`open_stream` for two (M, N) tensors streamed together (the same rows and chunks, one
    ``cp.async`` group a chunk of both). Returns (X's buffers, Y's buffers, column offsets)."""
    bx = buffers(X.dtype.element_ty, CHUNKS + SPARE, CHUNK)
    by = buffers(Y.dtype.element_ty, CHUNKS + SPARE, CHUNK)
    offs = gl.arange(0, CHUNK, layout=layout)
    start(bx, X, M, N, stride_x, offs, CHUNK, CHUNKS, SPARE, by, Y, stride_y)
    return bx, by, offs


@jit
def buffers(dtype: gl.constexpr, COUNT: gl.constexpr, CHUNK: gl.constexpr):
    """COUNT shared-memory buffers of CHUNK elements, unswizzled: a thread that reads with the
    layout it copied (or stored) with reads what it wrote, and needs no barrier."""
    unswizzled: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    return gl.allocate_shared_memory(dtype, [COUNT, CHUNK], unswizzled)


@jit
def start(buf, X, M, N, stride_x, offs, CHUNK: gl.constexpr, CHUNKS: gl.constexpr, SPARE: gl.constexpr,
          buf2=None, X2=None, stride_2=None):  # fmt: skip
    """Start this program's stream of row chunks (rows pid, pid + programs, ...; chunk g of the
    stream is chunk g % CHUNKS of the program's row g // CHUNKS, in buffer g % (CHUNKS + SPARE)):
    its first row into buffers 0 .. CHUNKS - 1, then, with a spare buffer, its second row's first
    chunk. One ``cp.async`` group per chunk, in stream order (see :func:`landed`); a pair of streams
    (``X2`` into ``buf2``) shares the groups."""
    row = gl.program_id(0)
    for g in gl.static_range(CHUNKS + SPARE):
        at = row + g // CHUNKS * gl.num_programs(0)
        cols = g % CHUNKS * CHUNK + offs
        if X2 is None:
            copy_chunk(buf.index(g), X, at, M, N, stride_x, cols)
        else:
            copy_chunk(buf.index(g), X, at, M, N, stride_x, cols, buf2.index(g), X2, stride_2)


@jit
def slot(buf, base, c: gl.constexpr, CHUNKS: gl.constexpr, SPARE: gl.constexpr):
    """The buffer holding chunk ``c`` of the current row, whose chunk 0 is in buffer ``base``."""
    if SPARE == 0:
        return buf.index(c)
    else:
        return buf.index((base + c) % (CHUNKS + SPARE))


@jit
def wait(c: gl.constexpr, CHUNKS: gl.constexpr, SPARE: gl.constexpr):
    """Wait until chunk ``c`` of the current row has landed. Every chunk of the rows before it has
    been read and refilled (:func:`refill`): the CHUNKS + SPARE - 1 - c groups committed after
    chunk c may still be pending."""
    cp.wait_group(CHUNKS + SPARE - 1 - c)


@jit
def landed(buf, base, c: gl.constexpr, CHUNKS: gl.constexpr, SPARE: gl.constexpr):
    """:func:`wait` for chunk ``c`` of the current row; its buffer."""
    wait(c, CHUNKS, SPARE)
    return slot(buf, base, c, CHUNKS, SPARE)


@jit
def refill(dst, X, row, M, N, stride_x, offs, c: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr,
           SPARE: gl.constexpr, dst2=None, X2=None, stride_2=None):  # fmt: skip
    """Chunk ``c`` of ``row`` has been read from its buffer ``dst`` (and ``dst2``, for a pair of
    streams): start the copy of the chunk CHUNKS + SPARE later in the stream into it (of the next
    row, or with a spare buffer, for the row's last chunks, of the row after it)."""
    nprog = gl.num_programs(0)
    if c + SPARE < CHUNKS:
        copy_chunk(dst, X, row + nprog, M, N, stride_x, (c + SPARE) * CHUNK + offs, dst2, X2, stride_2)
    else:
        copy_chunk(dst, X, row + 2 * nprog, M, N, stride_x, (c + SPARE - CHUNKS) * CHUNK + offs, dst2, X2,
                   stride_2)  # fmt: skip


@jit
def next_base(base, CHUNKS: gl.constexpr, SPARE: gl.constexpr):
    """The buffer of the next row's chunk 0, after the row whose chunk 0 is in ``base``."""
    return (base + CHUNKS) % (CHUNKS + SPARE)


# --- a row shared by K programs: tagged row terms ---------------------------------------------
# Rows too long for one program's shared memory and registers are cut into K parts, one program
# each; a part's row terms (partial sums) are exchanged through an int64 workspace, each term in its
# own word with the row's tag (row + 1) in the high half (:func:`publish`). One load of the K words
# both finds them written and reads them (:func:`gather`), where a counter barrier needs an acquire
# poll and then the loads (docs/tuning-log.md T52). Every program of a row sums the same K words in the same
# order, so they agree bitwise.
#
# The words of row ``row`` of a row group lie in slot (row // groups) % RING of the group's RING
# slots (:func:`row_terms`). A program publishes a row's terms one row step ahead and has gathered
# the row before; so when it writes a slot, every partner has gathered the row RING steps back
# (its publish of the row before this program's last gathered one came after its gather of the row
# three steps back): RING >= MIN_RING slots never overwrite a word still to be read, and a word of
# another row, tagged so, is never taken. How many slots is the config's (``LaunchConfig.ring``,
# measured per kind: more slots than the minimum read faster for some, docs/tuning-log.md T55). The
# workspace is kept per device and stream (:func:`terms_workspace`) and comes zeroed to every
# launch: the last of a row group's programs to finish zeroes the group's words (:func:`release`),
# so no launch of its own zeroes it.
MIN_RING = 4


@jit
def row_terms(Terms, row, groups, KP: gl.constexpr, RING: gl.constexpr):
    """The words of ``row``'s two terms ((2, KP): t1's K words, then t2's) in its group's slot of the
    (groups, RING, 2, KP) workspace ``Terms``."""
    return Terms + (row % groups * RING + row // groups % RING) * (2 * KP)


@jit
def publish(Terms, value, tag):
    """Write fp32 scalar ``value`` to the int64 word ``Terms`` with its row's ``tag`` (one 8-byte
    store: a reader sees an older word or the whole term)."""
    bits = value.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF
    gl.store(Terms, bits | (tag.to(gl.int64) << 32))


@jit
def request(Terms, K, KP: gl.constexpr, layout: gl.constexpr, tag):
    """Start loading the K tagged words ``Terms[0:K]`` (past K: a zero term with the tag);
    :func:`gather` finishes. Volatile: read at L2, never from a stale L1 line."""
    ks = gl.arange(0, KP, layout=layout)
    return gl.load(Terms + ks, mask=ks < K, other=tag.to(gl.int64) << 32, volatile=True)


@jit
def collect(words, Terms, K, KP: gl.constexpr, layout: gl.constexpr, tag):
    """The K fp32 terms at ``Terms`` ([KP], 0.0 past K), ``words`` their first load (:func:`request`);
    loads again until every word carries the row's ``tag``. A word not yet written carries an older
    row's tag (smaller) or 0, never a later one (:func:`row_terms`), so the least tag decides. The
    tags are reduced as loaded and compared after: a per-word compare is hoisted by ptxas next to
    the load (to free its registers), where it waits out the load's L2 round trip that the
    request had started early to hide (LayerNorm 0.77 against 0.87, docs/tuning-log.md T54)."""
    while gl.min((words >> 32).to(gl.int32), axis=0) != tag:
        words = request(Terms, K, KP, layout, tag)
    return words.to(gl.int32).to(gl.float32, bitcast=True)


@jit
def gather(words, Terms, K, KP: gl.constexpr, layout: gl.constexpr, tag):
    """The sum over k (in k's order) of the K terms at ``Terms`` (:func:`collect`)."""
    return gl.sum(collect(words, Terms, K, KP, layout, tag), axis=0)


@jit
def release(Done, Terms, words, count, layout: gl.constexpr):
    """At a launch's end, in each of the ``count`` programs that share the ``words`` words of
    ``Terms`` (a row group's): count this program done at ``Done`` (an int64 word, zero between
    launches); the last to arrive (every partner's reads of the words over) zeroes them and
    ``Done`` for the next launch."""
    barrier()  # every thread's loads of the words are done before the release
    last = gl.atomic_add(Done, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        BLOCK: gl.constexpr = gl.num_warps() * 32
        offs = gl.arange(0, BLOCK, layout=layout)
        for start in range(0, words, BLOCK):
            gl.store(Terms + start + offs, gl.zeros([BLOCK], gl.int64, layout), mask=start + offs < words)
        gl.store(Done, 0)


@jit
def publish_pair(Terms, k, t1, t2, KP: gl.constexpr, TWO: gl.constexpr, tag):
    """Publish part ``k``'s row terms to the row's words ``Terms`` ((2, KP): t1 in the first KP,
    t2 in the second, written only when TWO), tagged ``tag``."""
    publish(Terms + k, t1, tag)
    if TWO:
        publish(Terms + KP + k, t2, tag)


@jit
def request_pair(Terms, K, KP: gl.constexpr, layout: gl.constexpr, TWO: gl.constexpr, tag):
    """:func:`request` the row's K words of t1 (and of t2 when TWO; else the t1 words again) at
    ``Terms`` ((2, KP), as :func:`publish_pair`)."""
    w1 = request(Terms, K, KP, layout, tag)
    w2 = w1
    if TWO:
        w2 = request(Terms + KP, K, KP, layout, tag)
    return w1, w2


@jit
def part_of(N, K, P, CHUNK: gl.constexpr, layout: gl.constexpr):
    """This program's part of a row shared by K programs (grid = groups x K; program pid holds part
    pid % K, columns [k * P, min(N, (k + 1) * P)), of row group pid // K): (pid, group, groups, k,
    the CHUNK column offsets ``offs`` in ``layout``, the part's end column, chunk 0's columns)."""
    pid = gl.program_id(0)
    groups = gl.num_programs(0) // K
    group = pid // K
    k = pid % K
    offs = gl.arange(0, CHUNK, layout=layout)
    end = gl.minimum(N, (k + 1) * P)
    return pid, group, groups, k, offs, end, k * P + offs


# A program's part of the rows: columns [k * P, end) of rows group, group + groups, ... (end =
# min(N, (k + 1) * P)), streamed through NBUF = DEPTH * CHUNKS + SPARE buffers, DEPTH rows deep:
# chunk g of the stream (chunk g % CHUNKS of the stream's row g // CHUNKS) in buffer g % NBUF. One
# cp.async group a chunk (of both tensors of a pair), in stream order.
@jit
def open_parts(X, M, stride_x, group, groups, end, col0, CHUNK: gl.constexpr, CHUNKS: gl.constexpr,
               NBUF: gl.constexpr, X2=None, stride_2=None, HW=None, GAP=None):  # fmt: skip
    """Allocate the part's NBUF buffers of X (and of X2, for a pair; else X's again) and start its
    stream: its first NBUF chunks. ``col0``: the part's first CHUNK
    column offsets (in the reads' layout); ``HW``, ``GAP``: rows of runs (:func:`run_offsets`).
    Returns (X's buffers, X2's buffers)."""
    bx = buffers(X.dtype.element_ty, NBUF, CHUNK)
    b2 = bx
    if X2 is not None:
        b2 = buffers(X2.dtype.element_ty, NBUF, CHUNK)
    for g in gl.static_range(NBUF):
        row = group + g // CHUNKS * groups
        cols = col0 + g % CHUNKS * CHUNK
        # without X2, b2 is bx and copy_chunk leaves it alone
        copy_chunk(bx.index(g), X, row, M, end, stride_x, cols, b2.index(g), X2, stride_2, HW=HW, GAP=GAP)
    return bx, b2


@jit
def refill_part(bx, at, X, row, groups, M, end, stride_x, col0, c: gl.constexpr, CHUNK: gl.constexpr,
                CHUNKS: gl.constexpr, SPARE: gl.constexpr, DEPTH: gl.constexpr, b2=None, X2=None,
                stride_2=None, HW=None, GAP=None):  # fmt: skip
    """Chunk ``c`` of ``row`` has been read from buffer ``at`` (of X, and of X2 for a pair) of a
    stream DEPTH rows deep (NBUF = DEPTH * CHUNKS + SPARE): start the copy of the stream's chunk NBUF
    later into it, chunk (c + SPARE) % CHUNKS of the row DEPTH + (c + SPARE) // CHUNKS rows of the
    group on (``HW``, ``GAP``: rows of runs, :func:`run_offsets`)."""
    nxt = row + (DEPTH + (c + SPARE) // CHUNKS) * groups
    cols = col0 + (c + SPARE) % CHUNKS * CHUNK
    if b2 is None:  # a single stream: copy_chunk leaves the second buffer alone
        b2 = bx
    copy_chunk(bx.index(at), X, nxt, M, end, stride_x, cols, b2.index(at), X2, stride_2, HW=HW, GAP=GAP)


@jit
def hold(W, col0, end, CHUNK: gl.constexpr, CHUNKS: gl.constexpr):
    """The part's columns of the (N,) vector W (a weight, read every row) in CHUNKS shared-memory
    buffers, loaded once (zeros past ``end``); each thread reads back what it stored."""
    bw = buffers(W.dtype.element_ty, CHUNKS, CHUNK)
    for c in gl.static_range(CHUNKS):
        cols = col0 + c * CHUNK
        bw.index(c).store(gl.load(W + cols, mask=cols < end, other=0.0))
    return bw


@_constexpr_function
def chunk_masked(MASK, c, CHUNKS):
    """Whether chunk ``c`` of a part's CHUNKS may hold columns past the part, under
    :func:`parts_mask`'s ``MASK`` (a kernel's constexpr)."""
    return int(MASK) == 2 or (int(MASK) == 1 and int(c) + 1 == int(CHUNKS))


def parts_mask(N: int, K: int, P: int, width: int, chunk: int) -> int:
    """Which chunks of a part may hold columns past the part, for N columns in K parts of P (the
    last N - (K - 1) * P) in buffers of ``width`` = CHUNKS x ``chunk`` columns: 0 none (every part
    fills its buffers), 1 the last chunk only, 2 any (the last part ends before its last chunk)."""
    last = N - (K - 1) * P
    if P == width and last == P:
        return 0
    return 1 if last >= width - chunk else 2  # the last part's other chunks full


_WORKSPACES: dict = {}  # (device index, stream) -> (words, done): zero between launches


def terms_workspace(groups: int, parts: int, ring: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(words, done) for a launch of ``groups`` row groups of ``parts`` parts (KP = next_pow2 of
    them) and ``ring`` slots a group: at least groups x ring x 2 x KP zeroed int64 words and groups
    zero int64 counters, which the launch leaves zeroed (:func:`release`). Kept per device and current
    stream (launches on a stream run in order; two streams never share one); while a CUDA graph is
    captured, a fresh zeroed pair instead, whose zeroing the graph records."""
    if ring < MIN_RING:  # fewer slots could overwrite words a partner has still to read
        raise ValueError(f"terms_workspace: ring={ring} term slots a row group; at least {MIN_RING} are safe")
    need = groups * ring * 2 * triton.next_power_of_2(parts)
    if torch.cuda.is_current_stream_capturing():
        return _zeroed(need, device), _zeroed(groups, device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < need or ws[1].numel() < groups:
        ws = _WORKSPACES[key] = (_zeroed(need, device), _zeroed(groups, device))
    return ws


def _zeroed(n: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


def fits(N: int, stride: int, ptr: int) -> bool:
    """Whether rows of this layout can be copied by 16-byte ``cp.async``: Triton vectorizes the copy
    only where it knows the row starts and N to be multiples of 16 elements (its divisibility
    specialization) and the base address 16-byte aligned; a narrower copy does not compile. (Which
    dtypes take the path is ``config.smem_row``'s choice.)"""
    return N % 16 == 0 and stride % 16 == 0 and ptr % 16 == 0


def rows_fit(x: torch.Tensor) -> bool:
    """:func:`fits` for the rows of a 2-D tensor ``x``."""
    return fits(x.shape[1], x.stride(0), x.data_ptr())


def smem_per_block(device: torch.device) -> int:
    """Shared memory one program may use on ``device`` (opt-in maximum), 0 where unknown."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0))
