"""Composition of the OSCAR rotation R = U . H . P_br (docs/method.md section 2).

Rotations act on row vectors: ``x_rot = x @ R``. R is orthogonal, so
``(q @ R) . (k @ R) = q . k``.
"""

from __future__ import annotations

import torch

from vllm_oscar.quant.hadamard import bit_reversal_permutation, hadamard_matrix


def _check_square(name: str, matrix: torch.Tensor) -> int:
    if matrix.dim() < 2 or matrix.shape[-1] != matrix.shape[-2]:
        raise ValueError(f"{name} must have shape [..., D, D]; got {tuple(matrix.shape)}.")
    if not matrix.is_floating_point():
        raise ValueError(f"{name} must be a float tensor; got dtype {matrix.dtype}.")
    if not bool(torch.isfinite(matrix).all()):
        raise ValueError(f"{name} contains NaN or Inf values.")
    return matrix.shape[-1]


def permutation_matrix(target_of: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[D, D] matrix P with P[i, target_of[i]] = 1, so (x @ P)[..., target_of[i]] = x[..., i]."""
    dim = target_of.numel()
    matrix = torch.zeros(dim, dim, dtype=dtype, device=target_of.device)
    matrix[torch.arange(dim, device=target_of.device), target_of] = 1.0
    return matrix


def compose_rotation(
    eigenvectors: torch.Tensor,
    eigenvalues: torch.Tensor,
    use_hadamard: bool = True,
    use_bit_reversal: bool = True,
) -> torch.Tensor:
    """R = U_sorted . H . P_br for one or many heads.

    Args:
        eigenvectors: [..., D, D]; column i is the eigenvector of ``eigenvalues[..., i]``.
        eigenvalues: [..., D] importance of each direction (larger = more important).
        use_hadamard: include the normalised Hadamard factor H (ablation switch).
        use_bit_reversal: include P_br (ablation switch).
    Returns:
        [..., D, D] orthogonal rotation in the dtype of ``eigenvectors``. The columns of
        U are sorted by descending eigenvalue before H, and output channel br(i)
        receives sorted coordinate i.
    """
    dim = _check_square("eigenvectors", eigenvectors)
    if eigenvalues.shape != eigenvectors.shape[:-1]:
        raise ValueError(
            f"eigenvalues must have shape {tuple(eigenvectors.shape[:-1])} to match eigenvectors "
            f"{tuple(eigenvectors.shape)}; got {tuple(eigenvalues.shape)}."
        )
    order = torch.argsort(eigenvalues, dim=-1, descending=True)
    sorted_vectors = torch.gather(
        eigenvectors, -1, order.unsqueeze(-2).expand_as(eigenvectors)
    )
    rotation = sorted_vectors
    if use_hadamard:
        rotation = rotation @ hadamard_matrix(dim, eigenvectors.dtype, eigenvectors.device)
    if use_bit_reversal:
        target = bit_reversal_permutation(dim, eigenvectors.device)
        rotation = rotation @ permutation_matrix(target, eigenvectors.dtype)
    return rotation


def rotation_from_covariance(
    covariance: torch.Tensor, use_hadamard: bool = True, use_bit_reversal: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecompose a (batch of) covariance target(s) and compose R.

    Args:
        covariance: [..., D, D] symmetric positive semi-definite target (C_K or C_V).
    Returns:
        (rotation [..., D, D] float64, eigenvalues [..., D] float64 sorted descending).
        The matrix is symmetrised and decomposed in float64 whatever its input dtype.
    """
    _check_square("covariance", covariance)
    symmetric = covariance.to(torch.float64)
    symmetric = 0.5 * (symmetric + symmetric.transpose(-1, -2))
    eigenvalues, eigenvectors = torch.linalg.eigh(symmetric)
    rotation = compose_rotation(eigenvectors, eigenvalues, use_hadamard, use_bit_reversal)
    return rotation, torch.sort(eigenvalues, dim=-1, descending=True).values


def orthogonality_error(rotation: torch.Tensor) -> float:
    """max |R^T R - I| over all entries (and heads): 0 for an exact rotation."""
    _check_square("rotation", rotation)
    eye = torch.eye(rotation.shape[-1], dtype=rotation.dtype, device=rotation.device)
    return float((rotation.transpose(-1, -2) @ rotation - eye).abs().max())
