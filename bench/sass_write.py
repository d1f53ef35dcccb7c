#!/usr/bin/env python3
"""Read the SASS of the write kernel without a GPU (as bench/sass_decode.py does for the decode loop).

Compiles ``triton_write.oscar_write_kernel`` for sm_90 and prints registers, the whole kernel's
instruction count and barriers, and each loop's count (the clip search is a runtime loop; the refit
rounds are unrolled with --unroll 1). Use the device's Triton with PYTHONPATH (see bench/sass_decode.py).

    PYTHONPATH=/opt/tri36 python bench/sass_write.py --head-dim 128 --refit 8 2 --warps 4
    ... --query-group 4 --int2 if_flag --rotate-v 0   (a folded layer's first launch of a captured decode step)
    ... --rows 1 --int2 unless_flag   (the side-stream INT2 write by row programs: triton_write_rows)
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE, SCALE_EPS  # noqa: E402
from vllm_oscar.kernels.layout import PageLayout  # noqa: E402
from vllm_oscar.kernels.triton_ops import (  # noqa: E402
    CLIP_SEARCHES,
    CLIP_TOP_MAX_ROUNDS,
    DEFAULT_WRITE,
    INT2_MODES,
    ROTATE_BLOCK_C,
    ROTATE_BLOCK_K,
    ROTATE_BLOCK_M_SMALL,
    ROTATE_PRECISION,
    ROTATION_PRECISIONS,
    WRITE_BLOCK_K,
    WRITE_BLOCK_N,
    WRITE_WINDOW_BLOCK_C,
    WRITE_WINDOW_BLOCK_K,
    _plane_offsets,
    rows_rotation_ahead,
)
from vllm_oscar.kernels.triton_write import oscar_write_kernel  # noqa: E402
from vllm_oscar.kernels.triton_write_rows import oscar_write_rows_kernel  # noqa: E402
from vllm_oscar.quant import clip_threshold_index  # noqa: E402

from sass_decode import instructions, loop_histograms, read_compiled  # noqa: E402

#: Runtime arguments of oscar_write_kernel and their Triton types.
SIGNATURE = {
    "k_ptr": "*bf16", "v_ptr": "*bf16", "stride_kn": "i32", "stride_kh": "i32", "stride_vn": "i32", "stride_vh": "i32",
    "rk_ptr": "*fp32", "rv_ptr": "*fp32", "stride_rh": "i32", "stride_rr": "i32",
    "cache_ptr": "*u8", "stride_cb": "i64", "stride_ch": "i32", "slot_ptr": "*i64", "wslot_ptr": "*i64",
    "wk_ptr": "*bf16", "wv_ptr": "*bf16", "stride_w0": "i32", "stride_w1": "i32", "stride_w2": "i32", "N": "i32",
    "flag_ptr": "*i32",
}
#: The rotated rows' arguments (oscar_write's rotated_out, the row programs' rotated).
ROTATED_SIGNATURE = {"rot_ptr": "*fp32", "stride_on": "i32", "stride_oh": "i32"}
#: Strides that a launch specializes as multiples of 16 (Triton does so for int arguments divisible by 16): the
#: rotation's rows, which decides whether R loads as 16-byte vectors.
SPECIALIZED_STRIDES = ("stride_rh", "stride_rr")
#: The query rotation's runtime arguments (--query-group > 0: a layer step's first launch: oscar_write
#: with a query).
QUERY_SIGNATURE = {"q_ptr": "*bf16", "stride_qn": "i32", "stride_qh": "i32", "q_out_ptr": "*fp32", "stride_qon": "i32",
                   "stride_qoh": "i32"}


def compile_write(head_dim: int, block_size: int, warps: int, refit: tuple[int, int], clip: tuple[float, float],
                  clip_top: bool = False, rotation: str = "ieee", unroll: bool = True, query_group: int = 0,
                  int2_mode: int = 0, store_window: bool = True, rotate_v: bool = True,
                  window_columns: int = WRITE_WINDOW_BLOCK_C, store_rotated: bool = False):
    """The CompiledKernel for sm_90 (one group per row, fp16 scales, keys floored as served); query_group > 0:
    with the query rotation programs (QUERY_GROUP) of oscar_write with a query; rotate_v False: values arrive
    rotated (R_V folded into W_v); window_columns: output columns per window-copy program of a flagged launch;
    store_rotated: those programs also store the rotated rows (oscar_write's rotated_out)."""
    constants = dict(**_quantize_constants(head_dim, block_size, refit, clip, clip_top, int2_mode, rotate_v),
                     BLOCK_N=WRITE_BLOCK_N, BLOCK_K=min(head_dim, WRITE_BLOCK_K),
                     WINDOW_BLOCK_K=min(head_dim, WRITE_WINDOW_BLOCK_K), WINDOW_BLOCK_C=min(head_dim, window_columns),
                     ROT_PRECISION=rotation, UNROLL_REFIT=unroll, STORE_WINDOW=store_window, QUERY_GROUP=query_group,
                     STORE_ROTATED=store_rotated)
    runtime = {**SIGNATURE, **QUERY_SIGNATURE, **ROTATED_SIGNATURE}  # the query's arguments unused at QUERY_GROUP 0
    flagged_copies = store_window and int2_mode >= INT2_MODES["if_flag"]
    copies = 2 * (head_dim // min(head_dim, window_columns)) if flagged_copies else 0
    constants["WRITE_SIDES"] = 2 + copies
    if query_group:
        constants.update(Q_BLOCK_M=ROTATE_BLOCK_M_SMALL, Q_BLOCK_C=min(head_dim, ROTATE_BLOCK_C),
                         Q_BLOCK_K=min(head_dim, ROTATE_BLOCK_K), Q_PRECISION=ROTATE_PRECISION)
    return _compile(oscar_write_kernel, runtime, constants, warps)


def compile_write_rows(head_dim: int, block_size: int, refit: tuple[int, int], clip: tuple[float, float],
                       clip_top: bool = False, int2_mode: int = 0, rotate_v: bool = True, from_rotated: bool = False):
    """triton_write_rows.oscar_write_rows_kernel for sm_90, one warp (its launch), constants as compile_write's;
    from_rotated: reading the rotated rows (oscar_write's rotated)."""
    constants = dict(**_quantize_constants(head_dim, block_size, refit, clip, clip_top, int2_mode, rotate_v),
                     ROTATION_AHEAD=rows_rotation_ahead(head_dim), FROM_ROTATED=from_rotated)
    every = {**SIGNATURE, **ROTATED_SIGNATURE}
    runtime = {name: every[name] for name in oscar_write_rows_kernel.arg_names if name in every}
    return _compile(oscar_write_rows_kernel, runtime, constants, 1)


def _quantize_constants(head_dim: int, block_size: int, refit: tuple[int, int], clip: tuple[float, float],
                        clip_top: bool, int2_mode: int, rotate_v: bool) -> dict:
    """The constexprs both write kernels take: layout, clips, refit, INT2 mode (one group per row, fp16 scales, keys
    floored as served)."""
    layout = PageLayout(head_dim, head_dim, block_size)
    clip_k, clip_v = clip_threshold_index(head_dim, clip[0]), clip_threshold_index(head_dim, clip[1])
    return dict(D=head_dim, G=head_dim, BS=block_size, SCALE_T=tl.float16, EPS=SCALE_EPS, **_plane_offsets(layout),
                CLIP_K=clip_k, CLIP_V=clip_v, DO_CLIP_K=clip[0] < 1.0, DO_CLIP_V=clip[1] < 1.0, ROTATE_V=rotate_v,
                EMU=False, REFIT_K=refit[0], REFIT_V=refit[1], FLOOR_K=True, FLOOR_V=False,
                CLIP_TOP_K=clip_top and head_dim - clip_k <= CLIP_TOP_MAX_ROUNDS,
                CLIP_TOP_V=clip_top and head_dim - clip_v <= CLIP_TOP_MAX_ROUNDS, INT2_MODE=int2_mode)


def _compile(kernel, runtime: dict, constants: dict, warps: int):
    names = kernel.arg_names
    signature = {**runtime, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(k),): [["tt.divisibility", 16]] for k in runtime
                              if k.endswith("_ptr") or k in SPECIALIZED_STRIDES})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=GPU_DECODE_BLOCK_SIZE)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--refit", type=int, nargs=2, default=[8, 2], metavar=("K", "V"))
    parser.add_argument("--clip", type=float, nargs=2, default=[0.96, 0.92], metavar=("K", "V"))
    parser.add_argument("--clip-search", choices=CLIP_SEARCHES, default=DEFAULT_WRITE.clip_search)
    parser.add_argument("--rotation", choices=ROTATION_PRECISIONS, default=DEFAULT_WRITE.rotation_precision)
    parser.add_argument("--unroll", type=int, choices=(0, 1), default=int(DEFAULT_WRITE.unroll_refit),
                        help="1 = refit rounds unrolled, 0 = a loop (WriteConfig.unroll_refit)")
    parser.add_argument("--query-group", type=int, default=0,
                        help="> 0: with the query rotation programs of this GQA group (oscar_write with a query)")
    parser.add_argument("--int2", choices=tuple(INT2_MODES), default="always")
    parser.add_argument("--store-window", type=int, choices=(0, 1), default=1)
    parser.add_argument("--rotate-v", type=int, choices=(0, 1), default=1,
                        help="0: values arrive rotated (fold_rotations value_and_output)")
    parser.add_argument("--window-columns", type=int, default=WRITE_WINDOW_BLOCK_C,
                        help="output columns per window-copy program of a flagged launch (WriteConfig.window_columns)")
    parser.add_argument("--rows", type=int, choices=(0, 1), default=0,
                        help="1: the INT2-only launch by row programs (triton_write_rows; one warp, no windows)")
    parser.add_argument("--rotated", type=int, choices=(0, 1), default=0,
                        help="1: the first launch stores the rotated rows (--store-window 1) / the row programs read "
                             "them (--rows 1)")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--dump", metavar="FILE")
    args = parser.parse_args()
    if args.rows:
        args.warps = 1
        kernel = compile_write_rows(args.head_dim, args.block_size, tuple(args.refit), tuple(args.clip),
                                    args.clip_search == "top", INT2_MODES[args.int2], bool(args.rotate_v),
                                    bool(args.rotated))
    else:
        kernel = compile_write(args.head_dim, args.block_size, args.warps, tuple(args.refit), tuple(args.clip),
                               args.clip_search == "top", args.rotation, bool(args.unroll), args.query_group,
                               INT2_MODES[args.int2], bool(args.store_window), bool(args.rotate_v),
                               args.window_columns, bool(args.rotated))
    sass, registers, stack = read_compiled(kernel, args.dump)
    ops = collections.Counter(op for _, op in instructions(sass))
    common = " ".join(f"{op}={n}" for op, n in ops.most_common(args.top))
    print(f"{args.warps} warps, sm_90, registers {registers}, stack {stack} B, shared "
          f"{kernel.metadata.shared} B; whole kernel {sum(ops.values())} instructions: {common}")
    for line in loop_histograms(sass, args.top):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
