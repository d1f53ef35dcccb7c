"""gluon_decode's TMA copies (AttentionConfig.gluon_copy_tma) without a GPU: the host descriptors' boxes cover exactly
one (block, KV head) region each, in the order the kernel's staged reads assume (checked by reading each box through
torch.as_strided with the descriptor's own shape and strides, against byte ranges of the page layout); the shared
layout the kernel reads the V box through agrees with an independent model of where TMA's 128-byte swizzle puts each
byte; and the default copies by TMA only where it was measured to pay. The kernel's numbers are checked on the GPU
(bench/check_kernels_gpu.py --with-knob gluon_copy_tma, --only graph)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_oscar.kernels import gluon_decode, triton_ops
from vllm_oscar.kernels.layout import PageLayout

BLOCKS, HEADS = 3, 2


def _cache(dim: int) -> tuple[PageLayout, torch.Tensor, list]:
    layout = PageLayout(dim, dim, 64, torch.float16)
    cache = torch.randint(0, 256, (BLOCKS, HEADS, layout.head_region_bytes), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(dim))
    offsets = triton_ops._plane_offsets(layout)
    return layout, cache, gluon_decode.tma_descriptors(cache, dim, offsets["K_CODES"], offsets["V_CODES"],
                                                       offsets["K_SCALE"])


def _box(desc, cache: torch.Tensor, region: int) -> torch.Tensor:
    """The bytes TMA copies for the box at [region, 0, ...] of desc, in box order (row-major over its block shape)."""
    base = desc.base.storage_offset() - cache.storage_offset()
    flat = cache.reshape(-1)
    view = torch.as_strided(flat, list(desc.block_shape), list(desc.strides),
                            storage_offset=base + region * desc.strides[0])
    return view.reshape(-1, 128)


@pytest.mark.parametrize("dim", [128, 64])
def test_tma_boxes_cover_one_region_each(dim: int) -> None:
    layout, cache, (codes, values, planes) = _cache(dim)
    code_lines = 64 * layout.code_bytes // 128  # 128-byte lines of one code plane
    for block in range(BLOCKS):
        for head in range(HEADS):
            region = cache[block, head].view(-1, 128)  # the region's 128-byte lines
            r = block * HEADS + head
            torch.testing.assert_close(_box(planes, cache, r), region[2 * code_lines:], rtol=0, atol=0)
            if dim == 128:
                torch.testing.assert_close(_box(codes, cache, r), region[:code_lines], rtol=0, atol=0)
                # box line 8 p + a holds region line 2 a + p of the V codes
                box = _box(values, cache, r)
                v_lines = region[code_lines:2 * code_lines]
                for s in range(code_lines):
                    p, a = divmod(s, code_lines // 2)
                    torch.testing.assert_close(box[s], v_lines[2 * a + p], rtol=0, atol=0)
            else:
                assert values is None  # the key and V codes travel in one box
                torch.testing.assert_close(_box(codes, cache, r), region[:2 * code_lines], rtol=0, atol=0)
    total = sum(math.prod(desc.block_shape) for desc in (codes, values, planes) if desc is not None)
    assert total == layout.head_region_bytes  # the mbarrier's expected bytes: the whole region, once


def test_staged_v_layout_is_where_tma_puts_the_interleaved_lines() -> None:
    """STAGED_V_128_TMA maps each int16 offset of the V stage to (region line, element) as TMA placed it: box line
    s = 8 p + a holds region line 2 a + p, and the 128-byte swizzle stores 16-byte chunk c of box line s at chunk
    c ^ (s % 8)."""
    bases = gluon_decode.STAGED_V_128_TMA.offset_bases
    for offset in range(16 * 64):
        row = col = 0
        for bit, (d_row, d_col) in enumerate(bases):  # a linear layout: XOR of the bases of the offset's set bits
            if offset >> bit & 1:
                row, col = row ^ d_row, col ^ d_col
        s, within = divmod(offset, 64)
        chunk = (within // 8) ^ (s % 8)
        p, a = divmod(s, 8)
        assert (row, col) == (2 * a + p, 8 * chunk + within % 8), offset


def test_tma_descriptors_need_a_contiguous_cache_and_a_kernel_head_dim() -> None:
    layout = PageLayout(128, 128, 64, torch.float16)
    cache = layout.allocate(4, 4)[:, :2]  # every other KV head: not contiguous
    offsets = triton_ops._plane_offsets(layout)
    with pytest.raises(ValueError, match="contiguous .*leave gluon_copy_tma off"):
        gluon_decode.tma_descriptors(cache, 128, offsets["K_CODES"], offsets["V_CODES"], offsets["K_SCALE"])
    wide = PageLayout(256, 256, 64, torch.float16)
    offsets = triton_ops._plane_offsets(wide)
    with pytest.raises(ValueError, match="head_dim in \\(64, 128\\).*not 256"):
        gluon_decode.tma_descriptors(wide.allocate(2, 2), 256, offsets["K_CODES"], offsets["V_CODES"],
                                     offsets["K_SCALE"])


@pytest.mark.parametrize("capability,cuda_graph,dim,contiguous,expected", [
    ((9, 0), True, 128, True, True), ((10, 0), True, 128, True, True), ((8, 9), True, 128, True, False),
    ((9, 0), False, 128, True, False), ((9, 0), True, 64, True, False), ((9, 0), True, 128, False, False)])
def test_tma_copies_by_default_where_they_pay(monkeypatch, capability, cuda_graph, dim, contiguous, expected) -> None:
    """gluon_copy_tma None (where the tiles are staged): a captured launch, head_dim >= 128 (slower at 64), a
    contiguous cache, compute capability >= 9.0."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cache = PageLayout(dim, dim, 64, torch.float16).allocate(4, 4)
    cache = cache if contiguous else cache[:, :2]
    assert triton_ops.tma_copy_pays(cuda_graph, dim, cache, torch.device("cpu")) is expected


