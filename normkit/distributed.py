"""The public ops on DTensors (tensor / sequence parallelism): local kernels, no communication.

Every function here has the signature of its :mod:`normkit.functional` twin and is what
``normkit.<op>``, the :mod:`normkit.nn` modules and :func:`normkit.patch` call. Plain tensors go
straight to the twin (two type checks of overhead). A ``torch.distributed.tensor.DTensor`` input is
handled the way ``local_map`` handles a function, written out with the primitives it is built on
(``DTensor.to_local(grad_placements=...)`` and ``DTensor.from_local(shape=, stride=)``, public since
torch 2.4, where ``local_map``'s signature kept changing):

- the input's placements are checked *before* the twin flattens leading dims to rows: on a DTensor
  that reshape would redistribute (a (B, S, H) tensor sharded along S cannot be viewed as (B*S, H)
  shards), on the local shard it is free;
- each rank runs the twin on its local shard (the same kernels, the same validation) and the
  result is wrapped back with the input's mesh, placements, global shape and stride. The forward
  and the input's backward move no data between ranks;
- weight / bias must be DTensors with ``Replicate()`` on every mesh dim (what ``SequenceParallel``
  and FSDP2 + TP give). Their local gradient is this shard's rows only, so it is handed back as
  ``Partial()`` (a pending sum) on every mesh dim where the input is sharded, ``Replicate()`` where
  it is replicated: exactly the placement torch's own ``native_layer_norm_backward`` strategy gives,
  so the sum happens where DTensor / FSDP2 / the optimizer expect it, once per parameter and not
  per call.

Accepted input placements (anything else raises :class:`normkit.InvalidArgument` naming the
argument, the placement and what is accepted; normkit never gathers an input behind your back):

- layer_norm, rms_norm, add_layer_norm, add_rms_norm: ``Replicate()`` or ``Shard(d)`` along a dim
  before the normalized ones (batch, sequence); ``residual`` must have x's placements.
- softmax, log_softmax: ``Replicate()`` or ``Shard(d)`` with d != dim (heads, sequence).
- group_norm, instance_norm: ``Replicate()`` or ``Shard(0)`` (statistics span channels and space);
  instance_norm's running statistics only with a replicated input (their update averages over
  the whole batch).
- batch_norm: ``Replicate()``; in eval mode (running statistics, no batch statistics) also
  ``Shard(d)`` with d != 1. Training statistics over a sharded batch would need a cross-rank
  all-reduce of per-channel sums: not done here (use torch.nn.SyncBatchNorm).
- ``Partial()`` inputs raise everywhere (a norm of a pending sum is not the sum of norms).

Dropout in add_layer_norm / add_rms_norm: the mask is a function of (seed, local element index),
so each shard gets its own seed, derived from ``seed`` and the shard's coordinates on the sharded
mesh dims (replicated mesh dims keep the same mask, so replicas stay equal). ``seed=None`` draws
the seed from each rank's CPU generator: seed every rank the same (``torch.manual_seed``).
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import Parameter

from normkit import cpu, dispatch, plans
from normkit import functional as F
from normkit.errors import InvalidArgument

_compiling = torch.compiler.is_compiling  # (bound once: checked on every softmax call)
_FLOAT32, _INF = torch.float32, float("inf")  # (the CPU fast paths' checks)
_grad_enabled = torch.is_grad_enabled

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
    "is_dtensor",
]


# --- recognising DTensors without importing torch.distributed.tensor ------------------------------


def is_dtensor(value) -> bool:
    """True for a DTensor. A plain tensor or a Parameter answers from its type alone; DTensor is
    looked up only when its module is already imported (importing it costs ~0.5 s, and no DTensor
    can exist before it is)."""
    if value is None or type(value) is Tensor or type(value) is Parameter:
        return False
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def _plain(*values) -> bool:
    for v in values:
        if v is not None and type(v) is not Tensor and type(v) is not Parameter and is_dtensor(v):
            return False
    return True


# --- the local call ---------------------------------------------------------------------------------


def _placements_text(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _check_input(op: str, name: str, x, bad_dims, accepted: str) -> None:
    """Placements of the DTensor ``x``: no Partial, no Shard along a dim in ``bad_dims``."""
    for mesh_dim, p in enumerate(x.placements):
        if p.is_partial():
            raise InvalidArgument(
                f"{op}: {name} is a DTensor with placement {p!r} on mesh dim {mesh_dim} (placements "
                f"{_placements_text(x.placements)}): a norm of a pending sum is not the sum of norms; "
                f"reduce it first (e.g. {name}.redistribute(placements=[Shard(1)]) for sequence "
                f"parallelism); accepted: {accepted}"
            )
        if p.is_shard() and p.dim % max(x.dim(), 1) in bad_dims:
            raise InvalidArgument(
                f"{op}: {name} is a DTensor sharded along dim {p.dim} ({p!r} on mesh dim {mesh_dim}, "
                f"placements {_placements_text(x.placements)}, shape {list(x.shape)}), a dim {op} "
                f"reduces over; normkit does not gather activations: accepted: {accepted} (or "
                f"redistribute explicitly)"
            )


def _local_param(op: str, name: str, p, x, grad_placements):
    """The local tensor of a replicated DTensor parameter, whose gradient flows back with
    ``grad_placements``; None stays None."""
    if p is None:
        return None
    if not is_dtensor(p):
        raise InvalidArgument(
            f"{op}: {name} is a {type(p).__name__} but the input is a DTensor; pass {name} as a DTensor "
            f"with Replicate() placements on the input's mesh (torch.distributed.tensor.parallel."
            f"SequenceParallel does this for norm modules), so its gradient is reduced across ranks"
        )
    if p.device_mesh != x.device_mesh:
        raise InvalidArgument(f"{op}: {name} is a DTensor on mesh {p.device_mesh}; expected the input's "
                              f"mesh {x.device_mesh}")  # fmt: skip
    if not all(q.is_replicate() for q in p.placements):
        raise InvalidArgument(
            f"{op}: {name} is a DTensor with placements {_placements_text(p.placements)}; accepted: "
            f"Replicate() on every mesh dim (norm parameters are replicated under tensor/sequence "
            f"parallelism; FSDP2 unshards them before forward)"
        )
    return _settled(p.to_local(grad_placements=grad_placements))


def _local_buffer(op: str, name: str, b):
    """A running-statistics buffer to update in place: plain, or the local tensor of a replicated
    DTensor (the same storage)."""
    if b is None or not is_dtensor(b):
        return b
    if not all(q.is_replicate() for q in b.placements):
        raise InvalidArgument(f"{op}: {name} is a DTensor with placements {_placements_text(b.placements)}; "
                              f"accepted: Replicate() on every mesh dim")  # fmt: skip
    with torch.no_grad():
        return b.to_local()


class _Wait(torch.autograd.Function):
    """Identity whose output is a plain tensor: waits for an AsyncCollectiveTensor."""

    @staticmethod
    def forward(ctx, t):
        done = t.trigger_wait()
        return done.view_as(done)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ToLocal(torch.autograd.Function):
    """``x.to_local()`` whose gradient is a DTensor with x's own placements, global shape and
    strides. DTensor's to_local derives the gradient's global strides from the local shard, which
    for an uneven shard (5 rows over 2 ranks) differ from the leaf's; torch 2.11's AccumulateGrad
    then copies the gradient into a tensor of the leaf's strides, a Replicate DTensor: an all-gather
    (H200 x2 run, rms_norm on a Shard(1) input of 5 rows)."""

    @staticmethod
    def forward(ctx, x):
        ctx.spec = (x.device_mesh, tuple(x.placements), x.shape, x.stride())
        local = _settled(x.to_local())
        return local.view_as(local)  # a new tensor object: the shard itself keeps no grad_fn

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(_settled(grad), mesh, placements, run_check=False, shape=shape,
                                  stride=stride)  # fmt: skip


def _localize(x):
    return _ToLocal.apply(x) if x.requires_grad and torch.is_grad_enabled() else _settled(x.to_local())


class _SettleGrad(torch.autograd.Function):
    """Identity whose backward waits for an AsyncCollectiveTensor gradient (the gradient that the
    next layer's redistribution hands back) before the backward kernels read it."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _settled(grad)


def _settled(t):
    """``to_local()`` of a DTensor just made by a collective (e.g. the reduce-scatter of a rowwise
    linear) is an AsyncCollectiveTensor, whose memory the kernels cannot read until it is waited
    for; torch ops wait implicitly, a kernel launch does not."""
    if t is None or type(t) is Tensor or type(t) is Parameter:
        return t
    funcol = sys.modules.get("torch.distributed._functional_collectives")
    if funcol is not None and isinstance(t, funcol.AsyncCollectiveTensor):
        return _Wait.apply(t) if t.requires_grad else t.trigger_wait()
    return t


def _global_stride(local: Tensor, shape) -> tuple[int, ...]:
    """Dense strides of the global ``shape`` with ``local``'s dim order (outermost first)."""
    order = sorted(range(local.dim()), key=lambda d: -local.stride(d))
    stride, acc = [0] * local.dim(), 1
    for d in reversed(order):
        stride[d] = acc
        acc *= shape[d]
    return tuple(stride)


def _wrap(out, x):
    from torch.distributed.tensor import DTensor

    def one(t):
        if t.requires_grad:
            t = _SettleGrad.apply(t)
        return DTensor.from_local(t, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=_global_stride(t, x.shape))  # fmt: skip

    return tuple(one(t) for t in out) if isinstance(out, tuple) else one(out)


def _grad_placements(x):
    """Where the input is sharded, a replicated parameter's local gradient is a partial sum."""
    from torch.distributed.tensor import Partial, Replicate

    return [Partial() if p.is_shard() else Replicate() for p in x.placements]


def _sharded(op, x, name, bad_dims, accepted, params, fn, others=None):
    """Run ``fn(local x, **local params, **local others)`` on this rank's shard and wrap the result
    like ``x``. ``others`` are activations that must share x's placements (the residual)."""
    if not is_dtensor(x):
        culprit = next(n for n, v in {**params, **(others or {})}.items() if is_dtensor(v))
        raise InvalidArgument(
            f"{op}: {culprit} is a DTensor but {name} is a {type(x).__name__}; pass {name} as a DTensor "
            f"too (e.g. DTensor.from_local), or local tensors for all (e.g. {culprit}.to_local())"
        )
    _check_input(op, name, x, bad_dims, accepted)
    grad = _grad_placements(x)
    local = {n: _local_param(op, n, v, x, grad) for n, v in params.items()}
    for n, v in (others or {}).items():
        if v is None:
            local[n] = None
            continue
        if not is_dtensor(v) or v.device_mesh != x.device_mesh or tuple(v.placements) != tuple(x.placements):
            got = _placements_text(v.placements) if is_dtensor(v) else f"a plain {type(v).__name__}"
            raise InvalidArgument(f"{op}: {n} is {got}; expected a DTensor with {name}'s placements "
                                  f"{_placements_text(x.placements)} on its mesh")  # fmt: skip
        local[n] = _localize(v)
    return _wrap(fn(_localize(x), **local), x)


def _trailing_dims(x, normalized_shape) -> range:
    """The dims that ``normalized_shape`` names (validation of its value is the twin's job)."""
    if isinstance(normalized_shape, numbers.Integral):
        n = 1
    elif isinstance(normalized_shape, Sequence):
        n = len(normalized_shape)
    else:
        n = 0
    return range(max(x.dim() - n, 0), x.dim())


def _accepted_rows(x, normalized_shape) -> str:
    first = _trailing_dims(x, normalized_shape).start
    return (f"Replicate() or Shard(d) with d < {first} (a dim before the normalized ones, e.g. batch or "
            f"sequence)")


# --- row ops ----------------------------------------------------------------------------------------


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """:func:`normkit.functional.layer_norm`, also on DTensors (see :mod:`normkit.distributed`)."""
    if (door := plans.DOOR) is not None and not dispatch._IN_OVERRIDE[0] and not _compiling() \
            and (y := door(2, input, normalized_shape, weight, bias, eps)) is not None:
        return y  # a CUDA call that a recorded plan serves: the backend's door (plans.DOOR)
    if (door := cpu.DOOR) is not None and not dispatch._IN_OVERRIDE[0] and not _compiling() \
            and (y := door(2, input, normalized_shape, weight, bias, eps)) is not None:
        return y  # a CPU call served by its torch operator from C++ (cpu.DOOR)
    if (type(input) is Tensor and input.is_cpu and not dispatch._IN_OVERRIDE[0] and type(eps) is float
            and 0 <= eps < _INF and input.dtype.is_floating_point and input.numel()):  # fmt: skip
        try:  # the CPU call: cpu.layer_norm inlined (a 1x8 call is ~5 us in torch)
            shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
            if input.dtype is _FLOAT32 or not _grad_enabled():  # (cpu._layer_norm's torch.layer_norm)
                return torch.layer_norm(input, shape, weight, bias, eps)
            return cpu._layer_norm(input, shape, weight, bias, eps)
        except cpu.ERRORS:
            pass
    if _plain(input, weight, bias):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)
    return _sharded("layer_norm", input, "input", _trailing_dims(input, normalized_shape),
                    _accepted_rows(input, normalized_shape), dict(weight=weight, bias=bias),
                    lambda x, weight, bias: F.layer_norm(x, normalized_shape, weight, bias, eps))  # fmt: skip


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """:func:`normkit.functional.rms_norm`, also on DTensors (see :mod:`normkit.distributed`)."""
    if (door := plans.DOOR) is not None and not dispatch._IN_OVERRIDE[0] and not _compiling() \
            and (y := door(3, input, normalized_shape, weight, None, eps)) is not None:
        return y  # (as layer_norm)
    if (door := cpu.DOOR) is not None and not dispatch._IN_OVERRIDE[0] and not _compiling() \
            and (y := door(3, input, normalized_shape, weight, eps)) is not None:
        return y  # (as layer_norm)
    if cpu.serves(input) and (y := cpu.rms_norm(input, normalized_shape, weight, eps)) is not None:
        return y
    if _plain(input, weight):
        return F.rms_norm(input, normalized_shape, weight, eps)
    return _sharded("rms_norm", input, "input", _trailing_dims(input, normalized_shape),
                    _accepted_rows(input, normalized_shape), dict(weight=weight),
                    lambda x, weight: F.rms_norm(x, normalized_shape, weight, eps))  # fmt: skip


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    """:func:`normkit.functional.softmax`, also on DTensors not sharded along ``dim``."""
    # a CUDA call that a recorded plan serves: the backend's door, one C++ call (plans.DOOR)
    if (door := plans.DOOR) is not None and dtype is None and not dispatch._IN_OVERRIDE[0] \
            and type(_stacklevel) is int and not _compiling() and (y := door(input, dim, 0)) is not None:
        return y
    if (door := cpu.DOOR) is not None and dtype is None and not dispatch._IN_OVERRIDE[0] \
            and type(_stacklevel) is int and not _compiling() and (y := door(0, input, dim)) is not None:
        return y  # a CPU call served by its torch operator from C++ (cpu.DOOR)
    if (type(input) is Tensor and type(dim) is int and dtype is None and type(_stacklevel) is int
            and input.is_cpu and input.dtype.is_floating_point and not dispatch._IN_OVERRIDE[0]):  # fmt: skip
        try:  # the common CPU call: _softmax's first branch inlined (a 1x8 call is ~1.5 us in torch)
            return input.softmax(dim)
        except cpu.ERRORS:
            pass
    return _softmax("softmax", False, input, dim, _stacklevel, dtype)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """:func:`normkit.functional.log_softmax`, also on DTensors not sharded along ``dim``."""
    if (door := plans.DOOR) is not None and dtype is None and not dispatch._IN_OVERRIDE[0] \
            and type(_stacklevel) is int and not _compiling() and (y := door(input, dim, 1)) is not None:
        return y  # (as softmax)
    if (door := cpu.DOOR) is not None and dtype is None and not dispatch._IN_OVERRIDE[0] \
            and type(_stacklevel) is int and not _compiling() and (y := door(1, input, dim)) is not None:
        return y  # (as softmax)
    if (type(input) is Tensor and type(dim) is int and dtype is None and type(_stacklevel) is int
            and input.is_cpu and input.dtype.is_floating_point and not dispatch._IN_OVERRIDE[0]):  # fmt: skip
        try:  # (as softmax)
            return input.log_softmax(dim)
        except cpu.ERRORS:
            pass
    return _softmax("log_softmax", True, input, dim, _stacklevel, dtype)


