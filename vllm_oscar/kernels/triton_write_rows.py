"""Triton INT2 write by row programs: the quantizing part of a decode-sized write, one warp per row.

A captured decode step writes its few new tokens' INT2 codes on a side stream beside the attention
(attention/step.layer_step). oscar_write_kernel (triton_write) gives each program BLOCK_N = 16 rows, since its
rotation is a tl.dot (16 rows at least) over 4 warps: at 1-8 new tokens most of those rows are padding, and
every reduction of the clip search and of the refit rounds crosses the warps through shared memory, which makes
the write a ~11 us chain (docs/decisions.md, sessions 38-40). Here a program is ONE warp and ONE row
(token n, KV head h, side K or V), so every reduction stays inside the warp:

    y      = x[n, h] @ R[h]     one FMA chain per output over k in order (the bits of the full write's
                                ieee dot, which chains the same way), R's rows loaded ROTATION_AHEAD ahead;
                                or x itself when V comes pre-rotated; or (FROM_ROTATED) read from the rotated
                                rows that the step's first launch stored (the same bits: its window-copy
                                programs chain the same way), so that no program loads R's 64 KiB again
    then clip, quantize, refit, pack and store exactly as triton_write (its _clip and _quantize_store,
    on a [1, D] tile).

Grid (N, Hkv, 2); axis 2: 0 = K, 1 = V. The window copies are not written here (a captured step's first launch
writes them). INT2_MODE as oscar_write_kernel's (triton_write's module docstring), flag_ptr read first.
Measured (H200, Qwen3-8B geometry, 1-16 tokens, FROM_ROTATED): 5.1 us a launch against 11.2-11.3 for the 16-row
programs, the same bytes (docs/decisions.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_oscar.kernels.triton_write import INT2_IF_FLAG, INT2_NEVER, INT2_UNLESS_FLAG, _clip, _quantize_store


@triton.jit
def _rotated_row(x_row, r_head, stride_rr, cols, D: tl.constexpr, ROTATE: tl.constexpr, AHEAD: tl.constexpr):
    """[1, D] fp32: the row at x_row (D contiguous 16- or 32-bit values) times R (fp32 rows at r_head + k *
    stride_rr) as one FMA chain per output over k = 0 .. D - 1 in order (the bits of the full write's ieee dot,
    which chains the same way), R's row k + AHEAD loaded as row k enters the chain (a ring of AHEAD rows in
    registers: the compiler alone keeps only a few loads in flight); or the row itself when not ROTATE."""
    if ROTATE:
        ring = ()
        for k in tl.static_range(AHEAD):
            ring = ring + (tl.load(r_head + k * stride_rr + cols),)
        y = tl.zeros([1, D], dtype=tl.float32)
        for k in tl.static_range(D):
            r_k = ring[0]
            if k + AHEAD < D:
                ring = ring[1:] + (tl.load(r_head + (k + AHEAD) * stride_rr + cols),)
            else:
                ring = ring[1:]
            y = tl.fma(tl.load(x_row + k).to(tl.float32), r_k, y)
        return y
    return tl.load(x_row + cols).to(tl.float32)


@triton.jit
def _row_input(x_row, r_head, stride_rr, rot_ptr, stride_on, stride_oh, n, h, side, cols, D: tl.constexpr,
               ROTATE: tl.constexpr, AHEAD: tl.constexpr, FROM_ROTATED: tl.constexpr):
    """[1, D] fp32: row n's rotated values of KV head h and this side, read from the rotated rows (FROM_ROTATED) or
    computed (_rotated_row)."""
    if FROM_ROTATED:
        return tl.load(rot_ptr + n.to(tl.int64) * stride_on + h * stride_oh + side * D + cols)
    return _rotated_row(x_row, r_head, stride_rr, cols, D, ROTATE, AHEAD)


@triton.jit
def _quantize_row(x_row, r_head, stride_rr, rot_ptr, stride_on, stride_oh, n, h, side, slot, valid, cache_ptr,
                  stride_cb, stride_ch, D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr,
                  EPS: tl.constexpr, EMU: tl.constexpr, CODES_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
                  ZERO_OFF: tl.constexpr, DO_CLIP: tl.constexpr, CLIP_INDEX: tl.constexpr, CLIP_TOP: tl.constexpr,
                  REFIT: tl.constexpr, FLOOR: tl.constexpr, ROTATE: tl.constexpr, AHEAD: tl.constexpr,
                  FROM_ROTATED: tl.constexpr):
    """One side of row n, KV head h: its rotated values (_row_input), clipped, quantized and stored at its slot."""
    y = _row_input(x_row, r_head, stride_rr, rot_ptr, stride_on, stride_oh, n, h, side, tl.arange(0, D)[None, :], D,
                   ROTATE, AHEAD, FROM_ROTATED)
    clipped = y
    if DO_CLIP:
        clipped = _clip(y, CLIP_INDEX, D, CLIP_TOP)
    _quantize_store(clipped, y, slot, valid, cache_ptr, stride_cb, stride_ch, h, CODES_OFF, SCALE_OFF, ZERO_OFF, BS,
                    D, G, SCALE_T, EPS, EMU, REFIT, FLOOR, 1)


@triton.jit
def oscar_write_rows_kernel(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
    rk_ptr, rv_ptr, stride_rh, stride_rr,
    cache_ptr, stride_cb, stride_ch, slot_ptr, flag_ptr, rot_ptr, stride_on, stride_oh,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr, EPS: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, DO_CLIP_K: tl.constexpr, DO_CLIP_V: tl.constexpr,
    ROTATE_V: tl.constexpr, EMU: tl.constexpr, REFIT_K: tl.constexpr, REFIT_V: tl.constexpr,
    FLOOR_K: tl.constexpr, FLOOR_V: tl.constexpr, CLIP_TOP_K: tl.constexpr, CLIP_TOP_V: tl.constexpr,
    INT2_MODE: tl.constexpr, ROTATION_AHEAD: tl.constexpr, FROM_ROTATED: tl.constexpr,
):
    """The INT2 part of row n = program_id(0) (token), KV head h, side 0 = K / 1 = V (module docstring); the
    constexprs as oscar_write_kernel's, and ROTATION_AHEAD: rows of R in flight
    (triton_ops.rows_rotation_ahead); FROM_ROTATED: the rows arrive rotated, fp32 [N, Hkv, 2, D] at rot_ptr
    (strides stride_on, stride_oh; K at 0, V at D: what a flagged launch's window-copy programs stored), so no
    rotation here. A row whose slot is < 0 (padding) returns at once."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    side = tl.program_id(2)
    if INT2_MODE == INT2_NEVER:
        return
    if INT2_MODE == INT2_IF_FLAG:
        if tl.load(flag_ptr) == 0:
            return
    if INT2_MODE == INT2_UNLESS_FLAG:
        if tl.load(flag_ptr) != 0:
            return
    if tl.load(slot_ptr + n) < 0:  # padding: nothing to write
        return
    slot = tl.load(slot_ptr + n + tl.arange(0, 1))  # [1], as _quantize_store takes it
    valid = slot >= 0
    if side == 0:
        _quantize_row(k_ptr + n.to(tl.int64) * stride_kn + h * stride_kh, rk_ptr + h * stride_rh, stride_rr, rot_ptr,
                      stride_on, stride_oh, n, h, side, slot, valid, cache_ptr, stride_cb, stride_ch, D, G, BS,
                      SCALE_T, EPS, EMU, K_CODES, K_SCALE, K_ZERO, DO_CLIP_K, CLIP_K, CLIP_TOP_K, REFIT_K, FLOOR_K,
                      True, ROTATION_AHEAD, FROM_ROTATED)
    else:
        _quantize_row(v_ptr + n.to(tl.int64) * stride_vn + h * stride_vh, rv_ptr + h * stride_rh, stride_rr, rot_ptr,
                      stride_on, stride_oh, n, h, side, slot, valid, cache_ptr, stride_cb, stride_ch, D, G, BS,
                      SCALE_T, EPS, EMU, V_CODES, V_SCALE, V_ZERO, DO_CLIP_V, CLIP_V, CLIP_TOP_V, REFIT_V, FLOOR_V,
                      ROTATE_V, ROTATION_AHEAD, FROM_ROTATED)
