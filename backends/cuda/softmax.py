"""Softmax and log-softmax along the last dim on NVIDIA GPUs: kernels, then launchers.

Fused: whole rows in registers, ROWS rows per program (max, exp, sum in one read of x). Shared
memory (16-bit rows that fit one SM's shared memory; smem.py): one program per SM streams rows
through shared-memory buffers, one read of x, each thread keeping its own running max and sum.
Rows in parts (16-bit rows longer than that, fp32 rows past the fused limit; with more than one part
only where ``config.IN_PARTS`` or forced): K programs a row, each streaming its part through shared memory and
exchanging the part's (max, sum) as tagged words. Split rows: a row's chunks on K programs that
exchange partial max / sum, or run solo where their row group did not fill (coop.py). Looped: one program per
row sweeps column tiles twice: an online max/sum (rescaling the running sum when the max grows),
then the output. Rows of all -inf give NaN, as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from normkit.backends.common import as_col, online_max_sum, softmax_fwd_tiles
from normkit.backends.cuda import config, coop, smem
from normkit.backends.cuda.launch import Bound, launch, tensor_spec
from normkit.backends.cuda.coop import arrive, join, load_chunk, wait
from normkit.backends.cuda.smem import cp, gl


@triton.jit
def _fwd_fused_kernel(
    X,  # (M, N) input rows; row stride stride_x, unit column stride
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    M,
    N,
    ROWS: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # power of two >= N
    LOG: tl.constexpr,  # log_softmax
    ACC: tl.constexpr,  # math dtype
):
    # ROWS == 1: the row is a 1-D tile and no row mask (grid = M), as layer_norm's fused forward.
    cols = tl.arange(0, BLOCK_N)
    if ROWS == 1:
        rows = tl.program_id(0)
        mask = cols < N
    else:
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & (cols < N)
    rows64 = rows.to(tl.int64)
    # evict_last (as the row norms' fused forward): rows of 32768 read 0.934-0.943 of copy against
    # 0.919-0.938 without it (16-bit), 0.995 against 0.979 (fp32) (H100, docs/tuning-log.md T28).
    x = tl.load(X + as_col(rows64 * stride_x, ROWS) + cols, mask=mask, other=float("-inf"),
                eviction_policy="evict_last").to(ACC)  # fmt: skip
    xm = x - as_col(tl.max(x, axis=-1), ROWS)
    e = tl.exp(xm)
    s = as_col(tl.sum(e, axis=-1), ROWS)
    if LOG:
        y = xm - tl.log(s)
    else:
        y = e / s
    tl.store(Y + as_col(rows64 * stride_y, ROWS) + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _fwd_looped_kernel(
    X,  # (M, N) input rows; row stride stride_x
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    N,
    BLOCK_N: tl.constexpr,  # column tile; one program per row
    LOG: tl.constexpr,
    ACC: tl.constexpr,
):
    softmax_fwd_tiles(X, Y, tl.program_id(0), stride_x, stride_y, N, BLOCK_N, LOG, ACC)  # NPU's row body too


@triton.jit
def _fwd_split_publish(x, row, Part, Count, k, KP: tl.constexpr, ACC: tl.constexpr):
    """From this chunk of ``row`` (-inf outside the row), write its max and sum of exp(x - max) to
    Part and arrive at the row's counter. Returns the chunk in ACC."""
    r64 = tl.cast(row, tl.int64)
    x = x.to(ACC)
    m_k, s_k = online_max_sum(tl.full((), float("-inf"), ACC), tl.zeros((), ACC), x)
    part = Part + r64 * (2 * KP)
    tl.store(part + k, m_k)
    tl.store(part + KP + k, s_k)
    arrive(Count + row)
    return x


