"""Clip-ratio search for the smallest attention-OUTPUT error (not reconstruction error).

For one layer and one calibration sequence (post-RoPE q [T, Hq, D], k/v [T, Hkv, D]),
with the layer's rotations and the serving windows (sink S, recent W):

    exact:      O = softmax(q k^T * scaling, causal) v                    per query head
    quantized:  position s is read exactly when s < S or t - s < W (BF16 windows), and
                from fake_quantize(x @ R, r) otherwise: the write path's quantizer
                (quant.quantize_rows: clip, INT2 grid, least-squares refit when
                refit_iterations > 0, as OscarConfig serves it), dequantized
    error(r)  = sum ||O^ - O||^2 / sum ||O||^2   over query heads and positions t >= S + W

(positions t < S + W have no INT2 history, so no error). Rotations are orthogonal, so the
error is the same in the rotated basis, where it is computed.

Search: r_K over the grid with V exact, r_V over the grid with K exact (the two errors
are nearly additive; the final pair is then measured jointly). The sample sequences are
split: even-numbered ones select the ratios (one pair per model = minimum of the summed
relative errors over layers; one pair per layer), odd-numbered ones judge: the per-model
pair falls back to the reference pair (DEFAULT_CLIP_RATIO_K/V) if that has the smaller
held-out joint error, and per-layer ratios are kept only if their held-out joint error
beats the per-model pair by CLIP_PER_LAYER_MIN_GAIN.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from vllm_oscar.calibration.rotations import RotationSet
from vllm_oscar.calibration.statistics import ActivationSamples
from vllm_oscar.config import (
    CLIP_PER_LAYER_MIN_GAIN,
    CLIP_RATIO_GRID,
    DEFAULT_CLIP_RATIO_K,
    DEFAULT_CLIP_RATIO_V,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    REFIT_SCALE_FLOOR,
    SERVED_REFIT_ITERATIONS,
    RefitIterations,
    check_clip_ratio,
    refit_pair,
)
from vllm_oscar.quant.quantizer import fake_quantize


def window_masks(tokens: int, sink: int, recent: int, device: torch.device | str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact [T, T] bool, history [T, T] bool) for query t (row) and key s (column).

    exact: causal and (s < sink or t - s < recent); history: causal and not exact.
    """
    t = torch.arange(tokens, device=device)[:, None]
    s = torch.arange(tokens, device=device)[None, :]
    causal = s <= t
    exact = causal & ((s < sink) | (t - s < recent))
    return exact, causal & ~exact


@dataclasses.dataclass
class LayerSample:
    """One layer's rotated sample: q [S, Hq, T, D], k/v [S, Hkv, T, D], float32, rows x @ R."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float


def rotated_sample(samples: ActivationSamples, rotation_set: RotationSet, layer: int,
                   sequences: Sequence[int]) -> LayerSample:
    """Rotate a layer's sample rows into its K/V bases and expand KV heads to query heads."""
    ident = rotation_set.identity
    rot = rotation_set.layers[layer]
    device = samples.query[layer].device
    index = torch.tensor(list(sequences), dtype=torch.long, device=device)
    q = samples.query[layer][index].transpose(1, 2)  # [S, Hq, T, D]
    k = samples.key[layer][index].transpose(1, 2)  # [S, Hkv, T, D]
    v = samples.value[layer][index].transpose(1, 2)
    head_of = torch.arange(ident.num_query_heads, device=device) // ident.group_size
    k_rotation, v_rotation = rot.k_rotation.to(device), rot.v_rotation.to(device)
    k_rot = k @ k_rotation[None]
    v_rot = v @ v_rotation[None]
    q_rot = q @ k_rotation[head_of][None]
    return LayerSample(q_rot, k_rot, v_rot, samples.scaling[layer])


