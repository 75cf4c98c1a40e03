"""Public API: dispatch, argument errors (type + the argument named), empty tensors."""

import sys
import contextlib
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import INTERPRETER

import normkit
from normkit import dispatch


def _call(op, x, shape, weight=None, bias=None, eps=1e-5):
    if op == "layer_norm":
        return normkit.layer_norm(x, shape, weight, bias, eps)
    return normkit.rms_norm(x, shape, weight, eps)


OPS = ["layer_norm", "rms_norm"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(shape=(7,)), normkit.InvalidArgument, ["normalized_shape", "[7]", "[4, 8]"]),
        (dict(shape=(4, 8, 1)), normkit.InvalidArgument, ["normalized_shape", "trailing"]),
        (dict(shape=()), normkit.InvalidArgument, ["normalized_shape", "at least one"]),
        (dict(shape="8"), TypeError, ["normalized_shape", "'8'"]),
        (dict(weight=torch.ones(7)), normkit.InvalidArgument, ["weight", "[7]", "[8]"]),
        (dict(weight=torch.ones(8, dtype=torch.complex64)), normkit.InvalidDtype, ["weight", "complex64"]),
        (dict(weight=[1.0] * 8), TypeError, ["weight", "list"]),
        (dict(eps=-1e-5), normkit.InvalidArgument, ["eps", "-1e-05", ">= 0"]),
        (dict(eps=float("nan")), normkit.InvalidArgument, ["eps", "nan"]),
        (dict(eps="1e-5"), TypeError, ["eps", "'1e-5'"]),
    ],
    ids=["shape-mismatch", "shape-too-long", "shape-empty", "shape-type", "weight-shape",
         "weight-dtype", "weight-type", "eps-negative", "eps-nan", "eps-type"],  # fmt: skip
)
def test_argument_errors_name_the_argument(op, kwargs, error, words):
    x = torch.randn(4, 8)
    args = dict(shape=(8,), weight=None, bias=None, eps=1e-5) | kwargs
    for weight in (None, torch.ones(8)):  # valid calls first: their signatures are memoized (_VALID)
        _call(op, x, (8,), weight, eps=1e-3)
    with pytest.raises(error) as info:
        _call(op, x, **args)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
def test_non_float_input_is_rejected(op, dtype):
    x = torch.ones(4, 8, dtype=dtype)
    with pytest.raises(normkit.InvalidDtype) as info:
        _call(op, x, (8,))
    assert "input" in str(info.value) and str(dtype) in str(info.value)
    assert "float32" in str(info.value)  # says what is accepted


def test_memoized_signatures_keep_the_backend_of_their_overrides():
    """A call signature that passed the checks is remembered with its backend (functional._VALID);
    the backend overrides in effect are part of the signature, and the memo is bounded."""
    from normkit import functional

    x, w = torch.randn(4, 8), torch.randn(8)
    for _ in range(2):
        assert functional._prepare("layer_norm", x, (8,), 1e-5, weight=w)[0].NAME == "reference"
        with dispatch.use_backend("cpu", "normkit.backends.npu"):
            assert functional._prepare("layer_norm", x, (8,), 1e-5, weight=w)[0].NAME == "npu"
        with dispatch.use_backend("cpu", "normkit.backends.cuda"):
            assert functional._prepare("layer_norm", x, [8], 1e-5, weight=w)[0].NAME == "cuda"
    assert functional._prepare("layer_norm", x, (8,), 1e-5, weight=w)[0].NAME == "reference"
    assert len(functional._VALID) <= functional.VALID_SIZE


def test_plan_keys_only_for_calls_a_plan_may_serve():
    """plans.key: a signature for calls on contiguous plain tensors (parameters
    included), with the input's alignment in it and, last, whether gradients are wanted (a training
    plan); None for strided or subclassed tensors and for an argument the checks would have to see
    (``extra`` None)."""
    from normkit import plans

    def key(x, w, *extra):
        return plans.key("layer_norm", x, (w, None), *(extra or (8, 1e-5)))

    x, w = torch.randn(4, 8), torch.randn(8)
    p = torch.nn.Parameter(w.clone())
    assert key(x, w) is not None and key(x, w) == key(x.clone(), w.clone())
    assert key(x, w)[-1] is False
    assert key(x, p)[-1] is True  # grad mode on and the weight requires grad: a training plan
    assert key(x.clone().requires_grad_(), w)[-1] is True
    with torch.no_grad():
        assert key(x, p)[-1] is False
        assert key(x.requires_grad_(), w)[-1] is False
    x.requires_grad_(False)
    misaligned = torch.randn(40)[1:33].view(4, 8)
    assert key(misaligned, w) != key(x, w)
    assert key(torch.randn(8, 4).t(), w) is None  # not contiguous
    assert key(x, torch.randn(16)[::2]) is None

    class Sub(torch.Tensor):
        pass

    assert key(x, w.as_subclass(Sub)) is None and key(x.as_subclass(Sub), w) is None
    assert key(x, w, 8, None) is None  # eps not a float: the checks must see it


