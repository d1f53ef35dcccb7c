"""bench/ab_tune.sh without a GPU: with a stand-in for `bench tune` (a `python` shim on PATH that writes a made-up
report wherever --json points and hands every other call to the real interpreter), it runs every tree in turn for
every round and geometry, from the tree's own folder, and prints bench/tune_ab.py's tables over the rounds."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

SHIM = '''#!{python}
import json, os, sys
args = sys.argv[1:]
if args[:4] == ["-m", "vllm_oscar.cli", "bench", "tune"]:
    out = args[args.index("--json") + 1]
    geometry = args[args.index("--geometry") + 1]
    ms = {{"fast": 0.010, "slow": 0.020}}[os.path.basename(os.getcwd())]
    with open(os.path.join(os.path.dirname(out), "calls.txt"), "a") as log:
        log.write(os.path.basename(os.getcwd()) + " " + geometry + "\\n")
    rows = [dict(geometry=geometry, context=4096, batch=1, config={{}}, oscar=dict(ms=ms))]
    json.dump({{"tune": rows}}, open(out, "w"))
else:
    os.execv({python!r}, [{python!r}] + args)
'''


def test_trees_in_turn_and_the_tables(tmp_path) -> None:
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "python"
    shim.write_text(SHIM.format(python=sys.executable))
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    for name in ("fast", "slow"):
        (tmp_path / name / "vllm_oscar").mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{shim_dir}:{os.environ['PATH']}", "OUT": str(out), "ROUNDS": "2",
           "TREES": f"slow={tmp_path / 'slow'} fast={tmp_path / 'fast'}", "GEOMETRIES": "g1 g2"}
    run = subprocess.run(["bash", str(ROOT / "bench" / "ab_tune.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    calls = (out / "calls.txt").read_text().split("\n")[:-1]
    assert calls == ["slow g1", "slow g2", "fast g1", "fast g2"] * 2  # trees in turn, each round
    tables = (out / "ab_tables.txt").read_text()
    assert "fast/slow" in tables and tables.count("2.000") == 2  # one cell per geometry, twice as fast
    assert json.loads((out / "ab_fast2_g1.json").read_text())["tune"][0]["oscar"]["ms"] == 0.010


def test_a_folder_without_the_package_is_refused(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "TREES": f"x={tmp_path}"}
    run = subprocess.run(["bash", str(ROOT / "bench" / "ab_tune.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 2 and "has no vllm_oscar/ folder" in run.stdout
