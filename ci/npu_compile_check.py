"""Compile every NPU kernel with triton-ascend, for every variant the NPU backend launches.

Run by ci/npu-compile-check.sh inside its triton-ascend virtualenv (no CANN, no NPU, no torch_npu).

1. Discovery: every ``@triton.jit`` function defined in a module of ``normkit.backends.npu`` is a
   kernel that must be compiled (helpers it calls, e.g. from ``backends/common.py``, are compiled as
   part of it). A kernel with no recorded variant fails the check, so a new kernel cannot skip it.
2. Record: every op family of the public API runs on small CPU tensors routed to the NPU backend
   (``dispatch.use_backend``), forward and backward, for each dtype the backend supports and each
   flag combination the front end can produce. ``JITFunction.run`` is replaced by a recorder, so
   nothing is executed: each launch is reduced to (kernel, argument types, constexpr values, launch
   options) and written to a JSON manifest.
3. Compile: each unique variant goes through ``triton.compile(ASTSource(...), target=GPUTarget("npu",
   ...))`` with the signature, constants and attributes that ``JITFunction.run`` would build for it.
   Without CANN the pipeline stops after ``ttadapter`` with ``[ConvertLinalgRToBinary] encounters
   error: ASCEND_HOME_PATH is not set``: that (and only that, with the ttadapter output present)
   is a pass. Any earlier error fails the check with the kernel, the variant and the message.

Usage: python ci/npu_compile_check.py [all|record|compile] [--manifest PATH] [--jobs N]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import inspect
import io
import itertools
import json
import os
import pkgutil
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "normkit.backends.npu"
TARGET_ARCH = "Ascend910B4"
# The one error accepted: the first stage that needs CANN's bishengir-compile.
CANN_STAGE = "ConvertLinalgRToBinary"
CANN_MESSAGE = "ASCEND_HOME_PATH is not set"
MESSAGE_LIMIT = 4000  # characters of a compiler message printed per failing variant

os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions: nothing here runs a kernel

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def import_normkit():
    """normkit from this checkout: normkit/ as the package, backends/ as normkit.backends (the
    layout pyproject.toml installs), without installing anything into the virtualenv."""
    sys.path.insert(0, str(REPO))
    import normkit

    if str(REPO) not in normkit.__path__:
        normkit.__path__.append(str(REPO))  # normkit.backends -> REPO/backends
    npu = importlib.import_module(PACKAGE)
    for mod in (normkit, npu):
        if not Path(mod.__file__).resolve().is_relative_to(REPO):
            raise SystemExit(f"{mod.__name__} was imported from {mod.__file__}, not from {REPO}")
    return normkit


# --- discovery -----------------------------------------------------------------------------------


def discover() -> dict[str, JITFunction]:
    """Qualified name -> JITFunction, for every @triton.jit defined in a module of the NPU package."""
    pkg = importlib.import_module(PACKAGE)
    found = {}
    for info in pkgutil.walk_packages(pkg.__path__, PACKAGE + "."):
        mod = importlib.import_module(info.name)
        for obj in vars(mod).values():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__:
                found[qualname(obj)] = obj
    return dict(sorted(found.items()))


def qualname(fn: JITFunction) -> str:
    return f"{fn.fn.__module__}.{fn.__name__}"


def short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


def callees(fn: JITFunction) -> list[JITFunction]:
    """@triton.jit functions that ``fn`` calls directly (``name(...)`` or ``module.name(...)``)."""
    out = []
    for node in ast.walk(fn.parse()):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        if isinstance(target, ast.Name):
            obj = fn.fn.__globals__.get(target.id)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            obj = getattr(fn.fn.__globals__.get(target.value.id), target.attr, None)
        else:
            continue
        if isinstance(obj, JITFunction) and obj is not fn and obj not in out:
            out.append(obj)
    return out


def reachable(kernels) -> dict[str, JITFunction]:
    """Every normkit @triton.jit helper compiled as part of ``kernels`` (transitively)."""
    seen, todo = {}, list(kernels)
    while todo:
        for helper in callees(todo.pop()):
            if qualname(helper).startswith("normkit.") and qualname(helper) not in seen:
                seen[qualname(helper)] = helper
                todo.append(helper)
    return dict(sorted(seen.items()))


# --- recording -----------------------------------------------------------------------------------

TORCH_TO_TRITON = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def arg_type(value) -> str:
    """Triton's signature type for a runtime argument (the rules of triton.runtime.jit.mangle_type)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        if -(2**31) <= value <= 2**31 - 1:
            return "i32"
        return "u64" if 2**63 <= value <= 2**64 - 1 else "i64"
    if isinstance(value, float):
        return "fp32"
    if isinstance(value, torch.Tensor):
        return "*" + TORCH_TO_TRITON[value.dtype]
    raise TypeError(f"unsupported kernel argument of type {type(value).__name__}")


