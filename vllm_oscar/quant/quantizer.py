"""Reference INT2 quantizer: row clipping, asymmetric uniform and Lloyd-Max levels.

A "row" is one (token, KV head) vector of D channels after rotation. It is split into
D / G groups of G consecutive channels; each group has its own (scale, offset):

    code = clamp(round((x - offset) / scale), 0, 3)        x^ = code * scale + offset

This is docs/method.md's asymmetric quantizer written with ``offset = min`` instead of the
zero point ``z = -min / scale`` (the two are the same grid: ``z = -offset / scale``).
Storing the offset in value units keeps its fp16 rounding error relative to the data,
and the decode kernel uses it directly: ``q . k^ = scale * (q . codes) + offset * sum(q)``.

Codes are computed from the scale and offset *after* rounding them to their storage
dtype, so dequantization with the stored values is exactly what a kernel reproduces.

The write path's quantizer (``quantize_rows``) is: clip -> min/max grid -> optional
least-squares refit (``refit_grid``) of each group's (scale, offset) against the
UNCLIPPED values. The refit returns the same (codes, scale, offset) form, so storage and
decode do not change.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_oscar.config import (
    LLOYD_MAX_BOUNDARY,
    NUM_LEVELS,
    REFIT_COMPACT_MIN_VALUES,
    SCALE_EPS,
    check_clip_ratio,
    check_group_size,
    check_refit_iterations,
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
    return _clip(rows, ratio)


def _clip(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """clip_rows without the argument checks (callers have checked)."""
    if ratio == 1.0:
        return rows
    index = clip_threshold_index(rows.shape[-1], ratio)
    tau = rows.abs().kthvalue(index + 1, dim=-1, keepdim=True).values
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


def _levels_for(grouped: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Codes clamp(round((x - offset) / scale), 0, 3) as floats of grouped's dtype."""
    levels = grouped - offset[..., None]
    levels.div_(scale[..., None]).round_()
    return levels.clamp_(0, NUM_LEVELS - 1)


