"""gluon_decode's kernel without a GPU: it compiles for sm_90 at both head_dims as triton_ops launches it (each
layout conversion of the INT2 operands is asserted free at compile time), keeps every operand in registers (no
shared memory; no spills in the split loop) and lets the merge start before its first load; with gluon_copy_stages
it stages tiles in shared memory by cp.async instead; and the decode plan uses it only when asked, with a clear error
where it does not apply.

Its numbers are checked on the GPU against float64 references (bench/check_kernels_gpu.py: every decode case at
head_dim 128 runs it)."""

from __future__ import annotations

import pytest
import torch

from vllm_oscar.kernels import triton_ops
from vllm_oscar.kernels.layout import PageLayout

from offline_probe import run_probe

PROBE = r'''
import json, re, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
from sass_decode import backward_branches, compile_gluon_kernel, copy_sources, instructions, read_compiled
from vllm_oscar.kernels import triton_ops

report = {}
for dim, group in ((128, 4), (64, 3)):
    kernel = compile_gluon_kernel(dim, group)  # as triton_ops launches it (register cap included)
    sass, registers, stack = read_compiled(kernel, None)
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*")]
    first = lambda text: next((i for i, line in enumerate(lines) if text in line), -1)
    loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
    body = [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in loops)]
    report[f"gluon_{dim}"] = dict(shared=kernel.metadata.shared, stack=int(stack), registers=int(registers),
                                  preexit=first("PREEXIT"), first_load=first("LDG"), loops=len(loops),
                                  loop_imma=body.count("IMMA"), loop_hmma=body.count("HMMA"),
                                  loop_local=body.count("LDL") + body.count("STL"), loop_movm=body.count("MOVM"),
                                  loop_shfl=body.count("SHFL"), loop_redux=body.count("REDUX"),
                                  lds=len(re.findall(r"\bLDS", sass)), sts=len(re.findall(r"\bSTS", sass)))
    for stages in triton_ops.GLUON_COPY_STAGES:  # tiles staged in shared memory by cp.async
        staged = compile_gluon_kernel(dim, group, copy_stages=stages)
        sass, registers, stack = read_compiled(staged, None)
        loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
        body = [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in loops)]
        report[f"staged_{dim}_{stages}"] = dict(shared=staged.metadata.shared, registers=int(registers),
                                                loops=len(loops), loop_stores=body.count("STL"),
                                                loop_reloads=body.count("LDL"),
                                                loop_copies=body.count("LDGSTS"), loop_ldg=body.count("LDG"),
                                                loop_copy_sources=len({reg for address, reg in copy_sources(sass)
                                                                       if any(lo <= address <= hi
                                                                              for lo, hi in loops)}),
                                                loop_prefetch=body.count("CCTL"))
    for stages in triton_ops.GLUON_COPY_STAGES:  # the staged tiles copied by TMA (fp16 values, as served)
        tma = compile_gluon_kernel(dim, group, copy_stages=stages, f16_values=True, copy_tma=True)
        sass, registers, stack = read_compiled(tma, None)
        loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
        body = [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in loops)]
        report[f"tma_{dim}_{stages}"] = dict(
            shared=tma.metadata.shared, registers=int(registers), loops=len(loops), loop_stores=body.count("STL"),
            loop_copies=body.count("LDGSTS"), loop_tma=body.count("UTMALDG"), loop_ldg=body.count("LDG"),
            loop_waits=body.count("SYNCS"))
    for stages in (0, triton_ops.GLUON_AUTO_COPY_STAGES):  # fp16 V operands and weights, as bf16 above
        for f16 in (False, True):
            sass, registers, stack = read_compiled(compile_gluon_kernel(dim, group, copy_stages=stages,
                                                                        f16_values=f16), None)
            loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
            body = [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in loops)]
            report[f"values_{dim}_{stages}_{int(f16)}"] = dict(
                registers=int(registers), loops=len(loops), loop_stores=body.count("STL"), size=len(body),
                **{op: body.count(op) for op in ("HMMA", "IMMA", "HMUL2", "SHF", "F2FP")})
    for prefetch in (False, True):  # the window programs' L2 prefetch of their V rows (fp16 values, unstaged)
        sass, registers, stack = read_compiled(compile_gluon_kernel(dim, group, f16_values=True,
                                                                    window_prefetch=prefetch), None)
        loops = [(lo, hi) for lo, hi, is_loop in backward_branches(sass) if is_loop]
        body = [op for address, op in instructions(sass) if any(lo <= address <= hi for lo, hi in loops)]
        report[f"window_prefetch_{dim}_{int(prefetch)}"] = dict(
            registers=int(registers), loops=len(loops), loop=" ".join(body),
            prefetches=[op for address, op in instructions(sass)].count("CCTL"))
for query, window in (("fp32", "bf16"), ("bf16", "fp16")):  # the served step's fp32 query; an fp16 window store
    report[f"types_{query}_{window}"] = compile_gluon_kernel(128, 4, query=query, window=window).metadata.shared
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_probe(PROBE)


@pytest.mark.parametrize("dim", [128, 64])
def test_gluon_kernel_keeps_operands_in_registers(compiled: dict, dim: int) -> None:
    kernel = compiled[f"gluon_{dim}"]
    assert kernel["shared"] == 0 and kernel["lds"] == 0 and kernel["sts"] == 0, kernel  # no shared memory at all
    assert kernel["registers"] <= triton_ops.GLUON_MAX_REGISTERS, kernel
    assert kernel["loops"] == 1 and kernel["loop_local"] == 0, kernel  # the split loop: no spills (window path may)
    # Per tile: 4 (head_dim 128) or 2 int8 K steps over 4 M tiles; the V product over D / 16 M tiles and 4 K steps,
    # plus the column sums' 4.
    steps = 4 if dim == 128 else 2
    assert kernel["loop_imma"] == 4 * steps, kernel
    assert kernel["loop_hmma"] == 4 * (dim // 16) + 4, kernel
    assert 0 <= kernel["preexit"] < kernel["first_load"], kernel  # the merge may start at once


@pytest.mark.parametrize("dim", [128, 64])
def test_gluon_weights_move_by_movmatrix_and_the_loop_barely_shuffles(compiled: dict, dim: int) -> None:
    """The weights W [64, 8] reach the V product's operand by one movmatrix.trans per register (8 MOVM per tile, no
    shuffle for them); the BIAS fold reads the column sums from each lane's own rows; whether a tile needs a rescale
    is one warp reduction (REDUX) of each lane's own test: the split loop's only shuffles are the rescale's (3 rounds
    over a head's rows, taken when a tile's max runs ahead of the running max by the slack)."""
    kernel = compiled[f"gluon_{dim}"]
    assert kernel["loop_movm"] == 8 and kernel["loop_redux"] == 1 and kernel["loop_shfl"] == 3, kernel


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("stages", triton_ops.GLUON_COPY_STAGES)
def test_gluon_kernel_stages_tiles_by_cp_async(compiled: dict, dim: int, stages: int) -> None:
    """gluon_copy_stages: each stage holds one tile's region (codes of K and V, the four scale planes); the split loop
    copies with cp.async (LDGSTS) instead of loading its tile (one LDG: the block-table entry of a later tile) and
    asks L2 for nothing; within the register cap, nothing the loop carries spills (no local stores in it), and at
    head_dim 128 at most a few loop invariants are reloaded from local memory per tile (an L1 hit each: 1 with Triton
    3.6, 3 with 3.9 since the fold of the BIAS sums, FOLD_TILES), none at 64."""
    kernel = compiled[f"staged_{dim}_{stages}"]
    region = PageLayout(dim, dim, 64, torch.float16).head_region_bytes
    assert kernel["shared"] == stages * region, kernel
    assert kernel["registers"] <= triton_ops.GLUON_MAX_REGISTERS and kernel["loop_stores"] == 0, kernel
    assert kernel["loop_reloads"] <= (4 if dim == 128 else 0), kernel
    assert kernel["loops"] == 1 and kernel["loop_prefetch"] == 0, kernel
    assert kernel["loop_copies"] == region // (16 * 32) and kernel["loop_ldg"] == 1, kernel  # 16 bytes per lane
    # the key and V codes' copies (both int16 lines, the same per-lane offsets: V54) take their source addresses from
    # one register (two at head_dim 128, where ptxas rebases the V chunks), the scale planes' copy from one more; five
    # before (a 64-bit add per copy and tile)
    assert kernel["loop_copy_sources"] <= 3, kernel


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("stages", triton_ops.GLUON_COPY_STAGES)
def test_gluon_copy_tma_copies_each_tile_in_boxes(compiled: dict, dim: int, stages: int) -> None:
    """gluon_copy_tma: per tile the split loop issues three TMA copies (key codes, V codes, scale planes; at head_dim
    64 the key and V codes in one) and no cp.async, waits on the stage's mbarrier and sets up the refill's (arrive
    with the expected bytes), loads one block-table entry, and spills nothing; shared memory holds the stages and one
    8-byte mbarrier each."""
    kernel = compiled[f"tma_{dim}_{stages}"]
    region = PageLayout(dim, dim, 64, torch.float16).head_region_bytes
    assert kernel["shared"] == stages * (region + 8), kernel
    assert kernel["registers"] <= triton_ops.GLUON_MAX_REGISTERS and kernel["loop_stores"] == 0, kernel
    assert kernel["loops"] == 1 and kernel["loop_copies"] == 0 and kernel["loop_ldg"] == 1, kernel
    assert kernel["loop_tma"] == (3 if dim == 128 else 2) and kernel["loop_waits"] >= 2, kernel


def test_gluon_copy_tma_is_checked() -> None:
    with pytest.raises(ValueError, match="gluon_copy_tma=True copies gluon_decode's staged tiles by TMA.*set 2 or 3"):
        _plan(triton_ops.AttentionConfig(gluon_copy_tma=True))  # CPU tensors: no Gluon kernel, nothing staged


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("stages", [0, triton_ops.GLUON_AUTO_COPY_STAGES])
def test_gluon_f16_values_take_fewer_instructions(compiled: dict, dim: int, stages: int) -> None:
    """gluon_f16_values: the same MMAs (the V product now fp16), no spill in the split loop, the weights as packed
    fp16 products (HMUL2: p times v_scale and v_offset, two positions each) instead of fp32 products rounded to bf16
    (F2FP), two shifts fewer per V word (one per word; the K planes' shifts unchanged) and fewer instructions per
    tile."""
    bf16, f16 = compiled[f"values_{dim}_{stages}_0"], compiled[f"values_{dim}_{stages}_1"]
    assert f16["loops"] == bf16["loops"] == 1 and f16["loop_stores"] == 0, (bf16, f16)
    assert f16["registers"] <= triton_ops.GLUON_MAX_REGISTERS, f16
    assert (f16["HMMA"], f16["IMMA"]) == (bf16["HMMA"], bf16["IMMA"]), (bf16, f16)
    assert bf16["HMUL2"] == 0 < f16["HMUL2"] and f16["F2FP"] < bf16["F2FP"], (bf16, f16)
    v_words = dim // 8  # a lane's V codes per tile: 64 positions x dim / 4 bytes / 32 lanes / 4 bytes
    assert f16["SHF"] == bf16["SHF"] - 2 * v_words, (bf16, f16)
    assert f16["size"] < bf16["size"], (bf16, f16)


@pytest.mark.parametrize("dim", [128, 64])
@pytest.mark.parametrize("stages", [0, triton_ops.GLUON_AUTO_COPY_STAGES])
def test_gluon_key_planes_take_one_shift_per_code_word(compiled: dict, dim: int, stages: int) -> None:
    """The key codes' planes 2 and 3 enter the logits MMA masked where they lie (16 x code, UPPER_PLANES) and planes
    1 and 3 share one shifted word: one shift per key code word (three before), beside the V unpack's one per word;
    at most a few more for addresses."""
    f16 = compiled[f"values_{dim}_{stages}_1"]
    words = dim // 8  # a lane's key (and V) code words per tile: 64 positions x dim / 4 bytes / 32 lanes / 4 bytes
    assert 2 * words <= f16["SHF"] <= 2 * words + 4, f16


@pytest.mark.parametrize("dim", [128, 64])
def test_gluon_window_prefetch_leaves_the_split_loop_alone(compiled: dict, dim: int) -> None:
    """gluon_window_prefetch: the window programs' path gains L2 prefetches (CCTL: one per lane and 128-byte line of
    the tile's 64 V rows), the split loop is instruction for instruction the same, within the register cap."""
    off, on = compiled[f"window_prefetch_{dim}_0"], compiled[f"window_prefetch_{dim}_1"]
    assert on["loops"] == off["loops"] == 1 and on["loop"] == off["loop"], (off["loops"], on["loops"])
    assert on["registers"] <= triton_ops.GLUON_MAX_REGISTERS, on
    assert on["prefetches"] == off["prefetches"] + 64 * (dim * 2 // 128) // 32, (off["prefetches"], on["prefetches"])


def test_window_prefetch_where_the_window_programs_are_few() -> None:
    """None: where the window programs number at most WINDOW_PREFETCH_PROGRAMS_PER_SM per SM (H200, 132 SMs:
    batch 1 at Qwen3-8B and SmolLM2 geometry, 8 x 6 and 3 x 6 window programs; not 8 requests x 8 KV heads x 6)."""
    pays, auto = triton_ops.window_prefetch_pays, triton_ops.AttentionConfig()
    assert pays(auto, 8 * 6, 132) and pays(auto, 3 * 6, 132) and pays(auto, 132, 132)
    assert not pays(auto, 8 * 8 * 6, 132) and not pays(auto, 133, 132)
    assert pays(triton_ops.AttentionConfig(gluon_window_prefetch=True), 8 * 8 * 6, 132)
    assert not pays(triton_ops.AttentionConfig(gluon_window_prefetch=False), 8, 132)
    with pytest.raises(ValueError,
                       match="gluon_window_prefetch=True is a hint of gluon_decode's window programs.*CUDA"):
        _plan(triton_ops.AttentionConfig(gluon_window_prefetch=True))  # CPU tensors: no Gluon kernel here


def test_gluon_f16_values_are_checked() -> None:
    with pytest.raises(ValueError, match="gluon_f16_values=True builds fp16 V operands in gluon_decode's kernel.*CUDA"):
        _plan(triton_ops.AttentionConfig(gluon_f16_values=True))  # CPU tensors: no Gluon kernel here
    with pytest.raises(ValueError, match="gluon_f16_values=True .*gluon_splits not False"):
        _plan(triton_ops.AttentionConfig(gluon_f16_values=True, gluon_splits=False))


def test_gluon_copy_stages_are_checked() -> None:
    with pytest.raises(ValueError, match="gluon_copy_stages=1: choose 0"):
        _plan(triton_ops.AttentionConfig(gluon_copy_stages=1))
    with pytest.raises(ValueError, match="gluon_copy_stages=2 stages tiles in gluon_decode's kernel.*CUDA GPU"):
        _plan(triton_ops.AttentionConfig(gluon_copy_stages=2))  # CPU tensors: no Gluon kernel here
    with pytest.raises(ValueError, match="gluon_copy_stages=3 .*gluon_splits not False"):
        _plan(triton_ops.AttentionConfig(gluon_copy_stages=3, gluon_splits=False))


def test_default_stages_where_the_h200_timed_them_faster() -> None:
    """gluon_copy_stages None: head_dim 64 always; head_dim 128 for plans of >= 8192 positions per SM (the H200's
    132 SMs: Qwen3-8B geometry, 8 KV heads, staged at 32K batch 8, 4K batch 64; not at 4K batch 32), and for plans
    with a small merge whose splits walk >= 4 tiles (batch 1 from 40K on: 6 tiles at 64K, 11 at 128K; not 3 at 32K).
    """
    assert triton_ops.staging_pays(64, 3, 4096, 132) and triton_ops.staging_pays(64, 3, 131072, 132)
    assert triton_ops.staging_pays(128, 8 * 8, 32768, 132) and triton_ops.staging_pays(128, 64 * 8, 4096, 132)
    assert not triton_ops.staging_pays(128, 8, 32768, 132) and not triton_ops.staging_pays(128, 32 * 8, 4096, 132)
    assert not triton_ops.staging_pays(128, 8, 131072, 132)
    cpu = torch.device("cpu")  # splits sized for 132 SMs
    nsink, windows = triton_ops.window_tile_counts(64, 256, 64, 64, True)
    tiles_per_split = {}
    for length in (32768, 40960, 65536, 131072):
        tiles = triton_ops.int2_split_tiles(length, 64, 256, 64, True)
        splits = triton_ops.decode_splits(1, 8, length, 64, cpu, triton_ops.SMALL_MERGE_PROGRAMS_PER_SM,
                                          triton_ops.MIN_TILES_PER_SPLIT, windows, tiles)
        tiles_per_split[length] = -(-tiles // splits)
    assert tiles_per_split == {32768: 3, 40960: 4, 65536: 6, 131072: 11}
    assert not triton_ops.staging_pays(128, 8, 32768, 132, tiles_per_split[32768])
    for length in (40960, 65536, 131072):
        assert triton_ops.staging_pays(128, 8, length, 132, tiles_per_split[length]), length


def test_two_waves_only_for_long_head_dim_128_splits_with_more_pairs_than_sms() -> None:
    """H200 (132 SMs, 16 programs per SM), Qwen3-8B geometry: two waves at 32K batch 32 / 64 and 16K batch 64 (each
    two-wave split >= 32 tiles of 64), not at 4K or 16K batch 32 (short splits), batch 8 (64 pairs), head_dim 64
    or the Triton split kernel."""
    pays = triton_ops.two_waves_pay
    assert pays(True, 128, 32 * 8, 132, 16, 512) and pays(True, 128, 64 * 8, 132, 16, 512)
    assert pays(True, 128, 64 * 8, 132, 16, 256) and not pays(True, 128, 32 * 8, 132, 16, 256)
    assert not pays(True, 128, 64 * 8, 132, 16, 64) and not pays(True, 128, 8 * 8, 132, 16, 2048)
    assert not pays(True, 64, 64 * 3, 132, 16, 2048) and not pays(False, 128, 64 * 8, 132, 16, 2048)


def test_fold_period_is_a_power_of_two() -> None:
    assert _plan(triton_ops.AttentionConfig()).split_consts["FOLD"] == triton_ops.FOLD_TILES.value == 8
    assert _plan(triton_ops.AttentionConfig(fold_tiles=1)).split_consts["FOLD"] == 1
    with pytest.raises(ValueError, match="fold_tiles=3 must be a power of two"):
        _plan(triton_ops.AttentionConfig(fold_tiles=3))


def test_gluon_kernel_compiles_for_every_query_and_window_dtype(compiled: dict) -> None:
    assert compiled["types_fp32_bf16"] == 0 and compiled["types_bf16_fp16"] == 0, compiled


def _plan(config: triton_ops.AttentionConfig, dim: int = 128, block_size: int = 64):
    layout = PageLayout(dim, dim, block_size, torch.float16)
    hq, hkv, batch, blocks = 8, 2, 2, 4
    query = torch.zeros(batch, hq, dim, dtype=torch.bfloat16)
    cache = layout.allocate(batch * blocks, hkv)
    window = torch.zeros(2, block_size, hkv, dim, dtype=torch.bfloat16)
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    return triton_ops._plan_decode(query, cache, window, window, layout, table, torch.full_like(table, -1),
                                   torch.full((batch,), blocks * block_size, dtype=torch.int32), 64, 256, 0.1,
                                   blocks * block_size, config)


def test_gluon_is_the_default_where_it_applies_and_the_triton_kernel_elsewhere() -> None:
    assert triton_ops.DEFAULT_DECODE.gluon_splits is None  # auto: gluon_decode where it applies and pays
    assert not _plan(triton_ops.DEFAULT_DECODE).gluon_splits  # CPU tensors: no GPU for Gluon
    assert not _plan(triton_ops.AttentionConfig(gluon_splits=False)).gluon_splits


def test_gluon_auto_unless_a_triton_split_knob_is_set_or_short_tma_pays() -> None:
    """Short contexts where int2_split_kernel would load by TMA keep that kernel at head_dim 128 only (Qwen3-8B 4K
    batch 1: faster there on the H200); at head_dim 64 gluon_decode's staged tiles were faster (SmolLM2 4K batch 1)."""
    pays = triton_ops.gluon_pays
    short = triton_ops.GRAPH_TMA_SHORT_CONTEXT
    for dim in (128, 64):
        assert pays(triton_ops.AttentionConfig(), 0, 32768, dim)
        assert pays(triton_ops.AttentionConfig(), triton_ops.GRAPH_TMA_STAGES, 32768, dim)  # TMA at long contexts
        for knob in (dict(tma_stages=0), dict(prefetch=1), dict(window_block_t=32), dict(windows_first=True),
                     dict(split_warps=2)):
            assert not pays(triton_ops.AttentionConfig(**knob), 0, 32768, dim), knob
        assert pays(triton_ops.AttentionConfig(max_registers=96), 0, 32768, dim)  # a cap applies to either kernel
    assert not pays(triton_ops.AttentionConfig(), triton_ops.GRAPH_TMA_STAGES, short, 128)
    assert pays(triton_ops.AttentionConfig(), triton_ops.GRAPH_TMA_STAGES, short, 64)


def test_plan_explains_why_gluon_splits_cannot_run() -> None:
    with pytest.raises(ValueError, match="gluon_splits=True.*CUDA GPU"):
        _plan(triton_ops.AttentionConfig(gluon_splits=True))
    with pytest.raises(ValueError, match="cache blocks of 64 positions.*block_size 16"):
        _plan(triton_ops.AttentionConfig(gluon_splits=True), block_size=16)
