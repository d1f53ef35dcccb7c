"""Argument validation shared by the torch and Triton implementations of the kernel ops.

Every check here looks at shapes, dtypes and devices only (never at tensor values), so it
costs no device synchronisation and is safe inside CUDA-graph capture. Each failure is a
ValueError that says what was expected and what arrived.
"""

from __future__ import annotations

import torch

from vllm_oscar.config import check_clip_ratio
from vllm_oscar.kernels.layout import PageLayout

#: dtypes accepted for K/V/query rows.
ROW_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
#: dtypes of an attention output buffer ``out`` (any of them, whatever the query's: a layer whose W_o takes the
#: rotated output has the attention write the model's bf16 / fp16 rows directly from float32 queries).
OUTPUT_DTYPES: tuple[torch.dtype, ...] = ROW_DTYPES
#: dtypes accepted for index tensors (block tables, lengths, slot mappings).
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_rows3(name: str, t: torch.Tensor, heads: int | None, head_dim: int) -> None:
    """``t`` must be [N, heads, head_dim] in one of ROW_DTYPES (heads None: any)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[2] != head_dim or (
        heads is not None and t.shape[1] != heads
    ):
        want = f"[N, {heads if heads is not None else 'H'}, {head_dim}]"
        got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {want}; got {got}.")
    if t.dtype not in ROW_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: bfloat16, float16, float32.")


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """``t`` must be an int32/int64 tensor of exactly ``shape``."""
    if not isinstance(t, torch.Tensor) or _shape(t) != shape:
        got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have shape {list(shape)}; got {got}.")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64; got {t.dtype}.")


def check_cache(int2_cache: torch.Tensor, layout: PageLayout, num_kv_heads: int) -> None:
    """``int2_cache`` must be uint8 [num_blocks, num_kv_heads, layout.head_region_bytes]."""
    if not isinstance(layout, PageLayout):
        raise ValueError(f"layout must be a PageLayout; got {type(layout).__name__}.")
    if (
        not isinstance(int2_cache, torch.Tensor)
        or int2_cache.dtype != torch.uint8
        or int2_cache.dim() != 3
        or int2_cache.shape[1] != num_kv_heads
        or int2_cache.shape[2] != layout.head_region_bytes
    ):
        got = f"{int2_cache.dtype} {_shape(int2_cache)}" if isinstance(int2_cache, torch.Tensor) else "?"
        raise ValueError(
            f"int2_cache must be uint8 [num_blocks, {num_kv_heads}, {layout.head_region_bytes}] "
            f"(layout.cache_shape); got {got}."
        )


def check_windows(window_k: torch.Tensor, window_v: torch.Tensor, layout: PageLayout, num_kv_heads: int) -> None:
    """Window stores must both be [num_window_blocks, block_size, Hkv, D] float tensors."""
    want = (layout.block_size, num_kv_heads, layout.head_dim)
    for name, t in (("window_k", window_k), ("window_v", window_v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or _shape(t)[1:] != want:
            got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape [num_window_blocks, {', '.join(map(str, want))}]; got {got}.")
        if t.dtype not in ROW_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: bfloat16, float16, float32.")
    if window_k.shape != window_v.shape or window_k.dtype != window_v.dtype:
        raise ValueError(
            f"window_k and window_v must match; got {window_k.dtype} {_shape(window_k)} and "
            f"{window_v.dtype} {_shape(window_v)}."
        )


def check_rotation(name: str, rotation: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """A rotation must be a float tensor [Hkv, D, D]."""
    want = (num_kv_heads, head_dim, head_dim)
    if not isinstance(rotation, torch.Tensor) or _shape(rotation) != want or not rotation.is_floating_point():
        got = f"{rotation.dtype} {_shape(rotation)}" if isinstance(rotation, torch.Tensor) else "?"
        raise ValueError(f"{name} must be a float tensor of shape {list(want)}; got {got}.")


def check_rotate_args(x: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """Rows x [N, H, D] float, rotation [Hr, D, D] float with Hr dividing H, out (if given) float
    [N, H, D] on x's device."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"x must be a float tensor [N, H, D]; got {getattr(x, 'shape', x)!r}.")
    n, heads, dim = x.shape
    if (
        not isinstance(rotation, torch.Tensor)
        or rotation.dim() != 3
        or _shape(rotation)[1:] != (dim, dim)
        or not rotation.is_floating_point()
    ):
        raise ValueError(f"rotation must be a float tensor [Hr, {dim}, {dim}]; "
                         f"got {getattr(rotation, 'shape', rotation)!r}.")
    groups = rotation.shape[0]
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"rotation heads ({groups}) must divide the heads of x ({heads}).")
    if out is not None:
        if not isinstance(out, torch.Tensor) or _shape(out) != (n, heads, dim) or not out.is_floating_point():
            raise ValueError(f"out must be a float tensor [{n}, {heads}, {dim}]; got {getattr(out, 'shape', out)!r}.")
        check_same_device(x=x, rotation=rotation, out=out)
    else:
        check_same_device(x=x, rotation=rotation)


