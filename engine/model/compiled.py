"""Decoder layers compiled by torch.compile around the engine's own attention (opt-in; `squeeze bench e2e
--compile`).

Each decoder layer's forward goes through `nn.Module.compile()` (PyTorch's per-instance API; no transformers code is
replaced). The engine's attention function and its cache update are `torch.compiler.disable`d, so dynamo compiles
what lies between them: the norms, the projections, RoPE, the MLP and the residual adds become a few fused
inductor kernels per layer instead of ~50 eager ones, and the engine's kernels run as they are. Compiled code is
captured by engine.model.graph's CUDA graphs like eager code: the warm step before each capture compiles the decode
shapes. Layers share their compiled code (dynamo passes a module's parameters as inputs); so that the layer index
each layer hands to the cache does not specialise one compilation per layer (and exhaust dynamo's recompile limit
after 8), dynamo is told to treat integer module attributes as inputs (`allow_unspec_int_on_nn_module`, a
process-wide dynamo setting).
"""

from __future__ import annotations

import torch

from engine.model.load import LoadedModel


def compile_layers(lm: LoadedModel) -> int:
    """Compile every decoder layer of lm.model in place (idempotent). Returns how many layers were compiled now.
    Compilation itself happens at each layer's first call per input shape (seconds to a minute on a GPU)."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    compiled = 0
    for layer in lm.model.get_decoder().layers:
        if not _compiled(layer):
            layer.compile()
            compiled += 1
    return compiled


def layers_compiled(lm: LoadedModel) -> bool:
    return all(_compiled(layer) for layer in lm.model.get_decoder().layers)


def _compiled(module: torch.nn.Module) -> bool:
    """Whether nn.Module.compile() was called on `module` (it sets the compiled call PyTorch's __call__ uses)."""
    return getattr(module, "_compiled_call_impl", None) is not None
