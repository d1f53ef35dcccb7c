"""Per-head rotation of rows: ``x_rot[n, h] = x[n, h] @ R[h // g]`` (or ``@ R^T``).

The torch implementation: ``oscar_rotate`` runs it on CPU tensors (the query before
decode/prefill, q @ R_K, and the output after it, out_rot @ R_V^T); the torch write path uses it
too. Plain batched matmul: works on CPU and CUDA, has no host synchronisation, and is safe under
CUDA-graph capture. On CUDA ``oscar_rotate`` takes the one-launch Triton kernel instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_oscar.kernels.checks import check_rotate_args


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
    check_rotate_args(x, rotation)
    n, heads, dim = x.shape
    groups = rotation.shape[0]
    work = torch.float64 if torch.float64 in (x.dtype, rotation.dtype) else torch.float32
    matrix = rotation.to(work)
    if inverse:
        matrix = matrix.transpose(-1, -2)
    grouped = x.to(work).reshape(n, groups, heads // groups, dim).transpose(0, 1)  # [Hr, N, g, D]
    rotated = torch.matmul(grouped.reshape(groups, -1, dim), matrix)  # [Hr, N*g, D]
    rotated = rotated.reshape(groups, n, heads // groups, dim).transpose(0, 1).reshape(n, heads, dim)
    return rotated.to(out_dtype or x.dtype)
