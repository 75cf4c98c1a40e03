"""Split-row kernels (backends/cuda/coop.py) against the fused and looped ones, and their chunk size.

Chose config.SPLIT_FWD / SPLIT_BWD / SPLIT_SOFTMAX_BWD. Run on a
GPU: python3 ci/measure-split.py [quick]. Prints, per op / N / setting, the forward and backward
as fractions of a device copy measured in the same run (bf16, M * N = 2^27), each output checked
against the reference first.

python3 ci/measure-split.py {fwd,bwd,softmax-bwd} [dtypes]: the split settings (chunk, warps,
register cap, most chunks a row, prefetch) of the row-norm / softmax forward, the row-norm backward
or the softmax backward; GPU time only of the CUDA backend's raw calls (``measure-host-bound.gpu_ms``)
at N = 16384 ... 262144, next to the kernels without split rows (docs/tuning-log.md T31, T46, T63).
"""

import functools
import importlib.util
import itertools
import pathlib
import sys

import torch
from triton.testing import do_bench

import normkit
from normkit.backends.cuda import config
from normkit.testing import assert_close, reference_results, softmax_reference


def setting(name):
    """One named launch setting as ``config.tables(...)``: ``default``, ``nosplit`` (fused / looped
    kernels only), or ``fwd<chunk>x<warps>r<cap>`` (the split forward with that chunk, warps and
    register cap; up to 256 chunks a row)."""
    if name == "nosplit":
        off = config.SplitRows(1 << 20, 4, 256, 0)  # no row has at most 0 chunks
        return config.tables(SPLIT_SOFTMAX_BWD={key: off for key in config.SPLIT_SOFTMAX_BWD},
                             SPLIT_FWD={key: off for key in config.SPLIT_FWD}, SPLIT_BWD=(off,))  # fmt: skip
    if name.startswith("fwd"):
        chunk, rest = name[3:].split("x")
        warps, cap = rest.split("r")
        split = config.SplitRows(int(chunk), int(warps), int(cap), 256)
        return config.tables(SPLIT_FWD={key: split for key in config.SPLIT_FWD})
    return config.tables()


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


product = itertools.product
SWEEPS = {  # kind -> (config attribute, settings (chunk, warps, register cap, most chunks, prefetch))
    "bwd": ("SPLIT_BWD", [config.SplitRows(c, w, r, k, p) for (c, w, r, k), p in itertools.product(
        ((4096, 8, 128, 32), (4096, 4, 256, 128), (2048, 4, 128, 32), (8192, 8, 256, 32)), (True, False))]),
    "fwd": ("SPLIT_FWD", [config.SplitRows(c, w, r, 64, p) for (c, w, r), p in itertools.product(
        ((4096, 4, 64), (4096, 4, 96), (8192, 8, 64), (8192, 8, 96)), (True, False))]),
    "softmax-bwd": ("SPLIT_SOFTMAX_BWD", [config.SplitRows(c, w, r, 32, p) for (c, w, r), p in product(
        ((8192, 4, 256), (8192, 8, 128), (4096, 8, 128)), (True, False))]),
}  # fmt: skip


def _calls(kind, dtype, n):
    """(op name, call, units of M * N elements moved) for the raw CUDA-backend calls of ``kind``."""
    from normkit.backends.cuda import layer_norm as ln
    from normkit.backends.cuda import softmax as sm

    x = torch.randn((1 << 27) // n, n, device="cuda", dtype=dtype)
    w, b = torch.randn(n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    if kind == "softmax-bwd":
        y = torch.softmax(x.float(), -1).to(dtype)
        return [("softmax", functools.partial(sm.softmax_bwd, dy, y, False), 3),
                ("log_softmax", functools.partial(sm.softmax_bwd, dy, y.float().log().to(dtype), True), 3)]
    if kind == "fwd":
        return [("layer_norm", functools.partial(ln._forward, x, w, b, 1e-5, False), 2),
                ("rms_norm", functools.partial(ln._forward, x, w, None, 1e-5, True), 2),
                ("softmax", functools.partial(sm.softmax_fwd, x, False), 2)]
    xf = x.float()
    out = []
    for is_rms in (False, True):
        rstd = ((xf.pow(2).mean(1) if is_rms else xf.var(1, unbiased=False)) + 1e-5).rsqrt()
        call = functools.partial(ln._backward, dy, x, w, xf.mean(1), rstd, None if is_rms else dtype, is_rms)
        out.append(("rms_norm" if is_rms else "layer_norm", call, 3))
    return out


def _name(split):
    if split is None:
        return "nosplit"
    s = split
    return f"{s.chunk}x{s.num_warps}r{s.max_registers}k{s.max_chunks}{'P' if s.prefetch else '-'}"


def sweep(kind, dtypes):
    """GPU time only of each split setting of ``kind`` next to the looped kernel (module doc)."""
    path = pathlib.Path(__file__).with_name("measure-host-bound.py")
    spec = importlib.util.spec_from_file_location("mhb", path)
    mhb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mhb)
    attr, settings = SWEEPS[kind]
    default = getattr(config, attr)
    keys = list(default) if isinstance(default, dict) else None
    copy = copy_gbps()
    print(f"{torch.cuda.get_device_name()}, split {kind} sweep; copy {copy:.0f} GB/s", flush=True)
    for dtype, n in itertools.product(dtypes, (16384, 32768, 65536, 131072, 262144)):
        dt = getattr(torch, dtype)
        for op, fn, units in _calls(kind, dt, n):
            ref = fn()
            ref = ref[0] if isinstance(ref, tuple) else ref
            res = []
            for split in [None, *settings]:
                value = split or config.SplitRows(1 << 20, 4, 256, 0)  # None: no row splits (fused or looped)
                if keys:
                    value = {key: value for key in keys}
                elif attr == "SPLIT_BWD":  # settings tried in order
                    value = (value,)
                with config.tables(**{attr: value}):
                    out = fn()
                    out = out[0] if isinstance(out, tuple) else out
                    err = (out.float() - ref.float()).abs() - 0.02 * ref.float().abs()
                    assert err.max() <= 0.05, (op, split)
                    frac = units * ref.numel() * ref.element_size() / mhb.gpu_ms(fn, 10) / 1e6 / copy
                res.append((frac, _name(split)))
            base = res[0][0]
            res.sort(reverse=True)
            best = " ".join(f"{f:.3f}({name})" for f, name in res[:6])
            print(f"{op} {dtype} {n}: nosplit {base:.3f} | {best}", flush=True)


def main():
    if sys.argv[1:2] and sys.argv[1] in SWEEPS:
        return sweep(sys.argv[1], sys.argv[2].split(",") if len(sys.argv) > 2 else ["bfloat16"])
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
                with setting(name):
                    f, b = case(op, (1 << 27) // n, n, torch.bfloat16)
                cells.append(f"{name} {f / copy:.2f}/{b / copy:.2f}")
            print(f"{op:11s} {n:7d} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
