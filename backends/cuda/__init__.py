"""CUDA backend: Triton kernels for NVIDIA GPUs, launch shape adapted to the row length.

Implements the backend contract (docs/design.md). The launchers also run on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1), which is how CI exercises these kernels.
"""

import torch

from normkit.backends.cuda.batch_norm import (
    batch_norm_apply,
    batch_norm_bwd,
    batch_norm_stats,
    batch_norm_train_fwd,
    plan_batch_norm,
)
from normkit.backends.cuda.group_norm import group_norm_bwd, group_norm_fwd, plan_group_norm
from normkit.backends.cuda.layer_norm import (
    add_layer_norm_bwd,
    add_layer_norm_fwd,
    add_rms_norm_bwd,
    add_rms_norm_fwd,
    layer_norm_bwd,
    layer_norm_fwd,
    plan_row_norm,
    rms_norm_bwd,
    rms_norm_fwd,
)
from normkit.backends.cuda.native import accelerate
from normkit.backends.cuda.softmax import plan_softmax, softmax_bwd, softmax_fwd

NAME = "cuda"
# Every output of every contract function is a new allocation (never an input or a view of one):
# plans.fresh skips its alias check for this backend (tests/test_api.py checks the promise).
FRESH_OUTPUTS = True
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

__all__ = [
    "NAME",
    "SUPPORTED_DTYPES",
    "FRESH_OUTPUTS",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "softmax_fwd",
    "softmax_bwd",
    "add_layer_norm_fwd",
    "add_layer_norm_bwd",
    "add_rms_norm_fwd",
    "add_rms_norm_bwd",
    "group_norm_fwd",
    "group_norm_bwd",
    "batch_norm_stats",
    "batch_norm_apply",
    "batch_norm_train_fwd",
    "batch_norm_bwd",
    "plan_row_norm",  # optional plans, inference and training (normkit.functional; docs/backends.md)
    "plan_softmax",
    "plan_group_norm",
    "plan_batch_norm",
    "accelerate",  # optional: the backend's own plans replayed from C++ where built (native.py)
]
