"""normkit.nn modules vs their torch.nn twins: state_dict both ways, repr, outputs, gradients, running
statistics over training and eval steps; LayerNorm / RMSNorm / add-norm modules on every executor."""

import inspect
import math
import re

import pytest
import torch
from conftest import executor_params

import normkit
import normkit.nn as nkn
from normkit.testing import assert_close, dropout_keep_mask

# id -> (normkit class, args, kwargs, input shape)
CASES = {
    "LayerNorm": (nkn.LayerNorm, (8,), {}, (4, 3, 8)),
    "LayerNorm-2d-no-bias": (nkn.LayerNorm, ((3, 8),), dict(bias=False, eps=1e-6), (4, 3, 8)),
    "LayerNorm-no-affine": (nkn.LayerNorm, (8,), dict(elementwise_affine=False), (5, 8)),
    "RMSNorm": (nkn.RMSNorm, (8,), {}, (4, 3, 8)),
    "RMSNorm-2d-eps": (nkn.RMSNorm, ((3, 8),), dict(eps=1e-6), (4, 3, 8)),
    "RMSNorm-no-affine": (nkn.RMSNorm, (8,), dict(elementwise_affine=False), (5, 8)),
    "GroupNorm": (nkn.GroupNorm, (2, 6), {}, (3, 6, 5)),
    "GroupNorm-no-affine": (nkn.GroupNorm, (3, 6), dict(affine=False), (3, 6, 2, 2)),
    "InstanceNorm1d": (nkn.InstanceNorm1d, (4,), {}, (2, 4, 7)),
    "InstanceNorm1d-no-batch": (nkn.InstanceNorm1d, (4,), dict(affine=True), (4, 7)),
    "InstanceNorm2d-tracked": (nkn.InstanceNorm2d, (4,), dict(affine=True, track_running_stats=True),
                               (2, 4, 3, 5)),  # fmt: skip
    "InstanceNorm3d-momentum-none": (nkn.InstanceNorm3d, (3,), dict(momentum=None, track_running_stats=True),
                                     (2, 3, 2, 3, 2)),  # fmt: skip
    "BatchNorm1d-2d-input": (nkn.BatchNorm1d, (4,), {}, (8, 4)),
    "BatchNorm1d": (nkn.BatchNorm1d, (4,), dict(momentum=0.3), (8, 4, 5)),
    "BatchNorm2d-cumulative": (nkn.BatchNorm2d, (4,), dict(momentum=None), (3, 4, 5, 2)),
    "BatchNorm2d-untracked": (nkn.BatchNorm2d, (4,), dict(track_running_stats=False, affine=False),
                              (3, 4, 5, 2)),  # fmt: skip
    "BatchNorm3d-no-bias": (nkn.BatchNorm3d, (3,), dict(bias=False), (2, 3, 2, 3, 2)),
    "Softmax": (nkn.Softmax, (), dict(dim=1), (3, 5, 4)),
    "LogSoftmax": (nkn.LogSoftmax, (), dict(dim=-1), (3, 5, 4)),
}


def _randomize(module, g):
    """Non-trivial parameters and running statistics (never the constructor's ones and zeros)."""
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.is_floating_point():
                r = torch.rand(t.shape, generator=g, dtype=t.dtype)
                t.copy_(r + 0.5 if name.endswith(("weight", "running_var")) else r - 0.5)
            elif t.numel():  # num_batches_tracked
                t.fill_(3)


def _pair(case, dtype=torch.float32, device="cpu"):
    """(normkit module, torch twin): the twin randomized, the normkit one loaded from its state_dict."""
    cls, args, kwargs, _ = CASES[case]
    twin = cls.__bases__[0]
    assert twin.__module__.startswith("torch.nn."), twin
    if "bias" in kwargs and "bias" not in inspect.signature(twin.__init__).parameters:
        pytest.skip(f"torch {torch.__version__}'s {twin.__name__} takes no bias argument (later releases do)")
    theirs = twin(*args, **kwargs).to(device, dtype)
    _randomize(theirs, torch.Generator().manual_seed(len(case)))
    ours = cls(*args, **kwargs).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("case", list(CASES))
