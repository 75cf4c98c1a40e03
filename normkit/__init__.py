"""normkit: normalization kernels in Triton for NVIDIA GPUs and Ascend NPUs.

``normkit.layer_norm(x, ...)`` works like ``torch.nn.functional.layer_norm(x, ...)`` on ``cuda``,
``npu`` and ``cpu`` tensors; the backend is chosen per call from ``x.device``. The same functions
take DTensors (tensor / sequence parallelism; :mod:`normkit.distributed`).
"""

from normkit.dispatch import backend_for, backend_name_for
from normkit.errors import InvalidArgument, InvalidDtype
from normkit.distributed import (  # normkit.functional's ops, also on DTensors
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
from normkit import nn
from normkit.patching import patch, unpatch

__version__ = "0.1.0"

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
