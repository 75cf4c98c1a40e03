"""CPU calls served by torch's own CPU operators, at torch's speed (issue 41).

The public functions (``normkit.*``, :mod:`normkit.distributed`) ask :func:`serves`, then the op's
function here, which takes the call's arguments and returns its result, or ``None`` when it does
not serve the call; the call then takes the full path (:mod:`normkit.functional`), whose checks
raise normkit's errors and whose CPU backend (:mod:`normkit.reference`, the fp64 test oracle) serves
what is left. A call is served only where torch's operator gives normkit's documented results
(docs/numerics.md, "Deliberate differences" in docs/testing.md):

- layer_norm, softmax / log_softmax, group_norm, instance_norm, batch_norm: torch's operator
  (fp32 math for 16-bit inputs, one rounding, as normkit's kernels); a 16-bit LayerNorm that gets
  any gradient runs as one C++ operator each way where the native extension is built (``normkit
  native``; normkit/native_cpu.cpp: fp32 statistics, fp32-summed parameter gradients, at torch's
  cost); without it on fp32 copies when small, else keeping fp32 statistics with torch's fp32
  backward a chunk of rows at a time (``_HalfLayerNorm``), and a
  16-bit GroupNorm that gets any gradient likewise runs as the native operator where it is built
  (contiguous inputs), else takes fp32 parameters (torch's mixed-dtype kernels: fp32 statistics);
  with 16-bit parameters torch's CPU backward loses the accuracy normkit promises;
- rms_norm: torch's; a 16-bit input with an fp32 weight explicitly in fp32, rounded once (torch
  2.13's CPU operator rounds once too: tests/test_cpu.py checks the result, not the route);
- add_layer_norm / add_rms_norm without dropout: ``x + residual`` then the norm above (dropout
  keeps the reference's mask, so those calls take the full path).

Left to the full path: anything normkit refuses or treats differently from torch (eps < 0, inf or
nan, or not a float; empty tensors; groups of one value; a bias without a weight in GroupNorm /
InstanceNorm, whose backward fails in torch), and anything torch's operator refuses (its error is
dropped; the full path raises normkit's). The checks cost ~0.5 us a call on the 2-core CI machine.
Autograd, double backward included, is torch's own (``_HalfLayerNorm``'s and the native
operator's: the fp32 route).
"""

from __future__ import annotations

import math

import torch

from normkit import dispatch, higher_order

_HALF = (torch.float16, torch.bfloat16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def serves(input) -> bool:
    """Whether this module may serve a call on ``input``: a plain CPU tensor, and no backend
    override in effect in any context (the tests' interpreter executors; ``dispatch.use_backend``).
    A module-global read, not the ContextVar: cheap, and traceable by torch.compile."""
    return type(input) is torch.Tensor and input.is_cpu and not dispatch._IN_OVERRIDE[0]
ERRORS = (RuntimeError, TypeError, ValueError, IndexError, AttributeError)


def _eps(eps) -> bool:
    return type(eps) is float and 0 <= eps < math.inf


def _plain_of(dtype: torch.dtype, *tensors) -> bool:
    """Every given tensor (None aside) a plain tensor of ``dtype`` (dtypes are singletons)."""
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.dtype is not dtype):
            return False
    return True


def _same_or_fp32(x: torch.Tensor, *params) -> bool:
    """Every given parameter a tensor of x's dtype, or all fp32 for a 16-bit x (torch's mixed-dtype
    rule)."""
    if _plain_of(x.dtype, *params):  # the common case first
        return True
    if not all(p is None or isinstance(p, torch.Tensor) for p in params):
        return False
    dtypes = {p.dtype for p in params if p is not None}
    return not dtypes or dtypes == {x.dtype} or (dtypes == {torch.float32} and x.dtype in _HALF)


def _differentiated(x: torch.Tensor, *params) -> bool:
    """Whether the call gets a gradient (a loop, not any(): ~0.4 us less a call)."""
    if not torch.is_grad_enabled():
        return False
    if x.requires_grad:
        return True
    for p in params:
        if p is not None and p.requires_grad:
            return True
    return False


def _f32(t):
    return None if t is None else t.float()


# Elements of a chunk of rows in _HalfLayerNorm's backward: fp32 copies of about 1 MB stay in cache.
_BWD_CHUNK = 1 << 18


