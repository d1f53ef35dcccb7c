"""R_V folded into SmolLM2's weights by the vLLM backend (vllm_oscar.attention.fold), end to end, in bf16.

Three engines score the same held-out prose (prompt log-probabilities, prefilled in 64-token chunks without
prefix caching, so every scored token past the windows reads the INT2 history of earlier chunks): vLLM's own
CPU attention (BF16 reference), OSCAR unfolded (fold_rotations "none") and OSCAR with the default fold (R_V in
W_v and W_o). The fold adds one bf16 rounding to two weight matrices per layer; the quantization itself moves
log-probabilities by ~0.12 on this text (mean |gap| to BF16). Requirement, stated against that effect: the
fold changes the mean |gap| to BF16 by less than a tenth of the quantization effect, and the perplexity by less
than 0.5% (measured 2026-12-02 on 8 sequences: +0.001 and -0.01%; a fold with a wrong rotation or head order
scrambles the values and fails by far). Exactness without the bf16 rounding is checked in float32 by
tests/test_eval_vllm_agreement.py (the default fold against the harness) and by tests/test_fold.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import oscar_status, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "brown.txt.xz"
SEQ_LEN, SEQUENCES, CHUNK, FIRST_SCORED = 1024, 3, 64, 320  # scored: positions past sink + recent
ENGINE = {"enable_prefix_caching": False, "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK,
          "max_model_len": 2048, "block_size": 32}
CONFIGS = {"bf16": {}, "none": {"kv_cache_dtype": "oscar", "additional_config": {"oscar": {"fold_rotations": "none"}}},
           "folded": {"kv_cache_dtype": "oscar"}}


@pytest.fixture(scope="module")
def runs(smollm2_path):
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_oscar.evaluation.data import heldout_sequences

    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} is not present")
    sequences = heldout_sequences(AutoTokenizer.from_pretrained(smollm2_path), [str(CORPUS)], SEQ_LEN, SEQUENCES)
    results = {}
    for name, options in CONFIGS.items():
        llm = start_llm(smollm2_path, **ENGINE, **options)
        try:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=ids.tolist()) for ids in sequences],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            status = oscar_status(llm) if name != "bf16" else None
            reload_error = None
            if name == "folded":
                with pytest.raises(Exception) as caught:
                    llm.collective_rpc("reload_weights")
                reload_error = str(caught.value)
                after_reload = llm.generate([TokensPrompt(prompt_token_ids=sequences[0].tolist())],
                                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        finally:
            stop_llm(llm)
        logprobs = torch.stack([
            torch.tensor([entry[int(token)].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])],
                         dtype=torch.float64) for out, ids in zip(outputs, sequences)])
        results[name] = {"logprobs": logprobs[:, FIRST_SCORED:], "status": status, "reload_error": reload_error}
        if name == "folded":
            results[name]["after_reload"] = [entry[int(token)].logprob for entry, token
                                             in zip(after_reload.prompt_logprobs[1:], sequences[0][1:])]
            results[name]["first"] = [entry[int(token)].logprob for entry, token
                                      in zip(outputs[0].prompt_logprobs[1:], sequences[0][1:])]
    return results


def test_the_default_folds_every_smollm2_layer_and_none_folds_nothing(runs):
    assert runs["folded"]["status"]["output_folded_layers"] == 30
    assert runs["folded"]["status"]["value_folded_layers"] == 30
    assert runs["none"]["status"]["output_folded_layers"] == 0
    assert runs["none"]["status"]["value_folded_layers"] == 0


def test_the_fold_keeps_smollm2_as_close_to_bf16_as_unfolded(runs, record_property):
    bf16 = runs["bf16"]["logprobs"]
    gap = {name: float((runs[name]["logprobs"] - bf16).abs().mean()) for name in ("none", "folded")}
    ppl = {name: float(torch.exp(-runs[name]["logprobs"].mean())) for name in ("bf16", "none", "folded")}
    effect = gap["none"]
    record_property("fold_quality", {"gap_to_bf16": gap, "ppl": ppl})
    print(f"mean |logprob gap| to BF16: unfolded {gap['none']:.4f}, folded {gap['folded']:.4f}; ppl {ppl}")
    assert effect > 0
    assert abs(gap["folded"] - gap["none"]) < 0.1 * effect, gap
    assert abs(ppl["folded"] / ppl["none"] - 1) < 0.005, ppl


def test_reloading_weights_into_a_folded_model_fails_with_the_way_out_and_serves_on(runs):
    assert "fold_rotations" in runs["folded"]["reload_error"]
    # the engine still serves the folded weights, unchanged
    assert runs["folded"]["after_reload"] == runs["folded"]["first"]
