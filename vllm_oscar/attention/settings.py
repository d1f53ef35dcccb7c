"""OSCAR serving options as vLLM users pass them: ``additional_config={"oscar": {...}}``.

vLLM carries ``VllmConfig.additional_config`` (``--additional-config`` on the command
line, ``additional_config=`` for ``LLM``) to every process it starts, including spawned
workers and Ray actors, so the options reach each attention layer without environment
variables. Keys (all optional):

    rotations        path of a rotation file (ours: safetensors; or a RotationZoo .pt)
    hadamard_only    true: data-free mode, Hadamard rotation only (lower quality)
    sink_tokens      BF16 sink window, tokens (default 64)
    recent_tokens    BF16 recent window, tokens (default 256)
    group_size       channels per scale/offset group (default: one group per head vector)
    scale_dtype      "float16" (default), "bfloat16" or "float32"
    refit_iterations least-squares (scale, offset) refit rounds per written group
                     (default [8, 2]: 8 key and 2 value rounds, config.SERVED_REFIT_ITERATIONS;
                     0 = plain clipped min/max; one integer sets both sides); the key refit is
                     always floored (never narrower than the clipped min/max grid:
                     config.REFIT_SCALE_FLOOR, docs/QUALITY.md "Passkey and the grid refit")
    int8_keys        GPU decode: the key dot as an int8 MMA with the query rounded to int8 per head
                     row (default: on where it applies, head_dim >= 64 on CUDA; false = bf16
                     query everywhere; true where it cannot apply is an error)
    flash_prefill    GPU prefill: large calls as FlashAttention over gathered rows (default: from a work
                     threshold on, where FlashAttention runs, the keys of few-row calls over long
                     prefixes cut into segments; false = the Triton prefill kernel always; true =
                     FlashAttention for every prefill call, an error where it cannot run)
    fold_rotations   "output" (default): fold R_V into W_o at load where the model allows it
                     (vllm_oscar.attention.fold: no output rotation launch per layer step);
                     "value_and_output": into W_v too (the write skips its V rotation: faster
                     at most served steps measured, slower at 128K batch 8); "none": rotate in
                     the kernels (and weights can be reloaded in place)

Unknown keys are an error (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from vllm_oscar.config import ADDITIONAL_CONFIG_KEY, OscarConfig

_SCALE_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
_KEYS: dict[str, str] = {
    "rotations": "rotation_path",
    "hadamard_only": "hadamard_only",
    "sink_tokens": "sink_tokens",
    "recent_tokens": "recent_tokens",
    "group_size": "group_size",
    "scale_dtype": "scale_dtype",
    "refit_iterations": "refit_iterations",
    "int8_keys": "int8_keys",
    "flash_prefill": "flash_prefill",
    "fold_rotations": "fold_rotations",
}


def oscar_options(additional_config: Any) -> Mapping[str, Any]:
    """The ``"oscar"`` entry of a vLLM ``additional_config`` ({} when absent)."""
    if not isinstance(additional_config, Mapping):
        return {}
    options = additional_config.get(ADDITIONAL_CONFIG_KEY) or {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must be a mapping of OSCAR options; '
            f"got {type(options).__name__}."
        )
    return options


def config_from_options(options: Mapping[str, Any]) -> OscarConfig:
    """An OscarConfig from the user's options (see module docstring for the keys)."""
    unknown = sorted(set(options) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"unknown OSCAR option(s) {unknown} in additional_config[\"{ADDITIONAL_CONFIG_KEY}\"]; "
            f"known: {sorted(_KEYS)}."
        )
    kwargs: dict[str, Any] = {}
    for key, field in _KEYS.items():
        if key not in options or options[key] is None:
            continue
        value = options[key]
        if key == "scale_dtype":
            if value not in _SCALE_DTYPES:
                raise ValueError(f"scale_dtype={value!r} is not supported; use one of {sorted(_SCALE_DTYPES)}.")
            value = _SCALE_DTYPES[value]
        elif key == "rotations":
            value = str(value)
        elif key in ("hadamard_only", "int8_keys", "flash_prefill"):
            if not isinstance(value, bool):
                raise ValueError(f"{key}={value!r} must be true or false.")
        kwargs[field] = value
    return OscarConfig(**kwargs)


def current_oscar_config(vllm_config: Any) -> OscarConfig:
    """The OscarConfig of a running vLLM (from ``vllm_config.additional_config``)."""
    return config_from_options(oscar_options(getattr(vllm_config, "additional_config", None)))
