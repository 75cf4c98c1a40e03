"""Sweep the fused row-norm backward's launch table: programs per SM, elements per thread (warps),
tile size, and prefetch (the next row tile loaded during this one).

Chose backends/cuda/config.py's FUSED_BWD table (docs/tuning-log.md T42). Each setting times
the CUDA backend's raw backward (dx + dweight/dbias partials + their sum) with the host given a
head start (``measure-host-bound.gpu_ms``: GPU time only), M * N = 2^27, as a fraction of a device
copy measured in the same run. Rows longer than the current fused limit are swept fused too, next to
the launch the backend picks today (split or looped), to re-check the limit.

Run on a GPU: python3 ci/measure-bwd-grid.py [dtypes] [Ns] [dropout_p] [programs per SM]
  e.g. python3 ci/measure-bwd-grid.py bfloat16,float32 256,4096,16384
With dropout_p, the add-norms' backward with a residual and that dropout (dx and dresidual written,
the mask regenerated; docs/tuning-log.md T90).
Prints the five best and two worst settings per (op, dtype, N) as frac(pps, ept, tile, prefetch).
"""

import importlib.util
import itertools
import pathlib
import sys

import torch

from normkit import bench
from normkit.backends.cuda import config
from normkit.backends.cuda import layer_norm as ln

_HOST_BOUND = pathlib.Path(__file__).with_name("measure-host-bound.py")
_spec = importlib.util.spec_from_file_location("mhb", _HOST_BOUND)
mhb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mhb)

DTYPES = sys.argv[1].split(",") if len(sys.argv) > 1 else ["bfloat16"]
NS = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [
    64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
DROPOUT = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
PPS = [int(p) for p in sys.argv[4].split(",")] if len(sys.argv) > 4 else (1, 2, 4)
TILES = ((16, 2048), (32, 2048), (16, 4096), (32, 4096), (16, 8192), (32, 8192))  # (elements a thread, tile)
SETTINGS = list(itertools.product(PPS, TILES, (True, False)))


def fraction(is_rms, x, dy, w, mean, rstd, copy, reps=10):
    bias_dtype = None if is_rms else x.dtype
    if DROPOUT:  # reads h, dy; writes dx, dresidual
        t = mhb.gpu_ms(lambda: ln._backward(dy, x, w, mean, rstd, bias_dtype, is_rms, None, x.dtype, x.dtype,
                                            DROPOUT, 1234), reps)  # fmt: skip
        return 4 * x.numel() * x.element_size() / t / 1e6 / copy
    t = mhb.gpu_ms(lambda: ln._backward(dy, x, w, mean, rstd, bias_dtype, is_rms), reps)
    return 3 * x.numel() * x.element_size() / t / 1e6 / copy


def main():
    copy = bench.copy_gbps("cuda")
    print(f"{torch.cuda.get_device_name()}, triton fused backward sweep; copy {copy:.0f} GB/s", flush=True)
    table, limit = dict(config.FUSED_BWD), dict(config.FUSED_MAX_N_BWD)
    for dtype, is_rms, n in itertools.product(DTYPES, (False, True), NS):
        dt = getattr(torch, dtype)
        m = (1 << 27) // n
        x = torch.randn(m, n, device="cuda", dtype=dt)
        dy, w = torch.randn_like(x), torch.randn(n, device="cuda", dtype=dt)
        xf = x.float()
        mean = xf.mean(1)
        var = xf.pow(2).mean(1) if is_rms else xf.var(1, unbiased=False)
        rstd = (var + 1e-5).rsqrt()
        with config.tables():  # the tables as they are
            cfg = config.backward(m, n, dt, x.device, is_rms, dres=DROPOUT > 0, dropout=DROPOUT > 0)
            now = fraction(is_rms, x, dy, w, mean, rstd, copy, 20)
        kind = "fused" if cfg.fused else ("split" if cfg.split > 1 else "looped")
        res = []
        for pps, (ept, tile), pre in SETTINGS:
            entry = config._FusedBwd(1 << 30, pps, ept, tile, pre)
            with config.tables(FUSED_MAX_N_BWD={key: 1 << 30 for key in limit},
                               FUSED_BWD={key: (entry,) for key in table}, FUSED_BWD_DROPOUT={}):
                res.append((fraction(is_rms, x, dy, w, mean, rstd, copy), pps, ept, tile, pre))
        res.sort(reverse=True)
        fmt = lambda r: f"{r[0]:.3f}({r[1]},{r[2]},{r[3]},{'P' if r[4] else '-'})"  # noqa: E731
        op = ("add_" if DROPOUT else "") + ("rms_norm" if is_rms else "layer_norm")
        print(f"{op} {dtype} {n}: now {kind} {now:.3f} | best",
              " ".join(fmt(r) for r in res[:5]), "| worst", " ".join(fmt(r) for r in res[-2:]), flush=True)
        del x, dy, xf


if __name__ == "__main__":
    main()
