"""softmax / log_softmax kernels of every backend vs the fp64 reference, forward and backward."""

import zlib

import pytest
import torch
from conftest import executor_params

import normkit
from normkit import reference
from normkit.testing import SOFTMAX_OPS, Executor, assert_close, check_softmax_case, fp64, softmax_reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DEVICE_SHAPES = [(m, n) for m in (1, 3, 128, 1151) for n in (1, 7, 1023, 1024, 1025, 4096, 20001, 40999)]
# One shape per code path: fused single/many rows per program, tile edges, the looped (online
# max/sum) path at 40999 > the fused limit, multi-tile NPU rows. On CUDA, 20001 is a fused row in
# the forward and a looped row in the backward (config.LOOPED_SOFTMAX_BWD), 40999 a split row.
INTERPRETER_SHAPES = [(1, 1), (3, 7), (1151, 7), (3, 1023), (2, 1025), (2, 4096), (2, 40999)]
# The NPU kernels' many-rows case: 67 rows over the interpreter's 4 programs (uneven: 17, 17, 17, 16).
NPU_INTERPRETER_SHAPES = [(67, 7) if s == (1151, 7) else s for s in INTERPRETER_SHAPES]


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor,shape", executor_params(
    [(s,) for s in INTERPRETER_SHAPES], [(s,) for s in DEVICE_SHAPES],
    [(s,) for s in NPU_INTERPRETER_SHAPES]))  # fmt: skip
def test_matches_reference(run_on, executor, shape, dtype, op):
    with run_on(executor, dtype):
        check_softmax_case(op, shape, -1, dtype, executor.device, seed=zlib.crc32(f"{shape}{op}".encode()))


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("executor,shape,dim", executor_params(
    [((4, 5, 33), 0), ((4, 5, 33), 1), ((6, 2050), 0)],
    [((4, 5, 33), 0), ((4, 5, 33), 1), ((64, 128, 257), 1), ((4099, 64), 0)]))  # fmt: skip
def test_any_dim(run_on, executor, shape, dim, op):
    """A non-last dim is moved last (a transposing copy) and back."""
    with run_on(executor, torch.float32):
        check_softmax_case(op, shape, dim, torch.float32, executor.device)


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("executor,shape", executor_params(
    [((9, 33),), ((3, 40999),)], [((1151, 1025),), ((5, 40999),)]))  # fmt: skip
def test_neg_inf_entries_and_rows_like_torch(run_on, executor, shape, op):
    """-inf entries give 0 (softmax) / -inf (log_softmax); an all -inf row gives NaN, as torch."""
    with run_on(executor, torch.float32):
        check_softmax_case(op, shape, -1, torch.float32, executor.device, neg_inf=True)


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("executor,shape", executor_params([((3, 1025),)], [((128, 4096),)]))
def test_dtype_argument_casts_first(run_on, executor, shape, op):
    """dtype=float32 on a bf16 input: the cast happens first, output and math in fp32."""
    with run_on(executor, torch.float32):
        x = torch.randn(shape, dtype=torch.bfloat16, device=executor.device, requires_grad=True)
        y = getattr(normkit, op)(x, -1, dtype=torch.float32)
        expected = getattr(torch.nn.functional, op)(fp64(x), -1)
        assert y.dtype == torch.float32
        torch.testing.assert_close(fp64(y), expected, atol=2e-5, rtol=2e-5)
        y.sum().backward()
        assert x.grad.dtype == torch.bfloat16


def test_softmax_reference_matches_torch():
    g = torch.Generator().manual_seed(0)
    for shape, dim in (((3, 7), -1), ((4, 5, 6), 1), ((2, 3), 0), ((), 0)):
        x = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
        for op in SOFTMAX_OPS:
            ours, theirs = getattr(normkit, op)(x, dim), getattr(torch.nn.functional, op)(x, dim)
            torch.testing.assert_close(ours, theirs)
            w = torch.randn(shape, generator=g, dtype=torch.float64)
            (g1,) = torch.autograd.grad((ours * w).sum(), x)
            (g2,) = torch.autograd.grad((theirs * w).sum(), x)
            torch.testing.assert_close(g1, g2)
            fn = getattr(normkit, op)
            assert torch.autograd.gradcheck(lambda t, fn=fn, dim=dim: fn(t, dim), (x,))


