"""`vllm-oscar env` (vllm_oscar.environment): the facts it reports against independent sources, and each problem it
must find (a plugin vLLM cannot see, vLLM failing to import, a bad plan table, a damaged shipped rotation file)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

import vllm_oscar
from vllm_oscar import environment
from vllm_oscar.cli import main


@pytest.fixture(autouse=True)
def _no_plan_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OSCAR_DECODE_PLANS", raising=False)


def test_report_matches_this_machine(tmp_path) -> None:
    from vllm_oscar.calibration.files import load_rotation_file, shipped_rotation_dirs

    out = tmp_path / "env.json"
    assert main(["env", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["versions"]["torch"] == importlib.metadata.version("torch")
    assert data["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert data["plugin"] == "vllm_oscar:register"
    assert data["package_dir"] == str(Path(vllm_oscar.__file__).resolve().parent)
    assert data["vllm_import"] == "ok"
    assert data["problems"] == []
    assert len(data["devices"]) == torch.cuda.device_count()
    if not torch.cuda.is_available():
        assert data["kernels"].startswith("CPU")
    shipped = sorted(p for d in shipped_rotation_dirs() for p in d.glob("*.safetensors"))
    assert shipped, "the checkout ships at least one rotation file"
    assert data["rotation_files"] == {str(p): load_rotation_file(p).identity.describe() for p in shipped}
    assert "NVIDIA_H200.json" in data["shipped_plan_tables"]


def test_missing_plugin_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    report = environment.collect()
    assert report.plugin is None
    assert any("no 'oscar' plugin" in p.what and "pip install" in p.fix for p in report.problems)


def test_vllm_import_failure_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def failing(name: str, *args, **kwargs):
        if name == "vllm":
            raise ImportError("planted failure")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", failing)
    report = environment.collect()
    assert "planted failure" in report.vllm_import
    problem = next(p for p in report.problems if p.what.startswith("import vllm fails"))
    assert "planted failure" in problem.what and problem.fix


def test_bad_plan_table_is_a_problem(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU the table is checked against the device instead (tests/test_measured_plans.py)")
    table = tmp_path / "plans.json"
    table.write_text("{not json")
    monkeypatch.setenv("VLLM_OSCAR_DECODE_PLANS", str(table))
    assert main(["env"]) == 1
    text = capsys.readouterr().out
    assert "problems (1):" in text and str(table) in text and "not valid JSON" in text
    assert f"VLLM_OSCAR_DECODE_PLANS={table}" in text


def test_damaged_rotation_file_is_a_problem(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_oscar.calibration import files

    damaged = tmp_path / "Broken.safetensors"
    damaged.write_bytes(b"\x00" * 64)
    monkeypatch.setattr(files, "shipped_rotation_dirs", lambda: [tmp_path])
    report = environment.collect()
    assert report.rotation_files == {}
    assert any(str(damaged) in p.what and "reinstall" in p.fix for p in report.problems)


def test_another_copy_elsewhere_is_a_problem(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "vllm_oscar"
    other.mkdir()
    (other / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # what a fresh process started elsewhere imports first
    report = environment.collect()
    assert report.package_dir_elsewhere == str(other.resolve())
    assert any(str(other.resolve()) in p.what and "pip install -e" in p.fix for p in report.problems)


def test_no_import_elsewhere_is_a_problem(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "vllm_oscar"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise ImportError('planted: not installed')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    report = environment.collect()
    assert report.package_dir_elsewhere.startswith("error: ") and "planted" in report.package_dir_elsewhere
    assert any("cannot be imported" in p.what and "planted" in p.what for p in report.problems)


def _config_folder(folder: Path, head_dim: int = 64, **shapes) -> str:
    """A model folder holding only a config.json (what `env --model` reads): SmolLM2-135M's shapes by default."""
    from transformers import LlamaConfig

    fields = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, **shapes}
    LlamaConfig(hidden_size=fields["num_attention_heads"] * head_dim, head_dim=head_dim,
                architectures=["LlamaForCausalLM"], **fields).save_pretrained(folder)
    return str(folder)


def test_model_with_a_shipped_rotation_file(tmp_path) -> None:
    from vllm_oscar.calibration.files import find_shipped_rotation, load_rotation_file

    model = _config_folder(tmp_path / "SmolLM2-135M-Instruct")
    report = environment.collect(model)
    assert report.problems == []
    assert report.model.rotation_source == "shipped"
    shipped = Path(report.model.rotations)
    assert load_rotation_file(shipped).identity.num_kv_heads == 3
    assert shipped == find_shipped_rotation(load_rotation_file(shipped).identity)


@pytest.mark.parametrize("case", ["no file for this model", "a file for another model", "unsupported head size",
                                  "no configuration"])
def test_model_problems(tmp_path, case, capsys) -> None:
    from vllm_oscar.calibration.files import shipped_rotation_dirs

    shipped = next(p for d in shipped_rotation_dirs() for p in d.glob("*.safetensors"))
    other_shapes = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    argv, expected = {
        "no file for this model": ([_config_folder(tmp_path / "tiny", 128, **other_shapes)], "vllm-oscar calibrate"),
        "a file for another model": ([_config_folder(tmp_path / "tiny", 128, **other_shapes), "--rotations",
                                      str(shipped)], "num_kv_heads"),
        "unsupported head size": ([_config_folder(tmp_path / "odd", 48)], "head_dim=48 is not supported"),
        "no configuration": ([str(tmp_path / "missing")], "cannot be read"),
    }[case]
    args = ["env", "--model", argv[0], *argv[1:]]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert expected in out and "problems (" in out


def test_rotations_without_model_is_refused(capsys) -> None:
    assert main(["env", "--rotations", "x.safetensors"]) == 2
    assert "give --model too" in capsys.readouterr().err


def test_gpu_without_a_shipped_table_gets_the_command_that_makes_one() -> None:
    """A GPU model with no table in the package reads "the rules" and the tuning command naming its table file
    (the file name the loader looks for: measured_plans.table_file_name)."""
    from vllm_oscar.kernels.measured_plans import SHIPPED_TABLES, TABLE_ENV, table_file_name

    report = environment.collect()
    name = "NVIDIA A100-SXM4-80GB"
    assert not (SHIPPED_TABLES / table_file_name(name)).exists()
    gpu = environment.DeviceReport(0, name, "8.0", 108, 79.2, True, True, None)
    shipped = environment.DeviceReport(1, "NVIDIA H200", "9.0", 132, 139.8, True, True,
                                       str(SHIPPED_TABLES / "NVIDIA_H200.json"))
    lines = environment.report_lines(dataclasses.replace(report, devices=[gpu, shipped]))
    gpu_line = next(line for line in lines if line.startswith("GPU 0:"))
    assert "the rules" in gpu_line and "vllm-oscar bench plans" in gpu_line
    assert f"--out {table_file_name(name)}" in gpu_line and f"{TABLE_ENV}={table_file_name(name)}" in gpu_line
    shipped_line = next(line for line in lines if line.startswith("GPU 1:"))
    assert shipped_line.endswith("NVIDIA_H200.json") and "bench plans" not in shipped_line
    assert "FlashAttention prefill yes;" in gpu_line
    no_flash = dataclasses.replace(gpu, flash_prefill="torch 2.11.0 was built without FlashAttention")
    no_flash_line = next(line for line in environment.report_lines(dataclasses.replace(report, devices=[no_flash]))
                         if line.startswith("GPU 0:"))
    assert "FlashAttention prefill no (torch 2.11.0 was built without FlashAttention);" in no_flash_line
