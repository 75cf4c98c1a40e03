"""normkit.reference (the CPU backend and the oracle) against torch.nn.functional and gradcheck."""

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit.testing import make_inputs

SHAPES = [((1, 1), 1), ((3, 7), 1), ((4, 5, 33), 1), ((2, 3, 4, 6), 2), ((17, 1025), 1)]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


def _torch(op, x, shape, weight, bias, eps):
    if op == "layer_norm":
        return F.layer_norm(x, shape, weight, bias, eps)
    return F.rms_norm(x, shape, weight, eps)


def _ours(op, x, shape, weight, bias, eps):
    if op == "layer_norm":
        return normkit.layer_norm(x, shape, weight, bias, eps)
    return normkit.rms_norm(x, shape, weight, eps)


@pytest.mark.parametrize("op,affine", [(op, a) for op in ("layer_norm", "rms_norm") for a in AFFINE
                                       if op == "layer_norm" or not a[1]], ids=str)  # fmt: skip
@pytest.mark.parametrize("shape,ndim", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reference_matches_torch(shape, ndim, dtype, affine, op):
    inputs = make_inputs(op, shape, ndim, dtype, "cpu", *affine, seed=3)
    norm_shape = inputs["normalized_shape"]
    eps = 1e-5 if op == "layer_norm" else None
    results = []
    for fn in (_torch, _ours):
        leaves = {k: inputs[k].clone().requires_grad_() if inputs[k] is not None else None
                  for k in ("x", "weight", "bias")}  # fmt: skip
        y = fn(op, leaves["x"], norm_shape, leaves["weight"], leaves["bias"], eps)
        y.backward(inputs["dy"])
        results.append([y] + [t.grad for t in leaves.values() if t is not None])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for expected, got in zip(*results):
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,ndim", [((3, 7), 1), ((2, 3, 4), 2)], ids=str)
def test_reference_gradcheck(shape, ndim, op):
    inputs = make_inputs(op, shape, ndim, torch.float64, "cpu", seed=5)
    names = [k for k in ("x", "weight", "bias") if inputs[k] is not None]
    leaves = [inputs[k].requires_grad_() for k in names]

    def fn(*tensors):
        kw = dict(zip(names, tensors))
        return _ours(op, kw["x"], inputs["normalized_shape"], kw.get("weight"), kw.get("bias"), 1e-5)

    assert torch.autograd.gradcheck(fn, leaves)


def test_cpu_is_served_by_reference():
    assert normkit.backend_name_for("cpu") == "normkit.reference"
    assert normkit.backend_name_for(torch.device("cuda", 1)) == "normkit.backends.cuda"
    assert normkit.backend_name_for("npu") == "normkit.backends.npu"
