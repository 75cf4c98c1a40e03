"""NPU backend: Triton kernels written for Ascend NPUs (triton-ascend).

Implements the backend contract (docs/design.md) with Ascend's launch rules (``config.py``): fixed
1024-element column tiles and a persistent grid of vector-core count programs. fp32 math only, so
fp64 is not offered. The same kernels run on CPU tensors under Triton's interpreter and on CUDA
tensors with upstream Triton, which is how they are tested without Ascend hardware.
"""

import torch

from normkit.backends.npu.batch_norm import (
    batch_norm_apply,
    batch_norm_bwd,
    batch_norm_stats,
    batch_norm_train_fwd,
)
from normkit.backends.npu.group_norm import group_norm_bwd, group_norm_fwd
from normkit.backends.npu.layer_norm import (
    add_layer_norm_bwd,
    add_layer_norm_fwd,
    add_rms_norm_bwd,
    add_rms_norm_fwd,
    layer_norm_bwd,
    layer_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)
from normkit.backends.npu.softmax import softmax_bwd, softmax_fwd

NAME = "npu"
# Every output of every contract function is a new allocation (never an input or a view of one):
# plans.fresh skips its alias check for this backend (tests/test_api.py checks the promise).
FRESH_OUTPUTS = True
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

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
]