def constexpr_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, triton.language.dtype):
        return {"tl.dtype": value.name}
    raise TypeError(f"unsupported constexpr value {value!r}")


class Recorder:
    """Replaces JITFunction.run: each launch is recorded, nothing is compiled or executed."""

    def __init__(self):
        self.case = "?"
        self.kernels: dict[str, JITFunction] = {}
        self.variants: dict[str, dict[str, dict]] = {}

    def __enter__(self):
        self._run = JITFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            recorder.record(fn, args, kwargs)
            return None

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        JITFunction.run = self._run

    def record(self, fn: JITFunction, args, kwargs):
        names = {p.name for p in fn.params}
        options = {k: v for k, v in kwargs.items() if k not in names}
        bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        sig, constexprs = {}, {}
        for p in fn.params:
            value = bound.arguments[p.name]
            if p.is_constexpr:
                constexprs[p.name] = constexpr_value(value)
            else:
                sig[p.name] = arg_type(value)
        variant = {"constexprs": constexprs, "signature": sig, "options": options}
        key = json.dumps(variant, sort_keys=True)
        name = qualname(fn)
        self.kernels[name] = fn
        entry = self.variants.setdefault(name, {}).setdefault(key, dict(variant, launches=0, first=self.case))
        entry["launches"] += 1


# Row lengths of the row-norm cases (config.resident_rows): rows held in UB, 64 a tile (8) and one
# row of the widest tile (2000 in 2048, the most UB; with dropout 1000 in 1024), and rows that loop
# over BLOCK_SIZE column tiles (2064 > config.ROW_NORM_WIDTH). Softmax likewise with its limit
# (config.SOFTMAX_WIDTH). Multiples of 16 keep row strides 16-element aligned.
ROW_LENGTHS = (8, 2000, 2064)
DROPOUT_ROW_LENGTHS = (8, 1000, 2064)
SOFTMAX_LENGTHS = (8, 4000, 4112)


