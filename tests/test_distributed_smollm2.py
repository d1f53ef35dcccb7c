"""PP=2 with the real SmolLM2-135M-Instruct and its calibrated rotations (opt-in).

Two engine starts of a 30-layer model (~2 minutes each on a loaded 2-core machine), so
it runs only with ``VLLM_OSCAR_DISTRIBUTED_SMOLLM2=1``; CI runs the tiny-model module
(tests/test_distributed.py). SmolLM2 has 9 query / 3 KV heads: TP=2 cannot split them,
so this is pipeline parallelism. Small BF16 windows make the INT2 history part of every
generation.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("vllm")

import distributed_setup as setup  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(os.environ.get("VLLM_OSCAR_DISTRIBUTED_SMOLLM2") != "1",
                       reason="opt-in: set VLLM_OSCAR_DISTRIBUTED_SMOLLM2=1 (two SmolLM2 engine starts)"),
]

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List five uses of a paperclip.",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    """(model folder, shipped rotation file)."""
    from transformers import AutoConfig

    from vllm_oscar.calibration.files import find_shipped_rotation
    from vllm_oscar.calibration.identity import ModelIdentity
    from vllm_oscar.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    identity = ModelIdentity.from_hf_config(AutoConfig.from_pretrained(folder), name=str(folder))
    rotations = find_shipped_rotation(identity)
    if rotations is None:
        pytest.skip("no shipped SmolLM2 rotation file in rotations/")
    return folder, rotations


def _run(smollm2: tuple[Any, Any], **parallel: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    folder, rotations = smollm2
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    kwargs = setup.engine_kwargs(folder, rotations, max_model_len=1024, **parallel)
    return setup.run_engine(kwargs, prompts, MAX_TOKENS)


def test_smollm2_pp2_equals_single_process(smollm2: tuple[Any, Any]) -> None:
    single = _run(smollm2)
    pp2 = _run(smollm2, pipeline_parallel_size=2)
    assert pp2["token_ids"] == single["token_ids"]
    layers = [sorted(r["layers"]) for r in sorted(pp2["reports"], key=lambda r: r["pp_rank"])]
    assert [len(names) for names in layers] == [15, 15] and not set(layers[0]) & set(layers[1])
    for report in pp2["reports"]:
        assert report["status"]["fallback_positions"] == 0
        assert {layer["backend"] for layer in report["layers"].values()} == {"OSCAR"}
        assert {layer["num_kv_heads"] for layer in report["layers"].values()} == {3}
