"""Plans: what every eager call runs (docs/design.md, "From call to kernel").

:mod:`normkit.functional` checks a call, then asks :func:`make` for its plan: the backend's own
(``plan_row_norm`` / ``plan_softmax`` / ``plan_group_norm`` / ``plan_batch_norm``: compiled kernels
bound to this call's launch) where it has one, else a *contract plan* made here from the backend's
contract functions (``layer_norm_fwd`` / ``layer_norm_bwd``, ...), which every backend has. A plan
is remembered under the call's signature (:func:`key`), so a repeated call (a model's layers, every
step) runs it with no checks or dispatch; a call without a signature (a strided or subclassed input,
dropout with its per-call seed) gets a plan of its own. Inference calls run the plan; training calls
run its forward and backward through one ``torch.autograd.Function`` per op family (below), whose
backward is differentiable again with ``create_graph`` (:mod:`normkit.higher_order`).

Protocols (the backends' ``plan_*`` follow the same; ``backends/cuda/layer_norm.py:plan_row_norm``
documents them):

- row norms (LayerNorm, RMSNorm, the add-norms): ``run(input, residual, weight, bias)`` -> y, or
  (y, h) for the add-norms; training ``forward(input, residual, weight, bias)`` -> (y, h, mean,
  rstd) and ``backward(dy, dh, xn, weight, mean, rstd)`` -> (dx, dresidual, dweight, dbias);
- GroupNorm: the same, the residual and h None;
- softmax: ``run(input)`` -> y; ``backward(dy, y)`` -> dx;
- BatchNorm: ``run(input, weight, bias, running_mean, running_var, momentum)`` -> y; training
  ``forward(...)`` -> (y, mean, rstd) and ``backward(dy, input, weight, mean, rstd)`` -> (dx, dweight,
  dbias).

torch.compile does not run plans: it traces the custom operators of :mod:`normkit.ops`, which call
the same contract functions.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from normkit import dispatch, higher_order, reference

# --- helpers shared with the custom operators (normkit.ops) ----------------------------------------

_NONE = (0,)  # shape of the empty tensor that stands for "no such output" (custom operators)
_NO_GUARD = contextlib.nullcontext()
_MODULES: dict = {}  # device type -> torch's device module (torch.cuda, torch.npu)


def on(device: torch.device):
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


def stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def unit_stride(rows: Tensor) -> Tensor:
    """Kernels take any row stride but need unit-stride columns: copy only when they are not."""
    return rows.contiguous() if rows.numel() and rows.stride(1) != 1 else rows


def fresh(outputs, like: Tensor, inputs, backend=None) -> tuple:
    """Outputs with a copy where a backend handed back (a view of) an input or of another output:
    normkit's outputs never alias its inputs (and custom operators may not return aliases). None
    outputs become empty tensors where ``like`` is given (custom operators return tensors only). A
    backend that declares ``FRESH_OUTPUTS`` (every output a new allocation, as the CUDA launchers make
    them) skips the check: it costs ~10 us of host time per call on the H100 host (docs/tuning-log.md
    T12)."""
    if getattr(backend, "FRESH_OUTPUTS", False):
        if like is None or all(t is not None for t in outputs):
            return tuple(outputs)
        return tuple(like.new_empty(_NONE) if t is None else t for t in outputs)
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, Tensor) and t.numel()}
    result = []
    for t in outputs:
        if t is None:
            t = None if like is None else like.new_empty(_NONE)
        elif t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        result.append(t)
    return tuple(result)


def in_layout_of(dy: Tensor, x: Tensor) -> Tensor:
    """dy in x's layout (contiguous, or channels-last: the kernels read both alike); a copy only
    where it is not."""
    if x.is_contiguous():
        return dy.contiguous()
    return dy if dy.stride() == x.stride() else torch.empty_like(x, dtype=dy.dtype).copy_(dy)


def contract_function(backend, name: str):
    """(``backend.<name>``, backend), or the reference's and the reference where the backend leaves
    it out (it names it in FALLS_BACK, ``dispatch.falls_back``; tests/test_api.py checks every
    registered backend): the module that serves it decides :func:`fresh`'s alias check."""
    fn = getattr(backend, name, None)
    return (fn, backend) if fn is not None else (getattr(reference, name), reference)


