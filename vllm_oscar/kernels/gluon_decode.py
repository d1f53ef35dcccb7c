"""The decode's INT2 split programs and BF16 window programs in Gluon (AttentionConfig.gluon_splits): the job of
triton_decode_int2.int2_split_kernel with its int8-key path and FULL_TILES, every INT2 MMA operand built in registers
(no shared memory and no barrier, unless the tiles are staged: COPY_STAGES below).

Same arguments, grid (B, Hkv, NSPLIT + window tiles) and partials as int2_split_kernel, but window tiles of 64
positions (whole cache blocks): program pid < NSPLIT walks split pid of the whole INT2 tiles of (request, KV head),
program NSPLIT + w takes window tile w (BF16 copies where the block has one, INT2 codes for the edges of the INT2
range and for blocks without a copy). Scope (triton_ops.gluon_splits_apply): int8 keys, tiles of 64 positions = cache
blocks of 64, one group per row with fp16 scales, GQA groups <= 4, head_dim 64 or 128, the PTX code layout
(triton_common). Gluon kernels do not run under TRITON_INTERPRET=1: the CPU tests compile this module for sm_90
(tests/test_gluon_decode.py) and bench/check_kernels_gpu.py checks it against float64 references on the GPU.

Per tile (positions on the MMA's M side, as in int2_split_kernel; KPARTS = 2 columns per head):

    S^T [64, 8] int32 = sum over K steps s of codes_s [64, 32] int8 @ q8_s [32, 8]       (mma m16n8k32, int8)
                        column 2 j + k: head j's dot over the planes of part k (the query operand is zero elsewhere;
                        the codes of part 1, planes 2 and 3, enter as 16 x code: UPPER_PLANES)
    x [64, 4] fp32    = k_scale * (16 S^T column 2 j + column 2 j + 1) + k_offset * 16 sum(q8_j)   (16 x the logits)
    p                 = exp2(x * s_q qk_scale / 16 - m)                                  (lazy rescale, RESCALE_SLACK)
    W [64, 8] bf16    = column 2 j: bf16(p v_scale), column 2 j + 1: bf16(p v_offset)
    acc [D, 8] fp32  += (BIAS + F_P code_v)^T [D, 64] @ W;  sums [16, 8] += ones [16, 64] @ W   (mma m16n8k16, bf16)

so the column sums of W (sw_j, and zw_j = sum p v_offset) come from one more MMA, and the output of head j is
((acc[:, 2 j] - BIAS sw_j) / F_P + zw_j) / l_j as in int2_split_kernel. Every FOLD tiles and at the end,
F_P zw_j - BIAS sw_j of the tiles since moves into acc[:, 2 j] (_fold_bias: the tensor cores' accumulation would
otherwise lose the code part of a long split's BIAS-sized sums), so that the epilogue divides by F_P l_j only.

Operands straight from memory into the MMA layouts (the lanes of an m16n8 MMA: gid = lane // 4, tig = lane % 4):
the tile's logical position m (M index of S^T, K index of the V product) is the physical position
ROW_POS(m) = 8 (m % 8) + 2 (m // 16) + (m // 8) % 2, so that lane gid's eight rows of S^T are positions
8 gid .. 8 gid + 7 (each scale plane one 16-byte load) and lane tig's K indices of the V operand are positions
16 tig .. 16 tig + 15. The key codes' K index c of a step is permuted the same way on both operands (head_dim 128:
step s = plane s, c -> byte 8 ((c % 16) // 4) + 4 (c // 16) + c % 4, one 8-byte load per position and lane;
head_dim 64: step s = planes 2 s (c < 16) and 2 s + 1, byte c % 16, one 4-byte load). The V operand's row r (M index)
is channel P Q + 2 pair + parity for r = (2 P + parity) Q / 2 + jl (pair = 2 (jl % 8) + jl // 8 at head_dim 128,
so that a lane loads one word per position; jl at 64). Each permutation is expressed as reshapes and permutes of the
loaded tensors whose conversion to the MMA layout is checked to be free (convert_layout(assert_trivial=True)).

A window tile computes its BF16 logits one K step (16 channels) at a time and its BF16 V product a plane at a time
(_window_logits, _window_values), each lane loading only its own operand elements, so that the window path needs
no shared memory (an allocation would cut the split programs' residency); its INT2 positions reuse the tile code of
the splits under masks. docs/decisions.md G2 has the measurements (H200, graph replays: the decode 5-15% faster
than int2_split_kernel's from 32K on and at 4K batch 64).

COPY_STAGES > 0 (AttentionConfig.gluon_copy_stages; by default 2 where triton_ops.staging_pays, H200 timings in
docs/decisions.md and "Session 29"): instead of an L2 prefetch one tile ahead and register loads,
a split program copies the regions of the tiles COPY_STAGES - 1 ahead into shared memory with cp.async (no
registers held while they are in flight) and reads each tile from there into the same register layouts
(_staged_tile; the code lines swizzled so that those reads are free of bank conflicts). The window programs load as
before. With COPY_TMA (AttentionConfig.gluon_copy_tma; by default at head_dim 128 in launches captured in CUDA graphs,
docs/decisions.md) the copies are TMA boxes instead (tma_descriptors, _start_stage: the same staged
layouts, written by the copy engine; one mbarrier per stage), and the kernel takes the descriptors as k_desc, v_desc
and s_desc (None without COPY_TMA).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from vllm_oscar.kernels.triton_common import BIAS, FOLD_TILES
from vllm_oscar.kernels.triton_decode_int2 import INT8_QUERY_MAX, PREFETCH_LINE, RESCALE_SLACK

#: bar.sync of the program's warps (Gluon's name for it: thread_barrier in Triton 3.6, barrier from 3.7 on).
_sync_warps = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
#: cp.async from global into shared memory (async_copy_global_to_shared in Triton 3.6, async_load later).
_copy_async = async_copy.async_load if hasattr(async_copy, "async_load") else async_copy.async_copy_global_to_shared
#: A TMA copy of one box into shared memory on an mbarrier (the same two names).
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@builtin
def _view_as(desc, dtype, shape, layout, _semantic=None):
    """A shared memory descriptor read as another dtype and shape (reinterpret; _reinterpret in Triton 3.6)."""
    method = desc.reinterpret if hasattr(desc, "reinterpret") else desc._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)


#: Positions per tile (and per cache block: one tile is one block's region).
TILE: gl.constexpr = gl.constexpr(64)
#: Columns of the logits per head (the query's planes split in two parts: an N = 8 MMA for GQA groups <= 4).
KPARTS: gl.constexpr = gl.constexpr(2)
#: The key codes of planes 2 and 3 enter the logits MMA as masked, i.e. times 16 (_plane_codes: no shift for plane 2,
#: one for planes 1 and 3): the folded logits are UPPER_PLANES times the true ones, and the query's qo and l_scale
#: carry the factor (_int8_query), so that every softmax input is the same float as without it (powers of 2).
UPPER_PLANES: gl.constexpr = gl.constexpr(16)
#: Largest GQA group (heads per KV head) the kernel takes: 4 heads x KPARTS fill the MMA's N = 8.
MAX_GROUP: gl.constexpr = gl.constexpr(4)
#: head_dims the kernel takes (code planes of 32 or 16 bytes).
HEAD_DIMS: tuple[int, ...] = (64, 128)
#: First compute capability with the mma.sync shapes used (int8 m16n8k32, bf16 m16n8k16).
MIN_CAPABILITY: tuple[int, int] = (8, 0)
#: F16_VALUES (AttentionConfig.gluon_f16_values): the V operand is fp16 BIAS_F16 + F_P code with F_P = 1, 4, 16, 64
#: (every plane of a byte inside fp16's 10-bit mantissa: one shift per word instead of three), and the weights are
#: fp16(p) times the fp16 scales as stored (no conversions of v_scale and v_offset to fp32).
BIAS_F16: gl.constexpr = gl.constexpr(1024.0)
#: The lazy rescale's slack (log2 units) with fp16 weights: p <= 4, so that p v_offset stays finite for any
#: |v_offset| < 16384 (RESCALE_SLACK = 8 would allow p = 256 and overflow from |v_offset| >= 256).
RESCALE_SLACK_F16: gl.constexpr = gl.constexpr(2.0)
#: Lines a program can prefetch into L2 for one (block, KV head) region (two per lane).
PREFETCH_LINES: gl.constexpr = gl.constexpr(64)

#: The mma.sync accumulator layout of one warp (m16n8).
MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
#: int8 operands, four per 32-bit register: the key codes [64, 32] (A) and the query [32, 8] (B).
CODES_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
QUERY_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
#: bf16 operands, two per register: the V codes^T [D, 64] or ones [16, 64] (A) and the weights W [64, 8] (B).
VALUE_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
WEIGHT_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
#: A scale plane as stored: lane gid holds positions 8 gid .. 8 gid + 7 (the same in every tig).
ROW_PHYS = gl.DistributedLinearLayout(reg_bases=[[1], [2], [4]], lane_bases=[[0], [0], [8], [16], [32]],
                                      warp_bases=[], block_bases=[], shape=[64])
#: Prefetch lines, two per lane.
LINES = gl.BlockedLayout([2], [32], [1], [0])
#: The key codes as _codes_raw holds them, [8 (gid), 8 (r), 4 (tig), W] uint8 (W = 8 at head_dim 128, 4 at 64).
CODE_BYTES_128 = gl.BlockedLayout([1, 8, 1, 8], [8, 1, 4, 1], [1, 1, 1, 1], [3, 1, 2, 0])
CODE_BYTES_64 = gl.BlockedLayout([1, 8, 1, 4], [8, 1, 4, 1], [1, 1, 1, 1], [3, 1, 2, 0])
#: The V byte pairs as _value_pairs returns them: [4 (tig), 2 (e), 8 (r'), 8 (g), 2 (jj)] int16 at head_dim 128,
#: [4, 2, 8, 8] at 64.
PAIRS_128 = gl.BlockedLayout([1, 2, 8, 1, 2], [4, 1, 1, 8, 1], [1, 1, 1, 1, 1], [1, 2, 4, 0, 3])
PAIRS_64 = gl.BlockedLayout([1, 2, 8, 1], [4, 1, 1, 8], [1, 1, 1, 1], [1, 2, 0, 3])
#: Copy stages in shared memory (COPY_STAGES > 0), a tile's region in three buffers of [stages, ...]: the key codes
#: as [lines of 128 bytes, 128] uint8 (4 positions per line at head_dim 128, 8 at 64), the V codes as the same lines
#: of int16 [lines, 64], the four scale planes flat. The code lines are swizzled in 16-byte chunks (chunk ^ phase,
#: the phase from the line) so that the reads below, eight positions 8 apart per instruction, fall on distinct banks;
#: the V lines change phase every second line at head_dim 128 (their reads step four lines per lane group).
STAGED = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
STAGED_KEYS = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
#: STAGED_KEYS as the copies write it: [lines, 64] int16, the same 16-byte chunks in the same places.
STAGED_KEYS_16 = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
STAGED_V_128 = gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=8, order=[1, 0])
STAGED_V_64 = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
#: The staged code lines read straight into _codes_raw's and _value_pairs' register layouts (as [lines, columns];
#: a reshape then gives their axes): key byte (8 gid + r, W tig + i) is line (8 gid + r) // P, column
#: ((8 gid + r) % P) 128 / P + W tig + i for P positions per line; V pair (tig, e, r', gid, jj) is int16 element
#: 256 tig + 128 e + 16 r' + 2 gid + jj at head_dim 128, 128 tig + 64 e + 8 r' + gid at 64, of the [lines, 64] rows.
STAGED_CODES_128 = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64], [1, 0]],
                                              lane_bases=[[0, 8], [0, 16], [2, 0], [4, 0], [8, 0]],
                                              warp_bases=[], block_bases=[], shape=[16, 128])
STAGED_CODES_64 = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [0, 64]],
                                             lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[], block_bases=[], shape=[8, 128])
STAGED_PAIRS_128 = gl.DistributedLinearLayout(reg_bases=[[2, 0], [0, 16], [0, 32], [1, 0], [0, 1]],
                                              lane_bases=[[4, 0], [8, 0], [0, 2], [0, 4], [0, 8]],
                                              warp_bases=[], block_bases=[], shape=[16, 64])
STAGED_PAIRS_64 = gl.DistributedLinearLayout(reg_bases=[[1, 0], [0, 8], [0, 16], [0, 32]],
                                             lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
                                             warp_bases=[], block_bases=[], shape=[8, 64])
#: COPY_TMA: the boxes of a tile's region as TMA writes them (tma_descriptors; region r = block x KV heads + head of a
#: contiguous cache), the code lines with the 128-byte swizzle (chunk ^ line % 8), the scale planes [1, 4, 128] as
#: stored. head_dim 128: the key codes [1, lines, 128] (STAGED_KEYS) and the V codes [1, 2, 8, 128] from a view whose
#: line pairs are interleaved (box line 8 p + a = region line 2 a + p), so that the swizzle of the box lines is
#: STAGED_V_128's chunk ^ (region line // 2) % 8 (reads free of bank conflicts: STAGED_V_128_TMA); head_dim 64: the
#: key and V codes in one box [1, 2 x lines, 128] (STAGED_KEYS and STAGED_V_64 both swizzle by line % 8).
TMA_SWIZZLED_3D = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=3)
TMA_SWIZZLED_4D = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=4)
TMA_PLAIN_3D = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=3)
#: The V box of head_dim 128 as _staged_tile reads it: [lines, 64] int16 whose region line L = 2 a + p sits in box
#: line s = 8 p + a, 16-byte chunks swizzled by s % 8 (offset bits: element 0-2, chunk 3-5, box line 6-9).
STAGED_V_128_TMA = gl.SharedLinearLayout(offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [2, 8],
                                                       [4, 16], [8, 32], [1, 0]])
#: cp.async of 16 bytes per lane and copy: flat bytes, and lines of 128 bytes as [lines, 64] int16 (the key codes too,
#: so that both code copies of a tile take their source addresses from one per-lane pointer: V54).
COPY_LANES = gl.BlockedLayout([16], [32], [1], [0])
COPY_LINES = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
#: Bytes of the four scale planes of a tile (k_scale, k_offset, v_scale, v_offset: 64 fp16 each), contiguous.
SCALE_BYTES: gl.constexpr = gl.constexpr(4 * 64 * 2)


def tma_descriptors(int2_cache: torch.Tensor, head_dim: int, k_codes: int, v_codes: int,
                    k_scale: int) -> list[TensorDescriptor | None]:
    """The host tensor descriptors of COPY_TMA's boxes (the layouts above) over a contiguous uint8 cache [num_blocks,
    Hkv, region] (the whole regions as [num_blocks x Hkv, region]; k_codes, v_codes, k_scale: the planes' byte
    offsets in a region, the four scale planes contiguous from k_scale): [codes, V codes, scale planes] with codes
    the key codes [regions, lines, 128] and V codes [regions, 2, lines / 2, 128] of strides (region, 128, 256, 1) at
    head_dim 128, the key and V codes [regions, 2 x lines, 128] and no V descriptor (None) at head_dim 64, and the
    scale planes [regions, 4, 128]."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"COPY_TMA boxes exist for head_dim in {HEAD_DIMS} (gluon_decode's), not {head_dim}.")
    if not int2_cache.is_contiguous():
        raise ValueError("COPY_TMA reads the INT2 cache by regions: it needs a contiguous [num_blocks, Hkv, region] "
                         f"cache (got strides {int2_cache.stride()}); leave gluon_copy_tma off for this cache.")
    flat = int2_cache.view(-1)
    regions, region = int2_cache.shape[0] * int2_cache.shape[1], int2_cache.shape[2]
    lines = TILE.value * head_dim // 4 // 128
    planes = TensorDescriptor(flat[k_scale:], [regions, 4, 128], [region, 128, 1], [1, 4, 128], TMA_PLAIN_3D)
    if head_dim == 128:
        keys = TensorDescriptor(flat[k_codes:], [regions, lines, 128], [region, 128, 1], [1, lines, 128],
                                TMA_SWIZZLED_3D)
        values = TensorDescriptor(flat[v_codes:], [regions, 2, lines // 2, 128], [region, 128, 256, 1],
                                  [1, 2, lines // 2, 128], TMA_SWIZZLED_4D)
        return [keys, values, planes]
    if v_codes != k_codes + lines * 128:
        raise ValueError(f"COPY_TMA at head_dim {head_dim} copies the key and V codes as one run: V codes at "
                         f"{v_codes}, expected {k_codes + lines * 128}.")
    both = TensorDescriptor(flat[k_codes:], [regions, 2 * lines, 128], [region, 128, 1], [1, 2 * lines, 128],
                            TMA_SWIZZLED_3D)
    return [both, None, planes]


@gluon.jit
def _plane_codes(raw, P: gl.constexpr):
    """uint8 packed bytes -> int8 codes of plane P times UPPER_PLANES (16) for P >= 2, four per and.b32: planes 0 and
    2 masked where they lie, planes 1 and 3 masked in the word shifted by 2 (one shift for both, shared by ptxas), so
    that the two planes of each logits part (0, 1 and 2, 3) carry one scale (_fold_key_parts)."""
    if P == 0:
        asm: gl.constexpr = "and.b32 $0, $1, 0x03030303;"
    elif P == 1:
        asm: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }"
    elif P == 2:
        asm: gl.constexpr = "and.b32 $0, $1, 0x30303030;"
    else:
        asm: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x30303030; }"
    return gl.inline_asm_elementwise(asm, "=r,r", [raw], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _unpacked_planes(pairs, F16: gl.constexpr):
    """int16 byte pairs -> BIAS + F_P code of every plane P and both bytes, joined as trailing axes [..., 2 (parity:
    low / high byte), 2 (P % 2), 2 (P // 2)]: bf16 with F_P = 1, 4, 16, 16 (as triton_common.unpack_pair_plane), or
    with F16 fp16 BIAS_F16 + F_P code, F_P = 1, 4, 16, 64. Consecutive elements share a register (one lop3 makes
    two values)."""
    if F16:  # every plane of either byte inside the mantissa: only the high byte is shifted
        shifts: gl.constexpr = "{ .reg .b32 o, x; mov.b32 x, 0x64006400; shr.b32 o, $8, 8; "
        plane3: gl.constexpr = "lop3.b32 $6, $8, 0x00C000C0, x, 0xEA; lop3.b32 $7, o, 0x00C000C0, x, 0xEA; }"
    else:  # plane 3 straddles bf16's 7-bit mantissa: shifted into bits 4-5 of each byte
        shifts: gl.constexpr = ("{ .reg .b32 o, e3, o3, x; mov.b32 x, 0x43004300; shr.b32 o, $8, 8; "
                                "shr.b32 e3, $8, 2; shr.b32 o3, $8, 10; ")
        plane3: gl.constexpr = "lop3.b32 $6, e3, 0x00300030, x, 0xEA; lop3.b32 $7, o3, 0x00300030, x, 0xEA; }"
    p0e, p0o, p1e, p1o, p2e, p2o, p3e, p3o = gl.inline_asm_elementwise(
        shifts + "lop3.b32 $0, $8, 0x00030003, x, 0xEA; lop3.b32 $1, o, 0x00030003, x, 0xEA; "
        "lop3.b32 $2, $8, 0x000C000C, x, 0xEA; lop3.b32 $3, o, 0x000C000C, x, 0xEA; "
        "lop3.b32 $4, $8, 0x00300030, x, 0xEA; lop3.b32 $5, o, 0x00300030, x, 0xEA; " + plane3,
        "=r,=r,=r,=r,=r,=r,=r,=r,r", [pairs], dtype=(gl.float16 if F16 else gl.bfloat16,) * 8, is_pure=True,
        pack=2)
    return gl.join(gl.join(gl.join(p0e, p0o), gl.join(p1e, p1o)), gl.join(gl.join(p2e, p2o), gl.join(p3e, p3o)))


@gluon.jit
def _prefetch_region(head_base, bt_row, stride_cb, t0, live, BS: gl.constexpr, REGION: gl.constexpr):
    """prefetch.global.L2 every line of the (block, KV head) region holding position t0 (nothing unless live)."""
    blk = gl.load(bt_row + t0 // BS, mask=live, other=0).to(gl.int64)
    line = gl.arange(0, PREFETCH_LINES, layout=LINES)
    addr = (head_base + blk * stride_cb + line * PREFETCH_LINE).to(gl.int64, bitcast=True)
    want = ((line * PREFETCH_LINE < REGION) & live).to(gl.int32)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [addr, want], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefetch_window_rows(rows_head, stride_w1, D: gl.constexpr):
    """prefetch.global.L2 the TILE rows (positions) of a BF16 window tile at rows_head + position * stride_w1, D
    2-byte elements each: D / 64 lines of 128 bytes per row, each lane taking the lines of two positions."""
    PER_ROW: gl.constexpr = D * 2 // PREFETCH_LINE
    L: gl.constexpr = gl.BlockedLayout([2, PER_ROW], [32, 1], [1, 1], [1, 0])
    pos = gl.arange(0, TILE, layout=gl.SliceLayout(1, L))
    line = gl.arange(0, PER_ROW, layout=gl.SliceLayout(0, L))
    addr = (rows_head + pos[:, None] * stride_w1 + line[None, :] * (PREFETCH_LINE // 2)).to(gl.int64, bitcast=True)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [addr], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _rows_logical(x):
    """A [64] per-position vector from physical order (8 gid + 2 mt + hf) to S^T's row order (16 mt + 8 hf + gid)."""
    return gl.reshape(gl.permute(gl.reshape(x, [8, 4, 2]), [1, 2, 0]), [TILE])


@gluon.jit
def _row_scales(ptr, ROWS: gl.constexpr, DTYPE: gl.constexpr = gl.float32):
    """One fp16 scale plane of the tile ([64] at ptr) as DTYPE (fp32, or fp16 as stored) per row of S^T, in layout
    ROWS."""
    raw = gl.load(ptr.to(gl.pointer_type(gl.float16)) + gl.arange(0, TILE, layout=ROW_PHYS))
    return gl.convert_layout(_rows_logical(raw), ROWS, assert_trivial=True).to(DTYPE)


@gluon.jit
def _axes4(N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr, L: gl.constexpr):
    """Index vectors of the four axes of an [N0, N1, N2, N3] tensor in layout L (slices of L, ready to broadcast)."""
    return (gl.arange(0, N0, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L)))),
            gl.arange(0, N1, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L)))),
            gl.arange(0, N2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L)))),
            gl.arange(0, N3, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L)))))


