"""Bits-per-element accounting (docs/method.md section 3), windows included.

Body (INT2 history): CODE_BITS per element plus a scale and an offset per group of G:
    body_bits = 2 + 2 * scale_bits / G        (2.25 for G=128 fp16, 2.5 for G=64 fp16)
Whole sequence of L tokens with W = sink + recent BF16 tokens:
    bpe(L) = (body_bits * (L - W) + 16 * W) / L    for L > W, and 16 when L <= W.
"""

from __future__ import annotations

import torch

from vllm_oscar.config import (
    CODE_BITS,
    CODES_PER_BYTE,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    SCALE_DTYPE_BITS,
    WINDOW_BITS,
    check_group_size,
    check_head_dim,
    check_scale_dtype,
)


def body_bits_per_element(group_size: int, scale_dtype: torch.dtype = torch.float16) -> float:
    """Bits per element of the INT2 body: codes plus one scale and one offset per group."""
    check_scale_dtype(scale_dtype)
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size={group_size!r} must be a positive integer.")
    return CODE_BITS + 2 * SCALE_DTYPE_BITS[scale_dtype] / group_size


def bits_per_element(
    context_len: int,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    recent_tokens: int = DEFAULT_RECENT_TOKENS,
) -> float:
    """Average bits per K/V element of a sequence of ``context_len`` tokens."""
    if not isinstance(context_len, int) or context_len <= 0:
        raise ValueError(f"context_len={context_len!r} must be a positive integer.")
    windows = sink_tokens + recent_tokens
    if context_len <= windows:
        return float(WINDOW_BITS)
    body = body_bits_per_element(group_size, scale_dtype)
    return (body * (context_len - windows) + WINDOW_BITS * windows) / context_len


def row_bytes(head_dim: int, group_size: int, scale_dtype: torch.dtype = torch.float16) -> int:
    """Bytes of one quantized row (one token, one head, K or V): codes + scale + offset."""
    check_head_dim(head_dim)
    check_group_size(head_dim, group_size)
    check_scale_dtype(scale_dtype)
    scale_bytes = SCALE_DTYPE_BITS[scale_dtype] // 8
    return head_dim // CODES_PER_BYTE + 2 * (head_dim // group_size) * scale_bytes
