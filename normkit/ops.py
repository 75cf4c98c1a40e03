"""The row ops as PyTorch custom operators (``torch.ops.normkit.*``), with fake and autograd kernels.

Registered with :func:`torch.library.custom_op`, so ``torch.compile(..., fullgraph=True)`` treats
each one as a single opaque node (no graph break, no tracing into Triton launchers): the fake
kernels give output shapes and dtypes, ``register_autograd`` wires each forward op to its backward
op. The real kernels pick the backend at run time from the input's device (overrides from
:func:`normkit.dispatch.use_backend` included; empty inputs go to the reference) and launch under
that device's guard. ``normkit.functional`` validates arguments and calls these.

Optional outputs (a weight gradient when there is no weight, ...) come back as empty tensors and
are turned into None here: custom operators return tensors only. Outputs never alias inputs.

Also here: the autograd Functions that run a backend's training plans (``RowNormTraining``,
``AddNormTraining``, ``SoftmaxTraining``; see ``normkit.functional._PLANS``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from normkit import dispatch, higher_order, reference

_NONE = (0,)  # shape of the empty tensor that stands for "no such output"


def _backend(x: Tensor, fn: str):
    """The module whose contract function ``fn`` serves x: its device's backend, or the reference
    where x is empty or the backend does not define ``fn`` (which it names in FALLS_BACK,
    ``dispatch.falls_back``; tests/test_api.py checks every registered backend)."""
    if x.numel() == 0:
        return reference
    backend = dispatch.backend_for(x.device)
    return backend if hasattr(backend, fn) else reference


_NO_GUARD = contextlib.nullcontext()
_MODULES: dict = {}  # device type -> torch's device module (torch.cuda, torch.npu)


def _on(device: torch.device):
    """Make ``device`` current for the launch (a tensor on cuda:1 launches on cuda:1). No guard
    when it already is: ~1 us of host time less a call (2.4-2.6 -> 1.5 us on the H100 host,
    docs/tuning-log.md T20)."""
    if device.index is None or device.type == "cpu":
        return _NO_GUARD
    module = _MODULES.get(device.type)
    if module is None:
        module = _MODULES[device.type] = torch.get_device_module(device.type)
    if device.index == module.current_device():
        return _NO_GUARD
    return module.device(device)


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _outs(outputs, like: Tensor, inputs, backend=None) -> tuple[Tensor, ...]:
    """Output tensors: empty for None, and a copy where a backend handed back (a view of) an input
    or of another output — custom operators may not return aliases. A backend that declares
    ``FRESH_OUTPUTS`` (every output a new allocation, as the CUDA launchers make them) skips the
    check: it costs ~10 us of host time per call on the H100 host (docs/tuning-log.md T12)."""
    if getattr(backend, "FRESH_OUTPUTS", False):
        return tuple(outputs) if all(t is not None for t in outputs) else tuple(
            like.new_empty(_NONE) if t is None else t for t in outputs
        )
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    result = []
    for t in outputs:
        if t is None:
            t = like.new_empty(_NONE)
        elif t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        result.append(t)
    return tuple(result)


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
    with _on(x.device):
        backend = _backend(x, "layer_norm_fwd")
        out = backend.layer_norm_fwd(x, weight, bias, eps)
    return _outs(out, x, (x, weight, bias), backend)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty(x.shape[0], dtype=_stat_dtype(x))
    return torch.empty_like(x), stat, torch.empty_like(stat)


@custom_op("normkit::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with _on(x.device):
        backend = _backend(x, "layer_norm_bwd")
        out = backend.layer_norm_bwd(dy, x, weight, mean, rstd, bias_dtype)
    return _outs(out, x, (dy, x, weight, mean, rstd), backend)


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
        dx, dw, db = _bwd(ctx, layer_norm_bwd)(unit_stride(dy), x, weight, mean, rstd, ctx.bias_dtype)
    return dx, dw if weight is not None else None, db if ctx.bias_dtype is not None else None, None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


@custom_op("normkit::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(M, N) rows -> (y, rstd)."""
    with _on(x.device):
        backend = _backend(x, "rms_norm_fwd")
        out = backend.rms_norm_fwd(x, weight, eps)
    return _outs(out, x, (x, weight), backend)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.shape[0], dtype=_stat_dtype(x))