def _softmax(op, log, input, dim, stacklevel, dtype):
    if type(input) is Tensor and type(dim) is int and dtype is None and type(stacklevel) is int:
        # the common call (on CPU the public functions ran it already): the plan functional
        # remembered for it, found without its layers (~1 us: docs/performance.md)
        if not input.is_cpu and (plan := plans.stored(F.softmax_key(op, input, dim, None))) is not None:
            return plan(input)
    elif type(stacklevel) is int and cpu.serves(input):  # (a dtype there is an error: see functional)
        if (y := cpu.softmax(input, dim, dtype, log)) is not None:
            return y
    fn = F.log_softmax if log else F.softmax
    # stacklevel + 2: the implicit-dim warning points at the caller, through this module's two frames
    level = stacklevel + 2 if type(stacklevel) is int else stacklevel
    if _plain(input):
        return fn(input, dim, level, dtype)
    bad = set(range(input.dim())) if not isinstance(dim, numbers.Integral) or input.dim() == 0 else {
        dim % input.dim()}  # fmt: skip
    return _sharded(op, input, "input", bad, f"Replicate() or Shard(d) with d != dim ({dim})", {},
                    lambda x: fn(x, dim, level, dtype))  # fmt: skip


# --- fused residual add + dropout + norm ----------------------------------------------------------

