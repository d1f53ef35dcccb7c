#!/usr/bin/env python3
"""Compare the decode of several source trees timed in one GPU call (A/B): `vllm-oscar bench tune --json` reports
of each tree's default launch config, per cell the fastest reading of each tree over its repeats, the speed-up
of each tree over a base tree (> 1: faster than the base) and the spread of the repeats (the largest over the
trees of (slowest - fastest) / fastest: a speed-up inside it is noise).

    python bench/tune_ab.py --base old \
        new=docs/perf/ab_session24/call4_redux1.json,docs/perf/ab_session24/call4_redux2.json \
        old=docs/perf/ab_session24/call4_old1.json,docs/perf/ab_session24/call4_old2.json

How the reports are made (docs/decisions.md): each tree's `vllm_oscar` package in its own folder,
`bench tune` run from each folder in turn (new, old, new, old, ...) with the same arguments and one config.
"""

from __future__ import annotations

import argparse
import json


def _cells(paths: list[str]) -> dict[tuple, list[float]]:
    """(geometry, context, batch) -> OSCAR ms of every reading in the reports at paths (one config per report)."""
    cells: dict[tuple, list[float]] = {}
    for path in paths:
        with open(path) as handle:
            rows = json.load(handle)["tune"]
        seen = set()
        for row in rows:
            key = (row["geometry"], row["context"], row["batch"])
            if key in seen:
                raise SystemExit(f"{path} times {key} with more than one config; an A/B report needs one config "
                                 "per tree (run `bench tune` without knobs, or with one value each).")
            seen.add(key)
            if "oscar" in row and "ms" in row["oscar"]:
                cells.setdefault(key, []).append(row["oscar"]["ms"])
    return cells


def compare(trees: dict[str, list[str]], base: str) -> list[str]:
    """Lines of the comparison table: one per cell timed by every tree."""
    if base not in trees:
        raise SystemExit(f"--base {base} is not one of the trees given ({', '.join(trees)}).")
    readings = {name: _cells(paths) for name, paths in trees.items()}
    best = {name: {key: min(times) for key, times in cells.items()} for name, cells in readings.items()}
    keys = [key for key in best[base] if all(key in cells for cells in best.values())]
    others = [name for name in trees if name != base]
    lines = ["geometry       context   B  " + " ".join(f"{name:>9}" for name in trees) + "  "
             + " ".join(f"{name + '/' + base:>12}" for name in others) + "  spread"]
    for key in keys:
        times = " ".join(f"{best[name][key]:9.4f}" for name in trees)
        ratios = " ".join(f"{best[base][key] / best[name][key]:12.3f}" for name in others)
        spread = max(max(cells[key]) / min(cells[key]) - 1.0 for cells in readings.values())
        lines.append(f"{key[0]:<14} {key[1]:>7} {key[2]:>3}  {times}  {ratios}  {100 * spread:5.1f}%")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", metavar="TREE=REPORT[,REPORT...]",
                        help="a tree's name and its `bench tune --json` reports (its repeats), comma-separated")
    parser.add_argument("--base", required=True, help="the tree the speed-ups are over")
    args = parser.parse_args()
    trees = {}
    for spec in args.trees:
        name, _, paths = spec.partition("=")
        if not name or not paths:
            parser.error(f"{spec!r}: write TREE=REPORT[,REPORT...]")
        trees[name] = paths.split(",")
    print("\n".join(compare(trees, args.base)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
