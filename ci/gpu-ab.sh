#!/usr/bin/env bash
# The A/B of issue 43 on a GPU machine: the code at an older revision and this tree installed side
# by side, the same `normkit bench` cells, then two more runs of this tree (the three-run spread).
#   git archive REV | (mkdir -p .old/REV && tar x -C .old/REV)   # here; .old/ is git-ignored locally
#   bash ci/gpu-ab.sh .old/REV                                     # there (carry .old)
# Runs from outside the source tree (its normkit/ would shadow the old install on PYTHONPATH); every
# results.json names the install it measured (normkit_path), and `normkit bench --compare` prints it.
# SUITES (default sweep,small,image), DTYPES (bfloat16,float16,float32), RUN_T (300 s a run),
# SPREAD_SUITES (the two repeat runs: sweep, as issue 43 states the spread), NATIVE (1: build the new
# tree's native host path first, `normkit native`; 0: the Python path). Logs and results under $OUT
# (or ./gpu-out): old/, new/, new2/, new3/ (results.json; the logs stay in RESULTS), ab.txt, spread.txt.
# BENCH (default new): the old runs use this tree's bench (normkit/bench.py, bench_plan.py, cli.py,
# __main__.py copied over the old install, which keeps its own ops, kernels and references), so both
# codes are timed the same way: where the bench's measuring point moved (since d420823 it times the
# backward of a later call's graph, not the first call's), the old tree's own bench (BENCH=old)
# times another point, and a kernel whose time depends on its buffers' addresses reads differently
# (docs/tuning-log.md T109).
# Steps s1 s2 s3 (not in the default): three more back-to-back runs of the new tree's SPREAD_SUITES
# with `--rounds ${ROUNDS:-2}` (each cell's fastest of ROUNDS passes); spread.txt then compares them
# (else new, new2, new3). Step retry (after old and new): the ops and dtypes of the cells below
# 0.98 in ab.txt run again, old then new, RETRIES times (default 2; old-r1 new-r1 old-r2 ...);
# ab.txt then compares old+old-r1+... with new+new-r1+..., each cell its code's fastest run (a dip
# of seconds lands in one run of one code; both codes get the same runs of the cells retried).
# STEPS (default "old new new2 new3") runs some of the runs, RESULTS (default $OUT) keeps them: one
# device call runs 600 s at most, so on one GPU the A/B is calls to the same warm machine with
# RESULTS=/tmp/ab (kept while it is warm): STEPS=old, STEPS="new new2", STEPS=new3 (or "s1 s2 s3");
# each call compares what RESULTS holds so far and brings back the runs it made.
set -uo pipefail
OLD=$(realpath "${1:?usage: bash ci/gpu-ab.sh DIR_OF_THE_OLD_TREE}")
OUT=$(realpath -m "${OUT:-gpu-out}"); mkdir -p "$OUT"
RES=$(realpath -m "${RESULTS:-$OUT}"); mkdir -p "$RES"
STEPS=" ${STEPS:-old new new2 new3} "
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -2
if [ "${NATIVE:-1}" = 1 ]; then
  export NORMKIT_NATIVE_DIR=${NORMKIT_NATIVE_DIR:-/tmp/normkit-native}
  python3 -m normkit native 2>&1 | tail -2
else
  export NORMKIT_NATIVE=0
fi
site=$RES/old-site  # (kept between steps in RESULTS; never under OUT, whose files come back)
[ "$RES" = "$OUT" ] && site=$(mktemp -d)
[ -d "$site/normkit" ] || python3 -m pip install -q --no-deps --no-build-isolation --target "$site" "$OLD" 2>&1 \
  | grep -v WARNING | tail -2
if [ "${BENCH:-new}" = new ]; then  # the old code timed by this tree's bench
  osite=$site-bench; rm -rf "$osite"; cp -r "$site" "$osite"
  cp normkit/bench.py normkit/bench_plan.py normkit/cli.py normkit/__main__.py "$osite/normkit/"
else
  osite=$site
fi
cd "$(mktemp -d)" || exit 1
args="--suite ${SUITES:-sweep,small,image} --dtypes ${DTYPES:-bfloat16,float16,float32} --impls normkit"
echo "old: $(PYTHONPATH=$osite python3 -c 'import normkit; print(normkit.__file__)')"
echo "new: $(python3 -c 'import normkit; print(normkit.__file__)')"
# Compile both installs' kernels first (once a machine): 8 shards each with 1 ms timings
# (discarded), over every GPU.
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ ! -e "$RES/compiled" ]; then
  for i in 0 1 2 3 4 5 6 7; do
    (CUDA_VISIBLE_DEVICES=$((i % gpus)) NORMKIT_NATIVE=0 PYTHONPATH=$osite timeout 100 python3 -m normkit bench \
       $args --shard "$i/8" --rep-ms 1 --warmup-ms 1 > /dev/null 2>&1) &
    (CUDA_VISIBLE_DEVICES=$((i % gpus)) timeout 100 python3 -m normkit bench $args \
       --shard "$i/8" --rep-ms 1 --warmup-ms 1 > /dev/null 2>&1) &
  done
  wait
  touch "$RES/compiled"
  echo "compiled: $(( $(date +%s) - start )) s"
