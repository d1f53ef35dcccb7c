"""Host time of the window plan per decode step (WindowBlockManager.plan, run by the metadata
builder once per scheduler step), by batch, context and block size.

Each request is prefilled (one plan for the whole prompt), then decoded; the figure is the mean
wall time of the decode steps' plans on this machine's CPU.

    python bench/window_plan.py [--batches 1 8 64 256] [--contexts 4096 32768 131072] [--block-sizes 16 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vllm_oscar.attention.window_store import WindowBlockManager, window_capacity_blocks
from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS

MAX_NUM_BATCHED_TOKENS = 8192


def time_decode_plans(batch: int, context: int, block_size: int, steps: int) -> float:
    """Mean seconds per decode-step plan for ``batch`` requests at about ``context`` tokens."""
    blocks = context // block_size + steps // block_size + 2
    capacity = window_capacity_blocks(batch, MAX_NUM_BATCHED_TOKENS, block_size, DEFAULT_SINK_TOKENS,
                                      DEFAULT_RECENT_TOKENS)
    manager = WindowBlockManager(capacity, block_size, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS)
    table = torch.randperm(batch * blocks, dtype=torch.int32).view(batch, blocks)  # shuffled physical ids
    lens = [context - 3 * i for i in range(batch)]
    for index in range(batch):  # prefill one request at a time, in chunks of one step's token budget
        for start in range(0, lens[index], MAX_NUM_BATCHED_TOKENS):
            end = min(start + MAX_NUM_BATCHED_TOKENS, lens[index])
            manager.plan(table[index:index + 1], [end], [end - start])
    start = time.perf_counter()
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        manager.plan(table, lens, [1] * batch)
    if manager.fallback_positions:
        raise RuntimeError(f"window store too small in the benchmark: {manager.fallback_positions} fallbacks")
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'block':>5} {'batch':>5} {'context':>8} {'ms/step':>8}")
    for block_size in args.block_sizes:
        for batch in args.batches:
            for context in args.contexts:
                ms = 1e3 * time_decode_plans(batch, context, block_size, args.steps)
                rows.append({"block_size": block_size, "batch": batch, "context": context, "ms_per_step": ms})
                print(f"{block_size:>5} {batch:>5} {context:>8} {ms:>8.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