class _HalfLayerNorm(torch.autograd.Function):
    """A 16-bit LayerNorm that gets any gradient. torch's CPU operator with 16-bit parameters saves
    16-bit statistics (dx 49 ulps off for rows of 8 around 300) and sums dweight / dbias in 16-bit
    (bf16, 8192 x 1024: 12.6% off). Given fp32 parameters (ones for a missing weight), its forward
    keeps fp32 mean / rstd; the backward runs torch's fp32 backward a chunk of rows at a time (fp32
    copies of about 1 MB), rounds dx into place and adds dweight / dbias up in fp32. With
    create_graph, the backward is the fp32 route, which autograd differentiates."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        w32 = torch.ones(shape, dtype=torch.float32) if weight is None else weight.float()
        y, mean, rstd = torch.native_layer_norm(x, shape, w32, _f32(bias), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape, ctx.eps = shape, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        want = ctx.needs_input_grad[:3]
        n = math.prod(ctx.shape)
        if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
            grads = higher_order.row_norm(dy.reshape(-1, n), x.reshape(-1, n),
                                          None if weight is None else weight.reshape(n),
                                          None if bias is None else bias.dtype, ctx.eps, False)  # fmt: skip
            return (*[g.view(t.shape) if w else None for g, t, w in zip(grads, (x, weight, bias), want)],
                    None, None)  # fmt: skip
        # In chunks of rows: torch's fp32 backward of each chunk (fp32 copies of about 1 MB stay in
        # cache), dx rounded into place, dweight / dbias added up in fp32.
        x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
        mean2, rstd2 = mean.reshape(-1, 1), rstd.reshape(-1, 1)  # fp32
        w32 = torch.ones(n, dtype=torch.float32) if weight is None else weight.float().reshape(n)
        b32 = None if bias is None else bias.float().reshape(n)
        mask = [want[0], want[1], want[2] and bias is not None]
        dx2 = torch.empty_like(x2) if want[0] else None
        dw32 = db32 = None
        step = max(1, _BWD_CHUNK // n)
        for i in range(0, x2.shape[0], step):
            rows = slice(i, i + step)
            gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
                dy2[rows].float(), x2[rows].float(), (n,), mean2[rows], rstd2[rows], w32, b32,
                mask)  # fmt: skip
            if dx2 is not None:
                dx2[rows] = gx
            if mask[1]:
                dw32 = gw if dw32 is None else dw32.add_(gw)
            if mask[2]:
                db32 = gb if db32 is None else db32.add_(gb)
        dx = None if dx2 is None else dx2.view(x.shape)
        dw = None if dw32 is None else dw32.view(weight.shape).to(weight.dtype)
        db = None if db32 is None else db32.view(bias.shape).to(bias.dtype)
        return dx, dw, db, None, None


# From this many elements a 16-bit LayerNorm that gets gradients takes _HalfLayerNorm; smaller ones,
# where its Python autograd node costs more than fp32 copies, torch's fp32 operator on fp32 copies.
# Forward + backward, bf16, 2 cores, 2026-11-26 (µs; torch's own 16-bit op in brackets): 1x8 268 /
# 141 (80), 16x4096 377 / 250 (199), 256x4096 2519 / 3037 (1460), 4096x4096 53377 / 154222 (48159).
_HALF_LN_CHUNKED_FROM = 1 << 18


_NATIVE_OPS: dict = {}  # the native extension's operators once found (a lookup: ~0.6 us a call)


def _native_op(name: str):
    """The native CPU extension's operator ``name``, or None (not built, or off)."""
    op = _NATIVE_OPS.get(name)
    if op is None:
        from normkit import native

        op = getattr(native.module(kind="cpu"), name, None)
        if op is not None:
            _NATIVE_OPS[name] = op
    return op


def _arm_door(*args):
    """:data:`DOOR` until its first call: the native extension's door, or None where it is not built
    (or is turned off), looked up once; this call goes through it."""
    global DOOR
    DOOR = _native_op("door")
    return None if DOOR is None else DOOR(*args)


# The native CPU extension's door (native_cpu.cpp): normkit's public functions call it first with a
# CPU call (`DOOR(op, x, ...)`, the ops of native_cpu.cpp's CpuOp); it runs the torch operator this
# module's first route would, checked in C++ (~1-2 us less a 1x8 call), or answers None (then this
# module's Python serves the call). None where the extension is not there.
DOOR = _arm_door


def _native_layer_norm():
    """The native extension's 16-bit CPU LayerNorm with gradients, or None."""
    return _native_op("cpu_layer_norm")


def _native_group_norm():
    """The native extension's 16-bit CPU GroupNorm with gradients, or None."""
    return _native_op("cpu_group_norm")


