#!/usr/bin/env python3
"""Where the decode merge's tail goes, on a CUDA GPU: per cell, as CUDA-graph replays over as many layers as `bench
decode` uses, the whole decode call beside gluon_decode's split kernel alone, the split kernel followed by an empty
kernel with the merge's grid (launched with programmatic dependent launch and griddepcontrol.wait, PDL without the
wait, or plain), and followed by the shipped merge kernel at several (channel block, warps) shapes, with its wait
and (timing only: it reads partials still being written) without it (docs/decisions.md).

    python bench/merge_tail.py [--cells qwen3-8b:131072:1 smollm2-135m:131072:8] [--shapes 32:1 16:4] [--json OUT]

Read: "empty + wait" minus "split" is the price of a second, dependent launch; "merge S" minus "empty + wait" is the
merge's own work after the split programs end (its loads, its reduction, its stores).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gluon_case import NOT_GLUON, add_output_arguments, cuda_device, gluon_case, write_rows  # noqa: E402
from triton.language.extra.cuda import gdc_wait  # noqa: E402

from vllm_oscar.kernels import triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import time_graph  # noqa: E402
from vllm_oscar.kernels.triton_attention import merge_kernel  # noqa: E402

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
    cell = gluon_case(geometry, length, batch, device)
    if cell is None:
        return {"skipped": NOT_GLUON}
    plan, part, lse = cell.plan, cell.part, cell.lse
    _, hq, slots, dim = part.shape
    scratch = torch.empty(1, device=device)
    default_d = triton_ops._merge_block_d(cell.config, dim)
    empty_grid = (batch, hq, dim // default_d)

    def split(i: int) -> None:
        cell.kernel(i, slots, plan.num_splits)

    def empty_after(wait: bool, pdl: bool):
        def step(i: int) -> None:
            split(i)
            empty_kernel[empty_grid](scratch, WAIT=wait, num_warps=1, **({"launch_pdl": True} if pdl else {}))
        return step

    def merge_after(block_d: int, warps: int, wait: bool):
        def step(i: int) -> None:
            split(i)
            out = cell.outs[i]
            merge_kernel[(batch, hq, dim // block_d)](
                part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1), out,
                out.stride(0), out.stride(1), NS=slots, NSP=triton.next_power_of_2(slots), D=dim, EMU=False,
                BLOCK_D=None if block_d == dim else block_d, WAIT_PRIOR=wait, ZERO_EMPTY=True,
                TRIGGER_DEPENDENTS=False, num_warps=warps, launch_pdl=True)
        return step

    variants = {"decode": cell.decode, "split": split, "empty + wait": empty_after(True, True),
                "empty, PDL": empty_after(False, True), "empty, plain": empty_after(False, False),
                f"merge {default_d}:{triton_ops.merge_warps(slots, default_d)} no wait":
                    merge_after(default_d, triton_ops.merge_warps(slots, default_d), False)}
    for block_d, warps in shapes:
        variants[f"merge {block_d}:{warps}"] = merge_after(block_d, warps, True)
    row = {"splits": plan.num_splits, "partials": slots, "layers": cell.layers, "us": {}}
    for _ in range(2):  # two rounds: the spread shows the noise
        for name, step in variants.items():
            us = 1000 * time_graph([(lambda i=i: step(i)) for i in range(cell.layers)], reps)
            row["us"].setdefault(name, []).append(us)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS), help="geometry:context:batch")
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                        help="merge shapes as channels:warps (channels a power of two >= 16 dividing head_dim)")
    add_output_arguments(parser)
    args = parser.parse_args()
    device = cuda_device("bench/merge_tail.py times the decode's kernels on a CUDA GPU; none is visible.")
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
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
