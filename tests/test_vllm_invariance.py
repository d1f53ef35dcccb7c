"""Prefix caching and chunked prefill change no greedy token (tiny Qwen3, D=128).

Small windows (sink 4, recent 16) so that most of every prompt is read as INT2 history:
the engine with prefix caching (later requests hit the shared prefix and replay only its
recent window) and the engine without it, prefilling in 16-token chunks, must agree token
for token (OSCAR applies the decode read rule to
every query). Cheap companion of the SmolLM2 tests (2 layers, random weights).
"""

from __future__ import annotations

import pytest

from conftest import greedy, oscar_status, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

OPTIONS = {"hadamard_only": True, "sink_tokens": 4, "recent_tokens": 16}
PREFIX = " ".join(f"item {i} costs {7 * i % 13} coins;" for i in range(40))
PROMPTS = [PREFIX + f" question {q}: what does item {q} cost?" for q in range(6)]
TOKENS = 48


def _run(model, **options) -> dict:
    llm = start_llm(model, block_size=16, max_model_len=480, disable_log_stats=False,
                    additional_config={"oscar": OPTIONS}, kv_cache_dtype="oscar", **options)
    try:
        if options.get("enable_prefix_caching"):
            ids = greedy(llm, PROMPTS[:1], TOKENS, ignore_eos=True) + greedy(llm, PROMPTS[1:], TOKENS, ignore_eos=True)
        else:
            ids = greedy(llm, PROMPTS, TOKENS, ignore_eos=True)
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        return {"ids": ids, "status": oscar_status(llm), "hits": metrics.get("vllm:prefix_cache_hits", 0)}
    finally:
        stop_llm(llm)


@pytest.mark.timeout(3600)
def test_prefix_hits_and_chunked_prefill_change_no_token(tiny_qwen3_path):
    cached = _run(tiny_qwen3_path, enable_prefix_caching=True)
    chunked = _run(tiny_qwen3_path, enable_prefix_caching=False, enable_chunked_prefill=True,
                   max_num_batched_tokens=16)
    assert cached["hits"] > 0
    assert cached["status"]["fallback_positions"] == 0 and chunked["status"]["fallback_positions"] == 0
    assert cached["ids"] == chunked["ids"]
