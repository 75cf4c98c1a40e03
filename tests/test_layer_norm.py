"""LayerNorm and RMSNorm kernels of every backend vs the fp64 reference, forward and backward."""

import math
import zlib

import pytest
import torch
from conftest import DEVICE, executor_params

import normkit
from normkit.testing import (
    NORM_OPS as OPS,
    Executor,
    assert_close,
    check_case,
    fp64,
    make_inputs,
    public_results,
    reference_results,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]

# On devices: the full cross of row lengths that stress tiling and row counts that stress grids.
DEVICE_SHAPES = [(m, n) for m in (1, 3, 128, 1151) for n in (1, 7, 1023, 1024, 1025, 4096, 40999)]
# Under the interpreter: one shape per code path (fused single row / many rows per program, tile
# edges, multi-tile NPU rows, the CUDA looped path at 40999 > FUSED_MAX_N_BWD), kept small for CI.
INTERPRETER_SHAPES = [(1, 1), (3, 7), (1151, 7), (3, 1023), (1, 1024), (2, 1025), (2, 4096), (2, 40999)]
# The NPU kernels' many-rows cases over the interpreter's 4 programs: 67 short rows packed 64 a tile
# (two tiles, the second of 3 rows), 5 rows held whole in UB (1025 in a tile of 2048: one row a tile,
# a program takes two), and 5 rows looping over column tiles (4096 > config.ROW_NORM_WIDTH) in
# backward row chunks of 2, 2, 1.
NPU_INTERPRETER_SHAPES = [{(1151, 7): (67, 7), (2, 1025): (5, 1025), (2, 4096): (5, 4096)}.get(s, s)
                          for s in INTERPRETER_SHAPES]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("executor,shape", executor_params(
    [(s,) for s in INTERPRETER_SHAPES], [(s,) for s in DEVICE_SHAPES],
    [(s,) for s in NPU_INTERPRETER_SHAPES]))  # fmt: skip
def test_matches_reference(run_on, executor, shape, dtype, op):
    """Every shape and dtype against fp64; eps 0.1 for bf16 and fp32 (the default for fp16), where
    an eps ignored, or added outside the square root, is far outside tolerance."""
    eps = None if dtype == torch.float16 else 0.1
    with run_on(executor, dtype):
        check_case(op, shape, 1, dtype, executor.device, eps=eps, seed=zlib.crc32(f"{shape}{op}".encode()))


AFFINE = [(False, False), (True, False), (False, True)]  # (weight, bias); both is the main test


@pytest.mark.parametrize("op,affine", [(op, a) for op in OPS for a in AFFINE
                                       if op == "layer_norm" or not a[1]], ids=str)  # fmt: skip
@pytest.mark.parametrize("executor,shape,dtype", executor_params(
    [((3, 1025), torch.bfloat16), ((2, 40999), torch.float32)],
    [((128, 1025), torch.bfloat16), ((3, 40999), torch.float32), ((1151, 64), torch.float16)]))  # fmt: skip
def test_weight_bias_optional(run_on, executor, shape, dtype, affine, op):
    with run_on(executor, dtype):
        check_case(op, shape, 1, dtype, executor.device, weight=affine[0], bias=affine[1])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("executor,shape,ndim", executor_params(
    [((2, 3, 5, 7), 2), ((4, 6, 33), 1), ((2, 3, 2, 4, 8), 3)],
    [((2, 3, 5, 7), 2), ((4, 6, 33), 1), ((2, 3, 2, 4, 8), 3), ((8, 16, 32, 64), 2)]))  # fmt: skip
def test_leading_and_multidim_normalized_shape(run_on, executor, shape, ndim, op):
    with run_on(executor, torch.float32):
        check_case(op, shape, ndim, torch.float32, executor.device)


