"""The launch contract of the decode's programmatic dependent launches (AttentionConfig.merge_pdl), read from
kernels compiled for sm_90 without a GPU.

After a decode's split kernel come the merge and the output rotation (oscar_rotate); each may start while the
one before still runs, so correctness rests on two instructions per edge: the later kernel executes
griddepcontrol.wait before it reads anything, and the earlier one signals griddepcontrol.launch_dependents
(SASS PREEXIT) at its start (where that is missing, the edge only loses its overlap, never correctness). The
kernels are compiled (PTX and SASS, Triton's own ptxas) in a subprocess without TRITON_INTERPRET, which the
rest of the suite sets."""

from __future__ import annotations

from offline_probe import run_probe

PROBE = r'''
import json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sass_decode import compile_kernel, cuobjdump
from vllm_oscar.kernels.triton_attention import merge_kernel
from vllm_oscar.kernels.triton_rotate import rotate_rows_kernel


def sass_lines(kernel):
    return [line for line in cuobjdump(kernel.asm["cubin"], "-sass").splitlines() if line.strip().startswith("/*")]


def first(lines, text):
    return next((i for i, line in enumerate(lines) if text in line), -1)

signature = {"part_ptr": "*fp32", "stride_pb": "i32", "stride_ph": "i32", "stride_ps": "i32", "lse_ptr": "*fp32",
             "stride_lb": "i32", "stride_lh": "i32", "out_ptr": "*bf16", "stride_ob": "i32", "stride_oh": "i32"}
report = {}
for pdl in (False, True):
    constants = dict(NS=5, NSP=8, D=128, EMU=False, BLOCK_D=32, WAIT_PRIOR=pdl, ZERO_EMPTY=True,
                     TRIGGER_DEPENDENTS=pdl)
    names = merge_kernel.arg_names
    source = ASTSource(fn=merge_kernel, signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx, lines = kernel.asm["ptx"], sass_lines(kernel)
    report[f"merge_{pdl}"] = [ptx.find("griddepcontrol.wait"), ptx.find("ld.global"), first(lines, "PREEXIT"),
                              first(lines, "LDG")]
    lines = sass_lines(compile_kernel(128, 4, 64, 16, 1, 1, int8_keys=True, prefetch=1, trigger_dependents=pdl))
    report[f"split_{pdl}"] = [first(lines, "PREEXIT"), first(lines, "LDG")]
    rotate_sig = {"x_ptr": "*fp32", "stride_xn": "i32", "stride_xh": "i32", "r_ptr": "*fp32", "stride_rh": "i32",
                  "stride_rr": "i32", "out_ptr": "*bf16", "stride_on": "i32", "stride_oh": "i32", "n_tokens": "i32"}
    constants = dict(GROUP=4, D=128, BLOCK_M=16, BLOCK_K=64, BLOCK_C=32, INVERSE=True, PRECISION="tf32x3",
                     WAIT_PRIOR=pdl)
    names = rotate_rows_kernel.arg_names
    source = ASTSource(fn=rotate_rows_kernel, signature={**rotate_sig, **{k: "constexpr" for k in constants}},
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    report[f"rotate_{pdl}"] = [ptx.find("griddepcontrol.wait"), ptx.find("ld.global")]
print(json.dumps(report))
'''


def test_decode_launch_chain_waits_before_reading_and_triggers_first() -> None:
    report = run_probe(PROBE, timeout=600)
    for kernel in ("merge", "rotate"):  # each waits (PTX) before its first global load
        wait_at, first_read = report[f"{kernel}_True"][:2]
        assert 0 <= wait_at < first_read, (kernel, report)
        assert report[f"{kernel}_False"][0] == -1, (kernel, report)  # off: no wait instruction at all
    for kernel in ("split", "merge"):  # each lets the next launch start before its first load (SASS)
        preexit, first_load = report[f"{kernel}_True"][-2:]
        assert 0 <= preexit < first_load, (kernel, report)
        assert report[f"{kernel}_False"][-2] == -1, (kernel, report)
