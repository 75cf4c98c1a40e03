"""``torch.nn``-compatible modules that run normkit's kernels.

Each module subclasses its ``torch.nn`` twin and overrides only the method that computes (``forward``,
or ``_apply_instance_norm`` for InstanceNorm, so torch's input checks and no-batch handling stay), so
constructor arguments, parameters, buffers, ``state_dict`` keys and ``repr`` are torch's own:
``load_state_dict`` works both ways and ``isinstance(m, torch.nn.LayerNorm)`` holds. The forward
passes are plain functions that :mod:`normkit.patching` reuses when it patches existing models, so they
never call ``super()``.

:class:`AddLayerNorm` / :class:`AddRMSNorm` (no torch twin) fuse ``h = dropout(x) + residual`` with
the norm; their parameters and ``state_dict`` are those of ``torch.nn.LayerNorm`` / ``RMSNorm``.

DTensor inputs (tensor / sequence parallelism) run on each rank's shard: :mod:`normkit.distributed`.

Differences from torch: under autocast these modules keep the input dtype (torch runs its norms in
fp32 and returns fp32); tensors on devices normkit does not serve raise ``normkit.InvalidArgument``.
"""

from __future__ import annotations

import numbers
import warnings

import torch
from torch import nn

from normkit import distributed as F  # normkit.functional's ops, also on DTensors
from normkit.errors import InvalidArgument

__all__ = [
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "Softmax",
    "LogSoftmax",
    "AddLayerNorm",
    "AddRMSNorm",
]


# --- forward passes (module-level so that normkit.patching can put them on other classes) --------------


def _layer_norm_forward(self, input):
    return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


def _rms_norm_forward(self, x):
    return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def _group_norm_forward(self, input):
    return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


def _apply_instance_norm(self, input):
    # torch's _InstanceNorm._apply_instance_norm, on normkit.instance_norm.
    return F.instance_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                           self.training or not self.track_running_stats,
                           self.momentum if self.momentum is not None else 0.0, self.eps)  # fmt: skip


def _batch_norm_forward(self, input):
    """torch's _BatchNorm.forward on normkit.batch_norm: momentum=None is a cumulative average,
    num_batches_tracked counts training calls, eval uses the running statistics when tracked."""
    self._check_input_dim(input)
    factor = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked)
    training = self.training or (self.running_mean is None and self.running_var is None)
    use_buffers = not self.training or self.track_running_stats
    return F.batch_norm(input, self.running_mean if use_buffers else None,
                        self.running_var if use_buffers else None, self.weight, self.bias, training,
                        factor, self.eps)  # fmt: skip


def _softmax_dim(self, input, name: str) -> int:
    """``self.dim``, or torch's legacy implicit choice (with its deprecation warning) when None."""
    if self.dim is not None:
        return self.dim
    warnings.warn(f"Implicit dimension choice for {name} has been deprecated. "
                  "Change the call to include dim=X as an argument.", stacklevel=4)  # fmt: skip
    return 0 if input.dim() in (0, 1, 3) else 1


def _softmax_forward(self, input):
    return F.softmax(input, _softmax_dim(self, input, "softmax"))


def _log_softmax_forward(self, input):
    return F.log_softmax(input, _softmax_dim(self, input, "log_softmax"))


# --- torch.nn twins ---------------------------------------------------------------------------------


