# Sourced on the GPU machine after install.sh: vLLM and the wheels of the bundle on the
# path, this checkout first (its vllm_oscar wins over the installed copy, whose only job is
# the entry point). Safe to source twice.
_oscar_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export OSCAR_GPU_SITE="${OSCAR_GPU_SITE:-/tmp/oscar_gpu_site}"
export PYTHONPATH="$_oscar_root:$OSCAR_GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
# The SmolLM2 folder (transformers dequantizes the GGUF once per machine).
export VLLM_OSCAR_CACHE="${VLLM_OSCAR_CACHE:-/tmp/oscar_cache}"
# LLM.collective_rpc ships vllm_oscar.attention.status.worker_status to the workers.
export VLLM_ALLOW_INSECURE_SERIALIZATION=1
# No network there: never ask a hub, never report usage.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PYTHONUNBUFFERED=1
# Held-out text for the GPU tests where ../shared does not travel: .gpu_data/ (docs/gpu-vllm.md).
if [ -d "$_oscar_root/.gpu_data" ]; then export OSCAR_CORPORA_DIR="${OSCAR_CORPORA_DIR:-$_oscar_root/.gpu_data}"; fi
unset _oscar_root