def _flat(p: Optional[Tensor]) -> Optional[Tensor]:
    return p if p is None or p.dim() == 1 else p.reshape(-1)


class _Restored:
    """The backend overrides in effect when a plan was made (``dispatch.overrides``): its backward
    runs under them, also on the autograd engine's thread and outside the block that set them (the
    contract functions pick their launch when called; ``config.forced`` reaches the backward)."""

    __slots__ = ("overrides",)

    def __init__(self):
        self.overrides = dispatch.overrides()

    def restored(self):
        if self.overrides is dispatch.overrides():  # usually: none, here as there
            return _NO_GUARD
        return dispatch.restore(self.overrides)


# --- contract plans: any backend's contract functions behind the plan protocols -------------------


class RowNormContract(_Restored):
    """LayerNorm / RMSNorm and the add-norms (dropout included: a plan per call, with its seed) from
    the backend's ``layer_norm_fwd`` / ``_bwd``, ``rms_norm_*``, ``add_layer_norm_*``,
    ``add_rms_norm_*``. Called with the input as made for (contiguous) or its (M, N) rows."""

    __slots__ = ("M", "N", "device", "eps", "is_rms", "add", "h_dtype", "x_dtype", "residual_dtype",
                 "bias_dtype", "dropout_p", "seed", "fwd", "fwd_by", "bwd", "bwd_by")  # fmt: skip

    def __init__(self, backend, rows, weight, bias, eps, is_rms, add=False, residual=None, h_dtype=None,
                 dropout_p=0.0, seed=0):  # fmt: skip
        super().__init__()
        self.M, self.N = rows.shape
        self.device, self.x_dtype, self.eps, self.is_rms, self.add = rows.device, rows.dtype, eps, is_rms, add
        self.h_dtype, self.residual_dtype = h_dtype, None if residual is None else residual.dtype
        self.bias_dtype = None if bias is None else bias.dtype
        self.dropout_p, self.seed = dropout_p, seed
        name = ("add_" if add else "") + ("rms_norm" if is_rms else "layer_norm")
        (self.fwd, self.fwd_by), (self.bwd, self.bwd_by) = (contract_function(backend, name + d)
                                                            for d in ("_fwd", "_bwd"))  # fmt: skip

    def forward(self, x, r, w, b):
        rows, w, b = x.view(self.M, self.N), _flat(w), _flat(b)
        h = None
        with on(self.device):
            if self.add:
                r = None if r is None else r.view(self.M, self.N)
                args = (self.eps, self.dropout_p, self.seed, self.h_dtype)
                if self.is_rms:
                    y, h, rstd = self.fwd(rows, r, w, *args)
                    mean = rstd = rstd.to(stat_dtype(rows))  # x's math dtype (the reference would follow h's)
                else:
                    y, h, mean, rstd = self.fwd(rows, r, w, b, *args)
                    mean, rstd = mean.to(stat_dtype(rows)), rstd.to(stat_dtype(rows))
            elif self.is_rms:
                y, rstd = self.fwd(rows, w, self.eps)
                mean = rstd
            else:
                y, mean, rstd = self.fwd(rows, w, b, self.eps)
        y, h = fresh((y, h), None, (rows, r, w, b), self.fwd_by)
        return y.view(x.shape), None if h is None else h.view(x.shape), mean, rstd

    def run(self, x, r, w, b):
        y, h, _, _ = self.forward(x, r, w, b)
        return (y, h) if self.add else y

    def backward(self, dy, dh, xn, w, mean, rstd):
        rows, w = xn.view(self.M, self.N), _flat(w)
        if dy is not None:
            dy = unit_stride(dy.reshape(self.M, self.N))
        elif self.add:  # y unused (add-norms): h's gradient alone
            dy = torch.zeros_like(rows, dtype=self.x_dtype)
        dh = None if dh is None else unit_stride(dh.reshape(self.M, self.N))
        dres = db = None
        with self.restored(), on(self.device):
            if self.add:
                dx, dres, dw, db = self._add_bwd(dy, dh, rows, w, mean, rstd, self.x_dtype,
                                                 self.residual_dtype)  # fmt: skip
            elif self.is_rms:
                dx, dw = self.bwd(dy, rows, w, rstd)
            else:
                dx, dw, db = self.bwd(dy, rows, w, mean, rstd, self.bias_dtype)
        dx, dres = fresh((dx, dres), None, (dy, dh, rows, w, mean, rstd), self.bwd_by)
        return dx.view(xn.shape), None if dres is None else dres.view(xn.shape), dw, db

    def _add_bwd(self, dy, dh, h, w, mean, rstd, x_dtype, residual_dtype):
        drop = (self.dropout_p, self.seed, x_dtype, residual_dtype)
        if self.is_rms:
            return *self.bwd(dy, dh, h, w, rstd, *drop), None
        return self.bwd(dy, dh, h, w, mean, rstd, self.bias_dtype, *drop)

    def keep_scale(self, h, w, mean, rstd):
        """The dropout mask times 1 / (1 - p) in x's math dtype (the backward of dh = 1, dy = 0), for
        a backward with create_graph (higher_order.add_norm); None without dropout."""
        if not self.dropout_p:
            return None
        rows, acc = h.view(self.M, self.N), stat_dtype(h)
        with torch.no_grad(), self.restored(), on(self.device):
            return self._add_bwd(torch.zeros_like(rows, dtype=self.x_dtype), torch.ones_like(rows), rows,
                                 _flat(w), mean, rstd, acc, None)[0]  # fmt: skip


