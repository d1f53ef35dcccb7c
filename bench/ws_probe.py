#!/usr/bin/env python3
"""Offline probe (no GPU): how Gluon lowers a warp-specialized ring for sm_90 (docs/decisions.md).

A producer warp (worker partition, 40 registers) copies [LINES, 128] byte boxes by TMA into one ring of STAGES
buffers per compute warp; the default partition's WARPS warps each wait on their own ring's full barriers, read their
buffer through a layout replicated over the warps (each warp the whole box, as V56's one-split-per-warp form would)
and arrive on its empty barrier. The question is whether those warps run independently. The script compiles the
kernel (Triton 3.6's Gluon API: `PYTHONPATH=/opt/tri36 python bench/ws_probe.py`) and prints, from the PTX, the
partition-wide barriers (`bar.sync 0, 128`) around the default partition's mbarrier wait and arrive and whether
its arrive is predicated to one thread. Seen: both are preceded by `bar.sync 0, 128` and the arrive is issued by
thread 0 only, so the four warps move in lockstep and one warp's arrival stands for all: per-warp split programs
in one CTA need barriers Gluon does not offer (inline PTX on the barriers' shared addresses, which Gluon does not
expose), and the form Gluon supports is one split per CTA whose tile compute is spread over the warps.
"""

from __future__ import annotations

import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

#: Compute warps (the default partition), ring stages per compute warp, lines of 128 bytes per box (4 KB).
WARPS, STAGES, LINES = 4, 3, 32
#: A [LINES, 128] layout that gives every warp the whole box (warp bases 0).
REPLICATED = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
    lane_bases=[[0, 16], [0, 32], [0, 64], [0, 0], [0, 0]], warp_bases=[[0, 0], [0, 0]], block_bases=[],
    shape=[LINES, 128])


@gluon.jit
def _warp_index():
    return gl.inline_asm_elementwise("{ .reg .u32 t; mov.u32 t, %tid.x; shr.u32 $0, t, 5; }", "=r", [],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _compute_warps(rings, full, empty, out_ptr, n_tiles, STAGES: gl.constexpr, LINES: gl.constexpr,
                   L: gl.constexpr):
    w = _warp_index()
    acc = gl.zeros([LINES, 128], gl.int32, L)
    for i in range(n_tiles):
        slot = w * STAGES + i % STAGES
        mbarrier.wait(full.index(slot), (i // STAGES) % 2)
        acc += rings.index(slot).load(L).to(gl.int32)
        mbarrier.arrive(empty.index(slot), count=1)
    gl.store(out_ptr + gl.program_id(0) * 4 + w, gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _copy_warp(desc, rings, full, empty, n_tiles, WARPS: gl.constexpr, STAGES: gl.constexpr, LINES: gl.constexpr):
    for i in range(n_tiles):
        for w in gl.static_range(WARPS):
            slot = w * STAGES + i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) % 2) ^ 1)
            mbarrier.expect(full.index(slot), LINES * 128)
            tma.async_copy_global_to_shared(desc, [(gl.program_id(0) * WARPS + w) * 4096 + i * LINES, 0],
                                            full.index(slot), rings.index(slot))


@gluon.jit
def ring_kernel(desc, out_ptr, n_tiles, WARPS: gl.constexpr, STAGES: gl.constexpr, LINES: gl.constexpr,
                L: gl.constexpr):
    rings = gl.allocate_shared_memory(gl.uint8, [WARPS * STAGES, LINES, 128], desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [WARPS * STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [WARPS * STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(WARPS * STAGES):
        mbarrier.init(full.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    fence_async_shared()
    gl.warp_specialize([(_compute_warps, (rings, full, empty, out_ptr, n_tiles, STAGES, LINES, L)),
                        (_copy_warp, (desc, rings, full, empty, n_tiles, WARPS, STAGES, LINES))], [1], [40])


def compile_ring() -> str:
    """The PTX of ring_kernel for sm_90 (a CPU tensor stands for the source: only its descriptor's type matters)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    desc = TensorDescriptor.from_tensor(torch.zeros(8 * 4096, 128, dtype=torch.uint8), [LINES, 128], layout)
    names = ring_kernel.arg_names
    constants = dict(WARPS=WARPS, STAGES=STAGES, LINES=LINES, L=REPLICATED)
    source = GluonASTSource(fn=ring_kernel,
                            signature={"desc": mangle_type(desc), "out_ptr": "*i32", "n_tiles": "i32",
                                       **{name: "constexpr" for name in constants}},
                            constexprs={(names.index(k),): v for k, v in constants.items()},
                            attrs={(names.index("out_ptr"),): [["tt.divisibility", 16]]})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": WARPS}).asm["ptx"]


def main() -> None:
    ptx = compile_ring()
    lines = [line.strip() for line in ptx.splitlines()]
    waits = [i for i, line in enumerate(lines) if line.startswith("mbarrier.try_wait")]
    arrive = next(i for i, line in enumerate(lines) if re.match(r"(@%p\d+ )?mbarrier\.arrive\.shared", line))
    consumer_wait = waits[0]  # the default partition's code comes first
    before = lambda i: any(l.startswith("bar.sync") and "128" in l for l in lines[max(0, i - 12):i])  # noqa: E731
    print(f"triton {triton.__version__}: default partition's wait preceded by bar.sync 0, 128: {before(consumer_wait)}")
    print(f"its arrive: '{lines[arrive]}', preceded by bar.sync 0, 128: {before(arrive)}, "
          f"one thread only: {lines[arrive].startswith('@')}")


if __name__ == "__main__":
    main()
