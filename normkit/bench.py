"""`normkit bench`: normkit, torch eager, torch.compile (and Liger-Kernel, quack when importable) side
by side on a CUDA GPU, or normkit, torch eager and torch_npu's fused ops on an Ascend NPU, forward and
backward, in GB/s and as fractions of a device-to-device copy timed in the same run.

Method. Each case (suite, op, dtype, shape) draws fresh inputs; every implementation's outputs and
gradients are first compared with the fp64 reference (normkit.testing tolerances): a mismatch is
reported as ``wrong`` (not timed, and the command exits 1 after the sweep), an exception as ``fail``
(the sweep goes on). Forward and backward are then timed separately: the forward call, and
``torch.autograd.grad`` of the first output w.r.t. every float input (x, weight, bias, residual)
with ``retain_graph=True``, on the graph of a call made after the forward's timed runs and two
more (not the first call's, which compiles and binds kernels; the native host path records the
third). On CUDA the timer is ``triton.testing.do_bench`` (median; it flushes L2
between runs); on other devices :func:`event_bench` does the same with the device module's events
(``torch.get_device_module(device)``), and the fp64 reference is computed on the CPU from copies of
the device inputs (NPU fp64 support is partial). Python's garbage collector is paused while each
measurement runs, as ``timeit`` does (``--gc-running`` leaves it on; docs/tuning-log.md T3).
``--rounds R`` times every row again in R - 1 more passes over the cases, on fresh inputs and
without the checks, and each direction keeps its fastest round (:func:`retime_row`; T106).
``torch._dynamo.reset()`` runs before each case, so torch.compile compiles every shape afresh instead
of falling back to eager after its recompile limit.
Row tensors hold 2^27 elements (M = 2^27 // N), well past L2; the ``few`` suite is small on purpose
(inference): its forward is timed under ``torch.no_grad()`` for every implementation, as a model
serving requests runs it (no autograd graph recorded); its backward as everywhere else.

Bytes counted are the fewest the op must move, in units of the input's size (``UNITS``; weight,
bias and statistics traffic is negligible and not counted):

  layer_norm, rms_norm, softmax, log_softmax    fwd 2: read x, write y
  (and *_dim0, group_norm, batch_norm)          bwd 3: read x (softmax: y) and dy, write dx
  add_layer_norm, add_rms_norm                  fwd 4: read x, residual; write y, h = x + residual
                                                bwd 4: read dy, h; write dx, dresidual

The add-norms' backward feeds only y's gradient (h unused downstream). torch's side of an add-norm
is ``h = x + residual; y = norm(h)``; normkit's is the fused op with ``prenorm=True``. On an NPU,
"torch" is F.* on NPU tensors, which torch_npu runs with Ascend's own (aclnn) kernels.
"""

from __future__ import annotations

import csv
import gc
import importlib
import json
import math
import os
import shlex
import statistics
import sys
import time
import zlib
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import normkit
from normkit import reference as ref_impl
from normkit import rng
from normkit.bench_plan import (  # noqa: F401  (the plan lives there, without torch; re-exported here)
    DEVICES,
    DIM0_NS,
    DIM0_OPS,
    DTYPES,
    FEW_MS,
    FEW_NS,
    GROUPS,
    IMAGE_OPS,
    IMAGE_SHAPES,
    IMPLS,
    ITEMSIZE,
    OPS,
    OPT_IN,
    ROW_OPS,
    SMALL_NS,
    SUITES,
    SWEEP_NS,
    TOTAL,
    UNITS,
    Case,
    comma_list,
    int_list,
    plan,
    shard,
    shard_spec,
)
from normkit.testing import (
    _softmax_bwd_reference,
    add_norm_reference,
    assert_close,
    reference_results,
    softmax_reference,
)

EPS = 1e-5
DEFAULT_NS = list(SWEEP_NS)  # kept for ci/ scripts
RESULTS = "results.json"
FORMAT = "normkit-bench/1"

# Which ops Liger-Kernel, quack and torch_npu implement here (normkit, torch and torch.compile: all).
SERVES = {
    "liger": {"layer_norm", "rms_norm", "softmax", "add_rms_norm", "group_norm"},
    "quack": {"rms_norm", "softmax", "add_rms_norm"},
    "torch_npu": {"rms_norm", "add_rms_norm", "add_layer_norm"},  # see _torch_npu_forward
}
IMPORTS = {"liger": "liger_kernel", "quack": "quack", "torch_npu": "torch_npu"}
# Implementations measured on one device type only (normkit and torch: on every device).
ONLY_ON = {"torch.compile": "cuda", "liger": "cuda", "quack": "cuda", "torch_npu": "npu",
           "npu-kernels-on-cuda": "cuda"}
NOT_ON = {  # why an implementation is not measured on a device type, where "<type> only" says too little
    ("torch.compile", "npu"): "not measured on npu: torch.compile there needs one of torch_npu's Inductor "
                              "backends (TORCHINDUCTOR_NPU_BACKEND, set before `import torch`) or torchair's "
                              "npu_backend, none of which normkit bench picks",
    ("liger", "npu"): "measured on cuda only", ("quack", "npu"): "measured on cuda only (CUDA kernels)",
}  # fmt: skip
# (impl, op) whose backward the library does not implement: the bwd cell says "-", not "fail".
FORWARD_ONLY = {("torch_npu", "add_rms_norm")}
FLUSH_BYTES = 256 << 20  # written between timed runs to evict L2, as triton's drivers do for do_bench
REFERENCE_ON_DEVICE = ("cuda", "cpu")  # device types whose fp64 is complete; others: reference on the CPU


class UsageError(Exception):
    """A bad combination of arguments: printed, exit status 2."""


# --- implementations ------------------------------------------------------------------------------


def available_impls(device_type="cuda") -> dict[str, str]:
    """{impl: "" if it can be measured on ``device_type`` else the reason}.

    Imports Liger-Kernel / quack (on cuda) or torch_npu (on npu) to find out, never on another device.
    """
    status = {}
    for impl in IMPLS:
        only = ONLY_ON.get(impl, device_type)
        status[impl] = "" if only == device_type else NOT_ON.get((impl, device_type), f"{only} only")
        if status[impl] or impl not in IMPORTS:
            continue
        try:
            importlib.import_module(IMPORTS[impl])
        except Exception as exc:  # ImportError, or a dependency failing at import
            status[impl] = f"{IMPORTS[impl]} not importable ({type(exc).__name__}: {exc})"
    return status


