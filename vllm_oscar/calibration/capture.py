"""Exact capture of post-RoPE Q, K, V and the attention output of a transformers model.

transformers' Llama/Qwen/Mistral-style attention modules compute q/k/v projections,
(for Qwen3: per-head q/k norms), RoPE, then call a function looked up by name in
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with the post-RoPE tensors.
``capture_attention`` registers, under a new name, a function that calls the model's
original attention function with the same arguments, hands its inputs and result to a
callback, and returns that result untouched; it also registers the original mask
function under the new name, so the mask the model builds is unchanged. The model's
outputs are therefore bit-identical with and without capture (tested).

Callback arguments, per attention call (one per layer per forward):
    layer_idx: int
    query: [B, Hq, T, D] post-RoPE queries (model dtype)
    key:   [B, Hkv, T, D] post-RoPE keys (before GQA repetition)
    value: [B, Hkv, T, D]
    output: [B, T, Hq, D] attention output per query head (softmax(q k^T * scaling) v)
    scaling: float softmax scale
Only forwards without a KV cache are meaningful for calibration (key = this call's tokens).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import torch

CaptureCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]

#: Prefix of the attention-implementation names registered by capture_attention.
CAPTURE_PREFIX = "oscar_capture:"


def _attention_configs(model: torch.nn.Module) -> list[Any]:
    """Distinct config objects whose _attn_implementation the attention modules read."""
    configs: list[Any] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and all(config is not c for c in configs):
            configs.append(config)
    return configs


def _original_function(module: torch.nn.Module, implementation: str) -> Callable[..., Any]:
    """The function the model itself would call for ``implementation``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(module).__module__]
    eager = getattr(modeling, "eager_attention_forward", None)
    if implementation == "eager" or implementation not in ALL_ATTENTION_FUNCTIONS:
        if eager is None:
            raise ValueError(
                f"{type(module).__name__} uses attention implementation {implementation!r} and its "
                "module has no eager_attention_forward; capture supports transformers models built "
                "on the AttentionInterface (Llama, Qwen2/3, Mistral, ...)."
            )
        return eager
    return ALL_ATTENTION_FUNCTIONS[implementation]


@contextlib.contextmanager
def capture_attention(model: torch.nn.Module, callback: CaptureCallback) -> Iterator[None]:
    """Within the block, every attention call of ``model`` also calls ``callback``.

    Raises ValueError if the model has no attention module with a ``layer_idx`` (not an
    AttentionInterface model). The previous attention implementation is restored on exit,
    also when the block raises.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import AttentionInterface

    configs = _attention_configs(model)
    implementations = {c._attn_implementation for c in configs}
    if not configs or len(implementations) != 1 or not any(
        hasattr(m, "layer_idx") and hasattr(m, "k_proj") for m in model.modules()
    ):
        raise ValueError(
            f"cannot capture attention of {type(model).__name__}: expected a transformers model whose "
            "attention modules (with layer_idx and k_proj) dispatch through the AttentionInterface "
            f"with one attention implementation; found implementations {sorted(map(str, implementations))}."
        )
    original_name = implementations.pop()
    name = CAPTURE_PREFIX + str(original_name)

    def capturing(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, **kwargs: Any) -> Any:
        result = _original_function(module, original_name)(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling")
        scaling = float(query.shape[-1] ** -0.5) if scaling is None else float(scaling)
        with torch.no_grad():
            callback(int(module.layer_idx), query.detach(), key.detach(), value.detach(), result[0].detach(), scaling)
        return result

    AttentionInterface.register(name, capturing)
    mask_functions = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if original_name in mask_functions:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_functions[original_name])
    try:
        for config in configs:
            config._attn_implementation = name
        yield
    finally:
        for config in configs:
            config._attn_implementation = original_name
        AttentionInterface._global_mapping.pop(name, None)
        mask_functions.pop(name, None)