def _strided_inputs(kind, m, n, dtype, device, op):
    inputs = make_inputs(op, (m, n), 1, dtype, device, seed=7)
    x = inputs["x"]
    if kind == "row-strided":  # rows of a wider tensor: row stride 2n, no copy needed
        wide = torch.empty(m, 2 * n, dtype=dtype, device=device).copy_(torch.cat([x, x], dim=1))
        inputs["x"] = wide[:, n:]
    elif kind == "transposed":  # unit stride along rows: must be made row-contiguous
        inputs["x"] = x.t().contiguous().t()
    elif kind == "expanded":  # one row broadcast to m rows: row stride 0
        inputs["x"] = x[:1].expand(m, n)
    inputs["dy"] = inputs["dy"].t().contiguous().t()  # a non-contiguous gradient as well
    return inputs


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["row-strided", "transposed", "expanded"])
@pytest.mark.parametrize("executor,shape", executor_params(
    [((5, 1025),)], [((129, 4097),)], [((5, 1025),), ((3, 2100),)]))  # NPU: rows held in UB, and looped
def test_non_contiguous(run_on, executor, shape, kind, op):
    with run_on(executor, torch.float32):
        inputs = _strided_inputs(kind, *shape, torch.float32, executor.device, op)
        assert not inputs["x"].is_contiguous()
        ref = reference_results(op, eps=1e-5, **inputs)
        out = public_results(op, eps=1e-5, **inputs)
        for key, kind_ in (("y", "fwd"), ("dx", "bwd"), ("dweight", "param"), ("dbias", "param")):
            if ref[key] is not None:
                assert_close(out[key], ref[key], torch.float32, kind_, key, rows=shape[0])


@pytest.mark.parametrize("executor,shape", executor_params(
    [((3, 1024),), ((2, 40999),)], [((64, 1024),), ((8, 40999),), ((4, 1 << 20),)]))  # fmt: skip
def test_variance_survives_large_mean(run_on, executor, shape):
    """x = 1e4 + randn in fp32: rstd must match fp64 (E[x^2] - E[x]^2 would lose it entirely)."""
    with run_on(executor, torch.float32):
        inputs = make_inputs("layer_norm", shape, 1, torch.float32, executor.device, mean=1e4)
        check_large_mean(inputs, torch.float32)


# LayerNorm's fused forward with both moments in one reduction (config.one_read_moments: CUDA rows of
# 16385-32768 columns, 16-bit, layer_norm without the residual add): x[row, 0], the shift the
# moments are taken about, placed from the mean out to an outlier, so that rows take the one-read
# variance and the variance taken again about the mean (E[xs^2] > VAR_RATIO var) alike.
ONE_READ_SHIFTS = ["randn", "mean 300", "first column 0-4 std off", "first column 50 std off"]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ONE_READ_SHIFTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(64, 32768), (9, 20000)], ids=str)
def test_fused_forward_moments_in_one_read(run_on, shape, dtype, kind):
    """y, mean and rstd match fp64 (rstd to 1e-5) and a second call is bitwise equal."""
    from normkit.backends.cuda import config

    executor = Executor("cuda", "cuda")
    with run_on(executor, dtype):
        m, n = shape
        cfg = config.forward(m, n, dtype, torch.device("cuda"), "layer_norm")
        assert cfg.fused and config.one_read_moments(cfg, dtype, torch.device("cuda"), False, False), cfg
        g = torch.Generator().manual_seed(zlib.crc32(f"{shape}layer_norm{kind}".encode()))
        x = torch.randn(m, n, generator=g, dtype=torch.float64) + (300 if kind == "mean 300" else 0)
        if kind.startswith("first column"):
            off = 4 * torch.arange(m) / max(m - 1, 1) if kind.endswith("0-4 std off") else 50
            x[:, 0] = x[:, 1:].mean(1) + off * x[:, 1:].std(1)
        w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        b = torch.randn(n, generator=g, dtype=torch.float64)
        dev = executor.device
        x, w, b = (t.to(dtype).to(dev) for t in (x, w, b))
        h = x.double()
        want = torch.nn.functional.layer_norm(h, (n,), w.double(), b.double(), 1e-5)
        _, mean, rstd = normkit.backend_for(x.device).layer_norm_fwd(x, None, None, 1e-5)
        var = h.var(1, unbiased=False)
        torch.testing.assert_close(rstd.double(), torch.rsqrt(var + 1e-5), rtol=1e-5, atol=0)
        # the mean to 5e-4 std: fp32 sums of up to 32768 values about x[row, 0]
        torch.testing.assert_close(mean.double(), h.mean(1), rtol=0, atol=5e-4 * float(var.min().sqrt()))
        y = normkit.layer_norm(x, (n,), w, b, 1e-5)
        assert_close(y, want, dtype, "fwd", "y", rows=m)
        assert torch.equal(normkit.layer_norm(x, (n,), w, b, 1e-5), y)