DROPOUT_SEED = 1234
# The implementations that draw normkit's dropout mask (docs/numerics.md, "Dropout"), so --dropout
# cells can be checked against fp64 through it; torch and the others draw their own.
DROPOUT_IMPLS = ("normkit", "npu-kernels-on-cuda")


def serves(impl, op, dropout=0.0) -> bool:
    return op in SERVES.get(impl, OPS) and (not dropout or impl in DROPOUT_IMPLS)


def _api_forward(ns, op, dropout=0.0):
    """fn(inputs) -> outputs for a torch.nn.functional-like namespace (F or normkit); ``dropout``: the
    add-norms' dropout_p (normkit only)."""
    if op in ("softmax", "log_softmax") or op in DIM0_OPS:
        fn, dim = getattr(ns, op.removesuffix("_dim0")), 0 if op in DIM0_OPS else -1
        return lambda i: (fn(i["x"], dim),)
    if op == "layer_norm":
        return lambda i: (ns.layer_norm(i["x"], i["x"].shape[-1:], i["weight"], i["bias"], EPS),)
    if op == "rms_norm":
        return lambda i: (ns.rms_norm(i["x"], i["x"].shape[-1:], i["weight"], EPS),)
    if op == "group_norm":
        return lambda i: (ns.group_norm(i["x"], GROUPS, i["weight"], i["bias"], EPS),)
    if op == "batch_norm":
        return lambda i: (ns.batch_norm(i["x"], i["running_mean"], i["running_var"], i["weight"],
                                        i["bias"], True, 0.1, EPS),)  # fmt: skip
    if ns is normkit:  # the fused add-norm, both outputs
        fn, params = getattr(normkit, op), ("weight", "bias") if op == "add_layer_norm" else ("weight",)
        seed = DROPOUT_SEED if dropout else None  # (a call with a seed is not served by a remembered plan)
        return lambda i: fn(i["x"], i["residual"], i["x"].shape[-1:], *(i[p] for p in params), eps=EPS,
                            prenorm=True, dropout_p=dropout, seed=seed)  # fmt: skip
    norm = _api_forward(ns, op.removeprefix("add_"))

    def add_norm(i):
        h = i["x"] + i["residual"]
        return norm({**i, "x": h})[0], h

    return add_norm


def _liger_forward(op):
    mod = importlib.import_module(f"liger_kernel.ops.{'fused_add_rms_norm' if op == 'add_rms_norm' else op}")
    if op == "layer_norm":
        return lambda i: (mod.LigerLayerNormFunction.apply(i["x"], i["weight"], i["bias"], EPS),)
    if op == "rms_norm":  # offset 0, llama casting, in_place=False (in place would overwrite dy)
        return lambda i: (mod.LigerRMSNormFunction.apply(i["x"], i["weight"], EPS, 0.0, "llama", False),)
    if op == "add_rms_norm":
        return lambda i: mod.LigerFusedAddRMSNormFunction.apply(i["x"], i["residual"], i["weight"], EPS, 0.0,
                                                                "llama", False)  # fmt: skip
    if op == "softmax":
        return lambda i: (mod.LigerSoftmaxFunction.apply(i["x"]),)
    return lambda i: (mod.LigerGroupNormFunction.apply(i["x"], i["weight"], i["bias"], i["x"].shape[1],
                                                       GROUPS, EPS),)  # fmt: skip


def _quack_forward(op):
    if op == "softmax":
        softmax = importlib.import_module("quack.softmax").softmax
        return lambda i: (softmax(i["x"]),)
    rmsnorm = importlib.import_module("quack.rmsnorm").rmsnorm
    if op == "rms_norm":
        return lambda i: (rmsnorm(i["x"], i["weight"], eps=EPS),)
    return lambda i: rmsnorm(i["x"], i["weight"], residual=i["residual"], eps=EPS, prenorm=True)


# torch_npu's fused norms, from Ascend/op-plugin (the source of torch_npu's custom ops):
# op_plugin/config/derivatives.yaml (schemas and registered derivatives), the API pages
# docs/context/（beta）torch_npu-npu_rms_norm.md and torch_npu.npu_add_rms_norm's, and op-plugin's tests:
#   npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)   rstd = 1 / Rms(x) (fp32, for the backward);
#       derivative npu_rms_norm_backward (y differentiable, rstd not).
#   npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x)   x = x1 + x2. No derivative is
#       registered (op-plugin's tests expect "... not implemented" from its backward): forward only.
#   npu_add_layer_norm(x1, x2, gamma, beta, epsilon=1e-05, additional_output=False) -> (y, mean, rstd, x)
#       x only with additional_output=True; derivative npu_add_layer_norm_backward. Newer releases insert
#       an optional bias before epsilon, so epsilon and additional_output go by keyword.
# gamma must have x's dtype (it does here: make_inputs draws weight in the input dtype). There is no
# fused op to set beside the others: LayerNorm (npu_layer_norm_eval is deprecated for F.layer_norm and
# has no backward), softmax (npu_scaled_masked_softmax is masked, scaled and 4-D only), GroupNorm (only
# fused with SiLU / Swish), BatchNorm. F.* on NPU tensors already runs Ascend's aclnn kernels ("torch").
def _torch_npu_forward(op):
    if op not in SERVES["torch_npu"]:
        raise ValueError(f"op {op!r}: torch_npu has no fused op for it here (it serves "
                         f"{', '.join(sorted(SERVES['torch_npu']))})")  # fmt: skip
    npu = importlib.import_module("torch_npu")
    if op == "rms_norm":
        return lambda i: (npu.npu_rms_norm(i["x"], i["weight"], epsilon=EPS)[0],)
    if op == "add_rms_norm":
        def add_rms_norm(i):
            y, _rstd, h = npu.npu_add_rms_norm(i["x"], i["residual"], i["weight"], epsilon=EPS)
            return y, h

        return add_rms_norm

    def add_layer_norm(i):  # additional_output=True: h comes back as the fourth output
        outs = npu.npu_add_layer_norm(i["x"], i["residual"], i["weight"], i["bias"], epsilon=EPS,
                                      additional_output=True)  # fmt: skip
        y, _mean, _rstd, h = outs
        return y, h

    return add_layer_norm


def _npu_kernels_forward(op, dropout=0.0):
    """normkit's public API with the NPU backend serving cuda tensors; the backward (autograd.grad)
    runs on the backend of the forward's context (normkit.dispatch.restore)."""
    fn = _api_forward(normkit, op, dropout)

    def on_npu_kernels(i):
        with normkit.dispatch.use_backend("cuda", "normkit.backends.npu"):
            return fn(i)

    return on_npu_kernels