@triton.jit
def _fwd_split_solo(X, row, stride_x, Part, Count, K, N, M, CHUNK: tl.constexpr, KP: tl.constexpr,
                    ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``row`` before its row loop: publish every chunk's max and sum
    of ``row`` itself, as the K partners would."""
    for j in range(K):
        cols = j * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        x = load_chunk(X, row, stride_x, cols, mask, M, float("-inf"))
        _fwd_split_publish(x, row, Part, Count, j, KP, ACC)


@triton.jit
def _fwd_split_kernel(
    X,  # (M, N) input rows; row stride stride_x
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    Part,  # (M, 2, KP) ACC workspace: per-chunk max and sum of exp(x - max)
    Count,  # (2 M,) int32, zeroed: the row barriers, then the row groups' start words (coop.join)
    M,
    N,
    K,  # chunks per row; program pid holds chunk pid % K of the rows of group pid // K
    CHUNK: tl.constexpr,  # columns per program
    KP: tl.constexpr,  # power of two >= K
    LOG: tl.constexpr,
    ACC: tl.constexpr,
    PREFETCH: tl.constexpr,  # chunk held through the barrier, the next row's chunk loaded early
    SPIN: tl.constexpr,  # polls to wait for the row group to fill (coop.join)
):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    k = pid % K
    together = join(Count + M + pid // K, K, SPIN)
    # A solo program (its row group did not fill: coop.join) publishes every chunk of its rows
    # first, where little else is live, so the row loop keeps its registers.
    if together == 0:
        for row in range(pid // K, M, groups):
            _fwd_split_solo(X, row, stride_x, Part, Count, K, N, M, CHUNK, KP, ACC)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    ks = tl.arange(0, KP)
    # PREFETCH as in the row norms' split forward (layer_norm.py): the next row's chunk is loaded
    # before this row's reductions and the chunk is held through the barrier; otherwise it is read
    # again from L2 after the barrier.
    if PREFETCH:
        x_next = load_chunk(X, pid // K, stride_x, cols, mask, M, float("-inf"))
    for row in range(pid // K, M, groups):
        r64 = tl.cast(row, tl.int64)
        if PREFETCH:
            x = x_next
            x_next = load_chunk(X, row + groups, stride_x, cols, mask, M, float("-inf"))
        else:
            x = load_chunk(X, row, stride_x, cols, mask, M, float("-inf"))
        x = _fwd_split_publish(x, row, Part, Count, k, KP, ACC)
        if together:
            wait(Count + row, K)
        part = Part + r64 * (2 * KP)
        ms = tl.load(part + ks, mask=ks < K, other=float("-inf"), cache_modifier=".cg")
        ss = tl.load(part + KP + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
        m = tl.max(ms, axis=0)
        # Chunks of all -inf carry s = 0; a row of all -inf keeps m = -inf, s = 0: NaN, as torch.
        s = tl.sum(ss * tl.exp(ms - tl.where(m == float("-inf"), 0.0, m)), axis=0)
        if not PREFETCH:
            x = tl.load(X + r64 * stride_x + cols, mask=mask, other=float("-inf")).to(ACC)  # from L2
        if LOG:
            y = (x - m) - tl.log(s)
        else:
            y = tl.exp(x - m) / s
        tl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# Shared-memory kernels' statistics: each thread keeps a running max of the values it reads and the
# sum of exp(x - max) over them, rescaled when its max grows. A chunk's max is first taken over the
# thread's own values only (no shuffle, no barrier), so a chunk costs one exp an element; the
# threads' terms are merged once a row (part). exp(v) is exp2(v * log2(e)) of v = x - max (formed
# first, so the exponent stays exact for large x); softmax's output exp2((x - max) * log2(e) -
# log2(sum)) folds the division into the exponent.
_LOG2E = tl.constexpr(1.4426950408889634)


@smem.jit
def _thread_terms(x, m, s, lay3: gl.constexpr, T: gl.constexpr, VEC: gl.constexpr):
    """Fold chunk ``x`` ([CHUNK] fp32 in the copies' layout: VEC values a thread, T threads, -inf
    outside the row) into each thread's running max ``m`` and sum ``s`` of exp(x - m) ([T]). A
    thread all of whose values are -inf keeps (-inf, 0)."""
    x3 = gl.convert_layout(gl.reshape(x, [x.shape[0] // (T * VEC), T, VEC]), lay3, assert_trivial=True)
    m_new = gl.maximum(m, gl.max(gl.max(x3, axis=2), axis=0))
    shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf (NaN) in the sum
    e = gl.exp2((x3 - gl.expand_dims(gl.expand_dims(shift, 0), 2)) * _LOG2E)
    return m_new, s * gl.exp2((m - shift) * _LOG2E) + gl.sum(gl.sum(e, axis=2), axis=0)


@smem.jit
def _merge_terms(m, s):
    """The max and the sum of exp(x - max) over the terms ``m``, ``s`` (a tensor of each: maxes and
    sums of exp(x - its max), -inf and 0 where empty), in a fixed order. All empty: (-inf, 0)."""
    top = gl.max(m, axis=0)
    shift = gl.where(top == float("-inf"), 0.0, top)
    return top, gl.sum(s * gl.exp2((m - shift) * _LOG2E), axis=0)


@smem.jit
def _offset(s, LOG: gl.constexpr):
    """What :func:`_out` subtracts after the row's max, from the row's sum ``s`` of exp(x - max):
    log(s) (log_softmax), log2(s) (softmax). A row of all -inf (s = 0): -inf, NaN out, as torch."""
    if LOG:
        return gl.log(s)
    else:
        return gl.log2(s)


@smem.jit
def _out(x, m, off, LOG: gl.constexpr):
    """The output of fp32 values ``x`` of a row of max ``m`` and :func:`_offset` ``off``."""
    if LOG:
        return (x - m) - off
    else:
        return gl.exp2((x - m) * _LOG2E - off)


@smem.jit
def _fwd_smem_kernel(
    X,  # (M, N) 16-bit input rows, 16-byte aligned; row stride stride_x (a multiple of 16)
    Y,  # (M, N) out; row stride stride_y
    stride_x,
    stride_y,
    M,
    N,  # a multiple of 16 in ((CHUNKS - 1) * CHUNK, CHUNKS * CHUNK]
    CHUNK: gl.constexpr,  # columns per shared-memory buffer
    CHUNKS: gl.constexpr,  # buffers a row
    SPARE: gl.constexpr,  # extra buffers (0 or 1): the row after next starts landing a chunk early
    LOG: gl.constexpr,
    MASK: gl.constexpr,  # N < CHUNKS * CHUNK: the last chunk's columns past N are masked
):
    """Persistent grid, one program per SM; rows stream through shared memory as in the row norms'
    shared-memory forward (layer_norm.py, smem.py): each thread's max and sum of exp(x - max) from
    the buffers as the chunks land (:func:`_thread_terms`), merged once a row, then per chunk: read
    it back, start the stream's next copy into its buffer, store."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # 16 bytes a thread and copy
    T: gl.constexpr = 32 * NW
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    lay3: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    per_thread: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, lay3))
    buf, offs = smem.open_stream(X, M, N, stride_x, layout, CHUNK, CHUNKS, SPARE)
    nprog = gl.num_programs(0)
    base = gl.program_id(0) * 0  # buffer of the row's chunk 0
    for row in range(gl.program_id(0), M, nprog):
        m = gl.full([T], float("-inf"), gl.float32, per_thread)
        s = gl.zeros([T], gl.float32, per_thread)
        for c in gl.static_range(CHUNKS):
            x = smem.landed(buf, base, c, CHUNKS, SPARE).load(layout).to(gl.float32)
            if MASK and c + 1 == CHUNKS:
                x = gl.where(c * CHUNK + offs < N, x, float("-inf"))
            m, s = _thread_terms(x, m, s, lay3, T, VEC)
        m, s = _merge_terms(m, s)
        off = _offset(s, LOG)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            dst = smem.slot(buf, base, c, CHUNKS, SPARE)
            x = dst.load(layout)
            smem.refill(dst, X, row, M, N, stride_x, offs, c, CHUNK, CHUNKS, SPARE)
            y = _out(x.to(gl.float32), m, off, LOG)
            gl.store(Y + row.to(gl.int64) * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols < N)
        base = smem.next_base(base, CHUNKS, SPARE)
    cp.wait_group(0)