_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct shards get far-apart seeds


def _shard_seed(x, dropout_p, seed):
    """The seed for this rank's shard: ``seed`` mixed with the coordinates on sharded mesh dims."""
    if dropout_p <= 0 or isinstance(seed, bool) or not isinstance(seed, (numbers.Integral, type(None))):
        return seed  # no dropout, or a bad seed for the twin to reject
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # as the twin draws it
    coordinate = x.device_mesh.get_coordinate() or []
    index = 0
    for mesh_dim, p in enumerate(x.placements):
        if p.is_shard():
            index = index * x.device_mesh.size(mesh_dim) + coordinate[mesh_dim]
    return seed if index == 0 else (seed + _GOLDEN * index) % 2**63


def _add_norm(op, fn, x, residual, normalized_shape, params, dropout_p, seed, **kwargs):
    if _plain(x, residual, *params.values()):
        return fn(x, residual, normalized_shape, **params, dropout_p=dropout_p, seed=seed, **kwargs)
    if is_dtensor(x):
        seed = _shard_seed(x, dropout_p, seed)

    def local(x, residual, **p):
        return fn(x, residual, normalized_shape, **p, dropout_p=dropout_p, seed=seed, **kwargs)

    return _sharded(op, x, "x", _trailing_dims(x, normalized_shape), _accepted_rows(x, normalized_shape),
                    params, local, others=dict(residual=residual))  # fmt: skip


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, dropout_p=0.0,
                   seed=None, residual_dtype=None, prenorm=False):  # fmt: skip
    """:func:`normkit.functional.add_layer_norm`, also on DTensors (see :mod:`normkit.distributed`)."""
    if (door := cpu.DOOR) is not None and type(dropout_p) is float and dropout_p == 0 and seed is None \
            and residual_dtype is None and prenorm is False and not dispatch._IN_OVERRIDE[0] \
            and not _compiling() and (y := door(4, x, residual, normalized_shape, weight, bias,
                                                eps)) is not None:  # fmt: skip
        return y  # a CPU call served by torch's operators from C++ (cpu.DOOR)
    if (type(x) is Tensor and x.is_cpu and type(residual) is Tensor and residual.dtype is x.dtype
            and type(dropout_p) is float and dropout_p == 0 and seed is None and residual_dtype is None
            and prenorm is False and type(eps) is float and 0 <= eps < _INF and not dispatch._IN_OVERRIDE[0]
            and x.dtype.is_floating_point and residual.shape == x.shape and x.numel()):  # fmt: skip
        try:  # the common CPU call: cpu.add_norm's first route inlined (a 1x8 call is ~7 us in torch)
            shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
            if x.dtype is _FLOAT32 or not _grad_enabled():  # (as layer_norm)
                return torch.layer_norm(x + residual, shape, weight, bias, eps)
            return cpu._layer_norm(x + residual, shape, weight, bias, eps)
        except cpu.ERRORS:
            pass
    elif cpu.serves(x):
        out = cpu.add_norm(x, residual, normalized_shape, weight, bias, eps, dropout_p, seed, residual_dtype,
                           prenorm, False)  # fmt: skip
        if out is not None:
            return out
    return _add_norm("add_layer_norm", F.add_layer_norm, x, residual, normalized_shape,
                     dict(weight=weight, bias=bias), dropout_p, seed, eps=eps, residual_dtype=residual_dtype,
                     prenorm=prenorm)  # fmt: skip


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, dropout_p=0.0, seed=None,
                 residual_dtype=None, prenorm=False):  # fmt: skip
    """:func:`normkit.functional.add_rms_norm`, also on DTensors (see :mod:`normkit.distributed`)."""
    if (door := cpu.DOOR) is not None and type(dropout_p) is float and dropout_p == 0 and seed is None \
            and residual_dtype is None and prenorm is False and not dispatch._IN_OVERRIDE[0] \
            and not _compiling() and (y := door(5, x, residual, normalized_shape, weight, eps)) is not None:
        return y  # (as add_layer_norm)
    if cpu.serves(x):
        out = cpu.add_norm(x, residual, normalized_shape, weight, None, eps, dropout_p, seed, residual_dtype,
                           prenorm, True)  # fmt: skip
        if out is not None:
            return out
    return _add_norm("add_rms_norm", F.add_rms_norm, x, residual, normalized_shape, dict(weight=weight),
                     dropout_p, seed, eps=eps, residual_dtype=residual_dtype, prenorm=prenorm)  # fmt: skip


