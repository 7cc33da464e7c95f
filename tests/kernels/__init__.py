"""Kernels: torch references, Triton kernels (TRITON_INTERPRET on a CPU), GPU backends."""
