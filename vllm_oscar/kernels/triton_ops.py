"""Triton implementations of oscar_write / oscar_decode / oscar_prefill (the CUDA path).

Same signatures and semantics as vllm_oscar.kernels.torch_ops (contract:
docs/design.md), plus launch knobs. No function here reads device data on the host:
grids come from tensor shapes and Python ints (``max_seq_len`` / ``max_query_len``), so
the ops can be captured in CUDA graphs and replayed with other lengths. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (tests).

Triton-path limits (each a ValueError, not a fallback): head_dim >= 64 (tl.dot needs
D/4 >= 16), group_size in {D, D/2, D/4}; window store and rows contiguous in the last dim.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Optional

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from vllm_oscar.config import INT8_MMA_MIN_HEAD_DIM, REFIT_SCALE_FLOOR, SCALE_EPS, RefitIterations, refit_pair
from vllm_oscar.intmath import cdiv, next_power_of_2
from vllm_oscar.kernels.checks import (
    check_attention_common,
    check_prefill_extra,
    check_rotate_args,
    check_write_args,
    check_write_query,
)
from vllm_oscar.kernels.flash_plan import (
    FLASH_SPLIT_MIN_KEYS,
    FLASH_SPLIT_PROGRAMS_PER_SM,
    CallSize,
    PrefillPlan,
    flash_unavailable,
    full_tile_programs,
)
from vllm_oscar.kernels.flash_prefill import PagedCaches, flash_prefill
from vllm_oscar.kernels.layout import PLANES, PageLayout
from vllm_oscar.kernels.measured_plans import MeasuredPlan, PlanCell, active_table
from vllm_oscar.kernels.triton_attention import LOG2E, attention_kernel, merge_kernel
from vllm_oscar.kernels.triton_common import FOLD_TILES, TL_DTYPES, UNPACK_PORTABLE, UNPACK_PTX
from vllm_oscar.kernels.triton_decode_int2 import int2_split_kernel
from vllm_oscar.kernels.triton_rotate import rotate_rows_kernel
from vllm_oscar.kernels.triton_write import (
    INT2_ALWAYS,
    INT2_IF_FLAG,
    INT2_NEVER,
    INT2_UNLESS_FLAG,
    oscar_write_kernel,
)
from vllm_oscar.kernels.triton_write_rows import oscar_write_rows_kernel
from vllm_oscar.quant import clip_threshold_index

logger = logging.getLogger(f"vllm.{__name__}")

#: Smallest head_dim the Triton kernels take (tl.dot needs the D/4-channel planes >= 16).
MIN_TRITON_HEAD_DIM: int = 64
#: Tokens per write program (tl.dot needs >= 16 rows).
WRITE_BLOCK_N: int = 16
#: Rows of R per step of the write's rotation dot (fp32 FMAs, k in order: the K step does not change the
#: bits on the GPU; the served_graph check compares graph and eager caches bit for bit). 64 in general, 32 in
#: the window-copy programs of a flagged launch (oscar_write with a query): at 64 their FMA dot needs 255
#: registers and spills (offline SASS, sm_90, D 128: 255 + 320 B of stack; 168, none at 32), while the full
#: write at 32 was 6-8% slower at 4096-16384 tokens (H200, docs/perf/write_prefill_h200_w7_*.json).
WRITE_BLOCK_K: int = 64
WRITE_WINDOW_BLOCK_K: int = 32
#: Output columns per window-copy program of a flagged launch (WriteConfig.window_columns; None = this). H200, the
#: first launch alone at 1 new token, us warm (Qwen3-8B geometry, docs/decisions.md): 128 columns 5.75,
#: 64 3.73, 32 3.17, 16 3.29; served steps 20-25% faster than with 128 at 4K-128K batch 1 and 4K-64K batch 8.
WRITE_WINDOW_BLOCK_C: int = 32
#: An INT2-only write launch (a captured decode step's side-stream write) of at most this many new tokens runs as
#: row programs (triton_write_rows: one warp per token, KV head and side) unless WriteConfig.row_programs says
#: otherwise. H200, Qwen3-8B attention x36, served steps, replay alone, ms, row programs reading the first launch's
#: rotated rows / 16-row programs (docs/decisions.md): 4K B=1 0.594 / 0.657, B=8 0.957 / 1.128,
#: B=16 1.520 / 1.858, B=32 2.13 / 2.29, B=64 3.68 / 3.81; 32K B=16 3.555 / 3.87, B=32 6.72 / 6.83, B=64 12.96 /
#: 13.40-14.29; 128K B=1 1.278 / 1.481, B=8 6.04 / 6.40; session 42 ("Session 42"): 4K B=128 6.37 / 6.87, B=256
#: 11.31 / 12.10, B=512 19.98 / 21.02; 16K B=128 14.20 / 14.99. The side write alone at 512 tokens: 12.7 / 23.3 us
#: (no larger batch timed; the first launch's rotated rows then take 4 MiB per layer step at this geometry).
WRITE_ROWS_MAX_TOKENS: int = 512
#: ... and a head_dim of at most this (at 256 the compiler hoists every one of the row's D loads of x ahead of the
#: rotation's chain and spills 1.7 KB per program: offline, sm_90, bench/sass_write.py --rows 1 --head-dim 256).
WRITE_ROWS_MAX_HEAD_DIM: int = 128
#: Registers per lane that a row program's ring of R rows in flight may take: head_dim / 32 fp32 values per row, so
#: 128 / 32 / 16 rows ahead at head_dim 64 / 128 / 256 (offline, sm_90: no stack at 128; rows 32 ahead at head_dim
#: 256 spill 1.9 KB).
WRITE_ROWS_RING_REGISTERS: int = 128
#: WriteConfig(clip_search="top") removes the row maximum at most this many times per row (the
#: rounds are unrolled); a side whose clip keeps fewer values bisects (same threshold either way).
CLIP_TOP_MAX_ROUNDS: int = 16
#: Warps per write program: 4; for head_dim <= 64, 8 below WRITE_PREFILL_TOKENS new tokens and 2 from
#: there. H200, served 8/2 refit, top clip, refit loop, ms (docs/perf/write_warps_w2.json,
#: write_warps_prefill.json): Qwen3-8B geometry, 2 / 4 / 8 warps, 32 tokens 0.0372 / 0.0208 / 0.0245,
#: 4096 tokens 0.2552 / 0.1760 / 0.3468, 16384 0.9761 / 0.6512 / 1.3474 (4 best at every size);
#: SmolLM2, 32 tokens 0.0138 / 0.0175 / 0.0124, 64-256 equal, 1024 0.0186 / 0.0169 / 0.0171,
#: 4096 0.0342 / 0.0391 / 0.0419, 16384 0.1032 / 0.1283 / 0.1336.
WRITE_NUM_WARPS: int = 4
WRITE_NUM_WARPS_SMALL_HEAD: int = 8
WRITE_NUM_WARPS_SMALL_HEAD_PREFILL: int = 2
WRITE_PREFILL_TOKENS: int = 4096


def write_warps(head_dim: int, tokens: int = 1) -> int:
    """Default warps per write program for this head size and number of new tokens."""
    if head_dim > 64:
        return WRITE_NUM_WARPS
    return WRITE_NUM_WARPS_SMALL_HEAD_PREFILL if tokens >= WRITE_PREFILL_TOKENS else WRITE_NUM_WARPS_SMALL_HEAD


#: oscar_write's int2 choices -> the kernel's INT2_MODE.
INT2_MODES: dict[str, int] = {"always": INT2_ALWAYS.value, "never": INT2_NEVER.value, "if_flag": INT2_IF_FLAG.value,
                              "unless_flag": INT2_UNLESS_FLAG.value}
#: WriteConfig defaults (top clip, refit loop, fp32 rotation), H200 2026-11-29 20:18 UTC, served 8 / 2 refit,
#: ms at 32 / 4096 new tokens (docs/perf/write_h200_w2.json): Qwen3-8B geometry bisect + unrolled
#: 0.0330 / 0.3636, top + loop 0.0168 / 0.1760; SmolLM2 0.0143 / 0.0559 -> 0.0114 / 0.0406. tf32x3
#: rotation: 0.0216 / 0.2488 (Qwen3-8B, top + loop), slower on SmolLM2 in every variant.
#: WriteConfig choices.
CLIP_SEARCHES: tuple[str, ...] = ("bisect", "top")
ROTATION_PRECISIONS: tuple[str, ...] = ("ieee", "tf32x3")


@dataclasses.dataclass(frozen=True)
class WriteConfig:
    """Launch knobs of oscar_write (the benchmark sweeps them; the defaults are the measured ones).

    num_warps: warps per program, None = write_warps(head_dim, new tokens). clip_search: "top" (remove the row
    maximum D - index times, two reductions per round; used on a side when that is <=
    CLIP_TOP_MAX_ROUNDS rounds, else bisect) or "bisect" (32 count steps per row): the same exact
    threshold (byte-identical on the H200), a speed choice. rotation_precision: the rotation dot's
    input precision, "ieee" (fp32 on the FMA pipe) or "tf32x3" (three TF32 tensor-core MMAs: about
    fp32 accuracy, not bit-identical: 1.4e-5 of the bytes differ on the H200; slower there with the
    refit loop). unroll_refit: the refit rounds unrolled (True) or a loop (False: same bytes, 255 ->
    128 registers at 8 / 2, D = 128). window_columns: output columns per window-copy program of a flagged launch
    (a captured decode step's first launch), None = WRITE_WINDOW_BLOCK_C (at most head_dim; same bytes).
    row_programs: an INT2-only launch (no window copies, no query) by row programs of one warp per token, KV head
    and side (triton_write_rows); None = where it has at most WRITE_ROWS_MAX_TOKENS new tokens and head_dim <=
    WRITE_ROWS_MAX_HEAD_DIM, True = at any count and head_dim, False = never (other launches: no effect). The same
    bytes as the 16-row programs (H200: bench/check_kernels_gpu.py --only write_rows).
    Defaults as measured (note above CLIP_SEARCHES).
    """

    num_warps: Optional[int] = None
    clip_search: str = "top"
    rotation_precision: str = "ieee"
    unroll_refit: bool = False
    window_columns: Optional[int] = None
    row_programs: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.window_columns is not None and (self.window_columns < 16
                                                or self.window_columns & (self.window_columns - 1)):
            raise ValueError(f"window_columns={self.window_columns}: a power of two >= 16 (tl.dot's N), or None.")
        if self.clip_search not in CLIP_SEARCHES:
            raise ValueError(f"clip_search={self.clip_search!r}: choose one of {CLIP_SEARCHES}.")
        if self.rotation_precision not in ROTATION_PRECISIONS:
            raise ValueError(f"rotation_precision={self.rotation_precision!r}: choose one of {ROTATION_PRECISIONS}.")


DEFAULT_WRITE = WriteConfig()


def window_columns(config: WriteConfig, head_dim: int) -> int:
    """Output columns per window-copy program of a flagged write launch (WriteConfig.window_columns)."""
    return min(head_dim, config.window_columns or WRITE_WINDOW_BLOCK_C)


def _clip_top(config: WriteConfig, head_dim: int, clip_index: int) -> bool:
    return config.clip_search == "top" and head_dim - clip_index <= CLIP_TOP_MAX_ROUNDS


#: Decode split-K sizing where no compiled kernel tells how many programs an SM holds (the
#: interpreter, CPU tensors) and the BF16 Triton baseline's target: programs per SM.
PROGRAMS_PER_SM: int = 16
#: SM limits of the residency estimate where torch does not report them (Hopper's), and the
#: registers-per-warp allocation unit.
SM_REGISTERS: int = 65536
SM_THREADS: int = 2048
SM_SHARED_BYTES: int = 233472
SM_MAX_PROGRAMS: int = 32
REGISTER_ALLOCATION_UNIT: int = 256
#: Schedulers per SM; each has a quarter of the register file and holds whole warps.
SM_PARTITIONS: int = 4
#: Shared memory the driver reserves per program (bytes).
DRIVER_SHARED_PER_PROGRAM: int = 1024
#: 2: H200, fused windows, 4K: B=1 0.0119 ms at 2 vs 0.0139 at 4 (Qwen3-8B geometry), B=8 equal.
MIN_TILES_PER_SPLIT: int = 2
#: gluon_decode's plans walk at least this many tiles per split: fewer, longer splits pay where 2-tile splits would
#: launch more programs than the memory needs. H200, graph replays (docs/decisions.md and "Session
#: 35"), ms at 2 / 3 tiles. Merges that are not small (session 34), SmolLM2 geometry: 4K B=8 0.0064-0.0065 /
#: 0.0063-0.0064, 4K B=16 0.0083 / 0.0079-0.0080, 8K B=8 0.0082 / 0.0074-0.0076; Qwen3-8B geometry: 8K B=2 0.0110 /
#: 0.0101-0.0102, 16K B=2 0.0155-0.0156 / 0.0128. Small merges (session 35), SmolLM2 geometry: 8K B=1 0.0058-0.0059 /
#: 0.0054-0.0055, 16K B=4 0.0080 / 0.0075-0.0076, 32K B=1 0.0068-0.0069 / 0.0063-0.0064, 32K B=2 0.0080-0.0081 /
#: 0.0074-0.0075. Plans of >= 3 tiles per split do not change.
GLUON_MIN_SPLIT_TILES: int = 3
#: The most splits per (request, KV head): it binds only where the pairs are few (one-wave count above it: SmolLM2
#: geometry, 3 KV heads, batch 1-2). H200, graph replays, Gluon splits (docs/decisions.md S19): SmolLM2 batch 1
#: 384 vs 256 splits 0.0126 / 0.0142 ms at 128K, 0.0092 / 0.0098 at 64K, equal at 32K (where two-tile splits cap
#: it at 256); batch 2 (264 one-wave splits): 256 vs 320 0.0117 / 0.0125 at 64K, 0.0175 / 0.0183 at 128K.
MAX_SPLITS: int = 384
#: AttentionConfig.beside_write: a decode launch with an INT2 write beside it on a side stream (a captured decode step,
#: attention/step.layer_step), sized for max_seq_len > BESIDE_WRITE_MIN_SEQ_LEN at batch <= BESIDE_WRITE_MAX_BATCH,
#: takes ceil(BESIDE_WRITE_SPLIT_EIGHTHS / 8) of its plan's splits, leaving the write's programs room in the one-wave
#: grid, whose end waits for its slowest SM. H200, Qwen3-8B attention x36 in graphs, replay alone per step, ms with /
#: without the room (docs/decisions.md; side writes by row programs reading the rotated rows):
#: 128K B=1 1.273-1.278 / 1.422-1.428, 64K B=1 0.905 / 0.975-0.978; B=2 2.00 / 1.93 (128K), 1.405 / 1.329 (64K);
#: B=4 3.38 / 3.21, 2.06 / 2.03; 128K B=8 6.37-6.39 / 6.00-6.07. (Session 40's 16-row side writes, 11 us each,
#: gained at B=8 too: 7.41 -> 6.52.) Shorter contexts (32K: equal at B=1 / 8) and larger batches keep every split.
BESIDE_WRITE_SPLIT_EIGHTHS: int = 7
BESIDE_WRITE_MIN_SEQ_LEN: int = 65536
BESIDE_WRITE_MAX_BATCH: int = 1
#: A split walking fewer tiles than this is "short": its window programs, trailing as a second wave,
#: then cost as much as the split itself, so decode_splits makes room for them in the first wave
#: (H200, docs/decisions.md V14: Qwen3-8B 4K B=8 24 -> 12 splits, 0.0237 -> 0.0197 ms).
SHORT_SPLIT_TILES: int = 4
#: Splits of SHORT_SPLIT_TILES up to WINDOW_ROOM_SPLIT_TILES tiles make the same room for the window programs, but only
#: where that drops at most a quarter of them. H200, graph replays, blocks of 64, ms at 4 / 8 (docs/decisions.md):
#: SmolLM2 32K B=8 (85 -> 73 splits) 0.0154-0.0155 / 0.0148, 16K B=16 (42 -> 36) 0.0155-0.0157 /
#: 0.0149-0.0150, Qwen3-8B 16K B=8 (32 -> 26) 0.0355 / 0.0350; without the quarter limit SmolLM2 4K B=64 (10 -> 5)
#: 0.0179 / 0.0186. Not in small-merge plans, whose split count is capped below the SM's residency (the windows fit
#: anyway): Qwen3-8B B=1 32K 127 -> 102 splits 4% faster but 64K 128 -> 114 2.4% slower. gluon_decode's plans only
#: (int2_split_kernel's window programs, of 16-32 positions, were not measured with it).
WINDOW_ROOM_SPLIT_TILES: int = 8
#: Where the merge of the partials has fewer programs than the GPU has SMs (batch 1: one per query
#: head and channel block), its time grows with the split count, so the splits are sized for at most
#: this many programs per SM even when more are resident (H200, docs/decisions.md V22: Qwen3-8B
#: B=1, blocks of 64 whose kernel holds 16 per SM: 32K 0.0172 ms at 251 splits, 0.0155 at 185).
SMALL_MERGE_PROGRAMS_PER_SM: int = 12
#: The same where gluon_decode's staged tiles are copied by TMA (no registers or issue slots held by the copies, so
#: fewer, longer splits keep the memory as busy; H200, docs/decisions.md: Qwen3-8B B=1 64K
#: 0.0174-0.0178 -> 0.0169-0.0170 ms at 128 splits instead of 170, 128K 0.0276-0.0277 -> 0.0274). Where TMA would
#: copy them (tma_copy_pays), small-merge plans always stage their tiles and walk >= STAGED_MIN_SPLIT_TILES tiles per
#: split (docs/decisions.md: Qwen3-8B B=1, ms unstaged splits of 2-3 tiles / staged TMA splits of 4:
#: 8K 0.0095 / 0.0084-0.0085, 16K 0.0107 / 0.0098-0.0099, 24K 0.0122-0.0123 / 0.0107-0.0108, 32K equal, 48K on equal).
TMA_SMALL_MERGE_PROGRAMS_PER_SM: int = 8
#: AttentionConfig.long_splits (opt-in): the grid holds LONG_SPLIT_PROGRAMS_PER_SM split programs per SM, of which a
#: (request, KV head) pair uses all only where the one-wave split count would leave each split >= LONG_SPLIT_TILES
#: tiles. H200, Qwen3-8B (int8 keys), graph replays with TMA loads (docs/decisions.md K1, session 14): 1-4%
#: faster at >= 64K and B >= 32, 4-5% slower at 64K-128K and B 8-16, 4K unchanged: not a default.
LONG_SPLIT_TILES: int = 64
LONG_SPLIT_PROGRAMS_PER_SM: int = 32
#: gluon_decode's splits at head_dim >= TWO_WAVE_MIN_HEAD_DIM with more (request, KV head) pairs than SMs are sized
#: for two waves of resident programs, not one (AttentionConfig.programs_per_sm None). H200, graph replays, Qwen3-8B
#: geometry, blocks of 64, ms at one wave / two (docs/decisions.md): B=64 (4 / 8 splits) 16K 0.2016 /
#: 0.1969, 32K 0.3644 / 0.3522, 64K 0.6922 / 0.6736, 128K 1.4174 / 1.3412; B=32 (8 / 16) 16K 0.1041 / 0.1038, 32K
#: 0.1914 / 0.1876, 64K 0.3542 / 0.3420, 128K 0.6804 / 0.6593. Not at head_dim 64 (SmolLM2 geometry B=32 / 64,
#: <= 1.5 pairs per SM: 0-5% slower), nor with fewer pairs than SMs (Qwen3-8B B=8: one wave of 33 splits fastest),
#: nor where the two-wave splits would walk fewer than TWO_WAVE_MIN_TILES tiles (4K B=32 / 64, 4 and 8 tiles:
#: 0.0448 / 0.0478 and 0.0810 / 0.0853 ms; 16K B=32, 16 tiles: equal).
TWO_WAVE_MIN_HEAD_DIM: int = 128
TWO_WAVE_MIN_TILES: int = 32
#: Default decode tile (cached positions per program step; H200 tune 2026-11-29 session 3:
#: 64 beats 128 for D = 64 and D = 128 once the INT2 splits run on one warp).
DECODE_BLOCK_T: int = 64
#: Programmatic dependent launch (griddepcontrol) exists from this compute capability (Hopper).
PDL_MIN_CAPABILITY: tuple[int, int] = (9, 0)
#: TMA tile-load pipeline depth of a decode launch captured in a CUDA graph (AttentionConfig.cuda_graph with
#: tma_stages None), and where it pays (tma_pays; H200, docs/decisions.md V26, H2, "Session 16"): with the
#: int8-key split kernel where each (request, KV head) pair has GRAPH_TMA_SMS_PER_PAIR SMs or more (batch 1:
#: 1-8% faster; batch 4-16 at >= 16K 2-9% slower since V38), and at head_dim >= GRAPH_TMA_MIN_HEAD_DIM also
#: for plans up to GRAPH_TMA_SHORT_CONTEXT positions with at most one pair per SM (4K batch 8-16: 3-5% faster).
GRAPH_TMA_STAGES: int = 3
GRAPH_TMA_MIN_HEAD_DIM: int = 128
GRAPH_TMA_SMS_PER_PAIR: int = 16
GRAPH_TMA_SHORT_CONTEXT: int = 4096
#: Window tile of the fused decode launch (positions per window program). 32, not the INT2 tile (64):
#: a 64-position BF16 tile raised the whole kernel to 196 registers (offline SASS, Triton 3.6), 32 keeps
#: it at the split loop's own 167.
WINDOW_BLOCK_T: int = 32
#: Wider window tiles (positions per window program) where they cost no registers and the windows are much of the
#: work: head_dim <= WIDE_WINDOW_MAX_HEAD_DIM (at 64 the bf16-key kernel kept 128 registers with either tile, offline
#: SASS; since V39/V40's int8 keys there 96 / 112; at 128 the wide tile takes the kernel to 156), a launch sized
#: for contexts <= WIDE_WINDOW_MAX_CONTEXT (there the 320 window positions are ~1/3 of the bytes) and (request,
#: KV head) pairs >= SMs x WIDE_WINDOW_MIN_PAIRS_PER_SM (half as many window programs then leave room in the wave;
#: with fewer pairs the longer window program sets the time).
#: H200, SmolLM2-135M geometry, blocks of 64, graph replays, window tiles 32 / 64 (docs/decisions.md V35): 4K
#: B=24 / 32 / 64 -3..-8% / -8% / -3%, B=8 / 16 +4% / +2% (hence the pair floor); 8K B=24 / 32 / 64 +6% / +1% / -5%
#: and 16K-128K equal or +1% (hence the context cap). Re-tuned with int8 keys (session 16, docs/decisions.md):
#: single cases +-4-13% either way, rule unchanged.
WIDE_WINDOW_BLOCK_T: int = 64
WIDE_WINDOW_MAX_HEAD_DIM: int = 64
WIDE_WINDOW_MAX_CONTEXT: int = 4096
WIDE_WINDOW_MIN_PAIRS_PER_SM: float = 0.5
#: Channels per merge program (min(head_dim, MERGE_BLOCK_D)). H200 tune 2026-11-29 20:20 UTC
#: (docs/perf/tune_h200_w2_merge_window.json): 32 beat one program per head in 17 of 18 cases, most at batch 1
#: and long contexts (Qwen3-8B 32K B=1 0.0230 -> 0.0205 ms), where the per-head [partials, D] tile spilled.
MERGE_BLOCK_D: int = 32
#: Warps of a merge program whose [next_pow2(partials), channels] fp32 tile holds at most MERGE_ONE_WARP_VALUES
#: values (128 per lane): one, so the reductions over the partials stay in the warp; MERGE_WARPS above that, where
#: one warp would spill. H200, 2026-12-01 (docs/decisions.md, graph replays, ms at 4 / 1 warp):
#: Qwen3-8B 4K B=8 0.0177 / 0.0167-0.0170, SmolLM2 4K B=8 0.0073-0.0074 / 0.0071-0.0073, 32K B=8 0.0182 /
#: 0.0177-0.0178; one warp at 256 partials: SmolLM2 32K B=1 0.0077 / 0.0389, Qwen3-8B 32K B=1 0.0135 / 0.0147.
MERGE_ONE_WARP_VALUES: int = 4096
MERGE_WARPS: int = 4
#: L2 prefetch distance (tiles) of the INT2 split programs on a GPU. H200, Qwen3-8B geometry, 32K,
#: int8 keys, distance 0/1/2/3: B=8 0.1130/0.0986/0.1002/0.1092 ms, B=32 0.3794/0.3213/0.3268/0.3454
#: (docs/decisions.md V8).
PREFETCH_TILES: int = 1
#: Tiles of a split program asked of L2 inside the query's prologue (plain and TMA loads, PTX unpack), so that the
#: int8 rounding of the query runs while the first tile's DRAM read is in flight. H200, graph replays, blocks of 64
#: (session 17, docs/decisions.md V43), ms with / without: SmolLM2 32K B=8 0.0206 / 0.0216, 4K B=64 0.0281 /
#: 0.0292; Qwen3-8B within the run-to-run noise.
FIRST_PREFETCH_TILES: int = 1
#: MMA rows per prefill program (query tokens x padded GQA group), AttentionConfig.prefill_rows.
PREFILL_ROWS: int = 64
#: Largest prefill tile on a GPU. With Triton 3.6 on the H200, prefill tiles of 64 positions compile to
#: warpgroup MMAs that read past their shared-memory operand (compute-sanitizer: "Invalid __shared__
#: read of size 512 bytes" in attention_kernel's tl.dot; illegal-address crashes at SmolLM2 and
#: Qwen3-8B geometry; docs/decisions.md P2), so oscar_prefill refuses them there.
PREFILL_MAX_BLOCK_T: int = 32
#: Automatic prefill_int2_apart: the pure INT2 prefix gets its own launch when the prefix is at least this
#: many times the windows plus the chunk (and the one-launch grid overflows a wave). H200, served read,
#: docs/decisions.md P2: Qwen3-8B 32K prefix 1.16-1.26x faster apart (ratios 13-39), 4K prefix
#: 0.76-1.05x (ratios 0.9-4.3).
PREFILL_APART_PREFIX_RATIO: int = 8
#: Automatic prefill split-K (AttentionConfig.prefill_splits None): programs per query tile when the
#: cached prefix is longer than the windows and the unsplit launch has fewer programs than the GPU has
#: SMs, else 1. H200, docs/decisions.md P2: SmolLM2 geometry, 512-token chunk, batch 1 (96
#: programs): 4 splits 1.56x (4K prefix) and 1.74x (32K) faster; with >= 256 programs 4 splits were
#: 0.6-1.1x; with no cached prefix 0.63x (nothing to split).
PREFILL_AUTO_SPLITS: int = 4
#: Register cap of gluon_decode's kernel (AttentionConfig.gluon_splits): its window path would take it to 162 at
#: head_dim 128 (Triton 3.6, offline SASS) and cost the split programs a quarter of their residency; at 128 (the
#: Triton split kernel's count) the window path spills 40 B and the split loop is unchanged.
GLUON_MAX_REGISTERS: int = 128
#: AttentionConfig.gluon_copy_stages values besides 0: shared-memory stages of gluon_decode's cp.async tile copies
#: (3 stages at head_dim 128 take 13.5 KB per program, 15 programs per SM of the H200's 227 KB).
GLUON_COPY_STAGES: tuple[int, ...] = (2, 3)
#: AttentionConfig.gluon_copy_tma None: staged tiles are copied by TMA from this head_dim on (3 boxes per tile, 1-5%
#: faster at head_dim 128 from 32K; at 64, 1-5% slower from 32K at batch >= 8: docs/decisions.md).
TMA_COPY_MIN_HEAD_DIM: int = 128
#: AttentionConfig.gluon_copy_stages None: GLUON_AUTO_COPY_STAGES where gluon_decode runs and staging pays
#: (staging_pays): at head_dim <= STAGED_MAX_HEAD_DIM always, above it where the plan holds at least
#: STAGED_MIN_POSITIONS_PER_SM cached positions of (request, KV head) pairs per SM (the bandwidth-bound launches).
#: H200, graph replays, blocks of 64, ms at 0 / 2 / 3 stages (docs/decisions.md, S1): SmolLM2
#: geometry (head_dim 64) 3-17% faster at every context (4K-128K) and batch (1-64), e.g. 4K B=1 0.0059 / 0.0049 /
#: 0.0049, 128K B=64 0.3307 / 0.2900 / 0.2901; Qwen3-8B geometry (head_dim 128) 4-5% faster at >= 32K B >= 8 (32K
#: B=32 0.2049 / 0.1967 / 0.2221, 128K B=64 1.4163 / 1.3482 / 1.7566), equal at 128K B=1 and 4K B=32/64 (7.9K /
#: 15.9K positions per SM), 15% slower at 32K B=1 (0.0134 / 0.0154 / 0.0148; 2K positions per SM). Three stages
#: cost residency at head_dim 128 (fewer splits) and gain nothing at 64.
GLUON_AUTO_COPY_STAGES: int = 2
STAGED_MAX_HEAD_DIM: int = 64
STAGED_MIN_POSITIONS_PER_SM: int = 8192
#: Plans with a small merge (fewer merge programs than SMs: batch 1, splits sized for SMALL_MERGE_PROGRAMS_PER_SM,
#: below the resident count) also stage at head_dim 128 where each split walks >= STAGED_MIN_SPLIT_TILES tiles: with
#: ~11 programs per SM, tiles copied one ahead hide the DRAM latency the L2 prefetch leaves. H200, graph replays,
#: Qwen3-8B geometry B=1, ms unstaged / staged (docs/decisions.md): 32K (3 tiles per split) 0.0127 /
#: 0.0133, 40K (4) 0.0147 / 0.0146, 48K (4) 0.0158 / 0.0150, 64K (6) 0.0192 / 0.0180, 96K (8) 0.0248 / 0.0228,
#: 128K (11) 0.0306 / 0.0276.
STAGED_MIN_SPLIT_TILES: int = 4
#: AttentionConfig.fold_tiles None with gluon_f16_values: the fp16 V operand's BIAS (1024) is 8x bf16's, so the
#: tensor cores' rounding of the BIAS-sized sums toward zero costs 8x more per add; folding every 2 tiles limits it
#: (H200, bench/split_error.py, 120000 positions in one split: 2.3e-3 at fold 2, 7.7e-3 at 8, bf16 1.5e-3; offline
#: SASS: the split loop 461 / 732 instructions per tile at head_dim 64 / 128 against 497 / 785 in bf16, Triton 3.6).
GLUON_F16_FOLD_TILES: int = 2
#: AttentionConfig.gluon_window_prefetch None: gluon_decode's window programs ask L2 for their BF16 V rows up front
#: where they number at most this many per SM (batch 1: their latency chain is the kernel's tail; with many, the
#: extra L2 requests compete with the splits' streams). H200, graph replays (docs/decisions.md,
#: V50): Qwen3-8B batch 1 16K 0.0125 -> 0.0110 ms, 32K 0.0139 -> 0.0128, SmolLM2 16K / 32K 2-3% faster, 64K / 128K
#: equal; on at batch >= 8 up to 4% slower (Qwen3-8B 128K B=64 1.198 -> 1.246 ms).
WINDOW_PREFETCH_PROGRAMS_PER_SM: int = 1
#: Warps per INT2 split program (one warp: no cross-warp reductions or barriers per tile;
#: H200 tune, docs/decisions.md V5).
SPLIT_WARPS: int = 1


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch knobs of the attention kernel (the benchmark sweeps them).

    block_t: cached positions per tile, None = DECODE_BLOCK_T; num_warps: warps of the window
    and prefill programs; split_warps: warps of the pure-INT2 split programs; unpack: UNPACK_PTX / UNPACK_PORTABLE,
    None = PTX on CUDA, portable under the interpreter; num_splits: decode split-K count, None =
    sized from max_seq_len and the SM count; tokens_on_m: decode runs its pure-INT2 splits
    in triton_decode_int2 (tokens on the MMA M side; one group per row, G = D) instead of
    the general kernel (query rows on M, padded to 16). Same function, different speed.
    programs_per_sm: decode split-K sizing target when num_splits is None: the split programs number
    at most programs_per_sm per SM (rounded down to whole splits per (request, KV head), so a multiple
    of the SM's capacity fills whole waves). None = as many as one SM holds at once (from the compiled
    split kernel's registers, warps and shared memory: one full wave, docs/decisions.md V10; two waves for
    gluon_decode at head_dim >= TWO_WAVE_MIN_HEAD_DIM with more (request, KV head) pairs than SMs); either way
    the count is then cut to the fewest splits at the same tiles per split for max_seq_len (decode_splits);
    min_tiles_per_split: the fewest tiles one split walks (caps the split count at short contexts; at least
    STAGED_MIN_SPLIT_TILES in batch-1 plans whose staged tiles TMA copies, TMA_SMALL_MERGE_PROGRAMS_PER_SM, and
    GLUON_MIN_SPLIT_TILES in gluon_decode's other plans);
    int8_keys: the INT2 split programs compute the key dot as an int8 MMA with the query rounded
    to int8 per head row (head_dim >= INT8_MMA_MIN_HEAD_DIM, 64). None = on where it applies (INT2 split kernel,
    head_dim >= 64, PTX unpack, i.e. a CUDA GPU), off otherwise (docs/decisions.md V7-V8, V39: 1.1-1.2x on
    the H200; scripts/int8_query_error.py: the rounding adds 1.6% of the INT2 key error in amplitude);
    max_registers: Triton's maxnreg for the INT2 split programs (None = compiler's choice, GLUON_MAX_REGISTERS
    for gluon_decode's kernel; fewer registers let more programs share an SM);
    prefetch: the INT2 split programs ask L2 for the tile this many steps ahead (prefetch.global.L2;
    0 = off; needs the PTX unpack mode, i.e. a CUDA GPU). A hint: results do not change. None =
    PREFETCH_TILES with the PTX unpack and plain tile loads, 0 otherwise (with TMA tile loads too); the hint
    for a split's first tile, issued inside its query prologue (FIRST_PREFETCH_TILES), does not depend on it;
    window_block_t: positions per window program of the INT2 split launch (a power of two >= 16;
    None = min(block_t, WINDOW_BLOCK_T), or WIDE_WINDOW_BLOCK_T at small head_dim, short contexts and many
    (request, KV head) pairs); merge_block_d: channels per merge program (a power of two
    >= 16 dividing head_dim; None = min(head_dim, MERGE_BLOCK_D)); windows_first: dispatch the
    window-tile programs of the INT2 split launch before its split programs. None = first when they
    number at most one per SM (batch 1: they then start beside the splits instead of trailing them as
    a last short wave; docs/decisions.md V10), after the splits otherwise; full_tiles: the INT2
    split programs walk whole tiles only, with no masks (fewer instructions per tile), and the partial
    INT2 tiles at the two edges of the range go to the window programs (docs/decisions.md V12:
    5-7% faster at Qwen3-8B geometry >= 32K on the H200). None = on wherever the INT2 split kernel
    runs (True with the general kernel is an error); prefill_rows: MMA rows per prefill program
    (query tokens x the GQA group padded to a power of two; a power of two >= 16); prefill_splits:
    programs per prefill query tile, each taking a share of the pure INT2 prefix (split-K, merged
    as in decode; 1 = one program walks the whole prefix; more lets a small batch fill the GPU.
    None = PREFILL_AUTO_SPLITS when oscar_prefill's max_seq_len implies a cached prefix longer than the
    windows and the unsplit launch has fewer programs than the GPU has SMs, 1 otherwise;
    docs/decisions.md P2); prefill_int2_apart: the pure INT2 prefix runs in its own
    launch and compile (no window or chunk loops: fewer registers, more programs per SM), the windows
    and the chunk in a second, merged; None = apart when oscar_prefill's max_seq_len implies a prefix of
    at least PREFILL_APART_PREFIX_RATIO x (sink + recent + chunk) and the one-launch grid overflows one
    wave (docs/decisions.md P2); merge_pdl: the merge of the partials is launched with programmatic
    dependent launch (Hopper and later): the decode split programs let it start as they begin and it
    waits (griddepcontrol.wait) for their kernel to finish, so its launch overlaps their tail instead of
    following it; likewise the merge lets the next launch (the output rotation, oscar_rotate) start early
    (docs/decisions.md H5). None = on for GPUs of compute capability >= 9.0 (the only ones with griddepcontrol),
    off elsewhere and under the interpreter; True on an older GPU raises (docs/decisions.md V19:
    up to 8% faster at batch 1 and small batches, the same elsewhere); tma_stages: > 0 = the whole-tile
    INT2 splits load their tiles by tensor-memory-accelerator copies (tensor descriptors over the cache's
    planes, built once per cache) in a software pipeline this many stages deep, and no L2 prefetch unless
    prefetch is given; needs full_tiles, cache blocks that hold whole tiles (block_size a multiple of
    block_t) and a contiguous cache. 0 = plain loads. On the H200 (since V38) 3 stages are 1-8% faster at
    batch 1 in CUDA-graph replays (head_dim 64 with int8 keys too) and at 4K batch 8-16 (head_dim 128), 2-9% slower
    at batch 4-16 from 16K on and with bf16 keys at head_dim 64; but Triton encodes the six descriptors on the host
    at every launch (tens of us), more than the kernel saves where the launch is not graph-captured
    (docs/decisions.md V26, "Session 16"). None (the default): GRAPH_TMA_STAGES for a cuda_graph launch where
    TMA applies (whole tiles in a cache block, compute capability >= 9.0) and pays (tma_pays), else 0;
    long_splits (opt-in; timed on the H200: +-5%, LONG_SPLIT_TILES):
    with the int8-key split kernel and a merge of at least as many programs as SMs (not batch 1), size the grid
    for LONG_SPLIT_PROGRAMS_PER_SM split programs per SM where
    max_seq_len's splits would be long, and let each (request, KV head) use them all only where its own context
    makes its one-wave splits walk >= LONG_SPLIT_TILES tiles (so a graph captured for max_model_len keeps one
    wave's splits at short contexts; docs/decisions.md K1); cuda_graph: the launch will
    be captured into a CUDA graph and replayed without host work (the vLLM backend's full decode graphs
    and the benchmark's replays; its warm-up must use the same config, so that nothing compiles during
    the capture); gluon_splits: the int8-key split programs and the window programs run as gluon_decode's Gluon
    kernel instead of int2_split_kernel (every INT2 operand built in registers; window tiles of 64). It applies
    (gluon_splits_apply) on a CUDA GPU of compute capability >= 8.0 with int8 keys, whole tiles of 64 in cache blocks
    of 64, one fp16 scale group per row, GQA groups <= 4 and head_dim 64 or 128. None (the default since session 19,
    after the served step's check and the kernel checks passed with it on the H200) = where it applies and gluon_pays
    (no knob of int2_split_kernel's splits set, and not where that kernel would use TMA for a short context);
    False = int2_split_kernel always; True = where it applies, else raises. H200, graph replays, bf16 queries
    (docs/decisions.md G2): None is 5-15% faster from 32K on and at 4K batch 64 (Qwen3-8B and SmolLM2 geometry);
    gluon_copy_stages: 0 = gluon_decode's split programs load each tile into registers after an L2 prefetch;
    GLUON_COPY_STAGES (2 or 3) = they copy tiles that many minus one ahead into shared memory (cp.async) and read
    them from there (needs gluon_decode's kernel, so it runs that kernel wherever it applies); None (the default) =
    GLUON_AUTO_COPY_STAGES where gluon_decode runs anyway and staging_pays (head_dim 64, or bandwidth-bound plans at
    head_dim 128, or batch-1 plans whose splits walk >= 4 tiles), else 0. H200 (docs/decisions.md): 3-17% faster at
    head_dim 64, 4-5% at head_dim 128 from 32K and batch 8 on, 5-10% at head_dim 128
    batch 1 from 48K on, 4-5% slower at head_dim 128 batch 1 16K-32K (hence the rule); fold_tiles: the INT2 split
    programs move the BIAS part of their V sums out of the tensor-core accumulators every this many tiles (a power of
    two; None = triton_common.FOLD_TILES, 8, or GLUON_F16_FOLD_TILES with gluon_f16_values): longer periods cost
    fewer instructions and lose more of a long split's accuracy (the tensor cores round their accumulation toward
    zero; docs/decisions.md F1); gluon_f16_values: gluon_decode's split programs build the V operand and the
    weights in fp16 (gluon_decode.F16_VALUES: ~7% fewer instructions per tile; a BIAS of 1024 instead of 128, hence
    the shorter default fold period); True = wherever gluon_decode's kernel applies (it then runs that kernel);
    None (the default) = wherever gluon_decode runs anyway; False = bf16. H200, graph replays, blocks of 64
    (docs/decisions.md): Qwen3-8B geometry 2-6% faster from 32K (32K B=8 0.0560 ->
    0.0528 ms, 128K B=64 1.369 -> 1.318), equal at 4K; SmolLM2 (head_dim 64) 1-4% faster at >= 32K batch >= 8 since
    the BIAS fold stays in each lane (32K B=64 0.0797 -> 0.0768, 128K B=64 0.2827 -> 0.2718; batch 1 and 4K equal).
    The kernel's error against float64 at 120000 positions in one split: 2.3e-3 / 2.8e-3 (Qwen3-8B / SmolLM2
    geometry) against bf16's 1.5e-3 / 1.7e-3 (bench/split_error.py); gluon_window_prefetch: gluon_decode's window
    programs ask L2 for their BF16 V rows before computing their logits (a hint: results do not change); None (the
    default) = where the window programs number at most WINDOW_PREFETCH_PROGRAMS_PER_SM per SM (batch 1);
    gluon_copy_tma: gluon_decode's staged split programs copy each tile by TMA (three boxes, two at head_dim 64, on
    one mbarrier per stage: gluon_decode.COPY_TMA) instead of cp.async; True needs staged tiles (gluon_copy_stages
    >= 2, or staged by default) and a contiguous cache; None (the default) = where the tiles are staged at head_dim >=
    TMA_COPY_MIN_HEAD_DIM in a launch captured in a CUDA graph (cuda_graph) on compute capability >= 9.0: the host
    encodes the tensor descriptors at every launch, which only a graph's replays skip. H200, graph replays
    (docs/decisions.md): Qwen3-8B geometry 1-5% faster from 32K (32K B=8 0.0541 -> 0.0517 ms, 128K
    B=1 0.0277 -> 0.0272), SmolLM2 geometry (head_dim 64) 1-5% slower from 32K at batch >= 8; False = cp.async;
    beside_write: the launch runs beside a side-stream INT2 write (a captured decode step): the INT2 split kernels
    take BESIDE_WRITE_SPLIT_EIGHTHS / 8 of their plan's splits (rules' or measured; not an explicit num_splits)
    where max_seq_len > BESIDE_WRITE_MIN_SEQ_LEN and batch <= BESIDE_WRITE_MAX_BATCH (what was measured);
    prefill_flash: oscar_prefill(chunk_from_cache=True) runs as flash_prefill (the rows of each request gathered
    into a far and a near range, two PyTorch FlashAttention varlen launches, a log-sum-exp merge) instead of the
    Triton prefill kernel; the same read rule. None (the default) = where flash_plan.flash_unavailable finds no
    reason against it (a CUDA GPU of compute capability >= 8.0, head_dim a multiple of 8 up to 256, a recent window,
    a torch built with FlashAttention) and the call's size (flash_plan.CallSize: exact from the step's
    PrefillPlan, else bounded by query rows x max_seq_len, query rows squared when max_seq_len is not given) has
    flash_plan.FLASH_PREFILL_MIN_WORK of work and FLASH_PREFILL_MIN_PROGRAMS FlashAttention programs
    (docs/PERFORMANCE.md "Chunked prefill" has the measured ratios on both sides), unless its gathered rows could
    exceed FLASH_PREFILL_MAX_WORKSPACE (then the Triton kernel, logged and counted); True = wherever flash_unavailable
    finds no reason, whatever the work and workspace, else raises; False = the Triton kernel. The chunk read from its
    new rows (chunk_from_cache False) always runs the Triton kernel;
    prefill_flash_split: where flash_prefill runs, it cuts the far positions every chunk row sees into key segments
    (flash_plan.KeySplit) until its launch has FLASH_SPLIT_PROGRAMS_PER_SM programs per SM (segments of >=
    FLASH_SPLIT_MIN_KEYS positions), and the default then routes without the program floor. None (the default) =
    where flash_plan.CallSize.split_pays (few programs, each over a long prefix, full query tiles; needs the step's
    plan; on an H100 1.08-1.40x faster in 10 of the 12 few-row cells it takes, 0.88x in one); True = on every
    flash_prefill call (on an H100, over 48 cells of 64-512 rows x 1-2 requests at 4K-32K
    prefixes, up to 1.5x faster than either unsplit path in 15, all at 16K-32K, and up to 1.9x slower in 19, every
    4K prefix included, docs/PERFORMANCE.md "Chunked prefill"); False = never.
    """

    block_t: Optional[int] = None
    num_warps: int = 2
    split_warps: int = SPLIT_WARPS
    num_stages: int = 1
    unpack: Optional[int] = None
    num_splits: Optional[int] = None
    tokens_on_m: bool = True
    programs_per_sm: Optional[int] = None
    min_tiles_per_split: int = MIN_TILES_PER_SPLIT
    int8_keys: Optional[bool] = None
    max_registers: Optional[int] = None
    prefetch: Optional[int] = None
    window_block_t: Optional[int] = None
    merge_block_d: Optional[int] = None
    windows_first: Optional[bool] = None
    full_tiles: Optional[bool] = None
    prefill_rows: int = PREFILL_ROWS
    prefill_splits: Optional[int] = None
    prefill_int2_apart: Optional[bool] = None
    merge_pdl: Optional[bool] = None
    tma_stages: Optional[int] = None
    long_splits: bool = False
    cuda_graph: bool = False
    gluon_splits: Optional[bool] = None
    gluon_copy_stages: Optional[int] = None
    fold_tiles: Optional[int] = None
    gluon_f16_values: Optional[bool] = None
    gluon_window_prefetch: Optional[bool] = None
    gluon_copy_tma: Optional[bool] = None
    beside_write: bool = False
    prefill_flash: Optional[bool] = None
    prefill_flash_split: Optional[bool] = None


DEFAULT_DECODE = AttentionConfig()
DEFAULT_PREFILL = AttentionConfig(block_t=32, num_warps=4, num_stages=1)


def _interpreting() -> bool:
    """True when the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(attention_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200) for CPU tensors, so that splits are sized alike."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _check_triton_layout(layout: PageLayout) -> None:
    d, g = layout.head_dim, layout.group_size
    if d < MIN_TRITON_HEAD_DIM:
        raise ValueError(f"the Triton kernels need head_dim >= {MIN_TRITON_HEAD_DIM}; got {d}.")
    if g not in (d, d // 2, d // 4):
        raise ValueError(f"the Triton kernels support group_size in {{{d}, {d // 2}, {d // 4}}} for head_dim {d}; "
                         f"got {g}.")


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride 1); got strides {t.stride()}.")


def _tile_descriptors(int2_cache: torch.Tensor, layout: PageLayout, block_t: int) -> list:
    """Tensor descriptors of the six planes of a contiguous [num_blocks, Hkv, region] uint8 cache, in PLANES
    order, for int2_split_kernel's TMA loads: codes as [regions, block_size, width] (K as uint8, V as int16
    byte pairs), scales and offsets as [regions, block_size] (one group per row), each read in boxes of
    one tile (block_t positions of one region)."""
    flat = int2_cache.view(-1)
    regions = int2_cache.shape[0] * int2_cache.shape[1]
    region, bs, width = layout.head_region_bytes, layout.block_size, layout.code_bytes
    offsets = _plane_offsets(layout)
    pairs = flat[offsets["V_CODES"]:].view(torch.int16)
    descriptors = [TensorDescriptor(flat[offsets["K_CODES"]:], [regions, bs, width], [region, width, 1],
                                    [1, block_t, width]),
                   TensorDescriptor(pairs, [regions, bs, width // 2], [region // 2, width // 2, 1],
                                    [1, block_t, width // 2])]
    entry = layout.param_bytes
    for plane in ("K_SCALE", "K_ZERO", "V_SCALE", "V_ZERO"):
        values = flat[offsets[plane]:].view(layout.scale_dtype)
        descriptors.append(TensorDescriptor(values, [regions, bs], [region // entry, 1], [1, block_t]))
    return descriptors


@functools.lru_cache(maxsize=None)
def prefill_config(flash: Optional[bool]) -> AttentionConfig:
    """DEFAULT_PREFILL with prefill_flash = flash (built once per value)."""
    return dataclasses.replace(DEFAULT_PREFILL, prefill_flash=flash)


@functools.lru_cache(maxsize=None)
def decode_config(int8_keys: Optional[bool], cuda_graph: bool, beside_write: bool = False) -> AttentionConfig:
    """DEFAULT_DECODE with these fields (one object per combination: built once, not per decode call)."""
    return dataclasses.replace(DEFAULT_DECODE, int8_keys=int8_keys, cuda_graph=cuda_graph, beside_write=beside_write)


@functools.lru_cache(maxsize=None)
def _plane_offsets(layout: PageLayout) -> dict[str, int]:
    return {
        "K_CODES": layout.plane_offset("k_codes"),
        "V_CODES": layout.plane_offset("v_codes"),
        "K_SCALE": layout.plane_offset("k_scale"),
        "K_ZERO": layout.plane_offset("k_offset"),
        "V_SCALE": layout.plane_offset("v_scale"),
        "V_ZERO": layout.plane_offset("v_offset"),
    }


def oscar_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_rotation: torch.Tensor,
    v_rotation: Optional[torch.Tensor],
    clip_k: float,
    clip_v: float,
    int2_cache: torch.Tensor,
    layout: PageLayout,
    slot_mapping: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_slot_mapping: torch.Tensor,
    value_prerotated: bool = False,
    refit_iterations: RefitIterations = 0,
    refit_floor: tuple[bool, bool] = REFIT_SCALE_FLOOR,
    config: WriteConfig = DEFAULT_WRITE,
    store_window: bool = True,
    int2: str = "always",
    flag: Optional[torch.Tensor] = None,
    query: Optional[torch.Tensor] = None,
    rotated_out: Optional[torch.Tensor] = None,
    rotated: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """One launch: rotate, clip, quantize (+ grid refit), pack K and V; copy rotated rows into windows.

    Arguments as torch_ops.oscar_write, plus config (launch knobs, WriteConfig) and the parts this launch
    writes (triton_write's module docstring): store_window (the BF16 window copies) and int2 (the INT2
    part: "always", "never", "if_flag" = where the int32 flag [1] on the device is non-zero, "unless_flag"
    = where it is 0). Rotations are used in float32 (converted if not). query: [N, Hq, D] rows of the same
    tokens (Hq a multiple of Hkv, unit stride on D): also returns q_rot [N, Hq, D] float32 = query @ R_K per
    KV head, as oscar_rotate computes it (same tiles and precision), from the same launch where the rows are
    decode-sized (N x Hq / Hkv <= ROTATE_SMALL_ROWS), else from an oscar_rotate launch after the write.
    rotated_out: a flagged launch with window copies (a captured decode step's first launch) also stores every row's
    rotated K and V, fp32 [N, Hkv, 2, D] (K at [:, :, 0], V at [:, :, 1]; contiguous); rotated: an INT2-only launch
    by row programs (reads_rotated_rows) reads them from there instead of rotating again (the same bits).
    """
    q_rot = None
    if query is not None:
        check_write_query(query, key, k_rotation)
        if query.shape[0] * (query.shape[1] // key.shape[1]) > ROTATE_SMALL_ROWS:
            # Prefill-sized: the rotation's programs would run at the write kernel's register count and
            # occupancy, and one launch more costs little beside a chunk's GPU time.
            oscar_write(key, value, k_rotation, v_rotation, clip_k, clip_v, int2_cache, layout, slot_mapping, window_k,
                        window_v, window_slot_mapping, value_prerotated, refit_iterations, refit_floor, config,
                        store_window, int2, flag)
            return oscar_rotate(query, k_rotation)
        _check_last_dim_contiguous(query=query)
        q_rot = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    if int2 not in INT2_MODES:
        raise ValueError(f"int2={int2!r}: choose one of {tuple(INT2_MODES)}.")
    if int2 in ("if_flag", "unless_flag") and (
            not isinstance(flag, torch.Tensor) or flag.dtype != torch.int32 or flag.numel() != 1
            or flag.device != int2_cache.device):
        raise ValueError(f"int2={int2!r} reads a flag: pass an int32 tensor of one element on {int2_cache.device}.")
    check_write_args(key, value, k_rotation, v_rotation, clip_k, clip_v, int2_cache, layout,
                     slot_mapping, window_k, window_v, window_slot_mapping, value_prerotated)
    refit_k, refit_v = refit_pair(refit_iterations)
    _check_triton_layout(layout)
    _check_last_dim_contiguous(key=key, value=value, window_k=window_k, window_v=window_v)
    if window_k.stride() != window_v.stride():
        raise ValueError(f"window_k and window_v must have the same strides; got {window_k.stride()} and "
                         f"{window_v.stride()}.")
    n, hkv, d = key.shape
    if n == 0:
        return q_rot
    rk = k_rotation.to(torch.float32).contiguous()
    rv = rk if value_prerotated else v_rotation.to(torch.float32).contiguous()
    _check_rotated_rows(rotated_out, rotated, key, store_window, int2, query is not None, config)
    if _row_programs(config, store_window, query is not None, n, d):
        oscar_write_rows_kernel[(n, hkv, 2)](
            key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1), rk, rv, rk.stride(0),
            rk.stride(1), int2_cache, int2_cache.stride(0), int2_cache.stride(1), slot_mapping,
            slot_mapping if flag is None else flag, rotated, *(rotated.stride()[:2] if rotated is not None else (0, 0)),
            FROM_ROTATED=rotated is not None,
            **_row_write_constants(layout, float(clip_k), float(clip_v), config, bool(value_prerotated), refit_k,
                                   refit_v, bool(refit_floor[0]), bool(refit_floor[1]), int2, _interpreting()))
        return q_rot
    # Axis 2: K, V (after the window copies' column blocks where they have programs of their own: a flagged launch;
    # then the query's column blocks): triton_write's module docstring.
    sides = 2
    if store_window and int2 in ("if_flag", "unless_flag"):
        sides += 2 * (d // window_columns(config, d))
    tiles, write_sides, query_args = cdiv(n, WRITE_BLOCK_N), sides, {}
    if query is not None:
        group = query.shape[1] // hkv
        block_m, block_c = _rotate_blocks(n * group, d)
        tiles, sides = max(tiles, cdiv(n * group, block_m)), sides + d // block_c
        query_args = dict(q_ptr=query, stride_qn=query.stride(0), stride_qh=query.stride(1), q_out_ptr=q_rot,
                          stride_qon=q_rot.stride(0), stride_qoh=q_rot.stride(1), QUERY_GROUP=group, Q_BLOCK_M=block_m,
                          Q_BLOCK_C=block_c, Q_BLOCK_K=min(d, ROTATE_BLOCK_K), Q_PRECISION=ROTATE_PRECISION,
                          WRITE_SIDES=write_sides)
    oscar_write_kernel[(tiles, hkv, sides)](
        key, value, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        rk, rv, rk.stride(0), rk.stride(1),
        int2_cache, int2_cache.stride(0), int2_cache.stride(1),
        slot_mapping, window_slot_mapping,
        window_k, window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
        n, slot_mapping if flag is None else flag,
        **_write_constants(layout, float(clip_k), float(clip_v), config, bool(value_prerotated), refit_k, refit_v,
                           bool(refit_floor[0]), bool(refit_floor[1]), bool(store_window), int2,
                           config.num_warps or write_warps(d, n), _interpreting()),
        **query_args,
        **({} if rotated_out is None else dict(rot_ptr=rotated_out, stride_on=rotated_out.stride(0),
                                               stride_oh=rotated_out.stride(1), STORE_ROTATED=True)),
    )
    return q_rot


def reads_rotated_rows(tokens: int, head_dim: int, config: WriteConfig = DEFAULT_WRITE) -> bool:
    """Whether an INT2-only oscar_write of this many new tokens runs as row programs, which may read the rotated
    rows a flagged launch stored (oscar_write's rotated / rotated_out)."""
    return _row_programs(config, False, False, tokens, head_dim)


def _check_rotated_rows(rotated_out: Optional[torch.Tensor], rotated: Optional[torch.Tensor], key: torch.Tensor,
                        store_window: bool, int2: str, with_query: bool, config: WriteConfig) -> None:
    """oscar_write's rotated_out / rotated: the launch kinds that take them, shape [N, Hkv, 2, D] fp32 contiguous."""
    n, hkv, d = key.shape
    for name, rows in (("rotated_out", rotated_out), ("rotated", rotated)):
        if rows is not None and (rows.shape != (n, hkv, 2, d) or rows.dtype != torch.float32
                                 or not rows.is_contiguous() or rows.device != key.device):
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {(n, hkv, 2, d)} on {key.device}; "
                             f"got {tuple(rows.shape)} {rows.dtype} on {rows.device}.")
    if rotated_out is not None and not (store_window and int2 in ("if_flag", "unless_flag")):
        raise ValueError("rotated_out is written by the window-copy programs of a flagged launch: pass "
                         "store_window=True and int2='if_flag' or 'unless_flag'.")
    if rotated is not None and not _row_programs(config, store_window, with_query, n, d):
        raise ValueError("rotated is read by row programs only: an INT2-only launch (store_window=False, no query) "
                         "that reads_rotated_rows(tokens, head_dim, config) allows.")


def _row_programs(config: WriteConfig, store_window: bool, with_query: bool, tokens: int, head_dim: int) -> bool:
    """Whether an oscar_write launch runs as row programs (WriteConfig.row_programs)."""
    if store_window or with_query:
        return False
    if config.row_programs is None:
        return tokens <= WRITE_ROWS_MAX_TOKENS and head_dim <= WRITE_ROWS_MAX_HEAD_DIM
    return config.row_programs


#: The constexprs (and num_warps) of _write_constants that oscar_write_rows_kernel takes.
_ROW_PROGRAM_CONSTANTS: tuple[str, ...] = (
    "D", "G", "BS", "SCALE_T", "EPS", "K_CODES", "V_CODES", "K_SCALE", "K_ZERO", "V_SCALE", "V_ZERO", "CLIP_K",
    "CLIP_V", "DO_CLIP_K", "DO_CLIP_V", "ROTATE_V", "EMU", "REFIT_K", "REFIT_V", "FLOOR_K", "FLOOR_V", "CLIP_TOP_K",
    "CLIP_TOP_V", "INT2_MODE", "num_warps")


@functools.lru_cache(maxsize=64)
def _row_write_constants(layout: PageLayout, clip_k: float, clip_v: float, config: WriteConfig,
                         value_prerotated: bool, refit_k: int, refit_v: int, floor_k: bool, floor_v: bool, int2: str,
                         emulated: bool) -> dict:
    """oscar_write_rows_kernel's constexprs: _write_constants' for an INT2-only launch, one warp per program."""
    constants = _write_constants(layout, clip_k, clip_v, config, value_prerotated, refit_k, refit_v, floor_k,
                                 floor_v, False, int2, 1, emulated)
    return {**{name: constants[name] for name in _ROW_PROGRAM_CONSTANTS},
            "ROTATION_AHEAD": rows_rotation_ahead(layout.head_dim)}


def rows_rotation_ahead(head_dim: int) -> int:
    """Rows of R that a row program's rotation keeps in flight (WRITE_ROWS_RING_REGISTERS), 1 .. head_dim."""
    return max(1, min(head_dim, WRITE_ROWS_RING_REGISTERS * 32 // head_dim))


@functools.lru_cache(maxsize=256)
def _write_constants(layout: PageLayout, clip_k: float, clip_v: float, config: WriteConfig, value_prerotated: bool,
                     refit_k: int, refit_v: int, floor_k: bool, floor_v: bool, store_window: bool, int2: str,
                     num_warps: int, emulated: bool) -> dict:
    """oscar_write_kernel's constexprs and num_warps for one write geometry and choice of parts (built once, not
    per layer step: a served model asks for a handful of combinations)."""
    d = layout.head_dim
    clip_k_index, clip_v_index = clip_threshold_index(d, clip_k), clip_threshold_index(d, clip_v)
    return dict(
        D=d, G=layout.group_size, BS=layout.block_size, SCALE_T=TL_DTYPES[layout.scale_dtype], EPS=SCALE_EPS,
        **_plane_offsets(layout),
        CLIP_K=clip_k_index, CLIP_V=clip_v_index,
        CLIP_TOP_K=_clip_top(config, d, clip_k_index), CLIP_TOP_V=_clip_top(config, d, clip_v_index),
        ROT_PRECISION=config.rotation_precision, UNROLL_REFIT=config.unroll_refit,
        DO_CLIP_K=clip_k < 1.0, DO_CLIP_V=clip_v < 1.0,
        ROTATE_V=not value_prerotated, BLOCK_N=WRITE_BLOCK_N, BLOCK_K=min(d, WRITE_BLOCK_K),
        WINDOW_BLOCK_K=min(d, WRITE_WINDOW_BLOCK_K), WINDOW_BLOCK_C=window_columns(config, d), EMU=emulated,
        REFIT_K=refit_k, REFIT_V=refit_v, FLOOR_K=floor_k, FLOOR_V=floor_v,
        STORE_WINDOW=store_window, INT2_MODE=INT2_MODES[int2], num_warps=num_warps,
    )


def _unpack_mode(config: AttentionConfig) -> int:
    if config.unpack is not None:
        if config.unpack == UNPACK_PTX and _interpreting():
            raise ValueError("unpack=UNPACK_PTX (inline PTX) cannot run under TRITON_INTERPRET=1.")
        return config.unpack
    return UNPACK_PORTABLE if _interpreting() else UNPACK_PTX


def int2_split_tiles(seq_len: int, sink: int, recent: int, block_t: int, full_tiles: bool) -> int:
    """Tiles of block_t positions the split programs of a seq_len request share (the kernels' n_tiles): the whole
    tiles inside its pure INT2 range [min(sink, seq_len), max(sink_end, seq_len - recent)) with full_tiles, else
    the tiles from the one holding the range's first position to its end (0 for an empty range)."""
    sink_end = min(sink, seq_len)
    int2_end = max(sink_end, seq_len - recent)
    if full_tiles:
        first = cdiv(sink_end, block_t) * block_t
        return max((int2_end // block_t) * block_t - first, 0) // block_t
    return cdiv(int2_end - (sink_end // block_t) * block_t, block_t) if int2_end > sink_end else 0


def window_tile_counts(sink: int, recent: int, block_t: int, window_t: int, full_tiles: bool) -> tuple[int, int]:
    """(sink window tiles, all window tiles) of window_t positions per (request, KV head) of a decode launch: the sink
    programs cover [0, head_end), the rest [tail_start, length) from the window tile holding tail_start on.
    full_tiles (the splits walk whole block_t tiles only; window_t and block_t powers of two): head_end <= the first
    whole tile's start; [tail_start, length) either starts at a block_t boundary and is < recent + block_t positions
    long (an INT2 edge shorter than a tile, then the recent window) or starts anywhere at the INT2 range's end and is
    <= recent long, so cdiv(recent + max(block_t, window_t) - 1, window_t) tiles cover it (one fewer than the masked
    splits' count wherever window_t <= block_t, as gluon_decode's window tiles always are). Else the sink and the
    recent window, each tile-aligned or not."""
    if full_tiles:
        nsink = cdiv(cdiv(sink, block_t) * block_t, window_t)
        return nsink, nsink + cdiv(recent + max(block_t, window_t) - 1, window_t)
    nsink = cdiv(sink, window_t)
    return nsink, nsink + cdiv(recent, window_t) + 1


def decode_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_t: int, device: torch.device,
                  programs_per_sm: int = PROGRAMS_PER_SM, min_tiles_per_split: int = MIN_TILES_PER_SPLIT,
                  window_programs: int = 0, split_tiles: Optional[int] = None,
                  room_tiles: int = SHORT_SPLIT_TILES) -> int:
    """Split-K count: at most programs_per_sm split programs per SM in all (rounded down, so that they
    fill whole waves rather than spill a partial one), each with >= min_tiles_per_split tiles.

    window_programs: programs per (request, KV head) of the same launch besides the splits. Where the
    splits are short (fewer than SHORT_SPLIT_TILES tiles each) and splits plus windows overflow one
    wave, the splits shrink to leave the windows room in it, to no fewer than half; splits of fewer than
    room_tiles tiles (WINDOW_ROOM_SPLIT_TILES in gluon_decode's plans where programs_per_sm is what an SM holds;
    the default, SHORT_SPLIT_TILES, adds no such splits) shrink so only where at most a quarter of them go.

    split_tiles: the tiles a max_seq_len request's splits share (int2_split_tiles), or None. Given, the count is
    then cut to the fewest splits that give those tiles out at the same tiles per split, so that no split of
    such a request is left without tiles (an empty split costs a program slot and a merge partial; H200:
    SmolLM2-135M 16K B=8 81 -> 63 splits 6.5-6.8% faster, Qwen3-8B 16K / 64K B=1 3.3-3.5%, the rest within 1.1%;
    docs/decisions.md)."""
    sms = _device_sms(device)
    pairs = batch * num_kv_heads
    wanted = programs_per_sm * sms // pairs
    tiles = cdiv(max_seq_len, block_t)
    splits = max(1, min(wanted, max(1, tiles // min_tiles_per_split), MAX_SPLITS))
    wave = programs_per_sm * sms
    if pairs * (splits + window_programs) > wave:
        room = max(1, (wave - pairs * window_programs) // pairs)  # splits that leave the windows room in the wave
        if splits * SHORT_SPLIT_TILES > tiles:
            splits = max(room, splits // 2)
        elif splits * room_tiles > tiles and room >= splits - splits // 4:
            splits = room
    if split_tiles is not None:
        splits = max(1, min(splits, splits_with_tiles(splits, split_tiles, min_tiles_per_split)))
    return splits


def splits_with_tiles(num_splits: int, split_tiles: int, min_tiles_per_split: int = 1) -> int:
    """How many of num_splits splits get tiles when they share split_tiles tiles (int2_split_tiles) as the kernels
    hand them out: max(ceil(split_tiles / num_splits), min_tiles_per_split) per split, in order; the rest are empty
    (each still a program and a merge partial)."""
    return cdiv(split_tiles, max(cdiv(split_tiles, num_splits), min_tiles_per_split))


def beside_write_splits(splits: int, split_tiles: Optional[int], min_tiles_per_split: int) -> int:
    """A plan's split count beside a side-stream write (AttentionConfig.beside_write): BESIDE_WRITE_SPLIT_EIGHTHS / 8
    of ``splits``, rounded up, cut to the splits that get tiles (splits_with_tiles) where split_tiles is given."""
    fewer = cdiv(splits * BESIDE_WRITE_SPLIT_EIGHTHS, 8)
    return fewer if split_tiles is None else max(1, min(fewer, splits_with_tiles(fewer, split_tiles,
                                                                              min_tiles_per_split)))


def measured_split_count(splits: int, max_seq_len: int, block_t: int, min_tiles_per_split: int,
                         split_tiles: Optional[int]) -> int:
    """A measured plan's split count (measured_plans) for a launch sized for max_seq_len: cut, like decode_splits'
    counts, to splits of >= min_tiles_per_split tiles and to those that get tiles (splits_with_tiles), since the
    plan serves every max_seq_len of its context bucket."""
    splits = max(1, min(splits, cdiv(max_seq_len, block_t) // min_tiles_per_split))
    if split_tiles is not None:
        splits = max(1, min(splits, splits_with_tiles(splits, split_tiles, min_tiles_per_split)))
    return splits


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """What one SM offers the programs resident on it."""

    registers: int = SM_REGISTERS
    threads: int = SM_THREADS
    shared_bytes: int = SM_SHARED_BYTES


@functools.lru_cache(maxsize=None)
def sm_limits(device_index: int) -> SmLimits:
    """This CUDA device's SmLimits (Hopper's where torch does not report a field)."""
    props = torch.cuda.get_device_properties(device_index)
    return SmLimits(getattr(props, "regs_per_multiprocessor", SM_REGISTERS),
                    getattr(props, "max_threads_per_multi_processor", SM_THREADS),
                    getattr(props, "shared_memory_per_multiprocessor", SM_SHARED_BYTES))


def resident_programs(registers: int, num_warps: int, shared_bytes: int, limits: SmLimits) -> int:
    """Programs of a kernel (registers per thread, warps, shared bytes per program) one SM holds at
    once: the least of the register (whole warps per scheduler partition), thread, shared-memory and
    program limits (at least 1)."""
    unit = REGISTER_ALLOCATION_UNIT
    per_warp = -(-registers * 32 // unit) * unit
    by_registers = SM_PARTITIONS * (limits.registers // SM_PARTITIONS // per_warp) // num_warps
    by_threads = limits.threads // (32 * num_warps)
    by_shared = limits.shared_bytes // (shared_bytes + DRIVER_SHARED_PER_PROGRAM)
    return max(1, min(by_registers, by_threads, by_shared, SM_MAX_PROGRAMS))


#: Programs per SM of each compiled kernel specialisation, keyed by kernel, device, constexprs and
#: argument dtypes (filled on first use by _programs_per_sm).
_RESIDENCY: dict[tuple, int] = {}


def _programs_per_sm(kernel, make_args: Callable[[], list], consts: dict, dtypes: tuple,
                     device: torch.device) -> int:
    """Programs of ``kernel`` (these constexprs and tensor dtypes) one SM holds at once.

    On first use per key, compiles the kernel with make_args() and consts (no launch, so safe inside
    a CUDA-graph capture) and reads its registers. PROGRAMS_PER_SM under the interpreter or where
    this Triton does not expose the compiled kernel's registers (logged once per key)."""
    if _interpreting() or device.type != "cuda":
        return PROGRAMS_PER_SM
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (kernel.__name__, index, tuple(sorted((k, repr(v)) for k, v in consts.items())), dtypes)
    if key not in _RESIDENCY:
        compiled = kernel.warmup(*make_args(), grid=(1, 1, 1), **consts)
        try:
            compiled._init_handles()  # loads the binary: n_regs comes from the driver
            per_sm = resident_programs(compiled.n_regs, compiled.metadata.num_warps, compiled.metadata.shared,
                                       sm_limits(index))
        except AttributeError as error:  # a Triton without these internals
            per_sm = PROGRAMS_PER_SM
            logger.warning("oscar: cannot read the registers of %s (%s); sizing its launch for %d programs per "
                           "SM, which may cost speed (not accuracy).", kernel.__name__, error, per_sm)
        _RESIDENCY[key] = per_sm
    return _RESIDENCY[key]


def _tile_size(name: str, value: Optional[int], default: int, divides: Optional[int] = None) -> int:
    """value, or default when None; a power of two >= 16 (that divides ``divides`` when given)."""
    if value is None:
        return default
    if value < 16 or value & (value - 1) or (divides is not None and divides % value):
        within = f" that divides head_dim {divides}" if divides is not None else ""
        raise ValueError(f"{name}={value} must be a power of two >= 16{within}.")
    return value


def resolved_block_t(config: AttentionConfig) -> int:
    """config.block_t, or DECODE_BLOCK_T; a power of two >= 16."""
    return _tile_size("block_t", config.block_t, DECODE_BLOCK_T)


def _window_block_t(config: AttentionConfig, block_t: int, head_dim: int, pairs: int, max_seq_len: int,
                    sms: int) -> int:
    """config.window_block_t, or the default: min(block_t, WIDE_WINDOW_BLOCK_T) where the wide-window rule holds
    (head_dim, context and (request, KV head) pairs, see WIDE_WINDOW_BLOCK_T), else min(block_t, WINDOW_BLOCK_T);
    a power of two >= 16."""
    wide = (head_dim <= WIDE_WINDOW_MAX_HEAD_DIM and max_seq_len <= WIDE_WINDOW_MAX_CONTEXT
            and pairs >= WIDE_WINDOW_MIN_PAIRS_PER_SM * sms)
    return _tile_size("window_block_t", config.window_block_t,
                      min(block_t, WIDE_WINDOW_BLOCK_T if wide else WINDOW_BLOCK_T))


def merge_warps(slots: int, block_d: int) -> int:
    """Warps of each merge program over ``slots`` partials of ``block_d`` channels (MERGE_ONE_WARP_VALUES)."""
    return 1 if next_power_of_2(slots) * block_d <= MERGE_ONE_WARP_VALUES else MERGE_WARPS


def _merge_block_d(config: AttentionConfig, head_dim: int) -> int:
    """config.merge_block_d, or min(head_dim, MERGE_BLOCK_D); a power of two >= 16 that divides head_dim."""
    return _tile_size("merge_block_d", config.merge_block_d, min(head_dim, MERGE_BLOCK_D), divides=head_dim)


def _common_meta(layout: PageLayout, group: int, window_k: torch.Tensor, config: AttentionConfig) -> dict:
    block_t = resolved_block_t(config)
    return dict(
        GROUP=group, GP=next_power_of_2(group), D=layout.head_dim, G=layout.group_size,
        BS=layout.block_size, SCALE_T=TL_DTYPES[layout.scale_dtype], **_plane_offsets(layout),
        BLOCK_T=block_t, SAME_BLOCK=layout.block_size % block_t == 0,
        MODE=_unpack_mode(config), WIN_T=TL_DTYPES[window_k.dtype], EMU=_interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@dataclasses.dataclass(frozen=True)
class _DecodePlan:
    """How oscar_decode launches one call: the split count and the INT2 split kernel's constexprs (the
    same for every call with the same shapes, dtypes, geometry, tiles of max_seq_len and config: _cached_plan)."""

    split_int2: bool  # the INT2 split kernel (else the general kernel)
    num_splits: int
    short_splits: int  # splits a pair uses unless its context is long (= num_splits without long_splits)
    total: int  # partials per (request, head): splits + window tiles
    nsink: int
    meta: dict  # _common_meta
    split_consts: dict  # constexprs and launch options of int2_split_kernel
    tma_block_t: Optional[int]  # the tile of the TMA plane descriptors (None: plain loads, no descriptors)
    merge_pdl: bool  # the merge launched with programmatic dependent launch (_merge_pdl)
    gluon_splits: bool = False  # the split and window programs in gluon_decode's kernel
    gluon_tma: bool = False  # gluon_decode's staged tiles copied by TMA (its descriptors)
    measured: bool = False  # the split count came from the device's table of measured plans (measured_plans)


def _split_args(query_rot, int2_cache, window_k, window_v, block_table, window_block_table, seq_lens,
                part: torch.Tensor, lse: torch.Tensor, sink: int, recent: int, softmax_scale: float,
                descriptors: list) -> list:
    """The runtime arguments of int2_split_kernel (tensors, strides, scalars, its six plane descriptors), or with
    _gluon_descriptors' three those of gluon_decode's kernel but NSPLIT (the same ABI up to qk_scale)."""
    return [query_rot, query_rot.stride(0), query_rot.stride(1),
            int2_cache, int2_cache.stride(0), int2_cache.stride(1),
            window_k, window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
            block_table, window_block_table, block_table.stride(0), seq_lens,
            part, part.stride(0), part.stride(1), part.stride(2),
            lse, lse.stride(0), lse.stride(1),
            sink, recent, softmax_scale * LOG2E, *descriptors]


#: Plans (_cached_plan) and TMA plane descriptors (_cached_descriptors) of earlier calls; each is
#: emptied when it reaches its bound (a served model reuses one entry per layer and batch shape).
_PLANS: dict[tuple, _DecodePlan] = {}
_DESCRIPTORS: dict[tuple, list] = {}
PLAN_CACHE_ENTRIES: int = 4096
DESCRIPTOR_CACHE_ENTRIES: int = 1024


def _bounded_entry(cache: dict, limit: int, key: tuple, build: Callable[[], object]):
    """cache[key], built by build() on a miss; the cache is emptied first when it holds limit entries."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= limit:
            cache.clear()
        found = cache[key] = build()
    return found


def _cached_descriptors(int2_cache: torch.Tensor, layout: PageLayout, block_t: Optional[int]) -> list:
    """_tile_descriptors of this cache (the same objects for the same memory, shape and layout), or one
    None per plane without TMA."""
    if block_t is None:
        return [None] * len(PLANES)
    key = (int2_cache.data_ptr(), tuple(int2_cache.shape), int2_cache.dtype, int2_cache.device, layout, block_t)
    return _bounded_entry(_DESCRIPTORS, DESCRIPTOR_CACHE_ENTRIES, key,
                          lambda: _tile_descriptors(int2_cache, layout, block_t))


def _gluon_descriptors(int2_cache: torch.Tensor, layout: PageLayout, tma: bool) -> list:
    """gluon_decode's TMA descriptors of this cache with tma (the same objects for the same memory, shape and layout:
    gluon_decode.tma_descriptors), else three None."""
    if not tma:
        return [None] * 3

    def build() -> list:
        from vllm_oscar.kernels.gluon_decode import tma_descriptors

        offsets = _plane_offsets(layout)
        return tma_descriptors(int2_cache, layout.head_dim, offsets["K_CODES"], offsets["V_CODES"], offsets["K_SCALE"])

    key = ("gluon", int2_cache.data_ptr(), tuple(int2_cache.shape), int2_cache.device, layout)
    return _bounded_entry(_DESCRIPTORS, DESCRIPTOR_CACHE_ENTRIES, key, build)


def _cached_plan(query_rot, int2_cache, window_k, window_v, layout: PageLayout, block_table, window_block_table,
                 seq_lens, sink: int, recent: int, softmax_scale: float, max_seq_len: int,
                 config: AttentionConfig) -> _DecodePlan:
    """_plan_decode of an earlier call with the same shapes, dtypes, layout, windows, tiles of max_seq_len and
    config (what the plan depends on: max_seq_len only sizes the split count, by its tiles), else a new one:
    a served step, whose max_seq_len grows by one, skips the planning's host work within a tile."""
    tiles = cdiv(max_seq_len, resolved_block_t(config))
    table = active_table(query_rot.device)
    batch, hq, d = query_rot.shape
    measured = None if table is None else table.lookup(
        PlanCell(hq, int2_cache.shape[1], d, layout.block_size, sink, recent, batch, max_seq_len))
    key = (tuple(query_rot.shape), query_rot.dtype, query_rot.device, tuple(int2_cache.shape[1:]), int2_cache.dtype,
           int2_cache.is_contiguous(), window_k.dtype, layout, sink, recent, tiles, config, _interpreting(), measured)
    return _bounded_entry(_PLANS, PLAN_CACHE_ENTRIES, key, lambda: _plan_decode(
        query_rot, int2_cache, window_k, window_v, layout, block_table, window_block_table, seq_lens, sink, recent,
        softmax_scale, max_seq_len, config, measured))


def _merge_partials(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, config: AttentionConfig,
                    emulated: bool, pdl: bool, zero_empty: bool = False, decode: bool = False) -> None:
    """out[r, h] = the exact log-sum-exp merge of part[r, h, :] ([R, Hq, S, D] fp32, lse [R, Hq, S]);
    rows whose partials are all empty are left as they are, or set to zero with zero_empty (merge_kernel).
    pdl: launched with programmatic dependent launch (_merge_pdl). decode: the decode's merge, whose programs take
    merge_warps (the prefill's keep MERGE_WARPS: not timed with one)."""
    rows, hq, slots, d = part.shape
    merge_d = _merge_block_d(config, d)
    merge_kernel[(rows, hq, d // merge_d)](
        part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1),
        out, out.stride(0), out.stride(1), NS=slots, NSP=next_power_of_2(slots), D=d, EMU=emulated,
        BLOCK_D=None if merge_d == d else merge_d, WAIT_PRIOR=pdl, ZERO_EMPTY=zero_empty, TRIGGER_DEPENDENTS=pdl,
        num_warps=merge_warps(slots, merge_d) if decode else MERGE_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )


@functools.lru_cache(maxsize=16)
def pdl_supported(device: torch.device) -> bool:
    """Whether launches on ``device`` can use programmatic dependent launch (griddepcontrol): a CUDA GPU of compute
    capability >= PDL_MIN_CAPABILITY, kernels not built by the interpreter."""
    return (device.type == "cuda" and not _interpreting()
            and torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY)


def _merge_pdl(config: AttentionConfig, emulated: bool, device: torch.device) -> bool:
    """Whether the merge is launched with programmatic dependent launch: config.merge_pdl, or (None) on
    GPUs of compute capability >= PDL_MIN_CAPABILITY; never under the interpreter (no launch to overlap)."""
    if emulated or config.merge_pdl is False:
        return False
    capable = torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY
    if config.merge_pdl and not capable:
        raise ValueError(f"AttentionConfig(merge_pdl=True) needs a GPU of compute capability >= "
                         f"{PDL_MIN_CAPABILITY[0]}.{PDL_MIN_CAPABILITY[1]} (griddepcontrol); "
                         f"{torch.cuda.get_device_name(device)} has "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}. "
                         f"Leave merge_pdl=None (the default) to use it only where it exists.")
    return capable


def _windows_first(config: AttentionConfig, window_programs: int, device: torch.device) -> bool:
    """config.windows_first, or (None) whether the window programs number at most one per SM."""
    if config.windows_first is not None:
        return config.windows_first
    sms = _device_sms(device)
    return window_programs <= sms


def window_prefetch_pays(config: AttentionConfig, window_programs: int, sms: int,
                         measured: Optional[MeasuredPlan] = None) -> bool:
    """config.gluon_window_prefetch, or (None) the measured plan's hint where it has one, else whether
    gluon_decode's window programs number at most WINDOW_PREFETCH_PROGRAMS_PER_SM per SM."""
    if config.gluon_window_prefetch is not None:
        return config.gluon_window_prefetch
    if measured is not None and measured.window_prefetch is not None:
        return measured.window_prefetch
    return window_programs <= WINDOW_PREFETCH_PROGRAMS_PER_SM * sms


def tma_pays(head_dim: int, int8_keys: bool, pairs: int, sms: int, max_seq_len: int) -> bool:
    """Whether TMA tile loads beat plain loads for a graph-captured decode of ``pairs`` (request, KV head) pairs
    planned for ``max_seq_len`` positions on ``sms`` SMs (the rule of GRAPH_TMA_STAGES). Without int8 keys they
    pay only at head_dim >= GRAPH_TMA_MIN_HEAD_DIM (2-6% slower at head_dim 64, V26)."""
    if head_dim < GRAPH_TMA_MIN_HEAD_DIM and not int8_keys:
        return False
    if pairs * GRAPH_TMA_SMS_PER_PAIR <= sms:
        return True
    return head_dim >= GRAPH_TMA_MIN_HEAD_DIM and max_seq_len <= GRAPH_TMA_SHORT_CONTEXT and pairs <= sms


def graph_tma_stages(cuda_graph: bool, tma_applies: bool, head_dim: int, emulated: bool, device: torch.device,
                     pairs: int, int8_keys: bool, max_seq_len: int) -> int:
    """AttentionConfig.tma_stages None: GRAPH_TMA_STAGES for a launch captured in a CUDA graph where the TMA
    path applies (whole tiles in a cache block, compute capability >= 9.0, not the interpreter) and pays
    (tma_pays); else 0."""
    if not cuda_graph or not tma_applies or emulated:
        return 0
    if torch.cuda.get_device_capability(device) < PDL_MIN_CAPABILITY:
        return 0
    return GRAPH_TMA_STAGES if tma_pays(head_dim, int8_keys, pairs, _device_sms(device), max_seq_len) else 0


def gluon_splits_apply(layout: PageLayout, group: int, int8_keys: bool, full_tiles: bool, block_t: int, meta: dict,
                       config: AttentionConfig, device: torch.device) -> tuple[bool, str]:
    """(whether gluon_decode's split programs can take this decode's INT2 splits, what rules them out)."""
    try:
        from vllm_oscar.kernels import gluon_decode
    except ImportError as error:  # a Triton without Gluon (it ships from 3.5 on)
        return False, f"a Triton with Gluon ({error})"
    tile = gluon_decode.TILE.value
    missing = []
    if not int8_keys:
        missing.append("int8 keys")
    if not full_tiles:
        missing.append("whole tiles (full_tiles)")
    if config.long_splits:
        missing.append("long_splits off")
    if group > gluon_decode.MAX_GROUP.value:
        missing.append(f"GQA groups of at most {gluon_decode.MAX_GROUP.value} (got {group})")
    if layout.head_dim not in gluon_decode.HEAD_DIMS:
        missing.append(f"head_dim in {gluon_decode.HEAD_DIMS} (got {layout.head_dim})")
    if layout.group_size != layout.head_dim or layout.scale_dtype != torch.float16:
        missing.append(f"one fp16 scale group per row (got group_size {layout.group_size}, {layout.scale_dtype})")
    if block_t != tile or layout.block_size != tile:
        missing.append(f"tiles and cache blocks of {tile} positions (got block_t {block_t}, block_size "
                       f"{layout.block_size})")
    if device.type != "cuda" or meta["EMU"] or meta["MODE"] != UNPACK_PTX:
        missing.append("a CUDA GPU (not the interpreter) and the PTX unpack")
    elif torch.cuda.get_device_capability(device) < gluon_decode.MIN_CAPABILITY:
        missing.append(f"compute capability >= {'.'.join(map(str, gluon_decode.MIN_CAPABILITY))}")
    return not missing, "; ".join(missing)


def gluon_pays(config: AttentionConfig, tma_stages: int, max_seq_len: int, head_dim: int) -> bool:
    """Whether AttentionConfig(gluon_splits=None) picks gluon_decode's kernel where it applies: unless a knob
    of int2_split_kernel's split programs is set (tma_stages, prefetch, window_block_t, windows_first, split_warps:
    the caller asked for that kernel; max_registers caps either kernel), or, at head_dim >= GRAPH_TMA_MIN_HEAD_DIM,
    int2_split_kernel would load its tiles by TMA for a short context (tma_pays' GRAPH_TMA_SHORT_CONTEXT rule:
    Qwen3-8B 4K batch 1-8, where it was 2-9% faster; at head_dim 64 gluon_decode's staged tiles are faster there,
    SmolLM2 4K batch 1 0.0049 against 0.0059 ms, H200, docs/decisions.md)."""
    triton_knobs = (config.tma_stages, config.prefetch, config.window_block_t, config.windows_first)
    if any(knob is not None for knob in triton_knobs) or config.split_warps != SPLIT_WARPS:
        return False
    return not (tma_stages and max_seq_len <= GRAPH_TMA_SHORT_CONTEXT and head_dim >= GRAPH_TMA_MIN_HEAD_DIM)


def two_waves_pay(gluon_splits: bool, head_dim: int, pairs: int, sms: int, per_sm: int, tiles: int) -> bool:
    """Whether gluon_decode's splits are sized for two waves of ``per_sm`` resident programs per SM instead of one:
    at head_dim >= TWO_WAVE_MIN_HEAD_DIM with more (request, KV head) pairs than SMs, where each of the two-wave
    splits still walks >= TWO_WAVE_MIN_TILES of the plan's ``tiles``."""
    if not gluon_splits or head_dim < TWO_WAVE_MIN_HEAD_DIM or pairs <= sms:
        return False
    return tiles >= TWO_WAVE_MIN_TILES * max(1, 2 * per_sm * sms // pairs)


def tma_copy_pays(cuda_graph: bool, head_dim: int, int2_cache: torch.Tensor, device: torch.device) -> bool:
    """AttentionConfig.gluon_copy_tma None, where gluon_decode stages its tiles: whether TMA copies them (a launch
    captured in a CUDA graph, head_dim >= TMA_COPY_MIN_HEAD_DIM, a contiguous cache, compute capability >= 9.0)."""
    return (cuda_graph and head_dim >= TMA_COPY_MIN_HEAD_DIM and int2_cache.is_contiguous()
            and torch.cuda.get_device_capability(device) >= PDL_MIN_CAPABILITY)


def staging_pays(head_dim: int, pairs: int, max_seq_len: int, sms: int,
                 small_merge_tiles: Optional[int] = None) -> bool:
    """Whether gluon_decode's split programs stage their tiles in shared memory (AttentionConfig.gluon_copy_stages
    None) for ``pairs`` (request, KV head) pairs planned for ``max_seq_len`` positions on ``sms`` SMs: at head_dim
    <= STAGED_MAX_HEAD_DIM always, above where the plan holds >= STAGED_MIN_POSITIONS_PER_SM positions per SM, or
    where its merge is small (batch 1) and each split walks small_merge_tiles >= STAGED_MIN_SPLIT_TILES tiles
    (None: the merge is not small)."""
    return (head_dim <= STAGED_MAX_HEAD_DIM or pairs * max_seq_len >= STAGED_MIN_POSITIONS_PER_SM * sms
            or (small_merge_tiles or 0) >= STAGED_MIN_SPLIT_TILES)


def _plan_decode(query_rot, int2_cache, window_k, window_v, layout: PageLayout, block_table, window_block_table,
                 seq_lens, sink: int, recent: int, softmax_scale: float, max_seq_len: int,
                 config: AttentionConfig, measured: Optional[MeasuredPlan] = None) -> _DecodePlan:
    """The launch plan of oscar_decode (arguments as there, already checked). measured: the device table's plan for
    this cell (measured_plans), taken where the INT2 split kernels run and config sets neither num_splits nor
    programs_per_sm (its window prefetch hint: where config.gluon_window_prefetch is None)."""
    if config.gluon_copy_stages and config.gluon_copy_stages not in GLUON_COPY_STAGES:
        raise ValueError(f"gluon_copy_stages={config.gluon_copy_stages}: choose 0 (off) or one of "
                         f"{GLUON_COPY_STAGES}.")
    batch, hq, d = query_rot.shape
    hkv = int2_cache.shape[1]
    block_t = resolved_block_t(config)
    split_int2 = config.tokens_on_m and layout.group_size == layout.head_dim
    device = query_rot.device
    if not split_int2 or config.num_splits or config.programs_per_sm is not None:
        measured = None
    full_tiles = split_int2 if config.full_tiles is None else config.full_tiles
    group = hq // hkv
    meta = _common_meta(layout, group, window_k, config)
    int8_applies = split_int2 and layout.head_dim >= INT8_MMA_MIN_HEAD_DIM
    int8_keys = (int8_applies and meta["MODE"] == UNPACK_PTX) if config.int8_keys is None else config.int8_keys
    tma_applies = split_int2 and full_tiles and meta["SAME_BLOCK"] and int2_cache.is_contiguous()
    tma_stages = config.tma_stages
    if tma_stages is None:
        tma_stages = graph_tma_stages(config.cuda_graph, tma_applies, layout.head_dim, meta["EMU"], query_rot.device,
                                      batch * hkv, int8_keys, max_seq_len)
    if tma_stages and not tma_applies:
        raise ValueError(
            f"tma_stages={tma_stages} needs the INT2 split kernel walking whole tiles (tokens_on_m=True, one "
            f"group per row, full_tiles not False), cache blocks holding whole tiles (block_size {layout.block_size} "
            f"a multiple of block_t {block_t}) and a contiguous int2_cache; got group_size {layout.group_size}, "
            f"head_dim {layout.head_dim}, full_tiles={config.full_tiles}, contiguous={int2_cache.is_contiguous()}. "
            f"Leave tma_stages at 0.")
    gluon_splits = False
    gluon_missing = "gluon_splits not False" if split_int2 else "the INT2 split kernel (tokens_on_m, one group per row)"
    if split_int2 and config.gluon_splits is not False:
        gluon_ok, gluon_missing = gluon_splits_apply(layout, group, int8_keys, full_tiles, block_t, meta, config,
                                                     device)
        if config.gluon_splits and not gluon_ok:
            raise ValueError(f"AttentionConfig(gluon_splits=True) needs {gluon_missing}. Use gluon_splits=None to "
                             f"run gluon_decode only where it applies (the default), or False for int2_split_kernel.")
        if config.gluon_splits and config.tma_stages:
            raise ValueError(f"AttentionConfig(gluon_splits=True) loads its tiles without TMA; tma_stages="
                             f"{config.tma_stages} applies to int2_split_kernel only. Leave tma_stages None.")
        gluon_splits = gluon_ok and (config.gluon_splits or bool(config.gluon_copy_stages)
                                     or bool(config.gluon_f16_values)
                                     or gluon_pays(config, tma_stages, max_seq_len, layout.head_dim))
        if gluon_ok and not gluon_splits:
            gluon_missing = ("gluon_splits=True: here the planner picks int2_split_kernel, because a knob of that "
                             "kernel is set (tma_stages, prefetch, window_block_t, windows_first, split_warps) or its "
                             "TMA tiles pay at this short context (gluon_pays)")
    elif config.gluon_splits:
        raise ValueError("AttentionConfig(gluon_splits=True) needs the INT2 split kernel (tokens_on_m=True, one "
                         f"group per row); got group_size {layout.group_size}, head_dim {layout.head_dim}, "
                         f"tokens_on_m={config.tokens_on_m}.")
    if config.gluon_copy_stages and not gluon_splits:
        raise ValueError(f"gluon_copy_stages={config.gluon_copy_stages} stages tiles in gluon_decode's kernel, which "
                         f"this launch does not run (it needs {gluon_missing}). Leave gluon_copy_stages at None (the "
                         f"default: staged tiles only where gluon_decode runs and they pay) or 0.")
    if config.gluon_f16_values and not gluon_splits:
        raise ValueError(f"gluon_f16_values=True builds fp16 V operands in gluon_decode's kernel, which this launch "
                         f"does not run (it needs {gluon_missing}). Leave gluon_f16_values at None.")
    if config.gluon_window_prefetch and not gluon_splits:
        raise ValueError(f"gluon_window_prefetch=True is a hint of gluon_decode's window programs, which this launch "
                         f"does not run (it needs {gluon_missing}). Leave gluon_window_prefetch at None.")
    f16_values = gluon_splits and config.gluon_f16_values is not False
    default_fold = GLUON_F16_FOLD_TILES if f16_values else FOLD_TILES.value
    fold = default_fold if config.fold_tiles is None else config.fold_tiles
    if fold < 1 or fold & (fold - 1):
        raise ValueError(f"fold_tiles={config.fold_tiles} must be a power of two >= 1 (tiles between folds of the "
                         f"BIAS sums); leave it None for the default, {default_fold}.")
    if gluon_splits:
        window_t = block_t  # gluon_decode's window tiles are whole cache blocks
        tma_stages = 0
    elif split_int2:
        window_t = _window_block_t(config, block_t, d, batch * hkv, max_seq_len, _device_sms(device))
    else:
        window_t = block_t
    nsink, windows = window_tile_counts(sink, recent, block_t, window_t, split_int2 and full_tiles)
    # Fewer merge programs than SMs (batch 1): the merge's time grows with the split count (V22).
    small_merge = batch * hq * (d // _merge_block_d(config, d)) < _device_sms(device)
    split_tiles = int2_split_tiles(max_seq_len, sink, recent, block_t, full_tiles) if split_int2 else None
    copy_stages = config.gluon_copy_stages
    tma_would_copy = gluon_splits and tma_copy_pays(config.cuda_graph, d, int2_cache, device)  # staged ones, by default
    # Small-merge plans whose tiles TMA would copy are staged, their splits walking >= STAGED_MIN_SPLIT_TILES tiles.
    tma_small_merge = (tma_would_copy and small_merge and copy_stages is None and config.gluon_copy_tma is not False
                       and not config.num_splits)
    batched_gluon = gluon_splits and not small_merge  # gluon_decode's plans with >= one merge program per SM
    min_tiles = config.min_tiles_per_split
    if tma_small_merge:
        min_tiles = max(min_tiles, STAGED_MIN_SPLIT_TILES)
    elif gluon_splits:
        min_tiles = max(min_tiles, GLUON_MIN_SPLIT_TILES)
    if copy_stages is None:
        small_merge_tiles = None  # tiles per split of a small-merge plan, its split count sized as below
        if gluon_splits and small_merge and not tma_small_merge:
            capped = config.num_splits or decode_splits(
                batch, hkv, max_seq_len, block_t, device, config.programs_per_sm or SMALL_MERGE_PROGRAMS_PER_SM,
                min_tiles, windows, split_tiles)
            small_merge_tiles = cdiv(split_tiles, capped)
        copy_stages = GLUON_AUTO_COPY_STAGES if gluon_splits and (tma_small_merge or staging_pays(
            layout.head_dim, batch * hkv, max_seq_len, _device_sms(device), small_merge_tiles)) else 0
    gluon_tma = config.gluon_copy_tma
    if gluon_tma is None:
        gluon_tma = bool(copy_stages) and tma_would_copy
    if gluon_tma and not (copy_stages and int2_cache.is_contiguous()):
        raise ValueError(f"gluon_copy_tma=True copies gluon_decode's staged tiles by TMA: it needs staged tiles "
                         f"(gluon_copy_stages {copy_stages}: set 2 or 3; this launch runs gluon_decode: "
                         f"{gluon_splits}) and a contiguous int2_cache (contiguous: {int2_cache.is_contiguous()}). "
                         f"Leave gluon_copy_tma False.")
    if config.prefetch is None:
        prefetch = PREFETCH_TILES if meta["MODE"] == UNPACK_PTX and not tma_stages else 0
    else:
        prefetch = config.prefetch
    if int8_keys and not int8_applies:
        raise ValueError(
            f"int8_keys needs the INT2 split kernel (tokens_on_m=True, one group per row) and head_dim >= "
            f"{INT8_MMA_MIN_HEAD_DIM} (an int8 MMA takes K >= 32 = head_dim / 4 per code plane); got head_dim "
            f"{layout.head_dim}, group_size {layout.group_size}, tokens_on_m={config.tokens_on_m}. "
            "Leave int8_keys off.")
    if full_tiles and not split_int2:
        raise ValueError("full_tiles applies to the INT2 split kernel only (tokens_on_m=True, one group per row); "
                         f"got group_size {layout.group_size}, head_dim {layout.head_dim}, "
                         f"tokens_on_m={config.tokens_on_m}. Leave full_tiles off.")
    if prefetch and meta["MODE"] != UNPACK_PTX:
        raise ValueError(f"prefetch={prefetch} issues inline PTX (prefetch.global.L2): it needs unpack=UNPACK_PTX "
                         f"on a CUDA GPU; set prefetch=0 under TRITON_INTERPRET=1 or with the portable unpack.")
    tma_block_t = block_t if tma_stages else None
    merge_pdl = _merge_pdl(config, meta["EMU"], device)

    split_consts = dict(
        **{k: meta[k] for k in ("GROUP", "GP", "D", "BS", "SCALE_T", "K_CODES", "V_CODES", "K_SCALE", "K_ZERO",
                                "V_SCALE", "V_ZERO", "BLOCK_T", "SAME_BLOCK", "MODE", "WIN_T", "EMU", "num_stages")},
        WIN_BT=window_t, WIN_SAME_BLOCK=layout.block_size % window_t == 0, num_warps=config.split_warps,
        NSINK=nsink, INT8_K=int8_keys, PREFETCH=prefetch, REGION=layout.head_region_bytes,
        WINDOWS_FIRST=_windows_first(config, batch * hkv * windows, device), FULL_TILES=full_tiles,
        TRIGGER_DEPENDENTS=merge_pdl, TMA_STAGES=tma_stages,
        FIRST_PREFETCH=FIRST_PREFETCH_TILES if meta["MODE"] == UNPACK_PTX else 0,
        MIN_TILES=1 if config.num_splits else min_tiles,  # an explicit split count is kept
        FOLD=fold,
        **({} if config.max_registers is None else {"maxnreg": config.max_registers}))
    if gluon_splits:  # gluon_decode's kernel instead: its own constexprs (and descriptors: _gluon_descriptors)
        split_consts = dict(GROUP=group, D=d, BS=layout.block_size, NSINK=nsink, MIN_TILES=split_consts["MIN_TILES"],
                            REGION=layout.head_region_bytes, TRIGGER_DEPENDENTS=merge_pdl, num_warps=1,
                            COPY_STAGES=copy_stages, FOLD=fold, F16_VALUES=f16_values, COPY_TMA=gluon_tma,
                            WINDOW_PREFETCH=window_prefetch_pays(config, batch * hkv * windows, _device_sms(device),
                                                                 measured),
                            maxnreg=config.max_registers or GLUON_MAX_REGISTERS,
                            **_plane_offsets(layout))
        tma_block_t = None
    if config.num_splits:
        nsplit = config.num_splits
    elif measured is not None:
        nsplit = measured_split_count(measured.splits, max_seq_len, block_t, min_tiles, split_tiles)
    else:
        per_sm = config.programs_per_sm
        if per_sm is None:
            per_sm = PROGRAMS_PER_SM
            if split_int2:
                def probe_args() -> list:  # partial outputs of one slot: the compile needs only their dtype
                    probe = torch.empty(1, hq, 1, d, dtype=torch.float32, device=device)
                    return _split_args(query_rot, int2_cache, window_k, window_v, block_table, window_block_table,
                                       seq_lens, probe, probe[..., 0], sink, recent, softmax_scale,
                                       _gluon_descriptors(int2_cache, layout, gluon_tma) if gluon_splits
                                       else _cached_descriptors(int2_cache, layout, tma_block_t))

                dtypes = (query_rot.dtype, int2_cache.dtype, window_k.dtype)
                runtime = {"NSPLIT": 1} if gluon_splits else {"NSPLIT": 1, "NSPLIT_SHORT": 1}
                per_sm = _programs_per_sm(_gluon_kernel() if gluon_splits else int2_split_kernel, probe_args,
                                          {**split_consts, **runtime}, dtypes, device)
            if small_merge:
                per_sm = min(per_sm, TMA_SMALL_MERGE_PROGRAMS_PER_SM if gluon_tma else SMALL_MERGE_PROGRAMS_PER_SM)
            if two_waves_pay(gluon_splits, d, batch * hkv, _device_sms(device), per_sm, cdiv(max_seq_len, block_t)):
                per_sm *= 2  # two waves of half-length splits: a shorter tail
        nsplit = decode_splits(batch, hkv, max_seq_len, block_t, device, per_sm, min_tiles,
                               windows if split_int2 else 0, split_tiles,
                               WINDOW_ROOM_SPLIT_TILES if batched_gluon else SHORT_SPLIT_TILES)
    if (config.beside_write and split_int2 and not config.num_splits and max_seq_len > BESIDE_WRITE_MIN_SEQ_LEN
            and batch <= BESIDE_WRITE_MAX_BATCH):
        nsplit = beside_write_splits(nsplit, split_tiles, min_tiles)
    short = nsplit
    if config.long_splits and split_int2 and int8_keys and not config.num_splits and not small_merge and not measured:
        longer = decode_splits(batch, hkv, max_seq_len, block_t, device, LONG_SPLIT_PROGRAMS_PER_SM,
                               config.min_tiles_per_split, windows, split_tiles)
        if longer > nsplit and cdiv(max_seq_len, block_t) >= LONG_SPLIT_TILES * nsplit:
            nsplit = longer
            split_consts["LONG_TILES"] = LONG_SPLIT_TILES
    return _DecodePlan(split_int2, nsplit, short, nsplit + windows, nsink, meta, split_consts, tma_block_t, merge_pdl,
                       gluon_splits, gluon_tma, measured is not None)


def decode_plan(query_rot: torch.Tensor, int2_cache: torch.Tensor, window_k: torch.Tensor,
                window_v: torch.Tensor, layout: PageLayout, block_table: torch.Tensor,
                window_block_table: torch.Tensor, seq_lens: torch.Tensor, sink: int, recent: int,
                softmax_scale: float, max_seq_len: int, config: AttentionConfig = DEFAULT_DECODE) -> _DecodePlan:
    """The plan oscar_decode launches for these arguments, the device's measured plans included (for reports and the
    plan tuner: num_splits, gluon_splits, measured, split_consts["WINDOW_PREFETCH"]; compiles on first use)."""
    return _cached_plan(query_rot, int2_cache, window_k, window_v, layout, block_table, window_block_table, seq_lens,
                        sink, recent, softmax_scale, max_seq_len, config)


def decode_split_count(query_rot: torch.Tensor, int2_cache: torch.Tensor, window_k: torch.Tensor,
                       window_v: torch.Tensor, layout: PageLayout, block_table: torch.Tensor,
                       window_block_table: torch.Tensor, seq_lens: torch.Tensor, sink: int, recent: int,
                       softmax_scale: float, max_seq_len: int, config: AttentionConfig = DEFAULT_DECODE) -> int:
    """The split-K count oscar_decode uses for these arguments (decode_plan's)."""
    return decode_plan(query_rot, int2_cache, window_k, window_v, layout, block_table, window_block_table, seq_lens,
                       sink, recent, softmax_scale, max_seq_len, config).num_splits


#: Rotation launch (oscar_rotate): rows per program (BLOCK_M) where N x g rows fit ROTATE_SMALL_ROWS (decode
#: steps) and beyond (prefill chunks), output columns per program, the K tile, and the dot's input precision:
#: "tf32x3" (three TF32 tensor-core MMAs, about fp32 accuracy; "ieee" = fp32 FMAs). H200, Qwen3-8B geometry,
#: query + output rotation of one layer step in graph replays, us at 1 / 8 / 64 / 2048 tokens
#: (docs/perf/rotate_h200.json, bench/rotate.py): torch 14.7 / 23.6 / 26.3 / 274.6, ieee 15.7 / 15.7 / 31.0 /
#: 423.5, tf32x3 11.6 / 11.5 / 13.9 / 119.5, tf32x3 with K tiles of 64 10.4 / 10.4 / 13.8 / 114.7.
ROTATE_SMALL_ROWS: int = 256
ROTATE_BLOCK_M_SMALL: int = 16
ROTATE_BLOCK_M_LARGE: int = 64
ROTATE_BLOCK_C: int = 32
ROTATE_BLOCK_K: int = 64
ROTATE_PRECISION: str = "tf32x3"


def _rotate_blocks(rows_per_rotation: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_C) of a rotation launch over rows_per_rotation rows (N x g) per rotation."""
    block_m = ROTATE_BLOCK_M_SMALL if rows_per_rotation <= ROTATE_SMALL_ROWS else ROTATE_BLOCK_M_LARGE
    return block_m, min(head_dim, ROTATE_BLOCK_C)


def oscar_rotate(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[n, h] = x[n, h] @ R[h // g]`` (``@ R^T`` when inverse) in one launch; fp32 math.

    x: [N, H, D] float rows, unit stride on D; rotation: [Hr, D, D] float (made fp32), Hr dividing H;
    out: [N, H, D] float, unit stride on D (default: a new fp32 tensor); it may be a view of a larger
    output (the layer's output rows). Safe under CUDA-graph capture (no host synchronisation). Launched with
    programmatic dependent launch where it exists (pdl_supported): after the decode's merge, which lets it start
    early, it waits for the merge to finish before reading.
    """
    check_rotate_args(x, rotation, out)
    n, heads, d = x.shape
    if out is None:
        out = torch.empty(n, heads, d, dtype=torch.float32, device=x.device)
    _check_last_dim_contiguous(x=x, out=out)
    if n == 0:
        return out
    rot = rotation.to(torch.float32).contiguous()
    group = heads // rot.shape[0]
    block_m, block_c = _rotate_blocks(n * group, d)
    grid = (cdiv(n * group, block_m), rot.shape[0], d // block_c)
    pdl = pdl_supported(x.device)
    rotate_rows_kernel[grid](x, x.stride(0), x.stride(1), rot, rot.stride(0), rot.stride(1),
                             out, out.stride(0), out.stride(1), n, GROUP=group, D=d, BLOCK_M=block_m,
                             BLOCK_K=min(d, ROTATE_BLOCK_K), BLOCK_C=block_c, INVERSE=inverse,
                             PRECISION=ROTATE_PRECISION, WAIT_PRIOR=pdl, **({"launch_pdl": True} if pdl else {}))
    return out


def oscar_decode(
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
    out: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    config: AttentionConfig = DEFAULT_DECODE,
) -> torch.Tensor:
    """Split-K paged decode; arguments as torch_ops.oscar_decode.

    max_seq_len: Python int >= every seq_len (default block_table.shape[1] * block_size);
    only sizes the split count, so one value can serve a whole CUDA graph. A row of seq_len 0 (a
    CUDA graph's padding) gets zeros.
    """
    hkv, batch = check_attention_common(query_rot, int2_cache, window_k, window_v, layout, block_table,
                                        window_block_table, seq_lens, sink, recent, softmax_scale, out)
    _check_triton_layout(layout)
    _check_last_dim_contiguous(query_rot=query_rot, window_k=window_k, window_v=window_v)
    if query_rot.shape[0] != batch:
        raise ValueError(f"query_rot has {query_rot.shape[0]} rows but block_table has {batch} requests.")
    if window_k.stride() != window_v.stride():
        raise ValueError("window_k and window_v must have the same strides.")
    _, hq, d = query_rot.shape
    if out is None:
        out = torch.empty_like(query_rot)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * layout.block_size
    plan = _cached_plan(query_rot, int2_cache, window_k, window_v, layout, block_table, window_block_table, seq_lens,
                        sink, recent, softmax_scale, max_seq_len, config)
    meta, nsplit, total, split_int2, nsink = plan.meta, plan.num_splits, plan.total, plan.split_int2, plan.nsink
    part = torch.empty(batch, hq, total, d, dtype=torch.float32, device=query_rot.device)
    lse = torch.empty(batch, hq, total, dtype=torch.float32, device=query_rot.device)
    if split_int2 and plan.gluon_splits:  # the split and window programs in gluon_decode's kernel
        _gluon_kernel()[(batch, hkv, total)](
            *_split_args(query_rot, int2_cache, window_k, window_v, block_table, window_block_table, seq_lens, part,
                         lse, sink, recent, softmax_scale, _gluon_descriptors(int2_cache, layout, plan.gluon_tma)),
            nsplit, **plan.split_consts)
    elif split_int2:  # INT2 splits, then window tiles, in one launch (split programs dispatch first)
        args = _split_args(query_rot, int2_cache, window_k, window_v, block_table, window_block_table, seq_lens, part,
                           lse, sink, recent, softmax_scale, _cached_descriptors(int2_cache, layout, plan.tma_block_t))
        int2_split_kernel[(batch, hkv, total)](*args, NSPLIT=nsplit, NSPLIT_SHORT=plan.short_splits,
                                               **plan.split_consts)
    else:
        attention_kernel[(total, batch, hkv)](
            query_rot, query_rot.stride(0), query_rot.stride(1),
            query_rot, query_rot, 0, 0,
            int2_cache, int2_cache.stride(0), int2_cache.stride(1),
            window_k, window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
            block_table, window_block_table, block_table.stride(0),
            seq_lens, seq_lens,
            part, part.stride(0), part.stride(1), part.stride(2),
            lse, lse.stride(0), lse.stride(1),
            sink, recent, softmax_scale * LOG2E,
            BLOCK_M=1, M=max(16, meta["GP"]), NSPLIT=nsplit, DECODE=True, NEW_T=meta["WIN_T"],
            NSINK=nsink, CHUNK_FROM_CACHE=False, **meta,
        )
    _merge_partials(part, lse, out, config, meta["EMU"], plan.merge_pdl, zero_empty=True, decode=True)
    return out


def _gluon_kernel():
    """gluon_decode's kernel (imported on first use: CPU runs never need Gluon)."""
    from vllm_oscar.kernels.gluon_decode import int2_split_gluon_kernel

    return int2_split_gluon_kernel


def _prefill_int2_apart(config: AttentionConfig, max_seq_len: Optional[int], max_query_len: int, sink: int,
                        recent: int, programs: int, one_launch_per_sm: Callable[[], int], device: torch.device) -> bool:
    """config.prefill_int2_apart, or (None) whether the pure INT2 prefix should run in its own launch:
    when max_seq_len is known, the prefix it implies (max_seq_len - max_query_len) is at least
    PREFILL_APART_PREFIX_RATIO x the windows plus the chunk, and the one-launch grid (``programs``)
    overflows one wave of that launch's compiled kernel (one_launch_per_sm() programs per SM)."""
    if config.prefill_int2_apart is not None:
        return config.prefill_int2_apart
    if (max_seq_len is None
            or max_seq_len - max_query_len < PREFILL_APART_PREFIX_RATIO * (sink + recent + max_query_len)):
        return False
    return programs > one_launch_per_sm() * _device_sms(device)


def prefill_split_count(config: AttentionConfig, programs: int, device: torch.device, long_prefix: bool) -> int:
    """Programs per prefill query tile: config.prefill_splits, or (None) PREFILL_AUTO_SPLITS when the
    cached prefix holds a pure INT2 range (long_prefix) and the unsplit launch has ``programs`` < the
    device's SMs, 1 otherwise."""
    if config.prefill_splits is None:
        return PREFILL_AUTO_SPLITS if long_prefix and programs < _device_sms(device) else 1
    if config.prefill_splits < 1:
        raise ValueError(f"prefill_splits={config.prefill_splits} must be >= 1 (1 = no split of the prefix) "
                         "or None (automatic).")
    return config.prefill_splits


def prefill_path(config: AttentionConfig, query_rot: torch.Tensor, layout: PageLayout, recent: int,
                 max_seq_len: Optional[int], block_table: torch.Tensor, kv_heads: int,
                 plan: Optional[PrefillPlan]) -> str:
    """How oscar_prefill(chunk_from_cache=True) reads the cache, one of flash_plan.PREFILL_PATHS
    (AttentionConfig.prefill_flash, prefill_flash_split); says once per reason why not FlashAttention where the
    default finds one on a CUDA GPU, and counts the calls its workspace cap sends to the Triton kernel
    (flash_plan.CallSize.path: sized exactly from the step's plan, else bounded, and then never split by default)."""
    if config.prefill_flash is False:
        return "triton"
    reason = flash_unavailable(query_rot.device, layout.head_dim, recent)
    if reason is None:
        rows, heads, dim = query_rot.shape
        if plan is not None:
            size = CallSize.of_plan(plan, heads, kv_heads, dim)
        else:  # unknown lengths: the work as if no row had a prefix, the gathered rows as long as the block table
            table_positions = block_table.shape[1] * layout.block_size
            longest = table_positions if max_seq_len is None else min(max_seq_len, table_positions)
            size = CallSize.bound(rows, rows if max_seq_len is None else max_seq_len, block_table.shape[0], longest,
                                  heads, kv_heads, dim)
        if config.prefill_flash:
            return "split" if size.splits_keys(config.prefill_flash_split) else "flash"
        return size.path(config.prefill_flash_split)
    if config.prefill_flash:
        raise ValueError(f"prefill_flash=True, but FlashAttention prefill cannot run here: {reason}. Use "
                         f"prefill_flash=None (default: the Triton prefill kernel where it cannot) or False.")
    if query_rot.device.type == "cuda":
        _log_once(f"OSCAR: chunked prefill runs the Triton prefill kernel, not FlashAttention: {reason}.")
    return "triton"


def key_segments(query_rot: torch.Tensor) -> int:
    """flash_prefill's key_segments under AttentionConfig.prefill_flash_split: enough segments per request that its
    FlashAttention launch has FLASH_SPLIT_PROGRAMS_PER_SM programs per SM (the routing's full-tile count of the query
    rows x Hq, times the segments)."""
    rows, heads, _ = query_rot.shape
    target = FLASH_SPLIT_PROGRAMS_PER_SM * _device_sms(query_rot.device)
    return max(1, cdiv(target, max(1, full_tile_programs(rows, heads))))


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


def oscar_prefill(
    query_rot: torch.Tensor,
    key_rot: torch.Tensor,
    value_rot: torch.Tensor,
    int2_cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    window_block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sink: int,
    recent: int,
    softmax_scale: float,
    out: Optional[torch.Tensor] = None,
    max_query_len: Optional[int] = None,
    config: AttentionConfig = DEFAULT_PREFILL,
    chunk_from_cache: bool = False,
    max_seq_len: Optional[int] = None,
    flash_plan: Optional[PrefillPlan] = None,
) -> torch.Tensor:
    """Varlen chunked prefill over a cached prefix; arguments as torch_ops.oscar_prefill.

    max_query_len: Python int >= every chunk length (default: T, always safe). max_seq_len: Python int
    >= every seq_len, or None (unknown: one launch); it lets the default config run a long pure INT2
    prefix in its own launch (config.prefill_int2_apart). flash_plan: the host ranges of these query_start_loc and
    seq_lens (flash_plan.PrefillPlan), read where flash_prefill runs; None: that call reads them (one sync).
    Rows of query_rot that belong to no request are left untouched in ``out``.
    """
    hkv, batch = check_attention_common(query_rot, int2_cache, window_k, window_v, layout, block_table,
                                        window_block_table, seq_lens, sink, recent, softmax_scale, out)
    check_prefill_extra(query_rot, key_rot, value_rot, query_start_loc, hkv, batch, layout.head_dim,
                        chunk_from_cache)
    _check_triton_layout(layout)
    path = prefill_path(config, query_rot, layout, recent, max_seq_len, block_table, hkv, flash_plan) \
        if chunk_from_cache else "triton"
    if path != "triton":
        caches = PagedCaches(int2_cache, window_k, window_v, layout, block_table, window_block_table)
        segments = key_segments(query_rot) if path == "split" else 1
        return flash_prefill(query_rot, caches, query_start_loc, seq_lens, recent, sink, softmax_scale,
                             torch.zeros_like(query_rot) if out is None else out, _plane_offsets(layout),
                             plan=flash_plan, key_segments=segments, min_segment_keys=FLASH_SPLIT_MIN_KEYS)
    new_k, new_v = (query_rot, query_rot) if chunk_from_cache else (key_rot, value_rot)  # unused if from cache
    _check_last_dim_contiguous(query_rot=query_rot, key_rot=new_k, value_rot=new_v,
                               window_k=window_k, window_v=window_v)
    if new_k.stride() != new_v.stride() or window_k.stride() != window_v.stride():
        raise ValueError("key_rot/value_rot and window_k/window_v must have matching strides.")
    t, hq, d = query_rot.shape
    if out is None:
        out = torch.zeros_like(query_rot)
    if batch == 0 or t == 0:
        return out
    max_query_len = t if max_query_len is None else max_query_len
    group = hq // hkv
    meta = _common_meta(layout, group, window_k, config)
    if meta["BLOCK_T"] > PREFILL_MAX_BLOCK_T and not meta["EMU"]:
        raise ValueError(f"prefill block_t={meta['BLOCK_T']} is not supported on a GPU: Triton 3.6 miscompiles "
                         f"prefill tiles above {PREFILL_MAX_BLOCK_T} positions (shared-memory over-read); use "
                         f"block_t <= {PREFILL_MAX_BLOCK_T} (the default prefill config uses 32).")
    rows = _tile_size("prefill_rows", config.prefill_rows, PREFILL_ROWS)
    block_m = max(1, rows // meta["GP"])
    tiles = cdiv(max_query_len, block_m)
    device = query_rot.device
    programs = tiles * batch * hkv
    # a query at position t reads INT2 only at [sink, t - recent]: a cached prefix longer than the
    # windows is what the splits and the INT2 launch work on (unknown lengths: assume none)
    long_prefix = max_seq_len is not None and max_seq_len - max_query_len > sink + recent
    psplit = prefill_split_count(config, programs, device, long_prefix)
    constants = dict(BLOCK_M=block_m, M=max(16, block_m * meta["GP"]), NSPLIT=1, DECODE=False, NSINK=0,
                     NEW_T=TL_DTYPES[new_k.dtype], CHUNK_FROM_CACHE=chunk_from_cache, **meta)

    def arguments_into(target: tuple) -> tuple:
        """The runtime arguments of attention_kernel writing into ``target`` (out or partials, 7 values)."""
        return (query_rot, query_rot.stride(0), query_rot.stride(1),
                new_k, new_v, new_k.stride(0), new_k.stride(1),
                int2_cache, int2_cache.stride(0), int2_cache.stride(1),
                window_k, window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
                block_table, window_block_table, block_table.stride(0),
                seq_lens, query_start_loc, *target, sink, recent, softmax_scale * LOG2E)

    into_out = (out, out.stride(0), out.stride(1), 0, out, 0, 0)  # the output itself, no partials

    def one_launch_per_sm() -> int:
        dtypes = (query_rot.dtype, new_k.dtype, int2_cache.dtype, window_k.dtype, out.dtype)
        return _programs_per_sm(attention_kernel, lambda: arguments_into(into_out), {**constants, "PSPLIT": 1},
                                dtypes, device)

    apart = _prefill_int2_apart(config, max_seq_len, max_query_len, sink, recent, programs, one_launch_per_sm, device)
    slots = psplit + 1 if apart else psplit
    if slots > 1:  # partials per (row, head, slot), merged below; rows of no request keep lse -inf
        part = torch.empty(t, hq, slots, d, dtype=torch.float32, device=device)
        lse = torch.full((t, hq, slots), float("-inf"), dtype=torch.float32, device=device)
        arguments = arguments_into((part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0),
                                    lse.stride(1)))
    else:
        arguments = arguments_into(into_out)
    if apart:  # the pure INT2 prefix in its own compile (slots 0..psplit-1), the rest in slot psplit
        attention_kernel[(tiles * psplit, batch, hkv)](*arguments, PSPLIT=psplit, PART=1, **constants)
        attention_kernel[(tiles, batch, hkv)](*arguments, PSPLIT=1, PART=2, SLOT0=psplit, **constants)
    else:
        attention_kernel[(tiles * psplit, batch, hkv)](*arguments, PSPLIT=psplit, **constants)
    if slots > 1:
        _merge_partials(part, lse, out, config, meta["EMU"], _merge_pdl(config, meta["EMU"], device))
    return out


__all__ = ["AttentionConfig", "DEFAULT_DECODE", "DEFAULT_PREFILL", "decode_plan", "decode_split_count",
           "decode_splits", "resolved_block_t", "oscar_decode", "oscar_prefill", "oscar_rotate",
           "prefill_split_count", "prefill_path", "oscar_write", "write_warps", "WriteConfig", "DEFAULT_WRITE"]
