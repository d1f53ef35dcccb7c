"""Reference OSCAR math in plain torch (CPU or CUDA, float32/float64).

This is the oracle the Triton kernels and the vLLM backend are tested against. It
imports neither vLLM nor Triton.
"""

from vllm_oscar.quant.bits import bits_per_element, body_bits_per_element, row_bytes
from vllm_oscar.quant.hadamard import (
    bit_reversal_permutation,
    fast_hadamard_transform,
    hadamard_matrix,
)
from vllm_oscar.quant.packing import code_plane, pack_codes, unpack_codes
from vllm_oscar.quant.quantizer import (
    QuantizedRows,
    clip_rows,
    clip_threshold_index,
    dequantize,
    fake_quantize,
    quantize,
    quantize_rows,
    refit_grid,
)
from vllm_oscar.quant.rotation import (
    compose_rotation,
    orthogonality_error,
    rotation_from_covariance,
)

__all__ = [
    "QuantizedRows",
    "bit_reversal_permutation",
    "bits_per_element",
    "body_bits_per_element",
    "clip_rows",
    "clip_threshold_index",
    "code_plane",
    "compose_rotation",
    "dequantize",
    "fake_quantize",
    "fast_hadamard_transform",
    "hadamard_matrix",
    "orthogonality_error",
    "pack_codes",
    "quantize",
    "quantize_rows",
    "refit_grid",
    "rotation_from_covariance",
    "row_bytes",
    "unpack_codes",
]
