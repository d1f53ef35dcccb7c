"""`vllm-oscar bench decode|tune|prefill|plans`: the OSCAR kernel benchmarks on a CUDA GPU.

decode: OSCAR decode vs BF16 SDPA (cuDNN/flash/efficient, enable_gqa) and a paged BF16
Triton decode, over geometries x contexts x batches; prints a table, writes JSON (and a
PNG plot with --png). tune: OSCAR decode only, over launch-config variants. prefill: OSCAR's
chunked prefill over a cached INT2 prefix vs BF16 SDPA (bottom-right causal) over geometries x
prefixes x chunks x batches. plans: the device's table of measured decode plans (kernels.plan_tuning).
Logic: vllm_oscar.kernels.benchmark, .prefill_benchmark and .plan_tuning.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import torch

from vllm_oscar.provenance import source_digest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE, SERVED_REFIT_ITERATIONS
    from vllm_oscar.kernels.benchmark import ALLOCATOR_ENV, ALLOCATOR_SETTINGS, BATCHES, CONTEXTS, GEOMETRIES
    from vllm_oscar.kernels.plan_tuning import DEFAULT_MARGIN, DEFAULT_ROUNDS
    from vllm_oscar.kernels.prefill_benchmark import PREFILL_BATCHES, PREFILL_CHUNKS, PREFILL_PREFIXES
    from vllm_oscar.kernels.triton_ops import (
        CLIP_SEARCHES,
        DEFAULT_WRITE,
        MIN_TILES_PER_SPLIT,
        PREFILL_ROWS,
        ROTATION_PRECISIONS,
    )

    parser.add_argument("mode", choices=("decode", "tune", "prefill", "plans"),
                        help="decode: full comparison; tune: config sweep; prefill: chunked prefill comparison; "
                             "plans: measure split counts around the rules' and write this GPU's table of measured "
                             "decode plans (--out)")
    parser.add_argument("--out", metavar="TABLE",
                        help="plans: the table file to write; an existing one for this GPU is extended (cells tuned "
                             "now replace their old plans). Serve with VLLM_OSCAR_DECODE_PLANS=TABLE, or ship it "
                             "as vllm_oscar/kernels/plans/<GPU name>.json")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="plans: interleaved timing rounds per cell")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help="plans: the median gain over the rules a measured plan must show (a fraction), besides "
                             "being faster in every round")
    parser.add_argument("--json", metavar="OUT", help="write all results to this JSON file")
    parser.add_argument("--png", metavar="OUT", help="write the time-vs-context plot here (decode)")
    parser.add_argument("--geometry", nargs="+", type=geometry_name, default=sorted(GEOMETRIES), metavar="GEOMETRY",
                        help=f"{', '.join(sorted(GEOMETRIES))}, or query heads x KV heads x head_dim, e.g. 32x8x128")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--prefixes", type=int, nargs="+", default=list(PREFILL_PREFIXES),
                        help="prefill: cached prefix lengths")
    parser.add_argument("--chunks", type=int, nargs="+", default=list(PREFILL_CHUNKS),
                        help="prefill: new tokens per request")
    parser.add_argument("--prefill-batches", type=int, nargs="+", default=list(PREFILL_BATCHES),
                        help="prefill: requests per step")
    parser.add_argument("--prefill-tune", action="store_true",
                        help="prefill: time OSCAR only, over --block-t x --num-warps x --num-stages x --prefill-rows "
                             "x --prefill-splits (default: the default prefill config against BF16 SDPA)")
    parser.add_argument("--prefill-rows", type=int, nargs="+", default=[PREFILL_ROWS],
                        help="prefill tune: MMA rows per prefill program (query tokens x padded GQA group)")
    parser.add_argument("--prefill-splits", nargs="+", default=["auto"],
                        help="prefill tune: programs per query tile sharing the INT2 prefix (split-K; auto = "
                             "the product's rule)")
    parser.add_argument("--prefill-int2-apart", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="prefill tune: the pure INT2 prefix in its own launch "
                             "(AttentionConfig.prefill_int2_apart)")
    parser.add_argument("--prefill-flash", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="prefill: the served read by FlashAttention over gathered rows (1), by the Triton "
                             "prefill kernel (0), or by the product's rule (auto: FlashAttention from "
                             "FLASH_PREFILL_MIN_WORK on); several values time each in turn per case "
                             "(AttentionConfig.prefill_flash)")
    parser.add_argument("--prefill-flash-split", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="prefill: FlashAttention prefill's far positions in key segments for more programs "
                             "(1), never (0), or by the product's rule (auto: flash_plan.CallSize.split_pays); "
                             "several values time each in turn per case (AttentionConfig.prefill_flash_split)")
    parser.add_argument("--prefill-flash-plan", nargs="+", default=["step"], choices=("step", "call"),
                        help="prefill: FlashAttention prefill's ranges planned once per step on the host, as the "
                             "served backend does (step; no synchronisation per call), or read by each call (call: "
                             "one synchronisation per layer)")
    parser.add_argument("--prefill-layers", type=int, default=1,
                        help="prefill: calls per timed rep, back to back as the layers of one step (the time is per "
                             "call; eagerly the host launches one while the GPU runs the one before)")
    parser.add_argument("--prefill-timing", choices=("eager", "graph"), default="eager",
                        help="prefill: time OSCAR and BF16 SDPA as eager launches (host work included, as vLLM runs "
                             "prefill steps; default) or as CUDA-graph replays (the GPU time alone; FlashAttention "
                             "prefill reads the lengths on the host and cannot be captured: its rows report an error)")
    parser.add_argument("--prefill-new-rows", action="store_true",
                        help="prefill: read the chunk from its new BF16 rows, not back from the caches (the "
                             "served path reads the caches)")
    parser.add_argument("--block-size", type=int, default=GPU_DECODE_BLOCK_SIZE,
                        help=f"KV block size in tokens (default {GPU_DECODE_BLOCK_SIZE}, what OSCAR asks vLLM for "
                             f"on CUDA; vLLM's own default is 16)")
    parser.add_argument("--reps", type=int, default=20, help="timed graph replays per measurement (median)")
    parser.add_argument("--write-tokens", type=int, nargs="*", default=[64, 8192],
                        help="decode: also time oscar_write on this many new tokens per layer")
    parser.add_argument("--write-warps", type=int, nargs="+", default=[0],
                        help="decode: warps per write program to time (0 = the default)")
    parser.add_argument("--write-clip", nargs="+", default=[DEFAULT_WRITE.clip_search], choices=CLIP_SEARCHES,
                        help="decode: clip threshold searches of the write to time (WriteConfig.clip_search)")
    parser.add_argument("--write-rotation", nargs="+", default=[DEFAULT_WRITE.rotation_precision],
                        choices=ROTATION_PRECISIONS,
                        help="decode: rotation dot precisions of the write to time (WriteConfig.rotation_precision)")
    parser.add_argument("--write-unroll", type=int, nargs="+", default=[int(DEFAULT_WRITE.unroll_refit)],
                        choices=(0, 1),
                        help="decode: 1 = refit rounds unrolled, 0 = a loop (WriteConfig.unroll_refit)")
    parser.add_argument("--write-refit", type=refit_rounds, nargs="+",
                        default=[0, "/".join(map(str, SERVED_REFIT_ITERATIONS))], metavar="N|K/V",
                        help="decode: grid refit rounds of the timed writes, one number for both sides or "
                             f"K/V (served: {SERVED_REFIT_ITERATIONS[0]}/{SERVED_REFIT_ITERATIONS[1]})")
    parser.add_argument("--autotune", action="store_true",
                        help="decode: per geometry, pick the fastest launch config at 32K / B=8 first")
    parser.add_argument("--breakdown", action="store_true",
                        help="decode: also profile OSCAR's kernels (per-kernel ms, idle time between them)")
    parser.add_argument("--config-from", metavar="TUNE_JSON",
                        help="decode: per geometry, use the fastest launch config of this `bench tune --json` file")
    # The four launch knobs below default to the shipped config (DEFAULT_DECODE for `tune`,
    # DEFAULT_PREFILL for `prefill --prefill-tune`): each value given adds a variant around it.
    parser.add_argument("--block-t", type=int, nargs="+", help="tune: tile sizes (default: the shipped one)")
    parser.add_argument("--num-warps", type=int, nargs="+",
                        help="tune: warps per INT2 split program (per general-kernel program with --rows-on-m; "
                             "per program with --prefill-tune); default: the shipped count")
    parser.add_argument("--num-stages", type=int, nargs="+", help="tune: pipeline stages (default: the shipped count)")
    parser.add_argument("--unpack", type=int, nargs="+", help="tune: 0 portable, 1 PTX (default: the shipped mode)")
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[0],
                        help="tune: split-K sizing, split programs per SM (0 = as many as one SM holds at once, "
                             "the default)")
    parser.add_argument("--num-splits", type=int, nargs="+", default=[0],
                        help="tune: a fixed split-K count per (request, KV head) (AttentionConfig.num_splits; 0 = "
                             "sized by --programs-per-sm and --min-tiles, the default); each row reports the splits "
                             "a fixed count leaves without tiles at its context (empty_splits)")
    parser.add_argument("--min-tiles", type=int, nargs="+", default=[MIN_TILES_PER_SPLIT],
                        help="tune: the fewest tiles per decode split (short contexts / batch 1)")
    parser.add_argument("--int8-keys", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="tune: 1 = the int8-MMA key path of the INT2 splits (head_dim >= 64); auto = "
                             "the default (on where it applies)")
    parser.add_argument("--max-registers", type=int, nargs="+", default=[0],
                        help="tune: maxnreg of the INT2 split programs (0 = the default: the compiler's choice, "
                             "triton_ops.GLUON_MAX_REGISTERS for the Gluon kernel)")
    parser.add_argument("--prefetch", nargs="+", default=["auto"],
                        help="tune: L2 prefetch distance of the INT2 split programs in tiles "
                             "(0 = off; auto = the default)")
    parser.add_argument("--window-block-t", nargs="+", default=["auto"],
                        help="tune: positions per window program of the INT2 split launch (auto = the default)")
    parser.add_argument("--merge-block-d", nargs="+", default=["auto"],
                        help="tune: channels per merge program (auto = the default, MERGE_BLOCK_D)")
    parser.add_argument("--windows-first", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="tune: 1 = dispatch the window-tile programs before the INT2 splits, 0 = after "
                             "(auto = the default: first when they number at most one per SM)")
    parser.add_argument("--full-tiles", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="tune: 1 = the INT2 splits walk whole tiles, unmasked, 0 = masked tiles "
                             "(AttentionConfig.full_tiles; auto = the default: on wherever the split kernel runs)")
    parser.add_argument("--merge-pdl", nargs="+", default=["auto"], choices=("auto", "0", "1"),
                        help="tune: launch the merge with programmatic dependent launch (AttentionConfig.merge_pdl; "
                             "auto = the default: on for compute capability >= 9.0)")
    parser.add_argument("--tma-stages", nargs="+", default=["auto"],
                        help="tune: > 0 = the INT2 splits load whole tiles by TMA, pipelined this deep; 0 = plain "
                             "loads; auto = the default: 3 stages where they apply and pay (triton_ops.tma_pays: "
                             "few (request, KV head) pairs per SM), since the "
                             "benchmark times CUDA-graph replays (AttentionConfig.tma_stages and cuda_graph; > 0 "
                             "needs --block-size a multiple of the tile)")
    parser.add_argument("--long-splits", nargs="+", default=["0"], choices=("0", "1"),
                        help="tune: 1 = size the grid for more split programs, used by (request, KV head) pairs whose "
                             "splits would be long (AttentionConfig.long_splits, opt-in)")
    parser.add_argument("--gluon-copy-stages", nargs="+", default=["auto"],
                        help="tune: gluon_decode's split programs stage tiles in shared memory by cp.async, this many "
                             "(AttentionConfig.gluon_copy_stages: 0 = off, 2 or 3; auto = the default: 2 where "
                             "triton_ops.staging_pays)")
    parser.add_argument("--fold-tiles", nargs="+", default=["auto"],
                        help="tune: tiles between folds of the BIAS sums out of the split programs' V accumulators "
                             "(AttentionConfig.fold_tiles, a power of two; auto = the default: 8, or 2 with "
                             "--gluon-f16-values 1)")
    parser.add_argument("--gluon-f16-values", nargs="+", default=["auto"], choices=("0", "1", "auto"),
                        help="tune: 1 = gluon_decode's split programs build the V operand and the weights in fp16 "
                             "(AttentionConfig.gluon_f16_values; auto = the default)")
    parser.add_argument("--gluon-window-prefetch", nargs="+", default=["auto"], choices=("0", "1", "auto"),
                        help="tune: 1 = gluon_decode's window programs ask L2 for their V rows up front "
                             "(AttentionConfig.gluon_window_prefetch; auto = the default: batch 1)")
    parser.add_argument("--gluon-copy-tma", nargs="+", default=["auto"], choices=("0", "1", "auto"),
                        help="tune: 1 = gluon_decode's staged split programs copy tiles by TMA instead of cp.async "
                             "(AttentionConfig.gluon_copy_tma; needs staged tiles; auto = the default: staged tiles "
                             "at head_dim >= 128)")
    parser.add_argument("--allocator", choices=sorted(ALLOCATOR_SETTINGS), default="expandable",
                        help="PyTorch's CUDA allocator for every buffer of the run, OSCAR and baselines alike: "
                             "expandable segments (the default; the same case reads within 1%% wherever it sits in "
                             "a long run) or PyTorch's default segments (later cases read 3-7%% slower); a "
                             f"{ALLOCATOR_ENV} set in the environment wins")
    parser.add_argument("--rows-on-m", action="store_true", help="tune: the general kernel for the INT2 splits")
    parser.add_argument("--no-gluon", action="store_true",
                        help="decode: time AttentionConfig(gluon_splits=False), int2_split_kernel where the default "
                             "would run gluon_decode's kernel (for comparisons)")


def geometry_name(text: str) -> str:
    """--geometry value: a known geometry's name or HQxHKVxD (benchmark.geometry_heads checks it)."""
    from vllm_oscar.kernels.benchmark import geometry_heads

    try:
        geometry_heads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def refit_rounds(text: str) -> int | tuple[int, int]:
    """--write-refit value: "N" (both sides) or "K/V"."""
    try:
        parts = [int(part) for part in str(text).split("/")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts, default=-1) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give refit rounds as N or K/V with integers >= 0, e.g. 8/2.")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _auto(text: str, kind):
    """A tune value: "auto" -> None (AttentionConfig's default), else kind(int(text))."""
    return None if text == "auto" else kind(int(text))


