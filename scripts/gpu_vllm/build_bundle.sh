#!/usr/bin/env bash
# Builds, on a CPU machine with network, the bundle that lets vLLM 0.32.0 run on the GPU
# machine (torch 2.11.0+cu130, Python 3.12, no network; each run carries <= 64 MiB):
#   1. downloads the vLLM 0.32.0 CUDA wheel and the wheels in wheels.txt (cp312, x86_64);
#   2. unpacks vLLM and strips what an H100/H200 never loads for dense attention models
#      (STRIPPED below, with the reason for each);
#   3. packs vLLM's tree and the wheels into one tar.xz and splits it into parts of
#      PART_MIB, one git-ignored folder per part (.gpu_bundle/partN/), with SHA256SUMS.
# Usage: bash scripts/gpu_vllm/build_bundle.sh [PART_MIB]   (docs/gpu-vllm.md)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
HERE="$ROOT/scripts/gpu_vllm"
PART_MIB="${1:-50}"
VLLM_VERSION=0.32.0
OUT_DIR="$ROOT/.gpu_bundle"
WORK="${TMPDIR:-/tmp}/oscar_gpu_bundle_build"
PY="${PYTHON:-python3}"
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64
           --platform linux_x86_64)
# Paths inside the vLLM wheel that a Hopper GPU serving dense attention models never loads.
STRIPPED=(
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so   # FlashAttention 2 (sm80); its import is guarded, FA3 serves sm90
  vllm/vllm_flash_attn/cute                  # FlashAttention 4 (Blackwell; needs the CUTLASS DSL)
  vllm/vllm-rs                               # the optional Rust front end (VLLM_USE_RUST_FRONTEND=1)
  vllm/third_party/deep_gemm                 # FP8 GEMMs of DeepSeek-style models; misses torch 2.11 symbols
  vllm/third_party/fmha_sm100                # Blackwell attention
  vllm/_moe_C_stable_libtorch.abi3.so        # mixture-of-experts ops; imported under suppress(ImportError)
  vllm/_qutlass_C.abi3.so                    # FP4 (Blackwell); misses torch 2.11 symbols
)

mkdir -p "$WORK/wheels" "$WORK/vllm_wheel"
echo "== downloading vLLM $VLLM_VERSION and $(grep -cv '^\s*\(#\|$\)' "$HERE/wheels.txt") wheels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$WORK/vllm_wheel" "vllm==$VLLM_VERSION"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d "$WORK/wheels" -r "$HERE/wheels.txt"

echo "== unpacking and stripping vLLM"
rm -rf "$WORK/stage" && mkdir -p "$WORK/stage/site" "$WORK/stage/wheels"
"$PY" -m zipfile -e "$WORK"/vllm_wheel/vllm-"$VLLM_VERSION"-*.whl "$WORK/stage/site"
for path in "${STRIPPED[@]}"; do
  [ -e "$WORK/stage/site/$path" ] || { echo "expected $path in the vLLM wheel (another release?)" >&2; exit 1; }
  rm -rf "$WORK/stage/site/$path"
done
# pip install --target would not know vLLM's files anyway: drop the RECORD so nothing trusts it.
rm -f "$WORK"/stage/site/vllm-"$VLLM_VERSION".dist-info/RECORD
cp "$WORK"/wheels/*.whl "$WORK/stage/wheels/"
du -sh "$WORK/stage/site" "$WORK/stage/wheels"

echo "== compressing (xz -6, both cores)"
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR"
tar -C "$WORK/stage" -cf - site wheels | xz -6 -T0 > "$WORK/bundle.tar.xz"
( cd "$WORK" && sha256sum bundle.tar.xz > "$OUT_DIR/SHA256SUMS" )
split -b "${PART_MIB}M" -d -a 1 "$WORK/bundle.tar.xz" "$WORK/bundle.tar.xz.part"
n=0
for part in "$WORK"/bundle.tar.xz.part*; do
  n=$((n + 1)); mkdir -p "$OUT_DIR/part$n"; mv "$part" "$OUT_DIR/part$n/"
  cp "$OUT_DIR/SHA256SUMS" "$OUT_DIR/part$n/"
done
echo "$n" > "$OUT_DIR/NUM_PARTS"
for d in "$OUT_DIR"/part*; do echo "$n" > "$d/NUM_PARTS"; done
ls -la "$OUT_DIR"/part*/
echo "== $n parts in $OUT_DIR: carry .gpu_bundle/part1 ... part$n, one per GPU run (docs/gpu-vllm.md)"
