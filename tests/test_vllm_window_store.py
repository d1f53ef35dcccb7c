"""The BF16 window store bookkeeping (no engine): mapping, reads, stale copies, eviction."""

import torch

from vllm_oscar.attention.window_store import WindowBlockManager, window_capacity_blocks

BS, SINK, RECENT = 16, 64, 256


def _window_positions(t: int) -> list[int]:
    """Positions a query at t reads in BF16 (method: sink or recent window)."""
    return [s for s in range(t + 1) if s < SINK or s > t - RECENT]


def _check_reads(plan, rows: list[list[int]], seq_lens, query_lens):
    """Every window position of every query of the step has a usable BF16 block."""
    for index, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        for t in range(seq_len - query_len, seq_len):
            for s in _window_positions(t):
                assert plan.window_block_table[index, s // BS] >= 0, (index, t, s)


def test_prefill_then_decode_keeps_every_window_position_in_bf16():
    capacity = window_capacity_blocks(1, 128, BS, SINK, RECENT)
    manager = WindowBlockManager(capacity, BS, SINK, RECENT)
    row = list(range(100, 160))  # physical blocks of one request, 60 * 16 = 960 tokens
    table = torch.tensor([row])
    plan = manager.plan(table, [300], [300])
    assert (plan.window_slot_mapping >= 0).all()  # every new token gets its copy (read by its own query)
    _check_reads(plan, [row], [300], [300])
    for seq_len in range(301, 800):
        plan = manager.plan(table, [seq_len], [1])
        _check_reads(plan, [row], [seq_len], [1])
        window = int(plan.window_slot_mapping[0])
        assert window // BS == manager.window_of(row[(seq_len - 1) // BS])
        assert window % BS == (seq_len - 1) % BS
    assert manager.fallback_positions == 0 and manager.evictions > 0  # old recent blocks were reused


def test_chunked_prefill_reads_previous_chunk_tail():
    manager = WindowBlockManager(window_capacity_blocks(1, 64, BS, SINK, RECENT), BS, SINK, RECENT)
    row = list(range(40))
    table = torch.tensor([row])
    for end in range(64, 600, 64):
        plan = manager.plan(table, [end], [64])
        _check_reads(plan, [row], [end], [64])
    assert manager.fallback_positions == 0


def test_reused_block_is_rewritten_with_its_copy():
    """A physical block freed by one request and rewritten by another keeps no stale BF16:
    every write into a mapped block writes its copy (invariant 1)."""
    manager = WindowBlockManager(window_capacity_blocks(2, 64, BS, SINK, RECENT), BS, SINK, RECENT)
    manager.plan(torch.tensor([[7, 8, 9]]), [40], [40])
    window = manager.window_of(7)
    assert window >= 0
    # Block 7 is reused by another request as its third block (history, not a window block for it).
    plan = manager.plan(torch.tensor([[1, 2, 7]]), [48], [48])
    assert manager.window_of(7) == window
    slots = plan.window_slot_mapping.tolist()
    assert slots[32:48] == [window * BS + o for o in range(16)]


def test_prefix_hit_reads_shared_sink_in_bf16():
    manager = WindowBlockManager(window_capacity_blocks(2, 512, BS, SINK, RECENT), BS, SINK, RECENT)
    shared = list(range(20))
    manager.plan(torch.tensor([shared + [50, 51]]), [340], [340])  # request A: 340-token prompt
    # Request B shares A's first 20 blocks (320 tokens), replays the last 256 of them + 20 new.
    plan = manager.plan(torch.tensor([shared + [60, 61]]), [340], [276])
    _check_reads(plan, [shared + [60, 61]], [340], [276])
    assert all(plan.window_block_table[0, j] >= 0 for j in range(SINK // BS))
    assert manager.fallback_positions == 0


def test_exhausted_store_counts_fallbacks():
    manager = WindowBlockManager(4, BS, SINK, RECENT)  # far too small for a 300-token request
    plan = manager.plan(torch.tensor([list(range(20))]), [300], [300])
    assert plan.fallback_positions > 0
    assert manager.fallback_positions == plan.fallback_positions
    assert (plan.window_slot_mapping == -1).sum() > 0


def test_block_mapped_after_eviction_mid_block_is_not_served_from_bf16():
    """A block that gets a window block while it already holds tokens without copies
    (after an eviction) is read from INT2 (table -1), never with a partial copy; counted."""
    manager = WindowBlockManager(3, BS, SINK, RECENT)
    manager.plan(torch.tensor([[0, 1]]), [8], [8])  # request A: block 0 holds positions 0..7
    manager.plan(torch.tensor([[5, 6, 7]]), [48], [48])  # request B needs all 3 window blocks
    assert manager.window_of(0) == -1 and manager.evictions == 1
    plan = manager.plan(torch.tensor([[0, 1]]), [9], [1])  # A decodes position 8
    assert manager.window_of(0) >= 0  # position 8 gets its copy ...
    assert plan.window_block_table[0, 0] == -1  # ... but the block is read from INT2
    assert plan.fallback_positions == 9  # positions 0..8, all window positions of the query
