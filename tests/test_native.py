"""The CUDA backend's native host path (backends/cuda/native.py, native.cpp).

On CPU (CI): the extension builds, and its autograd node's mechanics hold with programs that launch
nothing (inputs that are absent, the saved tensors, the Python backward with create_graph or an
unrecorded variant, gradients viewed to the inputs' shapes). On a GPU (``-m cuda``): repeated calls
of every op with a native path are recorded on their second call and replayed from C++ after, with
the Python launcher patched to fail; values and gradients against fp64 torch on every call.
"""

import os

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import plans

native = pytest.importorskip("normkit.backends.cuda.native")


@pytest.fixture(scope="module")
def lib():
    if os.environ.get("NORMKIT_NATIVE") == "0":
        pytest.skip("the native host path is turned off (NORMKIT_NATIVE=0)")
    found = native.module(build=True)
    assert found is not None, native.why()  # CI and the GPU machine have a C++ compiler and ninja
    return found


class Slow:
    """A stand-in Python backward: records its calls, gives 3 dy for x and ones for the weight."""

    def __init__(self):
        self.calls = []

    def __call__(self, grads, saved):
        self.calls.append((grads, saved, torch.is_grad_enabled()))
        return [3 * grads[0], None, torch.ones(grads[0].shape[-1]), None]


def _forward_program(lib, M, N):
    # inputs x, r, w, b; allocations y (M, N), mean, rstd (M,): outputs (y, None, mean, rstd)
    allocs = [(4, [M, N], torch.float32, True), (5, [M], torch.float32, False), (6, [M], torch.float32, True)]
    return lib.program(4, 7, allocs, [], [4, -1, 5, 6])


def test_program_allocates_its_outputs(lib):
    x, w = torch.randn(3, 8), torch.randn(8)
    y, h, mean, rstd = _forward_program(lib, 3, 8)([x, None, w, None])
    assert h is None and y.shape == (3, 8) and mean.shape == rstd.shape == (3,)
    assert torch.equal(y, torch.zeros(3, 8)) and torch.equal(rstd, torch.zeros(3))  # the zeroed ones


def test_node_runs_the_python_backward_until_a_program_is_set(lib):
    x = torch.randn(2, 4, 8, requires_grad=True)  # three dims: the (M, N) gradient is viewed back
    w = torch.randn(8, requires_grad=True)
    slow = Slow()
    spec = lib.spec(_forward_program(lib, 8, 8), [0], [0, 2, -3, -4], [torch.float32, torch.float32], slow)
    (y,) = lib.apply(spec, [x, None, w, None])
    assert y.requires_grad and y.shape == (8, 8)
    dy = torch.randn(8, 8)
    y.backward(dy)
    (grads, saved, grad_mode), = slow.calls
    assert torch.equal(grads[0], dy) and saved[0] is not None and torch.equal(saved[0], x.detach())
    assert torch.equal(saved[1], w.detach()) and not grad_mode
    assert torch.equal(x.grad, (3 * dy).view(2, 4, 8)) and torch.equal(w.grad, torch.ones(8))
    # a backward program: its outputs (zeroed dx and dweight) are the gradients from now on
    allocs = [(6, [8, 8], torch.float32, True), (7, [8], torch.float32, True)]
    back = lib.program(6, 8, allocs, [], [6, -1, 7, -1])
    spec.set_backward(0, back)
    x.grad = w.grad = None
    (y,) = lib.apply(spec, [x, None, w, None])
    y.backward(dy)
    assert len(slow.calls) == 1
    assert torch.equal(x.grad, torch.zeros(2, 4, 8)) and torch.equal(w.grad, torch.zeros(8))
    # create_graph: the Python backward again, under grad mode
    (y,) = lib.apply(spec, [x, None, w, None])
    torch.autograd.grad(y, [x, w], dy, create_graph=True)
    assert len(slow.calls) == 2 and slow.calls[-1][2]


def test_node_gives_no_gradient_to_an_absent_input(lib):
    x = torch.randn(4, 8, requires_grad=True)
    spec = lib.spec(_forward_program(lib, 4, 8), [0], [0, 2, -3, -4], [torch.float32, torch.float32], Slow())
    (y,) = lib.apply(spec, [x, None, None, None])  # no weight: Slow's ones are dropped
    (dx,) = torch.autograd.grad(y, [x], torch.ones(4, 8))
    assert torch.equal(dx, torch.full((4, 8), 3.0))


