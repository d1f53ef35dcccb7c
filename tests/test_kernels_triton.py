"""The Triton kernels under TRITON_INTERPRET=1 (CPU) against the float64 references.

Select with ``-m triton_interpret``. Shapes are tiny (the interpreter runs each program in
numpy); the same checks at real sizes run on the GPU in bench/check_kernels_gpu.py.
The interpreter is switched on only while this module imports the kernel modules and
while its tests run, so other tests in the same process are unaffected.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from vllm_oscar.config import GRID_REFIT_ITERATIONS
from vllm_oscar.kernels import PageLayout, torch_ops

from kernels_reference import (
    POISON_BYTE,
    check_write_case,
    int8_rounded_query,
    random_paged_state,
    random_rotations,
    ref_decode,
    ref_prefill,
    ref_prefill_from_cache,
    relative_error,
    rotate_and_write_case,
    rows_with_outliers,
    write_case,
)

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    from vllm_oscar.kernels import flash_plan, flash_prefill, measured_plans, triton_ops
    from vllm_oscar.kernels.triton_common import UNPACK_PTX
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous

pytestmark = [
    pytest.mark.triton_interpret,
    pytest.mark.skipif(not triton_ops._interpreting(),
                       reason="the kernel modules were imported without TRITON_INTERPRET=1 earlier in this process"),
]



@pytest.fixture(autouse=True)
def _interpreter_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton consults TRITON_INTERPRET at launch too; keep it on for these tests only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


#: bf16 operands (query planes, p * scale) and a bf16 output: errors land near 3e-3.
BF16_TOLERANCE = 1e-2


@pytest.mark.parametrize("dim,group,bs,scale_dtype,prerotated", [
    (64, 64, 16, torch.float16, False),
    (64, 32, 32, torch.bfloat16, True),
    (128, 32, 16, torch.float32, False),
    (256, 128, 16, torch.float16, False),
])
def test_triton_write_matches_reference(dim, group, bs, scale_dtype, prerotated) -> None:
    result = write_case(triton_ops, 21, 2, dim, group, bs, scale_dtype, prerotated, seed=dim + bs + 1)
    check_write_case(result, prerotated)


@pytest.mark.parametrize("dim,group", [(64, 64), (128, 128), (128, 32)])
def test_triton_write_clip_by_maximum_removal_matches_reference(dim, group) -> None:
    """The default clip by maximum removal and WriteConfig(clip_search="bisect"): the same exact clip
    threshold (rows with planted outliers, so the top values are spread; served refit)."""
    result = write_case(triton_ops, 21, 2, dim, group, 16, torch.float16, False, seed=dim + group,
                        refit_iterations=GRID_REFIT_ITERATIONS)
    check_write_case(result, False, GRID_REFIT_ITERATIONS)
    bisected = write_case(triton_ops, 21, 2, dim, group, 16, torch.float16, False, seed=dim + group,
                          refit_iterations=GRID_REFIT_ITERATIONS, launch=triton_ops.WriteConfig(clip_search="bisect"))
    check_write_case(bisected, False, GRID_REFIT_ITERATIONS)
    assert torch.equal(result[8], bisected[8])


def test_triton_write_refit_loop_and_unrolled_write_the_same_bytes() -> None:
    """The default refit loop and WriteConfig(unroll_refit=True): the same cache bytes."""
    looped = write_case(triton_ops, 21, 2, 128, 128, 16, torch.float16, False, seed=12,
                        refit_iterations=GRID_REFIT_ITERATIONS)
    check_write_case(looped, False, GRID_REFIT_ITERATIONS)
    unrolled = write_case(triton_ops, 21, 2, 128, 128, 16, torch.float16, False, seed=12,
                          refit_iterations=GRID_REFIT_ITERATIONS, launch=triton_ops.WriteConfig(unroll_refit=True))
    assert torch.equal(looped[8], unrolled[8])


def _write_parts(store_window: bool, int2: str, flag_value=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One write of fresh rows (as write_case) into poisoned caches: (INT2 pages, window K, window V)."""
    gen = torch.Generator().manual_seed(21)
    layout = PageLayout(64, 64, 16, torch.float16)
    rows_k, rows_v = torch.randn(7, 2, 64, generator=gen), torch.randn(7, 2, 64, generator=gen)
    rows_k[:, :, 5] *= 30.0  # an outlier channel
    rotation = random_rotations(2, 64, gen)
    cache = torch.full(layout.cache_shape(3, 2), 0xA7, dtype=torch.uint8)
    window_k = torch.full((3, 16, 2, 64), float("nan"), dtype=torch.bfloat16)
    window_v = window_k.clone()
    slots, window_slots = torch.randperm(48, generator=gen)[:7], torch.tensor([3, -1, 9, 20, -1, 33, 40])
    flag = None if flag_value is None else torch.tensor([flag_value], dtype=torch.int32)
    triton_ops.oscar_write(rows_k.to(torch.bfloat16), rows_v.to(torch.bfloat16), rotation, rotation, 0.96, 0.92, cache,
                           layout, slots, window_k, window_v, window_slots, refit_iterations=GRID_REFIT_ITERATIONS,
                           store_window=store_window, int2=int2, flag=flag)
    return cache, window_k.view(torch.int16), window_v.view(torch.int16)


def test_triton_write_parts_and_flag_modes_write_exactly_their_part() -> None:
    """The window copies and the INT2 part in separate launches (the INT2 part beside the attention) write
    what one full launch writes, each part only its own bytes; the flag modes run on 1 / 0 as named."""
    full_cache, full_wk, full_wv = _write_parts(True, "always")
    poisoned = _write_parts(False, "never")  # writes nothing at all
    assert not torch.equal(poisoned[0], full_cache)
    window_only = _write_parts(True, "never")
    assert torch.equal(window_only[0], poisoned[0]) and torch.equal(window_only[1], full_wk)
    assert torch.equal(window_only[2], full_wv)
    int2_only = _write_parts(False, "always")
    assert torch.equal(int2_only[0], full_cache) and torch.equal(int2_only[1], poisoned[1])
    for mode, flag, writes in (("if_flag", 1, True), ("if_flag", 0, False), ("unless_flag", 0, True),
                               ("unless_flag", 1, False)):
        cache = _write_parts(False, mode, flag)[0]
        assert torch.equal(cache, full_cache if writes else poisoned[0]), (mode, flag)


@pytest.mark.parametrize("dim,group,bs,scale_dtype,prerotated,tokens,apart", [
    (64, 64, 16, torch.float16, False, 5, True),
    (128, 32, 16, torch.float32, False, 3, True),  # four groups per row, fp32 scales
    (64, 32, 32, torch.bfloat16, True, 6, True),  # values arrive rotated
    (64, 64, 16, torch.float16, False, 5, "rotated"),  # the rotated rows of the first launch
    (128, 32, 16, torch.float32, True, 3, "rotated"),
])
def test_triton_int2_write_by_row_programs_matches_float64(dim, group, bs, scale_dtype, prerotated, tokens,
                                                           apart) -> None:
    """A captured decode step's two writes, the INT2 part by row programs (one warp per token, KV head and side:
    WriteConfig(row_programs=True)), rotating or reading the rows the first launch rotated: rotation, clip and refit
    against float64, padding rows (slot -1) untouched."""
    result = write_case(triton_ops, tokens, 2, dim, group, bs, scale_dtype, prerotated, seed=1,
                        refit_iterations=GRID_REFIT_ITERATIONS, launch=triton_ops.WriteConfig(row_programs=True),
                        int2_apart=apart)
    assert bool((result[6] < 0).any()) and bool((result[6] >= 0).any())  # seed 1: padding and written rows
    check_write_case(result, prerotated, GRID_REFIT_ITERATIONS)


def test_int2_only_writes_of_decode_size_take_row_programs(monkeypatch) -> None:
    """WriteConfig.row_programs: None = row programs for an INT2-only launch of at most WRITE_ROWS_MAX_TOKENS new
    tokens and head_dim <= WRITE_ROWS_MAX_HEAD_DIM; launches with window copies or a query never; True / False force
    it for INT2-only launches."""
    limit, dim = triton_ops.WRITE_ROWS_MAX_TOKENS, triton_ops.WRITE_ROWS_MAX_HEAD_DIM
    auto, rows, tiles = (triton_ops.WriteConfig(row_programs=choice) for choice in (None, True, False))
    assert triton_ops._row_programs(auto, False, False, limit, dim)
    assert not triton_ops._row_programs(auto, False, False, limit + 1, dim)
    assert not triton_ops._row_programs(auto, False, False, 1, 2 * dim)
    assert not triton_ops._row_programs(auto, True, False, 1, dim) and not triton_ops._row_programs(rows, False, True,
                                                                                                     1, dim)
    assert triton_ops._row_programs(rows, False, False, 10 * limit, 2 * dim)
    assert not triton_ops._row_programs(tiles, False, False, 1, dim)
    launched = []
    monkeypatch.setattr(triton_ops, "oscar_write_rows_kernel", _Recorder(launched, "rows"))
    monkeypatch.setattr(triton_ops, "oscar_write_kernel", _Recorder(launched, "tiles"))
    _write_parts(False, "always")  # 7 tokens, INT2 only
    _write_parts(True, "always")
    assert launched == [("rows", (7, 2, 2)), ("tiles", (1, 2, 2))]


def test_rotated_rows_go_only_between_a_flagged_launch_and_row_programs() -> None:
    key = torch.zeros(3, 2, 64, dtype=torch.bfloat16)
    rows = torch.zeros(3, 2, 2, 64)
    rows_only = triton_ops.WriteConfig(row_programs=True)
    check = triton_ops._check_rotated_rows
    check(rows, None, key, True, "if_flag", True, rows_only)
    check(None, rows, key, False, "unless_flag", False, rows_only)
    with pytest.raises(ValueError, match="flagged launch"):
        check(rows, None, key, True, "always", False, rows_only)
    with pytest.raises(ValueError, match="row programs only"):
        check(None, rows, key, False, "unless_flag", False, triton_ops.WriteConfig(row_programs=False))
    with pytest.raises(ValueError, match="shape"):
        check(None, rows[:, :, :1], key, False, "unless_flag", False, rows_only)
    with pytest.raises(ValueError, match="float32"):
        check(None, rows.half(), key, False, "unless_flag", False, rows_only)


