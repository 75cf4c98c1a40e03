#!/usr/bin/env bash
# CI on a machine without GPU/NPU: a fresh virtualenv, the README's two quick-start commands, the
# install-layout check, and `pytest -m npu` (must exit 0 with every NPU test skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv-ci}
rm -rf "$VENV"
python3 -m venv "$VENV"
# shellcheck disable=SC1091
source "$VENV/bin/activate"

echo "== README quick start 1: install + main job"
pip install -q torch==2.13.0 ".[cuda]" && normkit check

echo "== install layout: wheel and editable both provide normkit.backends.{cuda,npu}"
pip install -q torch==2.13.0 -e ".[cuda,test]"  # the editable install check-install.sh probes
bash ci/check-install.sh

echo "== pytest -m npu without an NPU: every test skipped with its reason, exit 0"
pytest -m npu -q -rs | tail -3

# Last, so the log ends with the suite's own summary line (N passed, M skipped).
echo "== README quick start 2: test extra + tests (-v added so the log lists each test)"
pip install -q torch==2.13.0 -e ".[cuda,test]"
python -c 'import torch, triton, numpy; print("torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
pytest -v
