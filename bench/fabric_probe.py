#!/usr/bin/env python3
"""Read-only probe of the H200's memory side for the access pattern of the INT2 decode (docs/notes/kernels.md,
"The L2 side"): every program of one Triton kernel reads one contiguous region of REGION bytes, at a block index
taken in order (a contiguous stream, as cuDNN's BF16 decode reads its K/V) or from a random permutation (the
shuffled block tables of a long-running server), and sums it; the kernel also prefetches the next region into L2
when asked, as the decode splits do. Prints the achieved read bandwidth per variant, timed as CUDA-graph replays;
under Nsight Compute (bench/ncu_breakdown.sh with KERNEL=region_sum_kernel and CASES of "--probe" flags) it shows
what the L2 fabric costs per DRAM byte for each pattern.

    python bench/fabric_probe.py                       # the table: regions of 4608 / 9216 / 18432 B, ordered / shuffled
    python bench/fabric_probe.py --only 4608:shuffled  # one variant, for a profiler
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: Bytes read per probe run (several times the L2).
PROBE_BYTES = 4 << 30
#: Region sizes: one (block of 64 positions, KV head) region at D 128 (72 B per position), two and four of them.
REGIONS = (4608, 9216, 18432)
#: Bytes one program loads per step (a [rows, 16] int32 tile per step: 64 B per row, 16 lanes x 4 B).
STEP_BYTES = 1024


@triton.jit
def region_sum_kernel(x_ptr, order_ptr, out_ptr, REGION: tl.constexpr, STEP: tl.constexpr, PREFETCH: tl.constexpr):
    """out[pid] = sum of region order[pid]'s int32 words; PREFETCH: prefetch.global.L2 region order[pid + 1] first."""
    pid = tl.program_id(0)
    block = tl.load(order_ptr + pid).to(tl.int64)
    base = x_ptr + block * (REGION // 4)
    if PREFETCH:
        nxt = tl.load(order_ptr + pid + 1).to(tl.int64)
        lines = tl.arange(0, triton.next_power_of_2(REGION // 128))
        addr = (x_ptr + nxt * (REGION // 4) + lines * 32).to(tl.int64, bitcast=True)
        want = (lines * 128 < REGION).to(tl.int32)
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                                  "=r,l,r", [addr, want], dtype=tl.int32, is_pure=False, pack=1)
    words = tl.arange(0, STEP // 4)
    acc = tl.zeros([STEP // 4], tl.int32)
    for off in tl.static_range(0, REGION, STEP):
        if off + STEP <= REGION:  # whole steps unmasked (vector loads); the last partial step masked
            acc += tl.load(base + off // 4 + words)
        else:
            acc += tl.load(base + off // 4 + words, mask=off + words * 4 < REGION, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def run(region: int, shuffled: bool, prefetch: bool, reps: int, device: torch.device) -> float:
    """Achieved read bandwidth (GB/s) of one variant: graph replays of the kernel over PROBE_BYTES."""
    from vllm_oscar.kernels.benchmark import time_graph

    blocks = PROBE_BYTES // region
    x = torch.randint(0, 1 << 30, (blocks * region // 4,), dtype=torch.int32, device=device)
    order = torch.randperm(blocks, device=device) if shuffled else torch.arange(blocks, device=device)
    order = torch.cat([order, order[:1]]).to(torch.int32)  # the prefetch of the last program reads one past
    out = torch.empty(blocks, dtype=torch.int32, device=device)
    fn = lambda: region_sum_kernel[(blocks,)](x, order, out, REGION=region, STEP=STEP_BYTES,  # noqa: E731
                                              PREFETCH=prefetch, num_warps=1)
    ms = time_graph([fn], reps)
    return blocks * region / ms / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="REGION:ordered|shuffled[:prefetch]: one variant (for a profiler)")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    device = torch.device("cuda")
    if args.only:
        region, pattern, *rest = args.only.split(":")
        variants = [(int(region), pattern == "shuffled", bool(rest))]
    else:
        variants = [(r, s, p) for r in REGIONS for s in (False, True) for p in (False, True)]
    for region, shuffled, prefetch in variants:
        gbps = run(region, shuffled, prefetch, args.reps, device)
        print(f"region {region} B, {'shuffled' if shuffled else 'ordered'}, prefetch {int(prefetch)}: "
              f"{gbps:.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
