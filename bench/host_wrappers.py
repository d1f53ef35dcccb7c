#!/usr/bin/env python3
"""Host time of one eager decode layer step's Python wrappers, without a GPU.

Runs the CUDA path's op wrappers (vllm_oscar.kernels.triton_ops: oscar_write with the query, oscar_decode,
oscar_rotate) on CPU tensors under TRITON_INTERPRET=1 with every kernel launch replaced by a no-op, so what is
timed is argument checking, planning, allocation and argument marshalling: the part of an eager step's host
time that is this package's, apart from Triton's own launch path (docs/decisions.md H3). Qwen3-8B geometry
(32 / 8 heads, D 128), blocks of 64, 4K context, batch 8.

    python bench/host_wrappers.py [--steps 2000] [--profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402

KERNELS = ("int2_split_kernel", "merge_kernel", "oscar_write_kernel", "rotate_rows_kernel", "attention_kernel")


class _NoLaunch:
    """Stands in for a Triton kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile of 500 steps")
    args = parser.parse_args()
    for name in KERNELS:
        setattr(triton_ops, name, _NoLaunch())
    batch, hq, hkv, dim, block, context = 8, 32, 8, 128, 64, 4096
    layout = PageLayout(dim, dim, block, torch.float16)
    cache = layout.allocate(batch * context // block + 8, hkv)
    window_k = torch.zeros(64, block, hkv, dim, dtype=torch.bfloat16)
    window_v = torch.zeros_like(window_k)
    rotation = torch.eye(dim).expand(hkv, dim, dim).contiguous()
    query = torch.randn(batch, hq, dim, dtype=torch.bfloat16)
    key = torch.randn(batch, hkv, dim, dtype=torch.bfloat16)
    slots = torch.arange(batch)
    block_table = torch.arange(batch * (context // block), dtype=torch.int32).view(batch, -1)
    window_table = torch.full_like(block_table, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    output = torch.empty(batch, hq, dim, dtype=torch.bfloat16)
    config = triton_ops.decode_config(None, False)

    def step() -> None:
        q_rot = triton_ops.oscar_write(key, key, rotation, rotation, 0.96, 0.92, cache, layout, slots, window_k,
                                       window_v, slots, refit_iterations=(8, 2), query=query)
        out_rot = torch.empty_like(q_rot)
        triton_ops.oscar_decode(q_rot, cache, window_k, window_v, layout, block_table, window_table, seq_lens, 64,
                                256, 0.088, out=out_rot, max_seq_len=context, config=config)
        triton_ops.oscar_rotate(out_rot, rotation, inverse=True, out=output)

    for _ in range(50):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(f"{(time.perf_counter() - start) / args.steps * 1e6:.1f} us of wrapper host time per layer step "
          "(4 launches, stubbed)")
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
