"""The native host path: a CUDA plan's launches replayed from C++ (native.cpp), its training step a
C++ autograd node.

Why: a remembered plan still costs Python per call (the plan's closure, ``launch.Bound``, Triton's
launcher) and, in training, a Python ``autograd.Function`` whose backward the autograd engine runs
by taking the GIL; on the H100 host that put normkit's per-call host time at 1.2-2.3x torch eager's
(docs/performance.md). With this path a call is one Python -> C++ call and a backward no Python.

How: once a plan's kernels are bound (its third call: the first two compile them; one backward
variant of it likewise), it runs *recorded* (:func:`record`): every tensor it allocates (a
``TorchFunctionMode`` sees the factory calls) and every kernel it launches (``launch.TRACE``: the
compiled kernel, grid and arguments of each direct launch) are written down, and each kernel
argument becomes a slot's address (an input of the call or an allocation, + an offset) or a fixed
int / float. A remembered plan's call signature fixes its
shapes, dtypes, launch choices and scalars, so the same program serves every later call;
``native.cpp`` runs it. Anything the recording cannot replay exactly (a launch not through a bound
kernel, a tensor op that computes, a tensor the plan did not allocate, a kernel parameter of a kind
it does not pass: ``compat.native_launch``) refuses it, and that plan keeps its Python path.
Dropout plans are never remembered (their seed changes per call), so they are never recorded.

The door: a recorded softmax / log_softmax / layer_norm / rms_norm plan made without overrides is
also entered in native.cpp's door under its call's signature, and the public function calls the
door first (``plans.DOOR``): one C++ call from the user's call to the replay (:func:`_enter`).

When: the extension is compiled once per torch / Python / source (``normkit native``, 30-60 s;
a C++ compiler and ninja, no CUDA toolkit: the driver is looked up at run time) by
:mod:`normkit.native`, which says where and when. Launch hooks (profilers) and the tests' launch recording
(``launch.RECORD``) send calls back to the Python path, which calls them.
"""

from __future__ import annotations

import threading
import weakref
from types import SimpleNamespace

import torch
from torch.overrides import TorchFunctionMode

from normkit import plans
from normkit.backends.cuda import compat, launch
from normkit.native import build_dir, module, name, why  # noqa: F401

# the op families with a native path: their plans' protocols are known here (plans.py)
OPS = ("layer_norm", "rms_norm", "group_norm", "add_layer_norm", "add_rms_norm", "softmax", "log_softmax",
       "batch_norm")


# --- the extension: normkit/native.py builds and loads it (it also serves CPU 16-bit LayerNorm) -----
# (module, why, build_dir, name: re-exported for the CLI, the tests and the measuring scripts)
# --- recording a plan ------------------------------------------------------------------------------

_FACTORIES = {torch.empty: False, torch.empty_like: False, torch.zeros: True, torch.zeros_like: True}
# tensor functions a plan may call that neither compute nor allocate (the launch arguments' views
# are found by address, so a view that copied would be refused there)
_QUERIES = {"__get__", "view", "unbind", "__iter__", "__getitem__", "select", "stride", "size", "dim",
            "numel", "element_size", "data_ptr", "is_contiguous"}  # fmt: skip


class Refused(Exception):
    """A plan that cannot be replayed from C++ (its Python path serves)."""


class NotYet(Refused):
    """A plan whose kernels are not all bound yet (a ``launch.Bound``'s first calls compile through
    ``fn[grid]``): recorded again on its next call."""


TRIES = 4  # calls a plan (or a backward variant) is recorded on at most, from its second


class _Allocations(TorchFunctionMode):
    """Every tensor allocated in the block, with whether it was zeroed; ``other``: the first tensor
    function that is neither an allocation nor a query."""

    def __init__(self):
        super().__init__()
        self.made, self.other = [], None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        zero = _FACTORIES.get(func)
        if zero is not None:
            self.made.append((out, zero))
        elif getattr(func, "__name__", None) not in _QUERIES and self.other is None:
            self.other = func
        return out


