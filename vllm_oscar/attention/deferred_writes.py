"""Captured decode steps join their side-stream INT2 writes once per forward pass, not once per layer.

In a CUDA-graph capture of a pure decode step, each OSCAR layer writes the step's INT2 codes on a side stream
beside its attention (attention/step.layer_step). Joined in the same layer, a small batch's write (a chain of
dependent reductions, ~14 us on an H200 whatever the batch up to 8) is longer than the attention it runs beside,
so every layer waits for it. Deferred, the writes run on beside the following layers, on SIDE_WRITE_STREAMS
streams in turn, and the model's forward joins them all at its end (a forward hook, inside the capture: vLLM's
CUDAGraphWrapper captures ``model(...)``). H200, Qwen3-8B attention x36 layers, replay alone: 4K batch 1 16%,
32K batch 2 19% faster per step, 2-19% at 10 of 16 cells, 1.7-2.4% slower at 32K batch 8 and 128K batch 2-4
(docs/decisions.md).

Only layers of a model that carries the hook defer, so a forward that ends without it cannot leave a capture
with work unjoined (torch raises cudaErrorStreamCaptureUnjoined at the capture's end). And only where vLLM runs
the attention op outside every Inductor graph (deferral_blocker): a deferred write still reads the layer's key and
value rows after the op returns, which the caching allocator honours (record_stream) but Inductor's own buffer
reuse inside one compiled graph would not (the next layer's qkv output may take the same buffer).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from vllm_oscar.attention.step import join_side_writes

logger = logging.getLogger(f"vllm.{__name__}")

#: Attribute of a model that holds the handle of its joining forward hook.
JOIN_HOOK_ATTRIBUTE = "_oscar_side_write_join"
#: The custom op through which vLLM 0.32 calls a backend that accepts an output buffer (OSCAR does).
ATTENTION_OP = "vllm::unified_attention_with_output"


def deferral_blocker(compilation_config: Any) -> Optional[str]:
    """Why an engine with this vLLM CompilationConfig must join each layer's write in the layer, or None: the
    attention op must run outside Inductor graphs (no compilation, Dynamo with its "eager" backend, or vLLM's
    Dynamo-level split at ATTENTION_OP)."""
    from vllm.config import CompilationMode

    mode = compilation_config.mode
    if mode == CompilationMode.NONE or compilation_config.backend == "eager":
        return None
    if mode != CompilationMode.VLLM_COMPILE:
        return f"compilation mode {mode.name} compiles the attention op into an Inductor graph"
    if compilation_config.use_inductor_graph_partition:
        return "use_inductor_graph_partition compiles the attention op into an Inductor graph"
    if ATTENTION_OP not in (compilation_config.splitting_ops or []):
        return f"{ATTENTION_OP} is not in splitting_ops, so it is compiled into an Inductor graph"
    return None


def defer_side_writes(model: torch.nn.Module, compilation_config: Any) -> int:
    """Hook ``model``'s forward to join the deferred side-stream writes (once per model object) and let each OSCAR
    layer of ``model`` defer its write to it (OscarAttentionImpl.defer_side_writes), unless deferral_blocker says
    no (then logged). Returns the layers marked."""
    from vllm_oscar.attention.backend import OscarAttentionImpl

    impls = [module.impl for module in model.modules() if isinstance(getattr(module, "impl", None), OscarAttentionImpl)]
    if not impls:
        return 0
    blocker = deferral_blocker(compilation_config)
    if blocker is not None:
        logger.info("OSCAR: captured decode steps join each layer's INT2 write in the layer: %s.", blocker)
        return 0
    if getattr(model, JOIN_HOOK_ATTRIBUTE, None) is None:
        setattr(model, JOIN_HOOK_ATTRIBUTE, model.register_forward_hook(join_after_forward))
    for impl in impls:
        impl.defer_side_writes = True
    logger.info("OSCAR: %d layers defer the INT2 writes of captured decode steps to the end of the forward pass.",
                len(impls))
    return len(impls)


def join_after_forward(module: torch.nn.Module, args: tuple, output: object) -> None:
    """Forward hook: the current stream waits for every deferred side-stream write (a no-op when none is)."""
    join_side_writes()
