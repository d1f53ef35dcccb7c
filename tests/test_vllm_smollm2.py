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

import window_check
from conftest import chat_prompts, greedy, oscar_status, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

#: KV budget (GiB) of engines A and B: the capacity ratio is measured under the same budget.
KV_SPACE_GIB = "3"
#: Greedy agreement: tokens per generation (>= 600 so history leaves the 256-token window).
LONG_TOKENS = 600
QUESTIONS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how a computer works, from transistors to operating systems.",
    "Describe the history of the Roman Empire.",
    "Give me a detailed recipe for bread and explain each step.",
]
#: A shared ~420-token prefix (beyond sink + recent = 320) and distinct questions after it.
SHARED_PREFIX = (
    "You are a helpful assistant. Read the following notes carefully before answering. "
    + " ".join(f"Note {i}: the warehouse in district {i} stores {3 * i + 7} crates of apples, "
               f"{i + 11} crates of pears and ships them every {i % 5 + 1} days." for i in range(1, 19))
)
SHARED_QUESTIONS = [
    "How many crates of apples are in district 4?",
    "Which district ships every 3 days?",
    "Summarise the notes in one sentence.",
    "How many crates of pears are in district 10?",
    "What is stored in district 1?",
]
SHARED_TOKENS = 24
#: Preemption set: 4 prompts of ~120 tokens, 128 greedy tokens each: 4 x ~250 tokens do not fit
#: engine C's 47 usable blocks of 16 (752 tokens), 4 prompts do, so running requests are preempted.
PREEMPT_TOKENS = 128


def _shared_prompts(llm) -> list[str]:
    return chat_prompts(llm, [SHARED_PREFIX + "\n\nQuestion: " + q for q in SHARED_QUESTIONS])


def _preempt_prompts(llm) -> list[str]:
    prefix = SHARED_PREFIX[: len(SHARED_PREFIX) // 8]
    return chat_prompts(llm, [f"Story {i}. " + prefix + " Continue the story." for i in range(4)])


def _greedy_with_logprobs(llm, prompt, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ids of one prompt (str or prompt dict) and the logprob of each chosen token."""
    from vllm import SamplingParams

    (output,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1),
                             use_tqdm=False)
    completion = output.outputs[0]
    return list(completion.token_ids), [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]


def _metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


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
    """OSCAR, prefix caching on, one-block chunks, a preempting pool, window-store check on.

    48 blocks of 16 tokens (vLLM keeps one back): one shared-prefix prompt (~690 tokens + 24)
    fits; the four preemption prompts with their generations do not fit together.
    """
    import cloudpickle

    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = start_llm(smollm2_path, kv_cache_dtype="oscar", enable_prefix_caching=True,
                    enable_chunked_prefill=True, max_num_batched_tokens=16, num_gpu_blocks_override=48,
                    **{**COMMON, "max_model_len": 736})
    try:
        cloudpickle.register_pickle_by_value(window_check)
        (layers,) = llm.collective_rpc(window_check.install)
        prompts = _shared_prompts(llm)
        # one request in flight at a time: the same GEMM shapes with and without hits
        cold = [_greedy_with_logprobs(llm, {"prompt": p, "cache_salt": f"cold-{i}"}, SHARED_TOKENS)
                for i, p in enumerate(prompts)]
        hits_before = _metric(llm, "vllm:prefix_cache_hits")
        hot = [_greedy_with_logprobs(llm, p, SHARED_TOKENS) for p in prompts]
        print("engine C: cold", [ids for ids, _ in cold], "hot", [ids for ids, _ in hot])
        results = {"checked_layers": layers, "cold": cold, "hot": hot,
                   "prefix_hits": _metric(llm, "vllm:prefix_cache_hits") - hits_before,
                   "fallbacks_after_prefix_runs": oscar_status(llm)["fallback_positions"]}
        preempt = greedy(llm, _preempt_prompts(llm), PREEMPT_TOKENS, ignore_eos=True)
        results.update(preempt=preempt, preemptions=_metric(llm, "vllm:num_preemptions"),
                       status=oscar_status(llm), window_check=llm.collective_rpc(window_check.report)[0])
        return results
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
    prefixes = []
    for ours, reference in zip(engine_a["long"], engine_b["long"]):
        prefixes.append(next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(ours)))
    share_32 = sum(n >= 32 for n in prefixes) / len(prefixes)
    mean_prefix = sum(prefixes) / len(prefixes)
    report = {"matching_prefixes": prefixes, "share_first_32": share_32, "mean_matching_prefix": mean_prefix,
              "tokens": LONG_TOKENS}
    record_property("greedy_agreement", json.dumps(report))
    print("greedy agreement OSCAR vs CPU_ATTN (BF16):", json.dumps(report))
    # A 135M model in bf16 flips near-tie tokens: OSCAR with every position in BF16
    # windows matched BF16 for only 5-53 tokens (docs/design.md), so only a floor is asserted.
    assert mean_prefix >= 8


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
    assert engine_c["prefix_hits"] >= 4 * 16 * 16  # prompts 1..4 each hit >= 16 blocks of the prefix
    # every window position read in BF16 in both runs (else they legitimately differ)
    assert engine_c["fallbacks_after_prefix_runs"] == 0
    for (cold_ids, cold_lp), (hot_ids, hot_lp) in zip(engine_c["cold"], engine_c["hot"]):
        assert 0 < len(cold_ids) <= SHARED_TOKENS  # greedy stops at EOS (requests 0 and 1 do)
        assert hot_ids == cold_ids
        assert hot_lp == cold_lp  # exact: no tolerance is needed when the shapes match


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
    assert engine_c["checked_layers"] == 30
    assert engine_c["preemptions"] > 0  # the small pool really preempted requests
    assert all(len(ids) == PREEMPT_TOKENS for ids in engine_c["preempt"])
    assert check["rows"] > 0 and check["calls"] > 0
    assert check["stale"] == 0, check
    assert engine_c["status"]["fallback_positions"] == 0, engine_c["status"]
