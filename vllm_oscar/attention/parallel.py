"""Which KV heads (and so which rotations) a tensor-parallel rank owns.

OSCAR rotations are per (layer, KV head), stored for all ``Hkv_total`` heads of a layer
([Hkv_total, D, D] per layer). Under tensor parallelism vLLM gives each rank a contiguous
run of KV heads (``QKVParallelLinear``):

- ``tp_size <= Hkv_total``: each rank holds ``Hkv_total // tp_size`` heads, starting at
  ``tp_rank * heads_per_rank``;
- ``tp_size > Hkv_total`` (replicated): each rank holds ONE head,
  ``tp_rank // (tp_size // Hkv_total)``, shared by ``tp_size // Hkv_total`` ranks.

A rank loads only its slice, so the local KV head ``i`` of the attention layer uses the
rotation of global head ``slice.start + i``. That also keeps the V rotation right when
W_v / W_o are sharded: the rank's W_v rows and W_o columns belong to exactly these heads
(and their query heads).

Pipeline parallelism needs nothing here: a stage only builds (and loads rotations for)
its own layers, identified by ``layer.layer_name``.

This module does not import vLLM at module level; ``current_kv_head_slice`` imports it
lazily to read the rank of the calling worker.
"""

from __future__ import annotations

from typing import Any


def kv_head_slice(total_kv_heads: int, tp_size: int, tp_rank: int) -> slice:
    """The global KV heads held by ``tp_rank`` of ``tp_size`` (vLLM's QKV sharding).

    Raises ValueError for the layouts vLLM itself rejects: ``tp_size`` must divide
    ``total_kv_heads``, or be a multiple of it (replicated heads).
    """
    for name, value in (("total_kv_heads", total_kv_heads), ("tp_size", tp_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer.")
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank!r} must lie in [0, {tp_size}).")
    if tp_size >= total_kv_heads:
        if tp_size % total_kv_heads:
            raise ValueError(
                f"tensor parallel size {tp_size} is not a multiple of the {total_kv_heads} "
                "KV heads: vLLM cannot replicate them evenly."
            )
        first = tp_rank // (tp_size // total_kv_heads)
        return slice(first, first + 1)
    if total_kv_heads % tp_size:
        raise ValueError(
            f"{total_kv_heads} KV heads cannot be split evenly over tensor parallel size "
            f"{tp_size}."
        )
    per_rank = total_kv_heads // tp_size
    return slice(tp_rank * per_rank, (tp_rank + 1) * per_rank)


def current_kv_head_slice(total_kv_heads: int) -> slice:
    """``kv_head_slice`` for the calling vLLM worker (reads its tensor-parallel group).

    Call it inside a worker, e.g. from ``Impl.process_weights_after_loading``.
    """
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return kv_head_slice(
        total_kv_heads,
        get_tensor_model_parallel_world_size(),
        get_tensor_model_parallel_rank(),
    )


class OscarWorkerExtension:
    """vLLM worker extension: lets the driver ask each worker what OSCAR loaded there.

    Pass ``worker_extension_cls="vllm_oscar.attention.parallel.OscarWorkerExtension"``
    to ``LLM(...)`` (``--worker-extension-cls`` for ``vllm serve``); then
    ``llm.collective_rpc("oscar_report")`` returns one report per worker (TP and PP
    ranks, mp or Ray executor). Nothing else changes in the worker.
    """

    def oscar_report(self) -> dict[str, Any]:
        """This worker's parallel ranks and, per attention layer, what serves it.

        Returns {"pid", "tp_rank", "tp_size", "pp_rank", "pp_size", "status" (the
        worker-wide counters of vllm_oscar.attention.status.worker_status), "layers": {layer_name:
        {"backend", "impl", "num_kv_heads", "rotation_source", "k_rotation", "v_rotation",
        "clip_k", "clip_v"}}}; rotations are nested lists [Hkv_local][D][D] (plain data, so
        every executor returns them alike; None when the layer has no OSCAR rotations).
        """
        import os

        from vllm.distributed import get_pp_group, get_tp_group

        from vllm_oscar.attention.status import worker_status

        context = self.vllm_config.compilation_config.static_forward_context  # type: ignore[attr-defined]
        layers: dict[str, Any] = {}
        for name, layer in context.items():
            impl = getattr(layer, "impl", None)
            backend = getattr(layer, "attn_backend", None)
            if impl is None or backend is None:
                continue
            rotations = getattr(impl, "rotations", None)
            layers[name] = {
                "backend": backend.get_name(),
                "impl": f"{type(impl).__module__}.{type(impl).__qualname__}",
                "num_kv_heads": getattr(impl, "num_kv_heads", None),
                "rotation_source": getattr(rotations, "source", None),
                "k_rotation": None if rotations is None else rotations.k_rotation.detach().cpu().tolist(),
                "v_rotation": None if rotations is None else rotations.v_rotation.detach().cpu().tolist(),
                "clip_k": getattr(rotations, "clip_k", None),
                "clip_v": getattr(rotations, "clip_v", None),
            }
        return {
            "pid": os.getpid(),
            "tp_rank": get_tp_group().rank_in_group,
            "tp_size": get_tp_group().world_size,
            "pp_rank": get_pp_group().rank_in_group,
            "pp_size": get_pp_group().world_size,
            "status": worker_status(self),
            "layers": layers,
        }