def tune_configs(args: argparse.Namespace) -> list:
    """`bench tune`: the AttentionConfig variants, the product of every tune flag's values; a flag
    left out keeps the shipped default (DEFAULT_DECODE, as a graph-captured launch: the tune times CUDA-graph
    replays), so `--merge-pdl 0 1` alone gives exactly the default config and the default with merge_pdl on."""
    from vllm_oscar.kernels.triton_ops import DEFAULT_DECODE, AttentionConfig

    warps_default = DEFAULT_DECODE.num_warps if args.rows_on_m else DEFAULT_DECODE.split_warps
    warps_field = "num_warps" if args.rows_on_m else "split_warps"
    return [AttentionConfig(block_t=bt, num_stages=stages, **{warps_field: nw}, unpack=up,
                            tokens_on_m=not args.rows_on_m, programs_per_sm=pps or None, num_splits=ns or None,
                            min_tiles_per_split=tiles, int8_keys=_auto(int8, bool), max_registers=reg or None,
                            prefetch=_auto(pf, int), window_block_t=_auto(wbt, int), merge_block_d=_auto(mbd, int),
                            windows_first=_auto(wf, bool), full_tiles=_auto(ft, bool), merge_pdl=_auto(pdl, bool),
                            tma_stages=_auto(tma, int), long_splits=ls == "1", gluon_copy_stages=_auto(copy, int),
                            fold_tiles=_auto(fold, int), gluon_f16_values=_auto(f16, bool),
                            gluon_window_prefetch=_auto(wpf, bool), gluon_copy_tma=_auto(ctma, bool), cuda_graph=True)
            for bt, nw, stages, up, pps, ns, tiles, int8, reg, pf, wbt, mbd, wf, ft, pdl, tma, ls, copy, fold, f16,
            wpf, ctma in itertools.product(
                args.block_t or [DEFAULT_DECODE.block_t], args.num_warps or [warps_default],
                args.num_stages or [DEFAULT_DECODE.num_stages], args.unpack or [DEFAULT_DECODE.unpack],
                args.programs_per_sm, args.num_splits, args.min_tiles, args.int8_keys, args.max_registers,
                args.prefetch, args.window_block_t, args.merge_block_d, args.windows_first, args.full_tiles,
                args.merge_pdl, args.tma_stages, args.long_splits, args.gluon_copy_stages,
                args.fold_tiles, args.gluon_f16_values, args.gluon_window_prefetch, args.gluon_copy_tma)]


