"""Device/backend parametrization for the whole suite.

Executors pair a backend's kernels with the device they run on:
  cuda-kernels-interpreter, npu-kernels-interpreter   CPU tensors, TRITON_INTERPRET=1 (no marker)
  cuda, npu-kernels-on-cuda                            a CUDA GPU            (marker: cuda)
  npu                                                  an Ascend NPU         (marker: npu)
Each skips with the reason when its device is absent. On a machine with neither GPU nor NPU,
TRITON_INTERPRET=1 is set here, before any kernel module is imported, so plain `pytest` runs both
backends' kernels through the interpreter. NORMKIT_CHECK_LAUNCH_KEYS=1 is set here too.
"""

import importlib.util
import os

# NORMKIT_TEST_GPUS=K (ci/gpu-suite.sh GPUS=K): pytest-xdist worker gwI sees only GPU I % K, so one
# run spreads over K GPUs. Set before anything initializes CUDA in the worker.
if os.environ.get("NORMKIT_TEST_GPUS") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    os.environ["CUDA_VISIBLE_DEVICES"] = str(_worker % int(os.environ["NORMKIT_TEST_GPUS"]))

import pytest  # noqa: E402
import torch  # noqa: E402

from normkit.testing import Executor, interpreter_status, interpreting, npu_status

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() and not npu_status()[0]:
    os.environ["TRITON_INTERPRET"] = "1"
# Every keyed kernel launch of the CUDA backend is checked against the full specialization key
# (backends/cuda/launch.py): a call-site key that misses an argument fails the GPU suite.
os.environ.setdefault("NORMKIT_CHECK_LAUNCH_KEYS", "1")

INTERPRETER = [Executor("cuda", "cpu"), Executor("npu", "cpu")]
DEVICE = [
    (Executor("cuda", "cuda"), pytest.mark.cuda),
    (Executor("npu", "cuda"), pytest.mark.cuda),
    (Executor("npu", "npu"), pytest.mark.npu),
]


def executor_params(interpreter_cases, device_cases, npu_interpreter_cases=None):
    """pytest.params of (executor, *case): small cases under the interpreter, full ones on devices.
    ``npu_interpreter_cases`` replaces ``interpreter_cases`` for the NPU kernels under the
    interpreter, whose programs walk one row at a time (1151 short rows there cost ~30 s a test,
    ~15x the CUDA kernels' row-packed programs: CI time)."""
    params = []
    for ex in INTERPRETER:
        npu = ex.backend == "npu" and npu_interpreter_cases is not None
        cases = npu_interpreter_cases if npu else interpreter_cases
        params += [pytest.param(ex, *case, id=f"{ex.name}-{_id(case)}") for case in cases]
    for ex, mark in DEVICE:
        params += [pytest.param(ex, *case, id=f"{ex.name}-{_id(case)}", marks=mark) for case in device_cases]
    return params


def _id(case):
    return "-".join(str(c).replace("torch.", "").replace(" ", "") for c in case)


@pytest.fixture
def run_on():
    """Activate an executor for the test body, or skip with the reason it is unavailable."""

    def activate(ex, dtype=None):
        ok, reason = ex.status()
        if not ok:
            pytest.skip(f"{ex.name}: {reason}")
        if dtype is not None and dtype not in ex.dtypes:
            pytest.skip(f"{ex.name}: {dtype} is not served by the {ex.backend} backend")
        return ex.activate()

    return activate


@pytest.fixture
def in_parts():
    """Rows (BatchNorm: channels) in parts chosen again where they fit (``config.forced(in_parts=True)``;
    ``config.IN_PARTS`` keeps them off: their programs wait on each other with no bound), so their
    tests still test them; skipped where the installed Triton gets them wrong (compat.in_parts_ok)."""
    from normkit.backends.cuda import compat, config

    why = compat.in_parts_ok()
    if why is not None:
        pytest.skip(why)
    with config.forced(in_parts=True):
        yield


# --- records for ci/gpu_smoke.py (off unless asked) -----------------------------------------------
# NORMKIT_RECORD_LAUNCHES=DIR: every kernel launch of the CUDA backend is recorded with the test that
# made it (backends/cuda/launch.py RECORD), and every assert_close with the fraction of a candidate
# tolerance it used (normkit.testing.RECORD); each worker writes DIR/<worker>.json at its end.


def pytest_configure(config):
    # Triton's interpreter that cannot run beside this numpy would skip every interpreter test with one
    # reason: stop instead, with that reason.
    if interpreting() and importlib.util.find_spec("triton") is not None:
        ok, reason = interpreter_status()
        if not ok:
            raise pytest.UsageError(reason)
    if os.environ.get("NORMKIT_RECORD_LAUNCHES"):
        from normkit import testing
        from normkit.backends.cuda import launch

        launch.RECORD = set()
        testing.RECORD = []


def pytest_sessionfinish(session):
    out = os.environ.get("NORMKIT_RECORD_LAUNCHES")
    if not out:
        return
    import json

    from normkit import testing
    from normkit.backends.cuda import launch

    os.makedirs(out, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"launches": sorted(launch.RECORD or ()), "tolerances": testing.RECORD or []}, f)


@pytest.fixture(autouse=True)
def _cpu_calls_on_their_python_routes(monkeypatch):
    """CPU calls on normkit.cpu's Python routes in every test, whether or not this machine built the
    native CPU extension (whose door would serve them first): the door is tested apart, against
    these routes bit for bit (tests/test_cpu_door.py, which sets it)."""
    from normkit import cpu

    monkeypatch.setattr(cpu, "DOOR", None)
