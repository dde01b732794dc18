"""PyTorch references of every kernel, one module per kernel family (kernels/jit/<family>.py, wrapped by
kernels/<family>_ops.py): written for clarity, they define the semantics the Triton kernels must match.

Conventions (batch 1, no batch dimension):
    q: [Hq, Lq, D]      queries (already rotated), any float dtype
    k, v: [Hkv, Lk, D]  keys and values; Hq is a multiple of Hkv (GQA) and query head h reads KV head h // (Hq // Hkv)
Outputs are float32: out [Hq, Lq, D], lse [Hq, Lq] (natural-log log-sum-exp of the scaled scores; -inf where a
query attends to nothing, with out = 0 there).
"""
