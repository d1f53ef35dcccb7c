"""The BF16 window store: which paged KV blocks have a BF16 copy, and where it lives.

Every token is written to the paged INT2 cache. Tokens that attention will read in BF16
(the sink, the first ``sink`` positions of a sequence, and the recent window, the last
``recent`` positions before the query) also get a copy of their *rotated* K/V rows in a
window store: per layer two tensors ``[num_window_blocks, block_size, Hkv, D]`` (K and
V), owned by the attention layer and allocated at its first forward, when the block size
is final (the memory profile run on a GPU, so vLLM counts them before it sizes its KV pool;
on CPU the plugin takes their bytes, from the geometry, out of the KV budget).

Window blocks are keyed by the *physical* KV block id: a block's content is the same
for every request that shares it (prefix caching), so its BF16 copy is too. This module
is the host-side bookkeeping, ``WindowBlockManager``, run once per scheduler step by the
metadata builder; it has no vLLM import.

Invariants (they make stale BF16 impossible):
  1. While physical block ``b`` is mapped to window block ``w``, every write to ``b``
     also writes its BF16 copy into ``w`` (the write slot mapping always points there).
     So ``w`` holds the BF16 of every offset of ``b`` written since ``w`` was mapped; a
     block freed by vLLM and reused for other content overwrites its copy as it is
     rewritten, and positions not yet rewritten are never read (reads stop at seq_len).
  2. ``valid_from[w]``: the first offset of ``b`` written after the mapping. When it is
     > 0 (the block already held tokens with no copy: only after an eviction) the block
     is served from INT2 (window table -1) and its window positions count as fallbacks.
  3. Every token written in a step gets a copy: the step's queries (one per new token)
     read the new tokens of their own chunk by the same rule as a decode would, so the
     newest ``recent`` of them, and all of them for the query right after each, are
     window positions. After the step, blocks that left every window are *dead* and are
     the first to be reused.

Sizing (``window_capacity_blocks``): per running request, the sink blocks and the blocks
of its recent window (one partial block at each end), plus the new tokens of one step
(max_num_batched_tokens, a partial block per request). Blocks of finished requests stay
mapped (a later request that hits the same prefix reads their sink in BF16) until their
window block is needed: dead blocks go first, then the least recently used. A window
position served from INT2 is never silent: ``fallback_positions`` counts them, and the
first one is logged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from vllm_oscar.intmath import cdiv

# Under "vllm." so that vLLM's log handlers and level apply to the plugin too.
logger = logging.getLogger(f"vllm.{__name__}")


def window_capacity_blocks(max_num_seqs: int, max_num_batched_tokens: int, block_size: int,
                           sink: int, recent: int) -> int:
    """Window blocks that hold the windows of ``max_num_seqs`` requests and one step's tokens.

    Per request: ceil(sink / bs) sink blocks and ceil(recent / bs) + 1 blocks of the
    recent window, + 1 partial block for its new tokens; plus ceil(max_num_batched_tokens
    / bs) blocks for the new tokens of a step.
    """
    per_request = cdiv(sink, block_size) + cdiv(recent, block_size) + 2
    return max_num_seqs * per_request + cdiv(max_num_batched_tokens, block_size)


def window_store_bytes(num_window_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """Bytes of one layer's window store (K and V)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * num_window_blocks * block_size * num_kv_heads * head_dim * item


@dataclasses.dataclass
class WindowPlan:
    """What one scheduler step needs from the window store.

    table_shape: (B, max_blocks), the block table's shape.
    table_entries: int64 [3, E]: (request, logical block, window block) of every BF16-readable
        block of the step: the blocks of the sink and recent windows some query of the step
        reads whose copy is complete. The window block table is -1 everywhere else: where
        attention must read INT2, and outside those windows (the kernels apply the position
        rule, so they never look there). Sparse because a long-context table is mostly -1.
    window_slot_mapping: int64 [N] (one per scheduled token, request order): the BF16
        slot ``window_block * block_size + offset`` of the token, -1 for no copy.
    fallback_positions: window positions (read by the first query of each request) that
        this step serves from INT2.
    newest_read_bf16: every request with a new token reads its newest position in BF16 (it is
        in a window and its block's table entry is set), so a decode step's attention reads no
        INT2 code written in the same step and the INT2 write may run beside it. False only
        where that block is served from INT2 (after an eviction) or outside every window.
    """

    table_shape: tuple[int, int]
    table_entries: torch.Tensor
    window_slot_mapping: torch.Tensor
    fallback_positions: int
    newest_read_bf16: bool = False

    @property
    def window_block_table(self) -> torch.Tensor:
        """The dense window block table, int32 [B, max_blocks], -1 where no entry."""
        table = torch.full(self.table_shape, -1, dtype=torch.int32)
        table[self.table_entries[0], self.table_entries[1]] = self.table_entries[2].to(torch.int32)
        return table


