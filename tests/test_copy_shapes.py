"""bench/copy_shapes.py without a GPU: its copy kernels compile for sm_90 in the shapes it offers, issuing one TMA
copy per box of a tile per loop trip (three at head_dim 128, two at 64: gluon_decode's boxes) with no local memory and
a ring of the asked depth in shared memory; with a producer warp ("4p") only the producer's loop issues copies and
the CTA's registers are capped so that two share an SM; with independent warps ("1i" / "4i", bench/copy_warps.py) no
CTA-wide barrier is left and each warp issues one bulk copy per tile; its shapes parse and size the split counts as
documented."""

from __future__ import annotations

import argparse
import sys

import pytest

from offline_probe import ROOT, run_probe

sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from vllm_oscar.kernels.layout import PageLayout  # noqa: E402

import copy_shapes  # noqa: E402
from copy_shapes import parse_shape, shape_splits  # noqa: E402

SHAPES = ((128, "1", 2), (128, "4", 6), (64, "4", 4), (64, "1", 8), (128, "4p", 4), (64, "4p", 8))
#: Shapes of independent warps (bench/copy_warps.py).
WARP_SHAPES = ((128, "4i", 2), (128, "1i", 3), (64, "4i", 3), (128, "4c", 2), (64, "1c", 3), (128, "1c", 4))

