"""CPU-checkable parts of the decode benchmark: window bookkeeping, byte counts, CLI guard."""

from __future__ import annotations

import pytest
import torch

from vllm_oscar.cli import main
from vllm_oscar.kernels.benchmark import bf16_bytes, window_blocks


@pytest.mark.parametrize("length,bs,sink,recent", [(1, 16, 64, 256), (100, 16, 64, 256), (5000, 16, 64, 256),
                                                   (77, 8, 5, 7), (320, 32, 64, 256)])
def test_window_blocks_are_exactly_the_blocks_holding_window_positions(length, bs, sink, recent) -> None:
    expected = sorted({s // bs for s in range(length) if s < sink or s > length - 1 - recent})
    assert window_blocks(length, bs, sink, recent) == expected


def test_bf16_bytes_counts_k_v_query_and_output() -> None:
    # B=2, L=10, Hkv=3, Hq=6, D=8: K+V = 2*10*3*2*8*2 bytes, q and out = 2 * 2*6*8*2 bytes
    assert bf16_bytes(2, 10, 3, 6, 8) == 2 * 10 * 3 * 2 * 8 * 2 + 2 * 2 * 6 * 8 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_bench_without_gpu_says_so(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "decode"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
