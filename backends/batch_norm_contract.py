"""BatchNorm's training forward for backends that run it as statistics, then apply.

``batch_norm_train_fwd`` is functional: the updated running statistics come back as new tensors
(the front end copies them into the module's buffers), so one custom operator with an autograd
formula can serve the whole training forward. The CUDA backend has its own (one read of x on
split channels, falling back to this composition); the NPU backend and the reference use this.
"""

from __future__ import annotations


def train_fwd_from(stats, apply):
    """``batch_norm_train_fwd`` over a backend's ``batch_norm_stats`` (which updates the running
    statistics it is given in place: here copies) and ``batch_norm_apply``."""

    def batch_norm_train_fwd(x, weight, bias, eps, momentum, running_mean, running_var):
        """x: (N, C, HW) contiguous -> (y, mean, rstd, running_mean', running_var'): this batch's
        statistics, and the running statistics after this step (None where not given)."""
        rm = None if running_mean is None else running_mean.clone()
        rv = None if running_var is None else running_var.clone()
        mean, rstd = stats(x, eps, momentum, rm, rv)
        return apply(x, weight, bias, mean, rstd), mean, rstd, rm, rv

    return batch_norm_train_fwd
