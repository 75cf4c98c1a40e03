"""The row ops as PyTorch custom operators (``torch.ops.normkit.*``), with fake and autograd kernels.

Registered with :func:`torch.library.custom_op`, so ``torch.compile(..., fullgraph=True)`` treats
each one as a single opaque node (no graph break, no tracing into Triton launchers): the fake
kernels give output shapes and dtypes, ``register_autograd`` wires each forward op to its backward
op. The real kernels pick the backend at run time from the input's device (overrides from
:func:`normkit.dispatch.use_backend` included; empty inputs go to the reference) and launch under
that device's guard. ``normkit.functional`` validates arguments and calls these while
torch.compile traces; eager calls run plans instead (:mod:`normkit.plans`), which call the same
contract functions (or the backend's own plans).

Optional outputs (a weight gradient when there is no weight, ...) come back as empty tensors and
are turned into None here: custom operators return tensors only. Outputs never alias inputs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from normkit import dispatch, higher_order, reference
from normkit.plans import _NONE, contract_function, fresh, in_layout_of, on, unit_stride
from normkit.plans import stat_dtype as _stat_dtype


def _backend(x: Tensor, fn: str):
    """The module whose contract function ``fn`` serves x: its device's backend, or the reference
    where x is empty or the backend leaves ``fn`` to it (plans.contract_function)."""
    if x.numel() == 0:
        return reference
    return contract_function(dispatch.backend_for(x.device), fn)[1]


def _empty_grad(p: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_empty(_NONE) if p is None else torch.empty_like(p)


def _fake_param_grads(like: Tensor, weight: Optional[Tensor], bias_dtype: Optional[torch.dtype]):
    """Fake (dweight, dbias) of a backward operator: per-column (rows) or per-channel (images),
    i.e. ``like.shape[1]`` entries; empty where the forward had no weight / bias."""
    db = like.new_empty(_NONE) if bias_dtype is None else like.new_empty(like.shape[1], dtype=bias_dtype)
    return _empty_grad(weight, like), db


# --- LayerNorm / RMSNorm -------------------------------------------------------------------------


@custom_op("normkit::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(M, N) rows -> (y, mean, rstd)."""
    with on(x.device):
        backend = _backend(x, "layer_norm_fwd")
        out = backend.layer_norm_fwd(x, weight, bias, eps)
    return fresh(out, x, (x, weight, bias), backend)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty(x.shape[0], dtype=_stat_dtype(x))
    return torch.empty_like(x), stat, torch.empty_like(stat)


@custom_op("normkit::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with on(x.device):
        backend = _backend(x, "layer_norm_bwd")
        out = backend.layer_norm_bwd(dy, x, weight, mean, rstd, bias_dtype)
    return fresh(out, x, (dy, x, weight, mean, rstd), backend)


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, bias_dtype):
    return torch.empty_like(x), *_fake_param_grads(x, weight, bias_dtype)


def _layer_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the statistics outputs
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype, ctx.eps = None if bias is None else bias.dtype, inputs[3]


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # only the statistics were used, and they carry no gradient
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: a backward autograd can differentiate again
        dx, dw, db = higher_order.row_norm(dy, x, weight, ctx.bias_dtype, ctx.eps, False)
    else:
        dx, dw, db = layer_norm_bwd(unit_stride(dy), x, weight, mean, rstd, ctx.bias_dtype)
    return dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None, None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


@custom_op("normkit::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(M, N) rows -> (y, rstd)."""
    with on(x.device):
        backend = _backend(x, "rms_norm_fwd")
        out = backend.rms_norm_fwd(x, weight, eps)
    return fresh(out, x, (x, weight), backend)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=_stat_dtype(x))


