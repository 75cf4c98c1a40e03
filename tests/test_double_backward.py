"""Double backward (``create_graph=True``): every op's gradients can be differentiated again, equal
to torch's (normkit.higher_order).

- ``torch.autograd.gradgradcheck`` in fp64 of every op and every differentiable argument, on the
  reference, on the CUDA kernels (interpreter; GPU: marker cuda) — each call's forward runs the
  backend's kernels, the plan path included (the second call of a signature takes the plan).
- The NPU kernels refuse fp64: there, and again on every executor in fp32, second-order gradients
  of a gradient penalty are compared with torch.nn.functional's on the same inputs.
- A WGAN-GP critic (Linear -> Tanh -> Linear -> LayerNorm), as a user reported it: every parameter's
  gradient equals torch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import executor_params

import normkit

def _rand(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 0.8 + 0.3).to(dtype).to(device)


# (name, normkit call, torch call, input shapes): every tensor argument is differentiated
CASES = {
    "layer_norm": (lambda lib, x, w, b: lib.layer_norm(x, (5,), w, b, 1e-5), [(3, 5), (5,), (5,)]),
    "layer_norm-eps": (lambda lib, x, w: lib.layer_norm(x, (2, 3), w, None, 0.1), [(2, 2, 3), (2, 3)]),
    "layer_norm-no-affine": (lambda lib, x: lib.layer_norm(x, (4,)), [(3, 4)]),
    "rms_norm": (lambda lib, x, w: lib.rms_norm(x, (5,), w, 1e-6), [(3, 5), (5,)]),
    "rms_norm-no-weight": (lambda lib, x: lib.rms_norm(x, (4,), None, 0.1), [(2, 4)]),
    "softmax": (lambda lib, x: lib.softmax(x, -1), [(3, 5)]),
    "softmax-dim0": (lambda lib, x: lib.softmax(x, 0), [(4, 3)]),
    "log_softmax": (lambda lib, x: lib.log_softmax(x, -1), [(3, 5)]),
    "add_layer_norm": (
        lambda lib, x, r, w, b: _add_norm(lib, "layer", x, r, w, b, 0.0),
        [(3, 5), (3, 5), (5,), (5,)],
    ),
    "add_rms_norm-dropout": (
        lambda lib, x, r, w: _add_norm(lib, "rms", x, r, w, None, 0.3),
        [(3, 5), (3, 5), (5,)],
    ),
    "add_layer_norm-prenorm": (
        lambda lib, x, r, w, b: _add_norm(lib, "layer", x, r, w, b, 0.0, prenorm=True),
        [(2, 6), (2, 6), (6,), (6,)],
    ),
    "group_norm": (lambda lib, x, w, b: lib.group_norm(x, 2, w, b, 1e-5), [(2, 4, 3), (4,), (4,)]),
    "instance_norm": (lambda lib, x, w, b: lib.instance_norm(x, weight=w, bias=b), [(2, 3, 4), (3,), (3,)]),
    "batch_norm-train": (
        lambda lib, x, w, b: lib.batch_norm(x, None, None, w, b, training=True, eps=1e-3),
        [(3, 2, 4), (2,), (2,)],
    ),
    "batch_norm-eval": (
        lambda lib, x, w, b: lib.batch_norm(x, torch.tensor([0.2, -0.1], dtype=x.dtype, device=x.device),
                                            torch.tensor([1.5, 0.7], dtype=x.dtype, device=x.device), w, b),
        [(3, 2, 4), (2,), (2,)],
    ),  # fmt: skip
}


def _add_norm(lib, kind, x, r, w, b, p, prenorm=False):
    """normkit's add-norm, or for torch: (dropout(x) + r) normalized, with the same mask as normkit's
    (taken from normkit's own gradient of h w.r.t. x, cached per shape)."""
    if lib is normkit:
        fn = normkit.add_layer_norm if kind == "layer" else normkit.add_rms_norm
        kw = dict(weight=w, dropout_p=p, seed=7, prenorm=prenorm)
        if kind == "layer":
            kw["bias"] = b
        return fn(x, r, (x.shape[-1],), **kw)
    h = x * _keep_scale(x, r, w, p) + r if p > 0 else x + r
    y = F.layer_norm(h, (x.shape[-1],), w, b) if kind == "layer" else F.rms_norm(h, (x.shape[-1],), w)
    return (y, h) if prenorm else y


MASK_DEVICE = ["cpu"]  # where _keep_scale draws normkit's mask: the executor's device


def _keep_scale(x, r, w, p):
    """normkit's dropout mask x 1 / (1 - p) for seed 7, as the active executor's backend draws it:
    d(h)/d(x) of its prenorm output (fp32, on MASK_DEVICE)."""
    xd = x.detach().float().to(MASK_DEVICE[0]).requires_grad_()
    rd = r.detach().float().to(MASK_DEVICE[0])
    _, h = normkit.add_rms_norm(xd, rd, (x.shape[-1],), None, dropout_p=p, seed=7, prenorm=True)
    (g,) = torch.autograd.grad(h.sum(), xd)
    return g.detach().to(x.dtype).to(x.device)


def _inputs(shapes, dtype, device, seed=0):
    return [_rand(s, dtype, seed + i, device).requires_grad_() for i, s in enumerate(shapes)]


def _gradgradcheck(name, dtype, device):
    fn, shapes = CASES[name]
    inputs = _inputs(shapes, dtype, device)
    fn(normkit, *inputs)  # a first call makes the signature's plan (where the backend has plans)
    assert torch.autograd.gradgradcheck(lambda *a: fn(normkit, *a), inputs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_gradgradcheck_reference(name):
    _gradgradcheck(name, torch.float64, "cpu")


@pytest.mark.parametrize(
    "executor,name",
    executor_params([(n,) for n in CASES], [(n,) for n in CASES]),
)
def test_gradgradcheck_kernels(run_on, executor, name):
    """fp64 on the CUDA kernels (interpreter, GPU); the NPU kernels serve no fp64 (their second
    order is checked in fp32 below)."""
    if torch.float64 not in executor.dtypes:
        pytest.skip(f"{executor.name}: no fp64 (see test_second_order_matches_torch)")
    with run_on(executor, torch.float64):
        _gradgradcheck(name, torch.float64, executor.device)


def _penalty_grads(lib, fn, inputs, dy):
    """Gradients of a gradient penalty: g = d(<fn(inputs), dy>)/d(inputs) with create_graph, then
    d(sum ||g||^2 + <g, g0>)/d(inputs) — terms of second order in every input."""
    out = fn(lib, *inputs)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o * d).sum() for o, d in zip(outs, dy))
    grads = torch.autograd.grad(total, inputs, create_graph=True)
    penalty = sum((g.float() ** 2).sum() + (g.float() * 0.5).sum() for g in grads)
    return [g.detach() for g in grads], torch.autograd.grad(penalty, inputs, allow_unused=True)