def forward_fn(impl, op, dropout=0.0):
    """fn(inputs dict) -> tuple of outputs (y, or y and h for the add-norms); ``dropout``: the
    add-norms' dropout_p (the implementations of DROPOUT_IMPLS)."""
    if impl == "liger":
        return _liger_forward(op)
    if impl == "quack":
        return _quack_forward(op)
    if impl == "torch_npu":
        return _torch_npu_forward(op)
    if impl == "npu-kernels-on-cuda":
        return _npu_kernels_forward(op, dropout)
    fn = _api_forward(normkit if impl == "normkit" else F, op, dropout)
    return torch.compile(fn, dynamic=False) if impl == "torch.compile" else fn


# --- inputs and the fp64 reference ----------------------------------------------------------------


def make_inputs(case, device) -> dict:
    """Fresh random inputs (leaves requiring grad) and dy for one case."""
    dtype = getattr(torch, case.dtype)
    seed = zlib.crc32(f"{case.op} {case.dtype} {case.label}".encode())
    g = torch.Generator(device=device).manual_seed(seed)  # torch_npu has npu generators too

    def rand(shape, scale=1.0, offset=0.0, grad=True):
        t = torch.randn(shape, generator=g, device=device, dtype=dtype) * scale + offset
        return t.requires_grad_(grad)

    softmax = "softmax" in case.op
    inp = dict(x=rand(case.shape, 3.0 if softmax else 1.0), dy=rand(case.shape, grad=False))
    if case.channels_last:
        inp = {k: v.detach().contiguous(memory_format=torch.channels_last).requires_grad_(v.requires_grad)
               for k, v in inp.items()}  # fmt: skip
    channels = case.shape[1] if case.op in IMAGE_OPS else case.shape[-1]
    if not softmax:
        inp["weight"] = rand((channels,), 0.5, 1.0)
    if case.op in ("layer_norm", "add_layer_norm") or case.op in IMAGE_OPS:
        inp["bias"] = rand((channels,), 0.5)
    if case.op.startswith("add_"):
        inp["residual"] = rand(case.shape)
    if case.op == "batch_norm":  # training=True updates them in place on every call
        inp["running_mean"] = torch.zeros(channels, device=device, dtype=dtype)
        inp["running_var"] = torch.ones(channels, device=device, dtype=dtype)
    return inp


LEAVES = ("x", "weight", "bias", "residual")  # the float inputs gradients are taken for


def leaves(inp):
    return [inp[k] for k in LEAVES if k in inp]


def reference_inputs(inp, device) -> dict:
    """The inputs the fp64 reference is computed from: ``inp`` itself on CUDA / CPU, else CPU copies."""
    if torch.device(device).type in REFERENCE_ON_DEVICE:
        return inp
    return {k: v.detach().cpu() for k, v in inp.items()}


def reference(case, inp) -> dict:
    """fp64 expected outputs (y, h) and gradients (dx, dweight, dbias, dresidual) of y's gradient."""
    x, dy, w, b = inp["x"], inp["dy"], inp.get("weight"), inp.get("bias")
    if case.op in ("layer_norm", "rms_norm"):
        return reference_results(case.op, x, w, b, dy, x.shape[-1:], EPS)
    if case.op.startswith("add_"):
        keep = rng.keep_mask(x.shape, case.dropout, DROPOUT_SEED, x.device) if case.dropout else None
        return add_norm_reference(case.op, x, inp["residual"], w, b, dy, torch.zeros_like(dy), x.shape[-1:],
                                  EPS, keep, case.dropout, x.dtype)  # fmt: skip
    if "softmax" in case.op:
        y, dx = softmax_reference(case.op.removesuffix("_dim0"), x, dy, 0 if case.op in DIM0_OPS else -1)
        return dict(y=y, dx=dx)
    n, c = x.shape[:2]
    x3, dy3 = x.detach().double().reshape(n, c, -1), dy.double().reshape(n, c, -1)
    w64, b64 = w.detach().double(), b.detach().double()
    if case.op == "group_norm":
        y, mean, rstd = ref_impl.group_norm_fwd(x3, w64, b64, GROUPS, EPS)
        dx, dw, db = ref_impl.group_norm_bwd(dy3, x3, w64, mean, rstd, GROUPS, torch.float64)
    else:
        mean, rstd = ref_impl.batch_norm_stats(x3, EPS)
        y = ref_impl.batch_norm_apply(x3, w64, b64, mean, rstd)
        dx, dw, db = ref_impl.batch_norm_bwd(dy3, x3, w64, mean, rstd, True, torch.float64)
    return dict(y=y.reshape(x.shape), dx=dx.reshape(x.shape), dweight=dw, dbias=db)


def _check(name, got, expected, case, kind):
    """assert_close against any of the ``expected`` candidates (AssertionError from the first)."""
    dtype = getattr(torch, case.dtype)
    rows = case.numel // got.numel() if kind == "param" else 1
    errors = []
    for exp in expected:
        try:  # compared on the reference's device (the CPU for an NPU's results)
            return assert_close(got.detach().to(exp.device), exp.reshape(got.shape), dtype, kind, name, rows)
        except AssertionError as exc:
            errors.append(exc)
    raise errors[0]


def check_forward(case, outs, ref):
    for name, got in zip(("y", "h"), outs):
        _check(name, got, [ref[name]], case, "fwd")


def check_backward(case, inp, outs, grads, ref):
    for key, got in zip([k for k in LEAVES if k in inp], grads):
        name = "d" + key
        expected = [ref[name]]
        if "softmax" in case.op:  # the contract: dx from the saved (rounded) y; fp64 y accepted too
            dim, where = 0 if case.op in DIM0_OPS else -1, ref["y"].device
            y, dy = outs[0].detach().to(where), inp["dy"].to(where)
            expected.insert(0, _softmax_bwd_reference(case.op.removesuffix("_dim0"), y, dy, dim))
        _check(name, got, expected, case, "param" if key in ("weight", "bias") else "bwd")


# --- measuring ------------------------------------------------------------------------------------


