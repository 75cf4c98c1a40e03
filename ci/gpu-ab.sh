#!/usr/bin/env bash
# The A/B of issue 43 on a GPU machine: the code at an older revision and this tree installed side
# by side, the same `normkit bench` cells, then two more runs of this tree (the three-run spread).
#   git archive REV | (mkdir -p .old/REV && tar x -C .old/REV)   # here; .old/ is git-ignored locally
#   bash ci/gpu-ab.sh .old/REV                                     # there (carry .old)
# Runs from outside the source tree (its normkit/ would shadow the old install on PYTHONPATH); every
# results.json names the install it measured (normkit_path), and `normkit bench --compare` prints it.
# SUITES (default sweep,small,image), DTYPES (bfloat16,float16,float32), RUN_T (200 s a run),
# SPREAD_SUITES (the two repeat runs: sweep, as issue 43 states the spread), NATIVE (1: build the new
# tree's native host path first, `normkit native`; 0: the Python path). Logs and results under $OUT
# (or ./gpu-out): old/, new/, new2/, new3/, ab.txt, spread.txt.
set -uo pipefail
OLD=$(realpath "${1:?usage: bash ci/gpu-ab.sh DIR_OF_THE_OLD_TREE}")
OUT=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
if [ "${NATIVE:-1}" = 1 ]; then
  export NORMKIT_NATIVE_DIR=${NORMKIT_NATIVE_DIR:-/tmp/normkit-native}
  python3 -m normkit native 2>&1 | tail -1
else
  export NORMKIT_NATIVE=0
fi
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$OLD" 2>&1 | grep -v WARNING | tail -2
cd "$(mktemp -d)" || exit 1
args="--suite ${SUITES:-sweep,small,image} --dtypes ${DTYPES:-bfloat16,float16,float32} --impls normkit"
echo "old: $(PYTHONPATH=$site python3 -c 'import normkit; print(normkit.__file__)')"
echo "new: $(python3 -c 'import normkit; print(normkit.__file__)')"
# Compile both installs' kernels first: 8 shards each with 1 ms timings (discarded), over every GPU.
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
for i in 0 1 2 3 4 5 6 7; do
  (CUDA_VISIBLE_DEVICES=$((i % gpus)) NORMKIT_NATIVE=0 PYTHONPATH=$site timeout 100 python3 -m normkit bench $args \
     --shard "$i/8" --rep-ms 1 --warmup-ms 1 > /dev/null 2>&1) &
  (CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout 100 python3 -m normkit bench $args \
     --shard "$i/8" --rep-ms 1 --warmup-ms 1 > /dev/null 2>&1) &
done
wait
echo "compiled: $(( $(date +%s) - start )) s"
export CUDA_VISIBLE_DEVICES=0
NORMKIT_NATIVE=0 PYTHONPATH=$site timeout "${RUN_T:-200}" python3 -m normkit bench $args --out "$OUT/old" \
  > "$OUT/old.txt" 2>&1  # (the old tree on its Python path: one installed before 4e6a466 has no native.cpp)
echo "old: exit $?, $(( $(date +%s) - start )) s"
timeout "${RUN_T:-200}" python3 -m normkit bench $args --out "$OUT/new" > "$OUT/new.txt" 2>&1
echo "new: exit $?, $(( $(date +%s) - start )) s"
for run in new2 new3; do
  timeout "${RUN_T:-200}" python3 -m normkit bench ${args/--suite ${SUITES:-sweep,small,image}/--suite ${SPREAD_SUITES:-sweep}} \
    --out "$OUT/$run" > "$OUT/$run.txt" 2>&1
  echo "$run: exit $?, $(( $(date +%s) - start )) s"
done
python3 -m normkit bench --compare "$OUT/old,$OUT/new" > "$OUT/ab.txt" 2>&1
python3 -m normkit bench --compare "$OUT/new,$OUT/new2,$OUT/new3" > "$OUT/spread.txt" 2>&1
rm -rf "$OUT"/*/plots  # the device tool brings back a limited number of files: results.json first
grep -A3 "^fwd: last" "$OUT/ab.txt"; grep -E "^(below|spread over)" "$OUT/spread.txt"
echo "gpu A/B: $(( $(date +%s) - start )) s"