@gluon.jit
def _codes_raw(base, Q: gl.constexpr):
    """The tile's packed key codes [8 (gid), 8 (r), 4 (tig), W] uint8: lane (gid, tig) holds bytes W tig ..
    W tig + W - 1 (W = 8 at Q = 32, 4 at Q = 16) of positions 8 gid + r, one load per position."""
    W: gl.constexpr = 8 if Q == 32 else 4
    L: gl.constexpr = CODE_BYTES_128 if Q == 32 else CODE_BYTES_64
    g, r, t, i = _axes4(8, 8, 4, W, L)
    rows = ((8 * g)[:, None] + r[None, :]) * Q
    return gl.load(base + rows[:, :, None, None] + (W * t)[None, None, :, None] + i[None, None, None, :])


@gluon.jit
def _codes_operand(raw, S: gl.constexpr, Q: gl.constexpr):
    """K step S of the logits' A operand [64, 32] int8 (CODES_OP) from _codes_raw's bytes (module docstring)."""
    if Q == 32:  # [gid, r, tig, 8] -> [gid, mt, hf, tig, half, i] -> [mt, hf, gid, half, tig, i]
        codes = gl.reshape(_plane_codes(raw, S), [8, 4, 2, 4, 2, 4])
        op = gl.permute(codes, [1, 2, 0, 4, 3, 5])
    else:  # [gid, r, tig, 4, half] -> [gid, mt, hf, tig, i, half] -> [mt, hf, gid, half, tig, i]
        both = gl.reshape(gl.join(_plane_codes(raw, 2 * S), _plane_codes(raw, 2 * S + 1)), [8, 4, 2, 4, 4, 2])
        op = gl.permute(both, [1, 2, 0, 5, 3, 4])
    return gl.convert_layout(gl.reshape(op, [TILE, 32]), CODES_OP, assert_trivial=True)


