"""One layer's GPU work of one step, as the vLLM backend runs it (no vLLM import).

``OscarMetadata`` is what the metadata builder makes of a scheduler step; ``layer_step`` (the
write, ``write_step``, then the attention, ``attend_step``; in a captured decode graph the INT2
part of the write beside the attention) is the backend's ``forward`` once vLLM's arguments are
unpacked. Kept apart from backend.py so that the GPU checks (bench/served_graph.py,
bench/check_kernels_gpu.py, which run where vLLM is not installed) drive the same code a served
decode step runs, CUDA-graph capture and replay included.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch

from vllm_oscar.attention.rotations import LayerRotations
from vllm_oscar.config import OscarConfig
from vllm_oscar.kernels import PageLayout, oscar_decode, oscar_prefill, oscar_rotate, oscar_write

if TYPE_CHECKING:
    from vllm_oscar.kernels.flash_plan import PrefillPlan


@dataclasses.dataclass
class OscarMetadata:
    """One step's attention metadata; requests ordered decodes first.

    Every new token at position t reads each cached position s <= t by the decode read
    rule (BF16 iff sink or recent window and a copy exists, else INT2), including the
    earlier new tokens of its own chunk: write_step writes the chunk first, and prefills
    run ``oscar_prefill(chunk_from_cache=True)``. So outputs do not depend on chunking,
    prefix-cache hits or preemption. Tensors on the layer's device; the decode part covers
    the first ``num_decodes`` requests (one token each), the prefill part the others
    (query_start_loc rebased to their first token):

        block_table, window_block_table  int32 [B, max_blocks] (window: -1 = read INT2)
        seq_lens                         int32 [B]  (0 for a CUDA graph's padding rows)
        prefill_query_start_loc          int32 [B - num_decodes + 1]
        window_slot_mapping              int64 [N]  BF16 slot of each new token, -1: no copy
    """

    num_actual_tokens: int  # N: new tokens of the step (+ padding tokens of a full CUDA graph: slot -1)
    num_decodes: int
    max_seq_len: int  # >= every seq_len; sizes the decode split count (max_model_len in a CUDA graph)
    max_query_len: int
    block_table: torch.Tensor
    window_block_table: torch.Tensor
    seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    window_slot_mapping: torch.Tensor
    cuda_graph: bool = False  # built for a CUDA-graph capture (and its warm-up): the decode may use TMA
    #: Device int32 [1] (WindowPlanBuffers.serial_write): 0 = the step reads no INT2 code it writes (every
    #: newest token is read in BF16, WindowPlan.newest_read_bf16), so a captured decode step may write INT2
    #: beside its attention; 1 = write INT2 first. Read at each replay. None: no such buffer (CPU, tests).
    serial_write: Optional[torch.Tensor] = None
    #: >= every prefill request's seq_len (host values, from vLLM's CPU copy of seq_lens): sizes the prefill part
    #: (FlashAttention or the Triton kernel, flash_plan.FLASH_PREFILL_MIN_WORK; the Triton kernel's splits), which
    #: max_seq_len, raised by long decodes in the same step, would overstate. None: max_seq_len.
    prefill_max_seq_len: Optional[int] = None
    #: The prefill requests' ranges for FlashAttention prefill (host values and their device copy, built once per
    #: step), so that no layer synchronises to read them. None: not built (CPU, FlashAttention unavailable or
    #: turned off, no prefill); a FlashAttention prefill then reads them itself.
    prefill_plan: Optional[PrefillPlan] = None


@dataclasses.dataclass
class LayerCaches:
    """One layer's caches: the INT2 pages [num_blocks, Hkv, bytes] uint8 (layout's planes) and
    the BF16 window store, K and V [num_window_blocks, block_size, Hkv, D]."""

    int2: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    layout: PageLayout


def layer_step(m: OscarMetadata, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               slot_mapping: torch.Tensor, rotations: LayerRotations, caches: LayerCaches, config: OscarConfig,
               softmax_scale: float, output: torch.Tensor, defer_side_write: bool = False) -> None:
    """One layer of one step: write the new K/V, then attend (write_step + attend_step; the write and the
    query rotation in one launch: oscar_write(query=...)).

    In a CUDA-graph capture of a pure decode step the quantizing INT2 write (about a third of a
    small-batch decode step's GPU time) runs on a side stream beside the attention, which reads the
    step's new tokens from their BF16 copies, written first on the current stream by the launch that
    also rotates the queries (oscar_write with query); at decode sizes that launch also stores the rotated K / V
    rows, which the side write's row programs quantize without rotating again (so the side stream forks after it,
    else before); the current stream waits for the side stream
    before returning (and for the writes earlier layers deferred), or, with defer_side_write, not until a
    later layer_step without it or join_side_writes (so that the write may run on beside the following
    layers; key and value stay allocated for it until then). The graph holds both orders, each launch predicated on
    m.serial_write, so every replay takes the one its plan allows (1: the INT2 part on the current
    stream, before the attention). Eager steps (host-bound: a second launch costs more host time than it
    saves) write, then attend; their write launch rotates the queries too (one launch fewer per layer).
    """
    pure_decode = m.num_decodes > 0 and m.num_actual_tokens == m.num_decodes
    beside = (pure_decode and m.serial_write is not None and caches.int2.is_cuda
              and torch.cuda.is_current_stream_capturing())
    args = _write_args(m, key, value, slot_mapping, rotations, caches)
    if not beside:  # the write and the query rotation in one launch, then the attention
        q_rot = oscar_write(*args, refit_iterations=config.refit_iterations, query=query[:m.num_actual_tokens])
        attend_step(m, query, rotations, caches, config, softmax_scale, output, query_rot=q_rot)
        return
    from vllm_oscar.kernels import triton_ops

    main = torch.cuda.current_stream()
    side = _side_stream(main, deferred=defer_side_write)
    n, hkv, d = args[0].shape
    rotated = None  # the first launch's rotated rows, which the side write's row programs read
    if triton_ops.reads_rotated_rows(n, d):
        rotated = torch.empty((n, hkv, 2, d), dtype=torch.float32, device=key.device)
    else:
        side.wait_stream(main)
    q_rot = triton_ops.oscar_write(*args, refit_iterations=config.refit_iterations, int2="if_flag",
                                   flag=m.serial_write, query=query[:m.num_actual_tokens], rotated_out=rotated)
    if rotated is not None:
        side.wait_stream(main)
    with torch.cuda.stream(side):
        triton_ops.oscar_write(*args, refit_iterations=config.refit_iterations, store_window=False,
                               int2="unless_flag", flag=m.serial_write, rotated=rotated)
    attend_step(m, query, rotations, caches, config, softmax_scale, output, query_rot=q_rot, beside_write=True)
    if defer_side_write:  # until the join, the caching allocator keeps key, value and rotated for the side stream
        for tensor in (key, value) if rotated is None else (key, value, rotated):
            tensor.record_stream(side)
        _UNJOINED_SIDE_STREAMS.setdefault(main, {})[side] = None
    else:
        main.wait_stream(side)
        join_side_writes()


#: Side streams for the INT2 writes of captured decode steps, a pool per stream that forks them (the capturing
#: stream: captures on different streams never share a side stream). A write that layer_step does not join takes
#: the next of SIDE_WRITE_STREAMS in turn, so that writes of consecutive layers may overlap each other.
SIDE_WRITE_STREAMS = 4
_SIDE_STREAMS: dict["torch.cuda.Stream", list["torch.cuda.Stream"]] = {}
_DEFERRED_WRITES: dict["torch.cuda.Stream", int] = {}  # deferred writes so far per forking stream: the next side
_UNJOINED_SIDE_STREAMS: dict["torch.cuda.Stream", dict["torch.cuda.Stream", None]] = {}  # ordered sets


def join_side_writes() -> None:
    """Make the current stream wait for the INT2 writes that layer_step, called on it, left unjoined."""
    if not torch.cuda.is_available():
        return
    main = torch.cuda.current_stream()
    for side in _UNJOINED_SIDE_STREAMS.pop(main, {}):
        main.wait_stream(side)


def _side_stream(main: "torch.cuda.Stream", deferred: bool) -> "torch.cuda.Stream":
    """A side stream forked from ``main`` for an INT2 write: the first of main's pool for a write joined in its
    layer, the pool's streams in turn for deferred ones (streams created once per process)."""
    index = 0
    if deferred:
        index = _DEFERRED_WRITES.get(main, 0) % SIDE_WRITE_STREAMS
        _DEFERRED_WRITES[main] = index + 1
    pool = _SIDE_STREAMS.setdefault(main, [])
    while len(pool) <= index:
        pool.append(torch.cuda.Stream(device=main.device))
    return pool[index]