def do_bench_timer(warmup_ms=25, rep_ms=100):
    """A timer(fn) -> ms: triton.testing.do_bench's median."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def event_bench(fn, module, flush, warmup_ms=25, rep_ms=100) -> float:
    """Median ms of ``fn``, timed as triton.testing.do_bench does with ``module``'s events.

    ``module``: a device module (torch.cuda, torch.npu: ``Event(enable_timing=True)``, ``synchronize``);
    ``flush``: a tensor zeroed before each timed run (evicts L2). Five runs estimate the time per run,
    which sets the warm-up and timed run counts (at least one each; the estimate is floored at 1 us).
    """
    fn()
    module.synchronize()
    start, end = module.Event(enable_timing=True), module.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    module.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    n_warmup, n_repeat = max(1, int(warmup_ms / estimate)), max(1, int(rep_ms / estimate))
    starts = [module.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [module.Event(enable_timing=True) for _ in range(n_repeat)]
    for _ in range(n_warmup):
        fn()
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    module.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def event_timer(device, warmup_ms=25, rep_ms=100, module=None, flush=None):
    """A timer(fn) -> ms by :func:`event_bench` on ``device`` (module: torch.get_device_module(device))."""
    module = module or torch.get_device_module(device)
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=device) if flush is None else flush
    return lambda fn: event_bench(fn, module, flush, warmup_ms, rep_ms)


def gc_paused(timer):
    """``timer`` with Python's garbage collector paused while it runs, as ``timeit`` does: a
    collection that falls in a timed run is host time of every object the process holds (torch.compile
    leaves millions), charged to whichever call crossed the collector's threshold, not the op's."""

    def timed(fn):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return timer(fn)
        finally:
            if was_enabled:
                gc.enable()

    return timed


def make_timer(device, warmup_ms=25, rep_ms=100, pause_gc=True):
    """do_bench on CUDA (unchanged); device events with an L2 flush (:func:`event_timer`) elsewhere;
    with the garbage collector paused during each measurement (:func:`gc_paused`) unless ``pause_gc``
    is False."""
    if torch.device(device).type == "cuda":
        timer = do_bench_timer(warmup_ms, rep_ms)
    else:
        timer = event_timer(device, warmup_ms, rep_ms)
    return gc_paused(timer) if pause_gc else timer


def _error(exc) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


NO_GRAD_FORWARD = ("few",)  # suites whose forward is timed as inference (module doc)


def _no_grad(fn):
    def run():
        with torch.no_grad():
            return fn()

    return run


def measure_row(case, impl, inp, ref, timer, copy) -> dict:
    """One result row: check then time forward and backward of ``impl`` on ``case``."""
    result = dict(fwd=("fail", None), bwd=("fail", None), error="")
    try:
        call = forward_fn(impl, case.op, case.dropout)
        call_inp = lambda: call(inp)  # noqa: E731
        outs = call_inp()
    except Exception as exc:
        return make_row(case, impl, copy, error=_error(exc))
    try:
        check_forward(case, outs, ref)
        if case.suite in NO_GRAD_FORWARD:
            timed = _no_grad(call_inp)
            timed()  # torch.compile: the no-grad graph is compiled here, not in the timed runs
        else:
            timed = call_inp
        result["fwd"] = ("ok", timer(timed))
    except AssertionError as exc:
        result.update(fwd=("wrong", None), error=_error(exc))
    except Exception as exc:
        result["error"] = _error(exc)
    try:
        # the graph of a call past those that compile, bind and record (the native path records the
        # third): a training step's backward follows a forward that ran as every later one does;
        # that forward checked too, and the backward's third run (a replayed one), not its first
        for _ in range(3):
            outs = call_inp()
        try:
            check_forward(case, outs, ref)
        except AssertionError as exc:
            result.update(fwd=("wrong", None), error=result["error"] or _error(exc))
            raise
        args = (outs[0], leaves(inp), inp["dy"])
        for _ in range(3):
            grads = torch.autograd.grad(*args, retain_graph=True)
        check_backward(case, inp, outs, grads, ref)
        result["bwd"] = ("ok", timer(lambda: torch.autograd.grad(*args, retain_graph=True)))
    except AssertionError as exc:
        result["bwd"] = ("wrong", None)
        result["error"] = result["error"] or _error(exc)
    except Exception as exc:
        if (impl, case.op) in FORWARD_ONLY:  # no backward to measure: "-" (not implemented), no error
            result["bwd"] = ("-", None)
        else:
            result["error"] = result["error"] or _error(exc)
    return make_row(case, impl, copy, result["fwd"], result["bwd"], result["error"])


def retime_row(case, impl, inp, timer, row) -> dict:
    """Another round of ``row``'s timings on fresh inputs ``inp``, as :func:`measure_row` times them
    (no checks: the first round made them). Each direction that timed ``ok`` keeps its fastest round
    (``fwd_rounds`` / ``bwd_rounds`` list every round's ms): a round is a median over ``rep_ms`` of
    runs, so a disturbance of the host or the GPU that outlasts it (tenths of a second to seconds)
    moves that round's median, not the kept one, while a slower code is slower in every round."""
    call = forward_fn(impl, case.op, case.dropout)
    call_inp = lambda: call(inp)  # noqa: E731
    times = {}
    if row["fwd_status"] == "ok":
        timed = _no_grad(call_inp) if case.suite in NO_GRAD_FORWARD else call_inp
        timed()
        times["fwd"] = timer(timed)
    if row["bwd_status"] == "ok":
        for _ in range(3):
            outs = call_inp()
        args = (outs[0], leaves(inp), inp["dy"])
        for _ in range(3):
            torch.autograd.grad(*args, retain_graph=True)
        times["bwd"] = timer(lambda: torch.autograd.grad(*args, retain_graph=True))
    for direction, nbytes in zip(("fwd", "bwd"), case.bytes()):
        if direction not in times:
            continue
        rounds = row.setdefault(f"{direction}_rounds", [row[f"{direction}_ms"]])
        rounds.append(times[direction])
        row[f"{direction}_ms"] = min(rounds)
        row[f"{direction}_gbps"] = nbytes / row[f"{direction}_ms"] / 1e6
    return with_fractions(row)


def make_row(case, impl, copy, fwd=("fail", None), bwd=("fail", None), error="") -> dict:
    """A result row; GB/s from the ms and the op's byte count, fractions of ``copy`` GB/s."""
    row = dict(suite=case.suite, op=case.op, dtype=case.dtype, shape=case.label, m=case.m, n=case.n,
               impl=impl)  # fmt: skip
    for (direction, (status, ms)), nbytes in zip((("fwd", fwd), ("bwd", bwd)), case.bytes()):
        row[f"{direction}_status"], row[f"{direction}_ms"] = status, ms
        row[f"{direction}_gbps"] = nbytes / ms / 1e6 if ms else None
    row["copy_gbps"], row["error"] = copy, error
    return with_fractions(row)


def with_fractions(row) -> dict:
    """The row with fwd_frac / bwd_frac = GB/s / the copy GB/s it was measured against."""
    for d in ("fwd", "bwd"):
        gbps = row.get(f"{d}_gbps")
        row[f"{d}_frac"] = gbps / row["copy_gbps"] if gbps is not None and row.get("copy_gbps") else None
    return row


def copy_gbps(device, nbytes: int = 1 << 30, timer=None) -> float:
    """Device-to-device copy bandwidth (bytes read + written) in GB/s, timed by ``timer`` (default:
    :func:`make_timer` with 50 ms warm-up and 300 ms of runs, the same timer as the measurements)."""
    timer = timer or make_timer(device, 50, 300)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def measure(impl, op, m, n, dtype, device="cuda"):
    """(forward ms, backward ms) of one row op of M x N; raises when it fails or is wrong."""
    case = Case("sweep", op, str(dtype).replace("torch.", ""), (m, n))
    inp = make_inputs(case, device)
    torch._dynamo.reset()
    row = measure_row(case, impl, inp, reference(case, reference_inputs(inp, device)), make_timer(device),
                      copy=None)  # fmt: skip
    if row["fwd_status"] != "ok" or row["bwd_status"] != "ok":
        raise RuntimeError(f"{impl} {op} {case.label}: {row['error']}")
    return row["fwd_ms"], row["bwd_ms"]


class _NoBar:
    """Stands in for tqdm when it is not installed: one line per case instead of a bar."""

    def __init__(self, total):
        self.n, self.total = 0, total

    def update(self, k=1):
        self.n += k

    def set_description_str(self, text):
        print(f"[{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)

    def write(self, text):
        print(text, file=sys.stderr, flush=True)

    def close(self):
        pass


def progress(total):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(total)
    return tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)


def pending(cases, impls, done=()):
    """[(case, [impls still to measure])] for the cases with any."""
    todo = [(c, [i for i in impls if serves(i, c.op, c.dropout) and row_key(c, i) not in done])
            for c in cases]  # fmt: skip
    return [(c, case_impls) for c, case_impls in todo if case_impls]


def run(cases, impls, device="cuda", timer=None, copy=None, done=(), on_row=None, rounds=1):
    """Measure every (case, impl) not in ``done`` (keys of :func:`row_key`).

    Returns (rows, {suite: seconds}). ``on_row(row)`` is called after each measurement of the first
    round. ``rounds`` > 1: then as many more passes over every case, each on fresh inputs, timing the
    rows again in place (:func:`retime_row`: each direction keeps its fastest round); a pass is far
    apart in time from the one before it, so a disturbance lasting a second or two lands in one round
    of a cell.
    """
    timer = timer or make_timer(device)
    todo = pending(cases, impls, done)
    bar = progress(sum(len(i) for _, i in todo) * rounds)
    rows, sections = [], {}
    try:
        for suite in dict.fromkeys(c.suite for c, _ in todo):
            start = time.perf_counter()
            for case, case_impls in (t for t in todo if t[0].suite == suite):
                bar.set_description_str(f"{suite} {case.op} {case.dtype} {case.label}")
                try:
                    inp = make_inputs(case, device)
                    ref = reference(case, reference_inputs(inp, device))
                except Exception as exc:  # e.g. out of memory: every implementation of the case fails
                    inp = ref = None
                    error = "reference: " + _error(exc)
                for impl in case_impls:
                    torch._dynamo.reset()
                    if ref is None:
                        rows.append(make_row(case, impl, copy, error=error))
                    else:
                        rows.append(measure_row(case, impl, inp, ref, timer, copy))
                    if on_row:
                        on_row(rows[-1])
                    bar.update(1)
                del inp, ref
            sections[suite] = time.perf_counter() - start
            bar.write(f"section {suite}: {sections[suite]:.1f}s")
        by_key = {row_key(r): r for r in rows}
        for n in range(2, rounds + 1):
            start = time.perf_counter()
            for case, case_impls in todo:
                bar.set_description_str(f"round {n} {case.suite} {case.op} {case.dtype} {case.label}")
                timed = [by_key[row_key(case, i)] for i in case_impls]
                timed = [r for r in timed if "ok" in (r["fwd_status"], r["bwd_status"])]
                inp = None
                for row in timed:
                    torch._dynamo.reset()
                    try:
                        inp = make_inputs(case, device) if inp is None else inp
                        retime_row(case, row["impl"], inp, timer, row)
                    except Exception as exc:  # the first round's timings stand, and say so
                        row["error"] = row["error"] or f"round {n}: {_error(exc)}"
                del inp
                bar.update(len(case_impls))
            sections[f"round {n}"] = time.perf_counter() - start
            bar.write(f"round {n}: {sections[f'round {n}']:.1f}s")
    finally:
        bar.close()
    return rows, sections


# --- results: JSON, CSV, merge, table, plots ------------------------------------------------------

CSV_FIELDS = ("suite", "op", "dtype", "shape", "m", "n", "impl", "fwd_status", "fwd_ms", "fwd_gbps",
              "fwd_frac", "bwd_status", "bwd_ms", "bwd_gbps", "bwd_frac", "copy_gbps", "error")  # fmt: skip


def row_key(case_or_row, impl=None):
    """(op, dtype, shape, impl): what identifies a measurement across parts."""
    if isinstance(case_or_row, Case):
        return case_or_row.op, case_or_row.dtype, case_or_row.label, impl
    r = case_or_row
    return r["op"], r["dtype"], r["shape"], r["impl"]


def _dist_version(*names):
    import importlib.metadata

    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def device_info(device) -> dict:
    """The device's name (key ``gpu`` on every device type, so results files keep one format), its
    SMs (CUDA) or vector cores (NPU), and the device stack's versions."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return dict(device="cuda", gpu=props.name, sm_count=props.multi_processor_count,
                    cuda=torch.version.cuda)  # fmt: skip
    module = torch.get_device_module(device)
    index = module.current_device() if device.index is None else device.index
    info = dict(device=device.type, gpu=module.get_device_name(index),
                torch_npu=_dist_version("torch-npu", "torch_npu"))  # fmt: skip
    try:
        from normkit.backends.npu import config as npu_config

        info["vector_cores"] = npu_config.vector_cores(device)
    except Exception:  # the count is informative only
        pass
    return info


def metadata(device, copy, args_summary) -> dict:
    """What a run was measured on, and how."""
    try:
        import triton

        triton_version = getattr(triton, "__version__", None) or _dist_version("triton-ascend", "triton")
    except ImportError:
        triton_version = None
    # normkit_path: which install was measured (an A/B of two installs must show two)
    return dict(**device_info(device), torch=torch.__version__, triton=triton_version,
                normkit=normkit.__version__, normkit_path=str(Path(normkit.__file__).resolve().parent),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                copy_gbps=copy, command="normkit " + shlex.join(sys.argv[1:]), **args_summary)  # fmt: skip


def write_json(path, parts, rows):
    """{"format", "parts": [metadata of each run], "rows": [...]}, written atomically."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(dict(format=FORMAT, parts=parts, rows=[with_fractions(r) for r in rows]),
                              indent=1))  # fmt: skip
    os.replace(tmp, path)


