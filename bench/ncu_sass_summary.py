#!/usr/bin/env python3
"""Summarise an Nsight Compute source page (`<case>_sass.csv` of bench/ncu_decode.sh): where a kernel's warps wait.

Prints the stall reasons over all samples, the share of samples per region of SASS lines (with the most times any
line of the region ran: the split loop's lines run once per tile, the prologue's once per program, the window path's
once per window program), and the lines with the most samples and their main stall reason.

    python bench/ncu_sass_summary.py /tmp/ncu/qwen3-8b_32768_b1_sass.csv --region 200 --top 20
"""

from __future__ import annotations

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read_lines(path: str) -> tuple[list[dict], list[str]]:
    """The SASS lines of the first kernel in the file: dicts of source, samples, executions and per-reason samples."""
    with open(path, newline="") as handle:
        rows = list(csv.reader(handle))
    header = next(i for i, row in enumerate(rows) if SAMPLES in row)
    names = rows[header]
    reasons = [n for n in names if n.startswith("stall_") and "Not Issued" not in n]
    lines = []
    for row in rows[header + 1:]:
        if len(row) < len(names):
            break  # the next kernel's block, or the end
        cell = dict(zip(names, row))
        lines.append({"source": cell["Source"].strip(), "samples": int(cell[SAMPLES] or 0),
                      "executed": int(cell[EXECUTED] or 0),
                      "reasons": {r[len("stall_"):]: int(cell[r] or 0) for r in reasons}})
    return lines, [r[len("stall_"):] for r in reasons]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="an ncu --page source --csv --print-source sass export")
    parser.add_argument("--region", type=int, default=200, help="SASS lines per region (default 200)")
    parser.add_argument("--top", type=int, default=15, help="lines with the most samples to print (default 15)")
    args = parser.parse_args()

    lines, _ = read_lines(args.csv)
    total = sum(line["samples"] for line in lines) or 1
    by_reason = collections.Counter()
    for line in lines:
        by_reason.update(line["reasons"])
    print(f"{total} samples over {len(lines)} SASS lines")
    for reason, count in by_reason.most_common(10):
        print(f"  {reason:18s} {100 * count / total:5.1f}%")
    print(f"by region of {args.region} lines (share of samples, most executions of a line):")
    for start in range(0, len(lines), args.region):
        region = lines[start:start + args.region]
        share = sum(line["samples"] for line in region) / total
        if share > 0:
            print(f"  {start:5d}-{start + len(region) - 1:5d} {100 * share:5.1f}%  "
                  f"{max(l['executed'] for l in region)}")
    print("lines with the most samples:")
    ranked = sorted(range(len(lines)), key=lambda i: -lines[i]["samples"])[:args.top]
    for i in ranked:
        line = lines[i]
        main_reason = max(line["reasons"], key=line["reasons"].get)
        print(f"  {i:5d} {100 * line['samples'] / total:5.1f}% ran {line['executed']:7d}  {main_reason:14s} "
              f"{line['source'][:70]}")


if __name__ == "__main__":
    main()
