"""Captured decode steps join their side-stream INT2 writes once per forward pass, not once per layer.

In a CUDA-graph capture of a pure decode step, each OSCAR layer writes the step's INT2 codes on a side stream
beside its attention (attention/step.layer_step). Joined in the same layer, a small batch's write (a chain of
dependent reductions, ~14 us on an H200 whatever the batch up to 8) is longer than the attention it runs beside,
so every layer waits for it. Deferred, the writes run on beside the following layers, on SIDE_WRITE_STREAMS
streams in turn, and the model's forward joins them all at its end (a forward hook, inside the capture: vLLM's
CUDAGraphWrapper captures ``model(...)``). H200, Qwen3-8B attention x36 layers, replay alone: 4K batch 1 16%,
32K batch 2 19% faster per step; within +-2.4% from batch 8 on (docs/PERFORMANCE.md "Session 38").

Only layers of a model that carries the hook defer, so a forward that ends without it cannot leave a capture
with work unjoined (torch raises cudaErrorStreamCaptureUnjoined at the capture's end).
"""

from __future__ import annotations

import logging

import torch

from vllm_oscar.attention.step import join_side_writes

logger = logging.getLogger(__name__)

#: Attribute of a model that holds the handle of its joining forward hook.
JOIN_HOOK_ATTRIBUTE = "_oscar_side_write_join"


def defer_side_writes(model: torch.nn.Module) -> int:
    """Hook ``model``'s forward to join the deferred side-stream writes (once per model object) and let each OSCAR
    layer of ``model`` defer its write to it (OscarAttentionImpl.defer_side_writes). Returns the layers marked."""
    from vllm_oscar.attention.backend import OscarAttentionImpl

    impls = [module.impl for module in model.modules() if isinstance(getattr(module, "impl", None), OscarAttentionImpl)]
    if not impls:
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