def _plain_params(weight, bias) -> bool:
    """Parameters absent or plain tensors (a native operator would skip a subclass's
    __torch_function__)."""
    return (weight is None or type(weight) in _PLAIN) and (bias is None or type(bias) in _PLAIN)


def _layer_norm(input, shape, weight, bias, eps):
    """torch's layer_norm; a 16-bit input that gets any gradient: the native operator where it is
    built (forward + backward, bf16, 2 cores, against torch's own 16-bit op: 1x8 48 / 44 µs, 16x4096
    138 / 134, 256x4096 1329 / 1340, 4096x4096 55.5 / 50.2 ms; 2026-11-27), else fp32 copies (small)
    or :class:`_HalfLayerNorm`."""
    if input.dtype in _HALF and _differentiated(input, weight, bias):
        fused = _native_layer_norm()
        if fused is not None and input.is_contiguous() and _plain_params(weight, bias):
            try:  # the operator checks the shapes and dtypes before it runs (a RuntimeError: the routes
                # below); checking them here first cost ~2 us a call (a 1x8 forward is ~6)
                return fused(input, weight, bias, shape, eps)
            except RuntimeError:
                pass
        if input.numel() < _HALF_LN_CHUNKED_FROM:
            return torch.layer_norm(input.float(), shape, _f32(weight), _f32(bias), eps).to(input.dtype)
        return _HalfLayerNorm.apply(input, weight, bias, tuple(shape), eps)
    return torch.layer_norm(input, shape, weight, bias, eps)


def layer_norm(input, normalized_shape, weight, bias, eps):
    if not (_eps(eps) and input.dtype.is_floating_point and input.numel()):
        return None
    shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
    try:
        return _layer_norm(input, shape, weight, bias, eps)
    except ERRORS:
        return None


def rms_norm(input, normalized_shape, weight, eps):
    if not (input.dtype.is_floating_point and input.numel() and (eps is None or _eps(eps))):
        return None
    if weight is not None and not isinstance(weight, torch.Tensor):
        return None
    shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
    # eps None is finfo(input.dtype).eps: torch 2.13's CPU kernel takes its math dtype's, so it is
    # passed explicitly for a 16-bit input (fp32's eps there: bf16 rows of small values 4-8% off the
    # documented result); fp32 / fp64 keep None, torch's faster route (~6 us of a 1x8 call), equal bits
    if eps is None and input.dtype in _HALF:
        eps = torch.finfo(input.dtype).eps
    try:
        if weight is None or weight.dtype is input.dtype:  # fp32 math, one rounding (torch 2.13's fused
            return torch.rms_norm(input, shape, weight, eps)  # CPU kernel; tests/test_cpu.py checks it)
        if input.dtype in _HALF and weight.dtype is torch.float32:
            # fp32 math, one rounding, whatever torch's mixed-dtype path does (2.13's CPU path is the same)
            return torch.rms_norm(input.float(), shape, weight.float(), eps).to(input.dtype)
    except ERRORS:
        pass
    return None


def softmax(input, dim, dtype, log: bool):
    if dtype is None and type(dim) is int and input.dtype.is_floating_point:  # the common call
        try:
            return input.log_softmax(dim) if log else input.softmax(dim)
        except ERRORS:
            return None
    if type(dim) is not int:
        return None
    if dtype is None:
        if not input.dtype.is_floating_point:
            return None
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) or input.dtype.is_complex:
        return None
    try:
        if log:
            return input.log_softmax(dim) if dtype is None else input.log_softmax(dim, dtype=dtype)
        return input.softmax(dim) if dtype is None else input.softmax(dim, dtype=dtype)
    except ERRORS:
        return None


