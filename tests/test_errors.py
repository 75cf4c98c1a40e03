"""Argument errors of every public op: the type, and a message naming the argument, the value given
and what is accepted. tests/test_api.py covers LayerNorm/RMSNorm's normalized_shape, weight, eps and
input-dtype errors; the per-family files a few more. This file covers the rest, for every op."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

import normkit
from normkit import dispatch

NONFLOAT = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _x(shape=(4, 6, 5), dtype=torch.float32, device="cpu"):
    return torch.randn(shape).to(dtype).to(device) if dtype.is_floating_point or dtype.is_complex \
        else torch.ones(shape, dtype=dtype, device=device)  # fmt: skip


# One call per public op with its input replaced: (name of the input argument, call).
CALLS = {
    "softmax": ("input", lambda x: normkit.softmax(x, -1)),
    "log_softmax": ("input", lambda x: normkit.log_softmax(x, 1)),
    "add_layer_norm": ("x", lambda x: normkit.add_layer_norm(x, None, 5)),
    "add_rms_norm": ("x", lambda x: normkit.add_rms_norm(x, None, 5)),
    "group_norm": ("input", lambda x: normkit.group_norm(x, 3)),
    "instance_norm": ("input", lambda x: normkit.instance_norm(x)),
    "batch_norm": ("input", lambda x: normkit.batch_norm(x, None, None, training=True)),
    "layer_norm-3d": ("input", lambda x: normkit.layer_norm(x, (6, 5))),
    "rms_norm-3d": ("input", lambda x: normkit.rms_norm(x, (6, 5))),
}


def _check(info, *words):
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert isinstance(info.value, RuntimeError), "normkit errors are RuntimeErrors too (as torch's)"


@pytest.mark.parametrize("dtype", NONFLOAT, ids=str)
@pytest.mark.parametrize("op", CALLS)
def test_integer_bool_complex_inputs(op, dtype):
    name, call = CALLS[op]
    with pytest.raises(normkit.InvalidDtype) as info:
        call(_x(dtype=dtype))
    _check(info, name, str(dtype), "float32", "bfloat16")


@pytest.mark.parametrize("op", CALLS)
def test_unregistered_device(op):
    name, call = CALLS[op]
    with pytest.raises(normkit.InvalidArgument) as info:
        call(_x(device="meta"))
    _check(info, name, "'meta'", "cpu", "cuda", "npu")


@pytest.mark.parametrize("op", CALLS)
def test_not_a_tensor(op):
    name, call = CALLS[op]
    with pytest.raises(TypeError) as info:
        call([[1.0] * 5] * 6)
    assert name in str(info.value) and "list" in str(info.value)


# --- parameters: shape, device, dtype --------------------------------------------------------------

C = 6  # channels of _x()
PARAM_CALLS = {  # op -> call(x, **params); x is (4, 6, 5)
    "layer_norm": lambda x, **p: normkit.layer_norm(x, (5,), p.get("weight"), p.get("bias")),
    "rms_norm": lambda x, **p: normkit.rms_norm(x, (5,), p.get("weight")),
    "add_layer_norm": lambda x, **p: normkit.add_layer_norm(x, x, (5,), p.get("weight"), p.get("bias")),
    "add_rms_norm": lambda x, **p: normkit.add_rms_norm(x, x, (5,), p.get("weight")),
    "group_norm": lambda x, **p: normkit.group_norm(x, 3, p.get("weight"), p.get("bias")),
    "instance_norm": lambda x, **p: normkit.instance_norm(x, weight=p.get("weight"), bias=p.get("bias")),
    "instance_norm-running": lambda x, **p: normkit.instance_norm(
        x, p.get("running_mean"), p.get("running_var"), p.get("weight"), p.get("bias"),
        use_input_stats=False),  # fmt: skip
    "batch_norm": lambda x, **p: normkit.batch_norm(
        x, p.get("running_mean", torch.zeros(C)), p.get("running_var", torch.ones(C)), p.get("weight"),
        p.get("bias"), training=True),  # fmt: skip
}
PARAM_SIZE = {"layer_norm": 5, "rms_norm": 5, "add_layer_norm": 5, "add_rms_norm": 5}


def _params(op):
    names = ["weight"] if "rms" in op else ["weight", "bias"]
    if op in ("batch_norm", "instance_norm-running"):
        names += ["running_mean", "running_var"]
    return names


def _good(op, name):
    n = PARAM_SIZE.get(op, C)
    return torch.ones(n) if name != "running_mean" else torch.zeros(n)


@pytest.mark.parametrize("op,name", [(op, n) for op in PARAM_CALLS for n in _params(op)], ids=str)
def test_parameter_of_wrong_shape(op, name):
    params = {n: _good(op, n) for n in _params(op)}
    params[name] = torch.ones(PARAM_SIZE.get(op, C) + 1)
    with pytest.raises(normkit.InvalidArgument) as info:
        PARAM_CALLS[op](_x(), **params)
    bad = str(PARAM_SIZE.get(op, C) + 1)
    _check(info, name, f"[{bad}]", f"[{PARAM_SIZE.get(op, C)}]")
    if op not in PARAM_SIZE:  # the channel norms have no normalized_shape argument: C is named
        assert "normalized_shape" not in str(info.value)
        _check(info, f"expected shape [{C}] (num_channels")


@pytest.mark.parametrize("op,name", [(op, n) for op in PARAM_CALLS for n in _params(op)], ids=str)
def test_parameter_on_another_device(op, name):
    """Named with the op's prefix, as every other argument error (it lacked it)."""
    params = {n: _good(op, n) for n in _params(op)}
    params[name] = params[name].to("meta")
    with pytest.raises(normkit.InvalidArgument) as info:
        PARAM_CALLS[op](_x(), **params)
    _check(info, name, "meta", "cpu", "same device")
    assert str(info.value).startswith(f"{op.split('-')[0]}: {name} is on device meta"), str(info.value)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_residual_on_another_device(op):
    with pytest.raises(normkit.InvalidArgument) as info:
        getattr(normkit, op)(_x(), _x(device="meta"), 5)
    assert str(info.value).startswith(f"{op}: residual is on device meta but x is on cpu"), str(info.value)


