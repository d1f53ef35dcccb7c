"""TP=2 over a model with ONE KV head: both ranks hold (a replica of) head 0 (opt-in).

vLLM replicates KV heads when the tensor-parallel size exceeds their number; each rank
must then serve with the rotation of the head it holds (``kv_head_slice``: rank r holds
head r // (tp / Hkv)). The slicing is unit-tested against vLLM's weight loader in CI
(tests/test_parallel_slicing.py); this end-to-end check costs two more engine starts,
so it runs only with ``VLLM_OSCAR_DISTRIBUTED_REPLICATED=1``.

Outputs: measured here (2026-11-29), 2 of 3 prompts give the single-process tokens and
one diverges at token 15, where the single-process run's top two candidates are 0.020
nats apart. Float rounding differs between TP=2 and one process (row-parallel o_proj sums
in another order); a last-bit difference can move a value across an INT2 rounding
boundary and change it by a whole quantization step, which shifts log-probabilities by
up to ~0.03 here, enough to flip a near-tie. So this test requires equal tokens except
from a near-tie on (NEAR_TIE), with top log-probabilities close before it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from vllm_oscar.attention.parallel import kv_head_slice  # noqa: E402

import distributed_setup as setup  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(os.environ.get("VLLM_OSCAR_DISTRIBUTED_REPLICATED") != "1",
                       reason="opt-in: set VLLM_OSCAR_DISTRIBUTED_REPLICATED=1 (two engine starts)"),
]

KV_HEADS = 1
#: A greedy step whose top two log-probabilities are closer than this (nats) is a near-tie.
NEAR_TIE = 0.05
#: Largest |top-1 log-probability difference| allowed before the first divergence.
LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def mqa(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model folder, rotation file) of a tiny 4 q / 1 KV head Llama."""
    from vllm_oscar.models.smollm2 import smollm2_folder

    root = tmp_path_factory.mktemp("replicated")
    model = setup.make_tiny_llama(root / "tiny-mqa", smollm2_folder(), kv_heads=KV_HEADS)
    return model, setup.calibrate_tiny(model, root / "rotations.safetensors")


def test_tp2_replicated_kv_head(mqa: tuple[Path, Path]) -> None:
    from vllm.model_executor.models.utils import extract_layer_index

    from vllm_oscar.calibration import load_rotation_file

    single = setup.run_engine(setup.engine_kwargs(*mqa), logprobs=2)
    tp2 = setup.run_engine(setup.engine_kwargs(*mqa, tensor_parallel_size=2), logprobs=2)
    rotations = load_rotation_file(mqa[1])
    reports = sorted(tp2["reports"], key=lambda r: r["tp_rank"])
    assert [(r["tp_rank"], r["tp_size"]) for r in reports] == [(0, 2), (1, 2)]
    for report in reports:
        kv = kv_head_slice(KV_HEADS, 2, report["tp_rank"])
        assert kv == slice(0, 1)
        assert report["status"]["fallback_positions"] == 0
        # each rank folds the replicated KV head's R_V into its half of W_o's columns
        assert report["status"]["output_folded_layers"] == report["status"]["num_attention_layers"] > 0
        for name, layer in report["layers"].items():
            expected = rotations.layers[extract_layer_index(name)]
            assert layer["backend"] == "OSCAR" and layer["num_kv_heads"] == 1
            for field in ("k_rotation", "v_rotation"):
                got = torch.tensor(layer[field], dtype=torch.float32)
                assert torch.equal(got, getattr(expected, field)[kv].to(torch.float32)), (name, field)
    assert reports[0]["layers"] == reports[1]["layers"]  # both ranks hold the same replica
    for divergence in setup.first_divergence(single, tp2):
        assert divergence["max_logprob_delta"] < LOGPROB_TOLERANCE, divergence
        if divergence["position"] is not None:
            assert divergence["reference_gap"] < NEAR_TIE, divergence
