"""Modules served under another name where a CUDA-only dependency is missing (see :mod:`sat_patches.core.import_hook`)."""
