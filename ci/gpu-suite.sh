#!/usr/bin/env bash
# The GPU suite: run on a CUDA machine (the device tool) from the repository root.
#   bash ci/gpu-suite.sh            tests (pytest -m cuda) + a side-by-side benchmark
# Logs go to $OUT (or ./gpu-out). The machine's own torch/triton are used (--no-deps).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/machine.txt"
python3 -m pytest -m cuda -q -n 8 -p no:cacheprovider ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest-cuda.log" | tail -25
status=${PIPESTATUS[0]}
if [ "${BENCH:-1}" = 1 ]; then
  python3 -m normkit bench --suite sweep --n "${BENCH_N:-4096}" --dtypes bfloat16 2>&1 | tee "$OUT/bench.txt"
fi
exit "$status"
