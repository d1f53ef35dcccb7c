"""Triton building blocks shared by the OSCAR kernels: code unpacking and dtype mapping.

Codes never get dequantized element-wise. A packed byte holds the codes of channels
j, j+D/4, j+D/2, j+3D/4 (quant.packing); plane p of a [T, D/4] byte tile is the
[T, D/4] tile of codes of channels [p D/4, (p+1) D/4). ``unpack_plane`` turns it into a
bf16 tensor holding ``BIAS + F_p * code`` with two or three integer operations per code
(mask, or-in the bf16 exponent bits, reinterpret), so that the attention dots run on
tensor cores over those values, and the bias and factor are removed once per tile:

    q . code        = (q / F_p) . (BIAS + F_p code) - BIAS * sum(q / F_p)
    sum_t w_t code  = (sum_t w_t (BIAS + F_p code) - BIAS * sum_t w_t) / F_p

where w_t are the same bf16 values fed to the dot (so the bias cancels exactly). F_p
is a power of two, so q / F_p is exact in bf16.

Modes (constexpr UNPACK):
  0  portable: ((byte >> 2p) & 3) | 0x4300 per code, as int16; F_p = 1. Runs under the
     Triton interpreter.
  1  PTX: per 4 bytes one and.b32 (plane 3: shr + and) and two prmt.b32 that insert the
     exponent byte 0x43 beside each masked byte: bf16 0x43XX = 128 + XX with the code left
     in place (F_p = 1, 4, 16, 16). CUDA only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: bf16 bit pattern 0x4300 = 128.0; 0x43XX = 128 + XX for XX < 128 (as a kernel constexpr).
BIAS: tl.constexpr = tl.constexpr(128.0)
#: Default tiles between folds of the BIAS part out of a decode split program's V accumulators (the kernels'
#: FOLD, AttentionConfig.fold_tiles): the tensor cores round their fp32 accumulation toward zero, so BIAS-sized
#: sums left to grow lose the small code part, about 1e-4 relative per tile (H200: 4.4e-2 for one split of 30000
#: positions, 0.18 for 120000; every 8 tiles 2.0e-3 / 1.6e-3; docs/decisions.md, F1).
FOLD_TILES: tl.constexpr = tl.constexpr(8)
#: Unpack modes (see module docstring).
UNPACK_PORTABLE: int = 0
UNPACK_PTX: int = 1

#: torch dtype -> Triton dtype, for the scale/offset planes and K/V rows.
TL_DTYPES: dict[torch.dtype, tl.dtype] = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
}


@triton.jit
def plane_factor(P: tl.constexpr, MODE: tl.constexpr):
    """F_p of plane P in unpack mode MODE (1 for portable; 1, 4, 16, 16 for PTX)."""
    if MODE == 1:
        if P == 0:
            return 1.0
        elif P == 1:
            return 4.0
        else:
            return 16.0
    else:
        return 1.0


@triton.jit
def _ptx_bias_bytes(b, ASM: tl.constexpr):
    """Run one masking PTX snippet (writes t from $2) and spread t's bytes into bf16 0x43XX."""
    return tl.inline_asm_elementwise(
        ASM,
        "=r,=r,r",
        [b],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def unpack_plane(b, P: tl.constexpr, MODE: tl.constexpr):
    """uint8 [T, C] packed bytes -> bf16 [T, C]: BIAS + F_P * (code of plane P)."""
    if MODE == 1:
        if P == 0:
            return _ptx_bias_bytes(b, "{ .reg .b32 t, e; mov.b32 e, 0x43434343; and.b32 t, $2, 0x03030303; "
                                      "prmt.b32 $0, t, e, 0x5140; prmt.b32 $1, t, e, 0x5342; }")
        elif P == 1:
            return _ptx_bias_bytes(b, "{ .reg .b32 t, e; mov.b32 e, 0x43434343; and.b32 t, $2, 0x0C0C0C0C; "
                                      "prmt.b32 $0, t, e, 0x5140; prmt.b32 $1, t, e, 0x5342; }")
        elif P == 2:
            return _ptx_bias_bytes(b, "{ .reg .b32 t, e; mov.b32 e, 0x43434343; and.b32 t, $2, 0x30303030; "
                                      "prmt.b32 $0, t, e, 0x5140; prmt.b32 $1, t, e, 0x5342; }")
        else:
            return _ptx_bias_bytes(b, "{ .reg .b32 t, e; mov.b32 e, 0x43434343; shr.b32 t, $2, 2; "
                                      "and.b32 t, t, 0x30303030; prmt.b32 $0, t, e, 0x5140; "
                                      "prmt.b32 $1, t, e, 0x5342; }")
    else:
        bits = ((b.to(tl.int16) >> (2 * P)) & 3) | 0x4300
        return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def scaled_codes(b, P: tl.constexpr, MODE: tl.constexpr):
    """uint8 [T, C] packed bytes -> bf16 [T, C]: F_P * (code of plane P), exact.

    unpack_plane minus BIAS, subtracted in fp32 (exact for these small integers; the
    Triton 3.9 interpreter does bf16 arithmetic on the raw bit patterns, so no bf16
    subtraction). Used where a tensor-core accumulation of many BIAS-sized terms would
    lose the small code part (wide MMAs of the general kernel, e.g. prefill tiles).
    """
    return (unpack_plane(b, P, MODE).to(tl.float32) - BIAS).to(tl.bfloat16)


@triton.jit
def mma(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b with fp32 accumulation (tensor cores for bf16/fp16 operands).

    EMULATE (set only under TRITON_INTERPRET=1): upcast the operands to fp32 and multiply
    in IEEE fp32. The Triton 3.9 interpreter returns garbage for bf16 tl.dot; the upcast
    computes the same function (bf16 x bf16 products are exact in fp32), so CPU tests still
    check the kernel's arithmetic. On the GPU EMULATE is False.
    """
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def round_to(x, T: tl.constexpr, EMULATE: tl.constexpr):
    """x converted to dtype T, rounding to nearest-even when T is narrower.

    On the GPU a plain ``.to`` rounds to nearest. The Triton 3.9 interpreter (EMULATE)
    truncates fp32 -> bf16 whatever rounding is asked for, which biases every product
    downwards; there the rounding is done on the bit pattern (finite values).
    """
    if EMULATE and x.dtype == tl.float32 and T == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(T)
    else:
        return x.to(T)


@triton.jit
def _ptx_pair_bytes(h, ASM: tl.constexpr):
    """Run one masking PTX snippet on int16 byte pairs (writes t from $2) and split t's even
    and odd bytes into two bf16 0x43XX tensors."""
    return tl.inline_asm_elementwise(
        ASM,
        "=r,=r,r",
        [h],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=2,
    )


@triton.jit
def unpack_pair_plane(h, P: tl.constexpr, MODE: tl.constexpr):
    """int16 [T, C] byte pairs -> two bf16 [T, C]: BIAS + F_P * (code of plane P) of the low
    (even channel) and the high (odd channel) byte of each pair.

    PTX: a 32-bit register holds two pairs; the even bytes (0 and 2) sit where a bf16x2's two low
    bytes are, so one lop3 (mask the plane, or in the exponent 0x43 of both halves) makes the even
    operand, and the odd bytes take the same after one shift by 8 (shared by the four planes).
    Plane 3 is shifted down by 2 first (its bit 7 would land in the exponent)."""
    if MODE == 1:  # lop3 0xEA: (a & b) | c
        if P == 0:
            return _ptx_pair_bytes(h, "{ .reg .b32 o, x; mov.b32 x, 0x43004300; shr.b32 o, $2, 8; "
                                      "lop3.b32 $0, $2, 0x00030003, x, 0xEA; lop3.b32 $1, o, 0x00030003, x, 0xEA; }")
        elif P == 1:
            return _ptx_pair_bytes(h, "{ .reg .b32 o, x; mov.b32 x, 0x43004300; shr.b32 o, $2, 8; "
                                      "lop3.b32 $0, $2, 0x000C000C, x, 0xEA; lop3.b32 $1, o, 0x000C000C, x, 0xEA; }")
        elif P == 2:
            return _ptx_pair_bytes(h, "{ .reg .b32 o, x; mov.b32 x, 0x43004300; shr.b32 o, $2, 8; "
                                      "lop3.b32 $0, $2, 0x00300030, x, 0xEA; lop3.b32 $1, o, 0x00300030, x, 0xEA; }")
        else:
            return _ptx_pair_bytes(h, "{ .reg .b32 e, o, x; mov.b32 x, 0x43004300; shr.b32 e, $2, 2; "
                                      "shr.b32 o, $2, 10; lop3.b32 $0, e, 0x00300030, x, 0xEA; "
                                      "lop3.b32 $1, o, 0x00300030, x, 0xEA; }")
    else:
        lo = ((h >> (2 * P)) & 3) | 0x4300
        hi = ((h >> (8 + 2 * P)) & 3) | 0x4300
        return lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)


@triton.jit
def _ptx_int8_codes(b, ASM: tl.constexpr):
    """Run one PTX snippet mapping four packed bytes ($1) to four int8 codes ($0)."""
    return tl.inline_asm_elementwise(ASM, "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def plane_codes_int8(b, P: tl.constexpr, MODE: tl.constexpr):
    """uint8 [T, C] packed bytes -> int8 [T, C]: the code (0..3) of plane P, exact.

    For the int8 MMA of the key path: no bias, one and.b32 (plus a shift for planes 1-3)
    per four codes in the PTX mode."""
    if MODE == 1:
        if P == 0:
            return _ptx_int8_codes(b, "and.b32 $0, $1, 0x03030303;")
        elif P == 1:
            return _ptx_int8_codes(b, "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }")
        elif P == 2:
            return _ptx_int8_codes(b, "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303; }")
        else:
            return _ptx_int8_codes(b, "{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303; }")
    else:
        return ((b >> (2 * P)) & 3).to(tl.int8)


@triton.jit
def int8_mma(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b for int8 operands with exact int32 accumulation.

    EMULATE: in fp32 (exact here: |products| <= 3 * 127, sums over <= 64 of them) and cast
    back, since the interpreter is only trusted for fp32 dots."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc.to(tl.float32), input_precision="ieee").to(tl.int32)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.int32)