@smem.jit
def _part_terms(bx, base, end, offs, layout: gl.constexpr, lay3: gl.constexpr, T: gl.constexpr,
                VEC: gl.constexpr, WAIT: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr,
                NBUF: gl.constexpr, MASK: gl.constexpr):  # fmt: skip
    """A row part's max and sum of exp(x - max) from its CHUNKS buffers (chunk c in buffer (base + c)
    % NBUF; ``end``: the part's columns counted from its first, chunk 0's offsets ``offs``), waiting
    for each to land (WAIT - c copy groups may still be pending after chunk c), in one read. A
    part of all -inf: (-inf, 0). ``MASK`` (:func:`smem.parts_mask`): 0 no chunk, 1 the last, 2 every
    chunk may hold columns past the part."""
    per_thread: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, lay3))
    m = gl.full([T], float("-inf"), gl.float32, per_thread)
    s = gl.zeros([T], gl.float32, per_thread)
    for c in gl.static_range(CHUNKS):
        cp.wait_group(WAIT - c)
        x = bx.index((base + c) % NBUF).load(layout).to(gl.float32)
        if smem.chunk_masked(MASK, c, CHUNKS):
            x = gl.where(c * CHUNK + offs < end, x, float("-inf"))  # columns past the part landed as zeros
        m, s = _thread_terms(x, m, s, lay3, T, VEC)
    return _merge_terms(m, s)