fi
export CUDA_VISIBLE_DEVICES=0
bench_run() {  # RUN ARGS...: one run of the old tree (RUN old*) or the new one into $RES/RUN
  local run=$1; shift
  if [[ $run == old* ]]; then  # the old tree on its Python path: one installed before 4e6a466 has no native.cpp
    NORMKIT_NATIVE=0 PYTHONPATH=$osite timeout "${RUN_T:-300}" python3 -m normkit bench "$@" --out "$RES/$run" \
      > "$RES/$run.txt" 2>&1
  else
    timeout "${RUN_T:-300}" python3 -m normkit bench "$@" --out "$RES/$run" > "$RES/$run.txt" 2>&1
  fi
  echo "$run: exit $?, $(( $(date +%s) - start )) s"
}
ab_compare() {  # ab.txt: old (and its retries) against new (and its retries)
  local old="$RES/old" new="$RES/new" i
  for i in $(seq "${RETRIES:-2}"); do
    [ -e "$RES/old-r$i/results.json" ] && [ -e "$RES/new-r$i/results.json" ] || continue
    old+="+$RES/old-r$i"; new+="+$RES/new-r$i"
  done
  python3 -m normkit bench --compare "$old,$new" > "$OUT/ab.txt" 2>&1
}
for run in old new; do
  [[ $STEPS == *" $run "* ]] && bench_run $run $args
done
if [[ $STEPS == *" retry "* ]] && [ -e "$RES/old/results.json" ] && [ -e "$RES/new/results.json" ]; then
  ab_compare
  low=$(sed -n '/^below /,/^spread over/p' "$OUT/ab.txt" | grep '^  ')  # "  op dtype shape impl dir ratio"
  if [ -n "$low" ]; then
    ops=$(awk '{print $1}' <<< "$low" | sort -u | paste -sd,)
    dtypes=$(awk '{print $2}' <<< "$low" | sort -u | paste -sd,)
    echo "retry: $(wc -l <<< "$low") cells below 0.98; --ops $ops --dtypes $dtypes"
    for i in $(seq "${RETRIES:-2}"); do
      bench_run "old-r$i" ${args/--dtypes ${DTYPES:-bfloat16,float16,float32}/--dtypes $dtypes} --ops "$ops"
      bench_run "new-r$i" ${args/--dtypes ${DTYPES:-bfloat16,float16,float32}/--dtypes $dtypes} --ops "$ops"
    done
  fi
fi
for run in new2 new3 s1 s2 s3; do
  [[ $STEPS == *" $run "* ]] || continue
  rounds=1; [[ $run == s* ]] && rounds=${ROUNDS:-2}
  timeout "${RUN_T:-300}" python3 -m normkit bench ${args/--suite ${SUITES:-sweep,small,image}/--suite ${SPREAD_SUITES:-sweep}} \
    --rounds "$rounds" --out "$RES/$run" > "$RES/$run.txt" 2>&1
  echo "$run: exit $?, $(( $(date +%s) - start )) s"
done
if [ -e "$RES/old/results.json" ] && [ -e "$RES/new/results.json" ]; then
  ab_compare
fi
spread_runs="new new2 new3"
[ -e "$RES/s1/results.json" ] && spread_runs="s1 s2 s3"
runs=$(for r in $spread_runs; do [ -e "$RES/$r/results.json" ] && printf '%s,' "$RES/$r"; done)
if [ "$(tr -cd , <<< "$runs" | wc -c)" -ge 2 ]; then
  python3 -m normkit bench --compare "${runs%,}" > "$OUT/spread.txt" 2>&1
fi
retries=$(for i in $(seq "${RETRIES:-2}"); do printf 'old-r%s new-r%s ' "$i" "$i"; done)
for r in old new $retries new2 new3 s1 s2 s3; do  # what this call ran comes back with it: results.json
  made=$r; [[ $r == *-r[0-9]* ]] && made=retry  # (the device tool brings back a limited number of files)
  [[ $STEPS == *" $made "* ]] && [ -e "$RES/$r.txt" ] || continue
  mkdir -p "$OUT/$r"
  [ "$RES" = "$OUT" ] || cp "$RES/$r/results.json" "$OUT/$r/" 2>/dev/null
  rm -rf "$OUT/$r/plots"
  echo "$r: $(tail -1 "$RES/$r.txt")"
done
grep -A3 "^fwd: last" "$OUT/ab.txt" 2>/dev/null; grep -E "^(below|spread over)" "$OUT/spread.txt" 2>/dev/null
echo "gpu A/B: $(( $(date +%s) - start )) s"
