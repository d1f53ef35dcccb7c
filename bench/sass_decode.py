#!/usr/bin/env python3
"""Read the SASS of the decode hot loop without a GPU (docs/decisions.md).

Compiles ``triton_decode_int2.int2_split_kernel`` for sm_90 with the Triton wheel's own
ptxas, disassembles it with its cuobjdump, and prints, per backward branch (loop), the
instruction count and the most frequent opcodes; plus registers and shared memory. Pointer
and stride arguments are marked divisible by 16, as Triton's launcher specialises them on
the GPU (without that, the loads compile to byte loads).

    python bench/sass_decode.py --head-dim 128 --group 4 --block-t 64 --block-size 16 --warps 1 --int8-keys --prefetch 1
    python bench/sass_decode.py ... --dump /tmp/k.sass      # also keep the full listing
    python bench/sass_decode.py --gluon --head-dim 64 --group 3   # gluon_decode's split programs

To compile with the GPU machine's Triton (3.6) instead of the one installed here:
    pip download triton==3.6.0 --no-deps -d /tmp/tri36 && pip install --no-deps --target /opt/tri36 /tmp/tri36/*.whl
    PYTHONPATH=/opt/tri36 python bench/sass_decode.py --warps 1 --stages 1
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vllm_oscar.config import DEFAULT_SINK_TOKENS, GPU_DECODE_BLOCK_SIZE  # noqa: E402
from vllm_oscar.kernels.layout import PageLayout  # noqa: E402
from vllm_oscar.kernels.triton_common import FOLD_TILES  # noqa: E402
from vllm_oscar.kernels.triton_decode_int2 import SPLIT_RUNTIME_ARGS, int2_split_kernel  # noqa: E402
from vllm_oscar.kernels.triton_ops import FIRST_PREFETCH_TILES, GLUON_MAX_REGISTERS, MIN_TILES_PER_SPLIT, _plane_offsets  # noqa: E402

#: Runtime (non-constexpr) arguments of int2_split_kernel and their Triton types, as the launcher
#: specialises them for the served caches (read from the H200's compile with
#: `bench/profile_decode.py --dump-compiled`): every stride fits in i32 (stride_cb as i64 instead
#: moves ptxas from 168 to 128 registers with full_tiles: docs/decisions.md V12).
SIGNATURE = {
    "q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "cache_ptr": "*u8", "stride_cb": "i32",
    "stride_ch": "i32", "wk_ptr": "*bf16", "wv_ptr": "*bf16", "stride_w0": "i32", "stride_w1": "i32",
    "stride_w2": "i32", "bt_ptr": "*i32", "wbt_ptr": "*i32", "stride_bt": "i32", "seq_ptr": "*i32", "part_ptr": "*fp32",
    "stride_pb": "i32", "stride_ph": "i32", "stride_ps": "i32", "lse_ptr": "*fp32", "stride_lb": "i32",
    "stride_lh": "i32", "sink": "i32", "recent": "i32", "qk_scale": "fp32", "NSPLIT": "i32", "NSPLIT_SHORT": "i32",
}
#: The plane descriptors of AttentionConfig.tma_stages (None, i.e. constexpr, without it).
DESCRIPTOR_ARGS = ("kc_desc", "vc_desc", "ks_desc", "kz_desc", "vs_desc", "vz_desc")
#: Scalars that are not marked divisible by 16 (the kernel's unspecialised ones among them; the
#: default sink 64 and recent 256 are, so the launcher marks them).
PLAIN_SCALARS = ("qk_scale", *SPLIT_RUNTIME_ARGS)


def compile_kernel(head_dim: int, group: int, block_t: int, block_size: int, warps: int, stages: int,
                   int8_keys: bool = False, prefetch: int = 0, maxnreg: int = 0, win_bt: int = 32,
                   full_tiles: bool = True, trigger_dependents: bool = False, tma_stages: int = 0,
                   first_prefetch: int = FIRST_PREFETCH_TILES):
    """The CompiledKernel for sm_90 (one group per row, fp16 scales, PTX unpack); maxnreg 0 = compiler's choice;
    trigger_dependents: AttentionConfig.merge_pdl's griddepcontrol.launch_dependents at each program's start;
    tma_stages: AttentionConfig.tma_stages (the plane descriptors typed as the launcher types them); first_prefetch:
    tiles asked of L2 inside the query prologue (FIRST_PREFETCH, the served default on a GPU)."""
    layout = PageLayout(head_dim, head_dim, block_size)
    q = layout.code_bytes
    descriptor_types = (f"tensordesc<u8[1,{block_t},{q}]>", f"tensordesc<i16[1,{block_t},{q // 2}]>",
                        *[f"tensordesc<fp16[1,{block_t}]>"] * 4)
    descriptors = dict(zip(DESCRIPTOR_ARGS, descriptor_types)) if tma_stages else {}
    sink_span = triton.cdiv(DEFAULT_SINK_TOKENS, block_t) * block_t if full_tiles else DEFAULT_SINK_TOKENS
    constants = dict(GROUP=group, GP=triton.next_power_of_2(group), D=head_dim, BS=block_size, SCALE_T=tl.float16,
                     BLOCK_T=block_t, SAME_BLOCK=block_size % block_t == 0, WIN_BT=win_bt,
                     WIN_SAME_BLOCK=block_size % win_bt == 0,
                     NSINK=triton.cdiv(sink_span, win_bt), MODE=1, WIN_T=tl.bfloat16, EMU=False,
                     INT8_K=int8_keys, PREFETCH=prefetch, REGION=layout.head_region_bytes, FULL_TILES=full_tiles,
                     TRIGGER_DEPENDENTS=trigger_dependents, WINDOWS_FIRST=False, TMA_STAGES=tma_stages,
                     MIN_TILES=MIN_TILES_PER_SPLIT, FOLD=FOLD_TILES.value, LONG_TILES=0, FIRST_PREFETCH=first_prefetch,
                     **({} if tma_stages else dict.fromkeys(DESCRIPTOR_ARGS)), **_plane_offsets(layout))
    names = int2_split_kernel.arg_names
    signature = {**SIGNATURE, **descriptors, **{name: "constexpr" for name in constants}}
    source = ASTSource(
        fn=int2_split_kernel, signature=signature,
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in SIGNATURE if k not in PLAIN_SCALARS},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages,
                                   **({"maxnreg": maxnreg} if maxnreg else {})})


#: Runtime arguments of gluon_decode.int2_split_gluon_kernel: int2_split_kernel's but the descriptors and NSPLIT_SHORT.
GLUON_SIGNATURE = {name: kind for name, kind in SIGNATURE.items() if name != "NSPLIT_SHORT"}
GLUON_PLAIN_SCALARS = tuple(name for name in PLAIN_SCALARS if name != "NSPLIT_SHORT")
#: gluon_decode's TMA descriptors (AttentionConfig.gluon_copy_tma; None, i.e. constexpr, without it).
GLUON_DESCRIPTOR_ARGS = ("k_desc", "v_desc", "s_desc")


def compile_gluon_kernel(head_dim: int, group: int, pdl: bool = True, maxnreg: int = GLUON_MAX_REGISTERS,
                         query: str = "bf16", window: str = "bf16", copy_stages: int = 0, f16_values: bool = False,
                         fold: int = FOLD_TILES.value, window_prefetch: bool = False, copy_tma: bool = False):
    """The CompiledKernel of gluon_decode's kernel for sm_90 (blocks of 64, fp16 scales, the default sink of 64) as
    triton_ops launches it; pdl: its TRIGGER_DEPENDENTS with programmatic dependent launch (the merge's); maxnreg 0:
    the compiler's register count; query / window: the element types of the query (fp32 from the served query
    rotation) and of the BF16 window store; copy_stages: its COPY_STAGES (AttentionConfig.gluon_copy_stages);
    f16_values: its F16_VALUES (AttentionConfig.gluon_f16_values); fold: its FOLD (AttentionConfig.fold_tiles);
    window_prefetch: its WINDOW_PREFETCH (AttentionConfig.gluon_window_prefetch); copy_tma: its COPY_TMA
    (AttentionConfig.gluon_copy_tma: the descriptors typed as the launcher types them, from a small CPU cache)."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from vllm_oscar.kernels.gluon_decode import int2_split_gluon_kernel, tma_descriptors

    layout = PageLayout(head_dim, head_dim, 64)
    offsets = _plane_offsets(layout)
    built = [None] * len(GLUON_DESCRIPTOR_ARGS)
    if copy_tma:
        built = tma_descriptors(torch.zeros(4, 2, layout.head_region_bytes, dtype=torch.uint8), head_dim,
                                offsets["K_CODES"], offsets["V_CODES"], offsets["K_SCALE"])
    descriptors = {name: mangle_type(desc) for name, desc in zip(GLUON_DESCRIPTOR_ARGS, built) if desc is not None}
    constants = dict(GROUP=group, D=head_dim, BS=64, NSINK=1, MIN_TILES=MIN_TILES_PER_SPLIT, FOLD=fold,
                     REGION=layout.head_region_bytes, TRIGGER_DEPENDENTS=pdl, COPY_STAGES=copy_stages,
                     F16_VALUES=f16_values, WINDOW_PREFETCH=window_prefetch, COPY_TMA=copy_tma,
                     **{name: None for name, desc in zip(GLUON_DESCRIPTOR_ARGS, built) if desc is None}, **offsets)
    names = int2_split_gluon_kernel.arg_names
    source = GluonASTSource(
        fn=int2_split_gluon_kernel, signature={**GLUON_SIGNATURE, "q_ptr": f"*{query}", "wk_ptr": f"*{window}",
                                               "wv_ptr": f"*{window}", **descriptors,
                                               **{name: "constexpr" for name in constants}},
        constexprs={(names.index(k),): v for k, v in constants.items()},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in GLUON_SIGNATURE if k not in GLUON_PLAIN_SCALARS})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 1, **({"maxnreg": maxnreg} if maxnreg else {})})


def cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump FLAG (-sass, -res-usage) of a cubin, with the tool shipped in the Triton wheel."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, flag, handle.name], capture_output=True, text=True, check=True).stdout


def read_compiled(kernel, dump: str | None) -> tuple[str, str, str]:
    """(SASS listing, registers, stack bytes) of a CompiledKernel; the listing also goes to ``dump``."""
    sass = cuobjdump(kernel.asm["cubin"], "-sass")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel.asm["cubin"], "-res-usage"))
    if dump:
        with open(dump, "w") as handle:
            handle.write(sass)
    return sass, usage.group(1), usage.group(2)


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, opcode without modifiers) of every SASS instruction, predicated or not."""
    return [(int(m.group(1), 16), m.group(2).split(".")[0]) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_.]+)", sass)]


def copy_sources(sass: str) -> list[tuple[int, str]]:
    """(address, source address register) of every cp.async (LDGSTS ... [Rn.64 + offset]): the registers a loop's
    tile copies compute their global addresses into."""
    return [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?LDGSTS[^\n]*?\]\[(R\d+)\.64", sass)]


def register_copies(sass: str) -> list[int]:
    """Addresses of plain register copies (IMAD.MOV.U32 Rd, RZ, RZ, Rs): in a hot loop they mostly build MMA
    operands whose halves Triton fills with copies of a half-empty tile (docs/decisions.md V40)."""
    return [int(m.group(1), 16) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?IMAD\.MOV\.U32 R\d+, RZ, RZ, R\d+", sass)]


def backward_branches(sass: str) -> list[tuple[int, int, bool]]:
    """(target, source, is_loop) of every backward branch; is_loop False for the divergence fallbacks that ptxas
    places after the last EXIT."""
    exits = [address for address, op in instructions(sass) if op == "EXIT"]
    return [(int(m.group(2), 16), int(m.group(1), 16), not exits or int(m.group(1), 16) < exits[-1])
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[0-9T] )?BRA[^;]*?0x([0-9a-f]+)", sass)
            if int(m.group(2), 16) < int(m.group(1), 16)]


def loop_histograms(sass: str, top: int) -> list[str]:
    """One line per loop (backward branch): instruction count, register copies and the top opcodes."""
    listing = instructions(sass)
    copies = register_copies(sass)
    lines = []
    for target, source, is_loop in backward_branches(sass):
        body = collections.Counter(op for address, op in listing if target <= address <= source)
        moved = sum(target <= address <= source for address in copies)
        common = " ".join(f"{op}={n}" for op, n in body.most_common(top))
        kind = "loop" if is_loop else "divergence fallback (not a loop)"
        lines.append(f"{kind} {target:#x}-{source:#x}: {sum(body.values())} instructions, {moved} register "
                     f"copies; {common}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
    parser.add_argument("--block-t", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=GPU_DECODE_BLOCK_SIZE)
    parser.add_argument("--warps", type=int, default=1)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--int8-keys", action="store_true", help="the int8-MMA key path (INT8_K)")
    parser.add_argument("--prefetch", type=int, default=0, help="L2 prefetch distance in tiles (PREFETCH; 0 = off)")
    parser.add_argument("--win-bt", type=int, default=32, help="window tile (WIN_BT)")
    parser.add_argument("--maxnreg", type=int, default=0, help="register cap (0 = compiler's choice)")
    parser.add_argument("--copy-stages", type=int, default=0,
                        help="--gluon: COPY_STAGES, tiles staged in shared memory by cp.async (0 = the L2 prefetch)")
    parser.add_argument("--f16-values", action="store_true",
                        help="--gluon: F16_VALUES, fp16 V operand and weights (AttentionConfig.gluon_f16_values)")
    parser.add_argument("--fold", type=int, default=FOLD_TILES.value,
                        help="--gluon: FOLD, tiles between folds of the BIAS sums (AttentionConfig.fold_tiles)")
    parser.add_argument("--window-prefetch", action="store_true",
                        help="--gluon: WINDOW_PREFETCH, window programs ask L2 for their V rows up front "
                             "(AttentionConfig.gluon_window_prefetch)")
    parser.add_argument("--full-tiles", type=int, choices=(0, 1), default=1,
                        help="1 = splits walk whole tiles, unmasked (FULL_TILES, the default); 0 = masked tiles")
    parser.add_argument("--trigger-dependents", action="store_true",
                        help="AttentionConfig.merge_pdl's griddepcontrol.launch_dependents (TRIGGER_DEPENDENTS)")
    parser.add_argument("--tma-stages", type=int, default=0,
                        help="TMA tile loads, software-pipelined this deep (AttentionConfig.tma_stages; 0 = off)")
    parser.add_argument("--gluon", action="store_true",
                        help="gluon_decode's split programs instead (AttentionConfig.gluon_splits; --head-dim and "
                             "--group only)")
    parser.add_argument("--top", type=int, default=18, help="opcodes listed per loop")
    parser.add_argument("--dump", metavar="FILE", help="write the full SASS listing here")
    args = parser.parse_args()
    if args.gluon:
        kernel = compile_gluon_kernel(args.head_dim, args.group, maxnreg=args.maxnreg or GLUON_MAX_REGISTERS,
                                      copy_stages=args.copy_stages, f16_values=args.f16_values, fold=args.fold,
                                      window_prefetch=args.window_prefetch)
    else:
        kernel = compile_kernel(args.head_dim, args.group, args.block_t, args.block_size, args.warps, args.stages,
                                args.int8_keys, args.prefetch, args.maxnreg, args.win_bt, bool(args.full_tiles),
                                args.trigger_dependents, args.tma_stages)
    sass, registers, stack = read_compiled(kernel, args.dump)
    print(f"shared memory {kernel.metadata.shared} B, {args.warps} warps, sm_90, registers {registers}, "
          f"stack {stack} B, {len(instructions(sass))} instructions in the kernel (the window programs' path is "
          f"what the split loop does not account for)")
    for line in loop_histograms(sass, args.top):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
