"""Normalised Sylvester Hadamard matrix, fast Walsh-Hadamard transform, bit reversal.

All functions work on CPU and CUDA tensors in float32 or float64.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from vllm_oscar.config import is_power_of_two


def _check_power_of_two(name: str, value: int) -> None:
    if not is_power_of_two(value):
        raise ValueError(
            f"{name}={value!r} must be a power of two (1, 2, 4, ..., 64, 128, 256) for a "
            "Sylvester Hadamard matrix."
        )


def hadamard_matrix(
    dim: int, dtype: torch.dtype = torch.float64, device: Optional[torch.device | str] = None
) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix H of size [dim, dim].

    H[i, j] = (-1) ** popcount(i & j) / sqrt(dim); H is symmetric and orthogonal
    (H @ H = I). ``dim`` must be a power of two.
    """
    _check_power_of_two("dim", dim)
    index = torch.arange(dim, device=device)
    overlap = index[:, None] & index[None, :]
    parity = torch.zeros_like(overlap)
    bits = overlap.clone()
    while bool(bits.any()):
        parity ^= bits & 1
        bits >>= 1
    signs = 1.0 - 2.0 * parity.to(dtype)
    return signs / math.sqrt(dim)


def fast_hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H along the last dimension, in O(D log D), without forming H.

    Args:
        x: [..., D] float tensor, D a power of two.
    Returns:
        [..., D] tensor of the same dtype equal to ``x @ hadamard_matrix(D)``.
    """
    dim = x.shape[-1]
    _check_power_of_two("x.shape[-1]", dim)
    lead = x.shape[:-1]
    out = x.reshape(-1, dim)
    half = 1
    while half < dim:
        pairs = out.reshape(-1, dim // (2 * half), 2, half)
        low, high = pairs[:, :, 0, :], pairs[:, :, 1, :]
        out = torch.stack((low + high, low - high), dim=2).reshape(-1, dim)
        half *= 2
    return (out / math.sqrt(dim)).reshape(*lead, dim)


def bit_reversal_permutation(dim: int, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Index vector p of length ``dim`` with p[i] = i with its log2(dim) bits reversed.

    Bit reversal is an involution (p[p] = arange). For dim = 8: [0, 4, 2, 6, 1, 5, 3, 7].
    Placing importance rank r in channel p[r] gives every block of G consecutive
    channels (G a power of two) exactly one rank from each of the G importance tiers
    [0, dim/G), [dim/G, 2 dim/G), ...
    """
    _check_power_of_two("dim", dim)
    width = dim.bit_length() - 1
    index = torch.arange(dim, device=device)
    reversed_index = torch.zeros_like(index)
    for bit in range(width):
        reversed_index |= ((index >> bit) & 1) << (width - 1 - bit)
    return reversed_index
