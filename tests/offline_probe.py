"""Compile probes for sm_90 without a GPU: a snippet run in a fresh Python that compiles kernels with Triton's own
ptxas and prints one JSON object. A child process because the suite sets TRITON_INTERPRET (conftest.py), under which
Triton builds interpreter kernels and Gluon none at all; the child runs without it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

#: The repository root: the probes put it and bench/ first on their sys.path.
ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_probe(code: str, timeout: int = 900, **names: object) -> dict:
    """Run ``code`` with ROOT (str) and each of ``names`` (by repr) defined before it, TRITON_INTERPRET unset; fail
    the test with the child's stderr if it exits non-zero, else return the JSON object of its last stdout line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    header = "".join(f"{name} = {value!r}\n" for name, value in {"ROOT": str(ROOT), **names}.items())
    run = subprocess.run([sys.executable, "-c", header + code], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