@pytest.mark.parametrize("op,name,dtype", [
    (op, n, d) for op in PARAM_CALLS for n in _params(op) for d in (torch.int32, torch.bool, torch.complex64)
    if "rms" not in op or d.is_complex  # RMSNorm takes integer and bool weights, as torch (test_torch_parity)
], ids=str)  # fmt: skip
def test_parameter_of_non_float_dtype(op, name, dtype):
    params = {n: _good(op, n) for n in _params(op)}
    params[name] = params[name].to(dtype)
    with pytest.raises(normkit.InvalidDtype) as info:
        PARAM_CALLS[op](_x(), **params)
    _check(info, name, str(dtype), "float32")


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
TORCH_RULE_OPS = {  # normkit op -> the torch.nn.functional op whose dtype rule it follows
    "layer_norm": lambda x, w, b: F.layer_norm(x, (5,), w, b),
    "group_norm": lambda x, w, b: F.group_norm(x, 3, w, b),
    "batch_norm": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
    "instance_norm": lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
}


@pytest.mark.parametrize("op", list(TORCH_RULE_OPS) + ["add_layer_norm"])
def test_mixed_parameter_dtypes_rejected_where_torch_rejects(op):
    """Every (input, weight, bias) dtype triple, with None: normkit accepts exactly what torch
    (CPU) accepts; a rejection names the parameter, its dtype and what is accepted. add_layer_norm
    follows layer_norm's rule, relative to x's dtype."""
    torch_call = TORCH_RULE_OPS[op if op != "add_layer_norm" else "layer_norm"]
    n = PARAM_SIZE.get(op, C)
    checked = 0
    for xd, wd, bd in itertools.product(FLOATS, FLOATS + [None], FLOATS + [None]):
        x = _x(dtype=xd)
        w = None if wd is None else torch.ones(n, dtype=wd)
        b = None if bd is None else torch.zeros(n, dtype=bd)
        try:
            torch_call(x, w, b)
            torch_ok = True
        except RuntimeError:
            torch_ok = False
        if torch_ok:
            y = PARAM_CALLS[op](x, weight=w, bias=b)
            assert y.dtype == xd
            checked += 1
            continue
        with pytest.raises(normkit.InvalidDtype) as info:
            PARAM_CALLS[op](x, weight=w, bias=b)
        message = str(info.value)
        assert ("weight" in message or "bias" in message) and "accepted" in message, message
        assert str(wd) in message or str(bd) in message, message
    assert checked >= 8  # same dtypes (4 x with/without params) and fp32 params of half inputs


