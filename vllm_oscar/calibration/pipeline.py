"""The whole calibration: model + text -> statistics -> rotations -> clip search -> RotationSet."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

import torch

from vllm_oscar.calibration.clip_search import search_clip_ratios
from vllm_oscar.calibration.data import calibration_tokens
from vllm_oscar.calibration.model_loading import LoadedModel
from vllm_oscar.calibration.rotations import RotationSet, build_rotations
from vllm_oscar.calibration.statistics import collect_statistics
from vllm_oscar.config import (
    CALIBRATION_TEXT_FRACTION,
    CLIP_RATIO_GRID,
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_CLIP_RATIO_K,
    DEFAULT_CLIP_SEARCH_SEQUENCES,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    DEFAULT_VALUE_FORM,
    SERVED_REFIT_ITERATIONS,
    RefitIterations,
)


@dataclasses.dataclass
class CalibrationOptions:
    """Everything `vllm-oscar calibrate` can choose (defaults: the shipped files' settings)."""

    num_tokens: int = DEFAULT_CALIBRATION_TOKENS
    seq_len: int = DEFAULT_CALIBRATION_SEQ_LEN
    batch_size: int = 1
    text_fraction: float = CALIBRATION_TEXT_FRACTION
    per_head: bool = True
    use_hadamard: bool = True
    use_bit_reversal: bool = True
    value_form: str = DEFAULT_VALUE_FORM
    clip_search: bool = True
    clip_sequences: int = DEFAULT_CLIP_SEARCH_SEQUENCES
    clip_grid: tuple[float, ...] = CLIP_RATIO_GRID
    clip_sink: int = DEFAULT_SINK_TOKENS
    clip_recent: int = DEFAULT_RECENT_TOKENS
    clip_refit_iterations: RefitIterations = SERVED_REFIT_ITERATIONS
    #: key-side candidates of the clip search (None: clip_grid); see search_clip_ratios. Fixed at the reference
    #: key clip: the output-error search prefers aggressive key clips that lose passkey retrieval (docs/decisions.md).
    clip_key_grid: Optional[tuple[float, ...]] = (DEFAULT_CLIP_RATIO_K,)
    progress: bool = True


def calibrate(loaded: LoadedModel, data_paths: Sequence[str | os.PathLike[str]],
              options: Optional[CalibrationOptions] = None) -> RotationSet:
    """Calibrate OSCAR rotations (and clip ratios) for a loaded model on text files.

    The returned set's metadata records the options, the data (file hashes, token
    sha256, token count), the device and the seconds spent per phase.
    """
    options = options or CalibrationOptions()
    started = time.perf_counter()
    data = calibration_tokens(loaded.tokenizer, data_paths, options.num_tokens, options.seq_len, options.text_fraction)
    if options.clip_search and data.tokens.shape[0] <= max(options.clip_sequences, 2):
        raise ValueError(
            f"the clip search holds out {options.clip_sequences} sequences (>= 2) from the statistics but only "
            f"{data.tokens.shape[0]} sequences of {options.seq_len} tokens are calibrated; raise --tokens or "
            "lower --clip-sequences."
        )
    tokenize_seconds = time.perf_counter() - started
    stats = collect_statistics(
        loaded.model, data.tokens, loaded.identity, options.batch_size,
        sample_sequences=options.clip_sequences if options.clip_search else 0, exclude_samples=True,
        progress=options.progress,
    )
    phase = time.perf_counter()
    rotation_set = build_rotations(stats, options.per_head, options.use_hadamard, options.use_bit_reversal,
                                   options.value_form)
    eigh_seconds = time.perf_counter() - phase
    clip_seconds = 0.0
    if options.clip_search:
        assert stats.samples is not None
        phase = time.perf_counter()
        result = search_clip_ratios(rotation_set, stats.samples, options.clip_grid, sink=options.clip_sink,
                                    recent=options.clip_recent, progress=options.progress,
                                    refit_iterations=options.clip_refit_iterations, key_grid=options.clip_key_grid)
        rotation_set = result.apply(rotation_set)
        clip_seconds = time.perf_counter() - phase
    device = str(next(loaded.model.parameters()).device)
    rotation_set.metadata["calibration"] = {
        "tokens": int(data.tokens.numel()),
        "sequences": int(data.tokens.shape[0]),
        "statistics_tokens": stats.num_tokens,
        "clip_search_sequences": options.clip_sequences if options.clip_search else 0,
        "seq_len": options.seq_len,
        "tokens_sha256": data.sha256,
        "data": data.sources,
        "model_dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        "device": device if device == "cpu" else f"{device} ({torch.cuda.get_device_name(device)})",
        "seconds": {
            "tokenize": round(tokenize_seconds, 2),
            "statistics": round(stats.seconds, 2),
            "eigh": round(eigh_seconds, 2),
            "clip_search": round(clip_seconds, 2),
            "total": round(time.perf_counter() - started, 2),
        },
    }
    return rotation_set
