"""`normkit bench --device cpu`: host time per call of normkit and torch on CPU tensors.

On the CPU a call's cost is its host time (checks, dispatch, autograd bookkeeping) plus torch's own
CPU operator, which normkit calls (:mod:`normkit.cpu`). Each cell is the median of ``REPEATS``
timed loops of one call (forward), or one call and its backward (forward + backward), normkit and
torch alternating, every loop at least ``--rep-ms`` / ``REPEATS`` long; results are checked against
torch first (fp64 on the same rounded inputs). torch's side is ``torch.nn.functional``'s op, and for
the add-norms ``F.layer_norm(x + residual)`` / ``F.rms_norm(x + residual)``; the channel norms take
the (M, N) shape as (M, 8, N / 8) with 4 groups (GroupNorm) or training statistics (BatchNorm,
eval where one value a channel would be too few).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

OPS = ("layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm", "add_rms_norm", "group_norm",
       "batch_norm")  # fmt: skip
SHAPES = ((1, 8), (16, 4096), (4096, 4096))
REPEATS = 7


def _inputs(op, m, n, dtype, grad):
    g = torch.Generator().manual_seed(m * 7919 + n)
    shape = (m, 8, n // 8) if op in ("group_norm", "batch_norm") else (m, n)
    c = shape[1] if len(shape) == 3 else n
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)
    inp = dict(x=x, w=(torch.rand(c, generator=g) + 0.5).to(dtype).requires_grad_(grad),
               b=torch.randn(c, generator=g).to(dtype).requires_grad_(grad))  # fmt: skip
    if op.startswith("add_"):
        inp["r"] = torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)
    if op == "batch_norm":
        inp["rm"], inp["rv"] = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)  # (torch's rule)
        inp["training"] = m * (n // 8) > 1
    return inp


def _call(lib, op, inp):
    x, w, b = inp["x"], inp["w"], inp["b"]
    n = x.shape[-1]
    if op == "layer_norm":
        return lib.layer_norm(x, (n,), w, b)
    if op == "rms_norm":
        return lib.rms_norm(x, (n,), w)
    if op in ("softmax", "log_softmax"):
        return getattr(lib, op)(x, -1)
    if op == "add_layer_norm":
        if lib is F:
            return F.layer_norm(x + inp["r"], (n,), w, b)
        return lib.add_layer_norm(x, inp["r"], (n,), w, b)
    if op == "add_rms_norm":
        return F.rms_norm(x + inp["r"], (n,), w) if lib is F else lib.add_rms_norm(x, inp["r"], (n,), w)
    if op == "group_norm":
        return lib.group_norm(x, 4, w, b)
    return lib.batch_norm(x, inp["rm"], inp["rv"], w, b, inp["training"])


def _runner(lib, op, inp, backward):
    if not backward:
        return lambda: _call(lib, op, inp)
    dy = torch.randn(_call(F, op, inp).shape).to(inp["x"].dtype)

    def run():
        _call(lib, op, inp).backward(dy)

    return run


def _loop(fn, count):
    start = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - start) / count


def _check(op, inp, dtype):
    """normkit's forward and every gradient no further from fp64 (on the same rounded inputs) than
    normkit's tolerance (docs/numerics.md) or twice torch's own error, whichever is larger."""
    import normkit
    from normkit.testing import tolerance

    def run(lib, up):
        leaves = {k: (v.detach().to(torch.float64 if up else v.dtype).requires_grad_(v.requires_grad)
                      if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}  # fmt: skip
        y = _call(lib, op, leaves)
        y.backward(dy.to(y.dtype))
        grads = [(f"d{k}", leaves[k].grad, y.numel() // leaves[k].numel()) for k in ("x", "w", "b", "r")
                 if k in leaves and leaves[k].grad is not None]  # fmt: skip
        return [("y", y, 1)] + grads

    dy = torch.randn(_call(F, op, inp).shape).to(dtype)
    ours, theirs, exact = run(normkit, False), run(F, False), run(F, True)
    for (name, got, rows), (_, same, _), (_, want, _) in zip(ours, theirs, exact):
        kind = "fwd" if name == "y" else "bwd" if name in ("dx", "dr") else "param"
        atol, rtol = tolerance(dtype, kind, rows, want)
        err = (got.double() - want).abs()
        bound = torch.maximum(atol + rtol * want.abs(), 2 * (same.double() - want).abs())
        if not bool((err <= bound).all()):
            return f"wrong {name} ({err.max().item():.2g})"
    return ""


def measure(op, m, n, dtype, rep_ms=100.0):
    """-> dict(op, shape, dtype, fwd / fwdbwd: (normkit us, torch us), check)."""
    import normkit

    row = dict(op=op, shape=f"{m}x{n}", dtype=str(dtype).replace("torch.", ""),
               check=_check(op, _inputs(op, m, n, dtype, True), dtype))  # fmt: skip
    for name, backward in (("fwd", False), ("fwdbwd", True)):
        inp = _inputs(op, m, n, dtype, backward)
        fns = [_runner(normkit, op, inp, backward), _runner(F, op, inp, backward)]
        t0 = _loop(fns[1], 1) + _loop(fns[0], 1)  # warm-up, and the loop length
        count = max(1, int(rep_ms / 1e3 / REPEATS / max(t0 / 2, 1e-7)))
        times = [[], []]
        for _ in range(REPEATS):
            for i, fn in enumerate(fns):
                times[i].append(_loop(fn, count))
        row[name] = tuple(statistics.median(t) * 1e6 for t in times)
    return row


def command(args) -> int:
    """Print the table; exit 1 if a result is wrong."""
    dtypes = [getattr(torch, d) for d in (args.dtypes or ["float32", "bfloat16"])]
    ops = [o for o in (args.ops or OPS) if o in OPS]
    rows = []
    print(f"normkit bench --device cpu: {len(ops) * len(SHAPES) * len(dtypes)} cases, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)  # fmt: skip
    header = f"{'op':16s} {'shape':10s} {'dtype':9s} {'fwd us nk/torch':>20s} {'ratio':>6s} " \
             f"{'fwd+bwd us nk/torch':>22s} {'ratio':>6s}  check"
    print(header)
    for op in ops:
        for m, n in SHAPES:
            for dtype in dtypes:
                r = measure(op, m, n, dtype, args.rep_ms)
                rows.append(r)
                f, fb = r["fwd"], r["fwdbwd"]
                print(f"{op:16s} {r['shape']:10s} {r['dtype']:9s} {f[0]:9.1f} /{f[1]:9.1f} "
                      f"{f[0] / f[1]:6.2f} "
                      f"{fb[0]:10.1f} /{fb[1]:10.1f} {fb[0] / fb[1]:6.2f}  {r['check'] or 'ok'}", flush=True)
    worst = max(max(r["fwd"][0] / r["fwd"][1], r["fwdbwd"][0] / r["fwdbwd"][1]) for r in rows)
    print(f"\nworst ratio normkit / torch: {worst:.2f}")
    return 1 if any(r["check"] for r in rows) else 0
