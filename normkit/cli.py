"""`normkit info | check | bench | native`: what serves each device, a correctness sweep, timings, the
C++ extensions built.

The sweep (`normkit check`) runs each op of OPS x dtype x representative shape, forward and backward,
through the public API on the best available device and compares with normkit.reference in fp64.

Nothing here imports torch or Triton before the arguments are parsed (the commands import them), so
`normkit --help`, `--version` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
import time

from normkit import __version__, bench_plan

OPS = ("layer_norm", "rms_norm", "softmax", "log_softmax", "add_layer_norm", "add_rms_norm",
       "group_norm", "instance_norm", "batch_norm")
DEVICE_SHAPES = [(1, 1), (3, 7), (128, 1023), (1151, 1024), (64, 4096), (3, 40999), (2, 1 << 20)]
INTERPRETER_SHAPES = [(1, 1), (3, 7), (130, 1023), (2, 4096), (2, 40999)]
# --quick under the interpreter: every op, fwd + bwd, every dtype, both backends' kernels, on rows small
# enough for Triton's interpreter (it runs each program in numpy: with (130, 1023) among them, --quick
# took 6.6 minutes on 2 cores, nearly all of it on that shape). 1030 columns: past the NPU backend's
# 1024-column tile (its column loop runs twice, the second tile masked); a masked tile on CUDA.
QUICK_INTERPRETER_SHAPES = [(3, 7), (2, 1030)]
DTYPES = ("float16", "bfloat16", "float32")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit status 2): the command, the
    argument, what was given and what is accepted; `--help` has the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def rows_shape(text: str) -> tuple[int, int]:
    """argparse type of `normkit info --shape`: M,N or MxN, two positive integers."""
    match = re.fullmatch(r"\s*(\d+)\s*[,xX]\s*(\d+)\s*", text)
    if not match or min(int(v) for v in match.groups()) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected M,N or MxN, two positive integers such "
                                         "as 16,4096 or 16x4096")  # fmt: skip
    return int(match[1]), int(match[2])


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _triton_range():
    """The Triton versions the ``cuda`` extra accepts (pyproject.toml, as installed), or None."""
    from packaging.requirements import Requirement

    try:
        reqs = [Requirement(r) for r in importlib.metadata.requires("normkit") or ()]
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((r.specifier for r in reqs if r.name == "triton" and r.marker is not None
                 and r.marker.evaluate({"extra": "cuda"})), None)  # fmt: skip


def _shapes(shapes) -> str:
    return ", ".join(f"{m}x{n}" for m, n in shapes)


def _executors(args):
    """(executors, shapes) that `normkit check` runs for these arguments."""
    import torch

    from normkit.testing import Executor, npu_status

    if args.interpret:
        shapes = QUICK_INTERPRETER_SHAPES if args.quick else INTERPRETER_SHAPES
        return [Executor("cuda", "cpu"), Executor("npu", "cpu")], shapes
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "npu" if npu_status()[0] else "cpu"
    executor, shapes = Executor(device, device), DEVICE_SHAPES
    if device == "cpu":
        executor, shapes = Executor("cpu", "cpu"), DEVICE_SHAPES[:-1]  # as a user's CPU calls run
    return [executor], shapes[:3] if args.quick else shapes


def _available_devices() -> list[str]:
    """The --device values that `normkit check` can run here."""
    import torch

    from normkit.testing import npu_status

    return ["cpu"] + ["cuda"] * torch.cuda.is_available() + ["npu"] * npu_status()[0]


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def cmd_check(args) -> int:
    if args.interpret and args.device not in ("auto", "cpu"):
        print(f"normkit check: --device {args.device} with --interpret: the interpreter runs the kernels on "
              "CPU tensors; drop --interpret to check the device, or --device (auto or cpu)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.interpret:
        if not _has_triton():
            print('normkit check --interpret: needs the `triton` module; pip install "normkit[cuda]"',
                  file=sys.stderr)  # fmt: skip
            return 2
        # Must be set before Triton compiles (decorates) any kernel: backends load lazily, later.
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from normkit.testing import check_case

    executors, shapes = _executors(args)
    for ex in executors:
        ok, reason = ex.status()
        if not ok:  # exit 2 like any usage error (and `normkit bench`); 1 means a check failed
            given = "--interpret" if args.interpret else f"--device {args.device}"
            also = ", or --interpret" if _has_triton() and not args.interpret else ""
            print(f"normkit check: {given}: {ex.name} is unavailable ({reason}); available here: "
                  f"--device {', '.join(_available_devices())}{also}", file=sys.stderr)  # fmt: skip
            return 2
    dtypes = [getattr(torch, name) for name in DTYPES]
    groups = [(ex, op, dtype) for ex in executors for op in OPS for dtype in dtypes if dtype in ex.dtypes]
    from tqdm import tqdm

    rows, failures, start = [], 0, time.perf_counter()
    # A bar on a terminal (stderr); on a pipe or CI log, one line per group instead.
    bar = tqdm(groups, desc="normkit check", unit="group", file=sys.stderr, disable=None)
    for ex, op, dtype in bar:
        bar.set_postfix_str(f"{ex.name} {op} {str(dtype).replace('torch.', '')}", refresh=False)
        worst, failed = 0.0, []  # worst: the largest fraction of tolerance used
        for shape in shapes:
            try:
                with ex.activate():
                    errors = check_case(op, shape, 1, dtype, ex.device)
                worst = max(worst, *errors.values())
            except AssertionError as exc:
                failed.append(f"{shape}: {str(exc).splitlines()[0]}")
        failures += bool(failed)
        status = "ok" if not failed else "FAIL"
        passed = f"{len(shapes) - len(failed)}/{len(shapes)}"
        dt = str(dtype).replace("torch.", "")
        rows.append((ex.name, op, dt, passed, f"{worst:.2f}", status))
        if bar.disable:
            print(f"  {ex.name:28s} {op:11s} {dt:9s} {passed:>6s} {status}", file=sys.stderr, flush=True)
        for line in failed:
            bar.write(f"    {ex.name} {op} {dt} {line}", file=sys.stderr)
    print()
    header = ("executor", "op", "dtype", "shapes", "tolerance used", "status")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    elapsed = time.perf_counter() - start
    print(f"\n{len(rows) - failures}/{len(rows)} op x dtype groups passed in {elapsed:.1f}s "
          f"(fwd + bwd vs fp64 reference; shapes {_shapes(shapes)})")
    if executors[0].backend == "cpu":
        print("Checked CPU tensors as normkit serves them (torch's CPU operators, the reference for the "
              "rest). `normkit check --interpret` runs both backends' Triton kernels through the Triton "
              "interpreter.")
    return 1 if failures else 0


def cmd_info(args) -> int:
    import torch

    import normkit
    from normkit import dispatch
    from normkit.testing import npu_status

    triton_flavour = "triton-ascend" if _version("triton-ascend") else "triton"
    print(f"normkit     {normkit.__version__}")
    print(f"python      {sys.version.split()[0]}")
    print(f"torch       {torch.__version__}")
    print(f"triton      {_version(triton_flavour) or 'not installed'} ({triton_flavour})")
    supported = _triton_range()
    if triton_flavour == "triton" and _version("triton") and supported is not None:
        ok = supported.contains(_version("triton"), prereleases=True)
        print(f"            {'in' if ok else 'NOT in'} the tested range {supported} (docs/backends.md)")
    print(f"torch_npu   {_version('torch_npu') or _version('torch-npu') or 'not installed'}")
    print("devices:")
    print("  cpu       yes")
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        print(f"  cuda      {len(names)}: {', '.join(names)}")
        if _has_triton() and triton_flavour == "triton":
            from normkit.backends.cuda import compat

            gluon = "on" if compat.gluon_ok(torch.device("cuda", 0)) else f"off ({compat.disabled('gluon')})"
            print(f"            fast paths: shared-memory kernels (Gluon) {gluon}")
    else:
        print("  cuda      none")
    ok, reason = npu_status()
    print(f"  npu       {torch.npu.device_count() if ok else 'none'}{'' if ok else f' ({reason})'}")
    print("backends:")
    for device_type, module in sorted(dispatch.registered().items()):
        print(f"  {device_type:9s} -> {module}")
        try:
            left = dispatch.falls_back(importlib.import_module(module))
        except Exception:  # its Triton is not installed, or breaks on import: said above / by a call
            continue
        for fn, why in left.items():
            print(f"              {fn}: from normkit.reference ({why})")
    if args.shape and not _has_triton():
        print('launch configs: need the `triton` module (pip install "normkit[cuda]", or "normkit[npu]")')
    elif args.shape:
        m, n = args.shape
        dtype = getattr(torch, args.dtype)
        from normkit.backends.cuda import config as cuda_config
        from normkit.backends.npu import config as npu_config

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"launch configs for rows M={m}, N={n}, {args.dtype} (CUDA on {device}; contiguous rows,"
              " 16-byte aligned, affine parameters in that dtype):")  # fmt: skip
        fit = n % 16 == 0  # smem.fits for such rows
        for kind, params in (("layer_norm", 2), ("rms_norm", 1), ("add_norm", 2), ("softmax", 0)):
            cfg = cuda_config.forward(m, n, dtype, device, kind, fit, params * dtype.itemsize)
            print(f"  cuda forward   {cfg} ({kind})")
        for name, is_rms, grads in (("layer_norm", False, 2), ("rms_norm", True, 1)):
            cfg = cuda_config.backward(m, n, dtype, device, is_rms, fit, grads)
            print(f"  cuda backward  {cfg} ({name})")
            cfg = cuda_config.backward(m, n, dtype, device, is_rms, fit, grads, True)
            print(f"  cuda backward  {cfg} (add_{name}, with the residual's gradient)")
        npu_device = torch.device("npu" if ok else "cpu")
        where = "npu" if ok else "cpu tensors, interpreter"
        programs = npu_config.vector_cores(npu_device)
        print(f"  npu rows       {npu_config.rows(m, npu_device)} ({where}: {programs} programs)")
    return 0


def cmd_bench(args) -> int:
    from normkit import bench

    return bench.command(args)


BENCH_EPILOG = """\
suites (default: all):
  sweep  row ops, N = 1024 ... 262144 (powers of 2), M = 2^27 // N
  small  row ops, N = 64, 128, 256, 512, M = 2^27 // N
  few    row ops, M = 1, 16, 128 rows of N = 4096, 8192 (inference: forward under no_grad)
  image  group_norm (32 groups), batch_norm (training, running stats) on (N, C, H, W) =
         128x256x56x56, 256x512x28x28, 128x64x112x112 (ResNet-50 training), 32x256x56x56
  image_cl  the image cases with x and dy in torch.channels_last (shapes labelled -cl)
  dim0   softmax_dim0, log_softmax_dim0: softmax along dim 0 of a contiguous (N, M) tensor,
         N = 1024, 4096, 32768, M = 2^27 // N
