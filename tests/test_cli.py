"""The `vllm-oscar` console script and its dispatcher."""

import shutil
import subprocess
import sys

from vllm_oscar.cli import main


def test_bits_command_prints_method_md_figures(capsys) -> None:
    assert main(["bits", "--head-dim", "128", "--context", "131072", "32768"]) == 0
    out = capsys.readouterr().out
    assert "body 2.2500 bits/element" in out
    assert "2.2836" in out and "2.3843" in out


def test_console_script_is_installed() -> None:
    script = shutil.which("vllm-oscar")
    assert script is not None, "`vllm-oscar` is not on PATH: install the package (scripts/install-cpu.sh)"
    result = subprocess.run([script, "bits", "--head-dim", "64"], capture_output=True, text=True, check=True)
    assert "body 2.5000" in result.stdout


def test_import_needs_no_vllm() -> None:
    code = "import sys, vllm_oscar, vllm_oscar.quant, vllm_oscar.cli; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
