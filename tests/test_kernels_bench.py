"""CPU-checkable parts of the decode benchmark: window bookkeeping, byte counts, CLI guard."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from vllm_oscar.cli import main
from vllm_oscar.commands.bench import fastest_configs
from vllm_oscar.kernels import triton_ops
from vllm_oscar.kernels.benchmark import (
    ALLOCATOR_ENV,
    ALLOCATOR_SETTINGS,
    bf16_bytes,
    configure_allocator,
    format_breakdown,
    summarize_kernels,
    window_blocks,
)
from vllm_oscar.kernels.triton_ops import (
    MIN_TILES_PER_SPLIT,
    WINDOW_ROOM_SPLIT_TILES,
    AttentionConfig,
    SmLimits,
    decode_splits,
    resident_programs,
)


@pytest.mark.parametrize("length,bs,sink,recent", [(1, 16, 64, 256), (100, 16, 64, 256), (5000, 16, 64, 256),
                                                   (77, 8, 5, 7), (320, 32, 64, 256)])
def test_window_blocks_are_exactly_the_blocks_holding_window_positions(length, bs, sink, recent) -> None:
    expected = sorted({s // bs for s in range(length) if s < sink or s > length - 1 - recent})
    assert window_blocks(length, bs, sink, recent) == expected


def test_bf16_bytes_counts_k_v_query_and_output() -> None:
    # B=2, L=10, Hkv=3, Hq=6, D=8: K+V = 2*10*3*2*8*2 bytes, q and out = 2 * 2*6*8*2 bytes
    assert bf16_bytes(2, 10, 3, 6, 8) == 2 * 10 * 3 * 2 * 8 * 2 + 2 * 2 * 6 * 8 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_says_so(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)  # the command sets it; undone after the test
    assert main(["bench", "decode"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_initialized(), reason="the allocator is chosen before CUDA starts")
def test_configure_allocator_sets_the_choice_and_keeps_a_users_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert configure_allocator("expandable") == "expandable_segments:True" == ALLOCATOR_SETTINGS["expandable"]
    assert os.environ[ALLOCATOR_ENV] == "expandable_segments:True"
    monkeypatch.delenv(ALLOCATOR_ENV)
    assert configure_allocator("default") == "" and ALLOCATOR_ENV not in os.environ
    monkeypatch.setenv(ALLOCATOR_ENV, "max_split_size_mb:512")
    assert configure_allocator("expandable") == "max_split_size_mb:512"  # the user's own setting wins
    with pytest.raises(ValueError, match="choose one of"):
        configure_allocator("huge")


def _tune_row(geometry: str, batch: int, block_t: int, ms: float | None) -> dict:
    row = {"geometry": geometry, "context": 32768, "batch": batch,
           "config": dataclasses.asdict(AttentionConfig(block_t=block_t, num_stages=1))}
    if ms is None:
        row["error"] = "OutOfResources: shared memory"
    else:
        row["oscar"] = {"ms": ms}
    return row


def test_config_from_picks_least_total_time_over_cases_that_all_ran(tmp_path) -> None:
    # block_t 32 has the single fastest row (B=8) but loses in total; block_t 128 is fastest in
    # total but failed on one case, so it is not eligible.
    rows = [_tune_row("qwen3-8b", 8, 32, 0.10), _tune_row("qwen3-8b", 32, 32, 0.70),
            _tune_row("qwen3-8b", 8, 64, 0.12), _tune_row("qwen3-8b", 32, 64, 0.50),
            _tune_row("qwen3-8b", 8, 128, 0.05), _tune_row("qwen3-8b", 32, 128, None),
            _tune_row("smollm2-135m", 8, 128, 0.2)]
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"tune": rows}))
    chosen = fastest_configs(str(path), ["qwen3-8b", "smollm2-135m"])
    assert chosen["qwen3-8b"] == AttentionConfig(block_t=64, num_stages=1)
    assert chosen["smollm2-135m"] == AttentionConfig(block_t=128, num_stages=1)
    with pytest.raises(SystemExit, match="no timed tune rows for geometry 'other'"):
        fastest_configs(str(path), ["other"])


def test_decode_splits_respect_the_fewest_tiles_per_split() -> None:
    cpu = torch.device("cpu")  # sized for the 132-SM default
    # 4K context, tile 64: 64 tiles; batch 1 x 8 KV heads wants 264 programs' worth of splits.
    assert decode_splits(1, 8, 4096, 64, cpu) == 64 // MIN_TILES_PER_SPLIT
    assert decode_splits(1, 8, 4096, 64, cpu, min_tiles_per_split=1) == 64
    # A full GPU (many requests) needs no splitting, whatever the floor.
    assert decode_splits(512, 8, 4096, 64, cpu, min_tiles_per_split=1) == 1


def test_decode_splits_fill_whole_waves() -> None:
    """The split programs never spill a partial wave: 12 per SM x 132 SMs = 1584 slots."""
    cpu = torch.device("cpu")
    for batch, heads in ((1, 8), (8, 8), (32, 8), (64, 8), (32, 3), (5, 7)):
        splits = decode_splits(batch, heads, 1 << 20, 64, cpu, programs_per_sm=12)
        assert splits * batch * heads <= 12 * 132 < (splits + 1) * batch * heads
    assert decode_splits(32, 8, 1 << 20, 64, cpu, programs_per_sm=24) == 12  # two full waves


def test_decode_splits_make_room_for_the_windows_beside_short_splits() -> None:
    """Short splits (< SHORT_SPLIT_TILES tiles) give way to the window programs of the launch, so that
    both fit one wave (12 per SM x 132 SMs = 1584 slots), down to half the one-wave count."""
    cpu = torch.device("cpu")
    # 4K, B=8 x 8 heads: 24 splits of 64 tiles are short; 64 x (24 + 13) > 1584; room for 11, half is 12.
    assert decode_splits(8, 8, 4096, 64, cpu, 12, 2) == 24
    assert decode_splits(8, 8, 4096, 64, cpu, 12, 2, window_programs=13) == 12
    # 32K, B=1 x 8 heads: 198 splits of 512 tiles are short; room for (1584 - 8 * 13) // 8 = 185.
    assert decode_splits(1, 8, 32768, 64, cpu, 12, 2, window_programs=13) == 185
    # Long splits (32K, B=8: 24 splits of 512 tiles) keep the one-wave count; so do launches that fit.
    assert decode_splits(8, 8, 32768, 64, cpu, 12, 2, window_programs=13) == 24
    assert decode_splits(1, 8, 16384, 64, cpu, 12, 2, window_programs=13) == 128


def test_decode_splits_of_under_eight_tiles_make_room_only_at_a_quarter_fewer() -> None:
    """Splits of SHORT_SPLIT_TILES to WINDOW_ROOM_SPLIT_TILES - 1 tiles give the window programs room in the wave
    (16 per SM x 132 SMs = 2112 slots) only where at most a quarter of the splits go."""
    cpu = torch.device("cpu")
    room = WINDOW_ROOM_SPLIT_TILES
    # 32K, B=8 x 3 heads: 88 splits of 512 tiles (5-6 each); 24 x (88 + 6) > 2112; room for 82 >= 88 - 22.
    assert decode_splits(8, 3, 32768, 64, cpu, 16, 2, 6, room_tiles=room) == 82
    assert decode_splits(8, 3, 32768, 64, cpu, 16, 2, 6, 507, room) == 73  # balanced: 7 tiles each
    assert decode_splits(8, 3, 32768, 64, cpu, 16, 2, 6) == 88  # the default: splits of < SHORT_SPLIT_TILES only
    # 4K, B=64 x 3 heads: 11 splits of 64 tiles (5-6 each); room for (2112 - 192 x 6) // 192 = 5 < 11 - 2: kept.
    assert decode_splits(64, 3, 4096, 64, cpu, 16, 2, 6, room_tiles=room) == 11
    # 128K, B=8: splits of 23 tiles keep the one-wave count although the windows overflow it.
    assert decode_splits(8, 3, 131072, 64, cpu, 16, 2, 6, room_tiles=room) == 88


def test_int2_split_tiles_count_the_tiles_the_splits_share() -> None:
    """The split programs' tiles of a request, from positions: with whole tiles only, those inside the pure INT2
    range [min(sink, L), max(sink_end, L - recent)); else from the tile of its first position to its end."""
    for length, sink, recent, block_t in ((131072, 64, 256, 64), (4096, 64, 256, 64), (700, 8, 24, 16),
                                          (300, 0, 0, 16), (90, 64, 256, 64), (1000, 40, 100, 64)):
        sink_end = min(sink, length)
        int2 = range(sink_end, max(sink_end, length - recent))
        whole = {p // block_t for p in int2 if all(q in int2 for q in range(p // block_t * block_t,
                                                                             (p // block_t + 1) * block_t))}
        touched = {p // block_t for p in int2}
        assert triton_ops.int2_split_tiles(length, sink, recent, block_t, True) == len(whole), length
        assert triton_ops.int2_split_tiles(length, sink, recent, block_t, False) == len(touched), length


def test_window_tile_counts_cover_what_the_whole_tiles_leave_and_no_more() -> None:
    """With whole-tile splits, the positions outside the whole INT2 tiles (found position by position) go to the
    sink programs up to the first whole tile (or, without one, up to the first tile boundary after the sink, INT2
    positions included) and to the recent programs from there, counted from the window tile holding their first
    position: every length fits the counts, and some length needs every recent program (none is always empty)."""
    for sink, recent, block_t, window_t in ((64, 256, 64, 64), (64, 256, 64, 16), (5, 7, 16, 16), (100, 30, 32, 16),
                                            (0, 64, 64, 64), (64, 0, 64, 32), (0, 40, 16, 64), (5, 7, 16, 64)):
        nsink, windows = triton_ops.window_tile_counts(sink, recent, block_t, window_t, True)
        most = 0
        for length in range(1, 6 * block_t + sink + recent):
            sink_end = min(sink, length)
            int2 = range(sink_end, max(sink_end, length - recent))
            whole = [p for p in int2 if all(q in int2 for q in range(p // block_t * block_t,
                                                                      (p // block_t + 1) * block_t))]
            boundary = -(-sink_end // block_t) * block_t
            head_end = whole[0] if whole else max(sink_end, min(boundary, int2.stop))
            rest = [p for p in range(length) if p >= head_end and (not whole or p > whole[-1])]
            assert head_end <= nsink * window_t, (sink, recent, block_t, window_t, length)
            if rest:
                needed = rest[-1] // window_t - rest[0] // window_t + 1
                most = max(most, needed)
                assert needed <= windows - nsink, (sink, recent, block_t, window_t, length)
        assert most == windows - nsink, (sink, recent, block_t, window_t, most, windows - nsink)


def test_decode_splits_leave_no_split_of_the_longest_request_without_tiles() -> None:
    """Given the tiles the splits share, the count is the fewest splits at the one-wave count's tiles per split:
    each split of a max_seq_len request gets tiles, none gets more than before."""
    cpu = torch.device("cpu")
    for batch, heads, length, windows in ((1, 8, 32768, 7), (1, 8, 131072, 7), (8, 3, 16384, 7), (8, 8, 32768, 7),
                                          (8, 8, 4096, 7), (3, 5, 70000, 7), (64, 3, 4096, 3)):
        shared = triton_ops.int2_split_tiles(length, 64, 256, 64, True)
        before = decode_splits(batch, heads, length, 64, cpu, 16, 2, windows)
        after = decode_splits(batch, heads, length, 64, cpu, 16, 2, windows, shared)
        per_split = max(math.ceil(shared / before), 2)
        assert after <= before and math.ceil(shared / after) == per_split, (batch, heads, length)
        assert (after - 1) * per_split < shared, f"the last split of {batch, heads, length} has no tile"
    # SmolLM2-135M geometry, 16K, B=8: 81 splits (room made for 7 window programs) of 4 tiles: 63 suffice.
    assert decode_splits(8, 3, 16384, 64, cpu, 16, 2, 7, 251) == 63


def test_write_warps_take_fewer_warps_for_prefill_sized_small_heads() -> None:
    """head_dim <= 64: 8 warps at decode sizes, 2 from WRITE_PREFILL_TOKENS new tokens (H200 write
    tunes); larger heads keep 4 at every size."""
    assert triton_ops.write_warps(64, 32) == 8
    assert triton_ops.write_warps(64, triton_ops.WRITE_PREFILL_TOKENS - 1) == 8
    assert triton_ops.write_warps(64, triton_ops.WRITE_PREFILL_TOKENS) == 2
    assert triton_ops.write_warps(128, 32) == triton_ops.write_warps(128, 1 << 16) == 4


def test_resident_programs_take_the_tightest_sm_limit() -> None:
    """Registers are allocated per warp in units of 256, whole warps per scheduler partition (a
    quarter of the file); threads, shared memory and the program cap bound it too (Hopper's SM)."""
    hopper = SmLimits(registers=65536, threads=2048, shared_bytes=233472)
    assert resident_programs(154, 1, 2304, hopper) == 12  # 154 -> 160 per thread: 5120 per warp
    assert resident_programs(158, 1, 2304, hopper) == 12
    assert resident_programs(128, 1, 2304, hopper) == 16
    assert resident_programs(168, 1, 2304, hopper) == 12  # 5376 per warp: 3 per 16384-register partition
    assert resident_programs(96, 1, 0, hopper) == 20  # 5 per partition (the whole file would fit 21)
    assert resident_programs(32, 1, 0, hopper) == 32  # the resident-program cap
    assert resident_programs(32, 4, 0, hopper) == 16  # 2048 threads / 128
    assert resident_programs(64, 1, 40 * 1024, hopper) == 5  # 233472 / (40 KB + 1 KB)
    assert resident_programs(255, 8, 0, hopper) == 1


def test_kernel_summary_separates_busy_time_from_gaps() -> None:
    # Two calls of a three-kernel op (microseconds): split 0-10, window 12-16 overlapping the
    # merge 15-18 in the first call; second call 100-110, 113-117, 120-122.
    records = [("split", 0, 10), ("window", 12, 16), ("merge", 15, 18),
               ("split", 100, 110), ("window", 113, 117), ("merge", 120, 122)]
    summary = summarize_kernels(records, calls=2)
    assert summary["kernels"] == pytest.approx({"split": 0.010, "window": 0.004, "merge": 0.0025})
    assert list(summary["kernels"]) == ["split", "window", "merge"]  # largest first
    assert summary["busy_ms"] == pytest.approx((10 + 6 + 10 + 4 + 2) / 2 / 1e3)
    assert "idle between kernels 0.0040 ms" in format_breakdown({**summary, "idle_ms": 0.004})


def _bench_args(argv: list[str]):
    import argparse

    from vllm_oscar.commands.bench import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_tune_without_launch_flags_times_exactly_the_shipped_decode_config() -> None:
    from vllm_oscar.commands.bench import tune_configs

    # The tune times CUDA-graph replays: the shipped config as a captured launch.
    shipped = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True)
    assert tune_configs(_bench_args(["tune"])) == [shipped]
    # One flag with two values: the shipped config and that one knob flipped, nothing else swept.
    pdl = tune_configs(_bench_args(["tune", "--merge-pdl", "0", "1"]))
    assert pdl == [dataclasses.replace(shipped, merge_pdl=flag) for flag in (False, True)]
    tma = tune_configs(_bench_args(["tune", "--tma-stages", "0", "2", "auto"]))
    assert tma == [dataclasses.replace(shipped, tma_stages=stages) for stages in (0, 2, None)]
    splits = tune_configs(_bench_args(["tune", "--num-splits", "0", "384"]))
    assert splits == [shipped, dataclasses.replace(shipped, num_splits=384)]
    staged = tune_configs(_bench_args(["tune", "--gluon-copy-stages", "0", "2", "3", "auto"]))
    assert staged == [dataclasses.replace(shipped, gluon_copy_stages=stages) for stages in (0, 2, 3, None)]
    tma_copies = tune_configs(_bench_args(["tune", "--gluon-copy-tma", "0", "1", "auto"]))
    assert tma_copies == [dataclasses.replace(shipped, gluon_copy_tma=flag) for flag in (False, True, None)]
    folds = tune_configs(_bench_args(["tune", "--fold-tiles", "8", "32", "auto"]))
    assert folds == [dataclasses.replace(shipped, fold_tiles=tiles) for tiles in (8, 32, None)]
    tiles = tune_configs(_bench_args(["tune", "--block-t", "32", "64", "--num-warps", "2"]))
    assert [(c.block_t, c.split_warps, c.num_stages) for c in tiles] == [(32, 2, triton_ops.DEFAULT_DECODE.num_stages),
                                                                        (64, 2, triton_ops.DEFAULT_DECODE.num_stages)]


