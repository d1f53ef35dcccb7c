#!/usr/bin/env bash
# Calibrate OSCAR rotations for a model, then serve it with them.
#
#   examples/calibrate_then_serve.sh MODEL_PATH CALIBRATION_TEXT [OUT_FILE]
#
# Calibration runs the model once in full precision over the text (default 32K tokens;
# minutes on a CPU for a small model) and writes one safetensors file: per layer and KV
# head the K and V rotations and the clip ratios. The file records the model identity;
# serving a different model with it fails at start-up and says so.
set -euo pipefail
MODEL=${1:?usage: calibrate_then_serve.sh MODEL_PATH TEXT_FILE [OUT_FILE]}
TEXT=${2:?calibration text file}
OUT=${3:-rotations.safetensors}
vllm-oscar calibrate --model "$MODEL" --data "$TEXT" --out "$OUT"
vllm-oscar info "$OUT"
exec "$(dirname "$0")/serve.sh" "$MODEL" "$OUT"
