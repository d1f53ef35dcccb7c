#!/usr/bin/env python3
"""Offline probes (no GPU): what Gluon (Triton 3.6, sm_90) lets the warps of one CTA, and the CTAs of one cluster,
do apart or together (docs/decisions.md). `env -u TRITON_INTERPRET PYTHONPATH=/opt/tri36 python
bench/cta_sharing_probe.py`.

1. Warps staging their own tiles. Each of WARPS warps copies its own [LINES, 64] int16 slice of a two-stage ring by
   cp.async (the warp axis is axis 0 of every layout, so no lane touches another warp's bytes), waits for its own
   copies (cp.async.wait_group), syncs its own lanes (inline PTX `bar.warp.sync`, or `gl.thread_barrier()` to
   compare) and reads the slice back; the probe prints the loop's copies, waits, barriers and shared loads in
   order. Seen: with the warp sync, Triton's shared-memory barrier analysis still puts a CTA-wide `bar.sync 0` after
   the wait_group (before the reads of what cp.async wrote) and before the next copies into the stage (after the
   reads): warps that share a ring in Gluon-allocated shared memory move in lockstep once per tile whatever the
   kernel asks, as V56's did. Independent warps would need their copies and reads in inline PTX on addresses Gluon
   does not hand out (shared_memory_descriptor has no address).
2. CTAs of a cluster combining values. A [CTAS, 64] fp32 tensor whose row c lives in CTA c of a cluster of CTAS
   (`num_ctas`, block bases on axis 0), reduced over axis 0 (a merge of CTAS split partials), or first converted to a
   layout replicated over the cluster's CTAs. Seen: both are refused by the compiler (the reduction's lowering
   asserts "isReduceWithinCTA", the conversion fails to legalize), so a merge through distributed shared memory
   needs inline PTX (mapa, ld.shared::cluster, barrier.cluster) and, again, shared addresses Gluon does not give.
3. Warps reading their own stages of a Gluon-allocated ring that only inline PTX writes. The ring is the kernel's
   only Gluon allocation ([WARPS x STAGES, LINES, 64] int16, so at offset 0 of global_smem); lane 0 of each warp fills
   the warp's stages by 1D bulk copies (bench/copy_warps.py's PTX, mbarriers in raw bytes past the ring), the lanes
   wait on the stage's mbarrier by inline PTX and then read it with a Gluon load in a layout replicated over the
   warps (V56's: each warp holds the whole slice). Seen: no bar.sync anywhere: Triton's barrier analysis sees only
   reads of the ring, so the warps stay independent while the reads (and every layout the decode's staged tiles use)
   are Gluon's own; only the copies and the waits need PTX.
4. What such a ring costs the decode's staged reads without gluon_decode's swizzle: a 1D bulk copy lands a tile's
   code lines as stored, so `_staged_tile`'s read layouts would meet them in an unswizzled buffer. Gluon's
   bank_conflicts (excess shared-memory wavefronts per access) for each staged read, swizzled as gluon_decode stages
   them and plain. Seen: 0 swizzled; plain, key codes 3 (head_dim 128) and 7 (64), V codes 3 (both): 4-8x the
   shared-memory traffic of those reads. So independent warps should keep the swizzle: per-lane cp.async by PTX into
   the swizzled addresses, or TMA tensor copies by PTX, not one bulk copy per region.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

from copy_warps import (BARRIER_SLOT, _init_barrier, _lane_and_warp, _shared_base, _start_copy,  # noqa: E402
                        _wait_landed, printed_when_compiled)

from vllm_oscar.kernels import gluon_decode as gd  # noqa: E402

#: bar.sync of the CTA (thread_barrier in Triton 3.6, barrier later).
_thread_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
#: cp.async into shared memory (async_copy_global_to_shared in Triton 3.6, async_load later).
_copy_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared

#: Warps per CTA (each its own slice of every stage), lines of 64 int16 per slice, ring stages.
WARPS, LINES, STAGES = 4, 16, 2
#: [WARPS, LINES, 64] int16: 16 bytes per lane, 8 lanes per line, warp w holding slice w.
SLICES = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 4, 8], warps_per_cta=[WARPS, 1, 1],
                          order=[2, 1, 0])
PLAIN = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])


@gluon.jit
def _sync_lanes_of_warp():
    gl.inline_asm_elementwise("bar.warp.sync -1; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _sync(WARP_SYNC: gl.constexpr):
    if WARP_SYNC:
        _sync_lanes_of_warp()
    else:
        _thread_barrier()


@gluon.jit
def staged_slices_kernel(src, out, n_tiles, WARP_SYNC: gl.constexpr, WARPS: gl.constexpr, LINES: gl.constexpr,
                         STAGES: gl.constexpr, SLICES: gl.constexpr, PLAIN: gl.constexpr):
    """Sum n_tiles tiles of [WARPS, LINES, 64] int16 from src (tile i at src + i * 4096, slice w at w * 997 lines)
    into out, each warp staging and reading only its own slice."""
    stages = gl.allocate_shared_memory(gl.int16, [STAGES, WARPS, LINES, 64], PLAIN)
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, SLICES)))
    r = gl.arange(0, LINES, layout=gl.SliceLayout(0, gl.SliceLayout(2, SLICES)))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, SLICES)))
    offs = (w[:, None, None] * 997 + r[None, :, None]) * 64 + c[None, None, :]
    acc = gl.zeros([WARPS, LINES, 64], gl.int32, SLICES)
    _copy_async(stages.index(0), src + offs)
    async_copy.commit_group()
    for i in range(n_tiles):
        _copy_async(stages.index((i + 1) % STAGES), src + offs + (i + 1) * 4096)
        async_copy.commit_group()
        async_copy.wait_group(1)
        _sync(WARP_SYNC)  # the warp's copies of tile i have landed for all its lanes
        acc += stages.index(i % STAGES).load(SLICES).to(gl.int32)
        _sync(WARP_SYNC)  # every lane has read tile i before the warp copies into its stage again
    gl.store(out + offs, acc)


def compile_ptx(warp_sync: bool) -> str:
    """The PTX of staged_slices_kernel for sm_90 with the warp-level (True) or CTA-wide (False) syncs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = staged_slices_kernel.arg_names
    constants = dict(WARP_SYNC=warp_sync, WARPS=WARPS, LINES=LINES, STAGES=STAGES, SLICES=SLICES, PLAIN=PLAIN)
    source = GluonASTSource(fn=staged_slices_kernel,
                            signature={"src": "*i16", "out": "*i32", "n_tiles": "i32",
                                       **{name: "constexpr" for name in constants}},
                            constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ("src", "out")})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS}).asm["ptx"]


