"""The BF16 window store bookkeeping (no engine): mapping, reads, stale copies, eviction."""

import random

import pytest
import torch

from vllm_oscar.attention.step_buffers import WindowPlanBuffers
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
        assert plan.newest_read_bf16  # the INT2 write may run beside the attention
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
    assert not plan.newest_read_bf16  # the query reads its own INT2 code: write INT2 first


def test_newest_token_outside_every_window_is_read_from_int2():
    manager = WindowBlockManager(16, BS, SINK, 0)  # no recent window
    assert manager.plan(torch.tensor([list(range(10))]), [40], [40]).newest_read_bf16  # 39 < sink
    plan = manager.plan(torch.tensor([list(range(10))]), [70], [30])
    assert not plan.newest_read_bf16  # position 69 is in no window: its query reads its INT2 code


def test_padding_rows_read_and_write_nothing():
    """Rows of a CUDA-graph batch beyond its requests: seq_len 0 (query 0 or 1 token)."""
    manager = WindowBlockManager(window_capacity_blocks(3, 64, BS, SINK, RECENT), BS, SINK, RECENT)
    manager.plan(torch.tensor([[3, 4, 5]]), [40], [40])
    plan = manager.plan(torch.tensor([[3, 4, 5], [0, 0, 0], [0, 0, 0]]), [41, 0, 0], [1, 0, 1])
    assert plan.window_slot_mapping.tolist()[1:] == [-1]
    assert (plan.window_block_table[1:] == -1).all() and manager.window_of(0) == -1
    assert plan.fallback_positions == 0 and plan.newest_read_bf16