def test_input_key_is_the_key_of_a_call_without_parameters():
    """plans.input_key (softmax's key, inlined) is plans.key with no parameter tensors, in every
    state the key depends on: grad mode, requires_grad, alignment, overrides, layout, subclass."""
    from normkit import dispatch, plans

    class Sub(torch.Tensor):
        pass

    x = torch.randn(4, 8)
    inputs = [x, x.clone().requires_grad_(), torch.randn(40)[1:33].view(4, 8), torch.randn(8, 4).t(),
              x.as_subclass(Sub), torch.randn(3), torch.randn(2, 3, 5).double()]  # fmt: skip
    states = [contextlib.nullcontext, torch.no_grad, lambda: dispatch.use_backend("cpu", "normkit.reference")]
    seen = set()
    for state in states:
        with state():
            for t in inputs:
                for extra in ((True,), (None,), (8, 1e-5)):
                    want = plans.key("softmax", t, (), *extra)
                    assert plans.input_key("softmax", t, *extra) == want, (state, t.shape, extra)
                    seen.add(want)
    assert len(seen) > 10  # the states above give keys of their own


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_remembered_softmax_plan_serves_only_its_dim(op):
    """A plan remembered for a last-dim softmax (functional.softmax_key) never serves a call along
    another dim of the same input, nor a 1-dim or 0-dim input's call; each call against torch in
    fp64. On CPU through the reference backend (an override: functional's plans, not torch's op)."""
    g = torch.Generator().manual_seed(7)
    x = (3 * torch.randn(6, 5, generator=g, dtype=torch.float64)).float()
    fn, ref = getattr(normkit, op), getattr(torch, op)
    with dispatch.use_backend("cpu", "normkit.reference"):
        for t, dim in [(x, -1), (x, 1), (x, 0), (x, -2), (x, -1), (x[0].clone(), 0), (x[0].clone(), -1),
                       (x[0, 0].clone(), 0), (x[0, 0].clone(), -1), (x, 0)]:  # fmt: skip
            where = f"{op} of {tuple(t.shape)} along {dim}"
            torch.testing.assert_close(fn(t, dim), ref(t.double(), dim).float(), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, where=where: f"{where}: {m}")  # fmt: skip