class GroupNormContract(_Restored):
    """GroupNorm from the backend's ``group_norm_fwd`` / ``_bwd``: called with the input as made for
    (contiguous) or its (N, C, HW) view, contiguous or channels-last (read and written in place)."""

    __slots__ = ("shape", "device", "num_groups", "eps", "bias_dtype", "fwd", "fwd_by", "bwd", "bwd_by")

    def __init__(self, backend, x, weight, bias, num_groups, eps):
        super().__init__()
        self.shape, self.device, self.num_groups, self.eps = x.shape, x.device, num_groups, eps
        self.bias_dtype = None if bias is None else bias.dtype
        (self.fwd, self.fwd_by), (self.bwd, self.bwd_by) = (contract_function(backend, f"group_norm{d}")
                                                            for d in ("_fwd", "_bwd"))  # fmt: skip

    def forward(self, x, r, w, b):
        x3 = x.view(self.shape)
        with on(self.device):
            y, mean, rstd = self.fwd(x3, w, b, self.num_groups, self.eps)
        (y,) = fresh((y,), None, (x3, w, b), self.fwd_by)
        return y.view(x.shape), None, mean, rstd

    def run(self, x, r, w, b):
        return self.forward(x, r, w, b)[0]

    def backward(self, dy, dh, x, w, mean, rstd):
        x3 = x.view(self.shape)
        dy = in_layout_of(dy.reshape(self.shape), x3)
        with self.restored(), on(self.device):
            dx, dw, db = self.bwd(dy, x3, w, mean, rstd, self.num_groups, self.bias_dtype)
        (dx,) = fresh((dx,), None, (dy, x3, w, mean, rstd), self.bwd_by)
        return dx.view(x.shape), None, dw, db


class SoftmaxContract(_Restored):
    """softmax / log_softmax along the last dim from the backend's ``softmax_fwd`` / ``_bwd``."""

    __slots__ = ("M", "N", "device", "log", "fwd", "fwd_by", "bwd", "bwd_by")

    def __init__(self, backend, rows, log):
        super().__init__()
        (self.M, self.N), self.device, self.log = rows.shape, rows.device, log
        (self.fwd, self.fwd_by), (self.bwd, self.bwd_by) = (contract_function(backend, f"softmax{d}")
                                                            for d in ("_fwd", "_bwd"))  # fmt: skip

    def forward(self, x):
        rows = x.view(self.M, self.N)
        with on(self.device):
            (y,) = fresh((self.fwd(rows, self.log),), None, (rows,), self.fwd_by)
        return y.view(x.shape)

    run = forward

    def backward(self, dy, y):
        dy, rows = unit_stride(dy.reshape(self.M, self.N)), y.view(self.M, self.N)
        with self.restored(), on(self.device):
            (dx,) = fresh((self.bwd(dy, rows, self.log),), None, (dy, rows), self.bwd_by)
        return dx.view(y.shape)


