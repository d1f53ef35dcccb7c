"""Per-device tables of measured decode plans.

The decode planner (triton_ops._plan_decode) sizes its split-K count and a few hints by rules fitted on the H200.
Some cells want another count than any rule gives them (docs/decisions.md: SmolLM2 batch 3-4,
Qwen3-8B 32K batch 6 / 8, 64K batch 3). A table of measured plans holds, for the cells a tuning run timed on one
GPU model (``vllm-oscar bench plans``), the split count and window-prefetch hint that beat the rules there, as vLLM
ships JSON configs per device for its fused-MoE kernels.

File (JSON, UTF-8)::

    {"format": 1,
     "device": "NVIDIA H200",                  # torch.cuda.get_device_name of the tuned GPU
     "sms": 132,                               # its SM count (a table for another count is refused)
     "measured": {...},                        # free-form provenance: date, commit, command, versions
     "plans": [{"query_heads": 32, "kv_heads": 8, "head_dim": 128, "block_size": 64, "sink": 64, "recent": 256,
                "batch": 8, "context": 32768,  # the cell
                "splits": 30,                  # split programs per (request, KV head)
                "window_prefetch": true,       # gluon_decode's window V prefetch hint, or null = the rule's
                "ms": 0.0499, "rule": {"splits": 32, "window_prefetch": false, "ms": 0.0518}}]}

A plan applies to a decode launch of the same geometry, cache block size, windows and batch whose max_seq_len lies
in (context / 2, context] (a CUDA graph's launch is sized for max_model_len: tune at that context to serve it). Its
split count is still cut to what the launch's tiles give out (triton_ops.splits_with_tiles), and it only applies
where the INT2 split kernels run and no explicit AttentionConfig knob (num_splits, programs_per_sm,
gluon_window_prefetch) decides instead.

Which table: the environment variable VLLM_OSCAR_DECODE_PLANS, a path to a table file (for this GPU model) or
``off`` (the rules only); unset, the table shipped in ``vllm_oscar/kernels/plans/`` for this GPU model, if any.
vLLM copies ``VLLM_*`` variables to its Ray workers, so the path must be readable on every node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

#: The table format this code reads and writes.
TABLE_FORMAT: int = 1
#: Environment variable naming the table to use: a file path, or TABLE_OFF.
TABLE_ENV: str = "VLLM_OSCAR_DECODE_PLANS"
TABLE_OFF: str = "off"
#: Tables shipped with the package, one per GPU model (file name: table_file_name(device name)).
SHIPPED_TABLES: Path = Path(__file__).with_name("plans")
#: A plan serves launches whose max_seq_len lies in (context / CONTEXT_BUCKET_RATIO, context].
CONTEXT_BUCKET_RATIO: int = 2

#: Keys of a plan entry kept for reports only (what the tuner measured).
_TIMING_FIELDS: tuple[str, ...] = ("ms", "rule")
_CELL_FIELDS: tuple[str, ...] = ("query_heads", "kv_heads", "head_dim", "block_size", "sink", "recent", "batch",
                                 "context")


class PlanTableError(ValueError):
    """A table of measured plans that cannot be used (unreadable, malformed, or for another GPU)."""


@dataclasses.dataclass(frozen=True)
class PlanCell:
    """What a measured plan was timed for: the decode geometry, cache block size, windows, batch and context."""

    query_heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    sink: int
    recent: int
    batch: int
    context: int

    def geometry_key(self) -> tuple[int, ...]:
        """Everything but the context: plans of one key serve contexts by bucket."""
        return (self.query_heads, self.kv_heads, self.head_dim, self.block_size, self.sink, self.recent, self.batch)


@dataclasses.dataclass(frozen=True)
class MeasuredPlan:
    """A plan that beat the rules on its cell: splits per (request, KV head), and the window prefetch hint
    (None = the rule's). timing: what the tuner measured (the entry's "ms" and "rule"; reports only)."""

    cell: PlanCell
    splits: int
    window_prefetch: Optional[bool] = None
    timing: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


@dataclasses.dataclass(frozen=True)
class PlanTable:
    """The measured plans of one GPU model (``device``, ``sms`` SMs), read from ``source``."""

    device: str
    sms: int
    plans: tuple[MeasuredPlan, ...]
    source: str
    measured: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @functools.cached_property
    def _by_key(self) -> dict[tuple[int, ...], list[MeasuredPlan]]:
        by_key: dict[tuple[int, ...], list[MeasuredPlan]] = {}
        for plan in sorted(self.plans, key=lambda p: p.cell.context):
            by_key.setdefault(plan.cell.geometry_key(), []).append(plan)
        return by_key

    def lookup(self, cell: PlanCell) -> Optional[MeasuredPlan]:
        """The plan serving ``cell`` (its context = the launch's max_seq_len): the plan of the same geometry key with
        the smallest context >= max_seq_len, if max_seq_len > that context / CONTEXT_BUCKET_RATIO; else None."""
        for plan in self._by_key.get(cell.geometry_key(), ()):
            if plan.cell.context >= cell.context:
                return plan if cell.context * CONTEXT_BUCKET_RATIO > plan.cell.context else None
        return None


def table_file_name(device_name: str) -> str:
    """File name of the shipped table of a GPU model: its name with every run of other characters than letters and
    digits made one underscore ("NVIDIA H200" -> "NVIDIA_H200.json")."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


def _require(condition: bool, source: str, what: str) -> None:
    if not condition:
        raise PlanTableError(f"decode plan table {source}: {what}. Re-create it with `vllm-oscar bench plans --out "
                             f"FILE`, or set {TABLE_ENV}={TABLE_OFF} to plan by the rules only.")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _parse_plan(entry: Any, index: int, source: str) -> MeasuredPlan:
    _require(isinstance(entry, dict), source, f"plans[{index}] is not an object")
    missing = [name for name in (*_CELL_FIELDS, "splits") if name not in entry]
    _require(not missing, source, f"plans[{index}] lacks {', '.join(missing)}")
    bad = [name for name in (*_CELL_FIELDS, "splits") if not (_positive_int(entry[name])
                                                              or (name in ("sink", "recent") and entry[name] == 0))]
    _require(not bad, source, f"plans[{index}] has non-positive or non-integer {', '.join(bad)}")
    prefetch = entry.get("window_prefetch")
    _require(prefetch is None or isinstance(prefetch, bool), source,
             f"plans[{index}].window_prefetch is {prefetch!r}, not true, false or null")
    cell = PlanCell(**{name: entry[name] for name in _CELL_FIELDS})
    return MeasuredPlan(cell, entry["splits"], prefetch, {k: entry[k] for k in _TIMING_FIELDS if k in entry})


def parse_table(data: Any, source: str) -> PlanTable:
    """A PlanTable from a decoded table file; PlanTableError naming the first problem."""
    _require(isinstance(data, dict), source, "the top level is not a JSON object")
    _require(data.get("format") == TABLE_FORMAT, source,
             f"format {data.get('format')!r}, this vllm_oscar reads format {TABLE_FORMAT}")
    _require(isinstance(data.get("device"), str) and data["device"], source, "no device name")
    _require(_positive_int(data.get("sms")), source, "no positive SM count (sms)")
    _require(isinstance(data.get("plans"), list), source, "no plans list")
    plans = tuple(_parse_plan(entry, i, source) for i, entry in enumerate(data["plans"]))
    cells = [plan.cell for plan in plans]
    _require(len(set(cells)) == len(cells), source, "a cell appears twice")
    measured = data.get("measured", {})
    return PlanTable(data["device"], data["sms"], plans, source, measured if isinstance(measured, dict) else {})


def load_table(path: "str | os.PathLike[str]") -> PlanTable:
    """Read and check a table file."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise PlanTableError(f"decode plan table {source} cannot be read ({error}). Point {TABLE_ENV} at a table "
                             f"written by `vllm-oscar bench plans --out FILE`, or set it to {TABLE_OFF}.") from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanTableError(f"decode plan table {source} is not valid JSON ({error}). Re-create it with "
                             f"`vllm-oscar bench plans --out FILE`, or set {TABLE_ENV}={TABLE_OFF}.") from error
    return parse_table(data, source)


def table_json(table: PlanTable) -> dict:
    """The JSON object of ``table`` (what load_table reads back)."""
    plans = [{**dataclasses.asdict(plan.cell), "splits": plan.splits, "window_prefetch": plan.window_prefetch,
              **plan.timing} for plan in table.plans]
    return {"format": TABLE_FORMAT, "device": table.device, "sms": table.sms, "measured": table.measured,
            "plans": plans}


def _checked_for_device(table: PlanTable, device: torch.device) -> PlanTable:
    name = torch.cuda.get_device_name(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if (table.device, table.sms) != (name, sms):
        raise PlanTableError(f"decode plan table {table.source} was measured on {table.device} ({table.sms} SMs), "
                             f"this GPU is {name} ({sms} SMs): its split counts do not carry over. Tune this GPU "
                             f"with `vllm-oscar bench plans --out FILE` and point {TABLE_ENV} at FILE, or set "
                             f"{TABLE_ENV}={TABLE_OFF}.")
    return table


@functools.lru_cache(maxsize=None)
def _device_table(device_index: int, setting: Optional[str]) -> Optional[PlanTable]:
    device = torch.device("cuda", device_index)
    if setting == TABLE_OFF:
        return None
    if setting:
        table = _checked_for_device(load_table(setting), device)
    else:
        path = SHIPPED_TABLES / table_file_name(torch.cuda.get_device_name(device))
        if not path.is_file():
            logger.info("No measured decode plans ship for %s: decode plans follow the rules (tune this GPU with "
                        "`vllm-oscar bench plans --out FILE`, then set %s=FILE).",
                        torch.cuda.get_device_name(device), TABLE_ENV)
            return None
        table = _checked_for_device(load_table(path), device)
    logger.info("Decode plans: %d measured plans for %s from %s.", len(table.plans), table.device, table.source)
    return table


_forced: list[Optional[PlanTable]] = []


@contextlib.contextmanager
def using_table(table: Optional[PlanTable]) -> Iterator[None]:
    """Plan every decode launch inside the block with ``table`` (None: the rules only), whatever the device and
    the environment say: the tuner's candidates and the tests."""
    _forced.append(table)
    try:
        yield
    finally:
        _forced.pop()


def active_table(device: torch.device) -> Optional[PlanTable]:
    """The table decode launches on ``device`` are planned with (None: the rules only). CPU tensors have none
    unless using_table forces one."""
    if _forced:
        return _forced[-1]
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_table(index, os.environ.get(TABLE_ENV) or None)


__all__ = ["CONTEXT_BUCKET_RATIO", "MeasuredPlan", "PlanCell", "PlanTable", "PlanTableError", "SHIPPED_TABLES",
           "TABLE_ENV", "TABLE_FORMAT", "TABLE_OFF", "active_table", "load_table", "parse_table", "table_file_name",
           "table_json", "using_table"]
