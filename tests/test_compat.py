"""The Triton-release adapter (backends/cuda/compat.py): the names the Gluon kernels use resolve on the
installed Triton, its probe kernel compiles for Hopper without a GPU (CI runs this on the lowest and
the newest supported Triton), and each fast path falls back, once, with a warning and the same
answers (GPU halves: marker `cuda`)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import triton

from normkit.backends.cuda import compat, config, launch, smem
from normkit.testing import Executor, check_case


@pytest.fixture
def fresh(monkeypatch):
    """compat's process state saved and restored around the test."""
    monkeypatch.setattr(compat, "_DISABLED", {})
    monkeypatch.setattr(compat, "_PROBED", {})
    config.clear_caches()
    yield
    monkeypatch.undo()
    config.clear_caches()


def test_gluon_names_resolve():
    """Every Gluon name the shared-memory kernels take from compat exists in this Triton (a rename
    in a new release shows here, on CPU, before any GPU run)."""
    assert compat._MISSING is None, compat._MISSING
    assert compat.barrier is not None and compat.async_copy is not None
    assert compat.async_copy.__name__ in ("async_load", "async_copy_global_to_shared")
    assert compat.barrier.__name__ in ("barrier", "thread_barrier")
    assert smem.AVAILABLE


_PROBE_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from normkit.backends.cuda import compat
aligned = [["tt.divisibility", 16]]
src = GluonASTSource(compat._probe_kernel, {"X": "*fp16", "Y": "*fp16", "Count": "*i32"}, {"N": 1024},
                     attrs={(0,): aligned, (1,): aligned})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
print("cp.async" in ptx, "bar.sync" in ptx, "atom" in ptx)
"""


def test_probe_kernel_compiles_for_hopper():
    """The probe kernel, which uses each Gluon construct of the kernels, compiles to PTX for sm_90
    with this Triton's own compiler (no GPU needed; in a process without TRITON_INTERPRET, under
    which Triton's own jitted helpers such as gl.sum are interpreter functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PROBE_COMPILE], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True", "True"], run.stdout


