"""Session 30 probe (throw-away): per-program timestamps (%globaltimer) of gluon_decode's split kernel, from a patched
copy of the kernel (ab_ts: start, first staged tile landed, loop end, partial stored, SM id written over the first
head's partial). Run from ab_ts: PYTHONPATH=ab_ts python out/s30/probe_timeline.py OUT.json"""
import json, math, sys
import os; sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")]
import numpy as np
import torch
from gluon_case import gluon_case
from vllm_oscar.kernels import triton_ops
from vllm_oscar.kernels.benchmark import time_graph, captured_graph

dev = torch.device("cuda")
report = []
for geometry, length, batch in (("qwen3-8b", 131072, 1), ("qwen3-8b", 65536, 1), ("smollm2-135m", 131072, 8),
                                ("qwen3-8b", 32768, 8), ("smollm2-135m", 131072, 1)):
    cell = gluon_case(geometry, length, batch, dev)
    plan = cell.plan
    fns = [(lambda i=i: cell.kernel(i, plan.total, plan.num_splits)) for i in range(cell.layers)]
    kernel_ms = time_graph(fns, 10)
    graph = captured_graph(fns)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    hkv = cell.case.caches[0].shape[1]
    group = cell.case.query.shape[1] // hkv
    raw = cell.part.view(torch.int32)[:, ::group, :, :5].cpu().numpy().astype(np.int64)  # [B, Hkv, total, 5]
    t = raw[..., :4]
    base = t[..., 0].min()
    t = (t - base) % (1 << 32)
    sm = raw[..., 4]
    n = triton_ops.int2_split_tiles(length, cell.sink, cell.recent, 64, True)
    ns = plan.num_splits
    per = max(math.ceil(n / ns), 1)
    tiles = np.array([max(0, min(n, (p + 1) * per) - min(n, p * per)) for p in range(ns)])
    sp = t[:, :, :ns].reshape(-1, 4)
    wi = t[:, :, ns:].reshape(-1, 4)
    til = np.broadcast_to(tiles, t[:, :, :ns, 0].shape).reshape(-1)
    full = til == til.max()
    pct = lambda x: [round(float(v) / 1000, 2) for v in np.percentile(x, [0, 10, 50, 90, 100])]
    row = {"geometry": geometry, "context": length, "batch": batch, "splits": ns, "total": plan.total,
           "copy_stages": plan.split_consts.get("COPY_STAGES"), "tiles_per_split": int(til.max()),
           "kernel_us_graph": round(kernel_ms * 1000, 2),
           "span_us": round(float(t[..., 3].max()) / 1000, 2),
           "split_start_us_pct": pct(sp[:, 0]), "split_first_tile_us_pct": pct(sp[:, 1] - sp[:, 0]),
           "split_loop_us_per_tile_pct": pct((sp[full, 2] - sp[full, 1]) / max(1, til.max() - 1)),
           "split_epilogue_us_pct": pct(sp[:, 3] - sp[:, 2]), "split_end_us_pct": pct(sp[:, 3]),
           "window_start_us_pct": pct(wi[:, 0]), "window_end_us_pct": pct(wi[:, 3]),
           "programs_per_sm": np.bincount(sm.reshape(-1), minlength=132).tolist()}
    counts = np.bincount(sm.reshape(-1), minlength=132)
    row["programs_per_sm_min_max"] = [int(counts.min()), int(counts.max())]
    ends_by_sm = {}
    for s_, e in zip(sm.reshape(-1), t[..., 3].reshape(-1)):
        ends_by_sm[int(s_)] = max(ends_by_sm.get(int(s_), 0), int(e))
    row["sm_last_end_us_pct"] = pct(np.array(list(ends_by_sm.values())))
    print(json.dumps({k: v for k, v in row.items() if k != "programs_per_sm"}), flush=True)
    report.append(row)
    del cell, graph
    torch.cuda.empty_cache()
json.dump(report, open(sys.argv[1], "w"), indent=1)
