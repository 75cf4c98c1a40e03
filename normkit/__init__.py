"""normkit: normalization kernels in Triton for NVIDIA GPUs and Ascend NPUs.

``normkit.layer_norm(x, ...)`` works like ``torch.nn.functional.layer_norm(x, ...)`` on ``cuda``,
``npu`` and ``cpu`` tensors; the backend is chosen per call from ``x.device``. The same functions
take DTensors (tensor / sequence parallelism; :mod:`normkit.distributed`).

``import normkit`` itself imports neither torch nor Triton (so ``normkit --help`` answers at once):
each name below is imported from its module on first use (PEP 562). Any op, ``normkit.nn`` or
``normkit.patch`` loads the API and registers the custom operators ``torch.ops.normkit.*``; code that
calls those operators without touching normkit's functions first runs ``import normkit.ops``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it (normkit.distributed: normkit.functional's ops, also on
# DTensors). Modules listed as their own entry are returned as modules.
_PUBLIC = {
    "backend_for": "normkit.dispatch",
    "backend_name_for": "normkit.dispatch",
    "InvalidArgument": "normkit.errors",
    "InvalidDtype": "normkit.errors",
    **dict.fromkeys(("layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm", "add_rms_norm",
                     "group_norm", "instance_norm", "batch_norm"), "normkit.distributed"),  # fmt: skip
    "nn": "normkit.nn",
    "patch": "normkit.patching",
    "unpatch": "normkit.patching",
}
# Submodules that `import normkit` used to load as a side effect: still reachable as attributes.
_SUBMODULES = ("dispatch", "errors", "distributed", "functional", "ops", "reference", "nn", "patching")

__all__ = [
    "layer_norm",
    "rms_norm",
    "softmax",
    "log_softmax",
    "add_layer_norm",
    "add_rms_norm",
    "group_norm",
    "instance_norm",
    "batch_norm",
    "nn",
    "patch",
    "unpatch",
    "backend_for",
    "backend_name_for",
    "InvalidArgument",
    "InvalidDtype",
    "__version__",
]


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports
    from normkit import nn
    from normkit.dispatch import backend_for, backend_name_for
    from normkit.distributed import (
        add_layer_norm,
        add_rms_norm,
        batch_norm,
        group_norm,
        instance_norm,
        layer_norm,
        log_softmax,
        rms_norm,
        softmax,
    )
    from normkit.errors import InvalidArgument, InvalidDtype
    from normkit.patching import patch, unpatch
