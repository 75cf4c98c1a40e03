"""What the installed Triton offers beyond plain ``triton.jit``: the one place that knows Triton
releases apart.

Two fast paths depend on one Triton release or another:

- ``gluon``: the shared-memory kernels (smem.py and its users) are written in Gluon
  (``triton.experimental.gluon``), whose API still changes between releases. The names they use
  are looked up here, under their current and older spellings (``barrier``: ``thread_barrier`` up
  to 3.6; ``async_load``: ``async_copy_global_to_shared`` up to 3.7). Before ``config`` first
  chooses a Gluon kernel on a device, :func:`gluon_ok` compiles and runs a small probe kernel that
  uses every one of those names the way the kernels do; if the import, a name, the compile or the
  probe's result fails, the Gluon kernels are never chosen in this process and the plain-Triton
  kernels (fused, split rows, looped) serve with the same results.
- ``direct launch`` (launch.py): a compiled kernel's own launcher (``CompiledKernel.run`` with
  ``function`` / ``packed_metadata``) called without ``fn[grid]``'s Python. Where the compiled
  kernel lacks those, or the call raises a ``TypeError`` (a changed launcher signature), every
  launch goes through ``fn[grid]``.

A path that is skipped warns once per process (:class:`FastPathWarning`), naming the path and why;
:func:`disable` is also how a test forces a fallback. The range of Triton versions normkit is
tested with is in pyproject.toml (the ``cuda`` extra) and docs/backends.md.
"""

from __future__ import annotations

import warnings

import torch
import triton

try:  # triton-ascend and Triton < 3.4 have no Gluon
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
except ImportError as e:  # pragma: no cover - depends on the installed Triton
    gluon = gl = cp = None
    _MISSING = f"triton {triton.__version__} has no Gluon ({e})"
else:
    _MISSING = None


def _first(module, *names):
    """The first of ``names`` that ``module`` has (a renamed API: newest spelling first), or None."""
    return next((getattr(module, n) for n in names if module is not None and hasattr(module, n)), None)


# global -> shared cp.async: ``async_load`` from 3.8 (3.9 keeps the old name as a stub that raises)
async_copy = _first(cp, "async_load", "async_copy_global_to_shared")
# the CTA barrier: ``thread_barrier`` up to 3.6, ``barrier`` from 3.7
barrier = _first(gl, "barrier", "thread_barrier")
if _MISSING is None and (async_copy is None or barrier is None):  # pragma: no cover
    _MISSING = f"triton {triton.__version__}'s Gluon lacks cp.async loads or a CTA barrier"
# Gluon and every name the kernels use import (whether they compile and run: gluon_ok's probe).
HAS_GLUON = _MISSING is None

# Paths skipped in this process: name -> why. Filled by the checks below (and by tests).
_DISABLED: dict[str, str] = {}
_PROBED: dict[int, bool] = {}  # CUDA device index -> the Gluon probe passed


class FastPathWarning(RuntimeWarning):
    """A Triton-release-specific fast path was skipped; the portable kernels serve instead."""


def disable(path: str, why: str) -> None:
    """Skip fast path ``path`` ("gluon" or "direct launch") for the rest of the process, warning once;
    forget the launch configs and compiled kernels chosen with it."""
    if path in _DISABLED:
        return
    _DISABLED[path] = why
    warnings.warn(f"normkit: the {path} fast path is off in this process ({why}); the portable Triton "
                  f"kernels serve instead, with the same results", FastPathWarning, stacklevel=3)  # fmt: skip
    from normkit.backends.cuda import config

    config.clear_caches()


def disabled(path: str) -> str | None:
    """Why ``path`` is skipped in this process, or None."""
    return _DISABLED.get(path)


def gluon_ok(device: torch.device) -> bool:
    """Whether the Gluon kernels may be chosen on CUDA ``device``: Gluon and the names they use are
    there, and the probe kernel compiled and gave the right answer on this device (once a device)."""
    if _MISSING is not None:
        disable("gluon", _MISSING)
    if "gluon" in _DISABLED:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False  # no launch or synchronize inside a CUDA graph capture: probe on a later call
        _PROBED[index] = _probe(index)
    return _PROBED[index]


def _probe(index: int) -> bool:
    x = torch.arange(1024, dtype=torch.float16, device=f"cuda:{index}")
    y = torch.full_like(x, float("nan"))
    count = torch.zeros(1, dtype=torch.int32, device=x.device)
    try:
        with torch.cuda.device(index):
            _probe_kernel[(1,)](x, y, count, 1024, num_warps=4)
            torch.cuda.current_stream(index).synchronize()  # not the device: another stream may wait on us
    except Exception as e:  # any failure of the compile or launch means: not on this Triton
        last = str(e).strip().splitlines()[-1][:200] if str(e).strip() else ""
        disable("gluon", f"its probe kernel failed to compile or run on triton {triton.__version__}: "
                         f"{type(e).__name__}: {last}")  # fmt: skip
        return False
    if not (torch.equal(y, 2 * x) and int(count) == 1):
        disable("gluon", f"its probe kernel gave a wrong result on triton {triton.__version__}")
        return False
    return True


