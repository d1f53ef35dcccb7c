#!/usr/bin/env python3
"""Run one decode case a few times, for a profiler (Nsight Compute) to attach to.

Builds the benchmark's random OSCAR case (one layer) and calls ``oscar_decode`` ``--calls``
times with the default launch config (or the knobs given: gluon_decode's kernel where it applies, as served, unless
a knob of int2_split_kernel is set or --no-gluon). Prints the kernels' names and the
mean wall time per call so that a profiled run can be matched to the benchmark table. Used by
bench/ncu_decode.sh:

    python bench/profile_decode.py --geometry qwen3-8b --context 32768 --batch 32
    python bench/profile_decode.py ... --dump-compiled /tmp/split   # + registers, PTX and cubin of each
                                                                      # compiled split kernel
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS, GPU_DECODE_BLOCK_SIZE  # noqa: E402
from vllm_oscar.kernels import triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, make_oscar_case  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=GPU_DECODE_BLOCK_SIZE)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--block-t", type=int, default=None)
    parser.add_argument("--int8-keys", type=int, choices=(0, 1), default=None)
    parser.add_argument("--prefetch", type=int, default=None)
    parser.add_argument("--max-registers", type=int, default=None)
    parser.add_argument("--full-tiles", type=int, choices=(0, 1), default=None,
                        help="AttentionConfig.full_tiles (default: on wherever the split kernel runs)")
    parser.add_argument("--merge-pdl", type=int, choices=(0, 1), default=None,
                        help="AttentionConfig.merge_pdl (default: on for compute capability >= 9.0)")
    parser.add_argument("--tma-stages", type=int, default=None,
                        help="AttentionConfig.tma_stages (default: the eager launch's, plain loads; 0 or more picks "
                             "int2_split_kernel)")
    parser.add_argument("--gluon-copy-stages", type=int, default=None,
                        help="AttentionConfig.gluon_copy_stages: gluon_decode's tiles staged by cp.async (0 = off; "
                             "default: 2 where triton_ops.staging_pays)")
    parser.add_argument("--gluon-f16-values", type=int, choices=(0, 1), default=None,
                        help="AttentionConfig.gluon_f16_values: gluon_decode's V operands in fp16 (default: "
                             "wherever gluon_decode runs)")
    parser.add_argument("--fold-tiles", type=int, default=None,
                        help="AttentionConfig.fold_tiles: tiles between folds of the BIAS sums (default: 8, or 2 "
                             "with fp16 V operands)")
    parser.add_argument("--no-gluon", action="store_true",
                        help="AttentionConfig(gluon_splits=False): int2_split_kernel where gluon_decode would run")
    parser.add_argument("--sdpa", action="store_true",
                        help="run the BF16 baseline instead: cuDNN scaled_dot_product_attention on contiguous K/V of "
                             "the same geometry (for comparing profiler metrics with OSCAR's kernels)")
    parser.add_argument("--dump-compiled", metavar="DIR",
                        help="write registers, spills, specialisation, PTX and cubin of every compiled "
                             "split kernel (int2_split_kernel, gluon_decode's) here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (this script feeds a GPU profiler)")
    device = torch.device("cuda")
    hq, hkv, dim = GEOMETRIES[args.geometry]
    gen = torch.Generator(device=device).manual_seed(args.context * 131 + args.batch)
    if args.sdpa:
        return profile_sdpa(args.geometry, args.context, args.batch, args.calls, device, gen)
    case = make_oscar_case(args.batch, args.context, hq, hkv, dim, args.block_size, 1, device, gen)
    config = triton_ops.AttentionConfig(
        block_t=args.block_t, prefetch=args.prefetch, max_registers=args.max_registers,
        full_tiles=None if args.full_tiles is None else bool(args.full_tiles),
        int8_keys=None if args.int8_keys is None else bool(args.int8_keys),
        merge_pdl=None if args.merge_pdl is None else bool(args.merge_pdl), tma_stages=args.tma_stages,
        gluon_splits=False if args.no_gluon else None, gluon_copy_stages=args.gluon_copy_stages,
        gluon_f16_values=None if args.gluon_f16_values is None else bool(args.gluon_f16_values),
        fold_tiles=args.fold_tiles)
    out = torch.empty_like(case.query)

    def decode() -> None:
        triton_ops.oscar_decode(case.query, case.caches[0], case.window_k[0], case.window_v[0], case.layout,
                                case.block_table, case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS,
                                DEFAULT_RECENT_TOKENS, 1.0 / math.sqrt(dim), out=out, max_seq_len=args.context,
                                config=config)

    decode()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        decode()
    torch.cuda.synchronize()
    print(f"{args.geometry} context {args.context} batch {args.batch}: {args.calls} calls, "
          f"{(time.perf_counter() - start) / args.calls * 1e3:.3f} ms per call (wall, unprofiled: the benchmark "
          f"times graph replays)")
    if args.dump_compiled:
        dump_compiled(args.dump_compiled)
    return 0


def profile_sdpa(geometry: str, context: int, batch: int, calls: int, device: torch.device,
                 gen: torch.Generator) -> int:
    """The benchmark's BF16 baseline for one case: cuDNN SDPA, q [B, Hq, 1, D], k/v [B, Hkv, L, D] bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, dim = GEOMETRIES[geometry]
    k = torch.randn(batch, hkv, context, dim, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, dim, device=device, dtype=torch.bfloat16, generator=gen)

    def attend() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    attend()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        attend()
    torch.cuda.synchronize()
    print(f"cuDNN SDPA {geometry} context {context} batch {batch}: {calls} calls, "
          f"{(time.perf_counter() - start) / calls * 1e3:.3f} ms per call (wall)")
    return 0


def dump_compiled(folder: str) -> None:
    """One line per compiled split kernel (int2_split_kernel's and gluon_decode's: registers, spills, shared
    bytes, constexprs) and its PTX / cubin, as the launch compiled them (the offline tool bench/sass_decode.py may
    specialise differently)."""
    from vllm_oscar.kernels.gluon_decode import int2_split_gluon_kernel
    from vllm_oscar.kernels.triton_decode_int2 import int2_split_kernel

    os.makedirs(folder, exist_ok=True)
    for prefix, kernel in (("split", int2_split_kernel), ("gluon", int2_split_gluon_kernel)):
        for entry in kernel.device_caches.values():
            for n, compiled in enumerate(entry[0].values()):
                _dump_one(compiled, os.path.join(folder, f"{prefix}_{n}"))


def _dump_one(compiled, name: str) -> None:
    """compiled's PTX, TTGIR and cubin as name.<ext>, and its one summary line."""
    compiled._init_handles()
    for ext in ("ptx", "ttgir", "cubin"):
        mode = "wb" if ext == "cubin" else "w"
        with open(f"{name}.{ext}", mode) as handle:
            handle.write(compiled.asm[ext])
    src = getattr(compiled, "src", None)
    print(f"{name}: registers {compiled.n_regs}, spills {compiled.n_spills}, shared "
          f"{compiled.metadata.shared} B, constants {getattr(src, 'constants', '?')}, "
          f"attrs {getattr(src, 'attrs', '?')}")


if __name__ == "__main__":
    sys.exit(main())
