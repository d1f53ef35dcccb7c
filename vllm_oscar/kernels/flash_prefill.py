"""Chunked prefill read back from the caches, as FlashAttention launches over gathered rows (CUDA path).

A chunk row at position t reads each cached position s <= t by the decode read rule: its BF16 window copy when
s < sink or s > t - recent and the block has one, its INT2 reading otherwise. Split a request's positions into two
ranges where the reading no longer depends on the query:

    far   positions [0, L - recent): s < sink reads its copy (INT2 where the block has none), s >= sink INT2.
          Row t sees s <= t - recent: with C queries over L - recent keys that is FlashAttention's bottom-right
          causal mask (key j visible iff j <= i + keys - queries).
    near  positions [max(0, P - recent + 1), L): every position reads its copy (INT2 where the block has none).
          Row t sees t - recent < s <= t: the bottom-right causal mask with a left window of recent - 1.

(L: the request's seq_len, P = L - C its cached prefix.) The two ranges of a row are disjoint and together hold
every s <= t, each read the way the rule reads it. One Triton launch per range gathers the rows (INT2 dequantized,
code * scale + offset per group in fp32, then rounded to the attention's dtype) into packed varlen buffers
[rows, Hkv, D]; PyTorch's FlashAttention varlen kernel (``aten._flash_attention_forward``, which returns the
log-sum-exp) attends to each, and an exact log-sum-exp merge in fp32 combines them. Rows with no far position
(t < recent) take the near part alone. With key segments (KeySplit; flash_plan.CallSize.split_pays), the far
positions every row sees are attended without a mask in several sequences, and only the rest of the far range with
the causal mask.

Numerics against the Triton prefill kernel: the dequantized rows and the query are rounded to bf16 (fp16 where the
window store is fp16) before the MMAs, as that kernel's MMAs round their operands, and each part's output is rounded
to that dtype before the merge.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from vllm_oscar.kernels.flash_plan import PrefillPlan
from vllm_oscar.kernels.layout import PageLayout
from vllm_oscar.kernels.triton_common import TL_DTYPES

#: Positions per gather program.
GATHER_BLOCK = 32
#: Query rows per merge program.
MERGE_BLOCK = 16
#: dtypes PyTorch's FlashAttention kernels take.
FLASH_DTYPES = (torch.bfloat16, torch.float16)

#: attend(q, k, v, cu_q, cu_k, max_q, max_k, scale, left_window, causal) -> (out [Tq, Hq, D] q's dtype, lse [Tq, Hq]
#: fp32, natural log): varlen attention, bottom-right causal with left_window None = unbounded where causal, every
#: key of the sequence where not (FlashAttention's semantics).
VarlenAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float,
                            Optional[int], bool], tuple[torch.Tensor, torch.Tensor]]


@triton.jit
def gather_rows_kernel(
    cache, stride_cb, stride_ch,
    window_k, window_v, stride_wb, stride_wt, stride_wh,
    block_table, window_block_table, stride_bt,
    first_position, counts, row_offsets,
    copy_below,
    out_k, out_v, stride_or, stride_oh,
    D: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, SCALE_T: tl.constexpr,
    K_CODES: tl.constexpr, V_CODES: tl.constexpr, K_SCALE: tl.constexpr, K_ZERO: tl.constexpr,
    V_SCALE: tl.constexpr, V_ZERO: tl.constexpr, BLOCK: tl.constexpr,
):
    """Rows [row_offsets[b] + i] of out_k / out_v (head h) = K / V of position first_position[b] + i, i <
    counts[b], of request b: the window copy where the position < copy_below and its block has a window block,
    else the INT2 reading. Grid (cdiv(max count, BLOCK), B, Hkv)."""
    tile = tl.program_id(0)
    request = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    count = tl.load(counts + request)
    i = tile * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    s = tl.load(first_position + request) + i
    logical = s // BS
    slot = s % BS
    block = tl.load(block_table + request * stride_bt + logical, mask=live, other=0).to(tl.int64)
    window = tl.load(window_block_table + request * stride_bt + logical, mask=live, other=-1).to(tl.int64)
    use_copy = live & (s < copy_below) & (window >= 0)
    use_int2 = live & ~use_copy

    cols = tl.arange(0, D)
    quarter: tl.constexpr = D // 4
    groups: tl.constexpr = D // G
    shift = (2 * (cols // quarter)).to(tl.uint8)  # code plane p holds channels [p D/4, (p+1) D/4) in bits 2p
    base = cache + block * stride_cb + head * stride_ch
    code_at = base[:, None] + slot[:, None] * quarter + (cols % quarter)[None, :]
    param_at = slot[:, None] * groups + (cols // G)[None, :]
    int2_mask = use_int2[:, None]
    copy_at = window[:, None] * stride_wb + slot[:, None] * stride_wt + head * stride_wh + cols[None, :]
    copy_mask = use_copy[:, None]
    out_at = (tl.load(row_offsets + request) + i).to(tl.int64)[:, None] * stride_or + head * stride_oh + cols[None, :]
    out_mask = live[:, None]

    _gather_plane(base, code_at + K_CODES, K_SCALE, K_ZERO, param_at, shift, int2_mask, window_k + copy_at, copy_mask,
                  out_k + out_at, out_mask, SCALE_T)
    _gather_plane(base, code_at + V_CODES, V_SCALE, V_ZERO, param_at, shift, int2_mask, window_v + copy_at, copy_mask,
                  out_v + out_at, out_mask, SCALE_T)


@triton.jit
def _gather_plane(base, codes_at, SCALE: tl.constexpr, ZERO: tl.constexpr, param_at, shift, int2_mask, copy_at,
                  copy_mask, out_at, out_mask, SCALE_T: tl.constexpr):
    """One of K / V for gather_rows_kernel's tile: code * scale + offset (fp32) where int2_mask, the window copy
    where copy_mask, stored in the output's dtype."""
    codes = tl.load(codes_at, mask=int2_mask, other=0)
    scale = tl.load((base + SCALE).to(tl.pointer_type(SCALE_T))[:, None] + param_at, mask=int2_mask, other=0)
    zero = tl.load((base + ZERO).to(tl.pointer_type(SCALE_T))[:, None] + param_at, mask=int2_mask, other=0)
    int2 = ((codes >> shift[None, :]) & 3).to(tl.float32) * scale.to(tl.float32) + zero.to(tl.float32)
    copy = tl.load(copy_at, mask=copy_mask, other=0).to(tl.float32)
    tl.store(out_at, tl.where(copy_mask, copy, int2).to(out_at.dtype.element_ty), mask=out_mask)


