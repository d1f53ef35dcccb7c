"""Chunked-prefill benchmark: OSCAR prefill over a cached INT2 prefix vs BF16 SDPA (CUDA only).

For each (geometry, cached prefix P, chunk C, batch B): ``oscar_prefill`` with C new tokens per
request attending causally to a P-token prefix held as INT2 pages plus its BF16 sink / recent
windows, and to each other: served (``chunk_from_cache``, what the vLLM backend runs) the chunk's
rows are read back from the pages and windows they were just written to, by the decode read rule;
otherwise from the new BF16 rows. Against torch SDPA on contiguous BF16 K/V of
P + C positions with the bottom-right causal mask (``causal_lower_right``, enable_gqa: what a BF16
cache would run for the same chunk). Both are captured in a CUDA graph and replayed; the cases are
compute-bound, so one layer per graph. Reported: ms, TFLOP/s of the attention proper
(4 * B * Hq * D * (C * P + C^2 / 2) flops) and the ratio BF16 / OSCAR (> 1: OSCAR faster).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels.benchmark import (
    OscarCase,
    error_summary,
    geometry_heads,
    make_oscar_case,
    time_eager,
    time_graph,
)

PREFILL_PREFIXES: tuple[int, ...] = (0, 4096, 32768)
PREFILL_CHUNKS: tuple[int, ...] = (512, 2048)
PREFILL_BATCHES: tuple[int, ...] = (1, 4)


def attention_flops(batch: int, heads: int, head_dim: int, prefix: int, chunk: int) -> float:
    """Multiply-adds x 2 of causal chunked attention: QK^T and PV over C x P + C (C + 1) / 2 pairs."""
    return 4.0 * batch * heads * head_dim * (chunk * prefix + chunk * (chunk + 1) / 2)


@dataclasses.dataclass
class PrefillCase:
    """One chunked-prefill step: batch x chunk new rows over a cached prefix (served layout).

    query [B*C, Hq, D], key / value [B*C, Hkv, D] bf16 (rotated); starts [B+1] int32 row offsets;
    cache: the INT2 pages and BF16 windows (seq_lens = prefix + chunk); chunk_from_cache: the served
    read (the windows then cover all prefix + chunk positions, as the backend's writes leave them)."""

    cache: OscarCase
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    starts: torch.Tensor
    chunk: int
    chunk_from_cache: bool


def make_prefill_case(batch: int, prefix: int, chunk: int, hq: int, hkv: int, dim: int, block_size: int,
                      device: torch.device, generator: torch.Generator, chunk_from_cache: bool = True) -> PrefillCase:
    """Random pages covering prefix + chunk positions (the chunk's own slots are written before the
    attention of a served step) with the windows of all of them (chunk_from_cache) or of the cached
    prefix only, and random new rows."""
    cache = make_oscar_case(batch, prefix + chunk, hq, hkv, dim, block_size, 1, device, generator,
                            window_length=None if chunk_from_cache else prefix)
    query = torch.randn(batch * chunk, hq, dim, device=device, dtype=torch.bfloat16, generator=generator)
    key = torch.randn(batch * chunk, hkv, dim, device=device, dtype=torch.bfloat16, generator=generator)
    value = torch.randn(batch * chunk, hkv, dim, device=device, dtype=torch.bfloat16, generator=generator)
    starts = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device=device)
    return PrefillCase(cache, query, key, value, starts, chunk, chunk_from_cache)


def prefill_call(oscar_prefill: Callable[..., torch.Tensor], case: PrefillCase, out: torch.Tensor,
                 **options) -> Callable[[], torch.Tensor]:
    """A no-argument call of an oscar_prefill implementation (triton_ops' or torch_ops') on the case,
    writing ``out``; options go to it as keywords."""
    c = case.cache
    scale = 1.0 / math.sqrt(case.query.shape[-1])
    key, value = (None, None) if case.chunk_from_cache else (case.key, case.value)
    return lambda: oscar_prefill(case.query, key, value, c.caches[0], c.window_k[0], c.window_v[0],
                                 c.layout, c.block_table, c.window_block_table, case.starts, c.seq_lens,
                                 DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale, out=out,
                                 chunk_from_cache=case.chunk_from_cache, **options)


