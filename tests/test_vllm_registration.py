"""Plugin registration without an engine: entry point, idempotence, pickling, selection."""

from __future__ import annotations

import pickle
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

from vllm_oscar.attention.registration import BACKEND_CLASS_PATH, oscar_backend_member, register, select_oscar
from vllm_oscar.config import ATTENTION_BACKEND_ENV, BACKEND_NAME, DEFAULT_MAX_NUM_SEQS

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


def test_oscar_sets_max_num_seqs_only_where_the_user_did_not(monkeypatch):
    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    unset = _args(kv_cache_dtype="oscar", max_num_seqs=None)  # vLLM's default would reserve windows for 1024
    select_oscar(unset)
    assert unset.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    chosen = _args(kv_cache_dtype="oscar", max_num_seqs=1024)
    select_oscar(chosen)
    assert chosen.max_num_seqs == 1024
    other = _args(max_num_seqs=None)
    select_oscar(other)
    assert other.max_num_seqs is None  # not OSCAR: vLLM's default stays


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
    the budget are refused with what they hold and a max_num_seqs whose stores take at most half the budget; smaller
    ones come out of it. Stores are counted in window blocks (window_store.window_capacity_blocks) of equal size."""
    from vllm_oscar.attention import backend, registration
    from vllm_oscar.attention.window_store import window_capacity_blocks

    budget, block_bytes, bs = 1 << 30, 1 << 20, 16  # 1 MiB per window block over all layers
    def stores(num_seqs: int, step_tokens: int) -> int:
        return window_capacity_blocks(num_seqs, step_tokens, bs, 64, 256) * block_bytes

    def worker(num_seqs: int, step_tokens: int) -> SimpleNamespace:
        monkeypatch.setattr(backend, "window_store_bytes_of_worker", lambda config: (stores(num_seqs, step_tokens), 0))
        return SimpleNamespace(
            vllm_config=SimpleNamespace(
                scheduler_config=SimpleNamespace(max_num_seqs=num_seqs, max_num_batched_tokens=step_tokens),
                cache_config=SimpleNamespace(block_size=bs), additional_config={}),
            cache_config=SimpleNamespace(kv_cache_memory_bytes=budget, block_size=bs))

    # 22 blocks per request (4 sink + 16 recent + 2), 128 for a step of 2048 tokens: (512 - 128) // 22 = 17 requests
    with pytest.raises(ValueError, match=r"max_num_seqs=256 requests \(22\.0 MiB each\).*max_num_batched_tokens="
                                         r"2048 \(0\.12 GiB\).*--max-num-seqs 17 leaves"):
        registration._available_memory_less_window_stores(lambda self: budget, worker(256, 2048))
    left = registration._available_memory_less_window_stores(lambda self: budget, worker(17, 2048))
    assert left == budget - stores(17, 2048) and left >= budget // 2 > budget - stores(18, 2048)
    with pytest.raises(ValueError, match="lower max_num_batched_tokens"):  # one step's tokens alone take half
        registration._available_memory_less_window_stores(lambda self: budget, worker(8, 16384))
