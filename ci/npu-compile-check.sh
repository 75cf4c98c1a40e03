#!/usr/bin/env bash
# Ascend compile check (no NPU, no CANN needed): compiles every kernel of backends/npu/ with
# triton-ascend for npu/Ascend910B4, in every variant the NPU backend launches (each dtype and flag
# combination, recorded from the public API), through the last stage of triton-ascend that runs
# without CANN (ttadapter): ci/npu_compile_check.py. Then stage 2, Ascend's own compiler through UB
# planning on each distinct variant (no scalar loops, UB within budget): ci/npu_stage2.py.
#
# triton-ascend replaces the `triton` module, so it gets its own virtualenv, cached under
# ${XDG_CACHE_HOME:-$HOME/.cache}/normkit-ci/ and keyed by a hash of
# ci/npu-compile-check.requirements.txt and the Python version; rebuilt when missing or broken.
# normkit is not installed there: the check imports it from this checkout.
#
# Usage: bash ci/npu-compile-check.sh [--jobs N]   (passed to npu_compile_check.py; stage 2's jobs:
# STAGE2_JOBS, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
reqs=ci/npu-compile-check.requirements.txt
python=${PYTHON:-python3}
key=$({ cat "$reqs"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/normkit-ci
venv=$cache/triton-ascend-$key
mkdir -p "$cache"

healthy() {
  [[ -f $venv/.complete ]] && "$venv/bin/python" - >/dev/null 2>&1 <<'EOF'
import importlib.util, os
import numpy, torch, triton
from triton.backends.ascend import compiler
assert int(numpy.__version__.split(".")[0]) < 2
assert importlib.util.find_spec("torch_npu") is None
assert os.access(os.path.join(os.path.dirname(compiler.__file__), "triton-adapter-opt"), os.X_OK)
import ascendnpuir
assert os.access(os.path.join(os.path.dirname(ascendnpuir.__file__), "bin", "bishengir-compile"), os.X_OK)
EOF
}

exec 9>"$cache/.lock"
flock 9  # one build at a time; a second run waits, then reuses it
if healthy; then
  echo "== npu compile check: reusing $venv"
else
  echo "== npu compile check: building $venv (triton-ascend, torch CPU wheel)"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -r "$reqs"
  touch "$venv/.complete"
  healthy || { echo "npu compile check: the new virtualenv fails its health check" >&2; exit 1; }
  # Virtualenvs of older requirement lists are not needed any more.
  find "$cache" -mindepth 1 -maxdepth 1 -name 'triton-ascend-*' ! -name "triton-ascend-$key" \
    -exec rm -rf {} +
  echo "== built in $((SECONDS - start))s"
fi
flock -u 9

# A fresh Triton home: nothing compiled before is reused, nothing is left behind.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
env -u TRITON_INTERPRET TRITON_HOME="$tmp" TRITON_CACHE_DIR="$tmp/cache" \
  "$venv/bin/python" ci/npu_compile_check.py --manifest "$tmp/npu-launches.json" \
  --ttadapters "$tmp/ttadapters.json" "$@"
echo "== npu compile check (stage 1): ${SECONDS}s"
# Stage 2: Ascend's compiler (bishengir-compile) through UB planning on each distinct variant of the
# same manifest (stage 1's .ttadapter files, left in "$tmp/cache"): no scalar loops, UB within budget
# (ci/npu_stage2.py). Self-test first.
stage2() {
  env -u TRITON_INTERPRET TRITON_HOME="$tmp" "$venv/bin/python" ci/npu_stage2.py "$@"
}
stage2 --selftest
stage2 --manifest "$tmp/npu-launches.json" --ttadapters "$tmp/ttadapters.json" --jobs "${STAGE2_JOBS:-2}"
echo "== npu compile check (stages 1 and 2): ${SECONDS}s in all"
