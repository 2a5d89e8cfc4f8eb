"""Kernels that stand in for CUDA-only ones; importing them does nothing else (the patches bind them)."""
