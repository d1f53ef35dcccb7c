"""gluon_decode's split programs without a GPU: the kernel compiles for sm_90 at both head_dims (each of its layout
conversions is asserted free at compile time), keeps every operand in registers (no shared memory, no spills) and
lets the merge start before its first load and, launched beside the window programs, waits for them after its last
store; and the decode plan uses it only when asked, with a clear error where it does not apply.

Its numbers are checked on the GPU against float64 references (bench/check_kernels_gpu.py: every decode case at
head_dim 128 runs it) and against int2_split_kernel's split programs (bench/gluon_probe.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from vllm_oscar.kernels import triton_ops
from vllm_oscar.kernels.layout import PageLayout

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBE = r'''
import json, re, sys
sys.path[:0] = [ROOT, ROOT + "/bench"]
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from sass_decode import read_compiled
from vllm_oscar.kernels.gluon_decode import int2_split_gluon_kernel
from vllm_oscar.kernels.layout import PageLayout
from vllm_oscar.kernels.triton_ops import _plane_offsets

SIGNATURE = {"q_ptr": "*bf16", "stride_qb": "i32", "stride_qh": "i32", "cache_ptr": "*u8", "stride_cb": "i32",
             "stride_ch": "i32", "bt_ptr": "*i32", "stride_bt": "i32", "seq_ptr": "*i32", "part_ptr": "*fp32",
             "stride_pb": "i32", "stride_ph": "i32", "stride_ps": "i32", "lse_ptr": "*fp32", "stride_lb": "i32",
             "stride_lh": "i32", "sink": "i32", "recent": "i32", "qk_scale": "fp32", "NSPLIT": "i32"}
PLAIN = ("qk_scale", "stride_pb", "stride_ph", "stride_lb", "stride_lh", "NSPLIT")
report = {}
for dim, group in ((128, 4), (64, 3)):
    layout = PageLayout(dim, dim, 64)
    consts = dict(GROUP=group, D=dim, BS=64, MIN_TILES=2, REGION=layout.head_region_bytes, TRIGGER_DEPENDENTS=True,
                  WAIT_PRIOR=True, **_plane_offsets(layout))
    names = int2_split_gluon_kernel.arg_names
    source = GluonASTSource(fn=int2_split_gluon_kernel, signature={**SIGNATURE, **{k: "constexpr" for k in consts}},
                            constexprs={(names.index(k),): v for k, v in consts.items()},
                            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in SIGNATURE if k not in PLAIN})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    sass, registers, stack = read_compiled(kernel, None)
    lines = [line for line in sass.splitlines() if line.strip().startswith("/*")]
    first = lambda text: next((i for i, line in enumerate(lines) if text in line), -1)
    ptx = kernel.asm["ptx"]
    report[f"gluon_{dim}"] = dict(shared=kernel.metadata.shared, stack=int(stack), registers=int(registers),
                                  preexit=first("PREEXIT"), first_load=first("LDG"),
                                  wait=ptx.rfind("griddepcontrol.wait"), last_store=ptx.rfind("st.global"),
                                  imma=sass.count("IMMA"), hmma=sass.count("HMMA"), lds=len(re.findall(r"\bLDS", sass)))
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + PROBE], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dim", [128, 64])
def test_gluon_split_kernel_keeps_operands_in_registers(compiled: dict, dim: int) -> None:
    kernel = compiled[f"gluon_{dim}"]
    assert kernel["shared"] == 0 and kernel["lds"] == 0, kernel  # no operand through shared memory
    assert kernel["stack"] == 0, kernel  # no spills
    assert kernel["registers"] <= 168, kernel
    # Per tile: 4 (head_dim 128) or 2 int8 K steps over 4 M tiles; the V product over D / 16 M tiles and 4 K steps,
    # plus the column sums' 4: counted once in the loop (the prologue and epilogue hold none).
    steps = 4 if dim == 128 else 2
    assert kernel["imma"] == 4 * steps, kernel
    assert kernel["hmma"] == 4 * (dim // 16) + 4, kernel
    assert 0 <= kernel["preexit"] < kernel["first_load"], kernel  # the merge may start at once
    # Launched beside the window programs (PDL): it exits only after they finished, so the merge's wait covers both.
    assert kernel["wait"] > kernel["last_store"] >= 0, kernel


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


def test_plan_keeps_the_triton_splits_by_default() -> None:
    assert not _plan(triton_ops.DEFAULT_DECODE).gluon_splits


def test_plan_explains_why_gluon_splits_cannot_run() -> None:
    with pytest.raises(ValueError, match="gluon_splits=True.*CUDA GPU"):
        _plan(triton_ops.AttentionConfig(gluon_splits=True))
    with pytest.raises(ValueError, match="cache blocks of 64 positions.*block_size 16"):
        _plan(triton_ops.AttentionConfig(gluon_splits=True), block_size=16)
