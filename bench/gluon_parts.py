#!/usr/bin/env python3
"""Time gluon_decode's kernel by parts on a CUDA GPU: its whole grid, its INT2 split programs alone and its BF16
window programs alone, beside the whole decode call (splits, windows and the merge), as CUDA-graph replays over as
many layers as `bench decode` uses. Where the whole grid takes as long as the window programs alone, the window
programs are the kernel's tail (docs/notes/kernels.md "Session 24": Qwen3-8B batch 1 at 16K-32K). The last column
is the split programs' fixed cost: the same split grid over requests of sink + recent positions, which leave every
split without a tile (launch, prologue and the partial's store only; docs/notes/kernels.md "Session 27").

    python bench/gluon_parts.py --geometry qwen3-8b --contexts 16384 32768 131072 --batches 1 8 [--json OUT]

The parts are the same launch with a smaller grid: the splits alone are programs 0 .. NSPLIT - 1; the windows alone
pass NSPLIT = 0, so that program w takes window tile w (their partials land in the first slots: timing only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS  # noqa: E402
from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, layers_for, make_oscar_case, time_graph  # noqa: E402

#: Cache blocks of the served decode on CUDA (gluon_decode's tile).
BLOCK_SIZE = 64


def time_parts(geometry: str, length: int, batch: int, reps: int, device: torch.device) -> dict:
    """ms per layer of the whole decode call, the Gluon kernel's whole grid, its splits, its windows and its splits
    without tiles."""
    hq, hkv, dim = GEOMETRIES[geometry]
    sink, recent, scale = DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, 1.0 / math.sqrt(dim)
    layers = layers_for(batch * hkv * length * PageLayout(dim, dim, BLOCK_SIZE, torch.float16).token_bytes)
    case = make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, layers, device,
                           torch.Generator(device=device).manual_seed(length * 131 + batch))
    config = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True)
    plan = triton_ops._cached_plan(case.query, case.caches[0], case.window_k[0], case.window_v[0], case.layout,
                                   case.block_table, case.window_block_table, case.seq_lens, sink, recent, scale,
                                   length, config)
    if not (plan.split_int2 and plan.gluon_splits):
        return {"skipped": "gluon_decode's kernel does not run in this case (triton_ops.gluon_pays)"}
    part = torch.empty(batch, hq, plan.total, dim, dtype=torch.float32, device=device)
    lse = torch.empty(batch, hq, plan.total, dtype=torch.float32, device=device)
    kernel = triton_ops._gluon_kernel()
    outs = [torch.empty_like(case.query) for _ in range(layers)]

    no_tiles = torch.full_like(case.seq_lens, sink + recent)  # the INT2 range is empty: no split has a tile

    def launch(i: int, programs: int, nsplit: int, seq_lens: torch.Tensor = case.seq_lens):
        args = triton_ops._split_args(case.query, case.caches[i], case.window_k[i], case.window_v[i],
                                      case.block_table, case.window_block_table, seq_lens, part, lse, sink,
                                      recent, scale, [])
        return lambda: kernel[(batch, hkv, programs)](*args, nsplit, **plan.split_consts)

    def decode(i: int):
        return lambda: triton_ops.oscar_decode(
            case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, case.block_table,
            case.window_block_table, case.seq_lens, sink, recent, scale, out=outs[i], max_seq_len=length,
            config=config)

    windows = plan.total - plan.num_splits
    return {"splits": plan.num_splits, "window_programs": windows, "layers": layers,
            "decode_ms": time_graph([decode(i) for i in range(layers)], reps),
            "kernel_ms": time_graph([launch(i, plan.total, plan.num_splits) for i in range(layers)], reps),
            "splits_ms": time_graph([launch(i, plan.num_splits, plan.num_splits) for i in range(layers)], reps),
            "windows_ms": time_graph([launch(i, windows, 0) for i in range(layers)], reps),
            "empty_splits_ms": time_graph([launch(i, plan.num_splits, plan.num_splits, no_tiles)
                                           for i in range(layers)], reps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", metavar="OUT", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gluon_parts.py times gluon_decode's kernel on a CUDA GPU; none is visible.")
    device = torch.device("cuda")
    rows = []
    print("geometry       context   B  splits windows  decode ms  kernel ms  splits ms  windows ms  empty ms")
    for length in args.contexts:
        for batch in args.batches:
            row = {"geometry": args.geometry, "context": length, "batch": batch,
                   **time_parts(args.geometry, length, batch, args.reps, device)}
            rows.append(row)
            if "skipped" in row:
                print(f"{args.geometry:<14} {length:>7} {batch:>3}  {row['skipped']}")
                continue
            print(f"{args.geometry:<14} {length:>7} {batch:>3} {row['splits']:>7} {row['window_programs']:>7} "
                  f"{row['decode_ms']:10.4f} {row['kernel_ms']:10.4f} {row['splits_ms']:10.4f} "
                  f"{row['windows_ms']:11.4f} {row['empty_splits_ms']:9.4f}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
