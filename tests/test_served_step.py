"""A served decode step without vLLM (bench/served_graph.py) on CPU: padded batches, as a full CUDA
graph runs them (padding rows: seq_len 0, slot -1, window table rows -1; max_seq_len = max_model_len),
against eager steps of the real requests on copies of the same state. The GPU run of the same check
replays captured graphs (bench/kernels_gpu.sh)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import served_graph  # noqa: E402


def test_padded_decode_steps_match_eager_steps_and_write_nothing_for_padding():
    report: list = []
    served_graph.check(report, torch.device("cpu"), layers=1, rounds=8,
                       prompts={0: 400, 1: 130, 2: 64, 3: 1, 4: 300}, max_model_len=1024)
    (row,) = report
    assert row["ok"], row
    assert row["replays"] == 8 and row["max_rel_err_replay_vs_eager"] < served_graph.TOLERANCE
