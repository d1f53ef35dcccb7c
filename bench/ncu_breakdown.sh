#!/usr/bin/env bash
# Nsight Compute "breakdown" metrics of the INT2 split decode kernel: which sub-unit of L2, L1 and the SM
# sets the headline throughputs (the section view's "L2 Cache Throughput" is the busiest lts__ sub-metric,
# which the details page does not name), plus pipe utilisation and L2 sector counts. One ncu pass per metric
# group, per case; CSV per case under $OUT, packed into $OUT/ncu_breakdown.tgz (the device tool returns
# only a few files per call). Clocks are left alone (--clock-control none). docs/decisions.md.
#
#     OUT=/tmp/b bash bench/ncu_breakdown.sh
#     CASES="qwen3-8b:131072:32:--tma-stages=3,--prefetch=0" OUT=/tmp/b bash bench/ncu_breakdown.sh
#
#     KERNEL=. CASES="qwen3-8b:131072:32:--sdpa" OUT=/tmp/b bash bench/ncu_breakdown.sh   # the cuDNN baseline
#
# CASES: geometry:context:batch[:extra profile_decode.py flags, comma-separated] (blocks of 64 always).
# KERNEL: the profiled kernels' name regex (default int2_split: int2_split_kernel and gluon_decode's
# int2_split_gluon_kernel, whichever the case runs; profile_decode.py --no-gluon keeps the former).
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:?set OUT to a folder for the results}"
CASES="${CASES:-qwen3-8b:131072:32 qwen3-8b:131072:32:--tma-stages=3,--prefetch=0 qwen3-8b:131072:32:--prefetch=0 smollm2-135m:32768:64}"
NCU="${NCU:-ncu}"
KERNEL="${KERNEL:-int2_split}"
BREAKDOWNS="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
BREAKDOWNS="$BREAKDOWNS,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed"
BREAKDOWNS="$BREAKDOWNS,breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
BREAKDOWNS="$BREAKDOWNS,breakdown:sm__throughput.avg.pct_of_peak_sustained_elapsed"
PIPES="sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active"
PIPES="$PIPES,smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_sectors_srcunit_tex_op_read.sum"
PIPES="$PIPES,lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,dram__bytes_read.sum"

for c in $CASES; do
  IFS=: read -r geometry context batch extra <<< "$c"
  flags=(--geometry "$geometry" --context "$context" --batch "$batch" --block-size 64 --calls 3)
  [ -n "${extra:-}" ] && IFS=, read -ra more <<< "${extra//=/ }" && flags+=(${more[@]})
  name="${geometry}_${context}_b${batch}${extra:+_$(echo -n "$extra" | tr -cs 'a-z0-9' '_')}"
  for group in breakdowns pipes; do
    metrics=$BREAKDOWNS; [ "$group" = pipes ] && metrics=$PIPES
    echo "[ncu_breakdown] $name $group at ${SECONDS} s"
    "$NCU" --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 \
      --metrics "$metrics" --csv python bench/profile_decode.py "${flags[@]}" > "$OUT/${name}_$group.csv" 2>&1 \
      || echo "[ncu_breakdown] $name $group: ncu failed (see the CSV)"
  done
done
(cd "$OUT" && tar czf ncu_breakdown.tgz ./*.csv && echo "[ncu_breakdown] done at ${SECONDS} s: $OUT/ncu_breakdown.tgz")