def test_prefill_tune_without_launch_flags_times_exactly_the_shipped_prefill_config() -> None:
    from vllm_oscar.commands.bench import prefill_tune_configs

    assert prefill_tune_configs(_bench_args(["prefill", "--prefill-tune"])) == [triton_ops.DEFAULT_PREFILL]
    warps = prefill_tune_configs(_bench_args(["prefill", "--prefill-tune", "--num-warps", "4", "8"]))
    assert [c.num_warps for c in warps] == [4, 8]
    assert all(c.block_t == triton_ops.DEFAULT_PREFILL.block_t for c in warps)


def test_served_launch_configs_are_built_once_per_combination() -> None:
    """The configs a served step asks for per call come from caches (no dataclass built on every decode)."""
    assert triton_ops.decode_config(None, True, False) is triton_ops.decode_config(None, True, False)
    assert triton_ops.prefill_config(None) is triton_ops.prefill_config(None) == triton_ops.DEFAULT_PREFILL
    assert triton_ops.prefill_config(False).prefill_flash is False


def test_bench_prefill_times_the_shipped_config_per_flash_setting_eagerly_by_default() -> None:
    from vllm_oscar.commands.bench import prefill_configs

    args = _bench_args(["prefill"])
    assert prefill_configs(args) == [triton_ops.DEFAULT_PREFILL] and args.prefill_timing == "eager"
    assert args.prefill_flash_plan == ["step"]  # as served: one host plan per step, no synchronisation per layer
    args = _bench_args(["prefill", "--prefill-flash", "0", "1", "auto", "--prefill-timing", "graph"])
    assert prefill_configs(args) == [dataclasses.replace(triton_ops.DEFAULT_PREFILL, prefill_flash=flag)
                                     for flag in (False, True, None)]
    assert args.prefill_timing == "graph"
    args = _bench_args(["prefill", "--prefill-flash", "1", "--prefill-flash-split", "0", "1", "auto"])
    assert [config.prefill_flash_split for config in prefill_configs(args)] == [False, True, None]


