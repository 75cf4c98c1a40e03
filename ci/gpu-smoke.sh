#!/usr/bin/env bash
# The GPU smoke run (a CUDA machine, from the repository root; after every change under backends/cuda):
#   bash ci/gpu-smoke.sh
# 1. The tests of ci/gpu-smoke-tests.txt: the fewest that reach every kernel variant the full
#    `pytest -m cuda` reaches (each kernel x dtype class x op flags, and the direct and plan launch
#    paths; ci/gpu_smoke.py select), each against its fp64 reference.
# 2. ci/gpu_smoke.py check: every variant of ci/gpu-smoke-variants.txt was reached, and every kernel
#    of backends/cuda in both dtype classes.
# 3. The GPU-only mutants (python ci/mutants.py --device cuda): each must be killed.
# Logs in $OUT (or ./gpu-out). WORKERS (default 8) pytest-xdist workers; INSTALL=0 skips the editable
# install. Exit status: nonzero if any step failed.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
fi
start=$(date +%s)
python3 -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)'
records="$OUT/smoke-records"; rm -rf "$records"
mapfile -t tests < ci/gpu-smoke-tests.txt
NORMKIT_RECORD_LAUNCHES=$records python3 -m pytest -m cuda -q -n "${WORKERS:-8}" --dist worksteal -p no:cacheprovider --tb=line -rf \
  "${tests[@]}" > "$OUT/smoke-pytest.log" 2>&1
status=$?
grep -E "^FAILED|passed|failed" "$OUT/smoke-pytest.log" | tail -20
python3 ci/gpu_smoke.py check "$records" | tee "$OUT/smoke-check.txt" || status=1
python3 ci/mutants.py --device cuda --jobs "${MUTANT_JOBS:-4}" | tee "$OUT/smoke-mutants.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "gpu smoke: $(( $(date +%s) - start )) s, exit $status"
exit "$status"
