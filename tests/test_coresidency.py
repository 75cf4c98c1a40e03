"""No kernel waits forever (marker `cuda`): every op whose programs wait on each other (split rows,
split BatchNorm channels) finishes with the right result while another stream's kernel holds all
but a few SMs and waits for a flag that is set on the op's stream *after* the op.

The holding kernel ("hog") runs one 1024-thread, register-heavy program per SM it takes and spins
until the flag is set; its programs record their SM, so the test knows how many SMs were left.
Before coop.join, the split kernels hung here (issue 40: fp32 (2048, 262144) LayerNorm, RMSNorm,
softmax with 8 SMs free). Each op's split path is asserted to be the one the config picks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import normkit
from normkit.testing import gpu_lock

TIMEOUT_S = 60.0
FREE_SMS = 4  # SMs the hog leaves to the op


def _hog_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def hog(Flag, Started, Sm, Out, BLOCK: tl.constexpr):
        """Hold this SM (1024 threads, ~64 registers each) until Flag is set."""
        pid = tl.program_id(0)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False,
                                       pack=1)  # fmt: skip
        tl.store(Sm + pid, sm)
        tl.atomic_add(Started, 1, sem="release", scope="gpu")
        acc = tl.arange(0, BLOCK).to(tl.float32)
        acc2 = acc + 1.0  # two BLOCK-wide accumulators: 64 values a thread, the whole register file
        while tl.atomic_add(Flag, 0, sem="acquire", scope="gpu") == 0:
            acc = acc * 0.999 + acc2
            acc2 = acc2 * 0.998 + acc
        tl.store(Out + pid * BLOCK + tl.arange(0, BLOCK), acc + acc2)

    return hog


class Hog:
    """Run the hog on its own stream over all but ``free`` SMs; release it on exit (also when it did
    not start)."""

    def __init__(self, free: int):
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.programs = self.sms - free
        self.stream = torch.cuda.Stream()
        self.copier = torch.cuda.Stream()
        self.flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.started = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.sm = torch.full((self.programs,), -1, dtype=torch.int32, device="cuda")
        self.out = torch.empty(self.programs * 32768, device="cuda")
        self.kernel = _hog_kernel()

    def __enter__(self):
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            self.kernel[(self.programs,)](self.flag, self.started, self.sm, self.out, BLOCK=32768,
                                          num_warps=32)  # fmt: skip
        deadline = time.monotonic() + 10
        while self._read(self.started) < self.programs:
            if time.monotonic() > deadline:
                self.__exit__()
                pytest.fail("the hog did not start on all its SMs within 10 s")
            time.sleep(0.01)
        self.held = len(set(self._read(self.sm, all=True)))
        return self

    def _read(self, t, all=False):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.copier):
            host.copy_(t, non_blocking=True)
        self.copier.synchronize()
        return host.tolist() if all else int(host[0])

    def release(self):
        one = torch.ones(1, dtype=torch.int32, pin_memory=True)
        with torch.cuda.stream(self.copier):
            self.flag.copy_(one, non_blocking=True)  # a copy-engine write: needs no SM
        self.copier.synchronize()

    def __exit__(self, *exc):
        self.release()
        self.stream.synchronize()


def _run_held(fn):
    """Run ``fn`` on its own stream while the hog holds all but FREE_SMS SMs, then set the hog's
    flag on that stream after it (so a kernel of ``fn`` that never finishes holds the hog too).
    Returns fn's result; fails if it has not finished within TIMEOUT_S. The caller runs ``fn``'s
    work once before (a warm-up): the first launch of a kernel loads its module (cuModuleLoadData),
    which waits for the device's running kernels, the hog among them (measured: a cold first call
    blocks in Triton's CompiledKernel._init_handles for as long as the hog spins)."""
    with gpu_lock(), Hog(FREE_SMS) as hog:
        assert hog.held >= hog.sms - 2 * FREE_SMS, f"the hog holds only {hog.held} of {hog.sms} SMs"
        op_stream = torch.cuda.Stream()
        with torch.cuda.stream(op_stream):
            out = fn()
            hog.flag.fill_(1)  # queued after the op: the hog waits for the op
            done = torch.cuda.Event()
            done.record()
        deadline = time.monotonic() + TIMEOUT_S
        while not done.query():
            if time.monotonic() > deadline:
                hog.release()
                op_stream.synchronize()
                free = hog.sms - hog.held
                pytest.fail(f"the op did not finish within {TIMEOUT_S:.0f} s with {free} SMs free")
            time.sleep(0.005)
    torch.cuda.synchronize()
    return out


