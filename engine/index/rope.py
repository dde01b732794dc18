"""Rotary position embeddings, undone: the keys and queries of a global layer as they were before RoPE rotated them
by their positions (Saap clusters keys and classifies queries in that space: its section 3, "removing temporal
bias").

A RoPE model (transformers' `rotate_half` convention: the head dim's two halves are the two coordinates of each
frequency's plane) turns a vector x at position p into a * (x * cos(p w) + rotate_half(x) * sin(p w)) with one
angle w_j per pair j (`inv_freq`) and a constant a (`attention_scaling`, 1 for plain RoPE). `derope` applies the
inverse rotation, not the 1 / a: both the training and the lookups see vectors in the same space, a constant factor
apart from the model's own.

The frequencies are read from the model's rotary-embedding module itself (the angle it gives position 1), so every
rope type transformers computes (default, linear, llama3, YaRN ...) is undone without knowing its formula.
"""

from __future__ import annotations

import inspect
import math

import torch

from kernels.reference.buckets import derope  # the one implementation (also the lookup kernel's reference)

__all__ = ["derope", "rope_frequencies"]


def rope_frequencies(model: torch.nn.Module, layer_type: str | None = None,
                     head_dim: int | None = None) -> torch.Tensor:
    """[D / 2] float32: the angle per position of each rotation plane of the layers of `layer_type` (Gemma 3:
    "full_attention"; None where the model has one kind), from the model's `rotary_emb` module: its inv_freq
    buffer where it has one, else measured (the angle it gives position 1)."""
    rotary = _rotary_module(model)
    buffer = getattr(rotary, f"{layer_type}_inv_freq" if layer_type else "inv_freq", None)
    if isinstance(buffer, torch.Tensor):
        return buffer.detach().float().cpu()
    params = inspect.signature(rotary.forward).parameters
    device = next((b.device for b in rotary.buffers()), torch.device("cpu"))
    x = torch.zeros(1, 1, head_dim or 1, device=device, dtype=torch.float32)
    positions = torch.tensor([[1]], device=device)
    with torch.no_grad():
        cos, sin = rotary(x, positions, layer_type) if "layer_type" in params else rotary(x, positions)
    cos, sin = cos.reshape(-1).double().cpu(), sin.reshape(-1).double().cpu()
    half = cos.numel() // 2
    if cos.numel() % 2 or not torch.allclose(cos[:half], cos[half:]) or not torch.allclose(sin[:half], sin[half:]):
        raise ValueError("the model's rotary embedding is not of the rotate_half form this engine undoes")
    angles = torch.atan2(sin[:half], cos[:half])  # in (-pi, pi]: RoPE's angles per position are at most 1 radian
    if bool((angles < 0).any()) or float(angles.max()) > math.pi / 2:
        raise ValueError("the model's rotary frequencies are outside what one position's angle can tell")
    return angles.float()


def _rotary_module(model: torch.nn.Module) -> torch.nn.Module:
    found = [m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_emb"]
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary_emb module: Saap needs a RoPE model")
    return found[0]
