"""bench/cluster_merge.py without a GPU: its kernel compiles for sm_90 in each merge form with the synchronisation
each form is built on and nothing else (no CTA-wide barrier in the copy loop, cluster barriers only where the form
has them, one st.async per pushed element, no local memory, no shared memory of Gluon's beyond the bytes that keep
the raw region), and its host-side sizes and layouts are what the kernel's addressing assumes."""

from __future__ import annotations

import argparse
import sys

import pytest
from offline_probe import ROOT, run_probe

sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import cluster_merge  # noqa: E402

#: (head_dim, GQA group, warps, CTAs per cluster, stages): Qwen3-8B's and SmolLM2's geometry, one- to eight-warp CTAs.
SHAPES = ((128, 4, 8, 16, 2), (64, 3, 4, 16, 3), (128, 4, 1, 16, 2), (64, 3, 2, 8, 3))
FORMS = ("global", "pull", "push")

PROBE = r'''
import collections, json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
from cluster_merge import compile_offline
from sass_decode import backward_branches, instructions, read_compiled
report = {}
for shape in SHAPES:
    for form in FORMS:
        kernel = compile_offline(*shape, form)
        sass, registers, stack = read_compiled(kernel, None)
        ops = instructions(sass)
        loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
        counts = collections.Counter(op for address, op in ops)
        report["_".join(map(str, shape)) + "_" + form] = dict(
            shared=kernel.metadata.shared, warps=kernel.metadata.num_warps,
            local=sass.count("STL") + sass.count("LDL"),
            loop_barriers=sum(op.startswith("BAR") for address, op in ops for lo, hi in loops if lo <= address <= hi),
            reading_loop_bulk=[sum(op == "UBLKCP" for address, op in ops if lo <= address <= hi) for lo, hi in loops
                               if any(op == "LDS" and lo <= address <= hi for address, op in ops)],
            cluster_arrive=counts["UCGABAR_ARV"], cluster_wait=counts["UCGABAR_WAIT"], pushes=counts["STAS"])
for dim, group in ((128, 4), (64, 3)):  # --lane-copies: the split programs' per-lane cp.async
    sass, registers, stack = read_compiled(compile_offline(dim, group, 4, 16, 2, "push", lane_copies=True), None)
    ops = instructions(sass)
    loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
    report[f"lanes_{dim}"] = dict(
        local=sass.count("STL") + sass.count("LDL"),
        loop_barriers=sum(op.startswith("BAR") for address, op in ops for lo, hi in loops if lo <= address <= hi),
        reading_loop_copies=[[sum(op == name for address, op in ops if lo <= address <= hi)
                              for name in ("LDGSTS", "UBLKCP")] for lo, hi in loops
                             if any(op == "LDS" and lo <= address <= hi for address, op in ops)])
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_probe(PROBE, SHAPES=SHAPES, FORMS=FORMS)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_synchronises_only_as_its_merge_form_says(compiled: dict, shape: tuple, form: str) -> None:
    head_dim, group, warps, ctas, stages = shape
    report = compiled["_".join(map(str, shape)) + "_" + form]
    assert report["local"] == 0 and report["warps"] == warps
    assert report["shared"] == 32 * warps  # Gluon's only allocation: the raw region starts right after it
    assert report["loop_barriers"] == 0  # the warps' copy loops never wait for each other
    assert report["reading_loop_bulk"] and set(report["reading_loop_bulk"]) == {1}  # (Triton 3.9 versions the loop)
    barriers = {"global": 0, "pull": 2, "push": 1}[form]  # pull: before reading peers and before exit
    assert report["cluster_arrive"] == report["cluster_wait"] == barriers
    elements = -(-group * head_dim // 32) + -(-ctas * group // 32)  # per lane: its outputs, then every owner's lse
    assert report["pushes"] == (elements if form == "push" else 0)


@pytest.mark.parametrize("dim", [128, 64])
def test_lane_copies_option_copies_by_lane(compiled: dict, dim: int) -> None:
    """--lane-copies: each reading loop's trip issues every lane's share of the region's 16-byte chunks by cp.async
    (9 at head_dim 128, 5 at 64) and no bulk copy, still without a CTA-wide barrier or local memory."""
    report = compiled[f"lanes_{dim}"]
    assert report["local"] == 0 and report["loop_barriers"] == 0 and report["reading_loop_copies"]
    assert all(copies == [9 if dim == 128 else 5, 0] for copies in report["reading_loop_copies"])


@pytest.mark.parametrize("slots,chunk,warps", [(128, 32, 8), (64, 16, 4), (16, 16, 1), (16, 32, 2), (8, 64, 1)])
def test_merge_layout_keeps_the_slots_in_one_warp(slots: int, chunk: int, warps: int) -> None:
    """The merge reduces over the slots (axis 0) with no shared memory only if a warp holds all of them; the chunk
    (axis 1) is spread over the warps, every column held somewhere."""
    layout = cluster_merge.merge_layout(slots, chunk, warps)
    assert list(layout.warps_per_cta) == [1, warps]
    assert layout.size_per_thread[0] * layout.threads_per_warp[0] == slots
    assert layout.size_per_thread[1] * layout.threads_per_warp[1] * warps >= chunk
    assert layout.threads_per_warp[0] * layout.threads_per_warp[1] == 32


def test_shared_bytes_hold_every_ring_slot_and_barrier() -> None:
    cell = cluster_merge.offline_cell(128, 4)  # Qwen3-8B: regions of 4608 bytes at blocks of 64
    rings = 8 * 2 * (4608 + 16)
    assert cluster_merge.slot_bytes("pull", 4, 128, 32) == 4 * (4 * 128 + 4)  # 2064, a multiple of 16
    assert cluster_merge.slot_bytes("push", 4, 128, 32) == 144 and cluster_merge.slot_bytes("push", 3, 64, 16) == 80
    shared = {form: cluster_merge.cluster_shared_bytes(cluster_merge.kernel_constants(cell, 8, 16, 2, form))
              for form in FORMS}
    assert shared == {"global": rings, "pull": rings + 8 * 2064, "push": rings + 128 * 144 + 16}


def test_shapes_parse() -> None:
    assert cluster_merge.parse_shape("8:16:2") == (8, 16, 2) and cluster_merge.parse_shape("1:128:3") == (1, 128, 3)
    for bad in ("3:16:2", "8:0:2", "8:16:1", "8:16", "a:b:c"):
        with pytest.raises(argparse.ArgumentTypeError):
            cluster_merge.parse_shape(bad)
