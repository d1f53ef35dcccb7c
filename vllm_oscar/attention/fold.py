"""R_V folded into a model's output (and optionally value) projection at load: no un-rotation launch per step.

Every OSCAR layer stores its values rotated by R_V[h] per KV head h (rows, v_rot = v @ R_V[h]), so attention
over the cache returns o_rot = o @ R_V[h] for each query head of the group. Unfolded, one launch per layer
step un-rotates the output (@ R_V^T). Folded, the weights carry the rotations, once, at load (docs/method.md
section 2, architecture.md "Kernel facts"):

    o_proj, the columns W_o[:, j] [hidden, D] of query head j of KV head h:   W_o[:, j] <- W_o[:, j] @ R_V[h]
    qkv_proj, the rows of W_v [D, hidden] of KV head h:   W_v[h] <- R_V[h]^T @ W_v[h]  (bias: b_v[h] @ R_V[h])

so o_proj(o_rot) = o_proj(o), and v = W_v x arrives rotated (the write then skips its V rotation). Both are
exact up to one more rounding of the weights in their dtype. config.FOLD_MODES: "output" (the default) folds
W_o only (it removes the launch; the write still rotates V, so the cache bytes are those of the unfolded path),
"value_and_output" both, "none" neither. Measured (docs/decisions.md, docs/QUALITY.md "Folded
rotations"): "output" takes 0-7% off every served graph step measured of Qwen3-8B's attention on an H200, never
slower; "value_and_output" 2-9% at most cells but 7% slower at 128K batch 8; SmolLM2's log-probabilities stay as
close to BF16 as unfolded under both.

A layer is folded only where that algebra is known to hold: its attention module is one of
FOLDABLE_ATTENTION_CLASSES (vLLM models whose forward feeds v from qkv_proj straight into the attention and
the attention's output straight into o_proj), both projections are vLLM's unquantized QKVParallelLinear /
RowParallelLinear with this rank's heads, and no LoRA adapter adds to them. Anything else keeps the
unfolded path (same outputs, one launch more per layer step) and is logged with its reason; the option
``fold_rotations`` (additional_config) picks the mode. Runs before vLLM's own post-load processing
(which on CPU repacks linear weights), from vllm_oscar.attention.registration.

After a fold the model's weights differ from the checkpoint's, so reloading weights in place would serve
raw W_v / W_o to folded layers: ``guard_weight_reloads`` makes those calls fail with a message instead.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

# Under "vllm." so that vLLM's log handlers and level apply to the plugin too.
logger = logging.getLogger(f"vllm.{__name__}")

#: vLLM attention modules (class names) whose forward is qkv_proj -> (q, k, v) -> attn(q, k, v) -> o_proj, with
#: nothing applied to v or to the attention's output in between (checked in vLLM 0.32's llama.py, mistral.py,
#: qwen2.py, qwen3.py). Others may gate or normalise one of them, which a fold would break.
FOLDABLE_ATTENTION_CLASSES: frozenset[str] = frozenset(
    {"LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention"})
#: Marks a model whose layers were folded (the set of folded layer names).
FOLDED_LAYERS_ATTRIBUTE = "_oscar_folded_layers"


def fold_value_rows(weight: torch.Tensor, bias: Optional[torch.Tensor], v_offset: int,
                    v_rotation: torch.Tensor) -> None:
    """In place: rows [v_offset, v_offset + Hkv * D) of ``weight`` (a qkv projection [rows, hidden], KV head h's
    W_v in rows v_offset + h * D ...) become R_V[h]^T @ W_v[h]; ``bias`` [rows] (or None) the same rows @ R_V[h].

    v_rotation: [Hkv, D, D] (any float dtype); math in float32, written back in the weight's dtype.
    """
    hkv, dim, _ = v_rotation.shape
    rotation = v_rotation.to(device=weight.device, dtype=torch.float32)
    rows = weight.data[v_offset:v_offset + hkv * dim]
    folded = torch.einsum("hde,hdn->hen", rotation, rows.float().view(hkv, dim, -1))
    rows.copy_(folded.reshape(hkv * dim, -1))
    if bias is not None:
        bias_rows = bias.data[v_offset:v_offset + hkv * dim]
        bias_rows.copy_(torch.einsum("hd,hde->he", bias_rows.float().view(hkv, dim), rotation).reshape(-1))


def fold_output_columns(weight: torch.Tensor, v_rotation: torch.Tensor, num_heads: int) -> None:
    """In place: the columns of query head j of an output projection ``weight`` [hidden, num_heads * D] become
    W_o[:, j] @ R_V[j // (num_heads / Hkv)] (the query heads of a KV head are consecutive, as in vLLM)."""
    hkv, dim, _ = v_rotation.shape
    if weight.shape[1] != num_heads * dim or num_heads % hkv:
        raise ValueError(f"an output projection of {num_heads} heads of {dim} over {hkv} KV heads must be "
                         f"[hidden, {num_heads * dim}]; got {tuple(weight.shape)}.")
    per_head = v_rotation.to(device=weight.device, dtype=torch.float32).repeat_interleave(num_heads // hkv, dim=0)
    columns = weight.data.float().view(weight.shape[0], num_heads, dim)
    weight.data.copy_(torch.einsum("njd,jde->nje", columns, per_head).reshape(weight.shape))


def fold_blocker(parent: torch.nn.Module, impl: Any, lora: bool) -> Optional[str]:
    """Why the attention module ``parent`` (holding qkv_proj, attn, o_proj) cannot take the fold; None if it can."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, UnquantizedLinearMethod

    name = type(parent).__name__
    if name not in FOLDABLE_ATTENTION_CLASSES:
        return f"{name} is not one of the attention modules known to pass v and the output through unchanged"
    if lora:
        return "LoRA adapters add to W_v and W_o in the unrotated basis"
    qkv, out = getattr(parent, "qkv_proj", None), getattr(parent, "o_proj", None)
    if not isinstance(qkv, QKVParallelLinear) or not isinstance(out, RowParallelLinear):
        return "its projections are not vLLM's QKVParallelLinear / RowParallelLinear"
    for label, proj in (("qkv_proj", qkv), ("o_proj", out)):
        if not isinstance(getattr(proj, "quant_method", None), UnquantizedLinearMethod):
            return f"{label} is quantized ({type(getattr(proj, 'quant_method', None)).__name__})"
        weight = getattr(proj, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            return f"{label} has no plain floating-point weight matrix"
    if (qkv.num_heads, qkv.num_kv_heads, qkv.head_size, qkv.v_head_size) != (
            impl.num_heads, impl.num_kv_heads, impl.head_size, impl.head_size):
        return (f"qkv_proj holds {qkv.num_heads} / {qkv.num_kv_heads} heads of {qkv.head_size} / {qkv.v_head_size} "
                f"on this rank, the attention {impl.num_heads} / {impl.num_kv_heads} of {impl.head_size}")
    return None


def fold_value_rotations(model: torch.nn.Module, act_dtype: torch.dtype, mode: str, lora: bool) -> dict[str, str]:
    """Fold R_V into W_o (mode "output") or W_v and W_o ("value_and_output") of every OSCAR layer of ``model``
    that can take it (module docstring); mode "none" folds nothing. ``mode`` is one of config.FOLD_MODES, as
    OscarConfig.fold_rotations checks.

    Loads each layer's rotations first (the impl's process_weights_after_loading; idempotent) and marks the
    folded ones (LayerRotations.output_rotated, value_prerotated). Returns {attention layer name: why it was not
    folded} for the OSCAR layers left unfolded; logs a summary once per call.
    """
    from vllm_oscar.attention.backend import OscarAttentionImpl

    kept: dict[str, str] = {}
    folded: set[str] = set()
    for parent_name, parent in model.named_modules():
        attn = getattr(parent, "attn", None)
        impl = getattr(attn, "impl", None)
        if not isinstance(impl, OscarAttentionImpl):
            continue
        layer = f"{parent_name}.attn"
        reason = "the option fold_rotations is \"none\"" if mode == "none" else fold_blocker(parent, impl, lora)
        if reason is not None:
            kept[layer] = reason
            continue
        impl.process_weights_after_loading(act_dtype)
        if impl.rotations.output_rotated:  # a second load of the same model object: already folded
            folded.add(layer)
            continue
        fold_output_columns(parent.o_proj.weight, impl.rotations.v_rotation, impl.num_heads)
        value = mode == "value_and_output"
        if value:
            qkv = parent.qkv_proj
            fold_value_rows(qkv.weight, getattr(qkv, "bias", None),
                            (qkv.num_heads + qkv.num_kv_heads) * qkv.head_size, impl.rotations.v_rotation)
        impl.rotations = dataclasses.replace(impl.rotations, output_rotated=True, value_prerotated=value)
        folded.add(layer)
    if folded:
        setattr(model, FOLDED_LAYERS_ATTRIBUTE, frozenset(folded) | folded_layers(model))
        guard_weight_reloads(model)
        logger.info("OSCAR: R_V folded into %s of %d attention layers (no output rotation per step).",
                    "W_v and W_o" if mode == "value_and_output" else "W_o", len(folded))
    for reason in sorted(set(kept.values())):
        layers = sorted(name for name, why in kept.items() if why == reason)
        logger.info("OSCAR: R_V not folded in %d layers (%s, ...): %s; they un-rotate the attention output "
                    "(one launch more per layer step).", len(layers), layers[0], reason)
    return kept


def folded_layers(model: torch.nn.Module) -> frozenset[str]:
    """Names of the attention layers of ``model`` whose R_V is in its weights (empty if none)."""
    return getattr(model, FOLDED_LAYERS_ATTRIBUTE, frozenset())


def reload_refusal(model: torch.nn.Module) -> str:
    """The error for reloading weights into a model with folded layers."""
    return (f"OSCAR folded R_V into the weights (W_o, and W_v under fold_rotations \"value_and_output\") of "
            f"{len(folded_layers(model))} attention layers when the model was loaded; weights reloaded in place "
            "would reach those layers unrotated and give wrong outputs. Start the "
            "engine with additional_config={\"oscar\": {\"fold_rotations\": \"none\"}} to reload or update weights "
            "in place.")


def guard_weight_reloads(model: torch.nn.Module) -> None:
    """Make in-place weight reloads of ``model`` fail with reload_refusal: its ``load_weights`` (checkpoint-format
    reloads and weight transfers call it) and vLLM's GPUModelRunner.reload_weights (also kernel-format reloads)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_oscar.attention.patching import wrap_once

    def refusing(load_weights):
        def refuse_load_weights(*args, **kwargs):
            raise RuntimeError(reload_refusal(model))

        return refuse_load_weights

    def unless_folded(reload_weights):
        def reload_unless_folded(self, *args, **kwargs):
            if folded_layers(self.get_model()):
                raise RuntimeError(reload_refusal(self.get_model()))
            return reload_weights(self, *args, **kwargs)

        return reload_unless_folded

    wrap_once(model, "load_weights", refusing)
    wrap_once(GPUModelRunner, "reload_weights", unless_folded)
