"""BatchNorm kernels of every backend (training and eval) vs the fp64 reference and torch."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import executor_params

import normkit
from normkit.testing import Executor, check_batch_norm_case

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICE_SHAPES = [(32, 64, 28, 28), (16, 128, 7, 7), (2, 8, 128, 128), (256, 64), (3, 5, 33), (2, 3, 1)]
INTERPRETER_SHAPES = [(4, 3, 5, 5), (16, 6), (2, 3, 1100), (3, 2, 1)]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor,shape", executor_params(
    [(s,) for s in INTERPRETER_SHAPES], [(s,) for s in DEVICE_SHAPES]))  # fmt: skip
def test_batch_norm_matches_reference(run_on, executor, shape, dtype, training):
    with run_on(executor, dtype):
        check_batch_norm_case(shape, dtype, executor.device, training=training)


@pytest.mark.parametrize("affine", [(False, False), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("executor,shape", executor_params([((4, 3, 5, 5),)], [((16, 32, 14, 14),)]))
def test_batch_norm_weight_bias_optional(run_on, executor, shape, affine):
    with run_on(executor, torch.float32):
        check_batch_norm_case(shape, torch.float32, executor.device, weight=affine[0], bias=affine[1])


@pytest.mark.parametrize("executor,shape", executor_params([((4, 3, 6, 6),)], [((16, 64, 28, 28),)]))
def test_batch_norm_running_stats_like_torch(run_on, executor, shape):
    """Several training steps (different batches) then eval: outputs, grads, running stats."""
    with run_on(executor, torch.float32):
        dev, C = executor.device, shape[1]
        w, b = torch.randn(C, device=dev), torch.randn(C, device=dev)
        ours = [torch.zeros(C, device=dev), torch.ones(C, device=dev)]
        theirs = [t.clone() for t in ours]
        for step in range(4):
            x = torch.randn(shape, device=dev) * (step + 1) + 3 * step
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya = normkit.batch_norm(xa, *ours, w, b, training=True, momentum=0.25)
            yb = F.batch_norm(xb, *theirs, w, b, training=True, momentum=0.25)
            torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
            dy = torch.randn(shape, device=dev)
            ya.backward(dy)
            yb.backward(dy)
            torch.testing.assert_close(xa.grad, xb.grad, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)
        x = torch.randn(shape, device=dev)
        torch.testing.assert_close(normkit.batch_norm(x, *ours, w, b), F.batch_norm(x, *theirs, w, b),
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("executor,shape", executor_params([((4, 3, 40, 40),)], [((32, 64, 56, 56),)]))
def test_batch_norm_large_mean_and_determinism(run_on, executor, shape):
    with run_on(executor, torch.float32):
        g = torch.Generator().manual_seed(11)
        x = (torch.randn(shape, generator=g) + 1e4).to(executor.device).requires_grad_()
        w = torch.randn(shape[1], generator=g).to(executor.device).requires_grad_()
        y = normkit.batch_norm(x, None, None, w, training=True)
        expected = F.batch_norm(x.detach().double(), None, None, w.detach().double(), training=True)
        # x's own ulp is 1e-3: the fp32 mean (and x - mean) carry that much, times rstd (~1) and |w|
        # (a fixed atol failed when an unseeded draw gave |w| ~ 2.8: 2.75e-3 against 2e-3).
        atol = 2e-3 * max(1.0, w.detach().abs().max().item())
        torch.testing.assert_close(y.double(), expected, atol=atol, rtol=0)
        grads = [torch.autograd.grad(normkit.batch_norm(x, None, None, w, training=True).square().sum(),
                                     (x, w)) for _ in range(2)]  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(*grads)), "gradients differ between runs"


# Channels in parts held in shared memory (config.batch_norm_smem: the training forward, and the
# backward; HW a multiple of 16): parts that fill their buffers and ones that do not (the last part
# short), one part a channel, more channels than channel groups, many parts a channel
PARTS_SHAPES = [(32, 64, 28, 28), (8, 24, 64, 64), (3, 40, 16, 16), (128, 12, 12, 12), (5, 7, 48, 80),
                (64, 3, 112, 112), (2, 300, 4, 4)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("mean", [0.0, 300.0])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", PARTS_SHAPES, ids=str)
@pytest.mark.usefixtures("in_parts")
def test_batch_norm_channels_in_parts(run_on, shape, dtype, mean):
    """The in-parts forward and backward are chosen (asserted); y, the running statistics and the
    gradients match fp64, also about a large mean, in eval mode (the backward alone in parts) and
    without weight and bias; two forwards and two backwards are bitwise equal; x at an offset that
    breaks 16-byte alignment takes split channels and matches too, as does dy (the backend called
    directly)."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        N, C, HW = shape[0], shape[1], math.prod(shape[2:])
        for backward in (False, True):
            cfg = config.batch_norm_smem(N, C, HW, dtype, device, backward)
            assert cfg is not None and cfg.smem, (backward, cfg)
            assert cfg.parts * cfg.part >= N * HW > (cfg.parts - 1) * cfg.part, (backward, cfg)
        seed = int(mean) + C
        check_batch_norm_case(shape, dtype, device, mean=mean, seed=seed)
        # eval mode about mean 0 (its random running statistics about 300 would take 16-bit dweight
        # past fp16's range, as torch's)
        check_batch_norm_case(shape, dtype, device, seed=seed + 1, training=False)
        check_batch_norm_case(shape, dtype, device, mean=mean, seed=seed + 2, weight=False, bias=False)
        x = (torch.randn(shape, device=device) + mean).to(dtype)
        dy = torch.randn(shape, device=device).to(dtype)
        w, b = torch.rand(C, device=device) + 0.5, torch.randn(C, device=device)
        runs = []
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
            y = normkit.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True)
            y.backward(dy)
            runs.append([y.detach()] + [t.grad for t in leaves])
        for name, first, second in zip(("y", "dx", "dweight", "dbias"), *runs):
            assert torch.equal(first, second), f"{name} differs between runs"
        shifted = torch.empty(x.numel() + 1, dtype=dtype, device=device)[1:].view(shape).copy_(x)
        expected = F.batch_norm(x.double(), None, None, w.double(), b.double(), training=True)
        torch.testing.assert_close(normkit.batch_norm(shifted, None, None, w, b, training=True).double(),
                                   expected, **_Y_TOL[dtype])  # fmt: skip
        # the backend with dy unaligned (x aligned): split channels' backward, the same gradients up to
        # rounding (the public path's plans would copy such a dy to an aligned one)
        from normkit.backends.cuda import batch_norm as bn

        x3, dy3 = x.view(N, C, HW), torch.empty(x.numel() + 1, dtype=dtype, device=device)[1:].view(N, C, HW)
        dy3.copy_(dy.view(N, C, HW))
        unaligned_cfg = bn._bwd_config(x3, dy3.data_ptr())  # None: HW too short to split (two passes)
        assert unaligned_cfg is None or not unaligned_cfg.smem
        _, mean_, rstd_, _, _ = bn.batch_norm_train_fwd(x3, w, b, 1e-5, 0.1, None, None)
        unaligned = bn.batch_norm_bwd(dy3, x3, w, mean_, rstd_, True, b.dtype)
        aligned = bn.batch_norm_bwd(dy.view(N, C, HW), x3, w, mean_, rstd_, True, b.dtype)
        for name, got, ref in zip(("dx", "dweight", "dbias"), unaligned, aligned):
            torch.testing.assert_close(got.double(), ref.double(), **_Y_TOL[dtype],
                                       msg=lambda m, n=name: f"{n} (unaligned dy): {m}")  # fmt: skip


