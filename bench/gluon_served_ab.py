#!/usr/bin/env python3
"""Time the served decode with gluon_decode's kernel (the default, AttentionConfig(gluon_splits=None)) against
int2_split_kernel (gluon_splits=False) side by side in one run: gluon / triton / gluon / triton per case, graph
replays at blocks of 64 as `bench decode` times them, with each variant's per-kernel times (docs/decisions.md
G2). GPU only.

    python bench/gluon_served_ab.py --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from vllm_oscar.kernels import triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import format_breakdown, measure_bandwidth, run_case  # noqa: E402

#: (geometry, context, batch) of the A/B (session 18's, and SmolLM2 32K B=8, 128K B=1 since session 19).
CASES = (("qwen3-8b", 4096, 1), ("qwen3-8b", 4096, 8), ("qwen3-8b", 4096, 64), ("qwen3-8b", 32768, 1),
         ("qwen3-8b", 32768, 8), ("qwen3-8b", 32768, 64), ("qwen3-8b", 131072, 1), ("qwen3-8b", 131072, 32),
         ("smollm2-135m", 4096, 8), ("smollm2-135m", 32768, 1), ("smollm2-135m", 32768, 8),
         ("smollm2-135m", 32768, 64), ("smollm2-135m", 131072, 1))
VARIANTS = (("gluon", triton_ops.AttentionConfig()), ("triton", triton_ops.AttentionConfig(gluon_splits=False)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    rows = []
    for geometry, context, batch in CASES:
        for name, config in VARIANTS * 2:
            row = run_case(geometry, context, batch, 64, args.reps, device, bandwidth, oscar_config=config,
                           with_baselines=False, breakdown=True)
            oscar = row["oscar"]
            print(f"{geometry} {context} {batch} {name}: {oscar['ms']:.4f} ms, {oscar['splits']} splits; "
                  f"{format_breakdown(oscar.get('breakdown', {}))}", flush=True)
            rows.append({"geometry": geometry, "context": context, "batch": batch, "variant": name, "oscar": oscar})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
