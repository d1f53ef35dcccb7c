"""`vllm-oscar bits`: bits per K/V element of a configuration, windows included."""

from __future__ import annotations

import argparse

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.quant.bits import bits_per_element, body_bits_per_element, row_bytes

_SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=None, help="default: head_dim")
    parser.add_argument("--scale-dtype", choices=sorted(_SCALE_DTYPES), default="fp16")
    parser.add_argument("--sink", type=int, default=DEFAULT_SINK_TOKENS)
    parser.add_argument("--recent", type=int, default=DEFAULT_RECENT_TOKENS)
    parser.add_argument(
        "--context", type=int, nargs="+", default=[4096, 32768, 131072], help="context lengths"
    )


def run(args: argparse.Namespace) -> int:
    group = args.group_size or args.head_dim
    scale_dtype = _SCALE_DTYPES[args.scale_dtype]
    body = body_bits_per_element(group, scale_dtype)
    per_row = row_bytes(args.head_dim, group, scale_dtype)
    print(
        f"head_dim={args.head_dim} group={group} scale/offset={args.scale_dtype}: "
        f"body {body:.4f} bits/element, {per_row} B per (token, head) for K or V "
        f"(BF16: {2 * args.head_dim} B, {2 * args.head_dim / per_row:.2f}x)"
    )
    print(f"{'context':>10} {'bits/element':>13}")
    for context in args.context:
        bpe = bits_per_element(context, group, scale_dtype, args.sink, args.recent)
        print(f"{context:>10} {bpe:>13.4f}")
    return 0
