"""Tables of measured decode plans (vllm_oscar.kernels.measured_plans): reading, checking, lookup by context
bucket, and the tuner's candidates and table merge (plan_tuning) without a GPU. The decode launches that take a
table's split count are checked against float64 in tests/test_kernels_triton.py."""

from __future__ import annotations

import json

import pytest

from vllm_oscar.kernels import measured_plans, plan_tuning
from vllm_oscar.kernels.measured_plans import MeasuredPlan, PlanCell, PlanTable, PlanTableError


def _entry(**overrides) -> dict:
    entry = {"query_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 64, "sink": 64, "recent": 256,
             "batch": 8, "context": 32768, "splits": 30, "window_prefetch": True, "ms": 0.0499,
             "rule": {"splits": 32, "window_prefetch": False, "ms": 0.0518}}
    return {**entry, **overrides}


def _table(*entries: dict, **top) -> dict:
    return {"format": measured_plans.TABLE_FORMAT, "device": "NVIDIA H200", "sms": 132, "measured": {"date": "x"},
            "plans": list(entries), **top}


def _cell(batch: int = 8, context: int = 32768, **overrides) -> PlanCell:
    fields = {"query_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 64, "sink": 64, "recent": 256,
              **overrides}
    return PlanCell(batch=batch, context=context, **fields)


def test_a_table_file_round_trips(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_table(_entry(), _entry(context=131072, splits=33, window_prefetch=None))))
    table = measured_plans.load_table(path)
    assert (table.device, table.sms, len(table.plans)) == ("NVIDIA H200", 132, 2)
    assert table.plans[0] == MeasuredPlan(_cell(), 30, True)
    assert table.plans[0].timing == {"ms": 0.0499, "rule": {"splits": 32, "window_prefetch": False, "ms": 0.0518}}
    again = measured_plans.parse_table(measured_plans.table_json(table), "again")
    assert again.plans == table.plans and [p.timing for p in again.plans] == [p.timing for p in table.plans]


def test_a_plan_serves_the_contexts_of_its_bucket_only() -> None:
    """A plan at context C serves max_seq_len in (C / 2, C]; with plans at 32K and 128K, 64K + 1 .. 128K take the
    128K plan and 32K + 1 .. 64K none; another batch, geometry or window size takes none."""
    table = measured_plans.parse_table(_table(_entry(), _entry(context=131072, splits=33)), "t")
    lookup = lambda **kw: table.lookup(_cell(**kw))  # noqa: E731
    assert lookup(context=32768).splits == 30 and lookup(context=16385).splits == 30
    assert lookup(context=16384) is None
    assert lookup(context=32769) is None and lookup(context=65536) is None
    assert lookup(context=65537).splits == 33 and lookup(context=131072).splits == 33
    assert lookup(context=131073) is None
    assert lookup(batch=16) is None and lookup(head_dim=64) is None and lookup(recent=128) is None
    assert lookup(block_size=16) is None and lookup(kv_heads=4) is None


@pytest.mark.parametrize("mutate,message", [
    (lambda t: t.update(format=2), "format 2"),
    (lambda t: t.pop("device"), "no device name"),
    (lambda t: t.update(sms=0), "SM count"),
    (lambda t: t.update(plans={}), "no plans list"),
    (lambda t: t["plans"][0].pop("splits"), r"plans\[0\] lacks splits"),
    (lambda t: t["plans"][0].update(batch=0), r"plans\[0\] has non-positive or non-integer batch"),
    (lambda t: t["plans"][0].update(splits=2.5), "non-integer splits"),
    (lambda t: t["plans"][0].update(window_prefetch="yes"), "window_prefetch is 'yes'"),
    (lambda t: t["plans"].append(_entry(splits=29)), "a cell appears twice"),
    (lambda t: t["plans"].append(7), r"plans\[1\] is not an object"),
])
def test_malformed_tables_are_refused_with_what_is_wrong_and_the_fix(tmp_path, mutate, message) -> None:
    data = _table(_entry())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanTableError, match=message) as error:
        measured_plans.load_table(path)
    assert "vllm-oscar bench plans" in str(error.value) and measured_plans.TABLE_ENV in str(error.value)


