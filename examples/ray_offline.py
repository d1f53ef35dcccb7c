"""Offline generation with OSCAR on a Ray cluster: tensor (and pipeline) parallel workers.

Run on the head node of a running Ray cluster (examples/multinode.md), with
vllm-oscar installed on every node and the rotation file at the same path on every node:

    python examples/ray_offline.py --model /models/Qwen3-8B --rotations /shared/qwen3-8b.safetensors \
        --tensor-parallel-size 4 [--pipeline-parallel-size 2]

Each Ray worker reports which KV heads' rotations it loaded (OscarWorkerExtension), so a
misconfigured node shows up before any traffic. Needs GPU nodes: vLLM's Ray executor does
not run on vLLM's CPU platform (docs/notes/distributed.md).
"""

from __future__ import annotations

import argparse

#: Worker extension that answers collective_rpc("oscar_report").
WORKER_EXTENSION = "vllm_oscar.attention.parallel.OscarWorkerExtension"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder or Hugging Face id")
    parser.add_argument("--rotations", help="rotation file (same path on every node); default: shipped file")
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--ray-address", default="auto", help="address of the running Ray cluster")
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import ray
    from vllm import LLM, SamplingParams

    ray.init(address=args.ray_address)
    oscar = {"rotations": args.rotations} if args.rotations else {}
    llm = LLM(
        model=args.model,
        kv_cache_dtype="oscar",
        additional_config={"oscar": oscar},
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_executor_backend="ray",
        worker_extension_cls=WORKER_EXTENSION,
    )
    for report in llm.collective_rpc("oscar_report"):
        layers = report["layers"]
        backends = sorted({layer["backend"] for layer in layers.values()})
        heads = sorted({layer["num_kv_heads"] for layer in layers.values()})
        print(f"pid {report['pid']}: tp {report['tp_rank']}/{report['tp_size']}, "
              f"pp {report['pp_rank']}/{report['pp_size']}: {len(layers)} layers, "
              f"backends {backends}, KV heads per layer {heads}")
    prompts = ["Explain in two sentences why KV-cache memory limits long-context serving."]
    for output in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens)):
        print(output.outputs[0].text)


if __name__ == "__main__":
    main()