def _planning_backend(calls: list):
    """The reference backend plus training plans built from its own contract functions, recording
    each plan call in ``calls`` (the CUDA backend's plans need a GPU; this checks the front end's
    plumbing: keys, autograd, gradient layout and dtypes, parameter shapes)."""
    from normkit import reference as ref

    module = types.ModuleType("normkit_test_planning_backend")
    module.__dict__.update({k: v for k, v in vars(ref).items() if not k.startswith("__")})

    def dense(g, dtype):
        assert g is None or (g.is_contiguous() and g.dtype == dtype and g.data_ptr() % 16 == 0)
        return g

    def plan_row_norm(x, weight, bias, eps, is_rms, add=False, residual=None, h_dtype=None, grad=False):
        if not grad:
            return None
        n, x_dtype, bias_dtype = x.shape[1], x.dtype, None if bias is None else bias.dtype
        res_dtype = None if residual is None else residual.dtype

        def rows(t):
            return None if t is None else t.reshape(-1, n)

        def flat(p):
            return None if p is None else p.reshape(n)

        def forward(inp, r, w, b):
            calls.append("row_norm forward")
            if add and is_rms:
                y, h, rstd = ref.add_rms_norm_fwd(rows(inp), rows(r), flat(w), eps, 0.0, 0, h_dtype)
                mean = rstd
            elif add:
                y, h, mean, rstd = ref.add_layer_norm_fwd(rows(inp), rows(r), flat(w), flat(b), eps, 0.0, 0,
                                                          h_dtype)  # fmt: skip
            elif is_rms:
                (y, rstd), h = ref.rms_norm_fwd(rows(inp), flat(w), eps), None
                mean = rstd
            else:
                (y, mean, rstd), h = ref.layer_norm_fwd(rows(inp), flat(w), flat(b), eps), None
            return y.view(inp.shape), None if h is None else h.view(inp.shape), mean, rstd

        def backward(dy, dh, xn, w, mean, rstd):
            calls.append("row_norm backward")
            dy, dh = rows(dense(dy, x_dtype)), rows(dense(dh, xn.dtype))
            if add and is_rms:
                (dx, dres, dw), db = ref.add_rms_norm_bwd(dy, dh, rows(xn), flat(w), rstd, 0.0, 0, x_dtype,
                                                          res_dtype), None  # fmt: skip
            elif add:
                dx, dres, dw, db = ref.add_layer_norm_bwd(dy, dh, rows(xn), flat(w), mean, rstd, bias_dtype,
                                                          0.0, 0, x_dtype, res_dtype)  # fmt: skip
            elif is_rms:
                (dx, dw), dres, db = ref.rms_norm_bwd(dy, rows(xn), flat(w), rstd), None, None
            else:
                (dx, dw, db), dres = ref.layer_norm_bwd(dy, rows(xn), flat(w), mean, rstd, bias_dtype), None
            return dx.view(xn.shape), None if dres is None else dres.view(xn.shape), dw, db

        return forward, backward

    def plan_softmax(x, log, grad=False):
        if not grad:
            return None
        n = x.shape[1]

        def forward(inp):
            calls.append("softmax forward")
            return ref.softmax_fwd(inp.reshape(-1, n), log).view(inp.shape)

        def backward(dy, y):
            calls.append("softmax backward")
            return ref.softmax_bwd(dense(dy, y.dtype).reshape(-1, n), y.reshape(-1, n), log).view(y.shape)

        return forward, backward

    def plan_group_norm(x, weight, bias, num_groups, eps, grad=False):
        if not grad:
            return None
        bias_dtype = None if bias is None else bias.dtype

        def forward(inp, r, w, b):
            calls.append("row_norm forward")
            y, mean, rstd = ref.group_norm_fwd(inp.reshape(x.shape), w, b, num_groups, eps)
            return y.view(inp.shape), None, mean, rstd

        def backward(dy, dh, inp, w, mean, rstd):
            calls.append("row_norm backward")
            dy = dense(dy, inp.dtype).reshape(x.shape)
            dx, dw, db = ref.group_norm_bwd(dy, inp.reshape(x.shape), w, mean, rstd, num_groups, bias_dtype)
            return dx.view(inp.shape), None, dw, db

        return forward, backward

    def plan_batch_norm(x, weight, bias, running_mean, running_var, eps, training, grad=False):
        if grad and not training:
            return None
        bias_dtype = None if bias is None else bias.dtype

        def forward(inp, w, b, rm, rv, momentum):
            calls.append("batch_norm forward")
            y, mean, rstd, _, _ = ref.batch_norm_train_fwd(inp.reshape(x.shape), w, b, eps, momentum, rm, rv,
                                                           in_place=True)  # fmt: skip
            return y.view(inp.shape), mean, rstd

        def backward(dy, inp, w, mean, rstd):
            calls.append("batch_norm backward")
            dy = dense(dy, inp.dtype).reshape(x.shape)
            dx, dw, db = ref.batch_norm_bwd(dy, inp.reshape(x.shape), w, mean, rstd, True, bias_dtype)
            return dx.view(inp.shape), dw, db

        def run_eval(inp, w, b, rm, rv, momentum):
            calls.append("batch_norm eval")
            y = ref.batch_norm_apply(inp.reshape(x.shape), w, b, rm, torch.rsqrt(rv + eps))
            return y.view(inp.shape)

        if not training:
            return run_eval
        return (forward, backward) if grad else (lambda *args: forward(*args)[0])

    module.plan_row_norm, module.plan_softmax = plan_row_norm, plan_softmax
    module.plan_group_norm, module.plan_batch_norm = plan_group_norm, plan_batch_norm
    return module


def _training_cases(x, r, w, b, ns, cw, cb):
    """name: (normkit's call, torch's, the inputs to differentiate), for x and r (4-D), w and b (of
    shape ns), cw and cb (per channel)."""
    f64, h = torch.float64, x + r.double()
    return {
        "group_norm": (lambda: normkit.group_norm(x, 2, cw, cb), lambda: F.group_norm(x, 2, cw, cb),
                       (x, cw, cb)),
        "layer_norm": (lambda: normkit.layer_norm(x, ns, w, b), lambda: F.layer_norm(x, ns, w, b), (x, w, b)),
        "rms_norm": (lambda: normkit.rms_norm(x, list(ns), w, 1e-6), lambda: F.rms_norm(x, ns, w, 1e-6),
                     (x, w)),
        "softmax": (lambda: normkit.softmax(x, -1), lambda: torch.softmax(x, -1), (x,)),
        "log_softmax": (lambda: normkit.log_softmax(x, 3), lambda: torch.log_softmax(x, -1), (x,)),
        "add_layer_norm": (lambda: normkit.add_layer_norm(x, r, ns, w, b, residual_dtype=f64),
                           lambda: F.layer_norm(h, ns, w, b), (x, r, w, b)),
        "add_rms_norm, prenorm": (lambda: sum(normkit.add_rms_norm(x, r, ns, w, 1e-6, residual_dtype=f64,
                                                                   prenorm=True)),
                                  lambda: F.rms_norm(h, ns, w, 1e-6) + h, (x, r, w)),
    }  # fmt: skip


