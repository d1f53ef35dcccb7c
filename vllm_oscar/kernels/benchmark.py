"""Decode benchmark: OSCAR INT2 decode vs BF16 baselines on the same shapes (CUDA only).

For each (geometry, context, batch): the OSCAR Triton decode (INT2 history + BF16 sink
and recent windows), torch SDPA on contiguous BF16 K/V with enable_gqa (cuDNN, flash,
efficient backends; the fastest is "best SDPA"), and the paged BF16 Triton decode of the
same family (bf16_paged). Every op is captured in a CUDA graph and the graph replayed;
each graph runs the op over several independent copies of the cache ("layers") so that
the data of one replay is several times the L2 cache, as in a real model step.

Bytes that must be read per step (per layer): OSCAR = (L - W) * Hkv * token_bytes +
W * Hkv * 4D (W = windows actually present) + query/output; BF16 = L * Hkv * 4D. The
ideal speed-up is their ratio; achieved bandwidth is bytes / time, compared with a
measured device read bandwidth (a large sum) and copy bandwidth (a large copy, read +
write bytes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Callable, Optional

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels.layout import PageLayout, page_views

#: name -> (query heads, KV heads, head_dim)
GEOMETRIES: dict[str, tuple[int, int, int]] = {
    "qwen3-8b": (32, 8, 128),
    "smollm2-135m": (9, 3, 64),
}
#: A geometry given by its numbers instead of a name: query heads x KV heads x head_dim, e.g. "32x8x128".
GEOMETRY_PATTERN: str = r"(\d+)x(\d+)x(\d+)"
CONTEXTS: tuple[int, ...] = (4096, 16384, 32768, 65536, 131072)
BATCHES: tuple[int, ...] = (1, 8, 32, 64)
#: Each timed graph reads at least this many bytes (several times the 50-60 MB L2).
MIN_GRAPH_BYTES: int = 512 << 20
#: At most this many cache copies per graph.
MAX_LAYERS: int = 36
#: Fraction of free device memory a case may use.
MEMORY_FRACTION: float = 0.85
#: `--allocator` choice -> PYTORCH_CUDA_ALLOC_CONF for the whole run (OSCAR and baselines alike). With PyTorch's
#: default segments the same OSCAR case read 3-7% slower late in a long run than fresh (cuDNN up to 15% in one
#: reading); with expandable segments every position read within 1% (docs/decisions.md).
ALLOCATOR_SETTINGS: dict[str, str] = {"expandable": "expandable_segments:True", "default": ""}
#: The environment variable PyTorch reads its CUDA allocator settings from (once, at CUDA initialisation).
ALLOCATOR_ENV: str = "PYTORCH_CUDA_ALLOC_CONF"


@dataclasses.dataclass
class OscarCase:
    """Random OSCAR caches (``layers`` copies) for B requests of length L, and their tables."""

    layout: PageLayout
    caches: list[torch.Tensor]
    window_k: list[torch.Tensor]
    window_v: list[torch.Tensor]
    block_table: torch.Tensor
    window_block_table: torch.Tensor
    seq_lens: torch.Tensor
    query: torch.Tensor
    window_tokens: int


def geometry_heads(geometry: str) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a GEOMETRIES name or of "HQxHKVxD" (GEOMETRY_PATTERN); ValueError
    naming both forms otherwise, or where the query heads are not a multiple of the KV heads."""
    if geometry in GEOMETRIES:
        return GEOMETRIES[geometry]
    match = re.fullmatch(GEOMETRY_PATTERN, geometry)
    if match is None:
        raise ValueError(f"geometry {geometry!r}: give one of {', '.join(sorted(GEOMETRIES))} or query heads x KV "
                         f"heads x head_dim of your model, e.g. 32x8x128.")
    hq, hkv, dim = (int(part) for part in match.groups())
    if not hkv or hq % hkv:
        raise ValueError(f"geometry {geometry!r}: the query heads ({hq}) must be a positive multiple of the KV heads "
                         f"({hkv}), as in grouped-query attention.")
    return hq, hkv, dim