@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_softmax_errors_name_the_argument(op):
    fn = getattr(normkit, op)
    with pytest.raises(normkit.InvalidArgument, match="dim 2 is out of range.*\\[-2, 1\\]"):
        fn(torch.randn(3, 4), 2)
    with pytest.raises(TypeError, match="dim must be an int"):
        fn(torch.randn(3, 4), 1.0)
    with pytest.raises(normkit.InvalidDtype, match="dtype must be one of"):
        fn(torch.randn(3, 4), -1, dtype=torch.int32)
    with pytest.raises(normkit.InvalidDtype, match="input has dtype torch.int64"):
        fn(torch.ones(3, 4, dtype=torch.long), -1)


@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (2, 0, 4)], ids=str)
def test_softmax_empty_like_torch(op, shape):
    x = torch.randn(shape, requires_grad=True)
    y = getattr(normkit, op)(x, -1)
    expected = getattr(torch.nn.functional, op)(x, -1)
    assert y.shape == expected.shape
    y.sum().backward()
    assert x.grad.shape == x.shape


# Rows resident in shared memory (CUDA, 16-bit, N a multiple of 16 over the fused limit, up to what
# one program's shared memory holds): as test_layer_norm.SMEM_SHAPES.
SMEM_SHAPES = [(1, 40000), (300, 40000), (3, 65536), (140, 114688)]
# Rows in parts (longer rows: K programs a row; fp32 from past the fused limit); N = 200000 and
# 270336 cut into parts whose last one is shorter, 133 rows over 132 SMs' row groups, one row.
PARTS_SHAPES = [(3, 131072), (133, 131072), (9, 262144), (2, 270336), (1, 200000)]
PARTS_CASES = [(shape, dtype) for shape in PARTS_SHAPES for dtype in DTYPES]
PARTS_CASES += [((3, 40000), torch.float32), ((300, 49152), torch.float32), ((2, 65536), torch.float32)]


