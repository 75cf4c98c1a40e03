"""Split-row kernels (backends/cuda/coop.py) against the fused and looped ones, and their chunk size.

Chose config.SPLIT_FWD / SPLIT_BWD / SPLIT_SOFTMAX_BWD. Run on a
GPU: python3 ci/measure-split.py [quick]. Prints, per op / N / setting, the forward and backward
as fractions of a device copy measured in the same run (bf16, M * N = 2^27), each output checked
against the reference first.
"""

import sys

import torch
from triton.testing import do_bench

import normkit
from normkit.backends.cuda import config
from normkit.testing import assert_close, reference_results, softmax_reference

DEFAULTS = (config.SPLIT_FWD, config.SPLIT_BWD, config.SPLIT_SOFTMAX_BWD, config.MAX_REGISTERS)


def setting(name):
    """Apply one named launch setting to config: ``default``, ``nosplit`` (fused / looped kernels
    only), or ``fwd<chunk>x<warps>r<cap>`` (the split forward with that chunk, warps and register
    cap; up to 256 chunks a row)."""
    config.SPLIT_FWD, config.SPLIT_BWD, config.SPLIT_SOFTMAX_BWD, config.MAX_REGISTERS = DEFAULTS
    if name == "nosplit":
        off = (1 << 20, 4, 256, 0)  # no row has at most 0 chunks
        config.SPLIT_FWD = config.SPLIT_BWD = config.SPLIT_SOFTMAX_BWD = off
    elif name.startswith("fwd"):
        chunk, rest = name[3:].split("x")
        warps, cap = rest.split("r")
        config.SPLIT_FWD = (int(chunk), int(warps), int(cap), 256)
    config.clear_caches()


def copy_gbps():
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / do_bench(lambda: dst.copy_(src), warmup=50, rep=200,
                                          return_mode="median") / 1e6  # fmt: skip


def case(op, m, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, device="cuda", dtype=dtype, generator=g)).requires_grad_()
    b = (0.5 * torch.randn(n, device="cuda", dtype=dtype, generator=g)).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
    if "softmax" in op:
        leaves, call = [x], (lambda: getattr(normkit, op)(x, -1))
        ref_y, ref_dx = softmax_reference(op, x, dy, -1)[:2]
        refs = {"y": ref_y, "dx": ref_dx}
    else:
        params = [w, b] if op == "layer_norm" else [w]
        leaves, call = [x, *params], (lambda: getattr(normkit, op)(x, (n,), *params, 1e-5))
        refs = reference_results(op, x, w, b if op == "layer_norm" else None, dy, (n,), 1e-5)
    y = call()
    grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)
    assert_close(y, refs["y"], dtype, "fwd", f"{op} y")
    assert_close(grads[0], refs["dx"], dtype, "bwd", f"{op} dx")
    fwd = do_bench(call, warmup=25, rep=100, return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), warmup=25, rep=100,
                   return_mode="median")  # fmt: skip
    y = call()  # and once more after the timing loops
    assert_close(y, refs["y"], dtype, "fwd", f"{op} y (after timing)")
    assert_close(torch.autograd.grad(y, leaves, dy)[0], refs["dx"], dtype, "bwd", f"{op} dx (after timing)")
    elt = torch.finfo(dtype).bits // 8
    return 2 * m * n * elt / fwd / 1e6, 3 * m * n * elt / bwd / 1e6


def main():
    quick = "quick" in sys.argv[1:]
    copy = copy_gbps()
    print(f"device copy {copy:.0f} GB/s", flush=True)
    ns = (65536,) if quick else (65536, 131072, 262144)
    names = ("nosplit", "default") if quick else (
        "nosplit", "default", "fwd1024x4r64", "fwd2048x4r128", "fwd4096x4r64", "fwd4096x4r128",
        "fwd4096x8r64")
    for op in ("layer_norm", "rms_norm", "softmax"):
        for n in ns:
            cells = []
            for name in names:
                setting(name)
                f, b = case(op, (1 << 27) // n, n, torch.bfloat16)
                cells.append(f"{name} {f / copy:.2f}/{b / copy:.2f}")
            print(f"{op:11s} {n:7d} " + " | ".join(cells), flush=True)
    setting("default")


if __name__ == "__main__":
    main()
