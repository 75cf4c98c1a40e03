"""CPU tensors with no backend override: torch's own operators serve (normkit/cpu.py, issue 41).

Every op against the fp64 reference through the public API (the same checks as the kernels get),
that torch's operators did serve (the reference is never called), and that the calls normkit/cpu.py
leaves to the full path still get normkit's results and errors.
"""

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit import ops, plans, reference
from normkit.errors import InvalidArgument
from normkit.testing import (check_add_norm_case, check_batch_norm_case, check_case, check_group_norm_case,
                             check_softmax_case)  # fmt: skip

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
ROW_SHAPES = [(16, 4096), (1, 8), (7, 33), (3, 5, 64), (1151, 1024)]  # 1151 rows: 16-bit dweight sums


@pytest.fixture
def no_reference(monkeypatch):
    """Fail a test whose normkit call takes the full path (normkit.functional, whose plans run the
    backend: the reference on CPU): torch's operators must serve it. Every op there looks up its
    plan (``plans.stored``) or makes one (``plans.make``); the operators are failed too. (The tests'
    fp64 oracle calls normkit.reference directly.)"""
    for name in ("stored", "make"):
        monkeypatch.setattr(plans, name, lambda *a, name=name, **k: pytest.fail(f"plans.{name} ran"))
    for name in ("layer_norm_fwd", "rms_norm_fwd", "softmax_fwd", "add_norm_fwd", "group_norm_fwd",
                 "batch_norm_train", "batch_norm_fwd", "batch_norm_stats"):  # fmt: skip
        monkeypatch.setattr(ops, name, lambda *a, name=name, **k: pytest.fail(f"ops.{name} ran"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_default_eps_is_the_input_dtypes(no_reference, dtype):
    """eps=None is torch.finfo(input.dtype).eps (as documented), also where torch's CPU kernel would
    take its math dtype's (fp32's): rows of small values, where the two differ by 20-80%, with no
    weight, a weight of the input's dtype and an fp32 one; add_rms_norm (h = x + 0 = x) alike."""
    x = (torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    expected = F.rms_norm(x.double(), (16,), eps=torch.finfo(dtype).eps)
    for weight in (None, torch.ones(16, dtype=dtype), torch.ones(16)):
        zero = torch.zeros_like(x)
        for y in (normkit.rms_norm(x, (16,), weight), normkit.add_rms_norm(x, zero, 16, weight)):
            assert y.dtype == dtype
            torch.testing.assert_close(y.double(), expected, atol=0, rtol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("affine", [(True, True), (False, False), (True, False)], ids=str)
def test_row_norms(no_reference, op, shape, dtype, affine):
    check_case(op, shape, 1, dtype, "cpu", weight=affine[0], bias=affine[1], eps=0.1, seed=len(shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_weights_with_16bit_inputs(no_reference, dtype):
    """fp32 parameters with 16-bit activations (and RMSNorm's 16-bit weight), rounded once from
    the fp32 result (a weight applied after rounding would flip about a quarter of them)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g).to(dtype)
    w = torch.rand(256, generator=g) + 0.5
    b = torch.randn(256, generator=g)
    pairs = ((normkit.layer_norm(x, (256,), w, b), F.layer_norm(x.double(), (256,), w.double(), b.double())),
             (normkit.rms_norm(x, (256,), w, 1e-6), F.rms_norm(x.double(), (256,), w.double(), 1e-6)),
             (normkit.rms_norm(x, (256,), w.to(dtype), 1e-6),  # 16-bit weight: torch's fused kernel
              F.rms_norm(x.double(), (256,), w.to(dtype).double(), 1e-6)))
    for got, want in pairs:
        assert got.dtype == dtype
        expected = want.to(dtype)  # one rounding of the exact result
        assert (got != expected).float().mean() < 0.02, "not rounded once from the fp32 result"
        torch.testing.assert_close(got.double(), want, atol=0, rtol=torch.finfo(dtype).eps * 2)


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _native_cpu():
    """The native CPU extension, built here if it is not (CI has a C++ compiler); the test is skipped
    where it cannot be (no compiler, NORMKIT_NATIVE=0), with the reason."""
    from normkit import native

    found = native.module(build=True, kind="cpu")
    if found is None:
        pytest.skip(f"native CPU extension: {native.why('cpu')}")
    return found


@pytest.fixture(scope="module")
def native_layer_norm():
    """The native extension's CPU LayerNorm."""
    return _native_cpu().cpu_layer_norm


@pytest.fixture(scope="module")
def native_group_norm():
    """The native extension's CPU GroupNorm."""
    return _native_cpu().cpu_group_norm


@pytest.mark.parametrize("route", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", ["16-bit", "fp32", "none"])
@pytest.mark.parametrize("m,n,mean", [(1151, 1024, 3.0), (32768, 8, 300.0), (16, 64, 300.0)],
                         ids=["1151x1024", "32768x8-mean300", "16x64-mean300"])  # fmt: skip
def test_16bit_layer_norm_gradients(no_reference, request, monkeypatch, route, dtype, params, m, n, mean):
    """A 16-bit LayerNorm that gets gradients, on each of its routes: the native operator
    (normkit/native_cpu.cpp: fp32 statistics, parameter gradients summed in fp32 over blocks of rows)
    and, without the extension, torch's operators (from 2^18 elements normkit.cpu._HalfLayerNorm: fp32
    statistics, torch's fp32 backward in chunks of rows, 1151 rows in chunks of 256; smaller: fp32
    copies): against fp64 torch on the same values, within 2 ulps (torch's 16-bit CPU path: dx 49
    ulps off for rows of 8 around 300, from its 16-bit statistics), fp32 parameters' gradients to
    fp32 accuracy (torch sums them in 16-bit: bf16 12.6% off at 8192 rows); then a gradient
    penalty's second-order gradients (the native operator's create_graph backward is the fp32 route)."""
    from normkit import cpu

    fused = request.getfixturevalue("native_layer_norm") if route == "native" else None
    monkeypatch.setattr(cpu, "_native_layer_norm", lambda: fused)
    g = torch.Generator().manual_seed(5)
    p = {"16-bit": dtype, "fp32": torch.float32, "none": None}[params]
    x = (torch.randn(m, n, generator=g) * 2 + mean).to(dtype).requires_grad_()
    w = None if p is None else (torch.rand(n, generator=g) + 0.5).to(p).requires_grad_()
    b = None if p is None else torch.randn(n, generator=g).to(p).requires_grad_()
    dy = torch.randn(m, n, generator=g).to(dtype)
    ins = [t for t in (x, w, b) if t is not None]
    y = normkit.layer_norm(x, (n,), w, b)
    assert ("CpuHalfLayerNorm" in y.grad_fn.name()) == (route == "native"), y.grad_fn.name()
    got = torch.autograd.grad(y, ins, dy)
    ref = [t.detach().double().requires_grad_() for t in ins]
    want = torch.autograd.grad(F.layer_norm(ref[0], (n,), *(ref[1:] or (None, None))), ref, dy.double())
    eps = torch.finfo(dtype).eps
    assert [t.dtype for t in got] == [t.dtype for t in ins]
    assert _rel(got[0], want[0]) < 2 * eps, "dx"
    for name, a, e in zip(("dweight", "dbias"), got[1:], want[1:]):
        assert _rel(a, e) < (2 * eps if p is dtype else 5e-5), name  # fp32 statistics of rows around 300
    if p is None or mean > 100:
        return
    # second order: d/d(x, w, b) of a penalty on the first-order gradients, on a small case (fp32
    # copies) and on 2^18 elements (_HalfLayerNorm's create_graph backward)
    for rows, cols in ((16, 64), (256, 1024)):
        xs, ws, bs = (t.detach()[:rows, :cols] if t.dim() == 2 else t.detach()[:cols] for t in (x, w, b))
        dys = dy[:rows, :cols]

        def penalty_grads(fn, ins, dys=dys, cols=cols):
            g1 = torch.autograd.grad((fn(ins[0], (cols,), ins[1], ins[2]) * dys.to(ins[0].dtype)).sum(), ins,
                                     create_graph=True)  # fmt: skip
            return torch.autograd.grad(sum((t.float() ** 2).sum() for t in g1), ins, allow_unused=True)

        got2 = penalty_grads(normkit.layer_norm, [t.clone().requires_grad_() for t in (xs, ws, bs)])
        want2 = penalty_grads(F.layer_norm, [t.double().requires_grad_() for t in (xs, ws, bs)])
        assert got2[2] is None and want2[2] is None  # the bias's gradient, sum(dy), depends on no input
        for i, (a, e) in enumerate(zip(got2[:2], want2[:2])):
            assert _rel(a, e) < 8 * eps, f"second order {rows}x{cols}, input {i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((16, 4096), -1), ((4, 8, 5), 1), ((9,), 0)], ids=str)
def test_softmax(no_reference, op, shape, dim, dtype):
    check_softmax_case(op, shape, dim, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("residual", [True, False])
def test_add_norms(no_reference, op, dtype, residual):
    check_add_norm_case(op, (16, 512), dtype, "cpu", residual=residual)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_add_norms_fp32_residual_stream(no_reference, op):
    check_add_norm_case(op, (16, 512), torch.bfloat16, "cpu", residual_dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_add_rms_norm_fp32_weight_rounds_once(no_reference, dtype):
    """16-bit x and residual with an fp32 weight: h = x + residual rounded once to x's dtype, then
    RMSNorm in fp32 rounded once (torch's mixed-dtype rms_norm would round twice)."""
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(64, 256, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(256, generator=g) + 0.5
    for eps in (None, 0.1):
        y, h = normkit.add_rms_norm(x, r, (256,), w, eps=eps, prenorm=True)
        h_exact = x.double() + r.double()
        assert h.dtype == y.dtype == dtype and torch.equal(h, h_exact.to(dtype))
        want = F.rms_norm(h.double(), (256,), w.double(), torch.finfo(dtype).eps if eps is None else eps)
        assert (y != want.to(dtype)).float().mean() < 0.02, "not rounded once from the fp32 result"
        torch.testing.assert_close(y.double(), want, atol=0, rtol=torch.finfo(dtype).eps * 2)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_softmax_dtype_in_stacklevel_slot_is_refused_on_cpu(op):
    """The CPU fast path keeps functional's refusal of a dtype passed as the third positional
    argument (torch's _stacklevel)."""
    with pytest.raises(TypeError, match="_stacklevel"):
        getattr(normkit, op)(torch.randn(2, 3), -1, torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,groups", [((4, 32, 7, 7), 8), ((2, 6, 33), 6), ((8, 512), 32),
                                          ((3, 8, 1), 4)], ids=str)  # (3, 8, 1): groups of 2 values
def test_group_norm(no_reference, shape, groups, dtype):
    check_group_norm_case(shape, groups, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", ["16-bit", "fp32", "none"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("groups", [32, 1], ids=["groups-of-2", "groups-of-64"])
def test_16bit_group_norm_gradients(no_reference, dtype, params, layout, groups):
    """A 16-bit GroupNorm that gets gradients (torch's mixed-dtype operator with fp32 parameters) on
    inputs around 15x their spread: y and dx within 2 ulps of fp64 torch on the same values (torch's
    16-bit CPU backward: 2-8 ulps there at groups of 64, hundreds at groups of 2), fp32 parameters'
    gradients to fp32 accuracy, 16-bit ones within 2 ulps; the layout kept. torch's channels-last CPU
    kernel is less accurate on such inputs in fp32 too (groups of 2: y up to 3 ulps, dweight 2e-4),
    whichever dtype it is given: 4 ulps and 5e-4 there."""
    g = torch.Generator().manual_seed(6)
    p = {"16-bit": dtype, "fp32": torch.float32, "none": None}[params]
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = (torch.randn(64, 64, 1, 1, generator=g) * 2 + 30).to(dtype).to(memory_format=fmt).requires_grad_()
    w = None if p is None else (torch.rand(64, generator=g) + 0.5).to(p).requires_grad_()
    b = None if p is None else torch.randn(64, generator=g).to(p).requires_grad_()
    dy = torch.randn(64, 64, 1, 1, generator=g).to(dtype)
    ins = [t for t in (x, w, b) if t is not None]
    y = normkit.group_norm(x, groups, w, b)
    got = torch.autograd.grad(y, ins, dy)
    ref = [t.detach().double().requires_grad_() for t in ins]
    want_y = F.group_norm(ref[0], groups, *(ref[1:] or (None, None)))
    want = torch.autograd.grad(want_y, ref, dy.double())
    ulps, fp32_tol = (4, 5e-4) if layout == "channels_last" else (2, 5e-5)
    eps = torch.finfo(dtype).eps
    assert y.dtype == dtype and y.is_contiguous(memory_format=fmt)
    assert [t.dtype for t in got] == [t.dtype for t in ins]
    assert _rel(y, want_y) < ulps * eps, "y"
    assert _rel(got[0], want[0]) < ulps * eps, "dx"
    for name, a, e in zip(("dweight", "dbias"), got[1:], want[1:]):
        assert _rel(a, e) < (ulps * eps if p is dtype else fp32_tol), name


# (N, C, *) shapes, groups, the inputs' mean: groups of 98 values in 2 channels; 4 values (2 x 2) around
# 300; a 2-D input (channels are the values: groups of 16) around 300; groups of 25600 values (chunks
# of 1024); 2400 groups of 32 values (3 blocks of rows: the parameter sums added block after block).
GN_CASES = [((8, 64, 7, 7), 32, 3.0), ((64, 16, 2), 8, 300.0), ((32, 96), 6, 300.0),
            ((4, 32, 40, 40), 2, 3.0), ((600, 8, 16), 4, 300.0)]  # fmt: skip
GN_IDS = ["8x64x7x7-g32", "64x16x2-g8-mean300", "32x96-g6-mean300", "4x32x40x40-g2", "600x8x16-g4-mean300"]


def _gn_inputs(shape, p, dtype, mean, seed=7):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    x = (torch.randn(shape, generator=g) * 2 + mean).to(dtype).requires_grad_()
    w = None if p is None else (torch.rand(C, generator=g) + 0.5).to(p).requires_grad_()
    b = None if p is None else torch.randn(C, generator=g).to(p).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("route", ["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", ["16-bit", "fp32", "none"])
@pytest.mark.parametrize("shape,groups,mean", GN_CASES, ids=GN_IDS)
def test_16bit_group_norm_routes(no_reference, request, monkeypatch, route, dtype, params, shape, groups,
                                 mean):  # fmt: skip
    """A 16-bit GroupNorm that gets gradients, on each of its routes: the native operator
    (normkit/native_cpu.cpp: fp32 statistics, parameter gradients summed in fp32 over blocks of rows)
    and, without the extension, torch's mixed-dtype operator with fp32 parameters: y and dx within 2
    ulps of fp64 torch on the same values, fp32 parameters' gradients to 5e-5, 16-bit ones within 2
    ulps; then a gradient penalty's second-order gradients within 8 ulps (the native operator's
    create_graph backward: the fp32 composite on x less its groups' means, also around 300; torch's
    route: around 3 only)."""
    from normkit import cpu

    fused = request.getfixturevalue("native_group_norm") if route == "native" else None
    monkeypatch.setattr(cpu, "_native_group_norm", lambda: fused)
    p = {"16-bit": dtype, "fp32": torch.float32, "none": None}[params]
    x, w, b, dy = _gn_inputs(shape, p, dtype, mean)
    ins = [t for t in (x, w, b) if t is not None]
    y = normkit.group_norm(x, groups, w, b)
    assert ("CpuHalfGroupNorm" in y.grad_fn.name()) == (route == "native"), y.grad_fn.name()
    got = torch.autograd.grad(y, ins, dy)
    ref = [t.detach().double().requires_grad_() for t in ins]
    want_y = F.group_norm(ref[0], groups, *(ref[1:] or (None, None)))
    want = torch.autograd.grad(want_y, ref, dy.double())
    eps = torch.finfo(dtype).eps
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert [t.dtype for t in got] == [t.dtype for t in ins]
    assert _rel(y, want_y) < 2 * eps, "y"
    assert _rel(got[0], want[0]) < 2 * eps, "dx"
    for name, a, e in zip(("dweight", "dbias"), got[1:], want[1:]):
        assert _rel(a, e) < (2 * eps if p is dtype else 5e-5), name
    if p is None or x.numel() > 10**5 or route == "torch" and mean > 100:
        return  # (torch's fp32 double backward works on x itself: groups around 300 lose it)

    def penalty_grads(fn, ins):  # d/d(x, w, b) of a penalty on the first-order gradients
        g1 = torch.autograd.grad((fn(ins[0], groups, ins[1], ins[2]) * dy.to(ins[0].dtype)).sum(), ins,
                                 create_graph=True)  # fmt: skip
        return torch.autograd.grad(sum((t.float() ** 2).sum() for t in g1), ins, allow_unused=True)

    got2 = penalty_grads(normkit.group_norm, [t.detach().clone().requires_grad_() for t in (x, w, b)])
    want2 = penalty_grads(F.group_norm, [t.detach().double().requires_grad_() for t in (x, w, b)])
    assert got2[2] is None and want2[2] is None  # the bias's gradient, sum(dy), depends on no input
    for i, (a, e) in enumerate(zip(got2[:2], want2[:2])):
        assert a.dtype == (x, w)[i].dtype
        assert _rel(a, e) < 8 * eps, f"second order, input {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_native_group_norm_edges(no_reference, native_group_norm, monkeypatch, dtype):
    """The native GroupNorm: parameter gradients the same bits on 1 thread as on 2 (fixed blocks,
    added in order); only what it gets: x's gradient alone, dweight without dbias (a weight without
    gradient); a NaN in x makes its group's y and dx NaN (not inf: the rounding's NaN fallback) and
    leaves the others' exact; a channels-last input keeps torch's kernels (and its layout); a weight
    of the wrong shape is refused by the operator, and the call left to the full path."""
    from normkit import cpu

    monkeypatch.setattr(cpu, "_native_group_norm", lambda: native_group_norm)
    x, w, b, dy = _gn_inputs((600, 8, 16), torch.float32, dtype, 300.0)
    threads = torch.get_num_threads()
    try:
        sums = []
        for n in (1, 2):
            torch.set_num_threads(n)
            sums.append(torch.autograd.grad(normkit.group_norm(x, 4, w, b), (x, w, b), dy))
    finally:
        torch.set_num_threads(threads)
    for a, e in zip(*sums):
        assert torch.equal(a, e)
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.group_norm(ref[0], 4, ref[1], ref[2]), ref, dy.double())
    (dx,) = torch.autograd.grad(normkit.group_norm(x, 4, w.detach(), b.detach()), (x,), dy)
    assert torch.equal(dx, sums[0][0])
    y = normkit.group_norm(x.detach(), 4, w, b.detach())
    (dw,) = torch.autograd.grad(y, (w,), dy)
    assert _rel(dw, want[1]) < 5e-5
    xn = x.detach().clone()
    xn[3, 2, 5] = float("nan")  # sample 3, group 1
    xn.requires_grad_()
    y = normkit.group_norm(xn, 4, w, b)
    (dx,) = torch.autograd.grad(y, (xn,), dy)
    for t, clean in ((y, normkit.group_norm(x, 4, w, b)), (dx, sums[0][0])):
        assert t[3, 2:4].isnan().all() and not t.isinf().any()
        t[3, 2:4] = 0
        clean = clean.detach().clone()
        clean[3, 2:4] = 0
        assert torch.equal(t.detach(), clean)
    xcl = x.detach()[:8].reshape(8, 8, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    y = normkit.group_norm(xcl, 4, w, b)
    assert "CpuHalfGroupNorm" not in y.grad_fn.name() and y.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="a parameter of"):
        native_group_norm(x, torch.ones(4, 2), None, 4, 1e-5)
    assert cpu.group_norm(x, 4, torch.ones(4, 2, requires_grad=True), None, 1e-5) is None  # the full path


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.float16 else t


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_fp16_rows_the_same_bits_with_and_without_f16c(op):
    """The native operators' fp16 rows through the CPU's F16C conversions (fp32 rows, converted in
    steps of 8) and through the portable ones (a CPU without F16C): the same bits, forward and every
    gradient, for rows with a tail of fewer than 8 values, rows around 300, fp16 / fp32 / no
    parameters, and each subset of gradients (dx alone, dweight and dbias alone). The fp16 tests
    against fp64 above run the F16C rows where the CPU has them."""
    lib = _native_cpu()
    if not lib.f16c(True):
        pytest.skip("this CPU has no AVX2 + F16C: the portable conversions alone run (tested above)")
    gen = torch.Generator().manual_seed(5)
    cases = []
    for shape, mean, params in [((1, 8), 0.0, "fp16"), ((3, 7), 300.0, "fp32"), ((5, 13), 0.0, None),
                                ((2, 1030), 300.0, "fp16"), ((4, 40999), 0.0, "fp16")]:  # fmt: skip
        n = shape[-1] if op == "layer_norm" else shape[1]
        if op == "group_norm":
            shape, n = {(1, 8): ((1, 8), 8), (3, 7): ((3, 6, 7), 6), (5, 13): ((5, 12, 3, 5), 12),
                        (2, 1030): ((2, 10, 103), 10), (4, 40999): ((4, 8, 129, 31), 8)}[shape]  # fmt: skip
        x = (torch.randn(shape, generator=gen) * 3 + mean).half()
        dtype = torch.float16 if params == "fp16" else torch.float32
        w = None if params is None else (torch.rand(n, generator=gen) + 0.5).to(dtype)
        b = None if params is None else torch.randn(n, generator=gen).to(dtype)
        cases.append((x, w, b, torch.randn(shape, generator=gen).half()))

    def run(x, w, b, dy, wants):
        leaves = [t.detach().clone().requires_grad_(i in wants) if t is not None else None
                  for i, t in enumerate((x, w, b))]  # fmt: skip
        if op == "layer_norm":
            y = lib.cpu_layer_norm(leaves[0], leaves[1], leaves[2], [x.shape[-1]], 1e-5)
        else:
            y = lib.cpu_group_norm(leaves[0], leaves[1], leaves[2], 2, 1e-5)
        return [y, *torch.autograd.grad(y, [leaves[i] for i in wants], dy)]

    try:
        for x, w, b, dy in cases:
            for wants in ((0, 1, 2), (0,), (1, 2)) if w is not None else ((0,),):
                got = {}
                for on in (True, False):
                    assert lib.f16c(on) is on
                    got[on] = run(x, w, b, dy, wants)
                for a, e in zip(got[True], got[False], strict=True):
                    assert a.dtype == e.dtype and torch.equal(_bits(a), _bits(e)), (x.shape, wants)
    finally:
        lib.f16c(True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(8, 16, 5, 5), (16, 4096)], ids=str)
def test_batch_norm(request, shape, dtype, training):
    if dtype != torch.float64:  # (fp32 running statistics with an fp64 input: torch refuses, the
        request.getfixturevalue("no_reference")  # full path serves; docs/testing.md)
    check_batch_norm_case(shape, dtype, "cpu", training=training)


@pytest.mark.parametrize("route", ["door", "python"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("running", ["none", "input", "fp32"])
@pytest.mark.parametrize("params", [True, False], ids=["affine", "no-affine"])
def test_16bit_batch_norm_training_statistics_in_fp32(no_reference, monkeypatch, route, dtype, running,
                                                     params):
    """16-bit training BatchNorm, x = 3 + 0.01 randn: fp32 statistics whatever the running statistics'
    and parameters' dtypes (torch's operator with 16-bit or no parameters rounds the batch mean to
    16 bits first: errors of 0.08-0.14 on outputs of unit scale; normkit.cpu gives it fp32 ones), on
    the CPU door (where the extension is built; it serves the calls whose tensors are all of the
    input's dtype) and on the Python path (the door off). Outputs, gradients and the running
    statistics' update against fp64."""
    from normkit import cpu

    if route == "python":
        monkeypatch.setattr(cpu, "DOOR", None)
    check_batch_norm_case((4, 8, 64), dtype, "cpu", mean=3.0, std=0.01, running=running, weight=params,
                          bias=params)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("params", [True, False], ids=["affine", "no-affine"])
def test_16bit_instance_norm_statistics_in_fp32(no_reference, dtype, params):
    """instance_norm of a 16-bit input (torch's operator, given fp32 parameters): as BatchNorm above,
    against fp64, forward and backward."""
    check_group_norm_case((4, 8, 64), 0, dtype, "cpu", mean=3.0, std=0.01, weight=params, bias=params,
                          instance=True)  # fmt: skip


def test_dropout_and_edge_cases_take_the_full_path():
    """What torch's operators would get wrong for normkit's semantics goes through the reference:
    dropout (normkit's mask), eps = 0 InstanceNorm of a constant channel (NaN, as normkit's
    GroupNorm), and refusals (negative eps) raise normkit's errors."""
    x, r = torch.randn(4, 64), torch.randn(4, 64)
    y = normkit.add_layer_norm(x, r, (64,), dropout_p=0.5, seed=7)
    keep = reference.dropout_keep(x.shape, 0.5, 7, x.device)
    torch.testing.assert_close(y, F.layer_norm(torch.where(keep, 2 * x, 0.0) + r, (64,)))
    const = torch.ones(2, 3, 4, 4)
    assert normkit.instance_norm(const, eps=0.0).isnan().all()
    with pytest.raises(InvalidArgument, match="eps"):
        normkit.layer_norm(x, (64,), eps=-1.0)
    with pytest.raises(InvalidArgument, match="normalized_shape"):
        normkit.layer_norm(x, (32,))
