"""Exact decode-time semantics of a quantized KV cache in one forward pass.

During decode, the query of token t reads key/value s (s <= t) in BF16 when s is in the
sink or in t's recent window, and the quantized reconstruction otherwise (the method's
``exact_mask``). A forward pass over a whole sequence reproduces this exactly with a
masked mixture: per (t, s) the logit is q_t.k_s or q_t.k^_s, one softmax over both, and
the output sums p_ts v_s over exact pairs plus p_ts v^_s over quantized ones.

It is installed as a transformers attention implementation ("oscar_eval"), so any
Hugging Face decoder whose attention calls ``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen,
Mistral, ...) runs under it unchanged. It works both for a whole sequence (prefill)
and with a KV cache (``generate``): query positions are the last Tq of the Tk keys.
Inputs must be unpadded (no attention mask): the harness builds the causal mask itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from vllm_oscar.config import EVAL_QUERY_CHUNK
from vllm_oscar.evaluation.methods import KVMethod

#: Query positions per fused attention call of a quantized layer: small enough that the
#: causal truncation saves most of the keys a chunk does not see, large enough to amortise
#: the exact-window copies (256: 2048-token prefill ~2x faster than 1024 on CPU).
SDPA_QUERY_CHUNK = 256

#: Name of the attention implementation registered with transformers.
ATTENTION_NAME = "oscar_eval"


@dataclasses.dataclass
class HarnessState:
    """What the attention function applies: a method and its BF16 windows."""

    method: KVMethod
    sink: int
    recent: int
    num_layers: int
    #: (positions key, per-chunk masks) of the last quantized layer (see _chunk_masks).
    masks: Optional[tuple] = None


_STATE: Optional[HarnessState] = None


def _chunk_masks(state: "HarnessState", q_len: int, kv_len: int, device: torch.device) -> list:
    """Per query chunk of a quantized layer: (start, stop, seen, exact columns, additive mask).

    The mask [chunk, exact columns + seen] is 0 where the pair is read (first the exact
    copies, then the reconstructions 0..seen-1) and -inf elsewhere. It depends only on
    positions and windows, so one list serves every layer of a forward pass (cached in
    ``state`` for the last (q_len, kv_len))."""
    key = (q_len, kv_len, str(device))
    if state.masks is not None and state.masks[0] == key:
        return state.masks[1]
    chunks = []
    for start in range(0, q_len, SDPA_QUERY_CHUNK):
        stop = min(q_len, start + SDPA_QUERY_CHUNK)
        query_pos = torch.arange(kv_len - q_len + start, kv_len - q_len + stop, device=device)
        seen = int(query_pos[-1]) + 1
        key_pos = torch.arange(seen, device=device)
        causal = key_pos[None, :] <= query_pos[:, None]
        exact = state.method.exact_mask(query_pos, key_pos, state.sink, state.recent) & causal
        columns = exact.any(dim=0).nonzero().squeeze(1)
        read = torch.cat((exact[:, columns], causal & ~exact), dim=1)
        mask = torch.zeros(read.shape, device=device).masked_fill_(~read, float("-inf"))
        chunks.append((start, stop, seen, columns, mask))
    state.masks = (key, chunks)
    return chunks


def mixed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    state: HarnessState,
    layer: int,
) -> torch.Tensor:
    """Causal attention reading BF16 or quantized K/V per (query, key) pair.

    Each key is quantized once per call (the whole sequence, one layer). Per chunk of
    SDPA_QUERY_CHUNK queries one softmax runs over the exact copies of the few keys some
    query of the chunk reads in BF16 (sink and recent window: ``method.exact_mask``) and
    the reconstructions of every key up to the chunk's last position; an additive mask
    picks, per (query, key) pair, exactly one of the two copies (exact pairs read the BF16
    row, other causal pairs the reconstruction). That is the masked mixture of the module
    docstring (mixed_attention_reference computes it densely, same result up to float
    summation order), in one fused scaled_dot_product_attention per chunk, without the
    keys no query of the chunk sees.

    Args:
        query: [B, Hq, Tq, D] post-RoPE queries (the last Tq positions).
        key, value: [B, Hkv, Tk, D] post-RoPE keys and values, positions 0..Tk-1.
        scaling: logit scale (1/sqrt(D) for most models).
    Returns:
        [B, Tq, Hq, D] attention output in the dtype of ``query`` (computed in float32).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    method = state.method
    q = query.float()
    exact_k, exact_v = key.float(), value.float()
    if method.is_exact or not method.quantizes_layer(layer, state.num_layers):
        if q_len == kv_len:
            out = F.scaled_dot_product_attention(q, exact_k, exact_v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            causal = (torch.arange(kv_len, device=q.device)[None, :]
                      <= torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None])
            out = F.scaled_dot_product_attention(q, exact_k, exact_v, attn_mask=causal, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).to(query.dtype).contiguous()
    chunks = _chunk_masks(state, q_len, kv_len, query.device)
    width = max(len(columns) for _, _, _, columns, _ in chunks)
    batch, heads, _, dim = key.shape
    # [exact copies (right-aligned in the first `width` slots) | reconstructions 0..Tk-1]
    keys = torch.empty(batch, heads, width + kv_len, dim, device=key.device)
    values = torch.empty_like(keys)
    keys[:, :, width:] = method.quantize_keys(key, layer)
    values[:, :, width:] = method.quantize_values(value, layer)
    outputs = []
    for start, stop, seen, columns, mask in chunks:
        first = width - len(columns)
        keys[:, :, first:width] = exact_k[:, :, columns]
        values[:, :, first:width] = exact_v[:, :, columns]
        outputs.append(F.scaled_dot_product_attention(
            q[:, :, start:stop], keys[:, :, first : width + seen], values[:, :, first : width + seen],
            attn_mask=mask, scale=scaling, enable_gqa=gqa,
        ))
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2).to(query.dtype).contiguous()


