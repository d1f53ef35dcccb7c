"""Rotations of one attention layer for this rank: calibrated file or explicit Hadamard mode.

Sources, in order:
  1. ``additional_config={"oscar": {"rotations": FILE}}``: a rotation file made by
     ``vllm-oscar calibrate`` (safetensors); it must fit the served model's attention
     shapes (vllm_oscar.calibration.load_rotation_file checks and names both shapes).
  2. a file shipped in ``rotations/`` whose model identity matches the served model
     (``find_shipped_rotation``).
  3. ``{"hadamard_only": true}``: the data-free mode, the normalised Hadamard matrix for
     every head, default clip ratios. Lower quality; logged as such. Only on request.
Anything else is a start-up error that says how to calibrate.

A file holds every KV head; each tensor-parallel rank keeps only its slice
(vllm_oscar.attention.parallel.kv_head_slice).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from vllm_oscar.calibration.files import find_shipped_rotation, load_rotation_file
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.rotations import RotationSet
from vllm_oscar.config import OscarConfig
from vllm_oscar.quant import hadamard_matrix

# Under "vllm." so that vLLM's log handlers and level apply to the plugin too.
logger = logging.getLogger(f"vllm.{__name__}")

#: Where a layer's rotation came from, for logs and for tests that check it.
SOURCE_FILE = "file"
SOURCE_SHIPPED = "shipped"
SOURCE_HADAMARD = "hadamard"


@dataclasses.dataclass(frozen=True)
class LayerRotations:
    """One layer's rotations for this rank's KV heads.

    Attributes:
        k_rotation, v_rotation: float32 [Hkv_local, D, D] (x_rot = x @ R[h]).
        clip_k, clip_v: clip ratios in (0, 1].
        source: SOURCE_FILE, SOURCE_SHIPPED or SOURCE_HADAMARD.
        path: the rotation file ("" in Hadamard mode).
        value_prerotated: the model's W_v carries R_V (vllm_oscar.attention.fold), so values arrive rotated
            and the write does not rotate them.
        output_rotated: the model's W_o carries R_V^T, so the attention output stays in the rotated basis
            (no un-rotation launch). v_rotation still holds R_V either way.
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    clip_k: float
    clip_v: float
    source: str
    path: str
    value_prerotated: bool = False
    output_rotated: bool = False


def missing_rotation_message(identity: ModelIdentity) -> str:
    """The start-up error for a model without rotations: what is missing and what to do."""
    return (
        f"OSCAR has no rotation file for {identity.describe()}: none was given and none is "
        "shipped for this model. Calibrate one (minutes on a CPU for a small model):\n"
        "    vllm-oscar calibrate --model MODEL_PATH --data TEXT_FILE --out rotations.safetensors\n"
        "then pass it: --additional-config '{\"oscar\": {\"rotations\": \"rotations.safetensors\"}}' "
        "(LLM(..., additional_config={\"oscar\": {\"rotations\": PATH}})). Or, knowingly, run the "
        "data-free Hadamard-only mode (lower quality): {\"oscar\": {\"hadamard_only\": true}}."
    )


@functools.lru_cache(maxsize=4)
def _load(path: str, identity: ModelIdentity) -> RotationSet:
    return load_rotation_file(path, identity)


def resolve_rotation_file(identity: ModelIdentity, config: OscarConfig) -> tuple[Optional[Path], str]:
    """(file, source) for a model, or (None, SOURCE_HADAMARD); raises ValueError if none applies."""
    if config.rotation_path is not None:
        if config.hadamard_only:
            raise ValueError(
                "OSCAR options 'rotations' and 'hadamard_only' exclude each other: a rotation file "
                "is the calibrated mode, hadamard_only the data-free one. Keep one of them."
            )
        path = Path(config.rotation_path).expanduser()
        if not path.is_file():
            raise ValueError(f"OSCAR rotation file {path} does not exist (additional_config oscar.rotations).")
        return path, SOURCE_FILE
    if config.hadamard_only:
        return None, SOURCE_HADAMARD
    shipped = find_shipped_rotation(identity)
    if shipped is None:
        raise ValueError(missing_rotation_message(identity))
    return shipped, SOURCE_SHIPPED


def layer_rotations(
    identity: ModelIdentity,
    config: OscarConfig,
    layer_index: int,
    kv_slice: slice,
    device: torch.device,
) -> LayerRotations:
    """Rotations and clip ratios of layer ``layer_index`` for the KV heads in ``kv_slice``."""
    path, source = resolve_rotation_file(identity, config)
    heads = kv_slice.stop - kv_slice.start
    if path is None:
        hadamard = hadamard_matrix(identity.head_dim, dtype=torch.float32)
        rotation = hadamard.expand(heads, -1, -1).contiguous().to(device)
        return LayerRotations(rotation, rotation, config.clip_ratio_k, config.clip_ratio_v, source, "")
    rotation_set = _load(str(path), identity)
    if not 0 <= layer_index < len(rotation_set.layers):
        raise ValueError(f"layer index {layer_index} is outside the {len(rotation_set.layers)} layers of {path}.")
    layer = rotation_set.layers[layer_index]
    return LayerRotations(
        k_rotation=layer.k_rotation[kv_slice].to(device=device, dtype=torch.float32).contiguous(),
        v_rotation=layer.v_rotation[kv_slice].to(device=device, dtype=torch.float32).contiguous(),
        clip_k=layer.clip_k,
        clip_v=layer.clip_v,
        source=source,
        path=str(path),
    )


def log_rotation_choice(identity: ModelIdentity, rotations: LayerRotations) -> None:
    """Log once per process which rotations OSCAR serves with (Hadamard mode as a warning)."""
    _log_once(identity.describe(), rotations.source, rotations.path)


@functools.lru_cache(maxsize=None)
def _log_once(model: str, source: str, path: str) -> None:
    if source == SOURCE_HADAMARD:
        logger.warning(
            "OSCAR runs in the data-free Hadamard-only mode for %s: lower quality than calibrated "
            "rotations (calibrate with `vllm-oscar calibrate`).", model)
    else:
        logger.info("OSCAR rotations for %s: %s file %s", model, source, path)
