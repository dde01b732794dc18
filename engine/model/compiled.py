"""Decoder layers compiled by torch.compile around the engine's own attention: the default on one CUDA device
(`compile="auto"`), on request elsewhere (`"on"`), off with `"off"`.

Each decoder layer's forward goes through `nn.Module.compile()` (PyTorch's per-instance API; no transformers code is
replaced). The engine's attention function and its cache update are `torch.compiler.disable`d, so dynamo compiles
what lies between them: the norms, the projections, RoPE, the MLP and the residual adds become a few fused
inductor kernels per layer instead of ~50 eager ones, and the engine's kernels run as they are. Compiled code is
captured by engine.model.graph's CUDA graphs like eager code. Layers share their compiled code (dynamo passes a
module's parameters as inputs); so that the layer index each layer hands to the cache does not specialise one
compilation per layer (and exhaust dynamo's recompile limit after 8), dynamo is told to treat integer module
attributes as inputs (`allow_unspec_int_on_nn_module`, a process-wide dynamo setting). On a GPU whose kernels the
engine launches with programmatic dependent launch (kernels/launch.py), inductor's kernels are generated for it too
(`triton.enable_pdl`, process-wide): a step's chain alternates between the two, and a launch with PDL after one
without it gains nothing (engine/bench/README.md).

Compilation happens at a layer's first call per input shape. `warm_up` pays it once per process, when the model is
loaded (a stage of the load the app and the command line show): calls of three lengths over a small random context,
so that a question's prefill (any length: the second length makes dynamo compile the token dimension as dynamic),
a decode step (one token, which dynamo specialises) and an ingest's chunks find their code compiled; where turns are
answered together, decode steps of two and three sequences too (the batch dimension compiled as dynamic: every
batch size finds its code compiled; without them a server's first batches compile for seconds while their turns
wait: engine/bench/README.md, "Several users on one GPU").
"""

from __future__ import annotations

import time

import torch
import torch._inductor.config as inductor_config

from engine.attention.function import StepContext
from engine.model.batch import forward_batch
from engine.model.load import LoadedModel
from engine.model.prefill import prefill
from kernels import launch
from kernels.backend import Backend

COMPILE_MODES = ("auto", "on", "off")
# The warm-up's calls, in tokens: a first length (compiled for its static shape), a second one (the token dimension
# compiled as dynamic: every later length of two or more tokens), then one token (a decode step's specialisation).
WARM_UP_LENGTHS = (40, 24, 1)
# Decode steps of this many sequences (engine.model.batch), where turns are answered together: dynamo specialises the
# first batch size it sees and compiles the batch dimension as dynamic at the second.
WARM_UP_BATCHES = (2, 3)


def wants_compile(mode: str | bool, lm: LoadedModel) -> bool:
    """Whether `mode` compiles the layers of `lm`: "on" (or True) always, "off" (or False) never, "auto" where the
    whole model sits on one CUDA device (torch.compile's gain there: decode steps 1.15-1.2x on an H200 at 128K;
    engine/bench/README.md)."""
    if isinstance(mode, bool):
        return mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    devices = {(torch.device(d).type, torch.device(d).index or 0) for d in [lm.device, *lm.layer_devices]}
    return lm.device.type == "cuda" and len(devices) == 1


def compile_layers(lm: LoadedModel) -> int:
    """Compile every decoder layer of lm.model in place (idempotent). Returns how many layers were compiled now.
    Compilation itself happens at each layer's first call per input shape (seconds to a minute on a GPU): warm_up."""
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    if launch.supported(lm.device) and hasattr(inductor_config.triton, "enable_pdl"):
        inductor_config.triton.enable_pdl = True
    compiled = 0
    for layer in lm.model.get_decoder().layers:
        if not _compiled(layer):
            layer.compile()
            compiled += 1
    return compiled


def warm_up(lm: LoadedModel, backend: Backend, batch: int = 1) -> float:
    """Run the compiled layers once at each of WARM_UP_LENGTHS (dense attention over a small random context: the
    engine's own prefill path) and, with batch > 1 (turns answered together), a decode step of WARM_UP_BATCHES
    sequences up to `batch`, so that their compilation is paid here rather than by a user's first question.
    Returns the seconds it took."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    for length in WARM_UP_LENGTHS:
        ids = torch.randint(0, lm.config.vocab_size, (length,), generator=gen)
        cache, _ = prefill(lm, ids, 1, backend, chunk=length)
    for size in (b for b in WARM_UP_BATCHES if b <= batch):
        steps = []
        for b in range(size):  # sequences over the last context (forks: new-token buffers of their own)
            fork = cache if b == 0 else cache.fork()
            fork.reserve(1)
            steps.append(StepContext(cache=fork, method=None, plan=None, backend=backend))
        with torch.inference_mode():
            forward_batch(lm, steps, torch.zeros(size, dtype=torch.int64), [length] * size)
        cache.reset_dynamic()
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return time.perf_counter() - start


def layers_compiled(lm: LoadedModel) -> bool:
    return all(_compiled(layer) for layer in lm.model.get_decoder().layers)


def _compiled(module: torch.nn.Module) -> bool:
    """Whether nn.Module.compile() was called on `module` (it sets the compiled call PyTorch's __call__ uses)."""
    return getattr(module, "_compiled_call_impl", None) is not None