@smem.jit
def _fwd_smem_split_kernel(
    X,  # (M, N) 16-bit or fp32 input rows, 16-byte aligned; row stride stride_x (a multiple of 16)
    Y,  # (M, N) out; row stride stride_y
    Terms,  # (groups, RING, 2, KP) int64, zeroed: part k's max, sum of exp(x - max), tagged (smem.row_terms)
    Done,  # (groups,) int64 counters, zero: a group's last program done zeroes its Terms (smem.release)
    stride_x,
    stride_y,
    M,
    N,  # a multiple of 16
    K,  # K to RING: parts a row and their columns, buffers, depth and term slots, as for the row norms
    P,  # (layer_norm._fwd_smem_split_kernel); program pid holds part pid % K of row group pid // K
    CHUNK: gl.constexpr,
    CHUNKS: gl.constexpr,
    SPARE: gl.constexpr,
    DEPTH: gl.constexpr,
    KP: gl.constexpr,
    RING: gl.constexpr,
    LOG: gl.constexpr,
    MASK: gl.constexpr,  # which chunks may hold columns past their part (smem.parts_mask)
):
    """The row norms' forward in parts (layer_norm._fwd_smem_split_kernel) for softmax: K
    co-resident programs share a row (grid = groups x K <= SMs), each streaming its part through
    shared memory DEPTH rows deep. Per row step: the next row's part (max, sum) is taken in one read
    as its chunks land and published; this row's K terms (their load started before) are merged
    (the largest max, the sums rescaled to it, in k's order: the same in every part), and the part
    is written while its buffers take the row after next."""
    NW: gl.constexpr = gl.num_warps()
    VEC: gl.constexpr = 128 // X.dtype.element_ty.primitive_bitwidth  # 16 bytes a thread and copy
    T: gl.constexpr = 32 * NW
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NW], [0])
    lay3: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [1, 32, 1], [1, NW, 1], [2, 1, 0])
    small: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    NBUF: gl.constexpr = DEPTH * CHUNKS + SPARE
    pid, group, groups, k, offs, end, col0 = smem.part_of(N, K, P, CHUNK, layout)
    width = end - k * P  # the part's columns
    bx, _ = smem.open_parts(X, M, stride_x, group, groups, end, col0, CHUNK, CHUNKS, NBUF)
    ks = gl.arange(0, KP, layout=small)
    # the group's first row: its terms from the prologue's copies (NBUF groups committed)
    t1, t2 = _part_terms(bx, 0, width, offs, layout, lay3, T, VEC, NBUF - 1, CHUNK, CHUNKS, NBUF, MASK)
    smem.publish_pair(smem.row_terms(Terms, group, groups, KP, RING), k, t1, t2, KP, True, group + 1)
    base = pid * 0  # buffer of this row's chunk 0
    for row in range(group, M, groups):
        r64 = row.to(gl.int64)
        mine = smem.row_terms(Terms, row, groups, KP, RING)
        # this row's terms: their load in flight during the next row's terms
        w1, w2 = smem.request_pair(mine, K, KP, small, True, row + 1)
        nxt = row + groups
        if nxt < M:
            # committed: NBUF + CHUNKS a row done; after the next row's chunk c: (DEPTH - 1) * CHUNKS
            # + SPARE - 1 - c
            n1, n2 = _part_terms(bx, (base + CHUNKS) % NBUF, width, offs, layout, lay3, T, VEC,
                                 (DEPTH - 1) * CHUNKS + SPARE - 1, CHUNK, CHUNKS, NBUF, MASK)  # fmt: skip
            smem.publish_pair(smem.row_terms(Terms, nxt, groups, KP, RING), k, n1, n2, KP, True, nxt + 1)
        maxes = gl.where(ks < K, smem.collect(w1, mine, K, KP, small, row + 1), float("-inf"))
        m, s = _merge_terms(maxes, smem.collect(w2, mine + KP, K, KP, small, row + 1))
        off = _offset(s, LOG)
        for c in gl.static_range(CHUNKS):
            cols = col0 + c * CHUNK
            at = (base + c) % NBUF
            x = bx.index(at).load(layout)
            smem.refill_part(bx, at, X, row, groups, M, end, stride_x, col0, c, CHUNK, CHUNKS, SPARE, DEPTH)
            y = _out(x.to(gl.float32), m, off, LOG)
            gl.store(Y + r64 * stride_y + cols, y.to(Y.dtype.element_ty), mask=cols < end)
        base = (base + CHUNKS) % NBUF
    cp.wait_group(0)
    smem.release(Done + group, Terms + group * (RING * 2 * KP), RING * 2 * KP, K, small)