def record_cases(normkit, dtypes):
    """(label, thunk) for every op family x dtype x flag combination; each thunk runs forward and
    backward through the public API on small CPU tensors."""
    F = normkit
    f32 = torch.float32
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype, grad=True):
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)

    def backward(*outs):
        sum(o.float().sum() for o in outs).backward()

    flags = [(True, True), (True, False), (False, True), (False, False)]
    for dt in dtypes:
        name = TORCH_TO_TRITON[dt]
        # Parameters in the input's dtype, and fp32 parameters with a half-precision input (AMP).
        for pdt in dict.fromkeys([dt, f32]):
            pre = f"x={name} params={TORCH_TO_TRITON[pdt]}"
            for w, b in flags:
                for n in ROW_LENGTHS:
                    yield (f"layer_norm {pre} N={n} weight={w} bias={b}",
                           lambda dt=dt, pdt=pdt, w=w, b=b, n=n: backward(F.layer_norm(
                               t((2, 3, n), dt), (n,), t(n, pdt) if w else None, t(n, pdt) if b else None)))
                yield (f"group_norm {pre} weight={w} bias={b}", lambda dt=dt, pdt=pdt, w=w, b=b: backward(
                    F.group_norm(t((2, 4, 3, 2), dt), 2, t(4, pdt) if w else None, t(4, pdt) if b else None)))
                yield (f"instance_norm {pre} weight={w} bias={b} running stats",
                       lambda dt=dt, pdt=pdt, w=w, b=b: backward(F.instance_norm(
                           t((2, 4, 6), dt), torch.zeros(4), torch.ones(4), t(4, pdt) if w else None,
                           t(4, pdt) if b else None)))  # fmt: skip
                for training in (True, False):
                    yield (f"batch_norm {pre} weight={w} bias={b} training={training}",
                           lambda dt=dt, pdt=pdt, w=w, b=b, tr=training: backward(F.batch_norm(
                               t((3, 4, 5), dt), torch.zeros(4, dtype=pdt), torch.ones(4, dtype=pdt),
                               t(4, pdt) if w else None, t(4, pdt) if b else None, training=tr)))  # fmt: skip
            for w, n in itertools.product((True, False), ROW_LENGTHS):
                yield (f"rms_norm {pre} N={n} weight={w}", lambda dt=dt, pdt=pdt, w=w, n=n: backward(
                    F.rms_norm(t((2, 3, n), dt), (n,), t(n, pdt) if w else None)))
            residuals = {"none": None, "same dtype": dt, "fp32": f32}
            dropouts = {"p=0": (0.0, None), "p=0.1 seed=i32": (0.1, 1234), "p=0.1 seed=i64": (0.1, 2**40 + 1)}
            for op, (res, rdt), rdtype, (drop, (p, seed)), prenorm, (w, b), n in itertools.product(
                    ("add_layer_norm", "add_rms_norm"), residuals.items(), (None, f32), dropouts.items(),
                    (False, True), flags, sorted({*ROW_LENGTHS, *DROPOUT_ROW_LENGTHS})):  # fmt: skip
                if n not in (DROPOUT_ROW_LENGTHS if p else ROW_LENGTHS):
                    continue
                if op == "add_rms_norm" and not b:
                    continue  # no bias: the b=True and b=False cases are the same call
                label = (f"{op} {pre} N={n} residual={res} residual_dtype={rdtype and 'fp32'} {drop} "
                         f"prenorm={prenorm} weight={w}" + ("" if op == "add_rms_norm" else f" bias={b}"))

                def add_norm(op=op, dt=dt, pdt=pdt, rdt=rdt, rdtype=rdtype, p=p, seed=seed, prenorm=prenorm,
                             w=w, b=b, n=n):  # fmt: skip
                    kw = dict(dropout_p=p, seed=seed, residual_dtype=rdtype, prenorm=prenorm)
                    if op == "add_layer_norm":
                        kw["bias"] = t(n, pdt) if b else None
                    out = getattr(F, op)(t((2, 3, n), dt), t((2, 3, n), rdt) if rdt else None, (n,),
                                         t(n, pdt) if w else None, **kw)  # fmt: skip
                    backward(*(out if prenorm else (out,)))

                yield label, add_norm
        for op in ("softmax", "log_softmax"):
            for n in SOFTMAX_LENGTHS:
                yield (f"{op} x={name} N={n}",
                       lambda op=op, dt=dt, n=n: backward(getattr(F, op)(t((2, 3, n), dt), dim=-1)))


def record(manifest: Path) -> dict:
    normkit = import_normkit()
    from normkit import dispatch

    npu = importlib.import_module(PACKAGE)
    kernels = discover()
    t0 = time.perf_counter()
    cases = 0
    with Recorder() as rec, dispatch.use_backend("cpu", PACKAGE):
        for label, thunk in record_cases(normkit, npu.SUPPORTED_DTYPES):
            rec.case = label
            thunk()
            cases += 1
    names = sorted(set(kernels) | set(rec.variants))
    launched = [rec.kernels[n] for n in rec.variants]
    data = {
        "triton": triton.__version__,
        "dtypes": [TORCH_TO_TRITON[d] for d in npu.SUPPORTED_DTYPES],
        "cases": cases,
        "kernels": {
            n: [rec.variants.get(n, {})[k] for k in sorted(rec.variants.get(n, {}))] for n in names
        },
        "helpers": sorted(reachable(launched)),
    }
    manifest.write_text(json.dumps(data, indent=1) + "\n")  # dicts keep parameter order
    total = sum(len(v) for v in data["kernels"].values())
    print(f"recorded {total} variants of {len(names)} kernels from {cases} API calls (forward + backward) "
          f"in {time.perf_counter() - t0:.1f}s -> {manifest}")
    return data


# --- compiling -----------------------------------------------------------------------------------


class _Pointer:
    """Stand-in for a tensor argument: 16-byte aligned, as torch's allocations are."""

    def __init__(self, dtype):
        self.dtype = dtype

    def data_ptr(self):
        return 4096


# Scalars that are neither 1 nor a multiple of 16: no value specialization, the general kernel.
_SCALARS = {"i1": False, "i32": 3, "i64": 2**40 + 3, "u64": 2**63 + 3, "fp32": 0.5, "none": None}


def _constexpr(value):
    if isinstance(value, dict) and "tl.dtype" in value:
        return triton.language.dtype(value["tl.dtype"])
    return value