def fill_random_cache(cache: torch.Tensor, layout: PageLayout, generator: torch.Generator) -> None:
    """Random code bytes, positive random scales and random offsets (never zeros/NaN)."""
    cache.random_(0, 256, generator=generator)
    views = page_views(cache, layout)
    for name in ("k_scale", "v_scale"):
        plane = getattr(views, name)
        plane.copy_(torch.rand(plane.shape, device=cache.device, generator=generator) * 0.1 + 0.01)
    for name in ("k_offset", "v_offset"):
        plane = getattr(views, name)
        plane.copy_(torch.randn(plane.shape, device=cache.device, generator=generator) * 0.2 - 0.15)


def window_blocks(length: int, block_size: int, sink: int, recent: int) -> list[int]:
    """Logical blocks of a length-L request that hold a window position (for its last token)."""
    blocks = set(range(-(-min(sink, length) // block_size)))
    start = max(0, length - recent)
    blocks.update(range(start // block_size, -(-length // block_size)))
    return sorted(blocks)


def make_oscar_case(batch: int, length: int, hq: int, hkv: int, dim: int, block_size: int, layers: int,
                    device: torch.device, generator: torch.Generator,
                    sink: int = DEFAULT_SINK_TOKENS, recent: int = DEFAULT_RECENT_TOKENS,
                    window_length: Optional[int] = None) -> OscarCase:
    """A uniform batch with shuffled physical blocks and windows for sink + recent of the first
    window_length positions (default: all ``length``; a prefill case passes its cached prefix)."""
    layout = PageLayout(dim, dim, block_size, torch.float16)
    per_request = -(-length // block_size)
    total = batch * per_request
    physical = torch.randperm(total, device=device, generator=generator).to(torch.int32)
    block_table = physical.view(batch, per_request)
    logical = window_blocks(length if window_length is None else window_length, block_size, sink, recent)
    window_table = torch.full((batch, per_request), -1, dtype=torch.int32, device=device)
    ids = torch.arange(batch * len(logical), dtype=torch.int32, device=device).view(batch, len(logical))
    window_table[:, torch.tensor(logical, dtype=torch.long, device=device)] = ids
    caches, wks, wvs = [], [], []
    for _ in range(layers):
        cache = layout.allocate(total, hkv, device=device)
        fill_random_cache(cache, layout, generator)
        caches.append(cache)
        shape = (max(1, batch * len(logical)), block_size, hkv, dim)  # one unused block when no window
        wks.append(torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16))
        wvs.append(torch.randn(shape, device=device, generator=generator, dtype=torch.bfloat16))
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    query = torch.randn(batch, hq, dim, device=device, generator=generator, dtype=torch.bfloat16)
    window_tokens = min(length, min(sink, length) + min(recent, max(0, length - sink)))
    return OscarCase(layout, caches, wks, wvs, block_table, window_table, seq_lens, query, window_tokens)


def oscar_bytes(case: OscarCase, batch: int, length: int, hkv: int, hq: int, dim: int) -> int:
    """Bytes one OSCAR decode of one layer must read (codes, scales, windows, query, output)."""
    window = case.window_tokens
    return batch * hkv * ((length - window) * case.layout.token_bytes + window * 4 * dim) + 2 * batch * hq * dim * 2


def bf16_bytes(batch: int, length: int, hkv: int, hq: int, dim: int) -> int:
    """Bytes one BF16 decode of one layer must read."""
    return batch * hkv * length * 4 * dim + 2 * batch * hq * dim * 2


def error_summary(error: Exception) -> str:
    """One line for a result row: the exception type and the first line of its message (<= 200 chars)."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:200]


def captured_graph(fns: list[Callable[[], object]]) -> "torch.cuda.CUDAGraph":
    """All fns captured in one CUDA graph after a warm-up (compile, autotune, allocate outside
    the capture), replayed 3 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph(fns: list[Callable[[], object]], reps: int) -> float:
    """Milliseconds per call of each fn: capture all fns in one CUDA graph, replay, events."""
    graph = captured_graph(fns)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / len(fns)


def time_eager(fns: list[Callable[[], object]], reps: int) -> float:
    """Milliseconds per call of each fn launched eagerly (host work and any synchronisation inside included, as a
    step vLLM runs without a CUDA graph sees it): a warm-up call, then events around each rep; the median."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for fn in fns:
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2] / len(fns)


def summarize_kernels(kernels: list[tuple[str, float, float]], calls: int) -> dict:
    """Per-kernel GPU time from (name, start_us, end_us) kernel records of ``calls`` calls.

    Returns {"kernels": {name: ms per call}, "busy_ms": the union of the kernel intervals per
    call}. The event-timed time of the same graph minus busy_ms is the time the GPU ran none of
    them (launch gaps, dependencies): run_case stores it as "idle_ms".
    """
    per_name: dict[str, float] = {}
    for name, begin, stop in kernels:
        per_name[name] = per_name.get(name, 0.0) + (stop - begin)
    busy, reach = 0.0, float("-inf")
    for _, begin, stop in sorted(kernels, key=lambda k: k[1]):
        busy += max(0.0, stop - max(begin, reach))
        reach = max(reach, stop)
    return {"kernels": {name: us / 1e3 / calls for name, us in sorted(per_name.items(), key=lambda i: -i[1])},
            "busy_ms": busy / 1e3 / calls}


def format_breakdown(breakdown: dict) -> str:
    """One line: each kernel's ms, then busy and idle time (per call)."""
    if "error" in breakdown:
        return f"profile failed: {breakdown['error']}"
    kernels = ", ".join(f"{name[:40]} {ms:.4f}" for name, ms in breakdown["kernels"].items())
    return f"{kernels}; busy {breakdown['busy_ms']:.4f} ms, idle between kernels {breakdown['idle_ms']:.4f} ms"


def kernel_breakdown(fns: list[Callable[[], object]], reps: int) -> dict:
    """summarize_kernels of ``reps`` graph replays of fns (torch.profiler's CUDA kernel records);
    ms per call of one fn (one layer)."""
    from torch.profiler import ProfilerActivity, profile

    graph = captured_graph(fns)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return summarize_kernels(kernels, reps * len(fns))


def measure_bandwidth(device: torch.device, gib: float = 4.0) -> dict[str, float]:
    """Device read bandwidth (sum of a large fp32 tensor) and copy bandwidth (read + write), GB/s."""
    numel = int(gib * (1 << 30)) // 4
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    acc = torch.empty((), device=device)
    # F821 silenced below: the lambdas run before `del x, y` frees the GPU memory (ruff false positive).
    read_ms = time_graph([lambda: torch.sum(x, dim=0, out=acc)], 10)  # noqa: F821
    copy_ms = time_graph([lambda: y.copy_(x)], 10)  # noqa: F821
    del x, y
    torch.cuda.empty_cache()
    return {"read_GBps": numel * 4 / read_ms / 1e6, "copy_GBps": 2 * numel * 4 / copy_ms / 1e6}


def layers_for(bytes_per_layer: int) -> int:
    """Copies needed so one graph replay reads >= MIN_GRAPH_BYTES."""
    return max(1, min(MAX_LAYERS, -(-MIN_GRAPH_BYTES // max(1, bytes_per_layer))))


def sdpa_fns(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], backend) -> list[Callable[[], object]]:
    """SDPA decode calls (q [B, Hq, 1, D], contiguous k/v [B, Hkv, L, D]) forced onto one backend."""
    from torch.nn.attention import sdpa_kernel

    def make(k, v):
        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return fn

    return [make(k, v) for k, v in zip(ks, vs)]


def run_case(geometry: str, length: int, batch: int, block_size: int, reps: int, device: torch.device,
             bandwidth: dict[str, float], oscar_config=None, with_baselines: bool = True,
             breakdown: bool = False) -> dict:
    """Time OSCAR and the baselines for one case; returns a JSON-able dict. breakdown: also
    OSCAR's per-kernel GPU time and the idle time between its kernels (kernel_breakdown)."""
    from torch.nn.attention import SDPBackend

    from vllm_oscar.kernels import triton_ops
    from vllm_oscar.kernels.bf16_paged import bf16_paged_decode

    hq, hkv, dim = geometry_heads(geometry)
    result: dict = {"geometry": geometry, "context": length, "batch": batch, "block_size": block_size,
                    "hq": hq, "hkv": hkv, "head_dim": dim}
    need_bf16 = batch * hkv * length * 4 * dim
    layout = PageLayout(dim, dim, block_size, torch.float16)
    need_oscar = batch * hkv * length * layout.token_bytes
    free, _ = torch.cuda.mem_get_info(device)
    bf16_layers = layers_for(need_bf16) if with_baselines else 0
    oscar_layers = layers_for(need_oscar)
    if need_bf16 * bf16_layers + need_oscar * oscar_layers * 1.1 > MEMORY_FRACTION * free:
        result["skipped"] = (f"needs {(need_bf16 * bf16_layers + need_oscar * oscar_layers) / 2**30:.1f} GiB, "
                             f"{free / 2**30:.1f} GiB free")
        return result
    gen = torch.Generator(device=device).manual_seed(length * 131 + batch)
    case = make_oscar_case(batch, length, hq, hkv, dim, block_size, oscar_layers, device, gen)
    scale = 1.0 / math.sqrt(dim)
    config = dataclasses.replace(oscar_config or triton_ops.DEFAULT_DECODE, cuda_graph=True)  # timed as replays
    outs = [torch.empty_like(case.query) for _ in range(oscar_layers)]

    # F821 silenced below: the closures run before `del case, outs` frees GPU memory (ruff false positive).
    def oscar_fn(i: int) -> Callable[[], object]:
        return lambda: triton_ops.oscar_decode(
            case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, case.block_table,  # noqa: F821
            case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale,  # noqa: F821
            out=outs[i], max_seq_len=length, config=config)  # noqa: F821

    ms = time_graph([oscar_fn(i) for i in range(oscar_layers)], reps)
    plan = case_plan(config, case, length)
    o_bytes = oscar_bytes(case, batch, length, hkv, hq, dim)
    result["oscar"] = {"ms": ms, "layers": oscar_layers, "bytes": o_bytes, "GBps": o_bytes / ms / 1e6,
                       "pct_read_bw": 100 * o_bytes / ms / 1e6 / bandwidth["read_GBps"],
                       "splits": plan.num_splits, "measured_plan": plan.measured}
    if breakdown:
        try:
            kernels = kernel_breakdown([oscar_fn(i) for i in range(oscar_layers)], reps)
            result["oscar"]["breakdown"] = {**kernels, "idle_ms": ms - kernels["busy_ms"]}
        except Exception as error:  # noqa: BLE001 - reported in the results, the timing above stands
            result["oscar"]["breakdown"] = {"error": error_summary(error)}
    del case, outs
    torch.cuda.empty_cache()
    if not with_baselines:
        return result

    b_bytes = bf16_bytes(batch, length, hkv, hq, dim)
    ks = [torch.randn(batch, hkv, length, dim, device=device, dtype=torch.bfloat16, generator=gen)
          for _ in range(bf16_layers)]
    vs = [torch.randn_like(k) for k in ks]
    q4 = torch.randn(batch, hq, 1, dim, device=device, dtype=torch.bfloat16, generator=gen)
    sdpa = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            t = time_graph(sdpa_fns(q4, ks, vs, backend), reps)
            sdpa[name] = {"ms": t, "GBps": b_bytes / t / 1e6}
        except Exception as error:  # a backend that rejects the shape is reported, not hidden
            sdpa[name] = {"error": error_summary(error)}
    result["sdpa"] = sdpa
    timed = {k: v["ms"] for k, v in sdpa.items() if "ms" in v}
    if timed:
        best = min(timed, key=timed.get)
        result["best_sdpa"] = {"backend": best, "ms": timed[best]}
    # Paged BF16 Triton decode over the same bytes: K and V pools [B*L/bs, bs, Hkv, D].
    del ks, vs
    torch.cuda.empty_cache()
    pages = -(-length // block_size)
    paged = [torch.randn(2, batch * pages, block_size, hkv, dim, device=device, dtype=torch.bfloat16, generator=gen)
             for _ in range(bf16_layers)]
    table = torch.randperm(batch * pages, device=device, generator=gen).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    q3 = q4[:, :, 0]
    pouts = [torch.empty_like(q3) for _ in paged]

    # F821 silenced below: the closures run before `del paged, pouts` frees GPU memory (ruff false positive).
    def paged_fn(i: int) -> Callable[[], object]:
        return lambda: bf16_paged_decode(q3, paged[i][0], paged[i][1], table, lens, scale, length, out=pouts[i])  # noqa: F821

    try:
        t = time_graph([paged_fn(i) for i in range(bf16_layers)], reps)
        result["bf16_triton"] = {"ms": t, "GBps": b_bytes / t / 1e6}
    except Exception as error:
        result["bf16_triton"] = {"error": error_summary(error)}
    del paged, pouts
    torch.cuda.empty_cache()

    result["bf16_bytes"] = b_bytes
    result["ideal_speedup"] = b_bytes / o_bytes
    if "best_sdpa" in result:
        result["speedup_vs_best_sdpa"] = result["best_sdpa"]["ms"] / ms
    if "ms" in result["bf16_triton"]:
        result["speedup_vs_bf16_triton"] = result["bf16_triton"]["ms"] / ms
    return result


def case_plan(config, case: OscarCase, length: int, layer: int = 0):
    """The launch plan oscar_decode makes for this config and case (triton_ops.decode_plan)."""
    from vllm_oscar.kernels import triton_ops

    return triton_ops.decode_plan(
        case.query, case.caches[layer], case.window_k[layer], case.window_v[layer], case.layout, case.block_table,
        case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS,
        1.0 / math.sqrt(case.layout.head_dim), length, config)


def forced_empty_splits(config, length: int) -> int:
    """Splits of an explicit AttentionConfig.num_splits that a ``length``-position request leaves without tiles
    (the default sink and recent windows; tiles of the config's block_t, whole unless full_tiles is False): each
    still launches a program and adds a merge partial, so a tune of split counts should know them."""
    from vllm_oscar.kernels import triton_ops

    tiles = triton_ops.int2_split_tiles(length, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS,
                                        triton_ops.resolved_block_t(config), config.full_tiles is not False)
    return config.num_splits - triton_ops.splits_with_tiles(config.num_splits, tiles)


def tune_case(geometry: str, length: int, batch: int, block_size: int, reps: int, device: torch.device,
              bandwidth: dict[str, float], configs: list) -> list[dict]:
    """OSCAR decode time of each launch config on one shared random case (built once).

    A config that fails to compile or launch is reported with its error, not dropped.
    """
    from vllm_oscar.kernels import triton_ops

    hq, hkv, dim = geometry_heads(geometry)
    layout = PageLayout(dim, dim, block_size, torch.float16)
    layers = layers_for(batch * hkv * length * layout.token_bytes)
    gen = torch.Generator(device=device).manual_seed(length * 131 + batch)
    case = make_oscar_case(batch, length, hq, hkv, dim, block_size, layers, device, gen)
    scale = 1.0 / math.sqrt(dim)
    outs = [torch.empty_like(case.query) for _ in range(layers)]
    o_bytes = oscar_bytes(case, batch, length, hkv, hq, dim)
    rows = []
    for config in configs:
        # F821 silenced below: the closures run before `del case, outs` frees GPU memory (ruff false positive).
        fns = [lambda i=i, c=config: triton_ops.oscar_decode(
            case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, case.block_table,  # noqa: F821
            case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, scale,  # noqa: F821
            out=outs[i], max_seq_len=length, config=c) for i in range(layers)]  # noqa: F821
        row = {"geometry": geometry, "context": length, "batch": batch, "block_size": block_size,
               "config": dataclasses.asdict(config)}
        try:
            ms = time_graph(fns, reps)
            row["oscar"] = {"ms": ms, "GBps": o_bytes / ms / 1e6,
                            "pct_read_bw": 100 * o_bytes / ms / 1e6 / bandwidth["read_GBps"],
                            "splits": case_plan(config, case, length).num_splits}
            if config.num_splits:
                row["oscar"]["empty_splits"] = forced_empty_splits(config, length)
        except Exception as error:  # noqa: BLE001 - a variant that fails is reported
            row["error"] = error_summary(error)
        rows.append(row)
    del case, outs
    torch.cuda.empty_cache()
    return rows


def write_throughput(geometry: str, tokens: int, block_size: int, device: torch.device, reps: int,
                     refit_iterations: "int | tuple[int, int]" = 0, config=None) -> dict:
    """oscar_write on ``tokens`` new rows of one layer with ``refit_iterations`` grid refit rounds
    on K and V (served floors) and launch knobs ``config`` (triton_ops.WriteConfig, None = the default):
    ms, tokens/s, input GB/s."""
    from vllm_oscar.config import refit_pair
    from vllm_oscar.kernels import triton_ops

    config = config or triton_ops.DEFAULT_WRITE
    hq, hkv, dim = geometry_heads(geometry)
    gen = torch.Generator(device=device).manual_seed(tokens)
    layout = PageLayout(dim, dim, block_size, torch.float16)
    blocks = -(-tokens // block_size) + 1
    cache = layout.allocate(blocks, hkv, device=device)
    key = torch.randn(tokens, hkv, dim, device=device, dtype=torch.bfloat16, generator=gen)
    value = torch.randn(tokens, hkv, dim, device=device, dtype=torch.bfloat16, generator=gen)
    rot = torch.linalg.qr(torch.randn(hkv, dim, dim, device=device, generator=gen))[0].contiguous()
    slots = torch.arange(tokens, device=device, dtype=torch.int64)
    wk = torch.empty(blocks, block_size, hkv, dim, device=device, dtype=torch.bfloat16)
    wv = torch.empty_like(wk)
    wslots = torch.where(slots % 4 == 0, slots, -1)  # a quarter of the tokens also go to a window
    ms = time_graph([lambda: triton_ops.oscar_write(key, value, rot, rot, 0.96, 0.92, cache, layout, slots,
                                                    wk, wv, wslots, refit_iterations=refit_iterations,
                                                    config=config)], reps)
    moved = tokens * hkv * (2 * dim * 2 + layout.token_bytes) + tokens // 4 * hkv * 4 * dim
    return {"geometry": geometry, "tokens": tokens, "refit_iterations": list(refit_pair(refit_iterations)),
            "num_warps": config.num_warps or triton_ops.write_warps(dim, tokens), "clip_search": config.clip_search,
            "rotation_precision": config.rotation_precision, "unroll_refit": config.unroll_refit, "ms": ms,
            "tokens_per_s": tokens / ms * 1e3,
            "GBps": moved / ms / 1e6}


def configure_allocator(choice: str) -> str:
    """Set PyTorch's CUDA allocator for this process (call before CUDA is initialised); returns the settings in
    force. A PYTORCH_CUDA_ALLOC_CONF already in the environment wins over ``choice`` (ALLOCATOR_SETTINGS key)."""
    if choice not in ALLOCATOR_SETTINGS:
        raise ValueError(f"allocator {choice!r}: choose one of {sorted(ALLOCATOR_SETTINGS)}")
    if ALLOCATOR_ENV in os.environ:
        return os.environ[ALLOCATOR_ENV]
    if torch.cuda.is_initialized():
        raise RuntimeError(f"configure_allocator({choice!r}) after CUDA was initialised: PyTorch has read its "
                           f"allocator settings already; call it first, or set {ALLOCATOR_ENV} in the environment.")
    if ALLOCATOR_SETTINGS[choice]:
        os.environ[ALLOCATOR_ENV] = ALLOCATOR_SETTINGS[choice]
    return ALLOCATOR_SETTINGS[choice]


def device_info(device: torch.device) -> dict:
    """Name, SM count, memory, versions."""
    import triton

    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "sms": props.multi_processor_count, "memory_GiB": props.total_memory / 2**30,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def format_table(rows: list[dict]) -> str:
    """Fixed-width table of the decode results (* after OSCAR's time: a measured plan of the device's table)."""
    head = (f"{'geometry':<13}{'ctx':>7}{'B':>4} {'oscar ms':>10}{'%rd bw':>7} {'cudnn':>8}{'flash':>8}"
            f"{'effic':>8}{'bf16trt':>8} {'x best':>7}{'x trt':>7}{'ideal':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['geometry']:<13}{r['context']:>7}{r['batch']:>4}  skipped: {r['skipped']}")
            continue
        def ms(d: Optional[dict]) -> str:
            return f"{d['ms']:8.4f}" if d and "ms" in d else f"{'err':>8}"
        sd = r.get("sdpa", {})
        lines.append(
            f"{r['geometry']:<13}{r['context']:>7}{r['batch']:>4} {r['oscar']['ms']:9.4f}"
            f"{'*' if r['oscar'].get('measured_plan') else ' '}{r['oscar']['pct_read_bw']:6.0f}% "
            f"{ms(sd.get('cudnn'))}{ms(sd.get('flash'))}{ms(sd.get('efficient'))}{ms(r.get('bf16_triton'))} "
            f"{r.get('speedup_vs_best_sdpa', float('nan')):7.2f}{r.get('speedup_vs_bf16_triton', float('nan')):7.2f}"
            f"{r.get('ideal_speedup', float('nan')):7.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Time vs context per batch size (one panel per geometry), log-log, OSCAR vs best SDPA."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geometries = sorted({r["geometry"] for r in rows})
    fig, axes = plt.subplots(1, len(geometries), figsize=(7 * len(geometries), 5), squeeze=False)
    for ax, geometry in zip(axes[0], geometries):
        for batch in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if r["geometry"] == geometry and r["batch"] == batch and "oscar" in r]
            if not sel:
                continue
            ctx = [r["context"] for r in sel]
            line, = ax.plot(ctx, [r["oscar"]["ms"] for r in sel], "o-", label=f"OSCAR B={batch}")
            best = [(r["context"], r["best_sdpa"]["ms"]) for r in sel if "best_sdpa" in r]
            if best:
                ax.plot([c for c, _ in best], [t for _, t in best], "s--", color=line.get_color(),
                        alpha=0.6, label=f"best SDPA BF16 B={batch}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode attention time per layer (ms)")
        sizes = sorted({r["block_size"] for r in rows if r["geometry"] == geometry and "block_size" in r})
        ax.set_title(f"{geometry}, cache blocks of {'/'.join(map(str, sizes))}" if sizes else geometry)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: Launch configs the decode benchmark's autotune tries (AttentionConfig arguments): the default and
#: one step away from it on each knob that the H200 tunes found close (docs/decisions.md); a knob of
#: int2_split_kernel's splits (prefetch, window_block_t, max_registers) times that kernel instead of gluon_decode's.
AUTOTUNE_CANDIDATES: tuple[dict, ...] = (
    dict(), dict(gluon_splits=False), dict(block_t=32), dict(programs_per_sm=24), dict(min_tiles_per_split=1),
    dict(min_tiles_per_split=4),
    dict(prefetch=0), dict(prefetch=2), dict(int8_keys=False), dict(window_block_t=16), dict(window_block_t=64),
    dict(merge_block_d=16), dict(max_registers=128), dict(full_tiles=False),
)


def autotune(geometry: str, block_size: int, device: torch.device, bandwidth: dict[str, float], reps: int,
             context: int = 32768, batch: int = 8) -> tuple[object, list[dict]]:
    """Time every AUTOTUNE_CANDIDATES config on one case; return (fastest config, all timings)."""
    from vllm_oscar.kernels.triton_ops import AttentionConfig

    trials = []
    for arguments in AUTOTUNE_CANDIDATES:
        config = AttentionConfig(**arguments)
        try:
            r = run_case(geometry, context, batch, block_size, reps, device, bandwidth, oscar_config=config,
                         with_baselines=False)
            trials.append({"config": dataclasses.asdict(config), "ms": r["oscar"]["ms"]})
        except Exception as error:  # a config that does not apply (e.g. int8 keys at head_dim 64) is recorded
            trials.append({"config": dataclasses.asdict(config), "error": error_summary(error)})
    timed = [t for t in trials if "ms" in t]
    if not timed:
        raise RuntimeError(f"no autotune candidate ran for {geometry}: {trials}")
    best = min(timed, key=lambda t: t["ms"])
    return AttentionConfig(**best["config"]), trials
