"""Paged BF16 split-K decode in Triton: the same-family baseline of the benchmark.

Same structure as the OSCAR decode (triton_attention): one program per (split, request,
KV head) with the GQA group as the rows of a tl.dot tile, BLOCK_T positions per step,
online softmax in base 2, partials merged by triton_attention.merge_kernel. The only
difference is what it reads: plain BF16 K/V rows from a paged cache
``[num_blocks, block_size, Hkv, D]`` (vLLM's NHD page layout). Not used by the backend.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from vllm_oscar.intmath import next_power_of_2
from vllm_oscar.kernels.triton_attention import LOG2E, merge_kernel
from vllm_oscar.kernels.triton_ops import decode_splits


@triton.jit
def bf16_decode_kernel(
    q_ptr, stride_qb, stride_qh,
    k_ptr, v_ptr, stride_c0, stride_c1, stride_c2,
    bt_ptr, stride_bt, seq_ptr,
    part_ptr, stride_pb, stride_ph, stride_ps, lse_ptr, stride_lb, stride_lh,
    qk_scale,
    GROUP: tl.constexpr, GP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_T: tl.constexpr, NSPLIT: tl.constexpr,
):
    """Partial attention of split ``program_id(0)`` over the request's positions."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    length = tl.load(seq_ptr + b)
    rows = tl.arange(0, M)
    row_ok = (rows < GP) & (rows < GROUP)
    head = h * GROUP + rows
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + cols[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
    n_tiles = tl.cdiv(length, BLOCK_T)
    per_split = tl.cdiv(n_tiles, NSPLIT)
    lo = tl.minimum(pid * per_split, n_tiles)
    hi = tl.minimum(lo + per_split, n_tiles)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    offs = tl.arange(0, BLOCK_T)
    for i in range(lo, hi):
        s = i * BLOCK_T + offs
        ok = s < length
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + s // BS, mask=ok, other=0).to(tl.int64)
        row = blk * stride_c0 + (s % BS) * stride_c1 + h * stride_c2
        k = tl.load(k_ptr + row[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        logits = tl.dot(q, tl.trans(k)) * qk_scale
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(logits - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        v = tl.load(v_ptr + row[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
    out = acc * tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
    tl.store(part_ptr + b.to(tl.int64) * stride_pb + head[:, None] * stride_ph + pid * stride_ps + cols[None, :],
             out, mask=row_ok[:, None])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + pid, lse, mask=row_ok)


def bf16_paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    max_seq_len: int,
    out: Optional[torch.Tensor] = None,
    block_t: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Decode query [B, Hq, D] (bf16) over paged BF16 K/V [num_blocks, bs, Hkv, D] -> [B, Hq, D]."""
    batch, hq, d = query.shape
    _, bs, hkv, _ = k_cache.shape
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or hq % hkv:
        raise ValueError("k_cache/v_cache must share strides with a contiguous last dim; Hq must be a multiple of Hkv.")
    out = torch.empty_like(query) if out is None else out
    nsplit = decode_splits(batch, hkv, max_seq_len, block_t, query.device)
    part = torch.empty(batch, hq, nsplit, d, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, hq, nsplit, dtype=torch.float32, device=query.device)
    group = hq // hkv
    gp = next_power_of_2(group)
    bf16_decode_kernel[(nsplit, batch, hkv)](
        query, query.stride(0), query.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), seq_lens,
        part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1),
        softmax_scale * LOG2E,
        GROUP=group, GP=gp, M=max(16, gp), D=d, BS=bs, BLOCK_T=block_t, NSPLIT=nsplit,
        num_warps=num_warps, num_stages=num_stages,
    )
    merge_kernel[(batch, hq)](
        part, part.stride(0), part.stride(1), part.stride(2), lse, lse.stride(0), lse.stride(1),
        out, out.stride(0), out.stride(1), NS=nsplit, NSP=next_power_of_2(nsplit), D=d, EMU=False,
    )
    return out