def mixed_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    state: HarnessState,
    layer: int,
) -> torch.Tensor:
    """Dense reference of mixed_attention (every (query, key) logit twice, masked
    einsums; the harness before issue 6). Kept for tests: same semantics, ~5x slower.

    Args:
        query: [B, Hq, Tq, D] post-RoPE queries (the last Tq positions).
        key, value: [B, Hkv, Tk, D] post-RoPE keys and values, positions 0..Tk-1.
        scaling: logit scale (1/sqrt(D) for most models).
    Returns:
        [B, Tq, Hq, D] attention output in the dtype of ``query`` (computed in float32).
    """
    batch, num_q_heads, q_len, dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_q_heads // num_kv_heads
    method = state.method
    quantized = not method.is_exact and method.quantizes_layer(layer, state.num_layers)
    exact_k, exact_v = key.float(), value.float()
    if quantized:
        quant_k = method.quantize_keys(key, layer)
        quant_v = method.quantize_values(value, layer)
    q = query.float().reshape(batch, num_kv_heads, group, q_len, dim)
    key_pos = torch.arange(kv_len, device=query.device)
    output = torch.empty(batch, num_kv_heads, group, q_len, dim, device=query.device, dtype=torch.float32)
    for start in range(0, q_len, EVAL_QUERY_CHUNK):
        stop = min(q_len, start + EVAL_QUERY_CHUNK)
        query_pos = torch.arange(kv_len - q_len + start, kv_len - q_len + stop, device=query.device)
        causal = key_pos[None, :] <= query_pos[:, None]
        chunk = q[:, :, :, start:stop]
        logits = torch.einsum("bhgtd,bhsd->bhgts", chunk, exact_k) * scaling
        if quantized:
            exact = method.exact_mask(query_pos, key_pos, state.sink, state.recent) & causal
            quant_logits = torch.einsum("bhgtd,bhsd->bhgts", chunk, quant_k) * scaling
            logits = torch.where(exact, logits, quant_logits)
        logits = logits.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if quantized:
            out = torch.einsum("bhgts,bhsd->bhgtd", probs * exact, exact_v)
            out += torch.einsum("bhgts,bhsd->bhgtd", probs * (causal & ~exact), quant_v)
        else:
            out = torch.einsum("bhgts,bhsd->bhgtd", probs, exact_v)
        output[:, :, :, start:stop] = out
    output = output.reshape(batch, num_q_heads, q_len, dim).transpose(1, 2)
    return output.to(query.dtype).contiguous()


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry point (see module docstring)."""
    if _STATE is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' used outside evaluation.harness.use_method().")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return mixed_attention(query, key, value, scale, _STATE, module.layer_idx), None


def _no_mask(*args, **kwargs) -> None:
    """The harness builds its own causal mask; transformers need not build one."""
    return None


def register() -> None:
    """Register the "oscar_eval" attention (and its mask hook) with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


@contextlib.contextmanager
def use_method(model, method: KVMethod, sink: int, recent: int) -> Iterator[None]:
    """Run ``model`` (a transformers causal LM) under ``method`` inside the block.

    Switches the model to the "oscar_eval" attention and back to its previous one.
    """
    global _STATE
    register()
    previous = model.config._attn_implementation
    _STATE = HarnessState(method, sink, recent, model.config.num_hidden_layers)
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        _STATE = None
        model.set_attn_implementation(previous)


@torch.no_grad()
def method_logits(
    model, input_ids: torch.Tensor, method: KVMethod, sink: int, recent: int, keep: int = 0
) -> torch.Tensor:
    """[B, T, vocab] float32 logits of ``input_ids`` [B, T] under ``method``
    ([B, keep, vocab] of the last ``keep`` positions when keep > 0: the LM head then runs
    only there)."""
    with use_method(model, method, sink, recent):
        return model(input_ids, use_cache=False, logits_to_keep=keep).logits.float()
