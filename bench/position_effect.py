"""Position effect experiment: the same decode case fresh, after memory churn, after other cases."""
import dataclasses
import math
import sys
import time

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels import benchmark as bm
from vllm_oscar.kernels import triton_ops

dev = torch.device("cuda")


def oscar_ms(geometry, length, batch, sort_table=False, reps=10):
    hq, hkv, dim = bm.GEOMETRIES[geometry]
    from vllm_oscar.kernels.layout import PageLayout
    layout = PageLayout(dim, dim, 64, torch.float16)
    layers = bm.layers_for(batch * hkv * length * layout.token_bytes)
    gen = torch.Generator(device=dev).manual_seed(length * 131 + batch)
    case = bm.make_oscar_case(batch, length, hq, hkv, dim, 64, layers, dev, gen)
    table = case.block_table
    if sort_table:
        table = torch.sort(table.flatten())[0].view_as(table).contiguous()
    config = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True)
    outs = [torch.empty_like(case.query) for _ in range(layers)]
    fns = [(lambda i=i: triton_ops.oscar_decode(
        case.query, case.caches[i], case.window_k[i], case.window_v[i], case.layout, table,
        case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS, DEFAULT_RECENT_TOKENS, 1 / math.sqrt(dim),
        out=outs[i], max_seq_len=length, config=config)) for i in range(layers)]
    ms = bm.time_graph(fns, reps)
    addr = case.caches[0].data_ptr()
    del case, outs, fns
    torch.cuda.empty_cache()
    return ms, layers, addr


def sdpa_ms(geometry, length, batch, reps=10):
    from torch.nn.attention import SDPBackend
    hq, hkv, dim = bm.GEOMETRIES[geometry]
    layers = bm.layers_for(batch * hkv * length * 4 * dim)
    ks = [torch.randn(batch, hkv, length, dim, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    vs = [torch.randn_like(k) for k in ks]
    q = torch.randn(batch, hq, 1, dim, device=dev, dtype=torch.bfloat16)
    t = bm.time_graph(bm.sdpa_fns(q, ks, vs, SDPBackend.CUDNN_ATTENTION), reps)
    del ks, vs
    torch.cuda.empty_cache()
    return t


def report(tag, geometry, length, batch):
    for sort_table in (False, True):
        ms, layers, addr = oscar_ms(geometry, length, batch, sort_table)
        print(f"{tag:>22} {geometry} {length} B={batch} sorted={sort_table}: oscar {ms:.4f} ms "
              f"(layers {layers}, cache at {addr / 2**30:.1f} GiB)", flush=True)
    print(f"{tag:>22} cudnn {sdpa_ms(geometry, length, batch):.4f} ms", flush=True)


def churn(gib_total):
    held = []
    for i in range(int(gib_total)):
        held.append(torch.empty(((1 + i % 3) << 30) // 4, dtype=torch.float32, device=dev).random_())
        if sum(t.numel() * 4 for t in held) > gib_total * 2**30:
            break
    del held
    torch.cuda.empty_cache()


if __name__ == "__main__":
    cases = [("qwen3-8b", 32768, 64), ("qwen3-8b", 65536, 8), ("smollm2-135m", 131072, 64)]
    for c in cases:
        report("fresh", *c)
    churn(100)
    for c in cases:
        report("after churn 100 GiB", *c)
    for g, l, b in [("qwen3-8b", 4096, 64), ("qwen3-8b", 16384, 32), ("qwen3-8b", 131072, 64),
                    ("smollm2-135m", 65536, 32), ("qwen3-8b", 131072, 32)]:
        oscar_ms(g, l, b)
        sdpa_ms(g, l, b)
    for c in cases:
        report("after five cases", *c)
    for c in cases:
        report("again", *c)
