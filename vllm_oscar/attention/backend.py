"""The OSCAR attention backend for vLLM: backend, KV spec, metadata builder, impl.

Shape of vLLM's own backends (triton_attn.py, cpu_attn.py): a metadata dataclass, a
builder that turns vLLM's CommonAttentionMetadata into it once per step, the backend
class vLLM selects, and the impl that each attention layer calls. The math lives in
vllm_oscar.kernels (Triton on CUDA, torch on CPU); the BF16 window bookkeeping in
vllm_oscar.attention.window_store. Data flow and layouts: docs/design.md.

KV cache of one layer, as vLLM allocates it from ``customize_spec``: uint8
``[num_blocks, Hkv, block_size, token_bytes]`` (layout LBHNC), viewed by the kernels as
``[num_blocks, Hkv, block_size * token_bytes]`` (vllm_oscar.kernels.layout.PageLayout:
six planes per block and head). token_bytes = 72 for D=128, 40 for D=64 (fp16 scales).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import ClassVar, Optional

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheLayout

from vllm_oscar.attention import window_store
from vllm_oscar.attention.parallel import current_kv_head_slice
from vllm_oscar.attention.rotations import LayerRotations, layer_rotations, log_rotation_choice
from vllm_oscar.attention.settings import current_oscar_config
from vllm_oscar.attention.step import LayerCaches, OscarMetadata, layer_step
from vllm_oscar.attention.step_buffers import WindowPlanBuffers
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.config import (
    BACKEND_NAME,
    GPU_DECODE_BLOCK_SIZE,
    INT8_MMA_MIN_HEAD_DIM,
    KERNEL_BLOCK_MULTIPLE,
    KV_CACHE_DTYPE_NAME,
    OscarConfig,
)
from vllm_oscar.kernels import PageLayout
from vllm_oscar.kernels.flash_plan import PrefillPlan, flash_unavailable

# Under "vllm." so that vLLM's log handlers and level apply to the plugin too.
logger = logging.getLogger(f"vllm.{__name__}")

#: Head sizes the kernels are built and tested for.
SUPPORTED_HEAD_SIZES: tuple[int, ...] = (64, 128, 256)


def platform_is_cuda() -> bool:
    """True on vLLM's CUDA platform (NVIDIA GPUs), where OSCAR prefers blocks of GPU_DECODE_BLOCK_SIZE."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def page_layout(head_size: int, block_size: int, config: OscarConfig) -> PageLayout:
    """The INT2 page layout of a layer."""
    return PageLayout(head_size, config.resolved_group_size(head_size), block_size, config.scale_dtype)


