"""Rotation files: round trip, every validation error, RotationZoo import, shipped-file
lookup, `vllm-oscar info`/`calibrate --import-rotationzoo`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_oscar.calibration import (
    LayerRotation,
    ModelIdentity,
    RotationSet,
    find_shipped_rotation,
    import_rotationzoo,
    load_rotation_file,
    read_rotation_metadata,
    save_rotation_file,
)
from vllm_oscar.cli import main

IDENTITY = ModelIdentity("LlamaForCausalLM", num_layers=3, num_query_heads=4, num_kv_heads=2, head_dim=16,
                         name="Tiny-Model-Instruct", weights_sha256="ab" * 32)


def random_rotations(generator: torch.Generator, heads: int, dim: int) -> torch.Tensor:
    """[heads, dim, dim] float32 orthogonal matrices (QR of Gaussian matrices, float64)."""
    q, _ = torch.linalg.qr(torch.randn(heads, dim, dim, generator=generator, dtype=torch.float64))
    return q.to(torch.float32).contiguous()


def random_set(identity: ModelIdentity = IDENTITY, seed: int = 0) -> RotationSet:
    generator = torch.Generator().manual_seed(seed)
    heads, dim = identity.num_kv_heads, identity.head_dim
    layers = []
    for index in range(identity.num_layers):
        eigen = torch.rand(2, heads, dim, generator=generator, dtype=torch.float64).sort(-1, descending=True).values
        layers.append(LayerRotation(random_rotations(generator, heads, dim), random_rotations(generator, heads, dim),
                                    eigen[0], eigen[1], clip_k=0.9 + 0.01 * index, clip_v=0.88))
    return RotationSet(identity, layers, {"method": {"value_form": "attention_output"}, "calibration": {"tokens": 7}})


def write_tensors(path: Path, source: Path, change: dict[str, torch.Tensor] | None = None,
                  metadata_change: dict[str, str] | None = None) -> Path:
    """Copy a rotation file with some tensors / metadata replaced (a hand-made bad file)."""
    with safe_open(str(source), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        metadata = dict(handle.metadata())
    tensors.update(change or {})
    metadata.update(metadata_change or {})
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.fixture
def saved(tmp_path: Path) -> tuple[RotationSet, Path]:
    rotation_set = random_set()
    return rotation_set, save_rotation_file(tmp_path / "tiny.safetensors", rotation_set)


def test_round_trip_keeps_tensors_clips_identity_and_metadata(saved) -> None:
    original, path = saved
    loaded = load_rotation_file(path, expected_identity=IDENTITY)
    assert loaded.identity == IDENTITY
    assert loaded.metadata == original.metadata
    assert loaded.clip_ratios == original.clip_ratios
    for a, b in zip(original.layers, loaded.layers):
        for field in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues"):
            assert torch.equal(getattr(a, field), getattr(b, field))
    metadata = read_rotation_metadata(path)
    assert metadata["format"] == "vllm_oscar.rotations" and metadata["format_version"] == "1"
    assert metadata["model.head_dim"] == "16" and json.loads(metadata["oscar"]) == original.metadata


def test_other_model_shape_names_both_shapes(saved) -> None:
    _, path = saved
    other = dataclasses.replace(IDENTITY, num_kv_heads=4, head_dim=32, num_query_heads=8)
    with pytest.raises(ValueError) as error:
        load_rotation_file(path, expected_identity=other)
    message = str(error.value)
    assert "(2, 16, 16)" in message and "(4, 32, 32)" in message and "vllm-oscar calibrate" in message


def test_same_shapes_other_name_only_warns(saved, caplog) -> None:
    _, path = saved
    load_rotation_file(path, expected_identity=dataclasses.replace(IDENTITY, name="Other-Model"))
    assert "Other-Model" in caplog.text


def test_non_orthogonal_matrix_is_rejected(saved, tmp_path: Path) -> None:
    original, path = saved
    # scaling column 5 by (1 + delta) makes (R^T R)[5, 5] = (1 + delta)^2: error ~ 2 delta
    for delta, accepted in ((2e-4, True), (1e-3, False)):
        bad = original.layers[1].v_rotation.clone()
        bad[0, :, 5] *= 1.0 + delta
        target = write_tensors(tmp_path / "bad.safetensors", path, {"layers.1.v_rotation": bad})
        if accepted:
            load_rotation_file(target)
            continue
        with pytest.raises(ValueError, match=r"layer 1 v_rotation is not orthogonal.*> 0.001"):
            load_rotation_file(target)


def test_nan_and_inf_are_rejected(saved, tmp_path: Path) -> None:
    original, path = saved
    for name, value in (("layers.0.k_rotation", float("nan")), ("layers.2.k_eigenvalues", float("inf"))):
        tensor = getattr(original.layers[int(name.split(".")[1])], name.split(".")[2]).clone()
        tensor.view(-1)[0] = value
        target = write_tensors(tmp_path / "nan.safetensors", path, {name: tensor})
        with pytest.raises(ValueError, match="NaN or Inf"):
            load_rotation_file(target)


def test_bad_clip_ratio_and_missing_tensor(saved, tmp_path: Path) -> None:
    _, path = saved
    target = write_tensors(tmp_path / "clip.safetensors", path,
                           {"clip_v": torch.tensor([0.9, 1.5, 0.9], dtype=torch.float64)})
    with pytest.raises(ValueError, match="clip_v"):
        load_rotation_file(target)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {n: handle.get_tensor(n) for n in handle.keys() if n != "layers.2.v_rotation"}
        metadata = handle.metadata()
    save_file(tensors, str(tmp_path / "missing.safetensors"), metadata=metadata)
    with pytest.raises(ValueError, match="layers.2.v_rotation"):
        load_rotation_file(tmp_path / "missing.safetensors")


def test_truncated_and_foreign_files_are_rejected(saved, tmp_path: Path) -> None:
    _, path = saved
    data = path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_rotation_file(truncated)
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a rotation file")
    with pytest.raises(ValueError, match="not valid safetensors"):
        load_rotation_file(text)
    pt = tmp_path / "zoo.pt"
    torch.save({"format_version": 2, "layers": {}}, pt)
    with pytest.raises(ValueError, match="torch.save"):
        load_rotation_file(pt)
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="metadata format"):
        load_rotation_file(plain)
    with pytest.raises(FileNotFoundError, match="vllm-oscar calibrate"):
        load_rotation_file(tmp_path / "absent.safetensors")
    assert path.read_bytes() == data  # nothing was touched


def test_unknown_format_version_is_rejected(saved, tmp_path: Path) -> None:
    _, path = saved
    target = write_tensors(tmp_path / "v9.safetensors", path, metadata_change={"format_version": "9"})
    with pytest.raises(ValueError, match="format_version '9'.*reads version 1"):
        load_rotation_file(target)


def test_save_refuses_an_invalid_set(tmp_path: Path) -> None:
    rotation_set = random_set()
    rotation_set.layers[0].k_rotation = rotation_set.layers[0].k_rotation * 1.01
    with pytest.raises(ValueError, match="not orthogonal"):
        save_rotation_file(tmp_path / "x.safetensors", rotation_set)
    assert not list(tmp_path.iterdir())


def write_zoo(path: Path, version: int, rotations: list[torch.Tensor], eigen: list[torch.Tensor],
              objective: str) -> Path:
    layers = {index: {"rotation": r, "eigenvalues": e} for index, (r, e) in enumerate(zip(rotations, eigen))}
    torch.save({"format_version": version, "objective": objective, "layers": layers}, path)
    return path


def test_rotationzoo_v2_import_round_trips(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    k = [random_rotations(generator, 2, 16) for _ in range(3)]
    v = [random_rotations(generator, 2, 16) for _ in range(3)]
    eig = [torch.rand(2, 16, generator=generator) for _ in range(3)]
    k_path = write_zoo(tmp_path / "k.pt", 2, k, eig, "qqt_r_h_pbr")
    v_path = write_zoo(tmp_path / "v.pt", 2, v, eig, "sst_r_h_pbr")
    imported = import_rotationzoo(k_path, v_path, IDENTITY)
    for index, layer in enumerate(imported.layers):
        assert torch.equal(layer.k_rotation, k[index]) and torch.equal(layer.v_rotation, v[index])
        assert torch.equal(layer.k_eigenvalues, eig[index].double())
        assert (layer.clip_k, layer.clip_v) == (0.96, 0.92)
    assert imported.metadata["method"]["granularity"] == "kv_head"
    assert imported.metadata["method"]["value_objective"] == "sst_r_h_pbr"
    saved = save_rotation_file(tmp_path / "imported.safetensors", imported)
    assert torch.equal(load_rotation_file(saved, IDENTITY).layers[2].v_rotation, v[2])


def test_rotationzoo_v1_is_one_matrix_per_layer_for_every_head(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(4)
    k = [random_rotations(generator, 1, 16)[0] for _ in range(3)]
    eig = [torch.rand(16, generator=generator) for _ in range(3)]
    path = write_zoo(tmp_path / "k1.pt", 1, k, eig, "qqt_r_h_pbr")
    imported = import_rotationzoo(path, path, IDENTITY)
    assert imported.layers[1].k_rotation.shape == (2, 16, 16)
    assert torch.equal(imported.layers[1].k_rotation[1], k[1]) and torch.equal(imported.layers[1].k_rotation[0], k[1])
    assert imported.metadata["method"]["granularity"] == "layer"


def test_rotationzoo_errors(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    good = [random_rotations(generator, 2, 16) for _ in range(3)]
    eig = [torch.rand(2, 16) for _ in range(3)]
    wrong_version = write_zoo(tmp_path / "v3.pt", 3, good, eig, "qqt_r_h_pbr")
    with pytest.raises(ValueError, match="format_version 3"):
        import_rotationzoo(wrong_version, wrong_version, IDENTITY)
    wrong_shape = write_zoo(tmp_path / "shape.pt", 2, [r[:, :8, :8] for r in good], [e[:, :8] for e in eig], "qqt")
    with pytest.raises(ValueError, match=r"\(2, 8, 8\).*needs \(2, 16, 16\)"):
        import_rotationzoo(wrong_shape, wrong_shape, IDENTITY)
    too_few = write_zoo(tmp_path / "few.pt", 2, good[:2], eig[:2], "qqt")
    with pytest.raises(ValueError, match="layers 0..2"):
        import_rotationzoo(too_few, too_few, IDENTITY)
    scaled = write_zoo(tmp_path / "scaled.pt", 2, [r * 1.1 for r in good], eig, "qqt")
    with pytest.raises(ValueError, match="not orthogonal"):
        import_rotationzoo(scaled, scaled, IDENTITY)
    (tmp_path / "junk.pt").write_bytes(b"\x00junk")
    with pytest.raises(ValueError, match="weights_only"):
        import_rotationzoo(tmp_path / "junk.pt", tmp_path / "junk.pt", IDENTITY)


def test_find_shipped_rotation_by_identity(tmp_path: Path) -> None:
    base = dataclasses.replace(IDENTITY, name="Tiny-Model")
    save_rotation_file(tmp_path / "a.safetensors", random_set(base))
    save_rotation_file(tmp_path / "b.safetensors", random_set(IDENTITY))
    (tmp_path / "broken.safetensors").write_text("junk")
    query = dataclasses.replace(IDENTITY, name="/root/.cache/vllm_oscar/tiny-model-instruct")
    assert find_shipped_rotation(query, [tmp_path]) == tmp_path / "b.safetensors"
    assert (find_shipped_rotation(dataclasses.replace(IDENTITY, name="tiny_model"), [tmp_path])
            == tmp_path / "a.safetensors")
    assert find_shipped_rotation(dataclasses.replace(query, head_dim=32), [tmp_path]) is None
    assert find_shipped_rotation(dataclasses.replace(query, name="Other"), [tmp_path]) is None


def test_info_command_prints_a_summary(saved, capsys) -> None:
    _, path = saved
    assert main(["info", str(path), "--layers"]) == 0
    out = capsys.readouterr().out
    assert "Tiny-Model-Instruct (LlamaForCausalLM, 3 layers, 4 q / 2 kv heads, D=16)" in out
    assert "0.920" in out and "orthogonality" in out


def test_commands_report_bad_input_as_an_error_line(tmp_path: Path, capsys) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_text("junk")
    assert main(["info", str(junk)]) == 2
    assert "vllm-oscar info: error:" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(tmp_path / "absent"), "--data", str(junk),
                 "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["calibrate", "--model", "x", "--out", str(tmp_path / "o")]) == 2
    assert "--data FILE" in capsys.readouterr().err


def test_calibrate_command_imports_rotationzoo(tmp_path: Path, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_hidden_layers=3, architectures=["LlamaForCausalLM"])
    folder = tmp_path / "Tiny-Model-Instruct"
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(6)
    k = write_zoo(tmp_path / "k.pt", 2, [random_rotations(generator, 2, 16) for _ in range(3)],
                  [torch.rand(2, 16) for _ in range(3)], "qqt_r_h_pbr")
    out = tmp_path / "zoo.safetensors"
    assert main(["calibrate", "--model", str(folder), "--import-rotationzoo", str(k), str(k), "--out", str(out)]) == 0
    loaded = load_rotation_file(out, dataclasses.replace(IDENTITY, weights_sha256=""))
    assert loaded.identity.name == "Tiny-Model-Instruct"
