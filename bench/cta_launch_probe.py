#!/usr/bin/env python3
"""How long a CUDA graph replay takes for a grid of tiny programs, by program count and warps per program: the
launch cost under gluon_decode's one-warp split grids (docs/decisions.md: the split grid of
Qwen3-8B batch 8 with no tile to walk still takes ~5-6 us).

    python bench/cta_launch_probe.py [--programs 528 1056 2112 4224] [--warps 1 2 4]

Each program loads one int32 per thread and stores it back (no other work); a graph holds LAUNCHES launches of the
same grid, and the time per launch is printed for each (programs, warps).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm_oscar.kernels.benchmark import time_graph  # noqa: E402

#: Launches per timed graph (their mean is printed).
LAUNCHES = 20


@triton.jit
def touch_kernel(src_ptr, dst_ptr, THREADS: tl.constexpr):
    """dst[p * THREADS + t] = src[p * THREADS + t] + 1 for program p and its THREADS lanes."""
    offs = tl.program_id(0) * THREADS + tl.arange(0, THREADS)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs) + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, nargs="+", default=[528, 1056, 2112, 4224])
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/cta_launch_probe.py times launches on a CUDA GPU; none is visible.")
    print(f"device: {torch.cuda.get_device_name()}; us per launch (graph of {LAUNCHES} launches)")
    print("programs  warps  us")
    for programs in args.programs:
        for warps in args.warps:
            threads = 32 * warps
            src = torch.zeros(programs * threads, dtype=torch.int32, device="cuda")
            dst = torch.empty_like(src)
            fns = [lambda: touch_kernel[(programs,)](src, dst, THREADS=threads, num_warps=warps)] * LAUNCHES
            print(f"{programs:8d} {warps:6d} {1e3 * time_graph(fns, args.reps):6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