class BatchNormContract(_Restored):
    """BatchNorm from the backend's ``batch_norm_train_fwd`` (running statistics updated in place)
    or, in eval mode, ``batch_norm_apply`` on the running statistics, and ``batch_norm_bwd``. Called
    with the input as made for (contiguous) or its (N, C, HW) view (a channels-last input: its (N *
    HW, C, 1) view, the same memory)."""

    __slots__ = ("shape", "device", "eps", "training", "bias_dtype", "fwd", "fwd_by", "bwd", "bwd_by")

    def __init__(self, backend, x, weight, bias, running_mean, running_var, eps, training):
        super().__init__()
        self.shape, self.device, self.eps, self.training = x.shape, x.device, eps, training
        self.bias_dtype = None if bias is None else bias.dtype
        fwd = "batch_norm_train_fwd" if training else "batch_norm_apply"
        self.fwd, self.fwd_by = contract_function(backend, fwd)
        self.bwd, self.bwd_by = contract_function(backend, "batch_norm_bwd")

    def forward(self, x, w, b, rm, rv, momentum):
        x3 = x.view(self.shape)
        with on(self.device):
            if self.training:
                if x3.shape[0] * x3.shape[2] == 0:  # an empty batch leaves the running statistics (as torch)
                    rm = rv = None
                y, mean, rstd = self.fwd(x3, w, b, self.eps, float(momentum), rm, rv, True)[:3]
            else:
                acc = stat_dtype(x3)
                mean, rstd = rm.detach().to(acc), torch.rsqrt(rv.detach().to(acc) + self.eps)
                y = self.fwd(x3, w, b, mean, rstd)
        (y,) = fresh((y,), None, (x3, w, b, rm, rv), self.fwd_by)
        return y.view(x.shape), mean, rstd

    def run(self, x, w, b, rm, rv, momentum):
        return self.forward(x, w, b, rm, rv, momentum)[0]

    def backward(self, dy, x, w, mean, rstd):
        x3 = x.view(self.shape)
        dy = dy.reshape(self.shape).contiguous()
        with self.restored(), on(self.device):
            dx, dw, db = self.bwd(dy, x3, w, mean, rstd, self.training, self.bias_dtype)
        (dx,) = fresh((dx,), None, (dy, x3, w, mean, rstd), self.bwd_by)
        return dx.view(x.shape), dw, db


# --- the plan cache ---------------------------------------------------------------------------------


class _Cache(dict):
    """The remembered plans by key; clearing it also empties the backend's door (below)."""

    __slots__ = ()

    def clear(self) -> None:
        super().clear()
        if DOOR_CLEAR is not None:
            DOOR_CLEAR()


_PLANS: dict = _Cache()
PLANS_SIZE = 4096  # signatures remembered; then cleared
# A backend's front door to its remembered plans (CUDA: native.cpp's door, which
# backends/cuda/native.py sets once it holds a recorded plan): ``DOOR(x, dim, op)`` (op 0: softmax,
# 1: log_softmax) or ``DOOR(op, x, normalized_shape, weight, bias, eps)`` (2: layer_norm, 3:
# rms_norm) gives the call's output without normkit's Python, or None; normkit.softmax, layer_norm
# and rms_norm try it first while no override is in effect (dispatch._IN_OVERRIDE).
DOOR = DOOR_CLEAR = None
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def overrides_key() -> tuple:
    """The backend and strategy overrides in effect (dispatch.use_backend / use_strategy), as part of
    a memo key."""
    overrides = dispatch.overrides()
    return tuple(overrides.items()) if overrides else ()


# bound once: key() runs on every call, and each attribute lookup costs (~1.2 -> ~0.8 us a key)
_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled


