#!/usr/bin/env bash
# Installs the bundle of build_bundle.sh on the GPU machine, one carried part per run.
#
# Each run copies the parts it carries (.gpu_bundle/partN/) to $OSCAR_BUNDLE_STORE (under
# /tmp, which lasts while the machine stays warm). Once every part is there it joins them,
# checks the sha256, unpacks vLLM and the wheels into $OSCAR_GPU_SITE with
# `pip install --no-index --no-deps --target`, installs this checkout's plugin there (its
# vllm.general_plugins entry point), and checks that vLLM imports on the GPU. Later runs
# only reinstall the plugin. Exit status: 0 installed, 3 parts still missing, 1 failed.
#
#   bash scripts/gpu_vllm/install.sh && source scripts/gpu_vllm/env.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
STORE="${OSCAR_BUNDLE_STORE:-/tmp/oscar_gpu_bundle}"
SITE="${OSCAR_GPU_SITE:-/tmp/oscar_gpu_site}"
PY="${PYTHON:-python3}"
mkdir -p "$STORE"

for dir in "$ROOT"/.gpu_bundle/part*/; do
  [ -d "$dir" ] || continue
  cp "$dir"/bundle.tar.xz.part* "$dir/SHA256SUMS" "$dir/NUM_PARTS" "$STORE/"
  echo "copied $(basename "$dir") to $STORE"
done

if [ ! -f "$SITE/.complete" ]; then
  [ -f "$STORE/NUM_PARTS" ] || { echo "no bundle part carried yet: carry .gpu_bundle/part1 (docs/gpu-vllm.md)"; exit 3; }
  want=$(cat "$STORE/NUM_PARTS")
  have=$(ls "$STORE"/bundle.tar.xz.part* | wc -l)
  if [ "$have" -lt "$want" ]; then
    echo "bundle: $have of $want parts on this machine; carry the next one in the next run"; exit 3
  fi
  echo "== joining $want parts and checking sha256"
  cat "$STORE"/bundle.tar.xz.part* > "$STORE/bundle.tar.xz"
  ( cd "$STORE" && sha256sum -c SHA256SUMS )
  rm -rf "$SITE" "$STORE/unpacked" && mkdir -p "$SITE" "$STORE/unpacked"
  tar -C "$STORE/unpacked" -xJf "$STORE/bundle.tar.xz"
  rm "$STORE/bundle.tar.xz"
  mv "$STORE/unpacked/site/"* "$SITE/"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STORE"/unpacked/wheels/*.whl
  touch "$SITE/.complete"
fi

echo "== installing the plugin from $ROOT"
rm -rf "$SITE"/vllm_oscar "$SITE"/vllm_oscar-*.dist-info
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$ROOT" 2>&1 | grep -v "^WARNING: Target directory" || true
rm -rf "$ROOT/build" "$ROOT"/*.egg-info

# shellcheck source=env.sh
source "$ROOT/scripts/gpu_vllm/env.sh"
"$PY" - <<'PY'
import importlib.metadata as md
import torch, triton, vllm
plugins = [ep.value for ep in md.entry_points(group="vllm.general_plugins")]
print(f"vllm {vllm.__version__} | torch {torch.__version__} | triton {triton.__version__} | "
      f"{torch.cuda.get_device_name(0)} | plugins {plugins}")
assert "vllm_oscar:register" in plugins, "the vllm_oscar entry point is not installed"
PY
