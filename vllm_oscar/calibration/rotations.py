"""RotationSet: per (layer, KV head) K/V rotations and clip ratios, and how to build them.

Convention (docs/method.md 2, vllm_oscar.quant.rotation): rows are rotated as
``x_rot = x @ R``; R = U . H . P_br with U the eigenvectors of the target sorted by
descending eigenvalue, H the normalised Hadamard matrix, P_br the bit-reversal placement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.statistics import CalibrationStats
from vllm_oscar.config import (
    DEFAULT_CLIP_RATIO_K,
    DEFAULT_CLIP_RATIO_V,
    DEFAULT_VALUE_FORM,
    ORTHOGONALITY_TOLERANCE,
    check_clip_ratio,
    check_head_dim,
)
from vllm_oscar.quant.rotation import orthogonality_error, rotation_from_covariance


@dataclasses.dataclass
class LayerRotation:
    """One attention layer's rotations.

    Attributes:
        k_rotation: [Hkv, D, D] float32, keys (and queries) as ``k @ k_rotation[h]``.
        v_rotation: [Hkv, D, D] float32, values as ``v @ v_rotation[h]``.
        k_eigenvalues: [Hkv, D] float64, eigenvalues of C_K, descending (zeros if unknown).
        v_eigenvalues: [Hkv, D] float64, eigenvalues of C_V, descending (zeros if unknown).
        clip_k / clip_v: clip ratios (quantile of |x| per rotated row) in (0, 1].
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    clip_k: float = DEFAULT_CLIP_RATIO_K
    clip_v: float = DEFAULT_CLIP_RATIO_V


@dataclasses.dataclass
class RotationSet:
    """Rotations of every attention layer of one model.

    Attributes:
        identity: the model they belong to.
        layers: ``identity.num_layers`` LayerRotation entries, layer i at index i.
        metadata: JSON-serialisable provenance: "method" (options), "calibration"
            (data, tokens, hashes, seconds), "clip_search" (grid, errors, choice), ...
    """

    identity: ModelIdentity
    layers: list[LayerRotation]
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def clip_ratios(self) -> tuple[list[float], list[float]]:
        """(clip_k per layer, clip_v per layer)."""
        return [l.clip_k for l in self.layers], [l.clip_v for l in self.layers]

    def with_clip_ratios(self, clip_k: list[float], clip_v: list[float], note: dict[str, Any]) -> "RotationSet":
        """A copy with new clip ratios per layer; ``note`` goes to metadata["clip_search"]."""
        if len(clip_k) != len(self.layers) or len(clip_v) != len(self.layers):
            raise ValueError(
                f"need one clip ratio per layer ({len(self.layers)}); got {len(clip_k)} for K, {len(clip_v)} for V."
            )
        layers = [dataclasses.replace(l, clip_k=float(a), clip_v=float(b))
                  for l, a, b in zip(self.layers, clip_k, clip_v)]
        return RotationSet(self.identity, layers, {**self.metadata, "clip_search": note})

    def validate(self, source: str = "rotation set") -> None:
        """Raise ValueError naming what is wrong: layer count, shapes, dtypes, NaN/Inf,
        orthogonality (max |R^T R - I| > ORTHOGONALITY_TOLERANCE), clip ratios."""
        ident = self.identity
        check_head_dim(ident.head_dim)
        if len(self.layers) != ident.num_layers:
            raise ValueError(
                f"{source} has {len(self.layers)} layers but its model identity {ident.describe()} "
                f"has {ident.num_layers}."
            )
        expected = ident.rotation_shape
        for index, layer in enumerate(self.layers):
            for name in ("k_rotation", "v_rotation"):
                matrix = getattr(layer, name)
                if tuple(matrix.shape) != expected:
                    raise ValueError(
                        f"{source}: layer {index} {name} has shape {tuple(matrix.shape)}, expected "
                        f"{expected} (Hkv, D, D) for {ident.describe()}."
                    )
                if not matrix.is_floating_point():
                    raise ValueError(f"{source}: layer {index} {name} has dtype {matrix.dtype}, expected float32.")
                if not bool(torch.isfinite(matrix).all()):
                    raise ValueError(f"{source}: layer {index} {name} contains NaN or Inf; recalibrate the model.")
                error = orthogonality_error(matrix.to(torch.float64))
                if not error <= ORTHOGONALITY_TOLERANCE:
                    raise ValueError(
                        f"{source}: layer {index} {name} is not orthogonal: max|R^T R - I| = {error:.3g} > "
                        f"{ORTHOGONALITY_TOLERANCE:g}; the file is corrupt or not a rotation, recalibrate."
                    )
            for name in ("k_eigenvalues", "v_eigenvalues"):
                values = getattr(layer, name)
                if tuple(values.shape) != expected[:2]:
                    raise ValueError(
                        f"{source}: layer {index} {name} has shape {tuple(values.shape)}, expected {expected[:2]}."
                    )
                if not bool(torch.isfinite(values).all()):
                    raise ValueError(f"{source}: layer {index} {name} contains NaN or Inf.")
            check_clip_ratio(f"{source}: layer {index} clip_k", layer.clip_k)
            check_clip_ratio(f"{source}: layer {index} clip_v", layer.clip_v)