def prefill_tune_configs(args: argparse.Namespace) -> list:
    """`bench prefill --prefill-tune`: the prefill AttentionConfig variants; a flag left out keeps
    DEFAULT_PREFILL's value."""
    from vllm_oscar.kernels.triton_ops import DEFAULT_PREFILL, AttentionConfig

    return [AttentionConfig(block_t=bt, num_warps=nw, num_stages=ns, prefill_rows=rows,
                            prefill_splits=_auto(splits, int), prefill_int2_apart=_auto(apart, bool),
                            prefill_flash=_auto(flash, bool))
            for bt, nw, ns, rows, splits, apart, flash in itertools.product(
                args.block_t or [DEFAULT_PREFILL.block_t], args.num_warps or [DEFAULT_PREFILL.num_warps],
                args.num_stages or [DEFAULT_PREFILL.num_stages], args.prefill_rows, args.prefill_splits,
                args.prefill_int2_apart, args.prefill_flash)]


def prefill_configs(args: argparse.Namespace) -> list:
    """`bench prefill`'s configs: prefill_tune_configs with --prefill-tune, else DEFAULT_PREFILL once per
    --prefill-flash value."""
    from vllm_oscar.kernels.triton_ops import DEFAULT_PREFILL

    if args.prefill_tune:
        return prefill_tune_configs(args)
    return [dataclasses.replace(DEFAULT_PREFILL, prefill_flash=_auto(flash, bool),
                                prefill_flash_split=_auto(split, bool))
            for flash, split in itertools.product(args.prefill_flash, args.prefill_flash_split)]


