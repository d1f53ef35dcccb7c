#!/usr/bin/env python3
"""GPU correctness of the OSCAR Triton kernels at real sizes, and CUDA-graph replay.

Checks (each prints one line and goes into the JSON report):
  write     oscar_write at real sizes vs the float64 reference of tests/kernels_reference
            (codes, scales, offsets, window rows, untouched poison) and vs the torch path
  decode    oscar_decode (both unpack modes) vs a dense float64 reference of the read rule,
            ragged batches with contexts from 1 to 32K+, fallback rows, GQA 1..16, D 64..256
  int8      the int8 key path (AttentionConfig.int8_keys, D >= 64) on pure INT2 history vs
            the dense reference with the query rounded to int8 per row
  prefill   oscar_prefill vs a dense float64 reference (causal chunk + cached prefix)
  rotate    oscar_rotate (one launch) vs float64: decode rows and prefill chunks, both directions
  rotate_write  oscar_write with a query (a layer step's first launch) vs oscar_write + oscar_rotate:
            the same cache bytes and q_rot, flag 0 and 1; q_rot vs float64
  graph     decode captured once in a CUDA graph (capture fails on any host sync), replayed
            while seq_lens, tables and queries change; each replay equals an eager call
  fold      layer steps (prefill chunks, decodes) with R_V folded into W_o, and into W_v too, against
            the unfolded step (tests/test_fold.py's checks, here on the GPU's kernels): the W_o fold
            gives the unfolded output @ R_V with every cache byte the same; the W_v fold stays within
            one bf16 rounding of the values' effect

    python bench/check_kernels_gpu.py [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE, GRID_REFIT_ITERATIONS, SERVED_REFIT_ITERATIONS  # noqa: E402
from vllm_oscar.kernels import PageLayout, page_views, torch_ops, triton_ops  # noqa: E402
from vllm_oscar.kernels.flash_plan import PrefillPlan  # noqa: E402
from vllm_oscar.kernels.triton_common import UNPACK_PORTABLE, UNPACK_PTX  # noqa: E402
from vllm_oscar.provenance import source_digest  # noqa: E402
from vllm_oscar.quant import unpack_codes  # noqa: E402

from kernels_reference import (  # noqa: E402
    check_write_case,
    int8_rounded_query,
    random_paged_state,
    rotate_and_write_case,
    write_case,
)

DEVICE = torch.device("cuda")
TOLERANCE = 1e-2  # bf16 operands and bf16 outputs


def dense_context(state, request: int, length: int, device) -> tuple:
    """float64 K, V [Hkv, length, D] of both readings and has_copy [length], on device."""
    layout = state.layout
    bs = layout.block_size
    nb = -(-length // bs)
    blocks = state.block_table[request, :nb].long()
    views = page_views(state.cache, layout)
    hkv = state.cache.shape[1]

    def deq(which: str) -> torch.Tensor:
        codes = unpack_codes(getattr(views, f"{which}_codes")[blocks]).double()  # [nb, Hkv, bs, D]
        scale = getattr(views, f"{which}_scale")[blocks].double()
        zero = getattr(views, f"{which}_offset")[blocks].double()
        g = layout.group_size
        rows = codes.reshape(*codes.shape[:-1], layout.groups, g) * scale[..., None] + zero[..., None]
        return rows.reshape(codes.shape).transpose(0, 1).reshape(hkv, nb * bs, layout.head_dim)[:, :length]

    wblocks = state.window_block_table[request, :nb].long()
    has = (wblocks >= 0).repeat_interleave(bs)[:length]
    picked = wblocks.clamp(min=0)

    def win(store: torch.Tensor) -> torch.Tensor:
        return store[picked].double().reshape(nb * bs, hkv, layout.head_dim)[:length].transpose(0, 1)

    return deq("k"), deq("v"), win(state.window_k), win(state.window_v), has


def dense_attention(q, positions, ctx, sink, recent, scale, new_k=None, new_v=None):
    """float64 attention of q [T, Hq, D] at positions [T] over ctx (+ causal new rows)."""
    k_i, v_i, k_w, v_w, has = ctx
    hkv, length = k_i.shape[0], k_i.shape[1]
    t, hq, d = q.shape
    qg = q.double().reshape(t, hkv, hq // hkv, d)
    s = torch.arange(length, device=q.device)
    use_w = (((s[None] < sink) | (s[None] > positions[:, None] - recent)) & has[None])[:, None, None, :]
    logits = torch.where(use_w, torch.einsum("thgd,hsd->thgs", qg, k_w), torch.einsum("thgd,hsd->thgs", qg, k_i))
    logits = logits.masked_fill(~(s[None] <= positions[:, None])[:, None, None, :], float("-inf"))  # causal
    if new_k is not None:
        own = torch.einsum("thgd,jhd->thgj", qg, new_k.double())
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        logits = torch.cat((logits, own.masked_fill(~causal[:, None, None], float("-inf"))), -1)
    p = torch.softmax(logits * scale, -1)
    out = torch.einsum("thgs,hsd->thgd", p[..., :length] * use_w, v_w)
    out = out + torch.einsum("thgs,hsd->thgd", p[..., :length] * ~use_w, v_i)
    if new_v is not None:
        out = out + torch.einsum("thgj,jhd->thgd", p[..., length:], new_v.double())
    return out.reshape(t, hq, d)


def to_device(state):
    for name in ("cache", "window_k", "window_v", "block_table", "window_block_table", "seq_lens"):
        setattr(state, name, getattr(state, name).to(DEVICE))
    return state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - b).norm() / b.norm())


#: Write launch variants (WriteConfig arguments): the default (clip by maximum removal, refit loop),
#: the bisection clip, the rotation on tensor cores, the refit rounds unrolled.
WRITE_VARIANTS = (dict(), dict(clip_search="bisect"), dict(rotation_precision="tf32x3"), dict(unroll_refit=True))


def check_write(report: list) -> None:
    for dim, group, bs, prerot, n in ((128, 128, 16, False, 4096), (64, 64, 16, True, 2048),
                                      (256, 128, 32, False, 1024)):
        twin = write_case(torch_ops, n, 8, dim, group, bs, torch.float16, prerot, seed=dim + n, device="cuda")
        for variant in WRITE_VARIANTS:
            t0 = time.time()
            result = write_case(triton_ops, n, 8, dim, group, bs, torch.float16, prerot, seed=dim + n, device="cuda",
                                launch=triton_ops.WriteConfig(**variant))
            check_write_case(result, prerot)
            differing = float((result[8] != twin[8]).float().mean())
            assert differing < 5e-3, f"triton {variant} vs torch cache bytes differ in {differing:.2e} of bytes"
            report.append({"check": "write", "dim": dim, "group": group, "n": n, "prerotated": prerot,
                           "config": variant, "bytes_differing_vs_torch": differing, "ok": True})
            print(f"write D={dim} G={group} N={n} prerotated={prerot} {variant}: ok (bytes differing vs torch path "
                  f"{differing:.1e}) {time.time() - t0:.1f}s", flush=True)


def check_write_rows(report: list) -> None:
    """The INT2-only launch by row programs (a captured decode step's side-stream write; WriteConfig.row_programs)
    at decode sizes: against float64 (check_write_case, refit rounds on both sides), and its bytes under the served
    refit against the full write's (one launch of 16-row programs), rotating or reading the rows a flagged first
    launch rotated (another reduction order: a tie could round either way; measured equal)."""
    for dim, group, bs, prerot, n in ((128, 128, 64, False, 1), (128, 128, 64, False, 200), (128, 128, 64, False, 8),
                                      (128, 128, 16, True, 16), (64, 64, 64, False, 8), (256, 128, 32, False, 5)):
        t0 = time.time()
        rows = write_case(triton_ops, n, 8, dim, group, bs, torch.float16, prerot, seed=dim + n, device="cuda",
                          refit_iterations=GRID_REFIT_ITERATIONS, launch=triton_ops.WriteConfig(row_programs=True),
                          int2_apart=True)
        check_write_case(rows, prerot, GRID_REFIT_ITERATIONS)
        served = [write_case(triton_ops, n, 8, dim, group, bs, torch.float16, prerot, seed=dim + n, device="cuda",
                             refit_iterations=SERVED_REFIT_ITERATIONS, int2_apart=apart,
                             launch=triton_ops.WriteConfig(row_programs=by_rows))[8]
                  for by_rows, apart in ((True, True), (True, "rotated"), (None, False))]
        differing = [float((bytes_ != served[2]).float().mean()) for bytes_ in served[:2]]
        ok = max(differing) < 1e-3
        report.append({"check": "write_rows", "dim": dim, "group": group, "n": n, "prerotated": prerot,
                       "bytes_differing_vs_full_write": differing[0],
                       "bytes_differing_vs_full_write_from_rotated": differing[1], "ok": ok})
        print(f"write_rows D={dim} G={group} N={n} prerotated={prerot}: float64 ok, bytes differing vs the full "
              f"write {differing[0]:.1e} (reading the first launch's rotated rows {differing[1]:.1e}) "
              f"{'ok' if ok else 'FAIL'} {time.time() - t0:.1f}s", flush=True)


def check_rotate_write(report: list) -> None:
    """A captured decode step's first launch (oscar_write with a query) at real sizes: the same cache bytes as
    oscar_write with the same parts and flag, the same q_rot as oscar_rotate, q_rot against float64."""
    for tokens, hkv, group, dim in ((1, 8, 4, 128), (8, 8, 4, 128), (64, 8, 4, 128), (5, 3, 3, 64), (33, 2, 8, 256)):
        for flag_value in (0, 1):
            separate, fused = (rotate_and_write_case(triton_ops, tokens, hkv, group, dim, flag_value, launch,
                                                     seed=tokens + dim, device="cuda") for launch in (False, True))
            equal = {name: bool(torch.equal(a, b))
                     for name, a, b in zip(("int2", "window_k", "window_v", "q_rot"), separate[:4], fused[:4])}
            err = rel(fused[3], fused[4])
            ok = all(equal.values()) and err < 1e-5
            report.append({"check": "rotate_write", "tokens": tokens, "hkv": hkv, "group": group, "dim": dim,
                           "flag": flag_value, "equal": equal, "q_rot_rel_err": err, "ok": ok})
            print(f"rotate_write N={tokens} Hkv={hkv} g={group} D={dim} flag={flag_value}: equal {equal}, q_rot rel "
                  f"err {err:.2e} {'ok' if ok else 'FAIL'}", flush=True)


def check_rotate(report: list) -> None:
    """The one-launch rotation at real sizes against float64: decode rows and prefill chunks, GQA 1-8,
    D 64-256, both directions, into a bf16 view (the layer's output) and into fp32 (the query)."""
    gen = torch.Generator().manual_seed(5)
    for n, hq, hkv, dim in ((1, 32, 8, 128), (64, 32, 8, 128), (4096, 32, 8, 128), (7, 9, 3, 64), (300, 16, 2, 256)):
        rotation = torch.linalg.qr(torch.randn(hkv, dim, dim, generator=gen, dtype=torch.float64))[0].float().cuda()
        x = torch.randn(n, hq, dim, generator=gen).cuda()
        x[:, :, 5] *= 50.0  # an outlier channel
        for inverse, out_dtype in ((False, torch.float32), (True, torch.bfloat16)):
            matrix = rotation.double().transpose(-1, -2) if inverse else rotation.double()
            source = x if inverse else x.to(torch.bfloat16)  # the query arrives in bf16, out_rot in fp32
            expected = torch.einsum("nhd,hde->nhe", source.double(), matrix.repeat_interleave(hq // hkv, dim=0))
            output = torch.full((n + 3, hq, dim), float("nan"), dtype=out_dtype, device="cuda")
            triton_ops.oscar_rotate(source, rotation, inverse=inverse, out=output[:n])
            err = rel(output[:n], expected)
            untouched = bool(torch.isnan(output[n:].float()).all())
            ok = err < (1e-5 if out_dtype == torch.float32 else 5e-3) and untouched  # tf32x3: about fp32
            report.append({"check": "rotate", "n": n, "hq": hq, "hkv": hkv, "dim": dim, "inverse": inverse,
                           "rel_err": err, "rows_after_n_untouched": untouched, "ok": ok})
            print(f"rotate N={n} Hq={hq} Hkv={hkv} D={dim} inverse={inverse}: rel err {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)


DECODE_CASES = [
    # (name, lens, Hq, Hkv, D, G, bs, drop)
    ("qwen3-8b ragged 32K..1", [32773, 4100, 300, 70, 1], 32, 8, 128, 128, 16, 1),
    ("smollm2 gqa3 bs32", [20000, 777, 321], 9, 3, 64, 64, 32, 0),
    ("gqa8 D256 G128 bs64", [5000, 65], 16, 2, 256, 128, 64, 1),
    ("gqa16 D128 G32 bs128", [9000], 16, 1, 128, 32, 128, 0),
    ("mha D128 bs16", [3000, 2], 4, 4, 128, 128, 16, 0),
    ("gqa8 D256 G=D bs16", [6000, 333], 16, 2, 256, 256, 16, 1),
    ("qwen3-8b bs64", [40000, 5000, 70], 32, 8, 128, 128, 64, 1),
    ("smollm2 gqa3 bs64", [20000, 777, 70], 9, 3, 64, 64, 64, 1),
    ("gqa2 D128 bs64", [9000, 300], 8, 4, 128, 128, 64, 1),
    # 320 (request, KV head) pairs and 469 tiles: gluon_decode's staged tiles in two waves of 13 splits (H200)
    ("qwen3-8b bs64 B=40", [30000, 12000, 5000, 700, 70] + [300 + 17 * i for i in range(35)], 32, 8, 128, 128, 64, 1),
    # batch 1 at 64K: a small merge whose splits walk 6 tiles, so gluon_decode stages by default (session 29)
    ("qwen3-8b bs64 B=1 64K", [65600], 32, 8, 128, 128, 64, 1),
    # batch 1 at 16K: with cuda_graph=True (TMA copies) staged splits of >= 4 tiles; unstaged 2-tile splits otherwise
    ("qwen3-8b bs64 B=1 16K", [16400], 32, 8, 128, 128, 64, 1),
    # 8 requests at 4K, head_dim 64: a merge that is not small, whose splits walk at least
    # triton_ops.GLUON_MIN_SPLIT_TILES tiles (session 34)
    ("smollm2 bs64 B=8 4K", [4100, 4000, 3100, 2050, 700, 321, 70, 1], 9, 3, 64, 64, 64, 1),
    # small merges at head_dim 64 (batch 1 and 2), splits of GLUON_MIN_SPLIT_TILES tiles (session 35)
    ("smollm2 bs64 B=1 32K", [32800], 9, 3, 64, 64, 64, 1),
    ("smollm2 bs64 B=2 16K", [16400, 9000], 9, 3, 64, 64, 64, 1),
    # up to 4K at head_dim 128: with cuda_graph=True int2_split_kernel's TMA tile loads, ragged (session 35)
    ("qwen3-8b bs64 B=4 4K", [4096, 4000, 2050, 70], 32, 8, 128, 128, 64, 1),
]


#: Launch variants each decode case runs (AttentionConfig arguments).
DECODE_VARIANTS = (dict(unpack=UNPACK_PTX, block_t=64, split_warps=2),
                   dict(unpack=UNPACK_PTX, block_t=128, split_warps=2),
                   dict(unpack=UNPACK_PTX, block_t=64, split_warps=1),
                   dict(unpack=UNPACK_PTX, block_t=128, split_warps=1),
                   dict(unpack=UNPACK_PORTABLE, block_t=32, split_warps=2),
                   dict(unpack=UNPACK_PTX, block_t=64, tokens_on_m=False),
                   dict(unpack=UNPACK_PTX, prefetch=1), dict(unpack=UNPACK_PTX, block_t=32, prefetch=2),
                   dict(unpack=UNPACK_PTX, window_block_t=64, merge_block_d=32),
                   dict(unpack=UNPACK_PTX, windows_first=True, programs_per_sm=24),
                   dict(unpack=UNPACK_PTX, full_tiles=False), dict(unpack=UNPACK_PTX, block_t=32, full_tiles=False),
                   dict(unpack=UNPACK_PTX, merge_pdl=False), dict(unpack=UNPACK_PTX, block_t=16, tma_stages=2),
                   dict(unpack=UNPACK_PTX, num_splits=1), dict(unpack=UNPACK_PORTABLE, num_splits=1))
#: --quick: the default launch config on the cases whose INT2 part runs in the split kernel (G = D),
#: the L2 prefetch variant, the window-tile / merge-block knobs, window programs first with two waves,
#: masked tiles instead of the default whole-tile splits (full_tiles=False), the merge launched without
#: programmatic dependent launch (merge_pdl=False; the default uses it on Hopper), TMA tile loads (16-position
#: tiles, which every block size here holds whole) and, at blocks of 64, TMA loads of the default 64-position tile
#: and int2_split_kernel where the default runs gluon_decode's kernel (gluon_splits=False: blocks of 64), and a
#: fixed 384 splits (most of them empty: the merge's widest partial lists), and gluon_decode's tiles staged in shared
#: memory by cp.async or not (gluon_copy_stages 0, 2, 3: the default stages where staging_pays; 2 and 3 are skipped
#: where gluon_decode does not run), and one split per (request, KV head) (the longest accumulation: 4.4e-2 at 30000
#: positions before the fold of the BIAS sums, bench/split_error.py), and gluon_decode's fp16 V operands
#: (gluon_f16_values: staged by default, unstaged, and in one split; skipped where gluon_decode does not run), and its
#: window programs' L2 prefetch of their V rows wherever gluon_decode runs (gluon_window_prefetch; default: batch 1),
#: and its staged tiles copied by TMA (gluon_copy_tma: refused where gluon_decode does not stage), and the default
#: plan of a launch that may be captured (cuda_graph=True: TMA copies where they pay, batch-1 plans then staged with
#: splits of >= triton_ops.STAGED_MIN_SPLIT_TILES tiles).
QUICK_VARIANTS = (dict(unpack=UNPACK_PTX), dict(unpack=UNPACK_PORTABLE), dict(unpack=UNPACK_PTX, prefetch=2),
                  dict(unpack=UNPACK_PTX, window_block_t=64, merge_block_d=32),
                  dict(unpack=UNPACK_PTX, window_block_t=16, merge_block_d=16),
                  dict(unpack=UNPACK_PTX, windows_first=True, programs_per_sm=24),
                  dict(unpack=UNPACK_PTX, full_tiles=False), dict(unpack=UNPACK_PTX, merge_pdl=False),
                  dict(unpack=UNPACK_PTX, block_t=16, tma_stages=2), dict(unpack=UNPACK_PTX, tma_stages=3),
                  dict(unpack=UNPACK_PTX, gluon_splits=False), dict(unpack=UNPACK_PTX, num_splits=384),
                  *(dict(unpack=UNPACK_PTX, gluon_copy_stages=stages) for stages in (0, *triton_ops.GLUON_COPY_STAGES)),
                  dict(unpack=UNPACK_PTX, num_splits=1),
                  dict(unpack=UNPACK_PTX, gluon_f16_values=True),
                  dict(unpack=UNPACK_PTX, gluon_f16_values=True, gluon_copy_stages=0),
                  dict(unpack=UNPACK_PTX, gluon_f16_values=True, num_splits=1),
                  dict(unpack=UNPACK_PTX, gluon_window_prefetch=True),
                  dict(unpack=UNPACK_PTX, gluon_copy_tma=True, gluon_copy_stages=2),
                  dict(unpack=UNPACK_PTX, gluon_copy_tma=True, gluon_copy_stages=3),
                  dict(unpack=UNPACK_PTX, cuda_graph=True))



#: The launch knobs oscar_decode refuses (ValueError "<knob>=<value> needs ...") where they do not apply: TMA tile
#: loads need one group per row and whole tiles (not G < D), staging and fp16 V operands need gluon_decode's kernel.
VARIANTS_REFUSED = ("gluon_copy_stages=", "tma_stages=", "gluon_f16_values=", "gluon_window_prefetch=",
                    "gluon_copy_tma=")


def check_decode(report: list, quick: bool = False, with_knob: str | None = None, case: str | None = None) -> None:
    """Every decode case against float64, in each launch variant (QUICK_VARIANTS with quick, else DECODE_VARIANTS);
    with_knob: only the variants that set that AttentionConfig field (e.g. gluon_copy_stages), to fit a call; case:
    only the cases whose name contains this."""
    sink, recent = 64, 256
    for name, lens, hq, hkv, dim, group, bs, drop in DECODE_CASES:
        if (quick and group != dim) or (case is not None and case not in name):
            continue
        gen = torch.Generator().manual_seed(sum(lens))
        layout = PageLayout(dim, group, bs, torch.float16)
        state = to_device(random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=drop))
        query = torch.randn(len(lens), hq, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
        scale = 1 / math.sqrt(dim)
        expected = torch.stack([
            dense_attention(query[b : b + 1], torch.tensor([n - 1], device=DEVICE),
                            dense_context(state, b, n, DEVICE), sink, recent, scale)[0]
            for b, n in enumerate(lens)])
        for variant in QUICK_VARIANTS if quick else DECODE_VARIANTS:
            if with_knob is not None and with_knob not in variant:
                continue
            if variant.get("tma_stages") and bs % variant.get("block_t", triton_ops.DECODE_BLOCK_T):
                continue  # TMA tiles need blocks that hold whole tiles (oscar_decode would raise)
            out = torch.full_like(query, float("nan"))
            config = triton_ops.AttentionConfig(**variant)
            try:
                triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                        state.window_block_table, state.seq_lens, sink, recent, scale, out=out,
                                        max_seq_len=max(lens), config=config)
            except ValueError as error:  # a knob refused for this case by its documented rule, not a failure
                if not str(error).startswith(VARIANTS_REFUSED):
                    raise
                print(f"decode {name} {variant}: skipped ({str(error).split(' ')[0]} does not apply to this case)",
                      flush=True)
                continue
            errors = [rel(out[b], expected[b]) for b in range(len(lens))]
            ok = max(errors) < TOLERANCE
            splits = triton_ops.decode_split_count(query, state.cache, state.window_k, state.window_v, layout,
                                                   state.block_table, state.window_block_table, state.seq_lens, sink,
                                                   recent, scale, max(lens), config)
            report.append({"check": "decode", "case": name, "config": variant, "splits": splits, "rel_errors": errors,
                           "ok": ok})
            print(f"decode {name} {variant}: {splits} splits, max rel err {max(errors):.2e} {'ok' if ok else 'FAIL'}",
                  flush=True)
        if with_knob is not None:
            continue  # the two checks below set no launch variant
        # long_splits (opt-in) with a low long-split threshold, so that the long pairs of these cases use the
        # extended grid and the short ones the one-wave count (docs/decisions.md K1).
        threshold, triton_ops.LONG_SPLIT_TILES = triton_ops.LONG_SPLIT_TILES, 2
        try:
            out = torch.full_like(query, float("nan"))
            triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                    state.window_block_table, state.seq_lens, sink, recent, scale, out=out,
                                    max_seq_len=max(lens), config=triton_ops.AttentionConfig(long_splits=True))
        finally:
            triton_ops.LONG_SPLIT_TILES = threshold
        errors = [rel(out[b], expected[b]) for b in range(len(lens))]
        ok = max(errors) < TOLERANCE
        report.append({"check": "decode_long_splits", "case": name, "rel_errors": errors, "ok": ok})
        print(f"decode {name} long_splits: max rel err {max(errors):.2e} {'ok' if ok else 'FAIL'}", flush=True)
        # Splits sized for a context 8x longer (a captured graph's max_model_len): most splits stay empty.
        out = torch.full_like(query, float("nan"))
        triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                state.window_block_table, state.seq_lens, sink, recent, scale, out=out,
                                max_seq_len=8 * max(lens))
        errors = [rel(out[b], expected[b]) for b in range(len(lens))]
        ok = max(errors) < TOLERANCE
        report.append({"check": "decode_long_plan", "case": name, "rel_errors": errors, "ok": ok})
        print(f"decode {name} planned for {8 * max(lens)} positions: max rel err {max(errors):.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)


def check_decode_int8_keys(report: list) -> None:
    """AttentionConfig.int8_keys on pure INT2 history (no windows: the window programs keep the
    bf16 query) against the dense float64 reference with the query rounded to int8 per row."""
    for name, lens, hq, hkv, dim, group, bs, drop in DECODE_CASES:
        if group != dim or dim < triton_ops.INT8_MMA_MIN_HEAD_DIM:
            continue
        gen = torch.Generator().manual_seed(sum(lens) + 1)
        layout = PageLayout(dim, group, bs, torch.float16)
        state = to_device(random_paged_state(lens, hkv, layout, 0, 0, gen))
        query = (3.0 * torch.randn(len(lens), hq, dim, generator=gen)).to(torch.bfloat16).to(DEVICE)
        scale = 1 / math.sqrt(dim)
        rounded = int8_rounded_query(query).to(DEVICE)
        expected = torch.stack([
            dense_attention(rounded[b : b + 1], torch.tensor([n - 1], device=DEVICE),
                            dense_context(state, b, n, DEVICE), 0, 0, scale)[0]
            for b, n in enumerate(lens)])
        # int2_split_kernel and, at blocks of 64, gluon_decode (the default, gluon_splits=None)
        for variant in (dict(int8_keys=True, prefetch=0), dict(int8_keys=True, prefetch=2), dict(int8_keys=True)):
            out = torch.full_like(query, float("nan"))
            triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                    state.window_block_table, state.seq_lens, 0, 0, scale, out=out,
                                    max_seq_len=max(lens), config=triton_ops.AttentionConfig(**variant))
            errors = [rel(out[b], expected[b]) for b in range(len(lens))]
            ok = max(errors) < TOLERANCE
            report.append({"check": "decode_int8_keys", "case": name, "config": variant, "rel_errors": errors,
                           "ok": ok})
            print(f"decode int8 keys {name} {variant}: max rel err {max(errors):.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)


def check_prefill(report: list) -> None:
    sink, recent, hq, hkv, dim, bs = 64, 256, 32, 8, 128, 16
    chunks, lens = [512, 300, 1, 0], [8704, 300, 2001, 50]
    gen = torch.Generator().manual_seed(5)
    layout = PageLayout(dim, dim, bs, torch.float16)
    state = to_device(random_paged_state(lens, hkv, layout, sink, recent, gen, drop_window_blocks=1))
    qsl = [0]
    for c in chunks:
        qsl.append(qsl[-1] + c)
    total = qsl[-1]
    q = torch.randn(total, hq, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = torch.randn(total, hkv, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(total, hkv, dim, generator=gen).to(torch.bfloat16).to(DEVICE)
    scale = 1 / math.sqrt(dim)
    variants = ((UNPACK_PTX, 64, 1, None), (UNPACK_PORTABLE, 64, 1, None), (UNPACK_PTX, 128, 1, None),
                (UNPACK_PTX, 64, 4, None), (UNPACK_PTX, 64, None, None), (UNPACK_PTX, 64, 1, False),
                (UNPACK_PTX, 64, 4, False))
    for mode, rows, splits, apart in variants:
        out = torch.full_like(q, float("nan"))
        config = triton_ops.AttentionConfig(block_t=32, num_warps=4, num_stages=1, unpack=mode, prefill_rows=rows,
                                            prefill_splits=splits, prefill_int2_apart=apart)
        triton_ops.oscar_prefill(q, k, v, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                 state.window_block_table, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                                 state.seq_lens, sink, recent, scale, out=out, max_query_len=max(chunks),
                                 config=config)
        errors = []
        for b, n in enumerate(lens):
            lo, hi = qsl[b], qsl[b + 1]
            if hi == lo:
                continue
            prefix = n - (hi - lo)
            ctx = dense_context(state, b, prefix, DEVICE)
            exp = dense_attention(q[lo:hi], torch.arange(prefix, n, device=DEVICE), ctx, sink, recent, scale,
                                  k[lo:hi], v[lo:hi])
            errors.append(rel(out[lo:hi], exp))
        ok = max(errors) < TOLERANCE
        report.append({"check": "prefill", "unpack": mode, "prefill_rows": rows, "prefill_splits": splits,
                       "prefill_int2_apart": apart, "rel_errors": errors, "ok": ok})
        print(f"prefill chunks {chunks} unpack={mode} rows={rows} splits={splits} apart={apart}: "
              f"max rel err {max(errors):.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    # chunk_from_cache: the chunk is read from the caches by the rule (as decoding would), by FlashAttention over
    # gathered rows (flash_prefill; the default on large calls) with its ranges planned on the host as the served
    # step plans them (planned) or read by the call, and by the Triton prefill kernel.
    # split: the far positions every row sees in key segments (prefill_flash_split; 2 segments for request 0 here).
    for flash, planned, split in ((True, True, False), (True, False, False), (True, True, True),
                                  (False, False, False)):
        out = torch.full_like(q, float("nan"))
        plan = PrefillPlan.of(qsl, lens, recent, DEVICE) if planned else None
        config = dataclasses.replace(triton_ops.DEFAULT_PREFILL, prefill_flash=flash, prefill_flash_split=split)
        triton_ops.oscar_prefill(q, None, None, state.cache, state.window_k, state.window_v, layout,
                                 state.block_table, state.window_block_table,
                                 torch.tensor(qsl, dtype=torch.int32, device=DEVICE), state.seq_lens, sink, recent,
                                 scale, out=out, max_query_len=max(chunks), chunk_from_cache=True, config=config,
                                 flash_plan=plan)
        errors = []
        for b, n in enumerate(lens):
            lo, hi = qsl[b], qsl[b + 1]
            if hi == lo:
                continue
            exp = dense_attention(q[lo:hi], torch.arange(n - (hi - lo), n, device=DEVICE),
                                  dense_context(state, b, n, DEVICE), sink, recent, scale)
            errors.append(rel(out[lo:hi], exp))
        ok = max(errors) < TOLERANCE
        report.append({"check": "prefill_chunk_from_cache", "prefill_flash": flash, "planned": planned,
                       "split": split, "rel_errors": errors, "ok": ok})
        print(f"prefill chunk_from_cache prefill_flash={flash} planned={planned} split={split}: max rel err "
              f"{max(errors):.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)


def check_graph(report: list) -> None:
    """Capture decode once; replay with new lengths/tables/queries; compare with eager calls of the same
    config (bit for bit); with the merge launched programmatically dependent and not, at vLLM's blocks of
    16 (pointer loads) and OSCAR's blocks of 64 (TMA tile loads where the GPU has them), and with gluon_decode's
    staged tiles, which a captured launch copies by TMA (gluon_copy_tma None)."""
    for bs in (16, GPU_DECODE_BLOCK_SIZE):
        for merge_pdl in (False, True):
            _check_graph(report, triton_ops.AttentionConfig(merge_pdl=merge_pdl), bs)
        _check_graph(report, triton_ops.AttentionConfig(cuda_graph=True), bs)  # the served capture: TMA at 64
    _check_graph(report, triton_ops.AttentionConfig(cuda_graph=True, gluon_copy_stages=2), GPU_DECODE_BLOCK_SIZE)


def _check_graph(report: list, config, bs: int) -> None:
    sink, recent, hq, hkv, dim = 64, 256, 32, 8, 128
    max_len = 40000
    gen = torch.Generator().manual_seed(9)
    layout = PageLayout(dim, dim, bs, torch.float16)
    lens0 = [30000, 500, 70, 3]
    state = to_device(random_paged_state([max_len] * 4, hkv, layout, sink, recent, gen))
    # Static inputs the graph reads; their contents change between replays.
    seq = torch.tensor(lens0, dtype=torch.int32, device=DEVICE)
    wtable = state.window_block_table.clone()
    query = torch.randn(4, hq, dim, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    scale = 1 / math.sqrt(dim)

    def step():
        triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout, state.block_table,
                                wtable, seq, sink, recent, scale, out=out, max_seq_len=max_len, config=config)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises on any host synchronisation inside
        step()
    worst = 0.0
    for i in range(6):
        lens = [min(max_len, n + 977 * i + i) for n in lens0]
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        wtable.copy_(state.window_block_table)
        wtable[torch.rand(wtable.shape, device=DEVICE) < 0.05] = -1  # some fallback rows
        query.copy_(torch.randn(4, hq, dim, device=DEVICE))
        graph.replay()
        replayed = out.clone()
        eager = triton_ops.oscar_decode(query, state.cache, state.window_k, state.window_v, layout,
                                        state.block_table, wtable, seq, sink, recent, scale, max_seq_len=max_len,
                                        config=config)
        worst = max(worst, float((replayed.float() - eager.float()).abs().max()))
    ok = worst == 0.0
    report.append({"check": "graph", "block_size": bs, "merge_pdl": config.merge_pdl, "cuda_graph": config.cuda_graph,
                   "gluon_copy_stages": config.gluon_copy_stages, "max_abs_diff_replay_vs_eager": worst, "ok": ok})
    print(f"graph (blocks of {bs}, merge_pdl={config.merge_pdl}, cuda_graph={config.cuda_graph}, "
          f"gluon_copy_stages={config.gluon_copy_stages}): 6 replays with changing lengths/tables/queries, "
          f"max |replay - eager| = {worst:.1e} "
          f"{'ok' if ok else 'FAIL'}", flush=True)


def check_fold(report: list) -> None:
    """tests/test_fold.py's fold checks on the GPU (the decode then writes the model's bf16 rows from float32
    rotated queries, as a folded layer's step does)."""
    import test_fold

    gaps, caches_equal = test_fold.output_fold_gaps(DEVICE)
    ok = max(gaps) < 2.0 ** -7 and caches_equal
    report.append({"check": "fold_output", "rel_gaps": gaps, "caches_equal": caches_equal, "ok": ok})
    print(f"fold output: max rel gap to the unfolded output @ R_V {max(gaps):.2e}, caches equal {caches_equal} "
          f"{'ok' if ok else 'FAIL'}", flush=True)
    gaps, yardstick = test_fold.value_fold_gaps(DEVICE)
    ok = 0 < sum(yardstick) and sum(gaps) < 2 * sum(yardstick)
    report.append({"check": "fold_value_and_output", "rel_gaps": gaps, "yardstick": yardstick, "ok": ok})
    print(f"fold value_and_output: mean rel gap {sum(gaps) / len(gaps):.2e}, one bf16 rounding of the values "
          f"{sum(yardstick) / len(yardstick):.2e} {'ok' if ok else 'FAIL'}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--only", nargs="*",
                        default=["graph", "prefill", "write", "write_rows", "decode", "int8", "rotate", "rotate_write",
                                 "fold"])
    parser.add_argument("--quick", action="store_true",
                        help="decode: only the default launch config (both unpack paths) on the G = D cases")
    parser.add_argument("--with-knob", metavar="FIELD",
                        help="decode: only the launch variants that set this AttentionConfig field (e.g. "
                             "gluon_copy_stages with --quick)")
    parser.add_argument("--case", help="decode: only the cases whose name contains this (e.g. 'B=40')")
    args = parser.parse_args()
    report: list = []
    failures = 0
    for name in args.only:
        try:
            if name == "decode":
                check_decode(report, args.quick, args.with_knob, args.case)
            else:
                {"write": check_write, "write_rows": check_write_rows, "prefill": check_prefill, "graph": check_graph,
                 "int8": check_decode_int8_keys, "rotate": check_rotate, "rotate_write": check_rotate_write,
                 "fold": check_fold}[name](report)
        except Exception as error:  # keep going: one broken check must not hide the others
            failures += 1
            report.append({"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"})
            print(f"{name}: ERROR {type(error).__name__}: {error}", flush=True)
    failures += sum(1 for r in report if not r.get("ok", False) and "error" not in r)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "source_digest": source_digest(), "checks": report},
                      handle, indent=1)
    print(f"{'ALL OK' if failures == 0 else f'{failures} FAILURES'}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
