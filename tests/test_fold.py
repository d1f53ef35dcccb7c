"""R_V folded into W_o (and W_v): the weight algebra against float64, and a layer step under every fold mode
against the unfolded step (CPU, torch ops). The served model under each mode: tests/test_vllm_fold.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from vllm_oscar.attention.fold import fold_blocker, fold_output_columns, fold_value_rows
from vllm_oscar.attention.step import layer_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import served_graph  # noqa: E402


def _orthogonal(heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(heads, dim, dim, generator=generator, dtype=torch.float64))
    return q


def _with_outliers(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """N(0, 1) rows with a few planted outlier channels (x 20) along the last dimension."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    x[..., torch.randperm(shape[-1], generator=generator)[:3]] *= 20.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_projections_equal_rotating_the_activations_in_float64(dtype):
    """v from the folded qkv rows equals (x W_v^T + b) @ R_V per KV head; o_proj's folded columns applied to the
    rotated output o @ R_V equal o_proj applied to o. Exact in float64 algebra; the folded weights are rounded
    once more in their dtype, so the bound is that dtype's rounding (float32 1e-5, bfloat16 2^-7 relative)."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, hidden, tokens = 6, 2, 16, 40, 9
    rotation = _orthogonal(hkv, dim, gen)
    qkv = _with_outliers(((hq + 2 * hkv) * dim, hidden), gen)
    bias = torch.randn((hq + 2 * hkv) * dim, generator=gen, dtype=torch.float64)
    w_o = _with_outliers((hidden, hq * dim), gen)
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    o = torch.randn(tokens, hq, dim, generator=gen, dtype=torch.float64)

    qkv_folded, bias_folded, w_o_folded = qkv.to(dtype), bias.to(dtype), w_o.to(dtype)
    v_offset = (hq + hkv) * dim
    fold_value_rows(qkv_folded, bias_folded, v_offset, rotation.float())
    fold_output_columns(w_o_folded, rotation.float(), hq)

    tolerance = 1e-5 if dtype == torch.float32 else 2.0 ** -7
    v = (x @ qkv[v_offset:].T + bias[v_offset:]).view(tokens, hkv, dim)
    want_v = torch.einsum("thd,hde->the", v, rotation)
    got_v = (x @ qkv_folded[v_offset:].double().T + bias_folded[v_offset:].double()).view(tokens, hkv, dim)
    assert float((got_v - want_v).norm() / want_v.norm()) < tolerance
    # q and k rows untouched
    assert torch.equal(qkv_folded[:v_offset], qkv[:v_offset].to(dtype))
    assert torch.equal(bias_folded[:v_offset], bias[:v_offset].to(dtype))

    o_rot = torch.einsum("thd,hde->the", o, rotation.repeat_interleave(hq // hkv, dim=0))
    want_y = o.reshape(tokens, -1) @ w_o.T
    got_y = o_rot.reshape(tokens, -1) @ w_o_folded.double().T
    assert float((got_y - want_y).norm() / want_y.norm()) < tolerance


def test_output_columns_of_a_wrong_shape_are_an_error():
    with pytest.raises(ValueError, match=r"must be \[hidden, 64\]"):
        fold_output_columns(torch.zeros(8, 48), torch.eye(16).expand(2, 16, 16), 4)


def test_modules_the_fold_does_not_know_are_left_unfolded_with_a_reason():
    gated = type("Qwen3NextAttention", (torch.nn.Module,), {})()
    assert "Qwen3NextAttention is not one of" in fold_blocker(gated, None, lora=False)
    llama = type("LlamaAttention", (torch.nn.Module,), {})()
    assert "LoRA" in fold_blocker(llama, None, lora=True)
    assert "QKVParallelLinear" in fold_blocker(llama, None, lora=False)  # no projections at all


def _served(fold: str, device: torch.device) -> served_graph.ServedAttention:
    """One layer, three requests, no history yet (the same rotations for every fold mode)."""
    served = served_graph.ServedAttention(layers=1, hq=6, hkv=2, dim=64, max_model_len=1024, max_requests=3,
                                          device=device, block_size=32, seed=5, fold=fold)
    for request in range(3):
        served.rows[request], served.lengths[request] = [], 0
    return served


def _step(state: served_graph.ServedAttention, requests: list[int], new_tokens: list[int], seed: int,
          value_noise: float = 0.0) -> torch.Tensor:
    """One layer step of fresh bf16 q/k/v rows (the same for every state given the seed; values scaled by
    1 + value_noise * N(0, 1) if asked); values are passed rotated (v @ R_V) where the state's W_v would carry
    R_V. Returns the step's output, float64 [N, Hq, D] on the CPU."""
    metadata, slots = state._step(requests, new_tokens, rows_padded=len(requests), tokens_padded=sum(new_tokens),
                                  table=None)
    gen = torch.Generator().manual_seed(seed)
    n = sum(new_tokens)
    query, key, value = (_with_outliers((n, heads, state.dim), gen) for heads in (state.hq, state.hkv, state.hkv))
    value = value * (1 + value_noise * torch.randn(value.shape, generator=gen, dtype=torch.float64))
    rotations = state.rotations[0]
    if rotations.value_prerotated:
        value = torch.einsum("thd,hde->the", value.to(torch.bfloat16).double(), rotations.v_rotation.double().cpu())
    rows = [x.to(device=state.device, dtype=torch.bfloat16) for x in (query, key, value)]
    output = torch.zeros(n, state.hq, state.dim, dtype=torch.bfloat16, device=state.device)
    layer_step(metadata, *rows, slots, rotations, state.caches[0], state.config, state.scale, output)
    return output.double().cpu()