def record(fn, inputs: tuple):
    """Run ``fn(*inputs)`` (a plan's closure: tensors or None in, tensors or None out) recorded ->
    (its outputs, the extension's Program, or the reason it was refused as a string, or None where
    a kernel was still compiling: record a later call)."""
    if not all(t is None or type(t) in plans._PLAIN for t in inputs):  # (modules' weights: Parameters)
        return fn(*inputs), "an input is not a tensor"
    trace = []
    launch.TRACE = (threading.get_ident(), trace)
    try:
        with _Allocations() as allocations:
            outputs = fn(*inputs)
    finally:
        launch.TRACE = None
    try:
        return outputs, _program(inputs, allocations, trace, outputs)
    except NotYet:
        return outputs, None
    except Refused as e:
        return outputs, str(e)


def _program(inputs, allocations, trace, outputs):
    if allocations.other is not None:
        raise Refused(f"the plan calls {getattr(allocations.other, '__name__', allocations.other)}")
    if "first" in trace:
        raise NotYet("a kernel compiled on this call")
    if not trace or any(entry is None for entry in trace):
        raise Refused("a launch that is not a bound compiled kernel")
    n_in = len(inputs)
    bases = [(t, i) for i, t in enumerate(inputs) if t is not None]
    allocs = []
    for j, (t, zero) in enumerate(allocations.made):
        if not t.is_contiguous() or t.device.type != "cuda":
            raise Refused("a non-contiguous allocation")
        bases.append((t, n_in + j))
        allocs.append((n_in + j, list(t.shape), t.dtype, zero))

    def slot(t):
        for base, s in bases:
            if t is base:
                return s, 0
        address = t.data_ptr()
        for base, s in bases:
            start = base.data_ptr()
            end = start + max(1, base.numel() * base.element_size())
            if base.device == t.device and start <= address < end:
                return s, address - start
        raise Refused("a launch takes a tensor the plan neither got nor allocated")

    launches = []
    for (kernel, tail, _), grid, args in trace:
        try:
            function, threads, shared, types = compat.native_launch(kernel)
        except ValueError as e:
            raise Refused(str(e)) from None
        values = (*args, *tail)
        if len(values) != len(types):
            raise Refused(f"{kernel.name}: {len(values)} arguments for {len(types)} parameters")
        params = []
        for ty, v in zip(types, values):
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                if not isinstance(v, torch.Tensor):
                    raise Refused(f"{kernel.name}: a pointer parameter given {type(v).__name__}")
                params.append((0, *slot(v), 0.0))
            elif ty == "fp32":
                params.append((3, 0, 0, float(v)))
            elif type(v) is int or type(v) is bool:
                params.append(({"i32": 1, "i64": 2, "u64": 5}[ty], int(v), 0, 0.0))
            else:
                raise Refused(f"{kernel.name}: a {ty} parameter given {type(v).__name__}")
        launches.append((function, list(grid[:3]), threads, shared, params))
    flat = outputs if isinstance(outputs, tuple) else (outputs,)
    out_slots = []
    for t in flat:
        if t is None:
            out_slots.append(-1)
            continue
        found = next((s for base, s in bases if base is t), None)
        if found is None or found < n_in:
            raise Refused("an output is not an allocation of the plan")
        out_slots.append(found)
    lib = module()
    try:
        return lib.program(n_in, n_in + len(allocs), allocs, launches, out_slots)
    except RuntimeError as e:  # the cubin's parameters differ from the plan's (a Triton release)
        raise Refused(str(e).splitlines()[0]) from None


# --- plans with the native path ----------------------------------------------------------------------


def accelerate(plan, op: str, train: bool, door=None):
    """``plan`` (a CUDA plan from plans.make: an inference plan, or a ``plans.Training``) with the
    native host path, where ``op`` has one and the extension is loaded; else ``plan`` itself.
    ``door``: the plan's key where the door may serve its calls (no override in it): a softmax,
    layer_norm or rms_norm plan, once recorded, is entered there too (:func:`_enter`)."""
    if op not in OPS or module() is None:
        return plan
    door = (DOOR_OPS[op], door) if door is not None and op in DOOR_OPS else None
    if not train:
        return BatchNormRun(plan) if op == "batch_norm" else Run(plan, door)
    made = _TRAINING[type(plan)](plan)
    made.native.door = door
    return made


# --- the front door: calls served from C++ before normkit's Python (native.cpp's door) --------------
DOOR_OPS = {"softmax": 0, "log_softmax": 1, "layer_norm": 2, "rms_norm": 3}


