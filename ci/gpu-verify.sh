#!/usr/bin/env bash
# Everything a change under backends/cuda (or the front end) must pass on a GPU machine, in one
# command (the device tool: one call, about 9 minutes on a 2x H200 host):
#   bash ci/gpu-verify.sh
# 1. With two or more GPUs: tests/test_distributed.py -m cuda (DDP, FSDP2, TP / SP, DTensor ops,
#    double backward and channels_last on DTensors; NCCL) and test_gpu_hardening's second-GPU,
#    side-stream and thread tests (skipped, with the reason, on one GPU).
# 2. The GPU suite (ci/gpu-suite.sh) with its workers spread over every GPU, no benchmark.
# 3. The GPU smoke (ci/gpu-smoke.sh): every kernel variant once and the GPU mutants.
# PYTHONPATH may point at another Triton (docs/backends.md, "Triton versions"). Logs in $OUT (or
# ./gpu-out). Time limits (s): DIST_T (200), SUITE_T (320: pytest is interrupted and its summary
# kept, and the run counts as failed), SMOKE_T (180). Exit status: nonzero if any step failed.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
status=0
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
if [ "$gpus" -ge 2 ]; then
  NORMKIT_DIST_LOG=$OUT/dist timeout -s INT "${DIST_T:-200}" python3 -m pytest -m cuda -s -q -p no:cacheprovider \
    tests/test_distributed.py > "$OUT/distributed.log" 2>&1 || status=1
  echo "two GPUs, test_distributed: $(tail -1 "$OUT/distributed.log")"
  timeout -s INT 120 python3 -m pytest -m cuda -q -p no:cacheprovider -rs tests/test_gpu_hardening.py \
    -k "second_gpu or side_stream or threads or per_thread" > "$OUT/hardening-two-gpus.log" 2>&1 || status=1
  echo "two GPUs, hardening: $(tail -1 "$OUT/hardening-two-gpus.log")"
else
  echo "one GPU: the two-GPU tests are left out (they skip in the suite with the reason)"
fi
OUT=$OUT INSTALL=0 BENCH=0 GPUS=$gpus WORKERS=${WORKERS:-$((15 * gpus))} PYTEST_TIMEOUT=${SUITE_T:-320} \
  bash ci/gpu-suite.sh || status=1
OUT=$OUT INSTALL=0 WORKERS=16 timeout -s INT "${SMOKE_T:-180}" bash ci/gpu-smoke.sh > "$OUT/smoke.txt" 2>&1 || status=1
tail -3 "$OUT/smoke.txt"
# The device tool brings back a limited number of files: keep the junit and logs, not the records.
rm -rf "$OUT/smoke-records"
echo "gpu verify: $(( $(date +%s) - start )) s, exit $status"
exit "$status"
