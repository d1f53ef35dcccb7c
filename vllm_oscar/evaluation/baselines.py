"""Baselines users would pick instead of OSCAR: KIVI-2 and vLLM's TurboQuant presets.

KIVI (Liu et al., ICML 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV
cache"): keys quantized per channel over groups of G consecutive tokens, values per
token over groups of G channels, asymmetric INT2 with fp16 scale and zero; the newest
tokens stay in full precision until a whole key group has left the recent window.
Body bits: keys 2 + 32/G, values 2 + 32/G (3.0 at G = 32).

TurboQuant as vLLM 0.32 implements its presets (``--kv-cache-dtype turboquant_*``):
keys: the norm ||k|| in fp16, the unit vector rotated by the normalised Hadamard
matrix, each coordinate replaced by the nearest Lloyd-Max centroid of N(0, 1/D) at b
bits, the centroid vector renormalised to unit length (norm correction, "_nc"); values:
uniform b-bit per token with fp16 scale and zero. vLLM keeps the first and last two
attention layers of a dense model unquantized for every preset. Bits: keys b + 16/D,
values b + 32/D.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from vllm_oscar.config import (
    KIVI_GROUP_SIZE,
    SCALE_DTYPE_BITS,
    TURBOQUANT_BOUNDARY_SKIP_LAYERS,
)
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.quant import fake_quantize, hadamard_matrix

_FP16_BITS = SCALE_DTYPE_BITS[torch.float16]
#: Lloyd-Max iterations for the Gaussian centroids (converges to 1e-12 well before).
_LLOYD_MAX_ITERATIONS = 500


class KiviMethod(KVMethod):
    """KIVI-2: per-channel keys over token groups, per-token values over channel groups.

    Args:
        group_size: G, tokens per key group and channels per value group (capped at D).
    """

    def __init__(self, group_size: int = KIVI_GROUP_SIZE) -> None:
        self.group_size = group_size
        self.name = f"kivi2-g{group_size}"
        self.description = (
            f"KIVI-2: keys per channel over {group_size}-token groups, values per token over "
            f"{group_size}-channel groups, fp16 scale/zero"
        )

    @property
    def is_exact(self) -> bool:
        return False

    def quantize_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """Aligned token groups [jG, (j+1)G); a trailing partial group is quantized as
        padded with its own last row (its tokens are always read exactly: exact_mask)."""
        batch, heads, tokens, dim = keys.shape
        group = self.group_size
        padded_len = math.ceil(tokens / group) * group
        rows = keys.float()
        if padded_len != tokens:
            pad = rows[:, :, -1:, :].expand(batch, heads, padded_len - tokens, dim)
            rows = torch.cat([rows, pad], dim=2)
        per_channel = rows.reshape(batch, heads, padded_len // group, group, dim).transpose(-1, -2)
        quantized = fake_quantize(per_channel.contiguous(), 1.0, group)
        return quantized.transpose(-1, -2).reshape(batch, heads, padded_len, dim)[:, :, :tokens]

    def quantize_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        return fake_quantize(values.float(), 1.0, min(self.group_size, values.shape[-1]))

    def exact_mask(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, sink: int, recent: int
    ) -> torch.Tensor:
        """A key is read quantized only once its whole token group is out of the recent
        window (KIVI keeps the residual in full precision until a group is complete)."""
        group_end = (key_pos // self.group_size) * self.group_size + self.group_size - 1
        distance = query_pos[:, None] - group_end[None, :]
        return (key_pos[None, :] < sink) | (distance < recent)

    def body_bits(self, head_dim: int) -> float:
        key_bits = 2 + 2 * _FP16_BITS / self.group_size
        value_bits = 2 + 2 * _FP16_BITS / min(self.group_size, head_dim)
        return 0.5 * (key_bits + value_bits)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


@lru_cache(maxsize=16)
def gaussian_lloyd_max(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd-Max levels of the standard normal at ``bits`` bits (float64).

    Returns:
        (centroids [2**bits], boundaries [2**bits - 1]), ascending. Each centroid is the
        conditional mean of N(0, 1) on its cell (closed form), each boundary the midpoint
        of its neighbours, iterated to convergence. For N(0, sigma^2) multiply by sigma.
    """
    levels = 1 << bits
    centroids = torch.linspace(-2.0, 2.0, levels, dtype=torch.float64)
    for _ in range(_LLOYD_MAX_ITERATIONS):
        boundaries = 0.5 * (centroids[1:] + centroids[:-1])
        edges = torch.cat([torch.tensor([-math.inf], dtype=torch.float64), boundaries,
                           torch.tensor([math.inf], dtype=torch.float64)])
        mass = _normal_cdf(edges[1:]) - _normal_cdf(edges[:-1])
        centroids = (_normal_pdf(edges[:-1]) - _normal_pdf(edges[1:])) / mass
    return centroids, 0.5 * (centroids[1:] + centroids[:-1])


class TurboQuantMethod(KVMethod):
    """vLLM's TurboQuant preset with ``key_bits`` MSE keys and ``value_bits`` uniform values.

    Args:
        preset: the vLLM preset name (for the table).
        key_bits / value_bits: bits per key coordinate and per value element.
        skip_boundary_layers: first and last N layers kept unquantized (vLLM: 2).
    """

    def __init__(
        self,
        preset: str,
        key_bits: int,
        value_bits: int,
        skip_boundary_layers: int = TURBOQUANT_BOUNDARY_SKIP_LAYERS,
    ) -> None:
        self.name = preset
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.skip_boundary_layers = skip_boundary_layers
        self.description = (
            f"TurboQuant (vLLM preset {preset}): Hadamard + {key_bits}-bit Lloyd-Max keys with "
            f"fp16 norm and norm correction, {value_bits}-bit uniform values, first/last "
            f"{skip_boundary_layers} layers unquantized"
        )

    @property
    def is_exact(self) -> bool:
        return False

    def quantizes_layer(self, layer: int, num_layers: int) -> bool:
        skip = self.skip_boundary_layers
        return skip <= layer < num_layers - skip

    def quantize_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        rows = keys.float()
        dim = rows.shape[-1]
        hadamard = hadamard_matrix(dim, torch.float32, rows.device)
        norm = rows.norm(dim=-1, keepdim=True)
        unit = rows / (norm + 1e-8)
        rotated = unit @ hadamard
        centroids, boundaries = gaussian_lloyd_max(self.key_bits)
        scale = 1.0 / math.sqrt(dim)
        centroids = (centroids * scale).to(torch.float32).to(rows.device)
        boundaries = (boundaries * scale).to(torch.float32).to(rows.device)
        levels = centroids[torch.bucketize(rotated, boundaries)]
        levels = levels / torch.sqrt((levels * levels).sum(dim=-1, keepdim=True) + 1e-16)
        stored_norm = norm.to(torch.float16).float()
        return (levels * stored_norm) @ hadamard.T

    def quantize_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        rows = values.float()
        top = (1 << self.value_bits) - 1
        low = rows.amin(dim=-1, keepdim=True)
        high = rows.amax(dim=-1, keepdim=True)
        scale = torch.clamp((high - low) / top, min=1e-8)
        codes = torch.clamp(torch.floor((rows - low) / scale + 0.5), 0, top)
        return codes * scale.to(torch.float16).float() + low.to(torch.float16).float()

    def body_bits(self, head_dim: int) -> float:
        key_bits = self.key_bits + _FP16_BITS / head_dim
        value_bits = self.value_bits + 2 * _FP16_BITS / head_dim
        return 0.5 * (key_bits + value_bits)
