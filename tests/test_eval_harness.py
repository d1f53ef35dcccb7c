"""The evaluation harness on a tiny random Llama: quant-off equals the stock model, and the
one-pass masked mixture equals a slow token-by-token decode reference for every method."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_oscar.evaluation.baselines import KiviMethod, TurboQuantMethod, gaussian_lloyd_max
from vllm_oscar.evaluation.harness import method_logits, use_method
from vllm_oscar.evaluation.methods import (
    KVMethod,
    LayerRotations,
    RowMethod,
    hadamard_layers,
    identity_layers,
)

NUM_LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 16
SINK, RECENT = 3, 5


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=128, attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    # Planted outlier channels in the key projection, as real models have.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[3::HEAD_DIM] *= 8.0
    return model


def _random_rotations(seed: int) -> list[LayerRotations]:
    generator = torch.Generator().manual_seed(seed)
    def orthogonal() -> torch.Tensor:
        return torch.linalg.qr(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator))[0]
    return [LayerRotations(orthogonal(), orthogonal(), 0.9, 0.85) for _ in range(NUM_LAYERS)]


def all_methods() -> list[KVMethod]:
    return [
        RowMethod("int2-naive", "", identity_layers(NUM_LAYERS)),
        RowMethod("int2-quarot", "", hadamard_layers(NUM_LAYERS, KV_HEADS, HEAD_DIM)),
        RowMethod("oscar-like", "", _random_rotations(1), group_size=8),
        RowMethod("oscar-like-lm", "", _random_rotations(2), lloyd_max=True),
        KiviMethod(group_size=4),
        TurboQuantMethod("turboquant_3bit_nc", 3, 3, skip_boundary_layers=0),
        TurboQuantMethod("turboquant_4bit_skip", 4, 4, skip_boundary_layers=1),
    ]


def _reference_attention_factory(method: KVMethod, calls: list[int]):
    """Slow decode attention: one query, the cache built row by row (or KIVI group by group)."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        assert query.shape[2] == 1, "the reference decodes one token at a time"
        calls.append(1)
        layer, t = module.layer_idx, key.shape[2] - 1
        quantized_layer = method.quantizes_layer(layer, NUM_LAYERS)
        keys, values = [], []
        for s in range(t + 1):
            exact = s < SINK or t - s < RECENT or not quantized_layer
            if isinstance(method, KiviMethod) and not exact:
                g = method.group_size
                start = (s // g) * g
                exact = t - (start + g - 1) < RECENT
            if exact:
                keys.append(key[:, :, s].double())
                values.append(value[:, :, s].double())
            elif isinstance(method, KiviMethod):
                assert start + g <= t + 1
                block = slice(start, start + g)
                keys.append(method.quantize_keys(key[:, :, block], layer)[:, :, s - start].double())
                values.append(method.quantize_values(value[:, :, s : s + 1], layer)[:, :, 0].double())
            else:
                keys.append(method.quantize_keys(key[:, :, s : s + 1], layer)[:, :, 0].double())
                values.append(method.quantize_values(value[:, :, s : s + 1], layer)[:, :, 0].double())
        k = torch.stack(keys, dim=2).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        v = torch.stack(values, dim=2).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        probs = torch.softmax(query.double() @ k.transpose(-1, -2) * scaling, dim=-1)
        return (probs @ v).transpose(1, 2).to(query.dtype), None

    return attention


def reference_logits(model, ids: torch.Tensor, method: KVMethod) -> torch.Tensor:
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface

    calls: list[int] = []
    AttentionInterface.register("eval_reference", _reference_attention_factory(method, calls))
    AttentionMaskInterface.register("eval_reference", lambda *a, **k: None)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eval_reference")
    try:
        cache, rows = DynamicCache(config=model.config), []
        with torch.no_grad():
            for t in range(ids.shape[1]):
                out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                rows.append(out.logits[:, -1].float())
    finally:
        model.set_attn_implementation(previous)
    assert len(calls) == ids.shape[1] * NUM_LAYERS
    return torch.stack(rows, dim=1)


def test_quantization_off_equals_the_stock_model(model) -> None:
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock = model(ids).logits
    ours = method_logits(model, ids, KVMethod(), SINK, RECENT)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("method", all_methods(), ids=lambda m: m.name)
def test_one_pass_equals_token_by_token_decode(model, method) -> None:
    ids = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(4))
    one_pass = method_logits(model, ids, method, SINK, RECENT)
    slow = reference_logits(model, ids, method)
    torch.testing.assert_close(one_pass, slow, rtol=1e-4, atol=1e-4)
    # The quantized history must matter, or the comparison proves nothing.
    exact = method_logits(model, ids, KVMethod(), SINK, RECENT)
    assert (one_pass - exact).abs().max() > 1e-3