def read_json(path):
    """(parts, rows) of a results file, or of DIR/results.json."""
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read results from {path}: {exc}") from None
    if data.get("format") != FORMAT:
        raise UsageError(f"{path} is not a normkit bench results file (format {data.get('format')!r})")
    return data["parts"], [with_fractions(r) for r in data["rows"]]


def part_device(part) -> str:
    """The device type a part was measured on (results written before --device existed: cuda)."""
    return part.get("device", "cuda")


def merge(sources):
    """(parts, rows) of several results: parts concatenated; a row measured again replaces the older.

    Rows are keyed without the device, so parts measured on different device types are refused."""
    parts, rows = [], {}
    for src in sources:
        p, r = read_json(src)
        parts += p
        rows.update((row_key(row), row) for row in r)
    types = sorted({part_device(p) for p in parts})
    if len(types) > 1:
        raise UsageError(f"--merge: the parts were measured on different device types ({', '.join(types)}); "
                         "merge each device's parts separately")  # fmt: skip
    return parts, list(rows.values())


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in with_fractions(row).items()})


def _num(v) -> str:
    """Three significant digits at most, never an exponent (2907, 12.3, 0.97, 0.004)."""
    return f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2 if v >= 0.1 else 3}f}"


def _cell(row, direction):
    if row is None:
        return "-"
    status = row[f"{direction}_status"]
    if status != "ok":
        return status
    return f"{_num(row[f'{direction}_gbps'])} {_num(row[f'{direction}_frac'])}"