def write_step(m: OscarMetadata, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
               rotations: LayerRotations, caches: LayerCaches, config: OscarConfig) -> None:
    """Write the step's K/V rows [>= N, Hkv, D]: INT2 into the pages at slot_mapping, rotated BF16
    copies into the window store at m.window_slot_mapping (slot -1: not written)."""
    oscar_write(*_write_args(m, key, value, slot_mapping, rotations, caches), refit_iterations=config.refit_iterations)


def _write_args(m: OscarMetadata, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                rotations: LayerRotations, caches: LayerCaches) -> tuple:
    """oscar_write's positional arguments for the step's N new tokens."""
    n = m.num_actual_tokens
    return (key[:n], value[:n], rotations.k_rotation, rotations.v_rotation, rotations.clip_k, rotations.clip_v,
            caches.int2, caches.layout, slot_mapping[:n], caches.window_k, caches.window_v, m.window_slot_mapping[:n],
            rotations.value_prerotated)


def attend_step(m: OscarMetadata, query: torch.Tensor, rotations: LayerRotations, caches: LayerCaches,
                config: OscarConfig, softmax_scale: float, output: torch.Tensor,
                query_rot: Optional[torch.Tensor] = None, beside_write: bool = False) -> None:
    """Attention of the step's queries [>= N, Hq, D] into output [>= N, Hq, D] (rows [0, N) written),
    each by the decode read rule; decodes through the split-K decode, the rest as chunked prefill.
    query_rot: the queries already rotated (fp32 [N, Hq, D], q @ R_K), else rotated here. beside_write: the step's
    INT2 write runs beside the attention on a side stream (oscar_decode's beside_write).
    With rotations.output_rotated the attention writes its rotated output straight into ``output`` (W_o
    takes it rotated); else into a float32 buffer that one launch un-rotates (@ R_V^T) into ``output``."""
    n, bd = m.num_actual_tokens, m.num_decodes
    sink, recent = config.sink_tokens, config.recent_tokens
    # float32 between the two rotations: no extra rounding of q or of the output.
    q_rot = oscar_rotate(query[:n], rotations.k_rotation) if query_rot is None else query_rot
    out_rot = output[:n] if rotations.output_rotated else torch.empty_like(q_rot)
    if bd:
        oscar_decode(q_rot[:bd], caches.int2, caches.window_k, caches.window_v, caches.layout, m.block_table[:bd],
                     m.window_block_table[:bd], m.seq_lens[:bd], sink, recent, softmax_scale, out=out_rot[:bd],
                     max_seq_len=m.max_seq_len, int8_keys=config.int8_keys, cuda_graph=m.cuda_graph,
                     beside_write=beside_write)
    if n > bd:
        oscar_prefill(q_rot[bd:], None, None, caches.int2, caches.window_k, caches.window_v, caches.layout,
                      m.block_table[bd:], m.window_block_table[bd:], m.prefill_query_start_loc, m.seq_lens[bd:],
                      sink, recent, softmax_scale, out=out_rot[bd:], max_query_len=m.max_query_len,
                      chunk_from_cache=True, flash=config.flash_prefill,
                      max_seq_len=m.max_seq_len if m.prefill_max_seq_len is None else m.prefill_max_seq_len,
                      flash_plan=m.prefill_plan)
    if not rotations.output_rotated:
        oscar_rotate(out_rot, rotations.v_rotation, inverse=True, out=output[:n])
