"""Why a split-row forward reads half its speed in one bench run of three (issue 43's spread: softmax
fp16 1024x131072 forward 2168, 1165, 2166 GB/s in three back-to-back runs, 2026-11-27), on a CUDA GPU:

    NORMKIT_NATIVE=0 python3 ci/split-solo.py [processes]

Each of ``processes`` (default 4) fresh processes times the forward of each cell as `normkit bench`
does (triton's do_bench median, L2 flushed), three times, and reads the row groups' start words of
the launches it made (coop.join): a group whose K programs did not all start within SPIN polls is
closed and runs solo, reading its rows K times. A slow process with solo groups points at program
placement; a slow process without them, at something else (the barrier's counters, clocks). The
native host path is off (NORMKIT_NATIVE=0) so that every call makes its workspace in Python, where
this script sees it; the kernels and their launches are the same.
"""

import os
import subprocess
import sys

CELLS = [("softmax", "float16", 1024, 131072), ("log_softmax", "float16", 1024, 131072),
         ("add_rms_norm", "bfloat16", 1024, 131072), ("layer_norm", "float16", 1024, 131072)]  # fmt: skip


def _call(op, x, w):
    import normkit

    n = x.shape[1]
    return {"softmax": lambda: normkit.softmax(x, -1), "log_softmax": lambda: normkit.log_softmax(x, -1),
            "add_rms_norm": lambda: normkit.add_rms_norm(x, x, (n,), w),
            "layer_norm": lambda: normkit.layer_norm(x, (n,), w)}[op]  # fmt: skip


def one() -> None:
    import torch
    from triton.testing import do_bench

    from normkit.backends.cuda import coop

    counters = []
    made = coop.workspace

    def workspace(M, *args):  # every launch's counters: [M, 2M) are the groups' start words
        part, count = made(M, *args)
        counters.append((M, count))
        del counters[:-64]  # the last 64 launches
        return part, count

    coop.workspace = workspace
    closed = 1 << 30  # coop._CLOSED
    for op, dtype, m, n in CELLS:
        x = torch.randn(m, n, device="cuda", dtype=getattr(torch, dtype))
        w = torch.randn(n, device="cuda", dtype=x.dtype)
        fn = _call(op, x, w)
        moved = 2 * x.numel() * x.element_size() * (1.5 if op == "add_rms_norm" else 1)
        with torch.no_grad():
            times = [do_bench(fn, warmup=25, rep=100, return_mode="median") for _ in range(3)]
        torch.cuda.synchronize()
        solo = groups = 0
        for rows, count in counters:
            start = count[rows:].cpu()
            groups += int((start > 0).sum())
            solo += int((start >= closed).sum())
        counters.clear()
        gbps = " ".join(f"{moved / t / 1e6:.0f}" for t in times)
        print(f"pid {os.getpid()} {op} {dtype} {m}x{n}: GB/s {gbps}; solo row groups {solo} of {groups} "
              f"(last 64 launches)", flush=True)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one()
    else:
        env = dict(os.environ, NORMKIT_NATIVE="0")
        for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
            subprocess.run([sys.executable, __file__, "--one"], env=env, check=False)
