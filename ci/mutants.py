"""The standing mutant set: each mutant is one small, realistic bug, applied to a scratch copy of the
repository; the tests named with it must fail on it (an assertion: pytest exit status 1). A mutant
the tests pass is a survivor, and the run fails. So does a stale mutant (its text is no longer found
exactly once in its function: update it with the code) and one whose tests crash or collect nothing.

    python ci/mutants.py                 # the CPU mutants (CI: .ci/run)
    python ci/mutants.py --device cuda   # the GPU-only ones (needs a CUDA GPU)
    python ci/mutants.py --list          # name, where, what
    python ci/mutants.py NAME ...        # some of them

A mutant names a function (``name`` or ``Class.name``) and a piece of its source, not a line
number, so it follows the code through refactors (a C++ source: no function, a piece found once in
the file). The mutants themselves: ci/mutant_set.py.
"""

from __future__ import annotations

import argparse
import ast
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # file, relative to the repository root
    function: str  # the function (or Class.method) whose source holds ``old``; "": the whole file
    old: str  # replaced by ``new``; must occur exactly once in the function
    new: str
    tests: tuple[str, ...]  # pytest arguments: the tests that must catch it
    device: str = "cpu"  # cpu: the interpreter / reference suite (CI); cuda: ci/gpu-smoke.sh
    what: str = ""  # the bug, in words
    also: tuple[tuple[str, str, str], ...] = ()  # more (function, old, new) edits of the same bug


class StaleMutant(Exception):
    pass


def _function_span(source: str, qualname: str) -> tuple[int, int]:
    """(first, last) 1-based lines of the function ``qualname`` (``f`` or ``Class.f``)."""
    parts = qualname.split(".")
    nodes = ast.parse(source).body
    found = None
    for i, part in enumerate(parts):
        want = (ast.FunctionDef, ast.AsyncFunctionDef) if i == len(parts) - 1 else (ast.ClassDef,)
        found = next((n for n in nodes if isinstance(n, want) and n.name == part), None)
        if found is None:
            raise StaleMutant(f"no {qualname}")
        nodes = found.body
    start = min([found.lineno] + [d.lineno for d in found.decorator_list])
    return start, found.end_lineno


def _edit(source: str, function: str, old: str, new: str) -> str:
    if not function:  # a file that is not Python (native.cpp): ``old`` once in the whole file
        if source.count(old) != 1:
            raise StaleMutant(f"{old!r} occurs {source.count(old)} times in the file")
        return source.replace(old, new)
    first, last = _function_span(source, function)
    lines = source.splitlines(keepends=True)
    body = "".join(lines[first - 1 : last])
    if body.count(old) != 1:
        raise StaleMutant(f"{old!r} occurs {body.count(old)} times in {function}")
    return "".join(lines[: first - 1]) + body.replace(old, new) + "".join(lines[last:])


def mutate(source: str, mutant: Mutant) -> str:
    for function, old, new in ((mutant.function, mutant.old, mutant.new), *mutant.also):
        source = _edit(source, function, old, new)
    return source


def scratch_copy(dest: Path) -> None:
    """The tracked files and the untracked ones git does not ignore (as in the working tree: a copy of
    a checkout whose index is older, as on the GPU machine, still has every file), with
    normkit/backends -> backends so that the copy's own backends are imported (the editable install
    maps normkit.backends to this checkout)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout  # fmt: skip
    for rel in files.decode().split("\0"):
        if rel and (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    (dest / "normkit" / "backends").symlink_to(Path("..") / "backends")


PROBE = ("import normkit, normkit.backends.cuda, normkit.backends.npu, sys; "
         "paths = [normkit.__file__, normkit.backends.cuda.__file__, normkit.backends.npu.__file__]; "
         "sys.exit(0 if all(p.startswith(sys.argv[1]) for p in paths) else f'imported {paths}')")  # fmt: skip


def run_one(mutant: Mutant, scratch: Path) -> tuple[str, float, str]:
    """-> (status, seconds, detail): killed | SURVIVED | STALE | ERROR."""
    target = scratch / mutant.path
    original = target.read_text()
    try:
        target.write_text(mutate(original, mutant))
    except StaleMutant as exc:
        return "STALE", 0.0, str(exc)
    env = dict(os.environ, PYTHONPATH=str(scratch), PYTHONDONTWRITEBYTECODE="1")
    if not mutant.path.endswith(".py"):  # the mutated extension is built in the scratch copy, not the cache
        env["NORMKIT_NATIVE_DIR"] = str(scratch / ".native")
    start = time.perf_counter()
    try:
        args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--tb=line",
                *mutant.tests]  # fmt: skip
        done = subprocess.run(args, cwd=scratch, env=env, capture_output=True, text=True)
    finally:
        target.write_text(original)
    seconds = time.perf_counter() - start
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    detail = next((ln for ln in lines if ln.startswith(("FAILED", "E ", "/")) or "Error" in ln), "")
    if done.returncode == 1:
        return "killed", seconds, detail
    if done.returncode == 0:
        return "SURVIVED", seconds, lines[-1] if lines else ""
    return "ERROR", seconds, f"pytest exit {done.returncode}: {lines[-1] if lines else ''}"


def main(argv=None) -> int:
    sys.path.insert(0, str(ROOT / "ci"))
    from mutant_set import MUTANTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: every one for --device)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    args = p.parse_args(argv)
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        print("mutants: duplicate names", file=sys.stderr)
        return 2
    unknown = set(args.names) - set(names)
    if unknown:
        print(f"mutants: unknown {', '.join(sorted(unknown))}; --list shows them", file=sys.stderr)
        return 2
    chosen = [m for m in MUTANTS if (m.name in args.names if args.names else m.device == args.device)]
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:34s} {m.device:4s} {m.path}:{m.function}  {m.what}")
        print(f"{len(MUTANTS)} mutants ({sum(m.device == 'cpu' for m in MUTANTS)} cpu)")
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="normkit-mutants-") as tmp:
        copies = queue.SimpleQueue()
        for i in range(max(1, args.jobs)):
            scratch = Path(tmp) / str(i)
            scratch_copy(scratch)
            probe = subprocess.run([sys.executable, "-c", PROBE, str(scratch)], cwd=scratch,
                                   env=dict(os.environ, PYTHONPATH=str(scratch)), capture_output=True,
                                   text=True)  # fmt: skip
            if probe.returncode:
                print(f"mutants: the scratch copy is not what gets imported: {probe.stderr.strip()}",
                      file=sys.stderr)  # fmt: skip
                return 2
            copies.put(scratch)

        def run(m):
            scratch = copies.get()
            try:
                return m, run_one(m, scratch)
            finally:
                copies.put(scratch)

        bad = 0
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for m, (status, seconds, detail) in pool.map(run, chosen):
                bad += status != "killed"
                print(f"{status:8s} {seconds:6.1f}s  {m.name:38s} {detail[:140]}", flush=True)
    print(f"mutants: {len(chosen) - bad} of {len(chosen)} killed, {bad} not "
          f"({time.perf_counter() - start:.0f} s, {args.device})")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
