"""Which call's graph does a backward timing measure? (docs/tuning-log.md T109)

A BatchNorm training backward (``torch.autograd.grad`` with retain_graph, as ``normkit bench``
times it) timed on three graphs of the same inputs in one process: ``first`` (the first call's, as
the bench before d420823 timed it), ``later`` (the fourth call's: a later call's, as the bench times
it since), ``bench`` (the fourth call after a ``do_bench`` of the forward: the bench's own order).
Each line: the median of ``do_bench``, GB/s (read x and dy, write dx), and the kernels of one
backward with their GPU µs (torch.profiler). The kernels and their arguments are the same at every
point; what changes is where dx, the workspace and the saved statistics sit. Run on a GPU, with the
normkit to measure on the path (an old install by PYTHONPATH, as ci/gpu-ab.sh does):
    python3 ci/measure-graph-point.py [SHAPE, default 128x64x112x112]
"""

import functools
import sys

import torch
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import normkit


def graph_points(shape, dtype):
    """Print one line per measuring point (module doc) for BatchNorm of ``shape`` and ``dtype``."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, dy = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    w, b = (torch.randn(shape[1], device="cuda", dtype=dtype, generator=gen) * 0.5 + s for s in (1.0, 0.0))
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    rm, rv = torch.zeros_like(w), torch.ones_like(w)
    call = functools.partial(normkit.batch_norm, x, rm, rv, w, b, True, 0.1, 1e-5)
    nbytes = 3 * x.numel() * x.element_size()
    for point in ("first", "later", "bench"):
        if point == "bench":
            do_bench(call, warmup=25, rep=100)
        for _ in range(1 if point == "first" else 4):
            y = call()
        backward = functools.partial(torch.autograd.grad, y, (x, w, b), dy, retain_graph=True)
        for _ in range(3):
            backward()
        ms = do_bench(backward, warmup=25, rep=200)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            backward()
            torch.cuda.synchronize()
        kernels = [(e.name[:40], round(e.device_time_total, 1)) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.device_time_total > 0]  # fmt: skip
        print(f"{str(dtype)[6:]} {point}: {ms * 1e3:.1f} us, {nbytes / ms / 1e6:.0f} GB/s, kernels {kernels}")


def main():
    shape = tuple(int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "128x64x112x112").split("x"))
    print("normkit", normkit.__file__, torch.cuda.get_device_name(), "triton", triton.__version__)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        graph_points(shape, dtype)


if __name__ == "__main__":
    main()
