"""Triton write kernel: rotate, clip, quantize and pack new K/V rows; copy window rows.

One launch per layer step. Grid: (cdiv(N, BLOCK_N), Hkv); a program takes BLOCK_N tokens
of one KV head and does, for K and then V:

    y      = x @ R[h]                    tl.dot, fp32 operands, IEEE precision, K-tiled
    window store[wslot] = y              (rotated, unclipped; where wslot >= 0)
    tau    = |y|_(CLIP_INDEX)            exact order statistic ("higher" quantile), found by
                                         bisection on the float bit patterns (32 steps)
    y      = clamp(y, -tau, tau)
    scale  = max(max_g - min_g, eps) / 3 -> storage dtype; offset = min_g -> storage dtype
    code   = clamp(floor((y - offset) / scale + 0.5), 0, 3)      (rounded scale/offset)
    byte j = code[j] | code[j+D/4] << 2 | code[j+D/2] << 4 | code[j+3D/4] << 6

Rounding note: floor(x + 0.5) rounds exact halves up where torch.round rounds to even;
exact halves need (y - offset) / scale to land exactly on k + 0.5, which float data of
rotated rows essentially never does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_oscar.kernels.triton_common import round_to


@triton.jit
def _rotated_rows(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, rows, row_ok, h,
                  D: tl.constexpr, BLOCK_K: tl.constexpr, ROTATE: tl.constexpr):
    """[BLOCK_N, D] fp32 rows x[rows, h] @ R[h] (or x itself when not ROTATE)."""
    cols = tl.arange(0, D)
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xn + h * stride_xh
    if ROTATE:
        acc = tl.zeros([rows.shape[0], D], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_base + ks[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            r = tl.load(r_ptr + h * stride_rh + ks[:, None] * stride_rr + cols[None, :]).to(tl.float32)
            acc = tl.dot(x, r, acc, input_precision="ieee")
        return acc
    else:
        return tl.load(x_base + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _clip(y, CLIP_INDEX: tl.constexpr, D: tl.constexpr):
    """Clamp each row of y [BN, D] to +-(CLIP_INDEX-th smallest |y|), exactly."""
    bits = tl.abs(y).to(tl.int32, bitcast=True)  # non-negative floats order like their bits
    lo = tl.zeros([y.shape[0]], dtype=tl.int32)
    hi = tl.max(bits, axis=1)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        count = tl.sum((bits <= mid[:, None]).to(tl.int32), axis=1)
        enough = count >= CLIP_INDEX + 1
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    tau = hi.to(tl.float32, bitcast=True)[:, None]
    return tl.minimum(tl.maximum(y, -tau), tau)


@triton.jit
def _quantize_store(y, slot, valid, cache_ptr, stride_cb, stride_ch, h,
                    CODES_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                    BS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, SCALE_T: tl.constexpr,
                    EPS: tl.constexpr, EMU: tl.constexpr):
    """Quantize clipped rows y [BN, D] and store codes/scale/offset at their slots."""
    BN: tl.constexpr = y.shape[0]
    NG: tl.constexpr = D // G
    Q: tl.constexpr = D // 4
    grouped = tl.reshape(y, [BN, NG, G])
    low = tl.min(grouped, axis=2)
    high = tl.max(grouped, axis=2)
    scale_s = round_to(tl.maximum(high - low, EPS) / 3.0, SCALE_T, EMU)
    low_s = round_to(low, SCALE_T, EMU)
    scale = scale_s.to(tl.float32)
    zero = low_s.to(tl.float32)
    level = tl.floor((grouped - zero[:, :, None]) / scale[:, :, None] + 0.5)
    codes = tl.minimum(tl.maximum(level, 0.0), 3.0).to(tl.int32)
    planes = tl.reshape(codes, [BN, 4, Q])
    shifts = (2 * tl.arange(0, 4))[None, :, None]
    packed = tl.sum(planes << shifts, axis=1).to(tl.uint8)  # [BN, Q]

    block = (slot // BS).to(tl.int64)
    offset = slot % BS
    base = cache_ptr + block * stride_cb + h * stride_ch  # [BN] byte pointers
    q_cols = tl.arange(0, Q)
    tl.store(base[:, None] + CODES_OFF + offset[:, None] * Q + q_cols[None, :], packed, mask=valid[:, None])
    g_cols = tl.arange(0, NG)
    param = offset[:, None] * NG + g_cols[None, :]
    tl.store((base + SCALE_OFF).to(tl.pointer_type(SCALE_T))[:, None] + param, scale_s, mask=valid[:, None])
    tl.store((base + ZERO_OFF).to(tl.pointer_type(SCALE_T))[:, None] + param, low_s, mask=valid[:, None])


@triton.jit
def _store_window(y, wslot, row_ok, w_ptr, stride_w0, stride_w1, stride_w2, h, BS: tl.constexpr, D: tl.constexpr,
                  EMU: tl.constexpr):
    """Store rotated rows y [BN, D] into the window store where wslot >= 0."""
    keep = row_ok & (wslot >= 0)
    wslot = tl.where(keep, wslot, 0)
    base = w_ptr + (wslot // BS).to(tl.int64) * stride_w0 + (wslot % BS) * stride_w1 + h * stride_w2
    tl.store(base[:, None] + tl.arange(0, D)[None, :], round_to(y, w_ptr.dtype.element_ty, EMU), mask=keep[:, None])


@triton.jit
def oscar_write_kernel(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
    rk_ptr, rv_ptr, stride_rh, stride_rr,
    cache_ptr, stride_cb, stride_ch,
    slot_ptr, wslot_ptr,
    wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    N,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr, EPS: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, DO_CLIP_K: tl.constexpr, DO_CLIP_V: tl.constexpr,
    ROTATE_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMU: tl.constexpr,
):
    """See module docstring. CLIP_* are 0-based ranks of the clip threshold in |row|."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    wslot = tl.load(wslot_ptr + rows, mask=row_ok, other=-1)
    valid = row_ok & (slot >= 0)
    slot = tl.where(valid, slot, 0)

    yk = _rotated_rows(k_ptr, stride_kn, stride_kh, rk_ptr, stride_rh, stride_rr, rows, row_ok, h, D, BLOCK_K, True)
    _store_window(yk, wslot, row_ok, wk_ptr, stride_w0, stride_w1, stride_w2, h, BS, D, EMU)
    if DO_CLIP_K:
        yk = _clip(yk, CLIP_K, D)
    _quantize_store(yk, slot, valid, cache_ptr, stride_cb, stride_ch, h, K_CODES, K_SCALE, K_ZERO, BS, D, G, SCALE_T, EPS, EMU)

    yv = _rotated_rows(v_ptr, stride_vn, stride_vh, rv_ptr, stride_rh, stride_rr, rows, row_ok, h, D, BLOCK_K, ROTATE_V)
    _store_window(yv, wslot, row_ok, wv_ptr, stride_w0, stride_w1, stride_w2, h, BS, D, EMU)
    if DO_CLIP_V:
        yv = _clip(yv, CLIP_V, D)
    _quantize_store(yv, slot, valid, cache_ptr, stride_cb, stride_ch, h, V_CODES, V_SCALE, V_ZERO, BS, D, G, SCALE_T, EPS, EMU)
