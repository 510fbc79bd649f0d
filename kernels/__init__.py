"""Compute kernels (torch reference and CUDA); filled in by the engine issues."""
