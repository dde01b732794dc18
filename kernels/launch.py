"""Programmatic dependent launch (PDL) of a step's kernels on Hopper and later GPUs.

A decode step is a chain of short kernels (per layer of the 8B shape at 128K, 10% budget: four matrix-vector
products of ~27 us, the lookup's and the attention's of 3-22 us, a few of ~1-2 us); between two of them the GPU
drains the first, then the second's blocks are scheduled. Launched with PDL, the second's blocks may be scheduled
as soon as every block of the first has started and released it (`release_next`): they wait (`wait_prior`) until
the first has finished and its writes are visible, and do before that only work that reads nothing an earlier kernel
wrote (a product's first tile of weights). The chain is then transitive: a kernel that waits finishes after its
predecessor, so its successor's wait covers every earlier kernel.

The contract of a kernel launched with `dependent_launch`: with PDL set, it calls `wait_prior` before it reads
anything an earlier kernel may have written and before it writes anything, on every path (even one that reads
nothing), and may call `release_next` anywhere. Without PDL (the interpreter, older GPUs) both are no-ops. CUDA
graphs keep the dependency as a programmatic edge.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MIN_CAPABILITY = 9  # griddepcontrol: sm_90 and later
ENABLED = True  # a benchmark's switch (squeeze bench e2e --no-pdl), set before any kernel is compiled or launched


@functools.lru_cache(maxsize=None)
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= MIN_CAPABILITY


def supported(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL (a GPU of compute capability 9 or more, and ENABLED)."""
    return ENABLED and _capable(device)


def dependent_launch(device: torch.device) -> dict:
    """The launch options of a kernel that follows the contract above: `PDL` (its constexpr) and Triton's
    `launch_pdl`, both on where `supported(device)`, else PDL off and no option."""
    if supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Block until the kernel before this one in the stream has finished and its writes are visible (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel in the stream be scheduled once every block of this one has called this (PDL only)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
