"""provenance.source_digest: what a benchmark JSON records to name the code it ran."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from vllm_oscar import provenance

PACKAGE = Path(provenance.__file__).resolve().parent


def test_the_digest_follows_code_and_plan_tables_not_caches(tmp_path: Path) -> None:
    """A copy of the package has the package's digest; editing a module or a plan table changes it, a
    __pycache__ file or another suffix does not; the module prints the digest of a folder given to it."""
    copy = tmp_path / "vllm_oscar"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    original = provenance.source_digest(PACKAGE)
    assert provenance.source_digest(copy) == original and len(original) == provenance.DIGEST_LENGTH
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "stale.py").write_text("x = 1\n")
    (copy / "notes.txt").write_text("not code\n")
    assert provenance.source_digest(copy) == original
    printed = subprocess.run([sys.executable, "-m", "vllm_oscar.provenance", str(copy)], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert printed == original
    plans = sorted((copy / "kernels" / "plans").glob("*.json"))
    assert plans, "the package ships plan tables"
    plans[0].write_text(plans[0].read_text() + " ")
    edited_plan = provenance.source_digest(copy)
    assert edited_plan != original
    (copy / "config.py").write_text((copy / "config.py").read_text() + "\n# edit\n")
    assert provenance.source_digest(copy) not in (original, edited_plan)


def test_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "vllm_oscar.provenance", str(tmp_path / "absent")],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "is not a directory: give the vllm_oscar folder" in result.stderr
