"""Arguments torch.nn.functional accepts, accepted by normkit with torch's results (issue 41, part 3).

Each case runs normkit and torch.nn.functional on the same inputs: the output's dtype and shape
must be torch's (torch run on the same dtypes), its values torch's run in fp64 (float inputs cast
up; integer inputs as they are) within the tolerance table (normkit/testing.py), and so must every
gradient, the running statistics updated in place, and the warnings a case names. Every case runs
on the reference backend and on both interpreter executors (with ``-m cuda``, on the GPU
executors). The refusals that remain are tested in tests/test_errors.py; docs/testing.md lists them
("Deliberate differences from torch.nn.functional").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, INTERPRETER

import normkit
from normkit.testing import Executor, assert_close

EXECUTORS = [pytest.param(Executor("reference", "cpu"), id="reference")]
EXECUTORS += [pytest.param(ex, id=ex.name) for ex in INTERPRETER]
EXECUTORS += [pytest.param(ex, id=ex.name, marks=mark) for ex, mark in DEVICE]

F64 = torch.float64
IMPLICIT = "Implicit dimension choice for {} has been deprecated"


@dataclass
class Case:
    inputs: dict  # name -> tensor; float tensors are cast up to fp64 for torch's expected values
    ours: Callable  # (**inputs) -> tensor or tuple of tensors (normkit)
    theirs: Callable  # (**inputs) -> the same from torch.nn.functional
    grad: tuple = ()  # inputs to differentiate
    buffers: tuple = ()  # inputs updated in place (running statistics)
    warns: str | None = None  # a warning both must give (its category: torch's)
    needs: tuple = ()  # dtypes the executor must serve (e.g. a dtype= argument)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _size(shape) -> tuple:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _randn(shape, dtype, device, seed=0, scale=1.0, offset=0.0):
    shape = _size(shape)
    return (torch.randn(shape, generator=_gen(seed), dtype=F64) * scale + offset).to(dtype).to(device)


def _ints(shape, device, dtype=torch.int64, low=-4, high=5, seed=0):
    return torch.randint(low, high, _size(shape), generator=_gen(seed)).to(dtype).to(device)


# --- cases: name -> (device, float dtype) -> Case --------------------------------------------------

ROW = (3, 5, 8)  # (batch, sequence, hidden): rows of 8
IMG = (2, 6, 5)  # (N, C, L): 6 channels


def _row_inputs(dev, dt, weight=True, bias=True, shape=ROW, norm=(8,)):
    t = {"x": _randn(shape, dt, dev, 1)}
    if weight:
        t["w"] = _randn(norm, dt, dev, 2, 0.5, 1.0)
    if bias:
        t["b"] = _randn(norm, dt, dev, 3, 0.5)
    return t


def _ln(norm, w=True, b=True, eps=1e-5, shape=ROW, torch_norm=None):
    def make(dev, dt):
        t = _row_inputs(dev, dt, w, b, shape, (8,) if type(norm) is int else tuple(int(d) for d in norm))
        return Case(t, lambda x, w=None, b=None: normkit.layer_norm(x, norm, w, b, eps),
                    lambda x, w=None, b=None: F.layer_norm(x, torch_norm or norm, w, b, eps), tuple(t))
    return make


def _rms(weight_dtype=None, eps=None, x_dtype=None, norm=(8,)):
    """rms_norm with a weight of ``weight_dtype`` (None: the float dtype), ``eps``, x of ``x_dtype``."""
    def make(dev, dt):
        xd = x_dtype or dt
        shape = ROW[:1] + tuple(norm) if len(norm) > 1 else ROW
        t = {"x": _randn(shape, xd, dev, 1)}
        if weight_dtype is None or weight_dtype.is_floating_point:
            t["w"] = _randn(norm, weight_dtype or xd, dev, 2, 0.5, 1.0)
        elif weight_dtype == torch.bool:
            t["w"] = _ints(norm, dev, torch.bool, 0, 2, seed=2)
        else:
            t["w"] = _ints(norm, dev, weight_dtype, seed=2)
        grad = ("x", "w") if t["w"].dtype.is_floating_point else ("x",)
        # torch's eps=None is finfo(x.dtype).eps: x's own dtype, also for the fp64 expected values
        e = eps if eps is not None else torch.finfo(xd).eps
        return Case(t, lambda x, w: normkit.rms_norm(x, list(norm), w, eps),
                    lambda x, w: F.rms_norm(x, list(norm), w, e), grad,
                    needs=(xd, t["w"].dtype) if "w" in grad else (xd,))
    return make


def _softmax(op, shape, dim, x_dtype=None, dtype=None, warns=False, **kw):
    """op along ``dim`` (None: the implicit choice) of an input of ``x_dtype`` (an integer or bool
    dtype: integers) with ``dtype=`` and any other keyword (``_stacklevel``)."""
    def make(dev, dt):
        xd = x_dtype or dt
        if xd.is_floating_point:
            x = _randn(shape, xd, dev, 1, 2.0)
        else:
            low = 0 if xd in (torch.uint8, torch.bool) else -4
            x = _ints(shape, dev, xd, low, 2 if xd == torch.bool else 5)
        extra = dict(kw, **({"dtype": dtype} if dtype is not None else {}))
        return Case({"x": x}, lambda x: getattr(normkit, op)(x, dim, **extra),
                    lambda x: getattr(F, op)(x, dim, **extra), ("x",) if xd.is_floating_point else (),
                    warns=IMPLICIT.format(op) if warns else None,
                    needs=tuple(d for d in (xd, dtype) if d is not None and d.is_floating_point))
    return make


def _softmax_default_dim(op, shape):
    def make(dev, dt):
        return Case({"x": _randn(shape, dt, dev, 1)}, lambda x: getattr(normkit, op)(x),
                    lambda x: getattr(F, op)(x), ("x",), warns=IMPLICIT.format(op))
    return make


def _group_norm(groups, shape=IMG, w=True, b=True, eps=1e-5):
    def make(dev, dt):
        t = {"x": _randn(shape, dt, dev, 1)}
        if w:
            t["w"] = _randn(shape[1], dt, dev, 2, 0.5, 1.0)
        if b:
            t["b"] = _randn(shape[1], dt, dev, 3, 0.5)
        def theirs(x, w=None, b=None):
            if w is None and b is not None:  # torch's backward raises "tensor does not have a device"
                w = torch.ones(x.shape[1], dtype=b.dtype, device=b.device)  # here (docs/testing.md)
            return F.group_norm(x, groups, w, b, eps)

        return Case(t, lambda x, w=None, b=None: normkit.group_norm(x, groups, w, b, eps), theirs, tuple(t))
    return make


def _stats(dev, dt, c=6):
    return {"rm": _randn(c, dt, dev, 4, 0.3), "rv": _randn(c, dt, dev, 5, 0.2, 1.0).abs()}


def _instance_norm(use_input_stats, stats=True, affine=True, momentum=0.1, eps=1e-5, shape=IMG):
    def make(dev, dt):
        t = {"x": _randn(shape, dt, dev, 1)}
        if stats:
            t.update(_stats(dev, dt, shape[1]))
        if affine:
            t["w"], t["b"] = _randn(shape[1], dt, dev, 2, 0.5, 1.0), _randn(shape[1], dt, dev, 3, 0.5)

        def call(fn):
            return lambda x, rm=None, rv=None, w=None, b=None: fn(x, rm, rv, w, b, use_input_stats,
                                                                  momentum, eps)  # fmt: skip

        grad = ("x",) + (("w", "b") if affine else ())
        return Case(t, call(normkit.instance_norm), call(F.instance_norm), grad,
                    buffers=("rm", "rv") if stats else ())  # fmt: skip
    return make


def _batch_norm(training, stats=True, affine=True, momentum=0.1, eps=1e-5, shape=IMG):
    def make(dev, dt):
        t = {"x": _randn(shape, dt, dev, 1, 1.5, 0.5)}
        if stats:
            t.update(_stats(dev, dt, shape[1]))
        if affine:
            t["w"], t["b"] = _randn(shape[1], dt, dev, 2, 0.5, 1.0), _randn(shape[1], dt, dev, 3, 0.5)

        def call(fn):
            return lambda x, rm=None, rv=None, w=None, b=None: fn(x, rm, rv, w, b, training, momentum, eps)

        grad = ("x",) + (("w", "b") if affine else ())
        return Case(t, call(normkit.batch_norm), call(F.batch_norm), grad,
                    buffers=("rm", "rv") if stats else ())  # fmt: skip
    return make


def _add_norm(op, residual_shape=ROW, dropout_p=0.0, eps=None, weight_dtype=None, residual=True):
    """normkit's add-norm (prenorm: y and h) against torch's norm of dropout(x) + residual."""
    rms = op == "add_rms_norm"

    def make(dev, dt):
        t = {"x": _randn(ROW, dt, dev, 1)}
        if residual:
            t["r"] = _randn(residual_shape, dt, dev, 6)
        t["w"] = _randn(8, dt, dev, 2, 0.5, 1.0) if weight_dtype is None else _ints(8, dev, weight_dtype,
                                                                                      seed=2)  # fmt: skip
        if not rms:
            t["b"] = _randn(8, dt, dev, 3, 0.5)
        e = eps if eps is not None else (torch.finfo(dt).eps if rms else 1e-5)  # (x's dtype: see _rms)

        def ours(x, w, r=None, b=None):
            if rms:
                return normkit.add_rms_norm(x, r, 8, w, eps, dropout_p=dropout_p, prenorm=True)
            return normkit.add_layer_norm(x, r, 8, w, b, e, dropout_p=dropout_p, prenorm=True)

        def theirs(x, w, r=None, b=None):
            dropped = F.dropout(x, float(dropout_p)) if dropout_p else x
            h = dropped + r if r is not None else dropped
            return (F.rms_norm(h, (8,), w, e) if rms else F.layer_norm(h, (8,), w, b, e)), h

        grad = tuple(n for n in t if weight_dtype is None or n != "w")
        return Case(t, ours, theirs, grad)
    return make


CASES = {
    # layer_norm: eps as a 0-dim tensor (float or integer), normalized_shape forms, weight / bias
    "layer_norm-eps-0dim-tensor": _ln((8,), eps=torch.tensor(1e-3)),
    "layer_norm-eps-0dim-int-tensor": _ln((8,), eps=torch.tensor(1)),
    "layer_norm-eps-int": _ln((8,), eps=0),
    "layer_norm-eps-numpy": _ln((8,), eps=np.float32(1e-4)),
    "layer_norm-shape-torch.Size": _ln(torch.Size([5, 8]), torch_norm=None),
    "layer_norm-shape-list": _ln([8]),
    "layer_norm-shape-numpy-int": _ln((np.int64(8),)),
    "layer_norm-shape-0dim-tensor": _ln((torch.tensor(8),)),
    "layer_norm-shape-int (normkit: as nn.LayerNorm)": _ln(8, torch_norm=(8,)),
    "layer_norm-weight-only": _ln((8,), b=False),
    "layer_norm-bias-only": _ln((8,), w=False),
    "layer_norm-no-affine": _ln((8,), w=False, b=False),
    "layer_norm-1d-input": _ln((8,), shape=(8,)),
    # rms_norm: eps as a tensor or None, integer / bool weights (torch: the input's math dtype)
    "rms_norm-eps-0dim-tensor": _rms(eps=torch.tensor(1e-4)),
    "rms_norm-eps-None": _rms(eps=None),
    "rms_norm-int64-weight": _rms(torch.int64),
    "rms_norm-int32-weight": _rms(torch.int32, eps=1e-6),
    "rms_norm-bool-weight": _rms(torch.bool),
    "rms_norm-int64-weight-fp16-input": _rms(torch.int64, x_dtype=torch.float16),
    "rms_norm-int64-weight-bf16-input": _rms(torch.int64, x_dtype=torch.bfloat16),
    "rms_norm-int64-weight-fp32-input": _rms(torch.int64, x_dtype=torch.float32),
    "rms_norm-int64-weight-fp64-input": _rms(torch.int64, x_dtype=torch.float64),
    "rms_norm-int64-weight-2d-shape": _rms(torch.int64, norm=(5, 8)),
    # (a float weight of another dtype: torch 2.13 returns the input's dtype too)
    "rms_norm-fp32-weight-bf16-input": _rms(torch.float32, x_dtype=torch.bfloat16),
    "rms_norm-bf16-weight-fp32-input": _rms(torch.bfloat16, x_dtype=torch.float32),
    "rms_norm-fp64-weight-fp16-input": _rms(torch.float64, x_dtype=torch.float16),
    # softmax / log_softmax: integer and bool inputs with dtype=, dim=None, dim forms, 0-dim input
    "softmax-int64-input-dtype-fp32": _softmax("softmax", ROW, -1, torch.int64, torch.float32),
    "softmax-int32-input-dtype-fp32-dim0": _softmax("softmax", ROW, 0, torch.int32, torch.float32),
    "log_softmax-int64-input-dtype-fp64": _softmax("log_softmax", ROW, 1, torch.int64, torch.float64),
    "softmax-uint8-input-dtype-fp16": _softmax("softmax", ROW, -1, torch.uint8, torch.float16),
    "log_softmax-bool-input-dtype-fp32": _softmax("log_softmax", ROW, -1, torch.bool, torch.float32),
    "softmax-fp16-input-dtype-fp32": _softmax("softmax", ROW, -1, torch.float16, torch.float32),
    "softmax-fp32-input-dtype-fp16": _softmax("softmax", ROW, 1, torch.float32, torch.float16),
    "log_softmax-fp32-input-dtype-bf16": _softmax("log_softmax", ROW, -1, torch.float32, torch.bfloat16),
    "softmax-dim-None-0d": _softmax("softmax", (), None, warns=True),
    "softmax-dim-None-1d": _softmax("softmax", (7,), None, warns=True),
    "softmax-dim-None-2d": _softmax("softmax", (3, 7), None, warns=True),
    "softmax-dim-None-3d": _softmax("softmax", ROW, None, warns=True),
    "softmax-dim-None-4d": _softmax("softmax", (2, 3, 4, 5), None, warns=True),
    "log_softmax-dim-None-3d": _softmax("log_softmax", ROW, None, warns=True),
    "log_softmax-dim-None-4d": _softmax("log_softmax", (2, 3, 4, 5), None, warns=True),
    "softmax-dim-None-int-input-dtype": _softmax("softmax", (4, 6), None, torch.int64, torch.float32,
                                                 warns=True),
    "softmax-default-dim-3d": _softmax_default_dim("softmax", ROW),
    "log_softmax-default-dim-4d": _softmax_default_dim("log_softmax", (2, 3, 4, 5)),
    "softmax-stacklevel-keyword": _softmax("softmax", ROW, None, warns=True, _stacklevel=2),
    "softmax-dim-0dim-tensor": _softmax("softmax", ROW, torch.tensor(1)),
    "log_softmax-dim-numpy": _softmax("log_softmax", ROW, np.int64(-2)),
    "softmax-dim-negative": _softmax("softmax", ROW, -3),
    "softmax-0d-input-dim0": _softmax("softmax", (), 0),
    "log_softmax-0d-input-dim-1": _softmax("log_softmax", (), -1),
    # group_norm: num_groups forms, eps as a tensor, (N, C) input, weight / bias
    "group_norm-groups-numpy": _group_norm(np.int64(3)),
    "group_norm-groups-0dim-tensor": _group_norm(torch.tensor(2)),
    "group_norm-eps-0dim-tensor": _group_norm(3, eps=torch.tensor(1e-3)),
    "group_norm-2d-input": _group_norm(3, shape=(4, 6)),
    "group_norm-weight-only": _group_norm(2, b=False),
    "group_norm-bias-only": _group_norm(2, w=False),
    # instance_norm: use_input_stats, running statistics, momentum / eps as tensors
    "instance_norm-use_input_stats-False": _instance_norm(False),
    "instance_norm-use_input_stats-False-no-affine": _instance_norm(False, affine=False),
    "instance_norm-use_input_stats-False-1-spatial": _instance_norm(False, shape=(2, 6, 1)),
    "instance_norm-use_input_stats-False-eps-tensor": _instance_norm(False, eps=torch.tensor(1e-2)),
    "instance_norm-running-stats-momentum-tensor": _instance_norm(True, momentum=torch.tensor(0.3)),
    "instance_norm-running-stats-momentum-int": _instance_norm(True, momentum=1),
    "instance_norm-eps-0dim-tensor": _instance_norm(True, stats=False, eps=torch.tensor(1e-3)),
    # batch_norm: training without running statistics, momentum / eps forms, (N, C) input, eval
    "batch_norm-training-no-running-stats": _batch_norm(True, stats=False),
    "batch_norm-training-no-running-stats-no-affine": _batch_norm(True, stats=False, affine=False),
    "batch_norm-training-momentum-0dim-tensor": _batch_norm(True, momentum=torch.tensor(0.25)),
    "batch_norm-training-momentum-int": _batch_norm(True, momentum=1),
    "batch_norm-training-eps-0dim-tensor": _batch_norm(True, eps=torch.tensor(1e-3)),
    "batch_norm-training-2d-input": _batch_norm(True, shape=(5, 6)),
    "batch_norm-eval-eps-0dim-tensor": _batch_norm(False, eps=torch.tensor(1e-3)),
    "batch_norm-eval-no-affine": _batch_norm(False, affine=False),
    # add-norms: broadcast residuals, dropout_p=1, 0-dim tensors, integer RMSNorm weight
    **{f"{op}-residual-{'x'.join(map(str, s)) or '0d'}": _add_norm(op, s)
       for op in ("add_layer_norm", "add_rms_norm") for s in ((8,), (1, 8), (3, 1, 8), (1, 5, 1), ())},
    **{f"{op}-dropout_p-{p!r}": _add_norm(op, dropout_p=p)
       for op in ("add_layer_norm", "add_rms_norm") for p in (1.0, 1)},
    "add_layer_norm-dropout_p-1-no-residual": _add_norm("add_layer_norm", dropout_p=1.0, residual=False),
    "add_rms_norm-dropout_p-1-broadcast-residual": _add_norm("add_rms_norm", (8,), dropout_p=1.0),
    "add_layer_norm-dropout_p-0dim-tensor": _add_norm("add_layer_norm", dropout_p=torch.tensor(0.0)),
    "add_layer_norm-eps-0dim-tensor": _add_norm("add_layer_norm", eps=torch.tensor(1e-3)),
    "add_rms_norm-eps-0dim-tensor": _add_norm("add_rms_norm", eps=torch.tensor(1e-4)),
    "add_rms_norm-int64-weight": _add_norm("add_rms_norm", weight_dtype=torch.int64),
}  # fmt: skip


# --- the runner ------------------------------------------------------------------------------------


def _clone(inputs: dict, grad: tuple, up: bool) -> dict:
    """Fresh leaves (``up``: float tensors in fp64), the ``grad`` ones requiring grad."""
    out = {}
    for name, t in inputs.items():
        c = t.detach().clone()
        if up and c.dtype.is_floating_point:
            c = c.to(F64)
        out[name] = c.requires_grad_(name in grad)
    return out


def _outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _run(fn, inputs: dict):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = _outputs(fn(**inputs))
    return out, [(w.category, str(w.message)) for w in seen]


def _grads(outs, inputs: dict, grad: tuple, dtypes, seed=7):
    """Gradients of sum(out * dy) for fixed random dy: fp64 draws rounded to ``dtypes`` (normkit's
    output dtypes), in each output's dtype."""
    pairs = [(o, d) for o, d in zip(outs, dtypes) if o.requires_grad]
    if not grad or not pairs:
        return {}
    outs = [o for o, _ in pairs]
    dys = [_randn(o.shape, d, o.device, seed + i).to(o.dtype) for i, (o, d) in enumerate(pairs)]
    got = torch.autograd.grad(outs, [inputs[n] for n in grad], dys, allow_unused=True)
    return dict(zip(grad, got))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_accepted_like_torch(executor, case, run_on):
    context = run_on(executor)  # (skips first where the executor cannot run)
    dt = F64 if F64 in executor.dtypes else torch.float32
    dev = executor.device
    c = CASES[case](dev, dt)
    missing = [d for d in c.needs if d not in executor.dtypes]
    if missing:
        pytest.skip(f"{executor.name}: {missing[0]} is not served by the {executor.backend} backend")
    theirs_same, theirs_warnings = _run(c.theirs, _clone(c.inputs, (), up=False))  # dtypes, shapes
    mine = _clone(c.inputs, c.grad, up=False)
    with context:
        ours, our_warnings = _run(c.ours, mine)
        our_grads = _grads(ours, mine, c.grad, [o.dtype for o in ours])
    expected_inputs = _clone(c.inputs, c.grad, up=True)
    expected, _ = _run(c.theirs, expected_inputs)
    expected_grads = _grads(expected, expected_inputs, c.grad, [o.dtype for o in ours])

    assert len(ours) == len(expected)
    for i, (o, same, e) in enumerate(zip(ours, theirs_same, expected)):
        assert o.dtype == same.dtype and o.shape == same.shape, (i, o.dtype, same.dtype, o.shape, same.shape)
        assert_close(o, e.to(o.device), o.dtype, "fwd", f"{case}: output {i}")
    for name, g in our_grads.items():
        e, t = expected_grads[name], mine[name]
        assert g is not None and e is not None, name
        assert g.dtype == t.dtype and g.shape == t.shape, (name, g.dtype, g.shape)
        rows = max(1, ours[0].numel() // max(t.numel(), 1))  # a broadcast input's gradient is a sum
        # the tolerance of the least precise dtype the gradient went through (softmax's dtype=)
        dtype = max([g.dtype] + [o.dtype for o in ours], key=lambda d: torch.finfo(d).eps)
        assert_close(g, e, dtype, "param" if rows > 1 else "bwd", f"{case}: d{name}", rows=rows)
    for name in c.buffers:
        assert_close(mine[name], expected_inputs[name], mine[name].dtype, "fwd", f"{case}: {name} after")
    if c.warns:  # the same warning (category and text) as torch, once a call
        theirs_named = [w for w in theirs_warnings if c.warns in w[1]]
        assert len(theirs_named) == 1, theirs_warnings
        assert [w for w in our_warnings if c.warns in w[1]] == theirs_named, our_warnings


def test_implicit_softmax_dim_warning_points_at_the_caller():
    """dim=None warns as torch does, attributed to the line that called normkit (stacklevel)."""
    x = torch.randn(2, 3, 4)
    for op in ("softmax", "log_softmax"):
        with pytest.warns(UserWarning, match=IMPLICIT.format(op)) as record:
            getattr(normkit, op)(x, None)
        assert record[0].filename == __file__


def test_dropout_p_1_gives_the_residual_exactly():
    """dropout_p=1 drops every element: h is the residual itself (bitwise), x's gradient is 0 and
    nothing is NaN or inf, even for non-finite x (whose dropped elements are 0, as with p < 1)."""
    x = torch.randn(4, 8)
    x[0, 0], x[1, 1], x[2, 2] = float("inf"), float("-inf"), float("nan")
    x.requires_grad_()
    r = torch.randn(4, 8, requires_grad=True)
    for op in ("add_layer_norm", "add_rms_norm"):
        y, h = getattr(normkit, op)(x, r, 8, dropout_p=1.0, prenorm=True)
        assert torch.equal(h, r) and torch.isfinite(y).all()
        gx, gr = torch.autograd.grad((y * y).sum() + h.sum(), (x, r))
        assert torch.equal(gx, torch.zeros_like(x)) and torch.isfinite(gr).all()
