"""Calibration statistics, rotations and clip search on tiny random models, against
float64 brute force written here (RoPE, causal softmax and covariances from scratch)."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_oscar.calibration import (  # noqa: E402
    ModelIdentity,
    build_rotations,
    capture_attention,
    collect_statistics,
    search_clip_ratios,
)
from vllm_oscar.calibration.clip_search import LayerErrorModel, rotated_sample  # noqa: E402
from vllm_oscar.config import CLIP_RATIO_GRID, VALUE_FORM_LOGIT_ENERGY  # noqa: E402
from vllm_oscar.quant import bit_reversal_permutation, fake_quantize, hadamard_matrix  # noqa: E402

SEQ, TOKENS = 3, 24


def tiny_llama(seed: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=128, rope_theta=500.0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def tiny_qwen3(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    )
    return transformers.Qwen3ForCausalLM(config).eval()


def brute_force_qkv(model: torch.nn.Module, tokens: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per layer float64 (q [B,Hq,T,D], k [B,Hkv,T,D], v [B,Hkv,T,D]) from the layer inputs,
    with RoPE computed here (Llama rotate-half convention)."""
    config = model.config
    d = config.head_dim
    with torch.no_grad():
        hidden = model(tokens, output_hidden_states=True).hidden_states
    positions = torch.arange(tokens.shape[1], dtype=torch.float64)
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)  # [T, D]
    cos, sin = angles.cos(), angles.sin()

    def rope(x: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * cos + half * sin

    result = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden[index]).double()
        batch, tokens_, _ = normed.shape

        def project(linear: torch.nn.Linear) -> torch.Tensor:
            out = normed @ linear.weight.double().T
            return out.view(batch, tokens_, -1, d).transpose(1, 2)

        result.append((rope(project(attn.q_proj)), rope(project(attn.k_proj)), project(attn.v_proj)))
    return result


def brute_force_targets(qkv: list[tuple[torch.Tensor, ...]], group: int) -> dict[str, torch.Tensor]:
    """C_K, C_V (output form) and C_V (logit-energy form) per layer and KV head, float64."""
    key_targets, outputs, energies = [], [], []
    for q, k, v in qkv:
        batch, heads, tokens, d = q.shape
        kv_heads = k.shape[1]
        c_k = torch.zeros(kv_heads, d, d, dtype=torch.float64)
        c_out = torch.zeros_like(c_k)
        weighted = torch.zeros_like(c_k)
        weight_sum = torch.zeros(kv_heads, dtype=torch.float64)
        causal = torch.ones(tokens, tokens).tril().bool()
        for b in range(batch):
            for h in range(kv_heads):
                seq_c = torch.zeros(d, d, dtype=torch.float64)
                for i in range(h * group, (h + 1) * group):
                    c_k[h] += q[b, i].T @ q[b, i]
                    seq_c += q[b, i].T @ q[b, i]
                    scores = (q[b, i] @ k[b, h].T / math.sqrt(d)).masked_fill(~causal, -math.inf)
                    out = scores.softmax(-1) @ v[b, h]
                    c_out[h] += out.T @ out
                seq_c /= tokens * group
                for t in range(tokens):
                    w = k[b, h, t] @ seq_c @ k[b, h, t]
                    weighted[h] += w * torch.outer(v[b, h, t], v[b, h, t])
                    weight_sum[h] += w
        key_targets.append(c_k / (batch * tokens * group))
        outputs.append(c_out / (batch * tokens * group))
        energies.append(weighted / weight_sum[:, None, None])
    return {"key": torch.stack(key_targets), "output": torch.stack(outputs), "energy": torch.stack(energies)}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_capture_leaves_logits_bit_identical_and_restores_config(make) -> None:
    model = make(seed=1)
    tokens = torch.randint(0, 97, (2, TOKENS))
    calls: list[tuple] = []
    with torch.no_grad():
        before = model(tokens).logits
        original = model.config._attn_implementation
        with capture_attention(model, lambda *args: calls.append(args)):
            during = model(tokens).logits
        after = model(tokens).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert model.config._attn_implementation == original
    assert [c[0] for c in calls] == [0, 1]
    layer, q, k, v, out, scaling = calls[0]
    assert q.shape == (2, 4, TOKENS, 16) and k.shape == v.shape == (2, 2, TOKENS, 16)
    assert out.shape == (2, TOKENS, 4, 16) and scaling == pytest.approx(16 ** -0.5)


def test_capture_restores_config_when_the_forward_raises() -> None:
    model = tiny_llama(seed=2)
    original = model.config._attn_implementation
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(model, lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))):
            model(torch.randint(0, 97, (1, 8)))
    assert model.config._attn_implementation == original


