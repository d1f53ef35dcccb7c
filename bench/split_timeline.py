#!/usr/bin/env python3
"""Per-program timelines of gluon_decode's kernel on a CUDA GPU: when each split and window program starts, when its
loop ends and when its partial is stored, on which SM it ran, and with --first-tile when its first staged tile has
landed (docs/decisions.md: at Qwen3-8B 128K batch 1 the loop streams at the read bandwidth and the
split programs' end times spread over 8 us).

    python bench/split_timeline.py --cells qwen3-8b:131072:1 smollm2-135m:131072:8 [--first-tile] [--json OUT]
        [--raw DIR]

--raw DIR also keeps each cell's stamps as DIR/<geometry>_<context>_<batch>.npz (save_raw) for analyses beyond the
summary (e.g. what the late programs have in common).

How: a copy of vllm_oscar/kernels/gluon_decode.py instrumented by text edits (instrumented_source) reads
%globaltimer (ns, low 32 bits) at those four points and writes them with %smid over the first five channels of the
program's first partial (head h GROUP of its (request, KV head) pair). The copy is loaded as a module of its own and
launched with the cell's plan (bench/gluon_case.py) over every layer in a CUDA graph, replayed and timed; the last
layer's partials hold the timeline. Timing only: the decode's results are overwritten. Edits that no longer find their
anchor in the kernel's source stop the script with the anchor's text (update INSTRUMENT_EDITS with the kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from types import ModuleType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_oscar.kernels import triton_ops  # noqa: E402
from vllm_oscar.kernels.benchmark import GEOMETRIES, time_graph  # noqa: E402

from gluon_case import NOT_GLUON, add_output_arguments, cuda_device, gluon_case, write_rows  # noqa: E402

KERNEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "vllm_oscar", "kernels",
                             "gluon_decode.py")

#: Gluon helpers the instrumented kernel calls, inserted before its definition.
TIMER_HELPERS = '''
@gluon.jit
def _timeline_now():
    """%globaltimer, low 32 bits (ns)."""
    return gl.inline_asm_elementwise("{ .reg .u64 t; mov.u64 t, %globaltimer; cvt.u32.u64 $0, t; }", "=r", [],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _timeline_sm():
    """%smid."""
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


#: A stamp parked in shared memory: [1] int32, every lane holding it.
TIMELINE_STAMP = gl.BlockedLayout([1], [32], [1], [0])


@gluon.jit
def _timeline_park(slot, stamp):
    """Store a stamp into its shared slot (held there, not in a register, while the tile loop runs)."""
    slot.store(gl.full([1], 0, gl.int32, layout=TIMELINE_STAMP) + stamp)


@gluon.jit
def _timeline_parked(slot):
    """The stamp in a shared slot."""
    return gl.sum(slot.load(TIMELINE_STAMP), axis=0)


'''

#: (anchor, replacement, every occurrence) text edits of gluon_decode.py: the helpers before the kernel, the start
#: stamp after its first line of setup, the first-tile stamp once the staged loop's first tile has landed (cp.async or
#: TMA: _stage_landed), the loop-end stamp before the epilogue's fold, and the stores after the partial's log-sum-exp.
#: The start and first-tile stamps wait in shared memory (_timeline_park), not in registers across the tile loop. The
#: first-tile stamp is the edit marked FIRST_TILE_EDIT: inside the loop it makes the 128-register kernel spill there
#: (offline SASS, Triton 3.6, sm_90, head_dim 128: 12-17 local loads and stores per tile, either copy path; none
#: without it), and the TMA loop's fence before each copy likely waits for those stores (session 33: that timeline's
#: kernel 34.8 us against 26.7-27.1), so it is opt-in (--first-tile).
FIRST_TILE_EDIT = "if i == lo:"
INSTRUMENT_EDITS: tuple[tuple[str, str, bool], ...] = (
    ('\n\n@gluon.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", "NSPLIT"])\n'
     'def int2_split_gluon_kernel(',
     '\n\n' + TIMER_HELPERS + '@gluon.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", '
     '"NSPLIT"])\ndef int2_split_gluon_kernel(', False),
    ('    Q: gl.constexpr = D // 4\n    b = gl.program_id(0)\n',
     '    Q: gl.constexpr = D // 4\n    t_start = _timeline_now()\n'
     '    parked_start = gl.allocate_shared_memory(gl.int32, [1], STAGED)\n'
     '    parked_first = gl.allocate_shared_memory(gl.int32, [1], STAGED)\n'
     '    _timeline_park(parked_start, t_start)\n    _timeline_park(parked_first, t_start)\n'
     '    b = gl.program_id(0)\n', False),
    ("COPY_STAGES, COPY_TMA)\n                m_i, l_acc, acc, sums = _tile_step(",
     "COPY_STAGES, COPY_TMA)\n                if i == lo:\n"
     "                    _timeline_park(parked_first, _timeline_now())\n"
     "                m_i, l_acc, acc, sums = _tile_step(", False),
    ('    acc, sums = _fold_bias(acc, sums, D, F16_VALUES)  # column 2 j',
     '    t_loop = _timeline_now()\n    acc, sums = _fold_bias(acc, sums, D, F16_VALUES)  # column 2 j', False),
    ('    gl.store(lse_ptr + b * stride_lb + head * stride_lh + pid, lse, mask=stored)\n',
     '    gl.store(lse_ptr + b * stride_lb + head * stride_lh + pid, lse, mask=stored)\n'
     '    t_end = _timeline_now()\n    t_start = _timeline_parked(parked_start)\n'
     '    t_first = _timeline_parked(parked_first)\n'
     '    stamps = (part_ptr + b.to(gl.int64) * stride_pb + (h * GROUP) * stride_ph + pid * stride_ps).to(\n'
     '        gl.pointer_type(gl.int32))\n'
     '    gl.store(stamps, t_start)\n    gl.store(stamps + 1, t_first)\n    gl.store(stamps + 2, t_loop)\n'
     '    gl.store(stamps + 3, t_end)\n    gl.store(stamps + 4, _timeline_sm())\n', False),
)


def instrumented_source(source: str, first_tile: bool = False) -> str:
    """gluon_decode.py's source with INSTRUMENT_EDITS applied (the first-tile stamp only with first_tile);
    ValueError naming the first anchor not found."""
    for anchor, replacement, every in INSTRUMENT_EDITS:
        if FIRST_TILE_EDIT in replacement and not first_tile:
            continue
        if anchor not in source:
            raise ValueError(f"split_timeline: gluon_decode.py no longer contains {anchor!r}; update "
                             "bench/split_timeline.py's INSTRUMENT_EDITS to the kernel's source.")
        source = source.replace(anchor, replacement, -1 if every else 1)
    return source


def load_instrumented(folder: str, first_tile: bool = False) -> ModuleType:
    """The instrumented copy of gluon_decode (instrumented_source), written into folder and imported as a module of its
    own (Gluon reads a kernel's source from its file)."""
    with open(KERNEL_SOURCE) as handle:
        source = instrumented_source(handle.read(), first_tile)
    path = os.path.join(folder, "gluon_decode_timeline.py")
    with open(path, "w") as handle:
        handle.write(source)
    spec = importlib.util.spec_from_file_location("gluon_decode_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def percentiles_us(values_ns: np.ndarray) -> list[float]:
    """Min, 10th, 50th, 90th percentile and max of values_ns, in us (two decimals); [] for none."""
    if values_ns.size == 0:
        return []
    return [round(float(v) / 1000, 2) for v in np.percentile(values_ns, [0, 10, 50, 90, 100])]


#: Warp schedulers per SM (Hopper): programs that share an SM are served oldest first, so each SM's programs fall
#: into dispatch tiers of this many (docs/decisions.md).
SCHEDULERS_PER_SM = 4


def dispatch_tiers(sm: np.ndarray) -> np.ndarray:
    """[B, Hkv, programs] tier of each program: its rank among the programs of its SM in dispatch order (grid order:
    request fastest, then KV head, then program), // SCHEDULERS_PER_SM. sm: [B, Hkv, programs] %smid."""
    batch, hkv, programs = sm.shape
    order = np.arange(batch * hkv * programs).reshape(programs, hkv, batch).transpose(2, 1, 0).reshape(-1)
    flat = sm.reshape(-1)
    rank = np.empty_like(flat)
    for unit in np.unique(flat):
        members = np.flatnonzero(flat == unit)
        rank[members[np.argsort(order[members])]] = np.arange(members.size)
    return (rank // SCHEDULERS_PER_SM).reshape(sm.shape)


def relative_stamps(raw: np.ndarray) -> np.ndarray:
    """[..., 4] int64 ns after the launch's first program start (the 32-bit wrap of %globaltimer's low word undone) of
    the four stamps in raw [..., 5] (save_raw's layout)."""
    return (raw[..., :4] - raw[..., 0].min()) % (1 << 32)


def summarize(raw: np.ndarray, tiles: np.ndarray, sms: int) -> dict:
    """The timeline of one launch. raw: [B, Hkv, programs, 5] int64 as the kernel wrote it (start, first staged tile
    landed, loop end, partial stored: %globaltimer's low 32 bits; %smid); tiles: [num_splits] tiles of each split
    program (programs >= num_splits are window programs). Times are us after the first program's start (the timer's
    32-bit wrap undone); the loop's time per tile counts the staged split programs of the most tiles, from the
    first tile's landing where the launch stamped it (--first-tile; loop_timed_from "first_tile"), else from the
    program's start (loop_timed_from "start": every tile, the first one's latency included);
    split_end_by_tier_us: the mean end of the split programs of each dispatch tier (dispatch_tiers) that started in
    the kernel's first microsecond (one wave)."""
    num_splits = tiles.shape[0]
    stamps = relative_stamps(raw)
    splits = stamps[:, :, :num_splits].reshape(-1, 4)
    windows = stamps[:, :, num_splits:].reshape(-1, 4)
    split_tiles = np.broadcast_to(tiles, stamps.shape[:2] + tiles.shape).reshape(-1)
    staged = splits[:, 1] != splits[:, 0]  # the unstaged loop (or no --first-tile) leaves the stamp at the start
    from_first = bool(staged.any())
    full = (staged if from_first else True) & (split_tiles == tiles.max())
    loop_tiles = max(1, int(tiles.max()) - 1) if from_first else max(1, int(tiles.max()))
    sm = raw[..., 4].reshape(-1)
    ends = stamps[..., 3].reshape(-1)
    last_end = np.zeros(sms, dtype=np.int64)
    np.maximum.at(last_end, sm, ends)
    per_sm = np.bincount(sm, minlength=sms)
    tiers = dispatch_tiers(raw[..., 4])[:, :, :num_splits].reshape(-1)
    first_wave = splits[:, 0] < 1000
    by_tier = [round(float(splits[first_wave & (tiers == t), 3].mean()) / 1000, 2)
               for t in range(int(tiers.max()) + 1) if (first_wave & (tiers == t)).any()]
    return {
        "span_us": round(float(ends.max()) / 1000, 2),
        "split_start_us": percentiles_us(splits[:, 0]),
        "split_first_tile_us": percentiles_us(splits[staged, 1] - splits[staged, 0]),
        "split_loop_us_per_tile": percentiles_us((splits[full, 2] - splits[full, 1]) / loop_tiles),
        "loop_timed_from": "first_tile" if from_first else "start",
        "split_epilogue_us": percentiles_us(splits[:, 3] - splits[:, 2]),
        "split_end_us": percentiles_us(splits[:, 3]),
        "split_end_by_tier_us": by_tier,
        "window_start_us": percentiles_us(windows[:, 0]),
        "window_end_us": percentiles_us(windows[:, 3]),
        "sm_last_end_us": percentiles_us(last_end[per_sm > 0]),
        "programs_per_sm": [int(per_sm[per_sm > 0].min()), int(per_sm.max())],
    }


def time_cell(kernel, geometry: str, length: int, batch: int, reps: int, device: torch.device,
              raw_dir: str | None = None) -> dict:
    """One cell's timeline (summarize) with its plan and the kernel's time alone (graph replays, ms); raw_dir: also
    keep the stamps there (save_raw)."""
    cell = gluon_case(geometry, length, batch, device)
    if cell is None:
        return {"skipped": NOT_GLUON}
    plan = cell.plan
    fns = [(lambda i=i: cell.kernel(i, plan.total, plan.num_splits, kernel=kernel)) for i in range(cell.layers)]
    kernel_ms = time_graph(fns, reps)  # its last replay leaves the last layer's stamps in the partials
    group = cell.case.query.shape[1] // cell.case.caches[0].shape[1]
    raw = cell.part.view(torch.int32)[:, ::group, :, :5].cpu().numpy().astype(np.int64)
    tiles = split_program_tiles(triton_ops.int2_split_tiles(length, cell.sink, cell.recent, 64, True),
                                plan.num_splits, plan.split_consts["MIN_TILES"])
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if raw_dir:
        save_raw(os.path.join(raw_dir, f"{geometry}_{length}_{batch}.npz"), raw, tiles, sms)
    return {"splits": plan.num_splits, "programs": plan.total, "copy_stages": plan.split_consts["COPY_STAGES"],
            "split_tiles": int(tiles.max()), "kernel_ms": kernel_ms, **summarize(raw, tiles, sms)}


def save_raw(path: str, raw: np.ndarray, tiles: np.ndarray, sms: int) -> None:
    """One launch's stamps at path (.npz): raw [B, Hkv, programs, 5] int64 as summarize takes them (start, first
    staged tile landed, loop end, partial stored: %globaltimer's low 32 bits; %smid), tiles [num_splits] int64 (the
    split programs' tile counts), sms (the device's SM count)."""
    np.savez_compressed(path, raw=raw, tiles=tiles, sms=np.int64(sms))


def split_program_tiles(n_tiles: int, num_splits: int, min_tiles: int) -> np.ndarray:
    """[num_splits] tiles of each split program of a request with n_tiles whole INT2 tiles, as gluon_decode's fixed
    ranges give them (per_split = max(cdiv(n, NSPLIT), MIN_TILES) each, the last ones short or empty)."""
    per_split = max(math.ceil(n_tiles / num_splits), min_tiles)
    lo = np.minimum(np.arange(num_splits) * per_split, n_tiles)
    return np.minimum(lo + per_split, n_tiles) - lo


def parse_cell(text: str) -> tuple[str, int, int]:
    """geometry:context:batch."""
    try:
        geometry, context, batch = text.split(":")
        cell = geometry, int(context), int(batch)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cells takes geometry:context:batch (e.g. qwen3-8b:131072:1); got {text!r}")
    if geometry not in GEOMETRIES:
        raise argparse.ArgumentTypeError(f"unknown geometry {geometry!r}; choose from {sorted(GEOMETRIES)}")
    return cell


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=parse_cell, nargs="+",
                        default=[parse_cell(c) for c in ("qwen3-8b:131072:1", "qwen3-8b:65536:1",
                                                         "qwen3-8b:32768:8", "smollm2-135m:131072:8")])
    parser.add_argument("--raw", metavar="DIR", help="also keep each cell's stamps in DIR (save_raw)")
    parser.add_argument("--first-tile", action="store_true",
                        help="also stamp when each staged split's first tile has landed (split_first_tile_us); that "
                             "stamp makes the kernel spill in its tile loop, which slows the TMA loop (~30%% at "
                             "Qwen3-8B 128K batch 1)")
    add_output_arguments(parser)
    args = parser.parse_args()
    if args.raw:
        os.makedirs(args.raw, exist_ok=True)
    device = cuda_device("bench/split_timeline.py times gluon_decode's programs on a CUDA GPU; none is visible.")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        kernel = load_instrumented(folder, args.first_tile).int2_split_gluon_kernel
        for geometry, length, batch in args.cells:
            row = {"geometry": geometry, "context": length, "batch": batch,
                   **time_cell(kernel, geometry, length, batch, args.reps, device, args.raw)}
            rows.append(row)
            print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
            torch.cuda.empty_cache()
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
