"""AttentionConfig.merge_pdl's launch contract, read from kernels compiled for sm_90 without a GPU.

With programmatic dependent launch the merge may start while the decode split kernel still runs, so
its correctness rests on two instructions: the merge must execute griddepcontrol.wait before it
reads any partial, and the split programs signal griddepcontrol.launch_dependents (SASS PREEXIT) at
their start. The kernels are compiled (PTX and SASS, Triton's own ptxas) in a subprocess without
TRITON_INTERPRET, which the rest of the suite sets."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBE = r'''
import json, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sass_decode import compile_kernel, cuobjdump
from vllm_oscar.kernels.triton_attention import merge_kernel

signature = {"part_ptr": "*fp32", "stride_pb": "i32", "stride_ph": "i32", "stride_ps": "i32", "lse_ptr": "*fp32",
             "stride_lb": "i32", "stride_lh": "i32", "out_ptr": "*bf16", "stride_ob": "i32", "stride_oh": "i32"}
report = {}
for wait in (False, True):
    constants = dict(NS=5, NSP=8, D=128, EMU=False, BLOCK_D=32, WAIT_PRIOR=wait, ZERO_EMPTY=True)
    names = merge_kernel.arg_names
    source = ASTSource(fn=merge_kernel, signature={**signature, **{k: "constexpr" for k in constants}},
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    report[f"merge_wait_{wait}"] = [ptx.find("griddepcontrol.wait"), ptx.find("ld.global")]
for trigger in (False, True):
    kernel = compile_kernel(128, 4, 64, 16, 1, 1, int8_keys=True, prefetch=1, trigger_dependents=trigger)
    sass = cuobjdump(kernel.asm["cubin"], "-sass")
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*")]
    first_load = next(i for i, line in enumerate(lines) if "LDG" in line)
    preexit = [i for i, line in enumerate(lines) if "PREEXIT" in line]
    report[f"split_trigger_{trigger}"] = [preexit[0] if preexit else -1, first_load, kernel.n_regs if hasattr(kernel, "n_regs") else None]
print(json.dumps(report))
'''


def test_merge_pdl_waits_before_reading_and_the_split_programs_trigger_first() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + PROBE], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    wait_at, first_read = report["merge_wait_True"]
    assert 0 <= wait_at < first_read, report
    assert report["merge_wait_False"][0] == -1  # off: no wait instruction at all
    preexit, first_load, _ = report["split_trigger_True"]
    assert 0 <= preexit < first_load, report
    assert report["split_trigger_False"][0] == -1
