"""Float64 calibration statistics per (layer, KV head), accumulated on the fly.

For layer l and KV head h with the g = Hq / Hkv query heads i of its group, over all
calibration tokens t (T in total):

    C_K[h]        = (1 / (T g)) sum_i sum_t q_it^T q_it                    (key target)
    C_V_out[h]    = (1 / (T g)) sum_i sum_t o_it^T o_it,  o_i = S_i V      (paper form)
    C_V_energy[h] = sum_t w_t v_t^T v_t / sum_t w_t,  w_t = k_t C_seq k_t^T  (reference form)

q: post-RoPE query rows, o: the attention output of query head i (the causal softmax
S_i = softmax(q_i K^T * scaling) applied to V, taken from the model's own attention
call), v/k: value/key rows of head h. C_V_out is the paper's (1/N) V^T S^T S V summed
over the group. For C_V_energy, C_seq is C_K of the calibration sequence that token t
belongs to (the queries that read k_t), so the statistic needs one pass; dividing by
sum w equals the reference code's "normalise w to mean 1, then (1/T) sum".

Nothing but these [L, Hkv, D, D] sums and, optionally, the Q/K/V of the first few
sequences (for the clip-ratio search) is kept.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Optional, Sequence

import torch
from tqdm.auto import tqdm

from vllm_oscar.calibration.capture import capture_attention
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.config import VALUE_FORM_LOGIT_ENERGY, VALUE_FORM_OUTPUT, VALUE_FORMS


@dataclasses.dataclass
class ActivationSamples:
    """Post-RoPE activations of a few calibration sequences, for the clip-ratio search.

    Attributes (one list entry per layer, float32, on the model's device):
        query: [S, T, Hq, D]
        key:   [S, T, Hkv, D]
        value: [S, T, Hkv, D]
        scaling: softmax scale per layer.
    """

    query: list[torch.Tensor]
    key: list[torch.Tensor]
    value: list[torch.Tensor]
    scaling: list[float]

    @property
    def num_sequences(self) -> int:
        return int(self.query[0].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.query[0].shape[1])


@dataclasses.dataclass
class CalibrationStats:
    """Finished statistics (targets float64 on the CPU; samples on the model's device).

    Attributes:
        identity: the calibrated model.
        key_target: [L, Hkv, D, D] C_K.
        value_output: [L, Hkv, D, D] C_V, score-weighted output form (paper).
        value_logit_energy: [L, Hkv, D, D] C_V, logit-energy-weighted form (reference code).
        num_tokens: calibration tokens T (per layer).
        samples: Q/K/V of the first sequences, or None.
        seconds: wall time of the model passes and accumulation.
    """

    identity: ModelIdentity
    key_target: torch.Tensor
    value_output: torch.Tensor
    value_logit_energy: torch.Tensor
    num_tokens: int
    samples: Optional[ActivationSamples] = None
    seconds: float = 0.0

    def value_target(self, value_form: str) -> torch.Tensor:
        """[L, Hkv, D, D] C_V of ``value_form`` (one of config.VALUE_FORMS)."""
        if value_form == VALUE_FORM_OUTPUT:
            return self.value_output
        if value_form == VALUE_FORM_LOGIT_ENERGY:
            return self.value_logit_energy
        raise ValueError(f"value_form={value_form!r} is not known; expected one of {VALUE_FORMS}.")


class StatisticsAccumulator:
    """Receives one attention call at a time (the capture callback) and sums in float64.

    The first ``sample_sequences`` sequences are kept as samples; with
    ``exclude_samples`` they are left out of the sums, so a clip search on them measures
    rotations that never saw them.
    """

    def __init__(self, identity: ModelIdentity, sample_sequences: int = 0,
                 device: torch.device | str = "cpu", exclude_samples: bool = False) -> None:
        layers, heads, dim = identity.num_layers, identity.num_kv_heads, identity.head_dim
        shape = (layers, heads, dim, dim)
        self.identity = identity
        self.query_sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.output_sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.energy_sum = torch.zeros(shape, dtype=torch.float64, device=device)
        self.energy_weight = torch.zeros(layers, heads, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(layers, dtype=torch.int64)
        self.sample_sequences = sample_sequences
        self.exclude_samples = exclude_samples
        self.sequences_seen = [0] * layers
        self.samples: list[dict[str, list[torch.Tensor]]] = [
            {"query": [], "key": [], "value": []} for _ in range(layers)
        ]
        self.scaling = [0.0] * layers

    def _check(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               output: torch.Tensor) -> None:
        ident = self.identity
        batch, _, tokens, _ = query.shape
        expected = {
            "query": (batch, ident.num_query_heads, tokens, ident.head_dim),
            "key": (batch, ident.num_kv_heads, tokens, ident.head_dim),
            "value": (batch, ident.num_kv_heads, tokens, ident.head_dim),
            "output": (batch, tokens, ident.num_query_heads, ident.head_dim),
        }
        for name, tensor in (("query", query), ("key", key), ("value", value), ("output", output)):
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(
                    f"layer {layer}: captured {name} has shape {tuple(tensor.shape)}, expected "
                    f"{expected[name]} for {ident.describe()}; calibration needs forwards without a "
                    "KV cache (use_cache=False) on a model of that geometry."
                )
        if not 0 <= layer < ident.num_layers:
            raise ValueError(f"captured layer_idx={layer} outside 0..{ident.num_layers - 1}.")

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 output: torch.Tensor, scaling: float) -> None:
        """Add one attention call: query [B, Hq, T, D], key/value [B, Hkv, T, D], output [B, T, Hq, D]."""
        self._check(layer, query, key, value, output)
        self._keep_samples(layer, query, key, value)
        first = max(0, self.sample_sequences - self.sequences_seen[layer]) if self.exclude_samples else 0
        self.sequences_seen[layer] += query.shape[0]
        self.scaling[layer] = scaling
        if first >= query.shape[0]:
            return
        query, key, value, output = query[first:], key[first:], value[first:], output[first:]
        ident = self.identity
        batch, _, tokens, dim = query.shape
        groups = (batch, ident.num_kv_heads, ident.group_size, tokens, dim)
        q = query.to(torch.float64).reshape(groups)
        o = output.to(torch.float64).permute(0, 2, 1, 3).reshape(groups)
        k = key.to(torch.float64)
        v = value.to(torch.float64)
        self.query_sum[layer] += torch.einsum("bhgti,bhgtj->hij", q, q)
        self.output_sum[layer] += torch.einsum("bhgti,bhgtj->hij", o, o)
        per_sequence = torch.einsum("bhgti,bhgtj->bhij", q, q) / (tokens * ident.group_size)
        weight = torch.einsum("bhti,bhij,bhtj->bht", k, per_sequence, k)
        self.energy_sum[layer] += torch.einsum("bht,bhti,bhtj->hij", weight, v, v)
        self.energy_weight[layer] += weight.sum(dim=(0, 2))
        self.tokens[layer] += batch * tokens

    def _keep_samples(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        store = self.samples[layer]
        have = sum(t.shape[0] for t in store["query"])
        take = min(self.sample_sequences - have, query.shape[0])
        if take <= 0:
            return
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            store[name].append(tensor[:take].transpose(1, 2).to(torch.float32).clone())

    def finish(self) -> CalibrationStats:
        """Normalised statistics (targets on the CPU); ValueError if some layer saw no tokens."""
        missing = [i for i in range(self.identity.num_layers) if int(self.tokens[i]) == 0]
        if missing:
            raise ValueError(f"no attention call was captured for layers {missing}; nothing to calibrate.")
        if len(set(self.tokens.tolist())) != 1:
            raise ValueError(f"layers saw different token counts {self.tokens.tolist()}; capture is inconsistent.")
        tokens = int(self.tokens[0])
        norm = float(tokens * self.identity.group_size)
        samples = None
        if self.sample_sequences > 0:
            samples = ActivationSamples(
                query=[torch.cat(s["query"]) for s in self.samples],
                key=[torch.cat(s["key"]) for s in self.samples],
                value=[torch.cat(s["value"]) for s in self.samples],
                scaling=list(self.scaling),
            )
        weight = self.energy_weight.clamp(min=torch.finfo(torch.float64).tiny)
        return CalibrationStats(
            identity=self.identity,
            key_target=(self.query_sum / norm).cpu(),
            value_output=(self.output_sum / norm).cpu(),
            value_logit_energy=(self.energy_sum / weight[..., None, None]).cpu(),
            num_tokens=tokens,
            samples=samples,
        )


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The model without its LM head when it exposes one (calibration needs no logits)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


def collect_statistics(
    model: torch.nn.Module,
    token_batches: torch.Tensor | Iterable[torch.Tensor],
    identity: Optional[ModelIdentity] = None,
    batch_size: int = 1,
    sample_sequences: int = 0,
    exclude_samples: bool = False,
    progress: bool = True,
) -> CalibrationStats:
    """Run ``model`` over calibration tokens and return the float64 statistics.

    Args:
        model: a transformers causal LM (Llama/Qwen-style attention), in eval mode.
        token_batches: LongTensor [N, T] of token ids (split into batches of
            ``batch_size`` rows), or an iterable of [B, T] LongTensors. No padding:
            every row is a full causal sequence.
        identity: the model's identity (default: ModelIdentity.from_model(model)).
        sample_sequences: keep post-RoPE Q/K/V of this many first sequences (float32)
            for search_clip_ratios.
        exclude_samples: leave the sample sequences out of the statistics (then the
            clip search's held-out sequences are held out from the rotations too).
        progress: show a tqdm bar (tokens, tokens/s, ETA).
    """
    identity = identity or ModelIdentity.from_model(model)
    if isinstance(token_batches, torch.Tensor):
        if token_batches.dim() != 2 or token_batches.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"token_batches must be an integer tensor [N, T]; got {token_batches.dtype} "
                f"{tuple(token_batches.shape)}."
            )
        batches: Sequence[torch.Tensor] = list(token_batches.split(batch_size))
    else:
        batches = list(token_batches)
    total = sum(int(b.numel()) for b in batches)
    if total == 0:
        raise ValueError("token_batches is empty: calibration needs at least one sequence of tokens.")
    excluded, remaining = 0, sample_sequences if exclude_samples else 0
    for batch in batches:
        take = min(remaining, int(batch.shape[0]))
        excluded, remaining = excluded + take * int(batch.shape[1]), remaining - take
    if excluded >= total:
        raise ValueError(
            f"all {sum(int(b.shape[0]) for b in batches)} sequences are clip-search samples "
            f"(sample_sequences={sample_sequences}) excluded from the statistics; calibrate more tokens."
        )
    device = next(model.parameters()).device
    accumulator = StatisticsAccumulator(identity, sample_sequences, device, exclude_samples)
    decoder = _decoder(model)
    bar = tqdm(total=total, unit="tok", unit_scale=True, desc="calibration", disable=not progress)
    started = time.perf_counter()
    with torch.inference_mode(), capture_attention(model, accumulator):
        for batch in batches:
            decoder(input_ids=batch.to(device), use_cache=False)
            bar.update(int(batch.numel()))
    bar.close()
    stats = dataclasses.replace(accumulator.finish(), seconds=time.perf_counter() - started)
    if stats.num_tokens != total - excluded:
        raise ValueError(f"captured {stats.num_tokens} tokens per layer but fed {total - excluded} for statistics.")
    return stats
