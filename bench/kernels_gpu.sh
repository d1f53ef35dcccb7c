#!/usr/bin/env bash
# One GPU call that refreshes the kernel figures: the GPU correctness check, a tune of the default
# launch config against its closest neighbours (masked tiles, TMA tile loads), then the full
# decode table with the fastest config per geometry (docs/decisions.md). Run from the repository root on the GPU machine;
# everything lands under $OUT (each step's log is written as it runs, so a cut call keeps the head).
#
#     OUT=/tmp/k bash bench/kernels_gpu.sh            # ~5-6 min on the H200
#     STEPS="check write" OUT=/tmp/k bash bench/kernels_gpu.sh
#     BLOCK_SIZE=16 STEPS="tune table" OUT=/tmp/k bash bench/kernels_gpu.sh   # vLLM's blocks of 16 (default 64, OSCAR's on CUDA)
#     STEPS="check served" OUT=/tmp/k bash bench/kernels_gpu.sh                # served decode steps (check + time)
# CHECKS: the checks of the check step (default without `write`, whose real-size variants take ~6 min: add it when
# the write's INT2 math changes).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:?set OUT to a folder for the results}"
STEPS="${STEPS:-check tune table}"
CHECKS="${CHECKS:-decode int8 graph rotate_write}"
GEOMETRIES="qwen3-8b smollm2-135m"
BLOCK_SIZE="${BLOCK_SIZE:-64}"

step() {  # name, command...: run, log to $OUT/<name>.log, report the exit code, go on either way
  local name=$1; shift
  echo "[kernels_gpu] $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  echo "[kernels_gpu] $name: rc $? at ${SECONDS} s"
}

for s in $STEPS; do
  case $s in
    check) step check python bench/check_kernels_gpu.py --only $CHECKS --quick --json "$OUT/check.json" ;;
    served) step served python bench/served_graph.py --calls 20 --json "$OUT/served.json" ;;
    write) step write python -m vllm_oscar.cli bench decode --geometry $GEOMETRIES --contexts 4096 --batches 8 \
             --write-tokens 8 32 256 4096 --write-refit 8/2 --write-clip bisect top --write-rotation ieee tf32x3 \
             --write-unroll 1 0 --reps 10 --json "$OUT/write.json" ;;
    tune) step tune python -m vllm_oscar.cli bench tune --geometry $GEOMETRIES --contexts 4096 32768 131072 \
            --batches 1 8 32 64 --block-t 64 --num-warps 1 --num-stages 1 --unpack 1 --full-tiles auto 0 \
            --tma-stages 0 3 --block-size "$BLOCK_SIZE" --reps 10 --json "$OUT/tune.json" ;;
    table) step table python -m vllm_oscar.cli bench decode --geometry $GEOMETRIES --config-from "$OUT/tune.json" \
             --contexts 4096 16384 32768 65536 131072 --batches 1 8 32 64 --write-tokens 32 4096 --write-refit 8/2 \
             --block-size "$BLOCK_SIZE" --reps 10 --json "$OUT/decode.json" --png "$OUT/decode.png" ;;
    *) echo "[kernels_gpu] unknown step $s (check, write, tune, table, served)"; exit 2 ;;
  esac
done
grep -h "FAIL\|ALL OK" "$OUT/check.log" 2>/dev/null | tail -3
# The device tool returns only a few files per call: pack the logs and JSON into one.
(cd "$OUT" && tar czf kernels_gpu.tgz ./*.log ./*.json 2>/dev/null && echo "[kernels_gpu] packed $OUT/kernels_gpu.tgz")
