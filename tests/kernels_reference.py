"""Float64 references and random fixtures for the kernel tests (torch ops and Triton).

Written from the formulas of docs/method.md / docs/design.md, not from the kernels' helpers:
rotation x @ R in float64, clip at torch.quantile(|x|, r, interpolation="higher"),
uniform INT2 with scale = max(max - min, eps) / 3 and offset = min rounded to the storage
dtype, codes unpacked bit by bit from the documented byte layout, attention by an explicit
per-position read rule and a float64 softmax.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_oscar.config import GRID_REFIT_ITERATIONS, REFIT_SCALE_FLOOR, SCALE_EPS
from vllm_oscar.kernels.layout import PageLayout, page_views
from vllm_oscar.quant import rotation_from_covariance


def random_rotations(heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[heads, D, D] float32 OSCAR-like rotations (U H P_br of a random covariance)."""
    base = torch.randn(heads, dim, 2 * dim, generator=generator, dtype=torch.float64)
    rotation, _ = rotation_from_covariance(base @ base.transpose(-1, -2))
    return rotation.to(torch.float32)


def rows_with_outliers(n: int, heads: int, dim: int, generator: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """[n, heads, D] random rows with a few planted outlier channels (x20) and a mean shift."""
    rows = torch.randn(n, heads, dim, generator=generator) + 0.3
    channels = torch.randperm(dim, generator=generator)[:3]
    rows[..., channels] *= 20.0
    return rows.to(dtype)


def ref_quantize(rows: torch.Tensor, ratio: float, group: int, scale_dtype: torch.dtype):
    """Reference INT2 of rotated rows [..., D] (float64).

    Returns (codes int64 [..., D], scale [..., D/G] scale_dtype, offset [..., D/G],
    position float64 [..., D] = (clipped - offset) / scale before rounding).
    """
    grouped = _ref_clipped(rows, ratio, group)
    raw_scale, low = _ref_min_max(rows, ratio, group)
    scale = raw_scale.to(scale_dtype)
    offset = low.to(scale_dtype)
    position = (grouped - offset.double()[..., None]) / scale.double()[..., None]
    codes = torch.clamp(torch.round(position), 0, 3).to(torch.int64)
    return codes.reshape(rows.shape), scale, offset, position.reshape(rows.shape)


def _ref_clipped(rows: torch.Tensor, ratio: float, group: int) -> torch.Tensor:
    """Clipped float64 rows [..., D/G, G]."""
    x = rows.to(torch.float64)
    tau = torch.quantile(x.abs(), ratio, dim=-1, keepdim=True, interpolation="higher")
    x = torch.clamp(x, -tau, tau)
    return x.reshape(*x.shape[:-1], -1, group)


def _ref_min_max(rows: torch.Tensor, ratio: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(max - min, eps) / 3, min) per group of the clipped rows, float64, before storage rounding."""
    grouped = _ref_clipped(rows, ratio, group)
    low = grouped.amin(-1)
    return torch.clamp(grouped.amax(-1) - low, min=SCALE_EPS) / 3, low


#: A float64 reference decision closer than this (relative) to its boundary is a tie that
#: float32 kernel arithmetic may resolve the other way (see ref_refit). Measured: float32
#: (torch) and float64 took different decisions only at margins <= 1.2e-7 (72,000 groups,
#: D = 128, G = 128 / 32, fp16 / bf16 / fp32 storage); 1e-6 flags ~2% of fp16 groups.
TIE_MARGIN = 1e-6


def _storage_margin(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Absolute distance of float64 values to the nearest rounding midpoint of ``dtype``.

    Where it is tiny, float32 arithmetic may round the value to the other neighbour. inf for
    float32 storage (compared with a tolerance instead: float32 compute noise exceeds its ulp).
    """
    if dtype == torch.float32:
        return torch.full_like(value, float("inf"))
    info = torch.finfo(dtype)
    binade = torch.exp2(torch.floor(torch.log2(value.abs().clamp(min=info.tiny))))
    ulp = binade * info.eps
    return ulp / 2 - (value - value.to(dtype).double()).abs()


def _code_margin(position: torch.Tensor) -> torch.Tensor:
    """Per group (last dim reduced): smallest |frac(position) - 0.5| among positions that
    round to different codes on either side (those in (-1, 4)); inf if none."""
    live = (position > -1) & (position < 4)
    gap = ((position - position.floor()) - 0.5).abs()
    return torch.where(live, gap, torch.full_like(gap, float("inf"))).amin(-1)


def ref_refit(rows: torch.Tensor, ratio: float, group: int, scale_dtype: torch.dtype, iterations: int,
              floor: bool = False):
    """Float64 reference of the write quantizer with the least-squares grid refit.

    From the clipped min/max grid (ref_quantize), ``iterations`` rounds per group of the
    UNCLIPPED values x (means = sums / G):
        s = cov(c, x) / var(c) (previous s if var(c) = 0), max(s, 1e-6) -> storage dtype
        o = mean(x) - s mean(c) -> storage dtype;  c = clamp(round((x - o) / s), 0, 3)
    keeping the grid with the smallest sum (x - c s - o)^2 (strictly smaller replaces).
    floor: s = max(cov / var, s_0) before the max with 1e-6, s_0 the clipped min/max scale.

    Returns (codes int64 [..., D], scale [..., D/G] storage dtype, offset, margin float64
    [..., D/G]). margin: the closest any decision on the way came to its boundary, relative
    (codes: |frac(position) - 1/2|; storage rounding of s and o: distance to the rounding
    midpoint / max(|value|, s); keeping an iterate: |error - best| / best). A group whose
    margin is < TIE_MARGIN sits on a tie that float32 arithmetic may break the other way.
    """
    codes, scale, offset, position = ref_quantize(rows, ratio, group, scale_dtype)
    x = rows.to(torch.float64).reshape(*rows.shape[:-1], -1, group)
    raw_scale, raw_low = _ref_min_max(rows, ratio, group)
    s_ref = scale.double()
    margin = torch.minimum(_code_margin(position.reshape(x.shape)),
                           _storage_margin(raw_scale, scale_dtype) / raw_scale.abs().clamp(min=1e-30))
    margin = torch.minimum(margin, _storage_margin(raw_low, scale_dtype) / torch.maximum(raw_low.abs(), s_ref))
    c = codes.reshape(x.shape).double()
    s, o = scale.double(), offset.double()
    best = (c, s, o)
    best_error = ((x - (c * s[..., None] + o[..., None])) ** 2).sum(-1)
    x_mean = x.sum(-1) / group
    s_0 = s
    for _ in range(iterations):
        c_mean = c.sum(-1) / group
        var = ((c - c_mean[..., None]) ** 2).sum(-1) / group
        cov = ((c - c_mean[..., None]) * (x - x_mean[..., None])).sum(-1) / group
        fitted = torch.where(var > 0, cov / torch.where(var > 0, var, torch.ones_like(var)), s)
        if floor:
            fitted = torch.maximum(fitted, s_0)
        fitted = fitted.clamp(min=SCALE_EPS)
        s = fitted.to(scale_dtype).double()
        margin = torch.minimum(margin, _storage_margin(fitted, scale_dtype) / fitted)
        raw_offset = x_mean - s * c_mean
        o = raw_offset.to(scale_dtype).double()
        margin = torch.minimum(margin, _storage_margin(raw_offset, scale_dtype) / torch.maximum(raw_offset.abs(), s))
        pos = (x - o[..., None]) / s[..., None]
        margin = torch.minimum(margin, _code_margin(pos))
        c = torch.clamp(torch.round(pos), 0, 3)
        error = ((x - (c * s[..., None] + o[..., None])) ** 2).sum(-1)
        same = (c == best[0]).all(-1) & (s == best[1]) & (o == best[2])
        gap = (error - best_error).abs() / best_error.clamp(min=1e-30)
        margin = torch.where(same, margin, torch.minimum(margin, gap))
        better = error < best_error
        best = (torch.where(better[..., None], c, best[0]), torch.where(better, s, best[1]),
                torch.where(better, o, best[2]))
        best_error = torch.where(better, error, best_error)
    return (best[0].to(torch.int64).reshape(rows.shape), best[1].to(scale_dtype), best[2].to(scale_dtype), margin)


def ref_unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/4] uint8 -> [..., D] int64: byte j holds channels j, j+D/4, j+D/2, j+3D/4."""
    quarter = packed.shape[-1]
    out = torch.empty(*packed.shape[:-1], 4 * quarter, dtype=torch.int64)
    as_int = packed.to(torch.int64)
    for plane in range(4):
        out[..., plane * quarter : (plane + 1) * quarter] = (as_int >> (2 * plane)) & 3
    return out


def ref_dequantize_slot(cache: torch.Tensor, layout: PageLayout, block: int, offset: int, which: str) -> torch.Tensor:
    """[Hkv, D] float64 dequantized K or V rows of one slot, read from the planes."""
    views = page_views(cache, layout)
    codes = ref_unpack(getattr(views, f"{which}_codes")[block, :, offset].cpu()).double()
    scale = getattr(views, f"{which}_scale")[block, :, offset].cpu().double()
    zero = getattr(views, f"{which}_offset")[block, :, offset].cpu().double()
    grouped = codes.reshape(codes.shape[0], -1, layout.group_size)
    return (grouped * scale[..., None] + zero[..., None]).reshape(codes.shape)


@dataclasses.dataclass
class PagedState:
    """A random paged cache: INT2 planes and BF16 windows with different contents."""

    layout: PageLayout
    cache: torch.Tensor  # uint8 [num_blocks, Hkv, bytes]
    window_k: torch.Tensor  # [num_window_blocks, bs, Hkv, D]
    window_v: torch.Tensor
    block_table: torch.Tensor  # int32 [B, max_blocks]
    window_block_table: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]


def random_paged_state(
    seq_lens: list[int],
    num_kv_heads: int,
    layout: PageLayout,
    sink: int,
    recent: int,
    generator: torch.Generator,
    drop_window_blocks: int = 0,
    window_dtype: torch.dtype = torch.bfloat16,
    extra_blocks: int = 3,
) -> PagedState:
    """Random codes/scales/offsets for every slot, random window rows, shuffled block ids.

    Every logical block that holds a window position of its request (for a query at the
    last position) gets a window block, except ``drop_window_blocks`` of them per request
    chosen at random (fallback rows, read from INT2). Unused table entries are -1/garbage
    ids that must not be read.
    """
    bs, dim = layout.block_size, layout.head_dim
    blocks_per = [-(-n // bs) for n in seq_lens]
    max_blocks = max(blocks_per) + 1
    total = sum(blocks_per) + extra_blocks
    cache = torch.randint(0, 256, layout.cache_shape(total, num_kv_heads), dtype=torch.uint8, generator=generator)
    views = page_views(cache, layout)
    for name in ("k_scale", "v_scale"):
        plane = getattr(views, name)
        plane.copy_((torch.rand(plane.shape, generator=generator) * 0.5 + 0.05).to(plane.dtype))
    for name in ("k_offset", "v_offset"):
        plane = getattr(views, name)
        plane.copy_((torch.randn(plane.shape, generator=generator) * 0.5 - 0.4).to(plane.dtype))
    ids = torch.randperm(total, generator=generator)
    block_table = torch.full((len(seq_lens), max_blocks), total + 7, dtype=torch.int32)  # garbage past the end
    window_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cursor, window_cursor = 0, 0
    for b, n in enumerate(seq_lens):
        block_table[b, : blocks_per[b]] = ids[cursor : cursor + blocks_per[b]].to(torch.int32)
        cursor += blocks_per[b]
        window_logical = [
            j for j in range(blocks_per[b])
            if any(s < sink or s > (n - 1) - recent for s in range(j * bs, min(n, (j + 1) * bs)))
        ]
        if drop_window_blocks and window_logical:
            keep = torch.randperm(len(window_logical), generator=generator)[drop_window_blocks:].tolist()
            window_logical = [window_logical[i] for i in sorted(keep)]
        for j in window_logical:
            window_table[b, j] = window_cursor
            window_cursor += 1
    shape = (window_cursor + 2, bs, num_kv_heads, dim)
    window_k = (torch.randn(shape, generator=generator) * 1.5).to(window_dtype)
    window_v = (torch.randn(shape, generator=generator) * 1.5 + 0.5).to(window_dtype)
    return PagedState(layout, cache, window_k, window_v, block_table, window_table,
                      torch.tensor(seq_lens, dtype=torch.int32))


def ref_context(state: PagedState, request: int, length: int, position: int, sink: int, recent: int,
                with_sources: bool = False):
    """K, V [length, Hkv, D] float64 as read by a query at ``position`` (explicit read rule); with_sources: also
    the bool [length] of positions read from the INT2 cache (not from a BF16 window copy)."""
    bs = state.layout.block_size
    ks, vs, from_int2 = [], [], []
    for s in range(length):
        logical = s // bs
        window_block = int(state.window_block_table[request, logical])
        if (s < sink or s > position - recent) and window_block >= 0:
            ks.append(state.window_k[window_block, s % bs].double())
            vs.append(state.window_v[window_block, s % bs].double())
            from_int2.append(False)
        else:
            block = int(state.block_table[request, logical])
            ks.append(ref_dequantize_slot(state.cache, state.layout, block, s % bs, "k"))
            vs.append(ref_dequantize_slot(state.cache, state.layout, block, s % bs, "v"))
            from_int2.append(True)
    dim, hkv = state.layout.head_dim, state.cache.shape[1]
    if not ks:
        k = v = torch.zeros(0, hkv, dim, dtype=torch.float64)
    else:
        k, v = torch.stack(ks), torch.stack(vs)
    return (k, v, torch.tensor(from_int2, dtype=torch.bool)) if with_sources else (k, v)


def ref_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          q_int2: torch.Tensor | None = None, from_int2: torch.Tensor | None = None) -> torch.Tensor:
    """One query [Hq, D] over k, v [S, Hkv, D] (GQA: head i uses KV head i // g), float64; q_int2 (with the bool
    [S] from_int2): the query the positions read from INT2 multiply instead (the int8 key path's rounded one)."""
    hq, hkv = q.shape[0], k.shape[1]
    group = hq // hkv
    out = torch.empty(hq, q.shape[1], dtype=torch.float64)
    for head in range(hq):
        kv = head // group
        logits = (k[:, kv] @ q[head].double()) * scale
        if q_int2 is not None:
            logits = torch.where(from_int2, (k[:, kv] @ q_int2[head].double()) * scale, logits)
        weights = torch.softmax(logits, dim=0)
        out[head] = weights @ v[:, kv]
    return out


def ref_decode(state: PagedState, query: torch.Tensor, sink: int, recent: int, scale: float,
               int2_query: torch.Tensor | None = None) -> torch.Tensor:
    """[B, Hq, D] float64 reference of oscar_decode; int2_query [B, Hq, D]: the query of the positions read from
    INT2 (BF16 window positions keep ``query``), as the int8 key path reads them."""
    out = []
    for b, n in enumerate(state.seq_lens.tolist()):
        k, v, from_int2 = ref_context(state, b, n, n - 1, sink, recent, with_sources=True)
        q_int2 = None if int2_query is None else int2_query[b]
        out.append(ref_softmax_attention(query[b], k, v, scale, q_int2, from_int2))
    return torch.stack(out)


def ref_prefill(state: PagedState, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                query_start_loc: list[int], sink: int, recent: int, scale: float) -> torch.Tensor:
    """[T, Hq, D] float64 reference of oscar_prefill (chunk rows exact, prefix by read rule)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, n in enumerate(state.seq_lens.tolist()):
        begin, end = query_start_loc[b], query_start_loc[b + 1]
        prefix = n - (end - begin)
        for i in range(begin, end):
            position = prefix + (i - begin)
            k, v = ref_context(state, b, prefix, position, sink, recent)
            k = torch.cat((k, key[begin : i + 1].double()))
            v = torch.cat((v, value[begin : i + 1].double()))
            out[i] = ref_softmax_attention(query[i], k, v, scale)
    return out


def int8_rounded_query(query: torch.Tensor) -> torch.Tensor:
    """float64 copy of ``query`` [..., D] with each row rounded to int8 steps of its absmax / 127
    (half up): the query the int8 key path multiplies (AttentionConfig.int8_keys)."""
    q = query.double()
    step = q.abs().amax(dim=-1, keepdim=True) / 127.0
    step = torch.where(step > 0, step, torch.ones_like(step))
    return torch.floor(q / step + 0.5) * step


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (NaN anywhere -> inf)."""
    actual = actual.double().cpu()
    if not bool(torch.isfinite(actual).all()):
        return float("inf")
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


POISON_BYTE = 0xA7


def write_case(ops, n, hkv, dim, group, bs, scale_dtype, prerotated, seed, device="cpu", refit_iterations=0,
               refit_floor=REFIT_SCALE_FLOOR, launch=None, int2_apart=False):
    """Run ops.oscar_write on fresh data; return everything needed to check it. launch: the Triton
    path's WriteConfig (None = its default). int2_apart (triton_ops): the window copies, then the INT2 part in a
    launch of its own (a captured decode step's two writes); "rotated": so, the first as a flagged launch (flag 0)
    that also stores the rotated rows, which the second (row programs) reads instead of rotating."""
    gen = torch.Generator().manual_seed(seed)
    layout = PageLayout(dim, group, bs, scale_dtype)
    num_blocks = -(-n // bs) + 2
    key = rows_with_outliers(n, hkv, dim, gen)
    value = rows_with_outliers(n, hkv, dim, gen)
    k_rot_m, v_rot_m = random_rotations(hkv, dim, gen), random_rotations(hkv, dim, gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:n].to(torch.int64)
    slots[torch.rand(n, generator=gen) < 0.15] = -1  # padding tokens
    window_slots = torch.full((n,), -1, dtype=torch.int64)
    chosen = torch.rand(n, generator=gen) < 0.5
    window_slots[chosen] = torch.randperm(num_blocks * bs, generator=gen)[: int(chosen.sum())]
    cache = torch.full(layout.cache_shape(num_blocks, hkv), POISON_BYTE, dtype=torch.uint8)
    window_k = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=torch.bfloat16)
    window_v = torch.full_like(window_k, float("nan"))
    value_in = value
    if prerotated:
        value_in = torch.einsum("nhd,hde->nhe", value.double(), v_rot_m.double()).to(torch.bfloat16)
    cache, window_k, window_v = cache.to(device), window_k.to(device), window_v.to(device)
    args = (key.to(device), value_in.to(device), k_rot_m.to(device), None if prerotated else v_rot_m.to(device),
            0.96, 0.92, cache, layout, slots.to(device), window_k, window_v, window_slots.to(device), prerotated)
    options = dict(refit_iterations=refit_iterations, refit_floor=refit_floor,
                   **({} if launch is None else {"config": launch}))
    if int2_apart == "rotated":
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        rotated = torch.full((n, hkv, 2, dim), float("nan"), device=device)
        ops.oscar_write(*args, int2="if_flag", flag=flag, rotated_out=rotated, **options)
        ops.oscar_write(*args, store_window=False, int2="unless_flag", flag=flag, rotated=rotated, **options)
    elif int2_apart:
        ops.oscar_write(*args, int2="never", **options)
        ops.oscar_write(*args, store_window=False, **options)
    else:
        ops.oscar_write(*args, **options)
    cache, window_k, window_v = cache.cpu(), window_k.cpu(), window_v.cpu()
    return layout, key, value, value_in, k_rot_m, v_rot_m, slots, window_slots, cache, window_k, window_v


def rotate_and_write_case(ops, tokens, hkv, group, dim, flag_value, fused, seed, device="cpu"):
    """A captured decode step's first launch on fresh rows (poisoned caches), fused
    (ops.oscar_write with query) or as the two launches it replaces (ops.oscar_write with the same
    parts, then ops.oscar_rotate): (INT2 pages, window K and V as int16 bits, q_rot, float64 q @ R_K),
    on the CPU. Served refit, clips 0.96 / 0.92; flag_value: the INT2 part only where it is non-zero
    (triton_ops' flagged launch), None: the plain write (any ops module)."""
    gen = torch.Generator().manual_seed(seed)
    bs = 16
    layout = PageLayout(dim, dim, bs, torch.float16)
    num_blocks = -(-tokens // bs) + 2
    key, value = rows_with_outliers(tokens, hkv, dim, gen), rows_with_outliers(tokens, hkv, dim, gen)
    query = rows_with_outliers(tokens, hkv * group, dim, gen)
    k_rotation, v_rotation = random_rotations(hkv, dim, gen), random_rotations(hkv, dim, gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    window_slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    window_slots[torch.rand(tokens, generator=gen) < 0.4] = -1
    cache = torch.full(layout.cache_shape(num_blocks, hkv), POISON_BYTE, dtype=torch.uint8, device=device)
    window_k = torch.full((num_blocks, bs, hkv, dim), float("nan"), dtype=torch.bfloat16, device=device)
    window_v = window_k.clone()
    args = (key.to(device), value.to(device), k_rotation.to(device), v_rotation.to(device), 0.96, 0.92, cache, layout,
            slots.to(device), window_k, window_v, window_slots.to(device))
    parts = {} if flag_value is None else dict(int2="if_flag", flag=torch.tensor([flag_value], dtype=torch.int32,
                                                                                  device=device))
    if fused:
        q_rot = ops.oscar_write(*args, refit_iterations=GRID_REFIT_ITERATIONS, query=query.to(device), **parts)
    else:
        ops.oscar_write(*args, refit_iterations=GRID_REFIT_ITERATIONS, **parts)
        q_rot = ops.oscar_rotate(query.to(device), k_rotation.to(device))
    expected_q = torch.einsum("nkgd,kde->nkge", query.double().view(tokens, hkv, group, dim), k_rotation.double())
    return (cache.cpu(), window_k.view(torch.int16).cpu(), window_v.view(torch.int16).cpu(), q_rot.cpu(),
            expected_q.reshape(tokens, hkv * group, dim))


def check_written(layout, rows_rot, ratio, slots, cache, which, hkv):
    """Stored codes/scale/offset of every written slot match the float64 reference."""
    views = page_views(cache, layout)
    bs = layout.block_size
    keep = slots >= 0
    blocks, offs = slots[keep] // bs, slots[keep] % bs
    codes, scale, offset, position = ref_quantize(rows_rot[keep], ratio, layout.group_size, layout.scale_dtype)
    got_codes = ref_unpack(getattr(views, f"{which}_codes")[blocks, :, offs].cpu())
    got_scale = getattr(views, f"{which}_scale")[blocks, :, offs].cpu()
    got_offset = getattr(views, f"{which}_offset")[blocks, :, offs].cpu()
    torch.testing.assert_close(got_scale.double(), scale.double(), rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(got_offset.double(), offset.double(), rtol=2e-3,
                               atol=2e-3 * scale.double().abs().amax().item())
    # A code may only differ where float32 vs float64 rounding lands on a rounding boundary.
    differs = got_codes != codes
    near_boundary = ((position - position.floor()) - 0.5).abs() < 2e-2
    assert bool((~differs | near_boundary).all()), f"{which}: {int((differs & ~near_boundary).sum())} codes wrong"
    assert int(differs.sum()) <= max(2, differs.numel() // 100)
    assert bool(((got_codes - codes).abs() <= 1).all())


def check_written_refit(layout, rows_rot, ratio, slots, cache, which, iterations,
                        floor: bool = False) -> dict[str, float]:
    """Stored grids of every written slot against ref_refit (float64).

    Away from ties (ref_refit margin >= TIE_MARGIN) codes, scale and offset equal the
    reference exactly (16-bit storage) or within float32 noise (float32 storage). At a tie
    float32 may take the other branch (a code at a rounding midpoint, a fitted scale/offset
    at a storage rounding midpoint, two iterates of equal error), so there only what holds
    for any branch is checked: the codes are the stored grid's rounding of the unclipped
    rows, and the grid's error is not above the clipped min/max grid's. Returns the error
    sums of the written grids and of the plain grids, the tie and differing group counts.
    """
    views = page_views(cache, layout)
    bs, group = layout.block_size, layout.group_size
    keep = slots >= 0
    blocks, offs = slots[keep] // bs, slots[keep] % bs
    rows = rows_rot[keep]
    codes, scale, offset, margin = ref_refit(rows, ratio, group, layout.scale_dtype, iterations, floor)
    got_codes = ref_unpack(getattr(views, f"{which}_codes")[blocks, :, offs].cpu())
    got_scale = getattr(views, f"{which}_scale")[blocks, :, offs].cpu().double()
    got_offset = getattr(views, f"{which}_offset")[blocks, :, offs].cpu().double()

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-1], -1, group)

    tolerance = 1e-5 if layout.scale_dtype == torch.float32 else 0.0
    ref_scale, ref_offset = scale.double(), offset.double()
    same = (grouped(got_codes) == grouped(codes)).all(-1)
    same &= (got_scale - ref_scale).abs() <= tolerance * ref_scale.abs()
    same &= (got_offset - ref_offset).abs() <= tolerance * torch.maximum(ref_offset.abs(), ref_scale)
    tie = margin < TIE_MARGIN
    assert bool((same | tie).all()), f"{which}: {int((~same & ~tie).sum())} groups differ away from a tie"
    # Ties are common only on exactly representable inputs (prerotated bf16 values hit
    # midpoints exactly); even there float32 breaks almost all of them the reference's way.
    assert int((~same).sum()) <= max(2, same.numel() // 20), f"{which}: {int((~same).sum())} groups differ at ties"
    x = grouped(rows.double())
    position = (x - got_offset[..., None]) / got_scale[..., None]
    at_midpoint = ((position - position.floor()) - 0.5).abs() < TIE_MARGIN
    assigned = torch.clamp(torch.round(position), 0, 3)
    assert bool(((grouped(got_codes).double() == assigned) | at_midpoint).all()), f"{which}: codes off the stored grid"
    got_error = ((x - (grouped(got_codes) * got_scale[..., None] + got_offset[..., None])) ** 2).sum(-1)
    plain_codes, plain_scale, plain_offset, _ = ref_quantize(rows, ratio, group, layout.scale_dtype)
    plain = grouped(plain_codes) * plain_scale.double()[..., None] + plain_offset.double()[..., None]
    plain_error = ((x - plain) ** 2).sum(-1)
    assert bool((got_error <= plain_error * (1 + 1e-6) + 1e-12).all()), f"{which}: refit worse than min/max"
    return {"error": float(got_error.sum()), "plain_error": float(plain_error.sum()), "ties": int(tie.sum()),
            "differ": int((~same).sum()), "groups": same.numel()}


def check_write_case(result, prerotated: bool, refit_iterations: int = 0,
                     refit_floor: tuple[bool, bool] = REFIT_SCALE_FLOOR) -> list[dict[str, float]]:
    """Verify a write_case result: INT2 planes, untouched poison, window copies.

    With refit_iterations, the planes are checked by check_written_refit (its summaries
    for K and V are returned)."""
    layout, key, value, value_in, rk, rv, slots, wslots, cache, wk, wv = result
    hkv, dim, bs = key.shape[1], key.shape[2], layout.block_size
    k_rot = torch.einsum("nhd,hde->nhe", key.double(), rk.double())
    v_rot = value_in.double() if prerotated else torch.einsum("nhd,hde->nhe", value.double(), rv.double())
    summaries = []
    if refit_iterations:
        summaries.append(check_written_refit(layout, k_rot, 0.96, slots, cache, "k", refit_iterations, refit_floor[0]))
        summaries.append(check_written_refit(layout, v_rot, 0.92, slots, cache, "v", refit_iterations, refit_floor[1]))
    else:
        check_written(layout, k_rot, 0.96, slots, cache, "k", hkv)
        check_written(layout, v_rot, 0.92, slots, cache, "v", hkv)
    # Untouched slots keep the poison; written slots are overwritten.
    written = torch.zeros(cache.shape[0] * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    views = page_views(cache, layout)
    untouched = views.k_codes.permute(0, 2, 1, 3).reshape(-1, hkv, dim // 4)[~written]
    assert bool((untouched == POISON_BYTE).all())
    # Window copies: rotated rows in bf16 exactly where window_slot_mapping >= 0, NaN elsewhere.
    in_window = wslots >= 0
    flat_k, flat_v = wk.reshape(-1, hkv, dim), wv.reshape(-1, hkv, dim)
    torch.testing.assert_close(flat_k[wslots[in_window]].double(), k_rot[in_window].to(torch.bfloat16).double(),
                               rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(flat_v[wslots[in_window]].double(), v_rot[in_window].to(torch.bfloat16).double(),
                               rtol=1e-2, atol=1e-2)
    rest = torch.ones(flat_k.shape[0], dtype=torch.bool)
    rest[wslots[in_window]] = False
    assert bool(flat_k[rest].isnan().all()) and bool(flat_v[rest].isnan().all())
    return summaries


def ref_prefill_from_cache(state: PagedState, query: torch.Tensor, query_start_loc: list[int], sink: int,
                           recent: int, scale: float) -> torch.Tensor:
    """[T, Hq, D] float64 reference of oscar_prefill(chunk_from_cache=True): each chunk row at
    position t attends to cached positions 0..t by the read rule, as decoding would."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b, n in enumerate(state.seq_lens.tolist()):
        begin, end = query_start_loc[b], query_start_loc[b + 1]
        start = n - (end - begin)
        for i in range(begin, end):
            position = start + (i - begin)
            k, v = ref_context(state, b, position + 1, position, sink, recent)
            out[i] = ref_softmax_attention(query[i], k, v, scale)
    return out
