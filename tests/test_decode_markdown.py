"""bench/decode_markdown.py --targets: which cells the issue sets targets for and how repeats of one table are
judged (met in all, some or none of the runs), on made-up reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import decode_markdown  # noqa: E402


def _row(geometry: str, context: int, batch: int, speedup: float) -> dict:
    return dict(geometry=geometry, context=context, batch=batch, speedup_vs_best_sdpa=speedup)


def test_cell_targets_follow_the_issue() -> None:
    assert decode_markdown.cell_target(4096, 1) == 1.0
    assert decode_markdown.cell_target(4096, 8) == decode_markdown.cell_target(4096, 64) == 2.0
    assert decode_markdown.cell_target(32768, 1) == decode_markdown.cell_target(131072, 64) == 5.0
    assert decode_markdown.cell_target(16384, 8) is None  # no target between 4K and 32K


def test_verdicts_over_repeats() -> None:
    first = [_row("g", 4096, 1, 1.3), _row("g", 4096, 8, 1.9), _row("g", 16384, 8, 9.0), _row("g", 32768, 8, 5.1),
             _row("g", 65536, 1, 4.0)]
    second = [_row("g", 4096, 1, 0.99), _row("g", 4096, 8, 2.2), _row("g", 32768, 8, 5.2), _row("g", 65536, 1, 4.1)]
    verdicts = {key: (target, values, verdict)
                for key, target, values, verdict in decode_markdown.target_verdicts([first, second])}
    assert ("g", 16384, 8) not in verdicts
    assert verdicts[("g", 4096, 1)] == (1.0, [1.3, 0.99], "some")
    assert verdicts[("g", 4096, 8)] == (2.0, [1.9, 2.2], "some")
    assert verdicts[("g", 32768, 8)] == (5.0, [5.1, 5.2], "all")
    assert verdicts[("g", 65536, 1)] == (5.0, [4.0, 4.1], "none")


def test_targets_command_line(tmp_path) -> None:
    paths = []
    for n, speedup in enumerate((5.3, 4.9)):
        path = tmp_path / f"run{n}.json"
        path.write_text(json.dumps({"decode": [_row("qwen3-8b", 32768, 64, speedup)]}))
        paths.append(str(path))
    script = os.path.join(os.path.dirname(decode_markdown.__file__), "decode_markdown.py")
    run = subprocess.run([sys.executable, script, "--targets", *paths], capture_output=True, text=True, check=True)
    assert "5.30 / 4.90  some" in run.stdout
    assert "1 target cells over 2 run(s): met in all 0, in some 1, in none 0" in run.stdout
    refused = subprocess.run([sys.executable, script, *paths], capture_output=True, text=True)
    assert refused.returncode == 2 and "several reports need --targets" in refused.stderr


def _timed_row(geometry: str, context: int, batch: int, oscar_ms: float, sdpa_ms: float) -> dict:
    return dict(geometry=geometry, context=context, batch=batch, oscar={"ms": oscar_ms},
                best_sdpa={"backend": "cudnn", "ms": sdpa_ms}, speedup_vs_best_sdpa=sdpa_ms / oscar_ms)


def test_targets_markdown_gives_the_time_each_target_asks_for(tmp_path) -> None:
    # 32K B=1: 0.040 ms of SDPA asks 0.008 ms of OSCAR (5x); runs at 0.0100 / 0.0120 / 0.0110 ms are 25% / 50% /
    # 37.5% too slow, so the median run needs 37.5% (printed rounded: 38%). 4K B=8 (2x) is met in both runs.
    runs = [[_timed_row("g", 32768, 1, oscar, 0.040), _timed_row("g", 4096, 8, 0.010, 0.030)]
            for oscar in (0.0100, 0.0120, 0.0110)]
    lines = decode_markdown.targets_markdown(runs).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| geometry | context | B | target |")
    assert lines[2] == "| g | 32K | 1 | 5x | 3.33-4.00 | 10.0-12.0 | 40.0 | 8.0 | 38% | none |"
    assert lines[3] == "| g | 4K | 8 | 2x | 3.00 | 10.0 | 30.0 | 15.0 | 0% | **all** |"
    png = tmp_path / "targets.png"
    decode_markdown.targets_plot(runs, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markdown_and_png_need_targets(tmp_path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"decode": [_timed_row("g", 32768, 1, 0.01, 0.04)]}))
    script = os.path.join(os.path.dirname(decode_markdown.__file__), "decode_markdown.py")
    refused = subprocess.run([sys.executable, script, "--markdown", str(path)], capture_output=True, text=True)
    assert refused.returncode == 2 and "--markdown and --png go with --targets" in refused.stderr