def fastest_configs(tune_json: str, geometries: list[str]) -> dict:
    """geometry -> the AttentionConfig of a `bench tune --json` report with the least total time
    over that geometry's cases (configs that failed on any case are left out)."""
    from vllm_oscar.kernels.triton_ops import AttentionConfig

    with open(tune_json) as handle:
        rows = [r for r in json.load(handle).get("tune", []) if "oscar" in r]
    chosen = {}
    for geometry in geometries:
        timed = [r for r in rows if r["geometry"] == geometry]
        if not timed:
            raise SystemExit(f"{tune_json} has no timed tune rows for geometry {geometry!r}; "
                             f"run `vllm-oscar bench tune --geometry {geometry} --json {tune_json}` first.")
        cases = {(r["context"], r["batch"]) for r in timed}
        totals: dict = {}
        for r in timed:
            key = json.dumps(r["config"], sort_keys=True)
            count, total = totals.get(key, (0, 0.0))
            totals[key] = (count + 1, total + r["oscar"]["ms"])
        best = min((total, key) for key, (count, total) in totals.items() if count == len(cases))[1]
        chosen[geometry] = AttentionConfig(**json.loads(best))
        print(f"{geometry}: launch config from {tune_json}: {chosen[geometry]}", flush=True)
    return chosen