def _gluon_jit(fn):
    return gluon.jit(fn) if gluon is not None else fn


@_gluon_jit
def _probe_kernel(X, Y, Count, N: gl.constexpr):
    """Each Gluon construct the shared-memory kernels use: an unswizzled [2, N] buffer filled by
    ``cp.async`` (commit, wait), read back in the copy's layout, the CTA barrier, a release/acquire
    atomic, a volatile load, a static_range loop and a reduction; y = 2 x."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])  # 16-byte copies
    unswizzled: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    buf = gl.allocate_shared_memory(X.dtype.element_ty, [2, N], unswizzled)
    offs = gl.arange(0, N, layout=layout)
    for i in gl.static_range(2):
        async_copy(buf.index(i), X + offs, mask=offs < N)
        cp.commit_group()
    cp.wait_group(0)
    x = buf.index(0).load(layout).to(gl.float32) + buf.index(1).load(layout).to(gl.float32)
    barrier()
    total = gl.sum(gl.load(X + offs, volatile=True).to(gl.float32), axis=0)
    gl.atomic_add(Count, 1, sem="acq_rel", scope="gpu")
    gl.store(Y + offs, (x + total - total).to(Y.dtype.element_ty))


# Rows (BatchNorm: channels) in more than one part (config.IN_PARTS, off by default) gave wrong
# results on triton 3.9.0 (H100, 2026-11-25: fp32 LayerNorm (2, 270336) y off by up to 0.2 in 4.5% of
# the elements; BatchNorm (64, 3, 112, 112) dx different between two runs, every dtype) and on 3.8.0
# (H200, 2026-11-28: 7 in-parts tests failed, fp32 (add_)layer_norm (2, 270336) y off in 6.0% /
# 1.5% of the elements, BatchNorm (64, 3, 112, 112) dx different between runs); 3.6.0 and 3.7.1
# pass the same tests. Cause not found: the cp.async zero fill, the tagged words' 8-byte stores and
# volatile loads compile as on 3.6. Refused from 3.8 on, even where IN_PARTS.
IN_PARTS_WRONG_FROM = "3.8.0"


def in_parts_ok() -> str | None:
    """None where rows in parts may run on the installed Triton, else why not."""
    from packaging.version import Version

    if Version(triton.__version__) >= Version(IN_PARTS_WRONG_FROM):
        return f"rows in parts give wrong results on triton {triton.__version__} (>= {IN_PARTS_WRONG_FROM})"
    return None


def direct_launch_ok(kernel) -> bool:
    """Whether launch.py may call ``kernel`` (a ``CompiledKernel``) through its own launcher."""
    if "direct launch" in _DISABLED:
        return False
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


# Parameter types of a compiled kernel the native host path (native.py) passes itself: pointers,
# 32/64-bit ints, fp32 (what Triton gives a Python float).
_NATIVE_TYPES = ("i32", "i64", "u64", "fp32")


def native_launch(kernel) -> tuple:
    """``(function, threads, shared, types)`` for launching ``kernel`` (a ``CompiledKernel`` launched
    once) from C++ with cuLaunchKernel: its CUfunction, threads a program, dynamic shared memory and
    the type of each kernel parameter in order (``"constexpr"`` for those the launcher leaves out).
    Raises ValueError naming what the plain launch has that it would lose (clusters, cooperative or
    PDL launches, scratch memory, tensor descriptors, a parameter type it does not pass)."""
    md = kernel.metadata
    why = [name for name, bad in (
        ("a cluster", getattr(md, "num_ctas", 1) != 1
         or tuple(getattr(md, "cluster_dims", (1, 1, 1))) != (1, 1, 1)),
        ("a cooperative launch", getattr(md, "launch_cooperative_grid", False)),
        ("a PDL launch", getattr(md, "launch_pdl", False)),
        ("global scratch", getattr(md, "global_scratch_size", 0)),
        ("profile scratch", getattr(md, "profile_scratch_size", 0)),
        ("tensor descriptors", getattr(md, "tensordesc_meta", None)),
        ("no CUfunction", not getattr(kernel, "function", None)),
    ) if bad]  # fmt: skip
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    if not isinstance(signature, dict):
        why.append("no signature")
    else:
        passed = [t for t in signature.values() if t != "constexpr"]
        odd = [t for t in passed if not (isinstance(t, str) and t.startswith("*")) and t not in _NATIVE_TYPES]
        if odd:
            why.append(f"parameter types {odd}")
    if why:
        raise ValueError(f"{kernel.name}: {', '.join(why)}")
    return kernel.function, md.num_warps * 32, md.shared, list(signature.values())
