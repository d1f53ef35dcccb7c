#!/usr/bin/env python3
"""Served decode steps of OSCAR attention on a GPU without vLLM, eager and as a full CUDA graph.

What vLLM does for a pure decode batch when the backend supports full CUDA graphs
(UNIFORM_SINGLE_TOKEN_DECODE under its default FULL_AND_PIECEWISE mode), with the product's own
code for each part: the window plan (WindowBlockManager) written into fixed-address buffers
(WindowPlanBuffers), then for every layer layer_step (vllm_oscar.attention.step: the write, then the
attention, with a decode step's INT2 write on a side stream beside it; what the backend's forward
runs), as one module's forward hooked to join the deferred side-stream writes (attention.deferred_writes).
vLLM's side is mimicked: block 0 is the null block, the graph is captured once per batch size on dummy
requests (seq_len 1, null block) with max_seq_len = max_model_len, and a smaller batch is padded to it
(seq_len 0, slot -1).

  check  every replay (ragged, padded batches, new blocks, windows sliding, 2 graph sizes; every third
         with the serial-write flag forced on) equals an eager step (write, then attend) on a copy of
         the same state: outputs within bf16 tolerance (the split counts differ), INT2 pages and
         window stores bit for bit
  time   wall time per decode step of all layers: eager (as vLLM runs attention outside graphs)
         against one graph replay, each with the host's step preparation (window plan, input copies),
         and the replay alone; Qwen3-8B geometry (36 layers, 32 / 8 heads, D 128); with --fold MODE...,
         each fold mode's graph side by side (vllm_oscar.attention.fold: "none" un-rotates the output in
         one launch per layer, "output" leaves it rotated for W_o, "value_and_output" also takes V rotated);
         with --side-join layer step, each layer's side-stream write joined in its layer against all of them
         after the last layer (the backend's way)

    python bench/served_graph.py [--json OUT] [--only check time] [--contexts 4096 --batches 1 8
                                 --max-model-len 131072] [--fold none output value_and_output]
                                 [--side-join layer step]
    python bench/served_graph.py --profile CONTEXT BATCH   (cProfile of eager steps)
    python bench/served_graph.py --kernels CONTEXT BATCH   (GPU time per kernel of a graph replay)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
import time
from typing import Callable, Iterator, Optional
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from vllm_oscar.attention import step  # noqa: E402
from vllm_oscar.attention.deferred_writes import join_after_forward  # noqa: E402
from vllm_oscar.attention.rotations import LayerRotations  # noqa: E402
from vllm_oscar.attention.step import LayerCaches, OscarMetadata, layer_step, write_step  # noqa: E402
from vllm_oscar.attention.step_buffers import WindowPlanBuffers  # noqa: E402
from vllm_oscar.attention.window_store import WindowBlockManager, window_capacity_blocks  # noqa: E402
from vllm_oscar.config import DEFAULT_FOLD_MODE, FOLD_MODES, GPU_DECODE_BLOCK_SIZE, OscarConfig  # noqa: E402
from vllm_oscar.kernels import PageLayout, measured_plans, triton_ops  # noqa: E402
from vllm_oscar.kernels.flash_plan import PrefillPlan, flash_unavailable  # noqa: E402
from vllm_oscar.provenance import source_digest  # noqa: E402

NULL_BLOCK = 0  # vLLM reserves block 0; dummy (capture) requests point at it
TOLERANCE = 1e-2  # graph vs eager outputs: the split counts differ (max_model_len vs the step's)
PREFILL_CHUNK = 2048  # tokens per prefill step (vLLM's max_num_batched_tokens; sizes the window store)


def _orthogonal(hkv: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(hkv, dim, dim, generator=gen, dtype=torch.float64))
    return q.float().contiguous()  # as LayerRotations holds them (QR returns column-major)


def folded(rotations: LayerRotations, fold: str) -> LayerRotations:
    """A layer's rotations as the backend holds them under fold mode ``fold`` (config.FOLD_MODES)."""
    if fold not in FOLD_MODES:
        raise ValueError(f"fold mode {fold!r} is not one of {FOLD_MODES}.")
    return dataclasses.replace(rotations, output_rotated=fold != "none", value_prerotated=fold == "value_and_output")


