"""The native CPU extension's door (normkit/native_cpu.cpp, ``normkit.cpu.DOOR``): CPU calls checked
in C++ and run by the torch operator normkit.cpu's first route would run.

Each call the door serves gives the Python path's output and gradients bit for bit (the door on,
then off, on the same inputs) and fp64 torch's to the dtype's tolerance; the public functions reach
the door before their Python; every call the door is not to serve (16-bit LayerNorm with gradients,
mixed dtypes, subclasses, bad arguments, an active TorchFunctionMode, an operator error) answers
None, and the Python path serves it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import normkit
from normkit import cpu

SOFTMAX, LOG_SOFTMAX, LAYER_NORM, RMS_NORM, ADD_LAYER_NORM, ADD_RMS_NORM, BATCH_NORM = range(7)
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def door():
    from normkit import native

    found = native.module(build=True, kind="cpu")  # (CI has a C++ compiler)
    if found is None:
        pytest.skip(f"native CPU extension: {native.why('cpu')}")
    return found.door


def _tensors(dtype, grad, seed, shape=(3, 5, 16)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_(grad)
    r = torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).requires_grad_(grad)
    b = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_(grad)
    return x, r, torch.nn.Parameter(w, requires_grad=grad), b


def _cases(dtype, grad):
    """(name, door's arguments, the public call, the fp64 oracle of the same call)."""
    x, r, w, b = _tensors(dtype, grad, 7)
    n = x.shape[-1]
    out = []
    for dim in (-1, 0, 1):
        out.append((f"softmax dim {dim}", (SOFTMAX, x, dim), lambda x=x, d=dim: normkit.softmax(x, d),
                    lambda x=x, d=dim: F.softmax(x, d)))  # fmt: skip
        out.append((f"log_softmax dim {dim}", (LOG_SOFTMAX, x, dim),
                    lambda x=x, d=dim: normkit.log_softmax(x, d), lambda x=x, d=dim: F.log_softmax(x, d)))
    for shape in (n, (n,), [n], torch.Size([5, n])):
        one_dim = isinstance(shape, int) or len(shape) == 1
        for wb in ((w, b), (None, None), (w, None)) if one_dim else ((None, None),):
            for eps in (1e-5, 0.25):
                args = (x, shape, *wb, eps)
                out.append((f"layer_norm {shape} {eps} {wb[0] is None}{wb[1] is None}", (LAYER_NORM, *args),
                            lambda a=args: normkit.layer_norm(*a),
                            lambda a=args: F.layer_norm(a[0], _tup(a[1]), *a[2:])))  # fmt: skip
                args = (x, r, shape, *wb, eps)
                out.append((f"add_layer_norm {shape} {eps}", (ADD_LAYER_NORM, *args),
                            lambda a=args: normkit.add_layer_norm(*a),
                            lambda a=args: F.layer_norm(a[0] + a[1], _tup(a[2]), *a[3:])))  # fmt: skip
    for weight in (w, None):
        for eps in (None, 1e-6, 0.5):
            # eps None: the input dtype's epsilon, as torch documents it (normkit.cpu.rms_norm)
            want_eps = torch.finfo(dtype).eps if eps is None else eps
            args = (x, (n,), weight, eps)
            out.append((f"rms_norm {eps} {weight is None}", (RMS_NORM, *args),
                        lambda a=args: normkit.rms_norm(*a),
                        lambda a=args, e=want_eps: F.rms_norm(*a[:3], e)))
            args = (x, r, (n,), weight, eps)
            out.append((f"add_rms_norm {eps} {weight is None}", (ADD_RMS_NORM, *args),
                        lambda a=args: normkit.add_rms_norm(*a),
                        lambda a=args, e=want_eps: F.rms_norm(a[0] + a[1], *a[2:4], e)))  # fmt: skip
    xb = x.detach().reshape(3, 5, 4, 4).requires_grad_(grad)
    wb_, bb = w.detach()[:5].requires_grad_(grad), b.detach()[:5].requires_grad_(grad)
    for training, stats in ((True, True), (True, False), (False, True)):
        rm = torch.linspace(-1, 1, 5).to(dtype) if stats else None
        rv = torch.linspace(0.5, 2, 5).to(dtype) if stats else None
        args = (xb, rm, rv, wb_, bb, training, 0.25, 1e-5)
        out.append((f"batch_norm training {training} stats {stats}", (BATCH_NORM, *args),
                    lambda a=args: normkit.batch_norm(*a), lambda a=args: F.batch_norm(*a)))  # fmt: skip
    return out


def _tup(shape):
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _leaves(call_args):
    return [t for t in call_args[1:] if isinstance(t, torch.Tensor) and t.requires_grad]


def _run(fn, leaves):
    y = fn()
    grads = torch.autograd.grad(y, leaves, torch.ones_like(y) * 0.5 + y.detach()) if leaves else ()
    return y, grads


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_door_serves_the_python_paths_results(door, monkeypatch, dtype, grad):
    if grad and dtype in (torch.bfloat16, torch.float16):
        cases = [c for c in _cases(dtype, grad) if "layer_norm" not in c[0]]  # (refused: the next test)
    else:
        cases = _cases(dtype, grad)
    for name, args, call, oracle in cases:
        running = [t.clone() for t in args[2:4]] if args[0] == BATCH_NORM and args[2] is not None else None
        leaves = _leaves(args)
        monkeypatch.setattr(cpu, "DOOR", door)
        assert door(*args) is not None, f"{name}: the door refused it"
        if running is not None:  # (that call moved the running statistics: put them back)
            args[2].copy_(running[0]), args[3].copy_(running[1])
        y, grads = _run(call, leaves)
        monkeypatch.setattr(cpu, "DOOR", None)
        if running is not None:
            args[2].copy_(running[0]), args[3].copy_(running[1])
        y_py, grads_py = _run(call, leaves)
        assert y.dtype == y_py.dtype and torch.equal(y, y_py), f"{name}: y differs from the Python path's"
        for i, (a, e) in enumerate(zip(grads, grads_py)):
            assert torch.equal(a, e), f"{name}: gradient {i} differs from the Python path's"
        # and both against fp64 torch on the same rounded values
        ins = {id(t): t.detach().double().requires_grad_(t.requires_grad) for t in args[1:]
               if isinstance(t, torch.Tensor)}  # fmt: skip
        if running is not None:
            ins[id(args[2])], ins[id(args[3])] = running[0].double(), running[1].double()
        up = tuple(ins.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in args[1:])
        fn64 = _replace(oracle, args[1:], up)
        want, want_grads = _run(fn64, [t for t in up if isinstance(t, torch.Tensor) and t.requires_grad])
        scale = want.abs().max().item() + 1
        assert (y.double() - want).abs().max().item() <= TOL[dtype] * scale, f"{name}: y against fp64"
        for i, (a, e) in enumerate(zip(grads, want_grads)):
            tol = TOL[dtype] * 8 if dtype in TOL and dtype != torch.float64 else 1e-10
            err = (a.double() - e).abs().max().item()
            assert err <= tol * (e.abs().max().item() + 1), f"{name}: gradient {i} against fp64 ({err:.3g})"


def _replace(oracle, old, new):
    """``oracle`` (a lambda over default arguments that hold ``old``'s tensors) with ``new``'s."""
    swap = {id(o): n for o, n in zip(old, new) if isinstance(o, torch.Tensor)}
    defaults = oracle.__defaults__

    def fresh(value):
        if isinstance(value, tuple):
            return tuple(swap.get(id(v), v) if isinstance(v, torch.Tensor) else v for v in value)
        return swap.get(id(value), value) if isinstance(value, torch.Tensor) else value

    return lambda: oracle(*[fresh(d) for d in defaults])


class _Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_door_refuses_what_the_python_path_is_to_serve(door, monkeypatch):
    x, r, w, b = _tensors(torch.float32, False, 3)
    xh, rh, wh, bh = _tensors(torch.bfloat16, True, 3)
    x2 = torch.randn(4, 16)
    n = 16
    sub = torch.nn.Parameter(x2)
    refused = {
        "no op": (), "op only": (LAYER_NORM,), "op out of range": (9, x2, -1), "op a bool": (True, x2, -1),
        "op huge": (2**70, x2, -1), "an int input": (SOFTMAX, torch.arange(8), -1),
        "a Parameter input": (SOFTMAX, sub, -1), "a list input": (SOFTMAX, [1.0], -1),
        "dim None": (SOFTMAX, x2, None), "dim a bool": (SOFTMAX, x2, True), "dim huge": (SOFTMAX, x2, 2**70),
        "dim out of range (the operator's error)": (SOFTMAX, x2, 2), "softmax arity": (SOFTMAX, x2, -1, None),
        "eps an int": (LAYER_NORM, x2, n, None, None, 0),
        "eps negative": (LAYER_NORM, x2, n, None, None, -1e-5),
        "eps inf": (LAYER_NORM, x2, n, None, None, float("inf")),
        "eps nan": (LAYER_NORM, x2, n, None, None, float("nan")),
        "eps a tensor": (LAYER_NORM, x2, n, None, None, torch.tensor(1e-5)),
        "eps None (layer_norm)": (LAYER_NORM, x2, n, None, None, None),
        "shape of floats": (LAYER_NORM, x2, (16.0,), None, None, 1e-5),
        "shape a tensor": (LAYER_NORM, x2, torch.tensor([16]), None, None, 1e-5),
        "shape mismatch (the operator's error)": (LAYER_NORM, x2, (8,), None, None, 1e-5),
        "weight a list": (LAYER_NORM, x2, n, [1.0] * 16, None, 1e-5),
        "empty input": (LAYER_NORM, torch.empty(0, 16), n, None, None, 1e-5),
        "16-bit layer_norm with gradients": (LAYER_NORM, xh, n, wh, bh, 1e-5),
        "16-bit layer_norm, a weight with gradients": (LAYER_NORM, xh.detach(), n, wh, None, 1e-5),
        "16-bit add_layer_norm with gradients": (ADD_LAYER_NORM, xh.detach(), rh, n, None, None, 1e-5),
        "rms_norm, an fp32 weight for bf16": (RMS_NORM, xh.detach(), (n,), w, None),
        "rms_norm eps nan": (RMS_NORM, x, (n,), w, float("nan")),
        "add_rms_norm, residual of another dtype": (ADD_RMS_NORM, x, rh.detach(), (n,), w, None),
        "add_rms_norm, residual of another shape": (ADD_RMS_NORM, x, r[:1], (n,), w, None),
        "add_rms_norm, residual broadcast": (ADD_RMS_NORM, x, r[0, 0], (n,), w, None),
        "add_layer_norm arity": (ADD_LAYER_NORM, x, r, (n,), w, None),
        "batch_norm training, one value a channel": (BATCH_NORM, torch.randn(1, 5, 1), None, None, None, None,
                                                     True, 0.1, 1e-5),
        "batch_norm eval without statistics": (BATCH_NORM, torch.randn(4, 5), None, None, None, None, False,
                                               0.1, 1e-5),
        "batch_norm, training an int": (BATCH_NORM, torch.randn(4, 5), None, None, None, None, 1, 0.1, 1e-5),
        "batch_norm, momentum None": (BATCH_NORM, torch.randn(4, 5), None, None, None, None, True, None,
                                      1e-5),
        "batch_norm eps 0": (BATCH_NORM, torch.randn(4, 5), None, None, None, None, True, 0.1, 0.0),
        "batch_norm, fp32 statistics for bf16": (BATCH_NORM, torch.randn(4, 5).bfloat16(), torch.zeros(5),
                                                 torch.ones(5), None, None, False, 0.1, 1e-5),
        "batch_norm, one statistic": (BATCH_NORM, torch.randn(4, 5), torch.zeros(5), None, None, None, True,
                                      0.1, 1e-5),
        "batch_norm 1-d": (BATCH_NORM, torch.randn(5), None, None, None, None, True, 0.1, 1e-5),
    }  # fmt: skip
    for name, args in refused.items():
        assert door(*args) is None, name
    monkeypatch.setattr(cpu, "DOOR", door)
    with _Seen() as mode:  # a TorchFunctionMode sees torch's ops: the door steps aside
        assert door(SOFTMAX, x2, -1) is None and door(LAYER_NORM, x2, n, None, None, 1e-5) is None
        y = normkit.layer_norm(x2, (n,))
    assert "layer_norm" in mode.seen, mode.seen
    torch.testing.assert_close(y, F.layer_norm(x2, (n,)))


def test_public_functions_reach_the_door_first(door, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the call left the door")

    x, r, w, b = _tensors(torch.float32, True, 11)
    xb, rm, rv = x.detach().reshape(3, 5, 4, 4).requires_grad_(), torch.zeros(5), torch.ones(5)
    calls = [lambda: normkit.softmax(x, -1), lambda: normkit.log_softmax(x, 1),
             lambda: normkit.layer_norm(x, (16,), w, b), lambda: normkit.rms_norm(x, 16, w),
             lambda: normkit.add_layer_norm(x, r, (16,), w, b), lambda: normkit.add_rms_norm(x, r, (16,), w),
             lambda: normkit.batch_norm(xb, rm, rv, None, None, True)]  # fmt: skip
    for name in ("layer_norm", "rms_norm", "batch_norm"):
        monkeypatch.setattr(torch, name, fail)
    for name in ("softmax", "log_softmax"):
        monkeypatch.setattr(torch.Tensor, name, fail)
    monkeypatch.setattr(cpu, "serves", fail)
    monkeypatch.setattr(cpu, "DOOR", None)
    for call in calls:  # without the door, the Python path runs (and fails here)
        with pytest.raises(AssertionError, match="left the door"):
            call()
    monkeypatch.setattr(cpu, "DOOR", door)
    for call in calls:
        call().sum().backward()
    assert x.grad is not None and w.grad is not None and r.grad is not None


def test_the_door_is_looked_up_on_the_first_call(monkeypatch):
    from normkit import native

    monkeypatch.setattr(cpu, "DOOR", cpu._arm_door)
    monkeypatch.setattr(cpu, "_NATIVE_OPS", {})
    found = native.module(kind="cpu")
    x = torch.randn(2, 8)
    torch.testing.assert_close(normkit.softmax(x, -1), torch.softmax(x, -1))
    assert cpu.DOOR is (None if found is None else found.door)