def key(op, input, tensors, *extra) -> tuple | None:
    """The signature of a call a remembered plan may serve, or None: a trace, a non-contiguous or
    subclassed input, a non-contiguous parameter, or an ``extra`` left None. Its last entry says
    whether gradients are wanted (grad mode on and a tensor that requires grad): a training plan."""
    if type(input) is not Tensor or None in extra or _compiling() or not input.is_contiguous():
        return None
    grad = _grad_enabled()
    train = grad and input.requires_grad
    specs = []
    for t in tensors:
        if t is None:
            specs.append(None)
            continue
        # plain tensors and parameters only (a tensor subclass gets a plan of its own, not remembered)
        if type(t) not in _PLAIN or not t.is_contiguous():
            return None
        train = train or (grad and t.requires_grad)
        specs.append((type(t), t.shape, t.dtype, t.device, t.data_ptr() % 16 == 0))
    return (op, input.shape, input.dtype, input.device, input.data_ptr() % 16 == 0, tuple(specs), extra,
            overrides_key(), train)  # fmt: skip


def input_key(op, input, *extra) -> tuple | None:
    """``key(op, input, (), *extra)`` without its parameter loop: the key of a call with no tensor
    but its input (softmax's, looked up on every call before functional's layers: 1.78 -> 1.36 us a
    key + lookup on a 2-core CPU host, docs/tuning-log.md T99)."""
    if type(input) is not Tensor or None in extra or _compiling() or not input.is_contiguous():
        return None
    return (op, input.shape, input.dtype, input.device, input.data_ptr() % 16 == 0, (), extra,
            overrides_key(), _grad_enabled() and input.requires_grad)  # fmt: skip


def stored(key):
    """The plan remembered for ``key``; None when there is no key or no plan yet."""
    return _PLANS.get(key) if key is not None else None


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def make(key, backend, family: str, op: str, rows: Tensor, *args, contract=(), train=None):
    """The plan for a call of ``op`` (checked by normkit.functional) on ``rows`` (the kernels' view
    of the input), remembered under ``key`` when there is one. The backend's ``plan_<family>(rows,
    *args)`` (``grad=True`` for a training plan) where the call has a key and the backend a plan for
    it, else its contract plan (``contract``: arguments only a contract plan takes: the add-norms'
    dropout p and seed). A training plan (``train``; default: the key's, or whether any tensor
    argument wants a gradient) is wrapped for autograd (:class:`Training`)."""
    if train is None:
        train = key[-1] if key is not None else _wants_grad((rows, *args))
    if rows.numel() == 0:
        backend = reference  # nothing to launch: plain torch gives the empty results (and zero grads)
    plan = None
    if key is not None and (maker := getattr(backend, f"plan_{family}", None)) is not None:
        plan = maker(rows, *args, grad=True) if train else maker(rows, *args)
    own = plan is not None
    if plan is None:
        made = _CONTRACT[family](backend, rows, *args, *contract)
        plan = (made.forward, made.backward, made.keep_scale if family == "row_norm" else None) if train \
            else made.run  # fmt: skip
    if train:
        scalars = tuple(None if isinstance(a, Tensor) else a for a in args)  # no tensor kept alive
        plan = _TRAINING[op](*plan, spec=(op, tuple(rows.shape), scalars))
    if own and (accelerate := getattr(backend, "accelerate", None)) is not None:
        # the backend's host path for its own plans (CUDA: native.py); its door serves calls of this key
        # only where no override is in it (the door does not see overrides)
        plan = accelerate(plan, op, train, door=key if key is not None and not overrides_key() else None)
    if key is not None:
        if len(_PLANS) >= PLANS_SIZE:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def is_contract(plan) -> bool:
    """Whether ``plan`` (from :func:`make`) runs a backend's contract functions rather than a plan of
    the backend's own."""
    fn = plan.forward if isinstance(plan, Training) else plan
    return isinstance(getattr(fn, "__self__", None), _Restored)


_CONTRACT = {"row_norm": RowNormContract, "group_norm": GroupNormContract, "softmax": SoftmaxContract,
             "batch_norm": BatchNormContract}  # fmt: skip


# --- training: one autograd.Function per op family ----------------------------------------------


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


def _row_norm_forward(ctx, plan, x, weight, bias):
    """The training plan's forward, with what its backward needs saved on ``ctx`` -> (y, mean, rstd)."""
    y, _, mean, rstd = plan.forward(x, None, weight, bias)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.plan, ctx.shape = plan, _params_shape(weight, bias)
    ctx.bias_dtype = None if bias is None else bias.dtype
    return y, mean, rstd


