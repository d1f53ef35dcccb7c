"""Integer helpers for host code (launch grids, split counts, block counts).

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions since Triton 3.6: called
from Python they cost about 2 us each (argument unwrapping), several times per eager layer step. These
are the plain versions, for Python ints only (inside @triton.jit code keep Triton's).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