@custom_op("normkit::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    """-> (dx, dweight or empty)."""
    with on(x.device):
        backend = _backend(x, "rms_norm_bwd")
        out = backend.rms_norm_bwd(dy, x, weight, rstd)
    return fresh(out, x, (dy, x, weight, rstd), backend)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x), _empty_grad(weight, x)


def _rms_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradient for rstd
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph
        dx, dw, _ = higher_order.row_norm(dy, x, weight, None, ctx.eps, True)
    else:
        dx, dw = rms_norm_bwd(unit_stride(dy), x, weight, rstd)
    return dx, dw if weight is not None else None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# --- softmax / log_softmax -----------------------------------------------------------------------


@custom_op("normkit::softmax_fwd", mutates_args=())
def softmax_fwd(x: Tensor, log: bool) -> Tensor:
    """(M, N) rows -> softmax (log_softmax when ``log``) of each row."""
    with on(x.device):
        backend = _backend(x, "softmax_fwd")
        return fresh((backend.softmax_fwd(x, log),), x, (x,), backend)[0]


@softmax_fwd.register_fake
def _(x, log):
    return torch.empty_like(x)


@custom_op("normkit::softmax_bwd", mutates_args=())
def softmax_bwd(dy: Tensor, y: Tensor, log: bool) -> Tensor:
    with on(y.device):
        backend = _backend(y, "softmax_bwd")
        return fresh((backend.softmax_bwd(dy, y, log),), y, (dy, y), backend)[0]


@softmax_bwd.register_fake
def _(dy, y, log):
    return torch.empty_like(y)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.log = inputs[1]


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph
        return higher_order.softmax(dy, y, ctx.log), None
    return softmax_bwd(unit_stride(dy), y, ctx.log), None


softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# --- fused residual add + dropout + LayerNorm / RMSNorm ------------------------------------------


@custom_op("normkit::add_norm_fwd", mutates_args=())
def add_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                 eps: float, dropout_p: float, seed: int, h_dtype: torch.dtype, is_rms: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """h = dropout(x) + residual; y = norm(h) -> (y, h, mean, rstd); mean is empty for RMSNorm."""
    ins = (x, residual, weight, bias)
    with on(x.device):
        backend = _backend(x, "add_rms_norm_fwd" if is_rms else "add_layer_norm_fwd")
        if is_rms:
            y, h, rstd = backend.add_rms_norm_fwd(x, residual, weight, eps, dropout_p, seed, h_dtype)
            mean = None
        else:
            y, h, mean, rstd = backend.add_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, seed,
                                                          h_dtype)  # fmt: skip
    # Statistics in x's math dtype on every backend (the reference would follow h's).
    stat = _stat_dtype(x)
    mean = None if mean is None else mean.to(stat)
    return fresh((y, h, mean, rstd.to(stat)), x, ins, backend)


@add_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, dropout_p, seed, h_dtype, is_rms):
    rstd = x.new_empty(x.shape[0], dtype=_stat_dtype(x))
    mean = x.new_empty(_NONE) if is_rms else torch.empty_like(rstd)
    return torch.empty_like(x), torch.empty_like(x, dtype=h_dtype), mean, rstd


@custom_op("normkit::add_norm_bwd", mutates_args=())
def add_norm_bwd(dy: Tensor, dh: Optional[Tensor], h: Tensor, weight: Optional[Tensor], mean: Tensor,
                 rstd: Tensor, bias_dtype: Optional[torch.dtype], dropout_p: float, seed: int,
                 x_dtype: torch.dtype, residual_dtype: Optional[torch.dtype], is_rms: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dresidual or empty, dweight or empty, dbias or empty)."""
    drop = (dropout_p, seed, x_dtype, residual_dtype)
    with on(h.device):
        backend = _backend(h, "add_rms_norm_bwd" if is_rms else "add_layer_norm_bwd")
        if is_rms:
            dx, dres, dw = backend.add_rms_norm_bwd(dy, dh, h, weight, rstd, *drop)
            db = None
        else:
            dx, dres, dw, db = backend.add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, bias_dtype, *drop)
    return fresh((dx, dres, dw, db), h, (dy, dh, h, weight, mean, rstd), backend)


@add_norm_bwd.register_fake
def _(dy, dh, h, weight, mean, rstd, bias_dtype, dropout_p, seed, x_dtype, residual_dtype, is_rms):
    dres = h.new_empty(_NONE) if residual_dtype is None else torch.empty_like(h, dtype=residual_dtype)
    return torch.empty_like(h, dtype=x_dtype), dres, *_fake_param_grads(h, weight, bias_dtype)


