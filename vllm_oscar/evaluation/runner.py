"""One evaluation run: load the model, build the methods, measure, return a JSON-able dict.

Order: perplexity metrics (standard windows, then the stress windows), passkey retrieval
(BF16 first), greedy-generation agreement. Every number is tied to its settings, the
device, library versions and the git commit in the returned ``meta``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from typing import Any, Callable, Optional

import torch
from tqdm import tqdm

from vllm_oscar.config import (
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    EVAL_STRESS_RECENT_TOKENS,
    EVAL_STRESS_SINK_TOKENS,
)
from vllm_oscar.calibration.data import sha256_file
from vllm_oscar.evaluation.data import heldout_sequences
from vllm_oscar.evaluation.harness import method_logits
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.evaluation.metrics import TokenStats, token_stats
from vllm_oscar.evaluation.retrieval import greedy_agreement, greedy_tokens, passkey_accuracy, passkey_cases
from vllm_oscar.evaluation.variants import (
    BASELINES,
    FILE_METHODS,
    OSCAR_VARIANTS,
    Geometry,
    baseline_method,
    file_method,
    oscar_methods,
)


@dataclasses.dataclass
class EvalSettings:
    """Everything a run depends on (recorded in the JSON)."""

    model: str
    data: list[str]
    seq_len: int = 2048
    num_seqs: int = 4
    sink: int = DEFAULT_SINK_TOKENS
    recent: int = DEFAULT_RECENT_TOKENS
    stress: bool = False
    stress_sink: int = EVAL_STRESS_SINK_TOKENS
    stress_recent: int = EVAL_STRESS_RECENT_TOKENS
    calib_data: Optional[list[str]] = None
    calib_tokens: int = 32768
    calib_seq_len: int = DEFAULT_CALIBRATION_SEQ_LEN
    clip_sequences: int = 4
    passkey_lengths: list[int] = dataclasses.field(default_factory=list)
    passkey_depths: list[float] = dataclasses.field(default_factory=lambda: [0.25, 0.5, 0.75])
    greedy_prompts: int = 0
    greedy_prompt_len: int = 1024
    greedy_new_tokens: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    rotations: Optional[str] = None


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "vllm_oscar"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("OSCAR_COMMIT", "unknown")


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def build_methods(
    names: list[str], settings: EvalSettings, model, tokenizer, geometry: Geometry
) -> tuple[dict[str, KVMethod], dict[str, Any]]:
    """Baselines directly; OSCAR variants from statistics collected on calibration text.

    Returns (methods by name in the order asked, calibration provenance or {}).
    """
    from vllm_oscar.calibration.data import calibration_tokens
    from vllm_oscar.calibration.statistics import collect_statistics

    methods: dict[str, KVMethod] = {}
    provenance: dict[str, Any] = {}
    for name in names:
        if name in BASELINES:
            methods[name] = baseline_method(name, geometry)
        elif name in FILE_METHODS:
            if not settings.rotations:
                raise ValueError(f"method {name} needs --rotations FILE.")
            methods[name] = file_method(settings.rotations, refit=name == "oscar-file-refit")
    wanted = [n for n in names if n in OSCAR_VARIANTS]
    if wanted:
        calib = calibration_tokens(
            tokenizer, settings.calib_data or settings.data,
            max(settings.calib_tokens, settings.clip_sequences * settings.calib_seq_len), settings.calib_seq_len,
        )
        stats = collect_statistics(model, calib.tokens, sample_sequences=settings.clip_sequences)
        provenance = {"tokens": int(calib.tokens.numel()), "sha256": calib.sha256, "sources": calib.sources}
        methods.update(
            oscar_methods(wanted, stats, next(model.parameters()).device, settings.sink, settings.recent)
        )
    unknown = [n for n in names if n not in methods]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; see vllm_oscar.evaluation.variants.")
    return {n: methods[n] for n in names}, provenance


def perplexity_metrics(
    model, sequences: torch.Tensor, methods: dict[str, KVMethod], sink: int, recent: int, label: str
) -> dict[str, dict[str, float]]:
    """KL / ppl / top-1 per method at positions >= sink + recent of every sequence."""
    device = next(model.parameters()).device
    first = sink + recent
    totals = {name: TokenStats() for name in methods}
    bar = tqdm(total=len(sequences) * len(methods), desc=f"metrics {label}", unit="pass")
    for row in sequences:
        ids = row[None].to(device)
        reference = method_logits(model, ids, KVMethod(), sink, recent)
        for name, method in methods.items():
            logits = reference if method.is_exact else method_logits(model, ids, method, sink, recent)
            totals[name].add(token_stats(reference, logits, ids, first))
            bar.update()
    bar.close()
    return {name: stats.summary() for name, stats in totals.items()}


def run_evaluation(
    settings: EvalSettings, names: list[str], checkpoint: Optional[Callable[[dict[str, Any]], None]] = None
) -> dict[str, Any]:
    """Run every measurement the settings ask for; return the JSON document.

    ``checkpoint`` (optional) receives the document after each stage (metrics, stress,
    passkey, greedy), so a run cut short keeps what it measured.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.time()
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    model = AutoModelForCausalLM.from_pretrained(
        settings.model, dtype=getattr(torch, settings.dtype), attn_implementation="sdpa"
    ).to(settings.device).eval()
    config = model.config
    geometry = Geometry(
        config.num_hidden_layers, config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    if "bf16" not in names:
        names = ["bf16", *names]
    methods, calibration = build_methods(names, settings, model, tokenizer, geometry)
    sequences = heldout_sequences(tokenizer, settings.data, settings.seq_len, settings.num_seqs)

    results: dict[str, dict[str, Any]] = {
        name: {
            "description": getattr(m, "description", name),
            "body_bits": m.body_bits(geometry.head_dim),
            "bpe": m.bits_per_element(settings.seq_len, geometry.head_dim, geometry.num_layers, settings.sink, settings.recent),
        }
        for name, m in methods.items()
    }
    meta = {
        "commit": _commit(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "device": _device_name(settings.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "geometry": dataclasses.asdict(geometry),
        "calibration": calibration,
        "rotations_sha256": sha256_file(settings.rotations) if settings.rotations else None,
        "scored_positions": "t >= sink + recent (queries that read quantized history), up to T - 2",
        "stages_done": [],
    }
    doc = {"meta": meta, "settings": dataclasses.asdict(settings), "methods": results}

    def stage_done(stage: str) -> None:
        meta["stages_done"].append(stage)
        meta["seconds"] = round(time.time() - started, 1)
        if checkpoint is not None:
            checkpoint(doc)

    for name, values in perplexity_metrics(model, sequences, methods, settings.sink, settings.recent, "standard").items():
        results[name].update(values)
    stage_done("standard")
    if settings.stress:
        stress = perplexity_metrics(model, sequences, methods, settings.stress_sink, settings.stress_recent, "stress")
        for name, values in stress.items():
            results[name]["stress"] = {
                **values,
                "bpe": methods[name].bits_per_element(
                    settings.seq_len, geometry.head_dim, geometry.num_layers, settings.stress_sink, settings.stress_recent
                ),
            }
        stage_done("stress")
    if settings.passkey_lengths:
        cases = passkey_cases(tokenizer, settings.passkey_lengths, settings.passkey_depths, settings.seed)
        for name, method in tqdm(methods.items(), desc="passkey", unit="method"):
            results[name]["passkey"] = passkey_accuracy(model, cases, method, settings.sink, settings.recent)
        stage_done("passkey")
    if settings.greedy_prompts:
        prompts = sequences[: settings.greedy_prompts, : settings.greedy_prompt_len]
        bf16 = methods["bf16"]
        reference = greedy_tokens(model, prompts, settings.greedy_new_tokens, bf16, settings.sink, settings.recent)
        for name, method in tqdm(methods.items(), desc="greedy", unit="method"):
            results[name]["greedy_prefix"] = greedy_agreement(model, prompts, reference, method, settings.sink, settings.recent)
        stage_done("greedy")
    return doc