def test_training_plans_run_forward_and_backward(monkeypatch):
    """Calls that want gradients run from a backend's training plan once their signature has been
    seen: the forward and backward both come from the plan, the gradients match torch in fp64 (with
    an expanded incoming gradient and a multi-dim normalized_shape), parameter gradients take the
    parameters' shape, the add-norms' x and residual gradients their dtypes (with and without h's
    own gradient), and a no-grad call of the same signature does not use the training plan. GroupNorm
    plans follow the row norms' protocol."""
    from normkit import plans

    calls: list = []
    module = _planning_backend(calls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plans._PLANS.clear()
    ns = (5, 6)
    with dispatch.use_backend("cpu", module.__name__):
        for rnd in range(3):
            x = torch.randn(3, 4, 5, 6, dtype=torch.float64, requires_grad=True)
            r = torch.randn(3, 4, 5, 6, dtype=torch.float32, requires_grad=True)
            w, b = (torch.nn.Parameter(torch.randn(ns, dtype=torch.float64)) for _ in range(2))
            cw, cb = (torch.nn.Parameter(torch.randn(4, dtype=torch.float64)) for _ in range(2))
            for name, (ours, reference, inputs) in _training_cases(x, r, w, b, ns, cw, cb).items():
                calls.clear()
                y, yr = ours(), reference()
                torch.testing.assert_close(y, yr, msg=name)
                for dy in (torch.randn_like(y), torch.randn(6, dtype=y.dtype).expand(y.shape)):
                    grads = torch.autograd.grad(y, inputs, dy, retain_graph=True)
                    expected = torch.autograd.grad(yr, inputs, dy, retain_graph=True)
                    for g, e, t in zip(grads, expected, inputs):
                        assert g.shape == e.shape and g.dtype == t.dtype, name
                        torch.testing.assert_close(g, e.to(t.dtype), msg=name)
                family = "softmax" if "softmax" in name else "row_norm"
                # each round's first call is served by the plan (asked for in round 0, reused later)
                assert calls == [f"{family} forward"] + [f"{family} backward"] * 2, (name, rnd, calls)
                with torch.no_grad():
                    calls.clear()
                    torch.testing.assert_close(ours(), yr.detach(), msg=name)
                    assert calls == [], name  # no inference plan here: a contract plan
    own = [p for p in plans._PLANS.values() if not plans.is_contract(p)]
    assert {type(p).__name__ for p in own} == {"Training", "AddNormTraining", "SoftmaxTraining"}
    assert all(plans.is_contract(p) for key, p in plans._PLANS.items() if not key[-1])
    plans._PLANS.clear()


def test_batch_norm_plans_update_running_statistics(monkeypatch):
    """BatchNorm calls run from a backend's plans (training with and without gradients, eval without)
    once their signature has been seen: y, every gradient and the running statistics (updated in
    place, a new momentum each step as nn.BatchNorm's cumulative average passes, so momentum is not
    part of the plan's key) match torch in fp64; eval mode with gradients runs a contract plan."""
    from normkit import plans

    calls: list = []
    module = _planning_backend(calls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plans._PLANS.clear()
    f64 = torch.float64
    w, b = (torch.nn.Parameter(torch.randn(4, dtype=f64)) for _ in range(2))
    ours = [torch.randn(4, dtype=f64), torch.rand(4, dtype=f64) + 0.5]
    theirs = [t.clone() for t in ours]
    with dispatch.use_backend("cpu", module.__name__):
        for rnd in range(3):
            momentum = 1.0 / (rnd + 1)
            x = torch.randn(3, 4, 5, 6, dtype=f64, requires_grad=True)
            modes = ((True, True, ["batch_norm forward", "batch_norm backward"]),
                     (True, False, ["batch_norm forward"]), (False, False, ["batch_norm eval"]),
                     (False, True, []))  # (training, gradients wanted, plan calls)  # fmt: skip
            for train, grad, served in modes:
                calls.clear()
                with torch.set_grad_enabled(grad):
                    y = normkit.batch_norm(x, *ours, w, b, training=train, momentum=momentum)
                    yr = F.batch_norm(x, *theirs, w, b, training=train, momentum=momentum)
                what = (rnd, train, grad)
                torch.testing.assert_close(y, yr, msg=str(what))
                for got, expected in zip(ours, theirs):
                    torch.testing.assert_close(got, expected, msg=str(what))
                if grad:
                    dy = torch.randn_like(y)
                    grads = torch.autograd.grad(y, (x, w, b), dy)
                    for g, e in zip(grads, torch.autograd.grad(yr, (x, w, b), dy)):
                        torch.testing.assert_close(g, e, msg=str(what))
                assert calls == served, (what, calls)
    kinds = {(key[-1], type(p).__name__, plans.is_contract(p))
             for key, p in plans._PLANS.items() if key[0] == "batch_norm"}  # fmt: skip
    # the backend's training and eval-mode inference plans; a contract plan for eval mode with gradients
    assert kinds == {(True, "BatchNormTraining", False), (False, "function", False),
                     (True, "BatchNormTraining", True)}, kinds  # fmt: skip
    plans._PLANS.clear()


def test_bias_wrong_shape_names_bias():
    with pytest.raises(normkit.InvalidArgument, match="bias has shape \\[3\\]"):
        normkit.layer_norm(torch.randn(2, 8), (8,), torch.ones(8), torch.ones(3))


def test_errors_are_also_runtime_errors():
    """Code written against torch (which raises RuntimeError) keeps catching our errors."""
    with pytest.raises(RuntimeError):
        normkit.layer_norm(torch.randn(2, 8), (7,))
    with pytest.raises(RuntimeError):
        normkit.layer_norm(torch.ones(2, 8, dtype=torch.long), (8,))


@pytest.mark.parametrize("op", OPS)
def test_mixed_devices_name_the_tensor(op):
    x = torch.randn(4, 8)
    weight = torch.ones(8, device="meta")
    with pytest.raises(normkit.InvalidArgument) as info:
        _call(op, x, (8,), weight)
    message = str(info.value)
    assert "weight" in message and "meta" in message and "cpu" in message
    assert message.startswith(f"{op}: weight is on device meta but input is on cpu"), message


def test_unregistered_device_lists_supported():
    x = torch.randn(4, 8, device="meta")
    with pytest.raises(normkit.InvalidArgument) as info:
        normkit.layer_norm(x, (8,))
    message = str(info.value)
    assert "input" in message and "'meta'" in message
    for device_type in ("cpu", "cuda", "npu"):
        assert device_type in message


def test_npu_backend_refuses_fp64_by_name():
    with dispatch.use_backend("cpu", "normkit.backends.npu"):
        with pytest.raises(normkit.InvalidDtype) as info:
            normkit.rms_norm(torch.randn(2, 8, dtype=torch.float64), (8,))
    assert "float64" in str(info.value) and "npu backend" in str(info.value)


def test_backend_for_and_overrides():
    assert normkit.backend_for("cpu").NAME == "reference"
    with dispatch.use_backend("cpu", "normkit.backends.npu"):
        assert normkit.backend_name_for("cpu") == "normkit.backends.npu"
        assert dispatch.registered()["cpu"] == "normkit.backends.npu"
    assert normkit.backend_name_for("cpu") == "normkit.reference"
    with pytest.raises(normkit.InvalidArgument, match="'xla'"):
        normkit.backend_name_for("xla:0")


@pytest.mark.parametrize("executor", [None] + INTERPRETER, ids=lambda e: e.name if e else "reference")
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (3, 0)], ids=str)
def test_empty_inputs_like_torch(executor, shape, run_on):
    """M = 0 (or N = 0): empty outputs, zero dweight/dbias, as torch gives; no kernel launched."""
    context = run_on(executor) if executor else dispatch.use_backend("cpu", "normkit.reference")
    n = shape[-1]
    with context:
        results = []
        for fn in (F.layer_norm, normkit.layer_norm):
            x = torch.randn(shape, requires_grad=True)
            w = torch.randn(n, requires_grad=True)
            b = torch.randn(n, requires_grad=True)
            y = fn(x, (n,), w, b, 1e-5)
            y.sum().backward()
            results.append((y, x.grad, w.grad, b.grad))
    for expected, got in zip(*results):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)


