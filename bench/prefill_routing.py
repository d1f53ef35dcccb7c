#!/usr/bin/env python3
"""Read `vllm-oscar bench prefill --json` files: per cell, the Triton kernel against FlashAttention prefill, and
whether the routing of THIS tree picks the faster one.

The runs to read time each cell with `--prefill-flash 0 1 --prefill-flash-split 0` (the Triton kernel and unsplit
FlashAttention), and may add `--prefill-flash 1 --prefill-flash-split 1` (the key segments) and `--prefill-flash
auto` (the default routing). For every (geometry, prefix, chunk, batch) cell the report gives the times, flash over
Triton, BF16 SDPA's time, what the current rule picks (flash_plan.CallSize.path of the cell's PrefillPlan, the
constants of this checkout: a JSON from older code is re-judged by today's rule), the measured `auto` row and its
`path` where the run had them, and how much slower the rule's pick is than the fastest path timed. A summary counts
the cells where the rule picks the fastest path and lists the others. CPU only (no GPU needed):

    python bench/prefill_routing.py docs/perf/session52/prefill_grid.json [--markdown] [--margin 0.05]

Several files: each time in the table is the median over the files that have it, and the rule is judged by each
path's median ratio to its own run's Triton time (repeated runs of one grid judge by less noisy times; runs on
different machines compare by ratios), so every run should time the Triton kernel. The summary also counts the
cells where the measured `auto` row took the rule's path (a run from before the key segments' rule has no such
row), and, where runs timed the key segments, compares them with the faster unsplit path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_oscar.config import DEFAULT_RECENT_TOKENS  # noqa: E402
from vllm_oscar.kernels.benchmark import geometry_heads  # noqa: E402
from vllm_oscar.kernels.flash_plan import PREFILL_PATHS, CallSize, PrefillPlan  # noqa: E402

Cell = tuple[str, int, int, int]  # geometry, cached prefix, chunk, batch


def cells_of(rows: list[dict]) -> dict[Cell, dict]:
    """Times per cell: "triton", "flash", "split" (FlashAttention with the key segments), "auto" (the default routing,
    key segments by its rule), "auto_split" / "auto_unsplit" (the default routing with the key segments always / never
    on: a run from before the segments' rule timed its `auto` this way) (ms; absent where not run), "bf16" and the
    auto row's "auto_path"; and, where the run timed the Triton kernel beside them, each path's time over it
    ("triton_rel", "flash_rel", "split_rel") and "unsplit_rel" (the faster of the two unsplit paths over it), so that
    runs on different machines compare by ratios."""
    cells: dict[Cell, dict] = {}
    for row in rows:
        if "ms" not in row.get("oscar", {}):
            continue
        cell = cells.setdefault((row["geometry"], row["prefix"], row["chunk"], row["batch"]), {})
        name = path_name(row)
        cell[name] = row["oscar"]["ms"]
        if name == "auto" and "path" in row:
            cell["auto_path"] = row["path"]
        if "ms" in row.get("bf16_sdpa", {}):
            cell.setdefault("bf16", row["bf16_sdpa"]["ms"])
    for times in cells.values():
        if "triton" not in times:
            continue
        for name in PREFILL_PATHS:
            if name in times:
                times[f"{name}_rel"] = times[name] / times["triton"]
        if "flash" in times:
            times["unsplit_rel"] = min(times["flash"], times["triton"]) / times["triton"]
    return cells


def path_name(row: dict) -> str:
    """The name cells_of files a row's time under, from its config (prefill_flash, prefill_flash_split; a forced
    FlashAttention row with the segments left to the rule is named by the path it took)."""
    flash, split = row["config"]["prefill_flash"], row["config"].get("prefill_flash_split", False)
    if flash is None:
        return "auto" if split is None else "auto_split" if split else "auto_unsplit"
    if not flash:
        return "triton"
    return row["path"] if split is None else "split" if split else "flash"


def rule_pick(cell: Cell) -> str:
    """One of flash_plan.PREFILL_PATHS: this checkout's default routing for the cell as the served step plans it."""
    geometry, prefix, chunk, batch = cell
    heads, kv_heads, head_dim = geometry_heads(geometry)
    starts = [index * chunk for index in range(batch + 1)]
    plan = PrefillPlan.of(starts, [prefix + chunk] * batch, DEFAULT_RECENT_TOKENS, torch.device("cpu"))
    return CallSize.of_plan(plan, heads, kv_heads, head_dim).path()