def check_large_mean(inputs, dtype, rows=1):
    """rstd of the backend's forward to 1e-5 of fp64 and y through the public API, for inputs far
    from zero."""
    x = inputs["x"]
    _, _, rstd = normkit.backend_for(x.device).layer_norm_fwd(x, None, None, 1e-5)
    expected = torch.rsqrt(x.double().var(dim=-1, unbiased=False) + 1e-5)
    torch.testing.assert_close(rstd.double(), expected, rtol=1e-5, atol=0)
    out = public_results("layer_norm", eps=1e-5, **inputs)
    ref = reference_results("layer_norm", eps=1e-5, **inputs)
    assert_close(out["y"], ref["y"], dtype, "fwd", "y", rows=rows)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("executor,shape",
                         executor_params([((130, 1023),)], [((1151, 4096),), ((64, 65536),)]))  # fmt: skip
def test_fp32_weight_with_half_input(run_on, executor, shape, op):
    """fp32 weights with bf16 activations: output in bf16, dweight in fp32 (on the GPU at 65536 the
    backward's rows in parts hold the fp32 weight in shared memory)."""
    with run_on(executor, torch.bfloat16):
        inputs = make_inputs(op, shape, 1, torch.bfloat16, executor.device)
        for key in ("weight", "bias"):  # fp32 values no bf16 holds (a rounded weight would differ)
            if inputs[key] is not None:
                inputs[key] = inputs[key].float() * (1 + 2**-12)
        out = public_results(op, eps=1e-5, **inputs)
        ref = reference_results(op, eps=1e-5, **inputs)
        assert out["y"].dtype == torch.bfloat16 and out["dweight"].dtype == torch.float32
        assert_close(out["y"], ref["y"], torch.bfloat16, "fwd", "y")
        assert_close(out["dx"], ref["dx"], torch.bfloat16, "bwd", "dx")
        # the fp32 weight's gradient is summed in fp32 from exact bf16 products: fp32 tolerance (a
        # weight rounded to bf16 on the way would bring its gradient back rounded to bf16 too)
        assert_close(out["dweight"], ref["dweight"], torch.float32, "param", "dweight", shape[0])


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("executor,shape", executor_params(
    [((1151, 7),), ((5, 40999),)], [((4096, 1024),), ((1151, 4097),), ((64, 40999),)],
    [((67, 7),), ((5, 40999),)]))  # fmt: skip
def test_weight_grad_is_deterministic(run_on, executor, shape, op):
    """Two backward passes on the same inputs give bitwise-equal dweight / dbias / dx."""
    with run_on(executor, torch.bfloat16):
        check_deterministic(op, make_inputs(op, shape, 1, torch.bfloat16, executor.device))


def check_deterministic(op, inputs):
    """Two backward passes on the same inputs give bitwise-equal dx / dweight / dbias."""
    first = public_results(op, eps=1e-5, **inputs)
    second = public_results(op, eps=1e-5, **inputs)
    for key in ("dx", "dweight", "dbias"):
        if first[key] is not None:
            assert torch.equal(first[key], second[key]), f"{key} differs between runs"