def test_missing_gluon_disables_it_once_with_a_warning(fresh, monkeypatch):
    """Without Gluon (or a name it needs) the shared-memory kernels are never chosen: one
    FastPathWarning naming the path and the reason, then silence."""
    monkeypatch.setattr(compat, "_MISSING", "triton 0.0 has no Gluon (test)")
    with pytest.warns(compat.FastPathWarning, match=r"gluon fast path is off .*no Gluon \(test\)"):
        assert not compat.gluon_ok(torch.device("cuda", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not compat.gluon_ok(torch.device("cuda", 0))
    assert "no Gluon (test)" in compat.disabled("gluon")


def test_disable_forgets_configs_and_compiled_kernels(fresh):
    """Turning a path off clears the memoized launch configs and the direct-launch cache, so no
    config chosen with the path survives."""
    config.forward(8, 1024, torch.float32, torch.device("cpu"))
    launch._CACHE[("sentinel",)] = None
    assert config.forward.cache_info().currsize
    with pytest.warns(compat.FastPathWarning):
        compat.disable("gluon", "test")
    assert config.forward.cache_info().currsize == 0 and not launch._CACHE


# --- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gluon_fallback_matches_reference(run_on, fresh, dtype):
    """With Gluon off, rows that take the shared-memory kernels take plain Triton ones and match
    fp64, forward and backward."""
    with run_on(Executor("cuda", "cuda"), dtype):
        dev = torch.device("cuda")
        assert config.forward(257, 40000, dtype, dev, smem_ok=True).smem
        with pytest.warns(compat.FastPathWarning):
            compat.disable("gluon", "test")
        assert not config.forward(257, 40000, dtype, dev, smem_ok=True).smem
        for op in ("layer_norm", "rms_norm", "softmax"):
            check_case(op, (257, 40000), dtype=dtype, device="cuda", seed=3)


class _ChangedLauncher:
    """A compiled kernel whose launcher takes other arguments (a future Triton)."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def run(self, *args):
        raise TypeError("launch() takes 9 positional arguments")


@pytest.mark.cuda
def test_direct_launch_falls_back_on_a_changed_launcher(run_on, fresh):
    """A compiled kernel whose launcher raises TypeError: the launch goes through ``fn[grid]``, one
    warning, the same answers."""
    with run_on(Executor("cuda", "cuda"), torch.float32):
        check_case("layer_norm", (64, 1024), dtype=torch.float32, device="cuda", seed=1)  # fills the cache
        assert launch._CACHE
        for key, (kernel, tail, full) in list(launch._CACHE.items()):
            launch._CACHE[key] = (_ChangedLauncher(kernel), tail, full)
        with pytest.warns(compat.FastPathWarning, match="direct launch"):
            check_case("layer_norm", (64, 1024), dtype=torch.float32, device="cuda", seed=2)
        assert compat.disabled("direct launch")
        check_case("layer_norm", (64, 1024), dtype=torch.float32, device="cuda", seed=3)


def test_info_names_the_tested_triton_range(capsys):
    """``normkit info`` says whether the installed Triton is in the ``cuda`` extra's range."""
    from packaging.version import Version

    from normkit import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    spec = cli._triton_range()
    assert spec is not None and Version("3.6.0") in spec and Version("3.5.1") not in spec
    assert Version("3.9.0") in spec and Version("3.10.0") not in spec
    verdict = "in" if Version(triton.__version__) in spec else "NOT in"
    assert f"{verdict} the tested range {spec}" in out


@pytest.mark.parametrize("version,refused", [("3.6.0", False), ("3.7.1", False), ("3.8.0", True),
                                             ("3.9.0", True), ("3.10.0", True)])
def test_rows_in_parts_refused_on_triton_that_gets_them_wrong(monkeypatch, version, refused):
    """More than one part a row only where forced (config.IN_PARTS is off) and the installed Triton is
    below compat.IN_PARTS_WRONG_FROM; one part a row is never refused."""
    monkeypatch.setattr(triton, "__version__", version)
    assert (compat.in_parts_ok() is not None) == refused
    if refused:
        assert version in compat.in_parts_ok()
    with config.forced(in_parts=True):
        assert config._parts_refused(2) == refused
        assert not config._parts_refused(1)
    assert config._parts_refused(2) and not config._parts_refused(1)
    with config.forced(in_parts=False):
        assert config._parts_refused(2) and not config._parts_refused(1)


def test_forced_strategies_hold_in_their_block_and_context_only():
    """config.forced: the choosers follow the forced strategy inside the block (nested blocks add to
    the enclosing one), the measured one outside it and on another thread (a fresh context); an
    unknown strategy is an error."""
    import threading

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    measured = config.forward(16, 4096, bf16, cpu)
    split = config.batch_norm_split(2, 16, 1024, bf16, cpu, False)
    assert measured.fused and split is not None and split.prefetch
    with config.forced(fused_max_n_fwd=128) as force:
        assert force == config.Force(fused_max_n_fwd=128) == config.force()
        assert not config.forward(16, 4096, bf16, cpu).fused
        seen = []
        thread = threading.Thread(target=lambda: seen.append(config.forward(16, 4096, bf16, cpu)))
        thread.start()
        thread.join()
        assert seen == [measured]
        with config.forced(batch_norm_pipelined=False) as inner:
            assert inner == config.Force(fused_max_n_fwd=128, batch_norm_pipelined=False)
            assert not config.batch_norm_split(2, 16, 1024, bf16, cpu, False).prefetch
        with config.forced(batch_norm_split=False):
            assert config.batch_norm_split(2, 16, 1024, bf16, cpu, False) is None
            assert config.batch_norm_channels(2, 16, 1024, bf16, cpu, False, True) is None
        with config.forced(batch_norm_split=True):
            assert config.batch_norm_channels(2, 16, 1024, bf16, cpu, True, True) == \
                config.batch_norm_split(2, 16, 1024, bf16, cpu, True) is not None  # fmt: skip
    assert config.force() == config.NOT_FORCED
    assert config.forward(16, 4096, bf16, cpu) == measured
    assert config.batch_norm_split(2, 16, 1024, bf16, cpu, False) == split
    with pytest.raises(TypeError, match="in_part"):
        with config.forced(in_part=True):
            pass


def test_forced_strategies_key_the_plans():
    """A call inside a forced block never reuses a plan made outside it (or in another block): the
    Force is part of the plan signature (plans.overrides_key)."""
    from normkit import plans

    x, w = torch.randn(4, 64), torch.randn(64)
    outside = plans.key("layer_norm", x, (w, None), 64, 1e-5)
    with config.forced(in_parts=True):
        inside = plans.key("layer_norm", x, (w, None), 64, 1e-5)
        with config.forced(split_prefetch=False):
            nested = plans.key("layer_norm", x, (w, None), 64, 1e-5)
    assert len({outside, inside, nested}) == 3
    assert plans.key("layer_norm", x, (w, None), 64, 1e-5) == outside
