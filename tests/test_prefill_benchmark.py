"""The prefill benchmark's pieces that run without a GPU: its flop count, its table, and that the
step it times is a valid served prefill (the Triton kernel, here under the interpreter, agrees with
the torch reference on the benchmark's own inputs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_oscar.kernels import torch_ops, triton_ops
from vllm_oscar.kernels.prefill_benchmark import attention_flops, format_prefill_table, make_prefill_case, prefill_call


def test_attention_flops_count_the_causal_pairs() -> None:
    """4 * B * Hq * D flops per (query, key) pair the bottom-right causal mask keeps."""
    batch, heads, dim = 2, 3, 8
    for prefix, chunk in ((0, 5), (7, 1), (13, 6)):
        rows = torch.arange(chunk)[:, None] + prefix
        keep = torch.arange(prefix + chunk)[None, :] <= rows
        assert attention_flops(batch, heads, dim, prefix, chunk) == 4 * batch * heads * dim * int(keep.sum())


def test_prefill_table_reports_errors_as_err() -> None:
    rows = [{"geometry": "qwen3-8b", "prefix": 4096, "chunk": 512, "batch": 1,
             "oscar": {"ms": 0.25, "TFLOPs": 80.0}, "bf16_sdpa": {"ms": 0.5, "TFLOPs": 40.0}, "bf16_over_oscar": 2.0},
            {"geometry": "smollm2-135m", "prefix": 0, "chunk": 2048, "batch": 4,
             "oscar": {"error": "RuntimeError: capture failed"}, "bf16_sdpa": {"ms": 0.1, "TFLOPs": 9.0}}]
    lines = format_prefill_table(rows).splitlines()
    assert lines[2].split() == ["qwen3-8b", "4096", "512", "1", "0.2500", "80.0", "0.5000", "40.0", "2.00"]
    assert lines[3].split() == ["smollm2-135m", "0", "2048", "4", "err", "err", "0.1000", "9.0", "err"]


@pytest.mark.parametrize("chunk_from_cache,apart", [(True, None), (False, None), (True, True)])
def test_the_timed_prefill_step_matches_the_torch_reference(chunk_from_cache, apart) -> None:
    """The benchmark's case (pages over prefix + chunk, one chunk per request; served: windows of all
    positions, the chunk read back from the caches; else windows of the cached prefix and the new rows)
    run through the Triton prefill equals the torch reference: without a pure INT2 range (prefix 0, 40)
    and with one (prefix 400), in one launch (the rule, at these sizes) or with the INT2 prefix apart."""
    config = dataclasses.replace(triton_ops.DEFAULT_PREFILL, prefill_int2_apart=apart)
    for prefix in (0, 40, 400):
        gen = torch.Generator().manual_seed(11 + prefix)
        case = make_prefill_case(2, prefix, 16, 4, 2, 64, 16, torch.device("cpu"), gen, chunk_from_cache)
        got = prefill_call(triton_ops.oscar_prefill, case, torch.full_like(case.query, float("nan")),
                           max_query_len=case.chunk, max_seq_len=prefix + case.chunk, config=config)()
        want = prefill_call(torch_ops.oscar_prefill, case, torch.empty_like(case.query))()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)  # about 1 bf16 ulp
