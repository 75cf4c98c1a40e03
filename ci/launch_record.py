"""Record every kernel launch the CUDA backend makes for a grid of calls, without a GPU.

A refactor of ``backends/cuda``'s launchers or heuristics that means to change nothing on the GPU can
be checked on any machine: the launches before and after must be the same, kernel by kernel (name,
grid, and every kernel parameter: tensors by role, shape, stride and dtype; numbers and constexprs
by value). The calls run under FakeTensorMode (CUDA tensors without memory), with the launch
functions replaced by recorders and the device described as an H100 (132 SMs, 227 KB of shared
memory a program, Gluon and the rows-in-parts kernels available; pass ``--in-parts`` to record with
rows in parts forced on as well, ``config.forced(in_parts=True)``). A call that raises is recorded
with its error (an older revision's GroupNorm plan, called with a 4-D input, raises). What it
cannot see: values written into workspaces (zeroed counters) and anything that happens on the GPU.

  python ci/launch_record.py --out new.txt           record this tree's launches
  python ci/launch_record.py --against REV            also REV's (installed into a temporary
                                                      directory), print the differences, exit 1 if any
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import itertools
import os
import subprocess
import sys
import tempfile
import warnings
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

SM_COUNT = 132  # H100 SXM
SMEM_PER_BLOCK = 232448  # H100: 227 KB opt-in
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ROW_NS = (1, 7, 64, 256, 1000, 1024, 4096, 8192, 16384, 32768, 40999, 65536, 131072, 262144, 1048576)
IMAGES = ((2, 6, 9, 3), (128, 256, 56 * 56, 32), (32, 256, 56 * 56, 32), (8, 64, 28 * 28, 32),
          (4, 512, 7 * 7, 32), (16, 64, 112 * 112, 8), (4096, 64, 1, 8))  # (N, C, HW, groups)  # fmt: skip


class Recorder:
    """Launch stand-ins: ``launch(fn, grid, *args, key=, **meta)`` and ``Bound(fn, grid, index,
    **meta)(*args)`` append one line each, naming tensors by the role the caller gave them (or
    ``t<k>`` in order of first appearance within the call)."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.seen: list[torch.Tensor] = []  # alive until the next call: no id() reused within one
        self.call = ""

    def start(self, call: str, **tensors) -> None:
        self.call = call
        self.names = {id(t): name for name, t in tensors.items() if isinstance(t, torch.Tensor)}
        self.seen = list(tensors.values())
        self.lines.append(f"== {call}")

    def _arg(self, a) -> str:
        if isinstance(a, torch.Tensor):
            if id(a) not in self.names:
                self.names[id(a)] = f"t{len(self.names)}"
                self.seen.append(a)
            name = self.names[id(a)]
            return f"{name}:{str(a.dtype)[6:]}{list(a.shape)}{list(a.stride())}"
        if isinstance(a, torch.dtype):
            return str(a)
        return repr(getattr(a, "value", a))  # a tl.constexpr by its value

    def out(self, result):
        """Append what a call returned (tensors by name), and return it."""
        def desc(v):
            if isinstance(v, (tuple, list)):
                return "(" + ", ".join(map(desc, v)) + ")"
            return self._arg(v) if isinstance(v, torch.Tensor) else repr(v)

        self.lines.append("-> " + desc(result))
        return result

    def plan(self, plan, grad, args, backward_args) -> None:
        """Run and record a plan: none (refused), the inference plan on ``args``, or the training
        plan's forward on ``args`` and its backward on ``backward_args(forward's result)``."""
        if plan is None:
            self.lines.append("(no plan)")
        else:
            try:
                if not grad:
                    self.out(plan(*args))
                else:
                    forward, backward = plan
                    self.out(backward(*backward_args(self.out(forward(*args)))))
            except Exception as e:  # recorded: the other revision may run it
                self.lines.append(f"raised {type(e).__name__}: {e}")

    def record(self, fn, grid, args, meta, suffix="") -> None:
        inner = getattr(fn, "fn", fn)
        params = list(inspect.signature(inner).parameters)
        given = dict(zip(params, args), **meta)
        extra = sorted(k for k in meta if k not in params)  # num_warps, maxnreg, ...
        fields = [f"{p}={self._arg(given[p])}" for p in params if p in given]
        fields += [f"{k}={meta[k]}" for k in extra]
        self.lines.append(f"{inner.__module__.rsplit('.', 1)[-1]}.{inner.__name__} grid={tuple(grid)} "
                          + " ".join(fields) + suffix)  # fmt: skip

    def launch(self, fn, grid, *args, key=None, **meta):
        self.record(fn, grid, args, meta, f" key={key!r}")

    def bound(self, fn, grid, device_index=None, **meta):
        recorder = self

        class _Bound:
            def __call__(self, *args):
                recorder.record(fn, grid, args, meta, f" bound to device {device_index}")

        return _Bound()


