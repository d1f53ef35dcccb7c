#!/usr/bin/env python3
"""Copies alone, by program shape: how fast long-lived split programs can copy a decode cell's INT2 tiles into shared
memory by TMA, for programs of 1 or 4 warps (or 4 warps fed by a producer warp) and rings of 2-8 stages, against a
plain streaming read of the same bytes (bench/decode_floor.py's floor). Measured on the H200 (docs/decisions.md):
gluon_decode's own shape (one-warp programs at the plan's split count, two stages) copies at 0.97-0.99
of the stream at the long cells and every other shape is slower, so the copies are not where the decode loses time;
with `--cells` and `--shapes 1:2:plan` it gives the "copies alone" column of a cell's time by parts.

    python bench/copy_shapes.py --cells qwen3-8b:131072:1 smollm2-135m:131072:8 \\
        --shapes 1:2:plan 1:4:plan 4:6:quarter 4p:6:quarter 4p:8:eighth [--json OUT]

A shape is warps:stages:splits. warps: 1 or 4 (the program's warps issue its copies, gluon_decode's way: block ids
from the block table one tile ahead, three TMA boxes per tile at head_dim 128 (two at 64) on one mbarrier per stage,
one bar.sync of the warps per tile), or 4p (copy_split_ws_kernel: a warp-specialized producer warp issues them, the
4 warps wait on full barriers and release stages on empty ones), or 1i / 4i (bench/copy_warps.py: CTAs of one or
four warps that are each an independent split program, copying each tile's whole region by one bulk copy into their
own ring through inline PTX, with no CTA-wide barrier), or 1c / 4c (the same warps copying by per-lane cp.async into
the swizzled code lines that gluon_decode's staged reads need, 9 chunks of 16 bytes per lane and tile at head_dim
128, waiting on their own groups: 2-4 stages); the independent-warp shapes' checksums are compared once per shape
with the one-warp TMA shape's, printed, and any difference makes the script exit 1). splits, per (request, KV head):
a number, ``plan`` (gluon_decode's split count of the cell), ``quarter`` / ``eighth`` (a quarter / an eighth of it:
as many warps per SM as the plan with 4-warp CTAs, or half as many), or ``tiles`` (one tile per program, the streaming
probes' shape: no ring at all). Each program walks its split of all the request's blocks (the window blocks too:
the bytes are those of the cell's blocks); after a stage lands its warps read the tile's 512 bytes of scale planes
(the copies are what is timed). Timed as CUDA-graph replays over as many cache copies as `bench decode` uses
(bench/gluon_case.py), ms per launch, with the achieved GB/s of the region bytes.

    python bench/copy_shapes.py --cells qwen3-8b:131072:1 --shapes 1:2:plan --work 0 200 400 --jitter 0 1

--work N (every shape but 4p) adds a stand-in for a tile's compute after each tile lands: N FMAs in one
dependent chain (--chains 4: four independent chains, the same FMAs issued four times as densely), or with --jitter 1
N times a pseudo-random factor in [0.5, 1.5) per program and tile. H200, Qwen3-8B
128K B=1 (docs/decisions.md): 19.8 us alone, 22.5 us at N = 200 and 25.7 with jitter at the same
mean, against the split kernel's 24.7: what the decode's compute costs the copies depends on how unevenly the
programs progress, not only on its size.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier  # noqa: E402

from vllm_oscar.kernels import PageLayout, triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, time_graph  # noqa: E402
from vllm_oscar.kernels.gluon_decode import STAGED, TILE, _start_stage, _sync_warps, _view_as, tma_descriptors, tma_ring  # noqa: E402

from copy_warps import add_stand_in_arguments, compute_stand_in, copy_warps_kernel, raw_launch, ring_bytes  # noqa: E402
from decode_floor import floor_ms  # noqa: E402
from gluon_case import NOT_GLUON, add_output_arguments, cuda_device, finish, gluon_case  # noqa: E402
from split_timeline import parse_cell  # noqa: E402

#: Warp counts and ring depths a shape may take; "4p": four warps fed by a producer warp (copy_split_ws_kernel);
#: "1i" / "4i": CTAs of one / four warps that are independent programs (bench/copy_warps.py), copying by one bulk
#: copy per tile; "1c" / "4c": the same with per-lane cp.async into swizzled code lines.
SHAPE_WARPS = ("1", "4", "4p", "1i", "4i", "1c", "4c")
#: The independent-warp shapes' warps fields, and those whose copies are per-lane cp.async.
INDEPENDENT_WARPS = ("1i", "4i", "1c", "4c")
LANE_COPIES = ("1c", "4c")
SHAPE_STAGES = (2, 3, 4, 6, 8)
#: The producer warp's registers (warp_specialize's worker_num_regs: 40 fits it, docs/decisions.md).
PRODUCER_REGISTERS: gl.constexpr = gl.constexpr(40)
#: Register cap of a producer-fed CTA (Gluon pads it to 8 warps, 4 of them the producer's group): 128 lets two CTAs
#: share an SM (without a cap ptxas takes 255: one CTA per SM).
WS_MAX_REGISTERS = 128
#: Split counts relative to the plan's (see the module docstring).
RELATIVE_SPLITS = {"plan": 1, "quarter": 4, "eighth": 8}


@gluon.jit
def copy_split_kernel(bt_ptr, stride_bt, n_tiles, heads, out_ptr, k_desc, v_desc, s_desc, NSPLIT, work, jitter,
                      D: gl.constexpr, STAGES: gl.constexpr, REGION: gl.constexpr, WARPS: gl.constexpr,
                      CHAINS: gl.constexpr = 1):
    """Grid (B, Hkv, NSPLIT): program (b, h, p) copies tiles [lo, hi) of split p of the request's n_tiles blocks (KV
    head h; the block ids in bt_ptr [B, >= n_tiles] int32, row stride stride_bt) through a ring of STAGES stages
    (gluon_decode's tma_ring and _start_stage; a launch of num_warps=WARPS) and stores the sum of the scale-plane
    bytes its lanes read, [B, Hkv, NSPLIT] int32 at out_ptr (contiguous), so that nothing is dead. work > 0: after
    each tile lands, copy_warps.compute_stand_in (``work`` FMAs in CHAINS chains, jittered per program and tile with
    jitter = 1)."""
    Q: gl.constexpr = D // 4
    b = gl.program_id(0)
    h = gl.program_id(1)
    pid = gl.program_id(2)
    per_split = gl.cdiv(n_tiles, NSPLIT)
    lo = gl.minimum(pid * per_split, n_tiles)
    hi = gl.minimum(lo + per_split, n_tiles)
    keys, values, planes, bars = tma_ring(STAGES, Q)
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    for s in gl.static_range(STAGES - 1):
        blk = gl.load(bt_row + lo + s, mask=lo + s < hi, other=0)
        _start_stage(keys.index(s), values.index(s), planes.index(s), bars.index(s), k_desc, v_desc, s_desc, out_ptr,
                     blk, heads, h, 0, lo + s < hi, Q, 0, 0, 0, REGION, True)
    ahead = lo + STAGES - 1
    blk_ahead = gl.load(bt_row + ahead, mask=ahead < hi, other=0)
    PLANE_BYTES: gl.constexpr = 4 * 128
    LANES: gl.constexpr = gl.BlockedLayout([PLANE_BYTES // 32 // WARPS], [32], [WARPS], [0])
    seen = gl.zeros([PLANE_BYTES], gl.int32, layout=LANES)
    for i in range(lo, hi):
        stage = (i - lo) % STAGES
        refill = (stage + STAGES - 1) % STAGES  # the stage every warp read one tile ago
        ahead = i + STAGES - 1
        _sync_warps()
        _start_stage(keys.index(refill), values.index(refill), planes.index(refill), bars.index(refill), k_desc,
                     v_desc, s_desc, out_ptr, blk_ahead, heads, h, 0, ahead < hi, Q, 0, 0, 0, REGION, True)
        blk_ahead = gl.load(bt_row + ahead + 1, mask=ahead + 1 < hi, other=0)
        mbarrier.wait(bars.index(stage), ((i - lo) // STAGES) % 2)
        seen += _view_as(planes.index(stage), gl.uint8, [PLANE_BYTES], STAGED).load(LANES).to(gl.int32)
        if work > 0:
            seen += compute_stand_in(gl.sum(seen, axis=0).to(gl.float32), work, jitter, pid, h, i, CHAINS)
    gl.store(out_ptr + (b * gl.num_programs(1) + h) * NSPLIT + pid, gl.sum(seen, axis=0))


@gluon.jit
def _ws_consumer(planes, full, empty, out_ptr, lo, hi, NSPLIT, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """copy_split_ws_kernel's default partition: per tile, wait for its stage, read its scale planes, release it."""
    PLANE_BYTES: gl.constexpr = 4 * 128
    LANES: gl.constexpr = gl.BlockedLayout([PLANE_BYTES // 32 // WARPS], [32], [WARPS], [0])
    seen = gl.zeros([PLANE_BYTES], gl.int32, layout=LANES)
    for i in range(lo, hi):
        stage = (i - lo) % STAGES
        mbarrier.wait(full.index(stage), ((i - lo) // STAGES) % 2)
        seen += _view_as(planes.index(stage), gl.uint8, [PLANE_BYTES], STAGED).load(LANES).to(gl.int32)
        mbarrier.arrive(empty.index(stage), count=1)
    program = (gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)) * NSPLIT + gl.program_id(2)
    gl.store(out_ptr + program, gl.sum(seen, axis=0))


@gluon.jit
def _ws_producer(keys, values, planes, full, empty, k_desc, v_desc, s_desc, out_ptr, bt_row, heads, lo, hi,
                 STAGES: gl.constexpr, REGION: gl.constexpr, Q: gl.constexpr):
    """copy_split_ws_kernel's producer warp: per tile, wait until its stage is free, then start its copies (the next
    tile's block id loaded meanwhile)."""
    blk = gl.load(bt_row + lo, mask=lo < hi, other=0)
    for i in range(lo, hi):
        stage = (i - lo) % STAGES
        blk_next = gl.load(bt_row + i + 1, mask=i + 1 < hi, other=0)
        mbarrier.wait(empty.index(stage), (((i - lo) // STAGES) % 2) ^ 1)  # a fresh barrier passes phase 1
        _start_stage(keys.index(stage), values.index(stage), planes.index(stage), full.index(stage), k_desc, v_desc,
                     s_desc, out_ptr, blk, heads, gl.program_id(1), 0, True, Q, 0, 0, 0, REGION, True)
        blk = blk_next


@gluon.jit
def copy_split_ws_kernel(bt_ptr, stride_bt, n_tiles, heads, out_ptr, k_desc, v_desc, s_desc, NSPLIT,
                         D: gl.constexpr, STAGES: gl.constexpr, REGION: gl.constexpr, WARPS: gl.constexpr):
    """copy_split_kernel's job (same arguments and output) with a producer warp: a warp-specialized worker of one
    warp issues every copy of the program's split into the ring, and the WARPS warps of the default partition wait
    on each stage's full barrier, read it and arrive on its empty barrier (no TMA issue in their loop)."""
    Q: gl.constexpr = D // 4
    per_split = gl.cdiv(n_tiles, NSPLIT)
    lo = gl.minimum(gl.program_id(2) * per_split, n_tiles)
    hi = gl.minimum(lo + per_split, n_tiles)
    keys, values, planes, full = tma_ring(STAGES, Q)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()
    bt_row = bt_ptr + gl.program_id(0).to(gl.int64) * stride_bt
    gl.warp_specialize([(_ws_consumer, (planes, full, empty, out_ptr, lo, hi, NSPLIT, STAGES, WARPS)),
                        (_ws_producer, (keys, values, planes, full, empty, k_desc, v_desc, s_desc, out_ptr, bt_row,
                                        heads, lo, hi, STAGES, REGION, Q))], [1], [PRODUCER_REGISTERS])


def shape_kernel(warps: str) -> tuple:
    """(kernel, num_warps, launch options) of a shape's warps field: copy_split_ws_kernel for "4p" (4 warps and the
    producer, registers capped at WS_MAX_REGISTERS), copy_warps_kernel for the INDEPENDENT_WARPS shapes."""
    if warps.endswith("p"):
        return copy_split_ws_kernel, int(warps[:-1]), {"maxnreg": WS_MAX_REGISTERS}
    if warps in INDEPENDENT_WARPS:
        return copy_warps_kernel, int(warps[:-1]), {}
    return copy_split_kernel, int(warps), {}


def compile_copy_kernel(head_dim: int, warps: str, stages: int):
    """The CompiledKernel of a shape's copy kernel for sm_90 (no GPU: the descriptors typed from a small CPU cache),
    as time_shape launches it."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    layout = PageLayout(head_dim, head_dim, TILE.value)
    offsets = triton_ops._plane_offsets(layout)
    descriptors = tma_descriptors(torch.zeros(4, 2, layout.head_region_bytes, dtype=torch.uint8), head_dim,
                                  offsets["K_CODES"], offsets["V_CODES"], offsets["K_SCALE"])
    kernel, num_warps, options = shape_kernel(warps)
    names = kernel.arg_names
    aligned = ["bt_ptr", "out_ptr"]
    if kernel is copy_warps_kernel:
        constants = warps_constants(layout, stages, num_warps, 1, warps in LANE_COPIES)
        typed = {"cache_ptr": "*u8"}
        aligned.append("cache_ptr")
    else:
        constants = dict(D=head_dim, STAGES=stages, REGION=layout.head_region_bytes, WARPS=num_warps,
                         **({} if warps.endswith("p") else {"CHAINS": 1}))
        typed = {name: mangle_type(desc) for name, desc in zip(("k_desc", "v_desc", "s_desc"), descriptors)
                 if desc is not None}
        if descriptors[1] is None:  # head_dim 64: keys and values in one box
            constants["v_desc"] = None
    signature = {"bt_ptr": "*i32", "stride_bt": "i32", "n_tiles": "i32", "heads": "i32", "out_ptr": "*i32",
                 **typed, "NSPLIT": "i32", "work": "i32", "jitter": "i32", **{name: "constexpr" for name in constants}}
    source = GluonASTSource(fn=kernel, signature={name: signature[name] for name in names},
                            constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})


def warps_constants(layout: PageLayout, stages: int, warps: int, chains: int, lane_copies: bool) -> dict:
    """copy_warps_kernel's constexprs for a cache layout (lane_copies: the "c" shapes' per-lane swizzled cp.async)."""
    return dict(STAGES=stages, REGION=layout.head_region_bytes, WARPS=warps, CHAINS=chains,
                PLANES=layout.plane_offset("k_scale"), LANE_COPIES=lane_copies, CODES=layout.plane_offset("v_codes"),
                V_PHASE=2 if layout.head_dim == 128 else 1)


def parse_shape(text: str) -> tuple[str, int, str]:
    """warps:stages:splits (module docstring)."""
    try:
        warps, stages, splits = text.split(":")
        shape = warps, int(stages), splits
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shapes takes warps:stages:splits (e.g. 4:6:quarter); got {text!r}")
    if shape[0] not in SHAPE_WARPS or shape[1] not in SHAPE_STAGES:
        raise argparse.ArgumentTypeError(f"{text!r}: warps in {SHAPE_WARPS}, stages in {SHAPE_STAGES}")
    if shape[0] in LANE_COPIES and shape[1] > 4:
        raise argparse.ArgumentTypeError(f"{text!r}: per-lane cp.async shapes take 2-4 stages")
    if not (splits.isdigit() or splits in RELATIVE_SPLITS or splits == "tiles"):
        raise argparse.ArgumentTypeError(f"{text!r}: splits is a number, 'tiles' or one of {sorted(RELATIVE_SPLITS)}")
    return shape


def shape_splits(splits: str, plan_splits: int, n_tiles: int) -> int:
    """The split count per (request, KV head) a shape's splits field names, at most one per tile."""
    if splits == "tiles":
        return n_tiles
    count = int(splits) if splits.isdigit() else -(-plan_splits // RELATIVE_SPLITS[splits])
    return max(1, min(count, n_tiles))


def shape_launches(cell, warps: str, stages: int, nsplit: int, out: torch.Tensor, work: int = 0, jitter: int = 0,
                   chains: int = 1) -> list:
    """One launch per layer's cache copy of a shape's copy kernel over the cell's blocks, each writing its per-program
    checksums into out [B, Hkv, nsplit] int32; work, jitter, chains: the compute stand-in (all shapes but "4p")."""
    case = cell.case
    layout = case.layout
    offsets = triton_ops._plane_offsets(layout)
    batch, hkv = case.block_table.shape[0], case.caches[0].shape[1]
    n_tiles = cell.length // TILE.value
    kernel, num_warps, options = shape_kernel(warps)
    if kernel is copy_warps_kernel:
        consts = dict(warps_constants(layout, stages, num_warps, chains, warps in LANE_COPIES), num_warps=num_warps)
        grid = (batch, hkv, -(-nsplit // num_warps))
        return [raw_launch(kernel, grid, [case.block_table, case.block_table.stride(0), n_tiles, hkv, out, cache,
                                          nsplit, work, jitter], consts,
                           ring_bytes(num_warps, stages, layout.head_region_bytes)) for cache in case.caches]
    consts = dict(D=layout.head_dim, STAGES=stages, REGION=layout.head_region_bytes, WARPS=num_warps,
                  num_warps=num_warps, **options)
    stand_in = ()  # the producer-fed kernel has no compute stand-in
    if kernel is copy_split_kernel:
        stand_in = (work, jitter)
        consts["CHAINS"] = chains

    def launch(cache: torch.Tensor):
        keys, values, planes = tma_descriptors(cache, layout.head_dim, offsets["K_CODES"], offsets["V_CODES"],
                                               offsets["K_SCALE"])
        return lambda: kernel[(batch, hkv, nsplit)](
            case.block_table, case.block_table.stride(0), n_tiles, hkv, out, keys, values, planes, nsplit, *stand_in,
            **consts)

    return [launch(cache) for cache in case.caches]


def _checksums(cell, warps: str, stages: int, nsplit: int) -> torch.Tensor:
    """The per-program checksums of one launch of a shape over the first layer's cache copy."""
    case = cell.case
    out = torch.full((case.block_table.shape[0], case.caches[0].shape[1], nsplit), -1, dtype=torch.int32,
                     device=case.query.device)
    shape_launches(cell, warps, stages, nsplit, out)[0]()
    torch.cuda.synchronize()
    return out


def checksums_match(cell, warps: str, stages: int, nsplit: int) -> bool:
    """Whether a shape's programs read the bytes gluon_decode's copies bring (the one-warp TMA shape, two stages):
    equal checksums of the scale planes per program."""
    return torch.equal(_checksums(cell, warps, stages, nsplit), _checksums(cell, "1", 2, nsplit))


def time_shape(cell, warps: str, stages: int, nsplit: int, reps: int, work: int = 0, jitter: int = 0,
               chains: int = 1) -> float:
    """ms per launch of a shape's copy kernel over the cell's blocks (every layer's cache copy in one CUDA graph);
    work, jitter, chains: the compute stand-in (all shapes but "4p")."""
    case = cell.case
    out = torch.empty(case.block_table.shape[0], case.caches[0].shape[1], nsplit, dtype=torch.int32,
                      device=case.query.device)
    return time_graph(shape_launches(cell, warps, stages, nsplit, out, work, jitter, chains), reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=parse_cell, nargs="+", default=[parse_cell("qwen3-8b:131072:1"),
                                                                   parse_cell("smollm2-135m:131072:8")])
    parser.add_argument("--shapes", type=parse_shape, nargs="+",
                        default=[parse_shape(s) for s in ("1:2:plan", "1:3:plan", "1:4:plan", "4:4:quarter",
                                                          "4:6:quarter", "4p:4:quarter", "4p:6:quarter",
                                                          "4p:8:eighth", "1:2:tiles")])
    add_stand_in_arguments(parser, [0], [1], [0], note="every shape but 4p: ")
    add_output_arguments(parser)
    args = parser.parse_args()
    device = cuda_device("bench/copy_shapes.py times TMA copies on a CUDA GPU; none is visible.")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    mismatched = []  # independent-warp shapes whose programs read other bytes than the TMA shape's
    for geometry, length, batch in args.cells:
        cell = gluon_case(geometry, length, batch, device)
        if cell is None:
            print(f"{geometry} {length} B={batch}: {NOT_GLUON}")
            continue
        region = cell.case.layout.head_region_bytes
        nbytes = batch * GEOMETRIES[geometry][1] * (length // TILE.value) * region
        stream_ms, stream_shape = floor_ms(nbytes, args.reps, device)
        print(f"{geometry} {length} B={batch}: {nbytes / 1e6:.1f} MB of regions, plan {cell.plan.num_splits} splits; "
              f"stream {stream_ms * 1000:.1f} us ({stream_shape})", flush=True)
        checked = {}  # (warps, stages, splits) of the independent-warp shapes -> checksums equal
        for (warps, stages, splits), work, jitter, chains in itertools.product(args.shapes, args.work, args.jitter,
                                                                              args.chains):
            if (warps.endswith("p") and work) or ((jitter or chains > 1) and not work):
                continue  # no stand-in in the producer-fed kernel; jitter or chains of nothing
            nsplit = shape_splits(splits, cell.plan.num_splits, length // TILE.value)
            if warps in INDEPENDENT_WARPS and (warps, stages, nsplit) not in checked:
                checked[(warps, stages, nsplit)] = checksums_match(cell, warps, stages, nsplit)
                if not checked[(warps, stages, nsplit)]:
                    mismatched.append(f"{geometry} {length} B={batch} {warps}:{stages} ({nsplit} splits)")
                print(f"  {warps} warps x {stages} stages, {nsplit} splits: checksums "
                      f"{'equal to' if checked[(warps, stages, nsplit)] else 'DIFFERENT from'} the TMA shape's",
                      flush=True)
            ms = time_shape(cell, warps, stages, nsplit, args.reps, work, jitter, chains)
            per_sm = batch * GEOMETRIES[geometry][1] * nsplit / sms  # a 4p CTA holds 8 warps: two per SM at most
            row = {"geometry": geometry, "context": length, "batch": batch, "warps": warps, "stages": stages,
                   "splits": nsplit, "work": work, "jitter": jitter, "chains": chains, "programs_per_sm": per_sm,
                   "ms": ms, "checksums_match": checked.get((warps, stages, nsplit)),
                   "GBps": nbytes / ms / 1e6, "stream_ms": stream_ms, "stream_over_copy": stream_ms / ms}
            rows.append(row)
            print(f"  {warps} warps x {stages} stages, {nsplit} splits ({per_sm:.1f} programs per SM), work {work} "
                  f"jitter {jitter} chains {chains}: {ms * 1000:.1f} us, {nbytes / ms / 1e6:.0f} GB/s, stream / copies "
                  f"{stream_ms / ms:.2f}", flush=True)
        del cell
        torch.cuda.empty_cache()
    return finish(args.json, rows, mismatched, "checksums differ from the TMA shape's")


if __name__ == "__main__":
    raise SystemExit(main())
