"""KV-cache methods evaluated by the harness: what each one does to K and V, and its bits.

A method turns the post-RoPE keys and the values of one layer, [B, Hkv, T, D], into the
values attention reads back after a round trip through its storage (quantize, then
dequantize, in float32). The harness decides per (query, key) pair whether attention
reads the exact BF16 row (sink and recent windows) or this reconstruction.

Row methods (naive INT2, QuaRot, OSCAR) quantize each (token, head) row on its own in an
orthogonal basis ``x_rot = x @ R`` and rotate back, ``x^ = Q(clip(x @ R)) @ R^T``: the
same attention as rotating the query instead (R orthogonal), which is what the backend
does. Bits are counted from what the cache really stores (codes plus every scale, zero
or norm) and, for the whole sequence, with the BF16 windows and unquantized layers.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from vllm_oscar.config import WINDOW_BITS, RefitIterations, refit_pair
from vllm_oscar.quant import body_bits_per_element, fake_quantize, hadamard_matrix


def window_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sink: int, recent: int
) -> torch.Tensor:
    """[Tq, Tk] bool: True where a query at t reads key s exactly (BF16).

    s is exact when it is in the sink (s < sink) or in t's recent window (t - s < recent,
    the current token included). Causality is not applied here.
    """
    distance = query_pos[:, None] - key_pos[None, :]
    return (key_pos[None, :] < sink) | (distance < recent)


class KVMethod:
    """Base class: the identity (BF16 KV cache). Subclasses override the hooks.

    Attributes:
        name: short name used on the command line and in tables.
        description: one line saying what is stored.
    """

    name: str = "bf16"
    description: str = "BF16 K and V (no quantization)"

    @property
    def is_exact(self) -> bool:
        """True when attention never reads a quantized row (the BF16 reference)."""
        return True

    def quantizes_layer(self, layer: int, num_layers: int) -> bool:
        """False for layers this method keeps in BF16."""
        return not self.is_exact

    def quantize_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """[B, Hkv, T, D] keys -> [B, Hkv, T, D] float32 reconstruction."""
        return keys.float()

    def quantize_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        """[B, Hkv, T, D] values -> [B, Hkv, T, D] float32 reconstruction."""
        return values.float()

    def exact_mask(
        self, query_pos: torch.Tensor, key_pos: torch.Tensor, sink: int, recent: int
    ) -> torch.Tensor:
        """[Tq, Tk] bool: pairs read in BF16 (default: the sink and recent windows)."""
        return window_mask(query_pos, key_pos, sink, recent)

    def body_bits(self, head_dim: int) -> float:
        """Bits per K/V element of a quantized token (mean of K and V)."""
        return float(WINDOW_BITS)

    def bits_per_element(
        self, context_len: int, head_dim: int, num_layers: int, sink: int, recent: int
    ) -> float:
        """Mean bits per K/V element over a sequence of ``context_len`` tokens.

        Counts, for the last query of the sequence, which tokens are read in BF16
        (exact_mask) and which from the quantized body, and averages over layers
        (unquantized layers cost WINDOW_BITS everywhere).
        """
        if self.is_exact:
            return float(WINDOW_BITS)
        positions = torch.arange(context_len)
        exact = self.exact_mask(positions[-1:], positions, sink, recent)[0]
        num_exact = int(exact.sum())
        body = self.body_bits(head_dim)
        quantized_layer = (WINDOW_BITS * num_exact + body * (context_len - num_exact)) / context_len
        quantized_layers = sum(self.quantizes_layer(i, num_layers) for i in range(num_layers))
        return (quantized_layer * quantized_layers + WINDOW_BITS * (num_layers - quantized_layers)) / num_layers


@dataclasses.dataclass
class LayerRotations:
    """Per-layer rotations and clip ratios of a row method.

    Attributes:
        key: [Hkv, D, D] float32 rotation of the keys (x_rot = x @ R), or None (identity).
        value: [Hkv, D, D] float32 rotation of the values, or None.
        clip_k / clip_v: clip ratios (1.0 = no clipping).
        key_mean / value_mean: [Hkv, D] float32 calibrated means subtracted before
            quantization and added back after (None = no centering). Exact for
            attention: q.mu shifts every logit of a query equally only among quantized
            keys, so it is part of the reconstruction, not a free shift; it costs no
            per-token bits.
    """

    key: Optional[torch.Tensor]
    value: Optional[torch.Tensor]
    clip_k: float = 1.0
    clip_v: float = 1.0
    key_mean: Optional[torch.Tensor] = None
    value_mean: Optional[torch.Tensor] = None


def _rotate(rows: torch.Tensor, rotation: Optional[torch.Tensor], inverse: bool) -> torch.Tensor:
    """rows [B, Hkv, T, D] @ R[h] (or R[h]^T when inverse) per KV head."""
    if rotation is None:
        return rows
    rotation = rotation.to(device=rows.device, dtype=rows.dtype)
    pattern = "bhte,hde->bhtd" if inverse else "bhtd,hde->bhte"
    return torch.einsum(pattern, rows, rotation)


class RowMethod(KVMethod):
    """Per-(token, head) INT2 in a rotated basis: naive INT2, QuaRot and OSCAR.

    Args:
        name, description: see KVMethod.
        layers: one LayerRotations per layer (None rotation = identity).
        group_size: channels per (scale, offset); None = one group per row (D).
        scale_dtype: storage dtype of scale and offset.
        lloyd_max: Gaussian Lloyd-Max levels instead of the min/max grid, on K and V.
        refit_iterations: > 0: least-squares refit of each group's (scale, offset) to its
            unclipped values (the product's write quantizer, quant.quantize_rows); one int
            or a (K rounds, V rounds) pair; same storage, same decode.
        refit_floor: (keys, values): that side's refit never narrower than the clipped
            min/max grid (quant.refit_grid scale_floor; served: config.REFIT_SCALE_FLOOR).
    """

    def __init__(
        self,
        name: str,
        description: str,
        layers: Sequence[LayerRotations],
        group_size: Optional[int] = None,
        scale_dtype: torch.dtype = torch.float16,
        lloyd_max: bool = False,
        refit_iterations: RefitIterations = 0,
        refit_floor: tuple[bool, bool] = (False, False),
    ) -> None:
        self.name = name
        self.description = description
        self.layers = list(layers)
        self.group_size = group_size
        self.scale_dtype = scale_dtype
        self.lloyd_max = lloyd_max
        self.refit_iterations = refit_iterations
        self._refit_k, self._refit_v = refit_pair(refit_iterations)
        self.refit_floor = (bool(refit_floor[0]), bool(refit_floor[1]))

    @property
    def is_exact(self) -> bool:
        return False

    def _round_trip(
        self, rows: torch.Tensor, rotation: Optional[torch.Tensor], clip: float, mean: Optional[torch.Tensor],
        refit_iterations: int, refit_floor: bool = False,
    ) -> torch.Tensor:
        rows = rows.float()
        if mean is not None:
            mean = mean.to(rows.device)[None, :, None, :]
            rows = rows - mean
        rotated = _rotate(rows, rotation, inverse=False)
        group = self.group_size or rows.shape[-1]
        quantized = fake_quantize(rotated, clip, group, self.scale_dtype, self.lloyd_max, refit_iterations, refit_floor)
        restored = _rotate(quantized, rotation, inverse=True)
        return restored + mean if mean is not None else restored

    def quantize_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        spec = self.layers[layer]
        return self._round_trip(keys, spec.key, spec.clip_k, spec.key_mean, self._refit_k, self.refit_floor[0])

    def quantize_values(self, values: torch.Tensor, layer: int) -> torch.Tensor:
        spec = self.layers[layer]
        return self._round_trip(values, spec.value, spec.clip_v, spec.value_mean, self._refit_v, self.refit_floor[1])

    def body_bits(self, head_dim: int) -> float:
        return body_bits_per_element(self.group_size or head_dim, self.scale_dtype)


def hadamard_layers(
    num_layers: int, num_kv_heads: int, head_dim: int, clip_k: float = 1.0, clip_v: float = 1.0
) -> list[LayerRotations]:
    """The data-free QuaRot rotation: the normalised Hadamard matrix for every head."""
    hadamard = hadamard_matrix(head_dim, torch.float32).expand(num_kv_heads, head_dim, head_dim).contiguous()
    return [LayerRotations(hadamard, hadamard, clip_k, clip_v) for _ in range(num_layers)]


def identity_layers(num_layers: int, clip_k: float = 1.0, clip_v: float = 1.0) -> list[LayerRotations]:
    """No rotation (naive INT2)."""
    return [LayerRotations(None, None, clip_k, clip_v) for _ in range(num_layers)]