def test_rms_norm_accepts_any_float_weight_like_torch():
    """torch's rms_norm is composite: any float weight dtype works (normkit: y in x's dtype)."""
    for xd, wd in itertools.product(FLOATS, FLOATS):
        x = _x((3, 5), xd)
        y = normkit.rms_norm(x, (5,), torch.ones(5, dtype=wd))
        expected = F.rms_norm(x.double(), (5,), torch.ones(5, dtype=torch.float64),
                              eps=torch.finfo(xd).eps)  # fmt: skip
        assert y.dtype == xd
        torch.testing.assert_close(y.double(), expected, atol=2e-2, rtol=2e-2)


# --- scalar arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("groups,error,words", [
    (4, normkit.InvalidArgument, ["num_groups 4", "6 channels", "C % num_groups == 0", "1, 2, 3, 6"]),
    (12, normkit.InvalidArgument, ["num_groups 12", "6 channels"]),
    (-3, normkit.InvalidArgument, ["num_groups", "-3", "positive int", "1, 2, 3, 6"]),
    (True, TypeError, ["num_groups", "True", "positive int"]),
    (3.0, TypeError, ["num_groups", "3.0", "positive int"]),
    (torch.tensor(3.0), TypeError, ["num_groups", "tensor(3.)", "positive int"]),
], ids=["4", "12", "negative", "bool", "float", "float-tensor"])  # fmt: skip
def test_num_groups(groups, error, words):
    """A wrong type is a TypeError, as torch's (a numpy int or 0-dim integer tensor is accepted:
    tests/test_torch_parity.py)."""
    with pytest.raises(error) as info:
        normkit.group_norm(_x(), groups)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim,accepted", [
    ((4, 6, 5), 3, "[-3, 2]"), ((4, 6, 5), -4, "[-3, 2]"), ((7,), 1, "[-1, 0]"), ((), 1, "[-1, 0]"),
    ((), -2, "[-1, 0]"),
], ids=str)  # fmt: skip
def test_dim_out_of_range(op, shape, dim, accepted):
    with pytest.raises(normkit.InvalidArgument) as info:
        getattr(normkit, op)(torch.randn(shape), dim)
    _check(info, "dim", str(dim), accepted)
    assert isinstance(info.value, IndexError)  # as torch's error for the same call
    with pytest.raises(IndexError):  # torch rejects the same dims
        getattr(F, op)(torch.randn(shape), dim)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [1.0, "1", True, torch.tensor(1.0), torch.tensor([1]), (1,)], ids=repr)
def test_dim_of_wrong_type(op, dim):
    """As torch: TypeError (None, numpy ints and 0-dim integer tensors are accepted)."""
    with pytest.raises(TypeError) as info:
        getattr(normkit, op)(torch.randn(3, 4), dim)
    assert "dim" in str(info.value) and repr(dim) in str(info.value)
    # torch < 2.13 reads a str dim as a dimension name: RuntimeError ('1' is not an identifier)
    with pytest.raises((TypeError, RuntimeError) if isinstance(dim, str) else TypeError):
        getattr(F, op)(torch.randn(3, 4), dim)


EPS_CALLS = {
    "add_layer_norm": lambda eps: normkit.add_layer_norm(_x(), None, 5, eps=eps),
    "add_rms_norm": lambda eps: normkit.add_rms_norm(_x(), None, 5, eps=eps),
    "group_norm": lambda eps: normkit.group_norm(_x(), 3, eps=eps),
    "instance_norm": lambda eps: normkit.instance_norm(_x(), eps=eps),
    "instance_norm-running": lambda eps: normkit.instance_norm(_x(), torch.zeros(C), torch.ones(C),
                                                               use_input_stats=False, eps=eps),
    "batch_norm": lambda eps: normkit.batch_norm(_x(), None, None, training=True, eps=eps),
    "batch_norm-eval": lambda eps: normkit.batch_norm(_x(), torch.zeros(C), torch.ones(C), eps=eps),
}


