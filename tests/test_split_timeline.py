"""bench/split_timeline.py without a GPU: its text edits still find their anchors in gluon_decode.py and give valid
Python with every timestamp stored; by default the instrumented kernel's tile loop is the kernel's own (compiled for
sm_90); its summary of a launch's stamps (against numbers worked out by hand, across the 32-bit wrap of
%globaltimer's low word); the tiles of fixed split ranges."""

from __future__ import annotations

import ast
import collections
import os
import sys

import numpy as np
import pytest

from offline_probe import run_probe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import split_timeline  # noqa: E402
import split_timeline_plot  # noqa: E402


def test_edits_apply_to_the_kernel_and_store_every_stamp() -> None:
    with open(split_timeline.KERNEL_SOURCE) as handle:
        source = handle.read()
    edited = split_timeline.instrumented_source(source)
    tree = ast.parse(edited)
    kernel = next(node for node in tree.body if isinstance(node, ast.FunctionDef)
                  and node.name == "int2_split_gluon_kernel")
    body = ast.unparse(kernel)
    for stamp in ("t_start", "t_first", "t_loop", "t_end"):
        assert f"{stamp} = " in body
    assert body.count("gl.store(stamps") == 5
    assert "_timeline_park(parked_first, _timeline_now())" not in body  # the first-tile stamp is opt-in
    with_first = ast.unparse(next(node for node in ast.parse(split_timeline.instrumented_source(source, True)).body
                                  if isinstance(node, ast.FunctionDef) and node.name == "int2_split_gluon_kernel"))
    assert with_first.count("_timeline_park(parked_first, _timeline_now())") == 1


LOOP_PROBE = r'''
import json, sys, tempfile
sys.path[:0] = [ROOT, ROOT + "/bench"]
import split_timeline
from sass_decode import backward_branches, compile_gluon_kernel, instructions, read_compiled

def loop_opcodes():
    """The split loop's SASS opcodes of gluon_decode's kernel as the module now loaded compiles it (head_dim 128,
    staged tiles copied by TMA, fp16 values: the launch whose timeline the stamps disturbed in session 33)."""
    sass = read_compiled(compile_gluon_kernel(128, 4, copy_stages=2, f16_values=True, fold=2, copy_tma=True), None)[0]
    spans = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
    return [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in spans)]

plain = loop_opcodes()
sys.modules["vllm_oscar.kernels.gluon_decode"] = split_timeline.load_instrumented(tempfile.mkdtemp())
print(json.dumps({"plain": plain, "instrumented": loop_opcodes()}))
'''


def test_instrumented_tile_loop_is_the_kernels_own() -> None:
    """Without --first-tile the stamps stay out of the tile loop (the start stamp parked in shared memory): the
    instrumented kernel's loop has the plain kernel's instructions, no local-memory spill among them."""
    loops = run_probe(LOOP_PROBE)
    assert "STL" not in loops["instrumented"] and "LDL" not in loops["instrumented"]
    assert collections.Counter(loops["instrumented"]) == collections.Counter(loops["plain"])


def test_a_missing_anchor_is_named() -> None:
    with pytest.raises(ValueError, match="no longer contains"):
        split_timeline.instrumented_source("def int2_split_gluon_kernel(): pass\n")


def test_summary_of_hand_made_stamps_across_the_timer_wrap() -> None:
    base = (1 << 32) - 3000  # the low word wraps 3 us after the first start
    # one request, one KV head, two split programs (3 and 2 tiles) and one window program; ns after base
    stamps = [[0, 1000, 5000, 5200, 7],      # split 0: first tile at 1 us, loop 4 us for 3 tiles, SM 7
              [100, 1100, 3100, 3300, 7],    # split 1: 2 tiles
              [200, 200, 800, 900, 9]]       # window program, SM 9 (no staged tile: first == start)
    raw = np.array(stamps, dtype=np.int64)[None, None]
    raw[..., :4] = (raw[..., :4] + base) % (1 << 32)
    summary = split_timeline.summarize(raw, np.array([3, 2]), sms=16)
    assert summary["span_us"] == 5.2
    assert summary["split_start_us"] == [0.0, 0.01, 0.05, 0.09, 0.1]
    assert summary["split_first_tile_us"] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert summary["split_loop_us_per_tile"] == [2.0] * 5  # (5000 - 1000) / (3 - 1), split 0 only
    assert summary["split_end_us"][0] == 3.3 and summary["split_end_us"][-1] == 5.2
    assert summary["window_end_us"] == [0.9] * 5
    assert summary["sm_last_end_us"] == [0.9, 1.33, 3.05, 4.77, 5.2]  # SM 9: 0.9, SM 7: 5.2
    assert summary["programs_per_sm"] == [1, 2]
    assert summary["split_end_by_tier_us"] == [4.25]  # both splits: tier 0 of SM 7, mean of 5.2 and 3.3
    assert summary["loop_timed_from"] == "first_tile"
    raw[..., 1] = raw[..., 0]  # no --first-tile: the loop's time per tile runs from the start over every tile
    summary = split_timeline.summarize(raw, np.array([3, 2]), sms=16)
    assert summary["loop_timed_from"] == "start" and summary["split_first_tile_us"] == []
    assert summary["split_loop_us_per_tile"] == [round(5000 / 3 / 1000, 2)] * 5  # split 0: (5000 - 0) / 3


