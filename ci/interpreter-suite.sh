#!/usr/bin/env bash
# The CUDA kernels under the interpreter (on CPU tensors) on the lowest Triton of the supported
# range, in its own virtualenv: ci/cpu-suite.sh runs the whole suite on the newest (what the README's
# install resolves to), so together they see a Triton release that breaks a kernel.
#
# The virtualenv is cached under ${XDG_CACHE_HOME:-$HOME/.cache}/normkit-ci/, keyed by a hash of
# ci/triton-lowest.requirements.txt and the Python version; rebuilt when missing or broken. normkit
# is installed into it editable from this checkout on every run (no dependencies: seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
reqs=ci/triton-lowest.requirements.txt
python=${PYTHON:-python3}
key=$({ cat "$reqs"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/normkit-ci
venv=$cache/triton-lowest-$key
mkdir -p "$cache"
want=$(grep -E '^triton==' "$reqs" | cut -d= -f3)

healthy() {
  [[ -f $venv/.complete ]] && "$venv/bin/python" -c "import torch, triton, pytest, xdist; assert triton.__version__ == '$want'" \
    >/dev/null 2>&1
}

exec 9>"$cache/.lock-lowest"
flock 9
if healthy; then
  echo "== interpreter suite, lowest Triton: reusing $venv"
else
  echo "== interpreter suite, lowest Triton: building $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q -r "$reqs"
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
# The tests that run Triton here: the CUDA kernels under the interpreter, and the version adapter
# (backends/cuda/compat.py). The NPU kernels are not a CUDA user's Triton: triton-ascend compiles them
# (ci/npu-compile-check.sh), and the newest Triton's interpreter runs them in ci/cpu-suite.sh.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -n "${WORKERS:-2}" -k "cuda-kernels-interpreter or test_compat" \
  | tail -4
echo "== interpreter suite, lowest Triton: $((SECONDS - start)) s"
