#!/usr/bin/env bash
# The GPU suite: run on a CUDA machine (the device tool) from the repository root.
#   bash ci/gpu-suite.sh            pytest -m cuda, then `normkit bench --quick` (normkit, torch)
# Uses whichever triton imports: PYTHONPATH may point at another release unpacked from
# ../shared/tools/triton-for-device.sh (docs/backends.md, "Triton versions"). Logs go to $OUT (or
# ./gpu-out), named after the Triton version. PYTEST_ARGS narrows the suite (default: tests);
# PYTEST_TIMEOUT (s) interrupts it with SIGINT, so the summary of what ran is still printed (and the
# run counts as failed);
# BENCH=0 skips the benchmark; INSTALL=0 skips the editable install (done already); GPUS=K spreads
# the workers over K GPUs (worker I on GPU I % K, tests/conftest.py); RECORD=1 records each test's
# kernel launches and tolerance use under $OUT/<triton>-records (ci/gpu_smoke.py select / tolerances).
# REST_OF=JUNIT_XML runs only the tests an earlier run did not finish (one device call runs 600 s at
# most; the junit of a run stopped by PYTEST_TIMEOUT lists what it finished): ci/rest_of_junit.py.
# The machine's own torch is used (--no-deps).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
fi
tag=$(python3 -c 'import triton; print(triton.__version__)')
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, triton.__file__)'
} | tee "$OUT/$tag-machine.txt"
# worksteal: a worker that is done takes queued tests from the others (the longest tests run ~70 s)
dist=$(python3 -c 'import xdist; v = tuple(map(int, xdist.__version__.split(".")[:2])); print("worksteal" if v >= (3, 2) else "load")')
record=""; [ "${RECORD:-0}" = 1 ] && record="$OUT/$tag-records"
targets=(${PYTEST_ARGS:-tests}); run=$tag
if [ -n "${REST_OF:-}" ]; then  # (logs and junit then named $tag-rest-*)
  rest=$(python3 ci/rest_of_junit.py "$REST_OF" ${PYTEST_ARGS:-tests}) || exit 1
  [ -n "$rest" ] || { echo "REST_OF: every test finished"; exit 0; }
  mapfile -t targets <<< "$rest"; run=$tag-rest
fi
NORMKIT_RECORD_LAUNCHES=$record NORMKIT_TEST_GPUS=${GPUS:-} timeout -s INT "${PYTEST_TIMEOUT:-3600}" python3 -m pytest -m cuda -q -n "${WORKERS:-16}" --dist "$dist" -p no:cacheprovider \
  --tb=line -rf --durations=30 --junitxml="$OUT/$run-junit.xml" "${targets[@]}" > "$OUT/$run-pytest.log" 2>&1
status=$?
grep -E "^FAILED|passed|failed" "$OUT/$run-pytest.log" | tail -40
if grep -q "KeyboardInterrupt" "$OUT/$run-pytest.log"; then  # the totals above are then not the suite's
  echo "INTERRUPTED after ${PYTEST_TIMEOUT:-3600} s: not every test ran ($run-junit.xml lists those that did; REST_OF=it runs the rest)"
  status=1
fi
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m normkit bench --quick --impls normkit,torch 2>&1 | tee "$OUT/$tag-bench-quick.txt" | tail -30
fi
exit "$status"