class _PlannedRowNorm(torch.autograd.Function):
    """LayerNorm / RMSNorm or GroupNorm (the same protocol) from a training plan: the plan's forward
    (statistics written) and backward, with no operator, dispatch or argument handling."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        return _row_norm_forward(ctx, plan, x, weight, bias)[0]

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
        # (a strided input's rows, a channels-last GroupNorm: the contract plan takes dy as it comes)
        dx, _, dw, db = ctx.plan.backward(_dense(dy, x.dtype) if x.is_contiguous() else dy, None, x, weight,
                                          mean, rstd)  # fmt: skip
        return None, dx, _param_shaped(dw, ctx.shape), _param_shaped(db, ctx.shape)


class _PlannedRowNormStats(torch.autograd.Function):
    """:class:`_PlannedRowNorm` that also returns the statistics (InstanceNorm's running statistics
    take them), which carry no gradient."""

    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        ctx.set_materialize_grads(False)
        y, mean, rstd = _row_norm_forward(ctx, plan, x, weight, bias)
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        if dy is None:
            return None, None, None, None
        return _PlannedRowNorm.backward(ctx, dy)


class _PlannedAddNorm(torch.autograd.Function):
    """The add-norms from a training plan: (y, h) with h = dropout(x) + residual."""

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
            keep = None if ctx.plan.keep_scale is None else ctx.plan.keep_scale(h, weight, mean, rstd)
            dy, dh = (None if g is None else g.reshape(rows) for g in (dy, dh))
            w = None if weight is None else weight.reshape(-1)
            dx, dres, dw, db = higher_order.add_norm(
                dy, dh, h.reshape(rows), w, ctx.bias_dtype, args[2], args[3], keep, ctx.x_dtype,
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
    """BatchNorm from a training plan: in training mode the running statistics are updated in place
    by the plan's forward."""

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


class Training:
    """A training plan: ``(forward, backward)`` (and, for a contract add-norm plan with dropout, its
    ``keep_scale``) run by the op family's autograd Function; called as the inference plan is.
    ``spec``: (op, rows shape, the plan maker's arguments with tensors left out), what a backward
    with create_graph recomputes from (higher_order). This class: LayerNorm / RMSNorm / GroupNorm,
    ``plan(input, None, weight, bias)``."""

    __slots__ = ("forward", "backward", "keep_scale", "spec")

    def __init__(self, forward, backward, keep_scale=None, *, spec):
        self.forward, self.backward, self.keep_scale, self.spec = forward, backward, keep_scale, spec

    def __call__(self, x, residual, weight, bias):
        return _PlannedRowNorm.apply(self, x, weight, bias)

    def with_stats(self, x, weight, bias):
        """-> (y, mean, rstd): the statistics too (no gradient)."""
        return _PlannedRowNormStats.apply(self, x, weight, bias)


class AddNormTraining(Training):
    """An add-norm's training plan: ``plan(x, residual, weight, bias)`` -> (y, h)."""

    __slots__ = ()

    def __call__(self, x, residual, weight, bias):
        return _PlannedAddNorm.apply(self, x, residual, weight, bias)


class SoftmaxTraining(Training):
    """A softmax / log_softmax training plan: ``plan(input)``."""

    __slots__ = ()

    def __call__(self, x):
        return _PlannedSoftmax.apply(self, x)


class BatchNormTraining(Training):
    """A BatchNorm training plan: ``plan(input, weight, bias, running_mean, running_var, momentum)``."""

    __slots__ = ()

    def __call__(self, x, weight, bias, running_mean, running_var, momentum):
        return _PlannedBatchNorm.apply(self, x, weight, bias, running_mean, running_var, momentum)


_TRAINING = {"layer_norm": Training, "rms_norm": Training, "group_norm": Training,
             "batch_norm": BatchNormTraining, "add_layer_norm": AddNormTraining,
             "add_rms_norm": AddNormTraining, "softmax": SoftmaxTraining, "log_softmax": SoftmaxTraining}
