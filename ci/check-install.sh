#!/usr/bin/env bash
# backends/ must be installed as normkit.backends (never as a top-level `backends`), from the wheel
# and from the editable install. Run inside an environment with torch and triton installed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
probe='
import importlib.util, sys
import normkit.backends.cuda, normkit.backends.npu, normkit.reference
assert importlib.util.find_spec("backends") is None, "a top-level backends package is installed"
where = sys.argv[1]
assert normkit.backends.cuda.__file__.startswith(where), (normkit.backends.cuda.__file__, where)
print("ok:", normkit.backends.cuda.__file__, normkit.backends.npu.__file__)
'
python -m pip wheel -q --no-deps -w "$tmp/dist" .
unzip -l "$tmp"/dist/normkit-*.whl | grep -E "normkit/backends/(cuda|npu)/layer_norm.py"
python -m pip install -q --no-deps --target "$tmp/site" "$tmp"/dist/normkit-*.whl
(cd "$tmp" && PYTHONPATH="$tmp/site" python -c "$probe" "$tmp/site")
echo "wheel: ok"
(cd "$tmp" && python -c "$probe" "$repo/backends")  # the editable install of this checkout
echo "editable: ok"