class LayerNorm(nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` on :func:`normkit.layer_norm`."""

    forward = _layer_norm_forward


class RMSNorm(nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` on :func:`normkit.rms_norm` (``eps=None``: ``finfo(input.dtype).eps``)."""

    forward = _rms_norm_forward


class GroupNorm(nn.GroupNorm):
    """:class:`torch.nn.GroupNorm` on :func:`normkit.group_norm`."""

    forward = _group_norm_forward


class InstanceNorm1d(nn.InstanceNorm1d):
    """:class:`torch.nn.InstanceNorm1d` on :func:`normkit.instance_norm`."""

    _apply_instance_norm = _apply_instance_norm


class InstanceNorm2d(nn.InstanceNorm2d):
    """:class:`torch.nn.InstanceNorm2d` on :func:`normkit.instance_norm`."""

    _apply_instance_norm = _apply_instance_norm


class InstanceNorm3d(nn.InstanceNorm3d):
    """:class:`torch.nn.InstanceNorm3d` on :func:`normkit.instance_norm`."""

    _apply_instance_norm = _apply_instance_norm


class BatchNorm1d(nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` on :func:`normkit.batch_norm`."""

    forward = _batch_norm_forward


class BatchNorm2d(nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` on :func:`normkit.batch_norm`."""

    forward = _batch_norm_forward


class BatchNorm3d(nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d` on :func:`normkit.batch_norm`."""

    forward = _batch_norm_forward


class Softmax(nn.Softmax):
    """:class:`torch.nn.Softmax` on :func:`normkit.softmax`."""

    forward = _softmax_forward


class LogSoftmax(nn.LogSoftmax):
    """:class:`torch.nn.LogSoftmax` on :func:`normkit.log_softmax`."""

    forward = _log_softmax_forward


# --- fused residual add + dropout + norm -------------------------------------------------------------


class _AddNorm:
    """Settings and repr shared by AddLayerNorm / AddRMSNorm (mixed in before the torch class)."""

    def _init_add(self, dropout_p, prenorm, residual_dtype, seed) -> None:
        name = type(self).__name__
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p <= 1:
            raise InvalidArgument(f"{name}: dropout_p must be a number in [0, 1], got {dropout_p!r}")
        if residual_dtype is not None and not isinstance(residual_dtype, torch.dtype):
            raise InvalidArgument(f"{name}: residual_dtype must be a torch.dtype or None, "
                                  f"got {residual_dtype!r}")  # fmt: skip
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise InvalidArgument(f"{name}: seed must be an int or None, got {seed!r}")
        self.dropout_p, self.prenorm = float(dropout_p), bool(prenorm)
        self.residual_dtype, self.seed = residual_dtype, seed

    def _dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def extra_repr(self) -> str:
        s = f"{super().extra_repr()}, dropout_p={self.dropout_p}, prenorm={self.prenorm}"
        if self.residual_dtype is not None:
            s += f", residual_dtype={self.residual_dtype}"
        return s + (f", seed={self.seed}" if self.seed is not None else "")


class AddLayerNorm(_AddNorm, nn.LayerNorm):
    """``h = dropout(x) + residual; y = layer_norm(h)`` in one pass (:func:`normkit.add_layer_norm`).

    ``forward(x, residual=None)`` returns ``y``, or ``(y, h)`` with ``prenorm=True`` (h, the residual
    stream, kept in ``residual_dtype``: default the residual's dtype). Dropout applies in training
    mode only (eval: ``dropout_p`` is 0). Each training call draws a fresh mask seed from torch's
    CPU generator (reproducible under ``torch.manual_seed``), unless ``seed`` fixes one: then every
    call uses the same mask. Parameters and ``state_dict`` are those of :class:`torch.nn.LayerNorm`.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *, dropout_p=0.0,
                 prenorm=False, residual_dtype=None, seed=None, device=None, dtype=None):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self._init_add(dropout_p, prenorm, residual_dtype, seed)

    def forward(self, x, residual=None):
        return F.add_layer_norm(x, residual, self.normalized_shape, self.weight, self.bias, self.eps,
                                self._dropout_p(), self.seed, self.residual_dtype, self.prenorm)  # fmt: skip


class AddRMSNorm(_AddNorm, nn.RMSNorm):
    """``h = dropout(x) + residual; y = rms_norm(h)`` in one pass (:func:`normkit.add_rms_norm`);
    see :class:`AddLayerNorm`. Parameters and ``state_dict`` are those of :class:`torch.nn.RMSNorm`."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, *, dropout_p=0.0, prenorm=False,
                 residual_dtype=None, seed=None, device=None, dtype=None):  # fmt: skip
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._init_add(dropout_p, prenorm, residual_dtype, seed)

    def forward(self, x, residual=None):
        return F.add_rms_norm(x, residual, self.normalized_shape, self.weight, self.eps, self._dropout_p(),
                              self.seed, self.residual_dtype, self.prenorm)  # fmt: skip