class LayerErrorModel:
    """Attention-output error of one layer's sample as a function of (r_K, r_V).

    Only query positions t >= sink + recent (those with an INT2 history) are computed.
    """

    def __init__(self, sample: LayerSample, group_size: int, num_query_heads: int, sink: int, recent: int,
                 scale_dtype: torch.dtype, refit_iterations: RefitIterations = 0,
                 refit_floor: tuple[bool, bool] = REFIT_SCALE_FLOOR) -> None:
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.refit_k, self.refit_v = refit_pair(refit_iterations)
        self.floor_k, self.floor_v = bool(refit_floor[0]), bool(refit_floor[1])
        tokens = sample.query.shape[2]
        first = min(sink + recent, tokens)
        device = sample.query.device
        exact, history = window_masks(tokens, sink, recent, device)
        self.exact_mask, self.history_mask = exact[first:], history[first:]
        self.key, self.value, self.scaling = sample.key, sample.value, sample.scaling
        self.query = sample.query[:, :, first:]
        self.head_of = torch.arange(num_query_heads, device=device) // (num_query_heads // sample.key.shape[1])
        self.logits = self._logits(self.key)
        self.reference = self._output(self.logits, self.value)
        self.norm = float(self.reference.double().pow(2).sum())
        self._cache: dict[tuple[str, float], torch.Tensor] = {}

    def _logits(self, key: torch.Tensor) -> torch.Tensor:
        return (self.query @ key[:, self.head_of].transpose(-1, -2)) * self.scaling

    def _quantized(self, which: str, ratio: float) -> torch.Tensor:
        cache_key = (which, ratio)
        if cache_key not in self._cache:
            rows = self.key if which == "k" else self.value
            rounds = self.refit_k if which == "k" else self.refit_v
            floor = self.floor_k if which == "k" else self.floor_v
            self._cache[cache_key] = fake_quantize(rows, ratio, self.group_size, self.scale_dtype,
                                                   refit_iterations=rounds, refit_floor=floor)
        return self._cache[cache_key]

    def _output(self, logits: torch.Tensor, value_history: torch.Tensor) -> torch.Tensor:
        masked = logits.masked_fill(~(self.exact_mask | self.history_mask), float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        exact = (probs * self.exact_mask) @ self.value[:, self.head_of]
        history = (probs * self.history_mask) @ value_history[:, self.head_of]
        return exact + history

    def error(self, clip_k: Optional[float], clip_v: Optional[float]) -> float:
        """Relative output error with K clipped at clip_k and V at clip_v (None: exact)."""
        if self.query.shape[2] == 0 or self.norm == 0.0:
            return 0.0
        logits = self.logits
        if clip_k is not None:
            logits = torch.where(self.history_mask, self._logits(self._quantized("k", clip_k)), logits)
        value_history = self.value if clip_v is None else self._quantized("v", clip_v)
        output = self._output(logits, value_history)
        return float((output - self.reference).double().pow(2).sum()) / self.norm


@dataclasses.dataclass
class ClipSearchResult:
    """Outcome of search_clip_ratios.

    Attributes:
        grid: candidate ratios.
        key_errors / value_errors: [L, len(grid)] relative output errors on the selection
            sequences (K quantized with V exact / V quantized with K exact).
        per_model: (r_K, r_V) minimising the summed relative errors over layers (or the
            reference pair when that is better on the held-out sequences).
        per_layer: [(r_K, r_V)] per layer.
        heldout: joint held-out relative error summed over layers for "per_model" (the
            searched pair, before any fall-back), "per_layer" and "reference"
            (DEFAULT_CLIP_RATIO_K/V) ratios.
        use_per_layer: whether per-layer ratios won by CLIP_PER_LAYER_MIN_GAIN.
        refit_iterations: the quantizer's refit rounds the errors were measured with
            (0 = plain clipped min/max; int, or [K, V] when the sides differ).
        key_grid: the key-side candidates when they differ from ``grid`` (key_errors
            columns follow it), else None.
    """

    grid: tuple[float, ...]
    key_errors: torch.Tensor
    value_errors: torch.Tensor
    per_model: tuple[float, float]
    per_layer: list[tuple[float, float]]
    heldout: dict[str, float]
    use_per_layer: bool
    sink: int
    recent: int
    refit_iterations: RefitIterations = 0
    key_grid: Optional[tuple[float, ...]] = None

    @property
    def chosen(self) -> list[tuple[float, float]]:
        """The (r_K, r_V) pair stored for each layer."""
        return self.per_layer if self.use_per_layer else [self.per_model] * len(self.per_layer)

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable record for the rotation file's metadata."""
        return {
            "objective": "attention_output_relative_mse",
            "grid": list(self.grid),
            **({"key_grid": list(self.key_grid)} if self.key_grid is not None else {}),
            "sink": self.sink,
            "recent": self.recent,
            "refit_iterations": (self.refit_iterations if isinstance(self.refit_iterations, int)
                                 else list(self.refit_iterations)),
            "refit_floor": list(REFIT_SCALE_FLOOR),
            "per_model": list(self.per_model),
            "use_per_layer": self.use_per_layer,
            "heldout_error_sum": {k: round(v, 6) for k, v in self.heldout.items()},
            "key_errors": [[round(float(e), 6) for e in row] for row in self.key_errors],
            "value_errors": [[round(float(e), 6) for e in row] for row in self.value_errors],
        }

    def apply(self, rotation_set: RotationSet) -> RotationSet:
        """``rotation_set`` with the chosen clip ratios and this search in its metadata."""
        clip_k = [pair[0] for pair in self.chosen]
        clip_v = [pair[1] for pair in self.chosen]
        return rotation_set.with_clip_ratios(clip_k, clip_v, self.summary())


def search_clip_ratios(
    rotation_set: RotationSet,
    samples: ActivationSamples,
    grid: Sequence[float] = CLIP_RATIO_GRID,
    group_size: Optional[int] = None,
    scale_dtype: torch.dtype = torch.float16,
    sink: int = DEFAULT_SINK_TOKENS,
    recent: int = DEFAULT_RECENT_TOKENS,
    progress: bool = True,
    refit_iterations: RefitIterations = SERVED_REFIT_ITERATIONS,
    key_grid: Optional[Sequence[float]] = None,
) -> ClipSearchResult:
    """Search r_K and r_V (per model and per layer) for the smallest attention-output error.

    Args:
        rotation_set: rotations to evaluate (their clip ratios are ignored).
        samples: from collect_statistics(sample_sequences >= 2); sequences longer than
            sink + recent (else there is no INT2 history to measure).
        grid: candidate ratios in (0, 1].
        group_size: quantization group (default head_dim, the validated setting).
        scale_dtype: storage dtype of scale/offset (fp16 as served).
        sink / recent: BF16 windows of the serving layout.
        refit_iterations: least-squares grid refit rounds of the quantizer measured, as
            served (OscarConfig.refit_iterations: int or (K, V); default on). With the refit
            the clip ratio only sets the grid the refit starts from.
        key_grid: candidate key ratios (default: ``grid``). The output error favours
            aggressive key clipping (SmolLM2: 0.84) that costs long-context retrieval
            (docs/QUALITY.md, "Passkey and the grid refit"); a grid with only ratios near 1
            (or one ratio: fixed) keeps the key outliers.
    """
    refit_pair(refit_iterations)
    key_grid = tuple(float(r) for r in (grid if key_grid is None else key_grid))
    for ratio in (*grid, *key_grid):
        check_clip_ratio("grid ratio", ratio)
    ident = rotation_set.identity
    if samples.num_sequences < 2:
        raise ValueError(
            f"the clip search needs >= 2 sample sequences (one half selects, the other judges); got "
            f"{samples.num_sequences}. Keep more with sample_sequences / --clip-sequences."
        )
    if samples.seq_len <= sink + recent:
        raise ValueError(
            f"sample sequences of {samples.seq_len} tokens have no INT2 history with windows sink={sink} + "
            f"recent={recent}; use --seq-len > {sink + recent} or smaller --clip-sink/--clip-recent."
        )
    grid = tuple(float(r) for r in grid)
    group = group_size or ident.head_dim
    select = range(0, samples.num_sequences, 2)
    judge = range(1, samples.num_sequences, 2)
    key_errors = torch.zeros(ident.num_layers, len(key_grid), dtype=torch.float64)
    value_errors = torch.zeros(ident.num_layers, len(grid), dtype=torch.float64)
    args = (group, ident.num_query_heads, sink, recent, scale_dtype, refit_iterations)
    for layer in tqdm(range(ident.num_layers), desc="clip search", unit="layer", disable=not progress):
        selector = LayerErrorModel(rotated_sample(samples, rotation_set, layer, select), *args)
        for column, ratio in enumerate(key_grid):
            key_errors[layer, column] = selector.error(ratio, None)
        for column, ratio in enumerate(grid):
            value_errors[layer, column] = selector.error(None, ratio)
    per_model = (key_grid[int(key_errors.sum(0).argmin())], grid[int(value_errors.sum(0).argmin())])
    per_layer = [(key_grid[int(k.argmin())], grid[int(v.argmin())]) for k, v in zip(key_errors, value_errors)]
    candidates = {"per_model": [per_model] * ident.num_layers, "per_layer": per_layer,
                  # the reference pair, its key ratio only where key_grid allows it
                  "reference": [(DEFAULT_CLIP_RATIO_K if DEFAULT_CLIP_RATIO_K in key_grid else per_model[0],
                                 DEFAULT_CLIP_RATIO_V)] * ident.num_layers}
    heldout = dict.fromkeys(candidates, 0.0)
    for layer in tqdm(range(ident.num_layers), desc="clip check", unit="layer", disable=not progress):
        judge_model = LayerErrorModel(rotated_sample(samples, rotation_set, layer, judge), *args)
        for name, pairs in candidates.items():
            heldout[name] += judge_model.error(*pairs[layer])
    if heldout["reference"] < heldout["per_model"]:
        per_model = candidates["reference"][0]
    best_model_level = min(heldout["per_model"], heldout["reference"])
    use_per_layer = heldout["per_layer"] < (1.0 - CLIP_PER_LAYER_MIN_GAIN) * best_model_level
    return ClipSearchResult(grid, key_errors, value_errors, per_model, per_layer, heldout, use_per_layer, sink, recent,
                            refit_iterations, key_grid if key_grid != grid else None)
