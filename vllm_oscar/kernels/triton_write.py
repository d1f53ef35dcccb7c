"""Triton write kernel: rotate, clip, quantize and pack new K/V rows; copy window rows.

One launch per layer step (the refit adds REFIT passes over the rows held in registers,
no memory traffic). Grid: (cdiv(N, BLOCK_N), Hkv, 2) (more below: Parts, the query); a program takes BLOCK_N tokens
of one KV head and one side (axis 2: 0 = K, 1 = V, so the two sides' refit rounds run in
parallel programs) and does:

    y      = x @ R[h]                    tl.dot, fp32 operands, IEEE precision, K-tiled
    window store[wslot] = y              (rotated, unclipped; where wslot >= 0)
    tau    = |y|_(CLIP_INDEX)            exact order statistic ("higher" quantile), found by
                                         bisection on the float bit patterns (32 steps) or by
                                         removing the row maximum (CLIP_TOP, _clip)
    y      = clamp(y, -tau, tau)
    scale  = max(max_g - min_g, eps) / 3 -> storage dtype; offset = min_g -> storage dtype
    code   = clamp(round((y - offset) / scale), 0, 3)            (rounded scale/offset)
    REFIT_K / REFIT_V rounds (least-squares grid refit, quant.quantizer.refit_grid), against the
    UNCLIPPED rotated rows x, per group of G:
        s = cov(code, x) / var(code) (unchanged if var = 0), max(s, eps) -> storage dtype
            (FLOOR_K / FLOOR_V: s = max(s, s_0) first, s_0 the clipped min/max scale: the
            grid never narrows, quant.refit_grid scale_floor)
        o = mean(x) - s mean(code) -> storage dtype
        code = clamp(round((x - o) / s), 0, 3)
      keeping per group the (code, s, o) with the smallest sum (x - code s - o)^2
      (strictly smaller replaces; the clipped min/max grid is the first candidate)
    byte j = code[j] | code[j+D/4] << 2 | code[j+D/2] << 4 | code[j+3D/4] << 6

Parts (one launch may write both, or one of them, so that the INT2 part can run on a side stream
beside the attention, which reads the step's new tokens from their BF16 copies): STORE_WINDOW
writes the window copies; INT2_MODE says whether the clip / quantize / store above runs:
INT2_ALWAYS, INT2_NEVER, INT2_IF_FLAG (only where the int32 at flag_ptr is non-zero) or
INT2_UNLESS_FLAG (only where it is 0). A captured decode graph holds both flag modes, one on each
stream, and the metadata builder sets the flag per step (attention/step.py). A flagged program reads
the flag first and returns at once where its part does not run (a branch around the INT2 part made
the compiler spill: W7); a flagged launch that also stores windows gives the copies programs of their
own, each of WINDOW_BLOCK_C output columns (R stepped by WINDOW_BLOCK_K rows): axis 2 is then 0 .. C - 1
= K's column blocks, C .. 2 C - 1 = V's (C = D / WINDOW_BLOCK_C), 2 C, 2 C + 1 = K, V INT2 part
(WRITE_SIDES = 2 C + 2). A copy's column costs one chain of D FMAs per row whichever program computes it,
so that splitting the columns shortens each program's chain on a decode step's critical path.

The query in the same launch (QUERY_GROUP > 0, triton_ops.oscar_write with a query): a layer step's
first launch also rotates the step's queries, q_rot = q @ R_K (triton_rotate.rotate_rows_block,
its grid's program (pid_m, h, c) as program (pid_m, h, WRITE_SIDES + c) here; axis 0 then spans the
larger of the write tiles and the query row blocks, and programs past either return at once). The
window copies then cost no launch of their own on a captured decode step's critical path, and an eager
step one launch fewer (docs/decisions.md W7).

Rounding note: codes round half to even (floor(p + 0.5), minus 1 at an exact half with an
odd result), as torch.round does on the CPU path.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from vllm_oscar.kernels.triton_common import round_to
from vllm_oscar.kernels.triton_rotate import rotate_rows_block

#: INT2_MODE of oscar_write_kernel: whether a launch writes the INT2 part (module docstring).
INT2_ALWAYS = tl.constexpr(0)
INT2_NEVER = tl.constexpr(1)
INT2_IF_FLAG = tl.constexpr(2)
INT2_UNLESS_FLAG = tl.constexpr(3)


@triton.jit
def _rotated_rows(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, rows, row_ok, h, cols,
                  D: tl.constexpr, BLOCK_K: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr):
    """[BLOCK_N, C] fp32 columns cols [C] of the rows x[rows, h] @ R[h] (or of x itself when not ROTATE); PRECISION:
    the dot's input_precision ("ieee": fp32 FMAs, each output a chain over k in order, so that a column's bits do
    not depend on C or BLOCK_K; "tf32x3": three TF32 tensor-core MMAs, about fp32 accuracy)."""
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xn + h * stride_xh
    if ROTATE or x_ptr.dtype.element_ty.primitive_bitwidth == 16:
        # Pre-rotated 16-bit rows go through an identity MMA, BLOCK_K input channels at a time like the rotation:
        # the rows leave it in an MMA layout, in which the clip / refit / pack code after it fits the registers (the
        # plain load's layout took 255 and spilled: docs/decisions.md), and each step's identity
        # slice holds no more shared memory than a rotation step's (one [D, D] identity took 64 KiB: session 39).
        # Exact: 16-bit values are TF32 values, and the other slices add zeros.
        acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
        for k0 in tl.static_range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_base + ks[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            if ROTATE:
                r = tl.load(r_ptr + h * stride_rh + ks[:, None] * stride_rr + cols[None, :]).to(tl.float32)
                acc = tl.dot(x, r, acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, tl.where(ks[:, None] == cols[None, :], 1.0, 0.0), acc, input_precision="tf32")
        return acc
    else:
        return tl.load(x_base + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _clip(y, CLIP_INDEX: tl.constexpr, D: tl.constexpr, TOP: tl.constexpr):
    """Clamp each row of y [BN, D] to +-(CLIP_INDEX-th smallest |y|), exactly.

    TOP False: bisection on the float bit patterns, 32 steps of one count reduction. TOP True: the
    same order statistic as the (D - CLIP_INDEX)-th largest, by removing the row maximum (with all
    its ties, counted) D - CLIP_INDEX times: two reductions per round, fewer rounds when the clip
    keeps most of the row (6 for D = 128 at 0.96)."""
    bits = tl.abs(y).to(tl.int32, bitcast=True)  # non-negative floats order like their bits
    if TOP:
        need = tl.full([y.shape[0]], D - CLIP_INDEX, tl.int32)  # rank from the top, 1-based
        tau_bits = tl.zeros([y.shape[0]], dtype=tl.int32)
        found = tl.zeros([y.shape[0]], dtype=tl.int32)
        rest = bits
        for _ in range(D - CLIP_INDEX):
            top = tl.max(rest, axis=1)
            at_top = rest == top[:, None]
            count = tl.sum(at_top.to(tl.int32), axis=1)
            now = (found == 0) & (count >= need)
            tau_bits = tl.where(now, top, tau_bits)
            found = tl.where(now, 1, found)
            need -= count
            rest = tl.where(at_top, -1, rest)
    else:
        lo = tl.zeros([y.shape[0]], dtype=tl.int32)
        tau_bits = tl.max(bits, axis=1)
        for _ in range(32):
            mid = lo + (tau_bits - lo) // 2
            count = tl.sum((bits <= mid[:, None]).to(tl.int32), axis=1)
            enough = count >= CLIP_INDEX + 1
            tau_bits = tl.where(enough, mid, tau_bits)
            lo = tl.where(enough, lo, mid + 1)
    tau = tau_bits.to(tl.float32, bitcast=True)[:, None]
    return tl.minimum(tl.maximum(y, -tau), tau)


@triton.jit
def _assign(x, scale, zero, EMU: tl.constexpr):
    """Codes (as fp32) of grouped rows x [BN, NG, G] on the grids (scale, zero) [BN, NG].

    Rounds half to even, as torch.round: an exact half (frequent only when the inputs and
    the grid are exactly representable, e.g. prerotated bf16 values with bf16 scales)
    gives the code the CPU path gives. On the GPU one cvt.rni (libdevice.rint); the
    interpreter, which has no rint, takes floor(p + 0.5) corrected at odd halves (the same
    except just below 0.5, where p + 0.5 rounds up to 1 in fp32)."""
    position = (x - zero[:, :, None]) / scale[:, :, None]
    if EMU:
        level = tl.floor(position + 0.5)
        odd_half = ((level - position) == 0.5) & ((level - 2.0 * tl.floor(level * 0.5)) == 1.0)
        level = tl.where(odd_half, level - 1.0, level)
    else:
        level = libdevice.rint(position)
    return tl.minimum(tl.maximum(level, 0.0), 3.0)


@triton.jit
def _grid_error(x, codes, scale, zero):
    """[BN, NG] sum over the group of (x - codes * scale - zero)^2."""
    diff = x - (codes * scale[:, :, None] + zero[:, :, None])
    return tl.sum(diff * diff, axis=2)


@triton.jit
def _quantize_store(y, x, slot, valid, cache_ptr, stride_cb, stride_ch, h,
                    CODES_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr,
                    BS: tl.constexpr, D: tl.constexpr, G: tl.constexpr, SCALE_T: tl.constexpr,
                    EPS: tl.constexpr, EMU: tl.constexpr, REFIT: tl.constexpr, FLOOR: tl.constexpr = False,
                    REFIT_UNROLL: tl.constexpr = 1):
    """Quantize clipped rows y [BN, D] (refit against the unclipped rows x when REFIT > 0)
    and store codes/scale/offset at their slots."""
    BN: tl.constexpr = y.shape[0]
    NG: tl.constexpr = D // G
    Q: tl.constexpr = D // 4
    grouped = tl.reshape(y, [BN, NG, G])
    low = tl.min(grouped, axis=2)
    high = tl.max(grouped, axis=2)
    scale = round_to(tl.maximum(high - low, EPS) / 3.0, SCALE_T, EMU).to(tl.float32)
    zero = round_to(low, SCALE_T, EMU).to(tl.float32)
    codes_f = _assign(grouped, scale, zero, EMU)
    if REFIT > 0:
        xg = tl.reshape(x, [BN, NG, G])
        best_codes = codes_f
        best_scale = scale
        best_zero = zero
        best_error = _grid_error(xg, codes_f, scale, zero)
        x_mean = tl.sum(xg, axis=2) / G
        x_centered = xg - x_mean[:, :, None]
        floor = scale
        for _ in tl.range(REFIT, loop_unroll_factor=REFIT_UNROLL):
            code_mean = tl.sum(codes_f, axis=2) / G
            code_centered = codes_f - code_mean[:, :, None]
            variance = tl.sum(code_centered * code_centered, axis=2) / G
            covariance = tl.sum(code_centered * x_centered, axis=2) / G
            spread = variance > 0.0
            fitted = tl.where(spread, covariance / tl.where(spread, variance, 1.0), scale)
            if FLOOR:
                fitted = tl.maximum(fitted, floor)
            scale = round_to(tl.maximum(fitted, EPS), SCALE_T, EMU).to(tl.float32)
            zero = round_to(x_mean - scale * code_mean, SCALE_T, EMU).to(tl.float32)
            codes_f = _assign(xg, scale, zero, EMU)
            error = _grid_error(xg, codes_f, scale, zero)
            better = error < best_error
            best_codes = tl.where(better[:, :, None], codes_f, best_codes)
            best_scale = tl.where(better, scale, best_scale)
            best_zero = tl.where(better, zero, best_zero)
            best_error = tl.where(better, error, best_error)
        codes_f = best_codes
        scale = best_scale
        zero = best_zero
    codes = codes_f.to(tl.int32)
    scale_s = scale.to(SCALE_T)  # exact: already rounded to SCALE_T
    low_s = zero.to(SCALE_T)
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
def _store_window(y, wslot, row_ok, w_ptr, stride_w0, stride_w1, stride_w2, h, cols, BS: tl.constexpr,
                  EMU: tl.constexpr):
    """Store the columns cols [C] of rotated rows, y [BN, C], into the window store where wslot >= 0."""
    keep = row_ok & (wslot >= 0)
    wslot = tl.where(keep, wslot, 0)
    base = w_ptr + (wslot // BS).to(tl.int64) * stride_w0 + (wslot % BS) * stride_w1 + h * stride_w2
    tl.store(base[:, None] + cols[None, :], round_to(y, w_ptr.dtype.element_ty, EMU), mask=keep[:, None])


@triton.jit
def _copy_window_columns(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, rk_ptr, rv_ptr, stride_rh,
                         stride_rr, wslot_ptr, wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2, N, tile, h, side,
                         rot_ptr, stride_on, stride_oh,
                         D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_C: tl.constexpr, ROTATE_V: tl.constexpr, PRECISION: tl.constexpr, EMU: tl.constexpr,
                         STORE_ROTATED: tl.constexpr):
    """A window-copy program of a flagged launch: BLOCK_N rows (tile) of KV head h, side < D / BLOCK_C: K's output
    columns [BLOCK_C c, BLOCK_C (c + 1)) with c = side, else V's with c = side - D / BLOCK_C; rotated (V unless
    pre-rotated), stored into the window store where the row's window slot is >= 0. The same bits as the full
    write's copy (ieee: FMA chains over k in order). STORE_ROTATED: every row's fp32 columns also go to the rotated
    rows [N, Hkv, 2, D] at rot_ptr (strides stride_on, stride_oh; K at 0, V at D), which the side-stream INT2 write
    then reads instead of rotating again (triton_write_rows)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    wslot = tl.load(wslot_ptr + rows, mask=row_ok, other=-1)
    BLOCKS: tl.constexpr = D // BLOCK_C
    if side < BLOCKS:
        cols = side * BLOCK_C + tl.arange(0, BLOCK_C)
        y = _rotated_rows(k_ptr, stride_kn, stride_kh, rk_ptr, stride_rh, stride_rr, rows, row_ok, h, cols, D, BLOCK_K,
                          True, PRECISION)
        _store_window(y, wslot, row_ok, wk_ptr, stride_w0, stride_w1, stride_w2, h, cols, BS, EMU)
        if STORE_ROTATED:
            _store_rotated(y, rot_ptr, stride_on, stride_oh, rows, row_ok, h, cols)
    else:
        cols = (side - BLOCKS) * BLOCK_C + tl.arange(0, BLOCK_C)
        if ROTATE_V:
            y = _rotated_rows(v_ptr, stride_vn, stride_vh, rv_ptr, stride_rh, stride_rr, rows, row_ok, h, cols, D,
                              BLOCK_K, True, PRECISION)
        else:  # pre-rotated: a plain copy
            v_rows = v_ptr + rows.to(tl.int64)[:, None] * stride_vn + h * stride_vh
            y = tl.load(v_rows + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        _store_window(y, wslot, row_ok, wv_ptr, stride_w0, stride_w1, stride_w2, h, cols, BS, EMU)
        if STORE_ROTATED:
            _store_rotated(y, rot_ptr, stride_on, stride_oh, rows, row_ok, h, D + cols)


@triton.jit
def _store_rotated(y, rot_ptr, stride_on, stride_oh, rows, row_ok, h, cols):
    """Store y [BLOCK_N, C] fp32 at the rotated rows' columns cols of (row, KV head h) for the rows < N."""
    base = rot_ptr + rows.to(tl.int64) * stride_on + h * stride_oh
    tl.store(base[:, None] + cols[None, :], y, mask=row_ok[:, None])


@triton.jit
def _write_side(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, w_ptr, stride_w0, stride_w1, stride_w2,
                cache_ptr, stride_cb, stride_ch, rows, row_ok, slot, wslot, valid, h,
                D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr, EPS: tl.constexpr,
                EMU: tl.constexpr, BLOCK_K: tl.constexpr, ROTATE: tl.constexpr, PRECISION: tl.constexpr,
                CODES_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ZERO_OFF: tl.constexpr, DO_CLIP: tl.constexpr,
                CLIP_INDEX: tl.constexpr, CLIP_TOP: tl.constexpr, REFIT: tl.constexpr, FLOOR: tl.constexpr,
                REFIT_UNROLL: tl.constexpr, STORE_WINDOW: tl.constexpr, STORE_INT2: tl.constexpr):
    """One side (K or V) of BLOCK_N rows: rotate, copy into the window store (STORE_WINDOW), then clip,
    quantize and store the INT2 part (STORE_INT2)."""
    cols = tl.arange(0, D)
    y = _rotated_rows(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, rows, row_ok, h, cols, D, BLOCK_K,
                      ROTATE, PRECISION)
    if STORE_WINDOW:
        _store_window(y, wslot, row_ok, w_ptr, stride_w0, stride_w1, stride_w2, h, cols, BS, EMU)
    if STORE_INT2:
        clipped = y
        if DO_CLIP:
            clipped = _clip(y, CLIP_INDEX, D, CLIP_TOP)
        _quantize_store(clipped, y, slot, valid, cache_ptr, stride_cb, stride_ch, h, CODES_OFF, SCALE_OFF, ZERO_OFF,
                        BS, D, G, SCALE_T, EPS, EMU, REFIT, FLOOR, REFIT_UNROLL)


@triton.jit
def oscar_write_kernel(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh,
    rk_ptr, rv_ptr, stride_rh, stride_rr,
    cache_ptr, stride_cb, stride_ch,
    slot_ptr, wslot_ptr,
    wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    N, flag_ptr,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr, EPS: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, DO_CLIP_K: tl.constexpr, DO_CLIP_V: tl.constexpr,
    ROTATE_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMU: tl.constexpr,
    REFIT_K: tl.constexpr = 0, REFIT_V: tl.constexpr = 0, FLOOR_K: tl.constexpr = False, FLOOR_V: tl.constexpr = False,
    CLIP_TOP_K: tl.constexpr = False, CLIP_TOP_V: tl.constexpr = False, ROT_PRECISION: tl.constexpr = "ieee",
    UNROLL_REFIT: tl.constexpr = True, STORE_WINDOW: tl.constexpr = True, INT2_MODE: tl.constexpr = INT2_ALWAYS,
    q_ptr=None, stride_qn=0, stride_qh=0, q_out_ptr=None, stride_qon=0, stride_qoh=0,
    QUERY_GROUP: tl.constexpr = 0, Q_BLOCK_M: tl.constexpr = 16, Q_BLOCK_C: tl.constexpr = 32,
    Q_BLOCK_K: tl.constexpr = 64, Q_PRECISION: tl.constexpr = "tf32x3", WRITE_SIDES: tl.constexpr = 2,
    WINDOW_BLOCK_K: tl.constexpr = 32, WINDOW_BLOCK_C: tl.constexpr = 32,
    rot_ptr=None, stride_on=0, stride_oh=0, STORE_ROTATED: tl.constexpr = False,
):
    """See module docstring. CLIP_* are 0-based ranks of the clip threshold in |row|;
    REFIT_K / REFIT_V: least-squares grid refit rounds of K / V (0 = the clipped min/max grid);
    FLOOR_K / FLOOR_V: that side's refit scale never below the clipped min/max scale; CLIP_TOP_K / CLIP_TOP_V:
    that side's clip threshold by maximum removal instead of bisection (_clip); ROT_PRECISION: the rotation dot's
    input precision (_rotated_rows); UNROLL_REFIT: the refit rounds unrolled (True) or a loop; STORE_WINDOW,
    INT2_MODE, flag_ptr: which parts this launch writes (module docstring); QUERY_GROUP > 0: programs of
    axis 2 >= WRITE_SIDES rotate the step's queries too (module docstring, "The query in the same launch");
    WINDOW_BLOCK_K, WINDOW_BLOCK_C: BLOCK_K and output columns of the window-copy programs of a flagged launch
    (module docstring); STORE_ROTATED: those programs also store the fp32 rotated rows at rot_ptr
    (_copy_window_columns)."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    side = tl.program_id(2)
    if QUERY_GROUP > 0:
        if side >= WRITE_SIDES:
            if tile * Q_BLOCK_M < N * QUERY_GROUP:
                rotate_rows_block(q_ptr, stride_qn, stride_qh, rk_ptr, stride_rh, stride_rr, q_out_ptr, stride_qon,
                                  stride_qoh, N, tile, h, side - WRITE_SIDES, QUERY_GROUP, D, Q_BLOCK_M, Q_BLOCK_K,
                                  Q_BLOCK_C, False, Q_PRECISION)
            return
    if tile * BLOCK_N >= N:  # axis 0 sized for the query rows
        return
    if INT2_MODE == INT2_IF_FLAG or INT2_MODE == INT2_UNLESS_FLAG:
        if STORE_WINDOW:  # sides 0 .. 2 D / WINDOW_BLOCK_C - 1: the window copies; then K, V of the flagged INT2 part
            WINDOW_SIDES: tl.constexpr = 2 * (D // WINDOW_BLOCK_C)
            if side < WINDOW_SIDES:
                _copy_window_columns(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, rk_ptr, rv_ptr,
                                     stride_rh, stride_rr, wslot_ptr, wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
                                     N, tile, h, side, rot_ptr, stride_on, stride_oh, D, BS, BLOCK_N,
                                     WINDOW_BLOCK_K, WINDOW_BLOCK_C, ROTATE_V, ROT_PRECISION, EMU, STORE_ROTATED)
                return
            side -= WINDOW_SIDES
        flag = tl.load(flag_ptr)
        if INT2_MODE == INT2_IF_FLAG:
            if flag == 0:
                return
        else:
            if flag != 0:
                return
        _write_tile(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, rk_ptr, rv_ptr, stride_rh, stride_rr,
                    cache_ptr, stride_cb, stride_ch, slot_ptr, wslot_ptr, wk_ptr, wv_ptr, stride_w0, stride_w1,
                    stride_w2, N, tile, h, side, D, G, BS, SCALE_T, EPS, K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE,
                    V_ZERO, CLIP_K, CLIP_V, DO_CLIP_K, DO_CLIP_V, ROTATE_V, BLOCK_N, BLOCK_K, EMU, REFIT_K, REFIT_V,
                    FLOOR_K, FLOOR_V, CLIP_TOP_K, CLIP_TOP_V, ROT_PRECISION, UNROLL_REFIT, False, True)
    else:
        _write_tile(k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, rk_ptr, rv_ptr, stride_rh, stride_rr,
                    cache_ptr, stride_cb, stride_ch, slot_ptr, wslot_ptr, wk_ptr, wv_ptr, stride_w0, stride_w1,
                    stride_w2, N, tile, h, side, D, G, BS, SCALE_T, EPS, K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE,
                    V_ZERO, CLIP_K, CLIP_V, DO_CLIP_K, DO_CLIP_V, ROTATE_V, BLOCK_N, BLOCK_K, EMU, REFIT_K, REFIT_V,
                    FLOOR_K, FLOOR_V, CLIP_TOP_K, CLIP_TOP_V, ROT_PRECISION, UNROLL_REFIT, STORE_WINDOW,
                    INT2_MODE == INT2_ALWAYS)


@triton.jit
def _write_tile(
    k_ptr, v_ptr, stride_kn, stride_kh, stride_vn, stride_vh, rk_ptr, rv_ptr, stride_rh, stride_rr,
    cache_ptr, stride_cb, stride_ch, slot_ptr, wslot_ptr, wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    N, tile, h, side,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr, EPS: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, DO_CLIP_K: tl.constexpr, DO_CLIP_V: tl.constexpr,
    ROTATE_V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMU: tl.constexpr,
    REFIT_K: tl.constexpr, REFIT_V: tl.constexpr, FLOOR_K: tl.constexpr, FLOOR_V: tl.constexpr,
    CLIP_TOP_K: tl.constexpr, CLIP_TOP_V: tl.constexpr, ROT_PRECISION: tl.constexpr, UNROLL_REFIT: tl.constexpr,
    STORE_WINDOW: tl.constexpr, STORE_INT2: tl.constexpr,
):
    """BLOCK_N rows (tile) of KV head h, side 0 = K, 1 = V: the parts STORE_WINDOW / STORE_INT2 (module docstring)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    wslot = tl.load(wslot_ptr + rows, mask=row_ok, other=-1)
    valid = row_ok & (slot >= 0)
    slot = tl.where(valid, slot, 0)

    if side == 0:  # K and V in separate programs: the refit rounds of the two sides run in parallel
        _write_side(k_ptr, stride_kn, stride_kh, rk_ptr, stride_rh, stride_rr, wk_ptr, stride_w0, stride_w1, stride_w2,
                    cache_ptr, stride_cb, stride_ch, rows, row_ok, slot, wslot, valid, h, D, G, BS, SCALE_T, EPS, EMU,
                    BLOCK_K, True, ROT_PRECISION, K_CODES, K_SCALE, K_ZERO, DO_CLIP_K, CLIP_K, CLIP_TOP_K, REFIT_K,
                    FLOOR_K, REFIT_K if UNROLL_REFIT else 1, STORE_WINDOW, STORE_INT2)
    else:
        _write_side(v_ptr, stride_vn, stride_vh, rv_ptr, stride_rh, stride_rr, wv_ptr, stride_w0, stride_w1, stride_w2,
                    cache_ptr, stride_cb, stride_ch, rows, row_ok, slot, wslot, valid, h, D, G, BS, SCALE_T, EPS, EMU,
                    BLOCK_K, ROTATE_V, ROT_PRECISION, V_CODES, V_SCALE, V_ZERO, DO_CLIP_V, CLIP_V, CLIP_TOP_V, REFIT_V,
                    FLOOR_V, REFIT_V if UNROLL_REFIT else 1, STORE_WINDOW, STORE_INT2)
