"""The NPU kernels on a CUDA GPU: what their grid and their fixed column tile cost there.

Not an NPU measurement. On CUDA the NPU backend's vector-core query falls back to
``config.FALLBACK_VECTOR_CORES`` (40, an Ascend 910B4's vector cores), so the persistent grid has 40
programs for 132 SMs. This script re-runs the NPU kernels with larger grids (the same kernels and
1024-column tile, more programs) to separate the grid's cost from the tile's. Run on a GPU:
python3 ci/measure-npu-on-cuda.py. Prints forward / backward as fractions of a device copy measured
in the same run (bf16, M * N = 2^27), each output checked against the fp64 reference first.
"""

import torch

from normkit import bench
from normkit.backends.npu import config

OPS = ("layer_norm", "rms_norm", "softmax", "add_rms_norm")
NS = (1024, 8192, 65536)
GRIDS = (40, 132, 264, 528, 1056)


def main():
    copy = bench.copy_gbps("cuda")
    print(f"copy {copy:.0f} GB/s on {torch.cuda.get_device_name()}; NPU kernels on CUDA, bf16")
    print("op              N       " + "  ".join(f"grid {g:>4} fwd/bwd" for g in GRIDS))
    for op in OPS:
        fwd_units, bwd_units = bench.UNITS[op]
        for n in NS:
            m = bench.TOTAL // n
            size = m * n * 2
            cells = []
            for grid in GRIDS:
                config.FALLBACK_VECTOR_CORES = grid
                config._vector_cores.cache_clear()
                fwd, bwd = bench.measure("npu-kernels-on-cuda", op, m, n, torch.bfloat16)
                f, b = fwd_units * size / fwd / 1e6 / copy, bwd_units * size / bwd / 1e6 / copy
                cells.append(f"{f:.3f} / {b:.3f}")
            print(f"{op:<15} {n:<7} " + "  ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