@pytest.mark.parametrize("capability,setting,expected", [((9, 0), None, True), ((10, 0), None, True),
                                                         ((8, 0), None, False), ((9, 0), False, False),
                                                         ((9, 0), True, True), ((8, 9), True, ValueError)])
def test_merge_pdl_is_on_by_default_only_where_griddepcontrol_exists(monkeypatch, capability, setting,
                                                                     expected) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "test GPU")
    config = AttentionConfig(merge_pdl=setting)
    assert triton_ops._merge_pdl(config, True, torch.device("cpu")) is False  # the interpreter: never
    if expected is ValueError:
        with pytest.raises(ValueError, match="compute capability >= 9.0.*merge_pdl=None"):
            triton_ops._merge_pdl(config, False, torch.device("cpu"))
    else:
        assert triton_ops._merge_pdl(config, False, torch.device("cpu")) is expected


def _split_count_for(batch: int, max_seq_len: int) -> int:
    """decode_split_count of Qwen3-8B geometry (32 query / 8 KV heads, D 128, blocks of 16) on CPU
    tensors, where the split sizing assumes PROGRAMS_PER_SM resident programs per SM."""
    from vllm_oscar.kernels.layout import PageLayout

    layout = PageLayout(128, 128, 16, torch.float16)
    cache = layout.allocate(4, 8)
    window = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(batch, 4, dtype=torch.int32)
    return triton_ops.decode_split_count(torch.zeros(batch, 32, 128, dtype=torch.bfloat16), cache, window, window,
                                         layout, table, table.clone(), torch.full((batch,), 40, dtype=torch.int32),
                                         64, 256, 0.1, max_seq_len)


