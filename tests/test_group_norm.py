"""GroupNorm / InstanceNorm kernels of every backend vs the fp64 reference and torch."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import executor_params

import normkit
from normkit.testing import Executor, check_group_norm_case

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (shape, groups): image shapes, one group per channel, HW = 1, odd sizes, groups of more channels
# than one backward tile holds (CUDA: 16 x 1024), rows longer than the fused forward (L > 32768: the
# row norms' split forward on CUDA in 16-bit, the looped one in fp32 with weight / bias), rows too
# long for the split forward (L = 600000: the looped forward); fp32 CUDA rows split over co-resident
# programs in the backward (L > 8192), and rows as long whose G row groups do not fit at once (the
# one-program-per-row backward), groups of two channels of 12544 values ([2, 2048] backward tiles).
DEVICE_CASES = [((16, 64, 28, 28), 32), ((4, 32, 7, 7), 8), ((2, 16, 128, 128), 4), ((8, 512), 32),
                ((3, 6, 5, 5), 3), ((2, 12, 33), 12), ((1, 4, 1025), 2), ((2, 64, 32, 32), 4),
                ((2, 4, 96, 96), 1), ((8, 128, 48, 48), 32), ((1, 32, 256, 256), 32),
                ((1, 2, 300000), 1), ((4, 64, 112, 112), 32)]  # fmt: skip
INTERPRETER_CASES = [((2, 6, 5, 5), 3), ((1, 4, 33), 2), ((3, 8), 4), ((2, 4, 40, 40), 2),
                     ((1, 16, 1024), 2), ((1, 2, 16400), 1)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor,shape,groups", executor_params(INTERPRETER_CASES, DEVICE_CASES))
def test_group_norm_matches_reference(run_on, executor, shape, groups, dtype):
    with run_on(executor, dtype):
        check_group_norm_case(shape, groups, dtype, executor.device)


@pytest.mark.parametrize("affine", [(False, False), (True, False), (False, True)], ids=str)
@pytest.mark.parametrize("executor,shape,groups", executor_params(
    [((2, 6, 5, 5), 3)], [((4, 32, 7, 7), 8)]))  # fmt: skip
def test_group_norm_weight_bias_optional(run_on, executor, shape, groups, affine):
    with run_on(executor, torch.float32):
        check_group_norm_case(shape, groups, torch.float32, executor.device, weight=affine[0],
                              bias=affine[1])  # fmt: skip


@pytest.mark.parametrize("executor,shape,groups", executor_params(
    [((2, 4, 40, 40), 2)], [((8, 64, 56, 56), 32), ((8, 128, 48, 48), 32)]))  # fmt: skip
def test_group_norm_large_mean_and_determinism(run_on, executor, shape, groups):
    with run_on(executor, torch.float32):
        check_group_norm_case(shape, groups, torch.float32, executor.device, mean=1e4, forward_only=True)
        x = torch.randn(shape, device=executor.device, requires_grad=True)
        w = torch.randn(shape[1], device=executor.device, requires_grad=True)
        grads = []
        for _ in range(2):
            (gw,) = torch.autograd.grad(normkit.group_norm(x, groups, w).square().sum(), w)
            grads.append(gw)
        assert torch.equal(grads[0], grads[1]), "dweight differs between runs"


# 16-bit rows held in shared memory in the backward (config.group_norm_smem_backward). With the
# config's bounds on rows, row length and channels a group opened (``opened``): a row in 12.25 chunks
# (the last one masked), 32 channels a group of HW = 256 (the kernel's widest [runs, channels] sums),
# HW = 200 (a multiple of 8, not of 16), groups of two long channels, one group of 4 channels, rows
# that do not divide evenly over the programs, one channel a group (InstanceNorm's case), 6 and 3
# channels a group (fewer than the kernel's power-of-two channel slots). As configured: shapes
# with enough rows (N = 0 here: one more sample than GROUP_NORM_SMEM_MIN_ROWS rows an SM need) of
# 16384 values, of 2, 16 and 1 channels a group.
SMEM_BWD_CASES = [((4, 256, 56, 56), 32, True), ((2, 512, 16, 16), 16, True), ((3, 64, 200), 2, True),
                  ((5, 64, 112, 112), 32, True), ((3, 4, 96, 96), 1, True), ((37, 64, 32, 32), 8, True),
                  ((3, 6, 64, 64), 6, True), ((4, 48, 32, 32), 8, True), ((5, 48, 64, 64), 16, True),
                  ((0, 64, 128, 64), 32, False), ((0, 512, 32, 32), 32, False),
                  ((0, 256, 128, 128), 256, False)]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape,groups,opened", SMEM_BWD_CASES, ids=str)
def test_group_norm_backward_rows_in_shared_memory(run_on, shape, groups, opened, dtype):
    """The shared-memory backward is chosen (asserted); the gradients match fp64, also about a large
    mean and without weight or bias; two backwards are bitwise equal; the backend with dy at an
    offset that breaks 16-byte alignment takes the one-program-per-row kernel and agrees."""
    from normkit.backends.cuda import config

    with config.forced(group_norm_smem_backward=True) if opened else contextlib.nullcontext():
        _check_group_norm_backward_rows_in_shared_memory(run_on, shape, groups, dtype, opened)


def _check_group_norm_backward_rows_in_shared_memory(run_on, shape, groups, dtype, opened):
    from normkit.backends.cuda import config, launch
    from normkit.backends.cuda import group_norm as gn

    with run_on(Executor("cuda", "cuda"), dtype):  # skips without a CUDA GPU
        device = torch.device("cuda")
        if not opened:  # at least GROUP_NORM_SMEM_MIN_ROWS rows an SM on this GPU
            rows = config.GROUP_NORM_SMEM_MIN_ROWS * config.sm_count(device)
            shape = (rows // groups + 1, *shape[1:])
        N, C, HW = shape[0], shape[1], math.prod(shape[2:])
        cfg = config.group_norm_smem_backward(N * groups, C // groups, HW, dtype, device)
        assert cfg is not None and cfg.smem and cfg.buffers * cfg.block_size >= C // groups * HW, cfg
        check_group_norm_case(shape, groups, dtype, device, seed=C)
        assert any(key[0] is gn._bwd_smem_kernel for key in launch._CACHE), "the kernel was not launched"
        check_group_norm_case(shape, groups, dtype, device, seed=C + 1, weight=False)
        check_group_norm_case(shape, groups, dtype, device, seed=C + 2, bias=False)
        check_group_norm_case(shape, groups, dtype, device, seed=C + 3, weight=False, bias=False)
        # about a large mean: |x - mean| stays ~1, so the 16-bit tolerance holds against fp64
        check_group_norm_case(shape, groups, dtype, device, seed=C + 4, mean=300.0)
        x = torch.randn(shape, device=device).to(dtype)
        dy = torch.randn(shape, device=device).to(dtype)
        w, b = torch.rand(C, device=device) + 0.5, torch.randn(C, device=device)
        runs = []
        for _ in range(2):
            leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
            normkit.group_norm(leaves[0], groups, leaves[1], leaves[2]).backward(dy)
            runs.append([t.grad for t in leaves])
        for name, first, second in zip(("dx", "dweight", "dbias"), *runs):
            assert torch.equal(first, second), f"{name} differs between runs"
        x3 = x.view(N, C, HW)
        dy3 = torch.empty(x.numel() + 1, dtype=dtype, device=device)[1:].view(N, C, HW)
        dy3.copy_(dy.view(N, C, HW))
        assert gn._smem_ok(x3, groups) and gn._smem_ok(x3, groups, dy.view(N, C, HW))
        assert not gn._smem_ok(x3, groups, dy3)
        assert not gn._smem_ok(x3, groups, dy.view(N, C, HW).float())  # dy not in x's dtype
        assert config.group_norm_bwd_strategy(N, C, HW, groups, dtype, device, False, True).kernel == "smem"
        assert config.group_norm_bwd_strategy(N, C, HW, groups, dtype, device, False, False).kernel == "rows"
        _, mean_, rstd_ = gn.group_norm_fwd(x3, w, b, groups, 1e-5)
        aligned = gn.group_norm_bwd(dy.view(N, C, HW), x3, w, mean_, rstd_, groups, b.dtype)
        unaligned = gn.group_norm_bwd(dy3, x3, w, mean_, rstd_, groups, b.dtype)
        tol = dict(atol=4e-3, rtol=4e-3) if dtype == torch.float16 else dict(atol=3e-2, rtol=3e-2)
        for name, got, ref in zip(("dx", "dweight", "dbias"), unaligned, aligned):
            torch.testing.assert_close(got.double(), ref.double(), **tol,
                                       msg=lambda m, n=name: f"{n} (unaligned dy): {m}")  # fmt: skip


@pytest.mark.parametrize("executor,shape", executor_params([((2, 3, 4, 5),)], [((8, 16, 14, 14),)]))
def test_instance_norm_running_stats_like_torch(run_on, executor, shape):
    """Several training steps update running stats as torch does; eval mode uses them."""
    with run_on(executor, torch.float32):
        dev = executor.device
        C = shape[1]
        w, b = torch.randn(C, device=dev), torch.randn(C, device=dev)
        ours = [torch.randn(C, device=dev), torch.rand(C, device=dev) + 0.5]
        theirs = [t.clone() for t in ours]
        for step in range(3):
            x = torch.randn(shape, device=dev) * (step + 1) + step
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ya = normkit.instance_norm(xa, *ours, w, b, momentum=0.2)
            yb = F.instance_norm(xb, *theirs, w, b, momentum=0.2)
            torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
            dy = torch.randn(shape, device=dev)
            ya.backward(dy)
            yb.backward(dy)
            torch.testing.assert_close(xa.grad, xb.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1], theirs[1], atol=1e-5, rtol=1e-5)
        x = torch.randn(shape, device=dev)
        torch.testing.assert_close(normkit.instance_norm(x, *ours, w, b, use_input_stats=False),
                                   F.instance_norm(x, *theirs, w, b, use_input_stats=False))  # fmt: skip


def test_group_norm_reference_matches_torch_and_gradcheck():
    g = torch.Generator().manual_seed(0)
    for shape, groups in (((3, 6, 4, 5), 3), ((2, 4), 2), ((2, 8, 9), 8)):
        x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True)
        b = torch.randn(shape[1], generator=g, dtype=torch.float64, requires_grad=True)
        torch.testing.assert_close(normkit.group_norm(x, groups, w, b), F.group_norm(x, groups, w, b))
        assert torch.autograd.gradcheck(lambda x, w, b, gr=groups: normkit.group_norm(x, gr, w, b), (x, w, b))


def test_group_norm_errors_name_the_argument():
    x = torch.randn(2, 6, 4)
    with pytest.raises(normkit.InvalidArgument, match="num_groups 4 does not divide the 6 channels"):
        normkit.group_norm(x, 4)
    with pytest.raises(normkit.InvalidArgument, match="num_groups must be a positive int, got 0"):
        normkit.group_norm(x, 0)
    with pytest.raises(normkit.InvalidArgument, match="weight has shape \\[4\\]; expected .*\\[6\\]"):
        normkit.group_norm(x, 3, torch.ones(4))
    with pytest.raises(normkit.InvalidArgument, match="input must have shape \\(N, C, \\*\\)"):
        normkit.group_norm(torch.randn(6), 3)
    with pytest.raises(normkit.InvalidArgument, match="more than 1 spatial element"):
        normkit.instance_norm(torch.randn(2, 6))
    with pytest.raises(normkit.InvalidArgument, match="use_input_stats=False needs running_mean"):
        normkit.instance_norm(x, use_input_stats=False)
    with pytest.raises(normkit.InvalidArgument, match="running_mean has shape \\[5\\]"):
        normkit.instance_norm(x, torch.zeros(5), torch.ones(6))


def test_group_norm_empty_like_torch():
    x = torch.randn(0, 6, 3, requires_grad=True)
    y = normkit.group_norm(x, 3)
    assert y.shape == F.group_norm(x, 3).shape
    y.sum().backward()
    assert x.grad.shape == x.shape
