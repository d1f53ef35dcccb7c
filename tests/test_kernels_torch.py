"""The plain-torch kernel ops (CPU path) against float64 references written in the tests."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_oscar import kernels
from vllm_oscar.config import GRID_REFIT_ITERATIONS
from vllm_oscar.kernels import PageLayout, page_views, rotate_rows, torch_ops

from kernels_reference import (
    check_write_case,
    random_paged_state,
    random_rotations,
    ref_decode,
    ref_prefill,
    ref_prefill_from_cache,
    ref_quantize,
    ref_unpack,
    relative_error,
    rotate_and_write_case,
    rows_with_outliers,
    write_case,
)


@pytest.mark.parametrize("dim,group,bs,scale_dtype,prerotated", [
    (64, 64, 16, torch.float16, False),
    (128, 32, 8, torch.bfloat16, True),
    (32, 32, 4, torch.float32, False),
])
def test_torch_write_matches_reference(dim, group, bs, scale_dtype, prerotated) -> None:
    check_write_case(write_case(torch_ops, 37, 2, dim, group, bs, scale_dtype, prerotated, seed=dim + bs), prerotated)


@pytest.mark.parametrize("dim,group,bs,scale_dtype,prerotated", [
    (64, 64, 16, torch.float16, False),
    (128, 32, 8, torch.bfloat16, True),
    (32, 32, 4, torch.float32, False),
    (64, 16, 16, torch.float16, False),
])
def test_torch_write_with_refit_matches_reference(dim, group, bs, scale_dtype, prerotated) -> None:
    """Free refit grids (no floor) equal the float64 reference away from ties, never lose to
    min/max, and win overall (floors: test_torch_write_with_floored_refit_matches_reference)."""
    result = write_case(torch_ops, 37, 2, dim, group, bs, scale_dtype, prerotated, seed=dim + bs + 3,
                        refit_iterations=GRID_REFIT_ITERATIONS, refit_floor=(False, False))
    for summary in check_write_case(result, prerotated, GRID_REFIT_ITERATIONS, (False, False)):
        assert summary["error"] < 0.9 * summary["plain_error"], summary


def test_refit_never_worse_than_min_max_on_fresh_rows_with_outliers() -> None:
    """Per group, the written refit grid's error on the unclipped rotated row is <= the clipped
    min/max grid's (what the cache held before), on many fresh rows with planted outliers."""
    for seed in range(4):
        for ratio in (1.0, 0.84):
            gen = torch.Generator().manual_seed(100 + seed)
            rows = rows_with_outliers(64, 2, 64, gen)
            rotation = random_rotations(2, 64, gen)
            layout = PageLayout(64, 32 if seed % 2 else 64, 16, torch.float16)
            written = {}
            for iterations in (0, GRID_REFIT_ITERATIONS):
                cache = layout.allocate(4, 2)
                window = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
                kernels.oscar_write(rows, rows, rotation, rotation, ratio, ratio, cache, layout, torch.arange(64),
                                    window, window.clone(), torch.full((64,), -1), refit_iterations=iterations,
                                    refit_floor=(False, False))
                views = page_views(cache, layout)
                codes = ref_unpack(views.k_codes.permute(0, 2, 1, 3).reshape(64, 2, 16)).double()
                grouped = codes.reshape(64, 2, -1, layout.group_size)
                scale = views.k_scale.permute(0, 2, 1, 3).reshape(64, 2, -1).double()
                offset = views.k_offset.permute(0, 2, 1, 3).reshape(64, 2, -1).double()
                written[iterations] = grouped * scale[..., None] + offset[..., None]
            exact = torch.einsum("nhd,hde->nhe", rows.double(), rotation.double()).reshape(written[0].shape)
            plain_error = ((exact - written[0]) ** 2).sum(-1)
            refit_error = ((exact - written[GRID_REFIT_ITERATIONS]) ** 2).sum(-1)
            assert bool((refit_error <= plain_error * (1 + 1e-6) + 1e-12).all()), (seed, ratio)
            # Clipping already narrows the grid: the refit gains less from a clipped start.
            assert float(refit_error.sum()) < (0.95 if ratio < 1.0 else 0.8) * float(plain_error.sum()), (seed, ratio)


def test_write_refit_zero_is_the_plain_write_and_bad_values_raise() -> None:
    plain = write_case(torch_ops, 20, 2, 64, 32, 16, torch.float16, False, seed=9)
    zero = write_case(kernels, 20, 2, 64, 32, 16, torch.float16, False, seed=9, refit_iterations=0)
    assert torch.equal(plain[8], zero[8])
    refit = write_case(kernels, 20, 2, 64, 32, 16, torch.float16, False, seed=9, refit_iterations=2)
    direct = write_case(torch_ops, 20, 2, 64, 32, 16, torch.float16, False, seed=9, refit_iterations=2)
    assert torch.equal(refit[8], direct[8]) and not torch.equal(refit[8], plain[8])
    for bad in (-1, 1.5, True, (1, 2, 3), (0, -1)):
        with pytest.raises(ValueError, match="refit_iterations"):
            write_case(kernels, 4, 1, 32, 32, 4, torch.float16, False, seed=1, refit_iterations=bad)


