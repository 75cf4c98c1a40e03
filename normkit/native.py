"""The native extension: C++ that normkit compiles on the user's machine (``normkit native``).

It holds the CUDA plans' host path (backends/cuda/native.cpp, used by backends/cuda/native.py: a
plan's launches replayed from C++, its training step a C++ autograd node) and CPU LayerNorm of
16-bit inputs with gradients as one C++ operator each way (normkit/native_cpu.cpp, used by
normkit/cpu.py). Both are optional: without the extension the same calls run in Python and on
torch's operators, with the same results.

It is compiled once per torch / Python / source (30-60 s; a C++ compiler and ninja, no CUDA toolkit:
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

_STATE: dict = {}  # "module": the loaded extension or None, "why": why there is none
_LOCK = threading.Lock()


def sources() -> list[Path]:
    """The C++ sources: the CUDA host path's (found without importing the CUDA backend, which imports
    Triton) and the CPU LayerNorm's."""
    cuda = importlib.util.find_spec("normkit.backends.cuda")
    here = Path(cuda.submodule_search_locations[0])
    return [here / "native.cpp", Path(__file__).with_name("native_cpu.cpp")]


def build_dir() -> Path:
    """Where the extension for this torch, Python and source is (to be) compiled."""
    root = Path(os.environ.get("NORMKIT_NATIVE_DIR") or Path.home() / ".cache" / "normkit" / "native")
    return root / name()


def name() -> str:
    digest = hashlib.sha256()
    for source in sources():
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {sys.platform}".encode())
    return f"normkit_native_{digest.hexdigest()[:16]}"


def module(build: bool | None = None):
    """The compiled extension, or None (:func:`why` says why). ``build``: compile it if it is not
    there (default: only under ``NORMKIT_NATIVE=build``)."""
    if "module" in _STATE and not (build and _STATE["module"] is None):
        return _STATE["module"]
    with _LOCK:
        mode = os.environ.get("NORMKIT_NATIVE", "auto")
        if mode == "0":
            _STATE.update(module=None, why="NORMKIT_NATIVE=0")
            return None
        build = mode == "build" if build is None else build
        try:  # (a missing source, as native.cpp in a wheel before 4e6a466, is a reason too, not an error)
            path = build_dir() / f"{name()}.so"
            if path.exists():
                spec = importlib.util.spec_from_file_location(name(), path)
                found = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(found)
            elif build:
                from torch.utils import cpp_extension

                build_dir().mkdir(parents=True, exist_ok=True)
                # OpenMP: torch's at::parallel_for is OpenMP on Linux, and serial in code built without it
                openmp = ["-fopenmp"] if sys.platform == "linux" else []
                found = cpp_extension.load(name(), [str(s) for s in sources()], extra_cflags=["-O3", *openmp],
                                           extra_ldflags=openmp, build_directory=str(build_dir()),
                                           verbose=False)  # fmt: skip
            else:
                _STATE.update(module=None, why=f"not built ({path}): run `normkit native`")
                return None
        except Exception as e:  # no compiler, no ninja, a torch without headers: the Python path serves
            _STATE.update(module=None, why=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
            return None
        _STATE.update(module=found, why=None)
        return found


def why() -> str | None:
    """Why :func:`module` is None (None when it is loaded or was not looked for yet)."""
    return _STATE.get("why")
