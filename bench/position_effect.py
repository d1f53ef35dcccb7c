#!/usr/bin/env python3
"""Does a decode case read slower late in a long benchmark run? (CUDA GPU; docs/decisions.md.)

Times the same OSCAR decode cases (graph replays, as `vllm-oscar bench decode`; random and sorted block tables) and
cuDNN's SDPA on the same shapes four times in one process: fresh, after allocating and freeing --churn-gib of device
memory in mixed sizes, after five other cases, and again. With PyTorch's default allocator segments the late readings
were 3-7% slower (cuDNN once 14-15%); with expandable segments (`--allocator expandable`, the benchmark's default since
session 22) all four agreed within 1%.

    python bench/position_effect.py --allocator default
    python bench/position_effect.py --allocator expandable
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS  # noqa: E402
from vllm_oscar.kernels import benchmark, triton_ops  # noqa: E402
from vllm_oscar.kernels.layout import PageLayout  # noqa: E402

#: The cases read at each position (geometry, context, batch): near the 5x line in session 21's tables.
WATCHED = (("qwen3-8b", 32768, 64), ("qwen3-8b", 65536, 8), ("smollm2-135m", 131072, 64))
#: The other cases run between the third and fourth readings (a table's earlier rows).
BETWEEN = (("qwen3-8b", 4096, 64), ("qwen3-8b", 16384, 32), ("qwen3-8b", 131072, 64), ("smollm2-135m", 65536, 32),
           ("qwen3-8b", 131072, 32))
BLOCK_SIZE = 64


def oscar_ms(geometry: str, length: int, batch: int, device: torch.device, sorted_table: bool, reps: int) -> float:
    """Milliseconds per layer of the default decode (graph replays over benchmark.layers_for copies)."""
    hq, hkv, dim = benchmark.GEOMETRIES[geometry]
    layout = PageLayout(dim, dim, BLOCK_SIZE, torch.float16)
    layers = benchmark.layers_for(batch * hkv * length * layout.token_bytes)
    gen = torch.Generator(device=device).manual_seed(length * 131 + batch)
    case = benchmark.make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, layers, device, gen)
    table = case.block_table.flatten().sort().values.view_as(case.block_table) if sorted_table else case.block_table
    config = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True)
    outs = [torch.empty_like(case.query) for _ in range(layers)]

    # F821 silenced below: the closures run before `del case, outs` frees GPU memory (ruff false positive).
    def decode(i: int):
        return lambda: triton_ops.oscar_decode(
            case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, table,  # noqa: F821
            case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, 1 / math.sqrt(dim),  # noqa: F821
            out=outs[i], max_seq_len=length, config=config)  # noqa: F821

    ms = benchmark.time_graph([decode(i) for i in range(layers)], reps)
    del case, outs
    torch.cuda.empty_cache()
    return ms


def cudnn_ms(geometry: str, length: int, batch: int, device: torch.device, reps: int) -> float:
    """Milliseconds per layer of cuDNN's SDPA on contiguous BF16 K/V of the same shape."""
    from torch.nn.attention import SDPBackend

    hq, hkv, dim = benchmark.GEOMETRIES[geometry]
    layers = benchmark.layers_for(batch * hkv * length * 4 * dim)
    keys = [torch.randn(batch, hkv, length, dim, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    values = [torch.randn_like(k) for k in keys]
    query = torch.randn(batch, hq, 1, dim, device=device, dtype=torch.bfloat16)
    ms = benchmark.time_graph(benchmark.sdpa_fns(query, keys, values, SDPBackend.CUDNN_ATTENTION), reps)
    del keys, values
    torch.cuda.empty_cache()
    return ms


def churn(gib: float, device: torch.device) -> None:
    """Allocate about ``gib`` GiB in buffers of 1, 2 and 3 GiB (written once), free them, release the cache."""
    held, total = [], 0
    while total < gib * 2**30:
        size = (1 + len(held) % 3) << 30
        held.append(torch.empty(size // 4, dtype=torch.float32, device=device).random_())
        total += size
    del held
    torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allocator", choices=sorted(benchmark.ALLOCATOR_SETTINGS), default="expandable")
    parser.add_argument("--churn-gib", type=float, default=100.0)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    allocator = benchmark.configure_allocator(args.allocator)
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; {benchmark.ALLOCATOR_ENV}={allocator!r}; ms per layer", flush=True)

    def read(position: str) -> None:
        for geometry, length, batch in WATCHED:
            times = [oscar_ms(geometry, length, batch, device, sorted_table, args.reps)
                     for sorted_table in (False, True)]
            print(f"{position:>18} {geometry} {length} B={batch}: oscar {times[0]:.4f} (sorted table {times[1]:.4f}), "
                  f"cudnn {cudnn_ms(geometry, length, batch, device, args.reps):.4f}", flush=True)

    read("fresh")
    churn(args.churn_gib, device)
    read(f"after {args.churn_gib:g} GiB churn")
    for geometry, length, batch in BETWEEN:
        oscar_ms(geometry, length, batch, device, False, args.reps)
        cudnn_ms(geometry, length, batch, device, args.reps)
    read("after five cases")
    read("again")
    return 0


if __name__ == "__main__":
    sys.exit(main())