def test_node_takes_five_inputs_and_gives_the_fifth_no_gradient(lib):
    # BatchNorm's node: x, weight, bias, running_mean, running_var (the last two: no gradient)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    rm, rv = torch.randn(8), torch.rand(8)
    allocs = [(5, [4, 8], torch.float32, True), (6, [8], torch.float32, False), (7, [8], torch.float32, True)]
    forward = lib.program(5, 8, allocs, [], [5, 6, 7])
    calls = []

    def slow(grads, saved):
        calls.append(saved)
        return [2 * grads[0], torch.ones(8), None, None, None]

    spec = lib.spec(forward, [0], [0, 1, -2, -3], [torch.float32], slow)
    (y,) = lib.apply(spec, [x, w, None, rm, rv])
    dx, dw = torch.autograd.grad(y, [x, w], torch.full((4, 8), 3.0))
    assert torch.equal(dx, torch.full((4, 8), 6.0)) and torch.equal(dw, torch.ones(8))
    (saved,) = calls
    assert torch.equal(saved[0], x.detach()) and torch.equal(saved[1], w.detach()) and saved[3].shape == (8,)
    with pytest.raises(RuntimeError, match="at most 5 inputs"):
        lib.apply(spec, [x, w, None, rm, rv, None])


def test_node_refuses_a_backward_of_the_wrong_arity(lib):
    x = torch.randn(4, 8, requires_grad=True)
    spec = lib.spec(_forward_program(lib, 4, 8), [0], [0, 2, -3, -4], [torch.float32, torch.float32],
                    lambda grads, saved: [grads[0]])  # fmt: skip
    (y,) = lib.apply(spec, [x, None, None, None])
    with pytest.raises(RuntimeError, match="gave 1 gradients for 4 inputs"):
        y.backward(torch.ones(4, 8))


def test_program_refuses_a_kernel_parameter_list_it_cannot_check(lib):
    if torch.cuda.is_available():
        pytest.skip("no CUfunction to give on a GPU machine either; the GPU tests check real kernels")
    with pytest.raises(RuntimeError):  # a launch of a null CUfunction is refused before anything runs
        lib.program(1, 1, [], [(0, [1, 1, 1], 32, 0, [(1, 5, 0, 0.0)])], [])


# --- on a GPU -------------------------------------------------------------------------------------

CASES = [  # (op, M, N)
    ("layer_norm", 16, 4096), ("rms_norm", 16, 4096), ("add_layer_norm", 16, 4096),
    ("add_rms_norm", 16, 4096), ("softmax", 16, 4096), ("log_softmax", 16, 4096), ("layer_norm", 64, 1000),
    ("rms_norm", 4, 65536), ("add_layer_norm", 4, 65536), ("group_norm", 8, 4096),
]  # fmt: skip


def _torch(op, x, r, w, b):
    """fp64 torch of the call -> (y, h or None)."""
    x, r, w, b = (None if t is None else t.double() for t in (x, r, w, b))
    N = x.shape[-1]
    if op.startswith("add_"):
        h = x + r
        norm = F.layer_norm(h, (N,), w, b, 1e-5) if op == "add_layer_norm" else F.rms_norm(h, (N,), w, 1e-5)
        return norm, h
    if op == "layer_norm":
        return F.layer_norm(x, (N,), w, b, 1e-5), None
    if op == "rms_norm":
        return F.rms_norm(x, (N,), w, 1e-5), None
    if op == "group_norm":
        return F.group_norm(x, 4, w, b, 1e-5), None
    return (F.softmax if op == "softmax" else F.log_softmax)(x, -1), None


