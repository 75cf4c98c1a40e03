"""Kernel launches with less host time: a compiled kernel is launched directly once Triton has
compiled (and launched) it for the same specialization.

``fn[grid](*args, **meta)`` costs ~31-34 us of host time on the H100 machine's host, most of it
Triton's Python: binding and specializing every argument, the cache key string, launch metadata
(docs/tuning-log.md T11). The backward of a row norm makes 2-3 launches; in ``normkit bench`` that
host time showed up as GPU idle time in the backward cells. :func:`launch` keys Triton's own
``CompiledKernel`` by what Triton specializes a kernel on, and calls its launcher directly:

- a tensor: its dtype and whether its address is 16-byte aligned;
- an int: whether it equals 1, whether it is divisible by 16, and its width (i32, i64, u64);
- a float: nothing (always fp32); None, a bool or any other value: the value itself;
- the constexpr / launch keywords (``BLOCK_N=...``, ``num_warps=...``), and the current device.

The first call with a new key goes through ``fn[grid]`` unchanged (compiling if needed), and so do
all calls under the interpreter (``TRITON_INTERPRET=1``, where kernels are not ``JITFunction``s)
and all calls where compat.py finds the compiled kernel's launcher missing or changed.
Triton's launch hooks (profilers) are called with the same metadata as ``fn[grid]`` gives them;
an empty hook chain (Triton's default) is skipped.

Building that key from every argument costs ~4 us of the ~16 us a launch takes on the H100 host
(docs/tuning-log.md T13). The hot call sites pass ``key=``: a tuple they build from what they know
decides the specialization (shape, strides, dtypes, alignment of the tensors they did not allocate
themselves), ~1 us. :data:`CHECK_KEYS` (on in the GPU test suite) makes every keyed launch also build
the full key and fail if the two disagree, so a call-site key that misses an argument is a test
failure, not a wrong kernel.
"""

from __future__ import annotations

import inspect
import os
import threading

import torch
import triton
from triton.runtime.jit import JITFunction

from normkit import dispatch
from normkit.backends.cuda import compat, config

_I32 = range(-(2**31), 2**31)
_CACHE: dict = {}  # key -> (compiled kernel, resolved trailing kernel arguments, the full key)
CACHE_SIZE = 4096  # compiled kernels remembered (all specializations of all kernels); then cleared
# Check each keyed launch against the full key (tests; env NORMKIT_CHECK_LAUNCH_KEYS=1 at import).
CHECK_KEYS = os.environ.get("NORMKIT_CHECK_LAUNCH_KEYS", "") == "1"
# While native.py records a plan: (thread ident, list); each launch on that thread appends
# (cache entry, grid, args) for a direct one, "first" for a Bound's first (compiling) ones, None for
# any other (the recording is then refused).
TRACE: tuple | None = None
# Tests (tests/conftest.py under NORMKIT_RECORD_LAUNCHES, for ci/gpu_smoke.py) set a set here: each
# launch adds (test, kernel, dtype class, op flags, path) to it. None: nothing is recorded.
RECORD: set | None = None
FLAGS = ("IS_RMS", "ADD", "HAS_R", "DROPOUT", "LOG", "CL", "ONE_READ", "TRAINING")  # what tells ops apart


def _record(fn, args, meta, path: str) -> None:
    """Add this launch to :data:`RECORD`: the running test, ``module.kernel``, the dtype class of its
    floating-point tensors (16-bit if any is 16-bit), the :data:`FLAGS` it was given, and the launch
    path (``compile``: through ``fn[grid]``; ``direct``: the cached compiled kernel; ``bound``: a plan;
    ``interpreter``; ``plain``: ``fn[grid]`` for a kernel that is not a JITFunction)."""
    inner = getattr(fn, "fn", fn)
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point}
    klass = "16-bit" if any(d.itemsize == 2 for d in dtypes) else "fp32" if dtypes else "none"
    names = list(inspect.signature(inner).parameters)
    given = {**dict(zip(names, args)), **meta}
    flags = tuple((f, int(given[f])) for f in FLAGS if f in given and given[f] is not None)
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    RECORD.add((test, f"{inner.__module__}.{inner.__name__}", klass, flags, path))


def int_spec(a: int) -> tuple:
    """What Triton specializes an int argument on (for call-site keys)."""
    return (a == 1, a % 16 == 0, a in _I32, a < 2**63)


def tensor_spec(t: torch.Tensor | None) -> tuple | None:
    """What Triton specializes a tensor argument on, None for None (for call-site keys)."""
    return None if t is None else (t.dtype, t.data_ptr() % 16 == 0)


def _spec(args) -> tuple:
    out = []
    for a in args:
        t = type(a)
        if t is int:
            out.append((a == 1, a % 16 == 0, a in _I32, a < 2**63))
        elif t is float:
            out.append(float)
        elif isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        else:
            out.append((t, a))
    return tuple(out)


def _tail(fn, nargs: int, meta: dict) -> tuple:
    """The values of the kernel parameters after the ``nargs`` positional ones, in order: from
    ``meta`` or the parameter's default. Fixed for a cache key (the meta values are part of it)."""
    params = list(inspect.signature(fn.fn).parameters.values())[nargs:]
    return tuple(meta[p.name] if p.name in meta else p.default for p in params)


