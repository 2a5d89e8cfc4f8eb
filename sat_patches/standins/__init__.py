"""Modules served under another name where a CUDA-only dependency is missing (see ``_sat_patches_boot``)."""
