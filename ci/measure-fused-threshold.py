"""Measure where the CUDA backend should switch from register-resident rows to the looped kernels.

Times normkit's forward and backward with each path forced, at the row lengths around the
thresholds in backends/cuda/config.py (FUSED_MAX_N_FWD / FUSED_MAX_N_BWD), as fractions of a
device copy measured in the same run. Run on a GPU: python3 ci/measure-fused-threshold.py
"""

import torch

from normkit import bench
from normkit.backends.cuda import config

copy = bench.copy_gbps("cuda")
print(f"device copy {copy:.0f} GB/s")
print(f"{'op':11s} {'dtype':9s} {'N':>6s} {'path':7s} {'fwd/copy':>8s} {'bwd/copy':>8s}")
for dtype in (torch.bfloat16, torch.float32):
    elt = torch.finfo(dtype).bits // 8
    for op in ("layer_norm", "rms_norm"):
        for n in (8192, 16384, 32768, 65536):
            m = (1 << 27) // n
            for path, limit in (("fused", 1 << 30), ("looped", 0)):
                tables = config.tables(FUSED_MAX_N_FWD=limit,
                                       FUSED_MAX_N_BWD={key: limit for key in config.FUSED_MAX_N_BWD})
                try:
                    with tables:  # (remembered plans forgotten: each path gets its own)
                        fwd, bwd = bench.measure("normkit", op, m, n, dtype, "cuda")
                    f, b = 2 * m * n * elt / fwd / 1e6 / copy, 3 * m * n * elt / bwd / 1e6 / copy
                    print(f"{op:11s} {str(dtype)[6:]:9s} {n:6d} {path:7s} {f:8.2f} {b:8.2f}", flush=True)
                except Exception as exc:  # a variant that fails to compile/run is a result too
                    print(f"{op:11s} {str(dtype)[6:]:9s} {n:6d} {path:7s} failed: {str(exc)[:80]}")
