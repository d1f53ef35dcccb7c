#!/usr/bin/env python3
"""Job-level serving benchmark: vLLM with OSCAR against vLLM's own KV-cache options.

Same engine, same GPU, same KV memory (``kv_cache_memory_bytes``; OSCAR's BF16 window stores
are counted inside it), one engine per KV option, requests streamed through vLLM's AsyncLLM
(the engine behind ``vllm serve``) with token-id prompts. Per option and workload it reports
the KV capacity in tokens as vLLM reports it (blocks x block size), the most requests the
pool holds at once for that workload, the peak concurrency reached, output and total tokens
per second over the whole job, time to first token and inter-token latency (median, p99).

Workloads (``--workloads``; sizes from the options below):
  memory_bound     N distinct long requests submitted at once; KV memory bounds the batch
  long_generation  N short prompts with long outputs, submitted at once (decode-heavy)
  shared_document  one long document prefilled once, then requests that hit it in the prefix
                   cache one at a time: time to first token and decode latency at batch 1
  equal_batch      B requests that every option holds at once (memory not binding): what
                   OSCAR's extra work costs at the same batch

Models: ``qwen3-8b`` (Qwen3-8B's geometry with vLLM's dummy weights: exact for speed and
memory; OSCAR in its Hadamard-only mode, which runs the same kernels as calibrated
rotations), ``smollm2`` (real weights, shipped rotations), or a model folder.

    python bench/serve.py --model qwen3-8b --kv bf16 fp8 oscar --kv-budget-gib 16 \\
        --json serve.json --png serve.png [--workloads memory_bound equal_batch] [--quick]

Needs vLLM's CUDA build (docs/gpu-vllm.md). Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE

#: Engine options of each KV-cache option (vLLM 0.32's names; "bf16" is FlashAttention 3 on Hopper).
KV_OPTIONS: dict[str, dict[str, Any]] = {
    "bf16": {"attention_backend": "FLASH_ATTN"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "turboquant_k8v4": {"kv_cache_dtype": "turboquant_k8v4"},
    "turboquant_4bit_nc": {"kv_cache_dtype": "turboquant_4bit_nc"},
    "turboquant_3bit_nc": {"kv_cache_dtype": "turboquant_3bit_nc"},
    "int4_per_token_head": {"kv_cache_dtype": "int4_per_token_head"},
    "oscar": {"kv_cache_dtype": "oscar"},
}
#: Qwen3-8B's config.json (geometry only; vLLM's load_format="dummy" fills the weights).
QWEN3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
#: Tokens of the distinct question appended to the shared document by each request.
QUESTION_TOKENS = 32
#: Token ids drawn for prompts stay below this (inside every vocabulary used here).
PROMPT_VOCAB = 30000


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests of one workload: ``num_requests`` prompts of ``prompt_len`` tokens, ``output_len`` each."""

    name: str
    num_requests: int
    prompt_len: int
    output_len: int
    shared_prefix: bool = False  # requests share one document of prompt_len tokens (a prefix-cache hit)


def workloads(args: argparse.Namespace) -> list[Workload]:
    table = {
        "memory_bound": Workload("memory_bound", args.requests, args.long_prompt, args.long_output),
        "long_generation": Workload("long_generation", args.requests, args.short_prompt, args.generation_output),
        "shared_document": Workload("shared_document", args.document_requests, args.document, args.document_output,
                                    shared_prefix=True),
        "equal_batch": Workload("equal_batch", args.equal_batch, args.equal_context, args.equal_output),
    }
    return [table[name] for name in args.workloads]


def model_folder(name: str, work: Path) -> tuple[str, dict[str, Any]]:
    """(model path, extra engine options) for a model name or folder."""
    if name == "qwen3-8b":
        folder = work / "qwen3-8b-dummy"
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
        return str(folder), {"load_format": "dummy", "skip_tokenizer_init": True}
    if name == "smollm2":
        from vllm_oscar.models.smollm2 import smollm2_folder

        return str(smollm2_folder()), {}
    return name, {}