def test_missing_triton_names_the_install(monkeypatch):
    """Triton is no base dependency: a backend whose `triton` is absent says which extra provides it."""

    def no_triton(name):
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    monkeypatch.setattr(dispatch.importlib, "import_module", no_triton)
    with pytest.raises(ModuleNotFoundError, match=r'normkit\[cuda\]'):
        dispatch.backend_for("cuda")
    with pytest.raises(ModuleNotFoundError, match=r'normkit\[npu\]'):
        dispatch.backend_for("npu:0")


def test_backward_runs_on_the_forward_backend_from_another_thread(monkeypatch):
    """A backend override holds for the backward too, though autograd runs a CUDA backward on its
    own thread, where the forward's context is not set: here the backward runs on a fresh thread."""
    import sys
    import threading
    import types

    from normkit import reference

    calls = []
    spy = types.ModuleType("normkit_test_spy_backend")
    spy.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    for name in ("rms_norm_fwd", "rms_norm_bwd"):
        def record(*args, _name=name):
            calls.append((_name, threading.current_thread().name))
            return getattr(reference, _name)(*args)
        setattr(spy, name, record)
    monkeypatch.setitem(sys.modules, spy.__name__, spy)
    x = torch.randn(4, 8, requires_grad=True)
    with dispatch.use_backend("cpu", spy.__name__):
        y = normkit.rms_norm(x, (8,))
    dy = torch.randn_like(y)
    worker = threading.Thread(target=lambda: y.backward(dy), name="backward-thread")
    worker.start()
    worker.join()
    assert calls == [("rms_norm_fwd", threading.current_thread().name), ("rms_norm_bwd", "backward-thread")]
    x64 = x.detach().double().requires_grad_()
    y64 = F.rms_norm(x64, (8,), eps=torch.finfo(torch.float32).eps)
    (expected,) = torch.autograd.grad(y64, x64, dy.double())
    torch.testing.assert_close(x.grad.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("executor", INTERPRETER, ids=lambda e: e.name)
def test_fresh_outputs_backends_return_no_aliases(executor, run_on):
    """A backend that declares FRESH_OUTPUTS skips plans.fresh's alias check, so every output of every
    contract function must be a new allocation: no storage shared with an input or another output."""
    import importlib

    backend = importlib.import_module(executor.module)
    assert backend.FRESH_OUTPUTS
    g = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    x, dy, res, w, b = r(6, 40), r(6, 40), r(6, 40), r(40), r(40)
    img, dimg, cw, cb = r(2, 4, 9), r(2, 4, 9), r(4), r(4)
    f32 = torch.float32
    with run_on(executor):
        calls = {}
        y, mean, rstd = backend.layer_norm_fwd(x, w, b, 1e-5)
        calls["layer_norm_fwd"] = ((x, w, b), (y, mean, rstd))
        calls["layer_norm_bwd"] = ((dy, x, w, mean, rstd), backend.layer_norm_bwd(dy, x, w, mean, rstd, f32))
        yr, rs = backend.rms_norm_fwd(x, w, 1e-5)
        calls["rms_norm_fwd"] = ((x, w), (yr, rs))
        calls["rms_norm_bwd"] = ((dy, x, w, rs), backend.rms_norm_bwd(dy, x, w, rs))
        ys = backend.softmax_fwd(x, False)
        calls["softmax_fwd"] = ((x,), (ys,))
        calls["softmax_bwd"] = ((dy, ys), (backend.softmax_bwd(dy, ys, False),))
        ya, h, ma, ra = backend.add_layer_norm_fwd(x, res, w, b, 1e-5, 0.1, 3, f32)
        calls["add_layer_norm_fwd"] = ((x, res, w, b), (ya, h, ma, ra))
        calls["add_layer_norm_bwd"] = ((dy, dy, h, w, ma, ra), backend.add_layer_norm_bwd(
            dy, dy, h, w, ma, ra, f32, 0.1, 3, f32, f32))
        yb, hb, rb = backend.add_rms_norm_fwd(x, res, w, 1e-5, 0.0, 0, f32)
        calls["add_rms_norm_fwd"] = ((x, res, w), (yb, hb, rb))
        calls["add_rms_norm_bwd"] = ((dy, None, hb, w, rb), backend.add_rms_norm_bwd(
            dy, None, hb, w, rb, 0.0, 0, f32, f32))
        yg, mg, rg = backend.group_norm_fwd(img, cw, cb, 2, 1e-5)
        calls["group_norm_fwd"] = ((img, cw, cb), (yg, mg, rg))
        calls["group_norm_bwd"] = ((dimg, img, cw, mg, rg),
                                   backend.group_norm_bwd(dimg, img, cw, mg, rg, 2, f32))
        run_m, run_v = torch.zeros_like(cw), torch.ones_like(cw)
        bm, brs = backend.batch_norm_stats(img, 1e-5, 0.1, run_m, run_v)
        calls["batch_norm_stats"] = ((img, run_m, run_v), (bm, brs))
        calls["batch_norm_apply"] = ((img, cw, cb, bm, brs),
                                     (backend.batch_norm_apply(img, cw, cb, bm, brs),))
        calls["batch_norm_train_fwd"] = ((img, cw, cb, run_m, run_v),
                                         backend.batch_norm_train_fwd(img, cw, cb, 1e-5, 0.1, run_m, run_v))
        calls["batch_norm_bwd"] = ((dimg, img, cw, bm, brs),
                                   backend.batch_norm_bwd(dimg, img, cw, bm, brs, True, f32))
    for name, (inputs, outputs) in calls.items():
        seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None}
        outs = [t for t in outputs if t is not None and t.numel()]
        assert outs, name
        for t in outs:
            ptr = t.untyped_storage().data_ptr()
            assert ptr not in seen, f"{backend.NAME}.{name}: an output shares storage with another tensor"
            seen.add(ptr)


