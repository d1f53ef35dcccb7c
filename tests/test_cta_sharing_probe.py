"""bench/cta_sharing_probe.py without a GPU (Triton's sm_90 compile): the facts the independent-warp designs rest
on. Warps that stage their own slices of a ring with cp.async (Gluon's copies) still get CTA-wide barriers in
their loop whatever they sync themselves, while warps whose stages only inline-PTX bulk copies write, read by Gluon
loads in a layout replicated over the warps, get none: copy, wait, read, and only warp-level syncs. And those
stages must keep gluon_decode's swizzle, without which its staged reads meet bank conflicts."""

from __future__ import annotations

import pytest
from offline_probe import run_probe

PROBE = r'''
import json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
import cta_sharing_probe as probe
ptx, shared = probe.ptx_filled_ring_ptx()
print(json.dumps({"cp_async_loop": probe.loop_events(probe.compile_ptx(True)), "ptx_ring": probe.ptx_events(ptx),
                  "ptx_ring_shared": shared, "staged_reads": probe.staged_read_conflicts()}))
'''


@pytest.fixture(scope="module")
def report() -> dict:
    return run_probe(PROBE, timeout=600)


def test_only_ptx_filled_stages_leave_the_warps_independent(report: dict) -> None:
    # Gluon's own copies: two CTA-wide barriers per trip even though the kernel syncs only each warp's lanes.
    assert report["cp_async_loop"].count("BAR.SYNC (CTA)") == 2 and "bar.warp.sync" in report["cp_async_loop"]
    # PTX copies into a Gluon ring read by Gluon loads: no CTA-wide barrier at all; each trip issues the next copy,
    # waits for its stage, reads it, then syncs the warp's lanes.
    events = report["ptx_ring"]
    assert "BAR.SYNC (CTA)" not in events
    assert events[-4:] == ["bulk copy", "wait", "ld.shared", "bar.warp.sync"]
    assert report["ptx_ring_shared"] == 4 * 2 * 16 * 64 * 2  # the ring alone: WARPS x STAGES slices of 2 KB


def test_staged_reads_need_the_swizzle(report: dict) -> None:
    """gluon_decode's staged reads meet no bank conflict in their swizzled stages and several in unswizzled ones (what
    a 1D bulk copy of a region would give): per-warp rings must keep the swizzle."""
    reads = report["staged_reads"]
    assert set(reads) == {"key_codes_128", "v_codes_128", "key_codes_64", "v_codes_64"}
    assert all(swizzled == 0 and plain >= 3 for swizzled, plain in reads.values()), reads