def _h200_plan(monkeypatch, length: int, batch: int = 1, heads: tuple[int, int, int] = (32, 8, 128),
               gluon: bool = True, **config) -> "triton_ops._DecodePlan":
    """The decode plan over ``length`` positions for ``batch`` requests of ``heads`` (query heads, KV heads,
    head_dim; Qwen3-8B's by default) at blocks of 64, as on an sm_90 GPU of 132 SMs in a captured launch: gluon_decode's
    kernel (or int2_split_kernel with gluon False), 16 programs per SM."""
    hq, hkv, dim = heads
    monkeypatch.setattr(triton_ops, "gluon_splits_apply", lambda *args: (gluon, "" if gluon else "a GPU"))
    monkeypatch.setattr(triton_ops, "_programs_per_sm", lambda *args: 16)
    monkeypatch.setattr(triton_ops, "_gluon_descriptors", lambda *args: None)
    monkeypatch.setattr(triton_ops, "_cached_descriptors", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    layout = PageLayout(dim, dim, 64, torch.float16)
    blocks = length // 64
    table = torch.zeros(batch, blocks, dtype=torch.int32)  # every request reads block 0: only the plan matters
    window = torch.zeros(2, 64, hkv, dim, dtype=torch.bfloat16)
    return triton_ops._plan_decode(torch.zeros(batch, hq, dim, dtype=torch.bfloat16), layout.allocate(1, hkv),
                                   window, window, layout, table, torch.full((batch, 4), -1, dtype=torch.int32),
                                   torch.full((batch,), length, dtype=torch.int32), 64, 256, 0.1, length,
                                   triton_ops.AttentionConfig(cuda_graph=True, **config))


def test_batch1_tma_plans_stage_splits_of_at_least_four_tiles(monkeypatch) -> None:
    """Batch 1 at head_dim 128 where TMA would copy staged tiles: staged, copied by TMA, splits sized for
    TMA_SMALL_MERGE_PROGRAMS_PER_SM walking >= STAGED_MIN_SPLIT_TILES tiles (H200: 8K-24K 8-12% faster than
    unstaged splits of 2-3 tiles). Without TMA (gluon_copy_tma=False) the cp.async rule of staging_pays holds."""
    for length, splits in ((8192, 31), (16384, 63), (32768, 127), (65536, 128), (131072, 128)):
        plan = _h200_plan(monkeypatch, length)
        tiles = triton_ops.int2_split_tiles(length, 64, 256, 64, True)
        assert plan.gluon_tma and plan.split_consts["COPY_STAGES"] == triton_ops.GLUON_AUTO_COPY_STAGES, length
        assert (plan.num_splits, plan.split_consts["MIN_TILES"]) == (splits, triton_ops.STAGED_MIN_SPLIT_TILES)
        assert -(-tiles // plan.num_splits) >= triton_ops.STAGED_MIN_SPLIT_TILES, length
    cp_async = _h200_plan(monkeypatch, 16384, gluon_copy_tma=False)
    assert not cp_async.gluon_tma and cp_async.split_consts["COPY_STAGES"] == 0
    assert cp_async.split_consts["MIN_TILES"] == triton_ops.GLUON_MIN_SPLIT_TILES and cp_async.num_splits == 84
    staged = _h200_plan(monkeypatch, 16384, gluon_copy_stages=2)  # explicit stages: TMA's split sizing only
    assert staged.gluon_tma and staged.split_consts["MIN_TILES"] == triton_ops.GLUON_MIN_SPLIT_TILES


def test_window_room_for_splits_of_under_eight_tiles_in_gluon_plans_only(monkeypatch) -> None:
    """SmolLM2 geometry (9 / 3 heads, head_dim 64) at 32K batch 8: gluon_decode's one-wave splits (88, 6 tiles each)
    and its window programs overflow 16 programs per SM, so the splits leave the windows room (82, balanced to 73 of
    7 tiles); int2_split_kernel's plan keeps the count of SHORT_SPLIT_TILES' rule (not measured with the new one)."""
    cpu = torch.device("cpu")
    tiles = triton_ops.int2_split_tiles(32768, 64, 256, 64, True)
    gluon = _h200_plan(monkeypatch, 32768, batch=8, heads=(9, 3, 64))
    assert gluon.gluon_splits and gluon.num_splits == 73
    assert gluon.num_splits == triton_ops.decode_splits(8, 3, 32768, 64, cpu, 16, 2, gluon.total - gluon.num_splits,
                                                        tiles, triton_ops.WINDOW_ROOM_SPLIT_TILES)
    triton = _h200_plan(monkeypatch, 32768, batch=8, heads=(9, 3, 64), gluon=False)
    windows = triton.total - triton.num_splits
    assert not triton.gluon_splits
    assert triton.num_splits == triton_ops.decode_splits(8, 3, 32768, 64, cpu, 16, 2, windows, tiles)
    assert triton.num_splits != triton_ops.decode_splits(8, 3, 32768, 64, cpu, 16, 2, windows, tiles,
                                                         triton_ops.WINDOW_ROOM_SPLIT_TILES)


def test_gluon_plans_walk_at_least_three_tiles_per_split(monkeypatch) -> None:
    """gluon_decode's plans walk >= GLUON_MIN_SPLIT_TILES tiles per split (H200: where the merge is not small, SmolLM2
    8K B=8 and 4K B=16 5-7% faster; small merges, SmolLM2 32K B=1 / B=2 7.5%, 8K-16K B=1-4 3-5%): the plans below drop
    from 2-tile splits to 3-tile ones. Batch-1 plans whose tiles TMA copies keep STAGED_MIN_SPLIT_TILES, and
    int2_split_kernel's plans (gluon off) MIN_TILES_PER_SPLIT."""
    smollm2 = (9, 3, 64)
    cases = [(4096, 8, smollm2, {}, 30, 20), (4096, 16, smollm2, {}, 30, 20), (8192, 8, smollm2, {}, 62, 41),
             (8192, 1, smollm2, {}, 62, 41), (32768, 1, smollm2, {}, 254, 169), (32768, 2, smollm2, {}, 254, 169),
             (16384, 4, smollm2, {}, 126, 84), (16384, 1, (32, 8, 128), dict(gluon_copy_tma=False), 126, 84)]
    for length, batch, heads, config, before, after in cases:
        plan = _h200_plan(monkeypatch, length, batch, heads, **config)
        tiles = triton_ops.int2_split_tiles(length, 64, 256, 64, True)
        assert plan.gluon_splits and plan.split_consts["MIN_TILES"] == triton_ops.GLUON_MIN_SPLIT_TILES
        assert plan.num_splits == after and -(-tiles // after) == triton_ops.GLUON_MIN_SPLIT_TILES, (length, batch)
        assert -(-tiles // before) == triton_ops.MIN_TILES_PER_SPLIT  # the count of the 2-tile floor
    tma_batch1 = _h200_plan(monkeypatch, 16384)
    assert tma_batch1.gluon_tma and tma_batch1.split_consts["MIN_TILES"] == triton_ops.STAGED_MIN_SPLIT_TILES
    triton = _h200_plan(monkeypatch, 4096, 8, smollm2, gluon=False)
    assert triton.split_consts["MIN_TILES"] == triton_ops.MIN_TILES_PER_SPLIT


def test_window_prefetch_where_the_planner_picks_the_triton_kernel_says_why(monkeypatch) -> None:
    """gluon_window_prefetch (a hint, which does not make the planner pick gluon_decode) on a launch whose planner
    picks int2_split_kernel although gluon_decode could run (here: a knob of int2_split_kernel is set) names that
    reason, not an empty list of what is missing."""
    with pytest.raises(ValueError, match="gluon_window_prefetch=True .*it needs gluon_splits=True: here the planner "
                                         "picks int2_split_kernel, because a knob of that kernel is set"):
        _h200_plan(monkeypatch, 4096, windows_first=True, gluon_window_prefetch=True)