# --- image norms ------------------------------------------------------------------------------------

_BATCH_ONLY = "Replicate() or Shard(0) (the batch dim; statistics span channels and spatial dims)"


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """:func:`normkit.functional.group_norm`, also on DTensors sharded along the batch dim."""
    if cpu.serves(input) and (y := cpu.group_norm(input, num_groups, weight, bias, eps)) is not None:
        return y
    if _plain(input, weight, bias):
        return F.group_norm(input, num_groups, weight, bias, eps)
    return _sharded("group_norm", input, "input", set(range(1, input.dim())), _BATCH_ONLY,
                    dict(weight=weight, bias=bias),
                    lambda x, weight, bias: F.group_norm(x, num_groups, weight, bias, eps))  # fmt: skip


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):  # fmt: skip
    """:func:`normkit.functional.instance_norm`, also on DTensors sharded along the batch dim
    (running statistics only with a replicated input: their update averages the whole batch)."""
    if cpu.serves(input):
        y = cpu.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
        if y is not None:
            return y
    if _plain(input, running_mean, running_var, weight, bias):
        return F.instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
    op = "instance_norm"
    bad = set(range(1, input.dim())) if is_dtensor(input) else set()
    if is_dtensor(input) and (running_mean is not None or running_var is not None):
        bad = set(range(input.dim()))
    running = [_local_buffer(op, n, b) for n, b in (("running_mean", running_mean),
                                                            ("running_var", running_var))]  # fmt: skip
    accepted = (_BATCH_ONLY if not bad or 0 not in bad
                else "Replicate() (running statistics average the whole batch)")
    return _sharded(op, input, "input", bad, accepted, dict(weight=weight, bias=bias),
                    lambda x, weight, bias: F.instance_norm(x, *running, weight, bias, use_input_stats,
                                                            momentum, eps))  # fmt: skip


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-5):  # fmt: skip
    """:func:`normkit.functional.batch_norm`, also on replicated DTensors (and, in eval mode, on
    DTensors not sharded along channels): batch statistics of a sharded batch would need a
    cross-rank all-reduce, which normkit does not do (torch.nn.SyncBatchNorm does)."""
    if (door := cpu.DOOR) is not None and not dispatch._IN_OVERRIDE[0] and not _compiling() \
            and (y := door(6, input, running_mean, running_var, weight, bias, training, momentum,
                           eps)) is not None:  # fmt: skip
        return y  # a CPU call served by its torch operator from C++ (cpu.DOOR)
    if cpu.serves(input) and (y := cpu.batch_norm(input, running_mean, running_var, weight, bias,
                                                  training, momentum, eps)) is not None:  # fmt: skip
        return y
    if _plain(input, running_mean, running_var, weight, bias):
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    op = "batch_norm"
    if training:
        bad = set(range(input.dim())) if is_dtensor(input) else set()
        accepted = ("Replicate() in training mode (batch statistics of a sharded input would need a "
                    "cross-rank all-reduce; use torch.nn.SyncBatchNorm)")  # fmt: skip
    else:
        bad, accepted = {1}, "Replicate() or Shard(d) with d != 1 (eval mode)"
    running = [_local_buffer(op, n, b) for n, b in (("running_mean", running_mean),
                                                            ("running_var", running_var))]  # fmt: skip
    return _sharded(op, input, "input", bad, accepted, dict(weight=weight, bias=bias),
                    lambda x, weight, bias: F.batch_norm(x, *running, weight, bias, training, momentum,
                                                         eps))  # fmt: skip

