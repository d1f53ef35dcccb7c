"""bench/tune_ab.py: the fastest reading per tree and cell, speed-ups over the base tree, and clear errors, on
made-up `bench tune --json` reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
sys.path.insert(0, BENCH)

import tune_ab  # noqa: E402


def _report(path, times: dict) -> str:
    rows = [dict(geometry=g, context=c, batch=b, config={}, oscar=dict(ms=ms)) for (g, c, b), ms in times.items()]
    path.write_text(json.dumps({"tune": rows}))
    return str(path)


def test_fastest_reading_and_ratio_over_the_base(tmp_path) -> None:
    new = [_report(tmp_path / "n1.json", {("g", 4096, 1): 0.010, ("g", 4096, 8): 0.030}),
           _report(tmp_path / "n2.json", {("g", 4096, 1): 0.008, ("g", 4096, 8): 0.031})]
    old = [_report(tmp_path / "o1.json", {("g", 4096, 1): 0.012, ("g", 4096, 8): 0.015, ("g", 8192, 1): 1.0})]
    lines = tune_ab.compare({"new": new, "old": old}, "old")
    assert len(lines) == 3  # header + the two cells both trees timed (8192 only by old)
    first = lines[1].split()
    assert first[:3] == ["g", "4096", "1"] and float(first[3]) == 0.008 and float(first[5]) == pytest.approx(1.5)
    assert float(lines[2].split()[5]) == pytest.approx(0.5)  # slower than the base
    # the spread of the repeats: new's 0.010 / 0.008 at B=1 (25%), 0.031 / 0.030 at B=8 (old has one reading)
    assert first[6] == "25.0%" and lines[2].split()[6] == "3.3%"


def test_errors_say_what_to_fix(tmp_path) -> None:
    twice = tmp_path / "twice.json"
    row = dict(geometry="g", context=4096, batch=1, config={}, oscar=dict(ms=0.01))
    twice.write_text(json.dumps({"tune": [row, row]}))
    with pytest.raises(SystemExit, match="one config per tree"):
        tune_ab.compare({"a": [str(twice)], "b": [str(twice)]}, "a")
    with pytest.raises(SystemExit, match="--base c is not one of"):
        tune_ab.compare({"a": [], "b": []}, "c")
    run = subprocess.run([sys.executable, os.path.join(BENCH, "tune_ab.py"), "--base", "a", "a"],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "TREE=REPORT" in run.stderr
