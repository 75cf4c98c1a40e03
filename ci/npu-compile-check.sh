#!/usr/bin/env bash
# Ascend compile check (no NPU, no CANN needed): compiles every kernel of backends/npu/ with
# triton-ascend for npu/Ascend910B4, in every variant the NPU backend launches (each dtype and flag
# combination, recorded from the public API), through the last stage that runs without CANN
# (ttadapter). How variants are found and what counts as a pass: ci/npu_compile_check.py.
#
# triton-ascend replaces the `triton` module, so it gets its own virtualenv, cached under
# ${XDG_CACHE_HOME:-$HOME/.cache}/normkit-ci/ and keyed by a hash of
# ci/npu-compile-check.requirements.txt and the Python version; rebuilt when missing or broken.
# normkit is not installed there: the check imports it from this checkout.
#
# Usage: bash ci/npu-compile-check.sh [--jobs N] [--manifest PATH]   (passed to npu_compile_check.py)
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
  "$venv/bin/python" ci/npu_compile_check.py "$@"
echo "== npu compile check: ${SECONDS}s in all"