@gluon.jit
def _query_step(q_base, stride_qh, h, S: gl.constexpr, Q: gl.constexpr, GROUP: gl.constexpr):
    """The query values of K step S in _codes_operand's channel order, every column (head n // KPARTS): [32, 8] fp32
    in QUERY_OP (0 in the columns of heads >= GROUP)."""
    c = gl.arange(0, 32, layout=gl.SliceLayout(1, QUERY_OP))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, QUERY_OP))
    if Q == 32:
        chan = S * Q + 8 * ((c % 16) // 4) + 4 * (c // 16) + c % 4
    else:
        chan = (2 * S + c // 16) * Q + c % 16
    head = n // KPARTS
    f = gl.load(q_base + (h * GROUP + head)[None, :] * stride_qh + chan[:, None], mask=(head < GROUP)[None, :],
                other=0.0)
    return f.to(gl.float32)


@gluon.jit
def _query_operand(f, inv_scale, S: gl.constexpr, STEPS: gl.constexpr):
    """K step S's int8 query operand: round(f / s_q) (half up) in the columns of the part holding step S, 0
    elsewhere."""
    part = gl.arange(0, 8, layout=gl.SliceLayout(0, QUERY_OP)) % KPARTS
    q8 = gl.floor(f * inv_scale[None, :] + 0.5)
    return gl.where((part == S // (STEPS // KPARTS))[None, :], q8, 0.0).to(gl.int8)


@gluon.jit
def _fold_parts(x):
    """[64, 8] columns (head, part) -> [64, 4] per head (the parts added in-lane)."""
    return gl.sum(gl.reshape(x, [TILE, 4, KPARTS]), axis=2)


@gluon.jit
def _fold_key_parts(s):
    """The logits MMA's [64, 8] int32 columns (head, part) -> UPPER_PLANES times the dot per head [64, 4]: part 0
    (planes 0, 1 as 0..3) scaled up to part 1 (planes 2, 3 as 16 x 0..3), in-lane."""
    low, high = gl.split(gl.reshape(s, [TILE, 4, KPARTS]))
    return low * UPPER_PLANES + high


@gluon.jit
def _per_head(v, zero_s):
    """A [8] per-column vector (column 2 j + k: head j) as [4] per head, in the layout of _fold_parts' columns
    (the two parts' copies are added by the fold: returns their sum)."""
    full = gl.convert_layout(v, gl.SliceLayout(0, MMA))[None, :] + zero_s.to(gl.float32)
    return gl.max(_fold_parts(full), axis=0)


@gluon.jit
def _per_column(v):
    """A [4] per-head vector as [8] per column (2 j and 2 j + 1 both head j) in the MMA's column layout."""
    return gl.convert_layout(gl.reshape(gl.join(v, v), [8]), gl.SliceLayout(0, MMA))


@gluon.jit
def _value_pairs(base, Q: gl.constexpr):
    """The tile's V byte pairs as int16 [4 (tig), 2 (e), 8 (r'), 8 (g) (, 2 (jj) at Q = 32)]: lane (gid, tig) holds
    positions 16 tig + 8 e + r' of the pairs 2 gid, 2 gid + 1 (one word per position) at Q = 32, of pair gid at
    Q = 16; laid out so that the two values of an e pair share a register (the V operand's K pairs)."""
    if Q == 32:
        LOADED: gl.constexpr = gl.BlockedLayout([1, 16, 1, 2], [4, 1, 8, 1], [1, 1, 1, 1], [3, 1, 0, 2])
        t, r, g, jj = _axes4(4, 16, 8, 2, LOADED)
        offs = (((16 * t)[:, None] + r[None, :]) * (Q // 2))[:, :, None, None] + (2 * g)[None, None, :, None] \
            + jj[None, None, None, :]
        return gl.convert_layout(gl.reshape(gl.load(base + offs), [4, 2, 8, 8, 2]), PAIRS_128)
    else:
        LOADED: gl.constexpr = gl.BlockedLayout([1, 16, 1], [4, 1, 8], [1, 1, 1], [1, 0, 2])
        t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LOADED)))
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LOADED)))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LOADED)))
        offs = (((16 * t)[:, None] + r[None, :]) * (Q // 2))[:, :, None] + g[None, None, :]
        return gl.convert_layout(gl.reshape(gl.load(base + offs), [4, 2, 8, 8]), PAIRS_64)


@gluon.jit
def _value_operand(pairs, Q: gl.constexpr, F16: gl.constexpr):
    """(BIAS + F_P code)^T [D, 64] bf16 (fp16 with F16: _unpacked_planes) in VALUE_OP from _value_pairs: row
    (2 P + parity) Q / 2 + jl (module docstring), column 16 kk + 8 hk + 2 tig + e for the physical position
    16 tig + 8 e + 2 kk + hk."""
    x = _unpacked_planes(pairs, F16)
    if Q == 32:  # [tig, e, r', g, jj, par, Pb0, Pb1] -> [tig, e, kk, hk, g, jj, par, Pb0, Pb1]
        x = gl.permute(gl.reshape(x, [4, 2, 4, 2, 8, 2, 2, 2, 2]), [8, 7, 6, 5, 4, 2, 3, 0, 1])
    else:  # [tig, e, r', g, par, Pb0, Pb1] -> [tig, e, kk, hk, g, par, Pb0, Pb1]
        x = gl.permute(gl.reshape(x, [4, 2, 4, 2, 8, 2, 2, 2]), [7, 6, 5, 4, 2, 3, 0, 1])
    return gl.convert_layout(gl.reshape(x, [4 * Q, TILE]), VALUE_OP, assert_trivial=True)


@gluon.jit
def _int8_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, zero_s, Q: gl.constexpr, GROUP: gl.constexpr):
    """The query of (request b, KV head h) as int8 per head (absmax over all D channels, as int2_split_kernel rounds
    it): (q0..q3 K-step operands (q2, q3 repeat q0, q1 at head_dim 64), qo = sum(q8) and l_scale = s_q qk_scale per
    head in the layout of _fold_parts' columns)."""
    STEPS: gl.constexpr = 4 if Q == 32 else 2
    q_base = q_ptr + b.to(gl.int64) * stride_qb
    f0 = _query_step(q_base, stride_qh, h, 0, Q, GROUP)
    f1 = _query_step(q_base, stride_qh, h, 1, Q, GROUP)
    amax = gl.maximum(gl.max(gl.abs(f0), axis=0), gl.max(gl.abs(f1), axis=0))
    if STEPS == 4:
        f2 = _query_step(q_base, stride_qh, h, 2, Q, GROUP)
        f3 = _query_step(q_base, stride_qh, h, 3, Q, GROUP)
        amax = gl.maximum(amax, gl.maximum(gl.max(gl.abs(f2), axis=0), gl.max(gl.abs(f3), axis=0)))
    s_q = gl.where(amax > 0.0, amax / INT8_QUERY_MAX, 1.0)  # [8] per column; a head's two columns agree
    inv_s = 1.0 / s_q
    q0 = _query_operand(f0, inv_s, 0, STEPS)
    q1 = _query_operand(f1, inv_s, 1, STEPS)
    q_sum = gl.sum(q0.to(gl.float32), axis=0) + gl.sum(q1.to(gl.float32), axis=0)
    if STEPS == 4:
        q2 = _query_operand(f2, inv_s, 2, STEPS)
        q3 = _query_operand(f3, inv_s, 3, STEPS)
        q_sum += gl.sum(q2.to(gl.float32), axis=0) + gl.sum(q3.to(gl.float32), axis=0)
    else:
        q2 = q0
        q3 = q1
    qo = _per_head(q_sum, zero_s) * UPPER_PLANES  # each part's column holds the sum over its planes
    l_scale = _per_head(s_q * qk_scale, zero_s) * (0.5 / UPPER_PLANES)  # both columns hold s_q qk_scale
    return q0, q1, q2, q3, qo, l_scale


@gluon.jit
def _tile_loads(base, ROWS: gl.constexpr, Q: gl.constexpr, K_CODES: gl.constexpr, V_CODES: gl.constexpr,
                K_SCALE: gl.constexpr, K_ZERO: gl.constexpr, V_SCALE: gl.constexpr, V_ZERO: gl.constexpr,
                F16: gl.constexpr):
    """Every load of one INT2 tile (the (block, KV head) region at base), issued together: (key codes, V byte
    pairs, k_scale, k_offset, v_scale, v_offset per S^T row; the scales fp32, v_scale and v_offset fp16 with
    F16)."""
    codes = _codes_raw(base + K_CODES, Q)
    pairs = _value_pairs((base + V_CODES).to(gl.pointer_type(gl.int16)), Q)  # issued early, used last
    ks = _row_scales(base + K_SCALE, ROWS)
    kz = _row_scales(base + K_ZERO, ROWS)
    VDT: gl.constexpr = gl.float16 if F16 else gl.float32  # v_scale and v_offset as stored with F16
    vs = _row_scales(base + V_SCALE, ROWS, VDT)
    vz = _row_scales(base + V_ZERO, ROWS, VDT)
    return codes, pairs, ks, kz, vs, vz


@gluon.jit
def _copy_lines(stage, src, live, LINES: gl.constexpr):
    """cp.async of [LINES, 64] contiguous int16 at src into stage, 16 bytes per lane and copy; unless live no copy is
    issued and the stage keeps what it held (a tile past the split's end, never read)."""
    line = gl.arange(0, LINES, layout=gl.SliceLayout(1, COPY_LINES))
    col = gl.arange(0, 64, layout=gl.SliceLayout(0, COPY_LINES))
    offs = line[:, None] * 64 + col[None, :]
    _copy_async(stage, src + offs, mask=(offs >= 0) & live)


@gluon.jit
def _copy_tile(codes_k, codes_v, scales, base, live, Q: gl.constexpr, K_CODES: gl.constexpr,
               V_CODES: gl.constexpr, K_SCALE: gl.constexpr):
    """Start the copies of one INT2 tile (the (block, KV head) region at base) into one stage: key codes and V codes
    (TILE Q bytes each, as lines of 128 bytes, both copied as int16) and the four scale planes (SCALE_BYTES from
    K_SCALE), as one cp.async group."""
    LINES: gl.constexpr = TILE * Q // 128
    keys = _view_as(codes_k, gl.int16, [LINES, 64], STAGED_KEYS_16)
    _copy_lines(keys, (base + K_CODES).to(gl.pointer_type(gl.int16)), live, LINES)
    _copy_lines(codes_v, (base + V_CODES).to(gl.pointer_type(gl.int16)), live, LINES)
    flat = gl.arange(0, SCALE_BYTES, layout=COPY_LANES)
    _copy_async(scales, base + K_SCALE + flat, mask=(flat >= 0) & live)
    async_copy.commit_group()


@gluon.jit
def _staged_scales(scales, P: gl.constexpr, ROWS: gl.constexpr, DTYPE: gl.constexpr = gl.float32):
    """Scale plane P (0 k_scale, 1 k_offset, 2 v_scale, 3 v_offset) of a staged tile as _row_scales returns it."""
    plane = _view_as(scales, gl.float16, [4, TILE], STAGED).index(P)
    return gl.convert_layout(_rows_logical(plane.load(ROW_PHYS)), ROWS, assert_trivial=True).to(DTYPE)


@gluon.jit
def _staged_tile(codes_k, codes_v, scales, ROWS: gl.constexpr, Q: gl.constexpr, F16: gl.constexpr):
    """_tile_loads' tensors of a tile copied by _start_stage (cp.async or TMA), read from shared memory into the same
    layouts."""
    if Q == 32:
        codes = gl.convert_layout(gl.reshape(codes_k.load(STAGED_CODES_128), [8, 8, 4, 8]), CODE_BYTES_128,
                                  assert_trivial=True)
        pairs = gl.convert_layout(gl.reshape(codes_v.load(STAGED_PAIRS_128), [4, 2, 8, 8, 2]), PAIRS_128,
                                  assert_trivial=True)
    else:
        codes = gl.convert_layout(gl.reshape(codes_k.load(STAGED_CODES_64), [8, 8, 4, 4]), CODE_BYTES_64,
                                  assert_trivial=True)
        pairs = gl.convert_layout(gl.reshape(codes_v.load(STAGED_PAIRS_64), [4, 2, 8, 8]), PAIRS_64,
                                  assert_trivial=True)
    VDT: gl.constexpr = gl.float16 if F16 else gl.float32  # v_scale and v_offset as stored with F16
    return (codes, pairs, _staged_scales(scales, 0, ROWS), _staged_scales(scales, 1, ROWS),
            _staged_scales(scales, 2, ROWS, VDT), _staged_scales(scales, 3, ROWS, VDT))


@gluon.jit
def tma_ring(STAGES: gl.constexpr, Q: gl.constexpr):
    """COPY_TMA's stage buffers, [STAGES, ...] each, and one initialised mbarrier per stage: (keys, values, planes,
    bars) with keys the key codes [STAGES, 1, lines, 128] and values the V codes [STAGES, 1, 2, lines / 2, 128] at
    Q = 32 (head_dim 128), keys both codes [STAGES, 1, 2 x lines, 128] and values the same buffer at 16, planes the
    scale planes [STAGES, 1, 4, 128] (the layouts of tma_descriptors' boxes)."""
    LINES: gl.constexpr = TILE * Q // 128
    if Q == 32:
        keys = gl.allocate_shared_memory(gl.uint8, [STAGES, 1, LINES, 128], TMA_SWIZZLED_3D)
        values = gl.allocate_shared_memory(gl.uint8, [STAGES, 1, 2, LINES // 2, 128], TMA_SWIZZLED_4D)
    else:  # the key and V codes in one box
        keys = gl.allocate_shared_memory(gl.uint8, [STAGES, 1, 2 * LINES, 128], TMA_SWIZZLED_3D)
        values = keys
    planes = gl.allocate_shared_memory(gl.uint8, [STAGES, 1, 4, 128], TMA_PLAIN_3D)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()
    return keys, values, planes, bars


@gluon.jit
def _start_stage(keys, values, planes, bar, k_desc, v_desc, s_desc, head_base, blk, heads, h, stride_cb, live,
                 Q: gl.constexpr, K_CODES: gl.constexpr, V_CODES: gl.constexpr, K_SCALE: gl.constexpr,
                 REGION: gl.constexpr, COPY_TMA: gl.constexpr):
    """Start the copies of the tile in cache block blk (KV head h) into one stage; unless live nothing is issued.
    COPY_TMA: the boxes of tma_descriptors for the cache's region blk x heads + h (at Q = 16 the key and V codes in
    one, into keys; values unused), completing on ``bar`` once its REGION bytes have landed; else _copy_tile's
    cp.async group (bar unused)."""
    if COPY_TMA:
        region = blk * heads + h
        mbarrier.expect(bar, REGION, pred=live)
        _tma_load(k_desc, [region, 0, 0], bar, keys, pred=live)
        if Q == 32:
            _tma_load(v_desc, [region, 0, 0, 0], bar, values, pred=live)
        _tma_load(s_desc, [region, 0, 0], bar, planes, pred=live)
    else:
        _copy_tile(keys, values, planes, head_base + blk.to(gl.int64) * stride_cb, live, Q, K_CODES, V_CODES, K_SCALE)


@gluon.jit
def _stage_landed(keys, values, planes, bar, phase, ROWS: gl.constexpr, Q: gl.constexpr, F16: gl.constexpr,
                  COPY_STAGES: gl.constexpr, COPY_TMA: gl.constexpr):
    """Wait until the stage's tile has landed (its mbarrier at ``phase`` with COPY_TMA, else all but the
    COPY_STAGES - 1 newest cp.async groups, then every lane), and read it as _staged_tile does."""
    if COPY_TMA:
        mbarrier.wait(bar, phase)
        LINES: gl.constexpr = TILE * Q // 128
        if Q == 32:
            codes_k = _view_as(keys, gl.uint8, [LINES, 128], STAGED_KEYS)
            codes_v = _view_as(values, gl.int16, [LINES, 64], STAGED_V_128_TMA)
        else:
            codes_k = _view_as(keys, gl.uint8, [2, LINES, 128], STAGED_KEYS).index(0)
            codes_v = _view_as(keys, gl.int16, [2, LINES, 64], STAGED_V_64).index(1)
        return _staged_tile(codes_k, codes_v, _view_as(planes, gl.uint8, [SCALE_BYTES], STAGED), ROWS, Q, F16)
    else:
        async_copy.wait_group(COPY_STAGES - 1)
        _sync_warps()  # every lane's copies of the tile have landed
        return _staged_tile(keys, values, planes, ROWS, Q, F16)


@gluon.jit
def _tile_step(codes, pairs, ks, kz, vs, vz, q0, q1, q2, q3, qo, l_scale, zero_s, ones, m_i, l_acc, acc, sums,
               Q: gl.constexpr, F16: gl.constexpr):
    """One INT2 tile of a split program (its loads given): logits, lazy-rescaled online softmax, V products.
    Returns the running (m_i, l_acc, acc, sums)."""
    x = _tile_logits(codes, ks, kz, q0, q1, q2, q3, qo, zero_s, Q)
    SLACK: gl.constexpr = RESCALE_SLACK_F16 if F16 else RESCALE_SLACK
    lane_max = gl.max(gl.reshape(x, [8, 8, 4]), axis=0)  # [8 (gid), 4 (head)]: the max of each lane's own rows
    LANE: gl.constexpr = gl.SliceLayout(0, lane_max.type.layout)
    over = lane_max * gl.convert_layout(l_scale, LANE, assert_trivial=True)[None, :] \
        - gl.convert_layout(m_i, LANE, assert_trivial=True)[None, :] > SLACK
    if gl.max(gl.reshape(over.to(gl.int32), [32]), axis=0) > 0:  # lazy rescale, as int2_split_kernel
        tile_max = gl.convert_layout(gl.max(lane_max, axis=0), m_i.type.layout, assert_trivial=True) * l_scale
        m_new = gl.maximum(m_i, tile_max)
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        l_acc *= alpha[None, :]
        alpha_c = _per_column(alpha)
        acc *= alpha_c[None, :]
        sums *= alpha_c[None, :]
        m_i = m_new
    p = gl.exp2(x * l_scale[None, :] - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    l_acc += p
    sums, acc = _tile_values(p, vs, vz, pairs, sums, acc, ones, Q, F16)
    return m_i, l_acc, acc, sums


@gluon.jit
def _fold_bias(acc, sums, D: gl.constexpr, F16: gl.constexpr):
    """Move the column sums of W since the last fold out of sums (restarted at 0) into acc's head columns:
    acc[:, 2 j] += F_P zw_j - BIAS sw_j (BIAS_F16 with F16), so that acc[:, 2 j] / F_P is head j's unnormalised
    output (columns 2 j + 1 take junk and are never stored). Every row of ones @ W holds the column sums (sw_j at
    2 j, zw_j at 2 j + 1), so each lane takes them from its own rows of sums and adds them to its own rows of acc
    ([D, 8] as [D / 8, 8 (gid), 8]): no data moves between lanes. Returns (acc, sums)."""
    since = gl.max(gl.reshape(sums, [2, 8, 8]), axis=0)  # rows 8 hf + gid of sums: hf is in-lane
    zw = gl.split(gl.reshape(since, [8, 4, 2]))[1]  # a lane holds both columns of its head
    zw = gl.reshape(gl.join(zw, zw), [8, 8])
    acc3 = gl.reshape(acc, [D // 8, 8, 8])
    BLOCKS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, acc3.type.layout))
    factor = _plane_factor(gl.arange(0, D // 8, layout=BLOCKS) // (D // 32), F16)  # rows 8 k + gid: plane 4 k // D
    LANES: gl.constexpr = gl.SliceLayout(0, acc3.type.layout)
    bias: gl.constexpr = BIAS_F16 if F16 else BIAS
    delta = factor[:, None, None] * gl.convert_layout(zw, LANES, assert_trivial=True)[None, :, :] \
        - bias * gl.convert_layout(since, LANES, assert_trivial=True)[None, :, :]
    return gl.convert_layout(gl.reshape(acc3 + delta, [D, 8]), MMA, assert_trivial=True), gl.zeros_like(sums)


@gluon.jit
def _tile_logits(codes, ks, kz, q0, q1, q2, q3, qo, zero_s, Q: gl.constexpr):
    """x [64, 4] fp32 of one INT2 tile: k_scale (code . q8) + k_offset sum(q8) per position and head."""
    s = mma_v2(_codes_operand(codes, 0, Q), q0, zero_s)
    s = mma_v2(_codes_operand(codes, 1, Q), q1, s)
    if Q == 32:
        s = mma_v2(_codes_operand(codes, 2, Q), q2, s)
        s = mma_v2(_codes_operand(codes, 3, Q), q3, s)
    return ks[:, None] * _fold_key_parts(s).to(gl.float32) + kz[:, None] * qo[None, :]


@gluon.jit
def _weights_operand(w):
    """The weights W [64, 8] (bf16 or fp16) from the accumulator layout MMA into WEIGHT_OP (the V product's B operand,
    K index = W's row) by one movmatrix.trans per register and no other instruction: lane (gid, tig)'s register r
    holds W[8 r + gid, 2 tig + i] (i = 0, 1) and after the transpose of that 8 x 8 block W[8 r + 2 tig + i, gid],
    which is where WEIGHT_OP keeps those two elements. (A layout conversion would shuffle and repack them: 8 SHFL and
    16 PRMT per tile.)"""
    t = gl.inline_asm_elementwise("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [w], dtype=w.dtype,
                                  is_pure=True, pack=2)
    # t[8 r + gid, 2 tig + i] = W[8 r + 2 tig + i, gid]: relabel [r, gid, tig, i] -> [r, tig, i, gid]
    t = gl.permute(gl.reshape(t, [8, 8, 4, 2]), [0, 2, 3, 1])
    return gl.convert_layout(gl.reshape(t, [TILE, 8]), WEIGHT_OP, assert_trivial=True)


@gluon.jit
def _tile_values(p, vs, vz, pairs, sums, acc, ones, Q: gl.constexpr, F16: gl.constexpr):
    """The V side of one INT2 tile: W = (bf16(p v_scale), bf16(p v_offset)) per head (with F16: fp16(p) times the
    fp16 v_scale and v_offset, two products per instruction); sums += ones @ W, acc += (BIAS + F code)^T @ W.
    Returns (sums, acc)."""
    if F16:
        p16 = p.to(gl.float16)
        w = gl.join(p16 * vs[:, None], p16 * vz[:, None])
        w = _weights_operand(gl.convert_layout(gl.reshape(w, [TILE, 8]), MMA))
    else:
        w = gl.join((p * vs[:, None]).to(gl.bfloat16), (p * vz[:, None]).to(gl.bfloat16))
        w = _weights_operand(gl.convert_layout(gl.reshape(w, [TILE, 8]), MMA, assert_trivial=True))
    return mma_v2(ones, w, sums), mma_v2(_value_operand(pairs, Q, F16), w, acc)


@gluon.jit
def _window_logits(wk_head, stride_w1, q_ptr, stride_qb, stride_qh, b, h, D: gl.constexpr, GROUP: gl.constexpr):
    """fold(K @ q) [64, 4] fp32 over a BF16 window tile: K rows at wk_head + position * stride_w1 (the tile's block,
    KV head h), row m of the result = position ROW_POS(m); the query rounded to K's dtype. One K step (16 channels) at
    a time; lane tig takes channels C tig + 4 s + 0..3 (C = D / 4) of step s, the query the same."""
    C: gl.constexpr = D // 4
    L: gl.constexpr = gl.BlockedLayout([1, 8, 1, 4], [8, 1, 4, 1], [1, 1, 1, 1], [3, 1, 2, 0])
    g, r, t, i = _axes4(8, 8, 4, 4, L)
    rows = ((8 * g)[:, None] + r[None, :]) * stride_w1
    k_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    q_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    kq = gl.arange(0, 16, layout=gl.SliceLayout(1, q_op))
    n = gl.arange(0, 8, layout=gl.SliceLayout(0, q_op))
    head = n // KPARTS
    q_cols = q_ptr + b.to(gl.int64) * stride_qb + (h * GROUP + head) * stride_qh
    q_ok = (head < GROUP) & (n % KPARTS == 0)  # part 0's column holds the query, part 1's stays 0
    acc = gl.full([TILE, 8], 0.0, gl.float32, layout=MMA)
    for s in gl.static_range(D // 16):
        k = gl.load(wk_head + rows[:, :, None, None] + (C * t + 4 * s)[None, None, :, None] + i[None, None, None, :])
        # [gid, mt, hf, tig, h, e] -> [mt, hf, gid, h, tig, e]: row 16 mt + 8 hf + gid, K index 8 h + 2 tig + e
        k = gl.permute(gl.reshape(k, [8, 4, 2, 4, 2, 2]), [1, 2, 0, 4, 3, 5])
        k = gl.convert_layout(gl.reshape(k, [TILE, 16]), k_op, assert_trivial=True)
        chan = C * ((kq % 8) // 2) + 4 * s + 2 * (kq // 8) + kq % 2
        q = gl.load(q_cols[None, :] + chan[:, None], mask=q_ok[None, :], other=0.0).to(k.dtype)  # rounded as K
        acc = mma_v2(k, q, acc)
    return _fold_parts(acc)


@gluon.jit
def _window_plane(wv_head, stride_w1, w, P: gl.constexpr, Q: gl.constexpr):
    """Plane P's part of V^T @ W over a BF16 window tile: [Q, 8] fp32, rows (parity) Q / 2 + jl of _value_operand's
    order (channel P Q + 2 pair + parity). Lane (gid, tig) loads the channels of its MMA rows at positions 16 tig ..
    16 tig + 15 (Q = 32: four channels, 8 bytes per position; Q = 16: two), and the operand pairs positions."""
    W: gl.constexpr = 4 if Q == 32 else 2
    L: gl.constexpr = gl.BlockedLayout([1, 16, 1, W], [4, 1, 8, 1], [1, 1, 1, 1], [3, 1, 0, 2])
    t, r, g, i = _axes4(4, 16, 8, W, L)
    rows = ((16 * t)[:, None] + r[None, :]) * stride_w1
    v = gl.load(wv_head + rows[:, :, None, None] + (P * Q + W * g)[None, None, :, None] + i[None, None, None, :])
    if Q == 32:  # [tig, e, kk, hk, gid, hf, parity] -> rows (parity, hf, gid), K (kk, hk, tig, e)
        v = gl.permute(gl.reshape(v, [4, 2, 4, 2, 8, 2, 2]), [6, 5, 4, 2, 3, 0, 1])
    else:  # [tig, e, kk, hk, gid, parity] -> rows (parity, gid), K (kk, hk, tig, e)
        v = gl.permute(gl.reshape(v, [4, 2, 4, 2, 8, 2]), [5, 4, 2, 3, 0, 1])
    v = gl.convert_layout(gl.reshape(v, [Q, TILE]), VALUE_OP)
    return mma_v2(v, w, gl.full([Q, 8], 0.0, gl.float32, layout=MMA))


@gluon.jit
def _window_values(wv_head, stride_w1, pw, D: gl.constexpr):
    """V^T @ PW [D, 8] fp32 over a BF16 window tile (V rows at wv_head + position * stride_w1; PW column 2 j =
    pw_j [64, 4] rounded to V's dtype, 2 j + 1 = 0), rows in the INT2 accumulator's channel order, a plane at a
    time."""
    Q: gl.constexpr = D // 4
    dtype: gl.constexpr = wv_head.dtype.element_ty  # the window store's (bf16 or fp16)
    w = gl.join(pw.to(dtype), gl.zeros_like(pw).to(dtype))
    w = _weights_operand(gl.convert_layout(gl.reshape(w, [TILE, 8]), MMA, assert_trivial=True))
    planes = gl.join(gl.join(_window_plane(wv_head, stride_w1, w, 0, Q), _window_plane(wv_head, stride_w1, w, 1, Q)),
                     gl.join(_window_plane(wv_head, stride_w1, w, 2, Q), _window_plane(wv_head, stride_w1, w, 3, Q)))
    return gl.convert_layout(gl.reshape(gl.permute(planes, [3, 2, 0, 1]), [D, 8]), MMA)  # row P Q + plane row


@gluon.jit
def _plane_factor(plane, F16: gl.constexpr):
    """F_P of code planes P = plane (1, 4, 16, 16, or 1, 4, 16, 64 with F16), as fp32 in plane's layout."""
    last: gl.constexpr = 64.0 if F16 else 16.0
    return gl.where(plane == 0, 1.0, gl.where(plane == 1, 4.0, gl.where(plane == 2, 16.0, last)))


@gluon.jit
def _row_factor(D: gl.constexpr, F16: gl.constexpr):
    """F_P of the accumulator's rows [D] (row r: plane r // (D / 4))."""
    return _plane_factor(gl.arange(0, D, layout=gl.SliceLayout(1, MMA)) // (D // 4), F16)


@gluon.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", "NSPLIT"])
def int2_split_gluon_kernel(
    q_ptr, stride_qb, stride_qh,
    cache_ptr, stride_cb, stride_ch,
    wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    bt_ptr, wbt_ptr, stride_bt, seq_ptr,
    part_ptr, stride_pb, stride_ph, stride_ps,
    lse_ptr, stride_lb, stride_lh,
    sink, recent, qk_scale, k_desc, v_desc, s_desc, NSPLIT,
    GROUP: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, NSINK: gl.constexpr,
    K_CODES: gl.constexpr, V_CODES: gl.constexpr, K_SCALE: gl.constexpr, K_ZERO: gl.constexpr,
    V_SCALE: gl.constexpr, V_ZERO: gl.constexpr, MIN_TILES: gl.constexpr, REGION: gl.constexpr,
    TRIGGER_DEPENDENTS: gl.constexpr = False, COPY_STAGES: gl.constexpr = 0, FOLD: gl.constexpr = FOLD_TILES,
    F16_VALUES: gl.constexpr = False, WINDOW_PREFETCH: gl.constexpr = False, COPY_TMA: gl.constexpr = False,
):
    """int2_split_kernel's job with FULL_TILES (same arguments, grid (B, Hkv, NSPLIT + window tiles) and partials)
    for tiles and window tiles of 64 positions: program pid < NSPLIT takes split pid of the whole INT2 tiles of
    (request b, KV head h), program NSPLIT + w window tile w (NSINK tiles of [0, head_end), then tiles of
    [tail_start, length): BF16 copies where the block has one and the position is in a window, INT2 codes
    elsewhere). TRIGGER_DEPENDENTS: a programmatically dependent launch (the merge) may start at once;
    WINDOW_PREFETCH: a window program asks L2 for its BF16 V rows before its logits (they are read after them)."""
    gl.static_assert(BS == TILE, "one tile per cache block of 64 positions")
    gl.static_assert(GROUP <= MAX_GROUP, "GQA groups of at most 4 query heads per KV head")
    gl.static_assert((D == 64) | (D == 128), "head_dim 64 or 128")
    if TRIGGER_DEPENDENTS:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    Q: gl.constexpr = D // 4
    b = gl.program_id(0)
    h = gl.program_id(1)
    pid = gl.program_id(2)
    length = gl.load(seq_ptr + b)
    sink_end = gl.minimum(sink, length)
    int2_end = gl.maximum(sink_end, length - recent)
    first = gl.cdiv(sink_end, TILE) * TILE
    n_tiles = gl.maximum((int2_end // TILE) * TILE - first, 0) // TILE
    head_end = gl.maximum(sink_end, gl.minimum(first, int2_end))  # window programs: [0, head_end)
    tail_start = gl.minimum(int2_end, gl.maximum(first + n_tiles * TILE, head_end))  # and [tail_start, length)
    head_base = cache_ptr + h * stride_ch
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt

    zero_s = gl.full([TILE, 8], 0, gl.int32, layout=MMA)
    FOLDED: gl.constexpr = _fold_parts(zero_s).type.layout
    HEADS: gl.constexpr = gl.SliceLayout(0, FOLDED)
    ROWS: gl.constexpr = gl.SliceLayout(1, FOLDED)
    m_i = gl.full([4], float("-inf"), gl.float32, layout=HEADS)
    l_acc = gl.full([TILE, 4], 0.0, gl.float32, layout=FOLDED)  # per position; summed once, at the end
    acc = gl.full([D, 8], 0.0, gl.float32, layout=MMA)
    sums = gl.full([16, 8], 0.0, gl.float32, layout=MMA)
    ones = gl.full([16, TILE], 1.0, gl.float16 if F16_VALUES else gl.bfloat16, layout=VALUE_OP)
    if pid < NSPLIT:
        per_split = gl.maximum(gl.cdiv(n_tiles, NSPLIT), MIN_TILES)
        lo = gl.minimum(pid * per_split, n_tiles)
        hi = gl.minimum(lo + per_split, n_tiles)
        if COPY_STAGES > 0:  # tiles copied COPY_STAGES - 1 ahead into shared memory (cp.async or TMA), no prefetch
            gl.static_assert((K_ZERO == K_SCALE + 2 * TILE) & (V_SCALE == K_SCALE + 4 * TILE)
                             & (V_ZERO == K_SCALE + 6 * TILE), "the four fp16 scale planes, contiguous, in this order")
            LINES: gl.constexpr = TILE * Q // 128
            if COPY_TMA:  # the boxes of tma_descriptors, each stage completing on its mbarrier
                keys, values, planes, bars = tma_ring(COPY_STAGES, Q)
            else:
                keys = gl.allocate_shared_memory(gl.uint8, [COPY_STAGES, LINES, 128], STAGED_KEYS)
                values = gl.allocate_shared_memory(gl.int16, [COPY_STAGES, LINES, 64],
                                                   STAGED_V_128 if Q == 32 else STAGED_V_64)
                planes = gl.allocate_shared_memory(gl.uint8, [COPY_STAGES, SCALE_BYTES], STAGED)
                bars = planes  # never read: cp.async groups complete the stages (_stage_landed)
            heads = stride_cb // stride_ch  # regions per cache block (TMA: the cache is contiguous)
            for s in gl.static_range(COPY_STAGES - 1):
                blk = gl.load(bt_row + (first + (lo + s) * TILE) // BS, mask=lo + s < hi, other=0)
                _start_stage(keys.index(s), values.index(s), planes.index(s), bars.index(s), k_desc, v_desc, s_desc,
                             head_base, blk, heads, h, stride_cb, lo + s < hi, Q, K_CODES, V_CODES, K_SCALE, REGION,
                             COPY_TMA)
            ahead = lo + COPY_STAGES - 1
            blk_ahead = gl.load(bt_row + (first + ahead * TILE) // BS, mask=ahead < hi, other=0)
            q0, q1, q2, q3, qo, l_scale = _int8_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, zero_s, Q,
                                                      GROUP)
            for i in range(lo, hi):
                stage = (i - lo) % COPY_STAGES
                refill = (stage + COPY_STAGES - 1) % COPY_STAGES  # the stage every lane read one tile ago
                ahead = i + COPY_STAGES - 1
                _sync_warps()
                _start_stage(keys.index(refill), values.index(refill), planes.index(refill), bars.index(refill),
                             k_desc, v_desc, s_desc, head_base, blk_ahead, heads, h, stride_cb, ahead < hi, Q,
                             K_CODES, V_CODES, K_SCALE, REGION, COPY_TMA)
                blk_ahead = gl.load(bt_row + (first + (ahead + 1) * TILE) // BS, mask=ahead + 1 < hi, other=0)
                codes, pairs, ks, kz, vs, vz = _stage_landed(keys.index(stage), values.index(stage),
                                                             planes.index(stage), bars.index(stage),
                                                             ((i - lo) // COPY_STAGES) % 2, ROWS, Q, F16_VALUES,
                                                             COPY_STAGES, COPY_TMA)
                m_i, l_acc, acc, sums = _tile_step(codes, pairs, ks, kz, vs, vz, q0, q1, q2, q3, qo, l_scale, zero_s,
                                                   ones, m_i, l_acc, acc, sums, Q, F16_VALUES)
                if (i - lo) % FOLD == FOLD - 1:
                    acc, sums = _fold_bias(acc, sums, D, F16_VALUES)
        else:
            _prefetch_region(head_base, bt_row, stride_cb, first + lo * TILE, lo < hi, BS, REGION)
            q0, q1, q2, q3, qo, l_scale = _int8_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, zero_s, Q,
                                                      GROUP)
            for i in range(lo, hi):
                t0 = first + i * TILE
                _prefetch_region(head_base, bt_row, stride_cb, t0 + TILE, i + 1 < hi, BS, REGION)
                base = head_base + gl.load(bt_row + t0 // BS).to(gl.int64) * stride_cb
                codes, pairs, ks, kz, vs, vz = _tile_loads(base, ROWS, Q, K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE,
                                                           V_ZERO, F16_VALUES)
                m_i, l_acc, acc, sums = _tile_step(codes, pairs, ks, kz, vs, vz, q0, q1, q2, q3, qo, l_scale, zero_s,
                                                   ones, m_i, l_acc, acc, sums, Q, F16_VALUES)
                if (i - lo) % FOLD == FOLD - 1:
                    acc, sums = _fold_bias(acc, sums, D, F16_VALUES)
    else:
        tile = pid - NSPLIT
        in_sink = tile < NSINK
        part_lo = gl.where(in_sink, 0, tail_start)
        part_hi = gl.where(in_sink, head_end, length)
        t0 = (part_lo // TILE + gl.where(in_sink, tile, tile - NSINK)) * TILE
        if t0 < part_hi:
            mrow = gl.arange(0, TILE, layout=ROWS)
            s = t0 + 8 * (mrow % 8) + 2 * (mrow // 16) + (mrow // 8) % 2  # ROW_POS
            ok = (s >= part_lo) & (s < part_hi)
            wblk = gl.load(wbt_ptr + b.to(gl.int64) * stride_bt + t0 // BS)
            copy = ok & (wblk >= 0) & ((s < sink_end) | (s >= int2_end))  # window positions with a BF16 copy
            no_copy = ok & ~copy  # INT2: window positions without a copy, and the INT2 edges of the range
            w_head = gl.maximum(wblk, 0).to(gl.int64) * stride_w0 + h * stride_w2
            logits = gl.full([TILE, 4], float("-inf"), gl.float32, layout=FOLDED)
            any_copy = gl.max(copy.to(gl.int32), axis=0) > 0
            any_int2 = gl.max(no_copy.to(gl.int32), axis=0) > 0
            if WINDOW_PREFETCH:
                if any_copy:  # the V rows are read last, after the logits
                    _prefetch_window_rows(wv_ptr + w_head, stride_w1, D)
            if any_copy:
                x_copy = _window_logits(wk_ptr + w_head, stride_w1, q_ptr, stride_qb, stride_qh, b, h, D, GROUP)
                logits = gl.where(copy[:, None], x_copy * qk_scale, logits)
            base = head_base + gl.load(bt_row + t0 // BS).to(gl.int64) * stride_cb
            if any_int2:
                q0, q1, q2, q3, qo, l_scale = _int8_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, zero_s, Q,
                                                          GROUP)
                codes, pairs, ks, kz, vs, vz = _tile_loads(base, ROWS, Q, K_CODES, V_CODES, K_SCALE, K_ZERO,
                                                           V_SCALE, V_ZERO, F16_VALUES)
                x = _tile_logits(codes, ks, kz, q0, q1, q2, q3, qo, zero_s, Q)
                logits = gl.where(no_copy[:, None], x * l_scale[None, :], logits)
            m_i = gl.max(logits, axis=0)
            l_acc = gl.exp2(logits - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
            if any_int2:
                codes, pairs, ks, kz, vs, vz = _tile_loads(base, ROWS, Q, K_CODES, V_CODES, K_SCALE, K_ZERO,
                                                           V_SCALE, V_ZERO, F16_VALUES)
                sums, acc = _tile_values(gl.where(no_copy[:, None], l_acc, 0.0), vs, vz, pairs, sums, acc, ones, Q,
                                         F16_VALUES)
            if any_copy:  # BF16 values enter acc scaled like the INT2 codes (the epilogue divides by F_P)
                acc += _window_values(wv_ptr + w_head, stride_w1, gl.where(copy[:, None], l_acc, 0.0), D) \
                    * _row_factor(D, F16_VALUES)[:, None]

    acc, sums = _fold_bias(acc, sums, D, F16_VALUES)  # column 2 j: head j's output times F_P l_j
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    l_i = _per_column(gl.sum(l_acc, axis=0))
    m_c = _per_column(m_i)
    inv_l = gl.where(l_i > 0.0, 1.0 / gl.where(l_i > 0.0, l_i, 1.0), 0.0)
    j = gl.arange(0, 8, layout=COLS)
    head = h * GROUP + j // KPARTS
    stored = (j % KPARTS == 0) & (j // KPARTS < GROUP)
    r = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    plane = r // Q
    jl = r % (Q // 2)
    pair = 2 * (jl % 8) + jl // 8 if Q == 32 else jl
    chan = plane * Q + 2 * pair + (r // (Q // 2)) % 2
    out = acc / _row_factor(D, F16_VALUES)[:, None] * inv_l[None, :]
    o_ptrs = part_ptr + b.to(gl.int64) * stride_pb + head[None, :] * stride_ph + pid * stride_ps + chan[:, None]
    gl.store(o_ptrs, out, mask=stored[None, :])
    lse = gl.where(l_i > 0.0, m_c + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    gl.store(lse_ptr + b * stride_lb + head * stride_lh + pid, lse, mask=stored)
