"""Packing of 2-bit codes, 4 per byte, in the "strided planes" layout.

For a row of D codes c[0..D), byte j (0 <= j < D/4) holds four codes a quarter row apart:

    byte[j] = c[j] | c[j + D/4] << 2 | c[j + D/2] << 4 | c[j + 3D/4] << 6

Why this layout: a kernel loads the D/4 bytes of a row as one contiguous vector and gets
plane p (channels [p D/4, (p+1) D/4)) with one shift and one mask, ``(byte >> 2p) & 3``.
Each plane is a contiguous slice of channels, so the dot with the rotated query is four
ordinary dots against four contiguous query slices (tl.dot-friendly, no interleave or
gather), and the weighted value sum writes four contiguous output slices. An interleaved
layout (c[4j..4j+3] in one byte) would instead need a reshape/transposition per tile.
"""

from __future__ import annotations

import torch

from vllm_oscar.config import CODE_BITS, CODES_PER_BYTE, NUM_LEVELS

_CODE_MASK = NUM_LEVELS - 1


def _check_codes_dim(dim: int) -> int:
    if dim % CODES_PER_BYTE != 0:
        raise ValueError(
            f"the last dimension ({dim}) must be a multiple of {CODES_PER_BYTE} to pack "
            f"{CODES_PER_BYTE} codes per byte."
        )
    return dim // CODES_PER_BYTE


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] uint8 codes in {0..3} -> [..., D/4] uint8 bytes (strided planes)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8; got {codes.dtype}.")
    if bool((codes > _CODE_MASK).any()):
        raise ValueError(f"codes must lie in [0, {_CODE_MASK}] to fit {CODE_BITS} bits.")
    quarter = _check_codes_dim(codes.shape[-1])
    planes = codes.reshape(*codes.shape[:-1], CODES_PER_BYTE, quarter)
    packed = torch.zeros(planes.shape[:-2] + (quarter,), dtype=torch.uint8, device=codes.device)
    for plane in range(CODES_PER_BYTE):
        packed |= planes[..., plane, :] << (CODE_BITS * plane)
    return packed


def code_plane(packed: torch.Tensor, plane: int) -> torch.Tensor:
    """[..., D/4] uint8 bytes -> [..., D/4] uint8 codes of channels [plane D/4, (plane + 1) D/4)."""
    return (packed >> (CODE_BITS * plane)) & _CODE_MASK


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/4] uint8 bytes -> [..., D] uint8 codes (inverse of pack_codes)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8; got {packed.dtype}.")
    return torch.cat([code_plane(packed, plane) for plane in range(CODES_PER_BYTE)], dim=-1)
