"""Triton kernel: per-head rotation of rows in one launch, ``out[n, h] = x[n, h] @ M[h // g]``.

Used on CUDA for the query before attention (M = R_K, fp32 out) and for the attention output
after it (M = R_V^T, written straight into the layer's output in its dtype), replacing the
torch path's dtype conversions, transposing copies and batched matmul (7 launches per layer
step with the output copy; docs/decisions.md R1).

Grid (cdiv(N * g, BLOCK_M), Hr, D / BLOCK_C). Program (m, r, c) takes BLOCK_M of the N x g rows
that use rotation r (row i: token i // g, head r * g + i % g) and output columns
[c * BLOCK_C, (c + 1) * BLOCK_C), K-tiled:

    acc [BLOCK_M, BLOCK_C] fp32 += x[rows, k0:k0+BLOCK_K] (fp32) @ M[r][k0:k0+BLOCK_K, cols] (fp32)

with M = R, or M = R^T when INVERSE: then the tile of R [cols, k] is loaded along R's rows (unit
stride, coalesced) and transposed in registers, so R^T is never materialised. Layouts: x [N, H, D]
and out [N, H, D] with unit stride on D; rotation [Hr, D, D] fp32, unit stride on its last dim.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def rotate_rows_block(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, out_ptr, stride_on, stride_oh,
                      n_tokens, pid_m, r, pid_c, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, INVERSE: tl.constexpr, PRECISION: tl.constexpr):
    """Program (pid_m, r, pid_c) of rotate_rows_kernel's grid (module docstring); also run by
    triton_rotate_write's kernel."""
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    flat = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    token = flat // GROUP
    head = r * GROUP + flat % GROUP
    row_ok = token < n_tokens
    x_rows = x_ptr + token.to(tl.int64)[:, None] * stride_xn + head[:, None] * stride_xh
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        if INVERSE:  # M[k, c] = R[c, k]
            m = tl.trans(tl.load(r_ptr + r * stride_rh + cols[:, None] * stride_rr + ks[None, :]))
        else:
            m = tl.load(r_ptr + r * stride_rh + ks[:, None] * stride_rr + cols[None, :])
        acc = tl.dot(x, m.to(tl.float32), acc, input_precision=PRECISION)
    out_rows = out_ptr + token.to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh
    tl.store(out_rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def rotate_rows_kernel(
    x_ptr, stride_xn, stride_xh,
    r_ptr, stride_rh, stride_rr,
    out_ptr, stride_on, stride_oh,
    n_tokens,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr, INVERSE: tl.constexpr, PRECISION: tl.constexpr, WAIT_PRIOR: tl.constexpr = False,
):
    """WAIT_PRIOR (a launch with programmatic dependent launch): wait for the kernel before it to finish first."""
    if WAIT_PRIOR:
        gdc_wait()
    rotate_rows_block(x_ptr, stride_xn, stride_xh, r_ptr, stride_rh, stride_rr, out_ptr, stride_on, stride_oh,
                      n_tokens, tl.program_id(0), tl.program_id(1), tl.program_id(2), GROUP, D, BLOCK_M, BLOCK_K,
                      BLOCK_C, INVERSE, PRECISION)
