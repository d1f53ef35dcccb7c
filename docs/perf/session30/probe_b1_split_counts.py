"""Session 30 probe (throw-away): gluon_decode's split kernel alone (no merge) and the whole decode at batch 1 for
several split counts (staged, two copy stages), to see whether more one-warp programs per SM shorten the split
kernel itself and the merge eats the gain."""
import dataclasses, json, math, sys
sys.path[:0] = [".", "bench"]
import torch
from gluon_case import GluonCase, BLOCK_SIZE
from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels import PageLayout, triton_ops
from vllm_oscar.kernels.benchmark import GEOMETRIES, layers_for, make_oscar_case, time_graph

dev = torch.device("cuda")
rows = []
for geometry, length, batch, splits_list in (("qwen3-8b", 131072, 1, (0, 150, 186, 220, 256, 300)),
                                              ("qwen3-8b", 65536, 1, (0, 170, 220, 256)),
                                              ("smollm2-135m", 131072, 8, (0, 64, 86))):
    hq, hkv, dim = GEOMETRIES[geometry]
    layers = layers_for(batch * hkv * length * PageLayout(dim, dim, BLOCK_SIZE, torch.float16).token_bytes)
    case = make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, layers, dev,
                           torch.Generator(device=dev).manual_seed(length * 131 + batch))
    for ns in splits_list:
        config = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True, num_splits=ns or None,
                                     gluon_copy_stages=2)
        plan = triton_ops._cached_plan(case.query, case.caches[0], case.window_k[0], case.window_v[0], case.layout,
                                       case.block_table, case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS,
                                       DEFAULT_RECENT_TOKENS, 1.0 / math.sqrt(dim), length, config)
        part = torch.empty(batch, hq, plan.total, dim, dtype=torch.float32, device=dev)
        lse = torch.empty(batch, hq, plan.total, dtype=torch.float32, device=dev)
        cell = GluonCase(case, plan, config, layers, length, part, lse, [torch.empty_like(case.query) for _ in range(layers)])
        r = {"geometry": geometry, "context": length, "batch": batch, "splits": plan.num_splits, "total": plan.total}
        for rep in range(2):
            r[f"decode_ms{rep}"] = time_graph([(lambda i=i: cell.decode(i)) for i in range(layers)], 10)
            r[f"kernel_ms{rep}"] = time_graph([(lambda i=i: cell.kernel(i, plan.total, plan.num_splits)) for i in range(layers)], 10)
        print(json.dumps(r), flush=True)
        rows.append(r)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
