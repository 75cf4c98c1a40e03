"""Is a bench cell timing the GPU or the host? (docs/tuning-log.md T2)

For each cell (op, N, dtype; M = 2^27 / N as in the sweep) and implementation, the backward
(``torch.autograd.grad`` with retain_graph, as ``normkit bench`` times it) and the forward are timed
three ways in one process:

- ``bench``: ``triton.testing.do_bench`` median, exactly as the sweep does (L2 flush between runs);
- ``gpu``: the same loop, but a ``torch.cuda._sleep`` is queued after the flush, before the start
  event, so the host has enqueued the whole call before the GPU reaches the start event: the event
  window holds GPU time only;
- ``host``: microseconds of host time per call, calls issued back to back behind a long GPU sleep
  (so none waits on the GPU), median over bursts.

When ``host`` > ``gpu`` + the flush's GPU time, the bench window contains host gaps and ``bench`` is
slower than ``gpu``. Run on a GPU: python3 ci/measure-host-bound.py [cells] [image] [breakdown]
(``image``: the image suite's GroupNorm / BatchNorm cells, bf16, instead of ``CELLS``).
``breakdown``: host us of each layer of normkit's LayerNorm call path (bf16, 32768 x 4096), from
the public call down to one kernel launch (a cProfile of the same path: ci/measure-host-time.py
profile).
"""

import statistics
import sys
import time

import torch
from triton.testing import do_bench

from normkit import bench

CELLS = [("layer_norm", 1024, "bfloat16"), ("layer_norm", 4096, "bfloat16"), ("layer_norm", 8192, "bfloat16"),
         ("layer_norm", 8192, "float16"), ("rms_norm", 1024, "float16"), ("rms_norm", 2048, "bfloat16"),
         ("rms_norm", 8192, "bfloat16"), ("add_layer_norm", 4096, "bfloat16"),
         ("add_rms_norm", 8192, "bfloat16"),
         ("layer_norm", 65536, "bfloat16"), ("layer_norm", 512, "bfloat16"), ("softmax", 4096, "bfloat16")]
IMPLS = ("normkit", "torch")
SLEEP_CYCLES = 4_000_000  # ~2 ms at H100 clocks: far more than any call's host time


