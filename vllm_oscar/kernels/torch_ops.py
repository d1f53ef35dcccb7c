"""Plain-torch implementations of oscar_write / oscar_decode / oscar_prefill.

The CPU path of the vLLM backend, and a readable statement of what the Triton kernels
compute (contract: docs/design.md, "Kernel API"). Vectorised over tokens, heads and
positions, looped over requests (each request has its own length) and over chunks of
queries (one masked scaled_dot_product_attention each); float32 math, not fast
(bench/cpu_serving.py). The quantizer is the reference one (vllm_oscar.quant), so a CPU
cache holds exactly the codes/scales/offsets the reference math gives for float32 rotated
rows.

Read rule for a query at position t and a cached position s < seq_len:
BF16 (window store) iff ``(s < sink or s > t - recent)`` and the logical block of s has a
window block (``window_block_table >= 0``); INT2 otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from vllm_oscar.config import CODES_PER_BYTE, REFIT_SCALE_FLOOR, TORCH_QUERY_CHUNK, RefitIterations, refit_pair
from vllm_oscar.kernels.checks import (
    check_attention_common,
    check_prefill_extra,
    check_write_args,
    check_write_query,
)
from vllm_oscar.kernels.layout import PageLayout, PageViews, page_views
from vllm_oscar.kernels.rotate import rotate_rows
from vllm_oscar.quant import code_plane, pack_codes, quantize_rows


def _store_int2(
    rows: torch.Tensor,
    clip_ratio: float,
    layout: PageLayout,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    codes_plane: torch.Tensor,
    scale_plane: torch.Tensor,
    offset_plane: torch.Tensor,
    refit_iterations: int,
    refit_floor: bool = False,
) -> None:
    """Clip, quantize (+ grid refit), pack rows [n, Hkv, D] into slots (blocks[i], offsets[i])."""
    quantized = quantize_rows(rows, clip_ratio, layout.group_size, layout.scale_dtype, refit_iterations,
                              refit_floor=refit_floor)
    codes_plane[blocks, :, offsets] = pack_codes(quantized.codes)
    scale_plane[blocks, :, offsets] = quantized.scale
    offset_plane[blocks, :, offsets] = quantized.offset


def oscar_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_rotation: torch.Tensor,
    v_rotation: Optional[torch.Tensor],
    clip_k: float,
    clip_v: float,
    int2_cache: torch.Tensor,
    layout: PageLayout,
    slot_mapping: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_slot_mapping: torch.Tensor,
    value_prerotated: bool = False,
    refit_iterations: RefitIterations = 0,
    refit_floor: tuple[bool, bool] = REFIT_SCALE_FLOOR,
    query: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Rotate, clip, quantize and pack new K/V rows into the INT2 cache; copy window rows.

    Args:
        key, value: [N, Hkv, D] bf16/fp16/fp32 (value already rotated if value_prerotated).
        k_rotation, v_rotation: [Hkv, D, D] float rotations (x_rot = x @ R[h]);
            v_rotation is unused (may be None) when value_prerotated.
        clip_k, clip_v: clip ratios r in (0, 1]: rows are clamped to the r-quantile of |x|
            (order statistic "higher").
        int2_cache: uint8 layout.cache_shape(num_blocks, Hkv); written in place.
        slot_mapping: [N] int, block * block_size + offset, -1 = skip the token.
        window_k, window_v: [num_window_blocks, block_size, Hkv, D] (bf16); the rotated rows
            are stored where window_slot_mapping >= 0.
        window_slot_mapping: [N] int, window_block * block_size + offset, -1 = no BF16 copy.
        refit_iterations: rounds of the least-squares (scale, offset) refit of each group
            against its unclipped rotated values (quant.quantize_rows / refit_grid), starting
            from the clipped min/max grid; 0 = that grid as is; a (K, V) pair sets the two
            sides apart. Same storage either way.
        refit_floor: (keys, values): whether that side's refit may not narrow the grid below
            the clipped min/max scale (quant.refit_grid scale_floor); the served quantizer's
            setting by default (config.REFIT_SCALE_FLOOR: keys floored, values free).
        query: [N, Hq, D] query rows of the same tokens, or None.
    Returns:
        q_rot = query @ R_K per KV head (float32 [N, Hq, D]) when query is given, else None.
    """
    check_write_args(key, value, k_rotation, v_rotation, clip_k, clip_v, int2_cache, layout,
                     slot_mapping, window_k, window_v, window_slot_mapping, value_prerotated)
    if query is not None:
        check_write_query(query, key, k_rotation)
    refit_k, refit_v = refit_pair(refit_iterations)
    k_rot = rotate_rows(key, k_rotation, out_dtype=torch.float32)
    v_rot = value.to(torch.float32) if value_prerotated else rotate_rows(value, v_rotation, out_dtype=torch.float32)
    bs = layout.block_size

    keep = slot_mapping >= 0
    if bool(keep.any()):
        slots = slot_mapping[keep].long()
        blocks, offsets = slots // bs, slots % bs
        if int(blocks.max()) >= int2_cache.shape[0]:
            raise ValueError(f"slot_mapping addresses block {int(blocks.max())} but int2_cache has "
                             f"{int2_cache.shape[0]}.")
        views = page_views(int2_cache, layout)
        _store_int2(k_rot[keep], clip_k, layout, blocks, offsets, views.k_codes, views.k_scale, views.k_offset,
                    refit_k, bool(refit_floor[0]))
        _store_int2(v_rot[keep], clip_v, layout, blocks, offsets, views.v_codes, views.v_scale, views.v_offset,
                    refit_v, bool(refit_floor[1]))

    in_window = window_slot_mapping >= 0
    if bool(in_window.any()):
        slots = window_slot_mapping[in_window].long()
        if int(slots.max()) >= window_k.shape[0] * bs:
            raise ValueError(f"window_slot_mapping addresses slot {int(slots.max())} but the window store has "
                             f"{window_k.shape[0] * bs}.")
        window_k[slots // bs, slots % bs] = k_rot[in_window].to(window_k.dtype)
        window_v[slots // bs, slots % bs] = v_rot[in_window].to(window_v.dtype)
    return None if query is None else rotate_rows(query, k_rotation, out_dtype=torch.float32)


def _dequantized(pages: PageViews, which: str, length: int, layout: PageLayout) -> torch.Tensor:
    """Dequantized K or V rows ('k'/'v') of a request's gathered pages, logical positions [0, length).

    pages: views of the request's pages in head-major order, each plane [Hkv, nb, bs, ...] (_prefix_rows). Returns
    [Hkv, length, D] fp32: code * scale + offset per group, the operations of quant.dequantize (the same values),
    made one code plane (quant.packing: channels [p D/4, (p+1) D/4) in bits 2p) at a time straight into place, with
    no unpacked copy of the codes: a plane lies in one group or holds whole groups (D and G are powers of two).
    """
    codes = getattr(pages, f"{which}_codes")  # [Hkv, nb, bs, D/4] uint8
    scale = getattr(pages, f"{which}_scale").to(torch.float32)  # [Hkv, nb, bs, D/G]
    offset = getattr(pages, f"{which}_offset").to(torch.float32)
    hkv, blocks, bs, quarter = codes.shape
    group = layout.group_size
    rows = torch.empty(hkv, blocks, bs, layout.head_dim, dtype=torch.float32, device=codes.device)
    groups_per_plane = max(1, quarter // group)
    for plane in range(CODES_PER_BYTE):
        first = plane * quarter // group
        plane_codes = code_plane(codes, plane).unflatten(-1, (groups_per_plane, -1))
        target = rows[..., plane * quarter : (plane + 1) * quarter].unflatten(-1, (groups_per_plane, -1))
        torch.mul(plane_codes, scale[..., first : first + groups_per_plane, None], out=target)
        target.add_(offset[..., first : first + groups_per_plane, None])
    return rows.view(hkv, blocks * bs, layout.head_dim)[:, :length]


def _prefix_rows(
    request: int,
    length: int,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both readings of a request's first ``length`` cached positions.

    Returns (k_int2, v_int2 : [Hkv, length, D] fp32, every position; k_copy, v_copy : [Hkv, W, D] fp32, the BF16
    copies of the W positions whose logical block has a window block; copy_positions [W] int64, ascending).
    """
    bs = layout.block_size
    num_blocks = -(-length // bs)
    blocks = block_table[request, :num_blocks].long()
    window_blocks = window_block_table[request, :num_blocks].long()
    # One gather of the request's pages, stored head-major: page_views then reads [Hkv, nb] where it expects
    # [blocks, heads], so every plane comes out [Hkv, nb, bs, ...] and each head's rows are contiguous.
    pages = page_views(int2_cache.index_select(0, blocks).transpose(0, 1).contiguous(), layout)
    k_int2 = _dequantized(pages, "k", length, layout)
    v_int2 = _dequantized(pages, "v", length, layout)
    copy_positions = (window_blocks >= 0).repeat_interleave(bs)[:length].nonzero().squeeze(1)
    # rows of the flattened window store; index_select, not [] indexing: a few us against ~15-20 per gather on CPU
    rows = window_blocks.index_select(0, copy_positions // bs) * bs + copy_positions % bs

    def copies(store: torch.Tensor) -> torch.Tensor:  # [nwb, bs, Hkv, D] -> [Hkv, W, D]
        return store.flatten(0, 1).index_select(0, rows).transpose(0, 1).to(torch.float32)

    return k_int2, v_int2, copies(window_k), copies(window_v), copy_positions


def _attend(
    query: torch.Tensor,
    positions: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    new_k: Optional[torch.Tensor],
    new_v: Optional[torch.Tensor],
    sink: int,
    recent: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Attention of queries [T, Hq, D] at ``positions`` [T] over cached rows and new rows.

    prefix: _prefix_rows output for positions [0, P) (P may be 0); a query at position t sees the cached
    positions s <= t, each read once: its BF16 copy where it has one and is in t's windows (s < sink or
    s > t - recent), its INT2 reading otherwise. new_k/new_v: [T, Hkv, D] rows at positions P..P+T-1, attended
    causally in full precision (None in decode and when the chunk is cached).

    Per chunk of TORCH_QUERY_CHUNK queries, one scaled_dot_product_attention runs over [INT2 rows | BF16 copies |
    new rows] up to the chunk's last position, with a mask that picks exactly one reading of every visible position
    (float32 throughout).
    Returns [T, Hq, D] float32.
    """
    k_int2, v_int2, k_copy, v_copy, copy_positions = prefix
    t, hq, d = query.shape
    hkv, length = k_int2.shape[0], k_int2.shape[1]
    if t == 1 and new_k is None:  # decode: one reading per position, picked before the attention
        return _attend_one(query, int(positions[0]), prefix, sink, recent, softmax_scale)
    new_rows = None if new_k is None else (new_k.transpose(0, 1).to(torch.float32),
                                             new_v.transpose(0, 1).to(torch.float32))  # [Hkv, T, D] each
    q = query.to(torch.float32).transpose(0, 1)[None]  # [1, Hq, T, D]
    cached = torch.arange(length, device=query.device)
    in_sink = cached < sink
    has_copy = torch.zeros(length, dtype=torch.bool, device=query.device)
    has_copy[copy_positions] = True
    out = torch.empty(1, hq, t, d, dtype=torch.float32, device=query.device)
    for start in range(0, t, TORCH_QUERY_CHUNK):
        stop = min(t, start + TORCH_QUERY_CHUNK)
        pos = positions[start:stop, None]
        seen = min(length, int(pos.max()) + 1)  # no query of the chunk sees a cached position past it
        copies = int(torch.searchsorted(copy_positions, seen))
        visible = cached[None, :seen] <= pos  # [c, seen]
        window = in_sink[None, :seen] | (cached[None, :seen] > pos - recent)
        read_copy = visible & window & has_copy[None, :seen]
        keys = [k_int2[:, :seen], k_copy[:, :copies]]
        values = [v_int2[:, :seen], v_copy[:, :copies]]
        mask = [visible & ~read_copy, read_copy[:, copy_positions[:copies]]]
        if new_rows is not None:  # new row j is seen by the chunk's queries i >= j
            keys.append(new_rows[0][:, :stop])
            values.append(new_rows[1][:, :stop])
            rows = torch.arange(stop, device=query.device)
            mask.append(rows[None, :] <= rows[start:stop, None])
        out[:, :, start:stop] = F.scaled_dot_product_attention(
            q[:, :, start:stop], torch.cat(keys, dim=1)[None], torch.cat(values, dim=1)[None],
            attn_mask=torch.cat(mask, dim=1), scale=softmax_scale, enable_gqa=hq != hkv)
    return out[0].transpose(0, 1)


def _attend_one(
    query: torch.Tensor,
    position: int,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    sink: int,
    recent: int,
    softmax_scale: float,
) -> torch.Tensor:
    """_attend for one query [1, Hq, D] at ``position`` over cached rows only: every position's reading (_attend's
    rule) is picked into one [Hkv, P, D] set of rows first, so the attention needs no mask beyond causality. The
    picked copies overwrite the prefix's own INT2 rows in place (no [Hkv, P, D] copy; callers build a prefix per
    call and do not read it afterwards)."""
    k_int2, v_int2, k_copy, v_copy, copy_positions = prefix
    hq, hkv = query.shape[1], k_int2.shape[0]
    picked = ((copy_positions < sink) | (copy_positions > position - recent)).nonzero().squeeze(1)
    rows = copy_positions.index_select(0, picked)
    keys = k_int2.index_copy_(1, rows, k_copy.index_select(1, picked))[None, :, : position + 1]
    values = v_int2.index_copy_(1, rows, v_copy.index_select(1, picked))[None, :, : position + 1]
    out = F.scaled_dot_product_attention(query.to(torch.float32).transpose(0, 1)[None], keys, values,
                                         scale=softmax_scale, enable_gqa=hq != hkv)
    return out[0].transpose(0, 1)


def _finish(result: torch.Tensor, query_rot: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return result.to(query_rot.dtype)
    out.copy_(result)
    return out


def oscar_decode(
    query_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One new token per request attends to its whole cached sequence (itself included).

    Args:
        query_rot: [B, Hq, D] rotated queries (q @ R_K of the query head's KV head).
        int2_cache / window_k / window_v / layout: the caches (see oscar_write).
        block_table, window_block_table: [B, max_blocks] int; the window table gives the
            window block of each logical block, -1 where it has no BF16 copy.
        seq_lens: [B] int >= 0, including the current token (already written); 0 for a padding row
            (a CUDA graph's batch beyond its requests), whose output is zeros.
        sink, recent: BF16 window sizes in tokens; softmax_scale: logit multiplier.
        out: optional [B, Hq, D] result buffer (bf16, fp16 or fp32; default: the query's dtype).
    Returns:
        out_rot [B, Hq, D] (out's dtype, else the query's): attention output in the rotated V basis.
    """
    _, batch = check_attention_common(query_rot, int2_cache, window_k, window_v, layout, block_table,
                                      window_block_table, seq_lens, sink, recent, softmax_scale, out)
    if query_rot.shape[0] != batch:
        raise ValueError(f"query_rot has {query_rot.shape[0]} rows but block_table has {batch} requests.")
    lengths = seq_lens.tolist()
    if any(n < 0 or -(-n // layout.block_size) > block_table.shape[1] for n in lengths):
        raise ValueError(f"seq_lens must be >= 0 and fit block_table ({block_table.shape[1]} blocks); got {lengths}.")
    results = []
    for request, length in enumerate(lengths):
        if length == 0:  # a padding row of a CUDA-graph batch: nothing to attend, zeros (as the kernels)
            results.append(torch.zeros_like(query_rot[request: request + 1], dtype=torch.float32))
            continue
        prefix = _prefix_rows(request, length, int2_cache, window_k, window_v, layout, block_table,
                              window_block_table)
        position = torch.tensor([length - 1], device=query_rot.device)
        results.append(_attend(query_rot[request : request + 1], position, prefix, None, None, sink, recent,
                               softmax_scale))
    return _finish(torch.cat(results, dim=0), query_rot, out)


def oscar_prefill(
    query_rot: torch.Tensor,
    key_rot: torch.Tensor,
    value_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: Optional[torch.Tensor] = None,
    chunk_from_cache: bool = False,
) -> torch.Tensor:
    """A chunk of new tokens per request attends causally to itself and to its cached prefix.

    Args:
        query_rot: [T, Hq, D] rotated queries of all requests' chunks, concatenated.
        key_rot, value_rot: [T, Hkv, D] the chunk's own rotated K/V rows (read exactly).
        query_start_loc: [B+1] int, request b owns rows [qsl[b], qsl[b+1]).
        seq_lens: [B] int: cached prefix + chunk length; the prefix is read from the caches
            by the read rule, position of chunk row i of request b = prefix_b + i.
        chunk_from_cache: the chunk's rows were already written to the caches; read them
            from there by the same rule as the prefix (key_rot = value_rot = None), so the
            result equals decoding the chunk token by token. Default: exact rows, BF16.
        Other arguments as oscar_decode.
    Returns:
        out_rot [T, Hq, D] (out's dtype, else the query's).
    """
    hkv, batch = check_attention_common(query_rot, int2_cache, window_k, window_v, layout, block_table,
                                        window_block_table, seq_lens, sink, recent, softmax_scale, out)
    check_prefill_extra(query_rot, key_rot, value_rot, query_start_loc, hkv, batch, layout.head_dim,
                        chunk_from_cache)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    result = torch.zeros(query_rot.shape, dtype=torch.float32, device=query_rot.device)  # rows of no request stay 0
    for request in range(batch):
        begin, end = starts[request], starts[request + 1]
        chunk, length = end - begin, lengths[request]
        prefix_len = length - chunk
        if (chunk < 0 or prefix_len < 0 or end > query_rot.shape[0]
                or -(-length // layout.block_size) > block_table.shape[1]):
            raise ValueError(
                f"request {request}: query_start_loc [{begin}, {end}) and seq_len {length} are inconsistent "
                f"(need 0 <= chunk <= seq_len, rows within {query_rot.shape[0]}, blocks within {block_table.shape[1]})."
            )
        if chunk == 0:
            continue
        positions = torch.arange(prefix_len, length, device=query_rot.device)
        if chunk_from_cache:
            cached = _prefix_rows(request, length, int2_cache, window_k, window_v, layout, block_table,
                                  window_block_table)
            result[begin:end] = _attend(query_rot[begin:end], positions, cached, None, None, sink, recent,
                                        softmax_scale)
            continue
        prefix = _prefix_rows(request, prefix_len, int2_cache, window_k, window_v, layout, block_table,
                              window_block_table)
        result[begin:end] = _attend(query_rot[begin:end], positions, prefix, key_rot[begin:end],
                                    value_rot[begin:end], sink, recent, softmax_scale)
    return _finish(result, query_rot, out)
