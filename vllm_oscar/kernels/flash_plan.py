"""Host side of FlashAttention prefill (kernels/flash_prefill.py): where it can run, which calls it takes, and the
ranges each call reads, planned on the host once per step.

No Triton import: the vLLM metadata builder plans a step's ranges here (PrefillPlan, with KeySplit for the key
segments), and triton_ops routes each prefill call by its CallSize against the measured thresholds below to one of
PREFILL_PATHS (docs/PERFORMANCE.md "Chunked prefill").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Optional

import torch

logger = logging.getLogger(f"vllm.{__name__}")


#: Lowest compute capability PyTorch's FlashAttention kernels run on.
FLASH_MIN_CAPABILITY = (8, 0)
#: Largest head_dim they take (a multiple of 8).
FLASH_MAX_HEAD_DIM = 256
#: The default (AttentionConfig.prefill_flash None) runs flash_prefill where a call's attention work, counted as
#: query-key pairs x query heads x head_dim (a chunk of C rows over a prefix of P positions: C x P + C (C + 1) / 2
#: pairs; bounded by query rows x max_seq_len where no PrefillPlan gives the chunks), reaches this and its
#: FlashAttention launch has FLASH_PREFILL_MIN_PROGRAMS programs or more; below it the Triton prefill kernel is
#: faster, flash_prefill's host work (three Triton and two FlashAttention launches; its smallest calls take 0.16-0.45
#: ms with the step's plan, measured on an H100 and an H200) being larger than the attention there.
#: Measured (H200, eager, docs/PERFORMANCE.md "Chunked prefill"): Qwen3-8B geometry 1024 fresh tokens (2^31) 0.26
#: against 0.21 ms, SmolLM2 geometry 512 tokens over a 4K prefix x 2 (2^31.3) 0.27 against 0.34.
FLASH_PREFILL_MIN_WORK = 2 ** 31
#: Query rows per program of FlashAttention's forward kernel (head_dim <= 128 on sm80 / sm90).
FLASH_QUERY_TILE = 128
#: The default also wants this many FlashAttention programs, counted in full query tiles (CallSize.programs): it
#: splits no request's keys, so fewer programs leave SMs idle while each walks a long prefix, where the Triton
#: kernel splits the prefix. Measured (H200): SmolLM2 geometry 512 tokens over a 32K prefix (36 programs) 0.76
#: against 0.64 ms, 256 tokens x 4 over a 16K prefix (72 programs) 0.50 against 0.99.
FLASH_PREFILL_MIN_PROGRAMS = 64
#: Key segments (flash_plan.KeySplit, AttentionConfig.prefill_flash_split): FlashAttention programs per SM that the
#: segments aim for, and the fewest positions per segment.
FLASH_SPLIT_PROGRAMS_PER_SM = 2
FLASH_SPLIT_MIN_KEYS = 1024
#: The default cuts the keys into segments (CallSize.split_pays) where the unsplit launch has fewer programs than
#: this (under one per SM of an H100 or H200, 132 SMs), each program's work (CallSize.work / programs) is at least
#: FLASH_SPLIT_MIN_PROGRAM_WORK (long prefixes: Qwen3-8B geometry from 16K, SmolLM2 from 32K) and every request
#: fills a full query tile (FLASH_QUERY_TILE chunk rows: 64-row chunks at Qwen3-8B geometry lost 1.12-1.29x).
#: Read off 48 cells of 64-512 rows x 1-2 requests at 4K-32K prefixes and timed on fresh runs of them (H100,
#: docs/PERFORMANCE.md "Chunked prefill"): it takes 12, ten 1.08-1.40x faster than the unsplit default, one even, and
#: one (Qwen3-8B geometry, 128 rows over 16K) 0.88x.
FLASH_SPLIT_MAX_PROGRAMS = 128
FLASH_SPLIT_MIN_PROGRAM_WORK = 2 ** 28
#: The most bytes the default lets one call's gathered K and V rows take: vLLM sizes its KV cache after a profiling
#: step whose prefill has no long prefix, so this workspace is memory it did not count. Above it the Triton prefill
#: kernel runs (logged, counted in workspace_fallbacks). 1 GiB holds every measured cell (Qwen3-8B geometry, 8 KV
#: heads, D = 128: four requests at a 32K prefix, 0.53 GiB) and two 128K-token requests at that geometry.
FLASH_PREFILL_MAX_WORKSPACE = 2 ** 30
#: The paths a chunked prefill call over the cache can take: the Triton prefill kernel, FlashAttention over gathered
#: rows, and FlashAttention with the far keys in segments.
PREFILL_PATHS = ("triton", "flash", "split")


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


def full_tile_programs(rows: int, heads: int) -> int:
    """FlashAttention programs of ``rows`` query rows x ``heads`` heads, counted in full query tiles (CallSize)."""
    return -(-rows * heads // FLASH_QUERY_TILE)


@dataclasses.dataclass(frozen=True)
class CallSize:
    """What the default routing weighs for one call: ``work`` = query-key pairs x Hq x D, ``programs`` = its
    FlashAttention launch's programs counted in full query tiles, cdiv(query rows x Hq, FLASH_QUERY_TILE) (a chunk of
    64 rows fills half a tile's rows: 64 rows x 2 requests over 32K at Qwen3-8B geometry, 64 programs of half
    tiles, took 1.7x the Triton kernel's time), ``workspace`` = bytes of the gathered K and V rows (bf16 / fp16),
    ``shortest_chunk`` = the fewest new rows of any request with new rows (0 where unknown)."""

    work: int
    programs: int
    workspace: int
    shortest_chunk: int = 0

    @staticmethod
    def of_plan(plan: PrefillPlan, heads: int, kv_heads: int, head_dim: int) -> "CallSize":
        """Exact, from the step's chunks and prefixes (the near rows are freed before the far ones are gathered)."""
        ranges = plan.ranges
        pairs = sum(chunk * prefix + chunk * (chunk + 1) // 2 for chunk, prefix in zip(ranges.chunks, ranges.prefixes))
        rows = max(sum(ranges.far_count), sum(ranges.near_count))
        return CallSize(pairs * heads * head_dim, full_tile_programs(sum(ranges.chunks), heads),
                        rows * kv_heads * head_dim * 2 * 2,
                        min((chunk for chunk in ranges.chunks if chunk), default=0))

    @staticmethod
    def bound(rows: int, keys_per_row: int, requests: int, longest: int, heads: int, kv_heads: int,
              head_dim: int) -> "CallSize":
        """Without a plan: ``rows`` query rows reading <= ``keys_per_row`` positions each, of ``requests`` requests
        of <= ``longest`` positions (requests x longest bounds the gathered rows); each request's chunk unknown."""
        return CallSize(rows * keys_per_row * heads * head_dim, full_tile_programs(rows, heads),
                        requests * longest * kv_heads * head_dim * 2 * 2)

    def split_pays(self) -> bool:
        """Whether the default cuts the keys into segments (FLASH_SPLIT_MAX_PROGRAMS, FLASH_SPLIT_MIN_PROGRAM_WORK,
        FLASH_QUERY_TILE rows in every request's chunk; never where the chunks are unknown)."""
        return (0 < self.programs < FLASH_SPLIT_MAX_PROGRAMS and self.shortest_chunk >= FLASH_QUERY_TILE
                and self.work >= FLASH_SPLIT_MIN_PROGRAM_WORK * self.programs)

    def splits_keys(self, split: Optional[bool] = None) -> bool:
        """Whether FlashAttention runs this call with key segments: ``split`` (AttentionConfig.prefill_flash_split),
        or split_pays where it is None."""
        return self.split_pays() if split is None else split

    def path(self, split: Optional[bool] = None) -> str:
        """The default's path for this call, one of PREFILL_PATHS: "split" (FlashAttention with key segments) where
        splits_keys(split); then the work and workspace limits of takes_flash, with no program floor where the
        segments make the programs."""
        split = self.splits_keys(split)
        if not self.takes_flash(0 if split else None):
            return "triton"
        return "split" if split else "flash"

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


#: Calls the default sent to the Triton kernel because their workspace exceeded FLASH_PREFILL_MAX_WORKSPACE.
workspace_fallbacks = 0


def count_workspace_fallback(bound: int) -> None:
    """Count a call the workspace cap sent to the Triton kernel; log the first."""
    global workspace_fallbacks
    if workspace_fallbacks == 0:
        logger.warning("OSCAR: a prefill call whose gathered rows could take %.0f MiB (> %.0f MiB, "
                       "flash_plan.FLASH_PREFILL_MAX_WORKSPACE) runs the Triton prefill kernel instead of "
                       "FlashAttention (same result, slower); counted in flash_plan.workspace_fallbacks.",
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
