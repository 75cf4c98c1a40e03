"""Softmax along a non-last dim: normkit's transposing path against torch and torch.compile.

normkit moves ``dim`` last with one transposing copy, runs the row kernel, and returns a view
with ``dim`` back in place. This measures what that copy costs: bf16 (N, M) tensors of 2^27
elements, softmax along dim 0 (N), as fractions of a device copy in the same run; bytes counted as
for the last-dim softmax (forward 2, backward 3 tensor passes). Also prints torch.compile's
compile time for one shape. Run on a GPU: python3 ci/measure-softmax-dim.py
"""

import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import normkit
from normkit.testing import assert_close, softmax_reference


def main():
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    copy = 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src), return_mode="median") / 1e6
    print(f"device copy {copy:.0f} GB/s")
    for op in ("softmax", "log_softmax"):
        for n in (1024, 4096, 32768):
            m = (1 << 27) // n
            x = torch.randn(n, m, device="cuda", dtype=torch.bfloat16).requires_grad_()
            dy = torch.randn(n, m, device="cuda", dtype=torch.bfloat16)
            ref_y, ref_dx = softmax_reference(op, x, dy, 0)
            cells = []
            for impl in ("normkit", "torch", "torch.compile"):
                torch._dynamo.reset()
                fn = getattr(normkit, op) if impl == "normkit" else getattr(F, op)
                if impl == "torch.compile":
                    fn = torch.compile(fn)
                t0 = time.perf_counter()
                y = fn(x, 0)
                (dx,) = torch.autograd.grad(y, [x], dy, retain_graph=True)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                assert_close(y, ref_y, torch.bfloat16, "fwd", f"{impl} {op} y")
                assert_close(dx, ref_dx, torch.bfloat16, "bwd", f"{impl} {op} dx")
                fwd = do_bench(lambda fn=fn, x=x: fn(x, 0), return_mode="median")
                bwd = do_bench(lambda y=y, x=x, dy=dy: torch.autograd.grad(y, [x], dy, retain_graph=True),
                               return_mode="median")  # fmt: skip
                nbytes = m * n * 2
                cells.append(f"{impl} {2 * nbytes / fwd / 1e6 / copy:.2f}/{3 * nbytes / bwd / 1e6 / copy:.2f}"
                             f" (first call {first:.1f} s)")  # fmt: skip
            print(f"{op:11s} dim0 N={n:6d} M={m:7d} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