@pytest.mark.parametrize("floor", [(False, False), (True, False), (True, True)])
def test_torch_write_with_floored_refit_matches_reference(floor) -> None:
    """refit_floor per side (the served default floors K): planes equal the float64 floored
    refit away from ties; a floored side never stores a scale below the min/max grid's."""
    result = write_case(torch_ops, 23, 2, 64, 32, 16, torch.float16, False, seed=31,
                        refit_iterations=GRID_REFIT_ITERATIONS, refit_floor=floor)
    for summary in check_write_case(result, False, GRID_REFIT_ITERATIONS, floor):
        assert summary["error"] <= summary["plain_error"], summary
    layout, cache, slots = result[0], result[8], result[6]
    plain = write_case(torch_ops, 23, 2, 64, 32, 16, torch.float16, False, seed=31, refit_iterations=0)[8]
    views, plain_views = page_views(cache, layout), page_views(plain, layout)
    blocks, offs = slots[slots >= 0] // 16, slots[slots >= 0] % 16
    for side, floored in zip("kv", floor):
        got = getattr(views, f"{side}_scale")[blocks, :, offs].float()
        start = getattr(plain_views, f"{side}_scale")[blocks, :, offs].float()
        # floored: never narrower; free: the refit narrows some grids (outlier rows)
        assert bool((got >= start).all()) == floored, side


def test_write_refit_per_side() -> None:
    """A (K, V) pair: K planes as written with K's rounds, V planes with V's."""
    views = {}
    for rounds in (0, 3, (0, 3), (3, 0)):
        cache = write_case(torch_ops, 20, 2, 64, 32, 16, torch.float16, False, seed=12, refit_iterations=rounds)[8]
        layout = PageLayout(64, 32, 16, torch.float16)
        v = page_views(cache, layout)
        views[rounds] = ((v.k_codes, v.k_scale, v.k_offset), (v.v_codes, v.v_scale, v.v_offset))

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert same(views[(0, 3)][0], views[0][0]) and same(views[(0, 3)][1], views[3][1])
    assert same(views[(3, 0)][0], views[3][0]) and same(views[(3, 0)][1], views[0][1])
    assert not same(views[0][1], views[3][1])


def test_write_with_query_on_cpu_returns_the_rotated_query_and_writes_the_same_cache() -> None:
    """kernels.oscar_write(query=...) on CPU: the cache bytes and window rows of the plain write, and q @ R_K
    against float64 (None without a query)."""
    for fused in (False, True):
        cache, window_k, window_v, q_rot, expected_q = rotate_and_write_case(kernels, 9, 2, 3, 64, None, fused, seed=4)
        if not fused:
            separate = (cache, window_k, window_v, q_rot)
    assert all(torch.equal(a, b) for a, b in zip(separate, (cache, window_k, window_v, q_rot)))
    assert q_rot.dtype == torch.float32 and relative_error(q_rot, expected_q) < 1e-6
    layout = PageLayout(64, 64, 16, torch.float16)
    rows = torch.randn(2, 1, 64, dtype=torch.bfloat16)
    window = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    assert kernels.oscar_write(rows, rows, torch.eye(64)[None], torch.eye(64)[None], 0.96, 0.92, layout.allocate(1, 1),
                               layout, torch.arange(2), window, window.clone(), torch.full((2,), -1)) is None


