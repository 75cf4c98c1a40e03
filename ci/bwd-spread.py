"""Why a sweep backward cell moves between runs (issue 43's three-run spread), on a CUDA GPU:
python3 ci/bwd-spread.py. For a few cells that moved, five repeats each of: do_bench of
``torch.autograd.grad`` as `normkit bench` times it (L2 flushed before each call) and the host time
of one such call (perf_counter, median and 90th percentile, the GPU synchronized before each)."""

import time

import torch
from triton.testing import do_bench

import normkit
from normkit import plans
from normkit.backends.cuda import native

CELLS = [("add_rms_norm", torch.bfloat16, 131072, 1024), ("add_rms_norm", torch.bfloat16, 65536, 2048),
         ("add_rms_norm", torch.bfloat16, 16384, 8192), ("add_rms_norm", torch.bfloat16, 2048, 65536),
         ("add_rms_norm", torch.float32, 8192, 16384), ("add_rms_norm", torch.bfloat16, 4096, 32768),
         ("add_layer_norm", torch.bfloat16, 65536, 2048), ("rms_norm", torch.float16, 16384, 8192),
         ("layer_norm", torch.bfloat16, 32768, 4096)]  # fmt: skip


def call(op, x, r, w, b):
    if op == "add_rms_norm":
        return normkit.add_rms_norm(x, r, (x.shape[1],), w, prenorm=True)[0]
    if op == "add_layer_norm":
        return normkit.add_layer_norm(x, r, (x.shape[1],), w, b, prenorm=True)[0]
    if op == "rms_norm":
        return normkit.rms_norm(x, (x.shape[1],), w)
    return normkit.layer_norm(x, (x.shape[1],), w, b)


def host(fn, n=100):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    times.sort()
    return times[n // 2] * 1e6, times[9 * n // 10] * 1e6


for op, dtype, m, n in CELLS:
    x = torch.randn(m, n, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    leaves = {"add_layer_norm": (x, r, w, b), "add_rms_norm": (x, r, w), "layer_norm": (x, w, b)}
    leaves = leaves.get(op, (x, w))
    for _ in range(5):
        y = call(op, x, r, w, b)
    dy = torch.randn_like(y)
    grad = lambda y=y, leaves=leaves, dy=dy: torch.autograd.grad(y, leaves, dy, retain_graph=True)  # noqa: E731
    flushed = [do_bench(grad, warmup=25, rep=100, return_mode="median") * 1e3 for _ in range(5)]
    h = [host(grad) for _ in range(3)]
    print(f"{op} {dtype} {m}x{n} bwd us: do_bench {' '.join(f'{v:.0f}' for v in flushed)} | "
          "host median/p90 "
          f"{' '.join(f'{a:.0f}/{c:.0f}' for a, c in h)}", flush=True)
    key = next((k for k in reversed(plans._PLANS) if k[0] == op and k[-1]), None)
    print(f"  {native.state(plans._PLANS[key]) if key else 'no remembered training plan'}")
