"""Which kernel variants the GPU tests reach, and the smallest set of tests that reaches them all.

A *variant* is what one launch of a CUDA-backend kernel exercised: the kernel (``module.name``), the
dtype class of its tensors (fp32 or 16-bit), the flags that tell ops apart (IS_RMS, ADD, DROPOUT,
LOG, CL, ...; backends/cuda/launch.py FLAGS), and how it was launched (through ``fn[grid]`` and
compiled, directly from the launch cache, or from a plan). Tests record them under
``NORMKIT_RECORD_LAUNCHES=DIR`` (tests/conftest.py).

    python ci/gpu_smoke.py select DIR JUNIT   # from a full `pytest -m cuda` run: writes
                                              # ci/gpu-smoke-tests.txt and ci/gpu-smoke-variants.txt
    python ci/gpu_smoke.py check DIR          # a smoke run reached every variant in the list, and
                                              # every kernel of backends/cuda in both dtype classes
    python ci/gpu_smoke.py tolerances DIR     # the largest fraction of each tolerance the tests used

``select`` is a greedy weighted set cover: it takes, again and again, the test that reaches the most
variants not yet reached per second of its run time (from the junit file), so the smoke run
(ci/gpu-smoke.sh) reaches everything the full suite reaches in a fraction of its time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "ci" / "gpu-smoke-tests.txt"
VARIANTS = ROOT / "ci" / "gpu-smoke-variants.txt"
MODULES = ("batch_norm", "group_norm", "layer_norm", "reduce", "softmax")  # backends/cuda/<name>.py
_SMEM = "16-bit only: shared-memory rows are chosen for 2-byte elements (config._smem_config itemsizes)"
# Kernels served in one dtype class only, and why (the full `pytest -m cuda` of 2026-11-26 reaches
# every other kernel in both).
ONE_CLASS = {
    "normkit.backends.cuda.group_norm._bwd_smem_kernel": ("16-bit", _SMEM),
    "normkit.backends.cuda.layer_norm._bwd_smem_kernel": ("16-bit", _SMEM),
    "normkit.backends.cuda.layer_norm._bwd_smem_split_kernel": ("16-bit", _SMEM),
    "normkit.backends.cuda.layer_norm._fwd_smem_kernel": ("16-bit", _SMEM),
    "normkit.backends.cuda.softmax._fwd_smem_kernel": ("16-bit", _SMEM),
    "normkit.backends.cuda.softmax._fwd_looped_kernel": ("fp32", "16-bit rows past the fused limit go to "
                                                         "shared memory or split rows (config.forward)"),
}
FUZZ = "tests/test_fuzz.py::"
# Tests chosen first, whatever the records say: a plan (path=bound) is made once a signature has
# been seen, and the plan cache is process-wide, so a test's reach of a plan path can depend on the
# tests its worker ran before (the 2026-11-26 smoke missed BatchNorm's in-parts plan that way).
# These clear the plan cache themselves and reach their plan paths in any order.
ALWAYS = ("tests/test_gpu_hardening.py::test_batch_norm_plans_match_reference[(4, 8, 32, 32)-torch.float32]",)
PATHS = ("direct", "bound")  # launch paths each kernel must take where the full suite takes them


def _load(directory: str) -> tuple[list, list]:
    launches, tolerances = [], []
    for f in sorted(Path(directory).glob("*.json")):
        data = json.loads(f.read_text())
        launches += [tuple(x[:3]) + (tuple(map(tuple, x[3])), x[4]) for x in data["launches"]]
        tolerances += data["tolerances"]
    return launches, tolerances


def variants_of(launch) -> set[str]:
    """The variant lines one recorded launch reaches: kernel x class x flags, and kernel x path."""
    _, kernel, klass, flags, path = launch
    flag = ",".join(f"{k}={v}" for k, v in flags) or "-"
    out = {f"{kernel} {klass} {flag}"}
    if path in PATHS:
        out.add(f"{kernel} path={path}")
    return out


def kernels() -> list[str]:
    """Every launchable kernel of backends/cuda (a JITFunction whose name ends in ``_kernel``)."""
    from triton.runtime.jit import JITFunction

    names = []
    for m in MODULES:
        mod = importlib.import_module(f"normkit.backends.cuda.{m}")
        names += [f"{mod.__name__}.{n}" for n, v in vars(mod).items()
                  if n.endswith("_kernel") and isinstance(v, JITFunction)]  # fmt: skip
    return sorted(names)


def _durations(junit: str) -> dict[str, float]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # tests.test_x -> tests/test_x.py; tests.test_x.TestClass -> tests/test_x.py::TestClass
        i = next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        node = "/".join(parts[: i + 1]) + ".py" + "".join(f"::{p}" for p in parts[i + 1 :])
        out[f"{node}::{case.get('name')}"] = float(case.get("time", 0))
    return out


def select(directory: str, junit: str) -> int:
    launches, _ = _load(directory)
    per_test: dict[str, set[str]] = defaultdict(set)
    paths: dict[tuple, set[str]] = defaultdict(set)  # (test, kernel) -> launch paths
    for launch in launches:
        if launch[0]:
            per_test[launch[0]] |= variants_of(launch)
            paths[launch[0], launch[1]].add(launch[4])
    # A test reaches the direct / plan path by itself only if it also made the kernel's earlier
    # launch (compile, resp. compile or direct): otherwise another test in its worker did, and the
    # smoke run's scheduling may not repeat that. Only such tests count for those variants.
    for (test, kernel), seen in paths.items():
        if "direct" in seen and "compile" not in seen:
            per_test[test].discard(f"{kernel} path=direct")
        if "bound" in seen and not seen & {"compile", "direct"}:
            per_test[test].discard(f"{kernel} path=bound")
    times = _durations(junit)
    want = set().union(*per_test.values())
    # the fuzz tests draw their cases (hypothesis): what they reach can change with the examples
    fuzz = {t for t in per_test if t.startswith(FUZZ)}
    only_fuzz = want - set().union(*(v for t, v in per_test.items() if t not in fuzz))
    for t in fuzz:
        del per_test[t]
    want -= only_fuzz
    left, chosen, total = set(want), list(ALWAYS), sum(times.get(t, 30.0) for t in ALWAYS)
    for t in ALWAYS:
        left -= per_test.get(t, set())
    while left:
        test = max(per_test, key=lambda t: len(per_test[t] & left) / (times.get(t, 30.0) + 1.0))
        gain = per_test[test] & left
        if not gain:
            break
        chosen.append(test)
        total += times.get(test, 30.0)
        left -= gain
    TESTS.write_text("".join(f"{t}\n" for t in sorted(chosen)))
    VARIANTS.write_text("".join(f"{v}\n" for v in sorted(want)))
    for v in sorted(only_fuzz):
        print(f"  only the fuzz tests reach (left out): {v}")
    print(f"{len(want)} variants from {len(per_test)} tests; {len(chosen)} tests reach them all "
          f"({total:.0f} s of test time in the full run) -> {TESTS.name}, {VARIANTS.name}")  # fmt: skip
    return 0


def check(directory: str) -> int:
    launches, _ = _load(directory)
    reached = set().union(*(variants_of(x) for x in launches)) if launches else set()
    want = set(VARIANTS.read_text().split("\n")) - {""}
    missing = sorted(want - reached)
    by_class = {(v.split()[0], v.split()[1]) for v in reached if "path=" not in v}
    classes = {k: (ONE_CLASS[k][0],) if k in ONE_CLASS else ("fp32", "16-bit") for k in kernels()}
    unreached = [f"{k} {c}" for k, cs in classes.items() for c in cs if (k, c) not in by_class]
    n_kernels = len({v.split()[0] for v in reached})
    print(f"gpu smoke: {len(want) - len(missing)} of {len(want)} variants reached; {n_kernels} kernels, "
          f"{len(by_class)} kernel x dtype-class pairs")  # fmt: skip
    for v in missing:
        print(f"  NOT REACHED  {v}")
    for v in unreached:
        print(f"  KERNEL NOT REACHED  {v}")
    return 1 if missing or unreached else 0


def tolerances(directory: str) -> int:
    """Per (dtype, kind): the largest fraction of today's tolerance used, and the largest
    max|error| / (max|expected| + |expected|) (the tolerance scaled to the output: what atol = rtol
    = c x max|expected| would need c to be), with the test that set it."""
    _, records = _load(directory)
    worst: dict[tuple, list] = {}
    for test, dtype, kind, used, q in records:
        w = worst.setdefault((dtype, kind), [0.0, "", 0.0, "", 0])
        w[4] += 1
        if used > w[0]:
            w[0], w[1] = used, test
        if q > w[2]:
            w[2], w[3] = q, test
    print(f"{'dtype':9s} {'kind':6s} {'checks':>7s} {'used':>7s} {'scaled c':>9s}  where (scaled c)")
    for (dtype, kind), (used, _, q, qt, n) in sorted(worst.items()):
        print(f"{dtype:9s} {kind:6s} {n:7d} {used:7.3f} {q:9.2e}  {qt[:110]}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select", help="choose the smoke tests from a full run's records")
    s.add_argument("records")
    s.add_argument("junit")
    sub.add_parser("check", help="did a smoke run reach every variant").add_argument("records")
    sub.add_parser("tolerances", help="tolerance use per dtype and kind").add_argument("records")
    a = p.parse_args(argv)
    if a.cmd == "select":
        return select(a.records, a.junit)
    return check(a.records) if a.cmd == "check" else tolerances(a.records)


if __name__ == "__main__":
    sys.exit(main())
