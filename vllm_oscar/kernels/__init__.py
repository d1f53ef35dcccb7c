"""OSCAR kernels: fused INT2 write, paged decode, prefill over a cached prefix.

Public ops (contract: docs/design.md, "Kernel API"): ``oscar_write``, ``oscar_decode``,
``oscar_prefill``, ``oscar_rotate`` (q @ R_K, out_rot @ R_V^T; ``oscar_write(query=...)`` does q @ R_K
in the write's launch), plus ``rotate_rows`` (the torch rotation) and the page layout.

Dispatch is by platform, decided by the device of the cache tensor: CUDA tensors run the
Triton kernels (vllm_oscar.kernels.triton_ops), CPU tensors run the plain-torch
implementation (vllm_oscar.kernels.torch_ops). Both compute the same function; neither
falls back to the other. Any other device is an error. Triton is imported only when a CUDA
tensor arrives, so the CPU path needs no GPU toolchain.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Optional

import torch

from vllm_oscar.config import REFIT_SCALE_FLOOR, RefitIterations
from vllm_oscar.kernels import torch_ops
from vllm_oscar.kernels.layout import PLANES, PageLayout, PageViews, page_views
from vllm_oscar.kernels.rotate import rotate_rows

if TYPE_CHECKING:
    from vllm_oscar.kernels.flash_plan import PrefillPlan


def implementation_for(tensor: torch.Tensor) -> ModuleType:
    """The module implementing the ops for ``tensor``'s device: triton_ops (cuda) or torch_ops (cpu)."""
    if tensor.device.type == "cuda":
        from vllm_oscar.kernels import triton_ops

        return triton_ops
    if tensor.device.type == "cpu":
        return torch_ops
    raise ValueError(f"OSCAR kernels run on CUDA (Triton) or CPU (torch); got a tensor on {tensor.device}.")