@pytest.mark.parametrize("eps,error,words", [
    (-1e-5, normkit.InvalidArgument, ["eps", "-1e-05", ">= 0"]),
    (float("inf"), normkit.InvalidArgument, ["eps", "inf", "finite"]),
    (float("nan"), normkit.InvalidArgument, ["eps", "nan"]),
    ("1e-5", TypeError, ["eps", "'1e-5'", "real number"]),
    (torch.tensor([1e-5]), TypeError, ["eps", "tensor([1.0000e-05])", "0-dim"]),
    (torch.tensor(1e-5, requires_grad=True), TypeError, ["eps", "requires_grad=True",
                                                         "does not require grad"]),
    (torch.tensor(-1e-5), normkit.InvalidArgument, ["eps", "tensor(-1.0000e-05)", ">= 0"]),
    (torch.tensor(float("nan")), normkit.InvalidArgument, ["eps", "nan"]),
    (torch.tensor(1e-5j), TypeError, ["eps", "real number"]),
    (True, TypeError, ["eps", "True", "real number"]),
], ids=["negative", "inf", "nan", "str", "1d-tensor", "tensor-requiring-grad", "negative-tensor",
        "nan-tensor", "complex-tensor", "bool"])  # fmt: skip
@pytest.mark.parametrize("op", EPS_CALLS)
def test_eps(op, eps, error, words):
    """A negative, inf or nan eps is refused on purpose (torch gives NaN rows; docs/testing.md), a
    bool too (torch reads True as 1.0); a tensor that is not a 0-dim real one that does not
    require grad is torch's TypeError too. A valid 0-dim tensor is accepted (test_torch_parity)."""
    with pytest.raises(error) as info:
        EPS_CALLS[op](eps)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("p", [float("nan"), float("inf"), 1.5, -0.0001, True, None, torch.tensor([0.1]),
                               torch.tensor(1.5)], ids=repr)  # fmt: skip
def test_dropout_p_outside_0_1(op, p):
    """p = 1 is accepted (every element dropped, as F.dropout(p=1)): tests/test_torch_parity.py."""
    with pytest.raises(normkit.InvalidArgument) as info:
        getattr(normkit, op)(_x(), None, 5, dropout_p=p)
    _check(info, "dropout_p", "[0, 1]")
    assert repr(p) in str(info.value) or str(float(p)) in str(info.value), str(info.value)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_residual_errors(op):
    fn = getattr(normkit, op)
    with pytest.raises(normkit.InvalidDtype) as info:
        fn(_x(), _x(dtype=torch.int32), 5)
    _check(info, "residual", "int32", "float32")
    with pytest.raises(normkit.InvalidDtype) as info:
        fn(_x(), _x(dtype=torch.complex64), 5)
    _check(info, "residual", "complex64")
    with pytest.raises(normkit.InvalidArgument) as info:
        fn(_x(), _x(), 6)
    _check(info, "normalized_shape", "[6]", "x")
    with pytest.raises(normkit.InvalidArgument) as info:
        fn(_x(), _x(), 5, seed=2**63)
    _check(info, "seed", str(2**63), "[0, 2**63)")


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_momentum_type(op):
    x = _x()
    with pytest.raises(TypeError) as info:
        if op == "batch_norm":
            normkit.batch_norm(x, torch.zeros(C), torch.ones(C), training=True, momentum="0.1")
        else:
            normkit.instance_norm(x, torch.zeros(C), torch.ones(C), momentum="0.1")
    assert "momentum" in str(info.value) and "'0.1'" in str(info.value)


@pytest.mark.parametrize("shape", [(0, 4), (3, 4), (2, 4, 1), (0, 4, 1, 1)], ids=str)
def test_instance_norm_one_spatial_element_like_torch(shape):
    """torch rejects one spatial element whatever the batch size (an empty batch too)."""
    with pytest.raises(ValueError):
        F.instance_norm(torch.randn(shape))
    with pytest.raises(normkit.InvalidArgument) as info:
        normkit.instance_norm(torch.randn(shape))
    _check(info, "spatial element", str(list(shape)))


