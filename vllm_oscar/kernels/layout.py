"""The paged INT2 KV block layout shared by the kernels and the vLLM backend.

One layer's INT2 cache is a uint8 tensor ``[num_blocks, num_kv_heads, head_region_bytes]``.
Within a block, each KV head owns one contiguous region of ``block_size`` tokens, made of
six planes, each contiguous and token-major (byte offsets for block_size = B, D = head_dim,
n = D / G groups per row, s = bytes of one scale/offset entry (2 for fp16/bf16, 4 for fp32)):

    plane        offset                    shape          dtype
    k_codes      0                         [B, D/4]       uint8 (4 codes/byte, quant.packing)
    v_codes      B*D/4                     [B, D/4]       uint8
    k_scale      2*B*D/4                   [B, n]         scale dtype
    k_offset     2*B*D/4 + B*n*s           [B, n]         scale dtype
    v_scale      2*B*D/4 + 2*B*n*s         [B, n]         scale dtype
    v_offset     2*B*D/4 + 3*B*n*s         [B, n]         scale dtype
    total        head_region_bytes = B * (D/2 + 4*n*s)

Example, D = 128, G = 128, fp16, B = 16: codes 32 B per row, 72 B per (token, head) for
K+V, 1152 B per (block, head). BF16 K+V for the same token and head: 512 B (7.1x more).

Why planes and not one interleaved record per token: a decode program reads the K codes
of a tile of consecutive tokens of one head as one contiguous run of bytes (fully
coalesced, vectorised loads), then their scales/offsets as another run; V likewise. Every
plane offset is a multiple of 4 bytes, so the scale planes can be read as fp16/fp32.

Dequantised row: ``code * scale + offset`` per group (quant.quantizer). Codes are the
quantized *rotated* K (x @ R_K) and V (x @ R_V) rows.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_oscar.config import (
    CODES_PER_BYTE,
    SCALE_DTYPE_BITS,
    check_group_size,
    check_head_dim,
    check_scale_dtype,
)

#: Plane names in storage order.
PLANES: tuple[str, ...] = ("k_codes", "v_codes", "k_scale", "k_offset", "v_scale", "v_offset")


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """Geometry of one (block, KV head) region of the INT2 cache."""

    head_dim: int
    group_size: int
    block_size: int
    scale_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        check_head_dim(self.head_dim)
        check_group_size(self.head_dim, self.group_size)
        check_scale_dtype(self.scale_dtype)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size!r} must be a positive integer.")

    @property
    def code_bytes(self) -> int:
        """Bytes of packed codes of one row (one token, one head, K or V)."""
        return self.head_dim // CODES_PER_BYTE

    @property
    def groups(self) -> int:
        """Scale/offset groups per row."""
        return self.head_dim // self.group_size

    @property
    def param_bytes(self) -> int:
        """Bytes of one scale (or offset) entry."""
        return SCALE_DTYPE_BITS[self.scale_dtype] // 8

    @property
    def token_bytes(self) -> int:
        """Bytes per (token, KV head) for K and V together: codes + scales + offsets."""
        return 2 * self.code_bytes + 4 * self.groups * self.param_bytes

    @property
    def head_region_bytes(self) -> int:
        """Bytes of one (block, KV head) region."""
        return self.block_size * self.token_bytes

    def plane_offset(self, plane: str) -> int:
        """Byte offset of a plane inside a (block, head) region."""
        codes = self.block_size * self.code_bytes
        params = self.block_size * self.groups * self.param_bytes
        offsets = {
            "k_codes": 0,
            "v_codes": codes,
            "k_scale": 2 * codes,
            "k_offset": 2 * codes + params,
            "v_scale": 2 * codes + 2 * params,
            "v_offset": 2 * codes + 3 * params,
        }
        if plane not in offsets:
            raise ValueError(f"unknown plane {plane!r}; planes: {', '.join(PLANES)}.")
        return offsets[plane]

    def cache_shape(self, num_blocks: int, num_kv_heads: int) -> tuple[int, int, int]:
        """Shape of one layer's INT2 cache tensor (dtype uint8)."""
        return (num_blocks, num_kv_heads, self.head_region_bytes)

    def allocate(self, num_blocks: int, num_kv_heads: int, device=None) -> torch.Tensor:
        """A zeroed INT2 cache tensor for one layer."""
        return torch.zeros(self.cache_shape(num_blocks, num_kv_heads), dtype=torch.uint8, device=device)


@dataclasses.dataclass
class PageViews:
    """Typed views of the six planes of a cache; each is [num_blocks, num_kv_heads, B, last]."""

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    k_scale: torch.Tensor
    k_offset: torch.Tensor
    v_scale: torch.Tensor
    v_offset: torch.Tensor


def page_views(cache: torch.Tensor, layout: PageLayout) -> PageViews:
    """Views (no copy) of the planes of ``cache`` [num_blocks, num_kv_heads, head_region_bytes]."""
    if cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[2] != layout.head_region_bytes:
        raise ValueError(
            f"cache must be uint8 [num_blocks, num_kv_heads, {layout.head_region_bytes}] for {layout}; "
            f"got {cache.dtype} {tuple(cache.shape)}."
        )
    num_blocks, num_heads, _ = cache.shape
    block = layout.block_size

    def plane(name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
        start = layout.plane_offset(name)
        item = torch.empty((), dtype=dtype).element_size()
        raw = cache[:, :, start : start + block * width * item]
        return raw.view(dtype).view(num_blocks, num_heads, block, width)

    codes, groups, param = layout.code_bytes, layout.groups, layout.scale_dtype
    return PageViews(
        k_codes=plane("k_codes", codes, torch.uint8),
        v_codes=plane("v_codes", codes, torch.uint8),
        k_scale=plane("k_scale", groups, param),
        k_offset=plane("k_offset", groups, param),
        v_scale=plane("v_scale", groups, param),
        v_offset=plane("v_offset", groups, param),
    )