def check_write_query(query: torch.Tensor, key: torch.Tensor, k_rotation: torch.Tensor) -> None:
    """The query rows [N, Hq, D] that oscar_write rotates beside the write: rows of the key's N tokens and
    head size, Hq a multiple of the key's heads (and a valid x for k_rotation)."""
    check_rotate_args(query, k_rotation)
    if _shape(query)[0] != _shape(key)[0] or _shape(query)[2] != _shape(key)[2] or query.shape[1] % key.shape[1]:
        raise ValueError(f"query {tuple(query.shape)} must hold the same tokens and head size as key "
                         f"{tuple(key.shape)}, with a multiple of its heads.")


def check_window_sizes(sink: int, recent: int) -> None:
    """sink and recent are Python ints >= 0."""
    for name, value in (("sink", sink), ("recent", recent)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} must be a Python int >= 0.")


def check_same_device(**tensors: torch.Tensor) -> None:
    """All tensors must live on one device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n}: {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device; got {listing}.")


def check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    k_rotation: torch.Tensor,
    v_rotation: torch.Tensor | None,
    clip_k: float,
    clip_v: float,
    int2_cache: torch.Tensor,
    layout: PageLayout,
    slot_mapping: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_slot_mapping: torch.Tensor,
    value_prerotated: bool,
) -> None:
    """Validate the arguments of oscar_write (see docs/design.md, Kernel API)."""
    if not isinstance(key, torch.Tensor) or key.dim() != 3:
        raise ValueError(f"key must be [N, Hkv, D]; got {_shape(key) if isinstance(key, torch.Tensor) else key!r}.")
    n, hkv, d = key.shape
    if not isinstance(layout, PageLayout) or layout.head_dim != d:
        raise ValueError(f"layout.head_dim must equal key.shape[2]={d}; got layout {layout!r}.")
    check_rows3("key", key, hkv, d)
    check_rows3("value", value, hkv, d)
    if value.shape[0] != n:
        raise ValueError(f"key and value must have the same N; got {n} and {value.shape[0]}.")
    check_rotation("k_rotation", k_rotation, hkv, d)
    if not value_prerotated:
        if v_rotation is None:
            raise ValueError("v_rotation is required unless value_prerotated=True.")
        check_rotation("v_rotation", v_rotation, hkv, d)
    check_clip_ratio("clip_k", clip_k)
    check_clip_ratio("clip_v", clip_v)
    check_cache(int2_cache, layout, hkv)
    check_windows(window_k, window_v, layout, hkv)
    check_index("slot_mapping", slot_mapping, (n,))
    check_index("window_slot_mapping", window_slot_mapping, (n,))
    check_same_device(key=key, value=value, k_rotation=k_rotation, int2_cache=int2_cache,
                      slot_mapping=slot_mapping, window_k=window_k, window_slot_mapping=window_slot_mapping)


def check_attention_common(
    query_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: torch.Tensor | None,
) -> tuple[int, int]:
    """Shared checks of oscar_decode / oscar_prefill. Returns (Hkv, number of requests B)."""
    if not isinstance(layout, PageLayout):
        raise ValueError(f"layout must be a PageLayout; got {type(layout).__name__}.")
    check_rows3("query_rot", query_rot, None, layout.head_dim)
    if int2_cache.dim() != 3:
        raise ValueError(f"int2_cache must be [num_blocks, Hkv, bytes]; got {_shape(int2_cache)}.")
    hkv = int2_cache.shape[1]
    hq = query_rot.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of the cache's KV heads ({hkv}).")
    check_cache(int2_cache, layout, hkv)
    check_windows(window_k, window_v, layout, hkv)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be [B, max_blocks]; "
                         f"got {_shape(block_table) if isinstance(block_table, torch.Tensor) else block_table!r}.")
    b = block_table.shape[0]
    check_index("block_table", block_table, _shape(block_table))
    check_index("window_block_table", window_block_table, _shape(block_table))
    check_index("seq_lens", seq_lens, (b,))
    check_window_sizes(sink, recent)
    if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive float.")
    if out is not None and (_shape(out) != _shape(query_rot) or out.dtype not in OUTPUT_DTYPES):
        raise ValueError(f"out must be {_shape(query_rot)} in one of {OUTPUT_DTYPES} (the attention's output, "
                         f"written in out's dtype); got {out.dtype} {_shape(out)}.")
    check_same_device(query_rot=query_rot, int2_cache=int2_cache, window_k=window_k,
                      block_table=block_table, window_block_table=window_block_table, seq_lens=seq_lens)
    return hkv, b


def check_prefill_extra(
    query_rot: torch.Tensor,
    key_rot: torch.Tensor | None,
    value_rot: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    num_kv_heads: int,
    num_requests: int,
    head_dim: int,
    chunk_from_cache: bool = False,
) -> None:
    """oscar_prefill only: the chunk's own rotated K/V rows and the query offsets.

    With chunk_from_cache the rows are read from the caches: key_rot/value_rot must be None.
    """
    check_index("query_start_loc", query_start_loc, (num_requests + 1,))
    if chunk_from_cache:
        if key_rot is not None or value_rot is not None:
            raise ValueError("chunk_from_cache=True reads the chunk from the caches: "
                             "pass key_rot=None, value_rot=None.")
        return
    t = query_rot.shape[0]
    check_rows3("key_rot", key_rot, num_kv_heads, head_dim)
    check_rows3("value_rot", value_rot, num_kv_heads, head_dim)
    if key_rot.shape[0] != t or value_rot.shape[0] != t:
        raise ValueError(
            f"key_rot and value_rot must have one row per query token ({t}); got "
            f"{key_rot.shape[0]} and {value_rot.shape[0]}."
        )
