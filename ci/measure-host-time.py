"""Host time per normkit call (the few-row / small-image case), beside torch eager.

Run on a GPU: python3 ci/measure-host-time.py [profile]. For each op and a small shape, prints
microseconds per call issued back to back (forward, and forward + backward), which is host-bound
when the kernels are this small, and the GPU time of the same call from do_bench. With
``profile``, a cProfile of 500 normkit layer_norm forward calls (top functions by own time).

python3 ci/measure-host-time.py calls [device [n [runs]]]: the host time of one call as issue 43 states it,
as a markdown table: layer_norm, rms_norm, softmax and the add-norms at (16, 4096) and (32768,
4096), bf16, normkit against torch eager in this process; per call the median over n (200) calls of
perf_counter around the forward alone, and around the forward + ``backward(dy)``, the device
synchronized before each timed call and outside the timed region (so the host never waits for a
queue it filled), normkit's and torch's calls interleaved; ``runs`` tables in one process.
``device`` (default cuda): ``cpu`` runs the same protocol on CPU tensors.

python3 ci/measure-host-time.py pieces: the pieces of a replayed forward (plan key, plan, allocation,
the whole call, torch's), timed as ``calls`` times one call, at 16 and 32768 rows.

python3 ci/measure-host-time.py profile-calls [dir]: a cProfile of 300 calls of each 16 x 4096 case
of that table (normkit forward under no_grad, and forward + backward), top functions by own and by
cumulative time, one file per case and direction under ``dir`` (default: .).
"""

import cProfile
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import normkit

DEV = "cuda"
DT = torch.bfloat16


