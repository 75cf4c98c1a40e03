"""torch.nn.functional-compatible entry points: check the call, then run its plan.

Each op first looks up the plan remembered for its call's signature (:func:`normkit.plans.key`): a
repeated call runs it with no checks or dispatch. Otherwise it checks every argument (errors name
the argument, what was given and what is accepted), flattens the input to the kernels' view (rows
``(M, N)``, N = the product of ``normalized_shape``; (N, C, HW) for the channel norms), picks the
backend for the input's device (:mod:`normkit.dispatch`), and runs the plan :func:`normkit.plans.make`
gives: the backend's own, or one over its contract functions. While torch.compile traces, the same
checks lead to the custom operators of :mod:`normkit.ops` instead.
"""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from types import ModuleType
from typing import Sequence

import torch

from normkit import dispatch, ops, plans, reference
from normkit.errors import InvalidArgument, InvalidDim, InvalidDtype

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_tensor(op: str, name: str, value, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in _FLOAT_DTYPES:
        raise InvalidDtype(
            f"{op}: {name} has dtype {value.dtype}; accepted: {_dtype_names(_FLOAT_DTYPES)}"
        )


def _normalized_shape(op: str, input: torch.Tensor, normalized_shape, name="input") -> tuple[int, ...]:
    kind = type(normalized_shape)
    if kind is int:  # the common cases first: exact types, no ABC checks (host time, docs/tuning-log.md T12)
        shape = (normalized_shape,)
    elif kind in (tuple, list, torch.Size) and all(type(d) is int for d in normalized_shape):
        shape = tuple(normalized_shape)
    elif isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, Sequence) and None not in (
            dims := [_as_index(d) for d in normalized_shape]):  # fmt: skip
        shape = tuple(dims)  # numpy ints or 0-dim integer tensors too, as torch accepts
    else:
        raise TypeError(
            f"{op}: normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
        )
    if len(shape) == 0:
        raise InvalidArgument(f"{op}: normalized_shape must have at least one dimension, got ()")
    if tuple(input.shape[input.dim() - len(shape):]) != shape or input.dim() < len(shape):
        raise InvalidArgument(
            f"{op}: normalized_shape {list(shape)} does not match the trailing dims of {name} "
            f"with shape {list(input.shape)}; expected {name}.shape[-{len(shape)}:] == {list(shape)}"
        )
    return shape


def _check_param(op: str, name: str, value, shape: tuple[int, ...], per_channel=False) -> None:
    """``value`` None or a float tensor of ``shape``: normalized_shape for the row norms, (C,) for the
    channel norms (``per_channel``: GroupNorm, InstanceNorm, BatchNorm)."""
    _check_tensor(op, name, value, required=False)
    if value is not None and tuple(value.shape) != shape:
        expected = (f"shape {list(shape)} (num_channels: one entry per channel of input, input.shape[1])"
                    if per_channel else f"normalized_shape {list(shape)}")  # fmt: skip
        raise InvalidArgument(f"{op}: {name} has shape {list(value.shape)}; expected {expected}")


def _check_param_dtypes(op: str, input: torch.Tensor, **params: torch.Tensor | None) -> None:
    """torch's rule for the parameters of its native norms (layer_norm, group_norm, batch_norm):
    the given ones share one dtype, which is the input's, or float32 for a float16 / bfloat16
    input (fp32 weights with half activations). Other mixes are what torch rejects."""
    given = {name: p for name, p in params.items() if p is not None}
    if not given:
        return
    accepted = [input.dtype]
    if input.dtype in (torch.float16, torch.bfloat16):
        accepted.append(torch.float32)
    first_name, first = next(iter(given.items()))
    for name, p in given.items():
        if p.dtype not in accepted:
            raise InvalidDtype(
                f"{op}: {name} has dtype {p.dtype} but input has dtype {input.dtype}; accepted "
                f"for {name}: {_dtype_names(accepted)} (as torch.nn.functional.{op})"
            )
        if p.dtype != first.dtype:
            raise InvalidDtype(
                f"{op}: {name} has dtype {p.dtype} but {first_name} has dtype {first.dtype}; "
                f"accepted: {', '.join(given)} all of one dtype (as torch.nn.functional.{op})"
            )