class WindowBlockManager:
    """Host-side map physical KV block -> window block, with LRU eviction (see module doc)."""

    def __init__(self, num_window_blocks: int, block_size: int, sink: int, recent: int) -> None:
        if num_window_blocks <= 0 or block_size <= 0 or sink < 0 or recent < 0:
            raise ValueError(
                f"window store needs num_window_blocks > 0, block_size > 0, sink >= 0, recent >= 0; "
                f"got {num_window_blocks}, {block_size}, {sink}, {recent}."
            )
        self.num_window_blocks = num_window_blocks
        self.block_size = block_size
        self.sink = sink
        self.recent = recent
        self._window_of: dict[int, int] = {}
        self._owner = [-1] * num_window_blocks
        self._valid_from = [0] * num_window_blocks
        self._last_used = [0] * num_window_blocks
        self._free = list(range(num_window_blocks - 1, -1, -1))
        # Mapped window blocks, least recently used first; the dead ones (out of every window they
        # were used for) also in their own such order: eviction takes the head of one, O(1).
        self._by_use: OrderedDict[int, None] = OrderedDict()
        self._dead_by_use: OrderedDict[int, None] = OrderedDict()
        self._step = 0
        #: Window positions served from INT2 so far (never silent: see module doc).
        self.fallback_positions = 0
        #: Window blocks taken back from a physical block to serve another one.
        self.evictions = 0

    # -- queries -----------------------------------------------------------------------
    def window_of(self, physical_block: int) -> int:
        """The window block mapped to a physical block, -1 if none."""
        return self._window_of.get(physical_block, -1)

    @property
    def mapped_blocks(self) -> int:
        """Physical blocks that currently have a window block."""
        return len(self._window_of)

    # -- one step ----------------------------------------------------------------------
    def plan(self, block_table: torch.Tensor, seq_lens: Sequence[int], query_lens: Sequence[int]) -> WindowPlan:
        """Map the blocks this step writes or reads in BF16; build the tables for the step.

        Works block by block over the windows and the new tokens only, so its cost does not
        grow with the context: a decode step visits about (sink + recent) / block_size + 2
        blocks per request.

        Args:
            block_table: [B, max_blocks] int CPU tensor of physical block ids.
            seq_lens: per request, tokens after this step (cached prefix + new tokens); a
                padding row of a CUDA-graph batch has 0 and reads nothing.
            query_lens: per request, new tokens of this step (their K/V are written now;
                tokens at negative positions, only in padding rows, get no copy).
        """
        self._step += 1
        bs = self.block_size
        ids = block_table.numpy()
        steps = [(int(seq_len) - int(query_len), int(seq_len)) for seq_len, query_len in zip(seq_lens, query_lens)]
        needed: set[int] = set()
        live_after: set[int] = set()
        first_write: dict[int, int] = {}
        reads = [self._read_blocks(computed, seq_len) for computed, seq_len in steps]
        for row, (computed, seq_len), read in zip(ids, steps, reads):
            needed.update(int(row[logical]) for logical in read)
            for lo, hi in ((0, min(self.sink, seq_len)), (max(0, seq_len - self.recent), seq_len)):
                live_after.update(self._blocks(row, lo, hi))
            for logical, block in enumerate(self._blocks(row, max(computed, 0), seq_len), max(computed, 0) // bs):
                first_write.setdefault(block, max(computed - logical * bs, 0))
        needed.update(first_write)
        for block in needed:
            window = self._window_of.get(block, -1)
            if window >= 0:
                self._touch(window)
        for block, offset in first_write.items():
            if block not in self._window_of:
                self._map(block, offset)
        for block in needed:
            window = self._window_of.get(block, -1)
            if window < 0:
                continue
            if block in live_after:
                self._dead_by_use.pop(window, None)
            else:  # used this step, so it belongs at the recent end
                self._dead_by_use[window] = None
                self._dead_by_use.move_to_end(window)

        entries: list[tuple[int, int, int]] = []
        slots: list[int] = []
        fallbacks = 0
        for index, (row, (computed, seq_len), read) in enumerate(zip(ids, steps, reads)):
            for logical in read:
                window = self._window_of.get(int(row[logical]), -1)
                if window >= 0 and self._valid_from[window] == 0:
                    entries.append((index, logical, window))
                else:  # every read position of this block is served from INT2
                    ranges = self._read_ranges(computed, seq_len)
                    span = range(logical * bs, (logical + 1) * bs)
                    fallbacks += sum(1 for p in span if any(lo <= p < hi for lo, hi in ranges))
            slots.extend([-1] * max(-computed, 0))
            start = max(computed, 0)
            for logical, block in enumerate(self._blocks(row, start, seq_len), start // bs):
                window = self._window_of.get(block, -1)
                lo = max(start, logical * bs) - logical * bs
                hi = min(seq_len, (logical + 1) * bs) - logical * bs
                slots.extend(range(window * bs + lo, window * bs + hi) if window >= 0 else [-1] * (hi - lo))
        if fallbacks:
            if self.fallback_positions == 0:
                logger.warning(
                    "OSCAR: %d BF16-window positions were served from INT2 in this step (window "
                    "store full or evicted); counted in fallback_positions.", fallbacks)
            self.fallback_positions += fallbacks
        table_entries = torch.tensor(entries, dtype=torch.int64).reshape(-1, 3).T
        served = {(index, logical) for index, logical, _ in entries}
        newest_read_bf16 = all(
            (seq_len - 1 < self.sink or self.recent > 0) and (index, (seq_len - 1) // bs) in served
            for index, (computed, seq_len) in enumerate(steps) if seq_len > max(computed, 0))
        return WindowPlan(tuple(ids.shape), table_entries, torch.tensor(slots, dtype=torch.int64), fallbacks,
                          newest_read_bf16)

    # -- helpers -----------------------------------------------------------------------
    def _read_ranges(self, computed: int, seq_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Positions some query of the step (positions computed..seq_len-1) reads in BF16.

        The sink, and from the first query's window start up to the last new token (a query
        reads its own and earlier new tokens from the cache, written before attention).
        The two ranges may overlap; a padding row (seq_len 0) has none.
        """
        return (0, min(self.sink, seq_len)), (max(0, computed - self.recent + 1), seq_len)

    def _read_blocks(self, computed: int, seq_len: int) -> list[int]:
        """Logical blocks (ascending) holding a position of _read_ranges."""
        bs = self.block_size
        return sorted({j for lo, hi in self._read_ranges(computed, seq_len) if hi > lo
                       for j in range(lo // bs, cdiv(hi, bs))})

    def _blocks(self, row: np.ndarray, lo: int, hi: int) -> list[int]:
        """Physical ids of the blocks holding positions [lo, hi) of a block-table row."""
        if hi <= lo:
            return []
        return row[lo // self.block_size: cdiv(hi, self.block_size)].tolist()

    def _touch(self, window: int) -> None:
        """Mark a mapped window block used in this step."""
        self._last_used[window] = self._step
        self._by_use[window] = None
        self._by_use.move_to_end(window)
        if window in self._dead_by_use:
            self._dead_by_use.move_to_end(window)

    def _map(self, block: int, first_offset: int) -> None:
        """Give ``block`` a window block: a free one, else one not used in this step (so not
        needed by it), dead ones first (out of every window they were used for), each the
        least recently used."""
        if self._free:
            window = self._free.pop()
        else:
            window = next((w for w in (next(iter(self._dead_by_use), -1), next(iter(self._by_use), -1))
                           if w >= 0 and self._last_used[w] < self._step), -1)
            if window < 0:
                return  # capacity exhausted this step: its positions are counted as fallbacks
            del self._window_of[self._owner[window]]
            self._dead_by_use.pop(window, None)
            self.evictions += 1
        self._window_of[block] = window
        self._owner[window] = block
        self._valid_from[window] = first_offset
        self._touch(window)


# -- process-wide state: one window store geometry per worker process -----------------------
_manager: WindowBlockManager | None = None
_allocated_bytes = 0


def shared_manager(num_window_blocks: int, block_size: int, sink: int, recent: int) -> WindowBlockManager:
    """The worker's manager (one per process: all OSCAR layers share the block ids)."""
    global _manager
    geometry = (num_window_blocks, block_size, sink, recent)
    if _manager is None:
        _manager = WindowBlockManager(*geometry)
    elif (_manager.num_window_blocks, _manager.block_size, _manager.sink, _manager.recent) != geometry:
        raise ValueError(
            f"OSCAR window store geometry changed in one process: {geometry} vs "
            f"{(_manager.num_window_blocks, _manager.block_size, _manager.sink, _manager.recent)}; "
            "OSCAR supports one KV cache group of full-attention layers."
        )
    return _manager


def current_manager() -> WindowBlockManager | None:
    """The worker's manager, None before the first OSCAR layer is set up."""
    return _manager


def record_allocation(nbytes: int) -> None:
    """Count bytes of window-store tensors allocated in this process."""
    global _allocated_bytes
    _allocated_bytes += nbytes


def allocated_bytes() -> int:
    """Bytes of window-store tensors allocated in this process (all layers)."""
    return _allocated_bytes