def format_error(fn: JITFunction, e: BaseException) -> str:
    """A front-end error as: the kernel line it points at, the @triton.jit calls it went through,
    and the root cause (Triton nests each callee's error, repr and all, inside its caller's)."""
    from triton.compiler.errors import CompilationError

    chain = [e]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    head = e
    if isinstance(e, CompilationError) and getattr(e.node, "lineno", None):
        lines, start = inspect.getsourcelines(fn.fn)
        def_line = start + next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
        file = Path(inspect.getsourcefile(fn.fn)).resolve()
        where = file.relative_to(REPO) if file.is_relative_to(REPO) else file
        source = fn.src.splitlines()[e.node.lineno - 1].strip()
        head = f"{where}:{def_line + e.node.lineno - 1}: {source}"
    calls = [m.group(1) for c in chain[1:] if isinstance(c, CompilationError) and c.src
             and (m := re.match(r"\s*def\s+(\w+)", c.src))]  # fmt: skip
    root = chain[-1]
    cause = root.message if isinstance(root, CompilationError) else f"{type(root).__name__}: {root}"
    via = f"\n  via {' -> '.join(calls)}" if calls else ""
    return f"{type(e).__name__} at {head}{via}\n  {cause.strip()}\n"


# triton-adapter-opt 3.2.0 crashes now and then on a variant it compiles on other runs: its
# --triton-to-unstructure pass reads memory it does not own (2026-11-26: the ttir of
# _fwd_rows_kernel[ROWS=64 WIDTH=16 IS_RMS HAS_W ADD HAS_R], that pass alone, same file and command:
# 3-8 of 300 runs segfault with address randomisation, 400 of 400 under `setarch -R`, 2 of 100 with
# and without --mlir-disable-threading; a run that passes writes the same output). CI saw it as
# assertions on the MLIR context or a bare segfault, 1-5 of 2068-3066 variants a run, whole-row kernels
# only. A crash (LLVM's "Stack dump:" banner, printed for a signal or an assertion) is compiled again,
# up to CRASH_RETRIES times, and a variant that passes so is reported apart ("ttadapter after a
# compiler crash", kernels named). A diagnostic (an error the compiler reports) is never retried.
CRASH_RETRIES = 5
_CRASH = ("Stack dump:", "Assertion `")


def compile_variant(fn: JITFunction, variant: dict, arch: str = TARGET_ARCH) -> tuple[bool, str]:
    """(passed, detail) of :func:`_compile_once`, compiled again after a compiler crash."""
    ok, detail = _compile_once(fn, variant, arch)
    for _ in range(CRASH_RETRIES):
        if ok or not any(mark in detail for mark in _CRASH):
            break
        ok, again = _compile_once(fn, variant, arch)
        detail = f"{again} after a compiler crash" if ok else detail
    return ok, detail