def _active(hook):
    """``hook``, or None for no hook or an empty ``HookChain`` (Triton's default: it would build
    launch metadata and be called twice a launch to do nothing)."""
    return hook if hook is not None and getattr(hook, "calls", True) else None


def launch(fn, grid: tuple, *args, key: tuple | None = None, **meta):
    """``fn[grid](*args, **meta)``, through the compiled kernel when one is cached for these
    arguments' specialization (see the module doc). Positional ``args`` are the kernel's leading
    parameters; the others (constexprs) come by keyword or take their defaults. ``key``: a hashable
    the caller guarantees to determine ``_spec(args)`` and ``meta`` for ``fn`` (checked under
    :data:`CHECK_KEYS`); without it the key is built from the arguments. Returns the cache entry
    used (for :class:`Bound`), None when there is none (interpreter, first launch of a key)."""
    if TRACE is not None:
        _trace(None)
    if not isinstance(fn, JITFunction):
        if RECORD is not None:
            _record(fn, args, meta, "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "plain")
        fn[grid](*args, **meta)
        return None
    device = torch.cuda.current_device()
    full = None
    if key is None:
        key = full = (fn, device, _spec(args), tuple(meta.items()))
    else:  # a call-site key assumes the launch choices: with those forced (config.forced), also by the Force
        key = (fn, device, key, dispatch.strategy(config.BACKEND))
    cached = _CACHE.get(key)
    if RECORD is not None:
        _record(fn, args, meta, "compile" if cached is None else "direct")
    if cached is None:
        kernel = fn[grid](*args, **meta)
        if len(_CACHE) >= CACHE_SIZE:
            _CACHE.clear()
        if compat.direct_launch_ok(kernel):
            full = full or (fn, device, _spec(args), tuple(meta.items()))
            _CACHE[key] = kernel, _tail(fn, len(args), meta), full
        return None
    if CHECK_KEYS and full is None:
        _check(cached, key, args, meta)
    _run(cached, (*grid, 1, 1), device, args)
    return cached


def _trace(entry) -> None:
    if TRACE is not None and TRACE[0] == threading.get_ident():
        TRACE[1].append(entry)


def quiet() -> bool:
    """Whether launches may skip this module: no launch being recorded for tests (:data:`RECORD`) and
    no Triton launch hook (a profiler) set."""
    if RECORD is not None:
        return False
    runtime = triton.knobs.runtime  # (on every replayed call: _active's test inlined)
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or not getattr(enter, "calls", True)) and (
        leave is None or not getattr(leave, "calls", True))


def _check(cached, key, args, meta) -> None:
    fn, device = cached[2][:2]
    if cached[2] != (fn, device, _spec(args), tuple(meta.items())):
        raise AssertionError(
            f"launch key {key[2]!r} of {fn.__name__} does not determine its specialization: it was "
            f"compiled for {cached[2][2:]}, called with {(_spec(args), tuple(meta.items()))}"
        )


def _run(cached, g: tuple, device: int, args) -> None:
    kernel, tail, _ = cached
    stream = torch._C._cuda_getCurrentRawStream(device)
    runtime = triton.knobs.runtime  # launch hooks (profilers) are called as Triton calls them
    enter, leave = _active(runtime.launch_enter_hook), _active(runtime.launch_exit_hook)
    metadata = None if enter is None and leave is None else kernel.launch_metadata(g, stream, *args, *tail)
    try:
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, metadata, enter, leave,
                   *args, *tail)
    except TypeError as e:  # the launcher's signature changed (a Triton release): launch as Triton does
        fn, _, _, meta = cached[2]
        compat.disable("direct launch", f"CompiledKernel.run raised TypeError: {e}")
        fn[g[:3]](*args, **dict(meta))


class Bound:
    """One kernel launch site with everything but its leading arguments fixed (grid, constexprs) on
    CUDA device ``index`` (None for CPU tensors: each call a plain :func:`launch`, as under the
    interpreter): the first call launches through :func:`launch` (compiling if needed),
    later ones call the compiled kernel directly with no key at all. For plans (``plan_*`` in the op
    files), whose owner keys them by a call signature that fixes the specialization; :data:`CHECK_KEYS`
    checks that here too. Launches on the device's current stream, under its guard when another
    device is current."""

    __slots__ = ("fn", "grid", "g", "meta", "cached", "index")

    def __init__(self, fn, grid: tuple, index: int, **meta):
        self.fn, self.grid, self.g, self.meta = fn, grid, (*grid, 1, 1), meta
        self.cached, self.index = None, index

    def __call__(self, *args) -> None:
        if self.index is None:  # CPU tensors (the interpreter): nothing to keep
            launch(self.fn, self.grid, *args, **self.meta)
            return None
        device = torch.cuda.current_device()
        if device != self.index:
            with torch.cuda.device(self.index):
                return self(*args)
        if self.cached is None:
            if TRACE is not None:
                _trace("first")
            self.cached = launch(self.fn, self.grid, *args, **self.meta)
            return None
        if CHECK_KEYS:
            _check(self.cached, ("bound",), args, self.meta)
        if RECORD is not None:
            _record(self.fn, args, self.meta, "bound")
        if TRACE is not None:
            _trace((self.cached, self.g, args))
        _run(self.cached, self.g, device, args)
        return None
