"""The native extension: C++ that normkit compiles on the user's machine (``normkit native``).

Two extensions: the CUDA plans' host path (``kind="cuda"``: backends/cuda/native.cpp, used by
backends/cuda/native.py: a plan's launches replayed from C++, its training step a C++ autograd node)
and the CPU calls' (``kind="cpu"``: normkit/native_cpu.cpp, used by normkit/cpu.py): the door, which
checks a common CPU call in C++ and runs the torch operator normkit.cpu would (``cpu.DOOR``), and
LayerNorm and GroupNorm of 16-bit inputs with gradients as one C++ operator each way. Both are
optional: without them the same calls run in Python and on torch's operators, with the same results.

Each is compiled once per torch / Python / source (30-60 s; a C++ compiler and ninja, no CUDA toolkit:
the driver is looked up at run time) into ``$NORMKIT_NATIVE_DIR`` (default
``~/.cache/normkit/native``). By default a process uses it when it is built and never compiles it by
itself; ``NORMKIT_NATIVE=build`` builds it on first use, ``NORMKIT_NATIVE=0`` turns it off. This
module imports neither Triton nor a backend.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from pathlib import Path

import torch

_STATE: dict = {}  # kind -> {"module": the loaded extension or None, "why": why there is none}
_LOCK = threading.Lock()
# The two extensions, built and loaded apart (one failing to build leaves the other):
# "cuda" the CUDA plans' host path, "cpu" the CPU LayerNorm / GroupNorm. OpenMP for the CPU one:
# torch's at::parallel_for is OpenMP on Linux, and serial in code built without it.
_OPENMP = ["-fopenmp"] if sys.platform == "linux" else []
_FLAGS = {"cuda": (["-O2"], []), "cpu": (["-O3", *_OPENMP], _OPENMP)}
KINDS = tuple(_FLAGS)


def source(kind: str = "cuda") -> Path:
    """The C++ source of extension ``kind`` (the CUDA one found without importing the CUDA backend,
    which imports Triton)."""
    if kind == "cpu":
        return Path(__file__).with_name("native_cpu.cpp")
    cuda = importlib.util.find_spec("normkit.backends.cuda")
    return Path(cuda.submodule_search_locations[0]) / "native.cpp"


def build_dir(kind: str = "cuda") -> Path:
    """Where extension ``kind`` for this torch, Python and source is (to be) compiled."""
    root = Path(os.environ.get("NORMKIT_NATIVE_DIR") or Path.home() / ".cache" / "normkit" / "native")
    return root / name(kind)


def name(kind: str = "cuda") -> str:
    digest = hashlib.sha256(source(kind).read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {sys.platform}".encode())
    return f"normkit_native_{'cpu_' if kind == 'cpu' else ''}{digest.hexdigest()[:16]}"


def module(build: bool | None = None, kind: str = "cuda"):
    """Compiled extension ``kind``, or None (:func:`why` says why). ``build``: compile it if it is
    not there (default: only under ``NORMKIT_NATIVE=build``)."""
    state = _STATE.get(kind)  # (set whole, under the lock: a reader sees the old state or the new)
    if state is not None and not (build and state["module"] is None):
        return state["module"]
    with _LOCK:
        found, reason = None, None
        mode = os.environ.get("NORMKIT_NATIVE", "auto")
        build = mode == "build" if build is None else build
        try:  # (a missing source, as native.cpp in a wheel before 4e6a466, is a reason too, not an error)
            path = build_dir(kind) / f"{name(kind)}.so"
            if mode == "0":
                reason = "NORMKIT_NATIVE=0"
            elif path.exists():
                spec = importlib.util.spec_from_file_location(name(kind), path)
                found = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(found)
            elif build:
                from torch.utils import cpp_extension

                build_dir(kind).mkdir(parents=True, exist_ok=True)
                cflags, ldflags = _FLAGS[kind]
                found = cpp_extension.load(name(kind), [str(source(kind))], extra_cflags=cflags,
                                           extra_ldflags=ldflags, build_directory=str(build_dir(kind)),
                                           verbose=False)  # fmt: skip
            else:
                reason = f"not built ({path}): run `normkit native`"
        except Exception as e:  # no compiler, no ninja, a torch without headers: the Python path serves
            found, reason = None, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        _STATE[kind] = {"module": found, "why": reason}
        return found


def why(kind: str = "cuda") -> str | None:
    """Why :func:`module` of ``kind`` is None (None when it is loaded or was not looked for yet)."""
    return (_STATE.get(kind) or {}).get("why")
