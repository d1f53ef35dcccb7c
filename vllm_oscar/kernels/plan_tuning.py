"""`vllm-oscar bench plans`: measure decode plans around the rules' and write the device's table (CUDA only).

For each cell (geometry, context, batch) the tuner times the rules' plan and candidate plans (split counts at
SPLIT_FACTORS of the rules' count, each with the rules' window prefetch hint and, where gluon_decode's kernel runs,
with it flipped) in ``rounds`` interleaved rounds of CUDA-graph replays, on random cases (benchmark.make_oscar_case)
of the cell's context and of shorter ones that a graph sized for it also serves (SERVED_DIVISORS). It keeps the
candidate fastest at the cell's context among those no slower than the rules at the shorter ones, only where it
beats the rules in every round and by ``margin`` in the median.
Each candidate runs through the product's own path: a one-plan table (measured_plans.using_table), so that what is
timed is what the table will do. The result is a measured_plans table file.
"""

from __future__ import annotations

import datetime
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels import benchmark, measured_plans, triton_ops
from vllm_oscar.kernels.layout import PageLayout
from vllm_oscar.kernels.measured_plans import MeasuredPlan, PlanCell, PlanTable

#: Candidate split counts, as fractions of the rules' count (deduplicated after the tile cut).
SPLIT_FACTORS: tuple[float, ...] = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.94, 0.97, 1.03, 1.06, 1.1, 1.2, 1.35, 1.5)
#: Interleaved timing rounds per cell, and the median gain over the rules a plan must show (fraction).
DEFAULT_ROUNDS: int = 5
DEFAULT_MARGIN: float = 0.02
#: The most a candidate plan's decode output may differ from the rules' (relative L2 over the batch): another split
#: count only reorders fp32 sums ahead of the output's bf16 rounding (2^-9 relative per element).
PLAN_AGREEMENT: float = 1e-2
#: A CUDA graph sized for a cell's context serves every shorter one too: each candidate is also timed at the cell's
#: context divided by these (launches still sized for the cell's), and kept only where its median there is at most
#: SERVED_TOLERANCE above the rules'. H200, served steps of Qwen3-8B attention in graphs for 32K (session 39): a
#: batch-2 plan of 127 splits, 3.1% faster than the rules' 102 at 32K, made 4K steps 21% and 16K steps 12% slower.
SERVED_DIVISORS: tuple[int, ...] = (2, 8)
SERVED_TOLERANCE: float = 0.01


def _planned(case: benchmark.OscarCase, length: int, config: triton_ops.AttentionConfig,
             table: Optional[PlanTable]) -> tuple[int, bool, bool]:
    """(split count, window prefetch hint, whether gluon_decode's kernel runs) of the plan oscar_decode makes for
    the case with ``table`` (None: the rules')."""
    with measured_plans.using_table(table):
        plan = benchmark.case_plan(config, case, length)
    return plan.num_splits, bool(plan.split_consts.get("WINDOW_PREFETCH", False)), plan.gluon_splits


def candidate_plans(cell: PlanCell, rule_splits: int, rule_prefetch: bool, gluon: bool) -> list[MeasuredPlan]:
    """The plans to time against the rules on ``cell``: split counts at SPLIT_FACTORS of rule_splits with the rules'
    window prefetch hint, and where gluon_decode runs (the only kernel with the hint) every count, the rules' own
    too, with the hint flipped. Some may plan alike once the launch cuts their counts (tune_cell drops those)."""
    counts = sorted({max(1, round(rule_splits * f)) for f in SPLIT_FACTORS} - {rule_splits})
    plans = [MeasuredPlan(cell, n, rule_prefetch) for n in counts]
    if gluon:
        plans += [MeasuredPlan(cell, n, not rule_prefetch) for n in [rule_splits, *counts]]
    return plans


def _decode_fns(case: benchmark.OscarCase, max_seq_len: int,
                config: triton_ops.AttentionConfig) -> tuple[list[Callable[[], object]], list[torch.Tensor]]:
    """One oscar_decode call per cache copy of ``case``, sized for max_seq_len, and the outputs they write."""
    scale = 1.0 / math.sqrt(case.layout.head_dim)
    outs = [torch.empty_like(case.query) for _ in case.caches]
    fns = [lambda i=i: triton_ops.oscar_decode(
        case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, case.block_table,
        case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale, out=outs[i],
        max_seq_len=max_seq_len, config=config) for i in range(len(case.caches))]
    return fns, outs