_GETITEM = torch.Tensor.__getitem__


def _getitem(t, index):
    """Tensor indexing by ints and slices through ATen (Python indexing of a fake CUDA tensor asks
    for a CUDA device guard, which a CPU-only torch lacks)."""
    try:
        return _GETITEM(t, index)
    except RuntimeError:
        pass
    dim = 0
    for i in index if isinstance(index, tuple) else (index,):
        if isinstance(i, int):
            t = t.select(dim, i)
        elif isinstance(i, slice):
            t = torch.ops.aten.slice(t, dim, i.start, i.stop, 1 if i.step is None else i.step)
            dim += 1
        else:
            raise TypeError(f"launch_record: index {index!r} is not ints and slices")
    return t


def _patches(rec: Recorder, in_parts: bool):
    from normkit.backends.cuda import compat, config, smem

    mods = [sys.modules[n] for n in list(sys.modules) if n.startswith("normkit.backends.cuda.")]
    for m in mods:
        if getattr(m, "launch", None) is not None and m.__name__ != "normkit.backends.cuda.launch":
            yield mock.patch.object(m, "launch", rec.launch)
        if getattr(m, "Bound", None) is not None and m.__name__ != "normkit.backends.cuda.launch":
            yield mock.patch.object(m, "Bound", rec.bound)
    yield mock.patch.object(config, "_sm_count", lambda *a, **k: SM_COUNT)
    yield mock.patch.object(smem, "smem_per_block", lambda device: SMEM_PER_BLOCK)
    yield mock.patch.dict(smem._WORKSPACES, clear=True)  # each recording starts without kept workspaces
    yield mock.patch.object(compat, "gluon_ok", lambda device: True)
    yield mock.patch.object(compat, "in_parts_ok", lambda: None)
    if hasattr(config, "forced"):  # (a revision before config.forced: its global, for --against)
        yield config.forced(in_parts=in_parts)
    else:
        yield mock.patch.object(config, "IN_PARTS", in_parts)
    yield mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False)
    yield mock.patch.object(torch.cuda, "current_stream", lambda device=None: mock.Mock(cuda_stream=0))
    yield mock.patch.object(torch.cuda, "current_device", lambda: 0)
    yield mock.patch.object(torch.Tensor, "__getitem__", _getitem)
    yield mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def _calls(cuda, rec: Recorder, dtypes=DTYPES, row_ns=ROW_NS, images=IMAGES):
    """Drive the contract functions and plans over the grid; each call's launches follow its line."""
    dev = "cuda"
    for dtype, n in itertools.product(dtypes, row_ns):
        for m, pad in [(m, 0) for m in sorted({1, 3, max(1, min(1 << 20, (1 << 27) // n))})] + [(3, 24)]:
            # pad: rows of x, r and dy that many elements apart beyond N (a strided view)
            x, r, dy = (torch.empty(m, n + pad, device=dev, dtype=dtype)[:, :n] for _ in range(3))
            w, b = torch.empty(n, device=dev, dtype=dtype), torch.empty(n, device=dev, dtype=dtype)
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            mean, rstd = torch.empty(m, device=dev, dtype=acc), torch.empty(m, device=dev, dtype=acc)
            t = dict(x=x, w=w, b=b, r=r, dy=dy, mean=mean, rstd=rstd)
            tag = f"{str(dtype)[6:]} {m}x{n}" + (f" row stride {n + pad}" if pad else "")
            rec.start(f"layer_norm_fwd {tag}", **t)
            rec.out(cuda.layer_norm_fwd(x, w, b, 1e-5))
            rec.start(f"layer_norm_bwd {tag}", **t)
            rec.out(cuda.layer_norm_bwd(dy, x, w, mean, rstd, dtype))
            rec.start(f"rms_norm_fwd {tag}", **t)
            rec.out(cuda.rms_norm_fwd(x, w, 1e-5))
            rec.start(f"rms_norm_bwd {tag}", **t)
            rec.out(cuda.rms_norm_bwd(dy, x, w, rstd))
            for p in (0.0, 0.1):
                rec.start(f"add_layer_norm_fwd p={p} {tag}", **t)
                rec.out(cuda.add_layer_norm_fwd(x, r, w, b, 1e-5, p, 7, dtype))
                rec.start(f"add_layer_norm_bwd p={p} {tag}", **t)
                rec.out(cuda.add_layer_norm_bwd(dy, None, x, w, mean, rstd, dtype, p, 7, dtype, dtype))
                rec.start(f"add_rms_norm_fwd p={p} {tag}", **t)
                rec.out(cuda.add_rms_norm_fwd(x, None, w, 1e-5, p, 7, dtype))
                rec.start(f"add_rms_norm_bwd p={p} {tag}", **t)
                rec.out(cuda.add_rms_norm_bwd(dy, dy, x, w, rstd, p, 7, dtype, None))
            for log in (False, True):
                rec.start(f"softmax_fwd log={log} {tag}", **t)
                rec.out(cuda.softmax_fwd(x, log))
                rec.start(f"softmax_bwd log={log} {tag}", **t)
                rec.out(cuda.softmax_bwd(dy, x, log))
            kinds = ((False, False), (True, False), (True, True))  # (is_rms, add)
            plans = [] if pad else list(itertools.product((False, True), kinds))
            for grad, (is_rms, add) in plans:  # (plans serve contiguous inputs only)
                rec.start(f"plan_row_norm rms={is_rms} add={add} grad={grad} {tag}", **t)
                plan = cuda.plan_row_norm(x, w, None if is_rms else b, 1e-5, is_rms, add, r if add else None,
                                          dtype if add else None, grad)  # fmt: skip
                rec.plan(plan, grad, (x, r if add else None, w, None if is_rms else b),
                         lambda f, dy=dy, x=x, w=w: (dy, None, x, w, f[2], f[3]))  # fmt: skip
            for grad, log in [] if pad else itertools.product((False, True), (False, True)):
                rec.start(f"plan_softmax log={log} grad={grad} {tag}", **t)
                rec.plan(cuda.plan_softmax(x, log, grad), grad, (x,), lambda y, dy=dy: (dy, y))
    for dtype, (n, c, hw, g) in itertools.product([d for d in dtypes if d != torch.float64], images):
        acc = torch.float32
        for cl in (False, True):
            x = torch.empty(n, c, hw, device=dev, dtype=dtype)
            if cl:
                x = torch.empty(n, hw, c, device=dev, dtype=dtype).transpose(1, 2)
            w, b = torch.empty(c, device=dev, dtype=dtype), torch.empty(c, device=dev, dtype=dtype)
            dy = torch.empty_like(x)
            mean, rstd = torch.empty(n * g, device=dev, dtype=acc), torch.empty(n * g, device=dev, dtype=acc)
            t = dict(x=x, w=w, b=b, dy=dy, mean=mean, rstd=rstd)
            tag = f"{str(dtype)[6:]} {n}x{c}x{hw} G={g} cl={cl}"
            rec.start(f"group_norm_fwd {tag}", **t)
            rec.out(cuda.group_norm_fwd(x, w, b, g, 1e-5))
            rec.start(f"group_norm_bwd {tag}", **t)
            rec.out(cuda.group_norm_bwd(dy, x, w, mean, rstd, g, dtype))
            for grad in () if cl else (False, True):  # plans serve contiguous inputs only
                rec.start(f"plan_group_norm grad={grad} {tag}", **t)
                # the plan is made for the (N, C, HW) view and called on the input as given (functional)
                x4, dy4 = x.view(n, c, 1, hw), dy.view(n, c, 1, hw)
                rec.plan(cuda.plan_group_norm(x, w, b, g, 1e-5, grad), grad, (x4, None, w, b),
                         lambda f, dy=dy4, x4=x4, w=w: (dy, None, x4, w, f[2], f[3]))  # fmt: skip
            if cl:
                continue
            rm, rv = torch.empty(c, device=dev, dtype=acc), torch.empty(c, device=dev, dtype=acc)
            cm, cr = torch.empty(c, device=dev, dtype=acc), torch.empty(c, device=dev, dtype=acc)
            t.update(rm=rm, rv=rv, cm=cm, cr=cr)
            rec.start(f"batch_norm_stats {tag}", **t)
            rec.out(cuda.batch_norm_stats(x, 1e-5, 0.1, rm, rv))
            rec.start(f"batch_norm_apply {tag}", **t)
            rec.out(cuda.batch_norm_apply(x, w, b, cm, cr))
            for in_place in (False, True):
                rec.start(f"batch_norm_train_fwd in_place={in_place} {tag}", **t)
                rec.out(cuda.batch_norm_train_fwd(x, w, b, 1e-5, 0.1, rm, rv, in_place))
            for training in (False, True):
                rec.start(f"batch_norm_bwd training={training} {tag}", **t)
                rec.out(cuda.batch_norm_bwd(dy, x, w, cm, cr, training, dtype))
                for grad in (False, True):
                    rec.start(f"plan_batch_norm training={training} grad={grad} {tag}", **t)
                    plan = cuda.plan_batch_norm(x, w, b, rm, rv, 1e-5, training, grad)
                    backward_args = lambda f, dy=dy, x=x, w=w: (dy, x, w, f[1], f[2])  # noqa: E731
                    rec.plan(plan, grad, (x, w, b, rm, rv, 0.1), backward_args)


def record(in_parts: bool = False, **grid) -> list[str]:
    """The launch lines of this interpreter's normkit (see the module doc); ``grid``: ``dtypes``,
    ``row_ns``, ``images`` in place of the module's."""
    from normkit.backends import cuda
    from normkit.backends.cuda import config

    rec = Recorder()
    config.clear_caches()
    with ExitStack() as stack:
        for patch in _patches(rec, in_parts):
            stack.enter_context(patch)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # (it is 0: aligned)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        _calls(cuda, rec, **grid)
    config.clear_caches()
    return rec.lines


def _record_rev(rev: str, work: Path, in_parts: bool) -> list[str]:
    """REV's launches: its tree installed (no dependencies) into ``work``, recorded in a subprocess
    by this script."""
    src, site = work / "src", work / "site"
    src.mkdir()
    archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)  # fmt: skip
    out = work / "old.txt"
    env = dict(os.environ, PYTHONPATH=str(site), TRITON_INTERPRET="0")
    args = [sys.executable, str(Path(__file__).resolve()), "--out", str(out)]
    args += ["--in-parts"] if in_parts else []
    subprocess.run(args, check=True, env=env, cwd=work)
    return out.read_text().splitlines()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the launch lines here (default: stdout, unless --against)")
    parser.add_argument("--against", metavar="REV", help="compare with this git revision's launches")
    parser.add_argument("--in-parts", action="store_true", help="record with rows in parts forced on")
    args = parser.parse_args(argv)
    lines = record(args.in_parts)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if not args.against:
        if not args.out:
            print("\n".join(lines))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        old = _by_call(_record_rev(args.against, Path(tmp), args.in_parts))
    new = _by_call(lines)
    changed = [c for c in new if c in old and old[c] != new[c]]
    only = [c for c in new if c not in old] + [c for c in old if c not in new]
    for call in changed[:20]:
        diff = difflib.unified_diff(old[call], new[call], args.against, "this tree", n=0, lineterm="")
        print("\n".join(diff))
    launches = sum(not line.startswith(("->", "(no plan)")) for v in new.values() for line in v[1:])
    summary = f"{len(new)} calls ({launches} launches) here: {len(changed)} launch differently than at "
    summary += args.against
    summary += f" (the first {min(20, len(changed))} above)" if changed else ""
    print(summary + (f"; {len(only)} calls made by only one side" if only else ""))
    return 1 if changed or only else 0


def _by_call(lines: list[str]) -> dict[str, list[str]]:
    """{call line: its launch lines}."""
    calls: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("== "):
            current = calls.setdefault(line, [line])
        else:
            current.append(line)
    return calls


if __name__ == "__main__":
    sys.exit(main())
