"""Render a `vllm-oscar bench decode --json` report as the markdown table of docs/PERFORMANCE.md.

    python bench/decode_markdown.py docs/perf/decode_h200_session13.json \
        --compare docs/perf/decode_h200_graph_tma.json --compare-label 7d3cf91

One row per case: split count, OSCAR and baseline times (ms), % of the measured read bandwidth, the
speed-ups over the fastest SDPA backend and the paged BF16 Triton decode, the byte-count ideal, and
(--compare) the speed-up over the fastest SDPA of the same case in an older report. Then one summary
line per geometry with the ranges the issue's targets name (4K, >= 32K; B = 1 and B >= 8).

    python bench/decode_markdown.py --targets RUN1.json RUN2.json RUN3.json

instead lists every cell the issue sets a target for (4K batch 1: not slower than the fastest SDPA; 4K batch >= 8:
>= 2x; >= 32K, every batch: >= 5x) with its speed-up in each run and whether the target is met in all, some or none
of them (repeats of one table, so that a cell on the line reads as such). With --markdown the same as the table of
docs/PERFORMANCE.md's status (the times the target asks for, how far each cell is from it), with --png PATH as a
plot of every cell's speed-up over its target:

    python bench/decode_markdown.py --targets --markdown --png docs/perf/targets.png RUN1.json RUN2.json RUN3.json

With --floor the reports are `bench/decode_floor.py --json` files, and the table is docs/PERFORMANCE.md's "How far
the unmet cells are from the device": per target cell that misses its target in any run, the fastest SDPA, the
time the target asks for, the floor (the fastest streaming read of the cell's bytes) and OSCAR (us), the share of
the floor's speed the target needs and OSCAR's share, most demanding first:

    python bench/decode_markdown.py --floor FLOOR1.json FLOOR2.json
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

LONG_CONTEXT = 32768  # the ">= 32K" targets
SHORT_CONTEXT = 4096
#: The issue's speed-up targets over the fastest SDPA: at >= LONG_CONTEXT every batch, at SHORT_CONTEXT batch >= 8
#: and batch 1.
LONG_TARGET = 5.0
SHORT_BATCH_TARGET = 2.0
SHORT_SINGLE_TARGET = 1.0


def _ms(entry: Optional[dict]) -> str:
    """A timing cell: ms to 4 decimals, or 'err' where the backend did not run."""
    return f"{entry['ms']:.4f}" if entry and "ms" in entry else "err"


def _key(row: dict) -> tuple:
    return row["geometry"], row["context"], row["batch"]


def table(rows: list[dict], compare: dict[tuple, dict], label: str) -> str:
    """The markdown table of one report (rows as `bench decode` writes them; * after a split count: a measured plan
    of the device's table, measured_plans)."""
    head = ("| geometry | context | B | splits | OSCAR ms | % read BW | cuDNN ms | flash ms | paged BF16 Triton ms "
            "| x best SDPA | x BF16 Triton | ideal x |")
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if compare:
        head += f" x best SDPA at {label} |"
        rule += "---:|"
    lines = [head, rule]
    for r in rows:
        if "oscar" not in r:
            continue
        sdpa = r.get("sdpa", {})
        splits = f"{r['oscar'].get('splits', '')}{'*' if r['oscar'].get('measured_plan') else ''}"
        cells = [r["geometry"], str(r["context"]), str(r["batch"]), splits,
                 f"{r['oscar']['ms']:.4f}", f"{r['oscar']['pct_read_bw']:.0f}%", _ms(sdpa.get("cudnn")),
                 _ms(sdpa.get("flash")), _ms(r.get("bf16_triton")), f"**{r['speedup_vs_best_sdpa']:.2f}**",
                 f"{r['speedup_vs_bf16_triton']:.2f}", f"{r['ideal_speedup']:.2f}"]
        if compare:
            old = compare.get(_key(r))
            cells.append(f"{old['speedup_vs_best_sdpa']:.2f}" if old and "speedup_vs_best_sdpa" in old else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_ranges(rows: list[dict]) -> str:
    """Per geometry: the speed-up ranges over the fastest SDPA at 4K and >= 32K, B = 1 and B >= 8."""
    out = []
    for geometry in sorted({r["geometry"] for r in rows}):
        sel = [r for r in rows if r["geometry"] == geometry and "speedup_vs_best_sdpa" in r]

        def span(keep) -> str:
            values = [r["speedup_vs_best_sdpa"] for r in sel if keep(r)]
            return f"{min(values):.2f}-{max(values):.2f}x" if values else "-"

        out.append(f"{geometry}: 4K B=1 {span(lambda r: r['context'] == SHORT_CONTEXT and r['batch'] == 1)}, "
                   f"4K B>=8 {span(lambda r: r['context'] == SHORT_CONTEXT and r['batch'] >= 8)}, "
                   f">=32K B=1 {span(lambda r: r['context'] >= LONG_CONTEXT and r['batch'] == 1)}, "
                   f">=32K B>=8 {span(lambda r: r['context'] >= LONG_CONTEXT and r['batch'] >= 8)}, "
                   f"best % read BW {max(r['oscar']['pct_read_bw'] for r in sel):.0f}%")
    return "\n".join(out)


def cell_target(context: int, batch: int) -> Optional[float]:
    """The speed-up the issue asks of a (context, batch) cell, or None where it sets none (e.g. 16K)."""
    if context >= LONG_CONTEXT:
        return LONG_TARGET
    if context == SHORT_CONTEXT:
        return SHORT_BATCH_TARGET if batch >= 8 else SHORT_SINGLE_TARGET
    return None


def target_readings(runs: list[list[dict]]) -> list[tuple[tuple, float, list[dict]]]:
    """Per target cell present in the first run (in its order): (geometry, context, batch), the target, and the
    cell's row in each run that has it (rows with a speed-up over the fastest SDPA only)."""
    by_run = [{_key(r): r for r in rows if "speedup_vs_best_sdpa" in r} for rows in runs]
    readings = []
    for key in by_run[0]:
        target = cell_target(key[1], key[2])
        if target is not None:
            readings.append((key, target, [run[key] for run in by_run if key in run]))
    return readings


def _verdict(values: list[float], target: float) -> str:
    """"all" / "some" / "none": how many of a cell's speed-ups reach its target."""
    met = sum(value >= target for value in values)
    return "all" if met == len(values) else "some" if met else "none"


def target_verdicts(runs: list[list[dict]]) -> list[tuple[tuple, float, list[float], str]]:
    """Per target cell present in the first run (in its order): (geometry, context, batch), the target, the
    speed-up over the fastest SDPA in each run that has the cell, and "all" / "some" / "none" of them meeting it."""
    verdicts = []
    for key, target, rows in target_readings(runs):
        values = [r["speedup_vs_best_sdpa"] for r in rows]
        verdicts.append((key, target, values, _verdict(values, target)))
    return verdicts


def targets_report(runs: list[list[dict]]) -> str:
    """target_verdicts as text: one line per cell, then the counts."""
    verdicts = target_verdicts(runs)
    lines = [f"{g:14s} {c:7d} B={b:<3d} target {t:.0f}x: {' / '.join(f'{v:.2f}' for v in values)}  {verdict}"
             for (g, c, b), t, values, verdict in verdicts]
    counts = {name: sum(v[3] == name for v in verdicts) for name in ("all", "some", "none")}
    lines.append(f"{len(verdicts)} target cells over {len(runs)} run(s): met in all {counts['all']}, in some "
                 f"{counts['some']}, in none {counts['none']}")
    return "\n".join(lines)


def _span(values: list[float], digits: int) -> str:
    """'low-high' of a cell's readings (one value where they agree at that precision)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def targets_markdown(runs: list[list[dict]]) -> str:
    """The target cells as a markdown table: per cell its target, the speed-ups over the fastest SDPA, OSCAR's and
    the fastest SDPA's times (us, low-high over the runs), the OSCAR time the target asks for (the fastest SDPA's
    time over the target, per run) and how much faster OSCAR would have to be at the median run (0% where met)."""
    lines = ["| geometry | context | B | target | x best SDPA | OSCAR us | best SDPA us | OSCAR us for the target "
             "| faster by | met in runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (geometry, context, batch), target, rows in target_readings(runs):
        speedups = [r["speedup_vs_best_sdpa"] for r in rows]
        oscar = [1e3 * r["oscar"]["ms"] for r in rows]
        sdpa = [1e3 * r["best_sdpa"]["ms"] for r in rows]
        needed = [t / target for t in sdpa]
        short = sorted(o / n - 1.0 for o, n in zip(oscar, needed))[len(rows) // 2]
        verdict = _verdict(speedups, target)
        lines.append(f"| {geometry} | {context // 1024}K | {batch} | {target:.0f}x | {_span(speedups, 2)} "
                     f"| {_span(oscar, 1)} | {_span(sdpa, 1)} | {_span(needed, 1)} "
                     f"| {max(short, 0.0):.0%} | {'**' + verdict + '**' if verdict == 'all' else verdict} |")
    return "\n".join(lines)


def floor_markdown(runs: list[list[dict]]) -> str:
    """The target cells short of their target in any run, as a markdown table (us, low-high over the runs): the
    fastest SDPA, the OSCAR time the target asks for, the floor and OSCAR; then the share of the floor's speed the
    target needs (floor / target time) and OSCAR's (floor / OSCAR time). Rows with no floor (failed cells) are
    skipped; the most demanding cell (median needed share) first."""
    rows_out = []
    floored = [[r for r in rows if "floor" in r] for rows in runs]
    for (geometry, context, batch), target, rows in target_readings(floored):
        if _verdict([r["speedup_vs_best_sdpa"] for r in rows], target) == "all":
            continue
        sdpa = [1e3 * r["best_sdpa"]["ms"] for r in rows]
        needed = [t / target for t in sdpa]
        floor = [1e3 * r["floor"]["ms"] for r in rows]
        oscar = [1e3 * r["oscar"]["ms"] for r in rows]
        need_share = [f / n for f, n in zip(floor, needed)]
        own_share = [f / o for f, o in zip(floor, oscar)]
        rows_out.append((sorted(need_share)[len(rows) // 2],
                         f"| {geometry} {context // 1024}K B={batch} | {_span(sdpa, 1)} | {_span(needed, 1)} "
                         f"| {_span(floor, 1)} | {_span(oscar, 1)} | {_span(need_share, 2)} | {_span(own_share, 2)} |"))
    lines = ["| unmet cell | best SDPA us | target us | floor us | OSCAR us | needed share of floor "
             "| OSCAR's share |", "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [line for _, line in sorted(rows_out, key=lambda item: -item[0])])


def targets_plot(runs: list[list[dict]], path: str) -> None:
    """Every target cell's speed-up over the fastest SDPA divided by its target (bars: the median run, whiskers:
    the lowest and highest), one panel per geometry, grouped by context with one bar per batch; cells at or above
    1 meet their target in that run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    readings = target_readings(runs)
    geometries = list(dict.fromkeys(key[0] for key, _, _ in readings))
    batches = sorted({key[2] for key, _, _ in readings})
    fig, axes = plt.subplots(1, len(geometries), figsize=(7 * len(geometries), 4.5), squeeze=False, sharey=True)
    width = 0.8 / len(batches)
    for ax, geometry in zip(axes[0], geometries):
        cells = [(key, target, rows) for key, target, rows in readings if key[0] == geometry]
        contexts = sorted({key[1] for key, _, _ in cells})
        for n, batch in enumerate(batches):
            xs, mids, lows, highs = [], [], [], []
            for (_, context, b), target, rows in cells:
                if b != batch:
                    continue
                ratios = sorted(r["speedup_vs_best_sdpa"] / target for r in rows)
                mid = ratios[len(ratios) // 2]
                xs.append(contexts.index(context) + (n - (len(batches) - 1) / 2) * width)
                mids.append(mid)
                lows.append(mid - ratios[0])
                highs.append(ratios[-1] - mid)
            bars = ax.bar(xs, mids, width, yerr=[lows, highs], color=f"C{n}", capsize=2)
            for bar, mid in zip(bars, mids):
                if mid < 1.0:  # short of the target at the median run
                    bar.set_hatch("//")
                    bar.set_alpha(0.55)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
        ax.set_xlabel("context (target: 4K B=1 1x, 4K B>=8 2x, >=32K 5x over the fastest BF16 SDPA)")
        ax.set_title(f"{geometry}: speed-up / target ({len(runs)} run(s); hatched: short at the median)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend([Patch(color=f"C{n}") for n in range(len(batches))], [f"B={b}" for b in batches], fontsize=8)
    axes[0][0].set_ylabel("speed-up over the fastest SDPA / target")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="+", help="a `bench decode --json` file (several with --targets)")
    parser.add_argument("--targets", action="store_true",
                        help="list the cells the issue sets targets for, met in all / some / none of the reports")
    parser.add_argument("--markdown", action="store_true", help="with --targets: a markdown table with times")
    parser.add_argument("--png", help="with --targets: also plot every cell's speed-up over its target to this file")
    parser.add_argument("--floor", action="store_true",
                        help="the reports are bench/decode_floor.py files: how far each unmet cell is from the floor")
    parser.add_argument("--compare", help="an older report: adds its speed-up over the fastest SDPA per case")
    parser.add_argument("--compare-label", default="the older report", help="the older report's name in the header")
    args = parser.parse_args()
    runs = []
    for path in args.report:
        with open(path) as f:
            runs.append(json.load(f)["rows" if args.floor else "decode"])
    if args.floor:
        if args.targets or args.markdown or args.png or args.compare:
            parser.error("--floor renders its own table: leave out --targets, --markdown, --png and --compare")
        print(floor_markdown(runs))
        return
    if (args.markdown or args.png) and not args.targets:
        parser.error("--markdown and --png go with --targets")
    if args.targets:
        print(targets_markdown(runs) if args.markdown else targets_report(runs))
        if args.png:
            targets_plot(runs, args.png)
        return
    if len(runs) > 1:
        parser.error("several reports need --targets (the table renders one report)")
    rows = runs[0]
    compare = {}
    if args.compare:
        with open(args.compare) as f:
            compare = {_key(r): r for r in json.load(f)["decode"]}
    order = sorted(rows, key=lambda r: (r["geometry"] != "qwen3-8b", r["geometry"], r["context"], r["batch"]))
    print(table(order, compare, args.compare_label))
    print()
    print(target_ranges(order))


if __name__ == "__main__":
    main()