def served_contexts(length: int) -> list[int]:
    """The contexts a cell's candidates are timed at: its own, then those of SERVED_DIVISORS (all sized for it)."""
    return [length, *sorted({length // k for k in SERVED_DIVISORS if length // k > 0} - {length}, reverse=True)]


def tune_cell(geometry: str, length: int, batch: int, block_size: int, reps: int, rounds: int, margin: float,
              device: torch.device, progress: Optional[Callable[[int], None]] = None) -> dict:
    """Time the rules' plan and candidate_plans (those that plan differently) for launches sized for ``length``
    positions, at every served_contexts context (one random case each), in ``rounds`` interleaved rounds. A
    JSON-able row: "rule" and "candidates" with their split counts, hints and per-round ms by context, and "plan"
    ({"splits", "window_prefetch"} of the candidate chosen_candidate keeps, or None where the rules win). progress:
    called with 1 after each timed graph."""
    hq, hkv, dim = benchmark.geometry_heads(geometry)
    config = triton_ops.AttentionConfig(cuda_graph=True)  # timed as replays, as served
    token_bytes = PageLayout(dim, dim, block_size, torch.float16).token_bytes
    contexts = served_contexts(length)
    launches = {}
    for context in contexts:
        gen = torch.Generator(device=device).manual_seed(context * 131 + batch)
        case = benchmark.make_oscar_case(batch, context, hq, hkv, dim, block_size,
                                         benchmark.layers_for(batch * hkv * context * token_bytes), device, gen)
        launches[context] = (case, *_decode_fns(case, length, config))
    full_case = launches[length][0]
    cell = PlanCell(hq, hkv, dim, block_size, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, batch, length)
    rule_splits, rule_prefetch, gluon = _planned(full_case, length, config, None)
    device_name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tables: list[Optional[PlanTable]] = [None]
    planned = [(rule_splits, rule_prefetch)]
    for plan in candidate_plans(cell, rule_splits, rule_prefetch, gluon):
        table = PlanTable(device_name, sms, (plan,), "tuning candidate")
        splits, prefetch, _ = _planned(full_case, length, config, table)
        if (splits, prefetch) not in planned:
            tables.append(table)
            planned.append((splits, prefetch))
    times: list[dict[int, list[float]]] = [{context: [] for context in contexts} for _ in tables]
    for _ in range(rounds):
        for context in contexts:
            for table, series in zip(tables, times):
                with measured_plans.using_table(table):
                    series[context].append(benchmark.time_graph(launches[context][1], reps))
                if progress is not None:
                    progress(1)
    best, kept = chosen_candidate(times, length, margin)
    agreement = _relative_difference(launches[length][1][0], launches[length][2][0], tables[best]) if best else 0.0
    del launches, full_case
    torch.cuda.empty_cache()
    row: dict = {"geometry": geometry, "context": length, "batch": batch, "block_size": block_size,
                 "served_contexts": contexts,
                 "rule": {"splits": rule_splits, "window_prefetch": rule_prefetch, "ms": times[0]},
                 "candidates": [{"splits": s, "window_prefetch": p, "ms": t}
                                for (s, p), t in zip(planned[1:], times[1:])], "plan": None,
                 "fastest_gain": _gain(times, min(range(len(times)), key=lambda k: _median(times, k, length)),
                                       length)}
    if best:
        row["best_gain"] = _gain(times, best, length)
        row["best_relative_difference"] = agreement
        if agreement > PLAN_AGREEMENT:
            raise RuntimeError(f"{geometry} ctx={length} B={batch}: the plan of {planned[best][0]} splits (window "
                               f"prefetch {planned[best][1]}) differs from the rules' output by {agreement:.2e} "
                               f"(relative), more than a changed summation order can: a kernel bug, not a plan.")
        if kept:
            row["plan"] = {"splits": planned[best][0], "window_prefetch": planned[best][1]}
    return row


def _median(times: list[dict[int, list[float]]], k: int, context: int) -> float:
    return statistics.median(times[k][context])


def _gain(times: list[dict[int, list[float]]], k: int, context: int) -> float:
    return 1.0 - _median(times, k, context) / _median(times, 0, context)


def chosen_candidate(times: list[dict[int, list[float]]], length: int, margin: float) -> tuple[int, bool]:
    """(index of the candidate to weigh, whether to keep it) from per-round ms by context: times[0] the rules',
    times[k] candidate k's, each {context: [ms per round]} with the cell's context ``length`` and the shorter served
    contexts. The candidate weighed is the fastest at ``length`` (median) among those whose median at every shorter
    context is at most SERVED_TOLERANCE above the rules' (0: none); it is kept where it beats the rules at
    ``length`` in every round and by ``margin`` in the median."""
    shorter = [context for context in times[0] if context != length]
    served_ok = [k for k in range(1, len(times))
                 if all(_median(times, k, c) <= (1.0 + SERVED_TOLERANCE) * _median(times, 0, c) for c in shorter)]
    if not served_ok:
        return 0, False
    best = min(served_ok, key=lambda k: _median(times, k, length))
    kept = _gain(times, best, length) >= margin and all(b < r for b, r in zip(times[best][length], times[0][length]))
    return best, kept


def _relative_difference(fn: Callable[[], object], out: torch.Tensor, table: Optional[PlanTable]) -> float:
    """||fn's output with ``table`` - the rules' output|| / ||the rules' output|| (fn writes ``out``)."""
    with measured_plans.using_table(None):
        fn()
        rules = out.float().clone()
    with measured_plans.using_table(table):
        fn()
    return float((out.float() - rules).norm() / rules.norm().clamp_min(1e-30))


def tuning_graphs(geometry: str, length: int, batch: int, block_size: int, rounds: int) -> int:
    """An upper bound on the graphs tune_cell times for a cell (for a progress bar): the rules' and every
    candidate's at each served context, each round."""
    hq, hkv, dim = benchmark.geometry_heads(geometry)
    cell = PlanCell(hq, hkv, dim, block_size, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, batch, length)
    return rounds * len(served_contexts(length)) * (1 + len(candidate_plans(cell, 100, False, True)))


def _git_commit() -> Optional[str]:
    """The checkout's commit, "+modified" where tracked files differ from it; None outside a git checkout."""
    try:
        head, status = (subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True,
                                       timeout=10, check=True).stdout.strip()
                        for args in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+modified" if status else head or None


def _cell(row: dict) -> PlanCell:
    hq, hkv, dim = benchmark.geometry_heads(row["geometry"])
    return PlanCell(hq, hkv, dim, row["block_size"], DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, row["batch"],
                    row["context"])


def _timing(row: dict) -> dict:
    """A kept plan's entry extras: its median ms and the rules' plan and median ms."""
    best = next(c for c in row["candidates"] if (c["splits"], c["window_prefetch"]) == (
        row["plan"]["splits"], row["plan"]["window_prefetch"]))
    rule, context = row["rule"], row["context"]
    return {"ms": round(statistics.median(best["ms"][context]), 5),
            "rule": {"splits": rule["splits"], "window_prefetch": rule["window_prefetch"],
                     "ms": round(statistics.median(rule["ms"][context]), 5)}}


def merged_table(old: Optional[PlanTable], rows: list[dict], device: torch.device, source: str) -> PlanTable:
    """The table after tuning ``rows``: old's plans for cells not tuned now, then each tuned cell's kept plan (a cell
    whose rules won loses its old plan)."""
    cells_now = {_cell(r) for r in rows}
    kept = [p for p in (old.plans if old else ()) if p.cell not in cells_now]
    plans = tuple(kept + [MeasuredPlan(_cell(r), r["plan"]["splits"], r["plan"]["window_prefetch"], _timing(r))
                          for r in rows if r["plan"] is not None])
    measured = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv), "commit": _git_commit(), "torch": torch.__version__,
                "triton": benchmark.device_info(device)["triton"], "cells_tuned": len(cells_now)}
    return PlanTable(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count,
                     plans, source, measured)


def format_row(row: dict) -> str:
    """One printed line per tuned cell."""
    rule = row["rule"]
    line = (f"{row['geometry']} ctx={row['context']} B={row['batch']}: rules {rule['splits']} splits "
            f"(window prefetch {rule['window_prefetch']}) {statistics.median(rule['ms'][row['context']]):.4f} ms")
    if row["plan"] is None:
        return line + (f"; kept the rules (fastest candidate {100 * row['fastest_gain']:+.1f}%, fastest within "
                       f"{100 * SERVED_TOLERANCE:.0f}% at every served context "
                       f"{100 * row.get('best_gain', 0.0):+.1f}%)")
    plan = row["plan"]
    return line + (f"; measured plan {plan['splits']} splits (window prefetch {plan['window_prefetch']}) "
                   f"{100 * row['best_gain']:.1f}% faster")


__all__ = ["DEFAULT_MARGIN", "DEFAULT_ROUNDS", "SERVED_DIVISORS", "SERVED_TOLERANCE", "SPLIT_FACTORS",
           "candidate_plans", "chosen_candidate", "format_row", "merged_table", "served_contexts", "tune_cell",
           "tuning_graphs"]