def loop_events(ptx: str) -> list[str]:
    """The loop body's copies, waits, barriers and shared loads, in order, one word each."""
    lines = [line.strip() for line in ptx.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("$L__BB0_") and "%.lr.ph" in line)
    events = []
    for line in lines[start:]:
        for pattern, name in ((r"^cp\.async\.commit", "commit"), (r"^cp\.async\.wait_group", "wait_group"),
                              (r"^bar\.sync", "BAR.SYNC (CTA)"), (r"^bar\.warp\.sync", "bar.warp.sync"),
                              (r"^ld\.shared", "ld.shared")):
            if re.match(pattern, line) and (not events or events[-1] != name or name != "ld.shared"):
                events.append(name)
        if re.match(r"^@%p\d+ bra", line):
            break
    return events


#: CTAs per cluster in probe 2 (a portable cluster size).
CTAS = 8
#: [CTAS, 64] fp32: row c in CTA c, 64 columns over the 32 lanes of the CTA's one warp.
ROW_PER_CTA = gl.DistributedLinearLayout(reg_bases=[[0, 1]], lane_bases=[[0, 2], [0, 4], [0, 8], [0, 16], [0, 32]],
                                         warp_bases=[], block_bases=[[1, 0], [2, 0], [4, 0]], shape=[CTAS, 64])
#: The same tensor whole in every CTA of the cluster.
EVERY_CTA = gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [2, 0], [4, 0]],
                                       lane_bases=[[0, 2], [0, 4], [0, 8], [0, 16], [0, 32]], warp_bases=[],
                                       block_bases=[[0, 0], [0, 0], [0, 0]], shape=[CTAS, 64])


@gluon.jit
def cluster_merge_kernel(x_ptr, out_ptr, GATHER: gl.constexpr, ROW_PER_CTA: gl.constexpr,
                         EVERY_CTA: gl.constexpr, CTAS: gl.constexpr):
    """out[c] = sum over rows r of exp2(x[r, c] - max_r x[r, c]), row r held by CTA r (GATHER: converted to
    EVERY_CTA first, else reduced where it lies)."""
    r = gl.arange(0, CTAS, layout=gl.SliceLayout(1, ROW_PER_CTA))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, ROW_PER_CTA))
    x = gl.load(x_ptr + gl.program_id(0) * CTAS * 64 + r[:, None] * 64 + c[None, :])
    if GATHER:
        x = gl.convert_layout(x, EVERY_CTA)
    m = gl.max(x, axis=0)
    total = gl.sum(gl.exp2(x - m[None, :]), axis=0)
    gl.store(out_ptr + gl.program_id(0) * 64 + gl.arange(0, 64, layout=total.type.layout), total)


