"""One vLLM engine start with kv_cache_dtype="oscar" on the rebuilt SmolLM2 folder:
the shipped rotation file must be found (rotation_sources == ["shipped"])."""
import json
import os
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def main() -> None:
    from vllm import LLM, SamplingParams

    from vllm_oscar.attention.status import worker_status
    from vllm_oscar.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    print("config architectures:", json.loads((folder / "config.json").read_text()).get("architectures"))
    start = time.time()
    llm = LLM(str(folder), kv_cache_dtype="oscar", enforce_eager=True, dtype="bfloat16", max_num_seqs=2,
              max_model_len=1024, seed=0)
    print("engine architectures:", llm.llm_engine.model_config.architectures, f"start {time.time() - start:.0f} s")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    print("text:", repr(out[0].outputs[0].text))
    (status,) = llm.collective_rpc(worker_status)
    print("status:", json.dumps(status))
    assert status["rotation_sources"] == ["shipped"], status
    print("OK shipped rotation found")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
