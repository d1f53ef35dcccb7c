"""Reference math: Hadamard, rotations, clipping, INT2 quantizer, packing, bits.

Independent references here are float64 formulas written out in the test (not the
module's helpers) on fresh random data with planted outlier channels.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_oscar.config import DEFAULT_CLIP_RATIO_K, LLOYD_MAX_BOUNDARY, OscarConfig, refit_pair
from vllm_oscar.quant import (
    bit_reversal_permutation,
    bits_per_element,
    body_bits_per_element,
    clip_rows,
    dequantize,
    fast_hadamard_transform,
    hadamard_matrix,
    orthogonality_error,
    pack_codes,
    quantize,
    rotation_from_covariance,
    row_bytes,
    unpack_codes,
)

DIMS = [8, 16, 64, 128, 256]


def rows_with_outliers(n: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows with a few channels 20x larger (the outliers that break INT2)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    outliers = torch.randperm(dim, generator=gen)[: max(1, dim // 32)]
    rows[:, outliers] *= 20.0
    return rows.to(dtype)


def brute_hadamard(dim: int) -> torch.Tensor:
    """Sylvester recursion H_{2n} = [[H, H], [H, -H]], normalised, in float64."""
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < dim:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(dim)


@pytest.mark.parametrize("dim", DIMS)
def test_hadamard_matches_sylvester_and_is_orthogonal(dim: int) -> None:
    matrix = hadamard_matrix(dim, torch.float64)
    assert torch.equal(matrix, brute_hadamard(dim))
    assert orthogonality_error(hadamard_matrix(dim, torch.float32)) < 1e-5


@pytest.mark.parametrize("dim", DIMS)
def test_fast_transform_equals_matrix_product(dim: int) -> None:
    rows = rows_with_outliers(7, dim, seed=dim, dtype=torch.float64).reshape(7, 1, dim)
    expected = rows @ brute_hadamard(dim)
    assert torch.allclose(fast_hadamard_transform(rows), expected, atol=1e-12)


def test_bit_reversal_is_an_involution_spreading_tiers() -> None:
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    for dim in DIMS:
        perm = bit_reversal_permutation(dim)
        assert torch.equal(perm[perm], torch.arange(dim))
        # Rank r goes to channel perm[r]: each block of G channels holds one rank per tier.
        for group in (4, 8):
            if group > dim:
                continue
            rank_in_channel = torch.empty(dim, dtype=torch.long)
            rank_in_channel[perm] = torch.arange(dim)
            tiers = rank_in_channel.reshape(dim // group, group) // (dim // group)
            assert torch.equal(tiers.sort(dim=1).values, torch.arange(group).expand_as(tiers))


def random_spd(dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    return basis @ basis.T / dim + 1e-3 * torch.eye(dim, dtype=torch.float64)


@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("hadamard,bitrev", [(True, True), (False, True), (True, False), (False, False)])
def test_rotation_composition_follows_the_formula(dim: int, hadamard: bool, bitrev: bool) -> None:
    covariance = random_spd(dim, seed=dim)
    rotation, eigenvalues = rotation_from_covariance(covariance, hadamard, bitrev)
    assert orthogonality_error(rotation.float()) < 1e-5
    assert torch.all(eigenvalues[:-1] >= eigenvalues[1:])
    # Independent composition: eigenvectors sorted by eigenvalue, then H, then column i
    # moved to its bit-reversed position. Undo H and the move, and compare with the
    # sorted eigenvectors up to each eigenvector's free sign.
    values, vectors = torch.linalg.eigh(covariance)
    expected = vectors[:, torch.argsort(values, descending=True)]
    undone = rotation.clone()
    if bitrev:
        width = dim.bit_length() - 1
        source = [int(format(i, f"0{width}b")[::-1], 2) for i in range(dim)]
        undone = undone[:, source]
    if hadamard:
        undone = undone @ brute_hadamard(dim).T
    signs = torch.sign((undone * expected).sum(0))
    assert torch.allclose(undone, expected * signs, atol=1e-8)
    if not hadamard:
        # Without H the rotated covariance is diagonal with eigenvalue i at channel br(i).
        diag = torch.diagonal(rotation.T @ covariance @ rotation)
        target = bit_reversal_permutation(dim) if bitrev else torch.arange(dim)
        assert torch.allclose(diag[target], eigenvalues, atol=1e-8)


def test_rotation_preserves_dot_products_per_head() -> None:
    covariances = torch.stack([random_spd(64, seed=s) for s in range(3)])
    rotations, _ = rotation_from_covariance(covariances)
    assert rotations.shape == (3, 64, 64)
    q = rows_with_outliers(5, 64, seed=1, dtype=torch.float64)
    k = rows_with_outliers(5, 64, seed=2, dtype=torch.float64)
    for head in range(3):
        rot = rotations[head]
        assert torch.allclose((q @ rot) @ (k @ rot).T, q @ k.T, atol=1e-9)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.sampled_from([8, 64, 128]), st.integers(0, 10_000))
def test_pack_unpack_round_trip_is_bit_exact(rows: int, dim: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (rows, 3, dim), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (rows, 3, dim // 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed), codes)


def test_pack_layout_is_strided_planes() -> None:
    dim = 16
    for code in range(4):
        for channel in range(dim):
            codes = torch.zeros(dim, dtype=torch.uint8)
            codes[channel] = code
            packed = pack_codes(codes)
            expected = torch.zeros(dim // 4, dtype=torch.uint8)
            expected[channel % (dim // 4)] = code << (2 * (channel // (dim // 4)))
            assert torch.equal(packed, expected)


@pytest.mark.parametrize("dim,group", [(64, 64), (128, 128), (128, 32), (256, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantized_within_half_step_of_clipped_input(dim, group, scale_dtype) -> None:
    rows = rows_with_outliers(200, dim, seed=dim + group)
    clipped = clip_rows(rows, DEFAULT_CLIP_RATIO_K)
    quantized = quantize(clipped, group, scale_dtype)
    assert quantized.codes.dtype == torch.uint8 and int(quantized.codes.max()) <= 3
    assert quantized.scale.dtype == scale_dtype and quantized.scale.shape == (200, dim // group)
    error = (dequantize(quantized, torch.float64) - clipped.double()).reshape(200, dim // group, group)
    # Float64 reference grid from the stored (rounded) scale/offset:
    scale = quantized.scale.double()
    offset = quantized.offset.double()
    grouped = clipped.double().reshape(200, dim // group, group)
    # With exact storage the error is at most half a step; with 16-bit storage the
    # rounding of offset and scale can move the grid ends by their own rounding error.
    rounding = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[scale_dtype]
    slack = rounding * (offset.abs() + 3 * scale)
    assert bool((error.abs() <= scale[..., None] / 2 + slack[..., None] + 1e-6).all())
    # Independent check of the code formula.
    expected_codes = torch.round((grouped - offset[..., None]) / scale[..., None]).clamp(0, 3)
    assert torch.equal(quantized.codes.reshape(grouped.shape).double(), expected_codes)


@pytest.mark.parametrize("ratio", [1.0, 0.96, 0.92, 0.5, 0.01])
@pytest.mark.parametrize("dim", [64, 128])
def test_clipping_keeps_exactly_the_promised_quantile(ratio: float, dim: int) -> None:
    rows = rows_with_outliers(50, dim, seed=int(ratio * 100) + dim, dtype=torch.float64)
    clipped = clip_rows(rows, ratio)
    expected_tau = torch.quantile(rows.abs(), ratio, dim=-1, interpolation="higher", keepdim=True)
    assert torch.equal(clipped, rows.clamp(-expected_tau, expected_tau))
    unchanged = (clipped == rows).double().mean(dim=-1)
    assert bool((unchanged >= ratio - 1e-12).all())
    assert torch.equal(clipped.abs().amax(-1, keepdim=True), expected_tau)


def test_lloyd_max_levels_sit_at_the_published_boundaries() -> None:
    rows = rows_with_outliers(64, 128, seed=5)
    quantized = quantize(rows, 128, torch.float32, lloyd_max=True)
    mean = rows.double().mean(-1)
    std = rows.double().std(-1, correction=0)
    scale = quantized.scale[:, 0].double()
    offset = quantized.offset[:, 0].double()
    assert torch.allclose(scale, LLOYD_MAX_BOUNDARY * std, rtol=1e-6)
    # Decision boundaries are the midpoints of adjacent levels: mu - b sigma, mu, mu + b sigma.
    boundaries = offset[:, None] + scale[:, None] * torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)
    expected = mean[:, None] + std[:, None] * torch.tensor([-1, 0, 1], dtype=torch.float64) * LLOYD_MAX_BOUNDARY
    assert torch.allclose(boundaries, expected, atol=1e-5)
    z = (rows.double() - mean[:, None]) / std[:, None]
    expected_codes = (z > -LLOYD_MAX_BOUNDARY).long() + (z > 0).long() + (z > LLOYD_MAX_BOUNDARY).long()
    mismatched = (quantized.codes.long() != expected_codes).double().mean()
    assert mismatched < 1e-3  # only values within float32 rounding of a boundary may differ


def test_group_equal_to_dim_makes_bit_reversal_irrelevant() -> None:
    covariance = random_spd(64, seed=11)
    rows = rows_with_outliers(100, 64, seed=12, dtype=torch.float64)
    outputs = []
    for bitrev in (False, True):
        rotation, _ = rotation_from_covariance(covariance, use_hadamard=True, use_bit_reversal=bitrev)
        rotated = rows @ rotation
        restored = dequantize(quantize(clip_rows(rotated, 0.96), 64, torch.float32), torch.float64)
        outputs.append(restored @ rotation.T)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-5)


def test_bits_per_element_match_method_md() -> None:
    assert body_bits_per_element(128, torch.float16) == 2.25
    assert body_bits_per_element(128, torch.float32) == 2.5
    assert body_bits_per_element(64, torch.float16) == 2.5
    assert round(bits_per_element(128 * 1024, 128), 4) == 2.2836
    assert round(bits_per_element(32 * 1024, 128), 2) == 2.38
    assert bits_per_element(320, 128) == 16.0
    assert bits_per_element(1000, 64, sink_tokens=0, recent_tokens=0) == 2.5
    assert row_bytes(128, 128) == 32 + 4
    assert row_bytes(64, 64, torch.float32) == 16 + 8


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: hadamard_matrix(48), ["dim=48", "power of two"]),
        (lambda: fast_hadamard_transform(torch.zeros(2, 96)), ["96", "power of two"]),
        (lambda: quantize(torch.zeros(2, 64), 48), ["group_size=48", "allowed values", "64"]),
        (lambda: clip_rows(torch.zeros(2, 64), 1.5), ["ratio=1.5", "(0, 1]"]),
        (lambda: clip_rows(torch.zeros(2, 64), 0.0), ["ratio=0.0", "(0, 1]"]),
        (lambda: quantize(torch.full((2, 64), float("nan")), 64), ["rows", "NaN or Inf"]),
        (lambda: clip_rows(torch.tensor([[1.0, float("inf")] * 32]), 0.9), ["NaN or Inf"]),
        (lambda: quantize(torch.zeros(2, 64, dtype=torch.int32), 64), ["dtype torch.int32", "allowed"]),
        (lambda: quantize(torch.zeros(2, 64), 64, torch.int8), ["scale_dtype", "allowed"]),
        (lambda: pack_codes(torch.full((4,), 4, dtype=torch.uint8)), ["[0, 3]"]),
        (lambda: OscarConfig(clip_ratio_v=0), ["clip_ratio_v=0", "(0, 1]"]),
        (lambda: OscarConfig().resolved_group_size(96), ["head_dim=96", "power of two"]),
        (lambda: rotation_from_covariance(torch.zeros(3, 4)), ["[..., D, D]"]),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(call, words) -> None:
    with pytest.raises(ValueError) as info:
        call()
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("floor", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim,group,ratio", [(64, 64, 0.84), (128, 32, 0.96), (64, 16, 1.0)])
def test_refit_quantizer_matches_float64_reference(scale_dtype, dim, group, ratio, floor) -> None:
    """quantize_rows(refit) on float32 rows = the float64 refit of tests/kernels_reference.py
    (written from the formulas) in every group away from a tie; same storage as quantize."""
    from vllm_oscar.config import GRID_REFIT_ITERATIONS
    from vllm_oscar.quant import quantize_rows

    from kernels_reference import TIE_MARGIN, random_rotations, ref_refit, rows_with_outliers

    gen = torch.Generator().manual_seed(dim + group)
    rows = rows_with_outliers(300, 2, dim, gen)
    rotation = random_rotations(2, dim, gen)
    rotated32 = torch.einsum("nhd,hde->nhe", rows.float(), rotation)
    rotated64 = torch.einsum("nhd,hde->nhe", rows.double(), rotation.double())
    got = quantize_rows(rotated32, ratio, group, scale_dtype, GRID_REFIT_ITERATIONS, refit_floor=floor)
    codes, scale, offset, margin = ref_refit(rotated64, ratio, group, scale_dtype, GRID_REFIT_ITERATIONS, floor)
    if floor:  # the floored grid is never narrower than the clipped min/max grid
        assert bool((got.scale >= quantize_rows(rotated32, ratio, group, scale_dtype).scale).all())
    assert got.codes.dtype == torch.uint8 and got.scale.dtype == scale_dtype and got.offset.dtype == scale_dtype
    assert got.codes.shape == rows.shape and got.scale.shape == scale.shape
    tolerance = 1e-5 if scale_dtype == torch.float32 else 0.0
    same = (got.codes.long() == codes).reshape(*scale.shape, group).all(-1)
    same &= (got.scale.double() - scale.double()).abs() <= tolerance * scale.double().abs()
    same &= (got.offset.double() - offset.double()).abs() <= tolerance * torch.maximum(offset.double().abs(),
                                                                                     scale.double())
    assert bool((same | (margin < TIE_MARGIN)).all())
    assert int((~same).sum()) <= max(2, same.numel() // 100)  # differing groups are all ties


def test_refit_grid_zero_rounds_is_the_initial_grid_and_never_loses() -> None:
    from vllm_oscar.quant import quantize_rows, refit_grid

    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(400, 64, generator=gen) * torch.linspace(0.2, 3.0, 64)
    rows[:, 5] += 8.0
    initial = quantize(clip_rows(rows, 0.9), 32, torch.float16)
    assert refit_grid(rows, initial, 0) is initial
    refit = quantize_rows(rows, 0.9, 32, torch.float16, refit_iterations=3)
    error = lambda q: ((rows - dequantize(q)) ** 2).reshape(400, 2, 32).sum(-1)  # noqa: E731
    assert bool((error(refit) <= error(initial) * (1 + 1e-6)).all())
    assert float(error(refit).sum()) < float(error(initial).sum())
    with pytest.raises(ValueError, match="refit_iterations"):
        quantize_rows(rows, 0.9, 32, torch.float16, refit_iterations=-1)
    with pytest.raises(ValueError, match="refit_iterations"):
        OscarConfig(refit_iterations=-2)
    assert min(refit_pair(OscarConfig().refit_iterations)) > 0


def _refit_every_round(rows: torch.Tensor, initial, rounds: int, floor: bool):
    """refit_grid's documented fit / assign / score rounds in float32, every round run, no shortcut: the
    transcription its fixed-point exit and compaction must reproduce bit for bit (same float operations)."""
    group, storage = initial.group_size, initial.scale.dtype
    x = rows.float().reshape(-1, group)
    codes = initial.codes.reshape(-1, group).float()
    best = [codes, initial.scale.reshape(-1), initial.offset.reshape(-1)]
    scale, offset = best[1].float(), best[2].float()
    floor_scale = scale
    error = lambda c, s, o: ((x - (c * s[:, None] + o[:, None])) ** 2).sum(-1)  # noqa: E731
    best_error = error(codes, scale, offset)
    x_mean = x.sum(-1) / group
    for _ in range(rounds):
        code_mean = codes.sum(-1) / group
        centered = codes - code_mean[:, None]
        covariance = (centered * (x - x_mean[:, None])).sum(-1) / group
        variance = (centered * centered).sum(-1) / group
        fitted = torch.where(variance > 0, covariance / torch.where(variance > 0, variance, 1.0), scale)
        if floor:
            fitted = torch.maximum(fitted, floor_scale)
        stored_scale = fitted.clamp(min=1e-6).to(storage)
        scale = stored_scale.float()
        stored_offset = (x_mean - scale * code_mean).to(storage)
        offset = stored_offset.float()
        codes = ((x - offset[:, None]) / scale[:, None]).round().clamp(0, 3)
        round_error = error(codes, scale, offset)
        better = round_error < best_error
        best = [torch.where(better[:, None], codes, best[0]), torch.where(better, stored_scale, best[1]),
                torch.where(better, stored_offset, best[2])]
        best_error = torch.where(better, round_error, best_error)
    return best[0].to(torch.uint8).reshape(rows.shape), best[1], best[2]


@pytest.mark.parametrize("compact_from", [0, 10**9])  # 0: settled groups gathered out; 10**9: only the exit
@pytest.mark.parametrize("rounds,floor", [(8, True), (2, False), (12, False)])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_refit_shortcuts_change_no_bit(monkeypatch, compact_from, rounds, floor, scale_dtype) -> None:
    """The refit's fixed-point exit and its gathering-out of settled groups give exactly what running every round
    on every group gives, for a batch of rows and for the one-token writes of a decode step."""
    from vllm_oscar.quant import quantizer

    from kernels_reference import random_rotations
    from kernels_reference import rows_with_outliers as head_rows

    monkeypatch.setattr(quantizer, "REFIT_COMPACT_MIN_VALUES", compact_from)
    gen = torch.Generator().manual_seed(rounds + compact_from % 7)
    for tokens, dim, group in [(200, 64, 32), (1, 128, 32), (3, 64, 16)]:
        rotated = torch.einsum("nhd,hde->nhe", head_rows(tokens, 3, dim, gen).float(), random_rotations(3, dim, gen))
        initial = quantize(clip_rows(rotated, 0.9), group, scale_dtype)
        got = quantizer.refit_grid(rotated, initial, rounds, scale_floor=floor)
        codes, scale, offset = _refit_every_round(rotated, initial, rounds, floor)
        assert torch.equal(got.codes, codes)
        assert torch.equal(got.scale.reshape(-1), scale) and torch.equal(got.offset.reshape(-1), offset)
        assert got.scale.shape == initial.scale.shape and got.scale.dtype == scale_dtype
