"""Experiment (docs/notes/kernels.md, G1): the INT2 split programs of int2_split_kernel written in Gluon with explicit
MMA operand layouts, so that no operand goes through shared memory.

Scope: the int8-key split programs only (FULL_TILES; tiles of 64 positions = one cache block of 64; one group per
row, fp16 scales; GQA group <= 4; head_dim 64 or 128). The window programs and the merge stay Triton. It writes the
same partials (normalised output + log2-sum-exp per split) as int2_split_kernel's programs pid < NSPLIT, so
bench/gluon_probe.py can compare both on the same cache and time them side by side. GPU only (Gluon does not run
under TRITON_INTERPRET=1).

Orientation (heads on the MMA's M side, positions on N; the reverse of int2_split_kernel):

    S [16, 64] int32   = Q8 [16, D] int8 (row r: head r % 4) @ codes^T [D, 64]     (int8 m16n8k32, 4 or 2 k-steps)
    W [8, 64]          = bf16(p * v_scale) in rows 0..3, bf16(p * v_offset) in rows 4..7   (p from rows 0..7 of S)
    acc [D, 8] fp32   += (BIAS + F code_v)^T [D, 64] @ W^T [64, 8]                  (bf16 m16n8k16)
    sums [16, 8] fp32 += ones [16, 64] @ W^T                                         (column sums: sw, zw)

The accumulator layout of S gives each lane the positions that the B operand W^T of the V product needs in the same
lane (the FlashAttention-2 register reuse), so W never moves between lanes. Every other operand is loaded straight
into its MMA layout: a logical position n of the tile maps to the physical position POS(n) = 16 ((n % 8) // 2) +
2 (n // 8) + n % 2, which gives lane (gid, tig) the 16 consecutive positions 16 tig .. 16 tig + 15 in the V operand
and the scales, and a key code row as one 8-byte (head_dim 128) or 4-byte (64) load; the MMA's K index (channels)
and M index of the V product (channels) are permuted the same way on both operands, and undone at the store.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

#: The mma.sync accumulator layout of one warp (m16n8).
MMA = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
#: int8 operands (four per 32-bit register): the query [16, 32] and the key codes^T [32, 64].
QUERY_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
KEY_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
#: bf16 operands (two per register): V codes^T [D, 64] (or ones [16, 64]) and the weights W^T [64, 8].
VALUE_OP = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
WEIGHT_OP = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
#: A tile's per-position scales as stored: lane (gid, tig) holds physical positions 16 tig .. 16 tig + 15 (two
#: 16-byte loads), the same in every gid; [8, 64] with row r = gid for the V weights' scale/offset rows.
PHYS = gl.DistributedLinearLayout(reg_bases=[[1], [2], [4], [8]], lane_bases=[[16], [32], [0], [0], [0]],
                                  warp_bases=[], block_bases=[], shape=[64])
PHYS_ROWS = gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]],
                                       lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                                       warp_bases=[], block_bases=[], shape=[8, 64])
#: One 128-byte L2 prefetch per element: two per lane cover a (block, head) region of up to 8 KB.
LINES = gl.BlockedLayout([2], [32], [1], [0])
PREFETCH_LINE: gl.constexpr = gl.constexpr(128)
#: Small epilogue vectors.
EPI = gl.BlockedLayout([1, 1], [4, 8], [1, 1], [1, 0])

TILE: gl.constexpr = gl.constexpr(64)
RESCALE_SLACK: gl.constexpr = gl.constexpr(8.0)
INT8_QUERY_MAX: gl.constexpr = gl.constexpr(127.0)
BIAS: gl.constexpr = gl.constexpr(128.0)


@gluon.jit
def _pos(n):
    """Physical position in the tile of logical tile column n (module docstring)."""
    return 16 * ((n % 8) // 2) + 2 * (n // 8) + n % 2


@gluon.jit
def _plane_codes(raw, P: gl.constexpr):
    """uint8 packed bytes -> int8 codes (0..3) of plane P, four per and.b32."""
    if P == 0:
        asm: gl.constexpr = "and.b32 $0, $1, 0x03030303;"
    elif P == 1:
        asm: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, 2; and.b32 $0, t, 0x03030303; }"
    elif P == 2:
        asm: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x03030303; }"
    else:
        asm: gl.constexpr = "{ .reg .b32 t; shr.b32 t, $1, 6; and.b32 $0, t, 0x03030303; }"
    return gl.inline_asm_elementwise(asm, "=r,r", [raw], dtype=gl.int8, is_pure=True, pack=4)


@gluon.jit
def _key_raw(base, Q: gl.constexpr):
    """The tile's packed key codes, [4 (tig), W, 64 (logical position)] uint8 with W = 8 (Q = 32) or 4 (Q = 16):
    lane (gid, tig) holds bytes W tig .. W tig + W - 1 of the positions POS(gid + 8 j), one load each."""
    W: gl.constexpr = 8 if Q == 32 else 4
    L: gl.constexpr = gl.BlockedLayout([1, W, 1], [4, 1, 8], [1, 1, 1], [1, 0, 2])
    t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
    i = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
    n = gl.arange(0, TILE, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
    return gl.load(base + (t * W)[:, None, None] + i[None, :, None] + (_pos(n) * Q)[None, None, :])


@gluon.jit
def _key_operand(raw, S: gl.constexpr, Q: gl.constexpr):
    """K step S of the logits' B operand [32, 64] int8 (KEY_OP). Q = 32: plane S, logical channel c = byte
    8 ((c % 16) // 4) + 4 (c // 16) + c % 4; Q = 16: planes 2 S (c < 16) and 2 S + 1, byte c % 16."""
    if Q == 32:
        codes = gl.reshape(_plane_codes(raw, S), [4, 2, 4, TILE])
        op = gl.reshape(gl.permute(codes, [1, 0, 2, 3]), [32, TILE])
    else:
        both = gl.join(_plane_codes(raw, 2 * S), _plane_codes(raw, 2 * S + 1))  # [4, 4, 64, 2]
        op = gl.reshape(gl.permute(both, [3, 0, 1, 2]), [32, TILE])
    return gl.convert_layout(op, KEY_OP, assert_trivial=True)


@gluon.jit
def _query_step(q_rows, jok, S: gl.constexpr, Q: gl.constexpr):
    """The query values of K step S as _key_operand orders the channels: [16, 32] fp32 in QUERY_OP."""
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, QUERY_OP))
    if Q == 32:
        chan = S * Q + 8 * ((c % 16) // 4) + 4 * (c // 16) + c % 4
    else:
        chan = (2 * S + c // 16) * Q + c % 16
    return gl.load(q_rows[:, None] + chan[None, :], mask=jok[:, None], other=0.0).to(gl.float32)


@gluon.jit
def _to_int8(x, inv_scale):
    return gl.floor(x * inv_scale[:, None] + 0.5).to(gl.int8)


@gluon.jit
def _value_raw(base, Q: gl.constexpr):
    """The tile's V byte pairs as int16, lane (gid, tig) holding positions 16 tig .. 16 tig + 15 (r) of the pairs
    2 gid, 2 gid + 1 (Q = 32: [4, 16, 8, 2], loaded as one word per position) or gid (Q = 16: [4, 16, 8]),
    converted so that consecutive positions sit side by side in registers (the V operand pairs positions)."""
    if Q == 32:
        LOADED: gl.constexpr = gl.BlockedLayout([1, 16, 1, 2], [4, 1, 8, 1], [1, 1, 1, 1], [3, 1, 0, 2])
        PAIRED: gl.constexpr = gl.BlockedLayout([1, 16, 1, 2], [4, 1, 8, 1], [1, 1, 1, 1], [1, 3, 0, 2])
        t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LOADED))))
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LOADED))))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LOADED))))
        jj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LOADED))))
        offs = (((16 * t)[:, None] + r[None, :]) * (Q // 2))[:, :, None, None] + (2 * g)[None, None, :, None] \
            + jj[None, None, None, :]
        return gl.convert_layout(gl.load(base + offs), PAIRED)
    else:
        LOADED: gl.constexpr = gl.BlockedLayout([1, 16, 1], [4, 1, 8], [1, 1, 1], [1, 0, 2])
        t = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, LOADED)))
        r = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, LOADED)))
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LOADED)))
        return gl.load(base + (((16 * t)[:, None] + r[None, :]) * (Q // 2))[:, :, None] + g[None, None, :])


@gluon.jit
def _value_operand(pairs, Q: gl.constexpr):
    """(BIAS + F_P code)^T [D, 64] bf16 in VALUE_OP from _value_raw's pairs: row m = (2 P + parity) (Q / 2) + jl
    (channel P Q + 2 pair + parity, pair = 2 (jl % 8) + jl // 8 at Q = 32, jl at Q = 16), column = the logical
    position whose physical position is r's (module docstring). F_P = 1, 4, 16, 16 as triton_common's PTX unpack."""
    p0e, p0o, p1e, p1o, p2e, p2o, p3e, p3o = gl.inline_asm_elementwise(
        "{ .reg .b32 o, e3, o3, x; mov.b32 x, 0x43004300; shr.b32 o, $8, 8; shr.b32 e3, $8, 2; shr.b32 o3, $8, 10; "
        "lop3.b32 $0, $8, 0x00030003, x, 0xEA; lop3.b32 $1, o, 0x00030003, x, 0xEA; "
        "lop3.b32 $2, $8, 0x000C000C, x, 0xEA; lop3.b32 $3, o, 0x000C000C, x, 0xEA; "
        "lop3.b32 $4, $8, 0x00300030, x, 0xEA; lop3.b32 $5, o, 0x00300030, x, 0xEA; "
        "lop3.b32 $6, e3, 0x00300030, x, 0xEA; lop3.b32 $7, o3, 0x00300030, x, 0xEA; }",
        "=r,=r,=r,=r,=r,=r,=r,=r,r", [pairs], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=2)
    x = gl.join(gl.join(gl.join(p0e, p0o), gl.join(p1e, p1o)), gl.join(gl.join(p2e, p2o), gl.join(p3e, p3o)))
    D: gl.constexpr = 4 * Q
    if Q == 32:  # [tig, r, g, jj, par, Pb0, Pb1] -> [tig, kk, h, e, g, jj, par, Pb0, Pb1]
        x = gl.reshape(x, [4, 4, 2, 2, 8, 2, 2, 2, 2])
        x = gl.permute(x, [8, 7, 6, 5, 4, 1, 2, 0, 3])
    else:  # [tig, r, g, par, Pb0, Pb1] -> [tig, kk, h, e, g, par, Pb0, Pb1]
        x = gl.reshape(x, [4, 4, 2, 2, 8, 2, 2, 2])
        x = gl.permute(x, [7, 6, 5, 4, 1, 2, 0, 3])
    return gl.convert_layout(gl.reshape(x, [D, TILE]), VALUE_OP, assert_trivial=True)


@gluon.jit
def _logical_columns(x):
    """A tile's last axis from physical positions (16 tig + 2 j + e) to logical columns (8 j + 2 tig + e)."""
    if len(x.shape) == 1:
        return gl.reshape(gl.permute(gl.reshape(x, [4, 8, 2]), [1, 0, 2]), [TILE])
    else:
        rows: gl.constexpr = x.shape[0]
        return gl.reshape(gl.permute(gl.reshape(x, [rows, 4, 8, 2]), [0, 2, 1, 3]), [rows, TILE])


@gluon.jit
def _scales_raw(ptr):
    """One scale plane of the tile ([64] fp16 at ptr) as stored (PHYS)."""
    return gl.load(ptr.to(gl.pointer_type(gl.float16)) + gl.arange(0, TILE, layout=PHYS))


@gluon.jit
def _scales(raw, COL: gl.constexpr):
    """_scales_raw's plane as fp32 by logical column, in layout COL."""
    return gl.convert_layout(_logical_columns(raw), COL, assert_trivial=True).to(gl.float32)


@gluon.jit
def _first_rows(x):
    """Rows 0..7 of a [16, N] MMA-layout tensor (the lane's row gid; rows 8..15 repeat them here)."""
    top, _ = gl.split(gl.permute(gl.reshape(x, [2, 8, x.shape[1]]), [1, 2, 0]))
    return top


@gluon.jit
def _prefetch_region(head_base, bt_row, stride_cb, t0, live, BS: gl.constexpr, REGION: gl.constexpr):
    """prefetch.global.L2 every line of the (block, head) region holding position t0 (nothing unless live)."""
    blk = gl.load(bt_row + t0 // BS, mask=live, other=0).to(gl.int64)
    line = gl.arange(0, 64, layout=LINES)
    addr = (head_base + blk * stride_cb + line * PREFETCH_LINE).to(gl.int64, bitcast=True)
    want = ((line * PREFETCH_LINE < REGION) & live).to(gl.int32)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [addr, want], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _row_values(v, zero_s):
    """A per-row [16] vector (rows r -> head r % 4) as [8] in the row layout of _first_rows' tensors."""
    full = gl.convert_layout(v, gl.SliceLayout(1, MMA))[:, None] + zero_s.to(gl.float32)
    return gl.max(_first_rows(full), axis=1)


@gluon.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", "NSPLIT"])
def gluon_split_kernel(
    q_ptr, stride_qb, stride_qh,
    cache_ptr, stride_cb, stride_ch,
    bt_ptr, stride_bt, seq_ptr,
    part_ptr, stride_pb, stride_ph, stride_ps,
    lse_ptr, stride_lb, stride_lh,
    sink, recent, qk_scale, NSPLIT,
    GROUP: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
    K_CODES: gl.constexpr, V_CODES: gl.constexpr, K_SCALE: gl.constexpr, K_ZERO: gl.constexpr,
    V_SCALE: gl.constexpr, V_ZERO: gl.constexpr, MIN_TILES: gl.constexpr, REGION: gl.constexpr,
    PIPELINE: gl.constexpr = False,
):
    """Split pid of (request b, KV head h) over the whole tiles of the pure INT2 range, as int2_split_kernel's
    programs pid < NSPLIT with FULL_TILES; grid (B, Hkv, NSPLIT)."""
    gl.static_assert(BS == TILE, "one tile per cache block of 64 positions")
    gl.static_assert(GROUP <= 4, "GQA groups of at most 4")
    Q: gl.constexpr = D // 4
    STEPS: gl.constexpr = 4 if Q == 32 else 2
    b = gl.program_id(0)
    h = gl.program_id(1)
    pid = gl.program_id(2)
    length = gl.load(seq_ptr + b)
    sink_end = gl.minimum(sink, length)
    int2_end = gl.maximum(sink_end, length - recent)
    first = gl.cdiv(sink_end, TILE) * TILE
    n_tiles = gl.maximum((int2_end // TILE) * TILE - first, 0) // TILE
    per_split = gl.maximum(gl.cdiv(n_tiles, NSPLIT), MIN_TILES)
    lo = gl.minimum(pid * per_split, n_tiles)
    hi = gl.minimum(lo + per_split, n_tiles)

    head_base = cache_ptr + h * stride_ch
    bt_row = bt_ptr + b.to(gl.int64) * stride_bt
    _prefetch_region(head_base, bt_row, stride_cb, first + lo * TILE, lo < hi, BS, REGION)
    # The query as int8 per head row (absmax scale), rows r -> head r % 4, in the K steps' channel order.
    rq = gl.arange(0, 16, layout=gl.SliceLayout(1, QUERY_OP))
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + (h * GROUP + rq % 4) * stride_qh
    jok = rq % 4 < GROUP
    f0 = _query_step(q_rows, jok, 0, Q)
    f1 = _query_step(q_rows, jok, 1, Q)
    amax = gl.maximum(gl.max(gl.abs(f0), axis=1), gl.max(gl.abs(f1), axis=1))
    if STEPS == 4:
        f2 = _query_step(q_rows, jok, 2, Q)
        f3 = _query_step(q_rows, jok, 3, Q)
        amax = gl.maximum(amax, gl.maximum(gl.max(gl.abs(f2), axis=1), gl.max(gl.abs(f3), axis=1)))
    s_q = gl.where(amax > 0.0, amax / INT8_QUERY_MAX, 1.0)
    inv_s = 1.0 / s_q
    a0 = _to_int8(f0, inv_s)
    a1 = _to_int8(f1, inv_s)
    qo16 = gl.sum(a0.to(gl.float32), axis=1) + gl.sum(a1.to(gl.float32), axis=1)
    if STEPS == 4:
        a2 = _to_int8(f2, inv_s)
        a3 = _to_int8(f3, inv_s)
        qo16 += gl.sum(a2.to(gl.float32), axis=1) + gl.sum(a3.to(gl.float32), axis=1)
    else:
        a2 = a0
        a3 = a1
    # Per-row scalars in the layout of the logits' first 8 rows.
    zero_s = gl.full([16, TILE], 0, gl.int32, layout=MMA)
    L8: gl.constexpr = _first_rows(zero_s).type.layout
    ROW: gl.constexpr = gl.SliceLayout(1, L8)
    COL: gl.constexpr = gl.SliceLayout(0, L8)
    qo = _row_values(qo16, zero_s)
    l_scale = _row_values(s_q * qk_scale, zero_s)
    w_plane = gl.where(gl.arange(0, 8, layout=gl.SliceLayout(1, PHYS_ROWS)) < 4, V_SCALE, V_ZERO)
    t_phys = gl.arange(0, TILE, layout=gl.SliceLayout(0, PHYS_ROWS))  # rows 0..3 weigh V by its scale, rows 4..7 by its offset

    m_i = gl.full([8], float("-inf"), gl.float32, layout=ROW)
    l_acc = gl.full([8, TILE], 0.0, gl.float32, layout=L8)
    acc = gl.full([D, 8], 0.0, gl.float32, layout=MMA)
    sums = gl.full([16, 8], 0.0, gl.float32, layout=MMA)
    ones = gl.full([16, TILE], 1.0, gl.bfloat16, layout=VALUE_OP)
    AHEAD: gl.constexpr = 2 if PIPELINE else 1  # tiles between the L2 prefetch and the tile in work
    if PIPELINE:  # the key side of tile lo in registers before the loop (its last tile reloads harmlessly)
        nbase = head_base + gl.load(bt_row + (first + gl.minimum(lo, n_tiles - 1) * TILE) // BS,
                                    mask=lo < hi, other=0).to(gl.int64) * stride_cb
        kraw_n = _key_raw(nbase + K_CODES, Q)
        ks_n = _scales_raw(nbase + K_SCALE)
        kz_n = _scales_raw(nbase + K_ZERO)
    for i in range(lo, hi):
        t0 = first + i * TILE
        _prefetch_region(head_base, bt_row, stride_cb, t0 + AHEAD * TILE, i + AHEAD < hi, BS, REGION)
        base = head_base + gl.load(bt_row + t0 // BS).to(gl.int64) * stride_cb
        if PIPELINE:  # take tile i's key side, load tile i + 1's (clamped to the last) while tile i computes
            kraw = kraw_n
            ks_raw = ks_n
            kz_raw = kz_n
            nbase = head_base + gl.load(bt_row + (first + gl.minimum(i + 1, hi - 1) * TILE) // BS).to(gl.int64) \
                * stride_cb
            kraw_n = _key_raw(nbase + K_CODES, Q)
            ks_n = _scales_raw(nbase + K_SCALE)
            kz_n = _scales_raw(nbase + K_ZERO)
        else:
            kraw = _key_raw(base + K_CODES, Q)
            ks_raw = _scales_raw(base + K_SCALE)
            kz_raw = _scales_raw(base + K_ZERO)
        s = mma_v2(a0, _key_operand(kraw, 0, Q), zero_s)
        s = mma_v2(a1, _key_operand(kraw, 1, Q), s)
        if STEPS == 4:
            s = mma_v2(a2, _key_operand(kraw, 2, Q), s)
            s = mma_v2(a3, _key_operand(kraw, 3, Q), s)
        ks = _scales(ks_raw, COL)
        kz = _scales(kz_raw, COL)
        wsz = gl.load((base + w_plane).to(gl.pointer_type(gl.float16))[:, None] + t_phys[None, :])
        wsz = gl.convert_layout(_logical_columns(wsz), L8, assert_trivial=True).to(gl.float32)
        x = ks[None, :] * _first_rows(s).to(gl.float32) + kz[None, :] * qo[:, None]
        tile_max = gl.max(x, axis=1) * l_scale
        if gl.max(tile_max - m_i, axis=0) > RESCALE_SLACK:
            m_new = gl.maximum(m_i, tile_max)
            alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
            l_acc *= alpha[:, None]
            alpha_c = gl.convert_layout(alpha, gl.SliceLayout(0, MMA))
            acc *= alpha_c[None, :]
            sums *= alpha_c[None, :]
            m_i = m_new
        p = gl.exp2(x * l_scale[:, None] - gl.where(m_i == float("-inf"), 0.0, m_i)[:, None])
        l_acc += p
        w = gl.convert_layout(gl.permute((p * wsz).to(gl.bfloat16), [1, 0]), WEIGHT_OP, assert_trivial=True)
        sums = mma_v2(ones, w, sums)
        acc = mma_v2(_value_operand(_value_raw((base + V_CODES).to(gl.pointer_type(gl.int16)), Q), Q), w, acc)

    # Epilogue: per head j (columns 0..3): sw = sums column j, zw = sums column j + 4, l, m from rows j.
    total = gl.convert_layout(gl.max(sums, axis=0), gl.SliceLayout(0, EPI))
    ce = gl.arange(0, 8, layout=gl.SliceLayout(0, EPI))
    re = gl.arange(0, 8, layout=gl.SliceLayout(1, EPI))
    zw = gl.sum(gl.where(ce[None, :] == re[:, None] + 4, total[None, :], 0.0), axis=1)
    COLS: gl.constexpr = gl.SliceLayout(0, MMA)
    sw = gl.convert_layout(total, COLS)
    zw = gl.convert_layout(zw, COLS)
    l_i = gl.convert_layout(gl.sum(l_acc, axis=1), COLS)
    m_c = gl.convert_layout(m_i, COLS)
    inv_l = gl.where(l_i > 0.0, 1.0 / gl.where(l_i > 0.0, l_i, 1.0), 0.0)
    j = gl.arange(0, 8, layout=COLS)
    jst = j < GROUP
    m = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    plane = m // Q
    parity = (m // (Q // 2)) % 2
    jl = m % (Q // 2)
    pair = 2 * (jl % 8) + jl // 8 if Q == 32 else jl
    chan = plane * Q + 2 * pair + parity
    factor = gl.where(plane == 0, 1.0, gl.where(plane == 1, 4.0, 16.0))
    out = ((acc - BIAS * sw[None, :]) / factor[:, None] + zw[None, :]) * inv_l[None, :]
    o_ptrs = part_ptr + b.to(gl.int64) * stride_pb + (h * GROUP + j)[None, :] * stride_ph + pid * stride_ps
    gl.store(o_ptrs + chan[:, None], out, mask=jst[None, :])
    lse = gl.where(l_i > 0.0, m_c + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    gl.store(lse_ptr + b * stride_lb + (h * GROUP + j) * stride_lh + pid, lse, mask=jst)
