"""bench/gluon_parts.py without a GPU: it refuses with a message that says what it needs (it times gluon_decode's
kernel by parts on a CUDA GPU; docs/notes/kernels.md "Session 24")."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "gluon_parts.py")


def test_refuses_without_a_gpu_and_says_why() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, SCRIPT, "--contexts", "16384", "--batches", "1"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode != 0
    assert "times gluon_decode's kernel on a CUDA GPU; none is visible" in run.stderr
