"""One decode step of several sequences in one forward call: each over its own fixed context, with its own method,
plan and new tokens.

Sequence b is a StepContext of its own (engine.attention.function.StepContext: a context's cache, or a fork of it
for a second sequence over the same context, FixedContextCache.fork) whose question was prefilled alone
(engine.model.generate.forward_step). A step feeds each sequence's last token at its own position; the model's
products, norms and MLPs run once over the B tokens, and each sequence's attention is the one a call of its own
would compute (engine.attention.function.BatchStep), so its logits are those of its step alone, up to the order in
which a batched product sums. On a GPU the sequences attend at once, each on a CUDA stream of its own.
"""

from __future__ import annotations

import torch

from engine.attention.cache import BatchCache
from engine.attention.function import BatchStep, StepContext
from engine.model.load import LoadedModel

# Whether a batch's sequences attend at once on CUDA streams of their own (BatchStep.streams) rather than one after
# another: a benchmark's switch (squeeze bench serve --no-concurrent)
CONCURRENT = True
# Whether a batch's sequences attending at once each plan their union kernels for their share of the GPU's workers
# (BatchStep.split_gpu) rather than for all of them: off, slower where measured (engine/bench/README.md, "Several
# users on one GPU": 8 x 32K on an H100, 10.67 against 10.43 ms a step with squeeze, 21.92 against 18.64 with full
# attention); `squeeze bench serve --steps N` times both ("concurrent_ms" and "split_ms")
SPLIT_GPU = False
# Whether a batch's lookups and attentions at a global layer share their kernels' launches (BatchStep.shared): off,
# slower than streams where measured (engine/bench/README.md, "Several users on one GPU": 4 x 32K on an H200 at commit
# 9997d08, 8.49 against 7.23 ms a step, though the shared union launch alone beats a launch per sequence); `squeeze
# bench serve --steps N` times both
SHARED_LAUNCHES = False


def side_streams(device: torch.device, batch: int) -> list:
    """The streams sequences 1 .. batch - 1 of a batch on `device` attend on (engine.attention.function.BatchStep):
    torch.cuda.Stream from torch's pool on a GPU with CONCURRENT; none elsewhere."""
    if device.type != "cuda" or not CONCURRENT:
        return []
    return [torch.cuda.Stream(device=device) for _ in range(batch - 1)]


def forward_batch(lm: LoadedModel, steps: list[StepContext], tokens: torch.Tensor, positions: list[int],
                  streams: list | None = None, shared: bool | None = None,
                  split_gpu: bool | None = None) -> torch.Tensor:
    """One call over tokens [B] int64, token b at positions[b] of sequence steps[b] (its K/V joins that sequence's
    new tokens). streams: the side streams the sequences attend on (side_streams' by default); shared: whether
    their union kernels share launches (SHARED_LAUNCHES by default); split_gpu: whether sequences on streams plan
    their union kernels for their share of the GPU (SPLIT_GPU by default). Returns the logits [B, V] on the device."""
    if tokens.shape != (len(steps),) or len(positions) != len(steps) or not steps:
        raise ValueError(f"one token and one position per sequence: {len(steps)} sequences, tokens "
                         f"{tuple(tokens.shape)}, {len(positions)} positions")
    tokens = tokens.to(lm.device)
    for b, step in enumerate(steps):
        step.positions = torch.full((1,), positions[b], dtype=torch.int64, device=lm.device)
        if step.follow is not None:
            step.follow.begin(tokens[b : b + 1])
        if step.recorder is not None:
            step.recorder.begin_step()
    position_ids = torch.stack([step.positions for step in steps])  # [B, 1]
    out = lm.model(input_ids=tokens[:, None], position_ids=position_ids,
                   past_key_values=BatchCache([step.cache for step in steps]), use_cache=True, logits_to_keep=1,
                   squeeze_step=BatchStep(steps, side_streams(lm.device, len(steps)) if streams is None else streams,
                                          split_gpu=SPLIT_GPU if split_gpu is None else split_gpu,
                                          shared=SHARED_LAUNCHES if shared is None else shared))
    return out.logits[:, -1]