def add_norm(x, residual, normalized_shape, weight, bias, eps, dropout_p, seed, residual_dtype, prenorm,
             is_rms):  # fmt: skip
    """``h = x + residual`` in one rounding to h's dtype, then the norm of h in x's dtype."""
    if (type(residual) is torch.Tensor and residual_dtype is None and dropout_p == 0
            and (seed is None or type(seed) is int and 0 <= seed < 2**63)
            and type(dropout_p) in (float, int) and residual.dtype is x.dtype and type(prenorm) is bool
            and x.dtype.is_floating_point and residual.shape == x.shape and x.numel()
            and (eps is None or _eps(eps))):  # fmt: skip
        # the common call, at the cost of torch's ops (~1 us of checks at 1x8: docs/performance.md)
        shape = (normalized_shape,) if type(normalized_shape) is int else normalized_shape
        try:
            h = x + residual  # the common call's h: fp32 math for 16-bit tensors, one rounding
            if not is_rms:
                y = None if eps is None else _layer_norm(h, shape, weight, bias, eps)
            elif weight is None or weight.dtype is x.dtype:  # (eps None: finfo(x.dtype).eps, as rms_norm)
                half_eps = eps is None and x.dtype in _HALF
                y = torch.rms_norm(h, shape, weight, torch.finfo(x.dtype).eps if half_eps else eps)
            else:
                y = rms_norm(h, normalized_shape, weight, eps)
        except ERRORS:
            return None
        if y is None:
            return None
        return (y, h) if prenorm else y
    if not (type(dropout_p) in (float, int) and dropout_p == 0 and x.dtype.is_floating_point):
        return None
    eps = torch.finfo(x.dtype).eps if eps is None and is_rms else eps  # (as rms_norm)
    if not _eps(eps):
        return None
    if seed is not None and not (type(seed) is int and 0 <= seed < 2**63):
        return None  # (no dropout: a valid seed changes nothing; an invalid one is refused there)
    if not (x.dtype.is_floating_point and x.numel() and type(prenorm) is bool):
        return None
    if residual is None:
        h_dtype = x.dtype if residual_dtype is None else residual_dtype
    else:
        if type(residual) is not torch.Tensor or residual.shape != x.shape:
            return None
        h_dtype = residual.dtype if residual_dtype is None else residual_dtype
    if not isinstance(h_dtype, torch.dtype) or h_dtype not in (x.dtype, torch.float32):
        return None
    if residual is not None and residual.dtype not in (x.dtype, h_dtype):
        return None
    try:
        if residual is None:
            h = x.to(h_dtype) if h_dtype != x.dtype else x.clone() if prenorm else x
        elif residual.dtype == x.dtype == h_dtype:
            h = x + residual  # fp32 math for 16-bit tensors, one rounding
        else:  # a 16-bit x and an fp32 residual stream
            h = (x.float() + residual.float()).to(h_dtype)
        if h.dtype == x.dtype:
            y = (rms_norm(h, normalized_shape, weight, eps) if is_rms
                 else layer_norm(h, normalized_shape, weight, bias, eps))  # fmt: skip
        else:  # fp32 h, 16-bit x: the norm in fp32 (h's dtype), rounded once to x's dtype
            w = None if weight is None else weight.float()
            b = None if bias is None else bias.float()
            y = (rms_norm(h, normalized_shape, w, eps) if is_rms
                 else layer_norm(h, normalized_shape, w, b, eps))  # fmt: skip
            y = None if y is None else y.to(x.dtype)
    except ERRORS:
        return None
    if y is None:
        return None
    return (y, h) if prenorm else y


def group_norm(input, num_groups, weight, bias, eps):
    if not (_eps(eps) and type(num_groups) is int and num_groups > 0 and input.dtype.is_floating_point
            and input.dim() >= 2 and input.numel()):  # fmt: skip
        return None
    C = input.shape[1]
    if C % num_groups or (C // num_groups) * (input.numel() // (input.shape[0] * C)) == 1:
        return None  # refused, or groups of one value (torch's backward fails there with a bias)
    if not _same_or_fp32(input, weight, bias) or (weight is None and bias is not None):
        return None  # (bias without weight: torch's backward fails on some shapes)
    try:  # (torch's own function under F.group_norm, whose checks the ones above cover)
        if input.dtype in _HALF and _differentiated(input, weight, bias):
            # torch's 16-bit CPU backward: dx of groups of 2 values 200-650 ulps off, 2-8 ulps on
            # inputs around 15x their spread. The native operator where built: fp32 statistics, y
            # and dx rounded once, dweight / dbias summed in fp32, one operator each way (torch's
            # mixed-dtype route below costs 1.2-1.6x torch's 16-bit op per call).
            # A contiguous input only (channels-last: torch's kernels, which keep the layout), plain
            # parameters (no subclass's __torch_function__ skipped); the operator checks their shape
            # (a RuntimeError: the full path's error).
            fused = _native_group_norm()
            if fused is not None and input.is_contiguous() and _plain_params(weight, bias):
                return fused(input, weight, bias, num_groups, eps)
            # Else: given fp32 parameters (ones for none), torch's mixed-dtype kernels keep fp32
            # statistics: dx within 0.5 ulp, dweight / dbias to fp32 accuracy
            w32 = torch.ones(C, dtype=torch.float32) if weight is None else weight.float()
            return torch.group_norm(input, num_groups, w32, _f32(bias), eps, False)
        return torch.group_norm(input, num_groups, weight, bias, eps, False)
    except ERRORS:
        return None


def instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps):
    if not (use_input_stats is True and _eps(eps) and eps > 0 and type(momentum) is float
            and input.dtype.is_floating_point and input.dim() >= 3 and input.numel()
            and input.is_contiguous()):  # fmt: skip
        return None  # (torch's instance_norm returns a channels-last input's result contiguous)
    if input.numel() // (input.shape[0] * input.shape[1]) <= 1 or not _same_or_fp32(input, weight, bias):
        return None
    if weight is None and bias is not None:
        return None  # torch's backward fails there ("tensor does not have a device")
    if (running_mean is None) != (running_var is None) or not _same_or_fp32(input, running_mean, running_var):
        return None
    if input.dtype in _HALF:  # fp32 statistics (_fp32_affine); 16-bit running statistics: refused there
        weight, bias = _fp32_affine(input, weight, bias)
    try:
        return torch.nn.functional.instance_norm(input, running_mean, running_var, weight, bias, True,
                                                 momentum, eps)  # fmt: skip
    except ERRORS:
        return None