def test_capture_rejects_a_model_without_attention_interface() -> None:
    with pytest.raises(ValueError, match="cannot capture attention"):
        with capture_attention(torch.nn.Linear(4, 4), lambda *args: None):
            pass


def test_statistics_equal_float64_brute_force() -> None:
    model = tiny_llama(seed=3)
    tokens = torch.randint(0, 97, (SEQ, TOKENS))
    stats = collect_statistics(model, tokens, batch_size=2, sample_sequences=2, progress=False)
    expected = brute_force_targets(brute_force_qkv(model, tokens), group=2)
    assert stats.num_tokens == SEQ * TOKENS
    for name, got in (("key", stats.key_target), ("output", stats.value_output), ("energy", stats.value_logit_energy)):
        assert got.dtype == torch.float64
        scale = expected[name].abs().max()
        assert (got - expected[name]).abs().max() <= 2e-5 * scale, name
    assert stats.samples is not None and stats.samples.num_sequences == 2
    assert stats.samples.query[0].shape == (2, TOKENS, 4, 16)


def test_excluded_samples_are_kept_but_left_out_of_the_statistics() -> None:
    model = tiny_llama(seed=11)
    tokens = torch.randint(0, 97, (5, TOKENS))
    stats = collect_statistics(model, tokens, batch_size=2, sample_sequences=3, exclude_samples=True, progress=False)
    expected = brute_force_targets(brute_force_qkv(model, tokens[3:]), group=2)
    assert stats.num_tokens == 2 * TOKENS
    assert (stats.key_target - expected["key"]).abs().max() <= 2e-5 * expected["key"].abs().max()
    assert (stats.value_output - expected["output"]).abs().max() <= 2e-5 * expected["output"].abs().max()
    assert stats.samples is not None and stats.samples.num_sequences == 3
    q0 = brute_force_qkv(model, tokens[:3])[0][0]  # layer 0 queries [3, Hq, T, D]
    assert torch.allclose(stats.samples.query[0].double(), q0.transpose(1, 2), atol=1e-4)
    with pytest.raises(ValueError, match="all 3 sequences are clip-search samples"):
        collect_statistics(model, tokens[:3], sample_sequences=3, exclude_samples=True, progress=False)


def test_collect_statistics_rejects_bad_tokens() -> None:
    model = tiny_llama(seed=4)
    with pytest.raises(ValueError, match=r"integer tensor \[N, T\]"):
        collect_statistics(model, torch.zeros(2, 3, 4, dtype=torch.long), progress=False)
    with pytest.raises(ValueError, match="empty"):
        collect_statistics(model, [], progress=False)


def _check_eigen_structure(rotation: torch.Tensor, target: torch.Tensor, use_hadamard: bool) -> None:
    """Undo P_br (and H): the columns must be eigenvectors of target, eigenvalues descending."""
    d = target.shape[-1]
    target_of = bit_reversal_permutation(d)
    eigenvalues = torch.linalg.eigvalsh(target).flip(0)
    undone = rotation.double()[:, target_of]  # column i = sorted direction i (after H)
    if use_hadamard:
        undone = undone @ hadamard_matrix(d)
    for i in range(d):
        column = undone[:, i]
        residual = target @ column - eigenvalues[i] * column
        assert residual.norm() <= 1e-4 * eigenvalues[0], i


@pytest.mark.parametrize("use_hadamard", [True, False])
def test_rotations_are_orthogonal_eigen_sorted_and_bit_reversed(use_hadamard: bool) -> None:
    model = tiny_llama(seed=5)
    stats = collect_statistics(model, torch.randint(0, 97, (2, TOKENS)), progress=False)
    rotations = build_rotations(stats, use_hadamard=use_hadamard, value_form=VALUE_FORM_LOGIT_ENERGY)
    for index, layer in enumerate(rotations.layers):
        assert layer.k_rotation.dtype == torch.float32 and layer.k_rotation.shape == (2, 16, 16)
        eye = torch.eye(16, dtype=torch.float64)
        for h in range(2):
            for rotation, target, eigen in (
                (layer.k_rotation[h], stats.key_target[index, h], layer.k_eigenvalues[h]),
                (layer.v_rotation[h], stats.value_logit_energy[index, h], layer.v_eigenvalues[h]),
            ):
                r = rotation.double()
                assert (r.T @ r - eye).abs().max() < 1e-5
                assert torch.all(eigen[:-1] >= eigen[1:])
                assert torch.allclose(eigen, torch.linalg.eigvalsh(target).flip(0), rtol=1e-9, atol=1e-12)
                _check_eigen_structure(rotation, target, use_hadamard)