def _check_rows_in_smem(op, shape, dtype):
    """Random rows; rows with -inf entries and an all -inf row (NaN, as torch); rows whose first
    half is -inf (a running max stays -inf over whole buffers, whole parts); misaligned rows (split
    rows) match fp64."""
    from normkit.backends.cuda import smem

    device = torch.device("cuda")
    seed = zlib.crc32(f"{shape}{op}{dtype}".encode())
    check_softmax_case(op, shape, -1, dtype, device, seed=seed)
    check_softmax_case(op, shape, -1, dtype, device, seed=seed + 1, neg_inf=True)
    g = torch.Generator().manual_seed(seed + 2)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[:, : shape[1] // 2] = float("-inf")  # at least two buffers of -inf, then finite values
    x = x.to(device)
    expected, _ = softmax_reference(op, x, x, -1)
    assert_close(getattr(normkit, op)(x, -1), expected, dtype, "fwd", "y")
    wide = torch.randn(shape[0], shape[1] + 8, generator=g, dtype=torch.float64).to(dtype).to(device)
    x = wide[:, 8:]  # row stride N + 8: not a multiple of 16, no cp.async
    assert not smem.rows_fit(x)
    expected, _ = softmax_reference(op, x, x, -1)
    assert_close(getattr(normkit, op)(x, -1), expected, dtype, "fwd", "y")


@pytest.mark.cuda
@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SMEM_SHAPES, ids=str)
def test_rows_in_shared_memory(run_on, shape, dtype, op):
    """The shared-memory forward (chosen for these shapes, asserted) matches fp64
    (:func:`_check_rows_in_smem`)."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        cfg = config.softmax(*shape, dtype, torch.device("cuda"), True)
        assert cfg.smem and not cfg.in_parts
        _check_rows_in_smem(op, shape, dtype)


def test_parts_mask_covers_every_chunk_past_a_part():
    """smem.parts_mask (which chunks of a part the forwards in parts mask) against the columns of
    every part, for rows cut as config.smem_split_forward cuts them (every kind's settings): every
    chunk that holds a column past its part is masked, and the mask is no wider than needed (every N
    a multiple of 16 up to four parts: each of the three masks occurs)."""
    import triton

    from normkit.backends.cuda import config, smem

    tables = (config.SMEM_SPLIT_FWD, config.SMEM_SPLIT_FWD_FP32)
    settings = {(s.chunk, s.buffers) for table in tables for kind in table for s in table[kind].settings}
    seen = set()
    for chunk, chunks in sorted(settings):
        for N in [*range(16, 4 * chunk * chunks + 1, 16), *(k * chunk * chunks for k in (5, 11))]:
            K = triton.cdiv(N, chunk * chunks)
            P = triton.cdiv(triton.cdiv(N, K), 16) * 16
            CHUNKS = triton.cdiv(P, chunk)  # as the config's split
            ragged = set()  # (last chunk?) of each chunk that holds a column past its part
            for k in range(K):
                cols = min(N, (k + 1) * P) - k * P
                ragged |= {c + 1 == CHUNKS for c in range(CHUNKS) if (c + 1) * chunk > cols}
            mask = smem.parts_mask(N, K, P, CHUNKS * chunk, chunk)
            assert mask == (2 if False in ragged else 1 if True in ragged else 0), (N, chunk, chunks, mask)
            seen.add(mask)
    assert seen == {0, 1, 2}


@pytest.mark.cuda
@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("shape,dtype", PARTS_CASES, ids=str)
@pytest.mark.usefixtures("in_parts")
def test_rows_in_parts(run_on, shape, dtype, op):
    """The forward in parts (chosen for these shapes, asserted) matches fp64 (:func:`_check_rows_in_smem`),
    also on rows of 1000 + 3 randn (the exponent formed as x - max, exact, not x * log2(e) less the
    max's); a second call gives the same bits."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        cfg = config.softmax(*shape, dtype, torch.device("cuda"), True)
        assert cfg.smem and cfg.in_parts and cfg.parts > 1
        _check_rows_in_smem(op, shape, dtype)
        g = torch.Generator().manual_seed(zlib.crc32(f"{shape}{op}{dtype}big".encode()))
        x = (1000 + 3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).cuda()
        y = getattr(normkit, op)(x, -1)
        assert_close(y, softmax_reference(op, x, x, -1)[0], dtype, "fwd", "y")
        assert torch.equal(y, getattr(normkit, op)(x, -1))


LOOPED_BWD_SHAPES = [(5, 16385), (3, 20001), (7, 32768)]


@pytest.mark.cuda
@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LOOPED_BWD_SHAPES, ids=str)
def test_backward_looped_rows(run_on, shape, dtype, op):
    """Rows of 16385-32768 take the looped backward (config.LOOPED_SOFTMAX_BWD, asserted): through the
    public API (with -inf entries and an all -inf row too) and through a training plan, dx matches
    fp64 from the saved y; a second call gives the same bits."""
    from normkit.backends.cuda import config, softmax

    log = op == "log_softmax"
    with run_on(Executor("cuda", "cuda"), dtype):
        cfg = config.softmax_backward(*shape, dtype, torch.device("cuda"), log)
        assert not cfg.fused and cfg.split == 1 and not cfg.smem, cfg
        seed = zlib.crc32(f"{shape}{op}{dtype}looped".encode())
        check_softmax_case(op, shape, -1, dtype, "cuda", seed=seed)
        check_softmax_case(op, shape, -1, dtype, "cuda", seed=seed + 1, neg_inf=True)
        g = torch.Generator().manual_seed(seed)
        x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype).cuda()
        dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).cuda()
        forward, backward = softmax.plan_softmax(x, log, grad=True)
        y = forward(x)
        dx = backward(dy, y)
        assert_close(dx, reference.softmax_bwd(dy.double(), y.double(), log), dtype, "bwd", "dx")
        assert torch.equal(dx, backward(dy, y))


