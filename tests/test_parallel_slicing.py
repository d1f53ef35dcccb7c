"""KV-head slicing under tensor parallelism, checked against vLLM's own weight sharding.

The brute-force oracle builds vLLM's ``QKVParallelLinear`` for every (tp_size, tp_rank),
loads a full k_proj / q_proj weight whose rows carry their global head index, and reads
back which heads landed on that rank. Only the two "which rank am I" queries of vLLM's
distributed state are patched (no process group exists in a unit test); the sharding
arithmetic and the weight loader are vLLM's.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from vllm_oscar.attention.parallel import kv_head_slice

HIDDEN = 16
HEAD_DIM = 8

# (total query heads, total KV heads, tensor parallel sizes)
LAYOUTS = [
    (8, 8, (1, 2, 4, 8)),  # MHA
    (8, 2, (1, 2, 4, 8)),  # GQA, replicated from tp=4
    (4, 1, (1, 2, 4)),  # MQA: always replicated
    (12, 4, (1, 2, 4)),
    (9, 3, (1, 3)),  # SmolLM2-135M: 9 q / 3 KV heads
    (16, 2, (8,)),  # 4 ranks per KV head
]


def _vllm_owned_heads(total_q: int, total_kv: int, tp_size: int, tp_rank: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) that vLLM's QKVParallelLinear gives ``tp_rank``."""
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    parameter = pytest.importorskip("vllm.model_executor.parameter")
    from vllm.config import VllmConfig, set_current_vllm_config

    patches = [
        mock.patch.object(module, name, return_value=value)
        for module in (linear, parameter)
        for name, value in (
            ("get_tensor_model_parallel_world_size", tp_size),
            ("get_tensor_model_parallel_rank", tp_rank),
        )
    ]
    for patch in patches:
        patch.start()
    try:
        with set_current_vllm_config(VllmConfig()):
            layer = linear.QKVParallelLinear(
                HIDDEN, HEAD_DIM, total_q, total_kv, bias=False, params_dtype=torch.float32
            )

        def load(shard: str, total_heads: int, offset: int, local_heads: int) -> list[int]:
            rows = torch.arange(total_heads, dtype=torch.float32).repeat_interleave(HEAD_DIM)
            layer.weight_loader(layer.weight, rows[:, None].expand(-1, HIDDEN).contiguous(), shard)
            got = layer.weight.data[offset : offset + local_heads * HEAD_DIM, 0]
            return got.view(local_heads, HEAD_DIM)[:, 0].long().tolist()

        q_heads = load("q", total_q, 0, layer.num_heads)
        kv_heads = load("k", total_kv, layer.num_heads * HEAD_DIM, layer.num_kv_heads)
        return q_heads, kv_heads
    finally:
        for patch in patches:
            patch.stop()


@pytest.mark.parametrize(
    "total_q,total_kv,tp_size",
    [(q, kv, tp) for q, kv, tps in LAYOUTS for tp in tps],
)
def test_kv_head_slice_matches_vllm_sharding(total_q: int, total_kv: int, tp_size: int) -> None:
    group = total_q // total_kv
    for tp_rank in range(tp_size):
        q_heads, kv_heads = _vllm_owned_heads(total_q, total_kv, tp_size, tp_rank)
        kv = kv_head_slice(total_kv, tp_size, tp_rank)
        assert list(range(total_kv))[kv] == kv_heads, (tp_size, tp_rank)
        # Every query head of the rank reads a KV head the rank holds, and local GQA
        # indexing (local q // local group) lands on the right global head.
        local_group = len(q_heads) // len(kv_heads)
        for local_q, global_q in enumerate(q_heads):
            assert global_q // group == kv.start + local_q // local_group


def test_replicated_heads_each_rank_gets_one_shared_head() -> None:
    # 2 KV heads over 8 ranks: ranks 0-3 share head 0, ranks 4-7 share head 1.
    assert [kv_head_slice(2, 8, r) for r in range(8)] == [slice(0, 1)] * 4 + [slice(1, 2)] * 4
    # 1 KV head (MQA): every rank holds it.
    assert [kv_head_slice(1, 4, r) for r in range(4)] == [slice(0, 1)] * 4


def test_split_heads_partition_all_heads_once() -> None:
    owned = [h for r in range(4) for h in range(8)[kv_head_slice(8, 4, r)]]
    assert owned == list(range(8))


@pytest.mark.parametrize("total_kv,tp_size", [(3, 2), (2, 3), (4, 3), (6, 4)])
def test_layouts_vllm_rejects_are_rejected(total_kv: int, tp_size: int) -> None:
    with pytest.raises(ValueError, match="evenly"):
        kv_head_slice(total_kv, tp_size, 0)
    with pytest.raises(AssertionError):  # vLLM's own divide() for the same layout
        _vllm_owned_heads(total_kv * tp_size, total_kv, tp_size, 0)


@pytest.mark.parametrize("args", [(0, 1, 0), (2, 0, 0), (2, 2, 2), (2, 2, -1)])
def test_bad_arguments(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        kv_head_slice(*args)
