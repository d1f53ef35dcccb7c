#!/usr/bin/env python3
"""The fastest any one-launch decode could be: time a plain streaming read of exactly the bytes an OSCAR decode must
read (bench decode's byte count: codes, scales, BF16 windows, query, output), as CUDA-graph replays over as many
copies as `bench decode` uses, beside the served OSCAR decode and the SDPA baselines of the same run.

A contiguous stream summed by many programs is the best case of every access pattern (no block table, no compute),
so `best SDPA / floor` bounds the speed-up that any kernel reading those bytes in one launch can reach: where it is
below an issue target, no decode kernel meets that target on this device. Several launch shapes are timed and the
fastest is the floor.

    python bench/decode_floor.py --json floor.json     # the issue's target cells (>= 32K every batch, 4K B >= 8)
    python bench/decode_markdown.py --floor floor.json  # how far each unmet cell is from the floor
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS  # noqa: E402
from vllm_oscar.kernels import benchmark  # noqa: E402
from vllm_oscar.kernels.benchmark import (  # noqa: E402
    GEOMETRIES,
    OscarCase,
    error_summary,
    layers_for,
    measure_bandwidth,
    oscar_bytes,
    run_case,
    time_graph,
)
from vllm_oscar.kernels.layout import PageLayout  # noqa: E402
from vllm_oscar.provenance import source_digest  # noqa: E402

from decode_markdown import cell_target  # noqa: E402

#: (words per program, warps per program) of the streaming launches tried; the fastest is the floor.
STREAM_SHAPES: tuple[tuple[int, int], ...] = ((256, 1), (512, 1), (1024, 1), (2048, 2), (4096, 1), (4096, 4),
                                                 (16384, 4), (65536, 8))
BLOCK_SIZE = 64


@triton.jit
def stream_sum_kernel(x_ptr, out_ptr, n_words, CHUNK: tl.constexpr, STEP: tl.constexpr):
    """out[pid] = sum of int32 words [pid CHUNK, (pid + 1) CHUNK) of x (n_words in all), STEP words per load."""
    pid = tl.program_id(0)
    offs = tl.arange(0, STEP)
    acc = tl.zeros([STEP], tl.int32)
    start = pid.to(tl.int64) * CHUNK
    for k in range(0, CHUNK, STEP):
        idx = start + k + offs
        acc += tl.load(x_ptr + idx, mask=idx < n_words, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def decode_bytes(geometry: str, length: int, batch: int) -> int:
    """bench decode's byte count of one OSCAR decode (benchmark.oscar_bytes) without allocating a case."""
    hq, hkv, dim = GEOMETRIES[geometry]
    window = min(length, min(DEFAULT_SINK_TOKENS, length)
                 + min(DEFAULT_RECENT_TOKENS, max(0, length - DEFAULT_SINK_TOKENS)))
    case = OscarCase(PageLayout(dim, dim, BLOCK_SIZE, torch.float16), [], [], [], None, None, None, None, window)
    return oscar_bytes(case, batch, length, hkv, hq, dim)


def floor_ms(nbytes: int, reps: int, device: torch.device) -> tuple[float, str]:
    """(fastest ms per streaming read of nbytes, its launch shape), over layers_for(nbytes) buffer copies."""
    words = -(-nbytes // 4)
    copies = [torch.ones(words, dtype=torch.int32, device=device) for _ in range(layers_for(nbytes))]
    best = (float("inf"), "")
    for chunk, warps in STREAM_SHAPES:
        programs = -(-words // chunk)
        out = torch.empty(programs, dtype=torch.int32, device=device)
        step = min(chunk, 256 * warps)

        def make(x):
            return lambda: stream_sum_kernel[(programs,)](x, out, words, CHUNK=chunk, STEP=step, num_warps=warps)

        ms = time_graph([make(x) for x in copies], reps)
        best = min(best, (ms, f"{chunk} words x {warps} warps, {programs} programs"))
    del copies
    torch.cuda.empty_cache()
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", nargs="+", default=sorted(GEOMETRIES), choices=sorted(GEOMETRIES))
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 65536, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--allocator", choices=sorted(benchmark.ALLOCATOR_SETTINGS), default="expandable",
                        help="PyTorch's CUDA allocator for the run (as `vllm-oscar bench --allocator`)")
    args = parser.parse_args()
    allocator = benchmark.configure_allocator(args.allocator)
    device = torch.device("cuda")
    bandwidth = measure_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}; read bandwidth {bandwidth['read_GBps']:.0f} GB/s; ms per layer")
    print("geometry context batch | oscar best_sdpa floor | oscar_x ceiling_x target | floor/oscar")
    rows = []
    for geometry in args.geometry:
        for length in args.contexts:
            for batch in args.batches:
                try:
                    row = run_case(geometry, length, batch, BLOCK_SIZE, args.reps, device, bandwidth)
                    nbytes = decode_bytes(geometry, length, batch)
                    assert nbytes == row["oscar"]["bytes"], (nbytes, row["oscar"]["bytes"])
                    ms, shape = floor_ms(nbytes, args.reps, device)
                except Exception as error:  # noqa: BLE001 - reported per cell
                    rows.append({"geometry": geometry, "context": length, "batch": batch,
                                 "error": error_summary(error)})
                    print(f"{geometry} {length} {batch} ERROR {rows[-1]['error']}", flush=True)
                    continue
                sdpa = row["best_sdpa"]["ms"]
                row["floor"] = {"ms": ms, "shape": shape, "GBps": nbytes / ms / 1e6,
                                "ceiling_speedup": sdpa / ms, "target": cell_target(length, batch),
                                "oscar_share_of_floor": ms / row["oscar"]["ms"]}
                rows.append(row)
                goal = row["floor"]["target"]
                print(f"{geometry} {length} {batch} | {row['oscar']['ms']:.4f} {sdpa:.4f} {ms:.4f} | "
                      f"{sdpa / row['oscar']['ms']:.2f} {sdpa / ms:.2f} {goal if goal else '-'} | "
                      f"{ms / row['oscar']['ms']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "source_digest": source_digest(),
                       "bandwidth": bandwidth, "argv": sys.argv, "allocator": allocator, "rows": rows}, handle,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