def _as_index(value) -> int | None:
    """``value`` as an int where torch takes it for an int argument (an int, a numpy integer, a
    0-dim integer tensor), else None; never a bool (torch refuses those too)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or (
            isinstance(value, torch.Tensor) and (value.dim() or value.dtype == torch.bool)):  # fmt: skip
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _tensor_scalar(value):
    """A 0-dim real tensor that does not require grad, read to a Python number, as torch's argument
    parser reads a tensor given for a float argument (eps, momentum); None for any other value (a
    tensor that requires grad, has dims, or holds a bool or a complex number)."""
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
            and value.dtype != torch.bool and not value.dtype.is_complex):  # fmt: skip
        return value.item()
    return None


_REAL = "a real number (or a 0-dim real tensor that does not require grad)"


def _check_eps(op: str, eps) -> float:
    if type(eps) is float and 0 <= eps < math.inf:  # the common case, without the ABC checks
        return eps
    value = _tensor_scalar(eps) if isinstance(eps, torch.Tensor) else eps
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: eps must be {_REAL} >= 0, got {eps!r}")
    if not (value >= 0 and math.isfinite(value)):
        raise InvalidArgument(f"{op}: eps must be a finite number >= 0, got {eps!r}; accepted: 0 <= eps "
                              f"< inf (a negative, inf or nan eps is refused on purpose)")  # fmt: skip
    return float(value)


def _check_momentum(op: str, momentum) -> float:
    """momentum as a float: a real number or a 0-dim tensor, as torch reads it (None is torch's
    TypeError too: the modules' momentum=None, a cumulative average, is theirs to resolve)."""
    if type(momentum) is float:
        return momentum
    value = _tensor_scalar(momentum) if isinstance(momentum, torch.Tensor) else momentum
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: momentum must be {_REAL}, got {momentum!r}")
    return float(value)


def _backend(op: str, input: torch.Tensor, name="input", **params) -> ModuleType | None:
    """The backend serving ``input`` after the device and dtype checks; None while torch.compile
    traces (the custom ops pick the backend when they run, and the backend lookup reads a
    ContextVar that Dynamo cannot trace)."""
    if torch.compiler.is_compiling():
        dispatch.check_devices(input, op=op, input_name=name, **params)
        return None
    backend = dispatch.served(input.device)
    if backend is not None and input.dtype in backend.SUPPORTED_DTYPES:
        dispatch.check_devices(input, op=op, input_name=name, **params)
        return backend
    table = dispatch.registered()
    if input.device.type not in table:
        raise InvalidArgument(
            f"{op}: {name} is on device type '{input.device.type}', which no normkit backend "
            f"serves; supported device types: {', '.join(sorted(table))}"
        )
    backend = dispatch.backend_for_tensors(input, op=op, input_name=name, **params)
    if input.dtype not in backend.SUPPORTED_DTYPES:
        raise InvalidDtype(
            f"{op}: {name} has dtype {input.dtype}, which the {backend.NAME} backend serving "
            f"{input.device.type} does not support; accepted: {_dtype_names(backend.SUPPORTED_DTYPES)}"
        )
    return backend


def _flat_param(p: torch.Tensor | None) -> torch.Tensor | None:
    if p is None or (p.dim() == 1 and p.is_contiguous()):  # no view: no extra autograd node
        return p
    return p.reshape(-1).contiguous()


_SEQUENCES = (tuple, list, torch.Size)
# Signatures of row-op calls that passed every check below, with the backend that served them: a
# repeated call (a model's layers, every step) skips the checks, ~6 us of host time on the H100 host
# (docs/tuning-log.md T14). Only calls with exact int shapes, outside a torch.compile trace; the
# backend overrides in effect (dispatch.use_backend) are part of the signature.
_VALID: dict = {}
VALID_SIZE = 4096  # signatures remembered; then cleared


def _shape_key(normalized_shape):
    """normalized_shape as a hashable, or None unless it is an int or a sequence of exact ints."""
    if type(normalized_shape) is int:
        return normalized_shape
    if type(normalized_shape) in _SEQUENCES and all(type(d) is int for d in normalized_shape):
        return tuple(normalized_shape)
    return None


def _signature(op, input, normalized_shape, input_name, torch_dtypes, params) -> tuple | None:
    """What the checks of :func:`_prepare` depend on (eps aside), or None where the call is not
    memoized."""
    if type(input) is not torch.Tensor or torch.compiler.is_compiling():
        return None
    shape = _shape_key(normalized_shape)
    if shape is None:
        return None
    given = []
    for p in params.values():
        if p is not None and not isinstance(p, torch.Tensor):
            return None  # an error below
        given.append(None if p is None else (type(p), p.shape, p.dtype, p.device))
    return (op, input.shape, input.dtype, input.device, shape, input_name, torch_dtypes, tuple(params),
            tuple(given), plans.overrides_key())  # fmt: skip


def _prepare(op, input, normalized_shape, eps, input_name="input", torch_dtypes=False, **params):
    """Validate everything and return (backend, (M, N) rows of input, flat params, eps).
    ``torch_dtypes``: the parameters follow torch's dtype rule of its native norms
    (:func:`_check_param_dtypes`)."""
    signature = _signature(op, input, normalized_shape, input_name, torch_dtypes, params)
    backend = _VALID.get(signature) if signature is not None else None
    if backend is not None and type(eps) is float and 0 <= eps < math.inf:
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
    else:
        _check_tensor(op, input_name, input, required=True)
        shape = _normalized_shape(op, input, normalized_shape, input_name)
        for name, value in params.items():
            _check_param(op, name, value, shape)
        eps = _check_eps(op, eps)
        backend = _backend(op, input, input_name, **params)
        if torch_dtypes:
            _check_param_dtypes(op, input, **params)
        if signature is not None and backend is not None:
            if len(_VALID) >= VALID_SIZE:
                _VALID.clear()
            _VALID[signature] = backend
    if input.dim() == 2 and len(shape) == 1:  # already rows: no view, so no extra autograd node
        x = plans.unit_stride(input)
    else:
        m = math.prod(input.shape[: input.dim() - len(shape)])
        x = plans.unit_stride(input.reshape(m, math.prod(shape)))
    if x.numel() == 0:
        backend = reference  # nothing to launch: plain torch gives the empty results (and zero grads)
    flat = {name: _flat_param(value) for name, value in params.items()}
    return backend, x, flat, eps


def _shaped(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rows`` viewed in ``like``'s shape (no view when it already has it: no extra autograd node)."""
    return rows if rows.shape == like.shape else rows.view(like.shape)


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Same signature and semantics as :func:`torch.nn.functional.layer_norm`."""
    key = plans.key("layer_norm", input, (weight, bias), _shape_key(normalized_shape),
                    eps if type(eps) is float else None)  # fmt: skip
    plan = plans.stored(key)
    if plan is not None:
        return plan(input, None, weight, bias)
    backend, x, p, eps = _prepare(
        "layer_norm", input, normalized_shape, eps, torch_dtypes=True, weight=weight, bias=bias
    )
    if backend is None:  # torch.compile traces: the custom operator
        return _shaped(ops.layer_norm_fwd(x, p["weight"], p["bias"], eps)[0], input)
    plan = plans.make(key, backend, "row_norm", "layer_norm", x, p["weight"], p["bias"], eps, False)
    if key is not None:
        return plan(input, None, weight, bias)
    return _shaped(plan(x, None, p["weight"], p["bias"]), input)


def _rms_weight(op: str, input, weight: torch.Tensor) -> torch.Tensor:
    """An integer or bool RMSNorm weight as torch uses one: in the input's math dtype (float32, or
    float64 for a float64 input), as torch's rms_norm multiplies by it (type promotion) and returns
    the input's dtype. A complex weight is refused (torch would drop its imaginary part)."""
    if weight.dtype.is_complex:
        raise InvalidDtype(f"{op}: weight has dtype {weight.dtype}; accepted: {_dtype_names(_FLOAT_DTYPES)}, "
                           f"or an integer or bool dtype (a complex weight is refused: torch would drop its "
                           f"imaginary part)")  # fmt: skip
    f64 = isinstance(input, torch.Tensor) and input.dtype == torch.float64
    return weight.to(torch.float64 if f64 else torch.float32)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """Same signature and semantics as :func:`torch.nn.functional.rms_norm`.

    ``eps=None`` means ``torch.finfo(input.dtype).eps``, as in torch.
    """
    if eps is None and isinstance(input, torch.Tensor) and input.dtype.is_floating_point:
        eps = torch.finfo(input.dtype).eps
    key = plans.key("rms_norm", input, (weight,), _shape_key(normalized_shape),
                    eps if type(eps) is float else None)  # fmt: skip
    plan = plans.stored(key)
    if plan is not None:
        return plan(input, None, weight, None)
    if isinstance(weight, torch.Tensor) and weight.dtype not in _FLOAT_DTYPES:
        weight, key = _rms_weight("rms_norm", input, weight), None  # no plan keyed by the integer weight
    backend, x, p, eps = _prepare("rms_norm", input, normalized_shape, eps, weight=weight)
    if backend is None:  # torch.compile traces: the custom operator
        return _shaped(ops.rms_norm_fwd(x, p["weight"], eps)[0], input)
    plan = plans.make(key, backend, "row_norm", "rms_norm", x, p["weight"], None, eps, True)
    if key is not None:
        return plan(input, None, weight, None)
    return _shaped(plan(x, None, p["weight"], None), input)


def softmax_key(op: str, input, dim, dtype):
    """The plan key of a softmax / log_softmax call: only a last-dim call without ``dtype`` has one
    (normkit.distributed looks its plan up with it before this module's layers)."""
    if dtype is not None or type(dim) is not int or type(input) is not torch.Tensor:
        return None
    if dim != -1 and dim != input.dim() - 1:
        return None
    return plans.input_key(op, input, True) if input.dim() else None


def _softmax(op: str, input, dim, stacklevel, dtype, log: bool):
    if type(stacklevel) is not int and isinstance(stacklevel, torch.dtype):
        raise TypeError(f"{op}: the third positional argument is _stacklevel, as in torch.nn.functional."
                        f"{op}, got the dtype {stacklevel}; pass dtype={stacklevel} by keyword")  # fmt: skip
    key = softmax_key(op, input, dim, dtype)
    plan = plans.stored(key)
    if plan is not None:
        return plan(input)
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}: input must be a torch.Tensor, got {type(input).__name__}")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in _FLOAT_DTYPES:
            raise InvalidDtype(f"{op}: dtype must be one of {_dtype_names(_FLOAT_DTYPES)} or None, "
                               f"got {dtype!r}")  # fmt: skip
        if input.dtype.is_complex:
            raise InvalidDtype(f"{op}: input has dtype {input.dtype}; accepted with dtype={dtype}: a real "
                               f"(float, integer or bool) dtype (a complex input is refused: the cast "
                               f"would drop its imaginary part)")  # fmt: skip
        input = input.to(dtype)  # as torch: cast first (integer inputs too), so the math is in dtype
    _check_tensor(op, "input", input, required=True)
    if dim is None:  # torch's implicit choice (deprecated), its warning included
        warnings.warn(f"Implicit dimension choice for {op} has been deprecated. "
                      "Change the call to include dim=X as an argument.", stacklevel=stacklevel)  # fmt: skip
        dim = 0 if input.dim() in (0, 1, 3) else 1
    elif type(dim) is not int:
        index = _as_index(dim)
        if index is None:
            raise TypeError(f"{op}: dim must be an int (or None), got {dim!r}")
        dim = index
    ndim = max(input.dim(), 1)
    if not -ndim <= dim < ndim:
        raise InvalidDim(
            f"{op}: dim {dim} is out of range for input with {input.dim()} dims; "
            f"expected a value in [{-ndim}, {ndim - 1}]"
        )
    backend = _backend(op, input)  # a served device and a supported dtype, or an error
    # Rows along `dim`: moving it last costs a transposing copy when dim is not already last. No
    # view is taken where none is needed (each view is an extra autograd node on both passes).
    last = input.dim() > 0 and dim % input.dim() == input.dim() - 1
    moved = input.reshape(1) if input.dim() == 0 else input if last else input.movedim(dim, -1)
    if moved.dim() == 2 and moved.numel():
        rows = moved
    else:
        rows = moved.reshape(-1, moved.shape[-1]) if moved.numel() else moved.reshape(0, moved.shape[-1])
    rows = plans.unit_stride(rows)
    if backend is None:  # torch.compile traces: the custom operator
        y = _shaped(ops.softmax_fwd(rows, log), moved)
    else:
        plan = plans.make(key, backend, "softmax", op, rows, log)
        if key is not None:
            return plan(input)
        y = _shaped(plan(rows), moved)
    return y.reshape(()) if input.dim() == 0 else y if last else y.movedim(-1, dim)


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    """Same signature and semantics as :func:`torch.nn.functional.softmax`: ``dim=None`` is torch's
    deprecated implicit choice (0 for 0-, 1- and 3-dim inputs, else 1) with torch's warning;
    ``dtype`` casts the input first (integer and bool inputs too)."""
    return _softmax("softmax", input, dim, _stacklevel, dtype, log=False)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    """Same signature and semantics as :func:`torch.nn.functional.log_softmax` (see :func:`softmax`)."""
    return _softmax("log_softmax", input, dim, _stacklevel, dtype, log=True)


