#!/usr/bin/env bash
# Time the decode of two trees side by side in one GPU call (ratios, not runs on different days):
# the working tree, an older tree, the working tree again (the repeat shows the run-to-run noise).
#
#     git archive <rev> vllm_oscar | (mkdir -p ab_old && tar -x -C ab_old)   # here; ab_old/ is git-ignored
#     OLD=ab_old OUT=$OUT bash bench/ab_decode.sh                            # on the GPU (carry ab_old)
#     CASES="qwen3-8b:4096,32768:1,8" OLD=ab_old OUT=$OUT bash bench/ab_decode.sh
#
# CASES: geometry:contexts:batches (comma lists), space-separated. Each run writes
# $OUT/ab_<new1|old|new2>_<geometry>.json (the `bench decode` report, baselines included) and the
# printed rows; everything is packed into $OUT/ab.tgz.
set -uo pipefail
OUT="${OUT:?set OUT to a folder for the results}"
OLD="$(cd "${OLD:?set OLD to a folder holding the older vllm_oscar package}" && pwd)"
CASES="${CASES:-qwen3-8b:4096,32768:1,8 smollm2-135m:4096,16384:8,32}"
REPS="${REPS:-20}"
[ -d "$OLD/vllm_oscar" ] || { echo "[ab_decode] $OLD has no vllm_oscar/ folder"; exit 2; }

run() {  # tag, tree: `python -m` from the tree's root, so that its package is the one imported
  local tag=$1 tree=$2
  echo "[ab_decode] $tag: $tree"
  for c in $CASES; do
    IFS=: read -r geometry contexts batches <<< "$c"
    (cd "$tree" && PYTHONPATH="$tree" python -m vllm_oscar.cli bench decode --geometry "$geometry" \
       --contexts ${contexts//,/ } --batches ${batches//,/ } --write-tokens --reps "$REPS" \
       --json "$OUT/ab_${tag}_${geometry}.json" 2>/dev/null | grep -E "^$geometry " | sort -u)
  done
}
run new1 "$PWD"
run old "$OLD"
run new2 "$PWD"
(cd "$OUT" && tar czf ab.tgz ab_*.json && echo "[ab_decode] packed $OUT/ab.tgz")