def compile_cluster_merge(gather: bool) -> None:
    """Compile cluster_merge_kernel for a cluster of CTAS (raises, or aborts the process, where the compiler
    refuses)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = cluster_merge_kernel.arg_names
    constants = dict(GATHER=gather, ROW_PER_CTA=ROW_PER_CTA, EVERY_CTA=EVERY_CTA, CTAS=CTAS)
    source = GluonASTSource(fn=cluster_merge_kernel,
                            signature={"x_ptr": "*fp32", "out_ptr": "*fp32", **{n: "constexpr" for n in constants}},
                            constexprs={(names.index(k),): v for k, v in constants.items()})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_ctas": CTAS})


def cluster_merge_verdict(gather: bool) -> str:
    """'compiled', or the compiler's first error or assertion line: compile_cluster_merge in a child process (an
    assertion in the compiler ends the process)."""
    child = subprocess.run([sys.executable, __file__, "--cluster-case", "gather" if gather else "reduce"],
                           capture_output=True, text=True)
    if child.returncode == 0:
        return "compiled"
    found = [line for line in child.stderr.splitlines() if "Assertion" in line or "error:" in line]
    first = found[0] if found else f"exit status {child.returncode}"
    return "refused: " + (first.split("Assertion", 1)[-1] if "Assertion" in first else first.split("error:", 1)[-1]
                          ).strip()


#: [LINES, 64] int16, the whole slice in every warp (warp bases 0), 16 bytes per lane and load.
REPLICATED = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0]],
                                        lane_bases=[[0, 8], [0, 16], [0, 32], [4, 0], [8, 0]],
                                        warp_bases=[[0, 0]] * (WARPS.bit_length() - 1), block_bases=[],
                                        shape=[LINES, 64])
#: The ring as [WARPS x STAGES, LINES, 64]: one row per (warp, stage), unswizzled (a 1D bulk copy lands bytes as they
#: are in memory).
RING_ROWS = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])


@gluon.jit
def ptx_filled_ring_kernel(src, n_tiles, WARPS: gl.constexpr, LINES: gl.constexpr, STAGES: gl.constexpr,
                           REPLICATED: gl.constexpr, RING_ROWS: gl.constexpr):
    """Each warp sums n_tiles slices of [LINES, 64] int16 (its own, at src + warp x 1000 slices) copied into its own
    stages of a Gluon ring by inline-PTX bulk copies and read back by Gluon loads; the sum goes nowhere but keeps the
    loads (offline probe only)."""
    SLICE: gl.constexpr = LINES * 64 * 2
    ring = gl.allocate_shared_memory(gl.int16, [WARPS * STAGES, LINES, 64], RING_ROWS)
    lane, warp = _lane_and_warp()
    mine = _shared_base() + warp * (STAGES * SLICE)
    bars = _shared_base() + WARPS * STAGES * SLICE + warp * (STAGES * BARRIER_SLOT)
    for s in gl.static_range(STAGES):
        _init_barrier(bars + BARRIER_SLOT * s, lane)
    first = src.to(gl.int64, bitcast=True) + warp.to(gl.int64) * (1000 * SLICE)
    _start_copy(mine, first, SLICE, bars, lane, 1)
    total = gl.zeros([LINES, 64], gl.int32, REPLICATED)
    for i in range(n_tiles):
        ahead = (i + 1) % STAGES
        _start_copy(mine + ahead * SLICE, first + (i + 1) * SLICE, SLICE, bars + BARRIER_SLOT * ahead, lane,
                    (i + 1 < n_tiles).to(gl.int32))
        total += _wait_landed(bars + BARRIER_SLOT * (i % STAGES), (i // STAGES) % 2)
        total += ring.index(warp * STAGES + i % STAGES).load(REPLICATED).to(gl.int32)
        gl.inline_asm_elementwise("bar.warp.sync -1; mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ge.s32 p, $1, 0; mov.u32 $0, 0; }", "=r,r",
                              [gl.sum(gl.sum(total, axis=1), axis=0)], dtype=gl.int32, is_pure=False, pack=1)


def ptx_filled_ring_ptx() -> tuple[str, int]:
    """(PTX, shared bytes of Gluon's) of ptx_filled_ring_kernel for sm_90."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = ptx_filled_ring_kernel.arg_names
    constants = dict(WARPS=WARPS, LINES=LINES, STAGES=STAGES, REPLICATED=REPLICATED, RING_ROWS=RING_ROWS)
    source = GluonASTSource(fn=ptx_filled_ring_kernel,
                            signature={"src": "*i16", "n_tiles": "i32", **{name: "constexpr" for name in constants}},
                            constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(names.index("src"),): [["tt.divisibility", 16]]})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS})
    return kernel.asm["ptx"], kernel.metadata.shared


