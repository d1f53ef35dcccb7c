"""How the decode's error against float64 depends on the positions one split program walks (H200 / any CUDA GPU).

One request of each --lengths at Qwen3-8B geometry (32 query heads, 8 KV heads, head_dim 128; or --geometry
smollm2-135m: 9 / 3, head_dim 64), blocks of 64, the default sink 64 / recent 256, random paged state with planted
outliers as in check_kernels_gpu.py), decoded with a fixed split count per launch variant; prints per head the
largest and the mean relative error of the output (max / mean). A systematic loss in a split's accumulation grows
with the split's length, so the one-split column shows it first
(docs/decisions.md F1: the fold of the BIAS sums, FOLD_TILES).

    python bench/split_error.py [--geometry qwen3-8b] [--lengths 30000 120000] [--splits 1 2 4 16 64 256] \
        [--fold-tiles 8 32]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "tests")]

import torch  # noqa: E402

from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES  # noqa: E402

import check_kernels_gpu as gpu_check  # noqa: E402
from kernels_reference import random_paged_state  # noqa: E402

#: Launch variants: the default (gluon_decode where it applies), gluon_decode with fp16 and with bf16 V operands,
#: int2_split_kernel with the PTX unpack, with the portable unpack, and with bf16 keys.
VARIANTS = (dict(), dict(gluon_f16_values=True), dict(gluon_f16_values=False), dict(gluon_splits=False),
            dict(gluon_splits=False, unpack=0), dict(gluon_splits=False, int8_keys=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[30000, 120000])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    parser.add_argument("--fold-tiles", type=int, nargs="+", default=[None],
                        help="AttentionConfig.fold_tiles values to compare (default: the shipped period)")
    args = parser.parse_args()
    sink, recent = 64, 256
    hq, hkv, dim = GEOMETRIES[args.geometry]
    for length in args.lengths:
        gen = torch.Generator().manual_seed(length)
        layout = PageLayout(dim, dim, 64, torch.float16)
        state = gpu_check.to_device(random_paged_state([length], hkv, layout, sink, recent, gen, drop_window_blocks=1))
        query = torch.randn(1, hq, dim, generator=gen).to(torch.bfloat16).to(gpu_check.DEVICE)
        scale = 1 / math.sqrt(dim)
        context = gpu_check.dense_context(state, 0, length, gpu_check.DEVICE)
        expected = gpu_check.dense_attention(query, torch.tensor([length - 1], device=gpu_check.DEVICE), context, sink,
                                             recent, scale)[0].double()
        for variant in [dict(v, fold_tiles=fold) for fold in args.fold_tiles for v in VARIANTS]:
            cells = []
            for splits in args.splits:
                out = torch.full_like(query, float("nan"))
                triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                        state.window_block_table, state.seq_lens, sink, recent, scale, out=out,
                                        max_seq_len=length,
                                        config=triton_ops.AttentionConfig(num_splits=splits, **variant))
                per_head = (out[0].double() - expected).norm(dim=-1) / expected.norm(dim=-1)
                cells.append(f"{splits}:{per_head.max():.2e}/{per_head.mean():.2e}")
            print(length, variant, " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
