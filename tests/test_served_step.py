"""A served decode step without vLLM (bench/served_graph.py) on CPU: padded batches, as a full CUDA
graph runs them (padding rows: seq_len 0, slot -1, window table rows -1; max_seq_len = max_model_len),
against eager steps of the real requests on copies of the same state. The GPU run of the same check
replays captured graphs (bench/kernels_gpu.sh)."""

import os
import sys

import pytest
import torch

from vllm_oscar.config import FOLD_MODES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import served_graph  # noqa: E402


@pytest.mark.parametrize("fold", FOLD_MODES)
def test_padded_decode_steps_match_eager_steps_and_write_nothing_for_padding(fold):
    report: list = []
    served_graph.check(report, torch.device("cpu"), layers=1, rounds=8,
                       prompts={0: 400, 1: 130, 2: 64, 3: 1, 4: 300}, max_model_len=1024, fold=fold)
    (row,) = report
    assert row["ok"], row
    assert row["replays"] == 8 and row["max_rel_err_replay_vs_eager"] < served_graph.TOLERANCE


def test_cache_sized_for_the_positions_written_not_for_max_model_len():
    """A graph sized for a long max_model_len (the block table spans it) over a cache that holds only what the
    requests write, as vLLM sizes its cache by memory: a 128K graph at batch 32 no longer allocates 36 layers x
    32 x 128K positions (the CUDA OOM of docs/decisions.md)."""
    served = served_graph.ServedAttention(layers=1, hq=4, hkv=2, dim=64, max_model_len=131072, max_requests=3,
                                          device=torch.device("cpu"), block_size=64, cache_positions=300)
    assert served.block_table.shape == (3, 131072 // 64)
    assert served.caches[0].int2.shape[0] == 1 + 3 * 5  # the null block and ceil(300 / 64) blocks per request
    served.prefill(0, 290)
    assert len(served.rows[0]) == 5