class _Recorder:
    """Stands in for a Triton kernel: records (name, grid) of each launch and runs nothing."""

    def __init__(self, launched: list, name: str) -> None:
        self.launched, self.name = launched, name

    def __getitem__(self, grid):
        self.launched.append((self.name, grid))
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("columns, prerotated", [(16, False), (32, True), (64, False)])
def test_triton_window_copies_by_column_blocks_match_float64(columns, prerotated) -> None:
    """A flagged launch's window-copy programs, WriteConfig(window_columns) output columns of K or V each: every
    copied row within one bf16 rounding of float64 x @ R (V as given where pre-rotated), the rows without a window
    slot untouched (NaN poison), the INT2 part not written (if_flag with the flag 0)."""
    gen = torch.Generator().manual_seed(columns + prerotated)
    dim, hkv, tokens, bs = 64, 2, 9, 16
    layout = PageLayout(dim, dim, bs, torch.float16)
    key, value = rows_with_outliers(tokens, hkv, dim, gen), rows_with_outliers(tokens, hkv, dim, gen)
    k_rotation, v_rotation = random_rotations(hkv, dim, gen), random_rotations(hkv, dim, gen)
    cache = torch.full(layout.cache_shape(2, hkv), POISON_BYTE, dtype=torch.uint8)
    window_k = torch.full((2, bs, hkv, dim), float("nan"), dtype=torch.bfloat16)
    window_v = window_k.clone()
    window_slots = torch.randperm(2 * bs, generator=gen)[:tokens]
    window_slots[torch.rand(tokens, generator=gen) < 0.3] = -1
    triton_ops.oscar_write(key, value, k_rotation, v_rotation, 0.96, 0.92, cache, layout, torch.arange(tokens),
                           window_k, window_v, window_slots, value_prerotated=prerotated, int2="if_flag",
                           flag=torch.zeros(1, dtype=torch.int32),
                           config=triton_ops.WriteConfig(window_columns=columns))
    assert bool((cache == POISON_BYTE).all())
    expected_v = value.double() if prerotated else torch.einsum("nhd,hde->nhe", value.double(), v_rotation.double())
    kept = window_slots >= 0
    untouched = torch.ones(2 * bs, dtype=torch.bool)
    untouched[window_slots[kept]] = False
    for window, expected in ((window_k, torch.einsum("nhd,hde->nhe", key.double(), k_rotation.double())),
                             (window_v, expected_v)):
        rows = window.view(2 * bs, hkv, dim)
        torch.testing.assert_close(rows[window_slots[kept]].double(), expected[kept], rtol=2.0 ** -8, atol=1e-6)
        assert bool(torch.isnan(rows[untouched]).all())


def test_write_config_rejects_bad_window_columns() -> None:
    for columns in (8, 24, 0):
        with pytest.raises(ValueError, match="window_columns"):
            triton_ops.WriteConfig(window_columns=columns)


@pytest.mark.parametrize("dim, hkv, group, tokens", [(64, 2, 3, 7), (128, 2, 4, 20), (64, 3, 1, 33), (64, 1, 4, 70)])
def test_triton_write_with_query_equals_the_write_and_the_query_rotation(dim, hkv, group, tokens) -> None:
    """A captured decode step's first launch (oscar_write with query): the cache bytes of oscar_write with the
    same parts and flag, and the rotated queries of oscar_rotate, whether the query rows need more programs
    than the write tiles (GQA 4, 20 tokens), fewer, or as many, and past ROTATE_SMALL_ROWS (280 rows: the
    rotation in a launch of its own); q_rot against float64."""
    for flag_value in (0, 1):
        separate, fused = (rotate_and_write_case(triton_ops, tokens, hkv, group, dim, flag_value, launch,
                                                 seed=dim + tokens)
                           for launch in (False, True))
        for name, a, b in zip(("int2", "window_k", "window_v", "q_rot"), separate[:4], fused[:4]):
            assert torch.equal(a, b), (name, flag_value)
        assert bool((fused[0] != POISON_BYTE).any()) == bool(flag_value)  # the INT2 part ran only where flagged
        assert not bool(torch.isnan(fused[1].view(torch.bfloat16)).all())  # window copies written either way
        assert relative_error(fused[3].double(), fused[4]) < 1e-6


@pytest.mark.parametrize("ops", [triton_ops, torch_ops], ids=["triton", "torch"])
def test_write_rejects_a_query_of_other_tokens(ops) -> None:
    layout = PageLayout(64, 64, 16, torch.float16)
    rows = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    rotation = torch.eye(64).expand(2, 64, 64).contiguous()
    window = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    for query, message in ((torch.zeros(3, 4, 64, dtype=torch.bfloat16), "same tokens"),
                           (torch.zeros(4, 3, 64, dtype=torch.bfloat16), r"rotation heads \(2\) must divide")):
        with pytest.raises(ValueError, match=message):
            ops.oscar_write(rows, rows, rotation, rotation, 0.96, 0.92, layout.allocate(2, 2), layout,
                            torch.arange(4), window, window.clone(), torch.full((4,), -1), query=query)


def test_triton_write_rejects_bad_parts() -> None:
    with pytest.raises(ValueError, match="int2='sometimes'"):
        _write_parts(True, "sometimes")
    with pytest.raises(ValueError, match="reads a flag"):
        _write_parts(False, "if_flag")


def test_triton_write_clip_by_maximum_removal_counts_ties() -> None:
    """Rows whose largest |values| repeat: removing a maximum removes all its ties, counted."""
    gen = torch.Generator().manual_seed(9)
    dim = 64
    rows = torch.randn(16, 1, dim, generator=gen)
    rows[:, :, :2] = 5.0  # two equal maxima, then three equal runners-up: the 0.96 threshold (3rd
    rows[:, :, 2:5] = -4.0  # largest) is 4.0, reached in the second round; 0.92 (6th) in the third
    identity = torch.eye(dim).unsqueeze(0)
    layout = PageLayout(dim, dim, 16, torch.float32)
    outs = []
    for search in ("bisect", "top"):
        cache = layout.allocate(2, 1)
        window = torch.zeros(2, 16, 1, dim, dtype=torch.bfloat16)
        triton_ops.oscar_write(rows.to(torch.bfloat16), rows.to(torch.bfloat16), identity, identity, 0.96, 0.92, cache,
                               layout, torch.arange(16), window, window.clone(), torch.full((16,), -1),
                               config=triton_ops.WriteConfig(clip_search=search))
        outs.append(cache)
    assert torch.equal(outs[0], outs[1])


def test_triton_write_config_rejects_unknown_choices() -> None:
    with pytest.raises(ValueError, match="clip_search='sort'"):
        triton_ops.WriteConfig(clip_search="sort")
    with pytest.raises(ValueError, match="rotation_precision='tf32'"):
        triton_ops.WriteConfig(rotation_precision="tf32")


def test_triton_write_agrees_with_torch_write() -> None:
    """Same input through both paths: the caches match byte for byte almost everywhere."""
    a = write_case(triton_ops, 19, 1, 64, 64, 16, torch.float16, False, seed=7)
    b = write_case(torch_ops, 19, 1, 64, 64, 16, torch.float16, False, seed=7)
    differing = (a[8] != b[8]).float().mean().item()
    assert differing < 0.01
    torch.testing.assert_close(a[9], b[9], equal_nan=True, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dim,group,bs,scale_dtype,prerotated", [
    (64, 64, 16, torch.float16, False),
    (64, 32, 32, torch.bfloat16, True),
    (128, 32, 16, torch.float32, False),
    (128, 128, 16, torch.float16, False),
])
def test_triton_write_with_refit_matches_reference(dim, group, bs, scale_dtype, prerotated) -> None:
    """The fused kernel's refit grids equal the float64 reference away from ties (see
    kernels_reference.check_written_refit) and never lose to the min/max grid; free refit
    on both sides, then the served floors (keys floored: the floored grid gains less)."""
    result = write_case(triton_ops, 21, 2, dim, group, bs, scale_dtype, prerotated, seed=dim + bs + 5,
                        refit_iterations=GRID_REFIT_ITERATIONS, refit_floor=(False, False))
    for summary in check_write_case(result, prerotated, GRID_REFIT_ITERATIONS, (False, False)):
        assert summary["error"] < 0.9 * summary["plain_error"], summary
    result = write_case(triton_ops, 21, 2, dim, group, bs, scale_dtype, prerotated, seed=dim + bs + 5,
                        refit_iterations=GRID_REFIT_ITERATIONS)
    for summary in check_write_case(result, prerotated, GRID_REFIT_ITERATIONS):
        assert summary["error"] <= summary["plain_error"] * (1 + 1e-6), summary


@pytest.mark.parametrize("rounds,floor", [(GRID_REFIT_ITERATIONS, (True, False)),
                                          ((0, GRID_REFIT_ITERATIONS), (True, False)),
                                          (GRID_REFIT_ITERATIONS, (False, False)),
                                          (GRID_REFIT_ITERATIONS, (True, True))])
def test_triton_refit_write_agrees_with_torch_write(rounds, floor) -> None:
    a = write_case(triton_ops, 19, 2, 64, 32, 16, torch.float16, False, seed=8, refit_iterations=rounds,
                   refit_floor=floor)
    b = write_case(torch_ops, 19, 2, 64, 32, 16, torch.float16, False, seed=8, refit_iterations=rounds,
                   refit_floor=floor)
    differing = (a[8] != b[8]).float().mean().item()
    assert differing < 0.01


def run_decode(lens, hq, hkv, dim, group, bs, sink, recent, drop, block_t, splits, seed, qdtype=torch.bfloat16,
               tokens_on_m=True, query_scale=1.0, window_block_t=None, merge_block_d=None, windows_first=None,
               full_tiles=None, tma_stages=0, fold_tiles=None):
    gen = torch.Generator().manual_seed(seed)
    layout = PageLayout(dim, group, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=drop)
    query = (query_scale * torch.randn(len(lens), hq, dim, generator=gen)).to(qdtype)
    scale = 1.0 / math.sqrt(dim)
    out = torch.full(query.shape, float("nan"), dtype=qdtype)
    config = triton_ops.AttentionConfig(block_t=block_t, num_splits=splits, tokens_on_m=tokens_on_m,
                                        window_block_t=window_block_t, merge_block_d=merge_block_d,
                                        windows_first=windows_first, full_tiles=full_tiles, tma_stages=tma_stages,
                                        fold_tiles=fold_tiles)
    got = triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                  state.window_block_table, state.seq_lens, sink, recent, scale, out=out, config=config)
    assert got is out
    expected = ref_decode(state, query.double(), sink, recent, scale)
    for row in range(len(lens)):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row} (len {lens[row]})"


# (lens, Hq, Hkv, D, G, bs, sink, recent, dropped window blocks, block_t, splits)
DECODE_CASES = {
    "gqa4-ragged-splits": ([1, 17, 40, 90], 4, 2, 64, 64, 16, 5, 7, 0, 16, 3),
    "gqa3-fallback-rows": ([70, 33], 6, 2, 64, 32, 32, 16, 24, 1, 16, 2),
    "mha-gather-tiles": ([100, 3], 2, 2, 64, 16, 8, 3, 20, 0, 32, 4),
    "gqa8-d128-int2-only": ([77], 8, 1, 128, 128, 16, 0, 0, 0, 16, 5),
    "gqa16-short-contexts": ([9, 30], 16, 1, 64, 64, 16, 64, 256, 0, 16, 2),
    "d256-groups4": ([45], 2, 1, 256, 64, 16, 4, 9, 0, 16, 2),
    "block64-tile32": ([150], 4, 1, 64, 64, 64, 8, 40, 1, 32, 3),
    "gqa4-windows-without-copies": ([130, 66, 5], 8, 2, 64, 64, 16, 8, 40, 1, 32, 2),
}


@pytest.mark.parametrize("case", list(DECODE_CASES.values()), ids=list(DECODE_CASES))
def test_triton_decode_matches_reference(case) -> None:
    run_decode(*case, seed=sum(case[0]) + case[1])


