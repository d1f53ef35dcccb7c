"""Rotation files: safetensors with per-layer rotations, eigenvalues and clip ratios.

Tensors (L layers, Hkv KV heads, D head_dim):
    layers.{i}.k_rotation    float32 [Hkv, D, D]   keys/queries: x_rot = x @ R
    layers.{i}.v_rotation    float32 [Hkv, D, D]
    layers.{i}.k_eigenvalues float64 [Hkv, D]      descending
    layers.{i}.v_eigenvalues float64 [Hkv, D]
    clip_k                   float64 [L]           clip ratio per layer
    clip_v                   float64 [L]
Metadata (all strings):
    format = "vllm_oscar.rotations", format_version = "1", package_version,
    model.architecture / model.num_layers / model.num_query_heads / model.num_kv_heads /
    model.head_dim / model.name / model.weights_sha256 (ModelIdentity.to_metadata),
    oscar = JSON of RotationSet.metadata (method options, calibration data sha256 and
    token count, clip search).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from vllm_oscar import __version__
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.rotations import LayerRotation, RotationSet
from vllm_oscar.config import ROTATION_FILE_FORMAT, ROTATION_FILE_VERSION, SHIPPED_ROTATIONS_DIR

logger = logging.getLogger(__name__)

_TORCH_SAVE_MAGIC = b"PK\x03\x04"


def _tensor_name(layer: int, field: str) -> str:
    return f"layers.{layer}.{field}"


def save_rotation_file(path: str | os.PathLike[str], rotation_set: RotationSet) -> Path:
    """Validate ``rotation_set`` and write it to ``path`` atomically (temp file + rename)."""
    from safetensors.torch import save_file

    rotation_set.validate("rotation set to save")
    tensors: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(rotation_set.layers):
        tensors[_tensor_name(index, "k_rotation")] = layer.k_rotation.to(torch.float32).contiguous()
        tensors[_tensor_name(index, "v_rotation")] = layer.v_rotation.to(torch.float32).contiguous()
        tensors[_tensor_name(index, "k_eigenvalues")] = layer.k_eigenvalues.to(torch.float64).contiguous()
        tensors[_tensor_name(index, "v_eigenvalues")] = layer.v_eigenvalues.to(torch.float64).contiguous()
    clip_k, clip_v = rotation_set.clip_ratios
    tensors["clip_k"] = torch.tensor(clip_k, dtype=torch.float64)
    tensors["clip_v"] = torch.tensor(clip_v, dtype=torch.float64)
    metadata = {
        "format": ROTATION_FILE_FORMAT,
        "format_version": str(ROTATION_FILE_VERSION),
        "package_version": __version__,
        **rotation_set.identity.to_metadata(),
        "oscar": json.dumps(rotation_set.metadata, sort_keys=True),
    }
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    try:
        save_file(tensors, staging, metadata=metadata)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp makes 0600; a rotation file is not secret
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target


def _not_ours(path: Path, reason: str) -> ValueError:
    return ValueError(
        f"{path} is not a readable vllm_oscar rotation file: {reason}. Expected a safetensors file "
        "written by `vllm-oscar calibrate`; recreate it with that command (a RotationZoo .pt file "
        "is imported with `vllm-oscar calibrate --import-rotationzoo K.pt V.pt --model MODEL --out FILE`)."
    )


def read_rotation_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The metadata of a rotation file, without loading tensors; ValueError if not ours."""
    from safetensors import safe_open

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"rotation file {file} does not exist; run `vllm-oscar calibrate` to make one.")
    with open(file, "rb") as stream:
        if stream.read(4) == _TORCH_SAVE_MAGIC:
            raise _not_ours(file, "it is a torch.save (zip) file, not safetensors")
    try:
        with safe_open(str(file), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for bad headers
        raise _not_ours(file, f"not valid safetensors (truncated or another format): {error}") from None
    if metadata.get("format") != ROTATION_FILE_FORMAT:
        raise _not_ours(file, f"metadata format is {metadata.get('format')!r}, expected {ROTATION_FILE_FORMAT!r}")
    version = metadata.get("format_version")
    if version != str(ROTATION_FILE_VERSION):
        raise ValueError(
            f"{file} has rotation file format_version {version!r}; this vllm_oscar "
            f"({__version__}) reads version {ROTATION_FILE_VERSION}. Upgrade vllm_oscar or recalibrate "
            "with this version."
        )
    return metadata


def _check_identity(file: Path, found: ModelIdentity, expected: ModelIdentity) -> None:
    mismatches = found.shape_mismatches(expected)
    if mismatches:
        raise ValueError(
            f"{file} was calibrated for {found.describe()}, but the model is {expected.describe()} "
            f"({'; '.join(mismatches)}). Its rotations have shape {found.rotation_shape} per layer, "
            f"the model needs {expected.rotation_shape}. Use the rotation file of this model, or make one "
            "with `vllm-oscar calibrate --model MODEL --data TEXT --out FILE`."
        )
    if found.name and expected.name and not found.name_matches(expected.name):
        logger.warning(
            "rotation file %s was calibrated for %r; using it for %r (same attention shapes).",
            file, found.name, expected.name,
        )


def load_rotation_file(
    path: str | os.PathLike[str], expected_identity: Optional[ModelIdentity] = None
) -> RotationSet:
    """Read and validate a rotation file (CPU tensors).

    Raises ValueError (what is wrong, what was expected, what to do) for: a file that is
    not safetensors or is truncated, a torch.save file, an unknown format or version, a
    model identity whose shapes differ from ``expected_identity`` (both shapes named),
    missing tensors, wrong shapes, NaN/Inf, non-orthogonal rotations (> 1e-3), clip
    ratios outside (0, 1]. A different model *name* with equal shapes only logs a warning.
    """
    from safetensors import safe_open

    file = Path(path)
    metadata = read_rotation_metadata(file)
    identity = ModelIdentity.from_metadata(metadata, source=str(file))
    if expected_identity is not None:
        _check_identity(file, identity, expected_identity)
    try:
        extra: dict[str, Any] = json.loads(metadata.get("oscar", "{}"))
    except json.JSONDecodeError as error:
        raise _not_ours(file, f"its 'oscar' metadata is not JSON ({error})") from None
    try:
        with safe_open(str(file), framework="pt") as handle:
            names = set(handle.keys())
            needed = ["clip_k", "clip_v"] + [
                _tensor_name(i, f) for i in range(identity.num_layers)
                for f in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues")
            ]
            missing = [n for n in needed if n not in names]
            if missing:
                raise _not_ours(file, f"tensors {missing[:4]}{'...' if len(missing) > 4 else ''} are missing")
            tensors = {n: handle.get_tensor(n) for n in needed}
    except ValueError:
        raise
    except Exception as error:
        raise _not_ours(file, f"its tensor data cannot be read (truncated?): {error}") from None
    clip_k, clip_v = tensors["clip_k"], tensors["clip_v"]
    if clip_k.shape != (identity.num_layers,) or clip_v.shape != (identity.num_layers,):
        raise _not_ours(
            file,
            f"clip_k/clip_v have shapes {tuple(clip_k.shape)}/{tuple(clip_v.shape)}, expected ({identity.num_layers},)",
        )
    layers = [
        LayerRotation(
            k_rotation=tensors[_tensor_name(i, "k_rotation")],
            v_rotation=tensors[_tensor_name(i, "v_rotation")],
            k_eigenvalues=tensors[_tensor_name(i, "k_eigenvalues")],
            v_eigenvalues=tensors[_tensor_name(i, "v_eigenvalues")],
            clip_k=float(clip_k[i]),
            clip_v=float(clip_v[i]),
        )
        for i in range(identity.num_layers)
    ]
    rotation_set = RotationSet(identity, layers, extra)
    rotation_set.validate(str(file))
    return rotation_set


def shipped_rotation_dirs() -> list[Path]:
    """Folders searched for shipped files: the source checkout's rotations/ and the
    installed ``<prefix>/share/vllm_oscar/rotations`` (setup.py data_files)."""
    checkout = Path(__file__).resolve().parents[2] / SHIPPED_ROTATIONS_DIR
    installed = Path(sys.prefix) / "share" / "vllm_oscar" / SHIPPED_ROTATIONS_DIR
    return [d for d in (checkout, installed) if d.is_dir()]


def find_shipped_rotation(
    model_identity: ModelIdentity, search_dirs: Optional[list[Path]] = None
) -> Optional[Path]:
    """The shipped rotation file for a model, or None.

    A file matches when its attention shapes equal the model's and its model name
    appears in ``model_identity.name`` (a name or a path such as vLLM's model path;
    lower-case alphanumerics compared). Among matches the longest name wins (so
    "SmolLM2-135M-Instruct" beats "SmolLM2-135M"). Unreadable files are skipped with a warning.
    """
    best: Optional[tuple[int, Path]] = None
    for folder in shipped_rotation_dirs() if search_dirs is None else search_dirs:
        for file in sorted(Path(folder).glob("*.safetensors")):
            try:
                found = ModelIdentity.from_metadata(read_rotation_metadata(file), source=str(file))
            except ValueError as error:
                logger.warning("skipping %s: %s", file, error)
                continue
            if found.shape_mismatches(model_identity) or not found.name_matches(model_identity.name):
                continue
            score = len(found.name)
            if best is None or score > best[0]:
                best = (score, file)
    return None if best is None else best[1]