def _serve_randomly(seed: int, bs: int, sink: int, recent: int, store_fraction: float = 1.0, steps: int = 120):
    """A scheduler's life in miniature: requests arrive (some sharing a running request's prompt
    blocks and recomputing their recent window, as vLLM's prefix caching does with OSCAR's
    replay_tokens), prefill in chunks, decode, finish and free their blocks for
    reuse. The INT2 cache and the window store are simulated as token values written by slot;
    yields (manager, plan, rows, seq_lens, query_lens, cache, store) after each step. store_fraction < 1
    makes the window store that much smaller than window_capacity_blocks sizes it."""
    rng = random.Random(seed)
    max_running, chunk = 4, 24
    capacity = window_capacity_blocks(max_running, chunk * max_running, bs, sink, recent)
    manager = WindowBlockManager(max(1, int(capacity * store_fraction)), bs, sink, recent)
    free = list(range(200))
    rng.shuffle(free)
    refs: dict[int, int] = {}
    cache: dict[tuple[int, int], int] = {}  # (physical block, offset) -> token value
    store: dict[int, int] = {}  # window slot -> token value
    running: list[dict] = []
    for _ in range(steps):
        if len(running) < max_running and rng.random() < 0.3:
            prompt = rng.randrange(1, 5) * 10_000 if running and rng.random() < 0.4 else rng.randrange(10**6)
            request = {"prompt": prompt, "length": rng.randrange(8, 120), "done": 0, "blocks": []}
            donor = next((r for r in running if r["prompt"] == prompt), None)
            if donor is not None:  # share the donor's written full prompt blocks; replay their recent window
                shared = min(donor["done"], donor["length"], request["length"]) // bs
                request["blocks"] = donor["blocks"][:shared]
                request["done"] = max(0, shared * bs - -(-recent // bs) * bs)  # OscarAttentionSpec.replay_tokens
                for block in request["blocks"]:
                    refs[block] += 1
            running.append(request)
        if not running:
            continue
        seq_lens, query_lens = [], []
        for request in running:
            new = min(chunk, request["length"] - request["done"]) if request["done"] < request["length"] else 1
            seq_lens.append(request["done"] + new)
            query_lens.append(new)
            while len(request["blocks"]) * bs < seq_lens[-1]:
                block = free.pop()
                refs[block] = 1
                request["blocks"].append(block)
        width = max(len(r["blocks"]) for r in running)
        rows = [r["blocks"] + [0] * (width - len(r["blocks"])) for r in running]
        plan = manager.plan(torch.tensor(rows), seq_lens, query_lens)
        slots = iter(plan.window_slot_mapping.tolist())
        for request, row, seq_len, query_len in zip(running, rows, seq_lens, query_lens):
            for position in range(seq_len - query_len, seq_len):
                value = hash((request["prompt"], position)) if position < request["length"] else rng.random()
                cache[row[position // bs], position % bs] = value
                slot = next(slots)
                if slot >= 0:
                    store[slot] = value
            request["done"] = seq_len
        yield manager, plan, rows, seq_lens, query_lens, cache, store
        for request in [r for r in running if r["done"] >= r["length"] + 40 or rng.random() < 0.02]:
            running.remove(request)
            for block in request["blocks"]:
                refs[block] -= 1
                if refs[block] == 0:
                    free.insert(0, block)


@pytest.mark.parametrize("store_fraction", [1.0, 0.3])
@pytest.mark.parametrize("seed", range(4))
def test_random_serving_never_reads_a_stale_copy(seed, store_fraction):
    """Against the simulated stores: every BF16 entry of the window table serves, at each position a
    query of the step reads there, exactly the value the INT2 cache holds (no stale copy after block
    reuse, prefix sharing or eviction); every other read position is counted as a fallback, and there
    are none with the store window_capacity_blocks sizes; every slot lies in its block's window
    block at its offset."""
    bs, sink, recent = (4, 8, 24) if seed % 2 else (8, 16, 40)
    served = fallbacks = 0
    newest_seen: set[bool] = set()
    for manager, plan, rows, seq_lens, query_lens, cache, store in _serve_randomly(seed, bs, sink, recent,
                                                                                     store_fraction):
        table = plan.window_block_table
        step_fallbacks = 0
        for index, (row, seq_len, query_len) in enumerate(zip(rows, seq_lens, query_lens)):
            reads = {s for t in range(seq_len - query_len, seq_len) for s in range(t + 1) if s < sink or s > t - recent}
            for s in reads:
                window = int(table[index, s // bs])
                if window < 0:
                    step_fallbacks += 1
                    continue
                assert store.get(window * bs + s % bs) == cache[row[s // bs], s % bs], (seed, index, s)
                served += 1
        assert plan.fallback_positions == step_fallbacks
        newest_bf16 = all((seq_len - 1 < sink or recent > 0) and int(table[index, (seq_len - 1) // bs]) >= 0
                          for index, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens))
                          if query_len > 0 and seq_len > 0)
        assert plan.newest_read_bf16 == newest_bf16
        newest_seen.add(newest_bf16)
        fallbacks += step_fallbacks
        position_slots = [(row, p) for row, n, q in zip(rows, seq_lens, query_lens) for p in range(n - q, n)]
        for (row, position), slot in zip(position_slots, plan.window_slot_mapping.tolist()):
            window = manager.window_of(row[position // bs])
            assert slot == (window * bs + position % bs if window >= 0 else -1)
    assert served > 1000 and manager.evictions > 0
    assert manager.fallback_positions == fallbacks
    assert (fallbacks == 0) == (store_fraction == 1.0)
    assert newest_seen == ({True} if store_fraction == 1.0 else {True, False})


def test_window_plan_buffers_keep_addresses_and_reset_padding():
    manager = WindowBlockManager(window_capacity_blocks(3, 64, BS, SINK, RECENT), BS, SINK, RECENT)
    buffers = WindowPlanBuffers(max_requests=4, max_tokens=64, device=torch.device("cpu"))
    rows = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    plan = manager.plan(rows, [40, 33, 20], [20, 13, 20])
    table, slots = buffers.load(plan, 53)
    assert torch.equal(table, plan.window_block_table) and torch.equal(slots, plan.window_slot_mapping)
    assert int(buffers.serial_write) == 0  # every newest token read in BF16
    first = (buffers.table.data_ptr(), buffers.slots.data_ptr())
    plan = manager.plan(rows[:1], [41], [1])  # one decode, padded to a graph of 4 tokens
    table, slots = buffers.load(plan, 4)
    assert (buffers.table.data_ptr(), buffers.slots.data_ptr()) == first
    assert torch.equal(table, plan.window_block_table)
    assert (buffers.table[1:] == -1).all()  # rows of the earlier, larger step reset
    assert slots.tolist()[1:] == [-1, -1, -1] and (buffers.slots[1:] == -1).all()
    small = WindowBlockManager(3, BS, SINK, RECENT)  # the eviction case of the test above
    small.plan(torch.tensor([[0, 1, 2]]), [8], [8])
    small.plan(torch.tensor([[5, 6, 7]]), [48], [48])
    buffers.load(small.plan(torch.tensor([[0, 1, 2]]), [9], [1]), 1)
    assert int(buffers.serial_write) == 1  # a captured decode writes INT2 before its attention
    with pytest.raises(ValueError, match="width changed"):
        buffers.load(manager.plan(torch.tensor([[1, 2, 3, 4]]), [42], [1]), 1)
    with pytest.raises(ValueError, match="exceeds the window plan buffers"):
        buffers.load(manager.plan(rows.repeat(2, 1)[:5], [44] * 5, [1] * 5), 5)
