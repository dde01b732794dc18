"""The Triton kernels against their PyTorch references (in the interpreter on the CPU, compiled on a GPU)."""
