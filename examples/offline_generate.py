"""Offline generation with the OSCAR 2-bit KV cache (vLLM's LLM class).

    python examples/offline_generate.py MODEL_PATH [--rotations FILE | --hadamard-only]

Without --rotations, the rotation file shipped for the model (rotations/) is used; a model
with none needs `vllm-oscar calibrate` first (see calibrate_then_serve.sh) or, knowingly,
the data-free --hadamard-only mode. On the CPU build of vLLM set VLLM_CPU_KVCACHE_SPACE
(GiB of KV cache); the CPU path is correct but not fast. OSCAR's BF16 window stores are
reserved for --max-num-seqs requests out of that budget (vLLM's own default of 256 sequences
would reserve ~3.6 GiB for SmolLM2-135M's windows alone), so this demo asks for 8.
"""

import argparse

from vllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--rotations", help="rotation file made by `vllm-oscar calibrate`")
    source.add_argument("--hadamard-only", action="store_true", help="data-free mode (lower quality)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests at once (sizes the BF16 windows)")
    args = parser.parse_args()

    options = {"rotations": args.rotations} if args.rotations else {}
    if args.hadamard_only:
        options["hadamard_only"] = True
    # kv_cache_dtype="oscar" selects the OSCAR backend; its options travel in additional_config.
    llm = LLM(args.model, kv_cache_dtype="oscar", additional_config={"oscar": options}, max_model_len=4096,
              max_num_seqs=args.max_num_seqs)
    prompts = ["The three laws of thermodynamics are", "A short poem about the sea:\n"]
    for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
        print(repr(output.prompt), "->", repr(output.outputs[0].text))

    # What ran inside the worker (needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to ship the function).
    import os

    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
        from vllm_oscar.attention.status import worker_status

        print(llm.collective_rpc(worker_status))


if __name__ == "__main__":
    main()