def test_triton_decode_padding_rows_read_nothing() -> None:
    """Rows of a CUDA graph's batch beyond its requests (seq_len 0, max_seq_len = max_model_len) give
    zeros and leave the real rows as the float64 reference has them."""
    gen = torch.Generator().manual_seed(5)
    layout = PageLayout(128, 128, 16, torch.float16)
    lens = [90, 40, 3]
    state = random_paged_state(lens, 2, layout, 8, 24, gen)
    query = torch.randn(len(lens), 8, 128, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(128)
    expected = ref_decode(state, query.double(), 8, 24, scale)
    padded = state.seq_lens.clone()
    padded[1:] = 0
    got = triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                  state.window_block_table, padded, 8, 24, scale, max_seq_len=1024,
                                  config=triton_ops.AttentionConfig(block_t=16))
    assert relative_error(got[0], expected[0]) < BF16_TOLERANCE
    assert torch.equal(got[1:].float(), torch.zeros_like(got[1:].float()))


def decode_split_usage(monkeypatch, state, query, sink, recent, scale, max_seq_len, config):
    """oscar_decode's output, its split count and the non-empty split partials per (request, query head) [B, Hq]
    (from the log-sum-exps the merge receives: an empty split's is -inf; its partial is set to NaN first)."""
    seen = {}
    merge_partials = triton_ops._merge_partials

    def merge(part, lse, *args, **kwargs):
        seen["lse"] = lse.clone()
        # an empty split's partial may hold anything: the merge must not use it
        part[torch.isneginf(lse)] = float("nan")
        return merge_partials(part, lse, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "_merge_partials", merge)
    layout = state.layout
    args = (query, state.cache, state.window_k, state.window_v, layout, state.block_table, state.window_block_table,
            state.seq_lens, sink, recent, scale)
    got = triton_ops.oscar_decode(*args, max_seq_len=max_seq_len, config=config)
    nsplit = triton_ops.decode_split_count(*args, max_seq_len=max_seq_len, config=config)
    return got, nsplit, torch.isfinite(seen["lse"][:, :, :nsplit]).sum(dim=-1)


def test_triton_decode_splits_sized_for_a_longer_context_walk_at_least_min_tiles(monkeypatch) -> None:
    """A launch sized for a much longer context (a captured graph's max_model_len) has more split programs
    than the short contexts it serves have tiles: each used split still walks >= min_tiles_per_split tiles,
    the rest stay empty (lse -inf), and the merge, which skips empty partials, matches float64."""
    gen = torch.Generator().manual_seed(23)
    layout = PageLayout(64, 64, 16, torch.float16)
    lens, sink, recent, block_t = [300, 97, 40], 8, 24, 16
    state = random_paged_state(lens, 2, layout, sink, recent, gen)
    query = torch.randn(len(lens), 8, 64, generator=gen).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(64)
    config = triton_ops.AttentionConfig(block_t=block_t, window_block_t=16)
    got, nsplit, used = decode_split_usage(monkeypatch, state, query, sink, recent, scale, 4096, config)
    expected = ref_decode(state, query.double(), sink, recent, scale)
    for row in range(len(lens)):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row} (len {lens[row]})"
    assert nsplit >= 64  # sized for 4096 positions: far more splits than these requests have tiles
    for row, length in enumerate(lens):
        int2_end = max(sink, length - recent)
        whole_tiles = max(0, int2_end // block_t - math.ceil(sink / block_t))  # the splits' whole tiles
        assert int(used[row].max()) == math.ceil(whole_tiles / config.min_tiles_per_split), f"request {row}"


def _plan_case(seed: int):
    """A small decode case for split-count tests (3 requests of 300 / 97 / 40 positions, 2 KV heads, GQA 4, D 64,
    blocks of 16, windows 8 / 24): (layout, lens, sink, recent, state, query, float64 expected output)."""
    gen = torch.Generator().manual_seed(seed)
    layout = PageLayout(64, 64, 16, torch.float16)
    lens, sink, recent = [300, 97, 40], 8, 24
    state = random_paged_state(lens, 2, layout, sink, recent, gen)
    query = torch.randn(len(lens), 8, 64, generator=gen).to(torch.bfloat16)
    return layout, lens, sink, recent, state, query, ref_decode(state, query.double(), sink, recent, 0.125)


def test_triton_decode_takes_the_split_count_of_a_measured_plan_in_its_context_bucket(monkeypatch) -> None:
    """A table of measured plans (measured_plans.using_table) sets the split count of launches of its cell's
    geometry, windows and batch sized for max_seq_len in (context / 2, context], cut to splits of >= min_tiles tiles
    that get tiles; other launches keep the rules' count; every output matches float64."""
    layout, lens, sink, recent, state, query, expected = _plan_case(29)
    config = triton_ops.AttentionConfig(block_t=16, window_block_t=16)

    def table(splits: int, batch: int = 3) -> measured_plans.PlanTable:
        cell = measured_plans.PlanCell(8, 2, 64, 16, sink, recent, batch, 512)
        return measured_plans.PlanTable("test", 132, (measured_plans.MeasuredPlan(cell, splits),), "test")

    def splits_with(plans, max_seq_len: int, launch_config=config) -> int:
        with measured_plans.using_table(plans):
            got, nsplit, _ = decode_split_usage(monkeypatch, state, query, sink, recent, 0.125, max_seq_len,
                                                launch_config)
        for row in range(len(lens)):
            assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row}"
        return nsplit

    rules_400 = splits_with(None, 400)
    assert rules_400 != 5
    assert splits_with(table(5), 400) == 5
    # 40 splits at max_seq_len 400 (25 tiles of 16): 12 of >= 2 tiles, of which 11 get the 22 whole INT2 tiles.
    assert splits_with(table(40), 400) == 11
    assert splits_with(table(5), 512) == 5
    assert splits_with(table(5), 256) == splits_with(None, 256)  # below the bucket (256, 512]
    assert splits_with(table(5), 513) == splits_with(None, 513)
    assert splits_with(table(5, batch=4), 400) == rules_400  # another batch
    assert splits_with(table(5), 400, dataclasses.replace(config, num_splits=3)) == 3  # explicit knobs win
    plan_args = (query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                 state.window_block_table, state.seq_lens, sink, recent, 0.125, 400, config)
    with measured_plans.using_table(table(5)):
        assert triton_ops.decode_plan(*plan_args).measured
    assert not triton_ops.decode_plan(*plan_args).measured


def test_triton_decode_beside_a_write_leaves_it_room(monkeypatch) -> None:
    """AttentionConfig(beside_write=True), a captured decode step's attention beside its side-stream INT2 write:
    ceil(7/8) of the plan's splits, the rules' or a measured plan's, cut to the splits that get tiles, where
    max_seq_len and batch are in its bounds (lowered here to the test's sizes); an explicit num_splits is kept; every
    output matches float64."""
    _, lens, sink, recent, state, query, expected = _plan_case(31)
    config = triton_ops.AttentionConfig(block_t=16, window_block_t=16)
    beside = dataclasses.replace(config, beside_write=True)
    cell = measured_plans.PlanCell(8, 2, 64, 16, sink, recent, 3, 512)

    def splits_with(launch_config, measured_splits=None) -> int:
        plans = None if measured_splits is None else measured_plans.PlanTable(
            "test", 132, (measured_plans.MeasuredPlan(cell, measured_splits),), "test")
        with measured_plans.using_table(plans):
            got, nsplit, _ = decode_split_usage(monkeypatch, state, query, sink, recent, 0.125, 400, launch_config)
        for row in range(len(lens)):
            assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row}"
        return nsplit

    # max_seq_len 400: 22 whole INT2 tiles of 16, splits of >= 2 tiles.
    rules = splits_with(config)
    assert splits_with(beside) == rules  # 400 <= BESIDE_WRITE_MIN_SEQ_LEN
    monkeypatch.setattr(triton_ops, "BESIDE_WRITE_MIN_SEQ_LEN", 399)
    monkeypatch.setattr(triton_ops, "BESIDE_WRITE_MAX_BATCH", 2)
    monkeypatch.setattr(triton_ops, "_PLANS", {})  # plans cached under the shipped bounds
    assert splits_with(beside) == rules  # batch 3 > BESIDE_WRITE_MAX_BATCH
    monkeypatch.setattr(triton_ops, "BESIDE_WRITE_MAX_BATCH", 3)
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    assert splits_with(beside) == triton_ops.beside_write_splits(rules, 22, 2) < rules
    assert (splits_with(config, 8), splits_with(beside, 8)) == (8, 6)  # 7 splits of 4 tiles: 6 get tiles
    assert splits_with(dataclasses.replace(beside, num_splits=3)) == 3


def test_beside_write_splits_rounds_up_and_keeps_every_split_in_tiles() -> None:
    assert triton_ops.beside_write_splits(33, None, 1) == 29
    assert triton_ops.beside_write_splits(1, None, 1) == 1
    assert triton_ops.beside_write_splits(129, 2049, 3) == 108  # 113 splits of 19 tiles: 108 get tiles


@pytest.mark.parametrize("query_scale", [0.5, 8.0, 40.0])
def test_triton_decode_lazy_rescale_over_many_tiles(query_scale) -> None:
    """One split walks 14 tiles of pure INT2 history; the query scale sets how often a tile's
    max exceeds the running max by more than the lazy-rescale slack (rarely at 0.5, often at
    40, where the softmax is nearly one-hot), so both the skipped and the taken rescale run."""
    run_decode([220], 4, 1, 64, 64, 16, 0, 0, 0, 16, 1, seed=31, query_scale=query_scale)


@pytest.mark.parametrize("fold_tiles,query_scale", [(1, 40.0), (4, 0.5), (16, 8.0)])
def test_triton_decode_bias_fold_periods(fold_tiles, query_scale) -> None:
    """The BIAS sums leave the V accumulators every fold_tiles tiles of a 14-tile split (every tile, three times,
    only at the end), also between lazy rescales (query scale 40); ZW_COLS (GQA 4) and a D=128 case."""
    run_decode([220], 4, 1, 64, 64, 16, 0, 0, 0, 16, 1, seed=37, query_scale=query_scale, fold_tiles=fold_tiles)
    run_decode([150, 40], 8, 2, 128, 128, 16, 4, 16, 0, 16, 1, seed=41, query_scale=query_scale, fold_tiles=fold_tiles)


@pytest.mark.parametrize("lens,hq,hkv,dim,bs,block_t,splits", [
    ([300, 77, 1], 8, 2, 128, 16, 32, 3),   # GQA 4, gathered tiles, ragged
    ([200], 8, 1, 256, 64, 32, 2),          # GQA 8, D 256, whole-block tiles
    ([150, 40], 3, 3, 128, 32, 64, 1),      # MHA, one split (logits columns in four parts)
    ([130, 61], 6, 2, 128, 16, 32, 2),      # GQA 3: a padded head beside the two parts
    ([97], 4, 2, 128, 16, 16, 2),           # GQA 2: four parts
    ([150, 33], 9, 3, 64, 16, 32, 2),       # head_dim 64 (SmolLM2): planes paired into K = 32, GQA 3
    ([120], 2, 2, 64, 64, 64, 1),           # head_dim 64, MHA: four parts over the paired planes
])
@pytest.mark.parametrize("full_tiles", [False, True])
def test_triton_decode_int8_key_path_matches_int8_query_reference(lens, hq, hkv, dim, bs, block_t, splits,
                                                                   full_tiles) -> None:
    """int8_keys: pure INT2 history (no windows) against float64 attention over the same
    dequantized keys/values with the query rounded to int8 per head row (full_tiles: the partial
    last tile read by a window program, also with int8 keys)."""
    gen = torch.Generator().manual_seed(sum(lens) + dim)
    layout = PageLayout(dim, dim, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, 0, 0, gen)
    query = (3.0 * torch.randn(len(lens), hq, dim, generator=gen)).to(torch.bfloat16)
    query[:, :, 5] *= 8.0  # a planted outlier channel sets the int8 step
    scale = 1.0 / math.sqrt(dim)
    config = triton_ops.AttentionConfig(block_t=block_t, num_splits=splits, int8_keys=True, full_tiles=full_tiles)
    got = triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                  state.window_block_table, state.seq_lens, 0, 0, scale, config=config)
    expected = ref_decode(state, int8_rounded_query(query), 0, 0, scale)
    bf16_path = ref_decode(state, query.double(), 0, 0, scale)
    for row in range(len(lens)):
        error = relative_error(got[row], expected[row])
        assert error < BF16_TOLERANCE, f"request {row} (len {lens[row]})"
        # The kernel follows the int8 query, not the bf16 one: it is closer to the int8
        # reference than to the bf16-query reference (a one-token context cannot tell them
        # apart: softmax over one key ignores the query).
        if lens[row] > 1:
            assert error < relative_error(got[row], bf16_path[row]), f"request {row}"