def _spy_backend(calls: list, name: str = "normkit_test_contract_backend"):
    """The reference as a backend with no plans of its own, recording each contract call with the
    strategy override in effect for it (``dispatch.strategy``)."""
    from normkit import reference

    spy = types.ModuleType(name)
    spy.__dict__.update({k: v for k, v in vars(reference).items() if not k.startswith("__")})
    for fn in dispatch.CONTRACT:
        def record(*args, _fn=fn):
            calls.append((_fn, dispatch.strategy(name)))
            return getattr(reference, _fn)(*args)
        setattr(spy, fn, record)
    return spy


def test_every_backend_runs_remembered_contract_plans(monkeypatch):
    """A backend without plans of its own (the reference, the NPU backend) gets contract plans: a
    repeated call of every op is served by the plan remembered for its signature, with no checks
    (``_prepare`` would fail here) and fresh data each call, and matches torch in fp64, forward and
    backward; a call with dropout gets a plan of its own (none remembered)."""
    from normkit import functional, plans

    calls: list = []
    spy = _spy_backend(calls)
    monkeypatch.setitem(sys.modules, spy.__name__, spy)
    f64 = torch.float64
    w, b = (torch.randn(6, dtype=f64, requires_grad=True) for _ in range(2))
    c = torch.randn(4, dtype=f64, requires_grad=True)
    cases = {  # op -> (normkit, torch) on x (3, 4, 6) and r
        "layer_norm": (lambda x, r: normkit.layer_norm(x, (6,), w, b),
                       lambda x, r: F.layer_norm(x, (6,), w, b)),
        "rms_norm": (lambda x, r: normkit.rms_norm(x, (6,), w, 1e-6),
                     lambda x, r: F.rms_norm(x, (6,), w, 1e-6)),
        "softmax": (lambda x, r: normkit.softmax(x, -1), lambda x, r: torch.softmax(x, -1)),
        "add_rms_norm": (lambda x, r: normkit.add_rms_norm(x, r, 6, w, 1e-6),
                         lambda x, r: F.rms_norm(x + r, (6,), w, 1e-6)),
        "group_norm": (lambda x, r: normkit.group_norm(x, 2, c, c), lambda x, r: F.group_norm(x, 2, c, c)),
        "batch_norm": (lambda x, r: normkit.batch_norm(x, None, None, c, c, True),
                       lambda x, r: F.batch_norm(x, None, None, c, c, True)),
    }  # fmt: skip

    def one_round(rnd):
        for grad in (False, True):
            x = torch.randn(3, 4, 6, dtype=f64, requires_grad=grad)
            r = torch.randn(3, 4, 6, dtype=f64, requires_grad=grad)
            for op, (ours, theirs) in cases.items():
                with torch.set_grad_enabled(grad):
                    y, expected = ours(x, r), theirs(x, r)
                torch.testing.assert_close(y, expected, msg=f"{op} round {rnd} grad {grad}")
                if grad:
                    dy = torch.randn_like(y)
                    inputs = (x, r, w) if op == "add_rms_norm" else (x,)
                    got, want = torch.autograd.grad(y, inputs, dy), torch.autograd.grad(expected, inputs, dy)
                    for g, e in zip(got, want):
                        torch.testing.assert_close(g, e, msg=f"{op} round {rnd} gradient")

    plans._PLANS.clear()
    with dispatch.use_backend("cpu", spy.__name__):
        one_round(0)
        with monkeypatch.context() as patch:  # from here on every call must come from a remembered plan
            patch.setattr(functional, "_prepare", lambda *a, **k: pytest.fail("checked again"))
            patch.setattr(functional, "_group_norm", lambda *a, **k: pytest.fail("checked again"))
            one_round(1)
            one_round(2)
        assert len(plans._PLANS) == 2 * len(cases)
        assert all(plans.is_contract(p) for p in plans._PLANS.values())
        x = torch.randn(3, 4, 6, dtype=f64)
        y1, y2 = (normkit.add_layer_norm(x, None, 6, dropout_p=0.5, seed=seed) for seed in (1, 2))
        assert not torch.equal(y1, y2) and len(plans._PLANS) == 2 * len(cases)  # each seed's plan, not kept
    assert {fn for fn, _ in calls} >= {"layer_norm_fwd", "layer_norm_bwd", "group_norm_bwd", "batch_norm_bwd"}
    plans._PLANS.clear()


