"""Triton kernels for OSCAR: fused INT2 write, paged decode, prefill over a cached prefix."""