@pytest.mark.parametrize("shape", [(1, 4), (1, 4, 1), (1, 0, 1)], ids=str)
def test_batch_norm_one_value_per_channel_like_torch(shape):
    with pytest.raises(ValueError):
        F.batch_norm(torch.randn(shape), None, None, training=True)
    with pytest.raises(normkit.InvalidArgument) as info:
        normkit.batch_norm(torch.randn(shape), None, None, training=True)
    _check(info, "more than 1 value per channel", str(list(shape)))


@pytest.mark.parametrize("op", ["group_norm", "instance_norm", "batch_norm"])
@pytest.mark.parametrize("shape", [(6,), ()], ids=str)
def test_channel_ops_need_n_c(op, shape):
    x = torch.randn(shape)
    with pytest.raises(normkit.InvalidArgument) as info:
        if op == "group_norm":
            normkit.group_norm(x, 1)
        elif op == "instance_norm":
            normkit.instance_norm(x)
        else:
            normkit.batch_norm(x, None, None, training=True)
    _check(info, "input", "(N, C, *)", str(list(shape)))


def test_backend_dtype_error_names_the_backend():
    """A dtype the float set allows but the serving backend lacks (fp64 on the NPU kernels)."""
    with dispatch.use_backend("cpu", "normkit.backends.npu"):
        for call in (lambda x: normkit.softmax(x, -1), lambda x: normkit.group_norm(x, 3),
                     lambda x: normkit.add_rms_norm(x, None, 5)):  # fmt: skip
            with pytest.raises(normkit.InvalidDtype) as info:
                call(_x(dtype=torch.float64))
            _check(info, "float64", "npu backend", "float32")


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
@pytest.mark.parametrize("momentum", [None, True, "0.1", torch.tensor([0.1]),
                                      torch.tensor(0.1, requires_grad=True)], ids=repr)  # fmt: skip
def test_momentum_refused(op, momentum):
    """None is torch's TypeError too (the modules' momentum=None, a cumulative average, is resolved
    by the modules); a bool is refused (torch reads True as 1.0). Real numbers and 0-dim tensors are
    accepted (test_torch_parity)."""
    with pytest.raises(TypeError) as info:
        if op == "batch_norm":
            normkit.batch_norm(_x(), torch.zeros(C), torch.ones(C), training=True, momentum=momentum)
        else:
            normkit.instance_norm(_x(), torch.zeros(C), torch.ones(C), momentum=momentum)
    assert str(info.value).startswith(f"{op}: momentum must be a real number"), str(info.value)
    assert repr(momentum) in str(info.value)
    if momentum is None:
        with pytest.raises(TypeError):
            getattr(F, op)(_x(), torch.zeros(C), torch.ones(C), momentum=None)