def test_state_dict_both_ways_and_repr(case):
    ours, theirs = _pair(case)
    assert isinstance(ours, type(theirs))
    assert repr(ours) == repr(theirs)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    mine, other = ours.state_dict(), theirs.state_dict()
    assert list(mine) == list(other)
    for key in other:
        assert torch.equal(mine[key], other[key]), key
    fresh = type(theirs)(*CASES[case][1], **CASES[case][2])
    fresh.load_state_dict(mine)  # normkit -> torch, strict
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, other[key]), key


def _step(module, x, dy):
    """Forward + backward of a fresh leaf copy of x: (y, dx, {param name: grad})."""
    module.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    y = module(leaf)
    y.backward(dy)
    return y.detach(), leaf.grad, {n: p.grad for n, p in module.named_parameters()}


def _assert_steps_match(ours, theirs, shape, dtype, steps, seed=0, device="cpu"):
    """Run both modules on the same inputs (different scale and mean each step) and compare y, dx,
    parameter gradients and buffers after every step."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = (torch.randn(shape, generator=g) * (step + 1) + step).to(device, dtype)
        dy = torch.randn(shape, generator=g).to(device, dtype)
        (y, dx, grads), (ry, rdx, rgrads) = _step(ours, x, dy), _step(theirs, x, dy)
        assert y.dtype == ry.dtype
        assert_close(y, ry, dtype, "fwd", f"step {step}: y")
        assert_close(dx, rdx, dtype, "bwd", f"step {step}: dx")
        for name, grad in rgrads.items():
            if grad is not None:
                rows = max(x.numel() // max(grad.numel(), 1), 1)
                assert_close(grads[name], grad, dtype, "param", f"step {step}: d{name}", rows)
        for (name, buf), (_, rbuf) in zip(ours.named_buffers(), theirs.named_buffers()):
            if buf.is_floating_point():
                assert_close(buf, rbuf, buf.dtype, "fwd", f"step {step}: {name}")
            else:
                assert torch.equal(buf, rbuf), f"step {step}: {name} {buf} != {rbuf}"


@pytest.mark.parametrize("case", list(CASES))
def test_training_then_eval_matches_torch(case):
    """Three training steps (running statistics updated, num_batches_tracked counted, momentum=None
    cumulative), then two eval steps, on the CPU reference backend."""
    ours, theirs = _pair(case)
    shape = CASES[case][3]
    _assert_steps_match(ours, theirs, shape, torch.float32, steps=3)
    ours.eval(), theirs.eval()
    _assert_steps_match(ours, theirs, shape, torch.float32, steps=2, seed=1)


@pytest.mark.parametrize("case", ["BatchNorm1d", "InstanceNorm2d-tracked"])
def test_running_stats_switched_off_after_construction(case):
    """track_running_stats set False on a module that has buffers, as in torch: BatchNorm's training
    leaves them alone and its eval uses them; InstanceNorm updates them and normalizes by the input."""
    ours, theirs = _pair(case)
    ours.track_running_stats = theirs.track_running_stats = False
    _assert_steps_match(ours, theirs, CASES[case][3], torch.float32, steps=2)
    if case.startswith("BatchNorm"):
        assert torch.equal(ours.running_mean, _pair(case)[1].running_mean)
    ours.eval(), theirs.eval()
    _assert_steps_match(ours, theirs, CASES[case][3], torch.float32, steps=1)


@pytest.mark.parametrize("case,shape", [
    ("BatchNorm1d", (2, 4, 3, 3)), ("BatchNorm2d-cumulative", (4, 5, 2)), ("BatchNorm3d-no-bias", (2, 3, 4)),
    ("InstanceNorm1d", (4,)), ("InstanceNorm2d-tracked", (2, 5, 3, 3)),
])  # fmt: skip
def test_input_checks_like_torch(case, shape):
    ours, theirs = _pair(case)
    x = torch.randn(shape)
    with pytest.raises(ValueError) as expected:
        theirs(x)
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        ours(x)


@pytest.mark.parametrize("cls", [nkn.Softmax, nkn.LogSoftmax])
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5), (2, 3, 4, 5)], ids=str)
def test_softmax_implicit_dim_like_torch(cls, shape):
    x = torch.randn(shape)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        expected = cls.__bases__[0]()(x)
    with pytest.warns(UserWarning, match="Implicit dimension choice"):
        got = cls()(x)
    assert_close(got, expected, torch.float32, "fwd", "y")


# --- LayerNorm / RMSNorm / add-norm modules on each executor (interpreter on CPU, kernels on GPU) --------

KERNEL_CASES = executor_params(
    [((3, 64), torch.float32), ((2, 64), torch.bfloat16)],
    [((256, 1024), torch.bfloat16), ((64, 4096), torch.float32), ((8, 40999), torch.float16)],
)


@pytest.mark.parametrize("case", ["LayerNorm", "LayerNorm-no-affine", "RMSNorm"])
@pytest.mark.parametrize("executor,shape,dtype", KERNEL_CASES)
def test_norm_modules_on_kernels(run_on, executor, shape, dtype, case):
    backend = run_on(executor, dtype)  # skips first when the executor is unavailable
    cls, _, kwargs, _ = CASES[case]
    theirs = cls.__bases__[0](shape[-1], **kwargs).to(executor.device, dtype)
    _randomize(theirs, torch.Generator().manual_seed(1))
    ours = cls(shape[-1], **kwargs).to(executor.device, dtype)
    ours.load_state_dict(theirs.state_dict())
    with backend:
        _assert_steps_match(ours, theirs, shape, dtype, steps=1, device=executor.device)


def _add_norm_pair(cls, n, dtype, device, **kwargs):
    twin = nkn.LayerNorm.__bases__[0] if cls is nkn.AddLayerNorm else nkn.RMSNorm.__bases__[0]
    theirs = twin(n).to(device, dtype)
    _randomize(theirs, torch.Generator().manual_seed(2))
    ours = cls(n, prenorm=True, **kwargs).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _add_norm_expected(theirs, x, r, keep, p):
    """(torch.nn's norm of h, h) for h = x * keep / (1 - p) + r rounded to x's dtype (as stored)."""
    h = (x.double() * keep / (1 - p) + r.double()).to(x.dtype).requires_grad_(True)
    return theirs(h), h


@pytest.mark.parametrize("cls", [nkn.AddLayerNorm, nkn.AddRMSNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train-dropout"])
@pytest.mark.parametrize("executor,shape,dtype", KERNEL_CASES)
def test_add_norm_modules_on_kernels(run_on, executor, shape, dtype, training, cls):
    """prenorm=True with y and h both used; training applies dropout (fixed seed: the mask is the
    backend's own for that seed), eval none. Gradients of x, residual and the weight."""
    backend = run_on(executor, dtype)
    device, p, seed = executor.device, 0.25, 1234
    ours, theirs = _add_norm_pair(cls, shape[-1], dtype, device, dropout_p=p, seed=seed)
    ours.train(training)
    g = torch.Generator().manual_seed(3)
    x, r, dy, dh = (torch.randn(shape, generator=g).to(device, dtype) for _ in range(4))
    with backend:
        op = "add_layer_norm" if cls is nkn.AddLayerNorm else "add_rms_norm"
        keep = dropout_keep_mask(op, x, p, seed) if training else torch.ones_like(x, dtype=torch.bool)
        xl, rl = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        y, h = ours(xl, rl)
        torch.autograd.backward([y, h], [dy, dh])
    assert (0 < keep.float().mean() < 1) if training else keep.all()
    ry, rh = _add_norm_expected(theirs, x, r, keep, p if training else 0.0)
    torch.autograd.backward([ry, rh], [dy, dh])
    assert_close(y, ry, dtype, "fwd", "y")
    assert_close(h, rh, dtype, "fwd", "h")
    scale = keep / (1 - p) if training else 1.0
    assert_close(xl.grad, rh.grad.double() * scale, dtype, "bwd", "dx")
    assert_close(rl.grad, rh.grad, dtype, "bwd", "dresidual")
    rows = math.prod(shape[:-1])
    assert_close(ours.weight.grad, theirs.weight.grad, dtype, "param", "dweight", rows)


# --- add-norm modules: seeds, state_dict, repr, errors (CPU reference) -----------------------------------


@pytest.mark.parametrize("cls", [nkn.AddLayerNorm, nkn.AddRMSNorm], ids=lambda c: c.__name__)
def test_add_norm_seed_per_call(cls):
    """Training draws a fresh seed per call from torch's CPU generator; a fixed seed repeats the mask;
    eval applies no dropout and draws nothing."""
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    m = cls(64, dropout_p=0.5, prenorm=True)
    torch.manual_seed(1)
    h1, h2 = m(x, r)[1], m(x, r)[1]
    torch.manual_seed(1)
    assert not torch.equal(h1, h2) and torch.equal(m(x, r)[1], h1)
    fixed = cls(64, dropout_p=0.5, prenorm=True, seed=7)
    assert torch.equal(fixed(x, r)[1], fixed(x, r)[1])
    m.eval()
    state = torch.get_rng_state()
    assert torch.equal(m(x, r)[1], x + r)
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(cls(64)(x), torch.Tensor)  # prenorm=False: y only; residual optional


@pytest.mark.parametrize("cls", [nkn.AddLayerNorm, nkn.AddRMSNorm], ids=lambda c: c.__name__)
def test_add_norm_state_dict_and_repr(cls):
    twin = cls.__mro__[2]  # after the _AddNorm mixin: torch.nn.LayerNorm / RMSNorm
    theirs = twin(16)
    _randomize(theirs, torch.Generator().manual_seed(0))
    ours = cls(16, dropout_p=0.1, prenorm=True, residual_dtype=torch.float32)
    ours.load_state_dict(theirs.state_dict())
    back = twin(16)
    back.load_state_dict(ours.state_dict())
    assert torch.equal(back.weight, theirs.weight) and list(ours.state_dict()) == list(theirs.state_dict())
    assert repr(ours) == repr(theirs)[:-1].replace(twin.__name__, cls.__name__, 1) + (
        ", dropout_p=0.1, prenorm=True, residual_dtype=torch.float32)"
    )
    x = torch.randn(3, 16)
    ours.eval()
    assert_close(ours(x, None)[0], theirs(x), torch.float32, "fwd", "y")


@pytest.mark.parametrize("kwargs,words", [
    (dict(dropout_p=1.5), ["dropout_p", "1.5", "[0, 1]"]),
    (dict(dropout_p="0.1"), ["dropout_p", "'0.1'"]),
    (dict(residual_dtype="float32"), ["residual_dtype", "'float32'"]),
    (dict(seed=1.5), ["seed", "1.5"]),
], ids=["p-one", "p-type", "residual-dtype", "seed"])  # fmt: skip
@pytest.mark.parametrize("cls", [nkn.AddLayerNorm, nkn.AddRMSNorm], ids=lambda c: c.__name__)
def test_add_norm_errors_name_the_argument(cls, kwargs, words):
    with pytest.raises(normkit.InvalidArgument) as info:
        cls(8, **kwargs)
    for word in words + [cls.__name__]:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_exports():
    assert normkit.nn is nkn
    for name in nkn.__all__:
        assert getattr(nkn, name).__module__ == "normkit.nn"