def format_table(parts, rows) -> str:
    """One line per case; per implementation, forward and backward as 'GB/s fraction-of-copy'."""
    lines = []
    for p in parts:
        cores = f"{p['sm_count']} SMs" if p.get("sm_count") else f"{p.get('vector_cores', '?')} vector cores"
        stack = f", torch_npu {p['torch_npu']}" if p.get("torch_npu") else ""
        lines.append(f"copy {p['copy_gbps']:.0f} GB/s (read + write) on {p['gpu']} ({cores}), torch "
                     f"{p['torch']}{stack}, triton {p['triton']}, {p['date']}")  # fmt: skip
        lines += [f"  not measured: {impl}: {reason}" for impl, reason in p.get("skipped", {}).items()]
    lines.append("cells: GB/s and fraction of copy; fail = raised, wrong = off the fp64 reference, "
                 "- = not implemented")  # fmt: skip
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    cases = {}
    for r in rows:
        cases.setdefault((r["suite"], r["op"], r["dtype"], r["shape"]), {})[r["impl"]] = r
    header = ["suite", "op", "dtype", "shape"] + [f"{i} {d}" for i in impls for d in ("fwd", "bwd")]
    body = [list(key) + [_cell(by_impl.get(i), d) for i in impls for d in ("fwd", "bwd")]
            for key, by_impl in cases.items()]  # fmt: skip
    widths = [max(len(r[c]) for r in [header] + body) for c in range(len(header))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + body]
    problems = [r for r in rows if r["error"]]
    if problems:
        lines.append("\nfailures:")
        lines += [f"  {r['impl']} {r['op']} {r['dtype']} {r['shape']}: fwd {r['fwd_status']}, bwd "
                  f"{r['bwd_status']}: {r['error']}" for r in problems]  # fmt: skip
    return "\n".join(lines)


def _plot_groups(rows):
    """{(op, dtype, file suffix): (x label, [(series, x, row)])}: one figure each."""
    groups = {}
    for r in rows:
        if r["op"] in IMAGE_OPS:
            key, xlabel, series, x = "", "shape (N, C, H, W)", r["impl"], r["shape"]
        elif r["suite"] == "few":
            key, xlabel, series, x = "-few", "rows M", f"{r['impl']} N={r['n']}", r["m"]
        else:
            key, xlabel, series, x = "", "N (reduced dim 0)" if r["op"] in DIM0_OPS else "N (row length)", \
                r["impl"], r["n"]  # fmt: skip
        groups.setdefault((r["op"], r["dtype"], key), (xlabel, []))[1].append((series, x, r))
    return groups


LINESTYLES = ("-", "--", ":", "-.")  # the few suite: one per N


def _colour(impl):
    """An implementation keeps its colour in every figure."""
    return f"C{IMPLS.index(impl) if impl in IMPLS else len(IMPLS)}"


def write_plots(out_dir, rows) -> list[Path]:
    """GB/s vs N per (op, dtype): forward and backward panels, a line per implementation, copy dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (op, dtype, suffix), (xlabel, points) in _plot_groups(rows).items():
        categorical = isinstance(points[0][1], str)
        xs = list(dict.fromkeys(p[1] for p in points)) if categorical else sorted({p[1] for p in points})
        ns = sorted({r["n"] for _, _, r in points})
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, direction in zip(axes, ("fwd", "bwd")):
            for series in dict.fromkeys(p[0] for p in points):
                got = {x: r for s, x, r in points if s == series}
                first = next(iter(got.values()))
                style = LINESTYLES[ns.index(first["n"]) % len(LINESTYLES)] if suffix == "-few" else "-"
                ys = [got[x][f"{direction}_gbps"] if x in got else None for x in xs]
                ax.plot(range(len(xs)) if categorical else xs, [math.nan if y is None else y for y in ys],
                        marker="o", label=series, linestyle=style, color=_colour(first["impl"]))
            for copy in sorted({round(r["copy_gbps"]) for _, _, r in points if r.get("copy_gbps")}):
                ax.axhline(copy, linestyle="--", color="gray", label=f"copy {copy} GB/s")
            if categorical:
                ax.set_xticks(range(len(xs)), xs)
            else:
                ax.set_xscale("log", base=2)
            if suffix == "-few":  # launch-bound: far below the copy line
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_title(f"{op} {dtype} {'forward' if direction == 'fwd' else 'backward'}")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel("GB/s")
        axes[1].legend(fontsize="small")
        fig.tight_layout()
        paths.append(out_dir / f"{op}-{dtype}{suffix}.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_outputs(out_dir, parts, rows) -> str:
    """results.json, results.csv, table.txt and plots/ in ``out_dir``; returns what was written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / RESULTS, parts, rows)
    write_csv(out_dir / "results.csv", rows)
    (out_dir / "table.txt").write_text(format_table(parts, rows) + "\n")
    written = f"{out_dir}/{{{RESULTS}, results.csv, table.txt}}"
    try:
        plots = write_plots(out_dir / "plots", rows)
    except ImportError:
        return written + "; no plots: matplotlib is not installed (pip install 'normkit[bench]')"
    return written + f" and {len(plots)} plots in {out_dir / 'plots'}"


