"""Triton kernels (installed as etweedie.kernels); see issue 4."""