@triton.jit
def merge_far_near_kernel(
    far_out, far_lse, near_out, near_lse, out, cu_q, prefix, far_first,
    body_out, body_lse, body_first, body_segments,
    stride_fo, stride_fh, stride_fl, stride_flh, stride_no, stride_nh, stride_nl, stride_nlh, stride_o, stride_oh,
    stride_bo, stride_bh, stride_bl, stride_blh,
    row0, recent,
    D: tl.constexpr, BLOCK: tl.constexpr, HAS_FAR: tl.constexpr, HAS_BODY: tl.constexpr,
):
    """out[row0 + r, h] = the log-sum-exp merge of row r's parts (packed rows; lse natural log, [rows, Hq] with
    strides): the near part; the far part (keys from far_first[b] on, bottom-right causal), where the row's position
    t = prefix[b] + i has t - recent >= far_first[b] (and HAS_FAR); with HAS_BODY, body_segments[b] parts that every
    row of request b sees, the one of segment s at body row body_first[b] + s x chunk + i. Grid (cdiv(max chunk,
    BLOCK), B, Hq)."""
    request = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    begin = tl.load(cu_q + request)
    chunk = tl.load(cu_q + request + 1) - begin
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < chunk
    row = (begin + i).to(tl.int64)
    cols = tl.arange(0, D)
    mask = live[:, None]
    near = tl.load(near_out + row[:, None] * stride_no + head * stride_nh + cols[None, :], mask=mask, other=0)
    merged = near.to(tl.float32)
    if HAS_FAR or HAS_BODY:
        lse_near = tl.load(near_lse + row * stride_nl + head * stride_nlh, mask=live, other=0)
        top = lse_near
        if HAS_FAR:
            sees_far = live & (tl.load(prefix + request) + i - recent >= tl.load(far_first + request))
            lse_far = tl.load(far_lse + row * stride_fl + head * stride_flh, mask=sees_far, other=0)
            top = tl.where(sees_far, tl.maximum(lse_far, top), top)
        if HAS_BODY:
            segments = tl.load(body_segments + request)
            first = tl.load(body_first + request).to(tl.int64)
            for segment in range(0, segments):
                body_row = first + segment * chunk + i
                top = tl.maximum(top, tl.load(body_lse + body_row * stride_bl + head * stride_blh, mask=live,
                                              other=float("-inf")))
        w_near = tl.exp(lse_near - top)
        total = w_near
        merged = merged * w_near[:, None]
        if HAS_FAR:
            w_far = tl.where(sees_far, tl.exp(lse_far - top), 0.0)
            far = tl.load(far_out + row[:, None] * stride_fo + head * stride_fh + cols[None, :],
                          mask=sees_far[:, None], other=0).to(tl.float32)
            merged += far * w_far[:, None]
            total += w_far
        if HAS_BODY:
            for segment in range(0, segments):
                body_row = first + segment * chunk + i
                w_body = tl.exp(tl.load(body_lse + body_row * stride_bl + head * stride_blh, mask=live, other=0)
                                - top)
                body = tl.load(body_out + body_row[:, None] * stride_bo + head * stride_bh + cols[None, :], mask=mask,
                               other=0).to(tl.float32)
                merged += body * w_body[:, None]
                total += w_body
        merged = merged / total[:, None]
    tl.store(out + (row0 + row)[:, None] * stride_o + head * stride_oh + cols[None, :],
             merged.to(out.dtype.element_ty), mask=mask)