def read_best_of(source):
    """(parts, rows) of ``source``, or of the runs ``A+B+...`` it joins with ``+``: runs of one code
    (e.g. the old and the new code run in turns, A/B/A/B), the cells of run A, each keeping every
    direction's fastest run that timed it ``ok`` (a cell not ``ok`` in a run keeps that run's
    status; ``{fwd,bwd}_runs`` list every run's ms). A later run may hold some of A's cells only
    (a retry of some ops): the others keep A's. What ``--rounds`` does within one run, across runs:
    a disturbance that outlasts a run's pass over neighbouring cells lands in one run."""
    runs = [read_json(src) for src in source.split("+")]
    if len(runs) == 1:
        return runs[0]
    parts = [p for run_parts, _ in runs for p in run_parts]
    by_key = [{row_key(r): r for r in rows} for _, rows in runs]
    rows = []
    for key, first in by_key[0].items():
        cells = [first] + [b[key] for b in by_key[1:] if key in b]
        row = dict(first)
        for d in ("fwd", "bwd"):
            bad = [c[f"{d}_status"] for c in cells if c[f"{d}_status"] != "ok"]
            row[f"{d}_runs"] = [c[f"{d}_ms"] for c in cells]
            if bad:
                row[f"{d}_status"] = bad[0]
                continue
            best = max(cells, key=lambda c: c[f"{d}_gbps"])
            row[f"{d}_ms"], row[f"{d}_gbps"] = best[f"{d}_ms"], best[f"{d}_gbps"]
            row[f"{d}_frac"] = best[f"{d}_frac"]
        rows.append(row)
    return parts, rows


def compare(sources, floor=0.98, spread_limit=0.03) -> tuple[str, int]:
    """(report, number of wrong cells) of several results of the same cases, in order (an A/B: the
    old run first; a repeat: runs of one code). A source ``A+B`` is the fastest of runs A and B per
    cell (:func:`read_best_of`). Per (op, dtype, shape, impl) measured ok in every source, forward
    and backward: each source's GB/s, last / first, and the spread max / min - 1; then per direction
    the ratios' min / median / max, the cells below ``floor`` and those whose spread passes
    ``spread_limit``. A cell that failed or was wrong in any run is listed, not compared."""
    runs = [read_best_of(src) for src in sources]
    if len(runs) < 2:
        raise UsageError(f"--compare: needs two or more results (got {len(runs)})")
    by_key = [{row_key(r): r for r in rows} for _, rows in runs]
    keys = [k for k in by_key[0] if all(k in b for b in by_key[1:])]
    lines = []
    for i, (src, (parts, _)) in enumerate(zip(sources, runs)):
        p = parts[0] if parts else {}
        where = f", normkit from {p['normkit_path']}" if p.get("normkit_path") else ""
        where += f", the fastest of {src.count('+') + 1} runs per cell" if "+" in src else ""
        lines.append(f"run {i + 1}: {src} ({p.get('gpu')}, triton {p.get('triton')}, {p.get('date')}{where})")
    lines.append(f"{len(keys)} cells in every run; GB/s per run, last / first, spread = max / min - 1")
    ratios, low, wide, bad, wrong = {"fwd": [], "bwd": []}, [], [], [], 0
    for key in keys:
        cells = [b[key] for b in by_key]
        name = " ".join(map(str, key))
        text = [name]
        for d in ("fwd", "bwd"):
            status = {c[f"{d}_status"] for c in cells}
            if status == {None} or status == {"-"}:
                continue
            if status != {"ok"}:
                wrong += "wrong" in status
                bad.append(f"{name} {d}: " + " / ".join(c[f"{d}_status"] or "-" for c in cells))
                continue
            v = [c[f"{d}_gbps"] for c in cells]
            ratio, spread = v[-1] / v[0], max(v) / min(v) - 1
            ratios[d].append(ratio)
            low += [f"{name} {d} {ratio:.3f}"] if ratio < floor else []
            wide += [f"{name} {d} {spread:.1%}"] if spread > spread_limit else []
            text.append(f"{d} " + " ".join(_num(x) for x in v) + f" x{ratio:.3f} ~{spread:.1%}")
        lines.append("  ".join(text))
    for d, r in ratios.items():
        if r:
            r = sorted(r)
            lines.append(f"{d}: last / first min {r[0]:.3f}, median {r[len(r) // 2]:.3f}, max {r[-1]:.3f} "
                         f"over {len(r)} cells")  # fmt: skip
    lines.append(f"below {floor}: {len(low)}" + "".join(f"\n  {c}" for c in low))
    lines.append(f"spread over {spread_limit:.0%}: {len(wide)}" + "".join(f"\n  {c}" for c in wide))
    if bad:
        lines.append(f"not compared (fail / wrong in a run): {len(bad)}" + "".join(f"\n  {c}" for c in bad))
    return "\n".join(lines), wrong


# --- the command ----------------------------------------------------------------------------------


def _exit_status(rows) -> int:
    return 1 if any("wrong" in (r["fwd_status"], r["bwd_status"]) for r in rows) else 0


def _merge_command(args) -> int:
    parts, rows = merge(args.merge)
    print(format_table(parts, rows))
    if args.out:
        print(write_outputs(args.out, parts, rows), file=sys.stderr)
    return _exit_status(rows)


