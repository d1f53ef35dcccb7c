"""GPU-only bench scripts without a GPU: each refuses with a message that says what it needs (bench/gluon_parts.py
times gluon_decode's kernel by parts, docs/decisions.md; bench/cta_launch_probe.py times launches
of tiny grids, "Session 27"; bench/merge_tail.py times the decode merge's tail, "Session 29"; bench/split_timeline.py
records gluon_decode's programs' timelines, "Session 30"; bench/copy_shapes.py times TMA copies by program shape,
"Session 35"; bench/cluster_merge.py merges split partials in thread-block clusters, "Session 45")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


@pytest.mark.parametrize("script, args, message", [
    ("gluon_parts.py", ["--contexts", "16384", "--batches", "1"],
     "times gluon_decode's kernel on a CUDA GPU; none is visible"),
    ("cta_launch_probe.py", ["--programs", "528", "--warps", "1"], "times launches on a CUDA GPU; none is visible"),
    ("merge_tail.py", ["--cells", "qwen3-8b:131072:1"], "times the decode's kernels on a CUDA GPU; none is visible"),
    ("split_timeline.py", ["--cells", "qwen3-8b:131072:1"],
     "times gluon_decode's programs on a CUDA GPU; none is visible"),
    ("copy_shapes.py", ["--shapes", "4:6:quarter"], "times TMA copies on a CUDA GPU; none is visible"),
    ("cluster_merge.py", ["--check-only", "--shapes", "8:16:2"],
     "launches thread-block clusters on a CUDA GPU; none is visible"),
])
def test_refuses_without_a_gpu_and_says_why(script: str, args: list[str], message: str) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, os.path.join(BENCH, script), *args], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode != 0
    assert message in run.stderr