def _enter(door, args: tuple, made) -> None:
    """Serve calls like this one through the door: ``door``, (op number, the plan's key); ``args``, the
    recorded call's (x; layer_norm / rms_norm: x, residual, weight, bias); ``made``, its recorded
    inference Program or training Spec. The door is set up on first use (plans.DOOR, emptied with
    plans._PLANS)."""
    lib = module()
    if plans.DOOR is None:
        lib.door_setup(launch.triton.knobs.runtime, launch)
        plans.DOOR_CLEAR, plans.DOOR = lib.door_clear, lib.door
    op, key = door
    if op < DOOR_OPS["layer_norm"]:
        call = (args[0], -1, op)  # door(x, dim, op): the plan's key is a last-dim call's
    else:  # door(op, x, normalized_shape, weight, bias, eps); functional's key: (..., (shape, eps), ...)
        normalized_shape, eps = key[6]
        call = (op, args[0], normalized_shape, args[2], args[3], eps)
    try:
        lib.door_put(made, *call)
    except RuntimeError:  # a call the door does not serve (native.cpp checks): the plan's path serves it
        pass


class _Attempts:
    """When a plan's closure is recorded: from its second call, until a recording is made or refused,
    at most :data:`TRIES` times (a recording whose kernels were still compiling is tried again)."""

    __slots__ = ("calls", "done", "refused")

    def __init__(self):
        self.calls, self.done, self.refused = 0, False, None

    def due(self) -> bool:
        self.calls += 1
        return not self.done and 2 <= self.calls <= TRIES + 1

    def record(self, fn, args):
        """-> (fn's outputs, the Program or None)."""
        out, made = record(fn, args)
        if isinstance(made, str):
            self.done, self.refused = True, made
            return out, None
        self.done = made is not None
        return out, made


class Run:
    """An inference plan on the native path: recorded (:class:`_Attempts`), then replayed."""

    __slots__ = ("plan", "program", "tuple", "attempts", "door")

    def __init__(self, plan, door=None):
        self.plan, self.program, self.tuple, self.attempts = plan, None, False, _Attempts()
        self.door = door  # (op number, key) where the program is to serve the door too (accelerate)

    @property
    def refused(self):
        return self.attempts.refused

    def __call__(self, *args):
        program = self.program
        if program is not None and launch.quiet():
            out = program(args)
            return tuple(out) if self.tuple else out[0]
        if not self.attempts.due():
            return self.plan(*args)
        out, made = self.attempts.record(self.plan, args)
        if made is not None:
            self.tuple, self.program = isinstance(out, tuple), made
            if self.door is not None and not self.tuple:
                _enter(self.door, args, made)
        return out


class BatchNormRun(Run):
    """BatchNorm's inference plan (``plan(x, weight, bias, running_mean, running_var, momentum)``)
    on the native path. momentum is a kernel argument of the training-mode forward, so the recording
    holds the momentum it was made with and replays only calls with that one (nn.BatchNorm's
    constant momentum); a call with another (its cumulative average, momentum=None) runs the plan in
    Python. Eval-mode plans compute rstd with a tensor op: refused, they keep the Python path."""

    __slots__ = ("momentum",)

    def __call__(self, x, w, b, rm, rv, momentum):
        program = self.program
        if program is not None and momentum == self.momentum and launch.quiet():
            return program((x, w, b, rm, rv))[0]
        if not self.attempts.due():
            return self.plan(x, w, b, rm, rv, momentum)
        out, made = self.attempts.record(lambda *tensors: self.plan(*tensors, momentum), (x, w, b, rm, rv))
        if made is not None:
            self.tuple, self.program, self.momentum = False, made, momentum
        return out


class _Native:
    """The native state of a training plan: its forward closure (recorded, :class:`_Attempts`) and
    the C++ autograd spec made from that recording; :class:`_Backward` holds the backward side."""

    def __init__(self, plan, family):
        self.forward, self.family, self.spec, self.scalars = plan.forward, family, None, ()
        self.door = None  # (op number, key) where the spec is to serve the door too (accelerate)
        self.attempts = _Attempts()
        self.back = _Backward(plan, family)

    @property
    def refused(self):
        return self.attempts.refused

    def traced_forward(self, *args):
        if self.back.info is None:
            self.back.info = self.family.info(*args)
        if not self.attempts.due():
            return self.forward(*args)
        # trailing arguments that are not tensors (BatchNorm's momentum) are baked into the recording;
        # the caller replays only calls with the same ones (NativeBatchNormTraining)
        n = len(args) - self.family.SCALARS
        tensors, scalars = args[:n], args[n:]
        out, made = self.attempts.record(lambda *t: self.forward(*t, *scalars), tensors)
        if made is not None:
            self.scalars = scalars
            dtypes = self.family.grad_dtypes(args, out)
            self.spec = module().spec(made, self.family.RETURNED, self.family.SAVED, dtypes, self.back)
            self.back.node = weakref.ref(self.spec)
            if self.door is not None:
                _enter(self.door, args, self.spec)
        return out


