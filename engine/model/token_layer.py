"""A Llama-style decoder layer whose one-token step does the MLP's SiLU and last residual add inside its down product.

At batch 1 a decode step is a chain of short launches, and each launch between two matrix-vector products costs
more than its own work. Compiled, a Llama layer's step launches, besides its products and its attention, the
residual add fused with the MLP's RMSNorm, the gate's SiLU times the up product, and the last residual add.
`TokenStepLayer` runs one token's down product as the GEMV kernel's gated form (kernels/gemv_ops.py,
`gated_gemv`): it reads silu(gate) * up from the gate/up product's output and adds the residual as it stores, so the
last two launches are gone, each intermediate rounded where the model's eager modules round it. On an H200 with the
8B shape at 32K tokens this took full attention's decode step 5.29 -> 5.23 ms and squeeze's 4.92 -> 4.86
(engine/bench/README.md, "Fewer launches around the MLP"). The attention half, the RMSNorm and every call over several
tokens run the model's own modules.

`use_token_layers` swaps each decoder layer of a known Llama-style class (LLAMA_STYLE: the same forward, RMSNorm
and gated SiLU MLP) for a TokenStepLayer holding the same submodules under the same names (the same parameters and
state_dict keys); a layer of any other model is left as it is. Call it after engine.model.gemv.use_token_products
(the gate/up set fused and routed to the GEMV kernel).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.model.fused import SharedProduct
from engine.model.gemv import TokenLinear, TokenProduct
from kernels.backend import Backend

# Decoder layers whose forward is transformers' Llama layer's, h = x + attn(norm1(x)); h + mlp(norm2(h)), with a
# gated SiLU MLP, down(silu(gate(x)) * up(x))
LLAMA_STYLE = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
SILU = ("SiLU", "SiLUActivation")
COPIED = ("attention_type", "hidden_size")  # plain attributes the model may read off a layer


@torch.compiler.disable  # a Triton launch with host-side checks: called as it is from compiled layers
def _down(ops: ModuleType, gate_up: torch.Tensor, down: TokenLinear, h: torch.Tensor) -> torch.Tensor:
    """h + down(silu(gate) * up) for one token: gate_up [..., 2I], h [..., H] -> [..., H]."""
    return ops.gated_gemv(gate_up.reshape(1, -1), down.weight, down.bias, h.reshape(1, -1)).reshape(h.shape)


class TokenStepLayer(nn.Module):
    """A Llama-style decoder layer (its own submodules, not copies) whose one-token calls end with the gated down
    product of `ops` (a backend's kernels.reference.gemv family)."""

    def __init__(self, layer: nn.Module, ops: ModuleType):
        super().__init__()
        self.self_attn = layer.self_attn
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        for name in COPIED:
            if hasattr(layer, name):
                setattr(self, name, getattr(layer, name))
        self.__dict__["ops"] = ops  # a module of functions, not a submodule

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """hidden_states: [B, L, H] -> [B, L, H]; the other arguments go to the attention as the model's own layer
        passes them."""
        attn, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                                 **kwargs)
        h = hidden_states + attn
        if h.numel() != h.shape[-1]:  # several tokens: the model's own modules
            return h + self.mlp(self.post_attention_layernorm(h))
        gate_up = self.mlp.fused_gate_proj
        return _down(self.ops, gate_up.product(self.post_attention_layernorm(h), gate_up.weight, gate_up.bias),
                     self.mlp.down_proj, h)


def steppable(layer: nn.Module) -> bool:
    """Whether `layer` is a Llama-style decoder layer whose MLP has its gate/up set fused and its products routed
    to the GEMV kernel (engine.model.fused, engine.model.gemv)."""
    if type(layer).__name__ not in LLAMA_STYLE:
        return False
    mlp = getattr(layer, "mlp", None)
    gate_up = getattr(mlp, "fused_gate_proj", None)
    return (isinstance(gate_up, SharedProduct) and isinstance(gate_up.product, TokenProduct)
            and isinstance(getattr(mlp, "down_proj", None), TokenLinear)
            and type(getattr(mlp, "act_fn", None)).__name__ in SILU)


def use_token_layers(model: nn.Module, backend: Backend) -> int:
    """Swap every steppable decoder layer of `model` for a TokenStepLayer over `backend`'s GEMV kernels
    (idempotent). Returns how many layers it swapped now."""
    layers = model.get_decoder().layers
    ops = backend.kernel("gemv")
    swapped = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, TokenStepLayer) and steppable(layer):
            layers[i] = TokenStepLayer(layer, ops)
            swapped += 1
    return swapped


def token_layers(model: nn.Module) -> int:
    """How many of model's decoder layers are TokenStepLayers."""
    return sum(isinstance(layer, TokenStepLayer) for layer in model.get_decoder().layers)
