"""The metadata builder's side of full CUDA graphs, fed vLLM's own CommonAttentionMetadata as vLLM
0.32's model runner (V2) fills it for a FULL decode graph: requests padded to the captured size
(query length 0, sequence length 0), tokens padded, query_start_loc padded with the real token count.
What the graph replays must read: a padded step's window table and slot mapping in the same tensors as
every other step's, -1 for the padding, and the capture's metadata sized for max_model_len."""

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from vllm_oscar.attention.backend import OscarMetadataBuilder
from vllm_oscar.attention.step_buffers import WindowPlanBuffers
from vllm_oscar.attention.window_store import WindowBlockManager, window_capacity_blocks

BS, SINK, RECENT = 16, 16, 32
MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN, MAX_BLOCKS = 8, 128, 4096, 8


def _builder() -> OscarMetadataBuilder:
    """A builder with the state build() reads (its __init__ needs a whole VllmConfig)."""
    builder = object.__new__(OscarMetadataBuilder)
    builder.manager = WindowBlockManager(window_capacity_blocks(MAX_REQS, MAX_TOKENS, BS, SINK, RECENT),
                                         BS, SINK, RECENT)
    builder.window_buffers = WindowPlanBuffers(MAX_REQS, MAX_TOKENS, torch.device("cpu"))
    builder.max_model_len = MAX_MODEL_LEN
    builder.recent_tokens = RECENT
    builder.plans_flash_prefill = False  # CPU: no FlashAttention prefill
    return builder


def _common(rows: list[list[int]], seq_lens: list[int], query_lens: list[int], padded_reqs: int,
            padded_tokens: int) -> CommonAttentionMetadata:
    """vLLM's step metadata, padded as the V2 runner pads a FULL graph's batch."""
    tokens = sum(query_lens)
    pad = padded_reqs - len(rows)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()] + [tokens] * pad, dtype=torch.int32)
    table = torch.zeros(MAX_REQS, MAX_BLOCKS, dtype=torch.int32)  # vLLM's persistent buffer; padding rows 0
    for index, row in enumerate(rows):
        table[index, : len(row)] = torch.tensor(row, dtype=torch.int32)
    lens = torch.tensor(seq_lens + [0] * pad, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts.clone(), query_start_loc_cpu=starts, seq_lens=lens, num_reqs=padded_reqs,
        num_actual_tokens=padded_tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table[:padded_reqs], slot_mapping=torch.full((padded_tokens,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=lens)


def test_padded_decode_steps_reuse_the_window_tensors_and_pad_with_minus_one():
    builder = _builder()
    rows = [[3, 4, 5], [6, 7], [8]]
    prompts = [40, 17, 5]
    prefill = builder.build(0, _common(rows, prompts, prompts, len(rows), sum(prompts)))  # the prompts, eagerly
    assert prefill.serial_write is builder.window_buffers.serial_write
    first = None
    for step, (real, padded) in enumerate([(3, 4), (2, 4), (3, 8)]):
        lens = [n + 1 + step for n in prompts][:real]
        metadata = builder.build(0, _common(rows[:real], lens, [1] * real, padded, padded))
        assert metadata.num_actual_tokens == padded and metadata.num_decodes == padded
        assert tuple(metadata.window_block_table.shape) == (padded, MAX_BLOCKS)
        pointers = (metadata.window_block_table.data_ptr(), metadata.window_slot_mapping.data_ptr())
        first = first or pointers
        assert pointers == first  # the addresses a captured graph holds
        assert metadata.serial_write is builder.window_buffers.serial_write
        assert int(metadata.serial_write) == 0  # a replay may write INT2 beside the attention
        assert (metadata.window_block_table[real:] == -1).all()
        assert metadata.window_slot_mapping[real:].tolist() == [-1] * (padded - real)
        for index in range(real):  # the new token's copy goes to its block's window block, at its offset
            position = lens[index] - 1
            window = builder.manager.window_of(rows[index][position // BS])
            assert window >= 0
            assert int(metadata.window_slot_mapping[index]) == window * BS + position % BS
            for s in range(lens[index]):  # every window position of the query is readable in BF16
                if s < SINK or s > position - RECENT:
                    assert int(metadata.window_block_table[index, s // BS]) == builder.manager.window_of(
                        rows[index][s // BS])


def test_capture_metadata_is_sized_for_the_longest_context_and_marked_for_graphs():
    builder = _builder()
    capture = builder.build_for_cudagraph_capture(_common([[0]] * 4, [1] * 4, [1] * 4, 4, 4))  # dummy requests
    assert capture.cuda_graph and capture.max_seq_len == MAX_MODEL_LEN
    eager = builder.build(0, _common([[9]], [2], [1], 1, 1))
    assert not eager.cuda_graph and eager.max_seq_len == 2


def test_a_mixed_step_sizes_its_prefill_part_by_the_prefills_alone():
    """A long decode beside a short prompt: max_seq_len is the decode's, prefill_max_seq_len the prompt's (what
    routes the prefill between FlashAttention and the Triton kernel); a decode-only step has none."""
    builder = _builder()
    mixed = builder.build(0, _common([[1, 2, 3, 4, 5, 6, 7], [8, 9]], [100, 20], [1, 20], 2, 21))
    assert mixed.num_decodes == 1 and mixed.max_seq_len == 100 and mixed.prefill_max_seq_len == 20
    decodes = builder.build(0, _common([[1, 2, 3, 4, 5, 6, 7]], [101], [1], 1, 1))
    assert decodes.prefill_max_seq_len is None
    assert mixed.prefill_plan is None  # built only where FlashAttention prefill may run


def test_a_step_plans_flash_prefill_ranges_on_the_host_once():
    """Where FlashAttention prefill may run, build() plans the prefill requests' ranges from vLLM's host values
    (query_start_loc rebased past the decode tokens), for every layer of the step; a decode-only step plans none."""
    builder = _builder()
    builder.plans_flash_prefill = True
    mixed = builder.build(0, _common([[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12]], [100, 20, 40],
                                     [1, 20, 7], 3, 28))
    plan = mixed.prefill_plan
    assert plan.rows == (0, 27) and plan.recent == RECENT
    assert plan.ranges.chunks == [20, 7] and plan.ranges.prefixes == [0, 33]
    assert plan.ranges.far_count == [0, 40 - RECENT] and plan.ranges.near_first == [0, 33 - RECENT + 1]
    assert plan.views["cu_q"].tolist() == mixed.prefill_query_start_loc.tolist()
    assert builder.build(0, _common([[1, 2, 3, 4, 5, 6, 7]], [101], [1], 1, 1)).prefill_plan is None

