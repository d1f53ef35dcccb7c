#!/usr/bin/env python3
"""Time the per-head rotation of a layer step on a GPU: torch (rotate_rows, several launches) against
the one-launch Triton kernel (oscar_rotate) and its launch variants, in CUDA-graph replays.

Qwen3-8B geometry (32 query / 8 KV heads, D 128) at decode batches and a prefill chunk; the query
direction (bf16 rows -> fp32) and the output direction (fp32 rows @ R^T -> bf16 view of the output).

    python bench/rotate.py [--json OUT] [--tokens 1 8 64 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from vllm_oscar.kernels import rotate_rows, triton_ops  # noqa: E402

#: (name, triton_ops module constants overridden) per launch variant.
VARIANTS = (
    ("default", {}),
    ("ieee", {"ROTATE_PRECISION": "ieee"}),
    ("k32", {"ROTATE_BLOCK_K": 32}),
    ("k128", {"ROTATE_BLOCK_K": 128}),
    ("cols64", {"ROTATE_BLOCK_C": 64}),
    ("m32", {"ROTATE_BLOCK_M_SMALL": 32}),
)


def _time(fn) -> float:
    return do_bench_cudagraph(fn, rep=50) * 1e3  # us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 64, 2048])
    args = parser.parse_args()
    hq, hkv, dim = 32, 8, 128
    gen = torch.Generator().manual_seed(0)
    rotation = torch.linalg.qr(torch.randn(hkv, dim, dim, generator=gen, dtype=torch.float64))[0].float().cuda()
    rows = []
    for n in args.tokens:
        query = torch.randn(n, hq, dim, device="cuda", dtype=torch.bfloat16)
        out_rot = torch.randn(n, hq, dim, device="cuda")
        output = torch.empty(n + 8, hq, dim, device="cuda", dtype=torch.bfloat16)
        q_rot = torch.empty(n, hq, dim, device="cuda")

        def torch_pair() -> None:
            rotate_rows(query, rotation, out_dtype=torch.float32)
            output[:n] = rotate_rows(out_rot, rotation, inverse=True, out_dtype=output.dtype)

        row = {"tokens": n, "torch_us": _time(torch_pair)}
        for name, overrides in VARIANTS:
            saved = {key: getattr(triton_ops, key) for key in overrides}
            for key, value in overrides.items():
                setattr(triton_ops, key, value)
            try:
                def triton_pair() -> None:
                    triton_ops.oscar_rotate(query, rotation, out=q_rot)
                    triton_ops.oscar_rotate(out_rot, rotation, inverse=True, out=output[:n])

                row[f"triton_{name}_us"] = _time(triton_pair)
            finally:
                for key, value in saved.items():
                    setattr(triton_ops, key, value)
        rows.append(row)
        print("tokens {tokens}: ".format(**row) + ", ".join(f"{k[:-3]} {v:.2f} us" for k, v in row.items()
                                                              if k.endswith("_us")), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "geometry": "qwen3-8b", "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