def _normkit(op, x, r, w, b):
    N = x.shape[-1]
    if op == "add_layer_norm":
        return normkit.add_layer_norm(x, r, (N,), w, b, 1e-5, prenorm=True)
    if op == "add_rms_norm":
        return normkit.add_rms_norm(x, r, (N,), w, 1e-5, prenorm=True)
    if op == "layer_norm":
        return normkit.layer_norm(x, (N,), w, b, 1e-5), None
    if op == "rms_norm":
        return normkit.rms_norm(x, (N,), w, 1e-5), None
    if op == "group_norm":
        return normkit.group_norm(x, 4, w, b, 1e-5), None
    return (normkit.softmax if op == "softmax" else normkit.log_softmax)(x, -1), None


def _inputs(op, M, N, dtype, grad):
    shape = (M, 4, N // 4) if op == "group_norm" else (M, N)
    channels = 4 if op == "group_norm" else N
    x = torch.randn(shape, device="cuda:0", dtype=dtype).requires_grad_(grad)
    r = torch.randn_like(x).requires_grad_(grad) if op.startswith("add_") else None
    w = None if "softmax" in op else torch.randn(channels, device="cuda:0", dtype=dtype).requires_grad_(grad)
    biased = op in ("layer_norm", "add_layer_norm", "group_norm")
    b = torch.randn_like(w).requires_grad_(grad) if biased else None
    return x, r, w, b


def _close(got, want, dtype, what):
    tol = {torch.bfloat16: 2e-2, torch.float32: 2e-5}[dtype]
    scale = want.abs().max().item() + 1
    err = (got.double() - want).abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


@pytest.fixture
def gpu(lib, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    monkeypatch.setattr(native.launch, "RECORD", None)
    plans._PLANS.clear()
    yield
    plans._PLANS.clear()


def _served_natively(monkeypatch):
    """From here on a launch through Python fails the test."""

    def fail(*args, **kwargs):
        raise AssertionError("a launch went through Python")

    monkeypatch.setattr(native.launch, "_run", fail)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op,M,N", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_training_calls_replay_from_cpp(gpu, monkeypatch, op, M, N, dtype):
    # calls 0-2: the forward and the backward without h's gradient run in Python, recorded on the
    # third (the first two compile and bind the kernels); 3-5: the add-norms' backward with h's
    # gradient, which the C++ node hands to the Python backward until that records it (5); from 6 on
    # everything runs from C++, both variants
    for call in range(8):
        if call == 6:
            state = next(p for k, p in plans._PLANS.items() if k[0] == op).native
            assert state.spec is not None, f"the forward was not recorded: {state.refused}"
            _served_natively(monkeypatch)
        x, r, w, b = _inputs(op, M, N, dtype, grad=True)
        y, h = _normkit(op, x, r, w, b)
        want_y, want_h = _torch(op, x, r, w, b)
        _close(y, want_y, dtype, f"call {call} y")
        if h is not None:
            _close(h, want_h, dtype, f"call {call} h")
        dy = torch.randn_like(y)
        dh = torch.randn_like(h) if h is not None and 3 <= call <= 6 else None
        outs = [y] + ([h] if dh is not None else [])
        grads_in = [dy] + ([dh] if dh is not None else [])
        tensors = [t for t in (x, r, w, b) if t is not None]
        got = torch.autograd.grad(outs, tensors, grads_in)
        xd = [t.detach().double().requires_grad_() for t in tensors]
        it = iter(xd)
        args = [None if t is None else next(it) for t in (x, r, w, b)]
        wy, wh = _torch(op, *args)
        want_outs = [wy] + ([wh] if dh is not None else [])
        want = torch.autograd.grad(want_outs, xd, [g.double() for g in grads_in])
        for name, g, e in zip("xrwb", got, want):
            _close(g, e, dtype, f"call {call} d{name}")


@pytest.mark.cuda
@pytest.mark.parametrize("op,M,N", CASES[:6], ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES[:6]])
def test_inference_calls_replay_from_cpp(gpu, monkeypatch, op, M, N):
    with torch.no_grad():
        for call in range(4):
            if call == 3:  # recorded on the third (the first two bind the kernel)
                (plan,) = plans._PLANS.values()
                assert plan.program is not None, plan.refused
                _served_natively(monkeypatch)
            x, r, w, b = _inputs(op, M, N, torch.bfloat16, grad=False)
            y, h = _normkit(op, x, r, w, b)
            want_y, want_h = _torch(op, x, r, w, b)
            _close(y, want_y, torch.bfloat16, f"call {call} y")
            if h is not None:
                _close(h, want_h, torch.bfloat16, f"call {call} h")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_native_checks_raise_with_their_figures(lib, device):
    # every failed check of native.cpp raises RuntimeError with its numbers, in a GPU process too (a
    # TORCH_CHECK of several message parts crashed the process on the H100 machine's torch 2.11)
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    x = torch.randn(4, 8, device=device, requires_grad=True)
    program = _forward_program(lib, 4, 8)
    with pytest.raises(RuntimeError, match="program of 4 inputs given 1"):
        program([x])
    with pytest.raises(RuntimeError, match="returned output 4 of 4"):
        lib.spec(program, [4], [0], [torch.float32], Slow())
    with pytest.raises(RuntimeError, match="saved tensor 4 of 4 inputs and 4 outputs"):
        lib.spec(program, [0], [4], [torch.float32], Slow())
    dtypes = [torch.float32, torch.float32]
    spec = lib.spec(program, [0], [0, 2, -3, -4], dtypes, lambda grads, saved: [grads[0]])
    with pytest.raises(RuntimeError, match="of 4 inputs for 2 gradients and 4 saved tensors"):
        spec.set_backward(0, program)
    with pytest.raises(RuntimeError, match="at most 5 inputs"):
        lib.apply(spec, [x, None, None, None, None, None])
    (y,) = lib.apply(spec, [x, None, None, None])
    with pytest.raises(RuntimeError, match="gave 1 gradients for 4 inputs"):
        y.backward(torch.ones_like(y))


# --- the door: softmax / log_softmax served by one C++ call (native.cpp's door) --------------------


def test_door_serves_nothing_it_has_not_been_given(lib):
    lib.door_setup(native.launch.triton.knobs.runtime, native.launch)
    x = torch.randn(3, 8)
    for args in ((x, -1, 0), (x, 1, 1), (x, 0, 0), (3, -1, 0), (x, None, 0), (x, True, 0), (x, -1, 2**70),
                 (x, 2**70, 0), (x.t(), -1, 0), (torch.nn.Parameter(x), -1, 0), (x, -1)):  # fmt: skip
        assert lib.door(*args) is None, args
    w = torch.randn(8)
    norms = [(2, x, (8,), w, w, 1e-5), (3, x, 8, w, None, None), (2, x, (8,), w, w), (4, x, 8, w, w, 1e-5),
             (2, x, [8], w, w, 1e-5), (2, x, torch.Size([8]), None, None, 1e-5)]  # fmt: skip
    for args in norms:
        assert lib.door(*args) is None, args
    program = lib.program(1, 2, [(1, [3, 8], torch.float32, False)], [], [1])
    for args in ((x, -1, 0), (2, x, (8,), w, w, 1e-5), (x, -1)):  # CPU tensors, a wrong arity
        with pytest.raises(RuntimeError, match="arguments the door does not serve"):
            lib.door_put(program, *args)
    assert lib.door_size() == 0


def test_clearing_the_plan_cache_empties_the_door(monkeypatch):
    cleared = []
    monkeypatch.setattr(plans, "DOOR_CLEAR", lambda: cleared.append(True))
    plans._PLANS.clear()
    assert cleared == [True]


class _Hook:
    """A Triton launch hook (a profiler's stand-in) that counts the launches it sees."""

    calls = True

    def __init__(self):
        self.seen = 0

    def __call__(self, *args, **kwargs):
        self.seen += 1


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_calls_are_served_through_the_door(gpu, lib, monkeypatch, op):
    from normkit import dispatch, distributed

    fn, oracle = getattr(normkit, op), getattr(F, op)

    def check(x, y, what, grad):
        xd = x.detach().double().requires_grad_(grad)
        want = oracle(xd, -1)
        _close(y, want.detach(), x.dtype, f"{what} y")
        if grad:  # the gradient through the node the door made
            dy = torch.randn_like(y)
            (dx,) = torch.autograd.grad(y, [x], dy)
            (want_dx,) = torch.autograd.grad(want, [xd], dy.double())
            _close(dx, want_dx, x.dtype, f"{what} dx")

    def fresh(grad, shape=(64, 4096), dtype=torch.bfloat16):
        return torch.randn(shape, device="cuda:0", dtype=dtype).requires_grad_(grad)

    # inference first, then training of the same signature: each its own entry (the key holds
    # whether a gradient is wanted)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for call in range(3):  # recorded on the third
                x = fresh(grad)
                check(x, fn(x, -1), f"grad {grad} call {call}", grad)
            assert plans.DOOR is not None and lib.door_size() == 1 + grad
            with pytest.raises(RuntimeError, match="a Program of 4 inputs for a call of 1 inputs"):
                lib.door_put(_forward_program(lib, 64, 4096), fresh(False), -1, 0)  # (a norm's program)
            with monkeypatch.context() as m:  # from here on the Python path fails the test
                m.setattr(distributed, "_softmax", lambda *a: pytest.fail("the call left the door"))
                for call in range(3, 5):
                    x = fresh(grad)
                    check(x, fn(x, x.dim() - 1 if call == 4 else -1), f"grad {grad} call {call}", grad)
    # calls the door has no entry for take the Python path, with its results: another dtype or
    # shape, a transposed (non-contiguous) input, another dim, an input 16-byte misaligned
    buffer = torch.randn(64 * 4096 + 1, device="cuda:0", dtype=torch.bfloat16)
    others = [("fp32", fresh(False, dtype=torch.float32), -1), ("shape", fresh(False, (8, 4096)), -1),
              ("transposed", fresh(False).t(), -1), ("dim 0", fresh(False), 0),
              ("misaligned", buffer[1:].view(64, 4096), -1)]  # fmt: skip
    for what, x, dim in others:
        for call in range(4):
            with torch.no_grad():
                y = fn(x, dim)
            _close(y, oracle(x.double(), dim), x.dtype, f"{what} call {call}")
    # a launch hook (a profiler) sees every launch: the door steps aside while one is set
    x = fresh(False)
    hook = _Hook()
    monkeypatch.setattr(native.launch.triton.knobs.runtime, "launch_enter_hook", hook)
    assert lib.door(x, -1, native.DOOR_OPS[op]) is None
    with torch.no_grad():
        _close(fn(x, -1), oracle(x.double(), -1), x.dtype, "with a hook")
    assert hook.seen >= 1
    monkeypatch.setattr(native.launch.triton.knobs.runtime, "launch_enter_hook", None)
    # under an override the door is not asked (its entries were made without one)
    asked = []
    door = plans.DOOR
    monkeypatch.setattr(plans, "DOOR", lambda *a: asked.append(a) or door(*a))
    with dispatch.use_backend("cuda", "normkit.backends.npu"), torch.no_grad():
        x = fresh(False)
        _close(fn(x, -1), oracle(x.double(), -1), x.dtype, "under an override")
    assert not asked
    plans._PLANS.clear()
    assert lib.door_size() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_calls_are_served_through_the_door(gpu, lib, monkeypatch, op):
    from normkit import functional

    N = 4096
    ln = op == "layer_norm"

    def call(x, w, b, shape=(N,), eps=1e-5):
        if ln:
            return normkit.layer_norm(x, shape, w, b, eps)
        return normkit.rms_norm(x, shape, w, None if eps == 1e-5 else eps)  # eps None: finfo's, as torch

    def oracle(x, w, b, eps=1e-5):
        args = [t if t is None else t.double() for t in (x, w, b)]
        if ln:
            return F.layer_norm(args[0], (N,), args[1], args[2], eps)
        return F.rms_norm(args[0], (N,), args[1], torch.finfo(x.dtype).eps if eps == 1e-5 else eps)

    def fresh(grad, affine=True):
        x = torch.randn(4, 16, N, device="cuda:0", dtype=torch.bfloat16).requires_grad_(grad)
        w = torch.nn.Parameter(torch.randn(N, device="cuda:0", dtype=torch.bfloat16)) if affine else None
        b = torch.randn(N, device="cuda:0", dtype=torch.bfloat16) if affine and ln else None
        b = b if b is None else b.requires_grad_(grad)
        if w is not None:
            w.requires_grad_(grad)
        return x, w, b

    def check(x, w, b, y, what, grad):
        _close(y, oracle(x, w, b), x.dtype, f"{what} y")
        if grad:
            dy = torch.randn_like(y)
            tensors = [t for t in (x, w, b) if t is not None]
            got = torch.autograd.grad(y, tensors, dy)
            xd = [t.detach().double().requires_grad_() for t in tensors]
            want = torch.autograd.grad(oracle(*xd, *(None,) * (3 - len(xd))), xd, dy.double())
            for g, e, name in zip(got, want, "xwb"):
                _close(g, e, x.dtype, f"{what} d{name}")

    for grad in (False, True):  # (inference, then training: entries of their own)
        with torch.set_grad_enabled(grad):
            for call_no in range(3):
                x, w, b = fresh(grad)
                check(x, w, b, call(x, w, b), f"grad {grad} call {call_no}", grad)
            assert lib.door_size() == 1 + grad
            with monkeypatch.context() as m:  # from here on the Python path fails the test
                m.setattr(functional, op, lambda *a: pytest.fail("the call left the door"))
                for call_no, shape in ((3, (N,)), (4, N), (5, torch.Size([N])), (6, [N])):
                    x, w, b = fresh(grad)
                    check(x, w, b, call(x, w, b, shape), f"grad {grad} call {call_no} shape {shape!r}", grad)
    # what the door has no entry for takes the Python path, with its results
    for what, affine, eps in (("another eps", True, 1e-3), ("no weight", False, 1e-5)):
        for call_no in range(4):
            x, w, b = fresh(False, affine)
            with torch.no_grad():
                y = call(x, w, b, eps=eps)
            _close(y, oracle(x, w, b, eps), x.dtype, f"{what} call {call_no}")
    plans._PLANS.clear()
    assert lib.door_size() == 0


def _batch_norm_call(x, rm, rv, w, b, momentum, fp64_stats):
    """normkit's training BatchNorm and fp64 torch's on the same inputs -> (y, want)."""
    y = normkit.batch_norm(x, rm, rv, w, b, True, momentum, 1e-5)
    want = F.batch_norm(x.double(), *fp64_stats, w.double(), b.double(), True, momentum, 1e-5)
    return y, want


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [True, False], ids=["training", "no-grad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batch_norm_replays_from_cpp_with_its_momentum(gpu, monkeypatch, dtype, grad):
    # split channels (HW = 900, not a multiple of 16: no channels in parts): recorded on the third
    # call; from the sixth on from C++. A call with another momentum (a kernel argument the
    # recording holds) runs the Python path, with its own momentum
    C = 16
    rm = torch.randn(C, device="cuda:0")
    rv = torch.rand(C, device="cuda:0") + 0.5
    stats = [rm.double(), rv.double()]
    for call in range(8):
        if call == 6:
            (plan,) = plans._PLANS.values()
            made = plan.native.spec if grad else plan.program
            assert made is not None, plan.native.refused if grad else plan.refused
            _served_natively(monkeypatch)
        x = torch.randn(8, C, 30, 30, device="cuda:0", dtype=dtype).requires_grad_(grad)
        w, b = (torch.randn(C, device="cuda:0", dtype=dtype).requires_grad_(grad) for _ in range(2))
        with torch.set_grad_enabled(grad):
            y, want = _batch_norm_call(x, rm, rv, w, b, 0.1, stats)
        _close(y, want, dtype, f"call {call} y")
        _close(rm, stats[0], torch.float32, f"call {call} running_mean")
        _close(rv, stats[1], torch.float32, f"call {call} running_var")
        if grad:
            dy = torch.randn_like(y)
            got = torch.autograd.grad(y, [x, w, b], dy)
            xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
            ref = F.batch_norm(xd, stats[0].clone(), stats[1].clone(), wd, bd, True, 0.1, 1e-5)
            for name, g, e in zip("xwb", got, torch.autograd.grad(ref, [xd, wd, bd], dy.double())):
                _close(g, e, dtype, f"call {call} d{name}")
    x = torch.randn(8, C, 30, 30, device="cuda:0", dtype=dtype).requires_grad_(grad)
    with torch.set_grad_enabled(grad), pytest.raises(AssertionError, match="through Python"):
        normkit.batch_norm(x, rm, rv, w, b, True, 0.25, 1e-5)
    monkeypatch.undo()  # the Python launcher back (and the fixture's patch: set it again)
    monkeypatch.setattr(native.launch, "RECORD", None)
    with torch.set_grad_enabled(grad):
        y, want = _batch_norm_call(x, rm, rv, w, b, 0.25, stats)
    _close(y, want, dtype, "momentum 0.25: y")
    _close(rm, stats[0], torch.float32, "momentum 0.25: running_mean")
    _close(rv, stats[1], torch.float32, "momentum 0.25: running_var")


@pytest.mark.cuda
@pytest.mark.parametrize("name,shape", [("LayerNorm", (16, 4096)), ("BatchNorm2d", (8, 16, 30, 30))])
def test_modules_with_parameters_replay_from_cpp(gpu, monkeypatch, name, shape):
    # a module's weight and bias are Parameters (not plain tensors): recorded and replayed all the same
    size = shape[1] if name == "BatchNorm2d" else shape[-1]
    module = getattr(normkit.nn, name)(size, device="cuda:0")
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    reference = getattr(torch.nn, name)(size, device="cuda:0", dtype=torch.float64)
    reference.load_state_dict(module.state_dict())
    for call in range(8):
        if call == 6:
            (plan,) = plans._PLANS.values()
            assert plan.native.spec is not None, plan.native.refused
            _served_natively(monkeypatch)
        x = torch.randn(shape, device="cuda:0", requires_grad=True)
        xd = x.detach().double().requires_grad_()
        y, want = module(x), reference(xd)
        _close(y, want, torch.float32, f"call {call} y")
        dy = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, module.weight, module.bias], dy)
        expect = torch.autograd.grad(want, [xd, reference.weight, reference.bias], dy.double())
        for what, g, e in zip(("dx", "dweight", "dbias"), got, expect):
            _close(g, e, torch.float32, f"call {call} {what}")
    if name == "BatchNorm2d":
        _close(module.running_mean, reference.running_mean, torch.float32, "running_mean")
        _close(module.running_var, reference.running_var, torch.float32, "running_var")


