"""CPU path (kernels/torch_ops.py) alone, outside vLLM: one layer's write, decode and fresh-prompt prefill.

SmolLM2-135M's attention geometry (9 query / 3 KV heads, head_dim 64, groups of 32), blocks of 16, default windows
(sink 64 / recent 256), one request whose cache holds CONTEXT tokens of random rows. Rows timed, best of ROUNDS x
CALLS calls each, milliseconds per call:

* write: oscar_write of one token (the served refit: 8 floored key / 2 value rounds), with its query;
* decode: oscar_decode of one query over the CONTEXT cached tokens;
* prefill: oscar_prefill of a fresh CONTEXT-token prompt (no cached prefix);
* sdpa: torch's scaled_dot_product_attention alone over the same fresh prompt (float32, causal, GQA), for scale.

    python bench/cpu_torch_ops.py [--context 2048] [--threads 1] [--json OUT]

``--threads 1`` is what vLLM's CPU worker runs torch with on a 2-core machine ("Reducing Torch threads ... for
serving"). Run the script from another tree with PYTHONPATH set to it to time that tree's torch_ops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from vllm_oscar.kernels import torch_ops
from vllm_oscar.kernels.layout import PageLayout

QUERY_HEADS, KV_HEADS, HEAD_DIM, GROUP, BLOCK = 9, 3, 64, 32, 16
SINK, RECENT = 64, 256
CLIP_K, CLIP_V, REFIT = 0.96, 0.99, (8, 2)
ROUNDS, CALLS = 5, 10


def best_ms(fn: Callable[[], object], calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Best over ``rounds`` of the mean time of ``calls`` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    length = args.context
    layout = PageLayout(HEAD_DIM, GROUP, BLOCK)
    blocks = -(-length // BLOCK)
    cache = layout.allocate(blocks, KV_HEADS)
    rotation = torch.linalg.qr(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64))[0].float()
    window_blocks = -(-SINK // BLOCK) + -(-RECENT // BLOCK) + 1
    window_k = torch.zeros(window_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    window_v = torch.zeros_like(window_k)
    block_table = torch.arange(blocks, dtype=torch.int32)[None]
    window_table = torch.full((1, blocks), -1, dtype=torch.int32)
    sink_blocks, tail_blocks = -(-SINK // BLOCK), window_blocks - -(-SINK // BLOCK)
    window_table[0, :sink_blocks] = torch.arange(sink_blocks)
    window_table[0, blocks - tail_blocks:] = torch.arange(sink_blocks, window_blocks)
    positions = torch.arange(length)
    window_of = window_table[0, positions // BLOCK].long()
    window_slots = torch.where(window_of >= 0, window_of * BLOCK + positions % BLOCK, -1)
    key = torch.randn(length, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    value = torch.randn(length, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    query = torch.randn(length, QUERY_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    write = dict(k_rotation=rotation, v_rotation=rotation, clip_k=CLIP_K, clip_v=CLIP_V, int2_cache=cache,
                 layout=layout, window_k=window_k, window_v=window_v, refit_iterations=REFIT)
    torch_ops.oscar_write(key, value, slot_mapping=positions, window_slot_mapping=window_slots, **write)
    scale = HEAD_DIM ** -0.5
    caches = (cache, window_k, window_v, layout, block_table, window_table)
    q4 = query.float().transpose(0, 1)[None]
    k4, v4 = key.float().transpose(0, 1)[None], value.float().transpose(0, 1)[None]
    rows = {
        "write": best_ms(lambda: torch_ops.oscar_write(key[-1:], value[-1:], slot_mapping=positions[-1:],
                                                       window_slot_mapping=window_slots[-1:], query=query[-1:],
                                                       **write), calls=100),
        "decode": best_ms(lambda: torch_ops.oscar_decode(query[-1:], *caches, torch.tensor([length]), SINK, RECENT,
                                                         scale), calls=50),
        "prefill": best_ms(lambda: torch_ops.oscar_prefill(query, key, value, *caches, torch.tensor([0, length]),
                                                           torch.tensor([length]), SINK, RECENT, scale), calls=2),
        "sdpa": best_ms(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                               enable_gqa=True), calls=2),
    }
    report = {"context": length, "threads": args.threads, "torch": torch.__version__,
              "torch_ops": str(Path(torch_ops.__file__).resolve()), "ms_per_call": rows}
    print(f"torch_ops from {report['torch_ops']}, {args.threads} thread(s), context {length}:")
    for name, ms in rows.items():
        print(f"  {name:8} {ms:8.3f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
