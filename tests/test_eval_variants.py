"""Every named evaluation method builds and round-trips K/V; the refit quantizer's claims."""

from __future__ import annotations

import pytest
import torch

from vllm_oscar.evaluation.variants import BASELINES, OSCAR_VARIANTS, Geometry, baseline_method, oscar_methods
from vllm_oscar.quant import clip_rows, dequantize, fake_quantize, quantize

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


@pytest.fixture(scope="module")
def stats():
    from transformers import LlamaConfig, LlamaForCausalLM

    from vllm_oscar.calibration.statistics import collect_statistics

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
    return collect_statistics(model, tokens, sample_sequences=2, progress=False)


def test_every_method_builds_and_round_trips(stats) -> None:
    geometry = Geometry(LAYERS, KV_HEADS, HEAD_DIM)
    methods = {name: baseline_method(name, geometry) for name in BASELINES}
    methods.update(oscar_methods(list(OSCAR_VARIANTS), stats, torch.device("cpu"), sink=2, recent=8, progress=False))
    assert set(methods) == set(BASELINES) | set(OSCAR_VARIANTS)
    keys = torch.randn(1, KV_HEADS, 40, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    for name, method in methods.items():
        for layer in range(LAYERS):
            out_k, out_v = method.quantize_keys(keys, layer), method.quantize_values(keys, layer)
            assert out_k.shape == keys.shape and out_v.shape == keys.shape and out_k.dtype == torch.float32
            assert torch.isfinite(out_k).all() and torch.isfinite(out_v).all()
            if name != "bf16" and method.quantizes_layer(layer, LAYERS):
                assert not torch.equal(out_k, keys), name
        assert method.body_bits(HEAD_DIM) >= 2.0


def test_refit_never_worse_and_better_than_min_max_on_gaussian_rows() -> None:
    rows = torch.randn(2000, 64, generator=torch.Generator().manual_seed(3))
    plain = fake_quantize(rows, 1.0, 64)
    refit = fake_quantize(rows, 1.0, 64, torch.float16, refit_iterations=4)
    plain_error = ((rows - plain) ** 2).sum(-1)
    refit_error = ((rows - refit) ** 2).sum(-1)
    assert bool((refit_error <= plain_error + 1e-6).all())
    # The MSE-optimal 4-level uniform grid of a Gaussian is much narrower than its range.
    assert float(refit_error.mean()) < 0.7 * float(plain_error.mean())
    # Still a 4-level uniform grid per row: every reconstructed row has <= 4 distinct values.
    assert max(len(torch.unique(r)) for r in refit[:50]) <= 4


def test_refit_with_zero_iterations_is_the_clipped_quantizer() -> None:
    rows = torch.randn(50, 32, generator=torch.Generator().manual_seed(4))
    clipped_min_max = dequantize(quantize(clip_rows(rows, 0.9), 32, torch.float16))
    assert torch.equal(fake_quantize(rows, 0.9, 32, torch.float16, refit_iterations=0), clipped_min_max)


def test_file_methods_use_the_served_quantizer() -> None:
    """oscar-file is what the backend serves with default options (OscarConfig's refit);
    the other file methods fix the (K, V) refit rounds and, some, the key clip ratio."""
    from pathlib import Path

    from vllm_oscar.config import GRID_REFIT_ITERATIONS, REFIT_SCALE_FLOOR, OscarConfig, refit_pair
    from vllm_oscar.evaluation.variants import FILE_METHODS, FILE_VARIANTS, file_method

    shipped = Path(__file__).resolve().parents[1] / "rotations" / "SmolLM2-135M-Instruct.safetensors"
    built = {name: file_method(str(shipped), name) for name in FILE_METHODS}
    assert refit_pair(built["oscar-file"].refit_iterations) == refit_pair(OscarConfig().refit_iterations)
    assert built["oscar-file-refit"].refit_iterations == GRID_REFIT_ITERATIONS
    assert built["oscar-file-minmax"].refit_iterations == 0
    assert built["oscar-file-vrefit"].refit_iterations == (0, GRID_REFIT_ITERATIONS)
    assert built["oscar-file-krefit"].refit_iterations == (GRID_REFIT_ITERATIONS, 0)
    assert (built["oscar-file"].refit_floor == REFIT_SCALE_FLOOR
            and built["oscar-file-refit"].refit_floor == (False, False))
    fewer_rounds = {"oscar-file-r1": 1, "oscar-file-r2": 2, "oscar-file-r3": 3, "oscar-file-k1v2": (1, 2),
                    "oscar-file-k4v2": (4, 2), "oscar-file-k4v1": (4, 1), "oscar-file-k4v0": (4, 0),
                    "oscar-file-k6v2": (6, 2), "oscar-file-k8v2": (8, 2), "oscar-file-k8v4": (8, 4),
                    "oscar-file-k12v2": (12, 2)}
    for name, rounds in fewer_rounds.items():
        assert built[name].refit_iterations == rounds and built[name].refit_floor == REFIT_SCALE_FLOOR
    stored = built["oscar-file"].layers[0]
    for name, (_, _, clip_k, _) in FILE_VARIANTS.items():
        layer = built[name].layers[0]
        assert layer.clip_k == (stored.clip_k if clip_k is None else clip_k) and layer.clip_v == stored.clip_v
        assert torch.equal(layer.key, stored.key) and torch.equal(layer.value, stored.value)
    with pytest.raises(ValueError, match="rotation-file method"):
        file_method(str(shipped), "oscar-file-typo")


def test_row_method_refit_per_side() -> None:
    from vllm_oscar.evaluation.methods import RowMethod, identity_layers

    rows = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(5))
    split = RowMethod("split", "", identity_layers(1), refit_iterations=(0, 3))
    plain = RowMethod("plain", "", identity_layers(1))
    refit = RowMethod("refit", "", identity_layers(1), refit_iterations=3)
    assert torch.equal(split.quantize_keys(rows, 0), plain.quantize_keys(rows, 0))
    assert torch.equal(split.quantize_values(rows, 0), refit.quantize_values(rows, 0))
    assert not torch.equal(plain.quantize_values(rows, 0), refit.quantize_values(rows, 0))
