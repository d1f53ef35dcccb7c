"""Registers, spills and loop sizes of the prefill kernel without a GPU (the prefill knobs' offline read).

Compiles ``triton_attention.attention_kernel`` in prefill mode (DECODE=False) for sm_90 with the
Triton wheel's own ptxas, as ``oscar_prefill`` launches it (bf16 query and new rows, fp16 scales,
one group per row, PTX unpack), for each combination of MMA rows per program, tile, warps and
prefix splits given, and prints registers, stack bytes, shared memory and the instruction count
of each loop (bench/sass_decode.py has the method and the helpers).

    PYTHONPATH=/opt/tri36 python bench/sass_prefill.py --rows 64 128 --block-t 32 64 --warps 4 8
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE  # noqa: E402
from vllm_oscar.kernels.layout import PageLayout  # noqa: E402
from vllm_oscar.kernels.triton_attention import attention_kernel  # noqa: E402
from vllm_oscar.kernels.triton_ops import _plane_offsets  # noqa: E402

from sass_decode import instructions, loop_histograms, read_compiled  # noqa: E402

#: Runtime arguments of attention_kernel and their Triton types as the launcher passes them.
SIGNATURE = {
    "q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "kn_ptr": "*bf16", "vn_ptr": "*bf16",
    "stride_nt": "i32", "stride_nh": "i32", "cache_ptr": "*u8", "stride_cb": "i32", "stride_ch": "i32",
    "wk_ptr": "*bf16", "wv_ptr": "*bf16", "stride_w0": "i32", "stride_w1": "i32", "stride_w2": "i32",
    "bt_ptr": "*i32", "wbt_ptr": "*i32", "stride_bt": "i32", "seq_ptr": "*i32", "qsl_ptr": "*i32",
    "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "stride_os": "i32", "lse_ptr": "*fp32",
    "stride_lt": "i32", "stride_lh": "i32", "sink": "i32", "recent": "i32", "qk_scale": "fp32",
}
#: Scalars not marked divisible by 16 (qk_scale is a float; stride_os is 0 without splits).
PLAIN_SCALARS = ("qk_scale", "stride_os")


def compile_prefill(head_dim: int, group: int, rows: int, block_t: int, block_size: int, warps: int,
                    splits: int, part: int = 0, chunk_from_cache: bool = False):
    """The CompiledKernel of one prefill launch config for sm_90 (part: attention_kernel's PART: 0 the
    whole prefill, 1 its pure INT2 prefix, 2 the rest)."""
    layout = PageLayout(head_dim, head_dim, block_size)
    gp = triton.next_power_of_2(group)
    block_m = max(1, rows // gp)
    signature = dict(SIGNATURE)
    if splits > 1 or part:
        signature["out_ptr"] = "*fp32"  # the partials
    constants = dict(GROUP=group, GP=gp, BLOCK_M=block_m, M=max(16, block_m * gp), D=head_dim, G=head_dim,
                     BS=block_size, SCALE_T=tl.float16, BLOCK_T=block_t, SAME_BLOCK=block_size % block_t == 0,
                     NSPLIT=1, DECODE=False, MODE=1, WIN_T=tl.bfloat16, NEW_T=tl.bfloat16, EMU=False, NSINK=0,
                     CHUNK_FROM_CACHE=chunk_from_cache, PSPLIT=splits, PART=part, SLOT0=0, **_plane_offsets(layout))
    names = attention_kernel.arg_names
    source = ASTSource(
        fn=attention_kernel, signature={**signature, **{name: "constexpr" for name in constants}},
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in signature if k not in PLAIN_SCALARS},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--rows", type=int, nargs="+", default=[64], help="MMA rows per program (prefill_rows)")
    parser.add_argument("--block-t", type=int, nargs="+", default=[32])
    parser.add_argument("--block-size", type=int, default=GPU_DECODE_BLOCK_SIZE)
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--splits", type=int, nargs="+", default=[1], help="prefill_splits")
    parser.add_argument("--part", type=int, nargs="+", default=[0], choices=(0, 1, 2),
                        help="attention_kernel PART: 0 one launch, 1 the pure INT2 launch, 2 the rest")
    parser.add_argument("--chunk-from-cache", action="store_true", help="the served read of the chunk")
    parser.add_argument("--top", type=int, default=8, help="opcodes listed per loop")
    args = parser.parse_args()
    for rows, block_t, warps, splits, part in itertools.product(args.rows, args.block_t, args.warps, args.splits,
                                                                args.part):
        kernel = compile_prefill(args.head_dim, args.group, rows, block_t, args.block_size, warps, splits, part,
                                 args.chunk_from_cache)
        sass, registers, stack = read_compiled(kernel, None)
        print(f"rows {rows} block_t {block_t} warps {warps} splits {splits} part {part}: registers {registers}, "
              f"stack {stack} B, "
              f"shared {kernel.metadata.shared} B, {len(instructions(sass))} instructions")
        for line in loop_histograms(sass, args.top):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
