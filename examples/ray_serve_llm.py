"""OSCAR behind Ray Serve LLM: an OpenAI-compatible endpoint on a Ray cluster.

    pip install "ray[serve,llm]" vllm-oscar      # on every node (same environment)
    python examples/ray_serve_llm.py --model /models/Qwen3-8B \
        --rotations /shared/qwen3-8b.safetensors --tensor-parallel-size 2
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "oscar-model", "prompt": "Hello", "max_tokens": 16}'

Ray Serve LLM (ray.serve.llm, Ray >= 2.44) passes ``engine_kwargs`` to vLLM's engine
arguments and always runs vLLM's Ray executor, so the OSCAR plugin must be installed
where the replicas and their workers run; ``kv_cache_dtype="oscar"`` selects OSCAR and
``additional_config`` carries the rotation file. GPU clusters only: vLLM's Ray executor
does not run on vLLM's CPU platform, and this script is not run in CI
(docs/notes/distributed.md).
"""

from __future__ import annotations

import argparse
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder or Hugging Face id")
    parser.add_argument("--model-id", default="oscar-model", help="name clients use in requests")
    parser.add_argument("--rotations", help="rotation file (same path on every node); default: shipped file")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--accelerator-type", default=None, help="e.g. H100; default: any GPU")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    oscar = {"rotations": args.rotations} if args.rotations else {}
    llm_config = LLMConfig(
        model_loading_config={"model_id": args.model_id, "model_source": args.model},
        engine_kwargs={
            "kv_cache_dtype": "oscar",
            "additional_config": {"oscar": oscar},
            "tensor_parallel_size": args.tensor_parallel_size,
        },
        deployment_config={"num_replicas": args.replicas},
        accelerator_type=args.accelerator_type,
    )
    serve.run(build_openai_app({"llm_configs": [llm_config]}), blocking=False)
    print(f"OpenAI-compatible endpoint: http://127.0.0.1:8000/v1 (model {args.model_id!r}); Ctrl-C stops.")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    main()