def replay_tokens(block_size: int, config: OscarConfig) -> int:
    """Tokens of a prefix-cache hit that vLLM recomputes: the recent window, block aligned.

    A hit ends on a block boundary h and the request has >= 1 more token, so replaying
    round_up(recent, bs) tokens rebuilds (in BF16) every cached position of its recent
    window: h - round_up(recent, bs) <= floor((L - recent) / bs) * bs for all L > h.
    """
    return -(-config.recent_tokens // block_size) * block_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class OscarAttentionSpec(FullAttentionSpec):
    """Full-attention pages of packed INT2 K/V, with the recent window replayed on a hit."""

    replay_tokens: int = 0

    @property
    def prefix_replay_tokens(self) -> int:
        return self.replay_tokens

    @classmethod
    def merge(cls, specs: list["OscarAttentionSpec"]) -> "OscarAttentionSpec":
        replays = {spec.replay_tokens for spec in specs}
        if len(replays) != 1:
            raise ValueError(f"OSCAR layers of one KV cache group disagree on replay tokens: {sorted(replays)}.")
        return dataclasses.replace(super().merge(specs), replay_tokens=replays.pop())


class OscarAttentionBackend(AttentionBackend):
    """Attention over a 2-bit rotated KV cache with BF16 sink and recent windows."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", KV_CACHE_DTYPE_NAME]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["OscarAttentionImpl"]:
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["OscarMetadataBuilder"]:
        return OscarMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(KERNEL_BLOCK_MULTIPLE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The KV cache block size OSCAR asks vLLM for when the user gave no ``--block-size``.

        GPU_DECODE_BLOCK_SIZE (64) on CUDA when vLLM offers its default (16): the decode then reads
        each (block, KV head) page region of a 64-position tile in one piece (2-9% faster at long
        contexts, batch >= 8, on an H200; docs/decisions.md). Elsewhere, or for any other default,
        vLLM's own rule (the default, as every multiple of 16 is supported). vLLM 0.32 asks only
        when ``--block-size`` was not given (``Platform.update_block_size_for_backend``, after the
        model is loaded; the impls size their pages and window stores later, at their first forward).
        """
        from vllm.config.cache import CacheConfig

        if default_block_size == CacheConfig.DEFAULT_BLOCK_SIZE and platform_is_cuda():
            return GPU_DECODE_BLOCK_SIZE
        return super().get_preferred_block_size(default_block_size)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pages hold token_bytes per (token, KV head): INT2 codes + scale/offset of K and V."""
        if isinstance(spec, OscarAttentionSpec) or not isinstance(spec, FullAttentionSpec):
            return spec
        config = _process_config()
        layout = page_layout(spec.head_size, KERNEL_BLOCK_MULTIPLE, config)
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
        fields.update(dtype=torch.uint8, state_content_bytes=layout.token_bytes,
                      replay_tokens=replay_tokens(spec.block_size, config))
        return OscarAttentionSpec(**fields)


#: The OSCAR options of this process, recorded when the first OSCAR layer is built.
_config_of_process: Optional[OscarConfig] = None


def _process_config() -> OscarConfig:
    """The OSCAR options of this worker (vLLM calls customize_spec outside a config context)."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        return current_oscar_config(vllm_config)
    if _config_of_process is None:
        raise RuntimeError("OSCAR: the KV cache spec was requested before any OSCAR layer was built.")
    return _config_of_process


def check_no_speculative_decoding(vllm_config: VllmConfig) -> None:
    """Speculative decoding is refused at start-up: its verify rows run as OSCAR's prefill part, whose window plan
    and FlashAttention ranges are built from vLLM's host seq_lens, which vLLM documents as optimistic for those rows
    under async scheduling (every draft counted as accepted), and no OSCAR test covers it."""
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        method = getattr(speculative, "method", None)
        raise ValueError(f"The OSCAR KV cache does not support speculative decoding (got method {method!r}): remove "
                         "--speculative-config / speculative_config, or serve without kv_cache_dtype oscar.")


def check_int8_keys(config: OscarConfig, layout: PageLayout, device: torch.device) -> None:
    """int8_keys=True where the int8 key path cannot run is an error at start-up, not at the first decode."""
    if not config.int8_keys:
        return
    if device.type != "cuda" or layout.head_dim < INT8_MMA_MIN_HEAD_DIM or layout.group_size != layout.head_dim:
        raise ValueError(
            f"OSCAR option int8_keys=true needs the CUDA decode with head_dim >= {INT8_MMA_MIN_HEAD_DIM} and one "
            f"scale group per head vector; this layer runs on {device.type} with head_dim {layout.head_dim}, "
            f"group_size {layout.group_size}. Remove the option (the default uses it where it applies) or set "
            f"it to false.")


def check_flash_prefill(config: OscarConfig, layout: PageLayout, device: torch.device) -> None:
    """flash_prefill=True where FlashAttention prefill cannot run is an error at start-up, not at the first prefill."""
    if not config.flash_prefill:
        return
    reason = flash_unavailable(device, layout.head_dim, config.recent_tokens)
    if reason is not None:
        raise ValueError(f"OSCAR option flash_prefill=true needs FlashAttention prefill, which cannot run here "
                         f"({reason}). Remove the option (the default uses it on large calls where it runs) or set "
                         f"it to false.")


def unsupported_reasons(head_size: int, use_mla: bool, has_sliding_window: bool, attn_type: str,
                        use_sparse: bool = False, has_sink: bool = False) -> list[str]:
    """Why OSCAR cannot serve a layer, each with what to use instead ([] when it can)."""
    reasons = []
    if head_size not in SUPPORTED_HEAD_SIZES:
        reasons.append(
            f"head size {head_size} is not supported (OSCAR kernels: {list(SUPPORTED_HEAD_SIZES)}); "
            "serve this model without OSCAR (default backend, or --kv-cache-dtype fp8)")
    if use_mla:
        reasons.append("MLA attention is not supported; use vLLM's MLA backends (drop OSCAR)")
    if use_sparse:
        reasons.append("sparse attention is not supported; drop OSCAR for this model")
    if has_sliding_window:
        reasons.append("sliding-window attention is not supported; drop OSCAR for this model")
    if has_sink:
        reasons.append("learned attention sinks are not supported; drop OSCAR for this model")
    if attn_type != AttentionType.DECODER:
        reasons.append(
            f"attention type {attn_type!r} is not supported (decoder self-attention only: no "
            "encoder-decoder or encoder-only models); drop OSCAR for this model")
    return reasons


def block_size_hint(block_size: int, device: torch.device, user_specified: bool) -> Optional[str]:
    """The start-up suggestion to serve with GPU_DECODE_BLOCK_SIZE-position blocks, or None (not a GPU,
    a block size the user chose, or one that already is a multiple of it).

    OSCAR asks vLLM for blocks of GPU_DECODE_BLOCK_SIZE on CUDA (``get_preferred_block_size``), but vLLM
    keeps its default when the model also has layers of another attention backend, and may change the
    size to fit mamba layers or other KV dtypes; this says so, once, when it happened.
    """
    if device.type != "cuda" or user_specified or block_size % GPU_DECODE_BLOCK_SIZE == 0:
        return None
    return (f"OSCAR: KV cache blocks of {block_size} positions, not the {GPU_DECODE_BLOCK_SIZE} OSCAR prefers on "
            f"a GPU (vLLM chose this size for the model's other attention backends or mamba layers); if the "
            f"model accepts it, pass --block-size {GPU_DECODE_BLOCK_SIZE} for faster long-context decode (2-9% on "
            f"an H200 at batch >= 8: each (block, KV head) page region is then read in one piece; "
            f"docs/decisions.md).")


@functools.lru_cache(maxsize=None)
def _log_block_size_hint(hint: str) -> None:
    logger.info(hint)


def window_geometry(vllm_config: VllmConfig, config: OscarConfig) -> tuple[int, int]:
    """(window blocks, block size) of this engine's window store."""
    block_size = vllm_config.cache_config.block_size
    scheduler = vllm_config.scheduler_config
    capacity = window_store.window_capacity_blocks(
        scheduler.max_num_seqs, scheduler.max_num_batched_tokens, block_size, config.sink_tokens,
        config.recent_tokens)
    return capacity, block_size


def window_store_bytes_of_worker(vllm_config: VllmConfig) -> tuple[int, int]:
    """(planned, allocated) bytes of the window stores of every OSCAR layer of this worker: planned at
    the engine's block size, allocated so far (each layer allocates its store at its first forward)."""
    impls = [layer.impl for layer in vllm_config.compilation_config.static_forward_context.values()
             if isinstance(getattr(layer, "impl", None), OscarAttentionImpl)]
    planned = sum(impl.window_store_bytes() for impl in impls)
    allocated = sum(t.nbytes for impl in impls for t in (impl.window_k, impl.window_v) if t is not None)
    return planned, allocated


class OscarMetadataBuilder(AttentionMetadataBuilder[OscarMetadata]):
    """Builds OscarMetadata, mapping the step's window blocks (host side).

    Full CUDA graphs for pure single-token decode batches (UNIFORM_SINGLE_TOKEN_DECODE, vLLM's
    FULL_AND_PIECEWISE default then captures decode attention; mixed batches run it eagerly between
    graph pieces): every tensor the kernels read lives at a fixed address (vLLM's step buffers, and
    the window plan written into WindowPlanBuffers each step), and a captured graph is built for
    the longest context (max_seq_len = max_model_len, which only sizes the split count).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_no_speculative_decoding(vllm_config)
        config = current_oscar_config(vllm_config)
        capacity, block_size = window_geometry(vllm_config, config)
        if kv_cache_spec.block_size != block_size:
            raise ValueError(
                f"OSCAR sized its window store for block size {block_size} but the KV cache uses "
                f"{kv_cache_spec.block_size}; pass --block-size explicitly (a multiple of {KERNEL_BLOCK_MULTIPLE}).")
        self.manager = window_store.shared_manager(capacity, block_size, config.sink_tokens, config.recent_tokens)
        scheduler = vllm_config.scheduler_config
        self.window_buffers = WindowPlanBuffers(scheduler.max_num_seqs, scheduler.max_num_batched_tokens, device)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.recent_tokens = config.recent_tokens
        #: Whether a step's prefill part may run as FlashAttention (then each step plans its ranges on the host).
        self.plans_flash_prefill = config.flash_prefill is not False and flash_unavailable(
            torch.device(device), kv_cache_spec.head_size, config.recent_tokens) is None
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OscarMetadata:
        cam = common_attn_metadata
        num_reqs = cam.num_reqs
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(cam, decode_threshold=1)
        starts = cam.query_start_loc_cpu[: num_reqs + 1]
        seq_lens_cpu = cam.seq_lens_cpu_upper_bound if cam.seq_lens_cpu_upper_bound is not None else cam.seq_lens.cpu()
        block_table = cam.block_table_tensor[:num_reqs]
        plan = self.manager.plan(block_table.cpu(), seq_lens_cpu[:num_reqs].tolist(), starts.diff().tolist())
        num_tokens = max(cam.num_actual_tokens, int(starts[-1]))  # with a CUDA graph's padding tokens
        window_block_table, window_slot_mapping = self.window_buffers.load(plan, num_tokens)
        has_prefill = num_reqs > num_decodes
        prefill_plan = None
        if has_prefill and self.plans_flash_prefill:  # seq_lens_cpu is exact for prefill rows (vLLM's docstring)
            prefill_starts = (starts[num_decodes:] - num_decode_tokens).tolist()
            prefill_plan = PrefillPlan.of(prefill_starts, seq_lens_cpu[num_decodes:num_reqs].tolist(),
                                          self.recent_tokens, self.window_buffers.device)
        return OscarMetadata(
            num_actual_tokens=num_tokens,
            num_decodes=num_decodes,
            max_seq_len=cam.max_seq_len,
            max_query_len=cam.max_query_len,
            block_table=block_table,
            window_block_table=window_block_table,
            seq_lens=cam.seq_lens[:num_reqs],
            prefill_query_start_loc=cam.query_start_loc[num_decodes: num_reqs + 1] - num_decode_tokens,
            window_slot_mapping=window_slot_mapping,
            serial_write=self.window_buffers.serial_write,
            prefill_max_seq_len=int(seq_lens_cpu[num_decodes:num_reqs].max()) if has_prefill else None,
            prefill_plan=prefill_plan,
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> OscarMetadata:
        """build() with the decode split count sized for max_model_len (one graph serves every context), and
        the decode launches that pay only in a graph (TMA tile loads: OscarMetadata.cuda_graph)."""
        metadata = self.build(common_prefix_len=0, common_attn_metadata=common_attn_metadata)
        return dataclasses.replace(metadata, max_seq_len=max(metadata.max_seq_len, self.max_model_len),
                                   cuda_graph=True)


def served_model_identity(model_config) -> ModelIdentity:
    """The identity of the served model, named by the class vLLM instantiates (e.g.
    "LlamaForCausalLM", as calibration names it; vLLM reports "LlamaModel" for a config
    without ``architectures``) and by its path."""
    from vllm.model_executor.model_loader.utils import get_model_architecture

    identity = ModelIdentity.from_hf_config(model_config.hf_text_config, name=str(model_config.model))
    model_class, _ = get_model_architecture(model_config)
    return dataclasses.replace(identity, architecture=model_class.__name__)


def _layer_name_of(impl: "OscarAttentionImpl", vllm_config: VllmConfig) -> str:
    """The name of the attention layer that owns ``impl`` (vLLM gives impls no name)."""
    for name, layer in vllm_config.compilation_config.static_forward_context.items():
        if getattr(layer, "impl", None) is impl:
            return name
    raise RuntimeError("OSCAR: could not find the attention layer of an impl in the forward context.")


class OscarAttentionImpl(AttentionImpl[OscarMetadata]):
    """One attention layer: writes INT2 + BF16 window copies, attends in the rotated basis.

    The query is rotated by R_K of its KV head (q.k = (qR).(kR)); the output, an average of
    rotated values, is un-rotated once per head by R_V^T, unless the plugin folded R_V into the
    model's W_o (and W_v) at load (vllm_oscar.attention.fold; ``rotations.output_rotated`` /
    ``value_prerotated``), which saves that launch per layer step.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int], kv_cache_dtype: str,
                 logits_soft_cap: Optional[float] = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None, **kwargs) -> None:
        reasons = unsupported_reasons(head_size, False, sliding_window is not None, attn_type,
                                      has_sink=kwargs.get("sinks") is not None)
        if alibi_slopes is not None:
            reasons.append("ALiBi is not supported; drop OSCAR for this model")
        if logits_soft_cap:
            reasons.append("logit soft-capping is not supported; drop OSCAR for this model")
        if kv_sharing_target_layer_name is not None:
            reasons.append("cross-layer KV sharing is not supported; drop OSCAR for this model")
        if reasons:
            raise ValueError("The OSCAR attention backend cannot serve this model: " + "; ".join(reasons) + ".")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.sliding_window = None
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        #: The engine's config. Its block size is final only after vLLM applies the backends' preferred
        #: block size, after the model is loaded, so the page layout and the window store are sized from
        #: it at this layer's first forward (``_size_for_block_size``), not here.
        self.vllm_config = vllm_config
        self.config = current_oscar_config(vllm_config)
        global _config_of_process
        _config_of_process = self.config
        #: INT2 page layout at the engine's block size; None until the first forward.
        self.layout: Optional[PageLayout] = None
        self.rotations: Optional[LayerRotations] = None
        #: Device and dtype of the window store (set when the weights are loaded).
        self.device: Optional[torch.device] = None
        self.window_dtype: Optional[torch.dtype] = None
        #: Rotated BF16 rows [num_window_blocks, block_size, Hkv, D]; None until the first forward.
        self.window_k: Optional[torch.Tensor] = None
        self.window_v: Optional[torch.Tensor] = None
        self.layer_name = ""
        #: Leave a captured decode step's side-stream INT2 write for the model's forward to join
        #: (attention/deferred_writes: set where the model carries the joining hook).
        self.defer_side_writes = False

    # -- set-up (model load: before vLLM applies the preferred block size and sizes the KV pool) ---
    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Load this layer's rotations (this rank's KV heads) and fix the window store's device and dtype.

        The window store itself is allocated at the first forward: vLLM 0.32 sets the final block
        size after this (``Platform.update_block_size_for_backend`` in the executors).
        """
        if self.rotations is not None:
            return
        vllm_config = get_current_vllm_config()
        model_config = vllm_config.model_config
        from vllm.model_executor.models.utils import extract_layer_index

        self.layer_name = _layer_name_of(self, vllm_config)
        identity = served_model_identity(model_config)
        kv_slice = current_kv_head_slice(identity.num_kv_heads)
        if kv_slice.stop - kv_slice.start != self.num_kv_heads:
            raise ValueError(
                f"OSCAR: layer {self.layer_name} has {self.num_kv_heads} KV heads on this rank but the "
                f"tensor-parallel slice is {kv_slice}.")
        device = torch.device(vllm_config.device_config.device)
        # The check reads head_dim and group_size only, so any block size does.
        layout = page_layout(self.head_size, KERNEL_BLOCK_MULTIPLE, self.config)
        check_int8_keys(self.config, layout, device)
        check_flash_prefill(self.config, layout, device)
        self.rotations = layer_rotations(identity, self.config, extract_layer_index(self.layer_name),
                                         kv_slice, device)
        log_rotation_choice(identity, self.rotations)
        self.device = device
        self.window_dtype = act_dtype if act_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16

    def window_store_bytes(self) -> int:
        """Bytes of this layer's window store (K and V) at the engine's current block size, allocated
        or not (CPU: the plugin takes them out of the KV budget before the first forward)."""
        if self.window_dtype is None:
            raise RuntimeError(f"OSCAR: layer {self.layer_name or '?'} has not loaded its weights yet; "
                               "its window store has no dtype.")
        capacity, block_size = window_geometry(self.vllm_config, self.config)
        return window_store.window_store_bytes(capacity, block_size, self.num_kv_heads, self.head_size,
                                               self.window_dtype)

    def _size_for_block_size(self) -> None:
        """At the first forward (the memory profile run on a GPU, so vLLM counts the store as non-KV
        memory): the page layout and the window store at the engine's final block size."""
        if self.layout is not None:
            return
        if self.device is None or self.window_dtype is None:
            raise RuntimeError(f"OSCAR: layer {self.layer_name or '?'} ran before its weights were loaded.")
        cache_config = self.vllm_config.cache_config
        capacity, block_size = window_geometry(self.vllm_config, self.config)
        hint = block_size_hint(block_size, self.device, cache_config.user_specified_block_size)
        if hint:
            _log_block_size_hint(hint)
        shape = (capacity, block_size, self.num_kv_heads, self.head_size)
        self.window_k = torch.zeros(shape, dtype=self.window_dtype, device=self.device)
        self.window_v = torch.zeros(shape, dtype=self.window_dtype, device=self.device)
        window_store.record_allocation(self.window_k.nbytes + self.window_v.nbytes)
        self.layout = page_layout(self.head_size, block_size, self.config)

    # -- one step ----------------------------------------------------------------------------
    def _caches(self, kv_cache: torch.Tensor) -> LayerCaches:
        """This layer's caches; vLLM's [num_blocks, Hkv, bs, token_bytes] pages viewed as the kernels'
        [num_blocks, Hkv, bytes]."""
        if kv_cache.dim() != 4 or kv_cache.shape[2] != self.layout.block_size:
            raise ValueError(
                f"OSCAR expects the KV cache view [num_blocks, {self.num_kv_heads}, {self.layout.block_size}, "
                f"{self.layout.token_bytes}] (block size at its first forward); got {tuple(kv_cache.shape)}.")
        return LayerCaches(kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1), self.window_k, self.window_v,
                           self.layout)

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Nothing: OSCAR writes the step's K/V in ``forward`` (attention/step.layer_step), where the INT2
        part of a decode step can run on a side stream beside the attention and join it in the same op.
        (vLLM still calls this first, with the slot mapping padded as for backends that write here.)"""
        self._size_for_block_size()

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[OscarMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the step's K/V (INT2 pages, rotated BF16 window copies), then attend: queries [N, Hq, D] into
        ``output``, each by the decode read rule."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("OSCAR does not fuse output quantization.")
        self._size_for_block_size()
        if attn_metadata is None:  # memory profiling: nothing will read this cache
            return output
        from vllm.model_executor.layers.attention.attention import get_attention_context

        slot_mapping = get_attention_context(self.layer_name)[3]
        if key is None or value is None or slot_mapping is None:
            raise RuntimeError(f"OSCAR: layer {self.layer_name} got no new K/V or slot mapping in a step with "
                               "attention metadata; OSCAR writes the cache in forward and needs both.")
        layer_step(attn_metadata, query.view(-1, self.num_heads, self.head_size),
                   key.view(-1, self.num_kv_heads, self.head_size), value.view(-1, self.num_kv_heads, self.head_size),
                   slot_mapping, self.rotations, self._caches(kv_cache), self.config, self.scale,
                   output.view(-1, self.num_heads, self.head_size), defer_side_write=self.defer_side_writes)
        return output