def _codes_for(grouped: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return _levels_for(grouped, scale, offset).to(torch.uint8)


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
    return _quantize(rows, group_size, scale_dtype, lloyd_max)


def _quantize(rows: torch.Tensor, group_size: int, scale_dtype: torch.dtype, lloyd_max: bool) -> QuantizedRows:
    """quantize without the argument checks (callers have checked)."""
    work = _working_dtype(rows)
    grouped = _grouped(rows.to(work), group_size)
    if lloyd_max:
        mean = grouped.mean(dim=-1)
        std = grouped.std(dim=-1, correction=0)
        scale = torch.clamp(LLOYD_MAX_BOUNDARY * std, min=SCALE_EPS)
        offset = mean - 0.5 * (NUM_LEVELS - 1) * scale
    else:
        low, high = torch.aminmax(grouped, dim=-1)
        scale = torch.clamp(high - low, min=SCALE_EPS) / (NUM_LEVELS - 1)
        offset = low
    scale = scale.to(scale_dtype)
    offset = offset.to(scale_dtype)
    codes = _codes_for(grouped, scale.to(work), offset.to(work))
    return QuantizedRows(codes.reshape(rows.shape), scale, offset, group_size)


def _grid_error(grouped: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Per-group squared error sum_i (x_i - c_i s - o)^2 of a grid (all in the working dtype)."""
    residual = codes * scale[..., None]
    residual.add_(offset[..., None])
    torch.sub(grouped, residual, out=residual)
    return residual.mul_(residual).sum(dim=-1)


def refit_grid(rows: torch.Tensor, initial: QuantizedRows, iterations: int, scale_floor: bool = False) -> QuantizedRows:
    """Least-squares refit of each group's (scale, offset) to ``rows``, from ``initial``.

    The min/max grid (after clipping) spends its 4 levels on the group's range; for
    bell-shaped rotated rows the MSE-optimal uniform grid is narrower. Lloyd's algorithm
    restricted to uniform grids, per group of G values x_i with codes c_i:

        fit:    s = cov(c, x) / var(c)   (the previous s if var(c) = 0: all codes equal)
                s <- max(s, SCALE_EPS) rounded to the storage dtype
                o = mean(x) - s mean(c)  rounded to the storage dtype
        assign: c_i = clamp(round((x_i - o) / s), 0, 3)

    (means are sums / G). Every iterate is scored by sum_i (x_i - c_i s - o)^2 with the
    rounded (s, o), against the UNCLIPPED rows; per group the iterate with the smallest
    error wins (ties keep the earlier one, ``initial`` first), so the result is never
    worse than ``initial`` on ``rows``.

    Args:
        rows: [..., D] float tensor: the rows ``initial`` was made from, before clipping.
        initial: their quantization (quantize(clip_rows(rows, r), ...)); its scale dtype
            is the storage dtype of the result.
        iterations: fit/assign rounds (0 returns ``initial``).
        scale_floor: the fit step becomes s = max(cov / var, s_initial): the grid may move
            but never gets narrower than the initial (clipped min/max) grid, so the values
            the clip kept stay inside it. The served key side (config.REFIT_SCALE_FLOOR):
            the unconstrained key refit saturates the large coordinates that retrieval
            needs (docs/QUALITY.md, "Passkey and the grid refit").
    Returns:
        QuantizedRows with the same shapes and dtypes as ``initial``.
    """
    check_rows("rows", rows)
    check_refit_iterations(iterations)
    return _refit(rows, initial, iterations, scale_floor)


def _refit(rows: torch.Tensor, initial: QuantizedRows, iterations: int, scale_floor: bool = False) -> QuantizedRows:
    """refit_grid without the argument checks (callers have checked).

    All groups run in one [M, G] working array; every value is computed by the float operations of the documented
    formulas (in place where that saves a pass), per group, so the result is bit-identical to a direct
    transcription round by round. One exact shortcut: a group whose assign step returns the codes its fit started
    from is at a fixed point (the next fit sees the same codes and, if they are all equal, the scale it just
    produced), so every later iterate equals this one and none can be strictly better: the loop ends when every
    group is there (the CPU decode writes one token per request, whose few groups often settle well before the 8
    served key rounds), and once such groups are a quarter of a working array of >= config.REFIT_COMPACT_MIN_VALUES
    values they are gathered out with their best grid, so the rounds that remain run on the slow groups only.
    """
    if iterations == 0:
        return initial
    work = _working_dtype(rows)
    group = initial.group_size
    storage = initial.scale.dtype
    x = rows.to(work).reshape(-1, group)
    best_scale, best_offset = initial.scale.reshape(-1), initial.offset.reshape(-1)
    scale, offset = best_scale.to(work), best_offset.to(work)
    codes = initial.codes.reshape(-1, group).to(work)
    best_codes = codes
    best_error = _grid_error(x, codes, scale, offset)
    x_mean = x.sum(dim=-1) / group
    x_centered = x - x_mean[..., None]
    floor = scale if scale_floor else None
    home = None  # the full-array index of each working group, once settled groups were gathered out
    for round_ in range(1, iterations + 1):
        code_mean = codes.sum(dim=-1) / group
        code_centered = codes - code_mean[..., None]
        covariance = (code_centered * x_centered).sum(dim=-1) / group
        variance = code_centered.mul_(code_centered).sum(dim=-1) / group
        spread = variance > 0
        fitted = torch.where(spread, covariance / torch.where(spread, variance, 1.0), scale)
        if floor is not None:
            fitted = torch.maximum(fitted, floor)
        new_scale = fitted.clamp(min=SCALE_EPS).to(storage)
        scale = new_scale.to(work)
        new_offset = (x_mean - scale * code_mean).to(storage)
        offset = new_offset.to(work)
        new_codes = _levels_for(x, scale, offset)
        error = _grid_error(x, new_codes, scale, offset)
        better = error < best_error
        best_codes = torch.where(better[..., None], new_codes, best_codes)
        best_scale = torch.where(better, new_scale, best_scale)
        best_offset = torch.where(better, new_offset, best_offset)
        best_error = torch.where(better, error, best_error)
        if round_ == iterations:
            break
        if x.numel() < REFIT_COMPACT_MIN_VALUES:  # small: only the exit, in one call
            if torch.equal(new_codes, codes):
                break
            codes = new_codes
            continue
        settled = (new_codes - codes).abs_().amax(dim=-1) == 0  # exact on float codes, faster than bool all()
        codes = new_codes
        count = int(settled.sum())
        if count == settled.numel():
            break
        if 4 * count < settled.numel():
            continue
        if home is None:
            home = torch.arange(settled.numel(), device=x.device)
            saved = (best_codes.clone(), best_scale.clone(), best_offset.clone())
        gone, keep = settled.nonzero().squeeze(1), (~settled).nonzero().squeeze(1)
        for full, part in zip(saved, (best_codes, best_scale, best_offset)):
            full.index_copy_(0, home[gone], part.index_select(0, gone))
        x, x_mean, x_centered, codes, scale, home, best_codes, best_scale, best_offset, best_error = (
            t.index_select(0, keep) for t in (x, x_mean, x_centered, codes, scale, home, best_codes, best_scale,
                                              best_offset, best_error))
        floor = None if floor is None else floor.index_select(0, keep)
    if home is None:
        saved = (best_codes, best_scale, best_offset)
    else:
        for full, part in zip(saved, (best_codes, best_scale, best_offset)):
            full.index_copy_(0, home, part)
    out_codes, out_scale, out_offset = saved
    return QuantizedRows(out_codes.to(torch.uint8).reshape(initial.codes.shape), out_scale.reshape(initial.scale.shape),
                         out_offset.reshape(initial.offset.shape), group)


def quantize_rows(
    rows: torch.Tensor,
    clip_ratio: float,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    refit_iterations: int = 0,
    lloyd_max: bool = False,
    refit_floor: bool = False,
) -> QuantizedRows:
    """The write path's quantizer: clip, min/max (or Lloyd-Max) grid, optional refit.

    Args:
        rows: [..., D] float tensor (rotated, NOT clipped).
        clip_ratio: in (0, 1]; clips the rows the initial grid is made from.
        group_size, scale_dtype, lloyd_max: as quantize.
        refit_iterations: rounds of refit_grid against the unclipped rows (0: none).
        refit_floor: refit_grid's scale_floor (the grid never narrower than the clipped
            min/max grid; the served key side, config.REFIT_SCALE_FLOOR).
    """
    check_rows("rows", rows)
    check_clip_ratio("clip_ratio", clip_ratio)
    check_scale_dtype(scale_dtype)
    check_refit_iterations(refit_iterations)
    initial = _quantize(_clip(rows, clip_ratio), group_size, scale_dtype, lloyd_max)
    return _refit(rows, initial, refit_iterations, refit_floor)


def dequantize(quantized: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D] values code * scale + offset in ``dtype``."""
    grouped_codes = _grouped(quantized.codes, quantized.group_size).to(dtype)
    # The offset added in place: one [..., D] temporary fewer, the same two roundings as codes * scale + offset
    # (with _attend_one's in-place overwrite, the CPU decode's time per call: bench/cpu_torch_ops.py).
    values = (grouped_codes * quantized.scale.to(dtype)[..., None]).add_(quantized.offset.to(dtype)[..., None])
    return values.reshape(quantized.codes.shape)


def fake_quantize(
    rows: torch.Tensor,
    clip_ratio: float,
    group_size: int,
    scale_dtype: torch.dtype = torch.float16,
    lloyd_max: bool = False,
    refit_iterations: int = 0,
    refit_floor: bool = False,
) -> torch.Tensor:
    """quantize_rows -> dequantize, in the dtype of ``rows`` (for evaluation and tests)."""
    quantized = quantize_rows(rows, clip_ratio, group_size, scale_dtype, refit_iterations, lloyd_max, refit_floor)
    return dequantize(quantized, _working_dtype(rows)).to(rows.dtype)
