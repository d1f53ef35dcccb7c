"""OSCAR inside vLLM on the real SmolLM2-135M-Instruct (D=64): backend, quality, caching.

Three engines, each started once:
  A  kv_cache_dtype="oscar", prefix caching on, large token budget;
  C  OSCAR, prefix caching on, chunked prefill with a 16-token (one block) budget, a KV
     pool so small that concurrent requests are preempted and recomputed;
  B  vLLM's own backend (CPU_ATTN, BF16 KV), the reference for greedy agreement and for
     the KV capacity under the same memory budget.

Invariance (issue 5). vLLM's CPU GEMMs (oneDNN, bf16) are not batch invariant: a row's
result depends on how many rows the step has, so two engines that batch or chunk the same
prompts differently give different greedy tokens even with vLLM's own backend (measured,
docs/design.md). Greedy identity is therefore only asserted where both sides run the same
GEMM shapes: in engine C, each prompt alone (one request in flight, M = 1 per decode step)
with one-block chunks, once without prefix hits (a per-prompt cache salt) and once hitting
the shared prefix. Hits and their replay start on block boundaries, so both runs compute
every position in the same 16-token chunk; OSCAR's read rule then makes the outputs and
logprobs bit-identical. Preemption cannot keep GEMM shapes fixed (it changes the batch), so
it is tested by what could go wrong in OSCAR: every BF16 window row attention reads is the
copy of the token stored in INT2 at that position (tests/window_check.py).
"""

from __future__ import annotations

import json

import pytest

from conftest import chat_prompts, greedy, oscar_status, start_llm, stop_llm
from smollm2_workloads import (
    LONG_TOKENS,
    QUESTIONS,
    WINDOW_ENGINE,
    agreement_report,
    assert_no_stale_window_row,
    assert_prefix_hits_change_nothing,
    window_workload,
)

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

#: KV budget (GiB) of engines A and B: the capacity ratio is measured under the same budget.
KV_SPACE_GIB = "3"
COMMON = dict(max_model_len=2048, block_size=16, additional_config={"oscar": {}}, disable_log_stats=False)


@pytest.fixture(scope="module")
def engine_a(smollm2_path, monkeypatch_module) -> dict:
    """OSCAR via kv_cache_dtype="oscar" (shipped rotations), prefix caching on."""
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", KV_SPACE_GIB)
    llm = start_llm(smollm2_path, kv_cache_dtype="oscar", enable_prefix_caching=True, **COMMON)
    try:
        results = {"long": greedy(llm, chat_prompts(llm, QUESTIONS), LONG_TOKENS, ignore_eos=True)}
        results["status"] = oscar_status(llm)
        return results
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def engine_b(smollm2_path, monkeypatch_module) -> dict:
    """vLLM's own CPU backend (BF16 KV), same KV budget."""
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", KV_SPACE_GIB)
    llm = start_llm(smollm2_path, max_model_len=2048, block_size=32)
    try:
        return {"status": oscar_status(llm),
                "long": greedy(llm, chat_prompts(llm, QUESTIONS), LONG_TOKENS, ignore_eos=True)}
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def engine_c(smollm2_path, monkeypatch_module) -> dict:
    """OSCAR, the window workload (smollm2_workloads): prefix hits, one-block chunks, a preempting pool."""
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = start_llm(smollm2_path, kv_cache_dtype="oscar", **{**COMMON, **WINDOW_ENGINE})
    try:
        return window_workload(llm)
    finally:
        stop_llm(llm)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.timeout(3600)
def test_kv_cache_dtype_oscar_runs_the_oscar_backend(engine_a):
    status = engine_a["status"]
    assert status["impl_classes"] == ["OscarAttentionImpl"]
    assert status["num_attention_layers"] == 30
    assert status["rotation_sources"] == ["shipped"]
    assert status["fallback_positions"] == 0, status
    assert all(len(ids) == LONG_TOKENS for ids in engine_a["long"])


@pytest.mark.timeout(3600)
def test_greedy_agreement_with_vllm_bf16_backend(engine_a, engine_b, record_property):
    assert engine_b["status"]["impl_classes"] == ["CPUAttentionBackendImpl"]
    report = agreement_report(engine_a["long"], engine_b["long"])
    record_property("greedy_agreement", json.dumps(report))
    print("greedy agreement OSCAR vs CPU_ATTN (BF16):", json.dumps(report))
    # A 135M model in bf16 flips near-tie tokens: OSCAR with every position in BF16
    # windows matched BF16 for only 5-53 tokens (docs/design.md), so only a floor is asserted.
    assert report["mean_matching_prefix"] >= 8


@pytest.mark.timeout(3600)
def test_kv_capacity_is_at_least_6x_bf16_under_the_same_budget(engine_a, engine_b, record_property):
    oscar, bf16 = engine_a["status"], engine_b["status"]
    oscar_tokens = oscar["kv_cache_blocks"] * oscar["block_size"]
    bf16_tokens = bf16["kv_cache_blocks"] * bf16["block_size"]
    report = {"head_dim": 64, "budget_gib": float(KV_SPACE_GIB), "oscar_tokens": oscar_tokens,
              "bf16_tokens": bf16_tokens, "ratio": oscar_tokens / bf16_tokens,
              "window_store_bytes": oscar["window_store_bytes"]}
    record_property("kv_capacity_d64", json.dumps(report))
    print("KV capacity D=64:", json.dumps(report))
    assert oscar["window_store_bytes"] > 0
    assert oscar_tokens / bf16_tokens >= 6.0


@pytest.mark.timeout(3600)
def test_prefix_hits_change_no_token_and_no_logprob(engine_c, record_property):
    """Same prompts, same GEMM shapes, with and without prefix-cache hits: bit-identical.

    Each prompt runs alone with one-block chunks (hits and their recent-window replay start
    on block boundaries), so vLLM's non-batch-invariant GEMMs see the same rows in the same
    shapes; any difference comes from what OSCAR reads (window store, INT2 history, replay).
    """
    record_property("prefix_invariance", json.dumps({"prefix_hits": engine_c["prefix_hits"],
                                                     "fallbacks": engine_c["fallbacks_after_prefix_runs"]}))
    assert_prefix_hits_change_nothing(engine_c)


@pytest.mark.timeout(3600)
def test_preemption_and_prefix_hits_read_no_stale_window_row(engine_c, record_property):
    """Preemption/recompute and prefix hits never make attention read a stale BF16 copy.

    Checked on every attention call of engine C (all 30 layers): each BF16 window row read
    re-quantizes to the INT2 codes stored at its position (window_check.ROW_MISMATCH).
    Greedy identity with an engine that does not preempt is not a valid test: preemption
    changes the batch, and vLLM's own backend changes tokens with the batch too.
    """
    check = engine_c["window_check"]
    record_property("window_check", json.dumps({**check, "preemptions": engine_c["preemptions"]}))
    print("window check:", check, "preemptions:", engine_c["preemptions"])
    assert_no_stale_window_row(engine_c, num_layers=30)