def oscar_max_num_seqs(budget: int, config: dict[str, Any], tokens_per_request: int, block_size: int,
                       max_num_batched_tokens: int) -> int:
    """The most requests of ``tokens_per_request`` tokens an OSCAR budget holds with their window stores.

    OSCAR's BF16 window stores are sized by max_num_seqs and come out of the KV budget, so a large
    max_num_seqs shrinks the INT2 pool: this is the max_num_seqs whose windows and pages both fit.
    """
    from vllm_oscar.attention.window_store import window_capacity_blocks
    from vllm_oscar.config import OscarConfig
    from vllm_oscar.kernels.layout import PageLayout

    oscar = OscarConfig()
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bf16_row = 2 * heads * head_dim * 2 * layers  # K and V, bf16, all layers: bytes per window token
    page = PageLayout(head_dim, head_dim, block_size).token_bytes * heads * layers
    per_request_blocks = window_capacity_blocks(1, 0, block_size, oscar.sink_tokens, oscar.recent_tokens)
    step_blocks = window_capacity_blocks(0, max_num_batched_tokens, block_size, oscar.sink_tokens,
                                         oscar.recent_tokens)
    blocks_per_request = math.ceil(tokens_per_request / block_size)
    per_request = per_request_blocks * block_size * bf16_row + blocks_per_request * block_size * page
    return max(1, int((budget - step_blocks * block_size * bf16_row) // per_request))


def prompts_for(workload: Workload, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if workload.shared_prefix:
        document = rng.integers(1, PROMPT_VOCAB, workload.prompt_len).tolist()
        return [document + rng.integers(1, PROMPT_VOCAB, QUESTION_TOKENS).tolist()
                for _ in range(workload.num_requests + 1)]  # the first one prefills the document
    return [rng.integers(1, PROMPT_VOCAB, workload.prompt_len).tolist() for _ in range(workload.num_requests)]


async def timed_request(engine, prompt: list[int], output_len: int, request_id: str) -> dict[str, Any]:
    """Submit one request and stream it: submit time and the arrival time of every output token."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    submitted, arrivals = time.perf_counter(), []
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        now = time.perf_counter()
        arrivals.extend([now] * len(output.outputs[0].token_ids))
    return {"submitted": submitted, "arrivals": arrivals, "prompt_len": len(prompt)}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput over the job and latency percentiles (ms) of a list of timed requests."""
    start = min(r["submitted"] for r in records)
    end = max(r["arrivals"][-1] for r in records)
    ttft = np.array([r["arrivals"][0] - r["submitted"] for r in records]) * 1e3
    itl = np.concatenate([np.diff(r["arrivals"]) for r in records]) * 1e3
    output_tokens = sum(len(r["arrivals"]) for r in records)
    # peak number of requests decoding at once: sweep over [first token, last token] intervals
    events = sorted([(r["arrivals"][0], 1) for r in records] + [(r["arrivals"][-1], -1) for r in records])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return {"seconds": end - start, "output_tokens_per_s": output_tokens / (end - start),
            "total_tokens_per_s": (output_tokens + sum(r["prompt_len"] for r in records)) / (end - start),
            "ttft_ms_median": float(np.median(ttft)), "ttft_ms_p99": float(np.percentile(ttft, 99)),
            "itl_ms_median": float(np.median(itl)), "itl_ms_p99": float(np.percentile(itl, 99)),
            "peak_concurrency": peak, "requests": len(records)}


async def run_workload(engine, workload: Workload, seed: int) -> dict[str, Any]:
    prompts = prompts_for(workload, seed)
    tag = f"{workload.name}-{seed}"
    if workload.shared_prefix:  # prefill the document once, then one request at a time hits it
        await timed_request(engine, prompts[0], 1, f"{tag}-warm")
        records = [await timed_request(engine, p, workload.output_len, f"{tag}-{i}") for i, p in enumerate(prompts[1:])]
    else:
        records = await asyncio.gather(*(timed_request(engine, p, workload.output_len, f"{tag}-{i}")
                                         for i, p in enumerate(prompts)))
    return summarize(records)


def engine_options(option: str, model_name: str, config: dict[str, Any], args: argparse.Namespace,
                   loads: list[Workload]) -> dict[str, Any]:
    """Engine arguments of one KV option: shared ones, then what the option sets."""
    longest = max(w.prompt_len + w.output_len + (QUESTION_TOKENS if w.shared_prefix else 0) for w in loads)
    budget = int(args.kv_budget_gib * 2**30)
    max_num_seqs = max(w.num_requests for w in loads)
    if option == "oscar":  # windows come out of the budget: no more requests than the budget holds
        busiest = max(loads, key=lambda w: w.num_requests)
        fit = oscar_max_num_seqs(budget, config, busiest.prompt_len + busiest.output_len,
                                 args.block_size or GPU_DECODE_BLOCK_SIZE, args.max_num_batched_tokens)
        max_num_seqs = min(max_num_seqs, fit)
    options = dict(dtype="bfloat16", max_model_len=longest, seed=0,
                   kv_cache_memory_bytes=budget, max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                   max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.9,
                   disable_log_stats=True, **KV_OPTIONS[option])
    if args.block_size:
        options["block_size"] = args.block_size
    if args.enforce_eager:
        options["enforce_eager"] = True
    if option == "oscar" and model_name == "qwen3-8b":
        options["additional_config"] = {"oscar": {"hadamard_only": True}}
    return options


async def run_option(option: str, model: str, extra: dict[str, Any], model_name: str, config: dict[str, Any],
                     loads: list[Workload], args: argparse.Namespace) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    options = engine_options(option, model_name, config, args, loads)
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **extra, **options))
    try:
        cache = engine.vllm_config.cache_config
        capacity = cache.num_gpu_blocks * cache.block_size
        result = {"option": option, "engine_start_s": time.perf_counter() - started, "kv_capacity_tokens": capacity,
                  "max_num_seqs": options["max_num_seqs"], "workloads": {}}
        print(f"{option}: KV capacity {capacity} tokens, max_num_seqs {options['max_num_seqs']}, "
              f"started in {result['engine_start_s']:.0f} s", flush=True)
        for workload in loads:
            summary = await run_workload(engine, workload, seed=len(result["workloads"]))
            per_request = workload.prompt_len + workload.output_len
            summary["pool_holds_requests"] = min(capacity // per_request, options["max_num_seqs"])
            summary["workload"] = dataclasses.asdict(workload)
            result["workloads"][workload.name] = summary
            print(f"  {workload.name}: {json.dumps(summary)}", flush=True)
        return result
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def markdown(results: list[dict[str, Any]], baseline: Optional[str]) -> str:
    """One row per (workload, option), with the output-throughput and ITL ratios to the baseline option."""
    rows = ["| workload | KV option | capacity (tokens) | holds | peak batch | output tok/s | x base | total tok/s "
            "| TTFT ms p50 / p99 | ITL ms p50 / p99 | ITL x base |", "|" + "---|" * 11]
    base = next((r for r in results if r["option"] == baseline), None)
    for name in results[0]["workloads"]:
        for r in results:
            w = r["workloads"][name]
            b = base["workloads"][name] if base else None
            speed = f"{w['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}" if b else "-"
            latency = f"{w['itl_ms_median'] / b['itl_ms_median']:.2f}" if b else "-"
            rows.append(
                f"| {name} | {r['option']} | {r['kv_capacity_tokens']} | {w['pool_holds_requests']} | "
                f"{w['peak_concurrency']} | {w['output_tokens_per_s']:.0f} | {speed} | {w['total_tokens_per_s']:.0f} | "
                f"{w['ttft_ms_median']:.0f} / {w['ttft_ms_p99']:.0f} | {w['itl_ms_median']:.2f} / "
                f"{w['itl_ms_p99']:.2f} | {latency} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Output tokens/s per workload and option (bars), and median inter-token latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["workloads"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        x = np.arange(len(names)) + i * width
        axes[0].bar(x, [r["workloads"][n]["output_tokens_per_s"] for n in names], width, label=r["option"])
        axes[1].bar(x, [r["workloads"][n]["itl_ms_median"] for n in names], width, label=r["option"])
    for ax, title in zip(axes, ["output tokens/s (higher is better)", "median inter-token latency, ms"]):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=15)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="qwen3-8b (dummy weights), smollm2, or a folder")
    parser.add_argument("--kv", nargs="+", default=["bf16", "oscar"], choices=sorted(KV_OPTIONS))
    parser.add_argument("--workloads", nargs="+", default=["memory_bound", "long_generation", "shared_document",
                                                           "equal_batch"],
                        choices=["memory_bound", "long_generation", "shared_document", "equal_batch"])
    parser.add_argument("--kv-budget-gib", type=float, default=16.0, help="KV memory of every option (GiB)")
    parser.add_argument("--requests", type=int, default=64, help="requests of memory_bound / long_generation")
    parser.add_argument("--long-prompt", type=int, default=16384)
    parser.add_argument("--long-output", type=int, default=512)
    parser.add_argument("--short-prompt", type=int, default=512)
    parser.add_argument("--generation-output", type=int, default=4096)
    parser.add_argument("--document", type=int, default=100_000, help="shared document tokens")
    parser.add_argument("--document-requests", type=int, default=3)
    parser.add_argument("--document-output", type=int, default=256)
    parser.add_argument("--equal-batch", type=int, default=8)
    parser.add_argument("--equal-context", type=int, default=32768)
    parser.add_argument("--equal-output", type=int, default=256)
    parser.add_argument("--block-size", type=int, help="every option's KV block size (default: each option's own; "
                        "OSCAR's on CUDA is 64, vLLM's 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs or compilation (all options)")
    parser.add_argument("--json", help="write every result here")
    parser.add_argument("--png", help="write the plot here")
    args = parser.parse_args(argv)
    if args.kv_budget_gib <= 0 or args.requests < 1 or args.equal_batch < 1 or args.document_requests < 1:
        parser.error("--kv-budget-gib, --requests, --equal-batch and --document-requests must be positive.")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench/serve.py needs a CUDA GPU and vLLM's CUDA build (docs/gpu-vllm.md).")
    loads = workloads(args)
    with tempfile.TemporaryDirectory() as work:
        model, extra = model_folder(args.model, Path(work))
        config = json.loads((Path(model) / "config.json").read_text())
        results = [asyncio.run(run_option(option, model, extra, args.model, config, loads, args))
                   for option in args.kv]
    report = {"device": torch.cuda.get_device_name(0), "model": args.model, "kv_budget_gib": args.kv_budget_gib,
              "args": vars(args), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.png:
        plot(results, args.png)
    print(f"\n{report['device']}, {args.model}, KV budget {args.kv_budget_gib} GiB\n")
    print(markdown(results, "bf16" if "bf16" in args.kv else None))


if __name__ == "__main__":
    main()
