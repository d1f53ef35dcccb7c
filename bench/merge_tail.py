#!/usr/bin/env python3
"""Where the decode merge's tail goes, on a CUDA GPU: per cell, as CUDA-graph replays over as many layers as `bench
decode` uses, the whole decode call beside gluon_decode's split kernel alone, the split kernel followed by an empty
kernel with the merge's grid (launched with programmatic dependent launch and griddepcontrol.wait, PDL without the
wait, or plain), and followed by the shipped merge kernel at several (channel block, warps) shapes, with its wait
and (timing only: it reads partials still being written) without it (docs/notes/kernels.md "Session 29").

    python bench/merge_tail.py [--cells qwen3-8b:131072:1 smollm2-135m:131072:8] [--shapes 32:1 16:4] [--json OUT]

Read: "empty + wait" minus "split" is the price of a second, dependent launch; "merge S" minus "empty + wait" is the
merge's own work after the split programs end (its loads, its reduction, its stores).
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_wait  # noqa: E402

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS  # noqa: E402
from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, layers_for, make_oscar_case, time_graph  # noqa: E402
from vllm_oscar.kernels.triton_attention import merge_kernel  # noqa: E402

#: Cache blocks of the served decode on CUDA (gluon_decode's tile).
BLOCK_SIZE = 64
#: Cells timed by default: the nearest unmet targets of issue 4 and two batch-1 cells.
DEFAULT_CELLS = ("smollm2-135m:131072:8", "smollm2-135m:4096:8", "qwen3-8b:32768:8", "qwen3-8b:131072:1",
                 "smollm2-135m:131072:1")
#: Merge shapes (channels per program, warps per program) timed by default.
DEFAULT_SHAPES = ("32:1", "16:1", "32:4", "16:4")


@triton.jit
def empty_kernel(out_ptr, WAIT: tl.constexpr):
    """Nothing but (WAIT) griddepcontrol.wait; the store never runs (it keeps out_ptr an argument)."""
    if WAIT:
        gdc_wait()
    if tl.program_id(0) < 0:
        tl.store(out_ptr, 0.0)


def time_cell(geometry: str, length: int, batch: int, shapes: list[tuple[int, int]], reps: int,
              device: torch.device) -> dict:
    """us per layer of each variant (see the module docstring) for one cell."""
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
    slots = plan.total
    part = torch.empty(batch, hq, slots, dim, dtype=torch.float32, device=device)
    lse = torch.empty(batch, hq, slots, dtype=torch.float32, device=device)
    outs = [torch.empty_like(case.query) for _ in range(layers)]
    kernel = triton_ops._gluon_kernel()
    scratch = torch.empty(1, device=device)
    default_d = triton_ops._merge_block_d(config, dim)
    empty_grid = (batch, hq, dim // default_d)

    def split(i: int) -> None:
        args = triton_ops._split_args(case.query, case.caches[i], case.window_k[i], case.window_v[i],
                                      case.block_table, case.window_block_table, case.seq_lens, part, lse, sink,
                                      recent, scale, [])
        kernel[(batch, hkv, slots)](*args, plan.num_splits, **plan.split_consts)

    def empty_after(wait: bool, pdl: bool):
        def step(i: int) -> None:
            split(i)
            empty_kernel[empty_grid](scratch, WAIT=wait, num_warps=1, **({"launch_pdl": True} if pdl else {}))
        return step

    def merge_after(block_d: int, warps: int, wait: bool):
        def step(i: int) -> None:
            split(i)
            out = outs[i]
            merge_kernel[(batch, hq, dim // block_d)](
                part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1), out,
                out.stride(0), out.stride(1), NS=slots, NSP=triton.next_power_of_2(slots), D=dim, EMU=False,
                BLOCK_D=None if block_d == dim else block_d, WAIT_PRIOR=wait, ZERO_EMPTY=True,
                TRIGGER_DEPENDENTS=False, num_warps=warps, launch_pdl=True)
        return step

    def decode(i: int) -> None:
        triton_ops.oscar_decode(case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout,
                                case.block_table, case.window_block_table, case.seq_lens, sink, recent, scale,
                                out=outs[i], max_seq_len=length, config=config)

    variants = {"decode": decode, "split": split, "empty + wait": empty_after(True, True),
                "empty, PDL": empty_after(False, True), "empty, plain": empty_after(False, False),
                f"merge {default_d}:{triton_ops.merge_warps(slots, default_d)} no wait":
                    merge_after(default_d, triton_ops.merge_warps(slots, default_d), False)}
    for block_d, warps in shapes:
        variants[f"merge {block_d}:{warps}"] = merge_after(block_d, warps, True)
    row = {"splits": plan.num_splits, "partials": slots, "layers": layers, "us": {}}
    for _ in range(2):  # two rounds: the spread shows the noise
        for name, step in variants.items():
            us = 1000 * time_graph([(lambda i=i: step(i)) for i in range(layers)], reps)
            row["us"].setdefault(name, []).append(us)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS), help="geometry:context:batch")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help="merge shapes as channels:warps (channels a power of two >= 16 dividing head_dim)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", metavar="OUT", help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/merge_tail.py times the decode's kernels on a CUDA GPU; none is visible.")
    device = torch.device("cuda")
    shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.shapes]
    rows = []
    for cell in args.cells:
        geometry, length, batch = cell.split(":")
        row = {"geometry": geometry, "context": int(length), "batch": int(batch),
               **time_cell(geometry, int(length), int(batch), shapes, args.reps, device)}
        rows.append(row)
        if "skipped" in row:
            print(f"{cell}: {row['skipped']}")
            continue
        base = min(row["us"]["split"])
        print(f"{cell}: {row['splits']} splits, {row['partials']} partials per head; us per layer (best of two), "
              f"and over the split kernel alone")
        for name, readings in row["us"].items():
            print(f"  {name:<22} {min(readings):8.2f}  {min(readings) - base:+6.2f}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
