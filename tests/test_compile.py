"""torch.library registration: the row ops as custom operators, torch.compile with zero graph breaks.

`torch.library.opcheck` checks each operator's schema, fake kernel, autograd registration and
AOT dispatch against its real kernel; the compile tests trace a block that calls every row op with
`fullgraph=True`, count graph breaks with `torch._dynamo.explain`, and compare outputs and
gradients with eager execution. CPU tensors (the reference) always; both backends' kernels under
the interpreter; the CUDA kernels and the NPU kernels on a GPU under `-m cuda`.
"""

import pytest
import torch
from conftest import executor_params

import normkit
from normkit import ops
from normkit.testing import assert_close


def _rows(m, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=g, dtype=dtype)


def _opcheck_cases():
    x, dy = _rows(5, 33), _rows(5, 33, seed=1)
    w, b = 1 + 0.1 * _rows(1, 33, seed=2)[0], 0.1 * _rows(1, 33, seed=3)[0]
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5)
    _, rms_rstd = ops.rms_norm_fwd(x, w, 1e-5)
    s = ops.softmax_fwd(x, False)
    r = _rows(5, 33, seed=4)
    _, h, amean, arstd = ops.add_norm_fwd(x, r, w, b, 1e-5, 0.1, 7, torch.float32, False)
    grad = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    return [
        ("layer_norm_fwd", ops.layer_norm_fwd, (*grad(x, w, b), 1e-5)),
        ("layer_norm_fwd-no-params", ops.layer_norm_fwd, (*grad(x), None, None, 1e-5)),
        ("layer_norm_bwd", ops.layer_norm_bwd, (dy, x, w, mean, rstd, torch.float32)),
        ("rms_norm_fwd", ops.rms_norm_fwd, (*grad(x, w), 1e-6)),
        ("rms_norm_bwd", ops.rms_norm_bwd, (dy, x, None, rms_rstd)),
        ("softmax_fwd", ops.softmax_fwd, (*grad(x), True)),
        ("softmax_bwd", ops.softmax_bwd, (dy, s, False)),
        ("add_norm_fwd-ln-dropout", ops.add_norm_fwd,
         (*grad(x, r, w, b), 1e-5, 0.1, 7, torch.float32, False)),
        ("add_norm_fwd-rms-no-residual", ops.add_norm_fwd,
         (*grad(x), None, *grad(w), None, 1e-5, 0.0, 0, torch.float64, True)),
        ("add_norm_bwd", ops.add_norm_bwd,
         (dy, dy, h, w, amean, arstd, torch.float32, 0.1, 7, torch.float32, torch.float32, False)),
        *_image_cases(),
    ]  # fmt: skip


def _image_cases():
    x, dy = _rows(4, 8 * 6, seed=5).view(4, 8, 6), _rows(4, 8 * 6, seed=6).view(4, 8, 6)
    w, b = 1 + 0.1 * _rows(1, 8, seed=7)[0], 0.1 * _rows(1, 8, seed=8)[0]
    _, gmean, grstd = ops.group_norm_fwd(x, w, b, 2, 1e-5)
    mean, rstd = ops.batch_norm_stats(x, 1e-5, 0.1, None, None)
    running = [0.1 * _rows(1, 8, seed=9)[0], 1 + 0.1 * _rows(1, 8, seed=10)[0].abs()]
    grad = lambda *ts: [t.clone().requires_grad_() for t in ts]  # noqa: E731
    return [
        ("group_norm_fwd", ops.group_norm_fwd, (*grad(x, w, b), 2, 1e-5)),
        ("group_norm_bwd", ops.group_norm_bwd, (dy, x, w, gmean, grstd, 2, torch.float32)),
        ("batch_norm_stats", ops.batch_norm_stats, (x, 1e-5, 0.1, None, None)),
        ("batch_norm_stats-running", ops.batch_norm_stats, (x, 1e-5, 0.1, *running)),
        ("batch_norm_fwd-train", ops.batch_norm_fwd, (*grad(x, w, b), mean, rstd, True)),
        ("batch_norm_fwd-eval-no-params", ops.batch_norm_fwd, (*grad(x), None, None, mean, rstd, False)),
        ("batch_norm_bwd", ops.batch_norm_bwd, (dy, x, w, mean, rstd, True, torch.float32)),
        ("batch_norm_train", ops.batch_norm_train, (*grad(x, w, b), 1e-5, 0.1, None, None)),
        ("batch_norm_train-running", ops.batch_norm_train, (*grad(x, w, b), 1e-5, 0.1, *running)),
        ("batch_norm_train-no-params", ops.batch_norm_train, (*grad(x), None, None, 1e-5, 0.1, *running)),
    ]


