"""Tolerances, executors and comparison helpers shared by tests/, `normkit check` and benchmarks.

Every backend is compared against :mod:`normkit.reference` computed in fp64 on the same (already
rounded) inputs, so the tolerance only has to cover the kernel's fp32 math and the rounding of its
outputs to the input dtype.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Iterator

import torch

import normkit
from normkit import dispatch, reference

NORM_OPS = ("layer_norm", "rms_norm")
SOFTMAX_OPS = ("softmax", "log_softmax")
ADD_OPS = ("add_layer_norm", "add_rms_norm")
CHANNEL_OPS = ("group_norm", "instance_norm", "batch_norm")
OPS = NORM_OPS + SOFTMAX_OPS + ADD_OPS + CHANNEL_OPS

# (atol, rtol) per dtype. "fwd": y. "bwd": dx. "param": dweight / dbias, whose atol is further
# multiplied by sqrt(M) (a sum over M rows: fp32 rounding grows like a random walk).
# fp16 / bf16 outputs carry half an ulp of rounding (2^-11 / 2^-8 relative); the margins above that
# cover fp32 statistics. fp32 outputs differ from fp64 by fp32 reductions over up to 2^20 elements.
TOLERANCES: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    "fwd": {
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (1.6e-2, 1.6e-2),
        torch.float32: (2e-5, 2e-5),
        torch.float64: (1e-10, 1e-10),
    },
    "bwd": {
        torch.float16: (5e-3, 5e-3),
        torch.bfloat16: (3e-2, 3e-2),
        torch.float32: (1e-4, 1e-4),
        torch.float64: (1e-10, 1e-10),
    },
    "param": {
        torch.float16: (5e-3, 5e-3),
        torch.bfloat16: (3e-2, 3e-2),
        torch.float32: (1e-4, 1e-4),
        torch.float64: (1e-10, 1e-10),
    },
}


# A forward output's atol scales with the output: the table's atol is for outputs of magnitude 1
# (normalized values), and shrinks with max|expected| below that (softmax probabilities of long rows
# are ~1/N: a fixed atol of 1.6e-2 would pass any bf16 softmax of rows longer than ~64), down to
# FWD_ATOL_FLOOR of it (outputs that are exactly 0, such as one-element GroupNorm groups without a
# bias, computed as a rounding residue). Measured on the H200 GPU suite of 2026-11-26 (34,747
# checks, ci/gpu_smoke.py tolerances): max |error| / (max|expected| + |expected|) is at most 2.6e-3
# (bf16), 3.8e-4 (fp16), 6.0e-7 (fp32), so the scaled atol leaves each under a fifth of its tolerance.
# dx / dweight keep the table's atol: they are sums of terms that cancel (dx of a one-element row is
# 0 up to rounding of terms ~rstd * |w * dy|), so their own magnitude does not bound their error.
FWD_ATOL_FLOOR = 2.0**-8


def tolerance(dtype: torch.dtype, kind: str, rows: int = 1, expected: torch.Tensor | None = None
              ) -> tuple[float, float]:  # fmt: skip
    """(atol, rtol) of ``kind`` for ``dtype``; ``rows``: the rows a "param" gradient sums over;
    ``expected``: a "fwd" output's reference, whose max |finite value| scales atol (FWD_ATOL_FLOOR)."""
    atol, rtol = TOLERANCES[kind][dtype]
    if kind == "param":
        atol *= math.sqrt(max(rows, 1))
    if kind == "fwd" and expected is not None:
        e = expected.detach()
        e = e[e.isfinite()]
        atol *= min(1.0, max(e.abs().max().item(), FWD_ATOL_FLOOR)) if e.numel() else 1.0
    return atol, rtol