INT8_WINDOW_CASES = [
    ([300, 77, 9], 8, 2, 128, 16, 32, 16),   # GQA 4: INT2 logits in two parts, windows of one block
    ([260, 100], 9, 3, 64, 16, 16, 16),      # head_dim 64: paired planes, stacked V channels, GQA 3
    ([200], 2, 2, 64, 64, 64, 32),           # head_dim 64, MHA (four parts), whole-block tiles
]


@pytest.mark.parametrize("lens,hq,hkv,dim,bs,block_t,window_t,full_tiles,tma_stages", [
    *[(*case, full_tiles, 0) for case in INT8_WINDOW_CASES for full_tiles in (False, True)],
    ([300, 77, 9], 8, 2, 128, 32, 32, 16, True, 2),  # TMA tile loads (the served default at batch 1)
    (*INT8_WINDOW_CASES[1], True, 2),
    (*INT8_WINDOW_CASES[2], True, 2),
])
def test_triton_decode_int8_keys_with_bf16_windows(lens, hq, hkv, dim, bs, block_t, window_t, full_tiles,
                                                    tma_stages) -> None:
    """int8_keys with BF16 windows and lost window blocks (the default on CUDA): positions read from INT2 (history,
    INT2 edge tiles, windows without a copy) follow the int8-rounded query, BF16 window positions the bf16 one.
    Against that mixed float64 reference, nearer to it than half its distance to the all-bf16 one; and requests
    read wholly from BF16 copies match the bf16-query reference, nearer than half its distance to the int8 one."""
    gen = torch.Generator().manual_seed(sum(lens) + 7 * dim)
    layout = PageLayout(dim, dim, bs, torch.float16)
    sink, recent = 5, 40
    scale = 1.0 / math.sqrt(dim)
    config = triton_ops.AttentionConfig(block_t=block_t, window_block_t=window_t, num_splits=2, int8_keys=True,
                                        full_tiles=full_tiles, tma_stages=tma_stages)

    def decode(state, query):
        return triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                       state.window_block_table, state.seq_lens, sink, recent, scale, config=config)

    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1)
    state.window_k.mul_(0.2)  # window logits on the INT2 ones' scale: both parts of the softmax carry weight
    query = (3.0 * torch.randn(len(lens), hq, dim, generator=gen)).to(torch.bfloat16)
    query[:, :, 3] *= 8.0  # a planted outlier channel sets the int8 step
    got = decode(state, query)
    expected = ref_decode(state, query.double(), sink, recent, scale, int2_query=int8_rounded_query(query))
    bf16_only = ref_decode(state, query.double(), sink, recent, scale)
    for row in range(len(lens)):
        error = relative_error(got[row], expected[row])
        assert error < BF16_TOLERANCE, f"request {row} (len {lens[row]})"
        assert error < 0.5 * relative_error(expected[row], bf16_only[row]), f"request {row}: int8 query on INT2"

    short = [recent, recent - 7]  # every position in the recent window, every window block kept
    state = random_paged_state(short, hkv, layout, sink, recent, gen)
    query = (3.0 * torch.randn(len(short), hq, dim, generator=gen)).to(torch.bfloat16)
    query[:, :, 3] *= 40.0  # a coarse int8 step: the two hypotheses far apart
    got = decode(state, query)
    expected = ref_decode(state, query.double(), sink, recent, scale)
    int8_only = ref_decode(state, int8_rounded_query(query), sink, recent, scale)
    for row in range(len(short)):
        error = relative_error(got[row], expected[row])
        assert error < 0.5 * relative_error(expected[row], int8_only[row]), f"window request {row}: bf16 query"


@pytest.mark.parametrize("long_splits", [False, True])
def test_triton_decode_long_splits_only_where_a_pair_is_long(monkeypatch, long_splits) -> None:
    """AttentionConfig.long_splits: the grid holds LONG_SPLIT_PROGRAMS_PER_SM split programs per SM (here one SM,
    so 32 / 4 pairs = 8) where the plan's context is long; the 700-position request uses all 8 (its 4 one-wave
    splits would walk >= LONG_SPLIT_TILES tiles each), the 200-position one keeps the one-wave 4 (3 tiles each;
    all 8 would give 6 splits of 2), the extra programs stay empty, and both match float64 (int8 keys: the
    int8-query reference)."""
    monkeypatch.setattr(triton_ops, "_device_sms", lambda device: 1)
    monkeypatch.setattr(triton_ops, "LONG_SPLIT_TILES", 4)
    gen = torch.Generator().manual_seed(41)
    layout = PageLayout(128, 128, 16, torch.float16)
    lens, block_t = [700, 200], 16
    state = random_paged_state(lens, 2, layout, 0, 0, gen)
    query = (3.0 * torch.randn(len(lens), 4, 128, generator=gen)).to(torch.bfloat16)
    scale = 1.0 / math.sqrt(128)
    config = triton_ops.AttentionConfig(block_t=block_t, int8_keys=True, long_splits=long_splits)
    got, nsplit, used = decode_split_usage(monkeypatch, state, query, 0, 0, scale, max(lens), config)
    expected = ref_decode(state, int8_rounded_query(query), 0, 0, scale)
    for row in range(len(lens)):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row} (len {lens[row]})"
    assert nsplit == (8 if long_splits else 4)
    assert used[0].tolist() == [8 if long_splits else 4] * 4
    assert used[1].tolist() == [4] * 4


def decode_small_head(config) -> None:
    """oscar_decode on one 40-token request, head_dim 64, with ``config``."""
    gen = torch.Generator().manual_seed(3)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([40], 1, layout, 0, 0, gen)
    query = torch.randn(1, 2, 64, generator=gen).to(torch.bfloat16)
    triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                            state.window_block_table, state.seq_lens, 0, 0, 0.125, config=config)


def test_triton_decode_int8_key_path_needs_the_split_kernel() -> None:
    """int8_keys asked for where the general kernel runs (tokens_on_m=False) is a clear error, not ignored."""
    with pytest.raises(ValueError, match="int8_keys needs the INT2 split kernel"):
        decode_small_head(triton_ops.AttentionConfig(int8_keys=True, tokens_on_m=False))


@pytest.mark.parametrize("window_block_t", [16, 64])
def test_triton_decode_window_tile_sizes(window_block_t) -> None:
    """Window programs of 16 and 64 positions (explicit: the default is 32, or 64 under the wide-window rule), some
    blocks without a BF16 copy."""
    run_decode([150, 41, 7], 8, 2, 64, 64, 16, 20, 70, 1, 32, 2, seed=31 + window_block_t,
               window_block_t=window_block_t)


def test_triton_decode_default_window_tile_follows_head_dim_context_and_pairs(monkeypatch) -> None:
    """The default window tile is WIDE_WINDOW_BLOCK_T only at head_dim <= 64, launches sized for contexts <= 4K
    and (request, KV head) pairs >= half the SMs (4 SMs here, so that 2 pairs qualify); the decode it plans
    matches float64 (ragged, a request shorter than the windows, blocks without a BF16 copy)."""
    monkeypatch.setattr(triton_ops, "_device_sms", lambda device: 4)
    gen = torch.Generator().manual_seed(57)
    layout = PageLayout(64, 64, 64, torch.float16)
    lens, sink, recent = [300, 61], 20, 70
    state = random_paged_state(lens, 1, layout, sink, recent, gen, drop_window_blocks=1)
    query = torch.randn(len(lens), 3, 64, generator=gen).to(torch.bfloat16)
    args = (query, state.cache, state.window_k, state.window_v, layout, state.block_table, state.window_block_table,
            state.seq_lens, sink, recent, 0.125)
    config = triton_ops.AttentionConfig(block_t=64, num_splits=2)

    def window_tile(*plan_args, max_seq_len=1024, plan_config=config) -> int:
        return triton_ops._plan_decode(*plan_args, 0.125, max_seq_len, plan_config).split_consts["WIN_BT"]

    assert window_tile(*args[:-1]) == triton_ops.WIDE_WINDOW_BLOCK_T == 64
    assert window_tile(*args[:-1], max_seq_len=triton_ops.WIDE_WINDOW_MAX_CONTEXT + 1) == triton_ops.WINDOW_BLOCK_T
    assert window_tile(query[:1], *args[1:5], state.block_table[:1], state.window_block_table[:1],
                       state.seq_lens[:1], sink, recent) == triton_ops.WINDOW_BLOCK_T  # 1 pair < 4 SMs / 2
    assert window_tile(*args[:-1], plan_config=dataclasses.replace(config, window_block_t=16)) == 16
    wide_head = PageLayout(128, 128, 64, torch.float16)
    wide_state = random_paged_state(lens, 1, wide_head, sink, recent, gen)
    assert window_tile(torch.randn(2, 3, 128, generator=gen).to(torch.bfloat16), wide_state.cache,
                       wide_state.window_k, wide_state.window_v, wide_head, wide_state.block_table,
                       wide_state.window_block_table, wide_state.seq_lens, sink, recent) == triton_ops.WINDOW_BLOCK_T
    got = triton_ops.oscar_decode(*args, max_seq_len=1024, config=config)
    expected = ref_decode(state, query.double(), sink, recent, 0.125)
    for row in range(len(lens)):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"request {row} (len {lens[row]})"


@pytest.mark.parametrize("windows_first", [True, False])
def test_triton_decode_window_programs_before_or_after_the_splits(windows_first) -> None:
    """Window programs dispatched before or after the splits: the same partial slots, the same answer
    (ragged batch, a request shorter than the windows, blocks without a BF16 copy)."""
    run_decode([150, 41, 7], 8, 2, 64, 64, 16, 20, 70, 1, 32, 3, seed=37, windows_first=windows_first)


@pytest.mark.parametrize("dim,merge_block_d", [(64, 16), (128, 32), (128, 128)])
def test_triton_decode_merge_by_channel_blocks(dim, merge_block_d) -> None:
    """The merge split over channel blocks (grid axis 2), with many partials (splits + windows)."""
    run_decode([200, 65, 3], 4, 2, dim, dim, 16, 8, 24, 1, 16, 9, seed=41 + merge_block_d, merge_block_d=merge_block_d)