def oscar_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_rotation: torch.Tensor,
    v_rotation: Optional[torch.Tensor],
    clip_k: float,
    clip_v: float,
    int2_cache: torch.Tensor,
    layout: PageLayout,
    slot_mapping: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_slot_mapping: torch.Tensor,
    value_prerotated: bool = False,
    refit_iterations: RefitIterations = 0,
    refit_floor: tuple[bool, bool] = REFIT_SCALE_FLOOR,
    query: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Write new K/V rows: INT2 into the paged cache, rotated BF16 copies into the window store.

    CUDA -> Triton kernel, CPU -> torch. ``refit_iterations``: least-squares grid refit
    rounds, one int or a (K, V) pair (the backend passes OscarConfig.refit_iterations;
    0 = clipped min/max grid). ``refit_floor``: (keys, values) refit never narrower than
    the clipped min/max grid (default: the served setting, config.REFIT_SCALE_FLOOR).
    ``query``: [N, Hq, D] query rows of the same tokens: then also returns q_rot = query @ R_K
    (float32, as ``oscar_rotate``), on CUDA from the same launch (a layer step's first launch);
    else returns None. Arguments: torch_ops.oscar_write.
    """
    impl = implementation_for(int2_cache)
    return impl.oscar_write(key, value, k_rotation, v_rotation, clip_k, clip_v, int2_cache, layout,
                            slot_mapping, window_k, window_v, window_slot_mapping, value_prerotated,
                            refit_iterations=refit_iterations, refit_floor=refit_floor, query=query)


def oscar_rotate(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate every head's rows: ``out[n, h] = x[n, h] @ R[h // g]`` (``@ R^T`` when inverse), fp32 math.

    x [N, H, D] float; rotation [Hr, D, D] float, Hr dividing H; out [N, H, D] float, written in its own
    dtype (default: a new fp32 tensor; a view such as the layer's output rows is fine).
    CUDA -> one Triton launch, CPU -> torch (``rotate_rows``). Returns out.
    """
    impl = implementation_for(x)
    if impl is torch_ops:
        rotated = rotate_rows(x, rotation, inverse=inverse, out_dtype=out.dtype if out is not None else torch.float32)
        if out is None:
            return rotated
        out.copy_(rotated)
        return out
    return impl.oscar_rotate(x, rotation, inverse=inverse, out=out)


def oscar_decode(
    query_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    int8_keys: Optional[bool] = None,
    cuda_graph: bool = False,
    beside_write: bool = False,
) -> torch.Tensor:
    """Paged decode over INT2 history + BF16 windows -> out_rot [B, Hq, D].

    CUDA -> Triton kernel (split-K sized from ``max_seq_len``, a Python int upper bound of
    seq_lens; default: block_table.shape[1] * block_size; CUDA-graph safe), CPU -> torch
    (``max_seq_len`` unused). int8_keys: the Triton path's int8 key MMA (None = where it
    applies; triton_ops.AttentionConfig); the torch path has no int8 key path, so True on CPU
    is an error. cuda_graph: this launch (and its warm-up) will be captured into a CUDA graph, so the
    Triton path may use launches that cost host time per eager call (TMA tile loads;
    AttentionConfig.cuda_graph). beside_write: an INT2 write runs beside this launch on a side stream (a captured
    decode step), so the Triton path sizes its split-K grid with room for it (AttentionConfig.beside_write; no effect
    on the result). Other arguments: torch_ops.oscar_decode.
    """
    impl = implementation_for(int2_cache)
    if impl is torch_ops:
        if int8_keys:
            raise ValueError("int8_keys=True: the int8 key path exists only in the CUDA (Triton) decode; "
                             "on CPU leave int8_keys unset or false.")
        return torch_ops.oscar_decode(query_rot, int2_cache, window_k, window_v, layout, block_table,
                                      window_block_table, seq_lens, sink, recent, softmax_scale, out)
    config = impl.decode_config(int8_keys, cuda_graph, beside_write)
    return impl.oscar_decode(query_rot, int2_cache, window_k, window_v, layout, block_table,
                             window_block_table, seq_lens, sink, recent, softmax_scale, out, max_seq_len, config)


def oscar_prefill(
    query_rot: torch.Tensor,
    key_rot: torch.Tensor,
    value_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: Optional[torch.Tensor] = None,
    max_query_len: Optional[int] = None,
    chunk_from_cache: bool = False,
    max_seq_len: Optional[int] = None,
    flash: Optional[bool] = None,
    flash_plan: Optional[PrefillPlan] = None,
) -> torch.Tensor:
    """Chunked prefill over a cached prefix (varlen) -> out_rot [T, Hq, D].

    CUDA -> Triton kernel (grid sized from ``max_query_len``, a Python int >= every chunk
    length; default: T; ``max_seq_len``, a Python int >= every seq_len or None, lets a step
    without any pure INT2 range run as one launch), CPU -> torch. ``chunk_from_cache``: read the (already written)
    chunk from the caches by the decode read rule instead of key_rot/value_rot (pass None). flash: the served read
    as FlashAttention over gathered rows (triton_ops.AttentionConfig.prefill_flash: None = on large calls where it
    runs, False = never, True = always, an error where it cannot run, including CPU). flash_plan: the step's host
    ranges of query_start_loc and seq_lens (flash_plan.PrefillPlan.of), which spare FlashAttention prefill its
    synchronisation; unused elsewhere. Other arguments: torch_ops.oscar_prefill.
    """
    impl = implementation_for(int2_cache)
    if impl is torch_ops:
        if flash:
            raise ValueError("flash=True: FlashAttention prefill runs only on CUDA GPUs; on CPU leave flash unset "
                             "or false.")
        return torch_ops.oscar_prefill(query_rot, key_rot, value_rot, int2_cache, window_k, window_v, layout,
                                       block_table, window_block_table, query_start_loc, seq_lens, sink,
                                       recent, softmax_scale, out, chunk_from_cache)
    return impl.oscar_prefill(query_rot, key_rot, value_rot, int2_cache, window_k, window_v, layout,
                              block_table, window_block_table, query_start_loc, seq_lens, sink, recent,
                              softmax_scale, out, max_query_len, impl.prefill_config(flash),
                              chunk_from_cache=chunk_from_cache, max_seq_len=max_seq_len, flash_plan=flash_plan)


__all__ = [
    "PLANES",
    "PageLayout",
    "PageViews",
    "implementation_for",
    "oscar_decode",
    "oscar_prefill",
    "oscar_rotate",
    "oscar_write",
    "page_views",
    "rotate_rows",
]
