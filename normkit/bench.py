"""Side-by-side timing of normkit, torch eager and torch.compile, as fractions of a device copy.

First version: forward and backward of each op across row lengths, one dtype per run, printed as
a table. Bytes counted are the fewest an op must move (in units of M * N * elt, ``UNITS``): norms
and softmax read x and write y (2), backward reads x (softmax: y) and dy and writes dx (3); the
fused add-norm reads x and residual and writes y and h (4), backward reads dy and h and writes dx
and dresidual (4). torch's side of the add-norm is ``h = x + residual; y = norm(h)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import normkit
from normkit.testing import assert_close, reference_results, softmax_reference

IMPLS = ("normkit", "torch", "torch.compile")
DEFAULT_NS = [1024, 4096, 16384, 65536, 262144]


def copy_gbps(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in GB/s."""
    from triton.testing import do_bench

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / ms / 1e6


UNITS = {  # (forward, backward) bytes moved, in M * N * elt
    "layer_norm": (2, 3), "rms_norm": (2, 3), "softmax": (2, 3), "log_softmax": (2, 3),
    "add_layer_norm": (4, 4), "add_rms_norm": (4, 4),
}  # fmt: skip
# normkit bench covers these row ops; group_norm / batch_norm benchmarks come with issue 4.


def _torch_op(op):
    if op in ("softmax", "log_softmax"):
        return getattr(F, op)
    norm = F.layer_norm if op.endswith("layer_norm") else F.rms_norm
    if not op.startswith("add_"):
        return norm

    def add_norm(x, r, shape, *params_eps):
        h = x + r
        return norm(h, shape, *params_eps), h

    return add_norm


def _call(impl, op, x, r, params, n):
    """A zero-argument callable running one forward of ``op`` with ``impl``."""
    if impl == "normkit":
        fn = getattr(normkit, op)
    else:
        fn = _torch_op(op)
        fn = torch.compile(fn) if impl == "torch.compile" else fn
    if op in ("softmax", "log_softmax"):
        return lambda: fn(x, -1)
    if op.startswith("add_"):
        if impl == "normkit":
            return lambda: fn(x, r, (n,), *params, 1e-5, prenorm=True)
        return lambda: fn(x, r, (n,), *params, 1e-5)
    return lambda: fn(x, (n,), *params, 1e-5)


def measure(impl, op, m, n, dtype, device):
    """(forward ms, backward ms) of one implementation, after checking its output."""
    from triton.testing import do_bench

    torch._dynamo.reset()  # fresh compile per shape, so torch.compile never falls back to eager
    g = torch.Generator(device=device).manual_seed(m + n)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g).requires_grad_()
    r = torch.randn(m, n, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, device=device, dtype=dtype, generator=g)).requires_grad_()
    b = (0.5 * torch.randn(n, device=device, dtype=dtype, generator=g)).requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    params = [] if "softmax" in op else [w, b] if op.endswith("layer_norm") else [w]
    call = _call(impl, op, x, r, params, n)
    out = call()
    y = out[0] if op.startswith("add_") else out
    leaves = [x, *params] + ([r] if op.startswith("add_") else [])
    if "softmax" in op:
        ref = softmax_reference(op, x, dy, -1)[0]
    else:
        bias = b if op.endswith("layer_norm") else None
        h = (x + r) if op.startswith("add_") else x
        ref = reference_results(op.removeprefix("add_"), h, w, bias, dy, (n,), 1e-5)["y"]
    assert_close(y, ref, dtype, "fwd", f"{impl} {op} y")
    fwd = do_bench(call, warmup=25, rep=100, return_mode="median")
    bwd = do_bench(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True),
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
                f_units, b_units = UNITS[op]
                f_gbps, b_gbps = f_units * m * n * elt / fwd / 1e6, b_units * m * n * elt / bwd / 1e6
                rows.append((op, str(dtype).replace("torch.", ""), n, impl,
                             f_gbps, f_gbps / copy, b_gbps, b_gbps / copy))  # fmt: skip
    return copy, rows


def format_table(copy, rows) -> str:
    lines = [f"device copy: {copy:.0f} GB/s (read + write)",
             f"{'op':14s} {'dtype':9s} {'N':>8s} {'impl':14s} {'fwd GB/s':>9s} {'fwd/copy':>8s} "
             f"{'bwd GB/s':>9s} {'bwd/copy':>8s}"]  # fmt: skip
    for op, dt, n, impl, fg, ff, bg, bf in rows:
        lines.append(f"{op:14s} {dt:9s} {n:8d} {impl:14s} {fg:9.0f} {ff:8.2f} {bg:9.0f} {bf:8.2f}")
    return "\n".join(lines)