def gpu_ms(fn, reps=60):
    """Median event time of ``fn`` with the host given a head start (see module doc)."""
    flush = torch.empty(bench.FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, reps=15, calls=20):
    """Host microseconds per call, ``calls`` issued back to back (hot, as in do_bench's loop) behind a
    long GPU sleep so that none waits on the GPU; the median over ``reps`` such bursts."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES * 10)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


def calls(case, impl):
    op = case.op
    inp = bench.make_inputs(case, "cuda")
    call = bench.forward_fn(impl, op)
    fwd = lambda: call(inp)  # noqa: E731
    outs = fwd()
    args = (outs[0], bench.leaves(inp), inp["dy"])
    bwd = lambda: torch.autograd.grad(*args, retain_graph=True)  # noqa: E731
    return fwd, bwd


def breakdown():
    import torch.nn.functional as F

    import normkit
    from normkit import ops
    from normkit.backends.cuda import config
    from normkit.backends.cuda import layer_norm as ln
    from normkit.backends.cuda.launch import launch
    from normkit.backends.cuda.reduce import sum_partials

    M, N, dt = 32768, 4096, torch.bfloat16
    x = torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(N, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    y = normkit.layer_norm(x, (N,), w, b, 1e-5)
    yt = F.layer_norm(x, (N,), w, b, 1e-5)
    _, mean, rstd = ln.layer_norm_fwd(xd, wd, bd, 1e-5)
    cfg = config.forward(M, N, dt, x.device)
    out = torch.empty_like(xd)
    launch_args = (xd, xd, out, out, wd, bd, mean, rstd, N, N, N, N, M, N, 1e-5, 0.0, 0, 0.0, 1.0)
    launch_kw = dict(ROWS=cfg.rows_per_program, BLOCK_N=cfg.block_size, IS_RMS=False, HAS_W=True, HAS_B=True,
                     ADD=False, HAS_R=False, DROPOUT=False, ACC=config.tl_acc_dtype(dt),
                     num_warps=cfg.num_warps)
    parts = torch.randn(2, 264, N, device="cuda")

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    ident = Identity.apply(x)
    rows = [
        ("normkit.layer_norm, grad enabled", lambda: normkit.layer_norm(x, (N,), w, b, 1e-5)),
        ("normkit.layer_norm, no_grad", no_grad(lambda: normkit.layer_norm(x, (N,), w, b, 1e-5))),
        ("torch F.layer_norm, grad enabled", lambda: F.layer_norm(x, (N,), w, b, 1e-5)),
        ("custom op layer_norm_fwd (no autograd)", lambda: ops.layer_norm_fwd(xd, wd, bd, 1e-5)),
        ("cuda _forward launcher", lambda: ln._forward(xd, wd, bd, 1e-5, False)),
        ("one forward kernel launch, fn[grid]",
         lambda: ln._fwd_fused_kernel[cfg.grid](*launch_args, **launch_kw)),
        ("one forward kernel launch, launch()", lambda: launch(ln._fwd_fused_kernel, cfg.grid, *launch_args,
                                                               **launch_kw)),
        ("torch.empty (M, N)", lambda: torch.empty((M, N), dtype=dt, device=x.device)),
        ("config.forward (memoized)", lambda: config.forward(M, N, dt, x.device)),
        ("torch.cuda.device(...) enter+exit", lambda: enter_exit(torch.cuda.device(x.device))),
        ("autograd.grad normkit", lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)),
        ("autograd.grad torch", lambda: torch.autograd.grad(yt, (x, w, b), dy, retain_graph=True)),
        ("autograd.grad identity Function", lambda: torch.autograd.grad(ident, (x,), dy, retain_graph=True)),
        ("custom op layer_norm_bwd", lambda: ops.layer_norm_bwd(dy, xd, wd, mean, rstd, dt)),
        ("cuda _backward launcher", lambda: ln._backward(dy, xd, wd, mean, rstd, dt, False)),
        ("sum_partials, dw + db (one launch)", lambda: sum_partials(parts, (dt, dt))),
    ]
    print("host us per call (back to back, GPU kept busy)")
    for name, fn in rows:
        print(f"  {name:<40} {host_us(fn):>7.1f}", flush=True)


def no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()
    return run


def enter_exit(ctx):
    with ctx:
        pass


def main():
    args = sys.argv[1:] or ["cells"]
    if "image" in args:
        args.append("cells")
    if "breakdown" in args:
        breakdown()
    if "cells" not in args:
        return
    copy = bench.copy_gbps("cuda")
    flush = torch.empty(bench.FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    flush_us = do_bench(lambda: flush.zero_(), return_mode="median") * 1e3
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy:.0f} GB/s; "
          f"L2 flush {flush_us:.0f} us of GPU time")
    print("fraction of copy as the bench times it / GPU time only; host us per call")
    print(f"{'cell':<28} {'impl':<8} {'fwd bench':>9} {'fwd gpu':>8} {'fwd host':>9} "
          f"{'bwd bench':>9} {'bwd gpu':>8} {'bwd host':>9} {'bwd gpu us':>10}")
    cases = [bench.Case("sweep", op, dtype, (bench.TOTAL // n, n)) for op, n, dtype in CELLS]
    if "image" in args:  # the image suite's cells (bf16) instead
        cases = [bench.Case("image", op, "bfloat16", s) for op in bench.IMAGE_OPS for s in bench.IMAGE_SHAPES]
    for case in cases:
        for impl in IMPLS:
            fwd, bwd = calls(case, impl)
            fb, bb = case.bytes()
            res = []
            for fn, nbytes in ((fwd, fb), (bwd, bb)):
                t_bench = do_bench(fn, warmup=25, rep=100, return_mode="median")
                t_gpu = gpu_ms(fn)
                res += [nbytes / t_bench / 1e6 / copy, nbytes / t_gpu / 1e6 / copy, host_us(fn), t_gpu * 1e3]
            name = f"{case.op} {case.label} {case.dtype}"
            print(f"{name:<28} {impl:<8} {res[0]:>9.2f} {res[1]:>8.2f} "
                  f"{res[2]:>9.0f} {res[4]:>9.2f} {res[5]:>8.2f} {res[6]:>9.0f} {res[7]:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
