"""Per-head rotation of rows: ``x_rot[n, h] = x[n, h] @ R[h // g]`` (or ``@ R^T``).

Used for the query before decode/prefill (q @ R_K), for the output after it
(out_rot @ R_V^T) and inside the torch write path. Plain batched matmul: works on CPU
and CUDA, has no host synchronisation, and is safe under CUDA-graph capture.
"""

from __future__ import annotations

from typing import Optional

import torch


def rotate_rows(
    x: torch.Tensor,
    rotation: torch.Tensor,
    inverse: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Rotate every head's rows by its rotation.

    Args:
        x: [N, H, D] float rows (H query heads or KV heads).
        rotation: [Hr, D, D] float rotations, Hr dividing H; head h of ``x`` uses
            ``rotation[h // (H // Hr)]`` (GQA: query head -> its KV head's rotation).
        inverse: multiply by R^T instead of R (undo a rotation; R is orthogonal).
        out_dtype: dtype of the result (default: x.dtype). Math runs in float32
            (float64 if either input is float64).
    Returns:
        [N, H, D] tensor ``x[n, h] @ R[h // g]`` (or ``@ R[h // g]^T``).
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [N, H, D]; got {getattr(x, 'shape', x)!r}.")
    n, heads, dim = x.shape
    if (
        not isinstance(rotation, torch.Tensor)
        or rotation.dim() != 3
        or tuple(rotation.shape[1:]) != (dim, dim)
        or not rotation.is_floating_point()
    ):
        raise ValueError(f"rotation must be a float tensor [Hr, {dim}, {dim}]; got {getattr(rotation, 'shape', rotation)!r}.")
    groups = rotation.shape[0]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"rotation heads ({groups}) must divide the heads of x ({heads}).")
    work = torch.float64 if torch.float64 in (x.dtype, rotation.dtype) else torch.float32
    matrix = rotation.to(work)
    if inverse:
        matrix = matrix.transpose(-1, -2)
    grouped = x.to(work).reshape(n, groups, heads // groups, dim).transpose(0, 1)  # [Hr, N, g, D]
    rotated = torch.matmul(grouped.reshape(groups, -1, dim), matrix)  # [Hr, N*g, D]
    rotated = rotated.reshape(groups, n, heads // groups, dim).transpose(0, 1).reshape(n, heads, dim)
    return rotated.to(out_dtype or x.dtype)