def test_unreadable_and_corrupt_table_files_are_refused(tmp_path) -> None:
    with pytest.raises(PlanTableError, match="cannot be read"):
        measured_plans.load_table(tmp_path / "missing.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": 1, "plans": [')
    with pytest.raises(PlanTableError, match="not valid JSON"):
        measured_plans.load_table(corrupt)


def test_table_file_names_follow_the_gpu_name() -> None:
    assert measured_plans.table_file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert measured_plans.table_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"


def test_shipped_tables_are_valid_and_named_for_their_gpu() -> None:
    for path in sorted(measured_plans.SHIPPED_TABLES.glob("*.json")):
        table = measured_plans.load_table(path)
        assert path.name == measured_plans.table_file_name(table.device)
        assert table.plans, f"{path.name} ships no plan"
        for plan in table.plans:
            assert plan.timing["ms"] < plan.timing["rule"]["ms"], f"{path.name}: {plan}"


def test_using_table_nests_and_cpu_tensors_have_no_table_otherwise(monkeypatch) -> None:
    import torch

    monkeypatch.setenv(measured_plans.TABLE_ENV, "/nonexistent/table.json")  # never read for CPU tensors
    cpu = torch.device("cpu")
    outer = PlanTable("a", 1, (), "outer")
    assert measured_plans.active_table(cpu) is None
    with measured_plans.using_table(outer):
        assert measured_plans.active_table(cpu) is outer
        with measured_plans.using_table(None):
            assert measured_plans.active_table(cpu) is None
        assert measured_plans.active_table(cpu) is outer
    assert measured_plans.active_table(cpu) is None


def test_candidates_are_also_timed_at_the_shorter_contexts_a_graph_serves() -> None:
    assert plan_tuning.served_contexts(32768) == [32768, 16384, 4096]
    assert plan_tuning.served_contexts(4) == [4, 2]


def test_candidates_cover_counts_around_the_rules_and_the_flipped_hint() -> None:
    cell = _cell()
    plans = plan_tuning.candidate_plans(cell, 32, False, gluon=True)
    same_hint = sorted(p.splits for p in plans if p.window_prefetch is False)
    flipped = sorted(p.splits for p in plans if p.window_prefetch is True)
    assert 32 not in same_hint and same_hint == sorted({round(32 * f) for f in plan_tuning.SPLIT_FACTORS})
    assert flipped == sorted([32, *same_hint])
    assert all(p.cell == cell for p in plans)
    # int2_split_kernel has no window prefetch hint: the counts only.
    assert sorted(p.splits for p in plan_tuning.candidate_plans(cell, 32, False, gluon=False)) == same_hint


def _row(context: int, plan, rule_ms=(1.0, 1.0), best_ms=(0.9, 0.9)) -> dict:
    return {"geometry": "qwen3-8b", "context": context, "batch": 8, "block_size": 64,
            "rule": {"splits": 32, "window_prefetch": False, "ms": {context: list(rule_ms), context // 2: [0.5]}},
            "candidates": [{"splits": 30, "window_prefetch": True,
                            "ms": {context: list(best_ms), context // 2: [0.4]}}],
            "plan": plan, "fastest_gain": 0.1, **({"best_gain": 0.1} if plan else {})}


def test_a_new_tuning_replaces_the_plans_of_the_cells_it_tuned(monkeypatch) -> None:
    """merged_table keeps old plans of cells not tuned now, replaces those tuned now and drops those where the rules
    won this time."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(plan_tuning.benchmark, "device_info", lambda device: {"triton": "3.6.0"})
    old = measured_plans.parse_table(_table(_entry(context=4096, splits=10), _entry(context=32768, splits=28),
                                            _entry(context=65536, splits=31)), "old")
    rows = [_row(32768, {"splits": 30, "window_prefetch": True}), _row(65536, None)]
    table = plan_tuning.merged_table(old, rows, torch.device("cpu"), "new.json")
    assert {(p.cell.context, p.splits) for p in table.plans} == {(4096, 10), (32768, 30)}
    new = next(p for p in table.plans if p.cell.context == 32768)
    assert new.window_prefetch is True
    assert new.timing == {"ms": 0.9, "rule": {"splits": 32, "window_prefetch": False, "ms": 1.0}}
    assert table.measured["cells_tuned"] == 2


def _times(rule: dict, *candidates: dict) -> list[dict[int, list[float]]]:
    return [rule, *candidates]


def test_the_tuner_keeps_the_fastest_candidate_that_is_no_slower_at_the_served_contexts() -> None:
    rule = {32768: [1.00, 1.01, 0.99], 16384: [0.60] * 3, 4096: [0.20] * 3}
    fast_but_slow_short = {32768: [0.90] * 3, 16384: [0.61] * 3, 4096: [0.25] * 3}  # 25% slower at 4K
    good = {32768: [0.95, 0.96, 0.94], 16384: [0.605] * 3, 4096: [0.19] * 3}  # within 1% at 16K
    best, kept = plan_tuning.chosen_candidate(_times(rule, fast_but_slow_short, good), 32768, 0.02)
    assert (best, kept) == (2, True)


def test_the_tuner_keeps_the_rules_without_a_gain_in_every_round_and_by_the_margin() -> None:
    rule = {32768: [1.00, 1.00, 0.90], 4096: [0.2] * 3}
    noisy = {32768: [0.95, 0.95, 0.95], 4096: [0.2] * 3}  # 5% faster in the median, slower in round 3
    assert plan_tuning.chosen_candidate(_times(rule, noisy), 32768, 0.02) == (1, False)
    rule = {32768: [1.0] * 3, 4096: [0.2] * 3}
    small = {32768: [0.99] * 3, 4096: [0.2] * 3}  # faster every round, by 1% only
    assert plan_tuning.chosen_candidate(_times(rule, small), 32768, 0.02) == (1, False)
    slow_short = {32768: [0.5] * 3, 4096: [0.21] * 3}
    assert plan_tuning.chosen_candidate(_times(rule, slow_short), 32768, 0.02) == (0, False)
    assert plan_tuning.chosen_candidate(_times(rule), 32768, 0.02) == (0, False)  # no candidate at all


def test_bench_plans_writes_and_extends_the_table_of_this_gpu_only(tmp_path, monkeypatch) -> None:
    """`bench plans` without a GPU: tune_cell replaced by canned rows; the table and the report are written, an
    existing table of this GPU is extended, one of another GPU is refused before any tuning."""
    import argparse

    import torch

    from vllm_oscar.commands import bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"multi_processor_count": 132})())
    monkeypatch.setattr(plan_tuning.benchmark, "device_info", lambda device: {"triton": "3.6.0"})
    tuned = []

    def tune_cell(geometry, context, batch, block_size, reps, rounds, margin, device, progress):
        tuned.append((geometry, context, batch))
        progress(1)
        return _row(context, {"splits": 30, "window_prefetch": True} if context == 32768 else None)

    monkeypatch.setattr(plan_tuning, "tune_cell", tune_cell)
    out, raw = tmp_path / "table.json", tmp_path / "raw.json"
    args = argparse.Namespace(out=str(out), json=str(raw), rounds=5, margin=0.02, block_size=64, reps=10)
    out.write_text(json.dumps(_table(_entry(context=4096, splits=10))))
    rows = bench.run_plans(args, torch.device("cpu"), [("qwen3-8b", 32768, 8), ("qwen3-8b", 65536, 8)], {"x": 1})
    assert tuned == [("qwen3-8b", 32768, 8), ("qwen3-8b", 65536, 8)] and len(rows) == 2
    table = measured_plans.load_table(out)
    assert {(p.cell.context, p.splits) for p in table.plans} == {(4096, 10), (32768, 30)}
    assert json.loads(raw.read_text())["x"] == 1 and len(json.loads(raw.read_text())["plans"]) == 2
    out.write_text(json.dumps(_table(_entry(), device="NVIDIA H100 80GB HBM3")))
    tuned.clear()
    with pytest.raises(SystemExit, match="measured on NVIDIA H100 80GB HBM3"):
        bench.run_plans(args, torch.device("cpu"), [("qwen3-8b", 32768, 8)], {})
    assert not tuned
