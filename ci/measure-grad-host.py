"""Host time of calls that want gradients (few rows: 16 x 4096 bf16), layer by layer, torch in the
same process (docs/tuning-log.md T16: training plans).

Run on a GPU: python3 ci/measure-grad-host.py [M]. Calls are issued back to back behind a GPU sleep,
so the figure is host time; each is the minimum over 7 repetitions of 100 calls, two passes. Rows:
``torch.autograd.grad`` of torch's and normkit's ops; a do-nothing Python autograd.Function (the
engine's own floor for a Python node); the forward with grad; and the training plan's pieces.
"""

import sys
import time

import torch
import torch.nn.functional as F

import normkit
from normkit import plans

SLEEP = 60_000_000


def host_us(f, reps=7, calls=100):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP)
        t = time.perf_counter()
        for _ in range(calls):
            f()
        ts.append((time.perf_counter() - t) * 1e6 / calls)
        torch.cuda.synchronize()
    return min(ts)


class Floor(torch.autograd.Function):
    """A Python node that allocates its output and returns its inputs as gradients."""

    @staticmethod
    def forward(ctx, x, w, b):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def main(M=16, N=4096, dt=torch.bfloat16):
    x, r = (torch.randn(M, N, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(N, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
    dy = torch.randn(M, N, device="cuda", dtype=dt)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    ys = {
        "LN (x,w,b)": (F.layer_norm(x, (N,), w, b), normkit.layer_norm(x, (N,), w, b), (x, w, b)),
        "RMS (x,w)": (F.rms_norm(x, (N,), w), normkit.rms_norm(x, (N,), w), (x, w)),
        "add_rms (x,r,w)": (F.rms_norm(x + r, (N,), w), normkit.add_rms_norm(x, r, (N,), w), (x, r, w)),
        "softmax (x)": (F.softmax(x, -1), normkit.softmax(x, -1), (x,)),
    }
    yf = Floor.apply(x, w, b)
    plan = normkit.layer_norm(x, (N,), w, b).grad_fn.plan  # the training plan (plans.Training)
    _, _, mean, rstd = plan.forward(xd, None, wd, bd)
    assert any(p is plan for p in plans._PLANS.values())

    def grad_of(y, inputs):
        return lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)

    rows = []
    for name, (yt, yn, inputs) in ys.items():
        rows += [(f"torch grad {name}", grad_of(yt, inputs)), (f"normkit grad {name}", grad_of(yn, inputs))]
    rows += [
        ("Python node floor grad (x)", grad_of(yf, (x,))),
        ("torch F.layer_norm fwd, grad", lambda: F.layer_norm(x, (N,), w, b)),
        ("normkit.layer_norm fwd, grad", lambda: normkit.layer_norm(x, (N,), w, b)),
        ("torch add + rms_norm fwd, grad", lambda: F.rms_norm(x + r, (N,), w)),
        ("normkit.add_rms_norm fwd, grad", lambda: normkit.add_rms_norm(x, r, (N,), w)),
        ("plan.forward (LN)", lambda: plan.forward(xd, None, wd, bd)),
        ("plan.backward (LN)", lambda: plan.backward(dy, None, xd, wd, mean, rstd)),
        ("Floor.apply", lambda: Floor.apply(x, w, b)),
        ("torch.empty_like(x)", lambda: torch.empty_like(xd)),
    ]
    for rep in range(2):
        for name, f in rows:
            print(f"[{rep}] {name:34s} {host_us(f):7.2f} us", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
