"""Launch rules of the NPU backend (Ascend, triton-ascend): the one place they are decided.

Facts behind them (docs/backends.md has the sources):
- Norms are vector work, run by the AI cores' vector units; a launch of more programs than vector
  cores only queues, so kernels run a persistent grid of ``min(vector cores, work items)`` programs
  and loop over rows (or tiles) inside.
- The runtime rejects grids above 65535 programs: every grid goes through :func:`persistent_grid`,
  which checks it.
- The Unified Buffer (UB) is 192 KB. What Ascend's compiler plans for each kernel variant, double
  buffering included, is measured in CI (ci/npu_stage2.py: at most 176 KB) and noted on each kernel
  (docs/backends.md has the table).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Column tile: 1024 elements, the tile vllm-ascend's and triton-ascend's own norm kernels use, and a
# power of two as tl.arange requires; longer rows loop over tiles. Planned UB with it: 12-173 KB a
# kernel (docs/backends.md, stage 2 table).
BLOCK_SIZE = 1024

# Vector cores when the NPU kernels run on another executor (the CUDA GPU in tests), where there is
# no Ascend driver to ask: an Atlas 800 A2 with Ascend910B4 has 20 AI cores x 2 vector cores. On an
# NPU the count is asked of the driver (910B1 / B2 and A3 have 48) and a failed query raises, unless
# NORMKIT_NPU_VECTOR_CORES gives the count.
FALLBACK_VECTOR_CORES = 40
# Under the Triton interpreter (CPU tensors): a few programs, so persistent loops and the
# multi-partial reduction are exercised while the interpreted run stays short.
INTERPRETER_CORES = 4

MAX_GRID = 65535
# Rows that fit are held whole in UB: one HBM read of each row in the forward and one in the backward.
# A tile is ROWS rows of WIDTH columns, WIDTH = N rounded up to a power of two (at least MIN_WIDTH:
# 64-byte fp32 rows, the vector unit's block). Rows of at most BLOCK_SIZE / 2 share a tile of
# BLOCK_SIZE elements instead of padding one each; a longer row that fits is one tile of WIDTH, i.e.
# its WIDTH / BLOCK_SIZE column tiles at once. Longer rows loop over BLOCK_SIZE column tiles.
MIN_WIDTH = 16
# The widest row each kernel family holds, from the UB that bishengir-compile plans for its largest
# variant (ci/npu_stage2.py, 2026-11-26; budget 176 KB):
# - the row norms (layer_norm, rms_norm, the add-norms; forward and backward) without dropout: 2048.
#   Largest at 2048: 148.7 KB (bf16 add-norm forward with weight, bias, residual); at 4096 most
#   variants plan 176-185 KB.
ROW_NORM_WIDTH = 2048
# - with dropout (the hash drawn per element): 1024. At 2048 the fp32 add-norm forward plans 188.8 KB
#   and the backward with dropout 176.2-180.2 KB.
ROW_NORM_DROPOUT_WIDTH = 1024
# - softmax / log_softmax (forward and backward): 4096. Largest at 4096: 88.0 KB (bf16 backward).
SOFTMAX_WIDTH = 4096


@dataclass(frozen=True)
class LaunchConfig:
    block_size: int  # column tile
    rows_per_chunk: int  # rows per partial-sum chunk (backward); 1 elsewhere
    grid: tuple[int]


@dataclass(frozen=True)
class RowsConfig:
    rows: int  # rows a tile
    width: int  # columns a tile: N rounded up to a power of two; rows * width == max(width, BLOCK_SIZE)
    grid: tuple[int]


def _query_vector_cores(device_type: str, index: int) -> int:
    import triton  # the active Triton: triton-ascend on an Ascend host

    if device_type == "npu" and os.environ.get("NORMKIT_NPU_VECTOR_CORES"):
        return int(os.environ["NORMKIT_NPU_VECTOR_CORES"])
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["num_vectorcore"])
    except Exception as e:  # no such driver call or key on this Triton / device
        if device_type != "npu":
            return FALLBACK_VECTOR_CORES
        raise RuntimeError(
            f"normkit: the Triton driver (triton {triton.__version__}) did not report the vector cores of "
            f"npu:{index} ({type(e).__name__}: {e}); the NPU kernels size their grid by it (Ascend910B4: "
            "40, 910B1 / B2 and A3: 48). Use a triton-ascend whose driver reports num_vectorcore, or set "
            "NORMKIT_NPU_VECTOR_CORES to the count."
        ) from e


@functools.lru_cache(maxsize=64)
def _vector_cores(device_type: str, index: int | None) -> int:
    if device_type == "cpu":
        return INTERPRETER_CORES
    return _query_vector_cores(device_type, index)


def vector_cores(device: torch.device) -> int:
    """Vector cores of ``device``, queried once per device from the Triton driver."""
    index = device.index
    if device.type != "cpu" and index is None:
        index = torch.get_device_module(device.type).current_device()
    return _vector_cores(device.type, index)


def persistent_grid(work_items: int, device: torch.device) -> tuple[int]:
    """``min(vector cores, work items)`` programs (at least 1), never above 65535."""
    grid = max(1, min(vector_cores(device), work_items))
    if grid > MAX_GRID:
        raise RuntimeError(f"NPU launch of {grid} programs exceeds the runtime's limit of {MAX_GRID}")
    return (grid,)


def rows(M: int, device: torch.device) -> LaunchConfig:
    """Kernels that walk rows: program p takes rows p, p + G, p + 2G, ..."""
    return LaunchConfig(BLOCK_SIZE, 1, persistent_grid(M, device))


def resident_rows(M: int, N: int, max_width: int, device: torch.device) -> RowsConfig | None:
    """Whole rows held in UB: tiles of ROWS rows of WIDTH columns for N <= ``max_width`` (the kernel
    family's measured limit: ROW_NORM_WIDTH, ROW_NORM_DROPOUT_WIDTH, SOFTMAX_WIDTH); None for longer
    rows, which loop over BLOCK_SIZE column tiles (:func:`rows`). Program p takes tiles p, p + G, ..."""
    if N > max_width:
        return None
    width = max(MIN_WIDTH, 1 << max(0, N - 1).bit_length())
    rows_a_tile = max(1, BLOCK_SIZE // width)
    return RowsConfig(rows_a_tile, width, persistent_grid(-(-M // rows_a_tile), device))


def column_tiles(N: int, device: torch.device) -> LaunchConfig:
    """Kernels that walk column tiles (the partial-sum reduction)."""
    return LaunchConfig(BLOCK_SIZE, 1, persistent_grid(-(-N // BLOCK_SIZE), device))


def row_chunks(M: int, N: int, device: torch.device) -> tuple[LaunchConfig, int]:
    """Backward dx/dweight kernel: work items are (row chunk, column tile) pairs.

    Returns the config and the number of chunks, which is the number of dweight partial rows.
    """
    cores = vector_cores(device)
    per_chunk = -(-M // max(1, min(M, cores)))
    chunks = -(-M // per_chunk) if M else 0
    tiles = -(-N // BLOCK_SIZE)
    return LaunchConfig(BLOCK_SIZE, per_chunk, persistent_grid(chunks * tiles, device)), chunks
