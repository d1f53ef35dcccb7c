"""Least-squares (scale, offset) refit: the best uniform 4-level grid per group, same bits.

The min/max grid (optionally after clipping) spends its 4 levels on the group's range;
for bell-shaped rotated rows the MSE-optimal uniform grid is narrower. Starting from the
clipped min/max grid, alternate (Lloyd's algorithm restricted to uniform grids):

    fit:    (s, o) = argmin sum_i (x_i - s c_i - o)^2   (linear least squares in s, o)
    assign: c_i = clamp(round((x_i - o) / s), 0, 3)

against the UNCLIPPED values, keeping per group the iterate with the smallest error
(with s, o rounded to their storage dtype first, as the cache stores them). The result
is stored exactly like the plain quantizer's (codes, scale, offset), so a decode kernel
does not change; only the write path does a few more passes over the row.
"""

from __future__ import annotations

import torch

from vllm_oscar.config import NUM_LEVELS, SCALE_EPS
from vllm_oscar.quant import clip_rows, quantize


def refit_quantize(
    rows: torch.Tensor, clip_ratio: float, group_size: int, scale_dtype: torch.dtype, iterations: int
) -> torch.Tensor:
    """Quantize-dequantize [..., D] float32 rows with least-squares refitted grids.

    Args:
        rows: [..., D] float32 (already rotated).
        clip_ratio: clip ratio of the initial grid (1.0 = plain min/max).
        group_size: channels per (scale, offset).
        scale_dtype: storage dtype of scale and offset.
        iterations: fit/assign rounds (0 returns the initial grid's reconstruction).
    Returns:
        [..., D] float32 reconstruction.
    """
    shape = rows.shape
    x = rows.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    initial = quantize(clip_rows(rows, clip_ratio), group_size, scale_dtype)
    scale = initial.scale.float()
    offset = initial.offset.float()
    codes = initial.codes.reshape(x.shape).float()
    best = codes * scale[..., None] + offset[..., None]
    best_error = ((x - best) ** 2).sum(dim=-1)
    for _ in range(iterations):
        code_mean = codes.mean(dim=-1, keepdim=True)
        x_mean = x.mean(dim=-1, keepdim=True)
        covariance = ((codes - code_mean) * (x - x_mean)).mean(dim=-1)
        variance = ((codes - code_mean) ** 2).mean(dim=-1)
        fitted = torch.where(variance > 0, covariance / variance.clamp(min=1e-30), scale)
        scale = fitted.clamp(min=SCALE_EPS).to(scale_dtype).float()
        offset = (x_mean[..., 0] - scale * code_mean[..., 0]).to(scale_dtype).float()
        codes = torch.clamp(torch.round((x - offset[..., None]) / scale[..., None]), 0, NUM_LEVELS - 1)
        candidate = codes * scale[..., None] + offset[..., None]
        error = ((x - candidate) ** 2).sum(dim=-1)
        better = error < best_error
        best = torch.where(better[..., None], candidate, best)
        best_error = torch.where(better, error, best_error)
    return best.reshape(shape)
