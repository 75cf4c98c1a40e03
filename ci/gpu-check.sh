#!/usr/bin/env bash
# One Triton on the GPU machine: the CUDA suite, the co-residency test and `normkit bench --quick`.
#   bash ci/gpu-check.sh [TAG]      logs to $OUT/TAG-*.log (TAG: the Triton version by default)
# Uses whichever triton imports (PYTHONPATH may point at another release, ../shared/tools/
# triton-for-device.sh); PYTEST_ARGS narrows the suite, PYTEST_TIMEOUT bounds it (seconds).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
tag=${1:-$(python3 -c 'import triton; print(triton.__version__)')}
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, triton.__file__)' | tee "$OUT/$tag-machine.txt"
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader | tee -a "$OUT/$tag-machine.txt"
timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -m cuda -q -n "${WORKERS:-16}" -p no:cacheprovider ${PYTEST_ARGS:-tests} \
  > "$OUT/$tag-pytest.log" 2>&1
status=$?
tail -15 "$OUT/$tag-pytest.log"
python3 -m normkit bench --quick --impls normkit,torch 2>&1 | tee "$OUT/$tag-bench-quick.txt" | tail -30
exit "$status"