def run_prefill_case(geometry: str, prefix: int, chunk: int, batch: int, block_size: int, reps: int,
                     device: torch.device, config=None, with_baseline: bool = True,
                     chunk_from_cache: bool = True, eager: bool = False, flash_plan: bool = True,
                     layers: int = 1) -> dict:
    """Time OSCAR's chunked prefill (launch config: triton_ops.DEFAULT_PREFILL unless given; served
    read unless chunk_from_cache is False) and, with_baseline, the BF16 SDPA prefill for one case; a
    JSON-able dict. eager: both timed as eager launches (time_eager), else as CUDA-graph replays (time_graph; a
    path that synchronises with the host cannot be captured and reports an error). flash_plan: FlashAttention
    prefill reads its ranges from a PrefillPlan built before the timing, as the served step builds one for all its
    layers (False: each call reads the lengths on the host, one synchronisation per call). layers: each timed rep
    runs the call this many times back to back, as the layers of one step (eagerly, the host then launches a layer
    while the GPU runs the one before, unless a call synchronises); the time is per call."""
    if layers < 1:
        raise ValueError(f"layers={layers}: time at least one call per rep.")
    from torch.nn.attention.bias import causal_lower_right

    from vllm_oscar.kernels import triton_ops
    from vllm_oscar.kernels.flash_plan import PrefillPlan

    hq, hkv, dim = geometry_heads(geometry)
    total = prefix + chunk
    flops = attention_flops(batch, hq, dim, prefix, chunk)
    result: dict = {"geometry": geometry, "prefix": prefix, "chunk": chunk, "batch": batch,
                    "block_size": block_size, "hq": hq, "hkv": hkv, "head_dim": dim, "flops": flops,
                    "chunk_from_cache": chunk_from_cache, "timing": "eager" if eager else "graph",
                    "flash_plan": "step" if flash_plan else "call", "layers": layers}
    gen = torch.Generator(device=device).manual_seed(total * 131 + batch)
    case = make_prefill_case(batch, prefix, chunk, hq, hkv, dim, block_size, device, gen, chunk_from_cache)
    config = config or triton_ops.DEFAULT_PREFILL
    result["config"] = dataclasses.asdict(config)
    plan = (PrefillPlan.of(case.starts.tolist(), case.cache.seq_lens.tolist(), DEFAULT_RECENT_TOKENS, device)
            if flash_plan and chunk_from_cache else None)
    c = case.cache
    result["path"] = triton_ops.prefill_path(config, case.query, c.layout, DEFAULT_RECENT_TOKENS, total,
                                             c.block_table, hkv, plan) if chunk_from_cache else "triton"
    result["oscar"] = _timed(prefill_call(triton_ops.oscar_prefill, case, torch.empty_like(case.query),
                                        max_query_len=chunk, max_seq_len=total, config=config, flash_plan=plan),
                            reps, flops, eager, layers)
    del case
    torch.cuda.empty_cache()
    if not with_baseline:
        return result

    q4 = torch.randn(batch, hq, chunk, dim, device=device, dtype=torch.bfloat16, generator=gen)
    k4 = torch.randn(batch, hkv, total, dim, device=device, dtype=torch.bfloat16, generator=gen)
    v4 = torch.randn_like(k4)
    mask = causal_lower_right(chunk, total)

    # F821 silenced below: bf16 runs before `del q4, k4, v4` frees GPU memory (ruff false positive).
    def bf16() -> object:
        return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)  # noqa: F821

    result["bf16_sdpa"] = _timed(bf16, reps, flops, eager, layers)
    del q4, k4, v4
    torch.cuda.empty_cache()
    if "ms" in result["oscar"] and "ms" in result["bf16_sdpa"]:
        result["bf16_over_oscar"] = result["bf16_sdpa"]["ms"] / result["oscar"]["ms"]
    return result


def _timed(fn: Callable[[], object], reps: int, flops: float, eager: bool, layers: int = 1) -> dict:
    """{"ms", "TFLOPs"} per call of fn, ``layers`` calls per rep launched eagerly or replayed in a CUDA graph, or
    {"error"} (reported, not hidden)."""
    try:
        ms = time_eager([fn] * layers, reps) if eager else time_graph([fn] * layers, reps)
    except Exception as error:  # noqa: BLE001 - a path that cannot run is a result of the benchmark
        return {"error": error_summary(error)}
    return {"ms": ms, "TFLOPs": flops / ms / 1e9}


def format_prefill_table(rows: list[dict]) -> str:
    """Fixed-width table of run_prefill_case rows."""
    header = (f"{'geometry':<14}{'prefix':>8}{'chunk':>7}{'B':>4}{'oscar ms':>10}{'TFLOP/s':>9}"
              f"{'bf16 ms':>10}{'TFLOP/s':>9}{'bf16/oscar':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        def cell(side: str, key: str, fmt: str) -> str:
            value = r.get(side, {}).get(key)
            return "err" if value is None else format(value, fmt)

        ratio = r.get("bf16_over_oscar")
        lines.append(f"{r['geometry']:<14}{r['prefix']:>8}{r['chunk']:>7}{r['batch']:>4}"
                     f"{cell('oscar', 'ms', '.4f'):>10}{cell('oscar', 'TFLOPs', '.1f'):>9}"
                     f"{cell('bf16_sdpa', 'ms', '.4f'):>10}{cell('bf16_sdpa', 'TFLOPs', '.1f'):>9}"
                     f"{'err' if ratio is None else format(ratio, '.2f'):>11}")
    return "\n".join(lines)
