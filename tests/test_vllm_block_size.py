"""Blocks of GPU_DECODE_BLOCK_SIZE (64) by default on CUDA: the backend's preference, vLLM's rule
for applying it (an explicit --block-size always wins), and an engine that ends up with it.

vLLM's CPU platform never applies a backend's preferred block size (``CpuPlatform.
update_block_size_for_backend`` only aligns hybrid models), and its default is 128. The engine test
therefore runs vLLM's base ``Platform.update_block_size_for_backend`` (the one the CUDA platform
uses) in its place and makes the backend's CUDA check pass; the layers are then built at blocks of
128 and the engine changes them to 64 after the model is loaded, as on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("default,cuda,preferred", [
    (16, True, GPU_DECODE_BLOCK_SIZE),  # vLLM's default on CUDA
    (16, False, 16),                     # any other platform keeps vLLM's choice
    (32, True, 32),                      # another default: vLLM's rule (a supported size is kept)
])
def test_backend_prefers_64_for_vllms_default_on_cuda(monkeypatch, default, cuda, preferred) -> None:
    from vllm_oscar.attention import backend

    monkeypatch.setattr(backend, "platform_is_cuda", lambda: cuda)
    assert backend.OscarAttentionBackend.get_preferred_block_size(default) == preferred


@pytest.mark.parametrize("block_size,cuda,expected", [
    (None, True, GPU_DECODE_BLOCK_SIZE),  # no --block-size on CUDA: OSCAR's preference
    (16, True, 16),                        # --block-size 16: the user's choice wins
    (32, True, 32),
    (None, False, 16),                     # not CUDA: vLLM's default
])
def test_vllm_applies_the_preference_only_without_block_size(monkeypatch, tiny_qwen3_path, block_size, cuda,
                                                             expected) -> None:
    """vLLM 0.32's own rule (``Platform.update_block_size_for_backend``) on a real engine config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.interface import Platform

    from vllm_oscar.attention import backend

    monkeypatch.setattr(backend, "platform_is_cuda", lambda: cuda)
    # No model is built here: name the model's attention backends as the loaded layers would.
    monkeypatch.setattr(Platform, "_find_non_ssm_backends",
                        classmethod(lambda cls, vllm_config: [backend.OscarAttentionBackend]))
    config = EngineArgs(model=str(tiny_qwen3_path), kv_cache_dtype="oscar", block_size=block_size,
                        max_model_len=512).create_engine_config()
    Platform.update_block_size_for_backend(config)
    assert config.cache_config.block_size == expected
    assert config.cache_config.user_specified_block_size == (block_size is not None)


_ENGINE = textwrap.dedent("""
    import json, sys

    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import Platform


    def inspect(worker):
        from vllm_oscar.attention.backend import OscarAttentionImpl, window_geometry, window_store_bytes_of_worker
        from vllm_oscar.attention.status import worker_status

        config = worker.vllm_config
        impls = [layer.impl for layer in config.compilation_config.static_forward_context.values()
                 if isinstance(getattr(layer, "impl", None), OscarAttentionImpl)]
        planned, allocated = window_store_bytes_of_worker(config)
        return {**worker_status(worker),
                "kv_cache_block_sizes": [g.kv_cache_spec.block_size
                                         for g in worker.model_runner.kv_cache_config.kv_cache_groups],
                "layout_block_sizes": sorted({impl.layout.block_size for impl in impls}),
                "window_shapes": sorted({tuple(impl.window_k.shape) for impl in impls}),
                "expected_window_blocks": window_geometry(config, impls[0].config)[0],
                "planned_window_bytes": planned, "allocated_window_bytes": allocated}


    if __name__ == "__main__":
        from vllm import LLM, SamplingParams

        from vllm_oscar.attention import backend

        seen = {}
        base_update = Platform.update_block_size_for_backend.__func__

        def update_block_size_for_backend(cls, vllm_config):
            seen["before"] = vllm_config.cache_config.block_size
            base_update(cls, vllm_config)
            seen["after"] = vllm_config.cache_config.block_size

        CpuPlatform.update_block_size_for_backend = classmethod(update_block_size_for_backend)
        backend.platform_is_cuda = lambda: True
        llm = LLM(sys.argv[1], kv_cache_dtype="oscar", enforce_eager=True, dtype="bfloat16", max_model_len=512,
                  max_num_seqs=2, seed=0, additional_config={"oscar": {"hadamard_only": True}})
        outputs = llm.generate(["Hello, my name is", "The capital of France is"],
                               SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        (status,) = llm.collective_rpc(inspect)
        status.update(seen=seen, lengths=[len(o.outputs[0].token_ids) for o in outputs])
        print("RESULT " + json.dumps(status))
""")


@pytest.mark.slow
def test_engine_takes_the_preferred_block_size_after_loading(tiny_qwen3_path, tmp_path) -> None:
    """One in-process engine (its single worker sees the patches): built at blocks of 128, switched to
    64 after loading; the CPU KV budget takes out the window stores at 64, and every layer sizes its
    pages and window store at 64 at its first forward."""
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, str(script), str(tiny_qwen3_path)], env=env, capture_output=True,
                          text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    status = json.loads(line.removeprefix("RESULT "))
    bs = GPU_DECODE_BLOCK_SIZE
    assert status["seen"] == {"before": 128, "after": bs}  # the CPU platform's default, then OSCAR's
    assert status["block_size"] == bs and status["kv_cache_block_sizes"] == [bs]
    assert status["layout_block_sizes"] == [bs]
    blocks = status["expected_window_blocks"]
    assert status["window_blocks"] == blocks
    assert status["window_shapes"] == [[blocks, bs, 2, 128]]  # tiny Qwen3: 2 KV heads of 128
    assert status["planned_window_bytes"] == status["allocated_window_bytes"] == status["window_store_bytes"] > 0
    assert f"of the KV budget holds the BF16 window stores (blocks of {bs})" in output
    assert status["fallback_positions"] == 0
    assert status["lengths"] == [24, 24]
