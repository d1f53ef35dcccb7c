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
(t < recent) take the near part alone. With key segments (KeySplit, opt-in), the far positions every row sees are
attended without a mask in several sequences, and only the rest of the far range with the causal mask.

Numerics against the Triton prefill kernel: the dequantized rows and the query are rounded to bf16 (fp16 where the
window store is fp16) before the MMAs, as that kernel's MMAs round their operands, and each part's output is rounded
to that dtype before the merge.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from vllm_oscar.kernels.layout import PageLayout
from vllm_oscar.kernels.triton_common import TL_DTYPES

logger = logging.getLogger(f"vllm.{__name__}")


#: Positions per gather program.
GATHER_BLOCK = 32
#: Query rows per merge program.
MERGE_BLOCK = 16
#: Lowest compute capability PyTorch's FlashAttention kernels run on.
FLASH_MIN_CAPABILITY = (8, 0)
#: Largest head_dim they take (a multiple of 8).
FLASH_MAX_HEAD_DIM = 256
#: dtypes they take.
FLASH_DTYPES = (torch.bfloat16, torch.float16)
#: The default (AttentionConfig.prefill_flash None) runs flash_prefill where a call's attention work, counted as
#: query-key pairs x query heads x head_dim (a chunk of C rows over a prefix of P positions: C x P + C (C + 1) / 2
#: pairs; bounded by query rows x max_seq_len where no PrefillPlan gives the chunks), reaches this and its
#: FlashAttention launch has FLASH_PREFILL_MIN_PROGRAMS programs or more; below it the Triton prefill kernel is
#: faster, flash_prefill's host work (four Triton and two FlashAttention launches; its smallest calls take 0.16-0.45
#: ms with the step's plan, measured on an H100 and an H200) being larger than the attention there.
#: Measured (H200, eager, docs/PERFORMANCE.md "Chunked prefill"): Qwen3-8B geometry 1024 fresh tokens (2^31) 0.26
#: against 0.21 ms, SmolLM2 geometry 512 tokens over a 4K prefix x 2 (2^31.3) 0.27 against 0.34.
FLASH_PREFILL_MIN_WORK = 2 ** 31
#: Query rows per program of FlashAttention's forward kernel (head_dim <= 128 on sm80 / sm90).
FLASH_QUERY_TILE = 128
#: The default also wants sum over requests of cdiv(chunk, FLASH_QUERY_TILE) x Hq programs in each FlashAttention
#: launch: it splits no request's keys, so fewer programs leave SMs idle while each walks a long prefix, where the
#: Triton kernel splits the prefix. Measured (H200): SmolLM2 geometry 512 tokens over a 32K prefix (36 programs)
#: 0.76 against 0.64 ms, 256 tokens x 4 over a 16K prefix (72 programs) 0.50 against 0.99.
FLASH_PREFILL_MIN_PROGRAMS = 64
#: AttentionConfig.prefill_flash_split (opt-in): FlashAttention programs per SM that the key segments aim for, and
#: the fewest positions per segment.
FLASH_SPLIT_PROGRAMS_PER_SM = 2
FLASH_SPLIT_MIN_KEYS = 1024
#: The most bytes the default lets one call's gathered K and V rows take: vLLM sizes its KV cache after a profiling
#: step whose prefill has no long prefix, so this workspace is memory it did not count. Above it the Triton prefill
#: kernel runs (logged, counted in workspace_fallbacks). 1 GiB holds every measured cell (Qwen3-8B geometry, 8 KV
#: heads, D = 128: four requests at a 32K prefix, 0.53 GiB) and two 128K-token requests at that geometry.
FLASH_PREFILL_MAX_WORKSPACE = 2 ** 30

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