PROBE = r'''
import json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
from copy_shapes import compile_copy_kernel
from sass_decode import backward_branches, instructions, read_compiled
report = {}
for dim, warps, stages in SHAPES:
    kernel = compile_copy_kernel(dim, warps, stages)
    sass, registers, stack = read_compiled(kernel, None)
    loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
    ops = instructions(sass)
    report[f"{dim}_{warps}_{stages}"] = dict(
        shared=kernel.metadata.shared, warps=kernel.metadata.num_warps, registers=int(registers),
        loop_tma=sorted({sum(op == "UTMALDG" for address, op in ops if lo <= address <= hi) for lo, hi in loops}),
        kernel_tma=sum(op == "UTMALDG" for address, op in ops), local=sass.count("STL") + sass.count("LDL"),
        barriers=sum(op.startswith("BAR") for address, op in ops),
        reading_loop_bulk=[sum(op == "UBLKCP" for address, op in ops if lo <= address <= hi) for lo, hi in loops
                           if any(op == "LDS" and lo <= address <= hi for address, op in ops)],
        reading_loop_lane_copies=[sum(op == "LDGSTS" for address, op in ops if lo <= address <= hi)
                                  for lo, hi in loops
                                  if any(op == "LDS" and lo <= address <= hi for address, op in ops)])
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_probe(PROBE, SHAPES=SHAPES + WARP_SHAPES)


@pytest.mark.parametrize("dim,warps,stages", SHAPES)
def test_copy_kernel_issues_one_tma_copy_per_box_into_a_ring_of_the_asked_depth(compiled: dict, dim: int, warps: str,
                                                                                 stages: int) -> None:
    report = compiled[f"{dim}_{warps}_{stages}"]
    boxes = 3 if dim == 128 else 2  # key codes, V codes, scale planes (the codes in one box at 64)
    assert report["local"] == 0 and max(report["loop_tma"]) == boxes
    region = PageLayout(dim, dim, 64).head_region_bytes
    assert stages * region <= report["shared"] < (stages + 1) * region
    if warps.endswith("p"):  # the producer's loop alone copies; the prologue none
        assert report["kernel_tma"] == boxes and 0 in report["loop_tma"]
        assert report["registers"] == copy_shapes.WS_MAX_REGISTERS and report["warps"] == 8  # 4 + the producer's 4
    else:  # the ring's first STAGES - 1 tiles in the prologue, then one tile per trip of the one loop
        # (the loop of the compute stand-in, --work, issues none)
        assert [n for n in report["loop_tma"] if n] == [boxes] and report["kernel_tma"] == stages * boxes
        assert report["warps"] == int(warps)


@pytest.mark.parametrize("dim,warps,stages", WARP_SHAPES)
def test_independent_warps_copy_without_cta_barriers(compiled: dict, dim: int, warps: str, stages: int) -> None:
    """1i / 4i / 1c / 4c: no CTA-wide barrier anywhere; per trip of each loop that reads the landed tiles one bulk
    copy (i: the warp's lane 0 issues it) or each lane's share of the region's 16-byte chunks by cp.async (c: 9 at
    head_dim 128, 5 at 64) and nothing else; no local memory, and no shared memory of Gluon's but the bytes that keep
    the raw region (the rings, which raw_launch adds, start right after them)."""
    from copy_warps import KEEP_PER_WARP, ring_bytes

    report = compiled[f"{dim}_{warps}_{stages}"]
    assert report["barriers"] == 0 and report["local"] == 0 and report["kernel_tma"] == 0
    bulk, lanes = report["reading_loop_bulk"], report["reading_loop_lane_copies"]
    assert bulk and lanes  # (Triton 3.9 versions the loop: every version counted)
    chunks = -(-PageLayout(dim, dim, 64).head_region_bytes // 16 // 32)
    assert (set(bulk), set(lanes)) == (({0}, {chunks}) if warps.endswith("c") else ({1}, {0}))
    assert report["shared"] == KEEP_PER_WARP.value * int(warps[0]) and report["warps"] == int(warps[0])
    region = PageLayout(dim, dim, 64).head_region_bytes
    assert ring_bytes(int(warps[0]), stages, region) == int(warps[0]) * stages * (region + 16)  # + the mbarriers


LAYOUTS_PROBE = r'''
import json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
import triton
from copy_warps import staged_line_layouts
# Triton 3.6's to_linear_layout takes distributed layouts only (the device's Triton; CI's is newer).
old = tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7)
print(json.dumps({"triton": triton.__version__} if old else staged_line_layouts()))
'''


@pytest.mark.parametrize("dim", [128, 64])
def test_lane_copies_land_where_the_staged_layouts_read(dim: int) -> None:
    """The "c" shapes' per-lane destinations (copy_warps.lane_copy_destination) agree with Gluon's own shared layouts
    of gluon_decode's staged code lines: for every byte of the key and V code lines, the element a staged layout
    keeps at that byte's swizzled place is the element stored there in the cache's region."""
    from copy_warps import lane_copy_destination

    bases = run_probe(LAYOUTS_PROBE)
    if "triton" in bases:
        pytest.skip(f"Triton {bases['triton']} cannot linearise shared layouts (3.7 on can)")
    layout = PageLayout(dim, dim, 64)
    codes = layout.plane_offset("v_codes")
    for name, start, element in ((f"keys_{dim}", 0, 1), (f"v_{dim}", codes, 2)):
        columns = 128 // element  # elements per 128-byte line
        for at in range(start, start + codes, 16):  # every chunk of the part
            to = lane_copy_destination(at, codes, 2 if dim == 128 else 1) - start
            for byte in range(0, 16, element):  # each element of the chunk: where the layout keeps it
                offset = (to + byte) // element
                row = col = 0
                for bit, (r, c) in enumerate(bases[name]):
                    if offset >> bit & 1:
                        row, col = row ^ r, col ^ c
                source = (at - start + byte) // element
                assert (row, col) == (source // columns, source % columns), (name, at, byte)


def test_shapes_parse_and_size_their_splits() -> None:
    assert parse_shape("4:6:quarter") == ("4", 6, "quarter") and parse_shape("4p:8:eighth") == ("4p", 8, "eighth")
    assert parse_shape("1:2:plan") == ("1", 2, "plan") and parse_shape("1:3:40") == ("1", 3, "40")
    assert parse_shape("4i:3:quarter") == ("4i", 3, "quarter") and parse_shape("1i:2:plan") == ("1i", 2, "plan")
    assert parse_shape("4c:4:plan") == ("4c", 4, "plan")
    for bad in ("3:2:plan", "1p:2:plan", "2i:2:plan", "1:5:plan", "1:2:half", "1:2", "4c:6:plan"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_shape(bad)
    assert shape_splits("plan", 128, 2048) == 128
    assert shape_splits("quarter", 128, 2048) == 32 and shape_splits("eighth", 130, 2048) == 17
    assert shape_splits("tiles", 128, 2048) == 2048
    assert shape_splits("5000", 128, 2048) == 2048 and shape_splits("quarter", 2, 64) == 1