def _compile_once(fn: JITFunction, variant: dict, arch: str = TARGET_ARCH) -> tuple[bool, str]:
    """(passed, detail). Builds what JITFunction.run builds: signature of the non-constexpr
    parameters (None -> *i8), attributes (pointer alignment), constants (constexprs, None)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.compiler.errors import MLIRCompilationError

    target = GPUTarget("npu", arch, 0)
    backend = make_backend(target)
    values = []
    for p in fn.params:
        if p.is_constexpr:
            values.append(_constexpr(variant["constexprs"][p.name]))
        else:
            ty = variant["signature"][p.name]
            values.append(_Pointer(ty[1:]) if ty.startswith("*") else _SCALARS[ty])
    types = variant["signature"]  # in parameter order (the code generator binds by position)
    signature = {p.name: "*i8" if types[p.name] == "none" else types[p.name] for p in fn.params
                 if not p.is_constexpr}  # fmt: skip
    attrs = backend.get_attrs_descriptor(fn.params, values)
    constant_params = attrs.get_constants()
    constants = {p.name: v for v, p in zip(values, fn.params)
                 if p.is_constexpr or p.num in constant_params or v is None}  # fmt: skip
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            triton.compile(ASTSource(fn, signature, constants, attrs), target=target,
                           options=dict(variant["options"]))  # fmt: skip
    except MLIRCompilationError as e:
        message = e.message
        if e.stage_name == CANN_STAGE and CANN_MESSAGE in message:
            cache = re.search(r"The compiled kernel cache is in (\S+)", message)
            ttadapter = cache and Path(cache.group(1), f"{fn.__name__}.ttadapter")
            if ttadapter and ttadapter.is_file() and ttadapter.stat().st_size > 0:
                _TTADAPTER[0] = str(ttadapter)
                return True, "ttadapter"
            return False, f"{CANN_STAGE} reached but no ttadapter output was found:\n{message}"
        # Keep the tool's own message; drop the crash backtrace's address lines.
        message = "\n".join(line for line in message.splitlines()
                            if not re.match(r"\s*#\d+ 0x[0-9a-f]+ ", line) and "PLEASE submit" not in line)
        return False, f"stage {e.stage_name}:{message}\n{out.getvalue()}"
    except Exception as e:  # front end (ttir generation) and anything else
        return False, format_error(fn, e) + out.getvalue()
    return True, "npubin"  # CANN is installed: the whole pipeline ran


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[str, JITFunction]:
    return discover()


# The .ttadapter file of the last variant _compile_once passed in this process (stage 2 plans it).
_TTADAPTER: list[str | None] = [None]


def _compile_task(task):
    name, index, variant = task
    kernels = _kernels()
    t0 = time.perf_counter()
    _TTADAPTER[0] = None
    ok, detail = compile_variant(kernels[name], variant)
    return name, index, ok, detail, time.perf_counter() - t0, _TTADAPTER[0] if ok else None


def parallel_map(fn, tasks: list, jobs: int, chunksize: int = 1) -> list:
    """``[fn(t) for t in tasks]`` in ``jobs`` forked processes (in this one for jobs <= 1)."""
    if jobs <= 1:
        return [fn(t) for t in tasks]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(fn, tasks, chunksize=chunksize))


def describe(variant: dict) -> str:
    consts = " ".join(f"{k}={v}" for k, v in variant["constexprs"].items() if k != "BLOCK_SIZE")
    sig = ", ".join(f"{k}: {v}" for k, v in variant["signature"].items())
    opts = f" options={variant['options']}" if variant["options"] else ""
    return f"[{consts}]{opts} ({sig})"


def compile_all(manifest: Path, jobs: int, index: Path | None = None) -> int:
    """Compile every variant in ``manifest``; print the table and each distinct failure. ``index``:
    write {kernel: {variant number: its .ttadapter file}} there, for stage 2 (ci/npu_stage2.py), which
    then plans those files instead of compiling the variants again (the files stay in the Triton cache
    directory, TRITON_CACHE_DIR, of this run)."""
    import_normkit()
    data = json.loads(manifest.read_text())
    kernels = discover()
    recorded = data["kernels"]
    # (kernel, problem) -> variants it hit; "-" stands for the kernel as a whole.
    problems: dict[tuple[str, str], list[str]] = {}
    for name in kernels:
        if name not in recorded:
            problems[(name, "not in the manifest (it was recorded before the kernel existed)")] = ["-"]
        elif not recorded[name]:
            problems[(name, "no launch of this kernel was recorded: make record_cases() (in "
                            "ci/npu_compile_check.py) call the op and flags that launch it")] = ["-"]
    for name in recorded:
        if name not in kernels:
            problems[(name, "recorded in the manifest but not defined in the NPU backend any more")] = ["-"]
    print(f"triton {triton.__version__} ({Path(triton.__file__).parent}), target npu/{TARGET_ARCH}; "
          f"variants recorded under triton {data['triton']} from {data['cases']} API calls")
    print("helpers compiled inside the kernels: " + ", ".join(h.rsplit(".", 1)[1] for h in data["helpers"]))
    tasks = [(n, i, v) for n, vs in recorded.items() if n in kernels for i, v in enumerate(vs)]
    t0 = time.perf_counter()
    results = parallel_map(_compile_task, tasks, jobs, chunksize=4)
    elapsed = time.perf_counter() - t0
    passed, failed, reached = Counter(), Counter(), Counter()
    if index:
        files: dict[str, dict[int, str]] = {}
        for name, i, ok, _, _, path in results:
            if ok and path:
                files.setdefault(name, {})[i] = path
        index.write_text(json.dumps(files))
    for name, index, ok, detail, _, _ in results:
        if ok:
            passed[name] += 1
            reached[detail] += 1
        else:
            failed[name] += 1
            problems.setdefault((name, detail), []).append(describe(recorded[name][index]))
    names = sorted(set(kernels) | set(recorded))
    width = max(len("kernel"), *(len(short(n)) for n in names))
    print(f"\n{'kernel':<{width}}  variants  passed  failed")
    rows = [(short(n), len(recorded.get(n, [])), passed[n],
             failed[n] + sum(1 for (k, _), v in problems.items() if k == n and v == ["-"])) for n in names]
    for row in rows + [("total", *(sum(r[i] for r in rows) for i in (1, 2, 3)))]:
        print(f"{row[0]:<{width}}  {row[1]:>8}  {row[2]:>6}  {row[3]:>6}")
    for (name, detail), variants in problems.items():
        if len(detail) > MESSAGE_LIMIT:
            detail = detail[:MESSAGE_LIMIT] + f"\n... ({len(detail) - MESSAGE_LIMIT} more characters)"
        shown = "\n".join(f"    {v}" for v in variants[:3])
        more = f"\n    ... and {len(variants) - 3} more variants" if len(variants) > 3 else ""
        print(f"\nFAILED {short(name)}: {len(variants)} variant(s) with the same error\n{shown}{more}\n"
              f"{detail.rstrip()}" if variants != ["-"] else f"\nFAILED {short(name)}: {detail}")
    crashed = Counter(short(name) for name, _, ok, detail, _, _ in results if ok and detail.endswith("crash"))
    if crashed:
        print("\npassed after a compiler crash (triton-adapter-opt, compiled again): "
              + ", ".join(f"{k} ({n})" for k, n in sorted(crashed.items())))
    stages = ", ".join(f"{n} reached {stage}" for stage, n in sorted(reached.items()))
    verdict = "FAILED" if problems else "ok"
    print(f"\nnpu compile check {verdict}: {len(tasks)} variants of {len(names)} kernels compiled for "
          f"npu/{TARGET_ARCH} in {elapsed:.1f}s with {jobs} jobs ({stages or 'none passed'}); "
          f"{sum(failed.values())} variant(s) failed, {len(problems)} distinct problem(s)")
    return 1 if problems else 0


# --- self-test: the check must reject a kernel that does not lower for Ascend -------------------


@triton.jit
def _selftest_ok(X, Y, n, BLOCK: triton.language.constexpr):
    """Passes: the subset the NPU kernels use (masked loads, tl.where on values)."""
    offs = triton.language.arange(0, BLOCK)
    mask = offs < n
    x = triton.language.load(X + offs, mask=mask, other=0.0)
    triton.language.store(Y + offs, triton.language.where(x > 0, x, 0.0), mask=mask)


@triton.jit
def _selftest_where_on_pointers(X, Y, n, BLOCK: triton.language.constexpr):
    """Must fail: tl.where choosing between pointers, which triton-adapter-opt cannot lower."""
    offs = triton.language.arange(0, BLOCK)
    mask = offs < n
    ptrs = triton.language.where(offs < BLOCK // 2, X + offs, Y + offs)
    triton.language.store(Y + offs, triton.language.load(ptrs, mask=mask, other=0.0), mask=mask)


def selftest() -> int:
    """Compile a good and a deliberately bad kernel: the check is only worth something if the bad
    one fails (and the good one passes) with this triton-ascend."""
    variant = {"signature": {"X": "*fp32", "Y": "*fp32", "n": "i32"}, "constexprs": {"BLOCK": 1024},
               "options": {}}  # fmt: skip
    ok, detail = compile_variant(_selftest_ok, variant)
    bad_ok, bad_detail = compile_variant(_selftest_where_on_pointers, variant)
    error = " | ".join(line.strip() for line in bad_detail.splitlines() if line.strip())[:400]
    good = detail.splitlines()[0] if ok else detail
    verdict = "rejected, as it must be" if not bad_ok else "PASSED: the check cannot see this error"
    print(f"self-test: good kernel {'passed' if ok else 'FAILED'} ({good}); tl.where on pointers "
          f"{verdict}: {error}")
    return 0 if ok and not bad_ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", nargs="?", default="all", choices=("all", "selftest", "record", "compile"))
    parser.add_argument("--manifest", type=Path, help="JSON manifest of launches (default: a temp file)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--ttadapters", type=Path, help="write where each variant's .ttadapter is (stage 2)")
    args = parser.parse_args(argv)
    if args.step in ("all", "selftest") and selftest():
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        manifest = args.manifest or Path(tmp, "npu-launches.json")
        if args.step in ("all", "record"):
            record(manifest)
        if args.step in ("all", "compile"):
            return compile_all(manifest, args.jobs, args.ttadapters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