def report(cells: dict[Cell, dict], margin: float, markdown: bool) -> list[str]:
    """Table lines and the summary; a miss is a pick slower than the faster path by more than ``margin``."""
    lines = []
    if markdown:
        lines += ["| geometry | cached prefix | chunk | B | Triton ms | flash ms | flash / Triton | BF16 SDPA ms | "
                  "rule | rule / faster |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    else:
        lines.append(f"{'geometry':<14}{'prefix':>7}{'chunk':>6}{'B':>3}{'triton':>9}{'flash':>9}{'fl/tri':>7}"
                     f"{'split':>9}{'auto':>9}{'path':>7}{'bf16':>9}  rule   rule/faster")
    agree, misses, untimed, auto_judged, auto_agree = 0, [], [], 0, 0
    for cell, times in sorted(cells.items()):
        if "triton_rel" not in times or "flash_rel" not in times:
            continue
        pick = rule_pick(cell)
        if "auto_path" in times:
            auto_judged += 1
            auto_agree += times["auto_path"] == pick
        cost = None
        if f"{pick}_rel" not in times:
            untimed.append(cell)
        else:
            cost = times[f"{pick}_rel"] / min(times[f"{name}_rel"] for name in PREFILL_PATHS if f"{name}_rel" in times)
            if cost <= 1 + margin:
                agree += 1
            else:
                misses.append((cell, cost))
        cost_text = "-" if cost is None else f"{cost:.2f}"
        g, p, c, b = cell
        if markdown:
            lines.append(f"| {g} | {p} | {c} | {b} | {times['triton']:.3f} | {times['flash']:.3f} | "
                         f"{times['flash'] / times['triton']:.2f} | {_ms(times.get('bf16'))} | {pick} | {cost_text} |")
        else:
            lines.append(f"{g:<14}{p:>7}{c:>6}{b:>3}{times['triton']:>9.3f}{times['flash']:>9.3f}"
                         f"{times['flash'] / times['triton']:>7.2f}{_ms(times.get('split')):>9}"
                         f"{_ms(times.get('auto')):>9}{times.get('auto_path', '-'):>7}{_ms(times.get('bf16')):>9}"
                         f"  {pick:<7}{cost_text}")
    judged = agree + len(misses)
    lines.append(f"the rule picks the faster path (within {margin:.0%}) in {agree} of {judged} cells" +
                 ("" if not misses else "; slower: " + ", ".join(f"{g} {p}/{c}x{b} {cost:.2f}x"
                                                                  for (g, p, c, b), cost in misses)))
    if untimed:
        lines.append(f"not judged, the rule's path not timed: {len(untimed)} cells ("
                     + ", ".join(f"{g} {p}/{c}x{b}" for g, p, c, b in untimed) + ")")
    if auto_judged:
        lines.append(f"the measured auto row took the rule's path in {auto_agree} of {auto_judged} cells")
    lines += split_summary(cells, margin)
    return lines


def split_summary(cells: dict[Cell, dict], margin: float) -> list[str]:
    """Where the runs timed the key segments: per cell, the faster unsplit path's time over the key segments', both
    as ratios to the Triton kernel of their own run (median over the runs), and which cells gain or lose by more
    than ``margin``."""
    gains = {cell: times["unsplit_rel"] / times["split_rel"] for cell, times in sorted(cells.items())
             if "split_rel" in times and "unsplit_rel" in times}
    if not gains:
        return []
    wins = [(cell, gain) for cell, gain in gains.items() if gain > 1 + margin]
    losses = [(cell, gain) for cell, gain in gains.items() if gain < 1 / (1 + margin)]
    return [f"key segments against the faster unsplit path (times over each run's Triton kernel): faster by more "
            f"than {margin:.0%} in {len(wins)} of {len(gains)} cells"
            + ("" if not wins else " (" + ", ".join(f"{g} {p}/{c}x{b} {gain:.2f}x" for (g, p, c, b), gain in wins)
               + ")")
            + f"; slower in {len(losses)}"
            + ("" if not losses else f" (at worst {1 / min(gain for _, gain in losses):.2f}x the time)")]


def merge_runs(runs: list[dict[Cell, dict]]) -> dict[Cell, dict]:
    """One time per cell and path: the median over the runs that timed it; the auto path the runs' auto rows took,
    or "mixed" where they took different paths."""
    merged: dict[Cell, dict] = {}
    for cell in {cell for run in runs for cell in run}:
        present = [run[cell] for run in runs if cell in run]
        times = {name: statistics.median(run[name] for run in present if name in run)
                 for name in {name for run in present for name in run if name != "auto_path"}}
        paths = {run["auto_path"] for run in present if "auto_path" in run}
        if paths:
            times["auto_path"] = paths.pop() if len(paths) == 1 else "mixed"
        merged[cell] = times
    return merged


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="bench prefill --json files (each time: the median over the files)")
    parser.add_argument("--margin", type=float, default=0.05, help="slower than the faster path by more: a miss")
    parser.add_argument("--markdown", action="store_true", help="a docs/PERFORMANCE.md table")
    args = parser.parse_args()
    runs = []
    for path in args.json:
        data = json.loads(Path(path).read_text())
        if "prefill" not in data:
            raise SystemExit(f"{path} has no 'prefill' rows: give the --json of `vllm-oscar bench prefill`.")
        runs.append(cells_of(data["prefill"]))
    print("\n".join(report(merge_runs(runs), args.margin, args.markdown)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
