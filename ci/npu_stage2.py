"""Stage 2 of the Ascend check: Ascend's own compiler on every NPU kernel variant, through UB planning.

Stage 1 (ci/npu_compile_check.py) takes each variant to ``.ttadapter`` with triton-ascend. This
script takes each distinct variant (one per kernel x constexpr flags x pointer dtypes; the others
differ only in integer widths or alignment) one stage further: ``bishengir-compile`` from the
``ascendnpu-ir`` wheel (Apache-2.0; no CANN needed), which runs the HFusion / HIVM pipeline with
Unified Buffer (UB) planning and stops at the missing ``hivmc`` binary, leaving
``module.hivm.opt.mlir`` (../shared/npu-notes.md). From that module it reads:

- the UB high-water mark: the largest ``hivm.hir.pointer_cast`` offset + the size of its buffer;
- scalar loops: ``scf.for`` with a step of 1 up to a constant (one iteration per element of a tile:
  an op the vector units could not take, e.g. a per-element gather or a 64-bit / unsigned multiply).

A variant fails on any compiler error other than the missing ``hivmc``, on a scalar loop, or above
``--budget-kb`` of UB: 176 of the chip's 192 KB. The planned figure already holds the copies that
auto multi-buffering adds (measured: the fp32 LayerNorm forward with weight and bias plans 72.6 KB
with it, 48.6 KB without), so the budget keeps 16 KB back only for what the stages after planning
may add, which are not run here.

Run inside stage 1's triton-ascend virtualenv (ci/npu-compile-check.sh runs both, self-test first;
``ascendnpu-ir`` is in its requirements, and bishengir-compile is found in that package):
    python ci/npu_stage2.py [--bishengir PATH] [--manifest M] [--ttadapters F] [--jobs N] [--table T]
(--ttadapters: stage 1's index of the .ttadapter files it wrote, which are then planned as they are
instead of compiled again; ci/npu-compile-check.sh passes it)
    python ci/npu_stage2.py --selftest   # must reject a kernel with a scalar gather
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import npu_compile_check as stage1  # noqa: E402

TARGET = "Ascend910B4"
FLAGS = ["--enable-hfusion-compile=true", "--enable-hivm-compile=true", "--enable-triton-kernel-compile=true",
         "--enable-auto-multi-buffer=True", "--enable-auto-bind-sub-block=True"]  # fmt: skip
STOP = "Cannot find hivmc"  # the one error accepted: the stage after UB planning needs CANN's hivmc
UB_TOTAL_KB = 192
BYTES = {"f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i16": 2, "i8": 1, "i1": 1, "f64": 8, "i64": 8}
_CAST = re.compile(r"hivm\.hir\.pointer_cast\(([^)]*)\)\s*:\s*memref<([^>]*?)x?(\w+)(?:,[^>]*)?,\s*"
                   r"#hivm\.address_space<ub>>")  # fmt: skip
# a step-1 loop up to a constant (the tile): one iteration per element. Loops of the source (over rows,
# partial sums) have a step of 1 too, but a runtime bound.
_SCALAR_LOOP = re.compile(r"scf\.for %\w+ = %\w+ to %c(\d+)(?:_[a-z0-9]+)? step %c1(?:_[a-z0-9]+)?\s")


def ub_bytes(module: str) -> int:
    """The UB high-water mark of a planned module: max over UB buffers of offset + size."""
    top = 0
    for m in _CAST.finditer(module):
        offsets = [int(v) for v in re.findall(r"%c(\d+)_i64", m.group(1))] or [0]
        dims = [int(d) for d in m.group(2).split("x") if d.isdigit()]
        size = BYTES.get(m.group(3), 4)
        for d in dims:
            size *= d
        top = max(top, max(offsets) + size)
    return top


def scalar_loops(module: str) -> int:
    return sum(1 for line in module.splitlines() if _SCALAR_LOOP.search(line))


def bishengir(binary: str, ttadapter: Path, work: Path) -> tuple[bool, str, str]:
    """(ok, planned module text, compiler message) for one ``.ttadapter``."""
    mlir = work / "k.mlir"
    mlir.write_text(ttadapter.read_text().replace(', mix_mode = "aiv"', ""))  # as triton-ascend does
    temps = work / "temps"
    temps.mkdir()
    done = subprocess.run([binary, str(mlir), f"--target={TARGET}", *FLAGS, f"--save-temps={temps}"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    message = (done.stdout + done.stderr).strip()
    planned = temps / "module.hivm.opt.mlir"
    if done.returncode != 0 and STOP not in message:
        return False, "", message
    if not planned.is_file():
        return False, "", f"no module.hivm.opt.mlir: {message}"
    return True, planned.read_text(), message


def plan(fn, variant: dict, binary: str, ttadapter: str | None = None) -> tuple[int | None, int | None, str]:
    """(UB bytes, scalar loops, "") of one variant of ``fn`` through stage 1 (or stage 1's own
    ``ttadapter`` file of it) and bishengir-compile, or (None, None, what failed)."""
    with tempfile.TemporaryDirectory(prefix="normkit-stage2-") as tmp:
        if ttadapter and Path(ttadapter).is_file():
            found = [Path(ttadapter)]
        else:
            os.environ["TRITON_CACHE_DIR"] = str(Path(tmp, "cache"))
            ok, detail = stage1.compile_variant(fn, variant)
            found = sorted(Path(tmp, "cache").rglob("*.ttadapter"))
            if not ok or not found:
                return None, None, f"stage 1 failed: {detail}"
        ok, module, message = bishengir(binary, found[0], Path(tmp))
        if not ok:
            return None, None, message
        return ub_bytes(module), scalar_loops(module), ""


def _task(args):
    name, variant, binary, ttadapter = args
    return (name, variant, *plan(stage1._kernels()[name], variant, binary, ttadapter))


def distinct(variants: list[dict]) -> list[tuple[int, dict]]:
    """(number, variant): one variant per (constexprs, options, pointer dtypes)."""
    seen, out = set(), []
    for i, v in enumerate(variants):
        pointers = sorted({t for t in v["signature"].values() if t.startswith("*")})
        key = json.dumps([v["constexprs"], v["options"], pointers], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append((i, v))
    return out


def label(variant: dict) -> str:
    flags = [k for k, v in variant["constexprs"].items() if v is True]
    dtypes = sorted({t[1:] for t in variant["signature"].values() if t.startswith("*") and t != "*fp32"})
    return f"{'/'.join(dtypes) or 'fp32'} {' '.join(flags) or '-'}"


def run(binary: str, manifest: Path, jobs: int, budget_kb: float, table: Path | None,
        only: list[str] | None = None, ttadapters: Path | None = None) -> int:
    stage1.import_normkit()
    if not manifest.is_file():
        stage1.record(manifest)
    data = json.loads(manifest.read_text())
    files = json.loads(ttadapters.read_text()) if ttadapters and ttadapters.is_file() else {}
    tasks = [(name, v, binary, files.get(name, {}).get(str(i))) for name, vs in data["kernels"].items()
             if not only or any(stage1.short(name).startswith(o) for o in only)
             for i, v in distinct(vs)]  # fmt: skip
    reused = sum(1 for t in tasks if t[3])
    t0 = time.perf_counter()
    results = stage1.parallel_map(_task, tasks, jobs, chunksize=2)
    per_kernel: dict[str, list] = {}
    failures = []
    for name, variant, ub, loops, message in results:
        per_kernel.setdefault(stage1.short(name), []).append((ub, loops, label(variant)))
        why = (message and f"compiler: {message[:stage1.MESSAGE_LIMIT]}") or (
            f"{loops} scalar loop(s)" if loops else
            f"UB {ub / 1024:.1f} KB over the budget of {budget_kb:g} KB" if ub > budget_kb * 1024 else "")
        if why:
            failures.append(f"{stage1.short(name)} [{label(variant)}]: {why}")
    lines = ["| kernel | variants | UB KB (max) | the largest | scalar loops (max) | the most |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for kernel, rows in sorted(per_kernel.items()):
        good = [r for r in rows if r[0] is not None]
        big = max(good, default=(0, 0, "-"), key=lambda r: r[0])
        loops = max(good, default=(0, 0, "-"), key=lambda r: r[1])
        lines.append(f"| {kernel} | {len(rows)} | {big[0] / 1024:.1f} | {big[2]} | {loops[1]} | "
                     f"{loops[2] if loops[1] else '-'} |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if table:
        table.write_text(text + "\n")
    for f in failures:
        print(f"FAILED {f}")
    verdict = "FAILED" if failures else "ok"
    print(f"npu stage 2 {verdict}: {len(tasks)} variants of {len(per_kernel)} kernels through "
          f"bishengir-compile (UB planning, {TARGET}; {reused} from stage 1's .ttadapter files) in "
          f"{time.perf_counter() - t0:.0f} s with {jobs} jobs; "
          f"{len(failures)} failed (UB budget {budget_kb:g} of {UB_TOTAL_KB} KB)")  # fmt: skip
    return 1 if failures else 0


# --- self-test: a per-element gather must show as scalar loops ----------------------------------
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _selftest_plain(X, W, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * tl.load(W + offs, mask=mask), mask=mask)


@triton.jit
def _selftest_gather(X, W, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    w = tl.load(W + offs // 7, mask=mask)  # one weight per 7 elements: a gather (GroupNorm's old form)
    tl.store(Y + offs, tl.load(X + offs, mask=mask) * w, mask=mask)


def selftest(binary: str) -> int:
    variant = {"constexprs": {"BLOCK": 1024}, "options": {},
               "signature": {"X": "*fp32", "W": "*fp32", "Y": "*fp32", "n": "i32"}}  # fmt: skip
    results = {}
    for fn in (_selftest_plain, _selftest_gather):
        ub, loops, message = plan(fn, variant, binary)
        if message:
            print(f"self-test: {fn.__name__}: {message}")
            return 1
        results[fn.__name__] = (ub, loops)
    plain, gather = results["_selftest_plain"], results["_selftest_gather"]
    good = plain[1] == 0 and gather[1] > 0 and plain[0] > 0
    print(f"self-test {'ok' if good else 'FAILED'}: plain kernel {plain[1]} scalar loops, UB {plain[0]} B; "
          f"gather kernel {gather[1]} scalar loops (must be > 0), UB {gather[0]} B")  # fmt: skip
    return 0 if good else 1


def default_bishengir() -> str | None:
    """bishengir-compile of the installed ascendnpu-ir wheel (ascendnpuir/bin), if any."""
    import importlib.util

    spec = importlib.util.find_spec("ascendnpuir")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0], "bin", "bishengir-compile")
    return str(path) if path.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bishengir", default=default_bishengir(),
                   help="path of bishengir-compile (default: the installed ascendnpu-ir's)")  # fmt: skip
    p.add_argument("--manifest", type=Path, default=Path(tempfile.gettempdir(), "normkit-npu-launches.json"),
                   help="stage 1's manifest of recorded variants (recorded if missing)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--budget-kb", type=float, default=176.0, help="UB budget per kernel (default 176 KB)")
    p.add_argument("--table", type=Path, help="write the per-kernel UB / scalar-loop table here (markdown)")
    p.add_argument("--kernels", nargs="*", help="only kernels whose short name starts so (e.g. group_norm.)")
    p.add_argument("--ttadapters", type=Path, help="stage 1's index of .ttadapter files (--ttadapters there)")
    p.add_argument("--selftest", action="store_true")
    a = p.parse_args(argv)
    if not a.bishengir:
        p.error("--bishengir: no path given and no ascendnpu-ir installed (pip install ascendnpu-ir==1.2.0)")
    if a.selftest:
        stage1.import_normkit()
        return selftest(a.bishengir)
    return run(a.bishengir, a.manifest, a.jobs, a.budget_kb, a.table, a.kernels, a.ttadapters)


if __name__ == "__main__":
    sys.exit(main())
