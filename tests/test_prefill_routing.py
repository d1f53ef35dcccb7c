"""bench/prefill_routing.py: the report that judges the prefill routing against measured cells (CPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _row(geometry: str, prefix: int, chunk: int, batch: int, flash, ms: float, bf16: float = 0.1,
         split: Optional[bool] = False) -> dict:
    return {"geometry": geometry, "prefix": prefix, "chunk": chunk, "batch": batch,
            "config": {"prefill_flash": flash, "prefill_flash_split": split}, "oscar": {"ms": ms},
            "bf16_sdpa": {"ms": bf16}}


def _run(tmp_path: Path, rows: list[dict], *extra: str, runs: tuple[list[dict], ...] = ()) -> \
        subprocess.CompletedProcess:
    """The report over ``rows`` and, as further files, each list of ``runs``."""
    paths = []
    for index, file_rows in enumerate((rows, *runs)):
        paths.append(tmp_path / f"prefill{index}.json")
        paths[-1].write_text(json.dumps({"device": {"name": "test"}, "prefill": file_rows}))
    return subprocess.run([sys.executable, str(BENCH / "prefill_routing.py"), *map(str, paths), *extra],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})


def test_the_report_judges_the_current_rule_against_the_faster_path(tmp_path: Path) -> None:
    """A large Qwen3-8B cell (32K prefix, 2048 x 4: the rule takes FlashAttention) where flash is faster, and a tiny
    fresh SmolLM2 cell (512 x 1: the rule keeps the Triton kernel) where flash is faster by 30%: one agreement, one
    miss at 1.43x; the markdown form has a table row per cell."""
    rows = [_row("qwen3-8b", 32768, 2048, 4, False, 23.4), _row("qwen3-8b", 32768, 2048, 4, True, 13.3),
            _row("smollm2-135m", 0, 512, 1, False, 0.10), _row("smollm2-135m", 0, 512, 1, True, 0.07),
            _row("smollm2-135m", 0, 512, 1, None, 0.11, split=None) | {"path": "triton"}]
    result = _run(tmp_path, rows)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2] == ("the rule picks the faster path (within 5%) in 1 of 2 cells; slower: "
                         "smollm2-135m 0/512x1 1.43x")
    assert lines[-1] == "the measured auto row took the rule's path in 1 of 1 cells"
    qwen = next(line for line in lines if line.startswith("qwen3-8b"))
    assert qwen.split()[-2:] == ["flash", "1.00"]
    smol = next(line for line in lines if line.startswith("smollm2-135m"))
    assert "triton" in smol.split() and smol.split()[-2:] == ["triton", "1.43"]
    markdown = _run(tmp_path, rows, "--markdown").stdout.splitlines()
    assert markdown[0].startswith("| geometry |") and sum(line.startswith("| qwen3-8b") for line in markdown) == 1


def test_a_file_without_prefill_rows_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"device": {}, "decode": []}))
    result = subprocess.run([sys.executable, str(BENCH / "prefill_routing.py"), str(path)], capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert result.returncode != 0 and "has no 'prefill' rows: give the --json of `vllm-oscar bench prefill`" in \
        result.stderr


def test_repeated_runs_are_judged_by_their_median_times(tmp_path: Path) -> None:
    """Three runs of one fresh SmolLM2 cell (the rule keeps the Triton kernel): one run's noise makes FlashAttention
    look 1.5x faster; the median of each path over the runs (Triton 0.10, flash 0.12) judges the rule right, and the
    auto rows that took different paths are reported as mixed, not as the rule's."""
    def run(triton: float, flash: float, auto_path: str) -> list[dict]:
        return [_row("smollm2-135m", 0, 512, 1, False, triton), _row("smollm2-135m", 0, 512, 1, True, flash),
                _row("smollm2-135m", 0, 512, 1, None, triton, split=None) | {"path": auto_path}]

    noisy = run(0.15, 0.10, "triton")
    alone = _run(tmp_path, noisy).stdout.splitlines()
    assert alone[-2].startswith("the rule picks the faster path (within 5%) in 0 of 1 cells")
    result = _run(tmp_path, noisy, runs=(run(0.10, 0.12, "flash"), run(0.09, 0.13, "triton")))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    cell = next(line for line in lines if line.startswith("smollm2-135m")).split()
    assert cell[4:7] == ["0.100", "0.120", "1.20"] and cell[9] == "mixed"
    assert lines[-2] == "the rule picks the faster path (within 5%) in 1 of 1 cells"
    assert lines[-1] == "the measured auto row took the rule's path in 0 of 1 cells"


def test_key_segments_are_compared_by_ratios_to_their_own_runs_triton_time(tmp_path: Path) -> None:
    """Two cells timed unsplit on one machine and with the key segments on a machine twice as slow: by raw times the
    segments would lose everywhere; by each run's ratio to its own Triton time they gain 1.33x in the first cell
    (0.8 against 0.6 of Triton) and lose in the second (0.5 against 0.9: 1.80x the time). The auto row with the
    segments on is not judged as the rule's auto."""
    unsplit = [_row("smollm2-135m", 32768, 64, 1, False, 1.0), _row("smollm2-135m", 32768, 64, 1, True, 0.8),
               _row("qwen3-8b", 4096, 64, 1, False, 0.4), _row("qwen3-8b", 4096, 64, 1, True, 0.2)]
    split = [_row("smollm2-135m", 32768, 64, 1, False, 2.0), _row("smollm2-135m", 32768, 64, 1, True, 1.2, split=True),
             _row("smollm2-135m", 32768, 64, 1, None, 1.2, split=True) | {"path": "flash"},
             _row("qwen3-8b", 4096, 64, 1, False, 0.8), _row("qwen3-8b", 4096, 64, 1, True, 0.72, split=True)]
    result = _run(tmp_path, unsplit, runs=(split,))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == ("key segments against the faster unsplit path (times over each run's Triton kernel): faster "
                         "by more than 5% in 1 of 2 cells (smollm2-135m 32768/64x1 1.33x); slower in 1 (at worst "
                         "1.80x the time)")
    assert not any(line.startswith("the measured auto row") for line in lines)


def test_cells_the_rule_splits_are_judged_against_the_key_segments(tmp_path: Path) -> None:
    """Qwen3-8B 256 rows over a 32K prefix (64 programs of 2^29 work each, full tiles: the rule cuts the keys): with
    the key segments timed they are its path and the fastest (1.00); the same cell at 16K, where they were not
    timed, is left unjudged and named; the auto row that took the segments agrees with the rule."""
    rows = [_row("qwen3-8b", 32768, 256, 1, False, 1.4), _row("qwen3-8b", 32768, 256, 1, True, 1.3),
            _row("qwen3-8b", 32768, 256, 1, True, 0.85, split=True),
            _row("qwen3-8b", 32768, 256, 1, None, 0.86, split=None) | {"path": "split"},
            _row("qwen3-8b", 16384, 256, 1, False, 0.8), _row("qwen3-8b", 16384, 256, 1, True, 0.8)]
    result = _run(tmp_path, rows)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    cell = next(line for line in lines if line.startswith("qwen3-8b") and " 32768 " in line).split()
    assert cell[-2:] == ["split", "1.00"]
    assert "the rule picks the faster path (within 5%) in 1 of 1 cells" in lines
    assert "not judged, the rule's path not timed: 1 cells (qwen3-8b 16384/256x1)" in lines
    untimed = next(line for line in lines if line.startswith("qwen3-8b") and " 16384 " in line).split()
    assert untimed[-2:] == ["split", "-"]
    assert "the measured auto row took the rule's path in 1 of 1 cells" in lines