def _add_norm(op, x, residual, normalized_shape, weight, bias, eps, dropout_p, seed, residual_dtype,
              prenorm, is_rms):  # fmt: skip
    # a plan serves calls without dropout (and no seed)
    plain = seed is None and type(dropout_p) in (float, int) and dropout_p == 0
    key = plans.key(op, x, (residual, weight, bias), _shape_key(normalized_shape),
                    eps if type(eps) is float and plain else None, (residual_dtype,), prenorm)  # fmt: skip
    plan = plans.stored(key)
    if plan is not None:  # (only keys whose residual has x's shape get a plan: see below)
        y, h = plan(x, residual, weight, bias)
        return (y, h) if prenorm else y
    if residual is not None and isinstance(residual, torch.Tensor) and isinstance(x, torch.Tensor) and (
            residual.shape != x.shape):  # fmt: skip
        # x's shape from here on; no plan keyed by the residual's own shape
        residual, key = _broadcast_residual(op, x, residual), None
    if residual is not None:
        _check_tensor(op, "residual", residual, required=True)
    if type(dropout_p) is not float:
        dropout_p = _dropout_p(op, dropout_p)
    if not 0 <= dropout_p <= 1:
        raise InvalidArgument(f"{op}: dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if seed is None:
        # Drawn from torch's CPU generator (reproducible under torch.manual_seed; no device sync).
        # None drawn for p = 1, which drops every element (F.dropout(p=1) draws nothing either).
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if 0 < dropout_p < 1 else 0
    elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise InvalidArgument(f"{op}: seed must be an int in [0, 2**63) or None, got {seed!r}")
    if residual_dtype is not None and residual_dtype not in _FLOAT_DTYPES:
        raise InvalidDtype(f"{op}: residual_dtype must be one of {_dtype_names(_FLOAT_DTYPES)} or "
                           f"None, got {residual_dtype!r}")  # fmt: skip
    if is_rms and isinstance(weight, torch.Tensor) and weight.dtype not in _FLOAT_DTYPES:
        weight, key = _rms_weight(op, x, weight), None  # as rms_norm's; no plan keyed by the integer weight
    params = dict(weight=weight) if is_rms else dict(weight=weight, bias=bias)
    # LayerNorm's parameters follow torch.nn.functional.layer_norm's dtype rule
    backend, rows, p, eps = _prepare(op, x, normalized_shape, eps, input_name="x", torch_dtypes=not is_rms,
                                     **params)  # fmt: skip
    dispatch.check_devices(x, op=op, input_name="x", residual=residual)  # or an error naming residual
    if dropout_p == 1:  # every element dropped (F.dropout(p=1) is zeros): h = residual, x's gradient 0
        rows, dropout_p = rows.mul(0).nan_to_num(0.0, 0.0, 0.0), 0.0  # (1 / (1 - p) would be inf)
    h_dtype = residual_dtype or (residual.dtype if residual is not None else x.dtype)
    for name, dtype in (("residual", None if residual is None else residual.dtype), ("h", h_dtype)):
        if backend is not None and dtype is not None and dtype not in backend.SUPPORTED_DTYPES:
            raise InvalidDtype(f"{op}: {name} dtype {dtype} is not supported by the {backend.NAME} "
                               f"backend; accepted: {_dtype_names(backend.SUPPORTED_DTYPES)}")  # fmt: skip
    r_rows = None if residual is None else plans.unit_stride(residual.reshape(rows.shape))
    if backend is None:  # torch.compile traces: the custom operator
        y, h = ops.add_norm_fwd(rows, r_rows, p["weight"], p.get("bias"), eps, float(dropout_p), int(seed),
                                h_dtype, is_rms)[:2]  # fmt: skip
    else:  # (with dropout: a plan of its own, with this call's seed)
        plan = plans.make(key, backend, "row_norm", op, rows, p["weight"], p.get("bias"), eps, is_rms, True,
                          r_rows, h_dtype, contract=(float(dropout_p), int(seed)))  # fmt: skip
        if key is not None:
            y, h = plan(x, residual, weight, bias)
            return (y, h) if prenorm else y
        y, h = plan(rows, r_rows, p["weight"], p.get("bias"))
    y, h = _shaped(y, x), _shaped(h, x)
    return (y, h) if prenorm else y


def _broadcast_residual(op: str, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """A residual whose shape broadcasts to x's, expanded to x's shape (a copy: the kernels read
    rows); its gradient comes back summed to its own shape, as autograd of ``x + residual`` gives."""
    try:
        shape = torch.broadcast_shapes(residual.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise InvalidArgument(f"{op}: residual has shape {list(residual.shape)}; expected x's shape "
                              f"{list(x.shape)} or a shape that broadcasts to it")  # fmt: skip
    return residual.expand(x.shape).contiguous()


def _dropout_p(op: str, dropout_p) -> float:
    """dropout_p as a float: a real number or a 0-dim tensor (as F.dropout reads p)."""
    value = _tensor_scalar(dropout_p) if isinstance(dropout_p, torch.Tensor) else dropout_p
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{op}: dropout_p must be a number in [0, 1], got {dropout_p!r}")
    return float(value)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5, dropout_p=0.0,
                   seed=None, residual_dtype=None, prenorm=False):  # fmt: skip
    """``h = dropout(x) + residual; y = layer_norm(h)`` in one pass. Returns y, or (y, h) with
    ``prenorm=True``.

    - ``residual`` may be None (h = dropout(x)), or of any shape that broadcasts to x's (its
      gradient then comes back summed to its shape). h is kept in ``residual_dtype`` (default: the
      residual's dtype, else x's), e.g. an fp32 residual stream with bf16 activations; y is in x's
      dtype.
    - Dropout keeps each element of x with probability 1 - ``dropout_p`` and scales it by
      1 / (1 - dropout_p); a dropped element is 0. The mask is never stored: it is a function of
      (``seed``, element index), regenerated in the backward, so the same seed gives the same mask on
      every call. ``seed=None`` draws one from torch's default CPU generator. ``dropout_p=1`` drops
      every element (h = residual, x's gradient 0) and draws no seed.
    - ``eps`` and ``dropout_p`` may be 0-dim tensors (read with ``.item()``, as torch reads them).
    - Gradients flow to x, residual, weight and bias (and into h's own uses when returned).
    """
    return _add_norm("add_layer_norm", x, residual, normalized_shape, weight, bias, eps, dropout_p,
                     seed, residual_dtype, prenorm, is_rms=False)  # fmt: skip


def add_rms_norm(x, residual, normalized_shape, weight=None, eps=None, dropout_p=0.0, seed=None,
                 residual_dtype=None, prenorm=False):  # fmt: skip
    """``h = dropout(x) + residual; y = rms_norm(h)``; see :func:`add_layer_norm`.
    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in :func:`torch.nn.functional.rms_norm`."""
    if eps is None and isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        eps = torch.finfo(x.dtype).eps
    return _add_norm("add_rms_norm", x, residual, normalized_shape, weight, None, eps, dropout_p,
                     seed, residual_dtype, prenorm, is_rms=True)  # fmt: skip


def _num_groups(op: str, num_groups) -> int:
    """num_groups as an int (a numpy integer or 0-dim integer tensor too, as torch takes), or
    torch's TypeError for another type (a bool or float included)."""
    index = _as_index(num_groups)
    if index is None:
        raise TypeError(f"{op}: num_groups must be a positive int, got {num_groups!r}")
    return index


def _divisors(n: int) -> str:
    """The divisors of n as a short text (the accepted num_groups for n channels)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    found = sorted(set(small + [n // d for d in small]))
    return ", ".join(map(str, found[:12])) + (", ..." if len(found) > 12 else "") if found else "none"


def _channels(x: torch.Tensor) -> torch.Tensor:
    """An (N, C, HW) view of a channel norm's input as the kernels take it: contiguous, or
    channels-last (channels_last / channels_last_3d inputs: strides (HW * C, 1, C)), read and
    written in place; a copy for any other layout."""
    if x.is_contiguous():
        return x
    N, C, HW = x.shape
    if x.stride(1) == 1 and x.stride(2) == C and (N == 1 or x.stride(0) == C * HW):
        return x
    return x.contiguous()


def _group_norm(op, input, num_groups, weight, bias, eps, key=None, stats=False):
    """-> y after validation, run from the plan for ``key`` (:func:`normkit.plans.key`) or one of
    its own; with ``stats``: (y, mean (N * G,), rstd (N * G,)), the statistics not differentiable."""
    _check_tensor(op, "input", input, required=True)
    if input.dim() < 2:
        raise InvalidArgument(f"{op}: input must have shape (N, C, *), got {list(input.shape)}")
    C = input.shape[1]
    if type(num_groups) is not int:
        num_groups = _num_groups(op, num_groups)
    if num_groups <= 0:
        raise InvalidArgument(f"{op}: num_groups must be a positive int, got {num_groups!r}; "
                              f"accepted: a divisor of the {C} channels ({_divisors(C)})")  # fmt: skip
    if C % num_groups:
        raise InvalidArgument(
            f"{op}: num_groups {num_groups} does not divide the {C} channels of input with shape "
            f"{list(input.shape)}; expected C % num_groups == 0 (accepted: {_divisors(C)})"
        )
    for name, value in (("weight", weight), ("bias", bias)):
        _check_param(op, name, value, (C,), per_channel=True)
    eps = _check_eps(op, eps)
    backend = _backend(op, input, weight=weight, bias=bias)  # a served device and dtype, or an error
    _check_param_dtypes("group_norm", input, weight=weight, bias=bias)
    x = input.reshape(input.shape[0], C, -1) if input.numel() else input.reshape(input.shape[0], C, 0)
    x, num_groups = _channels(x), int(num_groups)
    if backend is None:  # torch.compile traces: the custom operator
        y, mean, rstd = ops.group_norm_fwd(x, weight, bias, num_groups, eps)
        return (y.view(input.shape), mean, rstd) if stats else y.view(input.shape)
    plan = plans.make(key, backend, "group_norm", "group_norm", x, weight, bias, num_groups, eps,
                      train=True if stats else None)  # fmt: skip
    if stats:
        y, mean, rstd = plan.with_stats(x, weight, bias)
        return y.view(input.shape), mean, rstd
    if key is not None:
        return plan(input, None, weight, bias)
    return plan(x, None, weight, bias).view(input.shape)  # (in x's layout: channels-last stays so)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """Same signature and semantics as :func:`torch.nn.functional.group_norm`: input (N, C, *),
    statistics per (sample, group of C / num_groups channels), per-channel weight and bias."""
    key = plans.key("group_norm", input, (weight, bias), num_groups if type(num_groups) is int else None,
                    eps if type(eps) is float else None)  # fmt: skip
    plan = plans.stored(key)
    if plan is not None:
        return plan(input, None, weight, bias)
    if type(num_groups) is not int:
        num_groups = _num_groups("group_norm", num_groups)
    if (isinstance(input, torch.Tensor) and input.dim() >= 2 and num_groups > 0
            and input.shape[1] % num_groups == 0
            and input.shape[0] * (input.shape[1] // num_groups) * math.prod(input.shape[2:]) == 1):
        # torch's own check (N * C / G * spatial == 1), message included
        raise InvalidArgument(
            f"group_norm: expected more than 1 value per channel when training, "
            f"got input shape {list(input.shape)} with num_groups {num_groups}"
        )
    return _group_norm("group_norm", input, num_groups, weight, bias, eps, key)


def _check_both_or_neither(op: str, running_mean, running_var) -> None:
    """torch's rule: the running statistics come together or not at all."""
    if (running_mean is None) != (running_var is None):
        given, missing = ("running_mean", "running_var")[:: 1 if running_var is None else -1]
        raise InvalidArgument(f"{op}: {given} is given but {missing} is None; accepted: both running_mean "
                              f"and running_var, or neither (as torch.nn.functional.{op})")  # fmt: skip


def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None,
                  use_input_stats=True, momentum=0.1, eps=1e-5):  # fmt: skip
    """Same signature and semantics as :func:`torch.nn.functional.instance_norm`.

    With ``use_input_stats`` (the default) each (sample, channel) is normalized by its own
    statistics: GroupNorm with C groups, on the GroupNorm kernels. Running statistics, when given,
    are updated in place as torch does: running = (1 - momentum) * running + momentum * (the batch
    mean of the per-instance mean / unbiased variance). Without ``use_input_stats`` the running
    statistics normalize the input (a per-channel affine, computed with torch ops).
    """
    op = "instance_norm"
    _check_tensor(op, "input", input, required=True)
    if input.dim() < 2:
        raise InvalidArgument(f"{op}: input must have shape (N, C, *), got {list(input.shape)}")
    for name, value in (("running_mean", running_mean), ("running_var", running_var)):
        _check_param(op, name, value, (input.shape[1],), per_channel=True)
    _check_both_or_neither(op, running_mean, running_var)
    momentum = _check_momentum(op, momentum)
    stats = dict(running_mean=running_mean, running_var=running_var)
    if not use_input_stats:
        if running_mean is None or running_var is None:
            raise InvalidArgument(f"{op}: use_input_stats=False needs running_mean and running_var")
        for name, value in (("weight", weight), ("bias", bias)):
            _check_param(op, name, value, (input.shape[1],), per_channel=True)
        eps = _check_eps(op, eps)
        _backend(op, input, weight=weight, bias=bias, **stats)
        _check_param_dtypes("instance_norm", input, weight=weight, bias=bias)
        shape = (1, -1) + (1,) * (input.dim() - 2)
        y = (input - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
        if weight is not None:
            y = y * weight.view(shape)
        return y + bias.view(shape) if bias is not None else y
    if math.prod(input.shape[2:]) == 1:  # as torch: whatever the batch size (empty included)
        raise InvalidArgument(f"{op}: expected more than 1 spatial element per channel when "
                              f"use_input_stats=True, got input shape {list(input.shape)}")  # fmt: skip
    dispatch.check_devices(input, op=op, **stats)
    C = input.shape[1]
    eps = _check_eps(op, eps)
    if (running_mean is None and running_var is None) or not input.numel():
        # (an empty input leaves the running statistics as they are, as torch does for HW = 0)
        return _group_norm(op, input, C or 1, weight, bias, eps)
    y, mean, rstd = _group_norm(op, input, C or 1, weight, bias, eps, stats=True)
    hw = math.prod(input.shape[2:])
    with torch.no_grad():
        mean_nc = mean.view(input.shape[0], C)
        var_nc = (rstd.view(input.shape[0], C).double().pow(-2) - eps) * (hw / (hw - 1))
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean_nc.mean(0).to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            running_var.mul_(1 - momentum).add_(var_nc.mean(0).to(running_var.dtype), alpha=momentum)
    return y


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1,
               eps=1e-5):  # fmt: skip
    """Same signature and semantics as :func:`torch.nn.functional.batch_norm`.

    Training: per-channel statistics over (N, *) normalize the input, and the running statistics
    (when given) are updated in place with the unbiased variance, as torch does. Eval: the running
    statistics normalize the input. Forward and backward are deterministic.
    """
    op = "batch_norm"
    # momentum is an argument of the plan, not part of its key (nn.BatchNorm's cumulative average
    # passes a new one each step)
    key = plans.key(op, input, (weight, bias, running_mean, running_var),
                    training if type(training) is bool else None, eps if type(eps) is float else None,
                    True if type(momentum) is float else None)  # fmt: skip
    plan = plans.stored(key)
    if plan is not None:
        return plan(input, weight, bias, running_mean, running_var, momentum)
    _check_tensor(op, "input", input, required=True)
    if input.dim() < 2:
        raise InvalidArgument(f"{op}: input must have shape (N, C, *), got {list(input.shape)}")
    C = input.shape[1]
    for name, value in (("running_mean", running_mean), ("running_var", running_var),
                        ("weight", weight), ("bias", bias)):  # fmt: skip
        _check_param(op, name, value, (C,), per_channel=True)
    if (running_mean is None) != (running_var is None):
        _check_both_or_neither(op, running_mean, running_var)
    if not training and running_mean is None:
        raise InvalidArgument(f"{op}: running_mean and running_var are required when training=False")
    if type(momentum) is not float:
        momentum = _check_momentum(op, momentum)
    eps = _check_eps(op, eps)
    if training and eps == 0:  # as torch (2.13): rstd would be inf for a constant channel
        raise InvalidArgument(f"{op}: eps must be positive when training, got {eps!r}; accepted: eps > 0")
    count = input.shape[0] * math.prod(input.shape[2:])  # values per channel, as torch counts them
    if training and count == 1:
        raise InvalidArgument(f"{op}: expected more than 1 value per channel when training, got input "
                              f"shape {list(input.shape)}")  # fmt: skip
    backend = _backend(op, input, weight=weight, bias=bias, running_mean=running_mean,
                       running_var=running_var)  # fmt: skip
    # weight / bias as torch; the running statistics may be of any float dtype (docs/testing.md).
    _check_param_dtypes(op, input, weight=weight, bias=bias)
    x = _channels(input.reshape(input.shape[0], C, math.prod(input.shape[2:])))
    cl = not x.is_contiguous()
    if cl:
        # channels-last: the same memory as a contiguous (N * HW, C, 1) batch, read in place (the
        # same per-channel statistics over N * HW values), the output viewed back (channels-last)
        x = input.movedim(1, -1).reshape(-1, C, 1)
    rm, rv = (None if t is None else t.detach() for t in (running_mean, running_var))
    if backend is not None:  # (training: the plan's forward updates the running statistics in place)
        plan = plans.make(key, backend, "batch_norm", op, x, weight, bias, rm, rv, eps, training)
        if key is not None:
            return plan(input, weight, bias, running_mean, running_var, momentum)
        return _batch_shaped(plan(x, weight, bias, rm, rv, momentum), input, cl)
    # torch.compile traces: the custom operators
    if training:  # one operator: statistics, running statistics and y (CUDA: one read of x)
        if count == 0:  # an empty batch leaves the running statistics as they are (as torch)
            rm = rv = None
        out = ops.batch_norm_train(x, weight, bias, eps, float(momentum), rm, rv)
        with torch.no_grad():  # the traced operator is functional: copy its statistics back
            for buf, new in ((rm, out[3]), (rv, out[4])):
                if buf is not None:
                    buf.copy_(new)
        return _batch_shaped(out[0], input, cl)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    mean, rstd = rm.to(acc), torch.rsqrt(rv.to(acc) + eps)
    return _batch_shaped(ops.batch_norm_fwd(x, weight, bias, mean, rstd, False), input, cl)


def _batch_shaped(y: torch.Tensor, input: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """BatchNorm's (N, C, HW) output or, for a ``channels_last`` input, its (N * HW, C, 1) one, in
    input's shape (and layout)."""
    if not channels_last:
        return y.view(input.shape)
    return y.view(input.movedim(1, -1).shape).movedim(-1, 1)
