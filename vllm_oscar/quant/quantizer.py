"""Reference INT2 quantizer: row clipping, asymmetric uniform and Lloyd-Max levels.

A "row" is one (token, KV head) vector of D channels after rotation. It is split into
D / G groups of G consecutive channels; each group has its own (scale, offset):

    code = clamp(round((x - offset) / scale), 0, 3)        x^ = code * scale + offset

This is method.md's asymmetric quantizer written with ``offset = min`` instead of the
zero point ``z = -min / scale`` (the two are the same grid: ``z = -offset / scale``).
Storing the offset in value units keeps its fp16 rounding error relative to the data,
and the decode kernel uses it directly: ``q . k^ = scale * (q . codes) + offset * sum(q)``.

Codes are computed from the scale and offset *after* rounding them to their storage
dtype, so dequantization with the stored values is exactly what a kernel reproduces.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_oscar.config import (
    LLOYD_MAX_BOUNDARY,
    NUM_LEVELS,
    SCALE_EPS,
    check_clip_ratio,
    check_group_size,
    check_scale_dtype,
)

_COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_rows(name: str, rows: torch.Tensor) -> None:
    """Raise ValueError unless ``rows`` is a finite floating tensor with >= 1 dimension."""
    if not isinstance(rows, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(rows).__name__}.")
    if rows.dtype not in _COMPUTE_DTYPES:
        allowed = ", ".join(str(d) for d in _COMPUTE_DTYPES)
        raise ValueError(f"{name} has dtype {rows.dtype}; allowed: {allowed}.")
    if rows.dim() < 1:
        raise ValueError(f"{name} must have shape [..., D]; got a scalar.")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{name} contains NaN or Inf values; cannot quantize it.")


def _working_dtype(rows: torch.Tensor) -> torch.dtype:
    return torch.float64 if rows.dtype == torch.float64 else torch.float32


def clip_threshold_index(dim: int, ratio: float) -> int:
    """0-based rank (ascending) of |x| used as the clip threshold: ceil(ratio * (dim - 1)).

    Same order statistic as ``torch.quantile(..., interpolation="higher")``: at least
    ``ratio`` of the channels are <= the threshold and stay unchanged.
    """
    check_clip_ratio("ratio", ratio)
    scaled = ratio * (dim - 1)
    index = int(scaled)
    return index if index == scaled else index + 1


def clip_rows(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row to [-tau, tau], tau = the ``ratio``-quantile of |row|.

    Args:
        rows: [..., D] float tensor (one row per token and head).
        ratio: in (0, 1]; 1.0 returns the rows unchanged.
    Returns:
        [..., D] tensor, same dtype.
    """
    check_rows("rows", rows)
    check_clip_ratio("ratio", ratio)
    if ratio == 1.0:
        return rows
    index = clip_threshold_index(rows.shape[-1], ratio)
    tau = rows.abs().sort(dim=-1).values[..., index : index + 1]
    return torch.maximum(torch.minimum(rows, tau), -tau)


@dataclasses.dataclass
class QuantizedRows:
    """INT2 form of [..., D] rows.

    Attributes:
        codes: [..., D] uint8 in {0, 1, 2, 3} (unpacked; see quant.packing).
        scale: [..., D // G] in the storage dtype.
        offset: [..., D // G] in the storage dtype (the value of code 0).
        group_size: G.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group_size: int


def _grouped(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    dim = rows.shape[-1]
    check_group_size(dim, group_size)
    return rows.reshape(*rows.shape[:-1], dim // group_size, group_size)


def _codes_for(grouped: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    levels = torch.round((grouped - offset[..., None]) / scale[..., None])
    return levels.clamp_(0, NUM_LEVELS - 1).to(torch.uint8)


def quantize(
    rows: torch.Tensor,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    lloyd_max: bool = False,
) -> QuantizedRows:
    """Quantize rows to INT2 per group of ``group_size`` channels.

    Uniform (default): scale = max(max - min, eps) / 3, offset = min: the grid spans the
    group's range. Lloyd-Max: the 4 levels of a Gaussian with the group's mean mu and
    standard deviation sigma, spaced LLOYD_MAX_BOUNDARY * sigma apart, so the decision
    boundaries fall at mu - b sigma, mu, mu + b sigma (b = 0.9811); it is the same
    (scale, offset) form, so the decode path does not change.

    Args:
        rows: [..., D] float tensor (already rotated and clipped).
        group_size: G, must divide D and be a multiple of 4.
        scale_dtype: float16, bfloat16 or float32.
        lloyd_max: use Gaussian Lloyd-Max levels instead of the min/max grid.
    """
    check_rows("rows", rows)
    check_scale_dtype(scale_dtype)
    work = _working_dtype(rows)
    grouped = _grouped(rows.to(work), group_size)
    if lloyd_max:
        mean = grouped.mean(dim=-1)
        std = grouped.std(dim=-1, correction=0)
        scale = torch.clamp(LLOYD_MAX_BOUNDARY * std, min=SCALE_EPS)
        offset = mean - 0.5 * (NUM_LEVELS - 1) * scale
    else:
        low = grouped.amin(dim=-1)
        high = grouped.amax(dim=-1)
        scale = torch.clamp(high - low, min=SCALE_EPS) / (NUM_LEVELS - 1)
        offset = low
    scale = scale.to(scale_dtype)
    offset = offset.to(scale_dtype)
    codes = _codes_for(grouped, scale.to(work), offset.to(work))
    return QuantizedRows(codes.reshape(rows.shape), scale, offset, group_size)


def dequantize(quantized: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D] values code * scale + offset in ``dtype``."""
    grouped_codes = _grouped(quantized.codes, quantized.group_size).to(dtype)
    values = grouped_codes * quantized.scale.to(dtype)[..., None] + quantized.offset.to(dtype)[..., None]
    return values.reshape(quantized.codes.shape)


def fake_quantize(
    rows: torch.Tensor,
    clip_ratio: float,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    lloyd_max: bool = False,
) -> torch.Tensor:
    """clip -> quantize -> dequantize, in the dtype of ``rows`` (for evaluation and tests)."""
    quantized = quantize(clip_rows(rows, clip_ratio), group_size, scale_dtype, lloyd_max)
    return dequantize(quantized, _working_dtype(rows)).to(rows.dtype)