@pytest.mark.parametrize("name,op,args", _opcheck_cases(),
                         ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
@pytest.mark.parametrize("executor", [pytest.param(None, id="cpu")] + executor_params([()], [()]))
def test_opcheck(run_on, executor, name, op, args):
    """Schema, fake kernel, autograd registration and AOT dispatch agree with the real kernel of
    each backend (the fake kernels must give every backend's output shapes and dtypes)."""
    if executor is None:
        torch.library.opcheck(op, args)
        return
    with run_on(executor, torch.float32):
        move = lambda a: a.detach().to(executor.device).requires_grad_(a.requires_grad) \
            if isinstance(a, torch.Tensor) else a  # noqa: E731
        torch.library.opcheck(op, tuple(move(a) for a in args))


def _block(x, residual, w, b):
    """Every row op once, as a transformer block would call them."""
    a = normkit.layer_norm(x, x.shape[-1:], w, b)
    y, h = normkit.add_rms_norm(a, residual, x.shape[-1:], w, prenorm=True)
    z = normkit.add_layer_norm(y, h, x.shape[-1:], w, b)
    return normkit.softmax(z, -1) + normkit.log_softmax(normkit.rms_norm(h, x.shape[-1:], w), 0)


def _inputs(shape, dtype, device):
    g = torch.Generator().manual_seed(3)
    make = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device).requires_grad_()  # noqa: E731
    x, r = make(*shape), make(*shape)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(dtype).to(device).requires_grad_()
    b = make(shape[-1])
    return x, r, w, b


@pytest.mark.parametrize("executor,shape,dtype", [pytest.param(None, (2, 3, 64), torch.float32, id="cpu")]
                         + executor_params([((2, 3, 64), torch.float32)],
                                           [((4, 128, 1024), torch.bfloat16)]))  # fmt: skip
def test_fullgraph_compile_matches_eager(run_on, executor, shape, dtype):
    """fullgraph=True traces normkit ops without a graph break; outputs and gradients match eager."""
    device = "cpu" if executor is None else executor.device
    ctx = torch.enable_grad() if executor is None else run_on(executor, dtype)
    with ctx:
        torch._dynamo.reset()
        x, r, w, b = _inputs(shape, dtype, device)
        explained = torch._dynamo.explain(_block)(x, r, w, b)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        compiled = torch.compile(_block, fullgraph=True)
        out, ref = compiled(x, r, w, b), _block(x, r, w, b)
        assert_close(out, ref, dtype, "fwd", "compiled output")
        dy = torch.randn_like(ref)
        got = torch.autograd.grad(out, (x, r, w, b), dy)
        want = torch.autograd.grad(ref, (x, r, w, b), dy)
        for name, g1, g2 in zip(("dx", "dresidual", "dweight", "dbias"), got, want):
            assert_close(g1, g2, dtype, "param" if name in ("dweight", "dbias") else "bwd", name, shape[0])


def _image_block(x, w, b, running_mean, running_var):
    """GroupNorm, BatchNorm (training, running statistics updated in place) and InstanceNorm."""
    g = normkit.group_norm(x, 2, w, b)
    y = normkit.batch_norm(g, running_mean, running_var, w, b, training=True)
    return normkit.instance_norm(y, weight=w, bias=b)


@pytest.mark.parametrize("executor", [pytest.param(None, id="cpu")]
                         + executor_params([()], [()]))  # fmt: skip
def test_fullgraph_compile_image_norms(run_on, executor):
    """GroupNorm / BatchNorm / InstanceNorm compile without graph breaks; outputs, gradients and the
    running statistics match eager."""
    device = "cpu" if executor is None else executor.device
    with torch.enable_grad() if executor is None else run_on(executor, torch.float32):
        torch._dynamo.reset()
        x = _inputs((4, 8, 3, 5), torch.float32, device)[0]
        _, _, w, b = _inputs((1, 8), torch.float32, device)
        stats = [torch.zeros(8, device=device), torch.ones(8, device=device)]
        eager_stats = [t.clone() for t in stats]
        explained = torch._dynamo.explain(_image_block)(x, w, b, *[t.clone() for t in stats])
        assert explained.graph_break_count == 0, explained.break_reasons
        out = torch.compile(_image_block, fullgraph=True)(x, w, b, *stats)
        ref = _image_block(x, w, b, *eager_stats)
        assert_close(out, ref, torch.float32, "fwd", "compiled output")
        for name, got, want in zip(("running_mean", "running_var"), stats, eager_stats):
            assert_close(got, want, torch.float32, "fwd", name)
        dy = torch.randn_like(ref)
        for name, g1, g2 in zip(("dx", "dweight", "dbias"), torch.autograd.grad(out, (x, w, b), dy),
                                torch.autograd.grad(ref, (x, w, b), dy)):  # fmt: skip
            assert_close(g1, g2, torch.float32, "bwd" if name == "dx" else "param", name, 4)


def test_ops_are_registered_under_torch_ops():
    """The operators are reachable as torch.ops.normkit.* (what compiled graphs and exports call)."""
    x = _rows(3, 8)
    y, _, _ = torch.ops.normkit.layer_norm_fwd(x, None, None, 1e-5)
    assert_close(y, torch.nn.functional.layer_norm(x, (8,)), torch.float32, "fwd", "y")
