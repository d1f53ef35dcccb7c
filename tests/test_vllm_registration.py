"""Plugin registration without an engine: entry point, idempotence, pickling, selection."""

from __future__ import annotations

import pickle
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from vllm_oscar.attention.registration import BACKEND_CLASS_PATH, oscar_backend_member, register, select_oscar
from vllm_oscar.config import ATTENTION_BACKEND_ENV, BACKEND_NAME

pytestmark = pytest.mark.vllm


def test_entry_point_is_installed():
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins.get("oscar") == "vllm_oscar:register"


def test_register_is_idempotent_and_registers_the_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register()
    register()
    member = AttentionBackendEnum[BACKEND_NAME]
    assert member.get_path() == BACKEND_CLASS_PATH
    assert member.get_class().get_name() == BACKEND_NAME


def test_enum_member_unpickles_in_a_process_that_has_not_loaded_plugins():
    payload = pickle.dumps({"backend": oscar_backend_member()})
    code = ("import pickle, sys; from vllm.v1.attention.backends.registry import AttentionBackendEnum; "
            "assert 'OSCAR' not in AttentionBackendEnum.__members__; "
            "print(pickle.loads(sys.stdin.buffer.read())['backend'].get_path())")
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=300,
                          env={"VLLM_PLUGINS": "", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip().splitlines()[-1] == BACKEND_CLASS_PATH


def _args(**kw):
    base = dict(kv_cache_dtype="auto", attention_backend=None, attention_config=SimpleNamespace(backend=None))
    return SimpleNamespace(**{**base, **kw})


def test_selection_rules(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    plain = _args()
    select_oscar(plain)
    assert plain.attention_backend is None and plain.kv_cache_dtype == "auto"

    by_dtype = _args(kv_cache_dtype="oscar")
    select_oscar(by_dtype)
    assert (by_dtype.attention_backend, by_dtype.kv_cache_dtype) == (BACKEND_NAME, "auto")

    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "oscar")
    by_env = _args()
    select_oscar(by_env)
    assert by_env.attention_backend == BACKEND_NAME

    with pytest.raises(ValueError, match="cannot be combined"):
        select_oscar(_args(kv_cache_dtype="fp8"))
    with pytest.raises(ValueError, match="needs the OSCAR attention backend"):
        select_oscar(_args(attention_backend="FLEX_ATTENTION"))


def test_cpu_platform_returns_oscar_only_when_asked_and_checks_the_layer():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    register()
    import torch

    def config(head_size: int, **kw):
        return AttentionSelectorConfig(head_size=head_size, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                       block_size=16, **kw)

    member = oscar_backend_member()
    assert CpuPlatform.get_attn_backend_cls(member, config(128)) == BACKEND_CLASS_PATH
    assert CpuPlatform.get_attn_backend_cls(None, config(128)).endswith("CPUAttentionBackend")
    with pytest.raises(ValueError, match="head size 80 is not supported"):
        CpuPlatform.get_attn_backend_cls(member, config(80))
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        CpuPlatform.get_attn_backend_cls(member, config(64, has_sliding_window=True))


def test_window_stores_over_the_budget_say_how_many_requests_fit(monkeypatch):
    """The KV budget less the window stores (registration._available_memory_less_window_stores): stores larger than
    the budget are refused with the per-request size and a max_num_seqs that leaves half the budget; smaller ones
    come out of it."""
    from vllm_oscar.attention import backend, registration

    budget, per_request, requests = 1 << 30, 7 << 20, 256
    monkeypatch.setattr(backend, "window_store_bytes_of_worker", lambda config: (requests * per_request, 0))
    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=requests)),
        cache_config=SimpleNamespace(kv_cache_memory_bytes=budget, block_size=16))
    with pytest.raises(ValueError, match=r"max_num_seqs=256 requests, ~7\.0 MiB each.*--max-num-seqs; 73 leaves"):
        registration._available_memory_less_window_stores(lambda self: budget, worker)
    worker.vllm_config.scheduler_config.max_num_seqs = 73
    monkeypatch.setattr(backend, "window_store_bytes_of_worker", lambda config: (73 * per_request, 0))
    left = registration._available_memory_less_window_stores(lambda self: budget, worker)
    assert left == budget - 73 * per_request and left >= budget // 2
