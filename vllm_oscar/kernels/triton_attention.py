"""Triton paged attention over the OSCAR cache: decode (split-K) and prefill over a prefix.

One kernel serves both. A program owns one KV head h of one request b and a tile of M
query rows: row r is query token ``r // GP`` of the tile and query head ``h * g + r % GP``
(g = Hq / Hkv, GP = next power of two >= g; rows with r % GP >= g or past the tile's
tokens are padding). Decode: one token, M = max(16, GP). Prefill: BLOCK_M tokens.

Cached positions are visited in tiles of BLOCK_T positions and read by the rule of
docs/design.md: BF16 (window store) iff (s < sink or s > t - recent) and the block has a
window copy; INT2 otherwise. Three loops:

* pure INT2 tiles: [sink_end, int2_end): every row reads INT2, no BF16 load at all. The
  logits use the codes directly (triton_common):
      logit[r, s] = sum_g scale[s,g] * (q_g . code_g[s]) + offset[s,g] * sum(q_g)
  and V accumulates  (p * scale) @ codes  +  sum_s p * offset  per group.
* mixed tiles (sink, recent, and in prefill the recent window of the tile's earliest
  query): both readings are loaded (masked) and chosen per (row, position).
* prefill only: the chunk's own rows (key_rot/value_rot), causally, exact; or, with
  CHUNK_FROM_CACHE, no such loop: the chunk's rows (already written) are cached positions
  like the prefix, read causally by the same rule, so a prefill computes what decoding
  token by token would.

Decode grid: (NSPLIT + NSINK + NREC, B, Hkv): programs 0..NSPLIT-1 split the pure INT2
range of the request into NSPLIT contiguous tile ranges (split-K); each of the next NSINK
programs takes one tile of the sink, each of the last NREC one tile of the recent window
(NSINK = cdiv(sink, BLOCK_T), NREC = cdiv(recent, BLOCK_T) + 1), so the windows add one
tile of latency, not sink + recent positions in series. Each writes a partial (output normalised by its own softmax
sum, and its log2-sum-exp); ``merge_kernel`` combines them exactly. NSPLIT comes from a
host-side upper bound of the lengths, so the launch never reads device data (CUDA-graph
safe). Decode runs here only when the INT2 history has several groups per row or tokens_on_m is
off; otherwise triton_decode_int2 runs the splits and the windows in one launch. Prefill grid:
(cdiv(max_query_len, BLOCK_M) * PSPLIT, B, Hkv): with PSPLIT = 1 the output is written directly;
with PSPLIT > 1 program (tile * PSPLIT + k) takes split k of the tile's pure INT2 range (the last
split also the window tiles and the chunk's own rows) and writes a partial for merge_kernel.
PART splits a prefill over two launches with their own compiles: PART = 1 programs walk only (split
k of) the pure INT2 range, without the window and chunk loops in the binary (139 instead of 225
registers at D 128, rows 64, 4 warps, offline: 3 programs per SM instead of 2); PART = 2 programs take
everything else. Both write partials, at slot SLOT0 + k of their row, for one merge.

Softmax runs in base 2 (logits * softmax_scale * log2 e). Accumulators are fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from vllm_oscar.kernels.triton_common import mma, plane_factor, round_to, scaled_codes

LOG2E: float = 1.4426950408889634

@triton.jit
def _int2_logits(q0, q1, q2, q3, qo0, qo1, qo2, qo3,
                 code_ptrs, scale_ptrs, zero_ptrs, load_ok,
                 NG: tl.constexpr, MODE: tl.constexpr, EMU: tl.constexpr):
    """[M, BT] fp32 logits q . k^ of one tile from packed K codes.

    q_p: [M, Q] bf16 plane p of the rotated query divided by F_p (so q_p . (F_p code) is
    the plane's q . code); qo_p = sum of the undivided plane (fp32 [M]). code_ptrs:
    [BT, Q] byte pointers; scale_ptrs/zero_ptrs: [BT] pointers to group 0 of each position.
    """
    b = tl.load(code_ptrs, mask=load_ok[:, None], other=0)
    r0 = mma(q0, tl.trans(scaled_codes(b, 0, MODE)), tl.zeros([q0.shape[0], b.shape[0]], tl.float32), EMU)
    if NG == 1:
        r0 = mma(q1, tl.trans(scaled_codes(b, 1, MODE)), r0, EMU)
        r0 = mma(q2, tl.trans(scaled_codes(b, 2, MODE)), r0, EMU)
        r0 = mma(q3, tl.trans(scaled_codes(b, 3, MODE)), r0, EMU)
        s0 = tl.load(scale_ptrs, mask=load_ok, other=0.0).to(tl.float32)
        z0 = tl.load(zero_ptrs, mask=load_ok, other=0.0).to(tl.float32)
        logits = s0[None, :] * r0 + z0[None, :] * (qo0 + qo1 + qo2 + qo3)[:, None]
    elif NG == 2:
        r0 = mma(q1, tl.trans(scaled_codes(b, 1, MODE)), r0, EMU)
        r2 = mma(q2, tl.trans(scaled_codes(b, 2, MODE)), tl.zeros([q0.shape[0], b.shape[0]], tl.float32), EMU)
        r2 = mma(q3, tl.trans(scaled_codes(b, 3, MODE)), r2, EMU)
        s0 = tl.load(scale_ptrs, mask=load_ok, other=0.0).to(tl.float32)
        z0 = tl.load(zero_ptrs, mask=load_ok, other=0.0).to(tl.float32)
        s1 = tl.load(scale_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)
        z1 = tl.load(zero_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)
        logits = s0[None, :] * r0 + z0[None, :] * (qo0 + qo1)[:, None]
        logits += s1[None, :] * r2 + z1[None, :] * (qo2 + qo3)[:, None]
    else:
        r1 = mma(q1, tl.trans(scaled_codes(b, 1, MODE)), tl.zeros([q0.shape[0], b.shape[0]], tl.float32), EMU)
        r2 = mma(q2, tl.trans(scaled_codes(b, 2, MODE)), tl.zeros([q0.shape[0], b.shape[0]], tl.float32), EMU)
        r3 = mma(q3, tl.trans(scaled_codes(b, 3, MODE)), tl.zeros([q0.shape[0], b.shape[0]], tl.float32), EMU)
        logits = tl.load(scale_ptrs, mask=load_ok, other=0.0).to(tl.float32)[None, :] * r0
        logits += tl.load(zero_ptrs, mask=load_ok, other=0.0).to(tl.float32)[None, :] * qo0[:, None]
        logits += tl.load(scale_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)[None, :] * r1
        logits += tl.load(zero_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)[None, :] * qo1[:, None]
        logits += tl.load(scale_ptrs + 2, mask=load_ok, other=0.0).to(tl.float32)[None, :] * r2
        logits += tl.load(zero_ptrs + 2, mask=load_ok, other=0.0).to(tl.float32)[None, :] * qo2[:, None]
        logits += tl.load(scale_ptrs + 3, mask=load_ok, other=0.0).to(tl.float32)[None, :] * r3
        logits += tl.load(zero_ptrs + 3, mask=load_ok, other=0.0).to(tl.float32)[None, :] * qo3[:, None]
    return logits


@triton.jit
def _int2_values(p, acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3,
                 code_ptrs, scale_ptrs, zero_ptrs, load_ok, NG: tl.constexpr, MODE: tl.constexpr,
                 EMU: tl.constexpr):
    """Accumulate p [M, BT] (fp32, 0 where not INT2) times dequantized V of one tile.

    acc_p [M, Q]: sum of bf16(p * scale) @ (F_p code); zw_p [M]: sum of p * offset. The
    true plane-p output is acc_p / F_p + zw_p (applied once at the end).
    """
    b = tl.load(code_ptrs, mask=load_ok[:, None], other=0)
    s0 = tl.load(scale_ptrs, mask=load_ok, other=0.0).to(tl.float32)
    z0 = tl.load(zero_ptrs, mask=load_ok, other=0.0).to(tl.float32)
    w0 = round_to(p * s0[None, :], tl.bfloat16, EMU)
    zs0 = tl.sum(p * z0[None, :], axis=1)
    acc0 = mma(w0, scaled_codes(b, 0, MODE), acc0, EMU)
    zw0 += zs0
    if NG == 1:
        acc1 = mma(w0, scaled_codes(b, 1, MODE), acc1, EMU)
        acc2 = mma(w0, scaled_codes(b, 2, MODE), acc2, EMU)
        acc3 = mma(w0, scaled_codes(b, 3, MODE), acc3, EMU)
        zw1 += zs0
        zw2 += zs0
        zw3 += zs0
    elif NG == 2:
        acc1 = mma(w0, scaled_codes(b, 1, MODE), acc1, EMU)
        zw1 += zs0
        s1 = tl.load(scale_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)
        z1 = tl.load(zero_ptrs + 1, mask=load_ok, other=0.0).to(tl.float32)
        w1 = round_to(p * s1[None, :], tl.bfloat16, EMU)
        zs1 = tl.sum(p * z1[None, :], axis=1)
        acc2 = mma(w1, scaled_codes(b, 2, MODE), acc2, EMU)
        acc3 = mma(w1, scaled_codes(b, 3, MODE), acc3, EMU)
        zw2 += zs1
        zw3 += zs1
    else:
        for g in tl.static_range(1, 4):
            sg = tl.load(scale_ptrs + g, mask=load_ok, other=0.0).to(tl.float32)
            zg = tl.load(zero_ptrs + g, mask=load_ok, other=0.0).to(tl.float32)
            wg = round_to(p * sg[None, :], tl.bfloat16, EMU)
            if g == 1:
                acc1 = mma(wg, scaled_codes(b, 1, MODE), acc1, EMU)
                zw1 += tl.sum(p * zg[None, :], axis=1)
            elif g == 2:
                acc2 = mma(wg, scaled_codes(b, 2, MODE), acc2, EMU)
                zw2 += tl.sum(p * zg[None, :], axis=1)
            else:
                acc3 = mma(wg, scaled_codes(b, 3, MODE), acc3, EMU)
                zw3 += tl.sum(p * zg[None, :], axis=1)
    return acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3


@triton.jit
def _exact_logits(qw, row_ptrs, load_ok, EMU: tl.constexpr):
    """[M, BT] fp32 q . k over exact rows: qw [M, D] (row dtype), row_ptrs [BT] -> channel 0."""
    cols = tl.arange(0, qw.shape[1])
    k = tl.load(row_ptrs[:, None] + cols[None, :], mask=load_ok[:, None], other=0.0)
    return mma(qw, tl.trans(round_to(k, qw.dtype, EMU)), tl.zeros([qw.shape[0], row_ptrs.shape[0]], tl.float32), EMU)


@triton.jit
def _exact_values(p, acc0, acc1, acc2, acc3, row_ptrs, load_ok, Q: tl.constexpr, MODE: tl.constexpr,
                  ROW_T: tl.constexpr, EMU: tl.constexpr):
    """acc_p += F_p * p @ V[:, plane p] over exact rows (p: fp32 [M, BT], 0 where unused)."""
    pw = round_to(p, ROW_T, EMU)
    cols = tl.arange(0, Q)
    v0 = tl.load(row_ptrs[:, None] + cols[None, :], mask=load_ok[:, None], other=0.0).to(ROW_T)
    v1 = tl.load(row_ptrs[:, None] + Q + cols[None, :], mask=load_ok[:, None], other=0.0).to(ROW_T)
    v2 = tl.load(row_ptrs[:, None] + 2 * Q + cols[None, :], mask=load_ok[:, None], other=0.0).to(ROW_T)
    v3 = tl.load(row_ptrs[:, None] + 3 * Q + cols[None, :], mask=load_ok[:, None], other=0.0).to(ROW_T)
    acc0 += plane_factor(0, MODE) * mma(pw, v0, tl.zeros([pw.shape[0], Q], tl.float32), EMU)
    acc1 += plane_factor(1, MODE) * mma(pw, v1, tl.zeros([pw.shape[0], Q], tl.float32), EMU)
    acc2 += plane_factor(2, MODE) * mma(pw, v2, tl.zeros([pw.shape[0], Q], tl.float32), EMU)
    acc3 += plane_factor(3, MODE) * mma(pw, v3, tl.zeros([pw.shape[0], Q], tl.float32), EMU)
    return acc0, acc1, acc2, acc3


@triton.jit
def _softmax_step(logits, m_i, l_i):
    """Online softmax update in base 2: returns (p, alpha, m_new, l_new); rows all -inf stay 0."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(logits - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def attention_kernel(
    q_ptr, stride_qt, stride_qh,
    kn_ptr, vn_ptr, stride_nt, stride_nh,
    cache_ptr, stride_cb, stride_ch,
    wk_ptr, wv_ptr, stride_w0, stride_w1, stride_w2,
    bt_ptr, wbt_ptr, stride_bt,
    seq_ptr, qsl_ptr,
    out_ptr, stride_ot, stride_oh, stride_os,
    lse_ptr, stride_lt, stride_lh,
    sink, recent, qk_scale,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, M: tl.constexpr,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr,
    BLOCK_T: tl.constexpr, SAME_BLOCK: tl.constexpr, NSPLIT: tl.constexpr, DECODE: tl.constexpr, MODE: tl.constexpr,
    WIN_T: tl.constexpr, NEW_T: tl.constexpr, EMU: tl.constexpr,
    NSINK: tl.constexpr, CHUNK_FROM_CACHE: tl.constexpr, PSPLIT: tl.constexpr = 1, PART: tl.constexpr = 0,
    SLOT0: tl.constexpr = 0,
):
    """See module docstring. Decode writes partials (out: [B, Hq, NSPLIT+2, D] fp32, lse:
    [B, Hq, NSPLIT+2]); prefill writes out[token, head, :] directly (out dtype), or with PSPLIT > 1
    partials (out: [T, Hq, PSPLIT, D] fp32, lse: [T, Hq, PSPLIT]). Decode runs here only
    when the INT2 history cannot take triton_decode_int2 (several groups per row, or tokens_on_m off)."""
    Q: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    PARAM: tl.constexpr = D // G  # scale entries per (token, head)
    pid = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    split = 0
    if not DECODE:  # prefill: query tile pid // PSPLIT, split pid % PSPLIT of its pure-INT2 range
        split = pid % PSPLIT
        pid = pid // PSPLIT

    length = tl.load(seq_ptr + b)
    if DECODE:
        q_start = b
        n_new = 1
        tile_tok = 0
        prefix = length
    else:
        q_start = tl.load(qsl_ptr + b)
        n_new = tl.load(qsl_ptr + b + 1) - q_start
        tile_tok = pid * BLOCK_M
        if CHUNK_FROM_CACHE:
            prefix = length  # the chunk's rows are read from the caches too, by the rule
        else:
            prefix = length - n_new
    if tile_tok >= n_new:
        return

    rows = tl.arange(0, M)
    tok = tile_tok + rows // GP
    head_in_group = rows % GP
    row_ok = (head_in_group < GROUP) & (tok < n_new) & (rows // GP < BLOCK_M)
    head = h * GROUP + head_in_group
    position = length - n_new + tok  # decode: the current token, length - 1
    q_row = q_ptr + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    cols = tl.arange(0, Q)
    qf0 = tl.load(q_row[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qf1 = tl.load(q_row[:, None] + Q + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qf2 = tl.load(q_row[:, None] + 2 * Q + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    qf3 = tl.load(q_row[:, None] + 3 * Q + cols[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    # INT2 operands: bf16 planes divided by F_p (exact) and their plain sums.
    q0 = round_to(round_to(qf0, tl.bfloat16, EMU).to(tl.float32) / plane_factor(0, MODE), tl.bfloat16, EMU)
    q1 = round_to(round_to(qf1, tl.bfloat16, EMU).to(tl.float32) / plane_factor(1, MODE), tl.bfloat16, EMU)
    q2 = round_to(round_to(qf2, tl.bfloat16, EMU).to(tl.float32) / plane_factor(2, MODE), tl.bfloat16, EMU)
    q3 = round_to(round_to(qf3, tl.bfloat16, EMU).to(tl.float32) / plane_factor(3, MODE), tl.bfloat16, EMU)
    qo0 = tl.sum(round_to(qf0, tl.bfloat16, EMU).to(tl.float32), axis=1)
    qo1 = tl.sum(round_to(qf1, tl.bfloat16, EMU).to(tl.float32), axis=1)
    qo2 = tl.sum(round_to(qf2, tl.bfloat16, EMU).to(tl.float32), axis=1)
    qo3 = tl.sum(round_to(qf3, tl.bfloat16, EMU).to(tl.float32), axis=1)
    dcols = tl.arange(0, D)
    q_full = tl.load(q_row[:, None] + dcols[None, :], mask=row_ok[:, None], other=0.0)
    q_win = round_to(q_full, WIN_T, EMU)

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc0 = tl.zeros([M, Q], tl.float32)
    acc1 = tl.zeros([M, Q], tl.float32)
    acc2 = tl.zeros([M, Q], tl.float32)
    acc3 = tl.zeros([M, Q], tl.float32)
    zw0 = tl.zeros([M], tl.float32)
    zw1 = tl.zeros([M], tl.float32)
    zw2 = tl.zeros([M], tl.float32)
    zw3 = tl.zeros([M], tl.float32)

    head_base = cache_ptr + h * stride_ch
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    wbt_row = wbt_ptr + b.to(tl.int64) * stride_bt
    offs_t = tl.arange(0, BLOCK_T)

    # Ranges. Positions s < prefix are cached. sink_end = min(sink, prefix).
    sink_end = tl.minimum(sink, prefix)
    t_min = tl.min(tl.where(row_ok, position, 2147483647), axis=0)
    seen_end = tl.max(tl.where(row_ok, position, -1), axis=0) + 1  # no row sees a cached position >= this
    # pure INT2 for every row: s <= t_min - recent and s >= sink
    int2_end = tl.maximum(sink_end, tl.minimum(prefix, t_min - recent + 1))
    if DECODE:
        int2_end = tl.maximum(sink_end, length - recent)

    run_int2 = True
    run_sink = True
    run_recent = True
    int2_first = (sink_end // BLOCK_T) * BLOCK_T
    n_int2_tiles = tl.cdiv(int2_end - int2_first, BLOCK_T)
    n_int2_tiles = tl.where(int2_end > sink_end, n_int2_tiles, 0)
    tile_lo = 0
    tile_hi = n_int2_tiles
    if DECODE:
        per_split = tl.cdiv(n_int2_tiles, NSPLIT)
        tile_lo = tl.minimum(pid * per_split, n_int2_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, n_int2_tiles)
        run_int2 = pid < NSPLIT
        run_sink = (pid >= NSPLIT) & (pid < NSPLIT + NSINK)
        run_recent = pid >= NSPLIT + NSINK
    elif PSPLIT > 1:  # the last split also takes the windows and the chunk's own rows
        per_split = tl.cdiv(n_int2_tiles, PSPLIT)
        tile_lo = tl.minimum(split * per_split, n_int2_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, n_int2_tiles)
        run_sink = split == PSPLIT - 1
        run_recent = split == PSPLIT - 1
    if PART == 1:  # prefill, pure INT2 prefix only (compiled without the window and chunk loops)
        run_sink = False
        run_recent = False
    if PART == 2:  # prefill, everything but the pure INT2 prefix
        run_int2 = False

    if run_int2:
        for i in range(tile_lo, tile_hi):
            s = int2_first + i * BLOCK_T + offs_t
            ok = (s >= sink_end) & (s < int2_end)
            if SAME_BLOCK:
                blk = tl.load(bt_row + (int2_first + i * BLOCK_T) // BS).to(tl.int64)
                base = head_base + blk * stride_cb
                slot = (int2_first + i * BLOCK_T) % BS + offs_t
                k_codes = base + K_CODES + slot[:, None] * Q + cols[None, :]
                v_codes = base + V_CODES + slot[:, None] * Q + cols[None, :]
                ks = (base + K_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                kz = (base + K_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vs = (base + V_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vz = (base + V_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
            else:
                blk = tl.load(bt_row + s // BS, mask=ok, other=0).to(tl.int64)
                base = head_base + blk * stride_cb
                slot = s % BS
                k_codes = base[:, None] + K_CODES + slot[:, None] * Q + cols[None, :]
                v_codes = base[:, None] + V_CODES + slot[:, None] * Q + cols[None, :]
                ks = (base + K_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                kz = (base + K_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vs = (base + V_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vz = (base + V_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
            logits = _int2_logits(q0, q1, q2, q3, qo0, qo1, qo2, qo3,
                                  k_codes, ks, kz, ok, NG, MODE, EMU)
            logits = tl.where(ok[None, :], logits * qk_scale, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
            acc0 *= alpha[:, None]
            acc1 *= alpha[:, None]
            acc2 *= alpha[:, None]
            acc3 *= alpha[:, None]
            zw0 *= alpha
            zw1 *= alpha
            zw2 *= alpha
            zw3 *= alpha
            acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3 = _int2_values(
                p, acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3,
                v_codes, vs, vz, ok, NG, MODE, EMU)

    # Mixed tiles: [0, sink_end) and [int2_end, prefix) (decode: int2_end..length), causally cut at
    # seen_end (prefill reading its chunk from the cache: tiles above every row's diagonal are skipped).
    for part in tl.static_range(2):
        if part == 0:
            lo = 0
            hi = tl.minimum(sink_end, seen_end)
            active = run_sink
        else:
            lo = int2_end
            hi = tl.minimum(prefix, seen_end)
            active = run_recent
        if active:
            first = (lo // BLOCK_T) * BLOCK_T
            last = hi
            if DECODE:  # one tile per window program: tile (pid - first window pid) of this part
                tile = pid - NSPLIT - part * NSINK
                first = first + tile * BLOCK_T
                last = tl.minimum(hi, first + BLOCK_T)
            for t0 in range(first, last, BLOCK_T):
                s = t0 + offs_t
                ok = (s >= lo) & (s < hi)
                blk = tl.load(bt_row + s // BS, mask=ok, other=0).to(tl.int64)
                wblk = tl.load(wbt_row + s // BS, mask=ok, other=-1)
                has_copy = ok & (wblk >= 0)
                window = (s[None, :] < sink) | (s[None, :] > position[:, None] - recent)
                use_w = has_copy[None, :] & window  # [M, BT]
                base = head_base + blk * stride_cb
                slot = s % BS
                k_codes = base[:, None] + K_CODES + slot[:, None] * Q + cols[None, :]
                v_codes = base[:, None] + V_CODES + slot[:, None] * Q + cols[None, :]
                ks = (base + K_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                kz = (base + K_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vs = (base + V_SCALE).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                vz = (base + V_ZERO).to(tl.pointer_type(SCALE_T)) + slot * PARAM
                wrow = (tl.where(has_copy, wblk, 0).to(tl.int64) * stride_w0 + slot * stride_w1 + h * stride_w2)
                logit_i = _int2_logits(q0, q1, q2, q3, qo0, qo1, qo2, qo3,
                                       k_codes, ks, kz, ok, NG, MODE, EMU)
                logit_w = _exact_logits(q_win, wk_ptr + wrow, has_copy, EMU)
                logits = tl.where(use_w, logit_w, logit_i)
                visible = ok[None, :] & (s[None, :] <= position[:, None])  # causal (chunk from cache)
                logits = tl.where(visible, logits * qk_scale, float("-inf"))
                p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
                acc0 *= alpha[:, None]
                acc1 *= alpha[:, None]
                acc2 *= alpha[:, None]
                acc3 *= alpha[:, None]
                zw0 *= alpha
                zw1 *= alpha
                zw2 *= alpha
                zw3 *= alpha
                acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3 = _int2_values(
                    tl.where(use_w, 0.0, p), acc0, acc1, acc2, acc3, zw0, zw1, zw2, zw3,
                    v_codes, vs, vz, ok, NG, MODE, EMU)
                acc0, acc1, acc2, acc3 = _exact_values(tl.where(use_w, p, 0.0), acc0, acc1, acc2, acc3,
                                                       wv_ptr + wrow, has_copy, Q, MODE, WIN_T, EMU)

    if (not DECODE) and (not CHUNK_FROM_CACHE) and (PART != 1) and (split == PSPLIT - 1):
        # The chunk's own rows, causally: key j sits at position prefix + j.
        new_hi = tl.minimum(n_new, tile_tok + BLOCK_M)
        for j0 in range(0, new_hi, BLOCK_T):
            j = j0 + offs_t
            ok = j < new_hi
            nrow = (q_start + j).to(tl.int64) * stride_nt + h * stride_nh
            logits = _exact_logits(round_to(q_full, NEW_T, EMU), kn_ptr + nrow, ok, EMU)
            causal = ok[None, :] & ((prefix + j)[None, :] <= position[:, None])
            logits = tl.where(causal, logits * qk_scale, float("-inf"))
            p, alpha, m_i, l_i = _softmax_step(logits, m_i, l_i)
            acc0 *= alpha[:, None]
            acc1 *= alpha[:, None]
            acc2 *= alpha[:, None]
            acc3 *= alpha[:, None]
            zw0 *= alpha
            zw1 *= alpha
            zw2 *= alpha
            zw3 *= alpha
            acc0, acc1, acc2, acc3 = _exact_values(p, acc0, acc1, acc2, acc3, vn_ptr + nrow, ok, Q, MODE, NEW_T, EMU)

    # Finish: remove bias and plane factors, normalise.
    inv_l = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)  # no 1 / 0 even unselected
    o0 = (acc0 / plane_factor(0, MODE) + zw0[:, None]) * inv_l[:, None]
    o1 = (acc1 / plane_factor(1, MODE) + zw1[:, None]) * inv_l[:, None]
    o2 = (acc2 / plane_factor(2, MODE) + zw2[:, None]) * inv_l[:, None]
    o3 = (acc3 / plane_factor(3, MODE) + zw3[:, None]) * inv_l[:, None]
    if DECODE or PSPLIT > 1 or PART != 0:  # a partial (normalised output, log2-sum-exp) in its row's slot
        if DECODE:
            p_row = b.to(tl.int64)
            slot = pid
        else:
            p_row = (q_start + tok).to(tl.int64)
            slot = SLOT0 + split
        o_row = out_ptr + p_row * stride_ot + head * stride_oh + slot * stride_os
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + p_row * stride_lt + head * stride_lh + slot, lse, mask=row_ok)
    else:
        o_row = out_ptr + (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    o_ty = out_ptr.dtype.element_ty
    tl.store(o_row[:, None] + cols[None, :], round_to(o0, o_ty, EMU), mask=row_ok[:, None])
    tl.store(o_row[:, None] + Q + cols[None, :], round_to(o1, o_ty, EMU), mask=row_ok[:, None])
    tl.store(o_row[:, None] + 2 * Q + cols[None, :], round_to(o2, o_ty, EMU), mask=row_ok[:, None])
    tl.store(o_row[:, None] + 3 * Q + cols[None, :], round_to(o3, o_ty, EMU), mask=row_ok[:, None])


@triton.jit
def merge_kernel(part_ptr, stride_pb, stride_ph, stride_ps, lse_ptr, stride_lb, stride_lh,
                 out_ptr, stride_ob, stride_oh, NS: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr,
                 EMU: tl.constexpr, BLOCK_D: tl.constexpr = None, WAIT_PRIOR: tl.constexpr = False,
                 ZERO_EMPTY: tl.constexpr = False, TRIGGER_DEPENDENTS: tl.constexpr = False):
    """out[b, h] = sum_i 2^(lse_i - max) o_i / sum_i 2^(lse_i - max) over the NS partials; an empty partial
    (lse -inf, weight 0) is not read. Rows whose partials are all empty are not written (ZERO_EMPTY: they
    get zeros, as a decode row of seq_len 0, a CUDA graph's padding, must).

    Grid (B, Hq, D / BLOCK_D): program (b, h, c) merges channels [c * BLOCK_D, (c + 1) * BLOCK_D)
    (BLOCK_D None = D: one program per head; a [NSP, D] fp32 tile spills past ~128 partials).
    WAIT_PRIOR (a launch with programmatic dependent launch): wait for the kernel that wrote the
    partials to finish (griddepcontrol.wait) before reading anything. TRIGGER_DEPENDENTS: let the next launch
    (the output rotation, launched with programmatic dependent launch) start as this one begins."""
    if TRIGGER_DEPENDENTS:
        gdc_launch_dependents()
    if WAIT_PRIOR:
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    idx = tl.arange(0, NSP)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + idx, mask=idx < NS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    if BLOCK_D is None:
        cols = tl.arange(0, D)
    else:
        cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    parts = tl.load(part_ptr + b.to(tl.int64) * stride_pb + h * stride_ph + idx[:, None] * stride_ps + cols[None, :],
                    mask=(lse > float("-inf"))[:, None], other=0.0)  # empty partials (weight 0) are not read
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + cols, round_to(out, out_ptr.dtype.element_ty, EMU),
             mask=(total + 0.0 * cols > 0.0) | ZERO_EMPTY)  # else a row with no partial (a prefill row of no
    # request) stays
