"""`normkit bench` without timing: case plans, arguments, byte counts, result files, merge, table,
plots, and the check-then-time loop on CPU tensors with a stand-in timer; devices, implementations per
device, the torch_npu wrappers (a fake torch_npu module) and the event timer (a fake device module)."""

import argparse
import csv
import gc
import json
import math
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

from normkit import bench, cli

# The fewest bytes each op must move, in units of its input tensor (the module docstring's table).
EXPECTED_UNITS = {
    "layer_norm": (2, 3), "rms_norm": (2, 3), "softmax": (2, 3), "log_softmax": (2, 3),
    "add_layer_norm": (4, 4), "add_rms_norm": (4, 4), "group_norm": (2, 3), "batch_norm": (2, 3),
    "softmax_dim0": (2, 3), "log_softmax_dim0": (2, 3),
}  # fmt: skip


def parse(*argv):
    parser = argparse.ArgumentParser(prog="normkit")
    cli.add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def plan(*argv):
    args = parse(*argv)
    return bench.plan(args.suite or bench.SUITES, args.ops, args.dtypes, args.n, args.quick)


def make_rows(copy, fwd_ms=1.0, suite="sweep", impls=("normkit", "torch")):
    cases = [bench.Case(suite, "rms_norm", "bfloat16", ((1 << 27) // n, n)) for n in (1024, 4096)]
    ok = (("ok", fwd_ms), ("ok", 2 * fwd_ms))
    return [bench.make_row(c, impl, copy, *ok) for c in cases for impl in impls]


def meta(copy, gpu="NVIDIA H100 80GB HBM3"):
    return dict(gpu=gpu, sm_count=132, torch="2.11.0", triton="3.6.0", date="2026-01-01T00:00:00+00:00",
                copy_gbps=copy, command="normkit bench")  # fmt: skip


# --- byte counts ----------------------------------------------------------------------------------


def test_units_cover_every_op():
    assert bench.UNITS == EXPECTED_UNITS
    assert set(bench.OPS) == set(EXPECTED_UNITS)


@pytest.mark.parametrize("op", sorted(EXPECTED_UNITS))
@pytest.mark.parametrize("dtype,elt", [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_bytes_per_op(op, dtype, elt):
    shape = (8, 64, 4, 4) if op in bench.IMAGE_OPS else (16, 256)
    case = bench.Case("s", op, dtype, shape)
    fwd, bwd = EXPECTED_UNITS[op]
    assert case.bytes() == (fwd * math.prod(shape) * elt, bwd * math.prod(shape) * elt)
    assert case.m * case.n == math.prod(shape)


def test_reduction_lengths():
    assert bench.Case("sweep", "rms_norm", "float32", (32, 4096)).n == 4096
    assert bench.Case("dim0", "softmax_dim0", "float32", (1024, 131072)).n == 1024  # along dim 0
    assert bench.Case("image", "group_norm", "float32", (32, 256, 56, 56)).n == 256 // 32 * 56 * 56
    assert bench.Case("image", "batch_norm", "float32", (32, 256, 56, 56)).n == 32 * 56 * 56


def test_gbps_and_fraction():
    row = bench.make_row(bench.Case("sweep", "add_rms_norm", "bfloat16", (1024, 1024)), "normkit", 3000.0,
                         ("ok", 0.5), ("wrong", None), "dx off")  # fmt: skip
    assert row["fwd_gbps"] == pytest.approx(4 * 1024 * 1024 * 2 / 0.5 / 1e6)
    assert row["fwd_frac"] == pytest.approx(row["fwd_gbps"] / 3000.0)
    assert row["bwd_gbps"] is None and row["bwd_frac"] is None and row["bwd_status"] == "wrong"


# --- plans and arguments --------------------------------------------------------------------------


def test_default_plan_covers_every_suite():
    cases = plan()
    assert len({(c.op, c.dtype, c.label) for c in cases}) == len(cases)
    by_suite = {s: [c for c in cases if c.suite == s] for s in bench.SUITES}
    assert {c.shape[1] for c in by_suite["sweep"]} == set(bench.SWEEP_NS)
    assert all(c.m * c.n == 1 << 27 for c in by_suite["sweep"] + by_suite["small"] + by_suite["dim0"])
    assert {c.shape for c in by_suite["small"]} == {((1 << 27) // n, n) for n in (64, 128, 256, 512)}
    assert {c.shape for c in by_suite["few"]} == {(m, n) for m in (1, 16, 128) for n in (4096, 8192)}
    assert {c.shape for c in by_suite["image"]} == set(bench.IMAGE_SHAPES)
    assert {c.op for c in by_suite["image"]} == {"group_norm", "batch_norm"}
    assert {(c.op, c.shape) for c in by_suite["image_cl"]} == {(c.op, c.shape) for c in by_suite["image"]}
    assert all(c.channels_last and c.label.endswith("-cl") for c in by_suite["image_cl"])
    assert {c.shape[0] for c in by_suite["dim0"]} == {1024, 4096, 32768}
    assert {c.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    assert len(cases) == 3 * (6 * 9 + 6 * 4 + 6 * 6 + 2 * 2 * len(bench.IMAGE_SHAPES) + 2 * 3)


def test_quick_is_a_small_bf16_subset_of_each_suite():
    cases = plan("--quick")
    assert {c.suite for c in cases} == set(bench.SUITES)
    assert {c.dtype for c in cases} == {"bfloat16"}
    assert {c.shape for c in cases if c.suite == "sweep"} == {((1 << 27) // 4096, 4096)}
    assert len({c.shape for c in cases if c.suite == "image"}) == 1
    assert len(cases) < 30


def test_suite_dtypes_ops_n():
    cases = plan("--suite", "sweep,dim0", "--dtypes", "float16,float32", "--n", "1024,2048")
    assert {c.suite for c in cases} == {"sweep", "dim0"}
    assert {c.dtype for c in cases} == {"float16", "float32"}
    assert {c.n for c in cases} == {1024, 2048}
    assert plan("--dtype", "float32", "--quick")[0].dtype == "float32"  # --dtype: old spelling
    cases = plan("--ops", "rms_norm,batch_norm")
    assert {c.op for c in cases} == {"rms_norm", "batch_norm"}


def test_repeated_shapes_run_once():
    cases = plan("--suite", "sweep,small", "--n", "4096", "--dtypes", "bfloat16")
    assert [c.suite for c in cases] == ["sweep"] * 6


@pytest.mark.parametrize("argv", [["--dtypes", "bf16"], ["--suite", "big"], ["--ops", "norm"],
                                  ["--n", "0"], ["--n", "x"], ["--shard", "3/2"], ["--impls", "apex"],
                                  ["--device", "tpu"], ["--rounds", "0"], ["--rounds", "two"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert "argument" in capsys.readouterr().err


def test_shards_cover_the_plan_once():
    cases = plan()
    parts = [bench.shard(cases, (i, 5)) for i in range(1, 6)]
    assert sorted(sum(parts, []), key=cases.index) == cases
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_list_needs_no_gpu(capsys):
    assert cli.main(["bench", "--quick", "--list", "--suite", "image"]) == 0
    assert capsys.readouterr().out.split() == ["image", "group_norm", "bfloat16", "128x256x56x56",
                                               "image", "batch_norm", "bfloat16", "128x256x56x56"]


def test_no_case_selected_exits_2(capsys):
    assert cli.main(["bench", "--suite", "image", "--ops", "rms_norm", "--list"]) == 2
    assert "no cases" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_without_cuda_exits_2(capsys):
    assert cli.main(["bench", "--quick"]) == 2
    assert "needs a CUDA GPU or an Ascend NPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_without_the_requested_device_exits_2(device, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_npu_status", lambda: (False, "torch_npu is not installed"))
    assert cli.main(["bench", "--quick", "--device", device]) == 2
    err = capsys.readouterr().err
    assert f"--device {device}: needs" in err and "--list shows the cases" in err


def test_resume_needs_out(capsys):
    assert cli.main(["bench", "--quick", "--resume"]) == 2
    assert "--resume needs --out" in capsys.readouterr().err


def test_resume_with_everything_done_measures_nothing(tmp_path, monkeypatch, capsys):
    impls = ("normkit", "torch", "torch.compile")
    case = bench.Case("sweep", "rms_norm", "bfloat16", ((1 << 27) // 4096, 4096))
    rows = [bench.make_row(case, impl, 3000.0, ("ok", 1.0), ("ok", 1.0)) for impl in impls]
    bench.write_json(tmp_path / "results.json", [meta(3000.0)], rows)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["bench", "--quick", "--suite", "sweep", "--ops", "rms_norm", "--impls", ",".join(impls)]
    assert cli.main([*argv, "--out", str(tmp_path), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert bench.read_json(tmp_path) == ([meta(3000.0)], rows)


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    out = capsys.readouterr().out
    options = "--suite --ops --dtypes --n --device --impls --quick --out --resume --shard --merge --compare "
    options += "--list "
    options += "--rep-ms --warmup-ms --rounds --gc-running"
    assert all(option in out for option in options.split())
    assert all(suite in out for suite in bench.SUITES)


# --- results files and merge ----------------------------------------------------------------------


def test_json_roundtrip(tmp_path):
    rows = make_rows(3000.0)
    image = bench.Case("image", "group_norm", "float32", (8, 128, 112, 112))
    rows.append(bench.make_row(image, "liger", 3000.0, error="RuntimeError: too large"))
    bench.write_json(tmp_path / "r.json", [meta(3000.0)], rows)
    parts, back = bench.read_json(tmp_path / "r.json")
    assert parts == [meta(3000.0)] and back == rows
    assert all(r["fwd_frac"] == pytest.approx(r["fwd_gbps"] / 3000.0) for r in back if r["fwd_gbps"])
    assert back[-1]["fwd_status"] == "fail" and back[-1]["fwd_gbps"] is None


def test_csv_values(tmp_path):
    rows = make_rows(2500.0, fwd_ms=0.25)
    bench.write_csv(tmp_path / "r.csv", rows)
    with open(tmp_path / "r.csv") as f:
        back = list(csv.DictReader(f))
    assert list(back[0]) == list(bench.CSV_FIELDS)
    for row, line in zip(rows, back):
        assert line["impl"] == row["impl"] and line["shape"] == row["shape"] and int(line["n"]) == row["n"]
        for key in ("fwd_ms", "fwd_gbps", "bwd_gbps", "copy_gbps"):
            assert float(line[key]) == pytest.approx(row[key])
        assert float(line["bwd_frac"]) == pytest.approx(float(line["bwd_gbps"]) / 2500.0)
        assert line["error"] == ""


def test_merge_keeps_each_parts_copy(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    bench.write_json(a / "results.json", [meta(3000.0)], make_rows(3000.0))
    newer = make_rows(2000.0, fwd_ms=2.0, impls=("torch",)) + make_rows(2000.0, suite="few", impls=("quack",))
    bench.write_json(b / "results.json", [meta(2000.0, "NVIDIA H200")], newer)
    parts, rows = bench.merge([a, b / "results.json"])
    assert [p["copy_gbps"] for p in parts] == [3000.0, 2000.0]
    assert len(rows) == 4 + 2  # b's torch rows replace a's; its quack rows are new
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert all(r["copy_gbps"] == 2000.0 and r["fwd_ms"] == 2.0 for r in torch_rows)
    for r in rows:
        assert r["fwd_frac"] == pytest.approx(r["fwd_gbps"] / r["copy_gbps"])


def test_merge_command_writes_everything(tmp_path, capsys):
    for name, copy, impl in (("p1", 3000.0, "normkit"), ("p2", 2990.0, "torch.compile")):
        (tmp_path / name).mkdir()
        bench.write_json(tmp_path / name / "results.json", [meta(copy)], make_rows(copy, impls=(impl,)))
    out = tmp_path / "all"
    assert cli.main(["bench", "--merge", f"{tmp_path / 'p1'},{tmp_path / 'p2'}", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "copy 3000 GB/s" in table and "copy 2990 GB/s" in table and "torch.compile fwd" in table
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.csv", "table.txt"}
    data = json.loads((out / "results.json").read_text())
    assert len(data["parts"]) == 2 and len(data["rows"]) == 4


def test_merge_of_a_wrong_result_exits_1(tmp_path):
    row = bench.make_row(bench.Case("sweep", "softmax", "bfloat16", (4, 4)), "torch", 1.0, ("wrong", None))
    bench.write_json(tmp_path / "results.json", [meta(1.0)], [row])
    assert cli.main(["bench", "--merge", str(tmp_path)]) == 1


def _runs(tmp_path, slow_ms, statuses=("ok", "ok", "ok")):
    """Three results of two cases (normkit and torch each): run 3's normkit rms_norm 1024 takes
    ``slow_ms`` forward (1.0 in the others) and, in each run, the forward status given. Run i was
    measured with the normkit installed at /site{i}."""
    case, other = (bench.Case("sweep", "rms_norm", "bfloat16", ((1 << 27) // n, n)) for n in (1024, 4096))
    dirs = []
    for i, status in enumerate(statuses):
        fwd = slow_ms if i == 2 else 1.0
        rows = [bench.make_row(case, "normkit", 3000.0, (status, fwd), ("ok", 2.0)),
                bench.make_row(other, "normkit", 3000.0, ("ok", 1.0), ("ok", 2.0))]  # fmt: skip
        rows += [bench.make_row(c, "torch", 3000.0, ("ok", 3.0), ("ok", 6.0)) for c in (case, other)]
        (tmp_path / f"r{i}").mkdir()
        bench.write_json(tmp_path / f"r{i}" / "results.json", [dict(meta(3000.0), normkit_path=f"/site{i}")],
                         rows)  # fmt: skip
        dirs.append(str(tmp_path / f"r{i}"))
    return dirs, case


def test_compare_reports_ratio_and_spread(tmp_path, capsys):
    dirs, case = _runs(tmp_path, 1.25)
    assert cli.main(["bench", "--compare", ",".join(dirs)]) == 0
    out = capsys.readouterr().out
    gbps = case.bytes()[0] / 1.0 / 1e6  # the forward's GB/s at 1.0 ms
    assert "4 cells in every run" in out
    for i in range(3):  # which install each run measured
        assert f"run {i + 1}: {dirs[i]} (NVIDIA H100 80GB HBM3, triton 3.6.0, 2026-01-01T00:00:00+00:00, " \
               f"normkit from /site{i})" in out
    line = next(x for x in out.splitlines() if x.startswith("rms_norm bfloat16 131072x1024 normkit"))
    assert f"fwd {bench._num(gbps)} {bench._num(gbps)} {bench._num(gbps / 1.25)} x0.800 ~25.0%" in line
    assert "bwd" in line and "x1.000 ~0.0%" in line
    assert "fwd: last / first min 0.800, median 1.000, max 1.000 over 4 cells" in out
    assert "below 0.98: 1\n  rms_norm bfloat16 131072x1024 normkit fwd 0.800" in out
    assert "spread over 3%: 1\n  rms_norm bfloat16 131072x1024 normkit fwd 25.0%" in out


def test_compare_within_the_limits_lists_nothing(tmp_path, capsys):
    dirs, _ = _runs(tmp_path, 1.02)  # 0.980 of the first run, 2.0% spread: at the limits, not past them
    assert cli.main(["bench", "--compare", ",".join(dirs[::2])]) == 0
    out = capsys.readouterr().out
    assert "below 0.98: 0" in out and "spread over 3%: 0" in out and "x0.980" in out


def test_compare_lists_a_wrong_cell_and_exits_1(tmp_path, capsys):
    dirs, _ = _runs(tmp_path, 1.0, statuses=("ok", "wrong", "ok"))
    assert cli.main(["bench", "--compare", ",".join(dirs)]) == 1
    out = capsys.readouterr().out
    listed = "not compared (fail / wrong in a run): 1\n  rms_norm bfloat16 131072x1024 normkit fwd: "
    assert listed + "ok / wrong / ok" in out
    assert "fwd: last / first min 1.000, median 1.000, max 1.000 over 3 cells" in out


def test_compare_of_run_groups_keeps_each_cells_fastest_run(tmp_path, capsys):
    # runs 1 and 3 of one code (run 3's forward of the first case 1.25x slower: a dip), run 2 of
    # the other; "r0+r2" is the fastest of the two per cell and direction
    dirs, case = _runs(tmp_path, 1.25)
    gbps = case.bytes()[0] / 1.0 / 1e6
    assert cli.main(["bench", "--compare", f"{dirs[2]}+{dirs[0]},{dirs[1]}"]) == 0
    out = capsys.readouterr().out
    assert f"run 1: {dirs[2]}+{dirs[0]} (" in out and "the fastest of 2 runs per cell)" in out
    line = next(x for x in out.splitlines() if x.startswith("rms_norm bfloat16 131072x1024 normkit"))
    assert f"fwd {bench._num(gbps)} {bench._num(gbps)} x1.000 ~0.0%" in line
    assert "below 0.98: 0" in out and "spread over 3%: 0" in out
    parts, rows = bench.read_best_of(f"{dirs[2]}+{dirs[0]}")
    assert len(parts) == 2 and len(rows) == 4
    row = next(r for r in rows if bench.row_key(r) == bench.row_key(case, "normkit"))
    assert row["fwd_runs"] == [1.25, 1.0] and row["fwd_ms"] == 1.0 and row["bwd_runs"] == [2.0, 2.0]
    assert row["fwd_frac"] == pytest.approx(gbps / 3000.0)


def test_compare_of_run_groups_with_a_partial_retry(tmp_path, capsys):
    # the new code's first run (r2) has the dip; a retry of that one cell (of each code) restores
    # it, and the cells the retries did not run keep their first run's
    dirs, case = _runs(tmp_path, 1.25)
    for name, ms in (("old-r1", 1.1), ("new-r1", 1.01)):
        (tmp_path / name).mkdir()
        row = bench.make_row(case, "normkit", 3000.0, ("ok", ms), ("ok", 2.0))
        bench.write_json(tmp_path / name / "results.json", [meta(3000.0)], [row])
    old, new = f"{dirs[0]}+{tmp_path / 'old-r1'}", f"{dirs[2]}+{tmp_path / 'new-r1'}"
    assert cli.main(["bench", "--compare", f"{old},{new}"]) == 0
    out = capsys.readouterr().out
    assert "4 cells in every run" in out and "below 0.98: 0" in out
    line = next(x for x in out.splitlines() if x.startswith("rms_norm bfloat16 131072x1024 normkit"))
    assert "x0.990" in line  # the old's 1.0 ms against the new's best, 1.01 ms
    _, rows = bench.read_best_of(new)
    by = {bench.row_key(r): r for r in rows}
    assert by[bench.row_key(case, "normkit")]["fwd_runs"] == [1.25, 1.01]
    assert all(len(r["fwd_runs"]) == 1 for k, r in by.items() if k != bench.row_key(case, "normkit"))


def test_compare_of_run_groups_lists_a_cell_wrong_in_one_run(tmp_path, capsys):
    dirs, _ = _runs(tmp_path, 1.0, statuses=("ok", "ok", "wrong"))
    assert cli.main(["bench", "--compare", f"{dirs[0]}+{dirs[2]},{dirs[1]}"]) == 1
    out = capsys.readouterr().out
    listed = "not compared (fail / wrong in a run): 1\n  rms_norm bfloat16 131072x1024 normkit fwd: "
    assert listed + "wrong / ok" in out


def test_compare_needs_two_runs(tmp_path, capsys):
    dirs, _ = _runs(tmp_path, 1.0)
    assert cli.main(["bench", "--compare", dirs[0]]) == 2
    assert "needs two or more results" in capsys.readouterr().err


def test_merge_of_a_missing_dir_exits_2(tmp_path, capsys):
    assert cli.main(["bench", "--merge", str(tmp_path / "nope")]) == 2
    assert "cannot read results" in capsys.readouterr().err


# --- table and plots ------------------------------------------------------------------------------


def test_table_cells():
    case = bench.Case("sweep", "layer_norm", "bfloat16", (32768, 4096))
    rows = [bench.make_row(case, "normkit", 3000.0, ("ok", 2 * case.numel * 2 / 2900e6), ("ok", 1.0)),
            bench.make_row(case, "liger", 3000.0, ("ok", 1.0), ("wrong", None), "AssertionError: dx off"),
            bench.make_row(case, "quack", 3000.0, error="TypeError: no layer_norm")]  # fmt: skip
    rows.append(bench.make_row(bench.Case("sweep", "rms_norm", "bfloat16", (32768, 4096)), "quack", 3000.0,
                               ("ok", 1.0), ("ok", 1.0)))  # fmt: skip
    table = bench.format_table([meta(3000.0)], rows)
    lines = table.splitlines()
    header = next(line for line in lines if line.startswith("suite"))
    assert header.split()[4:] == ["normkit", "fwd", "normkit", "bwd", "liger", "fwd", "liger", "bwd", "quack",
                                  "fwd", "quack", "bwd"]  # fmt: skip
    layer = next(line for line in lines if line.startswith("sweep  layer_norm")).split()
    assert layer[4:6] == ["2900", "0.97"] and layer[-3:] == ["wrong", "fail", "fail"]
    rms = next(line for line in lines if line.startswith("sweep  rms_norm")).split()
    assert rms[4:8] == ["-"] * 4  # normkit and liger have no rms_norm row here
    assert "liger layer_norm bfloat16 32768x4096: fwd ok, bwd wrong: AssertionError: dx off" in table
    assert "quack layer_norm bfloat16 32768x4096: fwd fail, bwd fail: TypeError: no layer_norm" in table


def test_small_numbers_keep_their_digits():
    row = bench.make_row(bench.Case("few", "softmax", "bfloat16", (16, 4096)), "torch", 3000.0,
                         ("ok", 2 * 16 * 4096 * 2 / 12.345e6), ("ok", 3 * 16 * 4096 * 2 / 1.5e6))  # fmt: skip
    assert bench._cell(row, "fwd") == "12.3 0.004" and bench._cell(row, "bwd") == "1.50 0.001"


def test_plots_are_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = make_rows(3000.0) + make_rows(3000.0, suite="few")
    rows += [bench.make_row(bench.Case("few", "rms_norm", "bfloat16", (m, 4096)), "torch", 3000.0,
                            ("ok", 0.01), ("fail", None)) for m in (1, 16)]  # fmt: skip
    rows += [bench.make_row(bench.Case("image", "batch_norm", "float32", s), "torch", 3000.0, ("ok", 1.0),
                            ("ok", 1.0)) for s in bench.IMAGE_SHAPES]  # fmt: skip
    paths = bench.write_plots(tmp_path, rows)
    names = {p.name for p in paths}
    assert names == {"rms_norm-bfloat16.png", "rms_norm-bfloat16-few.png", "batch_norm-float32.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_outputs(tmp_path):
    summary = bench.write_outputs(tmp_path / "out", [meta(3000.0)], make_rows(3000.0))
    assert (tmp_path / "out" / "results.csv").exists() and "results.json" in summary
    assert "copy 3000 GB/s" in (tmp_path / "out" / "table.txt").read_text()


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)
    bar = bench.progress(3)
    bar.update()
    bar.set_description_str("sweep rms_norm")
    assert "[1/3] sweep rms_norm" in capsys.readouterr().err


# --- the check-then-time loop on CPU (the reference serves normkit's CPU tensors) ----------------

TINY = [bench.Case("sweep", op, dt, (6, 64)) for op in bench.ROW_OPS for dt in ("bfloat16", "float32")]
TINY += [bench.Case(s, op, "float16", (2, 64, 3, 3)) for s in ("image", "image_cl") for op in bench.IMAGE_OPS]
TINY += [bench.Case("dim0", op, "bfloat16", (64, 5)) for op in bench.DIM0_OPS]


def fake_timer(fn):
    fn()
    return 0.5


def test_run_checks_every_op_on_cpu():
    rows, sections = bench.run(TINY, ["normkit", "torch"], "cpu", fake_timer, copy=100.0)
    assert len(rows) == 2 * len(TINY) and set(sections) == {"sweep", "image", "image_cl", "dim0"}
    bad = [(r["impl"], r["op"], r["dtype"], r["error"]) for r in rows if (r["fwd_status"], r["bwd_status"])
           != ("ok", "ok")]  # fmt: skip
    assert not bad
    assert all(r["fwd_ms"] == 0.5 and r["fwd_frac"] == pytest.approx(r["fwd_gbps"] / 100.0) for r in rows)
    assert bench._exit_status(rows) == 0


def test_dropout_cells_are_checked_through_the_mask(monkeypatch):
    """--dropout: the add-norms run with dropout_p and are checked against fp64 through normkit's mask
    (torch, drawing its own mask, is not measured); a mask off by one row is "wrong"."""
    cases = bench.plan(["sweep"], ["add_layer_norm", "add_rms_norm", "layer_norm"], ["float32"], [64],
                       dropout=0.25)  # fmt: skip
    assert [(c.op, c.dropout, c.label) for c in cases] == [
        ("layer_norm", 0.0, "2097152x64"), ("add_layer_norm", 0.25, "2097152x64-p0.25"),
        ("add_rms_norm", 0.25, "2097152x64-p0.25")]  # fmt: skip
    cases = [bench.Case("sweep", c.op, c.dtype, (6, 64), c.dropout) for c in cases]
    rows, _ = bench.run(cases, ["normkit", "torch"], "cpu", fake_timer, copy=100.0)
    status = {(r["impl"], r["op"]): (r["fwd_status"], r["bwd_status"]) for r in rows}
    ok = ("ok", "ok")
    assert status == {("normkit", "add_layer_norm"): ok, ("normkit", "add_rms_norm"): ok,
                      ("normkit", "layer_norm"): ok, ("torch", "layer_norm"): ok}  # fmt: skip
    real = bench.rng.keep_mask  # the bench's reference only (normkit's CPU path keeps the real mask)
    shifted = lambda shape, p, seed, device: real(shape, p, seed + 1, device)  # noqa: E731
    monkeypatch.setattr(bench, "rng", types.SimpleNamespace(keep_mask=shifted))
    rows, _ = bench.run(cases[1:], ["normkit"], "cpu", fake_timer, copy=100.0)
    assert {(r["fwd_status"], r["bwd_status"]) for r in rows} == {("wrong", "wrong")}


def test_run_reports_wrong_and_fail_and_goes_on(monkeypatch):
    real = bench.forward_fn

    def forward_fn(impl, op, dropout=0.0):
        if impl == "off":  # 10% off: every output and gradient is wrong
            fn = real("torch", op)
            return lambda i: tuple(1.1 * o for o in fn(i))
        if impl == "raises" and op == "rms_norm":
            raise RuntimeError("no kernel for this shape")
        return real("torch" if impl == "raises" else impl, op)

    monkeypatch.setattr(bench, "forward_fn", forward_fn)
    cases = [c for c in TINY if c.op in ("rms_norm", "softmax") and c.dtype == "float32"]
    rows, _ = bench.run(cases, ["off", "raises", "normkit"], "cpu", fake_timer, copy=100.0)
    status = {(r["impl"], r["op"]): (r["fwd_status"], r["bwd_status"]) for r in rows}
    assert status[("off", "rms_norm")] == status[("off", "softmax")] == ("wrong", "wrong")
    assert status[("raises", "rms_norm")] == ("fail", "fail")
    assert status[("raises", "softmax")] == status[("normkit", "rms_norm")] == ("ok", "ok")
    errors = {(r["impl"], r["op"]): r["error"] for r in rows}
    assert errors[("raises", "rms_norm")] == "RuntimeError: no kernel for this shape"
    assert "y (torch.float32, fwd tolerance" in errors[("off", "rms_norm")]
    assert bench._exit_status(rows) == 1


def test_run_goes_on_when_the_reference_fails(monkeypatch):
    def reference(case, inp):
        if case.dtype == "bfloat16":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(case, inp)

    real = bench.reference
    monkeypatch.setattr(bench, "reference", reference)
    rows, _ = bench.run(TINY[:2], ["torch"], "cpu", fake_timer, copy=1.0)
    assert [(r["fwd_status"], r["error"]) for r in rows] == [
        ("fail", "reference: OutOfMemoryError: CUDA out of memory"), ("ok", "")]


def test_run_skips_what_is_done():
    done = {bench.row_key(TINY[0], "torch")}
    rows, _ = bench.run(TINY[:2], ["normkit", "torch"], "cpu", fake_timer, copy=1.0, done=done)
    assert [(r["impl"], r["dtype"]) for r in rows] == [("normkit", "bfloat16"), ("normkit", "float32"),
                                                       ("torch", "float32")]  # fmt: skip


def test_rounds_keep_each_directions_fastest(monkeypatch):
    """--rounds 3: every row timed in three passes over the cases (inputs made afresh each pass), each
    direction keeps its fastest round and lists all three; a wrong row is not timed again; on_row
    sees each row once, in the first round (later rounds time the same row objects in place)."""
    times = iter([4.0, 8.0, 2.0, 9.0, 6.0, 3.0])  # rms_norm's fwd / bwd, rounds 1-3 (softmax: wrong)
    timer = lambda fn: (fn(), next(times))[1]  # noqa: E731
    real, made = bench.forward_fn, []

    def forward_fn(impl, op, dropout=0.0):
        fn = real("torch", op)
        return (lambda i: tuple(1.1 * o for o in fn(i))) if op == "softmax" else fn

    monkeypatch.setattr(bench, "forward_fn", forward_fn)
    make_inputs = bench.make_inputs
    counted = lambda case, device: made.append(case.op) or make_inputs(case, device)  # noqa: E731
    monkeypatch.setattr(bench, "make_inputs", counted)
    cases = [c for c in TINY if c.op in ("rms_norm", "softmax") and c.dtype == "float32"]
    seen = []
    rows, sections = bench.run(cases, ["normkit"], "cpu", timer, copy=100.0, on_row=seen.append, rounds=3)
    rms, soft = rows
    assert (rms["fwd_rounds"], rms["bwd_rounds"]) == ([4.0, 2.0, 6.0], [8.0, 9.0, 3.0])
    assert (rms["fwd_ms"], rms["bwd_ms"]) == (2.0, 3.0)
    fwd_bytes, bwd_bytes = cases[0].bytes()
    assert rms["fwd_gbps"] == pytest.approx(fwd_bytes / 2.0 / 1e6)
    assert rms["bwd_frac"] == pytest.approx(bwd_bytes / 3.0 / 1e6 / 100.0)
    assert (soft["fwd_status"], soft["bwd_status"]) == ("wrong", "wrong") and "fwd_rounds" not in soft
    assert made == ["rms_norm", "softmax", "rms_norm", "rms_norm"] and next(times, None) is None
    assert [r["op"] for r in seen] == ["rms_norm", "softmax"] and seen[0] is rms
    assert {"round 2", "round 3"} <= set(sections)


@pytest.mark.parametrize("where", ["retime_row", "make_inputs"])
def test_a_round_that_fails_keeps_the_first_rounds_timing(monkeypatch, where):
    """A later round that raises (its inputs, or its timing: out of memory) leaves the first round's
    timing, says which round failed, and the run goes on to the next case."""
    real = getattr(bench, where)
    calls = []

    def fails_after_the_first_round(*args):
        calls.append(args)
        if where == "retime_row" or len(calls) > 2:  # (make_inputs: the first round's two cases pass)
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*args)

    monkeypatch.setattr(bench, where, fails_after_the_first_round)
    rows, _ = bench.run(TINY[:2], ["torch"], "cpu", fake_timer, copy=1.0, rounds=2)
    assert [(r["fwd_status"], r["fwd_ms"], r["bwd_ms"]) for r in rows] == [("ok", 0.5, 0.5)] * 2
    assert [r["error"] for r in rows] == ["round 2: OutOfMemoryError: CUDA out of memory"] * 2


def test_rounds_on_cpu_exit_2(capsys):
    assert cli.main(["bench", "--device", "cpu", "--rounds", "2"]) == 2
    assert "--rounds 2" in capsys.readouterr().err


# --- devices and the implementations measured on each -------------------------------------------


def test_device_argument():
    assert parse().device == "auto"
    assert parse("--device", "npu").device == "npu"


@pytest.mark.parametrize("requested,cuda,npu,expected", [
    ("auto", True, True, "cuda"), ("auto", False, True, "npu"), ("cuda", True, True, "cuda"),
    ("npu", True, True, "npu")])  # fmt: skip
def test_resolve_device(requested, cuda, npu, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(bench, "_npu_status", lambda: (npu, "" if npu else "no NPU"))
    assert bench.resolve_device(requested) == expected


def test_torch_npu_is_looked_for_only_when_asked(monkeypatch):
    def npu_status():
        raise AssertionError("torch_npu looked for")

    monkeypatch.setattr(bench, "_npu_status", npu_status)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.resolve_device("auto") == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bench.UsageError, match="--device cuda: needs a CUDA GPU"):
        bench.resolve_device("cuda")


def test_resolve_device_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "_npu_status", lambda: (False, "torch_npu is not installed"))
    with pytest.raises(bench.UsageError, match=r"--device npu: needs an Ascend NPU \(torch_npu is not inst"):
        bench.resolve_device("npu")
    with pytest.raises(bench.UsageError, match="CUDA GPU or an Ascend NPU.*npu: torch_npu is not installed"):
        bench.resolve_device("auto")
    with pytest.raises(bench.UsageError, match="--device 'tpu'"):
        bench.resolve_device("tpu")


def test_npu_status_import_failure_is_a_reason(monkeypatch):
    import normkit.testing

    def npu_status():
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(normkit.testing, "npu_status", npu_status)
    ok, reason = bench._npu_status()
    assert not ok
    assert reason == "torch_npu failed to import (OSError: libhccl.so: cannot open shared object file)"


def test_impls_per_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu([]))
    for module in ("liger_kernel", "quack"):  # importing them fails: on npu they must not be tried
        monkeypatch.setitem(sys.modules, module, None)
    npu = bench.available_impls("npu")
    assert [i for i, reason in npu.items() if not reason] == ["normkit", "torch", "torch_npu"]
    assert "TORCHINDUCTOR_NPU_BACKEND" in npu["torch.compile"] and "torchair" in npu["torch.compile"]
    assert npu["liger"] == "measured on cuda only" and npu["quack"].startswith("measured on cuda only")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # on cuda torch_npu must not be imported either
    cuda = bench.available_impls("cuda")
    assert cuda["torch_npu"] == "npu only"
    assert "liger_kernel not importable" in cuda["liger"] and "quack not importable" in cuda["quack"]
    assert cuda["normkit"] == cuda["torch"] == cuda["torch.compile"] == ""


def test_impls_on_npu_default_and_requested(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu([]))
    impls, skipped = bench._impls(None, "npu")
    assert impls == ["normkit", "torch", "torch_npu"] and set(skipped) == {"torch.compile", "liger", "quack"}
    assert "skipping torch.compile: not measured on npu" in capsys.readouterr().err
    assert bench._impls(["torch_npu", "torch"], "npu") == (["torch_npu", "torch"], {})
    with pytest.raises(bench.UsageError, match="--impls: unavailable on npu: liger: measured on cuda only"):
        bench._impls(["normkit", "liger"], "npu")


def test_impls_on_cuda_say_nothing_of_torch_npu(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    for module in ("liger_kernel", "quack"):
        monkeypatch.setitem(sys.modules, module, None)
    impls, skipped = bench._impls(None, "cuda")
    assert impls == ["normkit", "torch", "torch.compile"] and set(skipped) == {"liger", "quack"}
    assert "torch_npu" not in capsys.readouterr().err
    with pytest.raises(bench.UsageError, match="--impls: unavailable on cuda: torch_npu: npu only"):
        bench._impls(["torch_npu"], "cuda")


def test_torch_npu_serves_its_fused_ops_only():
    cases = plan("--quick", "--suite", "sweep")
    todo = dict((c.op, impls) for c, impls in bench.pending(cases, ["normkit", "torch", "torch_npu"]))
    assert {op for op, impls in todo.items() if "torch_npu" in impls} == {"rms_norm", "add_rms_norm",
                                                                          "add_layer_norm"}  # fmt: skip
    assert all(impls[:2] == ["normkit", "torch"] for impls in todo.values())
    with pytest.raises(ValueError, match="op 'softmax': torch_npu has no fused op"):
        bench.forward_fn("torch_npu", "softmax")


# --- torch_npu's fused ops, through a fake torch_npu module ---------------------------------------


def _rms(x, gamma, eps):
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


def fake_torch_npu(calls):
    """torch_npu's documented signatures and return tuples, computed with torch ops; ``calls`` records
    (name, args, kwargs). npu_add_rms_norm runs without autograd: torch_npu registers no derivative."""

    def npu_rms_norm(x, gamma, epsilon=1e-06):
        calls.append(("npu_rms_norm", (x, gamma), dict(epsilon=epsilon)))
        return _rms(x, gamma, epsilon)

    def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
        calls.append(("npu_add_rms_norm", (x1, x2, gamma), dict(epsilon=epsilon)))
        with torch.no_grad():
            x = x1 + x2
            return (*_rms(x, gamma, epsilon), x)

    def npu_add_layer_norm(x1, x2, gamma, beta, bias=None, epsilon=1e-05, additional_output=False):
        calls.append(("npu_add_layer_norm", (x1, x2, gamma, beta),
                      dict(bias=bias, epsilon=epsilon, additional_output=additional_output)))  # fmt: skip
        x = x1 + x2
        mean = x.float().mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.float().var(-1, unbiased=False, keepdim=True) + epsilon)
        y = ((x.float() - mean) * rstd * gamma.float() + beta.float()).to(x.dtype)
        return y, mean, rstd, x if additional_output else x.new_empty(0)  # x only when asked for

    module = types.ModuleType("torch_npu")
    module.npu_rms_norm, module.npu_add_rms_norm = npu_rms_norm, npu_add_rms_norm
    module.npu_add_layer_norm = npu_add_layer_norm
    return module


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_torch_npu_wrappers_pass_weight_eps_and_unpack(dtype, monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    status = {}
    for op in ("rms_norm", "add_rms_norm", "add_layer_norm"):
        case = bench.Case("sweep", op, dtype, (6, 64))
        inp = bench.make_inputs(case, "cpu")
        calls.clear()
        row = bench.measure_row(case, "torch_npu", inp, bench.reference(case, inp), fake_timer, copy=1.0)
        status[op] = (row["fwd_status"], row["bwd_status"], row["error"])
        name, args, kwargs = calls[0]
        expected = {"rms_norm": ("x", "weight"), "add_rms_norm": ("x", "residual", "weight"),
                    "add_layer_norm": ("x", "residual", "weight", "bias")}[op]  # fmt: skip
        assert name == "npu_" + op and all(a is inp[k] for a, k in zip(args, expected, strict=True))
        assert kwargs["epsilon"] == bench.EPS  # not torch_npu's default (1e-6 for the RMS norms)
        if op == "add_layer_norm":
            assert kwargs["additional_output"] is True and kwargs["bias"] is None
    assert status["rms_norm"] == status["add_layer_norm"] == ("ok", "ok", "")
    assert status["add_rms_norm"] == ("ok", "-", "")  # forward only: "-", not a failure


def test_torch_npu_forward_only_cell_and_exit_status(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu([]))
    cases = [bench.Case("sweep", "add_rms_norm", "float32", (6, 64))]
    rows, _ = bench.run(cases, ["torch", "torch_npu"], "cpu", fake_timer, copy=100.0)
    row = next(r for r in rows if r["impl"] == "torch_npu")
    assert bench._cell(row, "bwd") == "-" and row["bwd_gbps"] is None and bench._exit_status(rows) == 0


def test_a_wrong_torch_npu_result_is_reported(monkeypatch):
    module = fake_torch_npu([])
    module.npu_rms_norm = lambda x, gamma, epsilon=1e-06: _rms(x, gamma, 1.0)  # eps ignored: off by far
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    case = bench.Case("sweep", "rms_norm", "float32", (6, 64))
    rows, _ = bench.run([case], ["torch_npu"], "cpu", fake_timer, copy=1.0)
    assert rows[0]["fwd_status"] == "wrong" and bench._exit_status(rows) == 1


# --- inputs and references on devices without full fp64 -------------------------------------------


def test_reference_inputs_are_cpu_copies_off_cuda():
    case = bench.Case("sweep", "add_layer_norm", "bfloat16", (4, 32))
    inp = bench.make_inputs(case, "cpu")
    assert bench.reference_inputs(inp, "cpu") is inp
    assert bench.reference_inputs(inp, torch.device("cuda", 0)) is inp  # CUDA: the reference stays there
    host = bench.reference_inputs(inp, "meta")  # stands for an NPU: fp64 reference on the CPU
    assert host.keys() == inp.keys()
    for k, t in host.items():
        assert t.device.type == "cpu" and not t.requires_grad and t.dtype == inp[k].dtype
        assert torch.equal(t, inp[k].detach())


# --- the event timer, with a fake device module ---------------------------------------------------


class FakeEvent:
    def __init__(self, device):
        self.device, self.time = device, None

    def record(self):
        self.time = self.device.now

    def elapsed_time(self, end):
        return end.time - self.time


class FakeDevice:
    """A device module whose clock moves only when the timed function runs (``run``) or the L2 flush
    buffer (the device itself) is zeroed; counts calls, flushes and synchronizations."""

    def __init__(self, durations, flush_ms=0.5):
        self.now, self.durations, self.flush_ms = 0.0, iter(durations), flush_ms
        self.calls = self.flushes = self.syncs = 0

    def Event(self, enable_timing=False):  # noqa: N802 (torch.cuda.Event's name)
        assert enable_timing
        return FakeEvent(self)

    def synchronize(self):
        self.syncs += 1

    def zero_(self):
        self.flushes += 1
        self.now += self.flush_ms

    def run(self):
        self.calls += 1
        self.now += next(self.durations)


def test_event_bench_counts_like_do_bench():
    dev = FakeDevice(iter(lambda: 2.0, None))
    assert bench.event_bench(dev.run, dev, dev, warmup_ms=25, rep_ms=100) == 2.0  # the flush is not timed
    # estimate (0.5 ms flush + 2 ms) = 2.5 ms: 10 warm-up runs, 40 timed runs
    assert dev.calls == 1 + 5 + 10 + 40 and dev.flushes == 5 + 40 and dev.syncs == 3


def test_event_bench_returns_the_median():
    timed = [1.0, 2.0, 9.0, 3.0] * 10
    dev = FakeDevice([2.0] * 16 + timed)  # 1 + 5 + 10 untimed runs of 2 ms, then 40 timed ones
    assert bench.event_bench(dev.run, dev, dev) == statistics.median(timed) == 2.5


def test_event_bench_runs_slow_functions_once():
    dev = FakeDevice(iter(lambda: 500.0, None))
    assert bench.event_timer("cpu", 25, 100, module=dev, flush=dev)(dev.run) == 500.0
    assert dev.calls == 1 + 5 + 1 + 1 and dev.flushes == 5 + 1


def test_copy_gbps_uses_the_given_timer():
    assert bench.copy_gbps("cpu", nbytes=1 << 20, timer=lambda fn: (fn(), 0.25)[1]) == pytest.approx(
        2 * (1 << 20) / 0.25 / 1e6)


# --- NPU results: table, resume, merge ------------------------------------------------------------


def npu_meta(copy=1500.0):
    return dict(device="npu", gpu="Ascend910B4", vector_cores=40, torch="2.7.1", torch_npu="2.7.1.post2",
                triton="3.2.0", date="2026-01-01T00:00:00+00:00", copy_gbps=copy,
                command="normkit bench --device npu", skipped={"torch.compile": "not measured on npu: why"})


def test_table_of_an_npu_run():
    case = bench.Case("sweep", "add_rms_norm", "bfloat16", (32768, 4096))
    rows = [bench.make_row(case, "torch", 1500.0, ("ok", 1.0), ("ok", 1.0)),
            bench.make_row(case, "torch_npu", 1500.0, ("ok", 1.0), ("-", None))]  # fmt: skip
    lines = bench.format_table([npu_meta()], rows).splitlines()
    assert lines[0].startswith("copy 1500 GB/s (read + write) on Ascend910B4 (40 vector cores), torch 2.7.1, "
                               "torch_npu 2.7.1.post2, triton 3.2.0")  # fmt: skip
    assert lines[1] == "  not measured: torch.compile: not measured on npu: why"
    header = next(line for line in lines if line.startswith("suite")).split()
    assert header[-4:] == ["torch_npu", "fwd", "torch_npu", "bwd"]
    assert next(line for line in lines if line.startswith("sweep")).split()[-1] == "-"
    assert "failures" not in "\n".join(lines)


def test_resume_refuses_another_devices_results(tmp_path, monkeypatch, capsys):
    bench.write_json(tmp_path / "results.json", [meta(3000.0)], make_rows(3000.0))  # a CUDA run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "_npu_status", lambda: (True, ""))
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu([]))
    assert cli.main(["bench", "--quick", "--device", "npu", "--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {tmp_path} holds results measured on cuda, not npu" in err


def test_merge_refuses_mixed_devices(tmp_path, capsys):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    bench.write_json(tmp_path / "a" / "results.json", [meta(3000.0)], make_rows(3000.0))
    bench.write_json(tmp_path / "b" / "results.json", [npu_meta()], make_rows(1500.0))
    assert cli.main(["bench", "--merge", f"{tmp_path / 'a'},{tmp_path / 'b'}"]) == 2
    assert "different device types (cuda, npu)" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU available")
def test_quick_bench_on_gpu(tmp_path):
    out = tmp_path / "bench"
    assert cli.main(["bench", "--quick", "--suite", "sweep", "--ops", "rms_norm", "--out", str(out)]) == 0
    assert {"results.json", "results.csv", "table.txt"} <= {p.name for p in out.iterdir()}
    parts, rows = bench.read_json(out)
    assert parts[0]["copy_gbps"] > 0 and parts[0]["sm_count"] > 0 and parts[0]["gc"] == "paused"
    assert {r["impl"] for r in rows} >= {"normkit", "torch", "torch.compile"}
    assert all(r["fwd_status"] == r["bwd_status"] == "ok" for r in rows if r["impl"] in bench.IMPLS[:3])


def test_npu_kernels_on_cuda_only_when_named(monkeypatch):
    for module in ("liger_kernel", "quack", "torch_npu"):
        monkeypatch.setitem(sys.modules, module, None)
    assert "npu-kernels-on-cuda" not in bench._impls(None, "cuda")[0]
    both = ["normkit", "npu-kernels-on-cuda"]
    assert bench._impls(both, "cuda") == (both, {})
    with pytest.raises(bench.UsageError, match="npu-kernels-on-cuda: cuda only"):
        bench._impls(["npu-kernels-on-cuda"], "npu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", ["rms_norm", "add_layer_norm", "softmax"])
def test_npu_kernels_on_cuda_run_the_npu_backend_fwd_and_bwd(op, monkeypatch):
    """The npu-kernels-on-cuda column: checked against fp64, and both directions on NPU kernels."""
    import normkit.backends.npu as npu_backend

    calls = []
    names = {"rms_norm": ("rms_norm_fwd", "rms_norm_bwd"), "softmax": ("softmax_fwd", "softmax_bwd"),
             "add_layer_norm": ("add_layer_norm_fwd", "add_layer_norm_bwd")}[op]  # fmt: skip
    for name in names:
        real = getattr(npu_backend, name)
        monkeypatch.setattr(npu_backend, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    case = bench.Case("sweep", op, "bfloat16", (256, 4096))
    rows, _ = bench.run([case], ["npu-kernels-on-cuda"], "cuda", fake_timer, copy=100.0)
    assert [(r["fwd_status"], r["bwd_status"]) for r in rows] == [("ok", "ok")], rows[0]["error"]
    assert set(calls) == set(names)


def test_help_lists_the_image_shapes():
    """`normkit bench --help` names the image suite's shapes as bench.IMAGE_SHAPES defines them."""
    shown = cli.BENCH_EPILOG.split("image ")[1].split("dim0")[0]
    for shape in bench.IMAGE_SHAPES:
        assert "x".join(map(str, shape)) in shown


@pytest.mark.parametrize("pause", [True, False])
def test_make_timer_pauses_the_garbage_collector_unless_asked(monkeypatch, pause):
    seen = []
    recording = lambda fn: (seen.append(gc.isenabled()), fn())[1]  # noqa: E731
    monkeypatch.setattr(bench, "event_timer", lambda *a, **k: recording)
    timer = bench.make_timer("cpu", 25, 100, pause_gc=pause)
    assert gc.isenabled()
    assert timer(lambda: 3.5) == 3.5
    assert seen == [not pause] and gc.isenabled()  # paused inside (by default), enabled again after
    assert parse().gc_running is False and parse("--gc-running").gc_running is True


def test_gc_paused_restores_the_collector_after_an_error():
    def failing(fn):
        raise RuntimeError("timer failed")

    with pytest.raises(RuntimeError, match="timer failed"):
        bench.gc_paused(failing)(lambda: None)
    assert gc.isenabled()
    gc.disable()
    try:
        assert bench.gc_paused(lambda fn: gc.isenabled())(None) is False
        assert not gc.isenabled()  # a collector paused by the caller stays paused
    finally:
        gc.enable()


def test_metadata_names_the_install_measured(monkeypatch):
    """Each run records which normkit it imported, so an A/B shows two installs (an install on
    PYTHONPATH is shadowed by a normkit/ in the working directory)."""
    import normkit

    monkeypatch.setattr(bench, "device_info", lambda device: dict(device="cpu", gpu="test"))
    part = bench.metadata("cpu", 1.0, {})
    assert part["normkit_path"] == str(Path(normkit.__file__).resolve().parent)
    assert part["normkit"] == normkit.__version__