@custom_op("normkit::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    """-> (dx, dweight or empty)."""
    with _on(x.device):
        backend = _backend(x, "rms_norm_bwd")
        out = backend.rms_norm_bwd(dy, x, weight, rstd)
    return _outs(out, x, (dy, x, weight, rstd), backend)


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
        dx, dw = _bwd(ctx, rms_norm_bwd)(unit_stride(dy), x, weight, rstd)
    return dx, dw if weight is not None else None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# --- softmax / log_softmax -----------------------------------------------------------------------


@custom_op("normkit::softmax_fwd", mutates_args=())
def softmax_fwd(x: Tensor, log: bool) -> Tensor:
    """(M, N) rows -> softmax (log_softmax when ``log``) of each row."""
    with _on(x.device):
        backend = _backend(x, "softmax_fwd")
        return _outs((backend.softmax_fwd(x, log),), x, (x,), backend)[0]


@softmax_fwd.register_fake
def _(x, log):
    return torch.empty_like(x)


@custom_op("normkit::softmax_bwd", mutates_args=())
def softmax_bwd(dy: Tensor, y: Tensor, log: bool) -> Tensor:
    with _on(y.device):
        backend = _backend(y, "softmax_bwd")
        return _outs((backend.softmax_bwd(dy, y, log),), y, (dy, y), backend)[0]


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
    return _bwd(ctx, softmax_bwd)(unit_stride(dy), y, ctx.log), None


softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# --- fused residual add + dropout + LayerNorm / RMSNorm ------------------------------------------


@custom_op("normkit::add_norm_fwd", mutates_args=())
def add_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                 eps: float, dropout_p: float, seed: int, h_dtype: torch.dtype, is_rms: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """h = dropout(x) + residual; y = norm(h) -> (y, h, mean, rstd); mean is empty for RMSNorm."""
    ins = (x, residual, weight, bias)
    with _on(x.device):
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
    return _outs((y, h, mean, rstd.to(stat)), x, ins, backend)


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
    with _on(h.device):
        backend = _backend(h, "add_rms_norm_bwd" if is_rms else "add_layer_norm_bwd")
        if is_rms:
            dx, dres, dw = backend.add_rms_norm_bwd(dy, dh, h, weight, rstd, *drop)
            db = None
        else:
            dx, dres, dw, db = backend.add_layer_norm_bwd(dy, dh, h, weight, mean, rstd, bias_dtype, *drop)
    return _outs((dx, dres, dw, db), h, (dy, dh, h, weight, mean, rstd), backend)


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
                keep_scale = _bwd(ctx, add_norm_bwd)(
                    torch.zeros_like(h, dtype=x_dtype), torch.ones_like(h), h, weight, mean, rstd, bias_dtype,
                    dropout_p, seed, acc, None, is_rms)[0]  # fmt: skip
        dx, dres, dw, db = higher_order.add_norm(dy, dh, h, weight, bias_dtype, ctx.eps, is_rms, keep_scale,
                                                 x_dtype, residual_dtype)  # fmt: skip
        return (dx, dres, dw if weight is not None else None, db if bias_dtype is not None else None,
                None, None, None, None, None)  # fmt: skip
    y_unused = dy is None  # then no gradient reaches the weight and bias: None, as torch gives
    dy = torch.zeros_like(h, dtype=x_dtype) if y_unused else unit_stride(dy)
    dh = None if dh is None else unit_stride(dh)
    dx, dres, dw, db = _bwd(ctx, add_norm_bwd)(dy, dh, h, weight, mean, rstd, bias_dtype, dropout_p, seed,
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
    with _on(x.device):
        backend = _backend(x, "group_norm_fwd")
        out = backend.group_norm_fwd(x, weight, bias, num_groups, eps)
    return _outs(out, x, (x, weight, bias), backend)


@group_norm_fwd.register_fake
def _(x, weight, bias, num_groups, eps):
    stat = x.new_empty(x.shape[0] * num_groups, dtype=_stat_dtype(x))
    return torch.empty_like(x), stat, torch.empty_like(stat)


@custom_op("normkit::group_norm_bwd", mutates_args=())
def group_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   num_groups: int, bias_dtype: Optional[torch.dtype]
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with _on(x.device):
        backend = _backend(x, "group_norm_bwd")
        out = backend.group_norm_bwd(dy, x, weight, mean, rstd, num_groups, bias_dtype)
    return _outs(out, x, (dy, x, weight, mean, rstd), backend)


@group_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, num_groups, bias_dtype):
    return torch.empty_like(x), *_fake_param_grads(x, weight, bias_dtype)


def _in_layout_of(dy: Tensor, x: Tensor) -> Tensor:
    """dy in x's layout (contiguous, or channels-last: the kernels read both alike); a copy only
    where it is not."""
    if x.is_contiguous():
        return dy.contiguous()
    return dy if dy.stride() == x.stride() else torch.empty_like(x, dtype=dy.dtype).copy_(dy)


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
        dx, dw, db = _bwd(ctx, group_norm_bwd)(_in_layout_of(dy, x), x, weight, mean, rstd, ctx.num_groups,
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
    with _on(x.device):
        backend = _backend(x, "batch_norm_stats")
        return _outs(backend.batch_norm_stats(x, eps, momentum, running_mean, running_var), x, (x,), backend)


@batch_norm_stats.register_fake
def _(x, eps, momentum, running_mean, running_var):
    stat = x.new_empty(x.shape[1], dtype=_stat_dtype(x))
    return stat, torch.empty_like(stat)


@custom_op("normkit::batch_norm_fwd", mutates_args=())
def batch_norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   training: bool) -> Tensor:  # fmt: skip
    """y = (x - mean_c) * rstd_c * weight_c + bias_c; ``training``: mean / rstd are this batch's."""
    with _on(x.device):
        backend = _backend(x, "batch_norm_apply")
        y = backend.batch_norm_apply(x, weight, bias, mean, rstd)
        return _outs((y,), x, (x, weight, bias), backend)[0]


@batch_norm_fwd.register_fake
def _(x, weight, bias, mean, rstd, training):
    return torch.empty_like(x)


@custom_op("normkit::batch_norm_bwd", mutates_args=())
def batch_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                   training: bool, bias_dtype: Optional[torch.dtype]
                   ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """-> (dx, dweight or empty, dbias or empty)."""
    with _on(x.device):
        backend = _backend(x, "batch_norm_bwd")
        out = backend.batch_norm_bwd(dy, x, weight, mean, rstd, training, bias_dtype)
    return _outs(out, x, (dy, x, weight, mean, rstd), backend)


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
        dx, dw, db = _bwd(ctx, batch_norm_bwd)(dy.contiguous(), x, weight, mean, rstd, ctx.training,
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
    return _batch_norm_train_call(x, weight, bias, eps, momentum, running_mean, running_var, False)


def _batch_norm_train_call(x, weight, bias, eps, momentum, running_mean, running_var, in_place):
    """The backend's batch_norm_train_fwd: all 5 outputs (the operator), or (y, mean, rstd) with
    the running statistics updated in place (``in_place``: the eager kernel)."""
    with _on(x.device):
        backend = _backend(x, "batch_norm_train_fwd")
        out = backend.batch_norm_train_fwd(x, weight, bias, eps, momentum, running_mean, running_var,
                                           in_place)  # fmt: skip
    if in_place:
        return _outs(out[:3], x, (x, weight, bias), backend)
    return _outs(out, x, (x, weight, bias, running_mean, running_var), backend)


@batch_norm_train.register_fake
def _(x, weight, bias, eps, momentum, running_mean, running_var):
    stat = x.new_empty(x.shape[1], dtype=_stat_dtype(x))
    return (torch.empty_like(x), stat, torch.empty_like(stat), _empty_grad(running_mean, x),
            _empty_grad(running_var, x))  # fmt: skip


def _batch_norm_train_eager(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                            momentum: float, running_mean: Optional[Tensor], running_var: Optional[Tensor]
                            ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """batch_norm_train's eager kernel: (y, mean, rstd), the running statistics updated in place
    (no copies back: ~25-30 us of host time a call on the H100 host, docs/tuning-log.md T19)."""
    return _batch_norm_train_call(x, weight, bias, eps, momentum, running_mean, running_var, True)


def _batch_norm_train_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the statistics outputs
    x, weight, bias = inputs[:3]
    mean, rstd = output[1:3]  # the operator's 5 outputs, or the eager kernel's 3
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.training, ctx.bias_dtype, ctx.eps = True, None if bias is None else bias.dtype, inputs[3]


def _batch_norm_train_backward(ctx, dy, *_stats):
    if dy is None:
        return (None,) * 7
    return *_batch_norm_backward(ctx, dy)[:3], None, None, None, None


batch_norm_train.register_autograd(_batch_norm_train_backward, setup_context=_batch_norm_train_setup)


# --- training plans: calls that want gradients, run from a backend's plan ------------------------


def _dense(grad: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """An incoming gradient as a plan's backward takes it: contiguous, 16-byte aligned, in ``dtype``
    (a copy only where it is not, e.g. the expanded gradient of a sum)."""
    if grad is None or (grad.dtype is dtype and grad.is_contiguous() and grad.data_ptr() % 16 == 0):
        return grad
    return grad.to(dtype, memory_format=torch.contiguous_format, copy=True)


def _param_shaped(grad: Optional[Tensor], shape) -> Optional[Tensor]:
    """A plan's (N,) parameter gradient in the parameters' shape (``shape``: None when 1-D)."""
    return grad if grad is None or shape is None else grad.view(shape)


def _params_shape(weight: Optional[Tensor], bias: Optional[Tensor]):
    """normalized_shape where the parameters are not 1-D (their gradients are viewed so), else None."""
    param = weight if weight is not None else bias
    return None if param is None or param.dim() == 1 else param.shape


def _plan_args(ctx):
    """(rows shape, the plan's non-tensor arguments) of the call a training plan was made for."""
    _, rows, args = ctx.plan.spec
    return rows, args


class _PlannedRowNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm (``plan_row_norm(..., grad=True)``) or GroupNorm (``plan_group_norm``, the
    same protocol) from a training plan: the plan's forward (statistics written) and backward, with
    no operator, dispatch or argument handling."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        y, _, mean, rstd = plan.forward(x, None, weight, bias)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.plan, ctx.shape = plan, _params_shape(weight, bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (higher_order): plan_row_norm's or plan_group_norm's
            rows, args = _plan_args(ctx)
            w, d, xr = None if weight is None else weight.reshape(-1), dy.reshape(rows), x.reshape(rows)
            if ctx.plan.spec[0] == "group_norm":  # (weight, bias, num_groups, eps)
                dx, dw, db = higher_order.group_norm(d, xr, w, ctx.bias_dtype, args[2], args[3])
            else:  # (weight, bias, eps, is_rms)
                dx, dw, db = higher_order.row_norm(d, xr, w, ctx.bias_dtype, args[2], args[3])
            return None, dx.view(x.shape), _param_shaped(dw, ctx.shape), _param_shaped(db, ctx.shape)
        dx, _, dw, db = ctx.plan.backward(_dense(dy, x.dtype), None, x, weight, mean, rstd)
        return None, dx, _param_shaped(dw, ctx.shape), _param_shaped(db, ctx.shape)


class _PlannedAddNorm(torch.autograd.Function):
    """The add-norms without dropout from a training plan: (y, h) with h = x + residual."""

    @staticmethod
    def forward(ctx, plan, x, residual, weight, bias):
        ctx.set_materialize_grads(False)  # h's gradient stays None when h is unused: no read of zeros
        y, h, mean, rstd = plan.forward(x, residual, weight, bias)
        ctx.save_for_backward(h, weight, mean, rstd)
        ctx.plan, ctx.shape, ctx.x_dtype = plan, _params_shape(weight, bias), x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.residual = None if residual is None else (residual.dtype, residual.shape)
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (higher_order); args: (weight, bias, eps, is_rms, ...)
            rows, args = _plan_args(ctx)
            dy, dh = (None if g is None else g.reshape(rows) for g in (dy, dh))
            w = None if weight is None else weight.reshape(-1)
            dx, dres, dw, db = higher_order.add_norm(
                dy, dh, h.reshape(rows), w, ctx.bias_dtype, args[2], args[3], None, ctx.x_dtype,
                None if ctx.residual is None else ctx.residual[0])  # fmt: skip
            if dres is not None:
                dres = dres.view(h.shape).sum_to_size(ctx.residual[1])
            return None, dx.view(h.shape), dres, _param_shaped(dw, ctx.shape), _param_shaped(db, ctx.shape)
        dy, dh = _dense(dy, ctx.x_dtype), _dense(dh, h.dtype)
        dx, dres, dw, db = ctx.plan.backward(dy, dh, h, weight, mean, rstd)
        if dy is None:  # y unused: no gradient reaches the weight and bias (None, as torch gives)
            dw = db = None
        return None, dx, dres, _param_shaped(dw, ctx.shape), _param_shaped(db, ctx.shape)


class _PlannedSoftmax(torch.autograd.Function):
    """softmax / log_softmax along the last dim from a training plan."""

    @staticmethod
    def forward(ctx, plan, x):
        y = plan.forward(x)
        ctx.save_for_backward(y)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph (higher_order); args: (log,)
            return None, higher_order.softmax(dy, y, _plan_args(ctx)[1][0])
        return None, ctx.plan.backward(_dense(dy, y.dtype), y)


class _PlannedBatchNorm(torch.autograd.Function):
    """BatchNorm in training mode from a training plan (``plan_batch_norm(..., grad=True)``): the
    running statistics are updated in place by the plan's forward, as the full path's eager kernel
    updates them."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias, running_mean, running_var, momentum):
        y, mean, rstd = plan.forward(x, weight, bias, running_mean, running_var, momentum)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.plan, ctx.bias_dtype = plan, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph; args: (weight, bias, running stats, eps, training)
            rows, args = _plan_args(ctx)
            dx, dw, db = higher_order.batch_norm(dy.reshape(rows), x.reshape(rows), weight, ctx.bias_dtype,
                                                 mean, rstd, args[5], args[4])  # fmt: skip
            return None, dx.view(x.shape), dw, db, None, None, None
        dx, dw, db = ctx.plan.backward(_dense(dy, x.dtype), x, weight, mean, rstd)
        return None, dx, dw, db, None, None, None


class RowNormTraining:
    """A backend's training plan for a LayerNorm / RMSNorm / GroupNorm signature (``plan_row_norm`` /
    ``plan_group_norm(..., grad=True)`` -> (forward, backward)), called as its inference plan is:
    ``plan(input, None, weight, bias)``. ``spec``: (op, rows shape, the plan maker's arguments with
    tensors left out), what a backward with create_graph recomputes from (higher_order)."""

    __slots__ = ("forward", "backward", "spec")

    def __init__(self, forward, backward, spec):
        self.forward, self.backward, self.spec = forward, backward, spec

    def __call__(self, x, residual, weight, bias):
        return _PlannedRowNorm.apply(self, x, weight, bias)


class AddNormTraining(RowNormTraining):
    """A backend's training plan for an add-norm signature: ``plan(x, residual, weight, bias)`` -> (y, h)."""

    __slots__ = ()

    def __call__(self, x, residual, weight, bias):
        return _PlannedAddNorm.apply(self, x, residual, weight, bias)


class SoftmaxTraining(RowNormTraining):
    """A backend's training plan for a softmax / log_softmax signature: ``plan(input)``."""

    __slots__ = ()

    def __call__(self, x):
        return _PlannedSoftmax.apply(self, x)


class BatchNormTraining(RowNormTraining):
    """A backend's training plan for a BatchNorm signature (``plan_batch_norm(..., grad=True)``):
    ``plan(input, weight, bias, running_mean, running_var, momentum)``."""

    __slots__ = ()

    def __call__(self, x, weight, bias, running_mean, running_var, momentum):
        return _PlannedBatchNorm.apply(self, x, weight, bias, running_mean, running_var, momentum)


def unit_stride(rows: Tensor) -> Tensor:
    """Kernels take any row stride but need unit-stride columns: copy only when they are not."""
    return rows.contiguous() if rows.numel() and rows.stride(1) != 1 else rows


# --- eager calls: the same kernels without the dispatcher -----------------------------------------


class _Entry:
    """What ``normkit.functional`` calls: the custom operator while torch.compile traces; in eager
    mode the operator's own Python kernel, through a plain autograd.Function when gradients are
    needed (same setup and backward functions), or directly when not. The operator path costs
    about 2x the host time of a small call on CPU (dispatcher boxing and alias checks: 94 vs 53 us
    for a 16 x 64 LayerNorm forward), which is what few-row inference calls are made of."""

    def __init__(self, op, setup=None, backward=None, stats=(), eager=None):
        self.op = op
        # the undecorated kernel (falls back to the op), or ``eager``: one that may differ where the
        # operator must be functional (batch_norm_train updates the running statistics in place)
        self.raw = eager or getattr(op, "_init_fn", op)
        self.function = None if backward is None else _eager_function(self.raw, setup, backward, stats)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled() and any(
            isinstance(a, Tensor) and a.requires_grad for a in args
        ):
            return self.function.apply(*args)
        return self.raw(*args)


def _eager_function(raw, setup, backward, stats):
    """``stats``: indices of outputs that carry no gradient (saved statistics), marked
    non-differentiable so autograd tracks no gradient for them."""

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = raw(*args)
            setup(ctx, args, out)
            if stats:
                ctx.mark_non_differentiable(*(out[i] for i in stats))
            ctx.eager = True  # the backward calls the raw backward kernels too
            ctx.overrides = dispatch.overrides()  # ... on the backend that served the forward
            return out

        @staticmethod
        def backward(ctx, *grads):  # differentiable again with create_graph (higher_order)
            return backward(ctx, *grads)

    return _Function


def _bwd(ctx, entry: _Entry):
    """The backward kernel for this context: raw in eager mode, run under the backend overrides
    of the forward's context (see dispatch.restore); the operator when traced."""
    if not getattr(ctx, "eager", False):
        return entry.op
    if ctx.overrides is dispatch.overrides():  # same overrides here (usually none): call directly
        return entry.raw

    def run(*args):
        with dispatch.restore(ctx.overrides):
            return entry.raw(*args)

    return run


layer_norm_fwd = _Entry(layer_norm_fwd, _layer_norm_setup, _layer_norm_backward, stats=(1, 2))
layer_norm_bwd = _Entry(layer_norm_bwd)
rms_norm_fwd = _Entry(rms_norm_fwd, _rms_norm_setup, _rms_norm_backward, stats=(1,))
rms_norm_bwd = _Entry(rms_norm_bwd)
softmax_fwd = _Entry(softmax_fwd, _softmax_setup, _softmax_backward)
softmax_bwd = _Entry(softmax_bwd)
add_norm_fwd = _Entry(add_norm_fwd, _add_norm_setup, _add_norm_backward, stats=(2, 3))
add_norm_bwd = _Entry(add_norm_bwd)
group_norm_fwd = _Entry(group_norm_fwd, _group_norm_setup, _group_norm_backward, stats=(1, 2))
group_norm_bwd = _Entry(group_norm_bwd)
batch_norm_stats = _Entry(batch_norm_stats)
batch_norm_fwd = _Entry(batch_norm_fwd, _batch_norm_setup, _batch_norm_backward)
batch_norm_train = _Entry(batch_norm_train, _batch_norm_train_setup, _batch_norm_train_backward,
                          stats=(1, 2), eager=_batch_norm_train_eager)  # fmt: skip
batch_norm_bwd = _Entry(batch_norm_bwd)