@pytest.mark.cuda
@pytest.mark.parametrize("op", SOFTMAX_OPS)
@pytest.mark.usefixtures("in_parts")
def test_rows_in_parts_workspace_left_clean(run_on, op):
    """The forward in parts' tagged-term workspace is left zeroed by each launch (as the row norms',
    test_layer_norm): calls in a row with fresh inputs (3 rows: every row's terms of the call before
    would sit under the same tags unless zeroed), on a second stream, and from a replayed CUDA
    graph match fp64, and the workspace is zero after them."""
    from normkit.backends.cuda import smem

    dtype, shape = torch.bfloat16, (3, 131072)
    fn = getattr(normkit, op)

    def fresh(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype).cuda()

    def check(x, y):
        assert_close(y, softmax_reference(op, x, x, -1)[0], dtype, "fwd", "y")

    with run_on(Executor("cuda", "cuda"), dtype):
        for seed in range(3):
            x = fresh(seed)
            check(x, fn(x, -1))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for seed in range(2):
                x = fresh(10 + seed)
                check(x, fn(x, -1))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for words, done in smem._WORKSPACES.values():
            assert not words.any() and not done.any(), "a launch left its workspace dirty"
        x = fresh(20)
        with torch.cuda.stream(stream):  # warm up off the capture
            fn(x, -1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn(x, -1)
        for seed in range(3):
            x.copy_(fresh(30 + seed))
            graph.replay()
            check(x, y)


@pytest.mark.cuda
@pytest.mark.parametrize("op", SOFTMAX_OPS)
def test_remembered_plan_serves_only_its_call(op, monkeypatch):
    """normkit.softmax finds the plan functional remembered for a last-dim call without functional's
    layers (distributed._softmax, by functional.softmax_key); a call along another dim of a
    same-shaped input, a 1-dim input, or a training call after inference calls must each get their
    own result, every call."""
    if not torch.cuda.is_available():
        pytest.skip("cuda: no CUDA GPU available")
    g = torch.Generator().manual_seed(zlib.crc32(op.encode()))
    fn, ref = getattr(normkit, op), getattr(torch, op)
    for shape, dim, train in [((64, 64), -1, False), ((64, 64), 1, False), ((64, 64), 0, False),
                              ((64, 64), -1, False), ((64, 64), -2, False), ((64, 64), -1, True),
                              ((64, 64), 0, True), ((64, 64), 1, True), ((64,), 0, False), ((64,), -1, True),
                              ((64, 64), -1, False), ((64, 64), -1, True)]:  # fmt: skip
        x = (3 * torch.randn(shape, generator=g, dtype=torch.float64)).float().cuda().requires_grad_(train)
        y = fn(x, dim)
        x64 = x.detach().cpu().double().requires_grad_(train)
        y64 = ref(x64, dim)
        assert_close(y, y64.detach(), torch.float32, "fwd", f"{op} y, dim {dim}")
        if train:
            dy = torch.randn(shape, generator=g, dtype=torch.float64)
            y.backward(dy.float().cuda())
            y64.backward(dy)
            assert_close(x.grad, x64.grad, torch.float32, "bwd", f"{op} dx, dim {dim}")
    # and a repeated last-dim call is served before functional's layers (distributed._softmax)
    x = torch.randn(64, 64, generator=g, dtype=torch.float64).float().cuda()
    fn(x, -1)
    monkeypatch.setattr(normkit.functional, "_softmax", None)  # (calling it would raise)
    assert_close(fn(x, -1), ref(x.double().cpu(), -1), torch.float32, "fwd", f"{op} y, remembered")
