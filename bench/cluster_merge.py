#!/usr/bin/env python3
"""The split-K merge inside a thread-block cluster, against the merge launch (docs/decisions.md).

gluon_decode merges its split partials in a second launch (merge_kernel, programmatic dependent launch): 1.0-2.1 us
after the split kernel at every unmet cell (session 36), and every merge that synchronised through global memory
instead was slower (V9, session 36's counted merge). What is left is a merge that never leaves the SMs: the split
programs of one (request, KV head) pair in one Hopper cluster of at most 16 CTAs, each CTA of 1-16 warps that are
independent split programs (bench/copy_warps.py: raw shared memory, one bulk copy per tile, no CTA-wide barrier),
their partials meeting in distributed shared memory. Gluon 3.6 lowers none of this (bench/cta_sharing_probe.py), so
it is inline PTX, and the kernel, compiled for one CTA per program, is launched with a cluster dimension through
Triton's own launcher (raw_launch).

Each split program's work is bench/copy_warps.py's: copy its tiles of the cell's blocks (one bulk copy per tile, or
with --lane-copies per-lane cp.async into swizzled lines), read their scale planes, optionally a compute stand-in
(--work / --jitter / --chains as in bench/copy_shapes.py); its partial (GROUP x D values and GROUP log-sum-exps) is
a deterministic function of what it read, so that the merge has real data. Per cell and shape (warps:ctas:stages;
splits per pair = warps x ctas) four modes, CUDA-graph replays over every layer's cache copy:

* ``split``: the split kernel alone, partials stored to global memory (what the merge's cost is measured on top of);
* ``launch``: the same kernel, then the shipped merge (triton_ops' merge launch, programmatic dependent launch);
* ``pull``: in the cluster, each warp's partial left in its CTA's shared memory, a cluster barrier, each CTA reading
  its share of the pair's outputs from every peer (mapa + ld.shared::cluster), a second barrier before exit;
* ``push``: in the cluster, each lane writing its partial's elements into the shared memory of the CTA that merges
  them (st.async, completing that CTA's mbarrier: no fence, no barrier after the work), each CTA waiting on its own;

and, for scale, the cell's shipped decode (split kernel and merge of the plan). Before timing, the merged outputs of
``launch``, ``pull`` and ``push`` are compared with a float64 merge of the stored partials; a difference makes the
script exit 1. Offline (no GPU), `compile_offline` gives the kernel's SASS (tests/test_cluster_merge.py).

    python bench/cluster_merge.py --cells qwen3-8b:131072:1 qwen3-8b:32768:8 smollm2-135m:131072:8 \\
        --shapes 8:16:2 4:16:3 4:8:3 2:16:3 --work 0 200 [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import types
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from copy_warps import (BARRIER_SLOT, _lane_and_warp, add_stand_in_arguments, raw_base, raw_launch,  # noqa: E402
                        ring_bytes, warp_split_checksum)
from gluon_case import NOT_GLUON, add_output_arguments, cuda_device, finish, gluon_case  # noqa: E402
from split_timeline import parse_cell  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, time_graph  # noqa: E402
from vllm_oscar.kernels.gluon_decode import TILE  # noqa: E402

#: Most CTAs per cluster on Hopper (16 is a non-portable size, which Triton's launcher enables).
MAX_CLUSTER = 16
#: The modes whose launches leave merged outputs (all but "split").
MERGING_MODES = ("launch", "pull", "push")
#: Tries of an mbarrier wait before the kernel traps: at >= ~50 ns a try (more where try_wait suspends the thread)
#: >= ~3 ms, far past the ~0.1 ms that the slowest split of a cluster can keep its peers waiting here.
WAIT_TRIES: gl.constexpr = gl.constexpr(1 << 16)
#: Largest |merged - float64 merge| accepted, relative to the largest |partial| (fp32 sums of <= 256 terms).
MERGE_TOLERANCE = 1e-5


@gluon.jit
def _cluster_sync():
    """Every thread of every CTA of the cluster: arrive (releasing this CTA's shared-memory writes to the cluster)
    and wait for all (acquiring theirs)."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                              "mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _launch_dependents():
    """Let a programmatically dependent launch (the merge) start now (gluon_decode's TRIGGER_DEPENDENTS)."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _store_f32(address, value, live, SHARED: gl.constexpr):
    """Where live != 0: store fp32 ``value`` at ``address`` (this CTA's shared window, int32, or global, int64).
    Returns 0."""
    if SHARED:
        return gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.shared.f32 [$1], $2; mov.u32 $0, 0; }",
            "=r,r,f,r", [address, value, live], dtype=gl.int32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p st.global.f32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,f,r", [address, value, live], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_peer_f32(address, rank, live, other):
    """Elementwise: the fp32 at shared ``address`` of CTA ``rank`` of the cluster (int32 tensors), or ``other``
    where live == 0 (nothing read there)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a; setp.ne.s32 p, $3, 0; mov.b32 $0, $4; "
        "@p mapa.shared::cluster.u32 a, $1, $2; @p ld.shared::cluster.f32 $0, [a]; }",
        "=f,r,r,r,f", [address, rank, live, other], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _stand_in_output(seen, pid, e):
    """Split program pid's stand-in partial output at element e (head e // D, channel e % D), from the checksum
    ``seen`` of what it read: fp32 in [-0.5, 0.5)."""
    return ((seen + 131 * pid + 7 * e) & 1023).to(gl.float32) * (1.0 / 1024.0) - 0.5


@gluon.jit
def _stand_in_lse(seen, pid, g):
    """Split program pid's stand-in log2-sum-exp of head g: fp32 in [g, g + 8)."""
    return ((seen + 17 * pid) & 255).to(gl.float32) * (1.0 / 32.0) + g


@gluon.jit
def _cluster_arrive_relaxed():
    """Every thread: arrive on the cluster barrier without ordering (the mbarrier inits before it are published by
    fence.mbarrier_init)."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _cluster_wait():
    """Every thread: wait until every thread of the cluster has arrived (acquiring what they released)."""
    gl.inline_asm_elementwise("barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _init_receiver(bar, nbytes, leader):
    """The leader thread: mbarrier at shared ``bar`` expecting one arrival, fenced for the cluster, and that arrival
    made with nbytes of transactions expected (the peers' pushes complete them). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p mbarrier.init.shared::cta.b64 [$1], 1; "
        "@p fence.mbarrier_init.release.cluster; @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r", [bar, nbytes, leader], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _push_f32(address, value, bar, rank, live):
    """Where live != 0: write fp32 ``value`` into shared ``address`` of CTA ``rank`` of the cluster, completing 4
    bytes of its mbarrier at shared ``bar`` (st.async: no fence, no wait). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a, m; setp.ne.s32 p, $5, 0; @p mapa.shared::cluster.u32 a, $1, $4; "
        "@p mapa.shared::cluster.u32 m, $3, $4; "
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [a], $2, [m]; mov.u32 $0, 0; }",
        "=r,r,f,r,r,r", [address, value, bar, rank, live], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_phase(bar):
    """Every thread: wait until the mbarrier at shared ``bar`` completes its phase 0, acquiring at cluster scope what
    the peers' pushes wrote, or trap after WAIT_TRIES tries (a push lost or miscounted ends the launch with an error
    instead of hanging the GPU). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred done; .reg .u32 n; mov.u32 n, 0; "
        "waiting: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$1], 0; @done bra landed; "
        "add.u32 n, n, 1; setp.lt.u32 done, n, $2; @done bra waiting; trap; landed: mov.u32 $0, 0; }",
        "=r,r,r", [bar, WAIT_TRIES], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _merge_slots(values, lse):
    """The exact merge of [S_PAD, CHUNK] partial values weighted by 2^lse (lse -inf: an empty slot, weight 0) over
    axis 0: [CHUNK] fp32 (0 where every slot is empty)."""
    top = gl.max(lse, axis=0)
    weight = gl.exp2(lse - gl.where(top == float("-inf"), 0.0, top)[None, :])
    total = gl.sum(weight, axis=0)
    return gl.sum(values * weight, axis=0) / gl.where(total > 0.0, total, 1.0)


@gluon.jit
def cluster_split_kernel(bt_ptr, stride_bt, n_tiles, heads, cache_ptr, NSPLIT, work, jitter,
                         part_ptr, stride_pb, stride_ph, stride_ps, lse_ptr, stride_lb, stride_lh,
                         out_ptr, stride_ob, stride_oh,
                         STAGES: gl.constexpr, REGION: gl.constexpr, WARPS: gl.constexpr, CHAINS: gl.constexpr,
                         LANE_COPIES: gl.constexpr, CODES: gl.constexpr, V_PHASE: gl.constexpr,
                         PLANES: gl.constexpr, CTAS: gl.constexpr, GROUP: gl.constexpr,
                         D: gl.constexpr, MERGE: gl.constexpr, MERGED: gl.constexpr, S_PAD: gl.constexpr,
                         CHUNK: gl.constexpr, SLOT_BYTES: gl.constexpr):
    """Grid (B x heads x CTAS,), WARPS warps per CTA; CTA x serves pair x // CTAS (request b, KV head h) as its
    (x % CTAS)-th CTA, warp w being split program p = (x % CTAS) x WARPS + w of NSPLIT (<= CTAS x WARPS), whose tiles
    it copies from cache_ptr [blocks, heads, REGION] uint8 (block table bt_ptr [B, >= n_tiles] int32, row stride
    stride_bt; copy_warps.warp_split_checksum). Its stand-in partial: GROUP x D fp32 outputs (element e = head x D +
    channel) and GROUP log2-sum-exps. Raw shared memory (copy_warps.raw_base; raw_launch adds cluster_shared_bytes of
    it): each warp's ring, then the merge's bytes.

    MERGE (one of MERGE_FORMS' values):
    * "global": the partials to global memory, part [B, heads x GROUP, >= NSPLIT, D] fp32 (strides stride_pb /
      stride_ph / stride_ps, channels contiguous) and lse [B, heads x GROUP, >= NSPLIT] fp32 (stride_lb /
      stride_lh), the layout merge_kernel reads; a dependent merge launch may start at once.
    * "pull" (launched as clusters of CTAS CTAs, a pair's CTAs one cluster): each warp leaves its partial in its
      CTA's shared memory (SLOT_BYTES per warp: outputs, then lse), a cluster barrier, CTA r reads its elements [r x
      PER_CTA, (r + 1) x PER_CTA) of every slot from its peers (ld.shared::cluster), merges them into out [B, heads x
      GROUP, D] fp32 (stride_ob / stride_oh), and a second cluster barrier keeps its shared memory until every peer
      has read it.
    * "push" (clusters as above): CTA r owns S_PAD receive slots of SLOT_BYTES (CHUNK outputs, then GROUP lse) and an
      mbarrier expecting NSPLIT x (its elements + GROUP) x 4 bytes; after a cluster barrier that publishes every
      mbarrier (arrived at the start, waited for after the split's work), each lane writes its partial's elements
      into the owning CTAs' slots by st.async, completing their mbarriers; CTA r waits on its own and merges locally.
    The merge's [S_PAD, CHUNK] tensors are in layout MERGED (the slots in one warp's lanes)."""
    rings = raw_base(WARPS)
    if MERGE == "global":
        _launch_dependents()
    x = gl.program_id(0)
    pair = x // CTAS
    rank = x % CTAS
    b = pair // heads
    h = pair % heads
    lane, warp = _lane_and_warp()
    pid = rank * WARPS + warp
    RING: gl.constexpr = STAGES * (REGION + BARRIER_SLOT)
    E: gl.constexpr = GROUP * D
    PER_CTA: gl.constexpr = (E + CTAS - 1) // CTAS  # merged elements per CTA
    STEPS: gl.constexpr = (E + 31) // 32  # of a warp's lanes over its partial's elements
    merge_base = rings + WARPS * RING
    if MERGE == "push":
        mine = gl.maximum(gl.minimum(PER_CTA, E - rank * PER_CTA), 0)  # elements this CTA merges
        _init_receiver(merge_base + S_PAD * SLOT_BYTES, NSPLIT * (mine + GROUP) * 4, (lane == 0) & (warp == 0))
        _cluster_arrive_relaxed()
    seen = warp_split_checksum(bt_ptr + b.to(gl.int64) * stride_bt, n_tiles, heads,
                               cache_ptr.to(gl.int64, bitcast=True) + h.to(gl.int64) * REGION, NSPLIT, work, jitter,
                               pid, h, lane, rings + warp * RING, STAGES, REGION, CHAINS, PLANES, LANE_COPIES, CODES,
                               V_PHASE)
    live = pid < NSPLIT
    if MERGE == "global":
        row = b.to(gl.int64) * stride_pb + pid.to(gl.int64) * stride_ps
        for k in gl.static_range(STEPS):
            e = lane + 32 * k
            at = row + (h * GROUP + e // D).to(gl.int64) * stride_ph + e % D
            _store_f32(part_ptr.to(gl.int64, bitcast=True) + 4 * at, _stand_in_output(seen, pid, e),
                       ((e < E) & live).to(gl.int32), False)
        for g in gl.static_range(GROUP):
            at = b.to(gl.int64) * stride_lb + (h * GROUP + g).to(gl.int64) * stride_lh + pid
            _store_f32(lse_ptr.to(gl.int64, bitcast=True) + 4 * at, _stand_in_lse(seen, pid, g),
                       ((lane == 0) & live).to(gl.int32), False)
    else:
        s = gl.arange(0, S_PAD, layout=gl.SliceLayout(1, MERGED))
        c = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, MERGED))
        e = rank * PER_CTA + c
        ok_e = (c < PER_CTA) & (e < E)
        head = e // D
        both = ((s < NSPLIT)[:, None] & ok_e[None, :]).to(gl.int32)
        if MERGE == "pull":
            mine = merge_base + warp * SLOT_BYTES
            for k in gl.static_range(STEPS):
                at = lane + 32 * k
                _store_f32(mine + 4 * at, _stand_in_output(seen, pid, at), (at < E).to(gl.int32), True)
            for g in gl.static_range(GROUP):
                _store_f32(mine + 4 * (E + g), _stand_in_lse(seen, pid, g), (lane == 0).to(gl.int32), True)
            _cluster_sync()
            slot = merge_base + (s % WARPS) * SLOT_BYTES  # split s: warp s % WARPS of CTA s // WARPS
            holder = (s // WARPS)[:, None] + 0 * c[None, :]
            lse = _load_peer_f32(slot[:, None] + 4 * (E + head)[None, :], holder, both, float("-inf"))
            values = _load_peer_f32(slot[:, None] + 4 * e[None, :], holder, both, 0.0)
        else:
            bar = merge_base + S_PAD * SLOT_BYTES
            slot = merge_base + pid * SLOT_BYTES  # this split's slot in every owner
            _cluster_wait()  # every owner's mbarrier initialised
            for k in gl.static_range(STEPS):
                at = lane + 32 * k
                _push_f32(slot + 4 * (at % PER_CTA), _stand_in_output(seen, pid, at), bar, at // PER_CTA,
                          ((at < E) & live).to(gl.int32))
            for k in gl.static_range((CTAS * GROUP + 31) // 32):
                at = lane + 32 * k
                _push_f32(slot + 4 * (CHUNK + at % GROUP), _stand_in_lse(seen, pid, at % GROUP), bar, at // GROUP,
                          ((at < CTAS * GROUP) & live).to(gl.int32))
            _wait_phase(bar)
            own = merge_base + s * SLOT_BYTES
            rows = rank + 0 * both
            lse = _load_peer_f32(own[:, None] + 4 * (CHUNK + head)[None, :], rows, both, float("-inf"))
            values = _load_peer_f32(own[:, None] + 4 * c[None, :], rows, both, 0.0)
        merged = _merge_slots(values, lse)
        gl.store(out_ptr + b.to(gl.int64) * stride_ob + (h * GROUP + head) * stride_oh + e % D, merged, mask=ok_e)
        if MERGE == "pull":
            _cluster_sync()


#: The benchmark's modes and the merge form each runs cluster_split_kernel with (its docstring): "split" and
#: "launch" store the partials ("launch" then runs the shipped merge launch), "pull" and "push" merge in the cluster.
MERGE_FORMS = {"split": "global", "launch": "global", "pull": "pull", "push": "push"}


def slot_bytes(merge: str, group: int, head_dim: int, chunk: int) -> int:
    """Shared bytes of one merge slot, rounded up to 16: a warp's whole partial (GROUP x D outputs and GROUP lse,
    fp32) for "pull", CHUNK outputs and GROUP lse for "push"."""
    values = group * head_dim if merge == "pull" else chunk
    return -(-4 * (values + group) // 16) * 16


def cluster_shared_bytes(constants: dict) -> int:
    """cluster_split_kernel's raw shared memory for its constexprs: per warp, its ring (copy_warps.ring_bytes); then,
    for "pull", one slot per warp, for "push", S_PAD slots and an mbarrier."""
    slot, merge = constants["SLOT_BYTES"], constants["MERGE"]
    rings = ring_bytes(constants["WARPS"], constants["STAGES"], constants["REGION"])
    return rings + {"global": 0, "pull": constants["WARPS"] * slot,
                    "push": constants["S_PAD"] * slot + BARRIER_SLOT.value}[merge]


def merge_layout(slots: int, chunk: int, warps: int) -> gl.BlockedLayout:
    """[slots, chunk] over ``warps`` warps with axis 0 (the split slots, a power of two) in each warp's lanes and
    registers, so that the merge's reductions over the slots stay inside a warp (no shared memory)."""
    lanes = min(32, slots)
    return gl.BlockedLayout(size_per_thread=[max(1, slots // lanes), max(1, chunk // (32 // lanes * warps))],
                            threads_per_warp=[lanes, 32 // lanes], warps_per_cta=[1, warps], order=[0, 1])


def kernel_constants(cell, warps: int, ctas: int, stages: int, merge: str, chains: int = 1,
                     lane_copies: bool = False) -> dict:
    """cluster_split_kernel's constexprs for a cell, a shape and a merge form (lane_copies: the split programs copy
    by per-lane cp.async into swizzled lines, copy_warps.warp_split_checksum, instead of one bulk copy per tile)."""
    layout = cell.case.layout
    dim = layout.head_dim
    group = cell.case.query.shape[1] // cell.case.caches[0].shape[1]
    slots = triton.next_power_of_2(warps * ctas)
    chunk = triton.next_power_of_2(-(-group * dim // ctas))
    slot = slot_bytes(merge, group, dim, chunk)
    return dict(STAGES=stages, REGION=layout.head_region_bytes, WARPS=warps, CHAINS=chains,
                PLANES=layout.plane_offset("k_scale"), LANE_COPIES=lane_copies, CODES=layout.plane_offset("v_codes"),
                V_PHASE=2 if dim == 128 else 1, CTAS=ctas, GROUP=group, D=dim, MERGE=merge,
                MERGED=merge_layout(slots, chunk, warps), S_PAD=slots, CHUNK=chunk, SLOT_BYTES=slot)


class Buffers:
    """A cell's partials ([B, Hq, splits, D] fp32, lse [B, Hq, splits] fp32) and merged outputs ([B, Hq, D] fp32,
    one per mode that merges)."""

    def __init__(self, batch: int, hq: int, splits: int, dim: int, device: torch.device):
        self.part = torch.zeros(batch, hq, splits, dim, dtype=torch.float32, device=device)
        self.lse = torch.zeros(batch, hq, splits, dtype=torch.float32, device=device)
        self.out = {mode: torch.full((batch, hq, dim), float("nan"), dtype=torch.float32, device=device)
                    for mode in MERGING_MODES}


def mode_launches(cell, warps: int, ctas: int, stages: int, mode: str, buffers: Buffers, work: int = 0,
                  jitter: int = 0, chains: int = 1, lane_copies: bool = False, layers: Optional[int] = None) -> list:
    """One callable per layer's cache copy (the first ``layers`` of them; all by default) running ``mode`` (module
    docstring) for a shape over the cell's blocks."""
    case = cell.case
    batch, hkv = case.block_table.shape[0], case.caches[0].shape[1]
    nsplit = warps * ctas
    constants = kernel_constants(cell, warps, ctas, stages, MERGE_FORMS[mode], chains, lane_copies)
    in_cluster = MERGE_FORMS[mode] != "global"
    out = buffers.out.get(mode, buffers.out["launch"])
    part, lse = buffers.part, buffers.lse
    config = cell.config

    def launches(cache: torch.Tensor):
        args = [case.block_table, case.block_table.stride(0), cell.length // TILE.value, hkv, cache, nsplit, work,
                jitter, part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1), out,
                out.stride(0), out.stride(1)]
        split = raw_launch(cluster_split_kernel, (batch * hkv * ctas, 1, 1), args, dict(constants, num_warps=warps),
                           cluster_shared_bytes(constants), ctas if in_cluster else 1)
        if in_cluster:
            return split

        def split_and_merge() -> None:
            split()
            if mode == "launch":
                triton_ops._merge_partials(part, lse, out, config, emulated=False, pdl=True, decode=True)

        return split_and_merge

    return [launches(cache) for cache in case.caches[:layers]]


def merge_error(cell, warps: int, ctas: int, stages: int, buffers: Buffers, modes: tuple[str, ...],
                lane_copies: bool = False) -> dict:
    """One launch of each of ``modes`` (in order: "split" first) over the first layer's cache copy, each merged
    output compared with a float64 merge of the partials the split-only mode stores (the same stand-in values):
    {mode: max |out - reference| / max |partial|} for the modes that merge."""
    for mode in modes:
        mode_launches(cell, warps, ctas, stages, mode, buffers, lane_copies=lane_copies, layers=1)[0]()
    torch.cuda.synchronize()
    part, lse = buffers.part.double(), buffers.lse.double()
    weight = torch.exp2(lse - lse.amax(dim=-1, keepdim=True))
    reference = (part * weight[..., None]).sum(dim=2) / weight.sum(dim=2)[..., None]
    scale = part.abs().max().item()
    return {mode: ((buffers.out[mode].double() - reference).abs().max() / scale).item()
            for mode in modes if mode in MERGING_MODES}


def offline_cell(head_dim: int, group: int) -> types.SimpleNamespace:
    """What kernel_constants reads of a cell, for one KV head of this head_dim and GQA group (CPU tensors, blocks of
    gluon_decode's tile)."""
    layout = PageLayout(head_dim, head_dim, TILE.value)
    return types.SimpleNamespace(case=types.SimpleNamespace(
        layout=layout, query=torch.empty(1, group, head_dim), caches=[torch.empty(1, 1, layout.head_region_bytes)]))


def compile_offline(head_dim: int, group: int, warps: int, ctas: int, stages: int, merge: str,
                    lane_copies: bool = False):
    """cluster_split_kernel's CompiledKernel for sm_90 without a GPU (the constexprs kernel_constants gives a cell of
    this head_dim and GQA group)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constants = kernel_constants(offline_cell(head_dim, group), warps, ctas, stages, merge, lane_copies=lane_copies)
    names = cluster_split_kernel.arg_names
    pointers = {"bt_ptr": "*i32", "cache_ptr": "*u8", "part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*fp32"}
    signature = {name: pointers.get(name, "i32") for name in names[:-len(constants)]}
    source = GluonASTSource(fn=cluster_split_kernel,
                            signature={**signature, **{name: "constexpr" for name in constants}},
                            constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in pointers})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def parse_shape(text: str) -> tuple[int, int, int]:
    """warps:ctas:stages (module docstring)."""
    try:
        warps, ctas, stages = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes warps:ctas:stages (e.g. 8:16:2); got {text!r}")
    if warps not in (1, 2, 4, 8, 16) or not 1 <= ctas <= 256 or not 2 <= stages <= 8:
        raise argparse.ArgumentTypeError(f"{text!r}: warps 1, 2, 4, 8 or 16; ctas 1-256 (a cluster at most "
                                         f"{MAX_CLUSTER}); stages 2-8")
    return warps, ctas, stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=parse_cell, nargs="+", default=[parse_cell("qwen3-8b:131072:1"),
                                                                   parse_cell("qwen3-8b:32768:8"),
                                                                   parse_cell("smollm2-135m:131072:8")])
    parser.add_argument("--shapes", type=parse_shape, nargs="+",
                        default=[parse_shape(s) for s in ("8:16:2", "4:16:3", "4:8:3", "2:16:3")])
    add_stand_in_arguments(parser, [0, 200], [4], [0, 1])
    parser.add_argument("--lane-copies", action="store_true",
                        help="split programs copy by per-lane cp.async into swizzled code lines (copy_shapes' 'c' "
                             "shapes, the form a decode reading staged tiles needs) instead of one bulk copy per tile")
    parser.add_argument("--check-only", action="store_true",
                        help="only compare each shape's merged outputs with the float64 merge (exit 1 on a "
                             "difference), no timing: a first, short run under `timeout`")
    add_output_arguments(parser)
    args = parser.parse_args()
    device = cuda_device("bench/cluster_merge.py launches thread-block clusters on a CUDA GPU; none is visible.")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows, failed = [], []
    for geometry, length, batch in args.cells:
        cell = gluon_case(geometry, length, batch, device)
        if cell is None:
            print(f"{geometry} {length} B={batch}: {NOT_GLUON}")
            continue
        hq, hkv, dim = GEOMETRIES[geometry]
        decode_ms = float("nan") if args.check_only else time_graph(
            [lambda i=i: cell.decode(i) for i in range(cell.layers)], args.reps)
        print(f"{geometry} {length} B={batch}: plan {cell.plan.num_splits} splits, shipped decode "
              f"{decode_ms * 1000:.1f} us", flush=True)
        rows.append({"geometry": geometry, "context": length, "batch": batch, "mode": "decode",
                     "splits": cell.plan.num_splits, "ms": decode_ms})
        for warps, ctas, stages in args.shapes:
            buffers = Buffers(batch, hq, warps * ctas, dim, device)
            modes = tuple(MERGE_FORMS) if ctas <= MAX_CLUSTER else ("split", "launch")  # no cluster of > 16
            errors = merge_error(cell, warps, ctas, stages, buffers, modes, args.lane_copies)
            bad = {mode: err for mode, err in errors.items() if not err <= MERGE_TOLERANCE}
            if bad:
                failed.append(f"{geometry} {length} B={batch} {warps}:{ctas}:{stages} {bad}")
            print(f"  {warps} warps x {ctas} CTAs x {stages} stages ({warps * ctas} splits per pair, "
                  f"{batch * hkv * ctas / sms:.1f} CTAs per SM): merge error vs float64 "
                  + ", ".join(f"{m} {e:.1e}" for m, e in errors.items()), flush=True)
            if args.check_only:
                continue
            for (work, jitter, chains), mode in itertools.product(
                    itertools.product(args.work, args.jitter, args.chains), modes):
                if (jitter or chains > 1) and not work:
                    continue  # jitter or chains of nothing
                ms = time_graph(mode_launches(cell, warps, ctas, stages, mode, buffers, work, jitter, chains,
                                              args.lane_copies), args.reps)
                rows.append({"geometry": geometry, "context": length, "batch": batch, "mode": mode, "warps": warps,
                             "ctas": ctas, "stages": stages, "splits": warps * ctas, "work": work, "jitter": jitter,
                             "chains": chains, "lane_copies": args.lane_copies, "ms": ms,
                             "merge_error": errors.get(mode)})
                print(f"    work {work} jitter {jitter} chains {chains} {mode:8s}: {ms * 1000:.1f} us", flush=True)
        del cell
        torch.cuda.empty_cache()
    return finish(args.json, rows, failed, "merged outputs differ from the float64 merge")


if __name__ == "__main__":
    raise SystemExit(main())