def _add_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # h's gradient stays None when h is unused: no read of zeros
    x, residual, weight, bias, ctx.eps, dropout_p, seed, _, is_rms = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h, weight, mean, rstd)
    ctx.args = (None if bias is None else bias.dtype, dropout_p, seed, x.dtype,
                None if residual is None else residual.dtype, is_rms)  # fmt: skip


def _add_norm_backward(ctx, dy, dh, _dmean, _drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    bias_dtype, dropout_p, seed, x_dtype, residual_dtype, is_rms = ctx.args
    if torch.is_grad_enabled():  # create_graph
        keep_scale = None
        if dropout_p > 0:  # the backend's own mask x 1 / (1 - p): its backward of dh = 1, dy = 0
            acc = _stat_dtype(h)
            with torch.no_grad():
                keep_scale = add_norm_bwd(
                    torch.zeros_like(h, dtype=x_dtype), torch.ones_like(h), h, weight, mean, rstd, bias_dtype,
                    dropout_p, seed, acc, None, is_rms)[0]  # fmt: skip
        dx, dres, dw, db = higher_order.add_norm(dy, dh, h, weight, bias_dtype, ctx.eps, is_rms, keep_scale,
                                                 x_dtype, residual_dtype)  # fmt: skip
        return (dx, dres, dw if weight is not None else None, db if bias_dtype is not None else None,
                None, None, None, None, None)  # fmt: skip
    y_unused = dy is None  # then no gradient reaches the weight and bias: None, as torch gives
    dy = torch.zeros_like(h, dtype=x_dtype) if y_unused else unit_stride(dy)
    dh = None if dh is None else unit_stride(dh)
    dx, dres, dw, db = add_norm_bwd(dy, dh, h, weight, mean, rstd, bias_dtype, dropout_p, seed,
                                               x_dtype, residual_dtype, is_rms)  # fmt: skip
    if y_unused:
        dw = db = None
    return (dx, dres if residual_dtype is not None else None, dw if weight is not None else None,
            db if bias_dtype is not None else None, None, None, None, None, None)


add_norm_fwd.register_autograd(_add_norm_backward, setup_context=_add_norm_setup)


# --- GroupNorm (InstanceNorm) --------------------------------------------------------------------


@custom_op("normkit::group_norm_fwd", mutates_args=())
def group_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], num_groups: int, eps: float
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x: (N, C, HW), contiguous or channels-last -> (y in x's layout, mean, rstd), statistics per
    (sample, group): (N * G,)."""
    with on(x.device):
        backend = _backend(x, "group_norm_fwd")
        out = backend.group_norm_fwd(x, weight, bias, num_groups, eps)
    return fresh(out, x, (x, weight, bias), backend)


@group_norm_fwd.register_fake
def _(x, weight, bias, num_groups, eps):
    stat = x.new_empty(x.shape[0] * num_groups, dtype=_stat_dtype(x))
    return torch.empty_like(x), stat, torch.empty_like(stat)


@custom_op("normkit::group_norm_bwd", mutates_args=())
def group_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   num_groups: int, bias_dtype: Optional[torch.dtype]
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with on(x.device):
        backend = _backend(x, "group_norm_bwd")
        out = backend.group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype)
    return fresh(out, x, (dy, x, weight, mean, rstd), backend)


@group_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    return torch.empty_like(x), *_fake_param_grads(x, weight, bias_dtype)


def _group_norm_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the statistics outputs
    x, weight, bias, num_groups, ctx.eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.num_groups, ctx.bias_dtype = num_groups, None if bias is None else bias.dtype


def _group_norm_backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph
        dx, dw, db = higher_order.group_norm(dy, x, weight, ctx.bias_dtype, ctx.num_groups, ctx.eps)
    else:
        dx, dw, db = group_norm_bwd(in_layout_of(dy, x), x, weight, mean, rstd, ctx.num_groups,
                                                ctx.bias_dtype)  # fmt: skip
    return dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None, None, None


group_norm_fwd.register_autograd(_group_norm_backward, setup_context=_group_norm_setup)


# --- BatchNorm -----------------------------------------------------------------------------------


@custom_op("normkit::batch_norm_stats", mutates_args=("running_mean", "running_var"))
def batch_norm_stats(x: Tensor, eps: float, momentum: float, running_mean: Optional[Tensor],
                     running_var: Optional[Tensor]) -> tuple[Tensor, Tensor]:  # fmt: skip
    """x: (N, C, HW) contiguous -> per-channel (mean, rstd), (C,) each; updates the running
    statistics (when given) in place. Not differentiable by itself: batch_norm_fwd's backward
    (training=True) accounts for the statistics' gradient."""
    with on(x.device):
        backend = _backend(x, "batch_norm_stats")
        return fresh(backend.batch_norm_stats(x, eps, momentum, running_mean, running_var), x, (x,), backend)


@batch_norm_stats.register_fake
def _(x, eps, momentum, running_mean, running_var):
    stat = x.new_empty(x.shape[1], dtype=_stat_dtype(x))
    return stat, torch.empty_like(stat)


@custom_op("normkit::batch_norm_fwd", mutates_args=())
def batch_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   training: bool) -> Tensor:  # fmt: skip
    """y = (x - mean_c) * rstd_c * weight_c + bias_c; ``training``: mean / rstd are this batch's."""
    with on(x.device):
        backend = _backend(x, "batch_norm_apply")
        y = backend.batch_norm_apply(x, weight, bias, mean, rstd)
        return fresh((y,), x, (x, weight, bias), backend)[0]


