"""Run-to-run variance of single bench cells (docs/tuning-log.md T2: it was host time): the same
normkit cells measured three times in one process, before and after torch.compile runs the same
shapes, with the caching allocator's cudaMalloc count around each timing. Run on a GPU:
python3 ci/measure-variance.py.
"""

import torch

from normkit import bench

CELLS = [("rms_norm", 1024, "float16"), ("rms_norm", 2048, "float16"), ("rms_norm", 2048, "bfloat16"),
         ("layer_norm", 8192, "float16"), ("layer_norm", 4096, "bfloat16"), ("softmax", 2048, "bfloat16")]


def mallocs():
    return torch.cuda.memory_stats().get("num_device_alloc", 0)


def frac(op, n, dtype, impl, copy):
    m = bench.TOTAL // n
    before = mallocs()
    fwd, bwd = bench.measure(impl, op, m, n, getattr(torch, dtype))
    size = m * n * torch.finfo(getattr(torch, dtype)).bits // 8
    f, b = bench.UNITS[op]
    return f * size / fwd / 1e6 / copy, b * size / bwd / 1e6 / copy, mallocs() - before


def main():
    copy = bench.copy_gbps("cuda")
    print(f"copy {copy:.0f} GB/s; fwd / bwd fraction of copy (cudaMallocs during the measurement)")
    for phase in ("normkit only, run 1", "normkit only, run 2", "after torch.compile", "normkit only, run 3"):
        print(phase)
        for op, n, dtype in CELLS:
            if phase == "after torch.compile":
                frac(op, n, dtype, "torch.compile", copy)
            f, b, k = frac(op, n, dtype, "normkit", copy)
            print(f"  {op:<11} {n:>6} {dtype:<9} {f:.2f} / {b:.2f}  ({k} cudaMallocs)", flush=True)
    print(f"copy again {bench.copy_gbps('cuda'):.0f} GB/s")


if __name__ == "__main__":
    main()
