#!/usr/bin/env python3
"""Read-only probe of the H200's memory side for the access pattern of the INT2 decode (docs/decisions.md): every program of one Triton kernel reads one contiguous region of REGION bytes, at a block index
taken in order (a contiguous stream, as cuDNN's BF16 decode reads its K/V) or from a random permutation (the
shuffled block tables of a long-running server), and sums it; the kernel also prefetches the next region into L2
when asked, as the decode splits do. Prints the achieved read bandwidth per variant, timed as CUDA-graph replays;
under Nsight Compute it shows what the L2 fabric costs per DRAM byte for each pattern. Two more variants separate the
decode kernel's traits: --pieces reads a 4608-B region as the decode reads one tile (K codes 2 KB, V codes 2 KB, four
128-B scale planes, six loads), and --work N adds N dependent integer steps per loaded word, which slows the
programs down to a decode-like DRAM throughput without changing what they read.

    python bench/fabric_probe.py                       # the table: regions of 4608 / 9216 / 18432 B, ordered / shuffled
    python bench/fabric_probe.py --only 4608:shuffled  # one variant, for a profiler (plus --pieces / --work N)
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
#: Bytes one program loads per step (a [256] int32 vector: 8 words per lane of its one warp).
STEP_BYTES = 1024
#: The decode's loads of one 64-position tile at D 128 (--pieces): K codes and V codes (2 KB each), then the four
#: scale / offset planes (128 B each), six loads.
CODE_PIECE_BYTES: tl.constexpr = tl.constexpr(2048)
PLANE_PIECE_BYTES: tl.constexpr = tl.constexpr(128)
TILE_BYTES = 2 * CODE_PIECE_BYTES.value + 4 * PLANE_PIECE_BYTES.value


@triton.jit
def _work(x, STEPS: tl.constexpr):
    """x after STEPS dependent multiply-adds per element (x * x + 1: a chain no compiler folds, which delays the
    program and does nothing else)."""
    for _ in tl.static_range(STEPS):
        x = x * x + 1
    return x


@triton.jit
def region_sum_kernel(x_ptr, order_ptr, out_ptr, REGION: tl.constexpr, STEP: tl.constexpr, PREFETCH: tl.constexpr,
                      PIECES: tl.constexpr = False, WORK: tl.constexpr = 0):
    """out[pid] = sum of region order[pid]'s int32 words (after WORK steps of _work each); PREFETCH: prefetch.global.L2
    region order[pid + 1] first; PIECES: read the region as the decode reads a tile (CODE_PIECE_BYTES, PLANE_PIECE_BYTES)."""
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
    if PIECES:  # one decode tile: two code pieces, four planes; REGION is their total (TILE_BYTES)
        code = tl.arange(0, CODE_PIECE_BYTES // 4)
        plane = tl.arange(0, PLANE_PIECE_BYTES // 4)
        acc = tl.zeros([1], tl.int32)
        for piece in tl.static_range(2):
            acc += tl.sum(_work(tl.load(base + piece * (CODE_PIECE_BYTES // 4) + code), WORK), axis=0)
        for piece in tl.static_range(4):
            offset = (2 * CODE_PIECE_BYTES + piece * PLANE_PIECE_BYTES) // 4
            acc += tl.sum(_work(tl.load(base + offset + plane), WORK), axis=0)
    else:
        words = tl.arange(0, STEP // 4)
        acc = tl.zeros([STEP // 4], tl.int32)
        for off in tl.static_range(0, REGION, STEP):
            if off + STEP <= REGION:  # whole steps unmasked (vector loads); the last partial step masked
                acc += _work(tl.load(base + off // 4 + words), WORK)
            else:
                acc += _work(tl.load(base + off // 4 + words, mask=off + words * 4 < REGION, other=0), WORK)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def run(region: int, shuffled: bool, prefetch: bool, reps: int, device: torch.device, pieces: bool = False,
        work: int = 0) -> float:
    """Achieved read bandwidth (GB/s) of one variant: graph replays of the kernel over PROBE_BYTES."""
    if pieces and region != TILE_BYTES:
        raise ValueError(f"--pieces reads one decode tile of {TILE_BYTES} B; got regions of {region} B")
    from vllm_oscar.kernels.benchmark import time_graph

    blocks = PROBE_BYTES // region
    x = torch.randint(0, 1 << 30, (blocks * region // 4,), dtype=torch.int32, device=device)
    order = torch.randperm(blocks, device=device) if shuffled else torch.arange(blocks, device=device)
    order = torch.cat([order, order[:1]]).to(torch.int32)  # the prefetch of the last program reads one past
    out = torch.empty(blocks, dtype=torch.int32, device=device)
    fn = lambda: region_sum_kernel[(blocks,)](x, order, out, REGION=region, STEP=STEP_BYTES,  # noqa: E731
                                              PREFETCH=prefetch, PIECES=pieces, WORK=work, num_warps=1)
    ms = time_graph([fn], reps)
    return blocks * region / ms / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="REGION:ordered|shuffled[:prefetch]: one variant (for a profiler)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pieces", action="store_true", help="read each region as the decode reads one tile")
    parser.add_argument("--work", type=int, default=0, help="dependent integer steps per loaded word")
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
        gbps = run(region, shuffled, prefetch, args.reps, device, args.pieces, args.work)
        print(f"region {region} B, {'shuffled' if shuffled else 'ordered'}, prefetch {int(prefetch)}, pieces "
              f"{int(args.pieces)}, work {args.work}: {gbps:.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