def test_generate_under_the_harness_matches_one_pass_argmax(model) -> None:
    method = all_methods()[1]
    prompt = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(5))
    with use_method(model, method, SINK, RECENT), torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    logits = method_logits(model, generated[:, :-1], method, SINK, RECENT)
    assert torch.equal(logits[0, prompt.shape[1] - 1 :].argmax(-1), generated[0, prompt.shape[1] :])


def test_bits_per_element() -> None:
    naive = all_methods()[0]
    assert naive.body_bits(64) == 2.5
    assert naive.bits_per_element(2048, 64, 30, 64, 256) == pytest.approx((2.5 * (2048 - 320) + 16 * 320) / 2048)
    kivi = KiviMethod(32)
    assert kivi.body_bits(64) == 3.0
    # Last query t = 2047: the group holding t - 256 = 1791 (1760..1791) ends at 1791, quantized;
    # exact tokens are the 64 sink tokens and 1792..2047 (256).
    assert kivi.bits_per_element(2048, 64, 30, 64, 256) == pytest.approx((3.0 * (2048 - 320) + 16 * 320) / 2048)
    # t = 2049: the group 1792..1823 still overlaps the window, so 1792..2049 (258) stay exact.
    assert kivi.bits_per_element(2050, 64, 30, 64, 256) == pytest.approx((3.0 * (2050 - 322) + 16 * 322) / 2050)
    tq3 = TurboQuantMethod("turboquant_3bit_nc", 3, 3)
    assert tq3.body_bits(64) == pytest.approx(0.5 * ((3 + 16 / 64) + (3 + 32 / 64)))
    per_layer = (tq3.body_bits(64) * 1728 + 16 * 320) / 2048
    assert tq3.bits_per_element(2048, 64, 30, 64, 256) == pytest.approx((per_layer * 26 + 16 * 4) / 30)
    assert KVMethod().bits_per_element(2048, 64, 30, 64, 256) == 16.0


def test_gaussian_lloyd_max_levels() -> None:
    centroids, boundaries = gaussian_lloyd_max(2)
    # Max (1960): 4-level optimum +-0.4528, +-1.510 with boundaries 0, +-0.9816.
    assert centroids.tolist() == pytest.approx([-1.510, -0.4528, 0.4528, 1.510], abs=1e-3)
    assert boundaries.tolist() == pytest.approx([-0.9816, 0.0, 0.9816], abs=1e-3)
    centroids3, _ = gaussian_lloyd_max(3)
    assert centroids3[-1] == pytest.approx(2.152, abs=1e-3)
    assert math.isclose(float(centroids3.sum()), 0.0, abs_tol=1e-9)


@pytest.mark.parametrize("method", all_methods(), ids=lambda m: m.name)
@pytest.mark.parametrize("q_len", [37, 9, 1])
def test_fused_chunked_attention_equals_the_dense_mixture(method, q_len, monkeypatch) -> None:
    """The fused per-chunk attention (exact copies + reconstructions, one softmax, causal
    truncation, masks shared by layers) equals the dense masked mixture, over several
    query chunks, with fewer queries than keys (decode) too."""
    from vllm_oscar.evaluation import harness

    monkeypatch.setattr(harness, "SDPA_QUERY_CHUNK", 8)
    gen = torch.Generator().manual_seed(6)
    kv_len = 37
    query = torch.randn(2, 4, q_len, HEAD_DIM, generator=gen)
    key = torch.randn(2, KV_HEADS, kv_len, HEAD_DIM, generator=gen) * 2
    value = torch.randn(2, KV_HEADS, kv_len, HEAD_DIM, generator=gen)
    state = harness.HarnessState(method, SINK, RECENT, NUM_LAYERS)
    for layer in range(NUM_LAYERS):
        fused = harness.mixed_attention(query, key, value, 0.3, state, layer)
        dense = harness.mixed_attention_reference(query, key, value, 0.3, state, layer)
        torch.testing.assert_close(fused, dense, rtol=1e-5, atol=1e-5)