@dataclasses.dataclass(frozen=True)
class PrefillRanges:
    """Per-request host values of one flash_prefill call: chunk rows, prefix, and the far / near key ranges
    (first position, count); ``packed`` copies them to the device for the kernels (one host-to-device copy)."""

    chunks: list[int]
    prefixes: list[int]
    far_count: list[int]
    near_first: list[int]
    near_count: list[int]

    @staticmethod
    def of(seq_lens: list[int], chunks: list[int], recent: int) -> "PrefillRanges":
        """far [0, L - recent), near [max(0, P - recent + 1), L) with P = L - C (module docstring); a request
        with no chunk has neither."""
        prefixes = [length - chunk for length, chunk in zip(seq_lens, chunks)]
        near_first = [max(0, prefix - recent + 1) for prefix in prefixes]
        return PrefillRanges(chunks, prefixes,
                             [max(0, length - recent) if chunk else 0 for length, chunk in zip(seq_lens, chunks)],
                             near_first,
                             [length - first if chunk else 0 for length, first, chunk in zip(seq_lens, near_first,
                                                                                             chunks)])

    def packed(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Device int32 views: cu_q, far_first, far_count, cu_far, near_first, near_count, cu_near, prefix."""
        batch = len(self.chunks)
        fields = {"cu_q": _cumulative(self.chunks), "far_first": [0] * batch, "far_count": self.far_count,
                  "cu_far": _cumulative(self.far_count), "near_first": self.near_first, "near_count": self.near_count,
                  "cu_near": _cumulative(self.near_count), "prefix": self.prefixes}
        return _packed(fields, device)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One step's flash_prefill ranges, built on the host once per step (vLLM's metadata builder holds the
    query_start_loc and seq_lens on the host) and read by every layer's call: no synchronisation and no copy per
    layer. ``rows`` = (first, end) packed query row of the prefill requests; ``views`` = PrefillRanges.packed."""

    ranges: PrefillRanges
    rows: tuple[int, int]
    recent: int
    views: dict[str, torch.Tensor]
    #: KeySplit per (key_segments, min_keys), built at the first call that asks (once per step).
    splits: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(query_start_loc: list[int], seq_lens: list[int], recent: int, device: torch.device) -> "PrefillPlan":
        """The plan of requests with host query_start_loc [B + 1] and seq_lens [B] (Python ints)."""
        if len(query_start_loc) != len(seq_lens) + 1:
            raise ValueError(f"a prefill plan needs B + 1 query_start_loc values for B seq_lens; got "
                             f"{len(query_start_loc)} and {len(seq_lens)}.")
        chunks = [end - begin for begin, end in zip(query_start_loc, query_start_loc[1:])]
        ranges = PrefillRanges.of(seq_lens, chunks, recent)
        return PrefillPlan(ranges, (query_start_loc[0], query_start_loc[-1]), recent, ranges.packed(device))

    def split(self, key_segments: int, min_keys: int) -> "KeySplit":
        """This plan's KeySplit (cached): each request's body in up to ``key_segments`` segments of >= min_keys."""
        key = (key_segments, min_keys)
        if key not in self.splits:
            self.splits[key] = KeySplit.of(self.ranges, self.recent, key_segments, min_keys,
                                           self.views["cu_q"].device)
        return self.splits[key]


@dataclasses.dataclass(frozen=True)
class KeySplit:
    """The far range of each request split for more FlashAttention programs (host lists; ``views`` on the device).

    Far positions s < T = min(L - recent, max(0, P - recent + 1)) are seen by every chunk row (row t sees s <= t -
    recent, and t >= P): this body is gathered as one range per request and attended without a mask as
    ``segments[b]`` varlen sequences of consecutive positions (``segment_keys``, request after request), each over
    a copy of the request's chunk rows; the tail [T, L - recent) keeps the bottom-right causal mask.
    segments[b] = max(1, min(key_segments, T // min_keys)), 0 without a body."""

    body_count: list[int]
    tail_count: list[int]
    segments: list[int]
    segment_keys: list[int]
    views: dict[str, torch.Tensor]

    @staticmethod
    def of(ranges: PrefillRanges, recent: int, key_segments: int, min_keys: int, device: torch.device) -> "KeySplit":
        """The split of ``ranges`` (class docstring), its index arrays copied to ``device`` in one copy."""
        if key_segments < 1 or min_keys < 1:
            raise ValueError(f"key_segments={key_segments}, min_keys={min_keys}: both must be >= 1.")
        body = [min(far, max(0, prefix - recent + 1)) if chunk else 0
                for chunk, prefix, far in zip(ranges.chunks, ranges.prefixes, ranges.far_count)]
        segments = [max(1, min(key_segments, seen // min_keys)) if seen else 0 for seen in body]
        segment_keys = [keys for seen, count in zip(body, segments) for keys in _even_cuts(seen, count)]
        cu_q, cu_body = _cumulative(ranges.chunks), _cumulative(body)
        query_index, cu_bq, cu_bk, body_first = [], [0], [0], []
        keys = iter(segment_keys)
        for b, count in enumerate(segments):
            body_first.append(cu_bq[-1])
            for _ in range(count):
                query_index.extend(range(cu_q[b], cu_q[b + 1]))
                cu_bq.append(cu_bq[-1] + ranges.chunks[b])
                cu_bk.append(cu_bk[-1] + next(keys))
        tail = [far - seen for far, seen in zip(ranges.far_count, body)]
        fields = {"body_first_position": [0] * len(body), "body_count": body, "cu_body": cu_body,
                  "tail_first": body, "tail_count": tail, "cu_tail": _cumulative(tail), "segments": segments,
                  "body_first": body_first, "cu_bq": cu_bq, "cu_bk": cu_bk, "query_index": query_index}
        return KeySplit(body, tail, segments, segment_keys, _packed(fields, device))


@dataclasses.dataclass(frozen=True)
class CallSize:
    """What the default routing weighs for one call: ``work`` = query-key pairs x Hq x D, ``programs`` of its
    FlashAttention launches, ``workspace`` = bytes of the gathered K and V rows (bf16 / fp16)."""

    work: int
    programs: int
    workspace: int

    @staticmethod
    def of_plan(plan: PrefillPlan, heads: int, kv_heads: int, head_dim: int) -> "CallSize":
        """Exact, from the step's chunks and prefixes (the near rows are freed before the far ones are gathered)."""
        ranges = plan.ranges
        pairs = sum(chunk * prefix + chunk * (chunk + 1) // 2 for chunk, prefix in zip(ranges.chunks, ranges.prefixes))
        tiles = sum(triton.cdiv(chunk, FLASH_QUERY_TILE) for chunk in ranges.chunks)
        rows = max(sum(ranges.far_count), sum(ranges.near_count))
        return CallSize(pairs * heads * head_dim, tiles * heads, rows * kv_heads * head_dim * 2 * 2)

    @staticmethod
    def bound(rows: int, keys_per_row: int, requests: int, longest: int, heads: int, kv_heads: int,
              head_dim: int) -> "CallSize":
        """Without a plan: ``rows`` query rows reading <= ``keys_per_row`` positions each, of ``requests`` requests
        of <= ``longest`` positions (requests x longest bounds the gathered rows; the rows counted as one request's
        tiles)."""
        return CallSize(rows * keys_per_row * heads * head_dim, triton.cdiv(rows, FLASH_QUERY_TILE) * heads,
                        requests * longest * kv_heads * head_dim * 2 * 2)

    def takes_flash(self, min_programs: Optional[int] = None) -> bool:
        """The default's choice (FLASH_PREFILL_MIN_WORK, ``min_programs`` = FLASH_PREFILL_MIN_PROGRAMS unless given,
        FLASH_PREFILL_MAX_WORKSPACE); a call the workspace cap turns away is counted (count_workspace_fallback)."""
        min_programs = FLASH_PREFILL_MIN_PROGRAMS if min_programs is None else min_programs
        if self.work < FLASH_PREFILL_MIN_WORK or self.programs < min_programs:
            return False
        if self.workspace > FLASH_PREFILL_MAX_WORKSPACE:
            count_workspace_fallback(self.workspace)
            return False
        return True


def _packed(fields: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """The int32 lists as views of one device tensor, copied from pinned host memory without blocking."""
    flat = [value for values in fields.values() for value in values]
    host = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()
    packed = host.to(device, non_blocking=True)
    views, start = {}, 0
    for name, values in fields.items():
        views[name] = packed[start:start + len(values)]
        start += len(values)
    return views


def _even_cuts(total: int, parts: int) -> list[int]:
    """``parts`` lengths summing to ``total``, the first total % parts one longer."""
    return [total // parts + (index < total % parts) for index in range(parts)]


def _cumulative(counts: list[int]) -> list[int]:
    """[0, c0, c0 + c1, ...]: the row offsets of packed varlen rows."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


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


#: Calls the default sent to the Triton kernel because their workspace exceeded FLASH_PREFILL_MAX_WORKSPACE.
workspace_fallbacks = 0


def count_workspace_fallback(bound: int) -> None:
    """Count a call the workspace cap sent to the Triton kernel; log the first."""
    global workspace_fallbacks
    if workspace_fallbacks == 0:
        logger.warning("OSCAR: a prefill call whose gathered rows could take %.0f MiB (> %.0f MiB, "
                       "flash_prefill.FLASH_PREFILL_MAX_WORKSPACE) runs the Triton prefill kernel instead of "
                       "FlashAttention (same result, slower); counted in flash_prefill.workspace_fallbacks.",
                       bound / 2 ** 20, FLASH_PREFILL_MAX_WORKSPACE / 2 ** 20)
    workspace_fallbacks += 1


@functools.lru_cache(maxsize=None)
def flash_device_unavailable(device: torch.device) -> Optional[str]:
    """Why flash_prefill cannot run on ``device`` whatever the shapes (None: it can); asked once per device (every
    prefill call routes through it)."""
    if device.type != "cuda":
        return f"tensors on {device.type}, not CUDA"
    if torch.cuda.get_device_capability(device) < FLASH_MIN_CAPABILITY:
        return f"compute capability {torch.cuda.get_device_capability(device)} < {FLASH_MIN_CAPABILITY}"
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without FlashAttention"
    return None


def flash_unavailable(device: torch.device, head_dim: int, recent: int) -> Optional[str]:
    """Why flash_prefill cannot run on ``device`` at this head_dim and recent window (None: it can)."""
    if recent < 1:
        return "no recent window (the near range would be empty)"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (FlashAttention takes multiples of 8 up to {FLASH_MAX_HEAD_DIM})"
    return flash_device_unavailable(device)


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