class _Backward:
    """A training plan's backward side, which the C++ spec calls (it holds nothing that holds the
    spec: no reference cycle through C++). ``backward(...)``: the plan's backward closure, each
    variant (with and without h's gradient) recorded into the spec once the spec exists; called with
    ``(grads, saved)``: the Python backward the C++ node falls back to (create_graph, a variant not
    recorded yet, no incoming gradient for y), the op family's ``plans._Planned*.backward`` on a
    stand-in ctx whose plan is this object."""

    def __init__(self, plan, family):
        self.plain, self.family = plan.backward, family
        self.spec, self.keep_scale = plan.spec, plan.keep_scale  # what plans._Planned*.backward reads
        self.info, self.node = None, None
        self.attempts = (_Attempts(), _Attempts())  # by variant

    def backward(self, *args):
        if args[0] is None:  # no incoming gradient for y (an add-norm whose y is unused): not replayed
            return self.plain(*args)
        variant = int(self.family.variant(args))
        due = self.attempts[variant].due()  # calls before the spec exists count too (they bind kernels)
        node = None if self.node is None else self.node()
        if node is None or not due:
            return self.plain(*args)
        pad = self.family.PAD  # the node takes a gradient for every input: None for those without
        plain = self.plain if not pad else (lambda *a: (*self.plain(*a), *(None,) * pad))
        out, made = self.attempts[variant].record(plain, args)
        if made is not None:
            try:
                node.set_backward(variant, made)
            except RuntimeError as e:  # a program that does not fit the node (native.cpp checks)
                self.attempts[variant].refused = str(e).splitlines()[0]
        return out[: len(out) - pad] if pad else out

    def __call__(self, grads, saved):
        return self.family.backward(self, _ctx(self, self.info, saved), grads)


def _ctx(plan, info, saved):
    """The ctx a ``plans._Planned*.backward`` reads, for the Python backward of a C++ node."""
    return SimpleNamespace(saved_tensors=tuple(saved), plan=plan, **vars(info))


class _RowNorm:
    """LayerNorm / RMSNorm / GroupNorm (``plans.Training``): inputs (x, residual, weight, bias), the
    forward's outputs (y, h, mean, rstd), the backward's (dy, dh, x, weight, mean, rstd)."""

    RETURNED, SAVED = [0], [0, 2, -3, -4]  # y; x, weight, mean, rstd
    SCALARS = 0  # trailing forward arguments that are not tensors
    PAD = 0  # inputs past the backward's outputs (no gradient)

    @staticmethod
    def info(x, r, w, b):
        return SimpleNamespace(shape=plans._params_shape(w, b), bias_dtype=None if b is None else b.dtype)

    @staticmethod
    def grad_dtypes(args, out):
        return [out[0].dtype, out[0].dtype]

    @staticmethod
    def variant(args):
        return False

    @staticmethod
    def backward(plan, ctx, grads):
        if grads[0] is None:
            return [None] * 4
        _, dx, dw, db = plans._PlannedRowNorm.backward(ctx, grads[0])
        return [dx, None, dw, db]


class _AddNorm(_RowNorm):
    """The add-norms (``plans.AddNormTraining``): y and h returned, h saved."""

    RETURNED, SAVED = [0, 1], [-2, 2, -3, -4]  # y, h; h, weight, mean, rstd

    @staticmethod
    def info(x, r, w, b):
        residual = None if r is None else (r.dtype, r.shape)
        return SimpleNamespace(shape=plans._params_shape(w, b), bias_dtype=None if b is None else b.dtype,
                               x_dtype=x.dtype, residual=residual)  # fmt: skip

    @staticmethod
    def grad_dtypes(args, out):
        return [args[0].dtype, out[1].dtype]

    @staticmethod
    def variant(args):
        return args[1] is not None

    @staticmethod
    def backward(plan, ctx, grads):
        _, dx, dres, dw, db = plans._PlannedAddNorm.backward(ctx, *grads)
        return [dx, dres, dw, db]


