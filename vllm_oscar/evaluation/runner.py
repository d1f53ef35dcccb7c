"""One evaluation run: load the model, build the methods, measure, return a JSON-able dict.

Order: perplexity metrics method by method (standard windows, then the stress windows,
in the order the methods are asked: most important first), then passkey retrieval and
greedy-generation agreement method by method. The BF16 reference log-probabilities are
computed once per sequence and reused by every method and both window settings. After
every method the caller's checkpoint receives the document, so a run cut short keeps
what it measured; ``max_seconds`` stops starting new work once spent (what was skipped
is listed in ``meta["skipped"]``). Every number is tied to its settings, the device,
library versions and the git commit in the returned ``meta``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import time
from typing import Any, Callable, Optional

import torch

from vllm_oscar.calibration.data import sha256_file
from vllm_oscar.config import (
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    EVAL_STRESS_RECENT_TOKENS,
    EVAL_STRESS_SINK_TOKENS,
)
from vllm_oscar.evaluation.data import heldout_sequences
from vllm_oscar.evaluation.harness import method_logits
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.evaluation.metrics import TokenStats, log_prob_stats
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
    batch_size: int = 1
    passkey_methods: Optional[list[str]] = None
    greedy_methods: Optional[list[str]] = None
    max_seconds: Optional[float] = None


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
            methods[name] = file_method(settings.rotations, name)
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


class Reference:
    """BF16 log-probabilities of every sequence at the positions any window setting scores.

    The BF16 pass reads no quantized row, so it does not depend on the windows: one
    forward pass per sequence serves every method and both window settings.
    """

    def __init__(self, model, sequences: torch.Tensor, first: int, batch_size: int) -> None:
        device = next(model.parameters()).device
        self.first = first
        self.log_probs: list[torch.Tensor] = []  # per batch: [b, T - 1 - first, V] float32
        for start in range(0, len(sequences), batch_size):
            ids = sequences[start : start + batch_size].to(device)
            logits = method_logits(model, ids, KVMethod(), 0, 0, keep=ids.shape[1] - first)
            self.log_probs.append(torch.log_softmax(logits[:, :-1], dim=-1))
            del logits


def window_metrics(
    model, sequences: torch.Tensor, reference: Reference, method: KVMethod, sink: int, recent: int, batch_size: int
) -> dict[str, float]:
    """KL / ppl / top-1 of one method at positions >= sink + recent of every sequence."""
    device = next(model.parameters()).device
    first = sink + recent
    if first < reference.first:
        raise ValueError(f"windows {sink}/{recent} score positions the reference does not hold.")
    totals = TokenStats()
    for index, start in enumerate(range(0, len(sequences), batch_size)):
        ids = sequences[start : start + batch_size].to(device)
        ref = reference.log_probs[index][:, first - reference.first :]
        logits = (None if method.is_exact
                  else method_logits(model, ids, method, sink, recent, keep=ids.shape[1] - first)[:, :-1])
        totals.add(log_prob_stats(ref, logits, ids[:, first + 1 :]))
    return totals.summary()


def run_evaluation(
    settings: EvalSettings, names: list[str], checkpoint: Optional[Callable[[dict[str, Any]], None]] = None
) -> dict[str, Any]:
    """Run every measurement the settings ask for; return the JSON document.

    ``checkpoint`` (optional) receives the document after every method of every stage
    (metrics, passkey, greedy), so a run cut short keeps what it measured.
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
            "bpe": m.bits_per_element(settings.seq_len, geometry.head_dim, geometry.num_layers, settings.sink,
                                      settings.recent),
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

    def over_budget(what: str) -> bool:
        """True (and noted in meta) when max_seconds is spent: ``what`` is not started."""
        if settings.max_seconds is None or time.time() - started < settings.max_seconds:
            return False
        meta.setdefault("skipped", []).append(what)
        return True

    def method_done(name: str, stage: str, seconds: float) -> None:
        results[name].setdefault("seconds", {})[stage] = round(seconds, 2)
        meta["seconds"] = round(time.time() - started, 1)
        print(f"[eval] {stage:8s} {name:24s} {seconds:7.1f} s (elapsed {meta['seconds']:.0f} s)", flush=True)
        if checkpoint is not None:
            checkpoint(doc)

    clock = time.time()
    first = settings.sink + settings.recent
    if settings.stress:
        first = min(first, settings.stress_sink + settings.stress_recent)
    reference = Reference(model, sequences, first, settings.batch_size)
    meta["seconds_setup"] = round(clock - started, 1)
    meta["seconds_reference"] = round(time.time() - clock, 1)
    print(f"[eval] setup {meta['seconds_setup']} s (model, calibration, methods, data); "
          f"BF16 reference {meta['seconds_reference']} s", flush=True)
    for name, method in methods.items():
        if over_budget(f"metrics:{name}"):
            continue
        clock = time.time()
        results[name].update(
            window_metrics(model, sequences, reference, method, settings.sink, settings.recent, settings.batch_size)
        )
        if settings.stress:
            results[name]["stress"] = {
                **window_metrics(
                    model, sequences, reference, method, settings.stress_sink, settings.stress_recent,
                    settings.batch_size,
                ),
                "bpe": method.bits_per_element(
                    settings.seq_len, geometry.head_dim, geometry.num_layers, settings.stress_sink,
                    settings.stress_recent,
                ),
            }
        method_done(name, "metrics", time.time() - clock)
    del reference
    stage_done("metrics")
    if settings.passkey_lengths:
        cases = passkey_cases(tokenizer, settings.passkey_lengths, settings.passkey_depths, settings.seed)
        for name in _subset(methods, settings.passkey_methods):
            if over_budget(f"passkey:{name}"):
                continue
            clock = time.time()
            results[name]["passkey"] = passkey_accuracy(model, cases, methods[name], settings.sink, settings.recent)
            method_done(name, "passkey", time.time() - clock)
        stage_done("passkey")
    if settings.greedy_prompts:
        prompts = sequences[: settings.greedy_prompts, : settings.greedy_prompt_len]
        reference_tokens = None
        for name in _subset(methods, settings.greedy_methods):
            if over_budget(f"greedy:{name}"):
                continue
            clock = time.time()
            if reference_tokens is None:
                reference_tokens = greedy_tokens(
                    model, prompts, settings.greedy_new_tokens, methods["bf16"], settings.sink, settings.recent
                )
            results[name]["greedy_prefix"] = (
                float(settings.greedy_new_tokens) if methods[name].is_exact
                else greedy_agreement(model, prompts, reference_tokens, methods[name], settings.sink, settings.recent)
            )
            method_done(name, "greedy", time.time() - clock)
        stage_done("greedy")
    return doc


def _subset(methods: dict[str, KVMethod], wanted: Optional[list[str]]) -> list[str]:
    """The methods of a stage, in the run's order (None = all; names not run are an error)."""
    if wanted is None:
        return list(methods)
    unknown = [n for n in wanted if n not in methods]
    if unknown:
        raise ValueError(f"{unknown} are not among the methods of this run.")
    return [n for n in methods if n in wanted]