def test_rotate_rows_gqa_and_inverse() -> None:
    gen = torch.Generator().manual_seed(3)
    rotation = random_rotations(2, 16, gen)
    x = torch.randn(5, 6, 16, generator=gen)
    got = rotate_rows(x, rotation)
    expected = torch.stack([x[:, h].double() @ rotation[h // 3].double() for h in range(6)], dim=1)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rotate_rows(got, rotation, inverse=True), x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must divide"):
        rotate_rows(torch.randn(2, 5, 16), rotation)


def test_oscar_rotate_on_cpu_writes_the_rows_into_out_in_its_dtype() -> None:
    gen = torch.Generator().manual_seed(4)
    rotation = random_rotations(3, 16, gen)
    x = torch.randn(4, 9, 16, generator=gen, dtype=torch.float32)
    expected = torch.stack([x[:, h].double() @ rotation[h // 3].double().T for h in range(9)], dim=1)
    fresh = kernels.oscar_rotate(x, rotation, inverse=True)
    assert fresh.dtype == torch.float32
    torch.testing.assert_close(fresh.double(), expected, rtol=1e-5, atol=1e-5)
    output = torch.full((6, 9, 16), float("nan"), dtype=torch.bfloat16)
    assert kernels.oscar_rotate(x, rotation, inverse=True, out=output[:4]).data_ptr() == output.data_ptr()
    torch.testing.assert_close(output[:4].double(), expected, rtol=1e-2, atol=2e-2)
    assert torch.isnan(output[4:].float()).all()


# (seq_lens, Hq, Hkv, D, bs, sink, recent, dropped window blocks, query dtype)
#: (lens, Hq, Hkv, D, block, sink, recent, dropped window blocks, query dtype, group, scale dtype); the groups cover
#: every way a code plane (D/4 channels, quant.packing) meets them: inside one group, one group each, two groups each.
DECODE_CASES = [
    ([1, 5, 13, 40, 29], 4, 2, 32, 4, 5, 7, 0, torch.float32, 32, torch.float16),  # windows cut blocks at odd offsets
    ([70, 3, 33], 6, 2, 64, 16, 16, 24, 1, torch.float32, 8, torch.float32),  # fallback rows, two groups per plane
    ([50, 17], 8, 1, 32, 8, 0, 0, 0, torch.bfloat16, 8, torch.bfloat16),  # INT2 only, one group per plane
    ([9, 31], 2, 2, 32, 8, 64, 256, 0, torch.float32, 16, torch.float16),  # contexts shorter than the windows
]


@pytest.mark.parametrize("case", DECODE_CASES)
def test_torch_decode_matches_reference(case) -> None:
    lens, hq, hkv, dim, bs, sink, recent, drop, qdtype, group, scale_dtype = case
    gen = torch.Generator().manual_seed(sum(lens) + hq)
    layout = PageLayout(dim, group, bs, scale_dtype)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=drop)
    query = torch.randn(len(lens), hq, dim, generator=gen).to(qdtype)
    scale = 1.0 / math.sqrt(dim)
    out = torch.full(query.shape, float("nan"), dtype=qdtype)
    got = kernels.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                               state.window_block_table, state.seq_lens, sink, recent, scale, out=out)
    assert got is out
    expected = ref_decode(state, query.double(), sink, recent, scale)
    tolerance = 1e-5 if qdtype == torch.float32 else 1e-2
    assert relative_error(got, expected) < tolerance


#: Queries per attention call of the torch path: the default, and a small one that splits every chunk of the prefill
#: tests into several calls, each cut at its last query (torch_ops._attend).
QUERY_CHUNKS = [torch_ops.TORCH_QUERY_CHUNK, 4]


@pytest.mark.parametrize("query_chunk", QUERY_CHUNKS)
def test_torch_prefill_matches_reference(query_chunk, monkeypatch) -> None:
    monkeypatch.setattr(torch_ops, "TORCH_QUERY_CHUNK", query_chunk)
    gen = torch.Generator().manual_seed(11)
    hq, hkv, dim, bs, sink, recent = 4, 2, 32, 4, 6, 9
    chunks, lens = [5, 1, 7, 0], [21, 1, 7, 12]  # prefix 16, 0 (first chunk), 0, 12 (no new tokens)
    layout = PageLayout(dim, 16, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1)
    qsl = [0]
    for c in chunks:
        qsl.append(qsl[-1] + c)
    total = qsl[-1]
    query = torch.randn(total, hq, dim, generator=gen)
    key = torch.randn(total, hkv, dim, generator=gen)
    value = torch.randn(total, hkv, dim, generator=gen)
    scale = 0.2
    got = kernels.oscar_prefill(query, key, value, state.cache, state.window_k, state.window_v, layout,
                                state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                                state.seq_lens, sink, recent, scale)
    expected = ref_prefill(state, query, key, value, qsl, sink, recent, scale)
    assert relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("query_chunk", QUERY_CHUNKS)
def test_torch_prefill_chunk_from_cache_matches_decoding_token_by_token(query_chunk, monkeypatch) -> None:
    monkeypatch.setattr(torch_ops, "TORCH_QUERY_CHUNK", query_chunk)
    gen = torch.Generator().manual_seed(13)
    hq, hkv, dim, bs, sink, recent = 4, 2, 32, 4, 3, 6
    lens = [30, 1, 14]  # chunks of 9, 1 and 14 new tokens (qsl below)
    layout = PageLayout(dim, dim, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1)
    qsl = [0, 9, 10, 24]
    query = torch.randn(qsl[-1], hq, dim, generator=gen)
    got = kernels.oscar_prefill(query, None, None, state.cache, state.window_k, state.window_v, layout,
                                state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                                state.seq_lens, sink, recent, 0.3, chunk_from_cache=True)
    assert relative_error(got, ref_prefill_from_cache(state, query, qsl, sink, recent, 0.3)) < 1e-5
    with pytest.raises(ValueError, match="key_rot=None"):
        kernels.oscar_prefill(query, query[:, :2], query[:, :2], state.cache, state.window_k, state.window_v, layout,
                              state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                              state.seq_lens, sink, recent, 0.3, chunk_from_cache=True)


def test_write_then_decode_reads_what_was_written() -> None:
    """End to end on CPU: write a sequence with windows, decode, compare with fake-quantized math."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, dim, bs, sink, recent, n = 4, 2, 32, 8, 8, 8, 40
    layout = PageLayout(dim, dim, bs, torch.float16)
    key, value = rows_with_outliers(n, hkv, dim, gen), rows_with_outliers(n, hkv, dim, gen)
    rk, rv = random_rotations(hkv, dim, gen), random_rotations(hkv, dim, gen)
    nb = n // bs
    cache = layout.allocate(nb, hkv)
    wk = torch.zeros(nb, bs, hkv, dim, dtype=torch.bfloat16)
    wv = torch.zeros_like(wk)
    slots = torch.arange(n)
    # window blocks: logical block j -> window block j for sink block 0 and the last 2 blocks
    window_table = torch.tensor([[0, -1, -1, 3, 4]], dtype=torch.int32)
    window_slots = torch.tensor([int(window_table[0, s // bs]) * bs + s % bs if window_table[0, s // bs] >= 0 else -1
                                 for s in range(n)])
    kernels.oscar_write(key, value, rk, rv, 0.96, 0.92, cache, layout, slots, wk, wv, window_slots)
    query = torch.randn(1, hq, dim, generator=gen)
    got = kernels.oscar_decode(rotate_rows(query, rk), cache, wk, wv, layout, torch.arange(nb, dtype=torch.int32)[None],
                               window_table, torch.tensor([n], dtype=torch.int32), sink, recent, 0.25)
    k_rot = torch.einsum("nhd,hde->nhe", key.double(), rk.double())
    v_rot = torch.einsum("nhd,hde->nhe", value.double(), rv.double())
    kc, ks, ko, _ = ref_quantize(k_rot, 0.96, dim, torch.float16)
    vc, vs, vo, _ = ref_quantize(v_rot, 0.92, dim, torch.float16)
    k_hat = kc * ks.double() + ko.double()
    v_hat = vc * vs.double() + vo.double()
    bf16 = torch.tensor([s < sink or s > n - 1 - recent for s in range(n)])[:, None, None]
    k_read = torch.where(bf16, k_rot.to(torch.bfloat16).double(), k_hat)
    v_read = torch.where(bf16, v_rot.to(torch.bfloat16).double(), v_hat)
    q_rot = torch.einsum("nhd,hde->nhe", query.double(), rk.double().repeat_interleave(2, 0))
    logits = torch.einsum("hd,shd->hs", q_rot[0], k_read.repeat_interleave(2, 1)) * 0.25
    expected = torch.einsum("hs,shd->hd", torch.softmax(logits, -1), v_read.repeat_interleave(2, 1))
    assert relative_error(got[0], expected) < 1e-3


def test_bad_arguments_raise_clear_errors() -> None:
    layout = PageLayout(32, 32, 4)
    cache = layout.allocate(4, 2)
    wk = torch.zeros(2, 4, 2, 32, dtype=torch.bfloat16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of the cache's KV heads"):
        kernels.oscar_decode(torch.randn(1, 3, 32), cache, wk, wk, layout, table, table, torch.tensor([3]), 1, 1, 0.1)
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        kernels.oscar_decode(torch.randn(1, 2, 32), cache, wk, wk, layout, table, table, torch.tensor([-1]), 1, 1, 0.1)
    padding_row = kernels.oscar_decode(torch.randn(1, 2, 32), cache, wk, wk, layout, table, table, torch.tensor([0]),
                                       1, 1, 0.1)  # a CUDA graph's padding request: nothing to read
    assert torch.equal(padding_row, torch.zeros_like(padding_row))
    with pytest.raises(ValueError, match="int2_cache must be uint8"):
        kernels.oscar_decode(torch.randn(1, 2, 32), cache.float(), wk, wk, layout, table, table, torch.tensor([3]),
                             1, 1, 0.1)
    with pytest.raises(ValueError, match="v_rotation is required"):
        kernels.oscar_write(torch.randn(2, 2, 32), torch.randn(2, 2, 32), torch.randn(2, 32, 32), None, 0.9, 0.9,
                            cache, layout, torch.arange(2), wk, wk, torch.full((2,), -1))
    with pytest.raises(ValueError, match="clip_k"):
        kernels.oscar_write(torch.randn(2, 2, 32), torch.randn(2, 2, 32), torch.randn(2, 32, 32),
                            torch.randn(2, 32, 32), 1.5, 0.9, cache, layout, torch.arange(2), wk, wk,
                            torch.full((2,), -1))