_Y_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=4e-3, rtol=4e-3),
          torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}  # fmt: skip


def test_batch_norm_reference_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for training in (True, False):
        assert torch.autograd.gradcheck(
            lambda x, w, b, t=training: normkit.batch_norm(x, rm.clone(), rv.clone(), w, b, training=t),
            (x, w, b),
        )


def test_batch_norm_errors_name_the_argument():
    x = torch.randn(4, 3, 5)
    with pytest.raises(normkit.InvalidArgument, match="running_mean and running_var are required"):
        normkit.batch_norm(x, None, None)
    with pytest.raises(normkit.InvalidArgument, match="running_var has shape \\[4\\]; expected .*\\[3\\]"):
        normkit.batch_norm(x, torch.zeros(3), torch.ones(4))
    with pytest.raises(normkit.InvalidArgument, match="more than 1 value per channel"):
        normkit.batch_norm(torch.randn(1, 3), None, None, training=True)
    with pytest.raises(normkit.InvalidArgument, match="eps must be a finite number >= 0"):
        normkit.batch_norm(x, None, None, training=True, eps=-1.0)
    with pytest.raises(normkit.InvalidArgument, match="running_mean is on device meta"):
        normkit.batch_norm(x, torch.zeros(3, device="meta"), torch.ones(3))
