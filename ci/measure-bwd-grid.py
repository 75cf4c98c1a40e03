"""Sweep the fused backward's persistent grid (programs per SM), warps and tile size.

Chose backends/cuda/config.py's FUSED_BWD table. Run on a GPU: python3 ci/measure-bwd-grid.py
(prints the four best and two worst settings per op and N, as fractions of a device copy).
"""

import itertools

import torch

from normkit import bench
from normkit.backends.cuda import config

copy = bench.copy_gbps("cuda")
print(f"device copy {copy:.0f} GB/s")
elt = 2
for op, n in itertools.product(("layer_norm", "rms_norm"), (256, 1024, 4096, 8192)):
    m = (1 << 27) // n
    best = []
    for pps, ept, tile in itertools.product((1, 2, 4), (16, 32), (2048, 8192)):
        entry = config._FusedBwd(1 << 30, pps, ept, tile)
        config.FUSED_BWD = {False: (entry,), True: (entry,)}
        config.clear_caches()
        _, bwd = bench.measure("normkit", op, m, n, torch.bfloat16, "cuda")
        best.append((3 * m * n * elt / bwd / 1e6 / copy, pps, ept, tile))
    best.sort(reverse=True)
    print(op, n, " ".join(f"{f:.2f}(pps={p},ept={e},tile={t})" for f, p, e, t in best[:4]),
          "| worst", " ".join(f"{f:.2f}(pps={p},ept={e},tile={t})" for f, p, e, t in best[-2:]), flush=True)
