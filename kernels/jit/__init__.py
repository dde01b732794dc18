"""@triton.jit kernels only; their typed wrappers live one level up (kernels/*_ops.py)."""