def _grads(y, inputs, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=g)
    return dy, torch.autograd.grad(y, inputs, dy, allow_unused=True)


def _close(got, want, dtype, what):
    tol = {torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]
    err = ((got.double() - want) / (want.abs().max() + 1e-30)).abs().max().item()
    assert err < tol, f"{what}: max error {err:.3g} (relative to the largest value) over {tol}"


ROW_OPS = ["layer_norm", "rms_norm", "softmax", "add_layer_norm"]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ROW_OPS)
def test_split_rows_finish_with_sms_held(op, dtype):
    """Forward and backward of every split-row op on rows long enough to split, with all but
    FREE_SMS SMs held by a kernel waiting for the op: finishes, and matches fp64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from normkit.backends.cuda import config

    # 16 rows: solo programs each read their group's rows whole, on FREE_SMS SMs
    M, N = 16, 262144 if dtype == torch.float32 else 131072
    dev = torch.device("cuda")
    kind = {"add_layer_norm": "add_norm"}.get(op, op)
    fwd = config.softmax(M, N, dtype, dev) if op == "softmax" else config.forward(M, N, dtype, dev, kind)
    assert fwd.split > 1 and not fwd.smem, f"{op} {dtype} ({M}, {N}) forward does not take split rows: {fwd}"
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(M, N, device="cuda", dtype=dtype, generator=g) + 2
    r = torch.randn(M, N, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(N, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(N, device="cuda", dtype=dtype, generator=g)

    def run(lib, x, w, b, r):
        if op == "layer_norm":
            return lib.layer_norm(x, (N,), w, b)
        if op == "rms_norm":
            return lib.rms_norm(x, (N,), w, 1e-5)
        if op == "softmax":
            return lib.softmax(x, -1)
        if lib is normkit:
            return normkit.add_layer_norm(x, r, (N,), w, b)
        return F.layer_norm(x + r, (N,), w, b)

    leaves = [t.detach().requires_grad_() for t in (x, w, b, r)]
    _grads(run(normkit, *leaves), leaves[:2], 1)  # warm-up: see _run_held
    got_y = _run_held(lambda: run(normkit, *leaves))
    got_dy, got_g = _run_held(lambda: _grads(got_y, leaves[:2], 1))
    ref = [t.detach().double().requires_grad_() for t in (x, w, b, r)]
    want_y = run(F, *ref)
    want_g = torch.autograd.grad(want_y, ref[:2], got_dy.double(), allow_unused=True)
    _close(got_y, want_y, dtype, f"{op} y")
    for name, a, e in zip(("dx", "dweight"), got_g, want_g):
        if op == "softmax" and name == "dweight":
            continue
        _close(a, e, dtype, f"{op} {name}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_batch_norm_finishes_with_sms_held(dtype):
    """BatchNorm training forward and backward on split channels with all but FREE_SMS SMs held."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from normkit.backends.cuda import config

    shape = (64, 16, 56, 56)
    cfg = config.batch_norm_split(shape[0], shape[1], shape[2] * shape[3], dtype, torch.device("cuda"), False)
    assert cfg is not None and cfg.split > 1, f"BatchNorm {dtype} {shape} does not take split channels"
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(shape, device="cuda", dtype=dtype, generator=g) + 1
    w = torch.randn(shape[1], device="cuda", dtype=dtype, generator=g)
    b = torch.randn(shape[1], device="cuda", dtype=dtype, generator=g)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    warm = normkit.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True)
    _grads(warm, leaves, 2)  # warm-up: see _run_held
    got_y = _run_held(lambda: normkit.batch_norm(leaves[0], None, None, leaves[1], leaves[2], training=True))
    got_dy, got_g = _run_held(lambda: _grads(got_y, leaves, 2))
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want_y = F.batch_norm(ref[0], None, None, ref[1], ref[2], training=True)
    want_g = torch.autograd.grad(want_y, ref, got_dy.double())
    _close(got_y, want_y, dtype, "batch_norm y")
    for name, a, e in zip(("dx", "dweight", "dbias"), got_g, want_g):
        _close(a, e, dtype, f"batch_norm {name}")
