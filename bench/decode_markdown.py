"""Render a `vllm-oscar bench decode --json` report as the markdown table of docs/PERFORMANCE.md.

    python bench/decode_markdown.py docs/perf/decode_h200_session13.json \
        --compare docs/perf/decode_h200_graph_tma.json --compare-label 7d3cf91

One row per case: split count, OSCAR and baseline times (ms), % of the measured read bandwidth, the
speed-ups over the fastest SDPA backend and the paged BF16 Triton decode, the byte-count ideal, and
(--compare) the speed-up over the fastest SDPA of the same case in an older report. Then one summary
line per geometry with the ranges the issue's targets name (4K, >= 32K; B = 1 and B >= 8).
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

LONG_CONTEXT = 32768  # the ">= 32K" targets
SHORT_CONTEXT = 4096


def _ms(entry: Optional[dict]) -> str:
    """A timing cell: ms to 4 decimals, or 'err' where the backend did not run."""
    return f"{entry['ms']:.4f}" if entry and "ms" in entry else "err"


def _key(row: dict) -> tuple:
    return row["geometry"], row["context"], row["batch"]


def table(rows: list[dict], compare: dict[tuple, dict], label: str) -> str:
    """The markdown table of one report (rows as `bench decode` writes them)."""
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
        cells = [r["geometry"], str(r["context"]), str(r["batch"]), str(r["oscar"].get("splits", "")),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a `bench decode --json` file")
    parser.add_argument("--compare", help="an older report: adds its speed-up over the fastest SDPA per case")
    parser.add_argument("--compare-label", default="the older report", help="the older report's name in the header")
    args = parser.parse_args()
    with open(args.report) as f:
        rows = json.load(f)["decode"]
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