def test_dispatch_tiers_follow_grid_order_per_sm() -> None:
    """Two requests, one KV head, 5 programs: dispatch order (request fastest) 0:(0,p0) 1:(1,p0) 2:(0,p1) ... All on
    one SM except request 1's program 0; tiers are ranks // SCHEDULERS_PER_SM among an SM's programs."""
    sm = np.zeros((2, 1, 5), dtype=np.int64)
    sm[1, 0, 0] = 3
    tiers = split_timeline.dispatch_tiers(sm)
    # SM 0 in dispatch order: (0,p0) (0,p1) (1,p1) (0,p2) (1,p2) (0,p3) (1,p3) (0,p4) (1,p4): ranks 0..8
    expected_rank = {(0, 0): 0, (0, 1): 1, (1, 1): 2, (0, 2): 3, (1, 2): 4, (0, 3): 5, (1, 3): 6, (0, 4): 7, (1, 4): 8}
    for (b, p), rank in expected_rank.items():
        assert tiers[b, 0, p] == rank // split_timeline.SCHEDULERS_PER_SM
    assert tiers[1, 0, 0] == 0  # alone on SM 3


def test_raw_stamps_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 1 << 32, size=(2, 3, 5, 5), dtype=np.int64)
    raw[..., 4] = rng.integers(0, 132, size=(2, 3, 5))  # %smid
    tiles = np.array([4, 4, 3])
    path = str(tmp_path / "cell.npz")
    split_timeline.save_raw(path, raw, tiles, sms=132)
    kept = np.load(path)
    assert np.array_equal(kept["raw"], raw) and np.array_equal(kept["tiles"], tiles) and int(kept["sms"]) == 132
    assert split_timeline.summarize(kept["raw"], kept["tiles"], int(kept["sms"])) == \
        split_timeline.summarize(raw, tiles, 132)


@pytest.mark.parametrize("n_tiles, splits, min_tiles, expected", [
    (2043, 186, 2, [11] * 185 + [8]),
    (10, 4, 2, [3, 3, 3, 1]),
    (3, 4, 2, [2, 1, 0, 0]),
    (0, 3, 2, [0, 0, 0]),
])
def test_fixed_split_ranges(n_tiles: int, splits: int, min_tiles: int, expected: list[int]) -> None:
    tiles = split_timeline.split_program_tiles(n_tiles, splits, min_tiles)
    assert tiles.tolist() == expected
    assert tiles.sum() == n_tiles


def test_plot_of_end_times_by_tier(tmp_path) -> None:
    """One SM, one request and KV head, 6 programs (5 splits, 1 window): dispatch ranks 0-3 are tier 0, 4 tier 1."""
    raw = np.zeros((1, 1, 6, 5), dtype=np.int64)
    raw[0, 0, :, 3] = [2000, 2500, 3000, 3500, 9000, 4000]  # ends (ns after the start at 0)
    by_tier, windows = split_timeline_plot.end_times_by_tier(raw, num_splits=5)
    assert [ends.tolist() for ends in by_tier] == [[2.0, 2.5, 3.0, 3.5], [9.0]] and windows.tolist() == [4.0]
    path = str(tmp_path / "cell.npz")
    split_timeline.save_raw(path, raw, np.array([3, 3, 3, 3, 2]), sms=1)
    out = tmp_path / "tiers.png"
    split_timeline_plot.plot([path], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