class ServedAttention:
    """The attention of ``layers`` layers of a served model, as one worker holds it. The block table spans
    max_model_len (the captured graphs are sized for it, as vLLM's); the cache holds cache_positions per request
    (default max_model_len), as vLLM sizes its cache by memory rather than by max_model_len x requests."""

    def __init__(self, layers: int, hq: int, hkv: int, dim: int, max_model_len: int, max_requests: int,
                 device: torch.device, block_size: int = GPU_DECODE_BLOCK_SIZE, seed: int = 0,
                 cache_positions: Optional[int] = None, fold: str = DEFAULT_FOLD_MODE) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.dim, self.bs, self.device = hq, hkv, dim, block_size, device
        self.config = OscarConfig()
        self.max_model_len = max_model_len
        self.max_tokens = max(max_requests, PREFILL_CHUNK)
        self.layout = PageLayout(dim, dim, block_size, self.config.scale_dtype)
        self.max_blocks = -(-max_model_len // block_size)
        num_blocks = 1 + max_requests * -(-(cache_positions or max_model_len) // block_size)
        capacity = window_capacity_blocks(max_requests, self.max_tokens, block_size, self.config.sink_tokens,
                                          self.config.recent_tokens)
        self.manager = WindowBlockManager(capacity, block_size, self.config.sink_tokens, self.config.recent_tokens)
        self.buffers = WindowPlanBuffers(max_requests, self.max_tokens, device)
        self.rotations = [folded(LayerRotations(_orthogonal(hkv, dim, gen).to(self.device),
                                                _orthogonal(hkv, dim, gen).to(self.device), 0.99, 1.0, "test", ""),
                                 fold)
                          for _ in range(layers)]
        window = (capacity, block_size, hkv, dim)
        self.caches = [LayerCaches(torch.zeros(self.layout.cache_shape(num_blocks, hkv), dtype=torch.uint8,
                                               device=self.device),
                                   torch.zeros(window, dtype=torch.bfloat16, device=self.device),
                                   torch.zeros(window, dtype=torch.bfloat16, device=self.device), self.layout)
                       for _ in range(layers)]
        self.free_blocks = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self.rows: dict[int, list[int]] = {}  # request -> physical blocks
        self.lengths: dict[int, int] = {}
        # vLLM's persistent step inputs (the graph reads these addresses).
        self.block_table = torch.zeros(max_requests, self.max_blocks, dtype=torch.int32, device=self.device)
        self.seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=self.device)
        self.query = torch.zeros(self.max_tokens, hq, dim, dtype=torch.bfloat16, device=self.device)
        self.key = torch.zeros(self.max_tokens, hkv, dim, dtype=torch.bfloat16, device=self.device)
        self.value = torch.zeros_like(self.key)
        self.output = torch.zeros_like(self.query)
        self.scale = 1 / math.sqrt(dim)
        self.side_join = "step"  # SIDE_JOINS
        self.layers = _AttentionLayers(self)
        self.layers.register_forward_hook(join_after_forward)

    # -- host side of a step: the scheduler's blocks, vLLM's inputs, OSCAR's builder -------------
    def prefill(self, request: int, length: int) -> None:
        """Write a prompt's K/V (every layer), chunk by chunk; no attention needed for the history."""
        self.rows[request], self.lengths[request] = [], 0
        while self.lengths[request] < length:
            new = min(PREFILL_CHUNK, length - self.lengths[request])
            metadata, slots = self._step([request], [new], rows_padded=1, tokens_padded=new, table=None)
            for layer in range(len(self.caches)):
                key, value = (torch.randn(new, self.hkv, self.dim, device=self.device, dtype=torch.bfloat16)
                              for _ in range(2))
                write_step(metadata, key, value, slots, self.rotations[layer], self.caches[layer], self.config)

    def decode_inputs(self, requests: list[int], graph_batch: int | None) -> OscarMetadata:
        """One decode token per request: the step's metadata, and fresh q/k/v in the static inputs.
        graph_batch: pad to this many requests / tokens (a captured graph's size), None = eager."""
        padded = graph_batch or len(requests)
        metadata, slots = self._step(requests, [1] * len(requests), rows_padded=padded, tokens_padded=padded,
                                     table=self.block_table)
        n = len(requests)
        self.slot_mapping[:n].copy_(slots)
        self.slot_mapping[n:padded].fill_(-1)
        self.query[:padded].normal_()
        self.key[:padded].normal_()
        self.value[:padded].normal_()
        return metadata

    def capture_inputs(self, graph_batch: int) -> OscarMetadata:
        """vLLM's dummy batch for capture: graph_batch requests of one token at position 0 in the null
        block; max_seq_len = max_model_len and cuda_graph (build_for_cudagraph_capture)."""
        plan = self.manager.plan(torch.full((graph_batch, self.max_blocks), NULL_BLOCK, dtype=torch.int32),
                                 [1] * graph_batch, [1] * graph_batch)
        table, slots = self.buffers.load(plan, graph_batch)
        self.block_table[:graph_batch].fill_(NULL_BLOCK)
        self.seq_lens[:graph_batch].fill_(1)
        self.slot_mapping[:graph_batch] = torch.arange(graph_batch, device=self.device) % self.bs  # null block slots
        return OscarMetadata(graph_batch, graph_batch, self.max_model_len, 1, self.block_table[:graph_batch], table,
                             self.seq_lens[:graph_batch], self.seq_lens[:1], slots, cuda_graph=True,
                             serial_write=self.buffers.serial_write)

    def _step(self, requests: list[int], new_tokens: list[int], rows_padded: int, tokens_padded: int,
              table: torch.Tensor | None) -> tuple[OscarMetadata, torch.Tensor]:
        """Allocate blocks, plan the windows, fill vLLM's block table / seq_lens and OSCAR's buffers; returns
        the step's metadata and the INT2 slots of its new tokens (int64 [sum(new_tokens)], request order).
        table: the block-table buffer to fill (a graph's), None = a fresh one."""
        lengths = []
        for request, new in zip(requests, new_tokens):
            self.lengths[request] += new
            while len(self.rows[request]) * self.bs < self.lengths[request]:
                self.rows[request].append(self.free_blocks.pop())
            lengths.append(self.lengths[request])
        host_table = torch.full((rows_padded, self.max_blocks), NULL_BLOCK, dtype=torch.int32)
        for index, request in enumerate(requests):
            host_table[index, : len(self.rows[request])] = torch.tensor(self.rows[request], dtype=torch.int32)
        pad = rows_padded - len(requests)
        plan = self.manager.plan(host_table, lengths + [0] * pad, new_tokens + [0] * pad)
        if plan.fallback_positions:
            raise RuntimeError(f"{plan.fallback_positions} window positions fell back to INT2 (store too small)")
        wtable, wslots = self.buffers.load(plan, tokens_padded)
        bt = (table if table is not None else torch.empty_like(self.block_table))[:rows_padded]
        bt.copy_(host_table)
        self.seq_lens[:rows_padded].copy_(torch.tensor(lengths + [0] * pad, dtype=torch.int32))
        slots = []
        for request, new in zip(requests, new_tokens):
            for position in range(self.lengths[request] - new, self.lengths[request]):
                slots.append(self.rows[request][position // self.bs] * self.bs + position % self.bs)
        decodes = len(requests) if all(new == 1 for new in new_tokens) else 0  # a prefill step: no decodes
        starts = [0, *itertools.accumulate(new_tokens)]
        query_start = torch.tensor(starts, dtype=torch.int32, device=self.device)
        recent = self.config.recent_tokens
        # as the backend's builder: a prefill step's ranges planned on the host where FlashAttention prefill may run
        flash_plan = (PrefillPlan.of(starts, lengths, recent, self.device)
                      if not decodes and self.config.flash_prefill is not False
                      and flash_unavailable(self.device, self.dim, recent) is None else None)
        metadata = OscarMetadata(tokens_padded, decodes, max(lengths), max(new_tokens), bt, wtable,
                                 self.seq_lens[:rows_padded], query_start, wslots,
                                 serial_write=self.buffers.serial_write, prefill_plan=flash_plan)
        return metadata, torch.tensor(slots, dtype=torch.int64, device=self.device)

    # -- device side: what the captured graph holds -------------------------------------------
    def run_layers(self, metadata: OscarMetadata, caches: list[LayerCaches] | None = None,
                   output: torch.Tensor | None = None) -> None:
        """layer_step (the write, then the attention; on CUDA the INT2 write of a decode step beside it) of every
        layer on the static inputs (one layer's output feeds none: attention only), as the forward of a module
        hooked as the backend hooks a served model (attention.deferred_writes) when side_join is "step"."""
        self.layers(metadata, caches or self.caches, self.output if output is None else output)

    def capture(self, graph_batch: int) -> torch.cuda.CUDAGraph:
        metadata = self.capture_inputs(graph_batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles and caches every launch plan outside the graph
            self.run_layers(metadata)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # raises on any host synchronisation inside
            self.run_layers(metadata)
        return graph


#: Where a captured step joins its side-stream INT2 writes (ServedAttention.side_join): "layer" each layer's
#: before the next layer, "step" all of them after the last (layer_step's defer_side_write; the product's way).
SIDE_JOINS = ("layer", "step")
#: --plans: decode plans with the device's table of measured plans ("device"), or by the rules alone ("rules").
PLAN_CHOICES = ("device", "rules")
#: --side-writes: the side-stream INT2 writes as served ("full"), or timing probes (side_writes).
SIDE_WRITE_MODES = ("full", "idle", "serial", "rows", "tiles", "warps1", "warps2", "warps8")


class _AttentionLayers(torch.nn.Module):
    """Every layer's layer_step as one module's forward (what a served model's forward runs of OSCAR)."""

    def __init__(self, served: ServedAttention) -> None:
        super().__init__()
        self.served = served

    def forward(self, metadata: OscarMetadata, caches: list[LayerCaches], output: torch.Tensor) -> None:
        served = self.served
        for layer, layer_caches in enumerate(caches):
            layer_step(metadata, served.query, served.key, served.value, served.slot_mapping,
                       served.rotations[layer], layer_caches, served.config, served.scale, output,
                       defer_side_write=served.side_join == "step")


def _clone(caches: list[LayerCaches]) -> list[LayerCaches]:
    return [LayerCaches(c.int2.clone(), c.window_k.clone(), c.window_v.clone(), c.layout) for c in caches]


def _same(a: list[LayerCaches], b: list[LayerCaches], exact: bool, rows: int) -> tuple[bool, int]:
    """Caches after a padded and an eager step agree: (whether they do, INT2 bytes that differ). exact (CUDA: the
    Triton write rotates and quantizes each row on its own, and a captured step's side-stream row programs give the
    eager write's bytes): bit for bit. Otherwise (CPU: torch's batched matmul rounds differently per batch size):
    window rows within bf16 rounding, and at most one INT2 byte per written (token, head) row differs, where a padding
    row written by mistake would change a whole row."""
    differing = 0
    for x, y in zip(a, b):
        layer_differing = int((x.int2 != y.int2).sum())
        differing += layer_differing
        if exact:
            same = layer_differing == 0 and torch.equal(x.window_k, y.window_k) and torch.equal(x.window_v, y.window_v)
        else:
            same = (torch.allclose(x.window_k.float(), y.window_k.float(), rtol=1e-2, atol=1e-3)
                    and torch.allclose(x.window_v.float(), y.window_v.float(), rtol=1e-2, atol=1e-3)
                    and layer_differing <= rows * x.int2.shape[1])
        if not same:
            return False, differing
    return True, differing


def check(report: list, device: torch.device, layers: int = 2, rounds: int = 60, prompts=None,
          max_model_len: int = 12288, fold: str = DEFAULT_FOLD_MODE, side_join: str = "step") -> None:
    """Padded steps against eager steps on copies of the same state, under fold mode ``fold`` and side-stream
    join ``side_join`` (SIDE_JOINS). On CUDA the
    padded steps are replays of graphs captured for 4 and 8 requests; elsewhere (a CPU smoke test of the
    padding rules) they run eagerly with the capture's max_seq_len."""
    served = ServedAttention(layers=layers, hq=32, hkv=8, dim=128, max_model_len=max_model_len, max_requests=8,
                             device=device, seed=1, fold=fold)
    served.side_join = side_join
    prompts = prompts or {0: 9000, 1: 700, 2: 300, 3: 65, 4: 1, 5: 4000}
    for request, length in prompts.items():
        served.prefill(request, length)
    if device.type == "cuda":
        graphs = {size: served.capture(size) for size in (4, 8)}
        padded_step = {size: graph.replay for size, graph in graphs.items()}
    else:
        padded_step = {size: (lambda size=size: served.run_layers(
            OscarMetadata(size, size, served.max_model_len, 1, served.block_table[:size], served.buffers.table[:size],
                          served.seq_lens[:size], served.seq_lens[:1], served.buffers.slots[:size])))
                       for size in (4, 8)}
    worst_err, caches_equal, steps, int2_bytes_differing = 0.0, True, 0, 0
    ids = list(prompts)
    schedule = [ids, ids[:2], ids[::-1][:3], ids, ids[2:3], ids[::2]]
    for round_index in range(rounds):  # windows slide across block boundaries and the sink edge
        requests = schedule[round_index % len(schedule)]
        size = 4 if len(requests) <= 4 else 8
        metadata = served.decode_inputs(requests, graph_batch=size)
        if round_index % 3 == 2:  # the replay's predicated launches as a step whose plan forbids the side stream
            served.buffers.serial_write.fill_(1)
        n = len(requests)
        eager_meta = OscarMetadata(n, n, int(served.seq_lens[:n].max()), 1, metadata.block_table[:n],
                                   metadata.window_block_table[:n], metadata.seq_lens[:n], metadata.seq_lens[:1],
                                   metadata.window_slot_mapping[:n])
        copies = _clone(served.caches)
        eager_out = torch.zeros_like(served.output)
        served.run_layers(eager_meta, copies, eager_out)  # eager: write, then attend
        padded_step[size]()
        if device.type == "cuda":
            torch.cuda.synchronize()
        got, want = served.output[:n].float(), eager_out[:n].float()
        if not torch.isfinite(got).all() or served.output[n:size].any():
            raise AssertionError(f"round {round_index}: non-finite outputs, or padding rows not zero")
        worst_err = max(worst_err, float((got - want).norm() / want.norm()))
        same, differing = _same(copies, served.caches, device.type == "cuda", n)
        caches_equal &= same
        int2_bytes_differing += differing
        steps += 1
    ok = worst_err < TOLERANCE and caches_equal
    report.append({"check": "served_graph", "device": str(device), "fold": fold, "side_join": side_join,
                   "replays": steps,
                   "graph_batches": [4, 8], "max_rel_err_replay_vs_eager": worst_err, "caches_equal": caches_equal,
                   "int2_bytes_differing": int2_bytes_differing, "ok": ok})
    print(f"served_graph (fold {fold}, join per {side_join}): {steps} padded steps (graphs of 4 and 8 requests on "
          f"CUDA, ragged), max rel err {worst_err:.1e}, caches equal {caches_equal} ({int2_bytes_differing} INT2 bytes "
          f"differ in all) {'ok' if ok else 'FAIL'}",
          flush=True)


def plan_table(choice: str) -> contextlib.AbstractContextManager:
    """PLAN_CHOICES: "device" plans with the device's table of measured plans (measured_plans), "rules" without."""
    return measured_plans.using_table(None) if choice == "rules" else contextlib.nullcontext()


@contextlib.contextmanager
def _patched(name: str, value, clear_cache: Callable[[], None] = lambda: None) -> Iterator[None]:
    """triton_ops.<name> = value under it (restored after), with clear_cache run on the way in and out: caches built
    from the other value would outlive it."""
    with mock.patch.object(triton_ops, name, value):
        clear_cache()
        try:
            yield
        finally:
            clear_cache()


def window_columns(columns: Optional[int]) -> contextlib.AbstractContextManager:
    """Write launches made under it give a flagged launch's window-copy programs ``columns`` output columns
    (triton_ops.WRITE_WINDOW_BLOCK_C, the default of WriteConfig.window_columns, which layer_step does not take);
    None: the default. For timing A/Bs: a captured graph keeps what its capture launched."""
    if columns is None:
        return contextlib.nullcontext()
    return _patched("WRITE_WINDOW_BLOCK_C", columns, triton_ops._write_constants.cache_clear)


def side_writes(mode: str) -> contextlib.AbstractContextManager:
    """SIDE_WRITE_MODES (timing probes but "full"): "full" as served; "idle" (the caches go stale) launches each
    side-stream INT2 write with nothing to do (int2="never"), to price what the writes cost the launches beside them;
    "serial" writes the INT2 part in the first launch on the current stream (int2="always", as an eager step) and
    leaves the side launch idle; "rows" runs the side write by row programs that rotate the rows again (not reading
    the first launch's rotated rows), "tiles" by 16-row programs (WriteConfig(row_programs=False), as served before
    session 41), "warpsN" so with N warps per program (WriteConfig.num_warps)."""
    if mode == "full":
        return contextlib.nullcontext()
    served_write = triton_ops.oscar_write

    def probed_write(*args, **kwargs):
        side = kwargs.get("int2") == "unless_flag" and kwargs.get("store_window") is False
        if side:
            kwargs = {**kwargs, "rotated": None}
        if side and mode in ("idle", "serial"):
            kwargs = {**kwargs, "int2": "never", "flag": None}
        elif side and mode == "rows":
            kwargs = {**kwargs, "config": triton_ops.WriteConfig(row_programs=True)}
        elif side:
            warps = None if mode == "tiles" else int(mode.removeprefix("warps"))
            kwargs = {**kwargs, "config": triton_ops.WriteConfig(num_warps=warps, row_programs=False)}
        elif mode == "serial" and kwargs.get("int2") == "if_flag":
            kwargs = {**kwargs, "int2": "always", "flag": None}
        return served_write(*args, **kwargs)

    return _patched("oscar_write", probed_write)


def recorded_splits(seen: set) -> contextlib.AbstractContextManager:
    """Adds the split count of every decode plan made under it to ``seen`` (what a capture launched)."""
    planned = triton_ops._cached_plan

    def recording(*args, **kwargs):
        plan = planned(*args, **kwargs)
        seen.add(plan.num_splits)
        return plan

    return _patched("_cached_plan", recording)


def beside_write_headroom(on: bool) -> contextlib.AbstractContextManager:
    """Decode plans made under it leave the side-stream write room (triton_ops.BESIDE_WRITE_SPLIT_EIGHTHS, the
    served default: on) or not (off: every split of the plan, for A/Bs)."""
    return contextlib.nullcontext() if on else _patched("BESIDE_WRITE_SPLIT_EIGHTHS", 8, triton_ops._PLANS.clear)


def window_columns_used(columns: Optional[int]) -> int:
    """The window-copy columns a Qwen3-8B-geometry step's first launch uses under window_columns(columns)."""
    return triton_ops.window_columns(triton_ops.WriteConfig(window_columns=columns), 128)


def time_steps(report: list, calls: int, contexts: list[int], batches: list[int],
               max_model_len: Optional[int] = None, folds: tuple[str, ...] = (DEFAULT_FOLD_MODE,),
               rounds: int = 2, joins: tuple[str, ...] = ("step",), plans: tuple[str, ...] = ("device",),
               columns: tuple[Optional[int], ...] = (None,), side_modes: tuple[str, ...] = ("full",),
               headroom: tuple[bool, ...] = (True,)) -> None:
    """Wall time per decode step, all 36 layers' attention: eager against one graph replay, per variant (fold
    mode x side-stream join x decode plans: the device's measured plans or the rules' alone x window-copy columns,
    window_columns x side-stream writes, side_writes x the decode's room for them, beside_write_headroom; one graph
    each over the same state), ``rounds`` rounds with the variants in turns.
    The graphs are captured for max_model_len (default: just above the context), as vLLM captures for the
    model's."""
    for context in contexts:
        for batch in batches:
            variants = list(itertools.product(folds, joins, plans, columns, side_modes, headroom))
            positions = context + 2 * calls * rounds * len(variants) + 64  # what the timed steps write
            served = ServedAttention(layers=36, hq=32, hkv=8, dim=128, max_model_len=max(max_model_len or 0, positions),
                                     max_requests=batch, device=torch.device("cuda"), seed=2, cache_positions=positions)
            for request in range(batch):
                served.prefill(request, context - 7 * request)
            rotations = {fold: [folded(r, fold) for r in served.rotations] for fold in folds}
            graphs, splits = {}, {}
            for variant in variants:
                fold, join, plan, copy_columns, side_mode, room = variant
                served.rotations, served.side_join = rotations[fold], join
                splits[variant] = set()
                with (plan_table(plan), window_columns(copy_columns), side_writes(side_mode),
                      beside_write_headroom(room), recorded_splits(splits[variant])):
                    graphs[variant] = served.capture(batch)
            requests = list(range(batch))
            timings: dict[tuple, dict[str, list[float]]] = {variant: {} for variant in variants}
            for round_index in range(rounds):  # variants in turns, the order reversed every other round (drift)
                for variant in variants if round_index % 2 == 0 else variants[::-1]:
                    fold, join, plan, copy_columns, side_mode, room = variant
                    served.rotations, served.side_join = rotations[fold], join
                    for mode in ("eager", "graph", "replay"):
                        torch.cuda.synchronize()
                        start = time.perf_counter()
                        for _ in range(calls):
                            if mode != "replay":  # the replay alone reuses the last step's inputs: the GPU's share
                                metadata = served.decode_inputs(requests,
                                                                graph_batch=batch if mode == "graph" else None)
                            if mode == "eager":
                                with plan_table(plan), window_columns(copy_columns), side_writes(side_mode):
                                    served.run_layers(metadata)  # eager steps write first: no beside_write
                            else:
                                graphs[variant].replay()
                        torch.cuda.synchronize()
                        timings[variant].setdefault(mode, []).append(
                            (time.perf_counter() - start) / calls * 1e3)
            for variant in variants:
                fold, join, plan, copy_columns, side_mode, room = variant
                runs = timings[variant]
                row = {"context": context, "batch": batch, "layers": 36, "max_model_len": served.max_model_len,
                       "fold": fold, "side_join": join, "plans": plan,
                       "window_columns": window_columns_used(copy_columns), "side_writes": side_mode,
                       "splits": sorted(splits[variant]), "beside_write_headroom": room,
                       "eager_ms": runs["eager"],
                       "graph_ms": runs["graph"],
                       "replay_only_ms": min(runs["replay"]), "replay_only_runs_ms": runs["replay"],
                       "speedup": min(runs["eager"]) / min(runs["graph"])}
                report.append({"time": "served_step", **row})
                print(f"served step, Qwen3-8B attention x36 layers, {context} ctx (graph for {served.max_model_len}), "
                      f"batch {batch}, fold {fold}, join per {join}, plans {plan}, window copies of "
                      f"{row['window_columns']} columns, side writes {side_mode}, headroom {'on' if room else 'off'}, "
                      f"splits {row['splits']}: "
                      f"eager {' / '.join(f'{t:.2f}' for t in runs['eager'])} ms, "
                      f"graph {' / '.join(f'{t:.2f}' for t in runs['graph'])} ms ({row['speedup']:.1f}x; replay "
                      f"alone {' / '.join(f'{t:.3f}' for t in runs['replay'])} ms)", flush=True)
            del served, graphs
            torch.cuda.empty_cache()


def profile_eager(context: int, batch: int, calls: int, top: int) -> None:
    """cProfile of eager decode steps (36 layers, after a warm-up): where the host time goes."""
    import cProfile
    import pstats

    served = ServedAttention(layers=36, hq=32, hkv=8, dim=128, max_model_len=context + 2 * calls + 64,
                             max_requests=batch, device=torch.device("cuda"), seed=3)
    for request in range(batch):
        served.prefill(request, context - 7 * request)
    requests = list(range(batch))
    served.run_layers(served.decode_inputs(requests, graph_batch=None))  # warm-up
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        served.run_layers(served.decode_inputs(requests, graph_batch=None))
    torch.cuda.synchronize()
    profiler.disable()
    print(f"eager decode steps, Qwen3-8B attention x36 layers, {context} ctx, batch {batch}, {calls} steps:")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


def profile_kernels(context: int, batch: int, calls: int, report: list, fold: str = DEFAULT_FOLD_MODE,
                    side_join: str = "step") -> None:
    """torch.profiler (CUPTI) over graph replays: GPU time and count per kernel name and stream, per decode
    step, and the replay's wall time, so the gaps between the kernels show as the difference; the streams
    are numbered by their first kernel (0: the one the step's first launch runs on)."""
    from torch.profiler import ProfilerActivity, profile

    served = ServedAttention(layers=36, hq=32, hkv=8, dim=128, max_model_len=context + 2 * calls + 64,
                             max_requests=batch, device=torch.device("cuda"), seed=4, fold=fold)
    served.side_join = side_join
    for request in range(batch):
        served.prefill(request, context - 7 * request)
    graph = served.capture(batch)
    served.decode_inputs(list(range(batch)), graph_batch=batch)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        graph.replay()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / calls * 1e3
    with tempfile.TemporaryDirectory() as folder:
        trace_path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as handle:
            events = [e for e in json.load(handle)["traceEvents"] if e.get("cat") == "kernel"]
    events.sort(key=lambda e: e["ts"])
    stream_index: dict = {}
    kernels: dict[tuple[str, int], list[float]] = {}
    for event in events:
        stream = stream_index.setdefault(event["args"].get("stream"), len(stream_index))
        entry = kernels.setdefault((event["name"][:90], stream), [0.0, 0])
        entry[0] += event["dur"] / 1e3 / calls  # ms per step
        entry[1] += 1 / calls
    rows = sorted(({"kernel": name, "stream": stream, "ms_per_step": t, "launches_per_step": c,
                    "us_per_launch": 1e3 * t / c} for (name, stream), (t, c) in kernels.items()),
                  key=lambda r: -r["ms_per_step"])
    busy = sum(r["ms_per_step"] for r in rows)
    print(f"graph replay, Qwen3-8B attention x36 layers, {context} ctx, batch {batch}, fold {fold}, join per "
          f"{side_join}: wall {wall_ms:.3f} ms per step, kernels {busy:.3f} ms, "
          f"{sum(r['launches_per_step'] for r in rows):.0f} launches", flush=True)
    for r in rows:
        print(f"  {r['ms_per_step']:8.4f} ms  {r['launches_per_step']:6.1f}x  {r['us_per_launch']:7.2f} us  "
              f"stream {r['stream']}  {r['kernel']}", flush=True)
    report.append({"kernels": "graph_replay", "context": context, "batch": batch, "fold": fold,
                   "side_join": side_join, "wall_ms": wall_ms, "kernel_ms": busy, "rows": rows})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--only", nargs="*", default=["check", "time"])
    parser.add_argument("--calls", type=int, default=30, help="decode steps per timed run")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768], help="time: contexts")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="time: batch sizes")
    parser.add_argument("--long-splits", action="store_true",
                        help="decode with AttentionConfig.long_splits (opt-in), for comparisons")
    parser.add_argument("--no-gluon", action="store_true",
                        help="decode with AttentionConfig(gluon_splits=False): int2_split_kernel only, for comparisons")
    parser.add_argument("--max-model-len", type=int,
                        help="check and time: capture the graphs for this many positions (a long-context "
                             "deployment: its batch-1 plans stage tiles, copied by TMA in the graphs)")
    parser.add_argument("--profile", nargs=2, type=int, metavar=("CONTEXT", "BATCH"),
                        help="instead: cProfile eager decode steps at this context and batch")
    parser.add_argument("--rotate-precision", choices=["ieee", "tf32x3"],
                        help="the rotation launches' dot precision (triton_ops.ROTATE_PRECISION), for comparisons")
    parser.add_argument("--kernels", nargs=2, type=int, action="append", metavar=("CONTEXT", "BATCH"),
                        help="also: GPU time per kernel of graph replays at this context and batch (repeatable)")
    parser.add_argument("--rounds", type=int, default=2, help="time: rounds of every fold mode, in turns")
    parser.add_argument("--plans", nargs="+", choices=PLAN_CHOICES, default=["device"],
                        help="time: decode plans with the device's measured plans, or by the rules alone")
    parser.add_argument("--window-columns", type=int, nargs="+",
                        help="time: output columns per window-copy program of the first launch (A/B; default: "
                             "triton_ops.WRITE_WINDOW_BLOCK_C)")
    parser.add_argument("--side-writes", nargs="+", choices=SIDE_WRITE_MODES, default=["full"],
                        help="time: the side-stream INT2 writes as served (full) or timing probes (side_writes)")
    parser.add_argument("--headroom", nargs="+", choices=("on", "off"), default=["on"],
                        help="time: the decode's split count with room for the side-stream write (on, served) or not")
    parser.add_argument("--fold", nargs="+", choices=FOLD_MODES, default=[DEFAULT_FOLD_MODE],
                        help="fold modes (vllm_oscar.attention.fold) to check, time side by side, and profile")
    parser.add_argument("--write-rows-max", type=int,
                        help="side-stream INT2 writes of at most this many tokens by row programs "
                             "(triton_ops.WRITE_ROWS_MAX_TOKENS), for A/Bs with --side-writes full tiles")
    parser.add_argument("--side-streams", type=int,
                        help="side streams that deferred INT2 writes take in turn (step.SIDE_WRITE_STREAMS)")
    parser.add_argument("--side-join", nargs="+", choices=SIDE_JOINS, default=["step"],
                        help="where a captured step joins its side-stream INT2 writes: after each layer, or once "
                             "after the last; each checked, timed side by side, and profiled")
    args = parser.parse_args()
    if args.rotate_precision or args.long_splits or args.no_gluon:
        if args.rotate_precision:
            triton_ops.ROTATE_PRECISION = args.rotate_precision
        if args.long_splits:  # decode_config builds the served configs from DEFAULT_DECODE
            triton_ops.DEFAULT_DECODE = dataclasses.replace(triton_ops.DEFAULT_DECODE, long_splits=True)
        if args.no_gluon:
            triton_ops.DEFAULT_DECODE = dataclasses.replace(triton_ops.DEFAULT_DECODE, gluon_splits=False)
    if args.side_streams:
        step.SIDE_WRITE_STREAMS = args.side_streams
    if args.write_rows_max is not None:
        triton_ops.WRITE_ROWS_MAX_TOKENS = args.write_rows_max
    if args.profile:
        profile_eager(*args.profile, calls=args.calls, top=45)
        return 0
    report: list = []
    failed = False
    for fold, join in itertools.product(args.fold, args.side_join) if "check" in args.only else []:
        try:
            check(report, torch.device("cuda"), fold=fold, side_join=join,
                  **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
        except Exception as error:  # report it; the timing still runs
            failed = True
            report.append({"check": "served_graph", "fold": fold, "side_join": join, "ok": False,
                           "error": f"{type(error).__name__}: {error}"})
            print(f"served_graph (fold {fold}, join per {join}): ERROR {type(error).__name__}: {error}", flush=True)
        failed |= not all(r.get("ok", True) for r in report)
    if "time" in args.only:
        time_steps(report, args.calls, args.contexts, args.batches, args.max_model_len, tuple(args.fold), args.rounds,
                   tuple(args.side_join), tuple(args.plans), tuple(args.window_columns or [None]),
                   tuple(args.side_writes), tuple(choice == "on" for choice in args.headroom))
    for context, batch in args.kernels or []:
        for fold, join in itertools.product(args.fold, args.side_join):
            profile_kernels(context, batch, args.calls, report, fold, join)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "source_digest": source_digest(), "rows": report},
                      handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
