"""Least-squares (scale, offset) refit for the evaluation harness: quantize-dequantize.

The math is the product's write quantizer (vllm_oscar.quant.quantize_rows with
``refit_iterations``; see quant.quantizer.refit_grid): start from the clipped min/max
grid, alternate least-squares fits of (scale, offset) and code assignments against the
UNCLIPPED values, keep per group the iterate with the smallest error (scale and offset
rounded to their storage dtype, as the cache stores them). This module only turns the
stored form back into values.
"""

from __future__ import annotations

import torch

from vllm_oscar.quant import dequantize, quantize_rows


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
    quantized = quantize_rows(rows.float(), clip_ratio, group_size, scale_dtype, iterations)
    return dequantize(quantized, torch.float32)