@pytest.mark.parametrize(
    "executor,name",
    executor_params([(n,) for n in CASES], [(n,) for n in CASES]),
)
def test_second_order_matches_torch(run_on, executor, name):
    """fp32: first- and second-order gradients of a gradient penalty against torch's on the same
    inputs (torch in fp64)."""
    active = run_on(executor, torch.float32)  # skips where the executor is unavailable
    fn, shapes = CASES[name]
    inputs = _inputs(shapes, torch.float32, executor.device, seed=3)
    ref = [t.detach().double().cpu().requires_grad_() for t in inputs]
    with active:
        MASK_DEVICE[0] = executor.device  # torch's add-norm takes this backend's dropout mask
        out = fn(F, *ref)
        outs = out if isinstance(out, tuple) else (out,)
        dy = [_rand(o.shape, torch.float64, 50 + i) for i, o in enumerate(outs)]
        want_g, want_gg = _penalty_grads(F, fn, ref, dy)
        MASK_DEVICE[0] = "cpu"
        for _ in range(2):  # the first call and the planned one
            got_g, got_gg = _penalty_grads(normkit, fn, inputs, [d.float().to(executor.device) for d in dy])
            for what, got, want in (("grad", got_g, want_g), ("second-order", got_gg, want_gg)):
                for i, (a, e) in enumerate(zip(got, want)):
                    # a second-order term that does not exist (a bias's) is None for torch and normkit
                    assert (a is None) == (e is None), f"{name}: {what} of input {i}: {a} against {e}"
                    if e is None:
                        continue
                    scale = e.abs().max().item() + 1e-6
                    err = (a.double().cpu() - e).abs().max().item() / scale
                    assert err < 2e-4, f"{name}: {what} of input {i} off by {err:.2e} (relative to max)"


def _critic(lib, dtype, device):
    torch.manual_seed(11)
    l1, l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)
    ln = torch.nn.LayerNorm(16)
    with torch.no_grad():
        ln.weight.normal_(1.0, 0.3)
        ln.bias.normal_(0.0, 0.3)
    model = torch.nn.Sequential(l1, torch.nn.Tanh(), l2, ln).to(dtype).to(device)
    if lib is normkit:
        normkit.patch(model)
    return model


@pytest.mark.parametrize("executor", executor_params([()], [()]))
def test_wgan_gp_critic_gradients_match_torch(run_on, executor):
    """A WGAN-GP penalty on a patched critic: the penalty and every parameter's gradient (the
    LayerNorm weight and bias included, which a detached first gradient would leave None) equal
    torch's."""
    dtype = torch.float32
    active = run_on(executor, dtype)  # skips where the executor is unavailable
    x = _rand((6, 8), dtype, 1, executor.device).requires_grad_()

    def step(lib):
        model = _critic(lib, dtype, executor.device)
        xi = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
        penalty = ((g.norm(dim=1) - 1) ** 2).mean()
        penalty.backward()
        return penalty.detach(), {n: p.grad for n, p in model.named_parameters()}

    want_pen, want = step(F)
    with active:
        got_pen, got = step(normkit)
    torch.testing.assert_close(got_pen, want_pen, rtol=1e-5, atol=1e-6)
    assert want.keys() == got.keys()
    # torch: every parameter but the LayerNorm bias (no second-order term) gets a gradient
    assert [n for n in want if want[n] is None] == ["3.bias"]
    for n in want:
        assert (got[n] is None) == (want[n] is None), f"{n}: {got[n]} against {want[n]}"
        if want[n] is not None:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_first_order_backward_still_runs_the_kernels(monkeypatch):
    """Without create_graph the backward is the backend's (first-order, no autograd history), not
    the differentiable recomputation."""
    from normkit import higher_order

    def boom(*a, **k):
        raise AssertionError("higher_order used without create_graph")

    for name in ("row_norm", "softmax", "add_norm", "group_norm", "batch_norm"):
        monkeypatch.setattr(higher_order, name, boom)
    x = _rand((3, 5), torch.float32, 0).requires_grad_()
    w = _rand((5,), torch.float32, 1).requires_grad_()
    for y in (normkit.layer_norm(x, (5,), w), normkit.softmax(x, -1), normkit.rms_norm(x, (5,), w),
              normkit.group_norm(x.view(3, 5, 1), 5)):  # fmt: skip
        (g,) = torch.autograd.grad(y.sum(), x)
        assert g.grad_fn is None and not g.requires_grad