@pytest.mark.parametrize("slots", [11, 200])
def test_merge_of_partials_matches_float64(slots) -> None:
    """The decode's log-sum-exp merge alone on fresh partials with empty ones (lse -inf, NaN inside: never read) and
    a row with none (zeros, as a CUDA graph's padding row must get): float64's sum_i 2^lse_i o_i / sum_i 2^lse_i,
    with one warp per program (11 partials) and MERGE_WARPS (200)."""
    assert triton_ops.merge_warps(slots, triton_ops.MERGE_BLOCK_D) == (1 if slots == 11 else triton_ops.MERGE_WARPS)
    gen = torch.Generator().manual_seed(61 + slots)
    rows, heads, dim = 3, 4, 64
    part = torch.randn(rows, heads, slots, dim, generator=gen) * 3.0
    lse = torch.randn(rows, heads, slots, generator=gen) * 6.0
    empty = torch.rand(rows, heads, slots, generator=gen) < 0.3
    empty[:2, :, 0] = False  # every real (row, head) keeps a partial
    empty[2] = True
    lse[empty] = float("-inf")
    part[empty] = float("nan")
    weight = torch.exp2(lse[:2].double() - lse[:2].double().amax(dim=-1, keepdim=True))
    expected = (weight[..., None] * torch.nan_to_num(part[:2].double())).sum(2) / weight.sum(2)[..., None]
    out = torch.full((rows, heads, dim), 7.0, dtype=torch.bfloat16)
    triton_ops._merge_partials(part, lse, out, triton_ops.AttentionConfig(), emulated=True, pdl=False,
                               zero_empty=True, decode=True)
    assert relative_error(out[:2], expected) < BF16_TOLERANCE
    assert torch.equal(out[2].float(), torch.zeros(heads, dim))


def test_triton_decode_rejects_a_bad_merge_block() -> None:
    with pytest.raises(ValueError, match="merge_block_d=48 must be a power of two"):
        run_decode([40], 2, 1, 64, 64, 16, 4, 8, 0, 16, 1, seed=3, merge_block_d=48)


def test_triton_decode_rejects_a_bad_window_tile() -> None:
    with pytest.raises(ValueError, match="window_block_t=24 must be a power of two"):
        run_decode([40], 2, 1, 64, 64, 16, 4, 8, 0, 16, 1, seed=3, window_block_t=24)


def test_triton_decode_prefetch_needs_the_ptx_path() -> None:
    """The L2 prefetch is inline PTX: asked for under the interpreter it is a clear error, not ignored."""
    with pytest.raises(ValueError, match="prefetch=1 issues inline PTX"):
        decode_small_head(triton_ops.AttentionConfig(prefetch=1))


@pytest.mark.parametrize("full_tiles", [None, False])
def test_triton_decode_window_boundaries_at_every_offset(full_tiles) -> None:
    """Every sequence length 1..41 with sink 5 / recent 7 in blocks of 16: each boundary
    position falls at every offset of a block; half the requests lose a window block. With the
    default whole-tile splits and with masked tiles (full_tiles=False)."""
    run_decode(list(range(1, 42, 2)), 2, 1, 64, 64, 16, 5, 7, 0, 16, 2, seed=3, full_tiles=full_tiles)
    run_decode(list(range(2, 42, 2)), 2, 1, 64, 64, 16, 5, 7, 1, 16, 2, seed=4, full_tiles=full_tiles)


#: full_tiles cases: (lens, Hq, Hkv, D, bs, sink, recent, dropped window blocks, block_t, splits, window_block_t)
FULL_TILE_CASES = {
    # unaligned sink and recent; ragged; requests shorter than the windows and than one tile
    "ragged-unaligned": ([150, 41, 7, 1, 96], 8, 2, 64, 16, 20, 70, 1, 32, 3, 16),
    # INT2 range shorter than a tile at every offset (sink 5, recent 7, tile 16)
    "every-offset": (list(range(1, 60, 3)), 2, 1, 64, 16, 5, 7, 1, 16, 2, 16),
    # whole-block tiles (block 64 = tile 64), aligned sink, dropped window blocks
    "block64": ([300, 129, 64], 4, 1, 128, 64, 64, 64, 1, 64, 2, 32),
    # window tiles larger than the INT2 tile; no sink
    "no-sink": ([200, 33], 4, 2, 64, 16, 0, 40, 0, 16, 4, 64),
}


@pytest.mark.parametrize("case", list(FULL_TILE_CASES.values()), ids=list(FULL_TILE_CASES))
def test_triton_decode_full_tiles_hands_the_int2_edges_to_the_window_programs(case) -> None:
    """full_tiles: the splits walk whole tiles unmasked; the partial INT2 tiles at both edges of the
    range are read (as INT2, not from any BF16 copy of their block) by the window programs."""
    lens, hq, hkv, dim, bs, sink, recent, drop, block_t, splits, window_t = case
    run_decode(lens, hq, hkv, dim, dim, bs, sink, recent, drop, block_t, splits, seed=sum(lens) + block_t,
               window_block_t=window_t, full_tiles=True)


@pytest.mark.parametrize("lens,hq,hkv,dim,bs,block_t,splits", [
    ([260, 130, 64, 1], 8, 2, 64, 64, 64, 2),     # GQA 4, one tile per block, ragged, shorter than a tile
    ([300, 77], 4, 2, 128, 32, 32, 3),            # GQA 2, D 128, blocks of 32
    ([520, 200], 9, 3, 64, 128, 64, 2),           # GQA 3, two tiles per block (second tile at slot 64)
])
@pytest.mark.parametrize("stages", [1, 2])
def test_triton_decode_tma_tiles_match_reference(lens, hq, hkv, dim, bs, block_t, splits, stages) -> None:
    """tma_stages: the whole-tile splits load each tile through tensor descriptors over the cache planes
    (region = block x KV heads + head, slot = the tile's offset in its block); unaligned windows, lost
    BF16 blocks."""
    run_decode(lens, hq, hkv, dim, dim, bs, 5, 24, 1, block_t, splits, seed=sum(lens) + bs, full_tiles=True,
               tma_stages=stages)


def test_graph_launches_choose_tma_tiles_only_where_they_apply_and_pay() -> None:
    """AttentionConfig.tma_stages None: TMA only for a CUDA-graph launch with whole tiles per block, where
    tma_pays, never under the interpreter; an eager launch keeps plain loads (the GPU check and
    bench/served_graph.py run the graph cases on the H200)."""
    cpu = torch.device("cpu")
    assert triton_ops.graph_tma_stages(False, True, 128, False, cpu, 8, True, 32768) == 0  # eager: host encoding
    assert triton_ops.graph_tma_stages(True, False, 128, False, cpu, 8, True, 32768) == 0  # tiles straddle blocks
    assert triton_ops.graph_tma_stages(True, True, 128, True, cpu, 8, True, 32768) == 0  # interpreter


@pytest.mark.parametrize("head_dim,int8_keys,pairs,max_seq_len,pays", [
    (128, True, 8, 131072, True),     # Qwen3-8B batch 1: 8 pairs, 16+ SMs each
    (128, True, 9, 131072, False),    # fewer than 16 SMs per pair at long contexts
    (128, True, 64, 131072, False),   # batch 8 at 128K: plain loads
    (128, True, 64, 4096, True),      # batch 8 at 4K: one pair per SM or fewer
    (128, True, 133, 4096, False),    # more pairs than SMs
    (64, True, 3, 131072, True),      # SmolLM2 batch 1 with int8 keys
    (64, True, 64, 4096, False),      # the short-context case is a head_dim 128 one
    (64, False, 3, 131072, False),    # head_dim 64 with bf16 keys: slower (V26)
])
def test_tma_pays_for_few_pairs_per_sm(head_dim, int8_keys, pairs, max_seq_len, pays) -> None:
    assert triton_ops.tma_pays(head_dim, int8_keys, pairs, 132, max_seq_len) is pays
    assert triton_ops.DEFAULT_DECODE.tma_stages is None and not triton_ops.DEFAULT_DECODE.cuda_graph


def test_triton_decode_tma_tiles_need_whole_tiles_in_a_block() -> None:
    with pytest.raises(ValueError, match="tma_stages=2 needs the INT2 split kernel walking whole tiles"):
        run_decode([90], 4, 1, 64, 64, 16, 4, 8, 0, 32, 1, seed=3, tma_stages=2)  # blocks of 16, tiles of 32


def test_decode_plans_and_descriptors_are_built_once_per_shape_and_cache(monkeypatch) -> None:
    """A second call with the same shapes, geometry, config and max_seq_len tiles (250 and 256 are both 8
    tiles of 32) reuses the launch plan and still matches the float64 reference on new data; more tiles
    plan again; each cache gets its own TMA descriptors, built once."""
    plans, descriptors = [], []
    plan, tile_descriptors = triton_ops._plan_decode, triton_ops._tile_descriptors
    monkeypatch.setattr(triton_ops, "_plan_decode", lambda *a: plans.append(a[-3]) or plan(*a))  # its max_seq_len
    monkeypatch.setattr(triton_ops, "_tile_descriptors", lambda *a: descriptors.append(a[0]) or tile_descriptors(*a))
    monkeypatch.setattr(triton_ops, "_PLANS", {})
    monkeypatch.setattr(triton_ops, "_DESCRIPTORS", {})
    layout = PageLayout(64, 64, 32, torch.float16)
    config = triton_ops.AttentionConfig(block_t=32, num_splits=2, tma_stages=2)
    for seed, max_seq_len in ((1, 250), (2, 256), (3, 512)):
        gen = torch.Generator().manual_seed(seed)
        state = random_paged_state([200, 90], 2, layout, 5, 24, gen)
        query = (4.0 * torch.randn(2, 8, 64, generator=gen)).to(torch.bfloat16)
        got = triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                      state.window_block_table, state.seq_lens, 5, 24, 0.125, max_seq_len=max_seq_len,
                                      config=config)
        expected = ref_decode(state, query.double(), 5, 24, 0.125)
        for row in range(2):
            assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"seed {seed} request {row}"
    assert plans == [250, 512]  # the second call reused the first plan
    assert len(descriptors) == 3  # one set per cache (each seed builds a new cache)
    assert all(a is not b for a, b in zip(descriptors, descriptors[1:]))
    reused = triton_ops._cached_descriptors(descriptors[-1], layout, 32)
    assert reused is triton_ops._cached_descriptors(descriptors[-1], layout, 32) and len(descriptors) == 3


def test_triton_decode_full_tiles_need_the_split_kernel() -> None:
    with pytest.raises(ValueError, match="full_tiles applies to the INT2 split kernel only"):
        run_decode([40], 2, 1, 64, 64, 16, 4, 8, 0, 16, 1, seed=3, tokens_on_m=False, full_tiles=True)


def test_triton_decode_general_kernel_for_int2_splits() -> None:
    """tokens_on_m=False: the INT2 splits run in the general kernel (rows on M)."""
    run_decode([90, 17, 1], 4, 2, 64, 64, 16, 5, 7, 1, 16, 3, seed=12, tokens_on_m=False)


def test_triton_decode_float32_query() -> None:
    run_decode([60, 21], 4, 2, 64, 64, 16, 4, 12, 0, 16, 2, seed=9, qdtype=torch.float32)


@pytest.mark.parametrize("prefill_rows,prefill_splits,apart", [(16, 1, True), (64, 1, True), (128, 1, True),
                                                              (64, 3, True), (16, 2, None), (64, None, True),
                                                              (64, 1, None)])