def _impls(requested, device_type="cuda") -> tuple[list[str], dict[str, str]]:
    """(implementations to measure, {implementation not measured: why}).

    The reasons printed and returned leave out implementations made for another device type (torch_npu
    on cuda), but keep those NOT_ON explains (torch.compile, Liger-Kernel, quack on npu)."""
    status = available_impls(device_type)
    if requested:
        missing = [f"{i}: {status[i]}" for i in requested if status[i]]
        if missing:
            raise UsageError(f"--impls: unavailable on {device_type}: " + "; ".join(missing))
        return list(requested), {}
    meant_here = lambda i: ONLY_ON.get(i, device_type) == device_type or (i, device_type) in NOT_ON  # noqa: E731
    skipped = {i: r for i, r in status.items() if r and meant_here(i)}
    for impl, reason in skipped.items():
        print(f"normkit bench: skipping {impl}: {reason}", file=sys.stderr)
    return [i for i in IMPLS if not status[i] and i not in OPT_IN], skipped


def _npu_status() -> tuple[bool, str]:
    """normkit.testing.npu_status (imports torch_npu only where it is installed), import errors as reasons."""
    from normkit.testing import npu_status

    try:
        return npu_status()
    except Exception as exc:  # torch_npu installed but failing to load (e.g. CANN missing)
        return False, f"torch_npu failed to import ({_error(exc)})"


NO_DEVICE_HINT = "--list shows the cases and --merge works without one"


def resolve_device(requested="auto") -> str:
    """The device type to measure on for ``--device requested``; UsageError when it is absent.

    auto: cuda if torch.cuda.is_available(), else npu if an Ascend NPU is usable. torch_npu is imported
    only for ``npu`` or for ``auto`` without a GPU, and only where it is installed.
    """
    if requested not in DEVICES:
        raise UsageError(f"--device {requested!r}: choose from {', '.join(DEVICES)}")
    if requested in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    if requested == "cuda":
        raise UsageError(f"--device cuda: needs a CUDA GPU (torch.cuda.is_available() is False); "
                         f"{NO_DEVICE_HINT}")  # fmt: skip
    ok, reason = _npu_status()
    if ok:
        return "npu"
    if requested == "npu":
        raise UsageError(f"--device npu: needs an Ascend NPU ({reason}); {NO_DEVICE_HINT}")
    raise UsageError(f"needs a CUDA GPU or an Ascend NPU (--device auto: torch.cuda.is_available() is False; "
                     f"npu: {reason}); {NO_DEVICE_HINT}")  # fmt: skip


def command(args) -> int:
    """`normkit bench` (see the CLI's help): exit 0, 1 if any result is wrong, 2 on a usage error."""
    try:
        if getattr(args, "compare", None):
            report, wrong = compare(args.compare)
            print(report)
            return 1 if wrong else 0
        if args.merge:
            return _merge_command(args)
        if getattr(args, "device", None) == "cpu" and not args.list:
            if args.rounds != 1:
                raise UsageError(f"--rounds {args.rounds}: the CPU bench repeats its own timed loops; "
                                 "--rounds is for cuda and npu (accepted on cpu: 1)")
            from normkit import bench_cpu

            return bench_cpu.command(args)
        return _bench_command(args)
    except UsageError as exc:
        print(f"normkit bench: {exc}", file=sys.stderr)
        return 2


def _bench_command(args) -> int:
    dropout = getattr(args, "dropout", 0.0)
    cases = plan(args.suite or SUITES, args.ops, args.dtypes, args.n, args.quick, dropout)
    if not cases:
        raise UsageError(f"no cases: --ops {','.join(args.ops or [])} is in none of the suites "
                         f"{','.join(args.suite or SUITES)} (image: {','.join(IMAGE_OPS)}; dim0: "
                         f"{','.join(DIM0_OPS)}; the others: {','.join(ROW_OPS)})")  # fmt: skip
    if args.shard:
        cases = shard(cases, args.shard)
    if args.list:
        for c in cases:
            print(f"{c.suite:6s} {c.op:16s} {c.dtype:9s} {c.label}")
        print(f"{len(cases)} cases", file=sys.stderr)
        return 0
    if args.resume and not args.out:
        raise UsageError("--resume needs --out DIR (the directory whose results it continues)")
    device_type = resolve_device(getattr(args, "device", None) or "auto")
    impls, skipped = _impls(args.impls, device_type)
    parts, old_rows = read_json(args.out) if args.resume and (Path(args.out) / RESULTS).exists() else ([], [])
    others = sorted({part_device(p) for p in parts} - {device_type})
    if others:
        raise UsageError(f"--resume: {args.out} holds results measured on {', '.join(others)}, not "
                         f"{device_type}; measure {device_type} into another --out DIR")  # fmt: skip
    done = {row_key(r) for r in old_rows}
    todo = pending(cases, impls, done)
    if not todo:
        print(format_table(parts, old_rows))
        print(f"\nnothing to do: {args.out} has every measurement of these cases", file=sys.stderr)
        return _exit_status(old_rows)
    device = torch.device(device_type, torch.get_device_module(device_type).current_device())
    copy = copy_gbps(device)
    summary = dict(suites=args.suite or list(SUITES), dtypes=sorted({c.dtype for c in cases}), impls=impls,
                   skipped=skipped, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, rounds=args.rounds,
                   gc="running" if args.gc_running else "paused",
                   shard="/".join(map(str, args.shard)) if args.shard else None)  # fmt: skip
    part = metadata(device, copy, summary)
    parts.append(part)
    count = sum(len(i) for _, i in todo)
    print(f"normkit bench: {count} measurements ({len(todo)} cases x {', '.join(impls)}) on {part['gpu']}; "
          f"copy {copy:.0f} GB/s", file=sys.stderr)  # fmt: skip
    new_rows, start = [], time.perf_counter()

    def save(row):  # (a first round's row; later rounds time the rows in place, written at the end)
        new_rows.append(row)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            write_json(Path(args.out) / RESULTS, parts, old_rows + new_rows)

    timer = make_timer(device, args.warmup_ms, args.rep_ms, pause_gc=not args.gc_running)
    _, part["sections"] = run(cases, impls, device, timer, copy, done, save, args.rounds)
    part["elapsed_s"] = time.perf_counter() - start
    rows = old_rows + new_rows
    print(format_table(parts, rows))
    sections = ", ".join(f"{s} {t:.0f}s" for s, t in part["sections"].items())
    print(f"\n{len(new_rows)} measurements in {part['elapsed_s']:.0f}s ({sections})")
    if args.out:
        print(write_outputs(args.out, parts, rows), file=sys.stderr)
    return _exit_status(rows)