@pytest.mark.parametrize("call", [
    lambda m, rm, rv: m.batch_norm(_x(), rm, rv, training=True),
    lambda m, rm, rv: m.batch_norm(_x(), rm, rv, training=False),
    lambda m, rm, rv: m.instance_norm(_x(), rm, rv),
    lambda m, rm, rv: m.instance_norm(_x(), rm, rv, use_input_stats=False),
], ids=["batch_norm-training", "batch_norm-eval", "instance_norm", "instance_norm-running"])  # fmt: skip
@pytest.mark.parametrize("given", ["running_mean", "running_var"])
def test_running_statistics_both_or_neither(call, given):
    """As torch: running_mean and running_var together or not at all (normkit took one alone)."""
    rm, rv = (torch.zeros(C), None) if given == "running_mean" else (None, torch.ones(C))
    if Version(torch.__version__).release >= (2, 11):  # torch 2.7.1 took one alone in training
        with pytest.raises((ValueError, RuntimeError)):
            call(F, rm, rv)
    with pytest.raises(normkit.InvalidArgument) as info:
        call(normkit, rm, rv)
    _check(info, f"{given} is given", "None", "both running_mean and running_var, or neither")


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_complex_rms_weight_refused(op):
    """Deliberate: torch casts a complex weight to the input's dtype with a warning (the imaginary
    part dropped); integer and bool weights are accepted as torch does (test_torch_parity)."""
    w = torch.ones(5, dtype=torch.complex64)
    with pytest.raises(normkit.InvalidDtype) as info:
        normkit.rms_norm(_x(), (5,), w) if op == "rms_norm" else normkit.add_rms_norm(_x(), None, 5, w)
    _check(info, op, "weight", "complex64", "float32", "integer or bool")


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_complex_input_with_dtype_refused(op):
    """Deliberate: torch casts a complex input to ``dtype`` with a warning, dropping its imaginary
    part; integer and bool inputs are cast (test_torch_parity)."""
    with pytest.raises(normkit.InvalidDtype) as info:
        getattr(normkit, op)(_x(dtype=torch.complex64), -1, dtype=torch.float32)
    _check(info, "input", "complex64", "dtype=torch.float32", "real")


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_dtype_in_the_stacklevel_slot(op):
    """torch's third positional argument is _stacklevel, which ignores a dtype put there (the result
    stays in the input's dtype); normkit's was dtype. Deliberate: normkit refuses a dtype there
    rather than ignore it, naming the keyword to use."""
    x = torch.randn(3, 4)
    assert getattr(F, op)(x, -1, torch.float64).dtype == torch.float32  # torch ignores it
    with pytest.raises(TypeError) as info:
        getattr(normkit, op)(x, -1, torch.float64)
    _check_words = ["_stacklevel", "torch.float64", "dtype=torch.float64"]
    for word in _check_words:
        assert word in str(info.value), str(info.value)
    assert getattr(normkit, op)(x, -1, _stacklevel=4, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("x_shape,r_shape", [((4, 6, 5), (6, 4)), ((4, 6, 5), (2, 6, 5)), ((6, 5), (4, 6, 5)),
                                             ((5,), (6, 5))], ids=str)  # fmt: skip
def test_residual_that_does_not_broadcast_to_x(op, x_shape, r_shape):
    """A residual whose shape broadcasts to x's is accepted (test_torch_parity); one that does not,
    or that x would broadcast to (torch's dropout(x) + residual would take the larger shape), is
    refused: normkit's y and h have x's shape."""
    with pytest.raises(normkit.InvalidArgument) as info:
        getattr(normkit, op)(torch.randn(x_shape), torch.randn(r_shape), 5)
    _check(info, f"{op}: residual", str(list(r_shape)), str(list(x_shape)), "broadcasts to it")


@pytest.mark.parametrize("shape", [(8.0,), (True,), ("8",), torch.tensor([8]), 8.0], ids=repr)
def test_normalized_shape_of_wrong_type(shape):
    """As torch: TypeError (numpy ints and 0-dim integer tensors inside a sequence are accepted)."""
    with pytest.raises(TypeError) as info:
        normkit.layer_norm(torch.randn(3, 8), shape)
    assert "normalized_shape" in str(info.value)
    with pytest.raises(TypeError):
        F.layer_norm(torch.randn(3, 8), shape)


def test_npu_vector_core_query_failure_is_an_error_on_an_npu(monkeypatch):
    """On an NPU a failed vector-core query raises, naming the fix, instead of guessing a grid;
    NORMKIT_NPU_VECTOR_CORES overrides; elsewhere (the NPU kernels on the GPU) the fallback stays."""
    import triton

    from normkit.backends.npu import config

    class Broken:
        def get_device_properties(self, index):
            raise KeyError("num_vectorcore")

    class Driver:
        utils = Broken()

    monkeypatch.setattr(type(triton.runtime.driver), "active", property(lambda self: Driver()))
    monkeypatch.delenv("NORMKIT_NPU_VECTOR_CORES", raising=False)
    with pytest.raises(RuntimeError, match=r"npu:3 .*NORMKIT_NPU_VECTOR_CORES"):
        config._query_vector_cores("npu", 3)
    assert config._query_vector_cores("cuda", 0) == config.FALLBACK_VECTOR_CORES
    monkeypatch.setenv("NORMKIT_NPU_VECTOR_CORES", "48")
    assert config._query_vector_cores("npu", 3) == 48
