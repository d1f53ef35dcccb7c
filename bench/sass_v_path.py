#!/usr/bin/env python3
"""Offline SASS of two ways to accumulate one 64-token tile of INT2 V (docs/decisions.md V18).

A, the shipped path (triton_decode_int2.accumulate_plane): V codes as int16 byte pairs per token row,
unpacked to bf16 even / odd planes and fed transposed to bf16 MMAs with w = bf16(p * scale).
B, the alternative weighed for a page-layout change: V codes transposed within each block (tokens
contiguous per channel byte), one lop3 per four codes into int8 planes (plane 3 centred: 64 (c - 2)),
an int8 MMA with the weights rounded to int8 per tile and column, the int32 result scaled back into
fp32 accumulators. Both are stand-alone loops over tiles (one warp, D 128, GQA padded to 8): only the
V work of the decode loop, so their instruction counts compare the two paths.

    PYTHONPATH=/opt/tri36 python bench/sass_v_path.py      # the GPU machine's Triton 3.6, sm_90
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sass_decode import loop_histograms, read_compiled  # noqa: E402
from vllm_oscar.kernels.triton_common import int8_mma  # noqa: E402
from vllm_oscar.kernels.triton_decode_int2 import accumulate_plane, zero_accumulators  # noqa: E402

#: triton_common.UNPACK_PTX as a kernel constant.
PTX_MODE: tl.constexpr = tl.constexpr(1)


@triton.jit
def _int8_plane(b, P: tl.constexpr):
    """uint8 bytes -> int8 F_P * code of plane P (F = 1, 4, 16) or, plane 3, 64 (code - 2): one lop3."""
    if P == 0:
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x03030303;", "=r,r", [b], dtype=tl.int8, is_pure=True,
                                         pack=4)
    elif P == 1:
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0C0C0C0C;", "=r,r", [b], dtype=tl.int8, is_pure=True,
                                         pack=4)
    elif P == 2:
        return tl.inline_asm_elementwise("and.b32 $0, $1, 0x30303030;", "=r,r", [b], dtype=tl.int8, is_pure=True,
                                         pack=4)
    else:  # (b & 0xC0) ^ 0x80 per byte: lop3 0x6A = (a & b) ^ c
        return tl.inline_asm_elementwise("{ .reg .b32 x; mov.b32 x, 0x80808080; lop3.b32 $0, $1, 0xC0C0C0C0, x, 0x6A; }",
                                         "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def shipped_v_tiles(v_ptr, p_ptr, s_ptr, o_ptr, n, BT: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr):
    """Path A over n tiles: v_ptr [n, BT, Q] bytes (token rows), p_ptr [n, BT, GP], s_ptr [n, BT]."""
    t = tl.arange(0, BT)
    pairs = tl.arange(0, Q // 2)
    g = tl.arange(0, GP)
    a0e, a0o, a1e, a1o, a2e, a2o, a3e, a3o = zero_accumulators(Q // 2, GP)
    for i in range(n):
        vc = tl.load(v_ptr.to(tl.pointer_type(tl.int16)) + i * BT * Q // 2 + t[:, None] * (Q // 2) + pairs[None, :])
        p = tl.load(p_ptr + i * BT * GP + t[:, None] * GP + g[None, :])
        w = (p * tl.load(s_ptr + i * BT + t)[:, None]).to(tl.bfloat16)
        a0e, a0o = accumulate_plane(vc, w, a0e, a0o, 0, PTX_MODE, False)
        a1e, a1o = accumulate_plane(vc, w, a1e, a1o, 1, PTX_MODE, False)
        a2e, a2o = accumulate_plane(vc, w, a2e, a2o, 2, PTX_MODE, False)
        a3e, a3o = accumulate_plane(vc, w, a3e, a3o, 3, PTX_MODE, False)
    tl.store(o_ptr + pairs[:, None] * GP + g[None, :], a0e + a0o + a1e + a1o + a2e + a2o + a3e + a3o)


@triton.jit
def transposed_int8_v_tiles(v_ptr, p_ptr, s_ptr, o_ptr, n, BT: tl.constexpr, GP: tl.constexpr, Q: tl.constexpr,
                            BS: tl.constexpr):
    """Path B over n tiles: v_ptr [n, BT / BS, Q, BS] bytes (tokens contiguous per byte column)."""
    t = tl.arange(0, BT)
    cols = tl.arange(0, Q)
    g = tl.arange(0, GP)
    a0 = tl.zeros([Q, GP], tl.float32)
    a1 = tl.zeros([Q, GP], tl.float32)
    a2 = tl.zeros([Q, GP], tl.float32)
    a3 = tl.zeros([Q, GP], tl.float32)
    for i in range(n):
        vt = tl.load(v_ptr + i * BT * Q + (t // BS)[None, :] * (Q * BS) + cols[:, None] * BS + (t % BS)[None, :])
        p = tl.load(p_ptr + i * BT * GP + t[:, None] * GP + g[None, :])
        w = p * tl.load(s_ptr + i * BT + t)[:, None]
        w_max = tl.max(w, axis=0)
        w8 = tl.floor(w * tl.where(w_max > 0, 127.0 / w_max, 0.0)[None, :] + 0.5).to(tl.int8)
        back = w_max / 127.0
        zero = tl.zeros([Q, GP], tl.int32)
        a0 += int8_mma(_int8_plane(vt, 0), w8, zero, False).to(tl.float32) * back[None, :]
        a1 += int8_mma(_int8_plane(vt, 1), w8, zero, False).to(tl.float32) * back[None, :]
        a2 += int8_mma(_int8_plane(vt, 2), w8, zero, False).to(tl.float32) * back[None, :]
        a3 += int8_mma(_int8_plane(vt, 3), w8, zero, False).to(tl.float32) * back[None, :]
    tl.store(o_ptr + cols[:, None] * GP + g[None, :], a0 + a1 + a2 + a3)


def compile_for_sm90(fn, constants: dict):
    signature = {"v_ptr": "*u8", "p_ptr": "*fp32", "s_ptr": "*fp32", "o_ptr": "*fp32", "n": "i32"}
    names = fn.arg_names
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(k),): [["tt.divisibility", 16]] for k in signature if k != "n"})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})


def main() -> int:
    shape = dict(BT=64, GP=8, Q=32)
    for label, fn, constants in (("A shipped (byte pairs, bf16 MMA)", shipped_v_tiles, shape),
                                 ("B transposed layout, int8 MMA", transposed_int8_v_tiles, {**shape, "BS": 16})):
        sass, registers, stack = read_compiled(compile_for_sm90(fn, constants), None)
        print(f"{label}: registers {registers}, stack {stack} B")
        for line in loop_histograms(sass, 14):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
