"""Sibling projections that read the same input fused into one matrix product: q/k/v, and an MLP's gate/up.

At batch 1 a decoder layer's step is a row of matrix-vector products, each bound by reading its weights; three small
products (a Llama-3-8B layer's k and v read 8 MB each, at a third of the copy bandwidth) each cost a launch, where
one product over their concatenated rows reaches nearly the large products' rate (`python -m engine.bench.gemv`, the
8B shape's 32 layers on an H100: 5.55 ms for the seven products per layer, 5.22 ms with q/k/v and gate/up fused;
engine/bench/README.md, "Fewer kernels per decode step").

`fuse_projections` replaces, inside each decoder layer, every set of sibling `nn.Linear` modules named in
FUSED_SETS (same input width, same dtype and device, all with a bias or none) by `ProjectionPart`s of one
`SharedProduct` holding their concatenated weights (the originals are freed: no memory is added). The model's own
forward is unchanged: it still calls `q_proj(x)`, `k_proj(x)`, `v_proj(x)`; the first part called computes the
product of all rows for `x`, and the others take their rows of it when called with the same tensor `x` (any order;
called with another input, a part computes its own rows). Once every part has taken its rows, the product is
released. The product is kept per thread (an ingest in the background and an answer may run the model at once).
Under torch.compile (engine.model.compiled) dynamo traces this into one matrix product and slices: what it keeps
of the attributes it stores while tracing is their final value, cleared, so compiled calls share no state either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

# Names of sibling projections applied to the same input, by the modules that hold them (Llama, Mistral, Qwen,
# Gemma and most transformers decoders).
FUSED_SETS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedProduct(nn.Module):
    """y = x @ weight.T + bias over the rows of several projections, computed once per input tensor.

    weight: [sum of the parts' out_features, in_features]; bias: [the same] or None
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parts: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.parts = parts
        # (x, weight, bias) -> the product: F.linear, or engine.model.gemv.TokenProduct (one token by a GEMV kernel)
        self.product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = F.linear
        self._input: torch.Tensor | None = None  # (while dynamo traces: the product being shared, then None)
        self._output: torch.Tensor | None = None
        self._taken = 0
        self._per_thread: dict[int, list] = {}  # thread id -> [input, product, parts taken] (eager calls)

    def rows(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of the product for x [..., in_features]: [..., stop - start]."""
        if torch.compiler.is_compiling():
            if self._input is not x:
                self._input, self._output, self._taken = x, self.product(x, self.weight, self.bias), 0
            out = self._output[..., start:stop]
            self._taken += 1
            if self._taken == self.parts:  # every part has its rows: nothing kept
                self._input, self._output, self._taken = None, None, 0
            return out
        thread = threading.get_ident()
        entry = self._per_thread.get(thread)
        if entry is None or entry[0] is not x:
            entry = self._per_thread[thread] = [x, self.product(x, self.weight, self.bias), 0]
        entry[2] += 1
        if entry[2] == self.parts:  # every part has its rows: do not keep the input and product alive
            del self._per_thread[thread]
        return entry[1][..., start:stop]


class ProjectionPart(nn.Module):
    """One projection of a fused set: rows start:stop of `shared`'s product (in_features -> out_features)."""

    def __init__(self, shared: SharedProduct, start: int, stop: int):
        super().__init__()
        # a plain attribute, not a submodule: the set's parts share one parameter, registered once (SharedProduct
        # is the holder's attribute `fused_<first name>`)
        self.__dict__["shared"] = shared
        self.start, self.stop = start, stop
        self.in_features, self.out_features = shared.weight.shape[1], stop - start

    @property
    def weight(self) -> torch.Tensor:
        """This projection's rows of the fused weight (a view): [out_features, in_features]."""
        return self.shared.weight[self.start : self.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.rows(x, self.start, self.stop)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.start}:{self.stop}"


def _fusible(linears: list[nn.Module]) -> bool:
    if not all(type(m) is nn.Linear for m in linears):  # quantized or already fused projections are left alone
        return False
    w = linears[0].weight
    same = all(m.weight.shape[1] == w.shape[1] and m.weight.dtype == w.dtype and m.weight.device == w.device
               for m in linears)
    return same and len({m.bias is None for m in linears}) == 1


def fuse_module(holder: nn.Module, names: tuple[str, ...]) -> bool:
    """Fuse holder's sibling projections `names` (nn.Linear, same input width, dtype and device) in place.
    Returns whether they were fused."""
    linears = [getattr(holder, name, None) for name in names]
    if any(m is None for m in linears) or not _fusible(linears):
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if linears[0].bias is not None else None
    shared = SharedProduct(weight, bias, len(names))
    setattr(holder, f"fused_{names[0]}", shared)
    start = 0
    for name, m in zip(names, linears):
        stop = start + m.weight.shape[0]
        setattr(holder, name, ProjectionPart(shared, start, stop))  # frees the original weight
        start = stop
    return True


def fuse_projections(model: nn.Module) -> int:
    """Fuse every FUSED_SETS set found in model's decoder layers (idempotent). Returns how many sets were fused now."""
    fused = 0
    for layer in model.get_decoder().layers:
        for holder in list(layer.modules()):
            for names in FUSED_SETS:
                fused += fuse_module(holder, names)
    return fused


def fused_sets(model: nn.Module) -> int:
    """How many fused sets model's decoder layers hold."""
    return sum(isinstance(m, SharedProduct) for layer in model.get_decoder().layers for m in layer.modules())


def unfused_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() in the layout of the checkpoint it was loaded from: each fused set's weight (and bias) as
    its projections' `<name>.weight` rows (views of the fused tensors: nothing is copied)."""
    state = model.state_dict()
    for prefix, holder in model.named_modules():
        parts = {name: m for name, m in holder.named_children() if isinstance(m, ProjectionPart)}
        for name, part in parts.items():
            shared = part.shared
            key = f"{prefix}.{name}" if prefix else name
            state[f"{key}.weight"] = shared.weight.detach()[part.start : part.stop]
            if shared.bias is not None:
                state[f"{key}.bias"] = shared.bias.detach()[part.start : part.stop]
        for name, m in holder.named_children():
            if isinstance(m, SharedProduct):
                key = f"{prefix}.{name}" if prefix else name
                state.pop(f"{key}.weight", None)
                state.pop(f"{key}.bias", None)
    return state
