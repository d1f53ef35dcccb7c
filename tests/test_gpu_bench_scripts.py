"""GPU-only bench scripts without a GPU: each refuses with a message that says what it needs (bench/split_timeline.py
records gluon_decode's programs' timelines; bench/copy_shapes.py times TMA copies by program shape)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


@pytest.mark.parametrize("script, args, message", [
    ("split_timeline.py", ["--cells", "qwen3-8b:131072:1"],
     "times gluon_decode's programs on a CUDA GPU; none is visible"),
    ("copy_shapes.py", ["--shapes", "4:6:quarter"], "times TMA copies on a CUDA GPU; none is visible"),
])
def test_refuses_without_a_gpu_and_says_why(script: str, args: list[str], message: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode != 0
    assert message in run.stderr