class _Softmax(_RowNorm):
    """softmax / log_softmax (``plans.SoftmaxTraining``): input x, forward y, backward (dy, y)."""

    RETURNED, SAVED = [0], [-1]

    @staticmethod
    def info(x):
        return SimpleNamespace()

    @staticmethod
    def grad_dtypes(args, out):
        return [out.dtype]

    @staticmethod
    def backward(plan, ctx, grads):
        return [None if grads[0] is None else plans._PlannedSoftmax.backward(ctx, grads[0])[1]]


class _BatchNorm(_RowNorm):
    """BatchNorm in training mode (``plans.BatchNormTraining``): inputs (x, weight, bias,
    running_mean, running_var; the last two updated in place, no gradient) and momentum (baked into
    the recording), forward (y, mean, rstd), backward (dy, x, weight, mean, rstd)."""

    RETURNED, SAVED = [0], [0, 1, -2, -3]  # y; x, weight, mean, rstd
    SCALARS, PAD = 1, 2  # momentum; the running statistics

    @staticmethod
    def info(x, w, b, rm, rv, momentum):
        return SimpleNamespace(bias_dtype=None if b is None else b.dtype)

    @staticmethod
    def grad_dtypes(args, out):
        return [out[0].dtype]

    @staticmethod
    def backward(plan, ctx, grads):
        if grads[0] is None:
            return [None] * 5
        _, dx, dw, db, *_ = plans._PlannedBatchNorm.backward(ctx, grads[0])
        return [dx, dw, db, None, None]


class _NativeCall:
    """A training plan (``plans.Training`` or a subclass, after this mixin) on the native path:
    called as its plan is, through the C++ autograd node once its forward is recorded."""

    __slots__ = ()
    FAMILY: type

    def __init__(self, plan):
        state = _Native(plan, self.FAMILY)
        super().__init__(state.traced_forward, state.back.backward, plan.keep_scale, spec=plan.spec)
        self.native = state

    def __call__(self, *args):
        spec = self.native.spec
        if spec is None or not launch.quiet():
            return super().__call__(*args)
        out = module().apply(spec, list(args))
        return out[0] if len(out) == 1 else tuple(out)


class NativeTraining(_NativeCall, plans.Training):
    __slots__ = ("native",)
    FAMILY = _RowNorm


class NativeAddNormTraining(_NativeCall, plans.AddNormTraining):
    __slots__ = ("native",)
    FAMILY = _AddNorm


class NativeSoftmaxTraining(_NativeCall, plans.SoftmaxTraining):
    __slots__ = ("native",)
    FAMILY = _Softmax


class NativeBatchNormTraining(_NativeCall, plans.BatchNormTraining):
    """BatchNorm's training plan: replayed for calls with the momentum it was recorded with (see
    :class:`BatchNormRun`), the Python path for others."""

    __slots__ = ("native",)
    FAMILY = _BatchNorm

    def __call__(self, x, w, b, rm, rv, momentum):
        native = self.native
        if native.spec is None or (momentum,) != native.scalars or not launch.quiet():
            return plans.BatchNormTraining.__call__(self, x, w, b, rm, rv, momentum)
        return module().apply(native.spec, [x, w, b, rm, rv])[0]


def state(plan) -> str:
    """What the native path does with ``plan`` so far, in words (ci/measure-host-time.py prints it)."""
    if isinstance(plan, Run):
        return "inference " + _state(plan.attempts, plan.program is not None)
    native = getattr(plan, "native", None)
    if not isinstance(native, _Native):
        return "not a native plan: Python"
    words = ["training forward " + _state(native.attempts, native.spec is not None)]
    for which, attempts in zip(("backward", "backward with h's gradient"), native.back.attempts):
        if attempts.calls:
            words.append(f"{which} " + _state(attempts, attempts.done and attempts.refused is None))
    return "; ".join(words)


def _state(attempts, made):
    if made:
        return "replayed"
    if attempts.refused:
        return f"refused ({attempts.refused})"
    return f"Python ({attempts.calls} calls, not recorded)"


_TRAINING = {plans.Training: NativeTraining, plans.AddNormTraining: NativeAddNormTraining,
             plans.SoftmaxTraining: NativeSoftmaxTraining, plans.BatchNormTraining: NativeBatchNormTraining}