def run_prefill(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """`bench prefill`: every geometry x prefix x chunk x batch (x launch config with --prefill-tune),
    printed as it goes, then the table."""
    from vllm_oscar.kernels.prefill_benchmark import format_prefill_table, run_prefill_case

    configs = prefill_configs(args)
    rows = []
    for geometry, prefix, chunk, batch, config, plan in itertools.product(
            args.geometry, args.prefixes, args.chunks, args.prefill_batches, configs, args.prefill_flash_plan):
        rows.append(run_prefill_case(geometry, prefix, chunk, batch, args.block_size, args.reps, device, config,
                                     with_baseline=not args.prefill_tune, chunk_from_cache=not args.prefill_new_rows,
                                     eager=args.prefill_timing == "eager", flash_plan=plan == "step",
                                     layers=args.prefill_layers))
        c = rows[-1]["config"]
        print(f"{format_prefill_table(rows[-1:]).splitlines()[-1]}  bt={c['block_t']} w={c['num_warps']} "
              f"s={c['num_stages']} rows={c['prefill_rows']} splits={c['prefill_splits']} "
              f"apart={c['prefill_int2_apart']} flash={c['prefill_flash']} split={c['prefill_flash_split']} "
              f"plan={plan} path={rows[-1]['path']}",
              flush=True)
    print(format_prefill_table(rows))
    return rows


def run_plans(args: argparse.Namespace, device: torch.device, cases: list[tuple[str, int, int]],
              report: dict) -> list[dict]:
    """`bench plans`: tune every case (plan_tuning.tune_cell) with a progress bar, print a line per case, and write
    the merged table to --out and the report (its "plans": the tuned rows) to --json after each case."""
    from pathlib import Path

    from tqdm import tqdm

    from vllm_oscar.kernels import measured_plans, plan_tuning

    if not args.out:
        raise SystemExit("bench plans writes a table of measured decode plans: give its file with --out TABLE.")
    if args.rounds < 1 or not 0.0 <= args.margin < 1.0:
        raise SystemExit(f"--rounds {args.rounds} / --margin {args.margin}: give >= 1 round and a margin in [0, 1).")
    old = measured_plans.load_table(args.out) if Path(args.out).exists() else None
    name = torch.cuda.get_device_name(device)
    if old is not None and old.device != name:
        raise SystemExit(f"{args.out} holds plans measured on {old.device}, this GPU is {name}: write this GPU's "
                         f"table to another file.")
    rows = []
    total = sum(plan_tuning.tuning_graphs(g, c, b, args.block_size, args.rounds) for g, c, b in cases)
    with tqdm(total=total, desc="decode plans", unit="graph") as bar:
        for geometry, context, batch in cases:
            rows.append(plan_tuning.tune_cell(geometry, context, batch, args.block_size, args.reps, args.rounds,
                                              args.margin, device, bar.update))
            bar.write(plan_tuning.format_row(rows[-1]))
            table = plan_tuning.merged_table(old, rows, device, args.out)  # written as it grows: nothing lost
            Path(args.out).write_text(json.dumps(measured_plans.table_json(table), indent=1) + "\n",
                                      encoding="utf-8")
            if args.json:
                Path(args.json).write_text(json.dumps({**report, "plans": rows}, indent=1), encoding="utf-8")
    kept = sum(r["plan"] is not None for r in rows)
    print(f"{args.out}: {len(table.plans)} measured plans ({kept} of {len(rows)} cells tuned now beat the rules by "
          f">= {100 * args.margin:.1f}%).")
    return rows


def run(args: argparse.Namespace) -> int:
    from vllm_oscar.kernels import benchmark

    allocator = benchmark.configure_allocator(args.allocator)  # before anything initialises CUDA
    if not torch.cuda.is_available():
        print("vllm-oscar bench needs a CUDA GPU (the Triton kernels); none is visible.", file=sys.stderr)
        return 2
    from vllm_oscar.kernels.triton_ops import WriteConfig

    device = torch.device("cuda")
    info = benchmark.device_info(device)
    bandwidth = benchmark.measure_bandwidth(device)
    source = source_digest()
    print(f"device: {info['name']} ({info['sms']} SMs), torch {info['torch']}, triton {info['triton']}; "
          f"read {bandwidth['read_GBps']:.0f} GB/s, copy {bandwidth['copy_GBps']:.0f} GB/s; "
          f"{benchmark.ALLOCATOR_ENV}={allocator!r}; vllm_oscar source {source}", flush=True)
    report: dict = {"device": info, "bandwidth": bandwidth, "argv": sys.argv, "allocator": allocator,
                    "source_digest": source}
    cases = list(itertools.product(args.geometry, args.contexts, args.batches))
    if args.mode == "plans":
        report["plans"] = run_plans(args, device, cases, report)
    elif args.mode == "prefill":
        report["prefill"] = run_prefill(args, device)
    elif args.mode == "tune":
        rows = []
        configs = tune_configs(args)
        for geometry, context, batch in cases:
            for r in benchmark.tune_case(geometry, context, batch, args.block_size, args.reps, device, bandwidth,
                                         configs):
                c = r["config"]
                line = r.get("error") or (f"{r['oscar']['ms']:.4f} ms {r['oscar']['pct_read_bw']:.0f}% "
                                          f"splits={r['oscar']['splits']}")
                if r.get("oscar", {}).get("empty_splits"):
                    line += f" ({r['oscar']['empty_splits']} of them without tiles at this context)"
                print(f"{geometry} ctx={context} B={batch} bs={args.block_size} bt={c['block_t']} "
                      f"w={c['num_warps']}/{c['split_warps']} "
                      f"s={c['num_stages']} unpack={c['unpack']} pps={c['programs_per_sm']} "
                      f"tiles>={c['min_tiles_per_split']} int8k={c['int8_keys']} "
                      f"reg={c['max_registers']} pf={c['prefetch']} wbt={c['window_block_t']} "
                      f"mbd={c['merge_block_d']} wf={c['windows_first']} ft={c['full_tiles']} pdl={c['merge_pdl']} "
                      f"tma={c['tma_stages']} ls={c['long_splits']} "
                      f"copy={c['gluon_copy_stages']} fold={c['fold_tiles']} f16={c['gluon_f16_values']} "
                      f"wpf={c['gluon_window_prefetch']} ctma={c['gluon_copy_tma']}: {line}",
                      flush=True)
                rows.append(r)
        report["tune"] = rows
    else:
        rows = []
        chosen: dict = fastest_configs(args.config_from, args.geometry) if args.config_from else {}
        if args.no_gluon:
            from vllm_oscar.kernels.triton_ops import AttentionConfig

            chosen = {g: dataclasses.replace(chosen.get(g, AttentionConfig()), gluon_splits=False)
                      for g in args.geometry}
        if args.autotune:
            report["autotune"] = {}
            for geometry in args.geometry:
                chosen[geometry], trials = benchmark.autotune(geometry, args.block_size, device, bandwidth, args.reps)
                report["autotune"][geometry] = trials
                for t in trials:
                    print(f"autotune {geometry}: {t}", flush=True)
                print(f"autotune {geometry}: chose {chosen[geometry]}", flush=True)
        for geometry, context, batch in cases:
            rows.append(benchmark.run_case(geometry, context, batch, args.block_size, args.reps, device, bandwidth,
                                           oscar_config=chosen.get(geometry), breakdown=args.breakdown))
            rows[-1]["oscar_config"] = str(chosen.get(geometry, "default"))
            print(benchmark.format_table(rows[-1:]).splitlines()[-1], flush=True)
            if "breakdown" in rows[-1].get("oscar", {}):
                print(f"  kernels: {benchmark.format_breakdown(rows[-1]['oscar']['breakdown'])}", flush=True)
        report["decode"] = rows
        report["write"] = [benchmark.write_throughput(g, n, args.block_size, device, args.reps, rounds,
                                                      WriteConfig(warps or None, clip, rotation, bool(unroll)))
                           for g in args.geometry for n in args.write_tokens for rounds in args.write_refit
                           for warps in args.write_warps for clip in args.write_clip for rotation in args.write_rotation
                           for unroll in args.write_unroll]
        print(benchmark.format_table(rows))
        for w in report["write"]:
            print(f"write {w['geometry']} {w['tokens']} tokens, refit {w['refit_iterations']}, {w['num_warps']} warps, "
                  f"clip {w['clip_search']}, rotation {w['rotation_precision']}, unrolled {w['unroll_refit']}: "
                  f"{w['ms']:.4f} ms, "
                  f"{w['tokens_per_s'] / 1e6:.2f} M tokens/s/layer, {w['GBps']:.0f} GB/s")
        if args.png:
            benchmark.plot(rows, args.png)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0
