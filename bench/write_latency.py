#!/usr/bin/env python3
"""Latency of the quantizing write at decode sizes on a GPU, in CUDA-graph replays, warm and with a
cold L2 (a 256 MB buffer zeroed before each write; the flush alone is timed too, to subtract).

Write launch variants (triton_ops.WriteConfig) at 1 / 8 / 16 / 32 new tokens, served refit 8 / 2 and clips
0.96 / 0.92, Qwen3-8B (8 KV heads, D 128) and SmolLM2 (3 KV heads, D 64) geometry, blocks of 64:
the default, the rotation on tensor cores (tf32x3), 2 and 8 warps, and the default without refit. Then the
launches of a captured decode step (attention/step.layer_step, flag 0: the INT2 part beside the attention):
the side stream's INT2 part by 16-row programs (side_int2) and by row programs whose ring of R rows takes N
registers per lane (side_rows_rN, triton_write_rows) or that read the rotated rows the first launch stored
(side_rows_rotated), and the current stream's first launch, window copies plus the query rotation in one launch
(first_fused, oscar_write with a query; first_fused_cN with window-copy programs of N output columns,
WriteConfig.window_columns; first_fused_rotated_out also storing the rotated rows) against the two launches it
replaced (first_separate: the window-copy write, then oscar_rotate), and its parts alone: the window copies
(first_windows), the query rotation (first_query), neither (first_empty: the flagged INT2 programs returning at
once).

    python bench/write_latency.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402

#: (name, WriteConfig, refit rounds (K, V)).
VARIANTS = (
    ("default", triton_ops.WriteConfig(), (8, 2)),
    ("tf32x3", triton_ops.WriteConfig(rotation_precision="tf32x3"), (8, 2)),
    ("warps2", triton_ops.WriteConfig(num_warps=2), (8, 2)),
    ("warps8", triton_ops.WriteConfig(num_warps=8), (8, 2)),
    ("no_refit", triton_ops.WriteConfig(), (0, 0)),
)
FLUSH_BYTES = 256 * 1024 * 1024
#: The side-stream INT2 launch by 16-row programs (BY_TILES) and by row programs (BY_ROWS, triton_write_rows) whose
#: ring of R rows in flight takes these registers per lane (triton_ops.WRITE_ROWS_RING_REGISTERS).
BY_TILES = triton_ops.WriteConfig(row_programs=False)
BY_ROWS = triton_ops.WriteConfig(row_programs=True)
RING_REGISTERS = (64, 128, 192)
#: Output columns per window-copy program of the first launch to time (WriteConfig.window_columns).
WINDOW_COLUMNS = (16, 32, 64, 128)


def rows_ring(registers: int, launch) -> None:
    """Run launch with row programs whose ring of R rows takes ``registers`` per lane (the constant restored)."""
    default = triton_ops.WRITE_ROWS_RING_REGISTERS
    triton_ops.WRITE_ROWS_RING_REGISTERS = registers
    triton_ops._row_write_constants.cache_clear()
    try:
        launch()
    finally:
        triton_ops.WRITE_ROWS_RING_REGISTERS = default
        triton_ops._row_write_constants.cache_clear()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32], help="new tokens per write")
    parser.add_argument("--variants", nargs="+", help="only these launches (names as printed; default: all)")
    args = parser.parse_args()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    flush_us = do_bench_cudagraph(flush.zero_, rep=50) * 1e3
    print(f"L2 flush alone: {flush_us:.2f} us", flush=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for geometry, hkv, group, dim in (("qwen3-8b", 8, 4, 128), ("smollm2-135m", 3, 3, 64)):
        block_size = 64
        layout = PageLayout(dim, dim, block_size, torch.float16)
        blocks = max(512, 3 * max(args.tokens) // block_size + 1)
        cache = torch.zeros(layout.cache_shape(blocks, hkv), dtype=torch.uint8, device="cuda")
        window_k = torch.zeros(max(64, max(args.tokens) // block_size + 1), block_size, hkv, dim, dtype=torch.bfloat16,
                               device="cuda")
        window_v = torch.zeros_like(window_k)
        rk, rv = (torch.linalg.qr(torch.randn(hkv, dim, dim, generator=gen, dtype=torch.float64))[0]
                  .float().contiguous().cuda() for _ in range(2))
        for tokens in args.tokens:
            key = torch.randn(tokens, hkv, dim, device="cuda", dtype=torch.bfloat16)
            value = torch.randn_like(key)
            slots = torch.arange(tokens, device="cuda") * 3
            window_slots = torch.arange(tokens, device="cuda")
            query = torch.randn(tokens, hkv * group, dim, device="cuda", dtype=torch.bfloat16)
            write_args = (key, value, rk, rv, 0.96, 0.92, cache, layout, slots, window_k, window_v, window_slots)
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            rotated = torch.zeros(tokens, hkv, 2, dim, device="cuda")  # the first launch's rotated rows (rotated_out)
            row = {"geometry": geometry, "tokens": tokens}
            launches = [(name, lambda config=config, refit=refit: triton_ops.oscar_write(
                *write_args, refit_iterations=refit, config=config)) for name, config, refit in VARIANTS]
            launches += [
                ("side_int2", lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), store_window=False,
                                                             int2="unless_flag", flag=flag, config=BY_TILES)),
                *((f"side_rows_r{registers}", lambda registers=registers: rows_ring(
                    registers, lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), store_window=False,
                                                              int2="unless_flag", flag=flag, config=BY_ROWS)))
                  for registers in RING_REGISTERS),
                ("side_rows_rotated", lambda: triton_ops.oscar_write(
                    *write_args, refit_iterations=(8, 2), store_window=False, int2="unless_flag", flag=flag,
                    config=BY_ROWS, rotated=rotated)),
                ("first_fused_rotated_out", lambda: triton_ops.oscar_write(
                    *write_args, refit_iterations=(8, 2), query=query, int2="if_flag", flag=flag,
                    rotated_out=rotated)),
                ("first_fused", lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), query=query,
                                                                          int2="if_flag", flag=flag)),
                *((f"first_fused_c{columns}", lambda columns=columns: triton_ops.oscar_write(
                    *write_args, refit_iterations=(8, 2), query=query, int2="if_flag", flag=flag,
                    config=triton_ops.WriteConfig(window_columns=columns)))
                  for columns in WINDOW_COLUMNS if columns <= dim),
                ("first_windows", lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), int2="if_flag",
                                                                 flag=flag)),
                ("first_query", lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), int2="if_flag",
                                                               flag=flag, store_window=False, query=query)),
                ("first_empty", lambda: triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), int2="if_flag",
                                                               flag=flag, store_window=False)),
                ("first_separate", lambda: (triton_ops.oscar_write(*write_args, refit_iterations=(8, 2), int2="if_flag",
                                                                   flag=flag), triton_ops.oscar_rotate(query, rk))),
            ]
            for name, write in launches:
                if args.variants and name not in args.variants:
                    continue

                def cold_write(write=write) -> None:
                    flush.zero_()
                    write()

                row[f"{name}_us"] = do_bench_cudagraph(write, rep=50) * 1e3
                row[f"{name}_cold_us"] = do_bench_cudagraph(cold_write, rep=50) * 1e3 - flush_us
            rows.append(row)
            print(f"{geometry} {tokens} tokens: " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in row.items()
                                                              if k.endswith("_us")) + " us", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "flush_us": flush_us, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
