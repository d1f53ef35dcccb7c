"""Decode in one launch: the pure-INT2 split-K programs and the BF16 window tiles, tokens on the MMA's M side.

Grid (B, Hkv, NSPLIT + NSINK + NREC). Program (b, h, k < NSPLIT) takes split k of the tiles of
request b's pure INT2 range [min(sink, L), max(min(sink, L), L - recent)) (positions every
query of a decode reads from INT2); program (b, h, NSPLIT + w) takes window tile w (WIN_BT
positions of the sink, then of the recent window). The split index is the slowest grid axis, so
every split program is dispatched before any window program (the splits are sized to fill whole
waves, the short window programs fill in behind them); WINDOWS_FIRST dispatches the window programs
first instead (the partial index pid stays split k / NSPLIT + w either way). NSPLIT_SHORT < NSPLIT
(AttentionConfig.long_splits): splits NSPLIT_SHORT.. serve only pairs whose splits would be long
(LONG_TILES) and are dispatched after the window programs. FULL_TILES: the splits walk
only the whole BLOCK_T tiles inside the INT2 range, with no masks (fewer registers and instructions);
the sink programs then cover [0, head_end) and the recent programs [tail_start, L), which add the
partial INT2 tiles at the two edges, read as INT2 by position (never from a BF16 copy of their block).
Each program writes a partial (normalised output + log2-sum-exp); triton_attention.merge_kernel
combines them. NSPLIT is a runtime argument: one compiled kernel serves every split count.

Orientation (why this kernel exists): the general kernel computes logits as
[query rows, tokens] with the GQA group padded to 16 rows, so every element-wise step of
the online softmax runs on 16 rows while only g (3 or 4 in common models) are real. Here
the tile is [tokens, GP] (GP = next power of two >= g), and V is accumulated transposed:

    logits^T [BT, GP] = sum_p  X_p [BT, D/4] @ (q_p / F_p)^T [D/4, GP]   (X_p = BIAS + F_p code)
    acc_pe^T [D/8, GP] += Xe_p^T [D/8, BT] @ w [BT, GP],   w = bf16(p * scale_v)   (same for odd)

so the softmax works on BT * GP elements and the V MMAs have the channels on their M side.
V codes are read as int16 byte pairs and unpacked into even- and odd-channel planes
(Xe_p, Xo_p; triton_common.unpack_pair_plane) so that their MMA operand comes by a
transposed ldmatrix; the output store interleaves the two. Bias/factor removal as in
triton_common. softmax_scale * log2(e) (and s_q) multiply the logits once, in the softmax's FFMA. The
online softmax rescales lazily (RESCALE_SLACK). One warp per program (no cross-warp
reductions); docs/decisions.md V5-V6 has the SASS counts behind each choice.

Column sums by the tensor cores (V29, SUMS_MMA: the bf16-key path): the V weights' sums over positions,
sw = sum_t w_t (to remove BIAS) and zw = sum_t p_t z_v,t (the offset term), come from one more MMA per tile,
ones [16, BT] @ w' [BT, NC], whose every row is the column sums of w', instead of in-lane trees plus shuffles. ZW_COLS
(GP <= 4, where a [BT, GP] tile leaves half of the MMA's N = 8 unused): the tile has NC = 2 GP
columns, column GP + j a copy of head j (same query, so the same logits and p), and w' carries
bf16(p z_v) there, so that the same MMA sums the offset term too; the extra columns' V accumulators
are never stored. Otherwise (NC = GP) zw is summed per tile as before. Every FOLD tiles (and at the end)
BIAS sw leaves the V accumulators (_fold_bias), so that the tensor cores' accumulation, which rounds toward zero,
never sums BIAS-sized terms over a long split.

INT8_K (D >= 64; the default on CUDA): the key path as an int8 MMA with int32 accumulation: codes are
exact int8 (one and.b32 per four), the query is rounded per head row to int8 with the
absmax scale s_q (q ~= s_q * q8, also in the offset term), logits = s_q (s_k (code . q8) +
z_k sum(q8)). scripts/int8_query_error.py measures what the query rounding costs. At D = 64 a plane
has 16 channels, fewer than the MMA's K = 32: planes (0, 1) and (2, 3) go in pairs (_paired_codes).
Logits columns in parts (KPARTS, GP < 8): a [BT, GP] logits tile leaves half of the MMA's N = 8 unused and
Triton replicates it across the lanes, so every softmax step would run twice per value. Instead the int8 MMA
writes [BT, GP * KPARTS] columns (head, part), part k's query operand holding only the planes of part k, and
the parts are added in-lane (_int2_tile_logits): the softmax then runs once per value (docs/decisions.md
V38: the loop 840 -> 708 instructions at D = 128). Only programs that read INT2 tiles compute the query
operands (_int2_query): window programs without INT2 positions skip them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from vllm_oscar.kernels.triton_common import (
    BIAS,
    FOLD_TILES,
    int8_mma,
    mma,
    plane_codes_int8,
    plane_factor,
    round_to,
    unpack_pair_plane,
    unpack_plane,
)

#: Lazy online softmax: the running max (log2 units) moves only when a tile's max exceeds it
#: by more than this, so most tiles skip the accumulator rescale; p stays <= 2^8, exact in
#: fp32 and bf16-relative as before, and the normalisation uses the same stale max.
RESCALE_SLACK: tl.constexpr = tl.constexpr(8.0)
#: Largest |int8| a query element is rounded to (symmetric absmax scaling per head row).
INT8_QUERY_MAX: tl.constexpr = tl.constexpr(127.0)
#: Bytes per L2 prefetch request (one cache line).
PREFETCH_LINE: tl.constexpr = tl.constexpr(128)
#: Narrowest N of the MMA instruction (m16n8k16 / m16n8k32): a [BT, GP] tile with GP < 8 fills an N = 8
#: accumulator anyway, so the columns GP..2 GP - 1 cost nothing (ZW_COLS, module docstring).
MMA_MIN_N: tl.constexpr = tl.constexpr(8)
#: Smallest M of the MMA instruction (m16n8k16): at head_dim 64 a plane's even (or odd) channels are 8 rows, so the
#: V MMAs take both stacked (STACK, _stacked) instead of half-empty operands that Triton would fill with copies.
MMA_MIN_M: tl.constexpr = tl.constexpr(16)
#: Smallest K of the int8 MMA instruction (m16n8k32): code planes of fewer channels (head_dim 64) go in pairs.
INT8_MMA_MIN_K: tl.constexpr = tl.constexpr(32)
#: Rows of the all-ones operand whose MMA with the V weights sums them over the tile's positions.
SUM_ROWS: tl.constexpr = tl.constexpr(16)


@triton.jit
def _query_plane(q_row, cols, jok, P: tl.constexpr, Q: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr):
    """Plane P of the query, transposed: ([Q, GP] bf16 / F_P, BIAS * sum, plain sum [GP])."""
    qf = tl.load(q_row[None, :] + P * Q + cols[:, None], mask=jok[None, :], other=0.0).to(tl.float32)
    q_bf = round_to(qf, tl.bfloat16, EMU).to(tl.float32)
    q_div = round_to(q_bf / plane_factor(P, MODE), tl.bfloat16, EMU)
    return q_div, BIAS * tl.sum(q_div.to(tl.float32), axis=0), tl.sum(q_bf, axis=0)


@triton.jit
def _query_plane_f32(q_row, cols, jok, P: tl.constexpr, Q: tl.constexpr):
    """Plane P of the query, transposed, as loaded: [Q, GP] float32."""
    return tl.load(q_row[None, :] + P * Q + cols[:, None], mask=jok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _to_int8(x, inv_scale):
    """round(x * inv_scale) (half up) as int8; |x * inv_scale| <= INT8_QUERY_MAX by construction."""
    return tl.floor(x * inv_scale[None, :] + 0.5).to(tl.int8)


@triton.jit
def _paired_codes(x, y):
    """Two int8 code planes [BT, Q] as one int8 MMA operand [BT, 2 Q] (for Q < INT8_MMA_MIN_K): groups of four
    channels alternate, x's then y's (column 8 (c // 4) + 4 s + c % 4 holds channel c of plane s), so that each
    32-bit word of four codes stays whole."""
    t: tl.constexpr = x.shape[0]
    q: tl.constexpr = x.shape[1]
    both = tl.join(tl.reshape(x, [t, q // 4, 4]), tl.reshape(y, [t, q // 4, 4]))  # [T, Q/4, 4, 2]
    return tl.reshape(tl.permute(both, (0, 1, 3, 2)), [t, 2 * q])


@triton.jit
def _paired_query(x, y):
    """Two query planes [Q, N] as the operand [2 Q, N] that matches _paired_codes(codes_x, codes_y)."""
    q: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    both = tl.join(tl.reshape(x, [q // 4, 4, n]), tl.reshape(y, [q // 4, 4, n]))  # [Q/4, 4, N, 2]
    return tl.reshape(tl.permute(both, (0, 3, 1, 2)), [2 * q, n])


@triton.jit
def _int8_part(x, inv_scale, part, P: tl.constexpr, KPARTS: tl.constexpr):
    """Plane P of the query [Q, GP * KPARTS] as int8 (_to_int8), kept only in the columns of plane P's part
    (parts of 4 // KPARTS consecutive planes), zero in the others."""
    return tl.where((part == P * KPARTS // 4)[None, :], _to_int8(x, inv_scale), 0).to(tl.int8)


@triton.jit
def zero_accumulators(Q: tl.constexpr, NC: tl.constexpr):
    """The eight fp32 V accumulators (acc^T of planes 0-3, even and odd channels), zero: [Q/2, NC] each, or with
    STACK the even one of each plane [Q, NC] holding both (_stacked) and the odd one an unused [1, NC]."""
    if Q // 2 < MMA_MIN_M:  # STACK
        both = tl.zeros([Q, NC], tl.float32)
        unused = tl.zeros([1, NC], tl.float32)
        return both, unused, both, unused, both, unused, both, unused
    else:
        zero = tl.zeros([Q // 2, NC], tl.float32)
        return zero, zero, zero, zero, zero, zero, zero, zero


@triton.jit
def _stacked(even, odd):
    """Even- and odd-channel planes [T, C] as one [T, 2 C]: columns 0..C-1 the even channels, C..2C-1 the odd
    ones (STACK: at head_dim 64, C = 8 would fill half of the V MMA's M = 16 and Triton would compute the other
    half as a copy)."""
    return tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), [even.shape[0], 2 * even.shape[1]])


@triton.jit
def accumulate_plane(vc, w, acc_even, acc_odd, P: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr):
    """V plane P of the int16 byte-pair tile vc [BT, D/8] into acc^T [D/8, NC] += X^T @ w [BT, NC], even and odd
    channels apart; STACK: both in acc_even [D/4, NC] (_stacked), acc_odd untouched."""
    even, odd = unpack_pair_plane(vc, P, MODE)
    if vc.shape[1] < MMA_MIN_M:  # STACK
        acc_even = mma(tl.trans(_stacked(even, odd)), w, acc_even, EMU)
    else:
        acc_even = mma(tl.trans(even), w, acc_even, EMU)
        acc_odd = mma(tl.trans(odd), w, acc_odd, EMU)
    return acc_even, acc_odd


@triton.jit
def _store_plane(o_row, acc_even, acc_odd, zw, inv_l, pairs, jok, P: tl.constexpr, Q: tl.constexpr,
                 MODE: tl.constexpr):
    """Store plane P's normalised outputs (the accumulators' BIAS part folded out, _fold_bias): even channels from
    acc_even, odd from acc_odd ([Q/2, NC]); STACK: both from acc_even [Q, NC] (row r < Q/2: channel 2 r, else
    2 (r - Q/2) + 1)."""
    if Q // 2 < MMA_MIN_M:  # STACK
        r = tl.arange(0, Q)
        out = (acc_even / plane_factor(P, MODE) + zw[None, :]) * inv_l[None, :]
        tl.store(o_row[None, :] + P * Q + (2 * (r % (Q // 2)) + r // (Q // 2))[:, None], out, mask=jok[None, :])
    else:
        even = (acc_even / plane_factor(P, MODE) + zw[None, :]) * inv_l[None, :]
        odd = (acc_odd / plane_factor(P, MODE) + zw[None, :]) * inv_l[None, :]
        ptrs = o_row[None, :] + P * Q + 2 * pairs[:, None]
        tl.store(ptrs, even, mask=jok[None, :])
        tl.store(ptrs + 1, odd, mask=jok[None, :])


@triton.jit
def _load_tile(head_base, bt_row, stride_cb, t0, offs_t, cols, pairs, sink_end, int2_end,
               K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
               V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, SCALE_T: tl.constexpr, BS: tl.constexpr,
               Q: tl.constexpr, SAME_BLOCK: tl.constexpr, MASKED: tl.constexpr = True):
    """One tile of positions [t0, t0 + BLOCK_T) of one (request, KV head): K codes [BT, Q] uint8, K scale and
    offset [BT] (SCALE_T), V codes as int16 byte pairs [BT, Q/2], V scale and offset [BT], and the mask ok [BT]
    of positions inside the pure-INT2 range [sink_end, int2_end). MASKED=False: the caller knows the whole
    tile is inside it (no masks, ok all true)."""
    s = t0 + offs_t
    if MASKED:
        ok = (s >= sink_end) & (s < int2_end)
    else:
        ok = tl.full([offs_t.shape[0]], 1, tl.int1)
    if SAME_BLOCK:
        base = head_base + tl.load(bt_row + t0 // BS).to(tl.int64) * stride_cb
        slot = t0 % BS + offs_t
    elif MASKED:
        base = head_base + tl.load(bt_row + s // BS, mask=ok, other=0).to(tl.int64) * stride_cb
        slot = s % BS
    else:
        base = head_base + tl.load(bt_row + s // BS).to(tl.int64) * stride_cb
        slot = s % BS
    rows = base + slot * Q  # with a scalar base, the K/V code rows are one contiguous run
    if MASKED:
        kc = tl.load(rows[:, None] + K_CODES + cols[None, :], mask=ok[:, None], other=0)
        ks = tl.load((base + K_SCALE).to(tl.pointer_type(SCALE_T)) + slot, mask=ok, other=0.0)
        kz = tl.load((base + K_ZERO).to(tl.pointer_type(SCALE_T)) + slot, mask=ok, other=0.0)
        vc = tl.load((rows + V_CODES).to(tl.pointer_type(tl.int16))[:, None] + pairs[None, :], mask=ok[:, None],
                     other=0)
        vs = tl.load((base + V_SCALE).to(tl.pointer_type(SCALE_T)) + slot, mask=ok, other=0.0)
        vz = tl.load((base + V_ZERO).to(tl.pointer_type(SCALE_T)) + slot, mask=ok, other=0.0)
    else:
        kc = tl.load(rows[:, None] + K_CODES + cols[None, :])
        ks = tl.load((base + K_SCALE).to(tl.pointer_type(SCALE_T)) + slot)
        kz = tl.load((base + K_ZERO).to(tl.pointer_type(SCALE_T)) + slot)
        vc = tl.load((rows + V_CODES).to(tl.pointer_type(tl.int16))[:, None] + pairs[None, :])
        vs = tl.load((base + V_SCALE).to(tl.pointer_type(SCALE_T)) + slot)
        vz = tl.load((base + V_ZERO).to(tl.pointer_type(SCALE_T)) + slot)
    return kc, ks, kz, vc, vs, vz, ok


@triton.jit
def _load_tile_tma(kc_desc, vc_desc, ks_desc, kz_desc, vs_desc, vz_desc, region, slot0, BLOCK_T: tl.constexpr,
                   Q: tl.constexpr):
    """_load_tile of a whole tile inside one cache block, by tensor-memory-accelerator copies: region = the
    (block, KV head) region index (block id x KV heads + head), slot0 = the tile's first position in the
    block. The descriptors (triton_ops._tile_descriptors) address each plane as [regions, block_size, width]."""
    kc = tl.reshape(kc_desc.load([region, slot0, 0]), [BLOCK_T, Q])
    vc = tl.reshape(vc_desc.load([region, slot0, 0]), [BLOCK_T, Q // 2])
    ks = tl.reshape(ks_desc.load([region, slot0]), [BLOCK_T])
    kz = tl.reshape(kz_desc.load([region, slot0]), [BLOCK_T])
    vs = tl.reshape(vs_desc.load([region, slot0]), [BLOCK_T])
    vz = tl.reshape(vz_desc.load([region, slot0]), [BLOCK_T])
    return kc, ks, kz, vc, vs, vz, tl.full([BLOCK_T], 1, tl.int1)


@triton.jit
def _prefetch_tile(head_base, bt_row, stride_cb, t0, int2_end, live, BS: tl.constexpr, BLOCK_T: tl.constexpr,
                   REGION: tl.constexpr):
    """prefetch.global.L2 every 128-byte line of the (block, head) regions whose first position lies in
    [t0, t0 + BLOCK_T) (nothing when ``live`` is False). A hint only: no result depends on it."""
    NB: tl.constexpr = BLOCK_T // BS if BLOCK_T > BS else 1
    LINES: tl.constexpr = triton.next_power_of_2((REGION + PREFETCH_LINE - 1) // PREFETCH_LINE)
    blk = tl.arange(0, NB)
    line = tl.arange(0, LINES)
    start = live & (t0 % BS == 0) if BLOCK_T < BS else live
    real = start & (t0 + blk * BS < int2_end)  # blocks past the request's INT2 range are not in its table
    ids = tl.load(bt_row + t0 // BS + blk, mask=real, other=0).to(tl.int64)
    addr = (head_base + ids[:, None] * stride_cb + line[None, :] * PREFETCH_LINE).to(tl.int64, bitcast=True)
    want = (real[:, None] & (line[None, :] * PREFETCH_LINE < REGION)).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [addr, want], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _int2_tile_logits(kc, ks, kz, ok, q0, q1, q2, q3, qb, qo,
                      BLOCK_T: tl.constexpr, GP: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr,
                      INT8_K: tl.constexpr, MASKED: tl.constexpr = True, KPARTS: tl.constexpr = 1):
    """[BT, GP] fp32 logits of one loaded INT2 tile before their per-column scale: logits (log2 units) =
    x * l_scale[None, :] (int2_split_kernel's prologue), applied where the softmax subtracts the running max
    (one FFMA in place of the FADD), so the loop multiplies no per-token or per-element scale. -inf where not
    ok (MASKED=False: ok is all true, no mask applied)."""
    ks = ks.to(tl.float32)
    kz = kz.to(tl.float32)
    if INT8_K and kc.shape[1] < INT8_MMA_MIN_K:  # planes paired into K = 2 Q operands (q0, q1: _paired_query)
        iraw = int8_mma(_paired_codes(plane_codes_int8(kc, 0, MODE), plane_codes_int8(kc, 1, MODE)), q0,
                        tl.zeros([BLOCK_T, GP * KPARTS], tl.int32), EMU)
        iraw = int8_mma(_paired_codes(plane_codes_int8(kc, 2, MODE), plane_codes_int8(kc, 3, MODE)), q1, iraw, EMU)
    elif INT8_K:
        iraw = int8_mma(plane_codes_int8(kc, 0, MODE), q0, tl.zeros([BLOCK_T, GP * KPARTS], tl.int32), EMU)
        iraw = int8_mma(plane_codes_int8(kc, 1, MODE), q1, iraw, EMU)
        iraw = int8_mma(plane_codes_int8(kc, 2, MODE), q2, iraw, EMU)
        iraw = int8_mma(plane_codes_int8(kc, 3, MODE), q3, iraw, EMU)
    if INT8_K:
        if KPARTS > 1:  # column (head, part) holds the head's dot over its part's planes: add the parts
            iraw = tl.sum(tl.reshape(iraw, [BLOCK_T, GP, KPARTS]), axis=2)
        x = ks[:, None] * iraw.to(tl.float32) + kz[:, None] * qo[None, :]
    else:
        raw = mma(unpack_plane(kc, 0, MODE), q0, tl.zeros([BLOCK_T, GP], tl.float32), EMU)
        raw = mma(unpack_plane(kc, 1, MODE), q1, raw, EMU)
        raw = mma(unpack_plane(kc, 2, MODE), q2, raw, EMU)
        raw = mma(unpack_plane(kc, 3, MODE), q3, raw, EMU)
        x = ks[:, None] * (raw - qb[None, :]) + kz[:, None] * qo[None, :]
    if MASKED:
        x = tl.where(ok[:, None], x, float("-inf"))
    return x


@triton.jit
def _int2_tile_values(p, vc, vs, vz, sums, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o,
                      GP: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr, SUMS_MMA: tl.constexpr,
                      ZW_COLS: tl.constexpr):
    """Accumulate p [BT, NC] (fp32, 0 where unused) times one loaded tile of INT2 V: acc^T += codes^T @ w with
    w = bf16(p * scale) in columns < GP; the column sums of w into sums (SUMS_MMA: [SUM_ROWS, NC] += ones @ w,
    module docstring; else [1, NC] += sum(w)); the offset term: ZW_COLS: w = bf16(p * offset) in columns >= GP
    (summed by the same MMA), else zw [NC] += sum(p * offset). Returns the updated state."""
    if ZW_COLS:
        upper = tl.arange(0, p.shape[1]) >= GP
        w = round_to(p * tl.where(upper[None, :], vz.to(tl.float32)[:, None], vs.to(tl.float32)[:, None]),
                     tl.bfloat16, EMU)
    else:
        w = round_to(p * vs.to(tl.float32)[:, None], tl.bfloat16, EMU)
        zw += tl.sum(p * vz.to(tl.float32)[:, None], axis=0)
    if SUMS_MMA:
        sums = mma(tl.full([SUM_ROWS, p.shape[0]], 1.0, tl.bfloat16), w, sums, EMU)
    else:
        sums += tl.sum(w.to(tl.float32), axis=0)[None, :]
    acc0e, acc0o = accumulate_plane(vc, w, acc0e, acc0o, 0, MODE, EMU)
    acc1e, acc1o = accumulate_plane(vc, w, acc1e, acc1o, 1, MODE, EMU)
    acc2e, acc2o = accumulate_plane(vc, w, acc2e, acc2o, 2, MODE, EMU)
    acc3e, acc3o = accumulate_plane(vc, w, acc3e, acc3o, 3, MODE, EMU)
    return sums, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o


@triton.jit
def _offset_sums(moved, zw, GP: tl.constexpr, ZW_COLS: tl.constexpr):
    """zw [NC] at the end of a program: zw_j = sum of p z_v (ZW_COLS: from column GP + j of the column sums moved
    out of the accumulators, _fold_bias)."""
    if ZW_COLS:
        c = tl.arange(0, moved.shape[0])
        zw = tl.sum(tl.where(c[None, :] == c[:, None] + GP, moved[None, :], 0.0), axis=1)
    return zw


@triton.jit
def _fold_bias(sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o):
    """Take the BIAS part out of the V accumulators: acc -= BIAS * (column sums of w since the last fold), which move
    from sums (restarted at 0) to moved [NC] (every FOLD tiles). Returns (sums, moved, the eight accumulators)."""
    since = tl.max(sums, axis=0)  # every row of sums holds the column sums
    bias = BIAS * since[None, :]
    return (tl.zeros_like(sums), moved + since, acc0e - bias, acc0o - bias, acc1e - bias, acc1o - bias, acc2e - bias,
            acc2o - bias, acc3e - bias, acc3o - bias)


@triton.jit
def _int2_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, GROUP: tl.constexpr, GP: tl.constexpr,
                NC: tl.constexpr, Q: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr, INT8_K: tl.constexpr,
                KPARTS: tl.constexpr, head_base=None, bt_row=None, stride_cb=0, t0=0, int2_end=0, live=False,
                BS: tl.constexpr = 0, BLOCK_T: tl.constexpr = 0, REGION: tl.constexpr = 0,
                FIRST_PREFETCH: tl.constexpr = 0):
    """The query operands of the INT2 logits (_int2_tile_logits) of request b, KV head h: (q0..q3, qb, qo, l_scale).
    Only the programs that read INT2 tiles compute them (the splits; window programs with INT2 positions).

    INT8_K: the query as int8 per head row (absmax over all D channels, q = s_q * q8 everywhere, so the offset term
    uses s_q * sum(q8) and no BIAS is involved: the codes are exact int8); planes [Q, GP * KPARTS] int8 in the
    columns (head, part) of _int8_part; qb = 0, qo = sum(q8) and l_scale = s_q * qk_scale per head [GP].
    Else: planes [Q, NC] bf16 / F_P (_query_plane), qb = BIAS * sum, qo = plain sum, l_scale = qk_scale [NC].

    FIRST_PREFETCH > 0 (INT8_K): once the query's loads are issued, ask L2 for the tile at t0 (head_base, bt_row,
    stride_cb, int2_end, live, BS, BLOCK_T, REGION as _prefetch_tile takes them), so that the rounding below runs
    while its DRAM read is in flight instead of before the tile's first load is issued."""
    cols = tl.arange(0, Q)
    j = tl.arange(0, NC * KPARTS)  # columns: head j // KPARTS (ZW_COLS: j % GP), part j % KPARTS
    head = j // KPARTS % GP
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + head) * stride_qh
    jok = head < GROUP
    if INT8_K:
        f0 = _query_plane_f32(q_row, cols, jok, 0, Q)
        f1 = _query_plane_f32(q_row, cols, jok, 1, Q)
        f2 = _query_plane_f32(q_row, cols, jok, 2, Q)
        f3 = _query_plane_f32(q_row, cols, jok, 3, Q)
        if FIRST_PREFETCH > 0:
            _prefetch_tile(head_base, bt_row, stride_cb, t0, int2_end, live, BS, BLOCK_T, REGION)
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(f0), axis=0), tl.max(tl.abs(f1), axis=0)),
                          tl.maximum(tl.max(tl.abs(f2), axis=0), tl.max(tl.abs(f3), axis=0)))
        s_q = tl.where(amax > 0.0, amax / INT8_QUERY_MAX, 1.0)
        inv_s = 1.0 / s_q
        part = j % KPARTS
        q0 = _int8_part(f0, inv_s, part, 0, KPARTS)
        q1 = _int8_part(f1, inv_s, part, 1, KPARTS)
        q2 = _int8_part(f2, inv_s, part, 2, KPARTS)
        q3 = _int8_part(f3, inv_s, part, 3, KPARTS)
        qo = (tl.sum(q0.to(tl.float32), axis=0) + tl.sum(q1.to(tl.float32), axis=0)
              + tl.sum(q2.to(tl.float32), axis=0) + tl.sum(q3.to(tl.float32), axis=0))
        if KPARTS > 1:  # per head: the parts' sums add up, their scales are equal
            qo = tl.sum(tl.reshape(qo, [GP, KPARTS]), axis=1)
            s_q = tl.max(tl.reshape(s_q, [GP, KPARTS]), axis=1)
        if Q < INT8_MMA_MIN_K:  # planes (0, 1) and (2, 3) as K = 2 Q operands, in _paired_codes' order
            q0 = _paired_query(q0, q1)
            q1 = _paired_query(q2, q3)
        qb = tl.zeros([GP], tl.float32)
    else:
        s_q = tl.full([NC], 1.0, tl.float32)
        q0, qb0, qo0 = _query_plane(q_row, cols, jok, 0, Q, MODE, EMU)
        q1, qb1, qo1 = _query_plane(q_row, cols, jok, 1, Q, MODE, EMU)
        q2, qb2, qo2 = _query_plane(q_row, cols, jok, 2, Q, MODE, EMU)
        q3, qb3, qo3 = _query_plane(q_row, cols, jok, 3, Q, MODE, EMU)
        qb = qb0 + qb1 + qb2 + qb3
        qo = qo0 + qo1 + qo2 + qo3
    return q0, q1, q2, q3, qb, qo, s_q * qk_scale


@triton.jit
def _tile_step(kc, ks, kz, vc, vs, vz, ok, q0, q1, q2, q3, qb, qo, l_scale,
               m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o,
               BLOCK_T: tl.constexpr, GP: tl.constexpr, NC: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr,
               INT8_K: tl.constexpr, MASKED: tl.constexpr, SUMS_MMA: tl.constexpr, ZW_COLS: tl.constexpr,
               KPARTS: tl.constexpr = 1):
    """One INT2 tile's logits, lazy online-softmax update and V accumulation (the loaded tile as
    _load_tile returns it; state as int2_split_kernel keeps it). Returns the updated state."""
    x = _int2_tile_logits(kc, ks, kz, ok, q0, q1, q2, q3, qb, qo, BLOCK_T, NC, MODE, EMU, INT8_K, MASKED, KPARTS)
    tile_max = tl.max(x, axis=0) * l_scale  # l_scale > 0: the max of the scaled logits
    if tl.max(tile_max - m_i, axis=0) > RESCALE_SLACK:  # lazy rescale (see module docstring)
        m_new = tl.maximum(m_i, tile_max)
        alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
        l_i *= alpha
        sums *= alpha[None, :]
        moved *= alpha
        zw *= alpha
        acc0e *= alpha[None, :]
        acc0o *= alpha[None, :]
        acc1e *= alpha[None, :]
        acc1o *= alpha[None, :]
        acc2e *= alpha[None, :]
        acc2o *= alpha[None, :]
        acc3e *= alpha[None, :]
        acc3o *= alpha[None, :]
        m_i = m_new
    p = tl.exp2(x * l_scale[None, :] - tl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    l_i += tl.sum(p, axis=0)
    sums, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _int2_tile_values(
        p, vc, vs, vz, sums, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o, GP, MODE, EMU, SUMS_MMA,
        ZW_COLS)
    return m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o


@triton.jit
def _window_query_plane(q_row, cols, jok, P: tl.constexpr, Q: tl.constexpr, WIN_T: tl.constexpr,
                        EMU: tl.constexpr):
    """Plane P of the query, transposed, in the window dtype: [Q, GP]."""
    return round_to(tl.load(q_row[None, :] + P * Q + cols[:, None], mask=jok[None, :], other=0.0), WIN_T, EMU)


@triton.jit
def _window_values(wv_rows, copy, pw, acc_even, acc_odd, cols, P: tl.constexpr, Q: tl.constexpr,
                   MODE: tl.constexpr, WIN_T: tl.constexpr, EMU: tl.constexpr):
    """acc^T += F_P * V_P^T @ pw over BF16 window rows (wv_rows [BT] -> channel 0; pw [BT, GP] fp32,
    0 where no copy), even and odd channels of plane P apart, or STACK stacked (the INT2 accumulators' layout)."""
    v = tl.load(wv_rows[:, None] + P * Q + cols[None, :], mask=copy[:, None], other=0.0)
    even, odd = tl.split(tl.reshape(v, [v.shape[0], Q // 2, 2]))
    pf = round_to(pw * plane_factor(P, MODE), WIN_T, EMU)  # exact: a power-of-two scaling
    if Q // 2 < MMA_MIN_M:  # STACK
        acc_even = mma(tl.trans(_stacked(even, odd)), pf, acc_even, EMU)
    else:
        acc_even = mma(tl.trans(even), pf, acc_even, EMU)
        acc_odd = mma(tl.trans(odd), pf, acc_odd, EMU)
    return acc_even, acc_odd


#: Arguments left unspecialised, so that one compiled kernel serves every split count (they
#: only address the partial outputs).
SPLIT_RUNTIME_ARGS = ["stride_pb", "stride_ph", "stride_lb", "stride_lh", "NSPLIT", "NSPLIT_SHORT"]


@triton.jit(do_not_specialize=SPLIT_RUNTIME_ARGS)
def int2_split_kernel(
    q_ptr, stride_qb, stride_qh,
    cache_ptr, stride_cb, stride_ch,
    wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    bt_ptr, wbt_ptr, stride_bt, seq_ptr,
    part_ptr, stride_pb, stride_ph, stride_ps,
    lse_ptr, stride_lb, stride_lh,
    sink, recent, qk_scale,
    kc_desc, vc_desc, ks_desc, kz_desc, vs_desc, vz_desc,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    BLOCK_T: tl.constexpr, SAME_BLOCK: tl.constexpr, WIN_BT: tl.constexpr, WIN_SAME_BLOCK: tl.constexpr,
    NSPLIT, NSPLIT_SHORT, NSINK: tl.constexpr,
    MODE: tl.constexpr, WIN_T: tl.constexpr, EMU: tl.constexpr, INT8_K: tl.constexpr = False,
    PREFETCH: tl.constexpr = 0, REGION: tl.constexpr = 0, WINDOWS_FIRST: tl.constexpr = False,
    FULL_TILES: tl.constexpr = False, TRIGGER_DEPENDENTS: tl.constexpr = False, TMA_STAGES: tl.constexpr = 0,
    MIN_TILES: tl.constexpr = 1, LONG_TILES: tl.constexpr = 0, FIRST_PREFETCH: tl.constexpr = 0,
    FOLD: tl.constexpr = FOLD_TILES,
):
    """One group per row (G = D). See module docstring. INT8_K: the key path as an int8 MMA
    (codes exact, query rounded to int8 per head row: module docstring).

    Programs 0..NSPLIT-1 split the pure INT2 range; program NSPLIT + w takes window tile w (WIN_BT
    positions; smaller than BLOCK_T so that the BF16 tiles do not raise the kernel's register count); a split
    walks at least MIN_TILES tiles, so at short contexts the splits past the last one are empty:
    tiles 0..NSINK-1 of the sink [0, sink_end), then tiles of the recent window [int2_end, length) (with
    FULL_TILES: [0, head_end) and [tail_start, length), see the module docstring). A window position reads
    its BF16 copy (window_k/window_v at window_block_table) and, where its block has no copy (table entry
    < 0), its INT2 codes; an INT2 edge position (FULL_TILES) reads its INT2 codes. TRIGGER_DEPENDENTS:
    every program lets a programmatically dependent launch (the merge) start as it begins. TMA_STAGES > 0
    (FULL_TILES, tiles inside one cache block): the splits load their tiles through the tensor descriptors
    kc_desc..vz_desc (None otherwise), software-pipelined TMA_STAGES deep. FIRST_PREFETCH > 0 (int8 keys, PTX): each
    split asks L2 for its first tile inside the query prologue (_int2_query)."""
    Q: tl.constexpr = D // 4
    # The column sums by MMA (module docstring) where they were measured faster: the bf16-key path (SmolLM2
    # geometry 2-5% at B >= 8); on the int8-key path (Qwen3-8B) they were 0-3% slower (docs/decisions.md V29).
    SUMS_MMA: tl.constexpr = not INT8_K
    ZW_COLS: tl.constexpr = SUMS_MMA and 2 * GP <= MMA_MIN_N  # the offset sums in spare MMA columns
    NC: tl.constexpr = 2 * GP if ZW_COLS else GP  # tile columns
    # The int8 logits MMA's columns (head, part) where GP < 8 would leave its N = 8 half empty: part k's query
    # operand holds only the planes of part k, so folding the parts in-lane leaves an unreplicated [BT, GP] tile.
    KPARTS: tl.constexpr = (MMA_MIN_N // GP if 4 * GP >= MMA_MIN_N else 4) if INT8_K and GP < MMA_MIN_N else 1
    if TRIGGER_DEPENDENTS:  # the merge, launched with programmatic dependent launch, may start now (it
        gdc_launch_dependents()  # waits for this kernel's completion before reading any partial)
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.program_id(2)
    if WINDOWS_FIRST:  # grid slots 0..windows-1 take the window tiles, the rest the splits
        windows = tl.num_programs(2) - NSPLIT
        pid = tl.where(slot < windows, NSPLIT + slot, slot - windows)
    elif LONG_TILES > 0:  # the first NSPLIT_SHORT splits, the window tiles, then the splits only long pairs use
        windows = tl.num_programs(2) - NSPLIT
        pid = tl.where(slot < NSPLIT_SHORT, slot,
                       tl.where(slot < NSPLIT_SHORT + windows, NSPLIT + slot - NSPLIT_SHORT, slot - windows))
    else:
        pid = slot
    length = tl.load(seq_ptr + b)
    sink_end = tl.minimum(sink, length)
    int2_end = tl.maximum(sink_end, length - recent)
    if FULL_TILES:  # the splits walk whole tiles only; the INT2 edges go to the window programs
        first = tl.cdiv(sink_end, BLOCK_T) * BLOCK_T
        n_tiles = tl.maximum((int2_end // BLOCK_T) * BLOCK_T - first, 0) // BLOCK_T
        head_end = tl.maximum(sink_end, tl.minimum(first, int2_end))  # window programs: [0, head_end)
        tail_start = tl.minimum(int2_end, tl.maximum(first + n_tiles * BLOCK_T, head_end))  # and [tail_start, L)
    else:
        first = (sink_end // BLOCK_T) * BLOCK_T
        n_tiles = tl.where(int2_end > sink_end, tl.cdiv(int2_end - first, BLOCK_T), 0)
        head_end = sink_end
        tail_start = int2_end
    # At least MIN_TILES per split: NSPLIT is sized for the longest context a launch may see (a captured graph's
    # max_model_len), so a shorter one uses fewer, longer splits; the rest stay empty (lse -inf, which the merge
    # skips without reading their outputs).
    # NSPLIT_SHORT < NSPLIT (LONG_TILES > 0): a pair uses all NSPLIT splits only where NSPLIT_SHORT splits would
    # each walk >= LONG_TILES tiles (the launch's grid was sized for a context that long), else NSPLIT_SHORT.
    used = tl.where(n_tiles >= LONG_TILES * NSPLIT_SHORT, NSPLIT, NSPLIT_SHORT) if LONG_TILES > 0 else NSPLIT
    per_split = tl.maximum(tl.cdiv(n_tiles, used), MIN_TILES)
    lo = tl.minimum(pid * per_split, n_tiles)
    hi = tl.minimum(lo + per_split, n_tiles)

    j = tl.arange(0, NC)
    jok = j % GP < GROUP  # columns of a real head (ZW_COLS: column GP + i repeats head i)
    jst = jok & (j < GP)  # the columns stored
    head = h * GROUP + j % GP
    cols = tl.arange(0, Q)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + head * stride_qh

    m_i = tl.full([NC], float("-inf"), tl.float32)
    l_i = tl.zeros([NC], tl.float32)
    sums = tl.zeros([SUM_ROWS if SUMS_MMA else 1, NC], tl.float32)
    moved = tl.zeros([NC], tl.float32)  # column sums of w folded out of the V accumulators (_fold_bias)
    zw = tl.zeros([NC], tl.float32)
    pairs = tl.arange(0, Q // 2)
    acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = zero_accumulators(Q, NC)
    head_base = cache_ptr + h * stride_ch
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    offs_t = tl.arange(0, BLOCK_T)
    if pid < NSPLIT and TMA_STAGES > 0:
        q0, q1, q2, q3, qb, qo, l_scale = _int2_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, GROUP, GP, NC, Q,
                                                      MODE, EMU, INT8_K, KPARTS, head_base, bt_row, stride_cb,
                                                      first + lo * BLOCK_T, int2_end, lo < hi, BS, BLOCK_T, REGION,
                                                      FIRST_PREFETCH)
        heads = stride_cb // REGION  # regions per block (the descriptors need a contiguous cache)
        for i in tl.range(lo, hi, num_stages=TMA_STAGES):
            t0 = first + i * BLOCK_T
            if PREFETCH > 0:  # ask L2 for the tile PREFETCH steps ahead (its loads then wait on L2, not DRAM)
                _prefetch_tile(head_base, bt_row, stride_cb, t0 + PREFETCH * BLOCK_T, int2_end,
                               i + PREFETCH < hi, BS, BLOCK_T, REGION)
            region = tl.load(bt_row + t0 // BS) * heads + h
            kc_i, ks_i, kz_i, vc_i, vs_i, vz_i, ok_i = _load_tile_tma(
                kc_desc, vc_desc, ks_desc, kz_desc, vs_desc, vz_desc, region, t0 % BS, BLOCK_T, Q)
            m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _tile_step(
                kc_i, ks_i, kz_i, vc_i, vs_i, vz_i, ok_i, q0, q1, q2, q3, qb, qo, l_scale,
                m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o,
                BLOCK_T, GP, NC, MODE, EMU, INT8_K, False, SUMS_MMA, ZW_COLS, KPARTS)
            if (i - lo) % FOLD == FOLD - 1:
                sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _fold_bias(
                    sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o)
    elif pid < NSPLIT:
        q0, q1, q2, q3, qb, qo, l_scale = _int2_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, GROUP, GP, NC, Q,
                                                      MODE, EMU, INT8_K, KPARTS, head_base, bt_row, stride_cb,
                                                      first + lo * BLOCK_T, int2_end, lo < hi, BS, BLOCK_T, REGION,
                                                      FIRST_PREFETCH)
        for i in range(lo, hi):
            if PREFETCH > 0:  # ask L2 for the tile PREFETCH steps ahead (its loads then wait on L2, not DRAM)
                _prefetch_tile(head_base, bt_row, stride_cb, first + (i + PREFETCH) * BLOCK_T, int2_end,
                               i + PREFETCH < hi, BS, BLOCK_T, REGION)
            kc_i, ks_i, kz_i, vc_i, vs_i, vz_i, ok_i = _load_tile(
                head_base, bt_row, stride_cb, first + i * BLOCK_T, offs_t, cols, pairs, sink_end, int2_end,
                K_CODES, V_CODES, K_SCALE, K_ZERO, V_SCALE, V_ZERO, SCALE_T, BS, Q, SAME_BLOCK, not FULL_TILES)
            m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _tile_step(
                kc_i, ks_i, kz_i, vc_i, vs_i, vz_i, ok_i, q0, q1, q2, q3, qb, qo, l_scale,
                m_i, l_i, sums, moved, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o,
                BLOCK_T, GP, NC, MODE, EMU, INT8_K, not FULL_TILES, SUMS_MMA, ZW_COLS, KPARTS)
            if (i - lo) % FOLD == FOLD - 1:
                sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _fold_bias(
                    sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o)
    else:
        tile = pid - NSPLIT
        in_sink = tile < NSINK
        part_lo = tl.where(in_sink, 0, tail_start)
        part_hi = tl.where(in_sink, head_end, length)
        t0 = (part_lo // WIN_BT + tl.where(in_sink, tile, tile - NSINK)) * WIN_BT
        if t0 < part_hi:
            offs_w = tl.arange(0, WIN_BT)
            s = t0 + offs_w
            ok = (s >= part_lo) & (s < part_hi)
            wblk = tl.load(wbt_ptr + b.to(tl.int64) * stride_bt + s // BS, mask=ok, other=-1)
            copy = ok & (wblk >= 0) & ((s < sink_end) | (s >= int2_end))  # window positions with a BF16 copy
            no_copy = ok & ~copy  # INT2: window positions without a copy, and (FULL_TILES) the edge tiles
            rows = tl.where(copy, wblk, 0).to(tl.int64) * stride_w0 + (s % BS) * stride_w1 + h * stride_w2
            raw = mma(tl.load(wk_ptr + rows[:, None] + cols[None, :], mask=copy[:, None], other=0.0),
                      _window_query_plane(q_row, cols, jok, 0, Q, WIN_T, EMU), tl.zeros([WIN_BT, NC], tl.float32), EMU)
            raw = mma(tl.load(wk_ptr + rows[:, None] + Q + cols[None, :], mask=copy[:, None], other=0.0),
                      _window_query_plane(q_row, cols, jok, 1, Q, WIN_T, EMU), raw, EMU)
            raw = mma(tl.load(wk_ptr + rows[:, None] + 2 * Q + cols[None, :], mask=copy[:, None], other=0.0),
                      _window_query_plane(q_row, cols, jok, 2, Q, WIN_T, EMU), raw, EMU)
            raw = mma(tl.load(wk_ptr + rows[:, None] + 3 * Q + cols[None, :], mask=copy[:, None], other=0.0),
                      _window_query_plane(q_row, cols, jok, 3, Q, WIN_T, EMU), raw, EMU)
            logits = tl.where(copy[:, None], raw * qk_scale, float("-inf"))
            any_int2 = tl.max(no_copy.to(tl.int32), axis=0) > 0
            if any_int2:  # positions whose block has no BF16 copy read INT2
                q0, q1, q2, q3, qb, qo, l_scale = _int2_query(q_ptr, stride_qb, stride_qh, b, h, qk_scale, GROUP,
                                                              GP, NC, Q, MODE, EMU, INT8_K, KPARTS)
                kc, ks, kz, vc, vs, vz, _ = _load_tile(
                    head_base, bt_row, stride_cb, t0, offs_w, cols, pairs, part_lo, part_hi, K_CODES, V_CODES,
                    K_SCALE, K_ZERO, V_SCALE, V_ZERO, SCALE_T, BS, Q, WIN_SAME_BLOCK)
                x = _int2_tile_logits(kc, ks, kz, no_copy, q0, q1, q2, q3, qb, qo, WIN_BT, NC, MODE, EMU, INT8_K,
                                      True, KPARTS)
                logits = tl.where(no_copy[:, None], x * l_scale[None, :], logits)
            m_i = tl.max(logits, axis=0)
            p = tl.exp2(logits - tl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
            l_i = tl.sum(p, axis=0)
            pw = tl.where(copy[:, None], p, 0.0)
            acc0e, acc0o = _window_values(wv_ptr + rows, copy, pw, acc0e, acc0o, cols, 0, Q, MODE, WIN_T, EMU)
            acc1e, acc1o = _window_values(wv_ptr + rows, copy, pw, acc1e, acc1o, cols, 1, Q, MODE, WIN_T, EMU)
            acc2e, acc2o = _window_values(wv_ptr + rows, copy, pw, acc2e, acc2o, cols, 2, Q, MODE, WIN_T, EMU)
            acc3e, acc3o = _window_values(wv_ptr + rows, copy, pw, acc3e, acc3o, cols, 3, Q, MODE, WIN_T, EMU)
            if any_int2:
                kc, ks, kz, vc, vs, vz, _ = _load_tile(
                    head_base, bt_row, stride_cb, t0, offs_w, cols, pairs, part_lo, part_hi, K_CODES, V_CODES,
                    K_SCALE, K_ZERO, V_SCALE, V_ZERO, SCALE_T, BS, Q, WIN_SAME_BLOCK)
                sums, zw, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _int2_tile_values(
                    tl.where(no_copy[:, None], p, 0.0), vc, vs, vz, sums, zw,
                    acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o, GP, MODE, EMU, SUMS_MMA, ZW_COLS)

    inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
    o_row = part_ptr + b.to(tl.int64) * stride_pb + head * stride_ph + pid * stride_ps
    sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o = _fold_bias(
        sums, moved, acc0e, acc0o, acc1e, acc1o, acc2e, acc2o, acc3e, acc3o)
    zw = _offset_sums(moved, zw, GP, ZW_COLS)
    _store_plane(o_row, acc0e, acc0o, zw, inv_l, pairs, jst, 0, Q, MODE)
    _store_plane(o_row, acc1e, acc1o, zw, inv_l, pairs, jst, 1, Q, MODE)
    _store_plane(o_row, acc2e, acc2o, zw, inv_l, pairs, jst, 2, Q, MODE)
    _store_plane(o_row, acc3e, acc3o, zw, inv_l, pairs, jst, 3, Q, MODE)
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + pid, lse, mask=jst)