def _rotations_for(target: torch.Tensor, per_head: bool, use_hadamard: bool, use_bit_reversal: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """[Hkv, D, D] target -> (rotation [Hkv, D, D] float32, eigenvalues [Hkv, D] float64)."""
    heads = target.shape[0]
    if not per_head:
        target = target.mean(dim=0, keepdim=True)
    rotation, eigenvalues = rotation_from_covariance(target, use_hadamard, use_bit_reversal)
    rotation = rotation.expand(heads, -1, -1).to(torch.float32).contiguous()
    return rotation, eigenvalues.expand(heads, -1).contiguous()


def build_rotations(
    stats: CalibrationStats,
    per_head: bool = True,
    use_hadamard: bool = True,
    use_bit_reversal: bool = True,
    value_form: str = DEFAULT_VALUE_FORM,
    clip_k: float = DEFAULT_CLIP_RATIO_K,
    clip_v: float = DEFAULT_CLIP_RATIO_V,
) -> RotationSet:
    """Eigendecompose the targets (float64) and compose R = U . H . P_br per (layer, KV head).

    Args:
        stats: from collect_statistics.
        per_head: one rotation per KV head (required for quality); False: one per layer
            from the head-averaged target, repeated over heads (ablation).
        use_hadamard / use_bit_reversal: ablation switches of R's factors.
        value_form: which C_V (config.VALUE_FORMS).
        clip_k / clip_v: clip ratios stored for every layer (search_clip_ratios refines them).
    """
    check_clip_ratio("clip_k", clip_k)
    check_clip_ratio("clip_v", clip_v)
    value_targets = stats.value_target(value_form)
    layers = []
    for index in range(stats.identity.num_layers):
        k_rotation, k_eigen = _rotations_for(stats.key_target[index], per_head, use_hadamard, use_bit_reversal)
        v_rotation, v_eigen = _rotations_for(value_targets[index], per_head, use_hadamard, use_bit_reversal)
        layers.append(LayerRotation(k_rotation, v_rotation, k_eigen, v_eigen, clip_k, clip_v))
    metadata = {
        "method": {
            "key_target": "qqt",
            "value_form": value_form,
            "granularity": "kv_head" if per_head else "layer",
            "use_hadamard": use_hadamard,
            "use_bit_reversal": use_bit_reversal,
            "composition": "R = U . H . P_br, rows: x_rot = x @ R",
        },
        "calibration": {"tokens": stats.num_tokens, "statistics_seconds": round(stats.seconds, 3)},
    }
    result = RotationSet(stats.identity, layers, metadata)
    result.validate("calibrated rotations")
    return result