def _caches_equal(a: served_graph.ServedAttention, b: served_graph.ServedAttention) -> bool:
    (x,), (y,) = a.caches, b.caches
    return torch.equal(x.int2, y.int2) and torch.equal(x.window_k, y.window_k) and torch.equal(x.window_v, y.window_v)


#: (requests, new tokens per request) of the checked steps: prefill chunks (the first within the windows, later
#: ones over INT2 history), then decode steps over INT2 history and BF16 windows.
STEPS = [([0], [300]), ([0, 1], [300, 90]), ([2], [400]), ([0, 1, 2], [1, 1, 1]), ([1], [40]), ([0, 2], [1, 1])]


def output_fold_gaps(device: torch.device) -> tuple[list[float], bool]:
    """Per step of STEPS: the relative gap between the "output" fold's step output and the unfolded output @ R_V
    per query head; and whether every cache byte stayed the same as unfolded after every step."""
    reference, served = _served("none", device), _served("output", device)
    per_head = served.rotations[0].v_rotation.double().cpu().repeat_interleave(served.hq // served.hkv, dim=0)
    gaps, equal = [], True
    for seed, (requests, new_tokens) in enumerate(STEPS):
        want = torch.einsum("thd,hde->the", _step(reference, requests, new_tokens, seed), per_head)
        gaps.append(float((_step(served, requests, new_tokens, seed) - want).norm() / want.norm()))
        equal &= _caches_equal(reference, served)
    return gaps, equal


def value_fold_gaps(device: torch.device) -> tuple[list[float], list[float]]:
    """Per step of STEPS: the relative gap between the "value_and_output" fold's output and the unfolded output
    @ R_V; and the yardstick: the unfolded path's gap when every value is scaled by (1 + 2^-9 N(0, 1))."""
    reference, served, perturbed = _served("none", device), _served("value_and_output", device), _served("none", device)
    per_head = served.rotations[0].v_rotation.double().cpu().repeat_interleave(served.hq // served.hkv, dim=0)
    gaps, yardstick = [], []
    for seed, (requests, new_tokens) in enumerate(STEPS):
        exact = _step(reference, requests, new_tokens, seed)
        want = torch.einsum("thd,hde->the", exact, per_head)
        gaps.append(float((_step(served, requests, new_tokens, seed) - want).norm() / want.norm()))
        noisy = _step(perturbed, requests, new_tokens, seed, value_noise=2.0 ** -9)
        yardstick.append(float((noisy - exact).norm() / exact.norm()))
    return gaps, yardstick


def test_folding_w_o_only_leaves_the_caches_bit_identical_and_rotates_the_output():
    """With W_o folded the step's output (W_o's input) is the unfolded output @ R_V per query head, within the two
    sides' bf16 rounding, and every cache byte is the same (the values are handled exactly as before). On the
    GPU: bench/check_kernels_gpu.py --only fold."""
    gaps, caches_equal = output_fold_gaps(torch.device("cpu"))
    assert max(gaps) < 2.0 ** -7, gaps
    assert caches_equal


def test_folding_w_v_too_moves_the_output_no_more_than_one_rounding_of_the_values():
    """With W_v folded as well, the values reach the write rotated and already rounded to bf16, one rounding the
    unfolded path does not make, and an INT2 code near a decision boundary can move. Yardstick, measured here: the
    unfolded path with every value scaled by (1 + 2^-9 N(0, 1)) (one bf16 rounding's worth). The folded steps'
    mean relative gap must stay within twice the yardstick's."""
    gaps, yardstick = value_fold_gaps(torch.device("cpu"))
    assert sum(yardstick) > 0
    assert sum(gaps) < 2 * sum(yardstick), (gaps, yardstick)


@pytest.mark.parametrize("prefill_max_seq_len, flash", [(None, None), (7, False)])
def test_the_prefill_part_is_sized_by_prefill_max_seq_len(monkeypatch, prefill_max_seq_len, flash):
    """attend_step hands oscar_prefill the metadata's prefill_max_seq_len (the prefills' own bound), max_seq_len
    where the builder gave none, and the user's flash_prefill option."""
    import dataclasses

    from vllm_oscar.attention import step

    state = _served("none", torch.device("cpu"))
    state.config = dataclasses.replace(state.config, flash_prefill=flash)
    _step(state, [0], [5], seed=1)  # a history for request 0, which then decodes beside request 1's prompt
    seen = []
    real_prefill = step.oscar_prefill
    monkeypatch.setattr(step, "oscar_prefill",
                        lambda *args, **kwargs: seen.append((kwargs["max_seq_len"], kwargs["flash"]))
                        or real_prefill(*args, **kwargs))
    metadata, slots = state._step([0, 1], [1, 7], rows_padded=2, tokens_padded=8, table=None)
    metadata = dataclasses.replace(metadata, prefill_max_seq_len=prefill_max_seq_len)
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(8, heads, state.dim, generator=gen).to(torch.bfloat16) for heads in (state.hq, state.hkv,
                                                                                             state.hkv)]
    output = torch.zeros(8, state.hq, state.dim, dtype=torch.bfloat16)
    step.layer_step(metadata, *rows, slots, state.rotations[0], state.caches[0], state.config, state.scale, output)
    assert seen == [(metadata.max_seq_len if prefill_max_seq_len is None else prefill_max_seq_len, flash)]

