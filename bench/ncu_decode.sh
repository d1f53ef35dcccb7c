#!/usr/bin/env bash
# Nsight Compute profile of the INT2 split decode kernel (and the merge) for a few cases: where the
# issue slots go (warp stall reasons), occupancy, memory throughput, and per-SASS-line samples.
# Needs ncu (the device's Firecracker machines have it; clocks are left alone: --clock-control none).
# Outputs under $OUT: <case>.ncu-rep, <case>_details.txt (sections), <case>_raw.csv (all metrics),
# <case>_sass.csv (source page: SASS with per-line stall samples, where this ncu prints it; summarised by
# bench/ncu_sass_summary.py), packed
# into $OUT/ncu_text.tgz at the end (the device tool returns only a few files per call); the
# .ncu-rep reports stay beside it only with KEEP_REP=1.
#
#     OUT=/tmp/ncu bash bench/ncu_decode.sh                       # the default cases
#     CASES="qwen3-8b:32768:32" OUT=/tmp/ncu bash bench/ncu_decode.sh
#     CASES="qwen3-8b:32768:32" EXTRA="--full-tiles 0" TAG=masked OUT=/tmp/ncu bash bench/ncu_decode.sh
#     CACHE=none TAG=warm OUT=/tmp/ncu bash bench/ncu_decode.sh   # caches kept between kernels, as in a replay
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:?set OUT to a folder for the results}"
CASES="${CASES:-qwen3-8b:32768:32 qwen3-8b:32768:1 smollm2-135m:32768:32}"
EXTRA="${EXTRA:-}"   # extra profile_decode.py flags, e.g. "--int8-keys 0"
NCU="${NCU:-ncu}"
CACHE="${CACHE:-all}"   # ncu --cache-control: all flushes every cache before each profiled kernel, none keeps them

for c in $CASES; do
  IFS=: read -r geometry context batch <<< "$c"
  name="${geometry}_${context}_b${batch}${TAG:+_$TAG}"
  echo "[ncu_decode] $name ($EXTRA) at ${SECONDS} s"
  "$NCU" --clock-control none --cache-control "$CACHE" --kernel-name regex:'int2_split|merge_kernel' --launch-skip 2 --launch-count 2 \
    --set full --import-source no -f -o "$OUT/$name" \
    python bench/profile_decode.py --geometry "$geometry" --context "$context" --batch "$batch" --calls 2 $EXTRA \
    > "$OUT/${name}_run.log" 2>&1 || { echo "[ncu_decode] $name: ncu failed"; tail -5 "$OUT/${name}_run.log"; continue; }
  "$NCU" -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
  "$NCU" -i "$OUT/$name.ncu-rep" --page raw --csv > "$OUT/${name}_raw.csv" 2>&1
  "$NCU" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass --kernel-name regex:int2_split \
    > "$OUT/${name}_sass.csv" 2>&1 || echo "[ncu_decode] $name: no source page from this ncu"
done
(cd "$OUT" && tar czf ncu_text.tgz ./*_details.txt ./*_raw.csv ./*_sass.csv ./*_run.log 2>/dev/null \
  && rm -f ./*_details.txt ./*_raw.csv ./*_sass.csv ./*_run.log)
[ "${KEEP_REP:-0}" = 1 ] || rm -f "$OUT"/*.ncu-rep
echo "[ncu_decode] done at ${SECONDS} s: $OUT/ncu_text.tgz"