def test_per_layer_rotation_is_shared_by_heads_and_uses_the_head_mean() -> None:
    model = tiny_llama(seed=6)
    stats = collect_statistics(model, torch.randint(0, 97, (2, TOKENS)), progress=False)
    rotations = build_rotations(stats, per_head=False)
    assert rotations.metadata["method"]["granularity"] == "layer"
    for index, layer in enumerate(rotations.layers):
        assert torch.equal(layer.k_rotation[0], layer.k_rotation[1])
        _check_eigen_structure(layer.k_rotation[0], stats.key_target[index].mean(0), use_hadamard=True)


def test_build_rotations_rejects_unknown_value_form() -> None:
    stats = collect_statistics(tiny_llama(seed=7), torch.randint(0, 97, (1, 8)), progress=False)
    with pytest.raises(ValueError, match="value_form"):
        build_rotations(stats, value_form="bogus")


def brute_force_output_error(q, k, v, k_hat, v_hat, scaling, sink, recent, group) -> float:
    """Relative attention-output error, one query at a time, float64 (shapes [Hq|Hkv, T, D])."""
    heads, tokens, _ = q.shape
    num = den = 0.0
    for i in range(heads):
        h = i // group
        for t in range(sink + recent, tokens):
            keys, values = [], []
            for s in range(t + 1):
                exact = s < sink or t - s < recent
                keys.append(k[h, s] if exact else k_hat[h, s])
                values.append(v[h, s] if exact else v_hat[h, s])
            keys_t, values_t = torch.stack(keys).double(), torch.stack(values).double()
            exact_out = (q[i, t].double() @ k[h, : t + 1].double().T * scaling).softmax(-1) @ v[h, : t + 1].double()
            approx = (q[i, t].double() @ keys_t.T * scaling).softmax(-1) @ values_t
            num += float((approx - exact_out).pow(2).sum())
            den += float(exact_out.pow(2).sum())
    return num / den


def test_clip_search_error_matches_brute_force_and_picks_the_minimum() -> None:
    model = tiny_llama(seed=8)
    tokens = torch.randint(0, 97, (4, 40))
    stats = collect_statistics(model, tokens, sample_sequences=4, progress=False)
    rotations = build_rotations(stats)
    sink, recent, grid = 3, 9, (0.75, 0.875, 1.0)
    assert stats.samples is not None
    sample = rotated_sample(stats.samples, rotations, 1, [0])
    model_error = LayerErrorModel(sample, 16, 4, sink, recent, torch.float16)
    q, k, v = sample.query[0], sample.key[0], sample.value[0]
    for clip_k, clip_v in ((0.75, None), (None, 0.875), (0.875, 1.0)):
        k_hat = k if clip_k is None else fake_quantize(k, clip_k, 16)
        v_hat = v if clip_v is None else fake_quantize(v, clip_v, 16)
        expected = brute_force_output_error(q, k, v, k_hat, v_hat, sample.scaling, sink, recent, group=2)
        assert model_error.error(clip_k, clip_v) == pytest.approx(expected, rel=1e-4)
    result = search_clip_ratios(rotations, stats.samples, grid=grid, sink=sink, recent=recent, progress=False)
    assert result.key_errors.shape == (2, 3)
    for layer in range(2):
        assert result.per_layer[layer] == (grid[int(result.key_errors[layer].argmin())],
                                           grid[int(result.value_errors[layer].argmin())])
    applied = result.apply(rotations)
    assert [ (l.clip_k, l.clip_v) for l in applied.layers] == result.chosen
    assert applied.metadata["clip_search"]["grid"] == list(grid)
    assert "key_grid" not in applied.metadata["clip_search"]
    # A key grid of its own (issue 6): the value side is searched as before, the key side
    # only among key_grid (one value: fixed, whatever the reference fall-back).
    fixed = search_clip_ratios(rotations, stats.samples, grid=grid, sink=sink, recent=recent, progress=False,
                               key_grid=(1.0,))
    assert fixed.key_errors.shape == (2, 1)
    assert torch.equal(fixed.value_errors, result.value_errors)
    assert all(pair[0] == 1.0 for pair in fixed.chosen)
    assert fixed.apply(rotations).metadata["clip_search"]["key_grid"] == [1.0]


def test_clip_search_rejects_samples_without_history() -> None:
    model = tiny_llama(seed=9)
    stats = collect_statistics(model, torch.randint(0, 97, (2, 16)), sample_sequences=2, progress=False)
    rotations = build_rotations(stats)
    assert stats.samples is not None
    with pytest.raises(ValueError, match="no INT2 history"):
        search_clip_ratios(rotations, stats.samples, CLIP_RATIO_GRID, sink=8, recent=8, progress=False)