@batch_norm_fwd.register_fake
def _(x, weight, bias, mean, rstd, training):
    return torch.empty_like(x)


@custom_op("normkit::batch_norm_bwd", mutates_args=())
def batch_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   training: bool, bias_dtype: Optional[torch.dtype]
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with on(x.device):
        backend = _backend(x, "batch_norm_bwd")
        out = backend.batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype)
    return fresh(out, x, (dy, x, weight, mean, rstd), backend)


@batch_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, training, bias_dtype):
    return torch.empty_like(x), *_fake_param_grads(x, weight, bias_dtype)


def _batch_norm_setup(ctx, inputs, output):
    x, weight, bias, mean, rstd, training = inputs
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.training, ctx.bias_dtype, ctx.eps = training, None if bias is None else bias.dtype, None


def _batch_norm_backward(ctx, dy):
    x, weight, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph
        dx, dw, db = higher_order.batch_norm(dy, x, weight, ctx.bias_dtype, mean, rstd, ctx.training, ctx.eps)
    else:
        dx, dw, db = batch_norm_bwd(dy.contiguous(), x, weight, mean, rstd, ctx.training,
                                                ctx.bias_dtype)  # fmt: skip
    return (dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None,
            None, None, None)  # fmt: skip


batch_norm_fwd.register_autograd(_batch_norm_backward, setup_context=_batch_norm_setup)


@custom_op("normkit::batch_norm_train", mutates_args=())
def batch_norm_train(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, momentum: float,
                     running_mean: Optional[Tensor], running_var: Optional[Tensor]
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Training forward: x (N, C, HW) contiguous -> (y, mean, rstd, running_mean', running_var'),
    the last two the running statistics after this step as new tensors (empty where not given;
    the caller copies them into its buffers: an operator with an autograd formula may not mutate
    its inputs). One backend call, so a backend can read x once (CUDA: split channels)."""
    with on(x.device):
        backend = _backend(x, "batch_norm_train_fwd")
        out = backend.batch_norm_train_fwd(x, weight, bias, eps, momentum, running_mean, running_var, False)
    return fresh(out, x, (x, weight, bias, running_mean, running_var), backend)


@batch_norm_train.register_fake
def _(x, weight, bias, eps, momentum, running_mean, running_var):
    stat = x.new_empty(x.shape[1], dtype=_stat_dtype(x))
    return (torch.empty_like(x), stat, torch.empty_like(stat), _empty_grad(running_mean, x),
            _empty_grad(running_var, x))  # fmt: skip


def _batch_norm_train_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the statistics outputs
    x, weight, bias = inputs[:3]
    mean, rstd = output[1:3]
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.training, ctx.bias_dtype, ctx.eps = True, None if bias is None else bias.dtype, inputs[3]


def _batch_norm_train_backward(ctx, dy, *_stats):
    if dy is None:
        return (None,) * 7
    return *_batch_norm_backward(ctx, dy)[:3], None, None, None, None


batch_norm_train.register_autograd(_batch_norm_train_backward, setup_context=_batch_norm_train_setup)
