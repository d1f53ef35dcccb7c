"""What the OSCAR backend is doing inside a vLLM worker: for users, tests and monitoring.

    llm.collective_rpc(worker_status)      # LLM(...); needs VLLM_ALLOW_INSECURE_SERIALIZATION=1
                                           # (vLLM refuses to ship a function to workers otherwise)

returns, per worker, the KV pool (blocks, bytes, block size), the attention impl class of every attention layer (the
backend that actually runs), where the rotations came from, how many layers have R_V folded into their weights
(vllm_oscar.attention.fold), how many defer the side-stream INT2 writes of captured decode steps to the end of the
forward (vllm_oscar.attention.deferred_writes), the window-store counters
(fallback_positions: BF16-window positions served from INT2; evictions) and bytes, the table of measured decode
plans the worker's GPU plans with (vllm_oscar.kernels.measured_plans; None: the rules alone, or no GPU), and the
prefill calls whose gathered rows would have exceeded FlashAttention prefill's workspace cap, run by the Triton
kernel instead (vllm_oscar.kernels.flash_plan.workspace_fallbacks).
"""

from __future__ import annotations

from typing import Any, Optional


def worker_status(worker: Any) -> dict[str, Any]:
    """Status of the OSCAR backend in ``worker`` (a vLLM worker; run via collective_rpc)."""
    from vllm_oscar.attention import window_store
    from vllm_oscar.kernels import flash_plan

    context = worker.vllm_config.compilation_config.static_forward_context
    impls = {name: layer.impl for name, layer in context.items() if hasattr(layer, "impl")}
    rotations = {getattr(getattr(impl, "rotations", None), "source", None) for impl in impls.values()}
    manager = window_store.current_manager()
    kv_cache_config = getattr(worker.model_runner, "kv_cache_config", None)
    return {
        "kv_cache_blocks": None if kv_cache_config is None else kv_cache_config.num_blocks,
        "kv_cache_bytes": _kv_cache_bytes(worker.model_runner),
        "block_size": worker.vllm_config.cache_config.block_size,
        "impl_classes": sorted({type(impl).__name__ for impl in impls.values()}),
        "num_attention_layers": len(impls),
        "rotation_sources": sorted(s for s in rotations if s is not None),
        "output_folded_layers": sum(bool(getattr(getattr(impl, "rotations", None), "output_rotated", False))
                                    for impl in impls.values()),
        "value_folded_layers": sum(bool(getattr(getattr(impl, "rotations", None), "value_prerotated", False))
                                   for impl in impls.values()),
        "side_write_deferred_layers": sum(bool(getattr(impl, "defer_side_writes", False)) for impl in impls.values()),
        "fallback_positions": None if manager is None else manager.fallback_positions,
        "evictions": None if manager is None else manager.evictions,
        "window_blocks": None if manager is None else manager.num_window_blocks,
        "window_store_bytes": window_store.allocated_bytes(),
        "decode_plan_table": _decode_plan_table(),
        "prefill_workspace_fallbacks": flash_plan.workspace_fallbacks,
    }


def _kv_cache_bytes(model_runner: Any) -> int:
    """Bytes of the paged KV cache tensors the runner allocated (distinct storages, each counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in getattr(model_runner, "kv_caches", []) if t is not None}
    return sum(storages.values())


def _decode_plan_table() -> Optional[str]:
    """Where the worker's table of measured decode plans came from (None without a table or a CUDA device)."""
    import torch

    from vllm_oscar.kernels.measured_plans import active_table

    if not torch.cuda.is_available():
        return None
    table = active_table(torch.device("cuda", torch.cuda.current_device()))
    return None if table is None else table.source