def test_decode_splits_are_sized_for_fewer_programs_when_the_merge_is_small() -> None:
    """Batch 1: the merge has 32 heads x 4 channel blocks = 128 programs < 132 SMs, so the splits are
    sized for SMALL_MERGE_PROGRAMS_PER_SM per SM; batch 2 (256 merge programs) keeps the resident count."""
    assert triton_ops.PROGRAMS_PER_SM > triton_ops.SMALL_MERGE_PROGRAMS_PER_SM
    # 128K: 2048 tiles of 64, long splits (no room made for the windows).
    # The splits share the whole tiles of [64, 131072 - 256): 2043. Batch 1: 12 x 132 / 8 = 198 splits would walk
    # ceil(2043 / 198) = 11 tiles each, which 186 splits cover; batch 2: 16 x 132 / 16 = 132 splits of 16 -> 128.
    small, resident = triton_ops.SMALL_MERGE_PROGRAMS_PER_SM * 132 // 8, triton_ops.PROGRAMS_PER_SM * 132 // 16
    assert _split_count_for(1, 131072) == math.ceil(2043 / math.ceil(2043 / small))
    assert _split_count_for(2, 131072) == math.ceil(2043 / math.ceil(2043 / resident))


@pytest.mark.parametrize("length,num_splits,empty", [(32768, 86, 1), (32768, 85, 0), (32768, 74, 1), (32768, 73, 0),
                                                     (24576, 48, 0), (24576, 74, 10), (131072, 128, 0), (4096, 64, 5),
                                                     (300, 8, 8)])
