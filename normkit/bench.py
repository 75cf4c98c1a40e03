"""Side-by-side timing of normkit, torch eager and torch.compile, as fractions of a device copy.

First version (issue 2): forward and backward of layer_norm / rms_norm across row lengths, one
dtype per run, printed as a table. Bytes counted are the fewest an op must move: forward reads x
and writes y (2 * M * N * elt); backward reads x and dy and writes dx (3 * M * N * elt).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import normkit
from normkit.testing import assert_close, reference_results

IMPLS = ("normkit", "torch", "torch.compile")
DEFAULT_NS = [1024, 4096, 16384, 65536, 262144]


def copy_gbps(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in GB/s."""
    from triton.testing import do_bench

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / ms / 1e6


def _fn(impl, op):
    if impl == "normkit":
        return normkit.layer_norm if op == "layer_norm" else normkit.rms_norm
    fn = F.layer_norm if op == "layer_norm" else F.rms_norm
    return torch.compile(fn) if impl == "torch.compile" else fn


def measure(impl, op, m, n, dtype, device):
    """(forward ms, backward ms) of one implementation, after checking its output."""
    from triton.testing import do_bench

    torch._dynamo.reset()  # fresh compile per shape, so torch.compile never falls back to eager
    g = torch.Generator(device=device).manual_seed(m + n)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, device=device, dtype=dtype, generator=g)).requires_grad_()
    b = (0.5 * torch.randn(n, device=device, dtype=dtype, generator=g)).requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    params = [w, b] if op == "layer_norm" else [w]
    fn = _fn(impl, op)
    call = lambda: fn(x, (n,), *params, 1e-5)  # noqa: E731
    y = call()
    ref = reference_results(op, x, w, b if op == "layer_norm" else None, dy, (n,), 1e-5)
    assert_close(y, ref["y"], dtype, "fwd", f"{impl} {op} y")
    fwd = do_bench(call, warmup=25, rep=100, return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(y, [x, *params], dy, retain_graph=True),
                   warmup=25, rep=100, return_mode="median")  # fmt: skip
    return fwd, bwd


def run(ops, ns, dtype, total_elements=1 << 27, device="cuda", impls=IMPLS):
    """Rows of (op, dtype, N, impl, fwd GB/s, fwd / copy, bwd GB/s, bwd / copy) plus the copy GB/s."""
    copy = copy_gbps(device)
    elt = torch.finfo(dtype).bits // 8
    rows = []
    for op in ops:
        for n in ns:
            m = max(1, total_elements // n)
            for impl in impls:
                fwd, bwd = measure(impl, op, m, n, dtype, device)
                f_gbps, b_gbps = 2 * m * n * elt / fwd / 1e6, 3 * m * n * elt / bwd / 1e6
                rows.append((op, str(dtype).replace("torch.", ""), n, impl,
                             f_gbps, f_gbps / copy, b_gbps, b_gbps / copy))  # fmt: skip
    return copy, rows


def format_table(copy, rows) -> str:
    lines = [f"device copy: {copy:.0f} GB/s (read + write)",
             f"{'op':11s} {'dtype':9s} {'N':>8s} {'impl':14s} {'fwd GB/s':>9s} {'fwd/copy':>8s} "
             f"{'bwd GB/s':>9s} {'bwd/copy':>8s}"]  # fmt: skip
    for op, dt, n, impl, fg, ff, bg, bf in rows:
        lines.append(f"{op:11s} {dt:9s} {n:8d} {impl:14s} {fg:9.0f} {ff:8.2f} {bg:9.0f} {bf:8.2f}")
    return "\n".join(lines)
