#!/usr/bin/env python3
"""Time gluon_decode's kernel by parts on a CUDA GPU: its whole grid, its INT2 split programs alone and its BF16
window programs alone, beside the whole decode call (splits, windows and the merge), as CUDA-graph replays over as
many layers as `bench decode` uses. Where the whole grid takes as long as the window programs alone, the window
programs are the kernel's tail (docs/decisions.md: Qwen3-8B batch 1 at 16K-32K). The last column
is the split programs' fixed cost: the same split grid over requests of sink + recent positions, which leave every
split without a tile (launch, prologue and the partial's store only; docs/decisions.md).

    python bench/gluon_parts.py --geometry qwen3-8b --contexts 16384 32768 131072 --batches 1 8 [--json OUT]

The parts are the same launch with a smaller grid: the splits alone are programs 0 .. NSPLIT - 1; the windows alone
pass NSPLIT = 0, so that program w takes window tile w (their partials land in the first slots: timing only).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from gluon_case import NOT_GLUON, add_output_arguments, cuda_device, gluon_case, write_rows  # noqa: E402

from vllm_oscar.kernels.benchmark import GEOMETRIES, time_graph  # noqa: E402


def time_parts(geometry: str, length: int, batch: int, reps: int, device: torch.device) -> dict:
    """ms per layer of the whole decode call, the Gluon kernel's whole grid, its splits, its windows and its splits
    without tiles."""
    cell = gluon_case(geometry, length, batch, device)
    if cell is None:
        return {"skipped": NOT_GLUON}
    plan, layers = cell.plan, cell.layers
    no_tiles = torch.full_like(cell.case.seq_lens, cell.sink + cell.recent)  # no split has a tile

    def launch(i: int, programs: int, nsplit: int, seq_lens=None):
        return lambda: cell.kernel(i, programs, nsplit, seq_lens)

    windows = plan.total - plan.num_splits
    return {"splits": plan.num_splits, "window_programs": windows, "layers": layers,
            "decode_ms": time_graph([(lambda i=i: cell.decode(i)) for i in range(layers)], reps),
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
    add_output_arguments(parser)
    args = parser.parse_args()
    device = cuda_device("bench/gluon_parts.py times gluon_decode's kernel on a CUDA GPU; none is visible.")
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
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