def test_tune_flags_forced_split_counts_that_leave_splits_without_tiles(length, num_splits, empty) -> None:
    """bench tune --num-splits n: the splits of a length-position request that get no tile, counted here by handing
    out the request's whole INT2 tiles (sink 64 .. length - 256, tiles of 64) as the kernels do: ceil(tiles / n) per
    split, in order."""
    from vllm_oscar.kernels.benchmark import forced_empty_splits

    first, end = 64, max(64, length - 256) // 64 * 64
    tiles = max(end - first, 0) // 64
    per_split = max(-(-tiles // num_splits), 1)
    without = sum(1 for split in range(num_splits) if split * per_split >= tiles)
    assert without == empty
    assert forced_empty_splits(AttentionConfig(num_splits=num_splits), length) == empty
    assert forced_empty_splits(AttentionConfig(num_splits=num_splits, block_t=64), length) == empty


def test_geometries_by_name_or_by_their_numbers() -> None:
    from vllm_oscar.kernels.benchmark import GEOMETRIES, geometry_heads

    assert geometry_heads("qwen3-8b") == GEOMETRIES["qwen3-8b"] == (32, 8, 128)
    assert geometry_heads("40x8x128") == (40, 8, 128)
    with pytest.raises(ValueError, match="e.g. 32x8x128"):
        geometry_heads("llama")
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        geometry_heads("32x6x128")


def test_bench_plans_refuses_a_bad_geometry(capsys) -> None:
    """`bench plans` refuses a bad geometry before anything runs (argparse exits 2 and names the fix)."""
    with pytest.raises(SystemExit) as error:
        main(["bench", "plans", "--geometry", "32x0x128", "--out", "t.json"])
    assert error.value.code == 2
    assert "positive multiple of the KV heads" in capsys.readouterr().err
