#!/usr/bin/env bash
# CI on a machine without GPU/NPU: a fresh virtualenv, the README quick start's CPU install line (the
# user form, then the developer form) and its commands, the install-layout check, `pytest -m npu`
# (must exit 0 with every NPU test skipped), the CPU mutants (ci/mutants.py), the README's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv-ci}
rm -rf "$VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"
# The README's CPU line names PyTorch's CPU index. Where that index cannot be reached, pip warns and
# takes torch's CPU wheel from the machine's own wheels; one retry a URL instead of five keeps that
# from costing minutes per install.
export PIP_RETRIES=${PIP_RETRIES:-1}
CPU_INDEX=https://download.pytorch.org/whl/cpu

echo "== README quick start, CPU line (user form): install, check, the interpreter's quick check"
pip install -q "torch==2.13.0+cpu" ".[cuda]" --extra-index-url "$CPU_INDEX"
normkit check  # (each on its own line: set -e ignores a failure on the left of &&)
normkit check --interpret --quick

echo "== install layout: wheel and editable both provide normkit.backends.{cuda,npu}"
pip install -q "torch==2.13.0+cpu" -e ".[cuda,test]" --extra-index-url "$CPU_INDEX"  # the developer form
bash ci/check-install.sh

echo "== pytest -m npu without an NPU: every test skipped with its reason, exit 0"
pytest -m npu -q -rs | tail -3

echo "== the standing mutant set (ci/mutant_set.py): each CPU mutant must fail its tests"
python ci/mutants.py

# Last, so the log ends with the suite's own summary line (N passed, M skipped).
echo "== README quick start: the test suite (-v added so the log lists each test)"
python -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
pytest -n auto -v