# fp64 is offered by the CUDA backend (and the reference) so gradcheck can run on the kernels.
FP64 = [e for e in executor_params([((3, 9),), ((2, 40999),)], [((3, 9),), ((5, 40999),)])
        if e.values[0].backend == "cuda"]  # fmt: skip


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("executor,shape", FP64)
def test_fp64_kernels(run_on, executor, shape, op):
    with run_on(executor, torch.float64):
        check_case(op, shape, 1, torch.float64, executor.device)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("executor,shape", [e for e in executor_params([((3, 9),)], [((4, 33),)])
                                            if e.values[0].backend == "cuda"])  # fmt: skip
def test_gradcheck_cuda_kernels(run_on, executor, shape, op):
    with run_on(executor, torch.float64):
        inputs = make_inputs(op, shape, 1, torch.float64, executor.device)
        args = [inputs[k].requires_grad_() for k in ("x", "weight", "bias") if inputs[k] is not None]
        fn = getattr(normkit, op)
        assert torch.autograd.gradcheck(lambda *a: fn(a[0], shape[-1:], *a[1:], eps=1e-5), args)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("ex", [pytest.param(ex, id=ex.name, marks=mark) for ex, mark in DEVICE])
def test_one_million_columns(run_on, ex, dtype, op):
    """N = 2^20 on a device, fwd + bwd, both backends' kernels (the NPU's on the GPU and on an
    Ascend NPU): no row-length limit."""
    with run_on(ex, dtype):
        check_case(op, (3, 1 << 20), 1, dtype, ex.device)