def _on_oracle(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both in fp64 on :func:`oracle_device` of ``actual``."""
    return fp64(actual), fp64(expected).to(oracle_device(actual.device))


def oracle_device(device) -> torch.device:
    """Where fp64 references of tensors on ``device`` are computed: the CPU for an Ascend NPU (whose
    fp64 support is partial), else ``device`` itself."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "npu" else device


def fp64(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, in fp64, on :func:`oracle_device` (an NPU tensor is copied to the CPU in its
    own dtype first, then widened there)."""
    t = t.detach()
    return t.cpu().double() if t.device.type == "npu" else t.double()


# Tests (tests/conftest.py under NORMKIT_RECORD_LAUNCHES) set a list here: each assert_close appends
# (test, dtype, kind, fraction of the tolerance used, max |error| / (sqrt(rows) or 1 * max|expected|
# + |expected|)) for ci/gpu_smoke.py's tolerance report. None: nothing is recorded.
RECORD: list | None = None


def _record(actual, expected, dtype, kind, rows, condition) -> None:
    a, e = _on_oracle(actual, expected)
    finite = e.isfinite() & a.isfinite()
    if not finite.any():
        return
    a, e = a[finite], e[finite]
    scale = (math.sqrt(max(rows, 1)) if kind == "param" else 1.0) * e.abs().max().item() * condition
    q = ((a - e).abs() / (scale + e.abs()).clamp_min(1e-300)).max().item()
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    RECORD.append((test, str(dtype).replace("torch.", ""), kind, tolerance_used(a, e, dtype, kind, rows), q))


def assert_close(actual, expected, dtype, kind, name, rows=1, equal_nan=False, condition=1.0):
    """Compare ``actual`` with the fp64 ``expected`` under the table's tolerance for ``dtype``, on
    :func:`oracle_device` of ``actual`` (``expected`` may be on the CPU for any device).
    ``condition`` (>= 1) scales atol for ill-conditioned inputs (see tests/test_fuzz.py)."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    atol, rtol = tolerance(dtype, kind, rows, expected)
    atol *= condition
    if RECORD is not None and actual.numel():
        _record(actual, expected, dtype, kind, rows, condition)
    torch.testing.assert_close(
        *_on_oracle(actual, expected),
        atol=atol,
        rtol=rtol,
        equal_nan=equal_nan,
        msg=lambda m: f"{name} ({dtype}, {kind} tolerance atol={atol:.1e} rtol={rtol:.1e}): {m}",
    )


def tolerance_used(actual, expected, dtype, kind, rows=1) -> float:
    """max |actual - expected| / (atol + rtol * |expected|): at most 1 where assert_close passes."""
    if actual.numel() == 0:
        return 0.0
    atol, rtol = tolerance(dtype, kind, rows, expected)
    actual, expected = _on_oracle(actual, expected)
    used = (actual - expected).abs() / (atol + rtol * expected.abs())
    return used.nan_to_num(0.0).max().item()  # NaN where both are NaN (checked by assert_close)


@contextlib.contextmanager
def gpu_lock():
    """Hold this GPU alone among the test processes that ask for it (a file lock per GPU): for tests
    that need most of its memory or its SMs. One lock per CUDA_VISIBLE_DEVICES value, so workers
    spread over several GPUs (ci/gpu-suite.sh GPUS=K) only wait for those on their own GPU."""
    import fcntl
    import tempfile

    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    with open(os.path.join(tempfile.gettempdir(), f"normkit-gpu-{gpu}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- executors: which backend's kernels run on which device -------------------------------------


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str:
    """Why Triton's interpreter cannot run the kernels beside this numpy, or "". Triton 3.6's
    interpreter calls int() on 1-element arrays (the persistent loops' ``range(pid, n,
    num_programs)``), which numpy 2.4 refuses with a TypeError inside the first kernel; 3.7 and later
    squeeze first (ci/triton-lowest.requirements.txt pins numpy < 2.4 for 3.6)."""
    from packaging.version import Version

    if Version(triton_version).release[:2] < (3, 7) and Version(numpy_version).release[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter needs numpy < 2.4, found numpy {numpy_version}: "
                "pip install 'numpy<2.4' (or Triton >= 3.7)")  # fmt: skip
    return ""


def interpreter_status() -> tuple[bool, str]:
    """Whether Triton's interpreter can run the kernels on CPU tensors here."""
    if not interpreting():
        return False, ("Triton kernels on CPU tensors need TRITON_INTERPRET=1 "
                       "(set by tests/conftest.py on machines without GPU/NPU)")  # fmt: skip
    if importlib.util.find_spec("triton") is None:
        return False, "Triton's interpreter needs the `triton` module: pip install 'normkit[cuda]'"
    import numpy
    import triton

    problem = interpreter_numpy_problem(triton.__version__, numpy.__version__)
    return not problem, problem


def npu_status() -> tuple[bool, str]:
    """Whether an Ascend NPU can be used; never imports torch_npu where it is not installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed (needs an Ascend host with CANN)"
    importlib.import_module("torch_npu")
    if not torch.npu.is_available():
        return False, "torch_npu is installed but reports no NPU"
    return True, ""


@dataclass(frozen=True)
class Executor:
    """Run ``backend``'s kernels on tensors of ``device`` (cpu = Triton interpreter). Backend
    ``reference``: normkit.reference serves every call; ``cpu``: CPU tensors as a user's calls take
    them, no override (torch's operators through normkit.cpu, the reference for the rest)."""

    backend: str  # "cuda" | "npu" | "reference" | "cpu"
    device: str  # "cpu" | "cuda" | "npu"

    @property
    def module(self) -> str:
        if self.backend in ("reference", "cpu"):
            return "normkit.reference"
        return f"normkit.backends.{self.backend}"

    @property
    def name(self) -> str:
        if self.backend in ("reference", "cpu"):
            return self.backend
        if self.device == "cpu":
            return f"{self.backend}-kernels-interpreter"
        if self.backend == self.device:
            return self.backend
        return f"{self.backend}-kernels-on-{self.device}"

    def status(self) -> tuple[bool, str]:
        """(available, reason when not)."""
        if self.backend in ("reference", "cpu"):
            return True, ""
        if self.device == "cpu":
            return interpreter_status()
        if self.device == "cuda":
            ok, reason = torch.cuda.is_available(), "no CUDA GPU available"
        else:
            ok, reason = npu_status()
        if ok and interpreting():
            ok, reason = False, f"TRITON_INTERPRET=1 is set: {self.device} kernels are not compiled"
        return ok, "" if ok else reason

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return importlib.import_module(self.module).SUPPORTED_DTYPES

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        if self.backend == "cpu":
            yield
            return
        with dispatch.use_backend(self.device, self.module):
            yield


# --- running an op both ways ---------------------------------------------------------------------


def make_inputs(op, shape, normalized_ndim, dtype, device, weight=True, bias=True, mean=0.0, seed=0):
    """Fresh random x, weight, bias, dy (never zeros); weight/bias None when not asked for."""
    g = torch.Generator().manual_seed(seed)
    norm_shape = tuple(shape[len(shape) - normalized_ndim:])

    def rand(s, scale=1.0, offset=0.0):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale + offset).to(dtype).to(device)

    return dict(
        x=rand(shape, 1.0, mean),
        weight=rand(norm_shape, 0.5, 1.0) if weight else None,
        bias=rand(norm_shape, 0.5) if (bias and op == "layer_norm") else None,
        dy=rand(shape),
        normalized_shape=norm_shape,
    )


def resolve_eps(op, eps, dtype):
    if eps is None and op == "rms_norm":
        return torch.finfo(dtype).eps
    return eps


def reference_results(op, x, weight, bias, dy, normalized_shape, eps):
    """fp64 outputs and gradients from normkit.reference's contract (no dispatch involved)."""
    n = math.prod(normalized_shape)
    m = x.numel() // n if n else 0
    up = lambda t: None if t is None else fp64(t).reshape(-1)  # noqa: E731
    x2, dy2 = fp64(x).reshape(m, n), fp64(dy).reshape(m, n)
    w, b = up(weight), up(bias)
    eps = resolve_eps(op, eps, x.dtype)
    if op == "layer_norm":
        y, mean, rstd = reference.layer_norm_fwd(x2, w, b, eps)
        dx, dw, db = reference.layer_norm_bwd(dy2, x2, w, mean, rstd, None if b is None else b.dtype)
    else:
        y, rstd = reference.rms_norm_fwd(x2, w, eps)
        dx, dw = reference.rms_norm_bwd(dy2, x2, w, rstd)
        db = None
    shape = lambda t, like: None if t is None else t.reshape(like.shape)  # noqa: E731
    return dict(
        y=y.reshape(x.shape), dx=dx.reshape(x.shape), dweight=shape(dw, weight), dbias=shape(db, bias)
    )


def public_results(op, x, weight, bias, dy, normalized_shape, eps):
    """Outputs and gradients through the public API and autograd (whatever backend serves x)."""
    x = x.detach().requires_grad_(True)
    params = [p.detach().requires_grad_(True) if p is not None else None for p in (weight, bias)]
    weight, bias = params
    if op == "layer_norm":
        y = normkit.layer_norm(x, normalized_shape, weight, bias, eps=1e-5 if eps is None else eps)
    else:
        y = normkit.rms_norm(x, normalized_shape, weight, eps=eps)
    y.backward(dy)
    grad = lambda p: None if p is None else p.grad  # noqa: E731
    return dict(y=y.detach(), dx=x.grad, dweight=grad(weight), dbias=grad(bias))


def poison_allocator(device) -> None:
    """Leave NaN in the caching allocator's free blocks, so unwritten outputs show up as NaN."""
    device = torch.device(device)
    if device.type == "cpu":
        return  # large CPU allocations come fresh from the OS (zeros): the reference is never 0
    for numel in (1 << 18, 1 << 18, 1 << 26):  # small-pool and large-pool blocks
        torch.full((numel,), float("nan"), device=device)


def softmax_inputs(shape, dtype, device, seed=0, neg_inf=False):
    """x (scaled randn; with ``neg_inf``, some -inf entries and one all -inf row) and dy."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    if neg_inf and x.numel():
        flat = x.view(-1, shape[-1])
        flat[torch.rand(flat.shape, generator=g) < 0.2] = float("-inf")
        flat[0] = float("-inf")
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype).to(device), dy.to(dtype).to(device)


def softmax_reference(op, x, dy, dim):
    """fp64 (y, dx) of softmax / log_softmax along ``dim`` from normkit.reference's contract."""
    log = op == "log_softmax"
    xm = fp64(x).movedim(dim, -1)
    rows = xm.reshape(-1, xm.shape[-1])
    y = reference.softmax_fwd(rows, log)
    dx = reference.softmax_bwd(fp64(dy).movedim(dim, -1).reshape(rows.shape), y, log)
    back = lambda t: t.reshape(xm.shape).movedim(-1, dim)  # noqa: E731
    return back(y), back(dx)


def _softmax_bwd_reference(op, y, dy, dim):
    ym = fp64(y).movedim(dim, -1)
    rows = ym.reshape(-1, ym.shape[-1])
    dx = reference.softmax_bwd(fp64(dy).movedim(dim, -1).reshape(rows.shape), rows,
                               op == "log_softmax")  # fmt: skip
    return dx.reshape(ym.shape).movedim(-1, dim)


def check_softmax_case(op, shape, dim=-1, dtype=torch.float32, device="cpu", *, seed=0,
                       neg_inf=False):
    """softmax / log_softmax fwd+bwd through the public API vs the fp64 reference."""  # fmt: skip
    x, dy = softmax_inputs(shape, dtype, device, seed, neg_inf)
    ref_y, _ = softmax_reference(op, x, dy, dim)
    poison_allocator(device)
    leaf = x.detach().requires_grad_(True)
    y = getattr(normkit, op)(leaf, dim)
    y.backward(dy)
    # The backward's input is the forward's saved, rounded y (as in torch): its expected dx is
    # computed from that y. (From the fp64 y instead, bf16 rounding of y near -8 alone moves
    # log_softmax's dx = dy - exp(y) * sum(dy) by ~3% of exp(y) * sum(dy) at N = 40999.)
    ref_dx = _softmax_bwd_reference(op, y, dy, dim)
    assert y.dtype == dtype and leaf.grad.dtype == dtype
    assert_close(y, ref_y, dtype, "fwd", "y", equal_nan=neg_inf)
    assert_close(leaf.grad, ref_dx, dtype, "bwd", "dx", equal_nan=neg_inf)
    return {
        "y": tolerance_used(y, ref_y, dtype, "fwd"),
        "dx": tolerance_used(leaf.grad, ref_dx, dtype, "bwd"),
    }


def check_case(op, shape, normalized_ndim=1, dtype=torch.float32, device="cpu", *, weight=True,
               bias=True, eps=None, mean=0.0, seed=0):
    """Run one case fwd+bwd through the public API and assert it matches the fp64 reference.

    Softmax ops reduce over the last dim (``normalized_ndim`` is ignored for them). Returns, per
    output, the fraction of its tolerance used (see :func:`tolerance_used`).
    """  # fmt: skip
    if op in SOFTMAX_OPS:
        return check_softmax_case(op, shape, -1, dtype, device, seed=seed)
    if op in ADD_OPS:  # residual + dropout (p = 0.1) + norm, with h used downstream
        return check_add_norm_case(op, shape, dtype, device, dropout_p=0.1, seed=seed)
    if op in CHANNEL_OPS:  # rows (M, N) -> an (N, C, HW) image batch with 8 channels
        # (instance_norm: HW >= 2, as torch, which refuses one value a channel with input statistics)
        image = (max(shape[0], 2), 8, max(shape[1] // 8, 2 if op == "instance_norm" else 1))
        if op in ("group_norm", "instance_norm"):
            return check_group_norm_case(image, 4, dtype, device, seed=seed, instance=op == "instance_norm")
        return check_batch_norm_case(image, dtype, device, seed=seed)
    if op == "layer_norm" and eps is None:
        eps = 1e-5
    inputs = make_inputs(op, shape, normalized_ndim, dtype, device, weight, bias, mean, seed)
    ref = reference_results(op, eps=eps, **inputs)
    poison_allocator(device)
    out = public_results(op, eps=eps, **inputs)
    rows = math.prod(shape[: len(shape) - normalized_ndim])
    errors = {}
    for key, kind in (("y", "fwd"), ("dx", "bwd"), ("dweight", "param"), ("dbias", "param")):
        if ref[key] is None:
            assert out[key] is None, f"{key}: expected None (no such input), got a tensor"
            continue
        assert out[key].dtype == (inputs["x"] if key in ("y", "dx") else inputs[key[1:]]).dtype, (
            f"{key}: dtype {out[key].dtype}"
        )
        assert_close(out[key], ref[key], dtype, kind, key, rows)
        errors[key] = tolerance_used(out[key], ref[key], dtype, kind, rows)
    return errors


# --- fused residual add + dropout + norm -----------------------------------------------------------


def add_norm_inputs(op, shape, dtype, device, *, residual=True, residual_dtype=None, weight=True,
                    bias=True, seed=0):
    """x, residual (in residual_dtype, default x's), weight, bias, dy, dh: fresh randn, never 0."""
    inputs = make_inputs(op[4:], shape, 1, dtype, device, weight, bias, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    h_dtype = residual_dtype or dtype
    rand = lambda dt: torch.randn(shape, generator=g, dtype=torch.float64).to(dt).to(device)  # noqa: E731
    inputs["residual"] = rand(h_dtype) if residual else None
    inputs["dh"] = rand(h_dtype)
    return inputs


def add_norm_public(op, x, residual, weight, bias, normalized_shape, dy=None, dh=None, eps=None,
                    dropout_p=0.0, seed=None, residual_dtype=None):
    """(outputs and gradients) of the public op, prenorm=True; loss = <y, dy> + <h, dh>."""  # fmt: skip
    leaves = {k: None if t is None else t.detach().requires_grad_(True)
              for k, t in dict(x=x, residual=residual, weight=weight, bias=bias).items()}  # fmt: skip
    kw = dict(eps=eps, dropout_p=dropout_p, seed=seed, residual_dtype=residual_dtype, prenorm=True)
    if op == "add_layer_norm":
        kw["eps"] = 1e-5 if eps is None else eps
        y, h = normkit.add_layer_norm(leaves["x"], leaves["residual"], normalized_shape,
                                      leaves["weight"], leaves["bias"], **kw)  # fmt: skip
    else:
        y, h = normkit.add_rms_norm(leaves["x"], leaves["residual"], normalized_shape,
                                    leaves["weight"], **kw)  # fmt: skip
    if dy is not None:
        outputs, grads = [y] + ([h] if dh is not None else []), [dy] + ([dh] if dh is not None else [])
        torch.autograd.backward(outputs, grads)
    result = dict(y=y.detach(), h=h.detach())
    for k, t in leaves.items():
        result["d" + k] = None if t is None else t.grad
    return result


def dropout_keep_mask(op, x, dropout_p, seed):
    """The serving backend's dropout mask for (seed, x's shape): h = dropout(x) with no residual is
    exactly 0 where dropped (x is never 0)."""
    n = x.shape[-1]
    return add_norm_public(op, x, None, None, None, (n,), dropout_p=dropout_p, seed=seed)["h"] != 0


def add_norm_reference(op, x, residual, weight, bias, dy, dh, normalized_shape, eps, keep, dropout_p,
                       h_dtype):
    """fp64 outputs and gradients by torch autograd through the explicit ``keep`` mask. h is rounded
    to ``h_dtype`` in the forward (as stored) and passed straight through in the backward."""  # fmt: skip
    up = lambda t: None if t is None else fp64(t).requires_grad_(True)  # noqa: E731
    x64, r64, w64, b64 = up(x), up(residual), up(weight), up(bias)
    h = x64 * keep.to(x64.device) * (1.0 / (1.0 - dropout_p)) if dropout_p > 0 else x64
    if r64 is not None:
        h = h + r64
    h_used = h + (h.to(h_dtype).double() - h).detach()
    if op == "add_layer_norm":
        y = torch.nn.functional.layer_norm(h_used, normalized_shape, w64, b64, 1e-5 if eps is None else eps)
    else:
        eps = torch.finfo(x.dtype).eps if eps is None else eps
        y = torch.nn.functional.rms_norm(h_used, normalized_shape, w64, eps)
    torch.autograd.backward([y, h_used], [fp64(dy), fp64(dh)])
    grad = lambda t: None if t is None else t.grad  # noqa: E731
    return dict(y=y.detach(), h=h_used.detach(), dx=x64.grad, dresidual=grad(r64),
                dweight=grad(w64), dbias=grad(b64))  # fmt: skip


def check_add_norm_case(op, shape, dtype=torch.float32, device="cpu", *, residual=True,
                        residual_dtype=None, weight=True, bias=True, dropout_p=0.0, seed=0):
    """The fused op (prenorm=True, both outputs used) vs fp64 autograd through an explicit mask."""
    inputs = add_norm_inputs(op, shape, dtype, device, residual=residual,
                             residual_dtype=residual_dtype, weight=weight, bias=bias, seed=seed)  # fmt: skip
    x, n = inputs["x"], shape[-1]
    if dropout_p > 0:
        keep = dropout_keep_mask(op, x, dropout_p, seed)
    else:
        keep = torch.ones_like(x, dtype=torch.bool)
    h_dtype = residual_dtype or (inputs["residual"].dtype if residual else dtype)
    args = [inputs[k] for k in ("x", "residual", "weight", "bias")]
    ref = add_norm_reference(op, *args, inputs["dy"], inputs["dh"], (n,), None, keep, dropout_p, h_dtype)
    poison_allocator(device)
    out = add_norm_public(op, *args, (n,), inputs["dy"], inputs["dh"], None, dropout_p, seed,
                          residual_dtype)  # fmt: skip
    rows = math.prod(shape[:-1])
    used = {}
    kinds = (("y", "fwd"), ("h", "fwd"), ("dx", "bwd"), ("dresidual", "bwd"), ("dweight", "param"),
             ("dbias", "param"))  # fmt: skip
    for key, kind in kinds:
        if ref[key] is None:
            assert out[key] is None, f"{key}: expected None, got a tensor"
            continue
        dt = out[key].dtype
        assert_close(out[key], ref[key], dt, kind, key, rows)
        used[key] = tolerance_used(out[key], ref[key], dt, kind, rows)
    return used


# --- GroupNorm -------------------------------------------------------------------------------------


def check_group_norm_case(shape, num_groups, dtype=torch.float32, device="cpu", *, weight=True,
                          bias=True, mean=0.0, std=1.0, seed=0, forward_only=False, instance=False):
    """group_norm fwd+bwd through the public API vs normkit.reference in fp64. (``forward_only``
    for inputs with a large mean: the backward reads the fp32-stored mean, whose ulp near 1e4 is
    1e-3, so its gradients are only as good as that, in torch as here.) ``instance``: instance_norm
    (its input statistics, no running statistics) against the reference with a group a channel;
    ``num_groups`` is then ignored."""  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    if instance:
        num_groups = C

    def rand(s, scale=1.0, offset=0.0):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale + offset).to(dtype).to(device)

    x, dy = rand(shape, std, mean), rand(shape)
    w = rand((C,), 0.5, 1.0) if weight else None
    b = rand((C,), 0.5) if bias else None
    n, hw = shape[0], math.prod(shape[2:])
    up = lambda t: None if t is None else fp64(t)  # noqa: E731
    x3 = fp64(x).reshape(n, C, hw)
    y_ref, m_ref, r_ref = reference.group_norm_fwd(x3, up(w), up(b), num_groups, 1e-5)
    dx_ref, dw_ref, db_ref = reference.group_norm_bwd(
        fp64(dy).reshape(n, C, hw), x3, up(w), m_ref, r_ref, num_groups, None if b is None else b.dtype
    )
    poison_allocator(device)
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    if instance:
        y = normkit.instance_norm(leaves[0], weight=leaves[1], bias=leaves[2], eps=1e-5)
    else:
        y = normkit.group_norm(leaves[0], num_groups, leaves[1], leaves[2], 1e-5)
    y.backward(dy)
    used = {}
    grad = lambda t: None if t is None else t.grad  # noqa: E731
    for key, got, ref, kind in (("y", y, y_ref, "fwd"), ("dx", leaves[0].grad, dx_ref, "bwd"),
                                ("dweight", grad(leaves[1]), dw_ref, "param"),
                                ("dbias", grad(leaves[2]), db_ref, "param")):  # fmt: skip
        if ref is None or (forward_only and key != "y"):
            assert ref is not None or got is None, f"{key}: expected None"
            continue
        ref = ref.reshape(got.shape)
        assert_close(got, ref, dtype, kind, key, rows=n * hw)
        used[key] = tolerance_used(got, ref, dtype, kind, n * hw)
    return used


# --- BatchNorm -------------------------------------------------------------------------------------


def check_batch_norm_case(shape, dtype=torch.float32, device="cpu", *, training=True, weight=True,
                          bias=True, mean=0.0, std=1.0, seed=0, running="fp32"):
    """batch_norm fwd+bwd through the public API vs normkit.reference in fp64 (eval mode uses
    random running statistics). x = mean + std * randn; ``running``: the running statistics in
    "fp32", in the input's dtype ("input"; their update checked to one rounding), or "none"
    (training only)."""  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    C = shape[1]

    def rand(s, scale=1.0, offset=0.0, dt=dtype):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale + offset).to(dt).to(device)

    x, dy = rand(shape, std, mean), rand(shape)
    w = rand((C,), 0.5, 1.0) if weight else None
    b = rand((C,), 0.5) if bias else None
    running_dtype = {"fp32": torch.float32, "input": dtype, "none": None}[running]
    running = [] if running_dtype is None else [rand((C,), 0.5, dt=running_dtype),
                                                rand((C,), 0.1, 1.0, dt=running_dtype).abs()]  # fmt: skip
    n, hw = shape[0], math.prod(shape[2:])
    x3 = fp64(x).reshape(n, C, hw)
    up = lambda t: None if t is None else fp64(t)  # noqa: E731
    running_ref = [fp64(t) for t in running]  # after the step: updated below when training
    if training:
        m_ref, r_ref = reference.batch_norm_stats(x3, 1e-5, 0.1, *running_ref)
    else:
        m_ref, r_ref = fp64(running[0]), torch.rsqrt(fp64(running[1]) + 1e-5)
    y_ref = reference.batch_norm_apply(x3, up(w), up(b), m_ref, r_ref)
    dx_ref, dw_ref, db_ref = reference.batch_norm_bwd(
        fp64(dy).reshape(n, C, hw), x3, up(w), m_ref, r_ref, training, None if b is None else torch.float64
    )
    poison_allocator(device)
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    y = normkit.batch_norm(leaves[0], *(running or (None, None)), leaves[1], leaves[2], training=training,
                           momentum=0.1)  # fmt: skip
    y.backward(dy)
    rtol = 1e-5 if running_dtype in (None, torch.float32, torch.float64) else torch.finfo(running_dtype).eps
    for name, got, ref in zip(("running_mean", "running_var"), running, running_ref):
        torch.testing.assert_close(fp64(got), ref, rtol=rtol, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    grad = lambda t: None if t is None else t.grad  # noqa: E731
    used = {}
    for key, got, ref, kind in (("y", y, y_ref, "fwd"), ("dx", leaves[0].grad, dx_ref, "bwd"),
                                ("dweight", grad(leaves[1]), dw_ref, "param"),
                                ("dbias", grad(leaves[2]), db_ref, "param")):  # fmt: skip
        if ref is None:
            assert got is None, f"{key}: expected None"
            continue
        ref = ref.reshape(got.shape)
        assert_close(got, ref, dtype, kind, key, rows=n * hw)
        used[key] = tolerance_used(got, ref, dtype, kind, n * hw)
    return used