--quick: sweep N=4096, small N=256, few 16x4096, the first image shape (both layouts), dim0 N=4096;
bfloat16.

devices (--device, default auto: cuda if available, else npu):
  cuda  normkit, torch eager, torch.compile, Liger-Kernel and quack (when importable), timed
        with triton.testing.do_bench
  npu   normkit, torch eager (Ascend's aclnn kernels) and torch_npu's fused ops: npu_rms_norm,
        npu_add_rms_norm (forward only: torch_npu has no backward for it), npu_add_layer_norm;
        timed with torch.npu events and an L2 flush between runs; fp64 references on the CPU.
        torch.compile, Liger-Kernel and quack are not measured there (the table says why).
  cpu   normkit and torch on CPU tensors: host time per call (us), forward and forward +
        backward, 8 ops at 1x8, 16x4096, 4096x4096 (--ops, --dtypes: float32,bfloat16 by default;
        suites do not apply); never chosen by auto

Every result is checked against the fp64 reference before it is timed: `fail` = the
implementation raised, `wrong` = output or gradient off the reference (exit status 1 after the
sweep), `-` = not implemented. Exit 2: no CUDA GPU or NPU for --device, or bad arguments.

The full run takes about half an hour on an H100. Splitting it (e.g. for a 10-minute limit per
command) and merging the parts:
  normkit bench --shard 1/8 --out p1     # ... up to --shard 8/8 --out p8
  normkit bench --merge p1,p2,p3,p4,p5,p6,p7,p8 --out all
or re-run one command until it has done everything (results are saved after each measurement):
  normkit bench --out all --resume
An A/B of two installs, or the spread of three runs of one, on one machine:
  normkit bench --suite sweep --out old ... normkit bench --suite sweep --out new
  normkit bench --compare old,new
  normkit bench --compare old1+old2,new1+new2   # runs in turns; each cell the fastest of its group
(each run records which normkit it imported, and --compare prints it: run both outside a source
checkout, whose normkit/ would shadow an install on PYTHONPATH)
"""


def _dirs(text: str) -> list[str]:
    """A comma-separated list of result directories (or .json files)."""
    return [t for t in text.split(",") if t]


def add_bench_parser(sub):
    """The `normkit bench` subcommand and its arguments (from normkit.bench_plan: no torch)."""
    bench = bench_plan  # what normkit.bench re-exports, without importing torch
    p = sub.add_parser(
        "bench", help="GB/s and fraction of copy: normkit vs torch vs torch.compile, Liger, quack (CUDA) or "
                      "torch_npu (NPU)",
        description=bench.DESCRIPTION, epilog=BENCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--suite", type=bench.comma_list(bench.SUITES, "suite"), metavar="LIST",
                   help=f"comma-separated suites from {','.join(bench.SUITES)} (default: all)")
    p.add_argument("--ops", type=bench.comma_list(bench.OPS, "op"), metavar="LIST",
                   help=f"only these ops (default: all of the suites'): {','.join(bench.OPS)}")
    p.add_argument("--dtypes", "--dtype", type=bench.comma_list(bench.DTYPES, "dtype"), metavar="LIST",
                   help=f"comma-separated dtypes (default: {','.join(bench.DTYPES)}; --quick: bfloat16)")
    p.add_argument("--n", type=bench.int_list, metavar="LIST",
                   help="row lengths N for the sweep, small, few and dim0 suites (M = 2^27 // N; few keeps "
                        "its M)")
    p.add_argument("--device", choices=bench.DEVICES, default="auto",
                   help="device to measure on (auto: cuda if available, else npu; exit 2 when neither is; "
                        "cpu: host time per call against torch)")
    p.add_argument("--impls", type=bench.comma_list(bench.IMPLS, "implementation"), metavar="LIST",
                   help=f"implementations (default: those of {','.join(bench.IMPLS)} importable and measured "
                        "on the device, except npu-kernels-on-cuda: normkit's NPU kernels launched on a CUDA "
                        "GPU, measured only when named)")
    p.add_argument("--quick", action="store_true", help="one small subset of each suite, bfloat16")
    p.add_argument("--dropout", type=bench.dropout_p, default=0.0, metavar="P",
                   help="the add-norms with dropout_p=P (fixed seed), checked against fp64 through normkit's "
                        "mask; measured for normkit (and npu-kernels-on-cuda) only: the others draw their "
                        "own masks (default: 0)")
    p.add_argument("--out", metavar="DIR",
                   help="write results.json, results.csv, table.txt and plots/*.png here (default: none)")
    p.add_argument("--resume", action="store_true",
                   help="keep DIR's results and measure only the (case, implementation) pairs not there")
    p.add_argument("--shard", type=bench.shard_spec, metavar="I/K",
                   help="run every K-th case from the I-th, so K invocations cover the plan")
    p.add_argument("--merge", type=_dirs, metavar="DIRS",
                   help="merge the results.json of these comma-separated DIRs (or .json files) into one "
                        "table (and --out DIR set); measures nothing, needs no GPU")
    p.add_argument("--compare", type=_dirs, metavar="DIRS",
                   help="compare the results of these comma-separated DIRs (or .json files), run by run: "
                        "each cell's GB/s, last / first (an A/B: the old run first), the spread of repeated "
                        "runs, the cells below 0.98 and over 3%%; A+B: the fastest of runs A and B per cell; "
                        "measures nothing, needs no GPU")
    p.add_argument("--list", action="store_true", help="print the cases and exit (needs no GPU)")
    p.add_argument("--rep-ms", type=float, default=100, metavar="MS",
                   help="time spent timing each measurement (do_bench on cuda, events on npu; default: 100)")
    p.add_argument("--warmup-ms", type=float, default=25, metavar="MS",
                   help="warm-up time before each measurement (default: 25)")
    p.add_argument("--rounds", type=bench.rounds, default=1, metavar="R",
                   help="time every measurement in R passes over the cases (each on fresh inputs, the "
                        "checks in the first) and keep each direction's fastest round: a disturbance that "
                        "outlasts one measurement lands in one round (default: 1; cuda and npu)")
    p.add_argument("--gc-running", action="store_true",
                   help="leave Python's garbage collector running in the timed runs (default: paused during "
                        "each measurement, as timeit does)")
    p.set_defaults(fn=cmd_bench)
    return p


def cmd_native(args) -> int:
    """Compile the native extensions (normkit/native.py) that are not there: the CUDA plans' host
    path, and the CPU calls' door and 16-bit LayerNorm / GroupNorm training. Needs no Triton and no
    GPU."""
    import time

    from normkit import native

    uses = {"cuda": "the CUDA plans' launches",
            "cpu": "CPU calls (the door; 16-bit LayerNorm / GroupNorm training)"}
    failed = False
    for kind in native.KINDS:
        start = time.perf_counter()
        if native.module(build=True, kind=kind) is None:
            print(f"native {kind}: not built: {native.why(kind)}", file=sys.stderr)
            failed = True
            continue
        print(f"native {kind}: {native.build_dir(kind)} ({time.perf_counter() - start:.0f} s), used from the "
              f"next process on by {uses[kind]} (NORMKIT_NATIVE=0 turns it off)")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = Parser(prog="normkit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"normkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,check,bench,native}")
    info = sub.add_parser("info", help="versions (is Triton in the tested range), devices, fast paths, "
                                       "the backend serving each device type")
    info.add_argument("--shape", type=rows_shape, metavar="M,N",
                      help="also print the launch configs chosen for M rows of N (M,N or MxN, e.g. 16x4096)")
    info.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32", "float64"])
    info.set_defaults(fn=cmd_info)
    check = sub.add_parser("check", help="fwd+bwd of every op x dtype x shape vs the fp64 reference "
                                         f"({', '.join(OPS)})")
    check.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"],
                       help="device to check (auto: cuda, else npu, else cpu, as normkit serves CPU tensors)")
    check.add_argument("--interpret", action="store_true",
                       help="run both backends' Triton kernels on CPU tensors through the Triton interpreter")
    check.add_argument("--quick", action="store_true",
                       help=f"fewer, smaller shapes: with --interpret {_shapes(QUICK_INTERPRETER_SHAPES)} "
                            f"(under a minute on 2 cores), else {_shapes(DEVICE_SHAPES[:3])}")
    check.set_defaults(fn=cmd_check)
    add_bench_parser(sub)
    native = sub.add_parser("native", help="compile normkit's C++ extensions: CUDA calls' host path, CPU "
                                           "calls' door and 16-bit LayerNorm / GroupNorm training (about a "
                                           "minute, once per torch: a C++ compiler and ninja; "
                                           "docs/performance.md)")
    native.set_defaults(fn=cmd_native)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
