"""`normkit` command line: --version, one-line usage errors (exit 2), --help without torch, `check`'s exit
statuses and its --quick plan under the interpreter, and the case counts the README states."""

import argparse
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normkit
from normkit import bench_plan, cli, testing

ROOT = Path(__file__).resolve().parents[1]


def run(*argv, code=None):
    """`python -m normkit ARGV` in a fresh interpreter (``code``: a script run instead)."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "normkit", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def usage_error(argv, capsys) -> str:
    """The one line `normkit ARGV` prints on stderr, after checking it exits 2 with nothing on stdout."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    return err


# --- --version, --help ----------------------------------------------------------------------------


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"normkit {normkit.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", normkit.__version__)


# What `normkit --help` etc. leave in sys.modules: a fresh interpreter runs normkit's entry point (as
# `python -m normkit` and the `normkit` script do) for each argv, then prints the heavy modules loaded.
HELP_PROBE = """
import contextlib, io, json, sys
from normkit.cli import main
codes = []
for argv in ({argvs}):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit as exc:
            codes.append(exc.code)
print(json.dumps([codes, sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules)]))
"""


def test_help_version_and_usage_errors_import_no_torch():
    argvs = [["--help"], ["--version"], ["info", "--help"], ["check", "--help"], ["bench", "--help"],
             ["info", "--shape", "16by4096"], ["bench", "--suite", "big"], []]  # fmt: skip
    done = run(code=HELP_PROBE.format(argvs=repr(argvs)))
    assert done.returncode == 0, done.stderr
    codes, heavy = json.loads(done.stdout)
    assert codes == [0, 0, 0, 0, 0, 2, 2, 2]
    assert heavy == []


def test_python_m_normkit_help():
    done = run("--help")
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.startswith("usage: normkit [-h] [--version] {info,check,bench,native}")
    for command in ("info", "check", "bench"):
        assert f"\n    {command} " in done.stdout


def test_bench_description_is_the_first_paragraph_of_bench_doc():
    """bench_plan.DESCRIPTION (no torch) is normkit.bench's docstring's first paragraph, kept in step."""
    from normkit import bench

    assert bench.__doc__.split("\n\n")[0] == bench_plan.DESCRIPTION


# --- usage errors: one line, exit 2 ---------------------------------------------------------------


@pytest.mark.parametrize("text, shape", [("16,4096", (16, 4096)), ("16x4096", (16, 4096)),
                                         ("16X4096", (16, 4096)), (" 3 , 7 ", (3, 7)), ("1x1", (1, 1))])
def test_shape_accepts_m_comma_n_and_m_x_n(text, shape):  # fmt: skip
    assert cli.rows_shape(text) == shape


@pytest.mark.parametrize("text", ["16by4096", "16", "16,4096,2", "0x4096", "16x0", "-1,4", "a,b", "", "1.5"])
def test_bad_shape_is_a_one_line_usage_error(text, capsys):
    err = usage_error(["info", f"--shape={text}"], capsys)
    assert err == (f"normkit info: argument --shape: got {text!r}; expected M,N or MxN, two positive "
                   "integers such as 16,4096 or 16x4096 (see normkit info --help)\n")  # fmt: skip


def test_bad_shape_prints_no_traceback():
    done = run("info", "--shape", "16by4096")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("normkit info: argument --shape: got '16by4096'; expected M,N or MxN")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize("argv, line", [
    ([], "normkit: the following arguments are required: {info,check,bench,native} (see normkit --help)"),
    (["frob"], "normkit: argument {info,check,bench,native}: invalid choice: 'frob' (choose from 'info', "
               "'check', 'bench', 'native') (see normkit --help)"),
    (["check", "--device", "tpu"], "normkit check: argument --device: invalid choice: 'tpu' (choose from "
                                   "'auto', 'cpu', 'cuda', 'npu') (see normkit check --help)"),
    (["info", "--dtype", "int8"], "normkit info: argument --dtype: invalid choice: 'int8' (choose from "
                                  "'float16', 'bfloat16', 'float32', 'float64') (see normkit info --help)"),
    (["bench", "--n", "0"], "normkit bench: argument --n: expected comma-separated positive integers, got "
                            "'0' (see normkit bench --help)"),
])  # fmt: skip
def test_usage_errors_are_one_line(argv, line, capsys):
    assert usage_error(argv, capsys) == line + "\n"


@pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="prints launch configs with triton only")
def test_info_shape_m_x_n(capsys):
    assert cli.main(["info", "--shape", "16x4096", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "launch configs for rows M=16, N=4096, float32" in out
    assert "  cuda forward   " in out and "  npu rows       " in out


# --- normkit check: exit statuses -----------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_check_on_a_missing_cuda_gpu_exits_2(capsys):
    assert cli.main(["check", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("normkit check: --device cuda: cuda is unavailable (no CUDA GPU available); "
                          "available here: --device cpu")  # fmt: skip


@pytest.mark.skipif(testing.npu_status()[0], reason="checks the message printed without an NPU")
def test_check_on_a_missing_npu_exits_2(capsys):
    assert cli.main(["check", "--device", "npu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"normkit check: --device npu: npu is unavailable ({testing.npu_status()[1]})")


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_check_interpret_with_a_device_exits_2(device, capsys):
    assert cli.main(["check", "--interpret", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"normkit check: --device {device} with --interpret: the interpreter runs the "
                          "kernels on CPU tensors")  # fmt: skip
    assert err.count("\n") == 1


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.4.0rc1", True), ("3.6.0", "2.3.5", False),
    ("3.7.1", "2.4.6", False), ("3.9.0", "2.5.0", False), ("3.2.0", "1.26.4", False),
])  # fmt: skip
def test_interpreter_numpy_problem(triton_version, numpy_version, refused):
    problem = testing.interpreter_numpy_problem(triton_version, numpy_version)
    assert bool(problem) == refused
    if refused:
        assert problem == (f"Triton {triton_version}'s interpreter needs numpy < 2.4, found numpy "
                           f"{numpy_version}: pip install 'numpy<2.4' (or Triton >= 3.7)")  # fmt: skip


def test_check_interpret_where_the_interpreter_cannot_run_exits_2(monkeypatch, capsys):
    """Triton 3.6 beside numpy 2.4 (what torch 2.11's install line gets without the numpy pin): one
    line and exit 2, not a TypeError from inside the first kernel."""
    import numpy

    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    assert cli.main(["check", "--interpret", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("normkit check: --interpret: cuda-kernels-interpreter is unavailable (Triton "
                          "3.6.0's interpreter needs numpy < 2.4, found numpy 2.4.6: pip install "
                          "'numpy<2.4'")  # fmt: skip


@pytest.mark.parametrize("fails, status", [(False, 0), (True, 1)])
def test_check_exits_1_when_a_check_fails(fails, status, monkeypatch, capsys):
    """1 means a check failed (and only that: usage errors and missing devices are 2)."""
    calls = []

    def fake_check_case(op, shape, normalized_ndim, dtype, device):
        calls.append((op, shape, dtype))
        if fails and op == "softmax" and dtype == torch.float32:
            raise AssertionError("y: mismatch\nmore detail")
        return {"y": 0.25}

    monkeypatch.setattr(testing, "check_case", fake_check_case)
    assert cli.main(["check", "--device", "cpu", "--quick"]) == status
    out, err = capsys.readouterr()
    assert len(calls) == len(cli.OPS) * 3 * 3  # ops x dtypes x the first three shapes
    assert {shape for _, shape, _ in calls} == {(1, 1), (3, 7), (128, 1023)}
    groups = len(cli.OPS) * 3
    assert f"{groups - fails}/{groups} op x dtype groups passed" in out
    if fails:
        assert "cpu softmax float32 (1, 1): y: mismatch\n" in err


def test_check_cpu_checks_what_users_get():
    """`check --device cpu` runs CPU calls as a user's run (torch's operators through normkit.cpu),
    not under a reference override."""
    from normkit import cpu, dispatch

    args = argparse.Namespace(interpret=False, quick=True, device="cpu")
    (executor,), _ = cli._executors(args)
    assert executor.name == "cpu"
    with executor.activate():
        assert dispatch._IN_OVERRIDE[0] == 0 and cpu.serves(torch.ones(2))


# --- normkit check --interpret --quick --------------------------------------------------------------


def test_quick_interpreter_plan_is_small():
    args = argparse.Namespace(interpret=True, quick=True, device="auto")
    executors, shapes = cli._executors(args)
    assert [ex.name for ex in executors] == ["cuda-kernels-interpreter", "npu-kernels-interpreter"]
    assert shapes == [(3, 7), (2, 1030)]
    assert max(n for _, n in shapes) > 1024  # the NPU backend's column loop runs twice
    args.quick = False
    assert cli._executors(args)[1] == cli.INTERPRETER_SHAPES


# The contract functions each op's forward and backward call (training mode).
ROW_AND_GROUP = ("layer_norm", "rms_norm", "softmax", "add_layer_norm", "add_rms_norm", "group_norm")
FWD_BWD = {f"{name}_{d}" for name in ROW_AND_GROUP for d in ("fwd", "bwd")} | {"batch_norm_train_fwd",
                                                                              "batch_norm_bwd"}


@pytest.mark.skipif(not testing.interpreting(), reason="needs TRITON_INTERPRET=1 from the start (CPU hosts)")
def test_check_interpret_quick_runs_every_op_fwd_and_bwd_on_both_backends(monkeypatch, capsys):
    """The quick sweep's kernels, fp32 only (the command runs fp16 and bf16 too): both backends serve
    every op's forward and backward."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cli, "DTYPES", ("float32",))
    calls = []
    for backend in ("cuda", "npu"):
        module = importlib.import_module(f"normkit.backends.{backend}")
        for name in FWD_BWD:
            real = getattr(module, name)
            spy = lambda *a, _r=real, _k=(backend, name), **k: calls.append(_k) or _r(*a, **k)  # noqa: E731
            monkeypatch.setattr(module, name, spy)
    assert cli.main(["check", "--interpret", "--quick"]) == 0
    assert set(calls) == {(backend, name) for backend in ("cuda", "npu") for name in FWD_BWD}
    out = capsys.readouterr().out
    assert f"{2 * len(cli.OPS)}/{2 * len(cli.OPS)} op x dtype groups passed" in out
    assert "shapes 3x7, 2x1030)" in out


# --- counts stated in the README ------------------------------------------------------------------


def test_readme_states_the_bench_case_counts(capsys):
    readme = (ROOT / "README.md").read_text()
    full = int(re.search(r"The full run \((\d+) cases\)", readme)[1])
    quick = int(re.search(r"`--quick` \((\d+) cases\)", readme)[1])
    assert full == len(bench_plan.plan()) == 3 * (6 * 9 + 6 * 4 + 6 * 6 + 2 * 4 * 2 + 2 * 3) == 408
    assert quick == len(bench_plan.plan(quick=True)) == 6 * 3 + 2 * 2 + 2 == 24
    assert cli.main(["bench", "--list"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == full and err == f"{full} cases\n"