def cases():
    x = torch.randn(16, 4096, device=DEV, dtype=DT, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(4096, device=DEV, dtype=DT, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    img = torch.randn(16, 512, 28, 28, device=DEV, dtype=DT, requires_grad=True)
    cw = torch.randn(512, device=DEV, dtype=DT, requires_grad=True)
    cb = torch.randn_like(cw, requires_grad=True)
    yield "layer_norm 16x4096", lambda ns: ns.layer_norm(x, (4096,), w, b, 1e-5)
    yield "rms_norm 16x4096", lambda ns: ns.rms_norm(x, (4096,), w, 1e-5)
    yield "softmax 16x4096", lambda ns: ns.softmax(x, -1)
    yield "add_rms_norm 16x4096", lambda ns: (normkit.add_rms_norm(x, r, (4096,), w, 1e-5, prenorm=True)[0]
                                              if ns is normkit else F.rms_norm(x + r, (4096,), w, 1e-5))
    yield "group_norm 16x512x28x28", lambda ns: ns.group_norm(img, 32, cw, cb, 1e-5)
    yield "batch_norm 16x512x28x28", lambda ns: ns.batch_norm(img, None, None, cw, cb, True, 0.1, 1e-5)


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _calls(device):
    """(name, normkit call, torch eager call) of issue 43's host-time table."""
    for m in (16, 32768):
        yield from _calls_of(torch.randn(m, 4096, device=device, dtype=DT, requires_grad=True))


def _calls_of(x):
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(4096, device=x.device, dtype=DT, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    shape = f"{x.shape[0]}x4096"
    return [
        (f"layer_norm {shape}", lambda: normkit.layer_norm(x, (4096,), w, b),
         lambda: F.layer_norm(x, (4096,), w, b)),
        (f"rms_norm {shape}", lambda: normkit.rms_norm(x, (4096,), w), lambda: F.rms_norm(x, (4096,), w)),
        (f"softmax {shape}", lambda: normkit.softmax(x, -1), lambda: F.softmax(x, -1)),
        (f"add_layer_norm {shape}", lambda: normkit.add_layer_norm(x, r, (4096,), w, b),
         lambda: F.layer_norm(x + r, (4096,), w, b)),
        (f"add_rms_norm {shape}", lambda: normkit.add_rms_norm(x, r, (4096,), w),
         lambda: F.rms_norm(x + r, (4096,), w)),
    ]  # fmt: skip


def host_us(fn, device, n=200, warmup=20):
    """Median microseconds of host time of ``fn()``, the device synchronized before each call and
    outside the timed region."""
    return host_pair_us((fn,), device, n, warmup)[0]


def host_pair_us(fns, device, n=200, warmup=20):
    """:func:`host_us` of each of ``fns``, their calls interleaved (a, b, a, b, ...) so that a drift
    of the host's speed during the measurement weighs on each alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = [[] for _ in fns]
    for i in range(warmup + n):
        for fn, out in zip(fns, times):
            sync()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if i >= warmup:
                out.append(dt)
    sync()
    return [sorted(out)[len(out) // 2] * 1e6 for out in times]


def calls_table(device="cuda", n=200, runs=1):
    """Issue 43's table, ``runs`` times in this process (normkit's and torch's calls interleaved)."""
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for run in range(runs):
        print(f"{name}, torch {torch.__version__}; host time of one call, median of {n} (us), bf16, "
              f"normkit and torch interleaved; run {run + 1} of {runs}")  # fmt: skip
        print("| call | normkit fwd | torch fwd | ratio | normkit fwd+bwd | torch fwd+bwd | ratio |")
        print("|---|---|---|---|---|---|---|")
        for case, nk, th in _calls(device):
            with torch.no_grad():
                row = host_pair_us((nk, th), device, n)
            dy = torch.randn_like(th())
            row += host_pair_us([lambda fn=fn, dy=dy: fn().backward(dy) for fn in (nk, th)], device, n)
            cells = f"{row[0]:.1f} | {row[1]:.1f} | {row[0] / row[1]:.2f} | {row[2]:.1f} | {row[3]:.1f}"
            print(f"| {case} | {cells} | {row[2] / row[3]:.2f} |", flush=True)
    if device == "cuda":
        from normkit import plans
        from normkit.backends.cuda import native

        print(f"\nnative host path: {'loaded' if native.module() is not None else native.why()}")
        for key, plan in plans._PLANS.items():
            print(f"  {key[0]} {tuple(key[1])} {key[2]}: {native.state(plan)}")


def profile_calls(out=".", n=300):
    for case, nk, _ in _calls_of(torch.randn(16, 4096, device="cuda", dtype=DT, requires_grad=True)):
        dy = torch.randn(16, 4096, device="cuda", dtype=DT)

        def fwd(nk=nk):
            with torch.no_grad():
                nk()

        for mode, fn in (("fwd", fwd), ("fwd+bwd", lambda nk=nk, dy=dy: nk().backward(dy))):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            with open(f"{out}/prof-{case.split()[0]}-{mode}.txt", "w") as f:
                f.write(f"cProfile of {n} normkit {case} {mode} calls, bf16\n")
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(30)
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)


def pieces(n=300):
    """The pieces of a replayed forward (softmax's and layer_norm's), each timed as ``calls`` times a
    call (the device synchronized before it), all interleaved, at 16 and 32768 rows: what the
    front end costs against torch's call, and how much slower any code runs right after a sync
    that waited for a long kernel (the key has no GPU work in it)."""
    for m in (16, 32768):
        with torch.no_grad():  # inference plans, as the forward columns of ``calls``
            rows = _pieces_of(torch.randn(m, 4096, device="cuda", dtype=DT))
            times = host_pair_us([fn for _, fn in rows], "cuda", n)
        for (name, _), us in zip(rows, times):
            print(f"{m:>6} rows  {name:<32} {us:8.2f} us", flush=True)


def _pieces_of(x):
    from normkit import functional as NF
    from normkit import plans
    from normkit.backends.cuda import launch

    w, b = torch.randn(4096, device="cuda", dtype=DT), torch.randn(4096, device="cuda", dtype=DT)
    for _ in range(5):  # recorded on the third call, replayed after
        normkit.softmax(x, -1), normkit.layer_norm(x, (4096,), w, b)
    splan = plans.stored(NF.softmax_key("softmax", x, -1, None))
    lplan = plans.stored(plans.key("layer_norm", x, (w, b), (4096,), 1e-5))
    return [
        ("no-op", lambda: None),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("softmax key + lookup", lambda: plans.stored(NF.softmax_key("softmax", x, -1, None))),
        ("layer_norm key + lookup", lambda: plans.stored(plans.key("layer_norm", x, (w, b), (4096,), 1e-5))),
        ("launch.quiet()", launch.quiet),
        ("softmax plan(x)", lambda: splan(x)),
        ("normkit.softmax", lambda: normkit.softmax(x, -1)),
        ("F.softmax", lambda: F.softmax(x, -1)),
        ("layer_norm plan(x, None, w, b)", lambda: lplan(x, None, w, b)),
        ("normkit.layer_norm", lambda: normkit.layer_norm(x, (4096,), w, b)),
        ("F.layer_norm", lambda: F.layer_norm(x, (4096,), w, b)),
    ]  # fmt: skip


def main():
    if sys.argv[1:2] == ["pieces"]:
        return pieces()
    if sys.argv[1:2] == ["profile-calls"]:
        return profile_calls(*sys.argv[2:3])
    if sys.argv[1:2] == ["calls"]:
        device, n, runs = (sys.argv[2:] + ["cuda", "200", "1"][len(sys.argv[2:]):])[:3]
        return calls_table(device, int(n), int(runs))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call (host-bound loop) "
          f"and GPU us (do_bench)")
    print(f"{'case':<26} {'normkit fwd':>12} {'torch fwd':>10} {'normkit f+b':>12} {'torch f+b':>10} "
          f"{'normkit GPU':>12} {'torch GPU':>10}")
    for name, call in cases():
        row = []
        for ns in (normkit, F):
            with torch.no_grad():
                row.append(per_call_us(lambda call=call, ns=ns: call(ns)))
        for ns in (normkit, F):
            def fwd_bwd(call=call, ns=ns):
                call(ns).float().sum().backward()
            row.append(per_call_us(fwd_bwd, 100))
        for ns in (normkit, F):
            with torch.no_grad():
                fn = lambda call=call, ns=ns: call(ns)  # noqa: E731
                row.append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
        print(f"{name:<26} " + " ".join(f"{v:>11.0f} " for v in row), flush=True)
    if "profile" in sys.argv[1:]:
        x = torch.randn(16, 4096, device=DEV, dtype=DT, requires_grad=True)
        w = torch.randn(4096, device=DEV, dtype=DT, requires_grad=True)
        b = torch.randn(4096, device=DEV, dtype=DT, requires_grad=True)

        def step():
            normkit.layer_norm(x, (4096,), w, b).float().sum().backward()

        for _ in range(20):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            step()
        prof.disable()
        print("cProfile of 200 normkit layer_norm forward + backward calls, 16 x 4096 bf16")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
