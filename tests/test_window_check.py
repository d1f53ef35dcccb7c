"""tests/window_check.py (no engine): it passes consistent window rows and flags a stale copy."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_oscar.config import SERVED_REFIT_ITERATIONS
from vllm_oscar.kernels import PageLayout, oscar_write

import window_check

D, HKV, HQ, BS = 64, 3, 9, 16


def _fake_worker(impl) -> SimpleNamespace:
    layer = SimpleNamespace(impl=impl)
    context = {"model.layers.0.self_attn.attn": layer}
    return SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
        static_forward_context=context)))


def _run(corrupt: bool) -> dict:
    import vllm_oscar.attention.step as backend

    torch.manual_seed(0)
    layout = PageLayout(D, D, BS, torch.float16)
    length = 3 * BS
    cache = layout.allocate(4, HKV)
    window_k = torch.zeros(4, BS, HKV, D, dtype=torch.bfloat16)
    window_v = torch.zeros_like(window_k)
    rotation = torch.linalg.qr(torch.randn(HKV, D, D))[0]
    key, value = torch.randn(length, HKV, D), torch.randn(length, HKV, D)
    slots = torch.arange(length)
    # The served quantizer (floored key refit rounds): the check must not depend on it.
    oscar_write(key, value, rotation, rotation, 0.96, 0.92, cache, layout, slots, window_k, window_v, slots,
                refit_iterations=SERVED_REFIT_ITERATIONS)
    if corrupt:  # a stale copy: block 1's window holds other tokens than its INT2 rows
        window_k[1] = window_k[2].clone()
    impl = SimpleNamespace(window_k=window_k)
    worker = _fake_worker(impl)
    decode, prefill = backend.oscar_decode, backend.oscar_prefill
    try:
        assert window_check.install(worker) == 1
        tables = torch.arange(3, dtype=torch.int32)[None]
        backend.oscar_decode(torch.randn(1, HQ, D), cache, window_k, window_v, layout, tables, tables,
                             torch.tensor([length]), 2 * BS, 2 * BS, 0.125)
    finally:
        backend.oscar_decode, backend.oscar_prefill = decode, prefill
    return window_check.report(worker)


def test_consistent_window_rows_pass():
    report = _run(corrupt=False)
    assert report["rows"] == 3 * BS and report["calls"] == 1
    assert report["stale"] == 0 and report["worst_mismatch"] < 0.05, report


def test_stale_window_copy_is_flagged():
    report = _run(corrupt=True)
    assert report["stale"] == BS, report  # exactly the 16 rows of the corrupted block