@pytest.mark.parametrize("ex", [pytest.param(ex, id=ex.name, marks=mark) for ex, mark in DEVICE])
def test_more_than_2_31_elements_forward(run_on, ex):
    """layer_norm forward on 2^31 + 2^18 bf16 elements (4.3 GB): int64 offsets, checked at both ends
    (references in fp64 on the CPU for an NPU: testing.fp64)."""
    with run_on(ex, torch.bfloat16):
        m, n = (1 << 19) + 64, 4096
        assert m * n > 2**31
        free, _ = torch.get_device_module(ex.device).mem_get_info()
        if free < 3 * m * n * 2:
            pytest.skip(f"needs {3 * m * n * 2 / 2**30:.1f} GiB of free {ex.device} memory, "
                        f"has {free / 2**30:.1f}")
        g = torch.Generator(device=ex.device).manual_seed(0)
        x = torch.randn(m, n, device=ex.device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, device=ex.device, dtype=torch.bfloat16, generator=g)
        b = torch.randn(n, device=ex.device, dtype=torch.bfloat16, generator=g)
        y = normkit.layer_norm(x, (n,), w, b)
        for rows in (slice(0, 256), slice(m // 2 - 128, m // 2 + 128), slice(m - 256, m)):
            expected = torch.nn.functional.layer_norm(fp64(x[rows]), (n,), fp64(w), fp64(b))
            assert_close(y[rows], expected, torch.bfloat16, "fwd", f"y[{rows.start}:{rows.stop}]")
        assert math.prod(y.shape) == m * n


# Rows resident in shared memory (CUDA, 16-bit, N a multiple of 16 over the fused limit, up to what
# one program's shared memory holds; backends/cuda/smem.py): a masked last buffer (40000), more rows
# than programs (300) and so rows after next landing in the spare buffer, rows of full buffers
# (65536), LayerNorm's two-pass statistics with (98304) and without (114688, the largest row) the
# spare buffer (on the H100). LayerNorm rows past 65536 take rows in parts on the H100
# (FWD_PARTS_CASES); this test keeps the one-program kernel by taking LayerNorm's rows in parts out of
# the config (the path of GPUs with less shared memory, or a weight and bias too large to hold).
SMEM_SHAPES = [(1, 40000), (300, 40000), (3, 65536), (2, 98304), (140, 114688)]


@pytest.mark.cuda
@pytest.mark.parametrize("op,affine", [(op, a) for op in OPS for a in AFFINE + [(True, True)]
                                       if op == "layer_norm" or not a[1]], ids=str)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SMEM_SHAPES, ids=str)
def test_rows_in_shared_memory(run_on, shape, dtype, op, affine):
    """The one-program shared-memory forward (chosen for these shapes with LayerNorm's rows in parts
    taken out of the config, asserted) matches fp64, with and without weight / bias; misaligned rows
    of the same shape take the split forward and match too."""
    from normkit.backends.cuda import config

    without = {k: v for k, v in config.SMEM_SPLIT_FWD.items() if k != "layer_norm"}
    with config.tables(SMEM_SPLIT_FWD=without):  # (plans made under it forgotten on the way out)
        _check_rows_in_shared_memory(run_on, shape, dtype, op, affine)


def _check_rows_in_shared_memory(run_on, shape, dtype, op, affine):
    from normkit.backends.cuda import config, smem

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        cfg = config.forward(*shape, dtype, device, op, True)
        assert cfg.smem and not cfg.in_parts, cfg
        check_case(op, shape, 1, dtype, device, weight=affine[0], bias=affine[1],
                   seed=zlib.crc32(f"{shape}{op}{affine}".encode()))  # fmt: skip
        inputs = make_inputs(op, (shape[0], shape[1] + 8), 1, dtype, device, affine[0], affine[1], seed=3)
        for key in ("x", "dy"):
            inputs[key] = inputs[key][:, 8:]  # row stride N + 8: not a multiple of 16, no cp.async
        for key in ("weight", "bias"):
            if inputs[key] is not None:
                inputs[key] = inputs[key][8:]
        inputs["normalized_shape"] = (shape[1],)
        assert not smem.rows_fit(inputs["x"])
        out = public_results(op, eps=1e-5, **inputs)
        ref = reference_results(op, eps=1e-5, **inputs)
        assert_close(out["y"], ref["y"], dtype, "fwd", "y", rows=shape[0])


# The backward's rows in shared memory (config.SMEM_BWD): 16-bit rows of 8193-32768 elements whose
# dweight / dbias partials fit the registers; rows not a multiple of the 8192-element buffer too.
SMEM_BWD_CASES = [  # (op, shape, weight, bias, rows in parts: config.SMEM_SPLIT_BWD on the H100)
    ("layer_norm", (1, 9232), True, True, False), ("layer_norm", (7, 12304), True, True, False),
    ("layer_norm", (300, 16384), True, True, False), ("layer_norm", (133, 32768), True, False, True),
    ("layer_norm", (5, 32768), False, False, True), ("rms_norm", (300, 16384), True, False, False),
    ("rms_norm", (133, 32768), True, False, True), ("rms_norm", (2, 20000), False, False, False),
    ("layer_norm", (3, 24576), True, True, True), ("layer_norm", (257, 40000), True, True, True),
    ("layer_norm", (4, 131072), True, True, True), ("layer_norm", (2, 270336), False, True, True),
    ("rms_norm", (61, 65536), True, False, True), ("rms_norm", (1, 135168), False, False, True),
]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op,shape,weight,bias,parted", SMEM_BWD_CASES, ids=str)
@pytest.mark.usefixtures("in_parts")
def test_backward_rows_in_shared_memory(run_on, op, shape, weight, bias, parted, dtype):
    """The shared-memory backward (chosen for these cases, asserted; with rows in parts where said:
    K programs a row exchanging tagged row terms) matches fp64 in dx, dweight and dbias, twice over
    bitwise equal; rows whose stride is off 16 take another backward and match too."""
    from normkit.backends.cuda import config, smem

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        cfg = config.backward(*shape, dtype, device, op == "rms_norm", True, weight + bias)
        assert cfg.smem and (cfg.parts > 1) == parted, cfg
        check_case(op, shape, 1, dtype, device, weight=weight, bias=bias,
                   seed=zlib.crc32(f"{shape}{op}{weight}{bias}".encode()))  # fmt: skip
        inputs = make_inputs(op, shape, 1, dtype, device, weight, bias, seed=4)
        check_deterministic(op, inputs)
        wide = torch.randn(shape[0], shape[1] + 8, dtype=dtype, device=device)
        inputs["x"] = wide[:, 8:]  # row stride N + 8: not a multiple of 16, no cp.async
        assert not smem.rows_fit(inputs["x"])
        out = public_results(op, eps=1e-5, **inputs)
        ref = reference_results(op, eps=1e-5, **inputs)
        assert_close(out["dx"], ref["dx"], dtype, "bwd", "dx")
        for key in ("dweight", "dbias"):
            if ref[key] is not None:
                assert_close(out[key], ref[key], dtype, "param", key, shape[0])


# (op, shape, weight, bias): forward rows in parts (config.SMEM_SPLIT_FWD and _FP32 on the H100)
FWD_PARTS_CASES = [
    ("layer_norm", (4, 131072), True, True), ("layer_norm", (2, 270336), False, True),
    ("layer_norm", (9, 200000), True, False), ("layer_norm", (133, 131072), False, False),
    ("layer_norm", (2, 98304), True, True), ("layer_norm", (140, 114688), True, True),
    ("layer_norm", (5, 70000), True, True),
    ("rms_norm", (61, 131072), True, False), ("rms_norm", (1, 262144), False, False),
    ("rms_norm", (3, 150000), True, False),
]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("op,shape,weight,bias", FWD_PARTS_CASES, ids=str)
@pytest.mark.usefixtures("in_parts")
def test_forward_rows_in_parts(run_on, op, shape, weight, bias, dtype):
    """Rows past one program's shared memory in the forward (K programs a row, each holding its
    part and its part of the weight and bias, exchanging tagged row terms; chosen, asserted; parts
    cut evenly where N is not a multiple of the part width): y (and through the backward dx,
    dweight, dbias) match fp64, and two forwards are bitwise equal."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        held = (weight + bias) * dtype.itemsize
        cfg = config.forward(*shape, dtype, device, op, True, held)
        assert cfg.smem and cfg.parts > 1, cfg
        assert cfg.parts * cfg.part >= shape[1] > (cfg.parts - 1) * cfg.part, cfg
        check_case(op, shape, 1, dtype, device, weight=weight, bias=bias,
                   seed=zlib.crc32(f"fwd{shape}{op}{weight}{bias}".encode()))  # fmt: skip
        inputs = make_inputs(op, shape, 1, dtype, device, weight, bias, seed=6)
        first = public_results(op, eps=1e-5, **inputs)
        second = public_results(op, eps=1e-5, **inputs)
        for key in ("y", "dx", "dweight", "dbias"):
            if first[key] is not None:
                assert torch.equal(first[key], second[key]), f"{key} differs between runs"


def _check_parts_call(op, shape, dtype, seed):
    """One forward and backward of fresh inputs through the public API against fp64."""
    inputs = make_inputs(op, shape, 1, dtype, torch.device("cuda"), True, True, seed=seed)
    out = public_results(op, eps=1e-5, **inputs)
    ref = reference_results(op, eps=1e-5, **inputs)
    assert_close(out["y"], ref["y"], dtype, "fwd", "y")
    assert_close(out["dx"], ref["dx"], dtype, "bwd", "dx")
    for key in ("dweight", "dbias"):
        if ref[key] is not None:
            assert_close(out[key], ref[key], dtype, "param", key, shape[0])


def test_term_slots_below_the_safe_minimum_are_refused():
    """Rows in parts cycle a row group's tagged terms through ring slots; fewer than smem.MIN_RING
    could overwrite words a partner still reads: the workspace refuses them, and every configured
    ring has at least that many."""
    from normkit.backends.cuda import config, smem

    with pytest.raises(ValueError, match="ring=3 term slots"):
        smem.terms_workspace(1, 2, smem.MIN_RING - 1, torch.device("cpu"))
    rings = [*config.SMEM_SPLIT_RING.values(), *config.SMEM_SPLIT_BWD_RING.values()]
    assert min(rings) >= smem.MIN_RING, rings


@pytest.mark.cuda
@pytest.mark.parametrize("op,shape", [("layer_norm", (3, 131072)), ("rms_norm", (2, 262144)),
                                      ("layer_norm", (300, 131072))], ids=str)  # fmt: skip
@pytest.mark.usefixtures("in_parts")
def test_rows_in_parts_workspace_left_clean(run_on, op, shape):
    """The rows in parts' tagged-term workspace is kept per stream, and each launch leaves it zeroed
    (smem.release): calls of one shape in a row with fresh inputs (with M this small, every row's
    terms of the call before sit in the workspace under the same tags unless zeroed), on a second
    stream, and from a replayed CUDA graph (the workspace zeroed in the graph) match fp64, forward
    (y) and backward (dx, dweight, dbias), and the workspace is zero after them."""
    from normkit.backends.cuda import config, smem

    dtype = torch.bfloat16
    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        assert config.forward(*shape, dtype, device, op, True, 2 * dtype.itemsize).parts > 1
        assert config.backward(*shape, dtype, device, op == "rms_norm", True, 2).parts > 1
        for seed in range(3):
            _check_parts_call(op, shape, dtype, 30 + seed)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for seed in range(2):
                _check_parts_call(op, shape, dtype, 40 + seed)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for words, done in smem._WORKSPACES.values():
            assert not words.any() and not done.any(), "a launch left its workspace dirty"
        inputs = make_inputs(op, shape, 1, dtype, device, True, True, seed=50)
        x, size, weight, bias = (inputs[k] for k in ("x", "normalized_shape", "weight", "bias"))
        if op == "layer_norm":
            call = lambda: normkit.layer_norm(x, size, weight, bias, eps=1e-5)  # noqa: E731
        else:
            call = lambda: normkit.rms_norm(x, size, weight, eps=1e-5)  # noqa: E731
        with torch.cuda.stream(stream):  # warm up off the capture
            call()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = call()
        for seed in range(3):
            x.copy_(make_inputs(op, shape, 1, dtype, device, seed=60 + seed)["x"])
            graph.replay()
            ref = reference_results(op, eps=1e-5, **inputs)
            assert_close(y, ref["y"], dtype, "fwd", "y")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(8, 131072), (3, 200000), (5, 40000)], ids=str)
@pytest.mark.usefixtures("in_parts")
def test_forward_rows_in_parts_variance_survives_large_mean(run_on, shape, dtype):
    """x = 1000 + randn through the forward in parts (Chan's merge of each thread's, the part's and
    the parts' means and squared deviations; fp32 rows in parts from 32769, 16-bit from 65537):
    rstd matches fp64 to 1e-5."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), dtype):
        device = torch.device("cuda")
        parts = config.forward(*shape, dtype, device, "layer_norm", True).parts
        assert parts > 1 or (dtype.itemsize == 2 and shape[1] < 65537), parts
        inputs = make_inputs("layer_norm", shape, 1, dtype, device, mean=1e3, seed=7)
        check_large_mean(inputs, dtype, rows=shape[0])


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(300, 40000), (140, 114688)], ids=str)
def test_shared_memory_variance_survives_large_mean(run_on, shape):
    """fp16 x = 1000 + randn through the shared-memory forward (on the H100 with the spare buffer at
    40000, without at 114688): rstd matches fp64 (E[x^2] - E[x]^2 in fp32 would be off by ~6%)."""
    from normkit.backends.cuda import config

    with run_on(Executor("cuda", "cuda"), torch.float16):
        device = torch.device("cuda")
        assert config.forward(*shape, torch.float16, device, "layer_norm", True).smem
        inputs = make_inputs("layer_norm", shape, 1, torch.float16, device, mean=1e3, seed=5)
        check_large_mean(inputs, torch.float16, rows=shape[0])