def ptx_events(ptx: str) -> list[str]:
    """The kernel's bulk copies, mbarrier waits, CTA and warp barriers and shared loads in PTX order, one word each
    (repeats of a shared load merged)."""
    events = []
    for line in (line.strip() for line in ptx.splitlines()):
        for pattern, name in ((r"cp\.async\.bulk\.", "bulk copy"), (r"mbarrier\.try_wait", "wait"),
                              (r"^(bar|barrier)\.sync", "BAR.SYNC (CTA)"), (r"^ld\.shared", "ld.shared"),
                              (r"bar\.warp\.sync", "bar.warp.sync")):  # inline PTX: one line per asm block
            if re.search(pattern, line) and (not events or events[-1] != name or name != "ld.shared"):
                events.append(name)
    return events


#: Unswizzled 2D buffers (a 1D bulk copy's landing).
PLAIN_2D = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])


@gluon.jit
def _print_conflicts(NAME: gl.constexpr, read, staged, plain):
    """static_print "BANK NAME <swizzled> <plain>": the bank conflicts of reading ``staged`` and ``plain`` (the same
    shape, unswizzled) into ``read``'s layout."""
    gl.static_print("BANK", NAME, gl.bank_conflicts(read.type, staged.type), gl.bank_conflicts(read.type, plain.type))


@gluon.jit
def staged_reads_kernel(PLAIN_2D: gl.constexpr):
    """Compile-time only: _print_conflicts of each staged read of gluon_decode, its stage buffer as gluon_decode lays
    it out against an unswizzled one."""
    keys = gl.allocate_shared_memory(gl.uint8, [16, 128], gd.STAGED_KEYS)
    _print_conflicts("key_codes_128", keys.load(gd.STAGED_CODES_128), keys,
                     gl.allocate_shared_memory(gl.uint8, [16, 128], PLAIN_2D))
    values = gl.allocate_shared_memory(gl.int16, [16, 64], gd.STAGED_V_128)
    _print_conflicts("v_codes_128", values.load(gd.STAGED_PAIRS_128), values,
                     gl.allocate_shared_memory(gl.int16, [16, 64], PLAIN_2D))
    keys = gl.allocate_shared_memory(gl.uint8, [8, 128], gd.STAGED_KEYS)
    _print_conflicts("key_codes_64", keys.load(gd.STAGED_CODES_64), keys,
                     gl.allocate_shared_memory(gl.uint8, [8, 128], PLAIN_2D))
    values = gl.allocate_shared_memory(gl.int16, [8, 64], gd.STAGED_V_64)
    _print_conflicts("v_codes_64", values.load(gd.STAGED_PAIRS_64), values,
                     gl.allocate_shared_memory(gl.int16, [8, 64], PLAIN_2D))


def staged_read_conflicts() -> dict[str, tuple[int, int]]:
    """{read: (bank conflicts swizzled, plain)} of staged_reads_kernel, from its compile-time prints."""
    found = (line.split() for line in printed_when_compiled(staged_reads_kernel, dict(PLAIN_2D=PLAIN_2D))
             if line.startswith("BANK "))
    return {name: (int(swizzled), int(plain)) for _, name, swizzled, plain in found}


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    print(f"1. {WARPS} warps per CTA, each staging its own slice:")
    for warp_sync in (True, False):
        print(f"   {'warp-level sync' if warp_sync else 'CTA-wide sync  '}: loop = "
              f"{' -> '.join(loop_events(compile_ptx(warp_sync)))}")
    print(f"2. a cluster of {CTAS} CTAs, one row each:")
    print(f"   reduced over the CTAs where it lies: {cluster_merge_verdict(False)}")
    print(f"   gathered into every CTA first:       {cluster_merge_verdict(True)}")
    ptx, shared = ptx_filled_ring_ptx()
    print(f"3. {WARPS} warps reading their own stages of a Gluon ring ({shared} B) that inline-PTX bulk copies fill:")
    print(f"   {' -> '.join(ptx_events(ptx))}")
    print("4. bank conflicts of gluon_decode's staged reads, swizzled as staged / unswizzled:")
    for read, (swizzled, plain) in staged_read_conflicts().items():
        print(f"   {read}: {swizzled} / {plain}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cluster-case"]:
        compile_cluster_merge(sys.argv[2] == "gather")
    else:
        main()