@dataclasses.dataclass(frozen=True)
class PagedCaches:
    """What a prefill reads besides its queries: the INT2 pages [blocks, Hkv, layout.head_region_bytes] uint8, the
    BF16 window store K and V [window blocks, block_size, Hkv, D], their layout, and the block tables [B, max_blocks]
    int32 (window_block_table: -1 = no window block, read INT2)."""

    int2: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    layout: PageLayout
    block_table: torch.Tensor
    window_block_table: torch.Tensor


def gather_rows(first: torch.Tensor, count: torch.Tensor, offsets: torch.Tensor, total: int, longest: int,
                copy_below: int, caches: PagedCaches, dtype: torch.dtype, plane_offsets: dict[str, int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V rows [total, Hkv, D] ``dtype`` of positions first[b] + i, i < count[b], request after request at
    offsets[b] (device int32 [B] each; longest = max count), by gather_rows_kernel."""
    layout, int2_cache, window_k = caches.layout, caches.int2, caches.window_k
    hkv, d = int2_cache.shape[1], layout.head_dim
    out_k = torch.empty(total, hkv, d, dtype=dtype, device=int2_cache.device)
    out_v = torch.empty_like(out_k)
    if total:
        gather_rows_kernel[(triton.cdiv(longest, GATHER_BLOCK), count.shape[0], hkv)](
            int2_cache, int2_cache.stride(0), int2_cache.stride(1),
            window_k, caches.window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
            caches.block_table, caches.window_block_table, caches.block_table.stride(0),
            first, count, offsets, copy_below,
            out_k, out_v, out_k.stride(0), out_k.stride(1),
            D=d, G=layout.group_size, BS=layout.block_size, SCALE_T=TL_DTYPES[layout.scale_dtype],
            BLOCK=GATHER_BLOCK, **plane_offsets,
        )
    return out_k, out_v


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float, left_window: Optional[int],
                 causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's FlashAttention varlen forward (VarlenAttention)."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=left_window, window_size_right=None if left_window is None else 0)
    if lse.dim() == 3:  # [B, Hq, max_q] (padded layout of older kernels) -> [Tq, Hq]
        starts = cu_q[:-1].long()
        request = torch.repeat_interleave(torch.arange(len(starts), device=q.device), cu_q.diff().long())
        lse = lse[request, :, torch.arange(q.shape[0], device=q.device) - starts[request]]
    else:  # [Hq, Tq]
        lse = lse.transpose(0, 1)
    return out, lse


def flash_prefill(query_rot: torch.Tensor, caches: PagedCaches, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  recent: int, sink: int, softmax_scale: float, out: torch.Tensor, plane_offsets: dict[str, int],
                  attend: VarlenAttention = flash_varlen, plan: Optional[PrefillPlan] = None,
                  key_segments: int = 1, min_segment_keys: int = 1) -> torch.Tensor:
    """oscar_prefill(chunk_from_cache=True) by the far / near split (module docstring); arguments as
    torch_ops.oscar_prefill (checked by the caller), out [T, Hq, D] written at the rows of requests.

    plan: the step's PrefillPlan of these query_start_loc and seq_lens (no synchronisation, no copy). Without one
    this call reads them on the host (one synchronisation; prefill steps run eagerly) and copies the ranges to the
    device in one pinned, non-blocking copy. key_segments > 1: the far positions every chunk row sees are attended
    as up to that many sequences of >= min_segment_keys positions per request (KeySplit), for more programs."""
    batch = seq_lens.shape[0]
    if plan is None:
        host = torch.cat((query_start_loc.to(seq_lens.dtype), seq_lens)).tolist()
        plan = PrefillPlan.of(host[:batch + 1], host[batch + 1:], recent, query_rot.device)
    elif len(plan.ranges.chunks) != batch or plan.recent != recent:
        raise ValueError(f"the prefill plan was built for {len(plan.ranges.chunks)} requests and a recent window of "
                         f"{plan.recent}; this call has {batch} requests and recent={recent}. Build the plan "
                         "(PrefillPlan.of) from this call's query_start_loc and seq_lens.")
    (first_row, end_row), ranges, views = plan.rows, plan.ranges, plan.views
    if end_row <= first_row:
        return out
    dtype = caches.window_k.dtype if caches.window_k.dtype in FLASH_DTYPES else torch.bfloat16
    q = query_rot[first_row:end_row].to(dtype)
    max_q = max(ranges.chunks)
    reads = (caches, dtype, plane_offsets)
    longest = max(prefix + chunk for prefix, chunk in zip(ranges.prefixes, ranges.chunks))
    near_k, near_v = gather_rows(views["near_first"], views["near_count"], views["cu_near"][:-1],
                                 sum(ranges.near_count), max(ranges.near_count), longest, *reads)
    near_out, near_lse = attend(q, near_k, near_v, views["cu_q"], views["cu_near"], max_q, max(ranges.near_count),
                                softmax_scale, recent - 1, True)
    del near_k, near_v
    split = plan.split(key_segments, min_segment_keys) if key_segments > 1 else None
    if split is None or not any(split.segments):  # the whole far range in one causal part
        split = None
        far_first, far_count, cu_far, far_counts = (views["far_first"], views["far_count"], views["cu_far"],
                                                    ranges.far_count)
    else:  # the far range's tail [T, L - recent) causal; the body [0, T) below, in segments
        pieces = split.views
        far_first, far_count, cu_far, far_counts = (pieces["tail_first"], pieces["tail_count"], pieces["cu_tail"],
                                                    split.tail_count)
    has_far = max(far_counts) > 0
    far_out, far_lse = near_out, near_lse  # read by the merge only where has_far
    if has_far:
        far_k, far_v = gather_rows(far_first, far_count, cu_far[:-1], sum(far_counts), max(far_counts), sink, *reads)
        far_out, far_lse = attend(q, far_k, far_v, views["cu_q"], cu_far, max_q, max(far_counts), softmax_scale,
                                  None, True)
        del far_k, far_v
    body_out, body_lse = near_out, near_lse  # read by the merge only with a split
    if split is not None:
        body_k, body_v = gather_rows(pieces["body_first_position"], pieces["body_count"], pieces["cu_body"][:-1],
                                     sum(split.body_count), max(split.body_count), sink, *reads)
        body_out, body_lse = attend(q.index_select(0, pieces["query_index"]), body_k, body_v, pieces["cu_bq"],
                                    pieces["cu_bk"], max_q, max(split.segment_keys), softmax_scale, None, False)
        del body_k, body_v
    bodies = (pieces["body_first"], pieces["segments"]) if split is not None else (far_first, far_first)
    merge_far_near_kernel[(triton.cdiv(max_q, MERGE_BLOCK), batch, q.shape[1])](
        far_out, far_lse, near_out, near_lse, out, views["cu_q"], views["prefix"], far_first,
        body_out, body_lse, *bodies,
        far_out.stride(0), far_out.stride(1), far_lse.stride(0), far_lse.stride(1),
        near_out.stride(0), near_out.stride(1), near_lse.stride(0), near_lse.stride(1),
        out.stride(0), out.stride(1), body_out.stride(0), body_out.stride(1), body_lse.stride(0), body_lse.stride(1),
        first_row, recent,
        D=q.shape[2], BLOCK=MERGE_BLOCK, HAS_FAR=has_far, HAS_BODY=split is not None,
    )
    return out
