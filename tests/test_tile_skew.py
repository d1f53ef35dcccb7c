"""gluon_decode's tile skew (AttentionConfig.gluon_tile_skew) on the host: the alpha -> SKEW_STEP check, and
triton_ops.skewed_split_ranges (the kernel's _split_range in Python, used by bench/split_timeline.py) against a
brute-force reading of the rule: every program's dispatch tier found by enumeration, its share of the pair's tiles
proportional to its tier's weight, the ranges a partition. The kernel itself is checked on the GPU against float64
(bench/check_kernels_gpu.py, variant gluon_tile_skew=0.14) and compiled offline in tests/test_gluon_decode.py."""

from __future__ import annotations

import random

import pytest

from vllm_oscar.kernels import triton_ops
from vllm_oscar.kernels.triton_common import TILE_SKEW_MIN_TILES, TILE_SKEW_ONE, TILE_SKEW_TIERS


def brute_force_shares(n_tiles: int, nsplit: int, b: int, h: int, batch: int, hkv: int, tier_programs: int,
                       alpha_step: int) -> list[float]:
    """Each program's ideal (fractional) tile count: the pair's program q is the (b + batch (h + hkv q))-th program
    dispatched, of tier that // tier_programs, weighing ONE - step min(tier, TIERS - 1)."""
    weights = []
    for q in range(nsplit):
        tier = (b + batch * (h + hkv * q)) // tier_programs
        weights.append(TILE_SKEW_ONE.value - alpha_step * min(tier, TILE_SKEW_TIERS.value - 1))
    total = sum(weights)
    return [n_tiles * w / total for w in weights]


def test_alpha_to_step() -> None:
    assert triton_ops.tile_skew_step(triton_ops.AttentionConfig(gluon_tile_skew=0)) == 0
    assert triton_ops.tile_skew_step(triton_ops.AttentionConfig(gluon_tile_skew=0.1)) == round(0.1 * 1024)
    assert triton_ops.tile_skew_step(triton_ops.AttentionConfig()) == round(triton_ops.GLUON_TILE_SKEW * 1024)
    for bad in (0.15, -0.01):
        with pytest.raises(ValueError, match="gluon_tile_skew=.*choose 0 <= alpha < 0.1429"):
            triton_ops.tile_skew_step(triton_ops.AttentionConfig(gluon_tile_skew=bad))


@pytest.mark.parametrize("seed", range(40))
def test_skewed_ranges_follow_the_tier_weights(seed: int) -> None:
    rng = random.Random(seed)
    batch, hkv = rng.choice([1, 2, 8, 32]), rng.choice([1, 3, 8])
    nsplit = rng.randint(1, 200)
    n_tiles = rng.randint(TILE_SKEW_MIN_TILES.value * nsplit, 40 * nsplit)
    tier_programs = 4 * rng.choice([1, 66, 132])
    step = rng.randint(1, (TILE_SKEW_ONE.value - 1) // (TILE_SKEW_TIERS.value - 1))
    b, h = rng.randrange(batch), rng.randrange(hkv)
    ranges = triton_ops.skewed_split_ranges(n_tiles, nsplit, b + batch * h, batch * hkv, tier_programs, step, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == n_tiles
    assert all(lo <= hi for lo, hi in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(nsplit - 1))
    shares = brute_force_shares(n_tiles, nsplit, b, h, batch, hkv, tier_programs, step)
    for (lo, hi), share in zip(ranges, shares):
        assert abs((hi - lo) - share) < 1 + 1e-9, (lo, hi, share)
    cumulative = 0.0
    for (lo, _), share in zip(ranges, shares):  # each boundary is the floor of the ideal running sum
        assert abs(lo - cumulative) < 1, (lo, cumulative)
        cumulative += share


@pytest.mark.parametrize("n_tiles, nsplit, step", [(2043, 186, 0), (700, 186, 100), (3, 4, 100)])
def test_even_ranges_without_skew_or_with_few_tiles(n_tiles: int, nsplit: int, step: int) -> None:
    ranges = triton_ops.skewed_split_ranges(n_tiles, nsplit, 0, 8, 528, step, 2)
    per_split = max(-(-n_tiles // nsplit), 2)
    assert ranges == [(min(p * per_split, n_tiles), min((p + 1) * per_split, n_tiles)) for p in range(nsplit)]


def test_skew_moves_tiles_to_the_first_tiers() -> None:
    """Qwen3-8B 128K batch 1 on an H200 (186 splits of 2043 tiles per KV head, 528 programs a tier): tier 0 (the
    pair's programs q with h + 8 q < 528) gets more tiles than the last tier."""
    ranges = triton_ops.skewed_split_ranges(2043, 186, 0, 8, 528, round(0.1 * 1024), 2)
    counts = [hi - lo for lo, hi in ranges]
    assert sum(counts[:66]) / 66 > sum(counts[132:]) / len(counts[132:]) + 1.5
