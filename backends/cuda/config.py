"""Launch heuristics of the CUDA backend: the one place where tile sizes, warps and grids are chosen.

Every kernel launch in ``backends/cuda`` gets its shape from a function here, as a frozen
:class:`LaunchConfig`. Each threshold carries the one measurement that chose it and the id of its line in
docs/tuning-log.md (the alternatives measured, the commit); results against the targets:
docs/performance.md. Figures: H100, 2^27-element tensors, GPU time as a fraction of copy, bf16 unless
named.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from normkit import dispatch
from normkit.backends.cuda import compat, coop, smem

# A row whose next power of two is at most this many elements is held in registers by one program
# (one read of x). Longer rows are shared by programs (shared memory, split rows) or loop over column
# tiles, reading x twice. Fused vs looped LayerNorm: 0.91 vs 0.66 at 32768, 0.40 vs 0.63 at 65536
# (register spills); fp32 0.96 vs 0.66 at 32768 (docs/tuning-log.md T24).
FUSED_MAX_N_FWD = 32768
# The backward keeps x, dy, w, xhat and two accumulators live per element, so spills start sooner,
# and sooner for LayerNorm (one more reduction) than RMSNorm. Keyed by (is_rms, element size >= 4).
# Fused vs looped at 16384: LayerNorm 0.40 vs 0.52, RMSNorm 0.65 vs 0.53; fp32 RMSNorm fused 0.73 vs
# split rows 0.93 (docs/tuning-log.md T40).
FUSED_MAX_N_BWD = {(False, False): 8192, (False, True): 8192, (True, False): 16384, (True, True): 8192}
# The softmax backward holds a row of y and one of dy. Rows of 16385-32768 take the looped kernel
# (LOOPED_SOFTMAX_BWD: 0.995 vs fused 0.917-0.960 at 32768), so the fused limit is 16384 for every
# dtype (docs/tuning-log.md T62).
FUSED_MAX_N_SOFTMAX_BWD = 16384
# fp64 rows take twice the registers.
FP64_DIVISOR = 2

# Forward: elements per program tile when rows are short. Small-N rows are packed ROWS to a
# program so that each program still moves a few KB (one row of N = 64 alone would idle the SM).
TILE_ELEMENTS_FWD = 4096
MAX_ROWS_PER_PROGRAM = 256


@dataclass(frozen=True)
class _FusedBwd:
    max_n: int  # rows up to this length use this entry
    programs_per_sm: int  # persistent grid; each program owns one fp32 dweight/dbias partial row
    elements_per_thread: int  # per tensor: sets num_warps from the tile size
    tile_elements: int  # rows per tile = tile_elements // BLOCK_N
    prefetch: bool  # load the next row tile before this one's reductions (two tiles in flight)


# Fused backward launch table, keyed by (is_rms, element size >= 4 bytes), from
# ci/measure-bwd-grid.py (GPU time only; fp64 uses the fp32 entries): 16-bit LayerNorm 0.93-0.96 at
# N = 64-4096, RMSNorm 0.94-0.97 at 64-8192, fp32 0.95-1.00, against 0.35-0.75 for the worst settings;
# prefetch +0.03-0.10 in most 16-bit cells, off where it spills (docs/tuning-log.md T42, T44).
FUSED_BWD = {
    (False, False): (  # LayerNorm, 16-bit
        _FusedBwd(128, 1, 16, 8192, False),
        _FusedBwd(256, 1, 32, 8192, True),
        _FusedBwd(2048, 4, 16, 2048, True),
        _FusedBwd(4096, 2, 16, 2048, True),
        _FusedBwd(8192, 1, 16, 2048, True),
    ),
    (True, False): (  # RMSNorm, 16-bit
        _FusedBwd(256, 1, 16, 8192, True),
        _FusedBwd(2048, 4, 16, 2048, True),
        _FusedBwd(4096, 2, 16, 2048, True),
        _FusedBwd(8192, 1, 16, 2048, True),
        _FusedBwd(16384, 1, 32, 8192, False),
    ),
    (False, True): (  # LayerNorm, fp32 / fp64
        _FusedBwd(256, 1, 32, 8192, True),
        _FusedBwd(2048, 1, 32, 8192, False),
        _FusedBwd(4096, 1, 32, 8192, True),
        _FusedBwd(8192, 1, 16, 8192, True),
    ),
    (True, True): (  # RMSNorm, fp32 / fp64
        _FusedBwd(256, 1, 32, 8192, True),
        _FusedBwd(2048, 1, 32, 8192, False),
        _FusedBwd(4096, 1, 32, 8192, True),
        _FusedBwd(8192, 1, 16, 8192, True),
        _FusedBwd(16384, 1, 16, 8192, False),
    ),
}

# The same with dropout (the add-norms' backward regenerating the mask from the hash), where it
# differs: fp32 without prefetch (the hash's registers make the prefetching tiles spill). H100,
# ci/measure-bwd-grid.py with dropout 0.1: 0.947-0.958 of copy at N = 128-8192 against 0.73 / 0.75
# for the 16-bit-tuned entries at N = 256 (docs/tuning-log.md T90).
FUSED_BWD_DROPOUT = {
    (False, True): (  # add_layer_norm, fp32 / fp64
        _FusedBwd(128, 1, 32, 8192, False),
        _FusedBwd(256, 1, 16, 8192, False),
        _FusedBwd(2048, 1, 32, 8192, False),
        _FusedBwd(4096, 1, 16, 8192, False),
        _FusedBwd(8192, 1, 32, 8192, False),
    ),
    (True, True): (  # add_rms_norm, fp32 / fp64
        _FusedBwd(128, 1, 16, 8192, False),
        _FusedBwd(512, 1, 32, 8192, False),
        _FusedBwd(4096, 1, 16, 8192, False),
        _FusedBwd(16384, 1, 32, 8192, False),
    ),
}

# Column tile of the looped (long-row) kernels.
LOOP_BLOCK_FWD = 8192
LOOP_BLOCK_BWD = 2048

# Looped backward: about this many programs per SM over (row chunk x column tile) work items.
LOOPED_PROGRAMS_PER_SM = 2

# Split rows (coop.py): rows longer than the fused limit are cut into chunks held by co-resident
# programs that exchange partial statistics, so x (and dy) are read from HBM once. Residency is
# guaranteed by the register file: programs per SM = 64 K registers // (threads x register cap),
# within 64 warps per SM (H100; also true of A100). Kernels launched without a cap count as 256
# registers a thread. Chunk sizes and warps: docs/tuning-log.md T31, T46.
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_REGISTERS = 256


@dataclass(frozen=True)
class SplitRows:
    """A split-row setting (:func:`split_row`): co-resident programs each hold a chunk of a row."""

    chunk: int  # elements a program holds (halved for fp64)
    num_warps: int
    max_registers: int = MAX_REGISTERS  # register cap the kernel is compiled with: programs an SM holds
    max_chunks: int = 32  # rows of more chunks take the next setting, or another kernel
    prefetch: bool = False  # pipelined: the next row's chunk loaded before this row's wait


# Backward: x, dy and
# the dweight/dbias partials in registers; settings tried in order, the first that can split the
# row is used; prefetch: pipelined, the next row's chunk loaded and its partials published before
# this row's wait. LayerNorm 0.69-0.72 at N = 16384-65536 pipelined vs 0.61-0.64 not; past 32
# chunks 0.57-0.69 at 131072-262144 vs looped 0.55-0.59 (docs/tuning-log.md T46).
SPLIT_BWD = (SplitRows(2048, 4, 128, 32, True), SplitRows(4096, 4, MAX_REGISTERS, 128, True))
# Softmax backward, keyed by element size >= 4 bytes: y and dy in registers. 16-bit pipelined
# 0.90-0.91 at N = 65536-262144 vs 0.82-0.86 not; fp32 not pipelined, 0.92-0.96 (the 16-bit setting
# read 0.84-0.86 in fp32: two rows of fp32 chunks fill the 128-register cap) (docs/tuning-log.md T63).
SPLIT_SOFTMAX_BWD = {False: SplitRows(8192, 8, 128, 32, True), True: SplitRows(8192, 4, MAX_REGISTERS, 32)}
# Forward, keyed by (element size >= 4 bytes, op kind: "layer_norm", "rms_norm", "add_norm",
# "softmax" (and log_softmax)).
# Re-read (prefetch False): the chunk is read again from L2 after the barrier, so a register cap lets
# many programs share an SM (16-bit 0.67-0.84 at N = 65536-262144; T31). Prefetch: the chunk is held
# through the barrier and the next row's chunk loaded before this row's reductions, for RMSNorm and
# softmax (RMSNorm 0.85 vs 0.81 re-read at 65536); LayerNorm and the add-norms spill with it (0.48-0.72
# vs 0.66-0.93) (docs/tuning-log.md T32).
SPLIT_FWD = {
    (False, "layer_norm"): SplitRows(8192, 8, 64, 64, False),
    (True, "layer_norm"): SplitRows(4096, 4, 96, 64, False),
    (False, "add_norm"): SplitRows(8192, 8, 64, 64, False),
    (True, "add_norm"): SplitRows(4096, 4, 96, 64, False),
    (False, "rms_norm"): SplitRows(8192, 8, 80, 64, True),
    (True, "rms_norm"): SplitRows(4096, 8, 64, 64, True),
    (False, "softmax"): SplitRows(8192, 8, 64, 64, True),
    (True, "softmax"): SplitRows(4096, 8, 64, 64, True),
}

# Partial-sum reduction tiles, about one program per SM. A first version had one program per 1024
# columns walking the G partial rows a load at a time: at N = 256 it cost as much as the whole
# backward (LayerNorm backward 0.20 of copy; docs/tuning-log.md T41).
REDUCE_ROWS = 64
REDUCE_MIN_BLOCK = 16
REDUCE_MAX_BLOCK = 256

# Under the Triton interpreter (CPU tensors) there are no SMs: a small persistent grid keeps the
# interpreted run short while still exercising the multi-program partial reduction.
INTERPRETER_SMS = 4


BACKEND = "normkit.backends.cuda"  # this backend's module (dispatch), whose strategies Force overrides


@dataclass(frozen=True)
class Force:
    """Launch strategies forced inside a :func:`forced` block instead of the measured choices below,
    where the shape allows them: tests take each kernel path on shapes the thresholds would not give
    it (no module global is assigned). None: as measured."""

    in_parts: bool | None = None  # rows (BatchNorm: channels) in more than one part (IN_PARTS)
    fused_max_n_fwd: int | None = None  # the longest row the fused forwards hold (FUSED_MAX_N_FWD)
    split_prefetch: bool | None = None  # split-row forwards hold their chunk, prefetch the next (SPLIT_FWD)
    batch_norm_split: bool | None = None  # BatchNorm training: False the two-pass kernels, True split
    # channels where they fit (not channels in parts; batch_norm_channels)
    batch_norm_pipelined: bool | None = None  # split channels publish the next before the wait
    group_norm_smem_backward: bool | None = None  # True: wherever it fits (GROUP_NORM_SMEM_* lifted)


NOT_FORCED = Force()


def force() -> Force:
    """The :class:`Force` in effect in this context (:func:`forced`)."""
    return dispatch.strategy(BACKEND) or NOT_FORCED


@contextlib.contextmanager
def forced(**strategies) -> Iterator[Force]:
    """Force :class:`Force`'s ``strategies`` (by field name) for the calls of this block, on top of an
    enclosing block's; e.g. ``with config.forced(in_parts=True): normkit.softmax(x, -1)``. Per
    context: this thread, and the eager backward of a forward made inside (a contract plan runs it
    under the forward's overrides, plans._Restored; a plan of the backend's own bakes the choice
    in); not another thread, nor the backward of a torch.compile'd graph. The memoized choices,
    launch keys and plans are keyed by it, so nothing needs clearing."""
    value = replace(force(), **strategies)
    with dispatch.use_strategy(BACKEND, value):
        yield value


def _or(forced_value, measured):
    return measured if forced_value is None else forced_value


# Launch configs are pure functions of (shape, dtype, device) and the Force in effect: each public
# chooser below is memoized (bounded, thread-safe lru_cache). A 16 x 4096 LayerNorm forward +
# backward spent ~12% of its host time choosing configs (cProfile on the H100; docs/tuning-log.md
# T9). Measurement scripts change the constants above only through tables().
CACHE_SIZE = 1024
_CACHED = []


def _memoized(fn):
    cached = functools.lru_cache(maxsize=CACHE_SIZE)(lambda forced, *args, **kwargs: fn(*args, **kwargs))

    @functools.wraps(fn)
    def chosen(*args, **kwargs):
        return cached(dispatch.strategy(BACKEND), *args, **kwargs)

    chosen.cache_info, chosen.cache_clear = cached.cache_info, cached.cache_clear
    chosen.cache_parameters = cached.cache_parameters
    _CACHED.append(cached)
    return chosen


def clear_caches() -> None:
    """Forget memoized launch configs (after changing a threshold constant of this module), the
    compiled kernels cached under call-site launch keys, which assume these constants (launch.py),
    and the remembered plans, which hold configs chosen under them (normkit/plans.py)."""
    from normkit import plans
    from normkit.backends.cuda import launch

    for fn in _CACHED:
        fn.cache_clear()
    launch._CACHE.clear()
    plans._PLANS.clear()


_NOT_TABLES = {"BACKEND", "NOT_FORCED", "CACHE_SIZE"}  # upper-case names tables() does not change


@contextlib.contextmanager
def tables(**values) -> Iterator[None]:
    """The block runs with some of this module's tables and thresholds replaced (``FUSED_BWD=...``),
    for the measurement scripts (ci/measure-*.py) that sweep them; every choice made under other
    values is forgotten on the way in and out (:func:`clear_caches`), and the values are restored.
    Tests force strategies through ``dispatch.use_strategy`` instead. Module state: one thread, no
    other normkit calls running; a table computed at import from another constant (``SPLIT_BWD``
    from ``MAX_REGISTERS``) keeps its value."""
    module = globals()
    unknown = sorted(k for k in values if not k.isupper() or k not in module or k in _NOT_TABLES)
    if unknown:
        raise ValueError(f"config.tables: no table or threshold named {', '.join(unknown)} in {__name__}")
    saved = {k: module[k] for k in values}
    module.update(values)
    clear_caches()
    try:
        yield
    finally:
        module.update(saved)
        clear_caches()


@dataclass(frozen=True)
class LaunchConfig:
    block_size: int  # column tile (BLOCK_N)
    num_warps: int
    rows_per_program: int  # rows per tile (fused) or per row chunk (looped backward)
    grid: tuple[int, ...]
    fused: bool  # the whole row fits one tile held in registers
    split: int = 1  # programs sharing one row (split rows, coop.py); grid = row groups x split
    maxnreg: int = MAX_REGISTERS  # register cap per thread the kernel is compiled with (split rows)
    prefetch: bool = False  # backward: load the next row tile (fused; split: the next row's chunk,
    # and publish its partials) during this one; shared-memory rows: one spare buffer
    smem: bool = False  # rows resident in shared memory (smem.py)
    buffers: int = 1  # shared-memory rows: CHUNK-element buffers a row (or a part) takes
    parts: int = 1  # shared-memory rows: programs sharing one row, one part each; grid = row groups x parts
    part: int = 0  # rows in parts (the in-parts kernels, even for one part): columns a part, a multiple of 16
    depth: int = 2  # rows in parts (forward): rows of buffers a part
    ring: int = 0  # rows in parts: slots of a row group's tagged terms (smem.row_terms)
    spin: int = 0  # split rows: polls a program waits for its row group to fill (coop.join)

    @property
    def in_parts(self) -> bool:
        """Rows in parts (smem_split_forward / smem_split_backward): the in-parts kernels serve."""
        return self.part > 0


@functools.lru_cache(maxsize=64)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return INTERPRETER_SMS


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed small number for CPU tensors)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _sm_count(device.type, index)


_FP32_MAX = 3.4028234663852886e38


def eps_tail(eps: float, device: torch.device) -> float:
    """``eps`` (or another float argument: momentum, count / (count - 1)) minus itself rounded to
    fp32. Triton passes a Python float to a compiled kernel as fp32, so fp64 kernels take such a
    value as (fp32 head, fp32 tail) and add them in fp64 (``common.exact_eps``); otherwise an fp64
    LayerNorm with eps = 0.1 is off by ~1e-9 relative, fp64 running statistics by ~3e-8.
    The interpreter (CPU tensors) passes floats unrounded: tail 0."""
    if device.type == "cpu" or not abs(eps) < _FP32_MAX:
        return 0.0
    return eps - struct.unpack("f", struct.pack("f", eps))[0]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of statistics, accumulators and partial sums: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _fused_max(limit: int, dtype: torch.dtype) -> int:
    return limit // FP64_DIVISOR if dtype == torch.float64 else limit


def _warps(tile_elements: int, dtype: torch.dtype) -> int:
    # Aim for ~4 16-byte vectors per thread (32 bf16 or 16 fp32 elements), within 4..32 warps.
    per_thread = 4 * 128 // torch.finfo(dtype).bits
    return max(4, min(32, triton.next_power_of_2(max(1, tile_elements // (32 * per_thread)))))


def _row_sweep(M: int, N: int, dtype: torch.dtype, fused_max: int) -> LaunchConfig:
    """Rows in registers, ROWS to a program (fused), or one program per row looping over tiles."""
    block = triton.next_power_of_2(N)
    if block <= _fused_max(fused_max, dtype):
        rows = max(1, min(MAX_ROWS_PER_PROGRAM, TILE_ELEMENTS_FWD // block, triton.next_power_of_2(M)))
        return LaunchConfig(block, _warps(rows * block, dtype), rows, (triton.cdiv(M, rows),), True)
    return LaunchConfig(LOOP_BLOCK_FWD, _warps(LOOP_BLOCK_FWD, dtype), 1, (M,), False)


def split_row(M: int, N: int, dtype: torch.dtype, device: torch.device,
              setting: SplitRows) -> LaunchConfig | None:  # fmt: skip
    """Split-row launch (coop.py) with ``setting`` for ``device``, or None for rows needing more
    chunks than programs that fit the SMs at once (or than the setting's ``max_chunks``). grid =
    row groups x chunks; group g takes rows g, g + groups, ...; ``split`` = chunks per row,
    ``block_size`` = chunk, ``maxnreg`` the register cap the kernel is compiled with, ``spin`` the
    polls of ``coop.join`` (CPU tensors: the interpreter runs programs one after another, so groups
    never fill and run solo at once)."""
    chunk, warps, maxnreg = _fused_max(setting.chunk, dtype), setting.num_warps, setting.max_registers
    per_sm = min(REGISTERS_PER_SM // (warps * 32 * maxnreg), MAX_WARPS_PER_SM // warps)
    programs = per_sm * sm_count(device)
    chunks = triton.cdiv(N, chunk)
    if chunks > min(programs, setting.max_chunks):
        return None
    groups = max(1, min(M, programs // chunks))
    spin = coop.SPIN if device.type == "cuda" else 0
    return LaunchConfig(chunk, warps, 1, (groups * chunks,), False, chunks, maxnreg, setting.prefetch,
                        spin=spin)  # fmt: skip


@_memoized
def forward(M: int, N: int, dtype: torch.dtype, device: torch.device, kind: str = "layer_norm",
            smem_ok: bool = False, held: int = 0) -> LaunchConfig:  # fmt: skip
    """Row forward of ``kind`` (a ``SPLIT_FWD`` key: layer_norm, rms_norm, add_norm, softmax):
    fused (rows in registers), rows resident in shared memory (``smem_ok``: the caller checked
    ``smem.fits`` for every streamed tensor; see :func:`smem_row`) or shared by K programs in shared
    memory (:func:`smem_split_forward`; ``held``: bytes a column of the weight and bias), split rows
    or looped (one program per row, two reads of x)."""
    cfg = _row_sweep(M, N, dtype, _or(force().fused_max_n_fwd, FUSED_MAX_N_FWD))
    parted = smem_ok and smem_split_forward(M, N, dtype, device, kind, held)
    cfg = parted or (smem_ok and smem_row(M, N, dtype, device, kind)) or cfg
    if not (cfg.fused or cfg.smem):
        cfg = split_row(M, N, dtype, device, _split_fwd(dtype, kind)) or cfg
    return cfg


def _split_fwd(dtype: torch.dtype, kind: str) -> SplitRows:
    """The ``SPLIT_FWD`` setting of ``kind`` for ``dtype`` (its prefetch as forced)."""
    setting, prefetch = SPLIT_FWD[dtype.itemsize >= 4, kind], force().split_prefetch
    return setting if prefetch is None else replace(setting, prefetch=prefetch)


# LayerNorm's fused forward takes both moments of a row in one reduction (ONE_READ of
# layer_norm._fwd_fused_kernel: E[xs^2] - E[xs]^2 of xs = x - x[row, 0], the variance taken again
# about the mean where the shift is an outlier) for 16-bit rows of at least ONE_READ_MIN_N: one
# program a row and an SM, whose two cross-warp reductions are what it waits on. N = 32768: bf16
# 0.933-0.936 -> 0.945-0.949; not fp32 (spills, 0.921 -> 0.913) nor the add-norms (two passes 0.988
# vs 0.929 in fp32) (docs/tuning-log.md T29). CUDA tensors only: the interpreter folds a tuple
# reduction left to right (fp32 sums of 20000 squares off by ~1e-5), where the GPU sums a tree.
ONE_READ_MIN_N = 32768


def one_read_moments(cfg: LaunchConfig, dtype: torch.dtype, device: torch.device, is_rms: bool,
                     add: bool) -> bool:  # fmt: skip
    """Whether the fused LayerNorm forward of ``cfg`` takes its moments in one reduction."""
    return (device.type == "cuda" and not is_rms and cfg.fused and cfg.rows_per_program == 1
            and cfg.block_size >= ONE_READ_MIN_N and dtype.itemsize == 2 and not add)  # fmt: skip


@dataclass(frozen=True)
class SmemRows:
    """A setting of rows resident in one program's shared memory (smem.py)."""

    chunk: int  # elements a buffer
    num_warps: int
    shortest: int  # rows from this length ...
    longest: int = 1 << 62  # ... up to this one


@dataclass(frozen=True)
class InParts:
    """A setting of rows in parts: K co-resident programs each stream a part of a row through their
    shared memory."""

    chunk: int  # elements a buffer
    buffers: int  # buffers a part: the part's width is chunk x buffers
    num_warps: int
    depth: int = 2  # rows of a part in flight (the backward: two)


@dataclass(frozen=True)
class InPartsChoice:
    """Rows in parts for one kind of forward: from ``shortest``, the first of ``settings`` that fits."""

    shortest: int
    settings: tuple[InParts, ...]


# Rows resident in shared memory (smem.py), keyed by op kind. 16-bit rows longer than the fused
# limit that fit one program's shared memory (N <= 114688 on the H100): RMSNorm 0.93-0.95 at N =
# 40000-114688 vs split rows 0.86-0.87, LayerNorm 0.89 vs 0.68-0.73 at 40000-65536 (T34, T35);
# softmax with each thread's own running max and sum 0.925 at 65536 (T37). At 32768 the fused
# kernels stay faster (RMSNorm 0.98 vs 0.955) (docs/tuning-log.md).
SMEM_FWD = {
    "layer_norm": SmemRows(16384, 16, 32769),
    "rms_norm": SmemRows(8192, 16, 32769),
    "softmax": SmemRows(8192, 16, 32769),
}
# Longer rows of these kinds take (shortest row, chunk elements) instead: CUDA 13's ptxas (which
# torch.compile puts in TRITON_PTXAS_PATH) builds softmax's 8192-element chunk at N = 65536 with
# spills, 0.63 vs 0.86; 16384 reads level (0.865 vs 0.872) and costs below 49152 (0.83 vs 0.91)
# (docs/tuning-log.md T34, T6).
SMEM_WIDE = {"softmax": (49153, 16384)}
# LayerNorm's statistics in one read of the buffers (Welford's update per column slot, two more
# register arrays) up to this many buffers a row, else two reads: one read 0.89 vs two 0.81-0.85 at
# N = 40000-65536; past 4 buffers it spills, 0.66-0.69 vs 0.74-0.75 (docs/tuning-log.md T36).
SMEM_ONE_PASS_MAX_CHUNKS = 4
SMEM_RESERVE = 1024  # bytes of a program's shared memory kept for the kernel's reductions


def smem_row(M: int, N: int, dtype: torch.dtype, device: torch.device, kind: str) -> LaunchConfig | None:
    """Rows resident in shared memory for ``kind`` (:data:`SMEM_FWD`), or None: a row shorter than
    the kind's shortest, or :func:`_smem_config`'s conditions (a CUDA device of compute capability
    8.0+, Gluon, 16-bit rows that fit one program's shared memory). One program per SM (the row's
    buffers fill most of it), each walking rows pid, pid + grid, ...; ``buffers`` = buffers a row,
    ``prefetch``: one spare buffer where it fits (the row after next starts landing while this
    row's last chunks do; smem.start)."""
    if kind not in SMEM_FWD or N < SMEM_FWD[kind].shortest:
        return None
    chunk, warps = SMEM_FWD[kind].chunk, SMEM_FWD[kind].num_warps
    if kind in SMEM_WIDE and N >= SMEM_WIDE[kind][0]:
        chunk = SMEM_WIDE[kind][1]
    return _smem_config(M, N, dtype, device, chunk, warps, 1)


# Row-norm backward rows in shared memory (layer_norm._bwd_smem_kernel): x and dy stream through
# one program's shared memory together, its fp32 dweight / dbias partials ([chunks, chunk] each) stay
# in registers. LayerNorm 16384: 0.88 vs split
# rows 0.73, RMSNorm 16384 0.94 vs fused 0.76 (T48); longer rows were faster in parts (RMSNorm 32768:
# 0.92 vs 0.88 here; T56), which IN_PARTS now keeps off (docs/tuning-log.md).
SMEM_BWD = SmemRows(8192, 16, 8193, 24576)
# The add-LayerNorm backward that writes the residual's gradient too (a third output stream) takes
# the rows-in-parts kernel (one part) past this length: 16384 0.922 vs 0.829 in the one-program
# kernel (docs/tuning-log.md T57). Not the add-RMSNorm (0.74 vs 0.93 there).
SMEM_BWD_DRES_LONGEST = 8192
# The registers bound the partials: next_pow2(chunks) rows for each of dweight / dbias, at most this
# many rows in all (64 fp32 registers a thread at 16 warps; LayerNorm 16384 and RMSNorm 32768 build
# to 128 registers with <= 56 bytes spilled, ptxas -v; one more row spills in earnest;
# docs/tuning-log.md T49).
SMEM_BWD_PARTIAL_ROWS = 4


def smem_backward(M: int, N: int, dtype: torch.dtype, device: torch.device,
                  partials: int) -> LaunchConfig | None:  # fmt: skip
    """Row-norm backward with rows in shared memory (:data:`SMEM_BWD`), or None: a row outside
    SMEM_BWD's lengths, ``partials`` (dweight, dbias: 0-2) x next_pow2(chunks) partial rows over
    :data:`SMEM_BWD_PARTIAL_ROWS`, or :func:`_smem_config`'s conditions for x and dy. One program
    per SM; ``buffers`` = buffers a row (of x, and of dy), ``prefetch``: a spare buffer of each where
    it fits."""
    setting = SMEM_BWD
    if not setting.shortest <= N <= setting.longest:
        return None
    if partials * triton.next_power_of_2(triton.cdiv(N, setting.chunk)) > SMEM_BWD_PARTIAL_ROWS:
        return None
    # a buffer of x and one of dy
    return _smem_config(M, N, dtype, device, setting.chunk, setting.num_warps, 2)


# Rows past one program's room in the backward (16-bit): K = cdiv(N, CHUNKS x CHUNK) co-resident
# programs share a row, each streaming its part of x and dy through shared memory two rows deep,
# holding its part of the weight there too and its part's partials in registers; they exchange the
# row terms as tagged words (smem.publish / gather).
# LayerNorm 32768-262144 0.85-0.87 vs split rows 0.58-0.74, RMSNorm 0.93 vs 0.67-0.75
# (docs/tuning-log.md T56).
SMEM_SPLIT_BWD = InParts(8192, 2, 8)
# Rows (BatchNorm: channels) in parts: K programs each hold a part in shared memory and wait for
# each other's tagged row terms (smem.collect) with no bound, so they hang where partners cannot
# get an SM (coop.py). More than one part a row is off until they join their row group first, as
# the split-row kernels do; the split-row and looped kernels serve those rows (cost: docs/tuning-log.md T51).
IN_PARTS = False


def _parts_refused(K: int) -> bool:
    """More than one part a row, where IN_PARTS is off (and not forced on) or the installed Triton
    gets them wrong (compat.in_parts_ok)."""
    return K > 1 and (not _or(force().in_parts, IN_PARTS) or compat.in_parts_ok() is not None)


def smem_split_backward(M: int, N: int, dtype: torch.dtype, device: torch.device,
                        dres: bool = False) -> LaunchConfig | None:  # fmt: skip
    """Row-norm backward with each row shared by K programs in shared memory (:data:`SMEM_SPLIT_BWD`),
    or None: :func:`_smem_config`'s conditions for a part's x and dy (two rows deep), or more parts a
    row than SMs. Grid = groups x K <= SMs (one program per SM: the programs of a row are co-resident,
    as coop.py's); ``buffers`` = buffers a part, ``parts`` = K (1 for rows of one part's width: the
    in-parts kernel still, ``part`` = its width)."""
    chunk, chunks, warps = SMEM_SPLIT_BWD.chunk, SMEM_SPLIT_BWD.buffers, SMEM_SPLIT_BWD.num_warps
    K = triton.cdiv(N, chunk * chunks)
    if _parts_refused(K):
        return None
    # two rows of the part, x and dy; beside them the part of the weight (room for an fp32 one)
    cfg = _smem_config(M, 2 * chunks * chunk, dtype, device, chunk, warps, 2, chunks * chunk * 4)
    if cfg is None or K > sm_count(device):
        return None
    groups = max(1, min(M, sm_count(device) // K))
    return replace(cfg, grid=(groups * K,), buffers=chunks, parts=K, part=chunk * chunks,
                   ring=SMEM_SPLIT_BWD_RING[dres])  # fmt: skip


def _smem_config(M: int, N: int, dtype: torch.dtype, device: torch.device, chunk: int, warps: int,
                 streams: int, held: int = 0, itemsizes: tuple = (2,)) -> LaunchConfig | None:  # fmt: skip
    """What :func:`smem_row`, :func:`smem_backward`, :func:`smem_split_backward` and
    :func:`smem_split_forward` share: None off a CUDA device of compute capability 8.0+
    (``cp.async``), without a working Gluon (compat.gluon_ok), for rows of an element size not in
    ``itemsizes``
    (16-bit by default), or where a row of ``streams`` tensors in CHUNK-element buffers does not fit
    one program's shared memory beside ``held`` bytes; else one program per SM (grid min(M, SMs)),
    ``buffers`` = buffers a row, ``prefetch``: one spare buffer (of each stream) where it fits."""
    if device.type != "cuda" or dtype.itemsize not in itemsizes or not compat.gluon_ok(device):
        return None
    if torch.cuda.get_device_capability(device) < (8, 0):
        return None
    chunks = triton.cdiv(N, chunk)
    room = smem.smem_per_block(device) - SMEM_RESERVE - held
    buffer = streams * chunk * dtype.itemsize
    if chunks * buffer > room:
        return None
    spare = (chunks + 1) * buffer <= room
    grid = (min(M, sm_count(device)),)
    return LaunchConfig(chunk, warps, 1, grid, False, prefetch=spare, smem=True, buffers=chunks)


# Rows in parts, forward (row norms, 16-bit here and fp32 below, layer_norm._fwd_smem_split_kernel;
# softmax, softmax._fwd_smem_split_kernel): K = cdiv(N, width) co-resident programs share a row, each
# streaming its part (x, and the residual for the add-norms) through shared memory DEPTH rows deep and
# holding its part of the weight and bias there, exchanging tagged row terms. Per kind: the shortest
# row, and settings tried in order until one fits beside the weight and bias. Parts as wide as their
# buffers (even cuts read 0.70-0.72). At 131072 / 262144 vs split rows (docs/tuning-log.md T58, T59):
# - layer_norm 16384 x 1: 0.894-0.904 vs 0.68-0.71; from 65537 (one program 0.79-0.81 at 98304).
# - rms_norm 8192 x 3: 0.931 / 0.936 vs 0.84-0.88.
# - add_norm 8192 x 2, 2 deep: 0.92-0.96 vs 0.89-0.95.
# - softmax 8192 x 3: 0.90-0.92 vs 0.78-0.84; from the first length one program cannot hold.
SMEM_SPLIT_FWD = {
    "layer_norm": InPartsChoice(65537, (InParts(16384, 1, 8, 3), InParts(8192, 2, 8, 3))),
    "rms_norm": InPartsChoice(131072, (InParts(8192, 3, 8, 3), InParts(16384, 1, 8, 3),
                                       InParts(8192, 2, 8, 3))),  # fmt: skip
    "add_norm": InPartsChoice(65536, (InParts(8192, 2, 8, 2), InParts(4096, 4, 8, 2),
                                      InParts(4096, 2, 8, 2))),  # fmt: skip
    "softmax": InPartsChoice(114689, (InParts(8192, 3, 8, 3), InParts(8192, 2, 8, 3))),
}
# fp32 rows in parts, same key, from past the fused limit (the fp32 weight and bias held beside the
# buffers limit the settings; LayerNorm's statistics of x - x[row, 0]). At 65536-262144 vs split
# rows: softmax 4096 x 3 0.95-0.96 vs 0.80-0.91, LayerNorm 8192 x 1 0.92 vs 0.71-0.81, RMSNorm 0.94 vs
# 0.86-0.92, add-norms 4096 x 2 0.92-0.96 vs 0.78-0.93; at 32768 the fused kernels stay
# (docs/tuning-log.md T60).
SMEM_SPLIT_FWD_FP32 = {
    "softmax": InPartsChoice(FUSED_MAX_N_FWD + 1, (InParts(4096, 3, 8, 3), InParts(4096, 2, 8, 3))),
    "layer_norm": InPartsChoice(FUSED_MAX_N_FWD + 1, (InParts(8192, 1, 8, 3), InParts(4096, 2, 8, 3))),
    "rms_norm": InPartsChoice(FUSED_MAX_N_FWD + 1, (InParts(8192, 1, 8, 3), InParts(4096, 2, 8, 3))),
    "add_norm": InPartsChoice(FUSED_MAX_N_FWD + 1, (InParts(4096, 2, 8, 2), InParts(4096, 1, 8, 3))),
}
# Term slots a row group (smem.row_terms; smem.MIN_RING at least), per kind of forward and for the
# backward (keyed by whether it writes the residual's gradient): 4 for the LayerNorm / RMSNorm
# forward (0.880 vs 0.862-0.873 with more), 32 for the add-norms (0.918 vs 0.872 with 4), softmax and
# every backward; why slots matter is not diagnosed (docs/tuning-log.md T55).
SMEM_SPLIT_RING = {"layer_norm": 4, "rms_norm": 4, "add_norm": 32, "softmax": 32}
SMEM_SPLIT_BWD_RING = {False: 32, True: 32}


def smem_split_forward(M: int, N: int, dtype: torch.dtype, device: torch.device, kind: str,
                       held: int = 0) -> LaunchConfig | None:  # fmt: skip
    """Row forward with each row shared by K programs in shared memory (:data:`SMEM_SPLIT_FWD`; fp32
    rows: :data:`SMEM_SPLIT_FWD_FP32`), or None: a kind without the path (for the dtype), a row
    shorter than the kind's shortest, or no setting meeting
    :func:`_smem_config`'s conditions for DEPTH rows of a part (of x, and of the residual for
    "add_norm") beside ``held`` bytes a column (the part's weight and bias). K = cdiv(N, width), P
    = N / K rounded up to 16 (``buffers`` = buffers a part, ``parts`` = K, ``part`` = P, ``depth``);
    grid = groups x K <= SMs, one program per SM."""
    table = SMEM_SPLIT_FWD_FP32 if dtype.itemsize == 4 else SMEM_SPLIT_FWD
    if kind not in table or N < table[kind].shortest:
        return None
    streams = 2 if kind == "add_norm" else 1
    return next((cfg for cfg in (_in_parts(M, N, dtype, device, setting, streams, held, SMEM_SPLIT_RING[kind])
                                 for setting in table[kind].settings) if cfg is not None), None)  # fmt: skip


def _in_parts(M: int, N: int, dtype: torch.dtype, device: torch.device, setting: InParts, streams: int,
              held: int, ring: int) -> LaunchConfig | None:  # fmt: skip
    """Rows in parts with ``setting``, or None where it does not fit (:func:`smem_split_forward`)."""
    chunk, chunks, warps, depth = setting.chunk, setting.buffers, setting.num_warps, setting.depth
    width = chunk * chunks
    K = triton.cdiv(N, width)
    if _parts_refused(K):
        return None
    cfg = _smem_config(M, depth * width, dtype, device, chunk, warps, streams, width * held, (2, 4))
    if cfg is None or K > sm_count(device):
        return None
    P = triton.cdiv(triton.cdiv(N, K), 16) * 16
    groups = max(1, min(M, sm_count(device) // K))
    return replace(cfg, grid=(groups * K,), buffers=triton.cdiv(P, chunk), parts=K, part=P, depth=depth,
                   ring=ring)  # fmt: skip


@_memoized
def softmax(M: int, N: int, dtype: torch.dtype, device: torch.device, smem_ok: bool = False) -> LaunchConfig:
    """Softmax / log_softmax forward: the row-norm forward's tiling (fused, rows in shared memory, in
    parts), with its own settings (``SMEM_FWD``, ``SMEM_SPLIT_FWD`` and split-row ``SPLIT_FWD``
    "softmax", measured; docs/tuning-log.md T32, T35, T58). The fused limit is the row norms' (a row of x in
    registers), not measured separately for softmax."""
    return forward(M, N, dtype, device, "softmax", smem_ok)


# Softmax backward, rows of LOOPED_SOFTMAX_BWD_N (exclusive, inclusive]: the looped kernel, its second
# sweep re-reading the row from L1 / L2, (column tile, num_warps) keyed by (element size >= 4,
# log_softmax). N = 32768: softmax 16-bit 32768 x 16 0.995-0.997 vs fused 0.917-0.960, fp32 16384 x 32
# 0.970 vs split rows 0.955 (docs/tuning-log.md T62).
LOOPED_SOFTMAX_BWD_N = (16384, 32768)
LOOPED_SOFTMAX_BWD = {(False, False): (32768, 16), (False, True): (16384, 16), (True, False): (16384, 32),
                      (True, True): (16384, 32)}  # fmt: skip


@_memoized
def softmax_backward(M: int, N: int, dtype: torch.dtype, device: torch.device,
                     log: bool = False) -> LaunchConfig:  # fmt: skip
    """Softmax backward (``log``: log_softmax's): the looped kernel for rows of 16385-32768 in 16-bit
    and fp32 (``LOOPED_SOFTMAX_BWD``), else fused rows of y and dy up to ``FUSED_MAX_N_SOFTMAX_BWD``,
    else split rows (0.79-0.84 of copy at N = 65536 - 262144 vs 0.56-0.59 looped, bf16;
    docs/tuning-log.md T63), else looped."""
    lo, hi = LOOPED_SOFTMAX_BWD_N
    if lo < N <= hi and dtype.itemsize <= 4:
        block, warps = LOOPED_SOFTMAX_BWD[(dtype.itemsize >= 4, log)]
        return LaunchConfig(block, warps, 1, (M,), False)
    cfg = _row_sweep(M, N, dtype, FUSED_MAX_N_SOFTMAX_BWD)
    if not cfg.fused:
        cfg = split_row(M, N, dtype, device, SPLIT_SOFTMAX_BWD[dtype.itemsize >= 4]) or cfg
    return cfg


@_memoized
def row_sweep(M: int, N: int, dtype: torch.dtype) -> LaunchConfig:
    """One program per row looping over column tiles (the looped backward's row statistics)."""
    return _row_sweep(M, N, dtype, fused_max=0)


@_memoized
def backward(M: int, N: int, dtype: torch.dtype, device: torch.device, is_rms: bool, smem_ok: bool = False,
             partials: int = 2, dres: bool = False, dropout: bool = False) -> LaunchConfig:  # fmt: skip
    """Row-norm backward (``dres``: the add-norms' backward writing the residual's gradient too).

    Fused: a persistent grid (``FUSED_BWD`` table) walks row tiles, each program keeping its
    dweight/dbias partial in registers; grid[0] is the number of partial rows.
    Rows in shared memory (``smem_ok``: the caller checked ``smem.fits`` for x and dy, both 16-bit,
    no dropout; ``partials``: how many of dweight / dbias are wanted): :func:`smem_backward`; one
    partial row a program.
    Split rows (``split`` > 1, coop.py): grid = row groups x chunks; each program keeps the
    dweight/dbias partial of its chunk's columns, so there are grid[0] // split partial rows.
    Looped: grid (row chunks, column tiles); each program sweeps a chunk of rows for one column
    tile; grid[0] row chunks is the number of partial rows.
    """
    block = triton.next_power_of_2(N)
    one_part = smem_ok and not (dres and not is_rms and N > SMEM_BWD_DRES_LONGEST)
    cfg = one_part and smem_backward(M, N, dtype, device, partials)
    if cfg:
        return cfg
    fused = block <= _fused_max(FUSED_MAX_N_BWD[is_rms, dtype.itemsize >= 4], dtype)
    cfg = smem_ok and not fused and smem_split_backward(M, N, dtype, device, dres)
    if cfg:
        return cfg
    if fused:
        key = (is_rms, dtype.itemsize >= 4)
        table = (dropout and FUSED_BWD_DROPOUT.get(key)) or FUSED_BWD[key]
        entry = next(e for e in table if block <= e.max_n)
        rows = max(1, min(MAX_ROWS_PER_PROGRAM, entry.tile_elements // block, triton.next_power_of_2(M)))
        grid = min(entry.programs_per_sm * sm_count(device), triton.cdiv(M, rows))
        per_warp = 32 * entry.elements_per_thread
        warps = max(4, min(32, triton.next_power_of_2(max(1, rows * block // per_warp))))
        return LaunchConfig(block, warps, rows, (grid,), True, prefetch=entry.prefetch)
    for setting in SPLIT_BWD:
        split = split_row(M, N, dtype, device, setting)
        if split is not None:
            return split
    programs = LOOPED_PROGRAMS_PER_SM * sm_count(device)
    col_tiles = triton.cdiv(N, LOOP_BLOCK_BWD)
    chunks = max(1, min(M, triton.cdiv(programs, col_tiles)))
    rows = triton.cdiv(M, chunks)
    chunks = triton.cdiv(M, rows)
    return LaunchConfig(LOOP_BLOCK_BWD, _warps(LOOP_BLOCK_BWD, dtype), rows, (chunks, col_tiles), False)


# --- GroupNorm / BatchNorm (channels-first images, (N, C, HW) contiguous) ------------------------
# First versions (one program per (n, g) row or per channel, 4096-element 1-D tiles) reached
# 0.04-0.35 of copy forward and 0.03-0.23 backward (2026-11-21; docs/tuning-log.md T66, T67).
# GroupNorm forward rows of L = (C / G) * HW elements up to the row norms' fused limit are held in
# registers (one HBM read); longer rows take the row norms' split forward (co-resident programs a
# row, ``group_norm_split_forward``; docs/tuning-log.md T71) or, where it
# cannot run (CPU, too many chunks), loop over tiles of GROUP_NORM_LOOP_BLOCK. The other image
# kernels walk 2-D tiles [rows or channels, HW columns] of about IMAGE_TILE elements whose column
# tile is a power of two chosen to waste at most 1 / IMAGE_MAX_WASTE of its lanes on HW's tail
# (HW = 3136 = 56 x 56 takes 7 x 512, not 4 x 1024).
GROUP_NORM_LOOP_BLOCK = 4096
IMAGE_TILE = 4096
IMAGE_MAX_HW_BLOCK = 1024
IMAGE_MIN_HW_BLOCK = 32
IMAGE_MAX_WASTE = 8
# BatchNorm's per-channel sums: each channel's N samples are cut into ``parts`` slices so that
# about this many programs per SM run (C = 256 channels alone would fill 2 of 132 SMs); the
# (parts, C) partials are merged in a fixed order (bitwise reproducible).
BATCH_NORM_PROGRAMS_PER_SM = 16
# GroupNorm backward: one program per (n, g) row at this many warps (8 / 16 / 32 measured: 0.58-0.76
# of copy at 16 on the bf16 image shapes). A persistent grid of 1-4 programs per SM, meant to keep
# each row's second walk in L2, was slower (0.20-0.63, H200) (docs/tuning-log.md T67).
GROUP_NORM_BWD_WARPS = 16
# Its [channels, HW] tiles may be this wide over HW (the other image kernels: IMAGE_MAX_HW_BLOCK), so
# that groups of few channels still fill an IMAGE_TILE tile: 128x64x112x112 G = 32 (Cg = 2) [2, 2048]
# 0.770 vs [2, 1024] 0.583 (T68). The row norms' shared-memory backward over GroupNorm rows was tried
# instead and not kept (0.21-0.76 on the image shapes; docs/tuning-log.md T70).
GROUP_NORM_BWD_MAX_HW_BLOCK = 2048
# Fused forward: at most this many warps by element size (the row norms' 32 warps for a 32768
# tile gave 0.64-0.86 of copy on the bf16 image shapes, 8 warps 0.75-0.90; docs/tuning-log.md T66;
# fp32 / fp64 keep twice / four times the warps for the same registers per thread, unmeasured).
GROUP_NORM_FWD_MAX_WARPS = {2: 8, 4: 16, 8: 32}
# BatchNorm sums: 16 programs per SM over [samples, HW] tiles of 2048 elements read the statistics
# pass at 0.45-0.70 of copy on the bf16 image shapes, the steadiest of {4, 8, 16} x {2048, 4096,
# 8192} (0.31-0.75; docs/tuning-log.md T72). The apply kernel reads 0.88-0.98 at any tile of 2048-16384.
BATCH_NORM_SUMS_TILE = 2048
# Channels a tile of the sums kernels for HW = 1 ((N, C) inputs, channels-last ones read as (N * HW,
# C, 1)): 128 bytes of bf16 a tile row. Not measured yet (issue 41: chosen so a warp's load is
# contiguous; the [samples, 1] tiles before it read one value a 32-byte sector;
# docs/tuning-log.md T77).
BATCH_NORM_SUMS_CHANNELS = 64
MERGE_BLOCK = 128  # channels per program of the partial-statistics merge
# GroupNorm backward: fp32 rows longer than this go through the row norms' split backward
# (``SPLIT_BWD``; co-resident programs share a row, x and dy read once) instead of one program per
# row reading it twice: fp32 0.57-0.63 -> 0.71-0.83 on the image shapes; 16-bit split rows were
# slower (0.44-0.55 vs 0.59-0.79), so 16-bit (and fp64, not measured) keeps one program a row
# (docs/tuning-log.md T69). L between 8192 and 12544 was not measured.
GROUP_NORM_SPLIT_MIN_L = {4: 8192}
# BatchNorm split channels (coop.py applied to channels, batch_norm.py): the K programs of a
# channel each take a chunk of its N * HW values (runs of whole samples' HW columns) and meet at a
# per-channel barrier, so the training forward reads x from HBM once (chunk re-read from L2 after
# the barrier) instead of twice, and the backward x and dy once (held in registers). Keyed by
# (backward, element size >= 4 bytes); prefetch: the next channel's chunk published before this
# channel's wait. Forward 0.58-0.67 vs
# the two-pass kernels' 0.49-0.62, backward fp32 0.77-0.83 vs 0.54-0.59 (docs/tuning-log.md T73).
# Channels of fewer than BATCH_NORM_SPLIT_MIN_HW values per sample keep the two-pass kernels (not
# measured on split channels; a chunk's runs would be that short).
BATCH_NORM_SPLIT = {
    (False, False): SplitRows(8192, 8, 64, 512, True),
    (False, True): SplitRows(4096, 8, 64, 512, True),
    (True, False): SplitRows(4096, 4, 128, 512, True),
    (True, True): SplitRows(8192, 8, 128, 512, False),
}
BATCH_NORM_SPLIT_MIN_HW = 64


@dataclass(frozen=True)
class ImageConfig:
    hw_block: int  # column tile over HW (power of two)
    row_block: int  # rows (channels of a group, samples of a channel, or (n, c) rows) per tile
    num_warps: int
    grid: tuple[int, ...]
    parts: int = 1  # BatchNorm sums: sample slices per channel (partial rows)
    samples: int = 1  # BatchNorm sums: samples per slice
    rows: int = 1  # GroupNorm forward: (n, g) rows per program
    fused: bool = False  # GroupNorm forward: whole rows in registers ([rows, row_block, hw_block])
    channels: int = 0  # BatchNorm sums, HW = 1: channels a [samples, channels] tile (0: [samples, HW])


def _hw_block(HW: int, most: int = 0) -> int:
    """Largest power-of-two tile over HW (<= ``most``, default IMAGE_MAX_HW_BLOCK) whose padding of
    HW is at most 1 / IMAGE_MAX_WASTE; the full power of two when none is."""
    top = min(most or IMAGE_MAX_HW_BLOCK, triton.next_power_of_2(max(1, HW)))
    block = top
    while block >= IMAGE_MIN_HW_BLOCK:
        padded = triton.cdiv(HW, block) * block
        if (padded - HW) * IMAGE_MAX_WASTE <= padded:
            return block
        block //= 2
    return top


def _image_tile(rows: int, HW: int, dtype: torch.dtype, tile: int = IMAGE_TILE, most: int = 0) -> ImageConfig:
    hw_block = _hw_block(HW, most)
    row_block = max(1, min(triton.next_power_of_2(max(1, rows)), max(1, tile // hw_block)))
    return ImageConfig(hw_block, row_block, _warps(row_block * hw_block, dtype), ())


# A channels-last group is HW runs of Cg contiguous channels, C apart. The fused forward reads such
# runs well only from 64 bytes (H100, 2026-11-26, fraction of copy, fused / the [channels, HW] tiles
# walked twice: bf16 Cg 8 (16 B) 0.027 / 0.27, Cg 16 (32 B) 0.51 / 0.62; fp32 Cg 8 (32 B) 0.21 /
# 0.55, Cg 16 (64 B) 0.84 / 0.67; Cg 2 bf16 0.024 / 0.092; docs/tuning-log.md T89).
GROUP_NORM_CL_FUSED_MIN_RUN = 64


@_memoized
def group_norm(rows: int, Cg: int, HW: int, dtype: torch.dtype, cl: bool = False) -> ImageConfig:
    """GroupNorm forward over ``rows`` = N * G rows of Cg channels x HW: fused when a
    [Cg, HW] tile padded to powers of two fits the row norms' fused limit (whole rows in registers,
    one HBM read, per-channel weight / bias loaded once per channel; several short rows to a
    program) and, channels-last (``cl``), a group's run of channels is at least
    GROUP_NORM_CL_FUSED_MIN_RUN bytes; else (not fused) one program per row looping over 1-D tiles,
    or channels-last over [channels, HW] tiles (two reads of the row)."""
    cb, hwb = triton.next_power_of_2(max(1, Cg)), triton.next_power_of_2(max(1, HW))
    short_runs = cl and Cg * dtype.itemsize < GROUP_NORM_CL_FUSED_MIN_RUN
    if cb * hwb <= _fused_max(_or(force().fused_max_n_fwd, FUSED_MAX_N_FWD), dtype) and not short_runs:
        r = max(1, min(MAX_ROWS_PER_PROGRAM, TILE_ELEMENTS_FWD // (cb * hwb), triton.next_power_of_2(rows)))
        warps = min(GROUP_NORM_FWD_MAX_WARPS[torch.finfo(dtype).bits // 8], _warps(r * cb * hwb, dtype))
        return ImageConfig(hwb, cb, warps, (triton.cdiv(rows, r),), rows=r, fused=True)
    block = GROUP_NORM_LOOP_BLOCK
    return ImageConfig(block, 1, _warps(block, dtype), (rows,))


@_memoized
def group_norm_backward(rows: int, Cg: int, HW: int, dtype: torch.dtype) -> ImageConfig:
    """GroupNorm backward: one program per (n, g) row walks it twice in [channels, HW] tiles (sums,
    then dx), up to GROUP_NORM_BWD_MAX_HW_BLOCK wide."""
    cfg = _image_tile(Cg, HW, dtype, most=GROUP_NORM_BWD_MAX_HW_BLOCK)
    return ImageConfig(cfg.hw_block, cfg.row_block, GROUP_NORM_BWD_WARPS, (rows,))


# GroupNorm backward with each (n, g) row held in shared memory (group_norm._bwd_smem_kernel: x and
# dy stream through one program's shared memory, read from HBM once; per-channel sums from [runs of
# 8, channels] registers, reduced once a row with lanes across the channels), for 16-bit rows with
# HW a multiple of 8, x and dy 16-byte aligned: (chunk values, num_warps). 128x256x56x56 (Cg 8, L
# 25088) 0.83-0.85 vs 0.74 one program a row; rows of 12544 lose (0.61-0.64 vs 0.79-0.85: _MIN_L),
# as 8 rows a program do (0.45-0.68 vs 0.57-0.64: _MIN_ROWS); Cg 32 is not measured (_MAX_CG)
# (docs/tuning-log.md T70).
GROUP_NORM_SMEM_BWD = (2048, 8)
GROUP_NORM_SMEM_MAX_CG = 16
GROUP_NORM_SMEM_MIN_L = 16384
GROUP_NORM_SMEM_MIN_ROWS = 16  # rows a program (of one per SM)


@_memoized
def group_norm_smem_backward(rows: int, Cg: int, HW: int, dtype: torch.dtype, device: torch.device,
                             ) -> LaunchConfig | None:  # fmt: skip
    """GroupNorm backward with rows in shared memory (:data:`GROUP_NORM_SMEM_BWD`), or None: HW not a
    multiple of 8, more than GROUP_NORM_SMEM_MAX_CG channels a group, rows shorter than
    GROUP_NORM_SMEM_MIN_L, fewer than GROUP_NORM_SMEM_MIN_ROWS rows an SM, or :func:`_smem_config`'s
    conditions (a CUDA device with ``cp.async``, Gluon, 16-bit, the row's x and dy fit one program's
    shared memory). The caller checks the alignment of x and dy (smem.fits). The persistent grid is
    cut so that every program takes as many rows (the last row step is not left to a few SMs)."""
    opened = force().group_norm_smem_backward  # True: 32 channels, no minimum rows or row length
    max_cg, min_l, min_rows = (max(32, GROUP_NORM_SMEM_MAX_CG), 0, 0) if opened else (
        GROUP_NORM_SMEM_MAX_CG, GROUP_NORM_SMEM_MIN_L, GROUP_NORM_SMEM_MIN_ROWS)
    if HW % 8 or Cg > max_cg or Cg * HW < min_l or opened is False:
        return None
    if device.type != "cuda" or rows < min_rows * sm_count(device):
        return None
    chunk, warps = GROUP_NORM_SMEM_BWD
    scratch = chunk // 8 * triton.next_power_of_2(Cg) * 4  # the [runs, channels] sums' reduction
    cfg = _smem_config(rows, Cg * HW, dtype, device, chunk, warps, 2, scratch)
    if cfg is None:
        return None
    return replace(cfg, grid=(triton.cdiv(rows, triton.cdiv(rows, cfg.grid[0])),))


@_memoized
def group_norm_split_forward(rows: int, L: int, G: int, dtype: torch.dtype, device: torch.device,
                             affine: bool) -> LaunchConfig | None:  # fmt: skip
    """GroupNorm forward of rows over the fused limit through the row norms' split forward (the
    LayerNorm setting of ``SPLIT_FWD``) over the ``rows`` = N * G rows of L = Cg * HW, or None (the
    looped kernel): fp32 / fp64 with a weight or bias (``affine``; measured slower, below), where
    ``split_row`` finds no split (more chunks than programs that fit at once) or fewer than G row groups
    fit (row groups a multiple of G, as in the backward).

    Split vs looped (G = 32, L = 65536-131072): without weight / bias 0.61-0.84 vs 0.46-0.64; fp32
    with both 0.42-0.50 vs 0.53-0.64 (the per-row weight rows, gathered per element;
    docs/tuning-log.md T71)."""
    if affine and dtype.itemsize >= 4:
        return None
    return _group_aligned(split_row(rows, L, dtype, device, _split_fwd(dtype, "layer_norm")), G)


@_memoized
def group_norm_split_backward(rows: int, L: int, G: int, dtype: torch.dtype, device: torch.device,
                              ) -> LaunchConfig | None:  # fmt: skip
    """GroupNorm backward through the row norms' split backward (``SPLIT_BWD``) over the ``rows`` =
    N * G rows of L = Cg * HW, or None (the one-program-per-row kernel): for element sizes not in
    ``GROUP_NORM_SPLIT_MIN_L`` or rows of at most its entry, on CPU, or when fewer than G row
    groups fit. The row groups are a multiple of G, so each group's rows share a weight row
    (layer_norm.py)."""
    if L <= GROUP_NORM_SPLIT_MIN_L.get(dtype.itemsize, L):
        return None
    return _group_aligned(next((c for c in (split_row(rows, L, dtype, device, s) for s in SPLIT_BWD) if c),
                               None), G)  # fmt: skip


@dataclass(frozen=True)
class GroupNormForward:
    """How a GroupNorm forward runs (:func:`group_norm_fwd_strategy`). ``kernel``: "fused" (whole
    rows in registers, ``tiles``), "looped" (one program a row over 1-D tiles, ``tiles``), "split"
    (the row norms' split forward, ``split``) or "channels_last" (one program a row over [channels,
    HW] tiles, ``tiles``: the backward's)."""

    kernel: str
    tiles: ImageConfig
    split: LaunchConfig | None = None


@_memoized
def group_norm_fwd_strategy(N: int, C: int, HW: int, G: int, dtype: torch.dtype, device: torch.device,
                            cl: bool = False, affine: bool = True) -> GroupNormForward:  # fmt: skip
    """The GroupNorm forward of an (N, C, HW) input in G groups, channels-last (``cl``) or contiguous,
    with a weight or bias (``affine``): fused where :func:`group_norm` fits the row, else
    channels-last rows over the backward's tiles, contiguous ones through the row norms' split
    forward (:func:`group_norm_split_forward`) or looped."""
    rows, Cg = N * G, C // G
    tiles = group_norm(rows, Cg, HW, dtype, cl)
    if tiles.fused:
        return GroupNormForward("fused", tiles)
    if cl:
        return GroupNormForward("channels_last", group_norm_backward(rows, Cg, HW, dtype))
    split = group_norm_split_forward(rows, Cg * HW, G, dtype, device, affine)
    return GroupNormForward("looped", tiles) if split is None else GroupNormForward("split", tiles, split)


@dataclass(frozen=True)
class GroupNormBackward:
    """How a GroupNorm backward runs (:func:`group_norm_bwd_strategy`). ``kernel``: "split" (the row
    norms' split backward, ``split``), "smem" (rows held in shared memory, ``smem``) or "rows" (one
    program a row, ``tiles``)."""

    kernel: str
    tiles: ImageConfig | None = None
    split: LaunchConfig | None = None
    smem: LaunchConfig | None = None


@_memoized
def group_norm_bwd_strategy(N: int, C: int, HW: int, G: int, dtype: torch.dtype, device: torch.device,
                            cl: bool = False, smem_ok: bool = False) -> GroupNormBackward:  # fmt: skip
    """The GroupNorm backward of an (N, C, HW) input in G groups: contiguous long rows through the
    row norms' split backward (:func:`group_norm_split_backward`), else contiguous rows in shared
    memory where :func:`group_norm_smem_backward` allows and the caller found x and dy aligned, in
    x's dtype (``smem_ok``), else one program a row (channels-last rows always)."""
    rows, Cg = N * G, C // G
    split = None if cl else group_norm_split_backward(rows, Cg * HW, G, dtype, device)
    if split is not None:
        return GroupNormBackward("split", split=split)
    in_smem = group_norm_smem_backward(rows, Cg, HW, dtype, device) if smem_ok and not cl else None
    if in_smem is not None:
        return GroupNormBackward("smem", smem=in_smem)
    return GroupNormBackward("rows", tiles=group_norm_backward(rows, Cg, HW, dtype))


def _group_aligned(cfg: LaunchConfig | None, G: int) -> LaunchConfig | None:
    """A split-row config whose row groups are cut to a multiple of G (program group g then takes
    rows of one GroupNorm group only: one weight row, kept in cache), or None if fewer than G fit."""
    if cfg is None:
        return None
    groups = cfg.grid[0] // cfg.split // G * G
    return replace(cfg, grid=(groups * cfg.split,)) if groups else None


@_memoized
def batch_norm_sums(N: int, C: int, HW: int, dtype: torch.dtype, device: torch.device) -> ImageConfig:
    """BatchNorm statistics / gradient sums: program (slice s, channel c) sums channel c over
    ``samples`` samples x HW in [samples, HW] tiles; grid = parts x C."""
    if HW == 1:  # (N, C) rows (BatchNorm1d, and channels-last inputs as (N * HW, C, 1)): program (s,
        # channel block) sums [samples, channels] tiles, contiguous along the channels
        cb = min(triton.next_power_of_2(max(1, C)), BATCH_NORM_SUMS_CHANNELS)
        blocks = triton.cdiv(C, cb)
        parts = max(1, min(N, triton.cdiv(BATCH_NORM_PROGRAMS_PER_SM * sm_count(device), blocks)))
        samples = triton.cdiv(N, parts)
        parts = triton.cdiv(N, samples) if N else 1
        rb = max(1, min(triton.next_power_of_2(max(1, samples)), BATCH_NORM_SUMS_TILE // cb))
        return ImageConfig(1, rb, _warps(rb * cb, dtype), (parts * blocks,), parts, samples, channels=cb)
    parts = max(1, min(N, triton.cdiv(BATCH_NORM_PROGRAMS_PER_SM * sm_count(device), max(1, C))))
    samples = triton.cdiv(N, parts)
    parts = triton.cdiv(N, samples) if N else 1
    cfg = _image_tile(samples, HW, dtype, BATCH_NORM_SUMS_TILE)
    return ImageConfig(cfg.hw_block, cfg.row_block, cfg.num_warps, (parts * C,), parts, samples)


def run_length(HW: int, dtype: torch.dtype) -> int:
    """Values per run of a split channel's chunk (batch_norm.py): the largest power of two that
    divides HW, up to one 16-byte vector."""
    vec = 16 // dtype.itemsize
    while HW % vec:
        vec //= 2
    return vec


@_memoized
def batch_norm_split(N: int, C: int, HW: int, dtype: torch.dtype, device: torch.device, backward: bool,
                     ) -> LaunchConfig | None:  # fmt: skip
    """Split-channel launch (``split_row`` over C rows of N * HW values, with ``BATCH_NORM_SPLIT``),
    or None where the two-pass kernels serve: HW < BATCH_NORM_SPLIT_MIN_HW, channels of 2^31 values
    or more, more chunks per channel than programs that fit at once (CPU tensors: the
    interpreter's programs run solo, coop.join), or forced off (``Force.batch_norm_split``)."""
    L, forced_now = N * HW, force()
    if HW < BATCH_NORM_SPLIT_MIN_HW or not 0 < L < 2**31 - 2**20 or forced_now.batch_norm_split is False:
        return None
    setting = BATCH_NORM_SPLIT[backward, dtype.itemsize >= 4]
    setting = replace(setting, prefetch=_or(forced_now.batch_norm_pipelined, setting.prefetch))
    return split_row(C, L, dtype, device, setting)


# BatchNorm's training forward with channels in parts (batch_norm._fwd_smem_split_kernel: the row
# norms' rows in parts, a channel of N * HW values for a row; HW a multiple of 16, x 16-byte
# aligned, fewer than 2^31 elements), per element size: settings tried in order; the first whose K
# parts a channel leave at most BATCH_NORM_SMEM_IDLE of the SMs idle (groups x K of them busy) and
# fill BATCH_NORM_SMEM_FILL of their buffers (a program's time a step is its buffers', not its
# values') is taken, else the first that keeps the SMs busy, else the one that leaves the fewest
# idle; settings past the first serve GPUs with less shared memory (not measured). No weight is
# held, so parts may be wider than the row norms'. 8192 x 6, 2 deep: 0.80-0.86 on the large image
# shapes vs split channels 0.60-0.64 (fp32 4096 x 6: 0.87-0.90); narrower parts read lower (8192 x
# 3: 0.77-0.82) (docs/tuning-log.md T74).
BATCH_NORM_SMEM = {
    2: (InParts(8192, 6, 8, 2), InParts(8192, 4, 8, 2), InParts(8192, 2, 8, 3)),
    4: (InParts(4096, 6, 8, 2), InParts(4096, 4, 8, 2), InParts(4096, 2, 8, 3)),
}
BATCH_NORM_SMEM_IDLE = 0.1
BATCH_NORM_SMEM_FILL = 0.9
BATCH_NORM_SMEM_RING = 32
# The backward in parts (batch_norm._bwd_smem_split_kernel: x and dy streamed together, two tensors'
# buffers a part, taken where x and dy are 16-byte aligned): settings as BATCH_NORM_SMEM's, chosen
# alike. 8192 x 3, 2 deep: 0.86-0.88 on the large image shapes vs split channels 0.60-0.67 (fp32 2048 x
# 7: 0.88-0.92); on 32x256x56x56 its parts fill 82% of their buffers and 4096 x 5 (98%) reads
# 0.754-0.757 vs 0.732: the fill rule (docs/tuning-log.md T75). Settings past the second serve GPUs
# with less shared memory (not measured).
BATCH_NORM_SMEM_BWD = {
    2: (InParts(8192, 3, 8, 2), InParts(4096, 5, 8, 2), InParts(8192, 2, 8, 2), InParts(4096, 2, 8, 3)),
    4: (InParts(2048, 7, 8, 2), InParts(4096, 3, 8, 2), InParts(4096, 2, 8, 2), InParts(2048, 2, 8, 3)),
}


@_memoized
def batch_norm_smem(N: int, C: int, HW: int, dtype: torch.dtype, device: torch.device, backward: bool = False,
                    ) -> LaunchConfig | None:  # fmt: skip
    """BatchNorm training forward (:data:`BATCH_NORM_SMEM`) or ``backward`` (:data:`BATCH_NORM_SMEM_BWD`)
    with channels in parts, or None: HW not a multiple of 16, no elements or 2^31 or more, or
    :func:`_in_parts`' conditions (a CUDA device with ``cp.async``, Gluon, 16-bit or fp32). The
    caller checks the alignment of x (and dy) (smem.fits). Of the settings that fit, the first that
    keeps all but BATCH_NORM_SMEM_IDLE of the SMs busy and whose parts fill BATCH_NORM_SMEM_FILL of
    their buffers; else the first that keeps them busy; else the busiest."""
    table = BATCH_NORM_SMEM_BWD if backward else BATCH_NORM_SMEM
    if HW % 16 or not 0 < N * C * HW < 2**31 or dtype.itemsize not in table:
        return None
    busy, best, sms = None, None, sm_count(device)
    for setting in table[dtype.itemsize]:
        cfg = _in_parts(C, N * HW, dtype, device, setting, 1 + backward, 0, BATCH_NORM_SMEM_RING)
        if cfg is None:
            continue
        if cfg.grid[0] >= (1 - BATCH_NORM_SMEM_IDLE) * min(sms, C * cfg.parts):
            if cfg.part >= BATCH_NORM_SMEM_FILL * cfg.buffers * cfg.block_size:
                return cfg
            busy = busy or cfg
        if best is None or cfg.grid[0] > best.grid[0]:
            best = cfg
    return busy or best


@_memoized
def batch_norm_rows(rows: int, HW: int, dtype: torch.dtype) -> ImageConfig:
    """BatchNorm apply / dx: elementwise over ``rows`` = N * C rows of HW, [rows, HW] tiles; a flat
    grid of row tiles x column tiles (no 65535 limit on either)."""
    cfg = _image_tile(rows, HW, dtype)
    tiles = triton.cdiv(rows, cfg.row_block) * triton.cdiv(HW, cfg.hw_block)
    return ImageConfig(cfg.hw_block, cfg.row_block, cfg.num_warps, (max(1, tiles),))


@_memoized
def reduce(G: int, N: int, device: torch.device) -> LaunchConfig:
    """Fixed-order column sum of (G, N) partials: [REDUCE_ROWS, block] tiles, columns spread so
    that about one program runs per SM even for short rows."""
    per_sm = triton.next_power_of_2(triton.cdiv(N, sm_count(device)))
    block = max(REDUCE_MIN_BLOCK, min(REDUCE_MAX_BLOCK, per_sm))
    return LaunchConfig(block, 4, REDUCE_ROWS, (triton.cdiv(N, block),), False)


@_memoized
def batch_norm_channels(N: int, C: int, HW: int, dtype: torch.dtype, device: torch.device, backward: bool,
                        aligned: bool) -> LaunchConfig | None:  # fmt: skip
    """How BatchNorm's training forward (or ``backward``) reads each channel once, or None where the
    two-pass kernels serve (sums, then apply / dx): channels in parts held in shared memory
    (:func:`batch_norm_smem`; the caller found x, and dy, 16-byte aligned: ``aligned``), else split
    channels (:func:`batch_norm_split`). Forced (``Force.batch_norm_split``): False the two-pass
    kernels, True split channels only."""
    forced_split = force().batch_norm_split
    if forced_split is False:
        return None
    parted = batch_norm_smem(N, C, HW, dtype, device, backward) if aligned and forced_split is None else None
    return parted or batch_norm_split(N, C, HW, dtype, device, backward)
