#!/usr/bin/env bash
# The native host path on a CUDA machine (the device tool), from the repository root:
#   bash ci/gpu-native.sh     build it (`normkit native`), its tests, the host-time table with it and
#                             without it (NORMKIT_NATIVE=0), same machine, one after the other.
# Logs to $OUT (or ./gpu-out). SUITE="tests/..." also runs those GPU tests with the path built.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NORMKIT_NATIVE_DIR=${NORMKIT_NATIVE_DIR:-/tmp/normkit-native}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' | tee "$OUT/native-machine.txt"
python3 -m normkit native 2>&1 | tail -3 | tee "$OUT/native-build.txt"
timeout -s INT 300 python3 -m pytest -m cuda -q -x -p no:cacheprovider --tb=short tests/test_native.py > "$OUT/native-pytest.log" 2>&1
tail -30 "$OUT/native-pytest.log"
python3 ci/measure-host-time.py calls cuda > "$OUT/native-host-on.md" 2>&1; cat "$OUT/native-host-on.md"
NORMKIT_NATIVE=0 python3 ci/measure-host-time.py calls cuda > "$OUT/native-host-off.md" 2>&1; cat "$OUT/native-host-off.md"
if [ -n "${SUITE:-}" ]; then
  timeout -s INT "${SUITE_T:-240}" python3 -m pytest -m cuda -q -n 16 -p no:cacheprovider --tb=line -rf $SUITE > "$OUT/native-suite.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/native-suite.log" | tail -30
fi