def test_triton_prefill_matches_reference(prefill_rows, prefill_splits, apart) -> None:
    """Ragged chunks over cached prefixes (and none), against the float64 reference; with 16, the
    default 64 and 128 MMA rows per program (4, 16 and 32 query tokens of the padded group of 4), and
    the prefix split over 2-3 programs per query tile (merged), or the automatic count (None: 4 here, a
    prefix longer than the windows in a launch far smaller than 132 SMs); the pure INT2 prefix in its
    own launch (apart True) or in the one launch (the rule's choice here: split or not). Rows past the last request's
    chunk belong to no request and must stay as they were (NaN here)."""
    gen = torch.Generator().manual_seed(21)
    hq, hkv, dim, bs, sink, recent = 6, 2, 64, 16, 6, 9
    chunks, lens = [5, 1, 20, 0, 18], [40, 1, 20, 12, 50]  # cached prefix 35, 0, 0, 12, 32
    layout = PageLayout(dim, 32, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1)
    qsl = [0]
    for c in chunks:
        qsl.append(qsl[-1] + c)
    total = qsl[-1]
    padding = 3
    query = torch.randn(total + padding, hq, dim, generator=gen).to(torch.bfloat16)
    key = torch.randn(total + padding, hkv, dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(total + padding, hkv, dim, generator=gen).to(torch.bfloat16)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    config = triton_ops.AttentionConfig(block_t=16, prefill_rows=prefill_rows, prefill_splits=prefill_splits,
                                        prefill_int2_apart=apart)
    got = triton_ops.oscar_prefill(query, key, value, state.cache, state.window_k, state.window_v, layout,
                                   state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                                   state.seq_lens, sink, recent, 0.2, out=out, max_query_len=max(chunks),
                                   config=config, max_seq_len=max(lens))
    expected = ref_prefill(state, query[:total].double(), key[:total].double(), value[:total].double(), qsl, sink,
                           recent, 0.2)
    for row in range(total):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"row {row}"
    assert torch.isnan(got[total:]).all()


def test_triton_prefill_rejects_bad_rows_or_splits() -> None:
    gen = torch.Generator().manual_seed(5)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([20], 1, layout, 4, 8, gen)
    rows = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    for config, message in ((triton_ops.AttentionConfig(prefill_rows=48), "prefill_rows=48 must be a power of two"),
                            (triton_ops.AttentionConfig(prefill_splits=0), "prefill_splits=0 must be >= 1")):
        with pytest.raises(ValueError, match=message):
            triton_ops.oscar_prefill(rows, rows[:, :1], rows[:, :1], state.cache, state.window_k, state.window_v,
                                     layout, state.block_table, state.window_block_table,
                                     torch.tensor([0, 4], dtype=torch.int32), state.seq_lens, 4, 8, 0.125,
                                     config=config)


def test_prefill_split_count_splits_only_long_prefixes_in_launches_smaller_than_the_gpu() -> None:
    cpu = torch.device("cpu")  # sized as a 132-SM GPU
    auto = triton_ops.AttentionConfig()
    assert triton_ops.prefill_split_count(auto, 96, cpu, True) == triton_ops.PREFILL_AUTO_SPLITS
    assert triton_ops.prefill_split_count(auto, 96, cpu, False) == 1
    assert triton_ops.prefill_split_count(auto, 132, cpu, True) == 1
    assert triton_ops.prefill_split_count(triton_ops.AttentionConfig(prefill_splits=3), 1000, cpu, False) == 3


def test_prefill_int2_apart_only_for_long_prefixes_that_overflow_a_wave() -> None:
    """The automatic rule: a known max_seq_len whose implied prefix is >= PREFILL_APART_PREFIX_RATIO x
    (sink + recent + chunk), and more programs than one wave of the one-launch kernel (3 per SM here)."""
    cpu, auto = torch.device("cpu"), triton_ops.AttentionConfig()
    ratio = triton_ops.PREFILL_APART_PREFIX_RATIO
    long_prefix = 512 + ratio * (64 + 256 + 512)
    wave = 3 * 132

    def apart(config, max_seq_len, programs):
        return triton_ops._prefill_int2_apart(config, max_seq_len, 512, 64, 256, programs, lambda: 3, cpu)

    assert apart(auto, long_prefix, wave + 1)
    assert not apart(auto, long_prefix, wave)  # fits one wave: nothing to gain
    assert not apart(auto, long_prefix - 1, wave + 1)  # the windows and the chunk weigh too much
    assert not apart(auto, None, wave + 1)  # unknown lengths: one launch
    assert not apart(triton_ops.AttentionConfig(prefill_int2_apart=False), long_prefix, wave + 1)
    assert apart(triton_ops.AttentionConfig(prefill_int2_apart=True), None, 1)


def test_triton_prefill_refuses_gpu_tiles_that_triton_miscompiles(monkeypatch) -> None:
    """On a GPU (not interpreting), prefill tiles above PREFILL_MAX_BLOCK_T are refused before any launch."""
    gen = torch.Generator().manual_seed(6)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([20], 1, layout, 4, 8, gen)
    rows = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(triton_ops, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="prefill block_t=64 is not supported on a GPU"):
        triton_ops.oscar_prefill(rows, rows[:, :1], rows[:, :1], state.cache, state.window_k, state.window_v,
                                 layout, state.block_table, state.window_block_table,
                                 torch.tensor([0, 4], dtype=torch.int32), state.seq_lens, 4, 8, 0.125,
                                 config=triton_ops.AttentionConfig(block_t=64, unpack=triton_ops.UNPACK_PORTABLE))


@pytest.mark.parametrize("prefill_splits", [1, 2])
def test_triton_prefill_chunk_from_cache_matches_decoding_token_by_token(prefill_splits) -> None:
    gen = torch.Generator().manual_seed(23)
    hq, hkv, dim, bs, sink, recent = 4, 2, 64, 16, 5, 20
    chunks, lens = [40, 1, 17], [75, 1, 17]
    layout = PageLayout(dim, dim, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1)
    qsl = [0, 40, 41, 58]
    query = torch.randn(qsl[-1], hq, dim, generator=gen).to(torch.bfloat16)
    got = triton_ops.oscar_prefill(query, None, None, state.cache, state.window_k, state.window_v, layout,
                                   state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                                   state.seq_lens, sink, recent, 0.2, max_query_len=max(chunks),
                                   config=triton_ops.AttentionConfig(block_t=16, prefill_splits=prefill_splits),
                                   chunk_from_cache=True)
    expected = ref_prefill_from_cache(state, query.double(), qsl, sink, recent, 0.2)
    for row in range(qsl[-1]):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"row {row}"


@pytest.mark.parametrize("recent", [15, 7])
def test_triton_prefill_window_tiles_read_bf16_only_inside_every_rows_window(recent) -> None:
    """A window tile is read from its BF16 copies alone only when every position lies inside the window
    of every row of the query tile. Query tiles of 8 tokens (16 rows of a group of 2) and 16-position
    tiles: the tile [16, 32) starts exactly at t_max - recent of the query tile ending at 31 (recent 15)
    or 23 (recent 7), where the last row must still read position 16 as INT2."""
    gen = torch.Generator().manual_seed(29 + recent)
    hq, hkv, dim, bs, sink = 2, 1, 64, 16, 5
    layout = PageLayout(dim, dim, bs, torch.float16)
    state = random_paged_state([40], hkv, layout, sink, recent, gen, drop_window_blocks=0)
    qsl = [0, 40]
    query = torch.randn(40, hq, dim, generator=gen).to(torch.bfloat16)
    got = triton_ops.oscar_prefill(query, None, None, state.cache, state.window_k, state.window_v, layout,
                                   state.block_table, state.window_block_table, torch.tensor(qsl, dtype=torch.int32),
                                   state.seq_lens, sink, recent, 0.2, max_query_len=40,
                                   config=triton_ops.AttentionConfig(block_t=16, prefill_rows=16),
                                   chunk_from_cache=True)
    expected = ref_prefill_from_cache(state, query.double(), qsl, sink, recent, 0.2)
    for row in range(40):
        assert relative_error(got[row], expected[row]) < BF16_TOLERANCE, f"row {row}"


def _ref_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, left_window, causal):
    """FlashAttention's varlen forward in float64, written from its documented semantics: query row i of a request
    with nq queries and nk keys sees key j iff i + nk - nq - left_window <= j <= i + nk - nq (bottom-right causal,
    left_window None = unbounded), every key where not causal; GQA; out in q's dtype, lse [Tq, Hq] (natural log;
    +inf for a row seeing nothing, as FlashAttention's unsplit forward writes it, so a merge that weighed such a
    row's part would turn NaN)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("inf"), dtype=torch.float64)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    assert max_q >= max(b - a for a, b in zip(bounds_q, bounds_q[1:]))
    assert max_k >= max(b - a for a, b in zip(bounds_k, bounds_k[1:]))
    for b in range(len(bounds_q) - 1):
        nq, nk = bounds_q[b + 1] - bounds_q[b], bounds_k[b + 1] - bounds_k[b]
        keys = k[bounds_k[b]:bounds_k[b + 1]].double().repeat_interleave(hq // hkv, dim=1)  # [nk, Hq, D]
        values = v[bounds_k[b]:bounds_k[b + 1]].double().repeat_interleave(hq // hkv, dim=1)
        for i in range(nq):
            row = bounds_q[b] + i
            last = i + nk - nq if causal else nk - 1
            first = 0 if left_window is None else max(0, last - left_window)
            if last < first or last < 0:
                continue
            logits = torch.einsum("hd,jhd->hj", q[row].double(), keys[first:last + 1]) * scale
            lse[row] = torch.logsumexp(logits, dim=1)
            out[row] = torch.einsum("hj,jhd->hd", torch.softmax(logits, dim=1), values[first:last + 1])
    return out.to(q.dtype), lse.float()


@pytest.mark.parametrize("chunks, lens, sink, recent, window_dtype, dropped, planned, segments", [
    # a prefix, a one-token chunk, a fresh prompt, none
    ([40, 1, 17, 0], [75, 1, 17, 30], 5, 20, torch.bfloat16, 1, False, 1),
    ([40, 1, 17, 0], [75, 1, 17, 30], 5, 20, torch.bfloat16, 0, True, 1),
    ([33, 9], [33, 140], 16, 32, torch.float16, 0, False, 1),  # chunks shorter and longer than recent; fp16 copies
    ([33, 9], [33, 140], 16, 32, torch.float16, 0, True, 1),
    ([25], [25], 4, 64, torch.bfloat16, 0, False, 1),  # the windows hold the whole prompt: no far position at all
    # the far positions every chunk row sees in key segments: bodies of 37 (3 segments: 13, 12, 12), 80 (4 of 20),
    # none (a fresh prompt), 2 (one segment: fewer keys than min_segment_keys), none (no chunk)
    ([4, 3, 17, 2, 0], [60, 102, 17, 23, 30], 5, 20, torch.bfloat16, 1, True, 4),
    ([4, 3, 17, 2, 0], [60, 102, 17, 23, 30], 5, 20, torch.bfloat16, 0, False, 4),
])
def test_flash_prefill_matches_decoding_token_by_token(chunks, lens, sink, recent, window_dtype, dropped,
                                                       planned, segments) -> None:
    """flash_prefill's far / near split (with a float64 stand-in for FlashAttention) against the float64 read rule,
    with ``dropped`` window blocks per request (their positions read from INT2), the rows outside the requests
    untouched. A softmax scale of 0.05 keeps every position's weight large enough that reading one the wrong way
    (sink copies in the far range, the row at t = recent) shows above the bf16 rounding. ``planned``: the ranges
    come from a host PrefillPlan (as the served step gives them) and the device query_start_loc it would otherwise
    read is poisoned (all zeros: no rows). ``segments`` > 1: the far range split (KeySplit, min_segment_keys 12)."""
    gen = torch.Generator().manual_seed(sum(lens) + recent + dropped)
    hq, hkv, dim, bs = 4, 2, 64, 16
    layout = PageLayout(dim, 32, bs, torch.float16)
    state = random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=dropped,
                               window_dtype=window_dtype)
    qsl = [1]
    for chunk in chunks:
        qsl.append(qsl[-1] + chunk)
    query = torch.randn(qsl[-1] + 2, hq, dim, generator=gen)
    out = torch.full_like(query, 7.0)
    caches = flash_prefill.PagedCaches(state.cache, state.window_k, state.window_v, layout, state.block_table,
                                       state.window_block_table)
    plan = flash_plan.PrefillPlan.of(qsl, lens, recent, query.device) if planned else None
    device_qsl = torch.tensor([0] * len(qsl) if planned else qsl, dtype=torch.int32)
    flash_prefill.flash_prefill(query, caches, device_qsl, state.seq_lens, recent, sink,
                                0.05, out, triton_ops._plane_offsets(layout), attend=_ref_varlen_attention, plan=plan,
                                key_segments=segments, min_segment_keys=12)
    expected = ref_prefill_from_cache(state, query[1:].double(), [q - 1 for q in qsl], sink, recent, 0.05)
    for row in range(qsl[0], qsl[-1]):
        assert relative_error(out[row], expected[row - 1]) < BF16_TOLERANCE, f"row {row}"
    assert bool((out[0] == 7.0).all()) and bool((out[qsl[-1]:] == 7.0).all())


def test_flash_prefill_refuses_a_plan_of_another_call() -> None:
    """A plan built for another batch or recent window is an error naming both, not a wrong read."""
    layout = PageLayout(64, 32, 16, torch.float16)
    state = random_paged_state([30, 20], 2, layout, 4, 8, torch.Generator().manual_seed(3))
    caches = flash_prefill.PagedCaches(state.cache, state.window_k, state.window_v, layout, state.block_table,
                                       state.window_block_table)
    query = torch.randn(50, 4, 64)
    qsl = torch.tensor([0, 30, 50], dtype=torch.int32)
    for plan, message in ((flash_plan.PrefillPlan.of([0, 30], [30], 8, query.device), "built for 1 requests"),
                          (flash_plan.PrefillPlan.of([0, 30, 50], [30, 20], 16, query.device), "window of 16")):
        with pytest.raises(ValueError, match=message):
            flash_prefill.flash_prefill(query, caches, qsl, state.seq_lens, 8, 4, 0.1, torch.zeros_like(query),
                                        triton_ops._plane_offsets(layout), attend=_ref_varlen_attention, plan=plan)
    with pytest.raises(ValueError, match="B \\+ 1 query_start_loc values"):
        flash_plan.PrefillPlan.of([0, 30], [30, 20], 8, query.device)


def test_key_split_cuts_the_positions_every_row_sees() -> None:
    """KeySplit against brute force: per request the body is the far positions (s < L - recent) that every chunk
    row t in [P, L) sees (s <= t - recent), cut into consecutive segments that cover it, each a sequence over a
    copy of the request's chunk rows; the tail is the rest of the far range."""
    starts, lens, recent = [0, 4, 7, 24, 26, 26], [60, 102, 17, 23, 30], 20
    plan = flash_plan.PrefillPlan.of(starts, lens, recent, torch.device("cpu"))
    split = plan.split(4, 12)
    assert plan.split(4, 12) is split  # once per step
    views = {name: view.tolist() for name, view in split.views.items()}
    bq, bk = 0, 0
    for b, (begin, end, length) in enumerate(zip(starts, starts[1:], lens)):
        prefix, chunk = length - (end - begin), end - begin
        far = max(0, length - recent) if chunk else 0
        body = sum(1 for s in range(far) if all(s <= t - recent for t in range(prefix, length)))
        assert (split.body_count[b], split.tail_count[b]) == (body, far - body)
        assert split.segments[b] == (max(1, min(4, body // 12)) if body else 0)
        assert views["body_first"][b] == views["cu_bq"][bq]
        for _ in range(split.segments[b]):
            assert views["cu_bq"][bq + 1] - views["cu_bq"][bq] == chunk
            assert views["query_index"][views["cu_bq"][bq]:views["cu_bq"][bq + 1]] == list(range(begin, end))
            bq += 1
        keys = views["cu_bk"][bk + split.segments[b]] - views["cu_bk"][bk]
        bk += split.segments[b]
        assert keys == body and views["cu_body"][b + 1] - views["cu_body"][b] == body
    assert bq == len(views["cu_bq"]) - 1 == sum(split.segments)


@pytest.mark.parametrize("padded_lse", [False, True])
def test_flash_varlen_returns_lse_per_row(monkeypatch, padded_lse) -> None:
    """flash_varlen turns the kernel's log-sum-exp, [Hq, Tq] or the padded [B, Hq, max_q] of older kernels, into
    [Tq, Hq] rows, and asks for the bottom-right causal mask with the left window given (no mask when not
    causal)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 8, generator=gen)
    k = torch.randn(9, 2, 8, generator=gen)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    expected_out, expected_lse = _ref_varlen_attention(q, k, k, cu_q, cu_k, 4, 5, 0.5, 2, True)
    calls = []

    def kernel(q_, k_, v_, cu_q_, cu_k_, max_q, max_k, dropout, causal, debug, *, scale, window_size_left,
               window_size_right):
        calls.append((causal, window_size_left, window_size_right, scale, dropout))
        if not padded_lse:
            return expected_out, expected_lse.T.contiguous(), None, None, None
        padded = torch.full((2, 4, max_q), float("nan"))
        padded[0, :, :3] = expected_lse[:3].T
        padded[1, :, :4] = expected_lse[3:].T
        return expected_out, padded, None, None, None

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", kernel)
    out, lse = flash_prefill.flash_varlen(q, k, k, cu_q, cu_k, 4, 5, 0.5, 2)
    assert calls == [(True, 2, 0, 0.5, 0.0)]
    assert out is expected_out and torch.equal(lse, expected_lse)
    flash_prefill.flash_varlen(q, k, k, cu_q, cu_k, 4, 5, 0.5, None, False)  # the unmasked form
    assert calls[1] == (False, None, None, 0.5, 0.0)


@pytest.mark.parametrize("prefill_flash, max_seq_len, workspace, expected", [
    (None, 20, 20 * 64 * 4, True), (None, 19, 1 << 30, False), (None, None, 1 << 30, False),
    (True, 19, 1 << 30, True), (False, 20, 1 << 30, False),
    (None, 20, 20 * 64 * 4 - 1, False),  # the gathered rows could exceed the workspace cap
    (True, 20, 0, True),  # True ignores the cap
])
def test_prefill_flash_default_takes_flash_from_the_work_threshold(monkeypatch, prefill_flash, max_seq_len, workspace,
                                                                    expected) -> None:
    """Where FlashAttention can run, the default routes the served read to flash_prefill once rows x max_seq_len x
    Hq x D reaches FLASH_PREFILL_MIN_WORK (rows squared without max_seq_len) and requests x max_seq_len x Hkv x D x 4
    bytes of gathered rows fit FLASH_PREFILL_MAX_WORKSPACE (one request, one KV head; max_seq_len 20 is below the
    table's 48 positions, so it bounds them); True always, False never. A call the cap turns away is counted."""
    gen = torch.Generator().manual_seed(8)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([20], 1, layout, 4, 8, gen)
    rows = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(triton_ops, "flash_unavailable", lambda *args: None)
    monkeypatch.setattr(triton_ops, "flash_prefill", lambda *args, **kwargs: calls.append(args) or args[7])
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_WORK", 4 * 20 * 2 * 64)
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_PROGRAMS", 1)  # 4 rows x 2 heads: one (partial) tile
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MAX_WORKSPACE", workspace)
    monkeypatch.setattr(flash_plan, "workspace_fallbacks", 0)
    triton_ops.oscar_prefill(rows, None, None, state.cache, state.window_k, state.window_v, layout, state.block_table,
                             state.window_block_table, torch.tensor([0, 4], dtype=torch.int32), state.seq_lens, 4, 8,
                             0.125, chunk_from_cache=True, max_seq_len=max_seq_len,
                             config=triton_ops.AttentionConfig(block_t=16, prefill_flash=prefill_flash))
    assert len(calls) == int(expected)
    capped = prefill_flash is None and max_seq_len == 20 and not expected
    assert flash_plan.workspace_fallbacks == int(capped)


@pytest.mark.parametrize("rows, split, expected", [(193, False, True), (192, False, False), (192, True, True)])
def test_prefill_flash_default_wants_enough_flash_programs(monkeypatch, rows, split, expected) -> None:
    """Above the work threshold the default still leaves a call to the Triton kernel where FlashAttention would
    run fewer than FLASH_PREFILL_MIN_PROGRAMS programs (cdiv(rows x Hq, FLASH_QUERY_TILE), full-tile equivalents: 2
    heads here, 4 programs from 193 rows), unless prefill_flash_split is on (the key segments make the programs)."""
    gen = torch.Generator().manual_seed(9)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([rows], 1, layout, 4, 8, gen)
    query = torch.randn(rows, 2, 64, generator=gen).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(triton_ops, "flash_unavailable", lambda *args: None)
    monkeypatch.setattr(triton_ops, "flash_prefill", lambda *args, **kwargs: calls.append(kwargs) or args[7])
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_WORK", 1)
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_PROGRAMS", 4)
    triton_ops.oscar_prefill(query, None, None, state.cache, state.window_k, state.window_v, layout,
                             state.block_table, state.window_block_table, torch.tensor([0, rows], dtype=torch.int32),
                             state.seq_lens, 4, 8, 0.125, chunk_from_cache=True, max_seq_len=rows,
                             config=triton_ops.AttentionConfig(block_t=16, prefill_flash_split=split))
    assert len(calls) == int(expected)
    if split:  # ceil(2 per SM x 132 SMs / 3 programs: 192 rows x 2 heads / 128) segments of >= FLASH_SPLIT_MIN_KEYS
        assert (calls[0]["key_segments"], calls[0]["min_segment_keys"]) == (88, flash_plan.FLASH_SPLIT_MIN_KEYS)
    elif calls:
        assert calls[0]["key_segments"] == 1


def test_call_size_of_a_plan_counts_pairs_programs_and_rows_exactly() -> None:
    """CallSize.of_plan against brute-force counts: the query-key pairs each row reads (t + 1 for the row at
    position t), FlashAttention's programs in full tiles (query rows x Hq / FLASH_QUERY_TILE, rounded up), and the
    larger of
    the far and near gathers (positions < L - recent; positions of the last recent - 1 before the chunk and the
    chunk's own)."""
    starts, lens, recent, heads, kv_heads, dim = [0, 200, 205, 205], [300, 5, 40], 8, 3, 1, 64
    plan = flash_plan.PrefillPlan.of(starts, lens, recent, torch.device("cpu"))
    pairs = far = near = tiles = 0
    for begin, end, length in zip(starts, starts[1:], lens):
        chunk = end - begin
        prefix = length - chunk
        pairs += sum(t + 1 for t in range(prefix, length))
        tiles += chunk * heads
        if chunk:
            far += sum(1 for s in range(length) if s < length - recent)
            near += sum(1 for s in range(length) if s > prefix - recent)
    size = flash_plan.CallSize.of_plan(plan, heads, kv_heads, dim)
    programs = -(-tiles // flash_plan.FLASH_QUERY_TILE)
    shortest = min(end - begin for begin, end in zip(starts, starts[1:]) if end > begin)  # 5: the empty one skipped
    assert size == flash_plan.CallSize(pairs * heads * dim, programs, max(far, near) * kv_heads * dim * 4,
                                       shortest)


_SPLIT_WORK = flash_plan.FLASH_SPLIT_MIN_PROGRAM_WORK
_TILE = flash_plan.FLASH_QUERY_TILE


@pytest.mark.parametrize("size, pays, default_path, unsplit_path", [
    (flash_plan.CallSize(_SPLIT_WORK * 64, 64, 0, _TILE), True, "split", "flash"),  # 64 programs: over the floor
    (flash_plan.CallSize(_SPLIT_WORK * 32, 32, 0, _TILE), True, "split", "triton"),  # under the floor
    (flash_plan.CallSize(_SPLIT_WORK * 64 - 1, 64, 0, _TILE), False, "flash", "flash"),  # programs' work too small
    (flash_plan.CallSize(_SPLIT_WORK * 128, 128, 0, _TILE), False, "flash", "flash"),  # enough programs unsplit
    (flash_plan.CallSize(_SPLIT_WORK * 32, 32, 0, _TILE - 1), False, "triton", "triton"),  # a partial query tile
    (flash_plan.CallSize(_SPLIT_WORK * 32, 32, 0, 0), False, "triton", "triton"),  # chunks unknown (no plan)
    (flash_plan.CallSize(_SPLIT_WORK * 32, 32, 2 ** 40, _TILE), True, "triton", "triton"),  # workspace cap
])
def test_call_size_splits_keys_where_few_programs_each_walk_a_long_prefix(monkeypatch, size, pays, default_path,
                                                                          unsplit_path) -> None:
    """CallSize.split_pays at each of its bounds (fewer than FLASH_SPLIT_MAX_PROGRAMS programs, each of at least
    FLASH_SPLIT_MIN_PROGRAM_WORK, every request a full query tile), and CallSize.path by default (segments where
    they pay, with no program floor) and with them off (prefill_flash_split False: the floor of 64 programs)."""
    monkeypatch.setattr(flash_plan, "workspace_fallbacks", 0)
    assert flash_plan.FLASH_SPLIT_MAX_PROGRAMS == 128 and flash_plan.FLASH_PREFILL_MIN_PROGRAMS == 64
    assert size.split_pays() is pays
    assert size.path() == default_path and size.path(False) == unsplit_path
    assert size.path(True) == ("triton" if size.workspace else "split")


@pytest.mark.parametrize("rows, split, segments", [(128, None, 132), (127, None, None), (128, False, None),
                                                   (127, True, 132)])
def test_prefill_default_cuts_keys_into_segments_by_its_rule(monkeypatch, rows, split, segments) -> None:
    """oscar_prefill's default (prefill_flash_split None) runs flash_prefill with key segments where the step's
    plan has every chunk fill a query tile (128 rows) and CallSize.split_pays (the work bound lowered here; 2 heads:
    2 programs unsplit, ceil(2 x 132 SMs / 2) segments), and the Triton kernel where the unsplit launch has too few
    programs (FLASH_PREFILL_MIN_PROGRAMS 4 here); False never cuts them, True always does."""
    gen = torch.Generator().manual_seed(11)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([rows + 40], 1, layout, 4, 8, gen)
    query = torch.randn(rows, 2, 64, generator=gen).to(torch.bfloat16)
    plan = flash_plan.PrefillPlan.of([0, rows], [rows + 40], 8, query.device)
    calls = []
    monkeypatch.setattr(triton_ops, "flash_unavailable", lambda *args: None)
    monkeypatch.setattr(triton_ops, "flash_prefill", lambda *args, **kwargs: calls.append(kwargs) or args[7])
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_WORK", 1)
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_PROGRAMS", 4)
    monkeypatch.setattr(flash_plan, "FLASH_SPLIT_MIN_PROGRAM_WORK", 1)
    config = triton_ops.AttentionConfig(block_t=16, prefill_flash_split=split)
    triton_ops.oscar_prefill(query, None, None, state.cache, state.window_k, state.window_v, layout,
                             state.block_table, state.window_block_table, torch.tensor([0, rows], dtype=torch.int32),
                             state.seq_lens, 4, 8, 0.125, chunk_from_cache=True, max_seq_len=rows + 40,
                             flash_plan=plan, config=config)
    assert [call["key_segments"] for call in calls] == ([] if segments is None else [segments])
    path = triton_ops.prefill_path(config, query, layout, 8, rows + 40, state.block_table, 1, plan)
    assert path == ("triton" if segments is None else "split")


@pytest.mark.parametrize("planned", [False, True])
def test_prefill_flash_default_sizes_a_planned_call_exactly(monkeypatch, planned) -> None:
    """One request of 4 new rows over a prefix of 16: rows x max_seq_len bounds its work at 80 pairs per head
    channel, the plan counts 74. With the threshold between the two, only the bound takes FlashAttention; the
    planned call goes to the Triton kernel."""
    gen = torch.Generator().manual_seed(10)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([20], 1, layout, 4, 8, gen)
    rows = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    plan = flash_plan.PrefillPlan.of([0, 4], [20], 8, rows.device) if planned else None
    calls = []
    monkeypatch.setattr(triton_ops, "flash_unavailable", lambda *args: None)
    monkeypatch.setattr(triton_ops, "flash_prefill", lambda *args, plan, **kwargs: calls.append(plan) or args[7])
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_WORK", 75 * 2 * 64)
    monkeypatch.setattr(flash_plan, "FLASH_PREFILL_MIN_PROGRAMS", 1)
    triton_ops.oscar_prefill(rows, None, None, state.cache, state.window_k, state.window_v, layout, state.block_table,
                             state.window_block_table, torch.tensor([0, 4], dtype=torch.int32), state.seq_lens, 4, 8,
                             0.125, chunk_from_cache=True, max_seq_len=20, flash_plan=plan,
                             config=triton_ops.AttentionConfig(block_t=16))
    assert calls == ([] if planned else [None])


@pytest.mark.parametrize("rows, expected", [(512, 8), (300, 12), (32768, 1)])
def test_key_segments_aim_at_programs_per_sm(rows, expected) -> None:
    """Under prefill_flash_split, flash_prefill gets ceil(FLASH_SPLIT_PROGRAMS_PER_SM x SMs / programs) key
    segments, programs counted as the routing counts them (query rows x Hq / 128, rounded up; 132 SMs stand in on
    CPU; 9 heads): 512 rows -> 36 programs -> 8; 300 rows -> 22 -> 12; 32768 rows are enough alone."""
    assert triton_ops.key_segments(torch.zeros(rows, 9, 64)) == expected


def test_prefill_flash_true_refuses_where_flash_cannot_run() -> None:
    gen = torch.Generator().manual_seed(6)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([20], 1, layout, 4, 8, gen)
    rows = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="prefill_flash=True, but FlashAttention prefill cannot run here: tensors "
                                         "on cpu, not CUDA"):
        triton_ops.oscar_prefill(rows, None, None, state.cache, state.window_k, state.window_v, layout,
                                 state.block_table, state.window_block_table, torch.tensor([0, 4], dtype=torch.int32),
                                 state.seq_lens, 4, 8, 0.125, chunk_from_cache=True,
                                 config=triton_ops.AttentionConfig(prefill_flash=True))


def _rows_with_outliers(n: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, heads, dim, generator=gen)
    x[:, :, 3] *= 40.0  # a planted outlier channel
    x[:, 1 % heads, dim - 2] = -75.0
    return x


@pytest.mark.parametrize("n, hq, hr, dim, dtype, inverse", [
    (1, 4, 1, 64, torch.bfloat16, False),  # a decode row, GQA 4
    (5, 9, 3, 64, torch.float32, True),  # GQA 3 (SmolLM2), the inverse on fp32 rows
    (3, 2, 2, 128, torch.float16, False),  # no GQA, fp16, four column blocks of D 128
    (100, 3, 1, 32, torch.float32, False),  # 300 rows: the prefill-sized row blocks, a ragged last one
])
def test_triton_rotate_matches_float64(n, hq, hr, dim, dtype, inverse) -> None:
    gen = torch.Generator().manual_seed(n + hq + dim)
    rotation = random_rotations(hr, dim, gen)
    x = _rows_with_outliers(n, hq, dim, gen).to(dtype)
    matrix = rotation.double().transpose(-1, -2) if inverse else rotation.double()
    expected = torch.einsum("nhd,hde->nhe", x.double(), matrix.repeat_interleave(hq // hr, dim=0))
    got = triton_ops.oscar_rotate(x, rotation, inverse=inverse)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert relative_error(got.double(), expected) < 1e-6


def test_triton_rotate_writes_into_a_view_in_its_dtype_and_nothing_else() -> None:
    gen = torch.Generator().manual_seed(11)
    rotation = random_rotations(2, 32, gen)
    rows = _rows_with_outliers(6, 4, 32, gen)
    output = torch.full((9, 4, 32), float("nan"), dtype=torch.bfloat16)  # poisoned: only rows [0, 6) may change
    triton_ops.oscar_rotate(rows, rotation, inverse=True, out=output[:6])
    expected = torch.einsum("nhd,hed->nhe", rows.double(), rotation.double().repeat_interleave(2, dim=0))
    assert relative_error(output[:6].double(), expected) < 1e-2  # bf16 output
    assert torch.isnan(output[6:].float()).all()


def test_triton_rotate_rejects_bad_shapes() -> None:
    rotation = torch.eye(16).expand(2, 16, 16).contiguous()
    with pytest.raises(ValueError, match="must divide"):
        triton_ops.oscar_rotate(torch.randn(2, 3, 16), rotation)
    with pytest.raises(ValueError, match="out must be"):
        triton_ops.oscar_rotate(torch.randn(2, 4, 16), rotation, out=torch.empty(2, 4, 8))


def test_triton_path_rejects_what_it_cannot_run() -> None:
    layout = PageLayout(32, 32, 16)
    cache = layout.allocate(2, 1)
    wk = torch.zeros(1, 16, 1, 32, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_dim >= 64"):
        triton_ops.oscar_decode(torch.randn(1, 1, 32), cache, wk, wk, layout, table, table,
                                torch.tensor([3], dtype=torch.int32), 1, 1, 0.1)
    layout = PageLayout(128, 8, 16)
    cache = layout.allocate(2, 1)
    wk = torch.zeros(1, 16, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_size"):
        triton_ops.oscar_decode(torch.randn(1, 1, 128), cache, wk, wk, layout, table, table,
                                torch.tensor([3], dtype=torch.int32), 1, 1, 0.1)
    layout = PageLayout(64, 64, 16)
    cache = layout.allocate(2, 1)
    wk = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        triton_ops.oscar_decode(torch.randn(1, 1, 64), cache, wk, wk, layout, table, table,
                                torch.tensor([3], dtype=torch.int32), 1, 1, 0.1,
                                config=triton_ops.AttentionConfig(unpack=UNPACK_PTX))