def _fp32_affine(input, weight, bias):
    """weight and bias in fp32 (ones / zeros where absent): with them torch's CPU BatchNorm of a
    16-bit input takes its mixed-type path, fp32 statistics. With 16-bit or no parameters it rounds
    the batch mean to the input's dtype before normalizing: an error of ulp(mean) / std in every
    output and gradient (bf16 x = 3 + 0.01 randn: 0.14 on outputs of unit scale, 0.007 with fp32
    parameters; docs/testing.md, deliberate differences)."""
    f32 = dict(dtype=torch.float32, device=input.device)
    C = input.shape[1]
    w = weight.float() if weight is not None else torch.ones(C, **f32)  # (differentiable casts)
    return w, bias.float() if bias is not None else torch.zeros(C, **f32)


def _half_training(input, running_mean, running_var, weight, bias, momentum, eps):
    """16-bit training BatchNorm on torch's operator with fp32 parameters and running statistics (16-bit
    running statistics updated through fp32 copies, written back rounded once)."""
    w, b = _fp32_affine(input, weight, bias)
    rm = rv = None
    if running_mean is not None:
        rm, rv = running_mean.float(), running_var.float()  # (fp32 ones: themselves, updated in place)
    y = torch.batch_norm(input, w, b, rm, rv, True, momentum, eps, False)
    if rm is not None and rm is not running_mean:
        with torch.no_grad():
            running_mean.copy_(rm)
            running_var.copy_(rv)
    return y


def batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps):
    dtype = input.dtype
    if (type(momentum) is float and type(eps) is float and 0 < eps < math.inf and dtype.is_floating_point
            and input.dim() >= 2 and (running_mean is None) is (running_var is None)
            and _plain_of(dtype, weight, bias, running_mean, running_var) and input.numel()):  # fmt: skip
        # the common call: every tensor of input's dtype (~1 us of checks at 1x8: docs/performance.md)
        # (16-bit training: below, with fp32 parameters)
        served = training is True and input.numel() > input.shape[1] and dtype not in _HALF
        if served or training is False and running_mean is not None:
            try:
                return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum,
                                        eps, False)  # fmt: skip
            except ERRORS:
                return None
    if not (type(training) is bool and _eps(eps) and eps > 0 and type(momentum) is float
            and input.dtype.is_floating_point and input.dim() >= 2 and input.numel()):  # fmt: skip
        return None
    if training and input.numel() // input.shape[1] <= 1:
        return None  # torch's F.batch_norm refuses it too; the full path words the error
    if (running_mean is None) != (running_var is None) or (not training and running_mean is None):
        return None
    if not (_same_or_fp32(input, weight, bias) and _same_or_fp32(input, running_mean, running_var)):
        return None
    if input.dtype in _HALF and training:
        try:
            return _half_training(input, running_mean, running_var, weight, bias, momentum, eps)
        except ERRORS:
            return None
    if input.dtype in _HALF and running_mean is not None and running_mean.dtype == torch.float32:
        # 16-bit parameters with fp32 running statistics: torch takes all-fp32 parameters there
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
    try:  # (torch's own function under F.batch_norm, whose checks the ones above cover)
        return torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
                                False)  # fmt: skip
    except ERRORS:
        return None
