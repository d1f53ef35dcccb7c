#!/usr/bin/env python3
"""Check and time the Gluon split programs (vllm_oscar/kernels/gluon_decode.py, docs/decisions.md G2) against
int2_split_kernel's split programs on the same caches, in one run (GPU only).

For each case both kernels run the split programs only (grid (B, Hkv, NSPLIT) with the served plan's NSPLIT, so the
window programs are left out of both) and write the same partials: the check compares their log-sum-exps and
normalised outputs split by split; the timing replays one CUDA graph per kernel over enough cache copies to miss
L2 (as `bench decode` does), Triton / Gluon / Triton, and reports the full served decode beside them.

    python bench/gluon_probe.py --geometry qwen3-8b smollm2-135m --contexts 4096 32768 131072 --batches 1 8 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS  # noqa: E402
from vllm_oscar.kernels import triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import (GEOMETRIES, layers_for, make_oscar_case, oscar_bytes,  # noqa: E402
                                          time_graph)
from vllm_oscar.kernels.gluon_decode import int2_split_gluon_kernel  # noqa: E402
from vllm_oscar.kernels.triton_decode_int2 import int2_split_kernel  # noqa: E402

BLOCK_SIZE = 64


def launchers(case, layer: int, length: int, part_t, lse_t, part_g, lse_g, maxnreg: int | None):
    """(triton split programs, gluon split programs, served decode) closures for one cache copy."""
    scale = 1.0 / math.sqrt(case.query.shape[-1])
    config = triton_ops.DEFAULT_DECODE
    cache = case.caches[layer]
    plan_args = (case.query, cache, case.window_k[layer], case.window_v[layer], case.layout, case.block_table,
                 case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale,
                 length, config)
    plan = triton_ops._cached_plan(*plan_args)
    nsplit = plan.num_splits
    batch, hkv = case.block_table.shape[0], cache.shape[1]
    args = triton_ops._split_args(case.query, cache, case.window_k[layer], case.window_v[layer], case.block_table,
                                  case.window_block_table, case.seq_lens, part_t, lse_t, DEFAULT_SINK_TOKENS,
                                  DEFAULT_RECENT_TOKENS, scale,
                                  triton_ops._cached_descriptors(cache, case.layout, plan.tma_block_t))
    consts = plan.split_consts
    offsets = triton_ops._plane_offsets(case.layout)
    out = torch.empty_like(case.query)
    extra = {"maxnreg": maxnreg or triton_ops.GLUON_MAX_REGISTERS}

    def triton_fn():
        int2_split_kernel[(batch, hkv, nsplit)](*args, NSPLIT=nsplit, NSPLIT_SHORT=plan.short_splits, **consts)

    def gluon_fn():
        wk, wv = case.window_k[layer], case.window_v[layer]
        int2_split_gluon_kernel[(batch, hkv, nsplit)](  # the split programs only (pid < NSPLIT)
            case.query, case.query.stride(0), case.query.stride(1), cache, cache.stride(0), cache.stride(1),
            wk, wv, wk.stride(0), wk.stride(1), wk.stride(2), case.block_table, case.window_block_table,
            case.block_table.stride(0), case.seq_lens,
            part_g, part_g.stride(0), part_g.stride(1), part_g.stride(2), lse_g, lse_g.stride(0), lse_g.stride(1),
            DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale * triton_ops.LOG2E, None, None, None, nsplit,
            GROUP=consts["GROUP"], D=consts["D"], BS=BLOCK_SIZE, NSINK=1, MIN_TILES=consts["MIN_TILES"],
            REGION=case.layout.head_region_bytes, num_warps=1, **offsets, **extra)

    def served_fn():
        triton_ops.oscar_decode(*plan_args[:11], out=out, max_seq_len=length, config=config)

    return triton_fn, gluon_fn, served_fn, nsplit


def run_case(geometry: str, length: int, batch: int, reps: int, maxnreg: int | None) -> dict:
    hq, hkv, dim = GEOMETRIES[geometry]
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(length * 7 + batch)
    probe = make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, 1, device, gen)
    layers = layers_for(oscar_bytes(probe, batch, length, hkv, hq, dim))
    del probe
    case = make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, layers, device, gen)
    fns = []
    nsplit = 0
    buffers = []
    for layer in range(layers):
        plan_probe = triton_ops._cached_plan(case.query, case.caches[layer], case.window_k[layer],
                                             case.window_v[layer], case.layout, case.block_table,
                                             case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS,
                                             DEFAULT_RECENT_TOKENS, 1.0 / math.sqrt(dim), length,
                                             triton_ops.DEFAULT_DECODE)
        total = plan_probe.total
        part_t = torch.full((batch, hq, total, dim), float("nan"), device=device)
        lse_t = torch.full((batch, hq, total), float("nan"), device=device)
        part_g, lse_g = part_t.clone(), lse_t.clone()
        buffers.append((part_t, lse_t, part_g, lse_g))
        t_fn, g_fn, s_fn, nsplit = launchers(case, layer, length, part_t, lse_t, part_g, lse_g, maxnreg)
        fns.append((t_fn, g_fn, s_fn))
    for t_fn, g_fn, _ in fns:
        t_fn()
        g_fn()
    torch.cuda.synchronize()
    part_t, lse_t, part_g, lse_g = (x[:, :, :nsplit] for x in buffers[0])
    live = torch.isfinite(lse_t)
    same_empty = bool(torch.equal(live, torch.isfinite(lse_g)))
    lse_err = (lse_t[live] - lse_g[live]).abs().max().item() if live.any() else 0.0
    scale_out = part_t[live].abs().max().item() if live.any() else 1.0
    out_err = (part_t[live] - part_g[live]).abs().max().item() / max(scale_out, 1e-30) if live.any() else 0.0
    ok = same_empty and lse_err < 2e-3 and out_err < 2e-2 and not torch.isnan(part_g[live]).any().item()
    result = {"geometry": geometry, "context": length, "batch": batch, "nsplit": nsplit, "layers": layers,
              "check": {"ok": ok, "same_empty_splits": same_empty, "max_abs_lse_diff": lse_err,
                        "max_rel_out_diff": out_err}}
    times = {}
    for tag, index in (("triton_1", 0), ("gluon_1", 1), ("triton_2", 0), ("gluon_2", 1), ("served", 2)):
        times[tag] = time_graph([f[index] for f in fns], reps)
    result["ms"] = times
    triton_ms = min(times["triton_1"], times["triton_2"])
    gluon_ms = min(times["gluon_1"], times["gluon_2"])
    result["gluon_speedup"] = triton_ms / gluon_ms
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", nargs="+", default=["qwen3-8b", "smollm2-135m"], choices=sorted(GEOMETRIES))
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--maxnreg", type=int, default=0,
                        help="register cap of the Gluon kernel (0 = triton_ops.GLUON_MAX_REGISTERS, as served)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}; split programs only, blocks of {BLOCK_SIZE}; ms per layer")
    print("geometry context batch nsplit | check | triton gluon triton gluon | served | gluon speed-up")
    rows = []
    for geometry in args.geometry:
        for length in args.contexts:
            for batch in args.batches:
                try:
                    row = run_case(geometry, length, batch, args.reps, args.maxnreg or None)
                except Exception as error:  # noqa: BLE001 - reported per case, the other cases still run
                    row = {"geometry": geometry, "context": length, "batch": batch,
                           "error": f"{type(error).__name__}: {str(error)[:2000]}"}
                    print(f"{geometry} {length} {batch} ERROR {row['error'][:600]}", flush=True)
                    rows.append(row)
                    continue
                rows.append(row)
                c, t = row["check"], row["ms"]
                print(f"{geometry} {length} {batch} {row['nsplit']} | {'ok' if c['ok'] else 'FAIL'} "
                      f"lse {c['max_abs_lse_diff']:.1e} out {c['max_rel_out_diff']:.1e} | "
                      f"{t['triton_1']:.4f} {t['gluon_1']:.4f} {t['triton_2']:.4f} {t['gluon_2']:.4f} | "
                      f"{t['served']:.4f} | {row['gluon_speedup']:.3f}", flush=True)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, handle, indent=1)
    return 0 if all(r.get("check", {}).get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