@pytest.mark.cuda
def test_double_backward_through_the_cpp_node(gpu, monkeypatch):
    x0, _, w0, b0 = _inputs("layer_norm", 16, 256, torch.float64, grad=False)
    for _ in range(3):
        x, w, b = (t.detach().clone().requires_grad_() for t in (x0, w0, b0))
        y = normkit.layer_norm(x, (256,), w, b, 1e-5)
        (dx,) = torch.autograd.grad(y.square().sum(), [x], create_graph=True)
        gx, gw = torch.autograd.grad(dx.square().sum(), [x, w])
        xr, wr, br = (t.detach().clone().requires_grad_() for t in (x0, w0, b0))
        yr = F.layer_norm(xr, (256,), wr, br, 1e-5)
        (dxr,) = torch.autograd.grad(yr.square().sum(), [xr], create_graph=True)
        ex, ew = torch.autograd.grad(dxr.square().sum(), [xr, wr])
        torch.testing.assert_close(gx, ex, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(gw, ew, rtol=1e-9, atol=1e-9)
    assert next(iter(plans._PLANS.values())).native.spec is not None


@pytest.mark.cuda
def test_replayed_calls_run_on_the_current_stream_and_device(gpu):
    side = torch.cuda.Stream()
    for call in range(4):
        x, _, w, b = _inputs("layer_norm", 64, 4096, torch.bfloat16, grad=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            y = normkit.layer_norm(x, (4096,), w, b, 1e-5)
            dx, dw = torch.autograd.grad(y, [x, w], torch.ones_like(y))
        side.synchronize()
        _close(y, _torch("layer_norm", x, None, w, b)[0], torch.bfloat16, f"call {call} y")
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):  # plans of cuda:0 tensors called with cuda:1 current
            for call in range(3):
                x, _, w, b = _inputs("layer_norm", 64, 4096, torch.bfloat16, grad=False)
                with torch.no_grad():
                    y = normkit.layer_norm(x, (4096,), w, b, 1e-5)
                want = _torch("layer_norm", x, None, w, b)[0]
                _close(y, want, torch.bfloat16, f"cuda:1 current, call {call}")