@triton.jit
def _bwd_fused_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    M,
    N,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LOG: tl.constexpr,
    ACC: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
    y = tl.load(Y + rows64[:, None] * stride_y + cols[None, :], mask=mask, other=0.0).to(ACC)
    if LOG:
        dx = dy - tl.exp(y) * tl.sum(dy, axis=1)[:, None]
    else:
        dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_looped_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    N,
    BLOCK_N: tl.constexpr,  # column tile; one program per row
    LOG: tl.constexpr,
    ACC: tl.constexpr,
    REVERSE: tl.constexpr,  # N > BLOCK_N: the second sweep takes the tiles last first
):
    # Two sweeps of a row: the first sums dy * y (dy for log_softmax) into per-column accumulators
    # (one cross-warp reduction a row), reading with evict_last; the second reads the tiles again,
    # last tile first where there are several, so that the most recently read come first while
    # they are still in L1 / L2 (16-bit log_softmax, 16384-column tiles at N = 32768: 1.00 of copy,
    # 0.88 in order). A row of one tile keeps the plain order (32768: 0.997 against 0.757).
    # Rows of 16385-32768 (config.LOOPED_SOFTMAX_BWD) read 0.97-1.01 of copy against 0.92-0.96
    # for the fused and split-row kernels (H100, docs/tuning-log.md T62).
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], ACC)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0, eviction_policy="evict_last").to(ACC)
        if LOG:
            acc += dy
        else:
            acc += dy * tl.load(Y + row * stride_y + offs, mask=mask, other=0.0,
                                eviction_policy="evict_last").to(ACC)  # fmt: skip
    c = tl.sum(acc, axis=0)
    tiles = tl.cdiv(N, BLOCK_N)
    for i in range(0, tiles):
        if REVERSE:
            offs = (tiles - 1 - i) * BLOCK_N + cols
        else:
            offs = i * BLOCK_N + cols
        mask = offs < N
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(ACC)
        y = tl.load(Y + row * stride_y + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(ACC)
        if LOG:
            dx = dy - tl.exp(y) * c
        else:
            dx = y * (dy - c)
        tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_split_publish(dy, y, row, Part, Count, k, KP: tl.constexpr, LOG: tl.constexpr, ACC: tl.constexpr):
    """Write this chunk's sum of dy * y (log_softmax: of dy) of ``row`` (dy, y: the chunk in its
    dtype) to Part and arrive at the row's counter."""
    part = Part + tl.cast(row, tl.int64) * KP
    if LOG:
        tl.store(part + k, tl.sum(dy.to(ACC), axis=0))
    else:
        tl.store(part + k, tl.sum(dy.to(ACC) * y.to(ACC), axis=0))
    arrive(Count + row)


@triton.jit
def _bwd_split_solo(DY, Y, row, stride_dy, stride_y, Part, Count, K, N, M, CHUNK: tl.constexpr,
                    KP: tl.constexpr, LOG: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """What a solo program (coop.join) does for ``row`` before its row loop: publish every chunk's partial sum
    of ``row`` itself, as the K partners would."""
    for j in range(K):
        cols = j * CHUNK + tl.arange(0, CHUNK)
        mask = cols < N
        dy = load_chunk(DY, row, stride_dy, cols, mask, M, 0.0)
        y = load_chunk(Y, row, stride_y, cols, mask, M, 0.0)
        _bwd_split_publish(dy, y, row, Part, Count, j, KP, LOG, ACC)


@triton.jit
def _bwd_split_kernel(
    DY,  # (M, N) output gradient rows; row stride stride_dy
    Y,  # (M, N) forward output rows; row stride stride_y
    DX,  # (M, N) out; row stride stride_dx
    stride_dy,
    stride_y,
    stride_dx,
    Part,  # (M, 1, KP) ACC workspace: per-chunk sum of dy * y (log_softmax: of dy)
    Count,  # (2 M,) int32, zeroed: the row barriers, then the row groups' start words (coop.join)
    M,
    N,
    K,
    CHUNK: tl.constexpr,
    KP: tl.constexpr,
    LOG: tl.constexpr,
    ACC: tl.constexpr,
    PREFETCH: tl.constexpr,  # pipelined: the next row's partial published before this row's wait
    SPIN: tl.constexpr,  # polls to wait for the row group to fill (coop.join)
):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // K
    k = pid % K
    together = join(Count + M + pid // K, K, SPIN)
    # A solo program (its row group did not fill: coop.join) publishes every chunk of its rows
    # first, where little else is live, so the row loop keeps its registers.
    if together == 0:
        for row in range(pid // K, M, groups):
            _bwd_split_solo(DY, Y, row, stride_dy, stride_y, Part, Count, K, N, M, CHUNK, KP, LOG, ACC)
    cols = k * CHUNK + tl.arange(0, CHUNK)
    mask = cols < N
    ks = tl.arange(0, KP)
    # PREFETCH: the next row's chunks are loaded and their partial published before waiting on
    # this row's barrier, so the barrier's latency overlaps a row of loads and reductions.
    if PREFETCH:
        dy_next = load_chunk(DY, pid // K, stride_dy, cols, mask, M, 0.0)
        y_next = load_chunk(Y, pid // K, stride_y, cols, mask, M, 0.0)
        _bwd_split_publish(dy_next, y_next, pid // K, Part, Count, k, KP, LOG, ACC)
    for row in range(pid // K, M, groups):
        r64 = tl.cast(row, tl.int64)
        if PREFETCH:
            dy, y = dy_next, y_next
            nxt = row + groups
            dy_next = load_chunk(DY, nxt, stride_dy, cols, mask, M, 0.0)
            y_next = load_chunk(Y, nxt, stride_y, cols, mask, M, 0.0)
            if nxt < M:
                _bwd_split_publish(dy_next, y_next, nxt, Part, Count, k, KP, LOG, ACC)
        else:
            dy = load_chunk(DY, row, stride_dy, cols, mask, M, 0.0)
            y = load_chunk(Y, row, stride_y, cols, mask, M, 0.0)
            _bwd_split_publish(dy, y, row, Part, Count, k, KP, LOG, ACC)
        if together:
            wait(Count + row, K)
        dy = dy.to(ACC)
        y = y.to(ACC)
        part = Part + r64 * KP
        c = tl.sum(tl.load(part + ks, mask=ks < K, other=0.0, cache_modifier=".cg"), axis=0)
        if LOG:
            dx = dy - tl.exp(y) * c
        else:
            dx = y * (dy - c)
        tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


# --- launches: each kernel's arguments spelled once, for the eager launchers and the plans -----------


def _fwd_kernel(cfg, N, log, dtype):
    """(kernel, launch keywords) of the forward config ``cfg``."""
    flags = dict(LOG=log, ACC=config.tl_acc_dtype(dtype), num_warps=cfg.num_warps)
    if cfg.fused:
        return _fwd_fused_kernel, dict(ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, **flags)
    if cfg.smem:
        return (_fwd_smem_split_kernel if cfg.in_parts else _fwd_smem_kernel), _smem_meta(cfg, N, log)
    if cfg.split > 1:
        return _fwd_split_kernel, dict(coop.split_meta(cfg), **flags)
    return _fwd_looped_kernel, dict(BLOCK_N=cfg.block_size, **flags)


def _fwd_args(cfg, x, y, stride_x, stride_y, M, N) -> tuple:
    """The positional arguments of :func:`_fwd_kernel`'s kernel for one call (fresh workspaces for
    the split rows; the current stream's for the rows in parts)."""
    if cfg.fused or (cfg.smem and not cfg.in_parts):
        return (x, y, stride_x, stride_y, M, N)
    if cfg.smem:
        return (x, y, *_terms(cfg, x.device), stride_x, stride_y, M, N, cfg.parts, cfg.part)
    if cfg.split > 1:
        work = coop.workspace(M, 2, cfg.split, config.acc_dtype(x.dtype), x.device)
        return (x, y, stride_x, stride_y, *work, M, N, cfg.split)
    return (x, y, stride_x, stride_y, N)


def _bwd_kernel(cfg, N, log, dtype):
    """(kernel, launch keywords) of the backward config ``cfg``."""
    flags = dict(LOG=log, ACC=config.tl_acc_dtype(dtype), num_warps=cfg.num_warps)
    if cfg.fused:
        return _bwd_fused_kernel, dict(ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, **flags)
    if cfg.split > 1:
        return _bwd_split_kernel, dict(coop.split_meta(cfg), **flags)
    return _bwd_looped_kernel, dict(BLOCK_N=cfg.block_size, REVERSE=N > cfg.block_size, **flags)


def _bwd_args(cfg, dy, y, dx, strides, M, N) -> tuple:
    """The positional arguments of :func:`_bwd_kernel`'s kernel for one call (``strides``: of dy, y,
    dx; a fresh workspace for split rows)."""
    if cfg.fused:
        return (dy, y, dx, *strides, M, N)
    if cfg.split > 1:
        work = coop.workspace(M, 1, cfg.split, config.acc_dtype(y.dtype), y.device)
        return (dy, y, dx, *strides, *work, M, N, cfg.split)
    return (dy, y, dx, *strides, N)


def softmax_fwd(x, log):
    """x: (M, N) rows -> softmax (log_softmax when ``log``) of each row, in x.dtype."""
    M, N = x.shape
    cfg = config.softmax(M, N, x.dtype, x.device, smem.rows_fit(x))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    key = (M, N, x.stride(0), tensor_spec(x), log)  # decides the specialization (launch.py's key=)
    kernel, meta = _fwd_kernel(cfg, N, log, x.dtype)
    launch(kernel, cfg.grid, *_fwd_args(cfg, x, y, x.stride(0), y.stride(0), M, N), key=key, **meta)
    return y


def _smem_meta(cfg, N, log) -> dict:
    """Launch keywords of ``_fwd_smem_kernel`` (``_fwd_smem_split_kernel`` for rows in parts) from its
    config, for rows of N."""
    meta = dict(CHUNK=cfg.block_size, CHUNKS=cfg.buffers, SPARE=int(cfg.prefetch), LOG=log,
                num_warps=cfg.num_warps)  # fmt: skip
    width = cfg.buffers * cfg.block_size  # columns of a row's (part's) buffers
    if cfg.in_parts:
        return dict(meta, DEPTH=cfg.depth, KP=triton.next_power_of_2(cfg.parts), RING=cfg.ring,
                    MASK=smem.parts_mask(N, cfg.parts, cfg.part, width, cfg.block_size))  # fmt: skip
    return dict(meta, MASK=int(N < width))


def _terms(cfg, device) -> tuple:
    """The rows in parts' tagged-term workspace and its counters (smem.terms_workspace)."""
    return smem.terms_workspace(cfg.grid[0] // cfg.parts, cfg.parts, cfg.ring, device)


def plan_softmax(x, log, grad=False):
    """A plan for softmax / log_softmax calls along the last dim shaped like this one (contract
    extension, see layer_norm.plan_row_norm), for contiguous inputs of x's M * N elements: the fused,
    shared-memory or split-row kernels, called directly (split rows: with a fresh workspace each
    call). Inference: ``run(input) -> y``, one launch. Training (``grad``): ``(forward, backward)``,
    ``forward(input) -> y`` and ``backward(dy, y) -> dx`` with dy contiguous and 16-byte aligned.
    Rows in parts take the workspace of the current stream at each call. None where the forward
    takes the looped kernel, or off the GPU."""
    M, N = x.shape
    cfg = config.softmax(M, N, x.dtype, x.device, smem.rows_fit(x))
    if x.device.type != "cuda" or not (cfg.fused or cfg.smem or cfg.split > 1):
        return None
    kernel, meta = _fwd_kernel(cfg, N, log, x.dtype)
    bound = Bound(kernel, cfg.grid, x.device.index, **meta)

    def run(x):
        y = torch.empty_like(x)
        bound(*_fwd_args(cfg, x, y, N, N, M, N))
        return y

    if not grad:
        return run
    bcfg = config.softmax_backward(M, N, x.dtype, x.device, log)
    kernel, meta = _bwd_kernel(bcfg, N, log, x.dtype)
    bwd = Bound(kernel, bcfg.grid, x.device.index, **meta)

    def backward(dy, y):
        dx = torch.empty_like(y)
        bwd(*_bwd_args(bcfg, dy, y, dx, (N, N, N), M, N))
        return dx

    return run, backward


def softmax_bwd(dy, y, log):
    """dy, y: (M, N) -> dx, in y.dtype."""
    M, N = y.shape
    cfg = config.softmax_backward(M, N, y.dtype, y.device, log)
    dx = torch.empty((M, N), dtype=y.dtype, device=y.device)
    strides = (dy.stride(0), y.stride(0), dx.stride(0))
    key = (M, N, strides, tensor_spec(dy), tensor_spec(y), log)  # decides the specialization (launch.py)
    kernel, meta = _bwd_kernel(cfg, N, log, y.dtype)
    launch(kernel, cfg.grid, *_bwd_args(cfg, dy, y, dx, strides, M, N), key=key, **meta)
    return dx
