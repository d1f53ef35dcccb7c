"""OSCAR on a tiny random Qwen3 (D=128): selection by VLLM_ATTENTION_BACKEND alone, a
calibrated-format rotation file, KV capacity, and start-up errors for bad configurations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_oscar.calibration.files import save_rotation_file
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.rotations import LayerRotation, RotationSet
from vllm_oscar.config import ATTENTION_BACKEND_ENV

from conftest import greedy, make_tiny_qwen3, oscar_status, start_llm, stop_llm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KV_SPACE_GIB = 1


def _random_rotation_file(path: Path, identity: ModelIdentity) -> Path:
    """A valid rotation file for ``identity``: random orthogonal matrices per (layer, head)."""
    generator = torch.Generator().manual_seed(0)
    shape = identity.rotation_shape

    def orthogonal() -> torch.Tensor:
        q, _ = torch.linalg.qr(torch.randn(shape, generator=generator, dtype=torch.float64))
        return q.to(torch.float32)

    layers = [LayerRotation(orthogonal(), orthogonal(), torch.zeros(shape[:2], dtype=torch.float64),
                            torch.zeros(shape[:2], dtype=torch.float64), 0.96, 0.92)
              for _ in range(identity.num_layers)]
    return save_rotation_file(path, RotationSet(identity, layers, {"method": "random test rotations"}))


def _identity(model_path: Path) -> ModelIdentity:
    from transformers import AutoConfig

    return ModelIdentity.from_hf_config(AutoConfig.from_pretrained(model_path), name=str(model_path))


def _bf16_tokens(model_path: Path, budget_bytes: int, block_size: int) -> int:
    """Tokens vLLM's BF16 KV pages hold in ``budget_bytes`` (vLLM's own page-size formula)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    identity = _identity(model_path)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=identity.num_kv_heads,
                             head_size=identity.head_dim, dtype=torch.bfloat16)
    return budget_bytes // (spec.page_size_bytes * identity.num_layers) * block_size


@pytest.fixture(scope="module")
def env_run(tiny_qwen3_path, tmp_path_factory):
    """One engine selected only by VLLM_ATTENTION_BACKEND=OSCAR, with a user rotation file."""
    rotation = _random_rotation_file(tmp_path_factory.mktemp("rot") / "qwen3.safetensors", _identity(tiny_qwen3_path))
    mp = pytest.MonkeyPatch()
    mp.setenv(ATTENTION_BACKEND_ENV, "OSCAR")
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", str(KV_SPACE_GIB))
    llm = start_llm(tiny_qwen3_path, max_model_len=1024, block_size=16,
                    additional_config={"oscar": {"rotations": str(rotation)}})
    try:
        ids = greedy(llm, ["Hello, my name is", "The capital of France is"], 40, ignore_eos=True)
        return {"ids": ids, "status": oscar_status(llm),
                "cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype}
    finally:
        stop_llm(llm)
        mp.undo()


def test_env_variable_alone_selects_oscar(env_run):
    status = env_run["status"]
    assert status["impl_classes"] == ["OscarAttentionImpl"]
    assert status["rotation_sources"] == ["file"]
    assert status["fallback_positions"] == 0
    assert all(len(ids) == 40 for ids in env_run["ids"])


def test_kv_capacity_d128_is_at_least_6x_bf16(env_run, tiny_qwen3_path, record_property):
    status = env_run["status"]
    oscar_tokens = status["kv_cache_blocks"] * status["block_size"]
    bf16_tokens = _bf16_tokens(tiny_qwen3_path, KV_SPACE_GIB * 2**30, status["block_size"])
    report = {"head_dim": 128, "budget_gib": KV_SPACE_GIB, "oscar_tokens": oscar_tokens,
              "bf16_tokens": bf16_tokens, "ratio": oscar_tokens / bf16_tokens,
              "window_store_bytes": status["window_store_bytes"]}
    record_property("kv_capacity_d128", json.dumps(report))
    print("KV capacity D=128:", json.dumps(report))
    assert oscar_tokens / bf16_tokens >= 6.0


def test_contradictory_requests_fail_before_start(tiny_qwen3_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="needs the OSCAR attention backend"):
        EngineArgs(model=str(tiny_qwen3_path), kv_cache_dtype="oscar",
                   attention_backend="CPU_ATTN").create_engine_config()
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "OSCAR")
    with pytest.raises(ValueError, match="cannot be combined"):
        EngineArgs(model=str(tiny_qwen3_path), kv_cache_dtype="fp8").create_engine_config()


_FAILING_START = textwrap.dedent("""
    import json, sys
    from vllm import LLM
    if __name__ == "__main__":
        LLM(sys.argv[1], kv_cache_dtype="oscar", enforce_eager=True, max_model_len=512, max_num_seqs=2,
            additional_config={"oscar": json.loads(sys.argv[2])})
""")


def _start_fails(model: Path, options: dict, tmp_path: Path) -> str:
    """Start an engine that must fail; return its combined output (the workers' errors included)."""
    script = tmp_path / "start.py"
    script.write_text(_FAILING_START)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop(ATTENTION_BACKEND_ENV, None)
    done = subprocess.run([sys.executable, str(script), str(model), json.dumps(options)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_missing_rotation_is_a_startup_error_that_explains_calibration(tiny_qwen3_path, tmp_path):
    output = _start_fails(tiny_qwen3_path, {}, tmp_path)
    assert "OSCAR has no rotation file" in output
    assert "vllm-oscar calibrate" in output and "hadamard_only" in output


def test_rotation_of_another_model_is_a_startup_error(tiny_qwen3_path, smollm2_path, tmp_path):
    other = _random_rotation_file(tmp_path / "smollm2.safetensors", _identity(smollm2_path))
    output = _start_fails(tiny_qwen3_path, {"rotations": str(other)}, tmp_path)
    assert "was calibrated for" in output and "(2, 128, 128)" in output and "(3, 64, 64)" in output


def test_unsupported_head_size_is_a_startup_error(smollm2_path, tmp_path):
    model = make_tiny_qwen3(tmp_path / "qwen3_d96", smollm2_path, head_dim=96)
    output = _start_fails(model, {"hadamard_only": True}, tmp_path)
    assert "head size 96 is not supported" in output
    assert "serve this model without OSCAR" in output
