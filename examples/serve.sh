#!/usr/bin/env bash
# Serve a model over the OpenAI-compatible API with the OSCAR 2-bit KV cache.
#
#   examples/serve.sh MODEL_PATH [ROTATION_FILE]
#
# Any of these selects OSCAR (pick one):
#   --kv-cache-dtype oscar                  (the vLLM-idiomatic way)
#   VLLM_ATTENTION_BACKEND=OSCAR            (environment; vLLM dropped it, the plugin honours it)
#   --attention-backend OSCAR
# OSCAR options go in --additional-config '{"oscar": {...}}' (rotations, hadamard_only,
# sink_tokens, recent_tokens, group_size, scale_dtype). Without "rotations", the file
# shipped in rotations/ for the model is used.
# With the CPU build of vLLM the console script `vllm` may not start; the module form
# below works everywhere. VLLM_CPU_KVCACHE_SPACE sets the CPU KV budget in GiB.
set -euo pipefail
MODEL=${1:?usage: serve.sh MODEL_PATH [ROTATION_FILE]}
OPTIONS='{}'
if [[ $# -ge 2 ]]; then OPTIONS="{\"rotations\": \"$2\"}"; fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
exec python -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port 8000 \
    --kv-cache-dtype oscar --additional-config "{\"oscar\": $OPTIONS}"
# Then:
#   curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "Hello", "max_tokens": 16}'
