#!/usr/bin/env bash
# A/B of source trees in one GPU call with `bench tune` (OSCAR decode only, each tree's default launch config):
# every tree in turn, ROUNDS times (the repeats show the noise), then the tables of bench/tune_ab.py (best reading
# per tree and cell, speed-ups over the first tree). Faster than bench/ab_decode.sh (no SDPA baselines).
#
#     git archive <rev> vllm_oscar | (mkdir -p ab_old && tar -x -C ab_old)        # here; ab_*/ is git-ignored
#     TREES="new=. old=ab_old" OUT=$OUT bash bench/ab_tune.sh                     # on the GPU (carry ab_old)
#     TREES="old=ab_old new=." GEOMETRIES="qwen3-8b" CONTEXTS="16384 32768" BATCHES="1 8" ROUNDS=3 OUT=$OUT \
#         bash bench/ab_tune.sh
#
# TREES: name=folder pairs, the first is the base of the speed-ups; each folder holds a vllm_oscar/ package (the
# working tree is "."). Reports: $OUT/ab_<name><round>_<geometry>.json and .log; tables: $OUT/ab_tables.txt.
set -uo pipefail
OUT="${OUT:?set OUT to a folder for the results}"
TREES="${TREES:?set TREES to name=folder pairs, e.g. new=. old=ab_old}"
GEOMETRIES="${GEOMETRIES:-qwen3-8b smollm2-135m}"
CONTEXTS="${CONTEXTS:-4096 32768 131072}"
BATCHES="${BATCHES:-1 8 32 64}"
ROUNDS="${ROUNDS:-2}"
ROOT="$PWD"
for spec in $TREES; do
  [ -d "${spec#*=}/vllm_oscar" ] || { echo "[ab_tune] ${spec#*=} has no vllm_oscar/ folder"; exit 2; }
done
for round in $(seq "$ROUNDS"); do
  for spec in $TREES; do
    name="${spec%%=*}"; tree="$(cd "${spec#*=}" && pwd)"
    for geometry in $GEOMETRIES; do
      (cd "$tree" && PYTHONPATH="$tree" python -m vllm_oscar.cli bench tune --block-size 64 --reps 10 \
         --geometry "$geometry" --contexts $CONTEXTS --batches $BATCHES \
         --json "$OUT/ab_${name}${round}_${geometry}.json" > "$OUT/ab_${name}${round}_${geometry}.log" 2>&1)
      echo "[ab_tune] $name round $round $geometry: rc=$? at ${SECONDS} s"
    done
  done
done
base="${TREES%%=*}"
for geometry in $GEOMETRIES; do
  args=()
  for spec in $TREES; do
    name="${spec%%=*}"
    args+=("$name=$(seq -s, -f "$OUT/ab_${name}%g_${geometry}.json" "$ROUNDS")")
  done
  python "$ROOT/bench/tune_ab.py" --base "$base" "${args[@]}"
done | tee "$OUT/ab_tables.txt"
