"""Import of the published OSCAR "RotationZoo" .pt files into a RotationSet.

Published layout (one file for K, one for V), read with torch.load(weights_only=True):

    {"format_version": 1 | 2,
     "objective": "qqt_r_h_pbr" (K) | "sst_r_h_pbr" (V),
     "layers": {layer_id: {"rotation": float32 [D, D] (v1, per layer) | [Hkv, D, D] (v2),
                           "eigenvalues": [D] | [Hkv, D]}}}

We assume the published rotations use our row convention (x_rot = x @ R), as docs/method.md
states for R = U . H . P_br. Clip ratios are not in those files: the imported set gets
the reference defaults (config.DEFAULT_CLIP_RATIO_K/V), recorded in its metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.rotations import LayerRotation, RotationSet
from vllm_oscar.config import DEFAULT_CLIP_RATIO_K, DEFAULT_CLIP_RATIO_V, ROTATIONZOO_VERSIONS


def _load_zoo(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"RotationZoo file {path} does not exist.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read as a RotationZoo file with torch.load(weights_only=True): {error}. "
            "Expected a torch.save dict {format_version, objective, layers}."
        ) from None
    if not isinstance(data, dict) or "layers" not in data or "format_version" not in data:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path} is not a RotationZoo file: expected keys format_version, objective, layers; "
                         f"got {keys}.")
    if data["format_version"] not in ROTATIONZOO_VERSIONS:
        raise ValueError(
            f"{path} has RotationZoo format_version {data['format_version']!r}; supported: {ROTATIONZOO_VERSIONS}."
        )
    return data


def _layer_tensors(path: Path, data: dict[str, Any],
                   identity: ModelIdentity) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (rotation [Hkv, D, D] float32, eigenvalues [Hkv, D] float64)."""
    layers = {int(key): value for key, value in data["layers"].items()}
    expected_ids = list(range(identity.num_layers))
    if sorted(layers) != expected_ids:
        raise ValueError(
            f"{path} has layers {sorted(layers)}, but {identity.describe()} needs layers 0..{identity.num_layers - 1}."
        )
    heads, dim = identity.num_kv_heads, identity.head_dim
    version = data["format_version"]
    per_file_shape = (dim, dim) if version == 1 else (heads, dim, dim)
    result = []
    for index in expected_ids:
        entry = layers[index]
        if not isinstance(entry, dict) or "rotation" not in entry:
            raise ValueError(f"{path}: layer {index} has no 'rotation' tensor.")
        rotation = torch.as_tensor(entry["rotation"])
        if tuple(rotation.shape) != per_file_shape:
            raise ValueError(
                f"{path}: layer {index} rotation has shape {tuple(rotation.shape)}; format_version {version} for "
                f"{identity.describe()} needs {per_file_shape}."
            )
        eigen = entry.get("eigenvalues")
        eigen = torch.zeros(per_file_shape[:-1]) if eigen is None else torch.as_tensor(eigen)
        if tuple(eigen.shape) != per_file_shape[:-1]:
            raise ValueError(
                f"{path}: layer {index} eigenvalues have shape {tuple(eigen.shape)}, expected {per_file_shape[:-1]}."
            )
        if version == 1:
            rotation = rotation.expand(heads, dim, dim)
            eigen = eigen.expand(heads, dim)
        result.append((rotation.to(torch.float32).contiguous(), eigen.to(torch.float64).contiguous()))
    return result


def import_rotationzoo(
    k_path: str | os.PathLike[str], v_path: str | os.PathLike[str], identity: ModelIdentity
) -> RotationSet:
    """Read a RotationZoo K file and V file (format_version 1 or 2) into a validated RotationSet.

    Args:
        k_path / v_path: the .pt files for keys and values.
        identity: the model they are for (the .pt files do not say); its num_layers,
            num_kv_heads and head_dim must fit the files.
    """
    k_file, v_file = Path(k_path), Path(v_path)
    k_data, v_data = _load_zoo(k_file), _load_zoo(v_file)
    k_layers = _layer_tensors(k_file, k_data, identity)
    v_layers = _layer_tensors(v_file, v_data, identity)
    layers = [
        LayerRotation(k_rot, v_rot, k_eig, v_eig, DEFAULT_CLIP_RATIO_K, DEFAULT_CLIP_RATIO_V)
        for (k_rot, k_eig), (v_rot, v_eig) in zip(k_layers, v_layers)
    ]
    metadata = {
        "method": {
            "imported_from": "RotationZoo",
            "granularity": "layer" if k_data["format_version"] == 1 else "kv_head",
            "key_objective": str(k_data.get("objective", "")),
            "value_objective": str(v_data.get("objective", "")),
            "format_versions": [int(k_data["format_version"]), int(v_data["format_version"])],
            "sources": [k_file.name, v_file.name],
        },
        "clip_search": {"note": "not calibrated: reference default clip ratios"},
    }
    rotation_set = RotationSet(identity, layers, metadata)
    rotation_set.validate(f"RotationZoo import of {k_file.name} / {v_file.name}")
    return rotation_set