def test_identity_from_config_and_mismatch_messages() -> None:
    model = tiny_llama(seed=10)
    identity = ModelIdentity.from_model(model, name="Tiny-Llama")
    assert identity.rotation_shape == (2, 16, 16) and identity.group_size == 2
    other = ModelIdentity("LlamaForCausalLM", 2, 8, 2, 32, "x")
    assert other.shape_mismatches(identity) == ["num_query_heads: 8 vs 4", "head_dim: 32 vs 16"]
    assert identity.name_matches("/cache/tiny-llama") and not identity.name_matches("")
    assert identity.shape_mismatches(ModelIdentity("", 2, 4, 2, 16)) == []  # unknown architecture
    assert identity.shape_mismatches(ModelIdentity("Qwen3ForCausalLM", 2, 4, 2, 16)) == [
        "architecture: 'LlamaForCausalLM' vs 'Qwen3ForCausalLM'"]
    with pytest.raises(ValueError, match="multiple"):
        ModelIdentity("X", 2, 5, 2, 16)


class CharTokenizer:
    """One token per character (id = code point): makes token counts exact in tests."""

    def __call__(self, text: str, add_special_tokens: bool = False):
        assert add_special_tokens is False
        return type("Encoding", (), {"input_ids": [ord(c) for c in text]})()


def test_calibration_tokens_interleave_files_and_never_read_the_heldout_part(tmp_path) -> None:
    import lzma

    from vllm_oscar.calibration import calibration_tokens, split_corpus_text

    prose = tmp_path / "prose.txt"
    prose.write_text("a" * 4000 + "Z" * 1000)  # last 20% (the Z's) is held out
    code = tmp_path / "code.txt.xz"
    with lzma.open(code, "wt") as stream:
        stream.write("b" * 800 + "Y" * 200)
    data = calibration_tokens(CharTokenizer(), [prose, code], num_tokens=100, seq_len=16)
    assert data.tokens.shape == (6, 16)  # whole sequences only
    assert [chr(int(row[0])) for row in data.tokens] == ["a", "b"] * 3
    assert not bool(((data.tokens == ord("Z")) | (data.tokens == ord("Y"))).any())
    assert [s["sequences"] for s in data.sources] == [3, 3] and len(data.sha256) == 64
    assert split_corpus_text("x" * 80 + "y" * 20) == ("x" * 80, "y" * 20)
    with pytest.raises(ValueError, match=r"too short: its first 80% \(800 characters\) gives 800 tokens"):
        calibration_tokens(CharTokenizer(), [code], num_tokens=1024, seq_len=16)
    with pytest.raises(ValueError, match="--tokens=8 must be >= --seq-len=16"):
        calibration_tokens(CharTokenizer(), [code], num_tokens=8, seq_len=16)


def test_weights_hash_covers_the_tensors_not_the_file_bytes(tmp_path) -> None:
    from safetensors.torch import save_file

    from vllm_oscar.calibration.model_loading import weights_sha256

    gen = torch.Generator().manual_seed(2)
    state = {"b.weight": torch.randn(4, 3, generator=gen).to(torch.bfloat16), "a.bias": torch.randn(5, generator=gen)}
    hashes = []
    for name, metadata in (("one", {"format": "pt", "x": "1"}), ("two", {"x": "1", "format": "pt", "y": "2"})):
        folder = tmp_path / name
        folder.mkdir()
        save_file(state, str(folder / "model.safetensors"), metadata=metadata)  # different header bytes
        hashes.append(weights_sha256(folder))
    assert hashes[0] == hashes[1] and len(hashes[0]) == 64
    changed = tmp_path / "changed"
    changed.mkdir()
    state["a.bias"][2] += 1.0  # one value
    save_file(state, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert weights_sha256(changed) != hashes[0]
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    save_file({"c.bias" if k == "a.bias" else k: v for k, v in state.items()}, str(renamed / "model.safetensors"))
    assert weights_sha256(renamed) != weights_sha256(changed)
    assert weights_sha256(tmp_path / "empty_folder_that_does_not_exist") == ""


def test_calibrate_fixes_the_key_clip_by_default() -> None:
    """A fresh calibration keeps r_K at the reference clip (the search's choice, 0.84 on SmolLM2, lost passkey
    retrieval); several --clip-grid-k values still search among them."""
    import argparse

    from vllm_oscar.calibration.pipeline import CalibrationOptions
    from vllm_oscar.commands import calibrate as command
    from vllm_oscar.config import DEFAULT_CLIP_RATIO_K

    assert CalibrationOptions().clip_key_grid == (DEFAULT_CLIP_RATIO_K,)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert parser.parse_args(["--model", "m", "--data", "d.txt", "--out", "o.safetensors"]).clip_grid_k == [
        DEFAULT_CLIP_RATIO_K]
    searched = parser.parse_args(["--model", "m", "--data", "d.txt", "--out", "o.safetensors",
                                  "--clip-grid-k", "0.84", "0.96"])
    assert searched.clip_grid_k == [0.84, 0.96]