def test_contract_plan_backward_runs_under_the_forward_strategy(monkeypatch):
    """A contract plan's backward runs under the overrides in effect for its forward (a strategy
    forced with ``config.forced`` reaches the backward), also from another thread and after the
    block that set them has ended."""
    import threading

    calls: list = []
    spy = _spy_backend(calls, "normkit_test_strategy_backend")
    monkeypatch.setitem(sys.modules, spy.__name__, spy)
    x = torch.randn(4, 8, requires_grad=True)
    with dispatch.use_backend("cpu", spy.__name__), dispatch.use_strategy(spy.__name__, "forced"):
        y = normkit.layer_norm(x.view(2, 2, 8)[:, 1], (8,))  # strided: a plan of its own
    worker = threading.Thread(target=lambda: y.backward(torch.randn_like(y)))
    worker.start()
    worker.join()
    assert calls == [("layer_norm_fwd", "forced"), ("layer_norm_bwd", "forced")], calls
    assert x.grad is not None and x.grad[0::2].abs().sum() == 0 and x.grad[1::2].abs().sum() > 0


def test_plans_never_serve_a_converted_argument(monkeypatch):
    """A broadcast residual (add-norms) and an integer RMSNorm weight are converted by the front end
    (expanded to x's shape; cast to the math dtype): such calls take the full path, and a plan made
    for the plain call of the same shapes is not handed the unconverted tensor (checked in both
    orders, through a stub backend whose training plans wrap the reference)."""
    from normkit import plans

    calls: list = []
    module = _planning_backend(calls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plans._PLANS.clear()
    f64 = torch.float64
    with dispatch.use_backend("cpu", module.__name__):
        for _ in range(2):
            x = torch.randn(3, 4, 8, dtype=f64, requires_grad=True)
            full = torch.randn(3, 4, 8, dtype=f64, requires_grad=True)
            row = torch.randn(8, dtype=f64, requires_grad=True)
            w = torch.randn(8, dtype=f64, requires_grad=True)
            for r in (full, row, full, row):
                y = normkit.add_layer_norm(x, r, 8, w, None)
                yr = F.layer_norm(x + r, (8,), w)
                torch.testing.assert_close(y, yr)
                expected = torch.autograd.grad(yr.sum(), (x, r, w))
                for g, e in zip(torch.autograd.grad(y.sum(), (x, r, w)), expected):
                    assert g.shape == e.shape
                    torch.testing.assert_close(g, e)
            wi = torch.tensor([1, 2, -1, 3, 0, 1, 2, 1])
            for weight in (w, wi, w, wi):
                y = normkit.rms_norm(x, (8,), weight, 1e-6)
                torch.testing.assert_close(y, F.rms_norm(x, (8,), weight, 1e-6))
    assert "row_norm forward" in calls  # the plain calls were served by plans
    plans._PLANS.clear()


def test_a_backend_may_leave_contract_functions_to_the_reference(monkeypatch):
    """A backend module that does not define some contract functions (named, with why, in its
    FALLS_BACK) serves the others, and normkit.reference serves those, forward and backward. Every
    registered backend defines each contract function or names it there; the reference defines all."""
    import importlib

    from normkit import reference

    registered = set(dispatch._REGISTRY.values())
    assert registered >= {"normkit.reference", "normkit.backends.cuda", "normkit.backends.npu"}
    for name in sorted(registered):
        module = importlib.import_module(name)
        left = dispatch.falls_back(module)
        assert all(isinstance(why, str) and why for why in left.values()), name
        assert [fn for fn in dispatch.CONTRACT if hasattr(module, fn) == (fn in left)] == [], name
    assert not dispatch.falls_back(reference)

    served = []
    partial = types.ModuleType("normkit_test_partial_backend")
    partial.NAME, partial.SUPPORTED_DTYPES = "partial", reference.SUPPORTED_DTYPES
    partial.FALLS_BACK = {"group_norm_fwd": "not written yet", "group_norm_bwd": "not written yet"}
    for fn in dispatch.CONTRACT:
        if fn not in partial.FALLS_BACK:
            def counted(*args, _name=fn, **kwargs):
                served.append(_name)
                return getattr(reference, _name)(*args, **kwargs)

            setattr(partial, fn, counted)
    monkeypatch.setitem(sys.modules, partial.__name__, partial)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    with dispatch.use_backend("cpu", partial.__name__):
        y = normkit.group_norm(x, 3, w) * 2 + normkit.layer_norm(x, (5,))
        y.sum().backward()
    assert served == ["layer_norm_fwd", "layer_norm_bwd"]
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    (F.group_norm(x2, 3, w2) * 2 + F.layer_norm(x2, (5,))).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    # A backend that promises fresh outputs (FRESH_OUTPUTS) may still leave functions to the
    # reference, whose outputs can alias inputs (the add-norms' h = x without a residual): those get
    # the alias check of the module that served them, forward and backward.
    partial.FRESH_OUTPUTS = True
    partial.FALLS_BACK = {fn: "not written yet" for fn in ("add_layer_norm_fwd", "add_layer_norm_bwd")}
    for fn in partial.FALLS_BACK:
        delattr(partial, fn)
    x, r = (torch.randn(4, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    with dispatch.use_backend("cpu", partial.__name__):
        for _ in range(2):  # made, then remembered
            y, h = normkit.add_layer_norm(x, None, 8, prenorm=True)
            assert h.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
            (y + h).sum().backward()
            y = normkit.add_layer_norm(x, r, 8)
            y.backward(torch.randn_like(y))
            assert x.grad.untyped_storage().data_ptr() != r.grad.untyped_storage().data_ptr()
            x.grad = r.grad = None
