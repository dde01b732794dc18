"""The decode step of several turns answered together (engine.model.batch.forward_batch), captured once in a CUDA
graph for the turns in the batch and replayed while they stay: no Python between the kernels of B sequences.

What a capture fixes: the turns (their caches' new-token buffers, methods and plans, follow rows and whether they
record statistics), in their order. It reads from device buffers what changes between steps: the B input tokens
and positions (`BatchGraph.ids`, `.positions`, advanced by the step itself to its greedy tokens and the next
positions), each cache's count of new tokens, and it adds each turn's statistics into a device total of its own
(`totals[b]`, handed to the turn's recorder by `flush`). A turn joining or leaving makes another batch: its graph is
captured anew, as a lone turn's first step is (engine.model.graph.DecodeGraph): one step run eagerly in the captured
form, then the capture; or, where every turn ran in the batch's last captured step (a turn left: nothing new to
compile or set up; TurnBatch.unwarmed), the capture alone, then its first replay.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.attention.cache import BatchCache
from engine.attention.function import BatchStep, StepContext
from engine.attention.stats import StepTotals
from engine.model import batch as batching
from engine.model.batch import side_streams
from engine.model.capture import capturing
from engine.model.load import LoadedModel
from engine.model.sampling import greedy


class BatchGraph:
    """One captured decode step of `steps` (B turns' StepContexts, each with its cache's new-token buffers reserved
    for the rest of its answer). pool: the memory pool its capture allocates from, shared with the batch's earlier
    captures, never replayed again once this one is (None: a pool of its own). streams: at least B CUDA streams, the
    capture's and those sequences 1 .. B - 1 attend on, shared with the batch's earlier captures (None: new ones).
    ids: [B] int64 the step's input tokens; positions: [B] int64 their positions; logits: [B, V] the last step's (the
    capture's buffer). totals[b]: where turn b's statistics add up (None: it records none); steps_run: the steps run
    since the capture began (a warm one included)."""

    def __init__(self, lm: LoadedModel, steps: list[StepContext], pool=None, streams: list | None = None):
        if not steps:
            raise ValueError("a batch graph needs at least one turn")
        self.lm = lm
        batch = len(steps)
        self.ids = torch.zeros(batch, dtype=torch.int64, device=lm.device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=lm.device)
        self.logits: torch.Tensor | None = None
        self.totals = [StepTotals.zeros(len(lm.global_layers), lm.num_heads, lm.device)
                       if step.recorder is not None else None for step in steps]
        self._steps = [replace(step, positions=self.positions[b : b + 1], static=True, graphs=None)
                       for b, step in enumerate(steps)]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps_run = 0
        self._pool = pool
        self._counted = 0  # steps run eagerly (a warm one): the caches' host counts hold their tokens already
        if streams is None:
            self._stream = torch.cuda.Stream(device=lm.device)
            self._side = side_streams(lm.device, batch)  # where sequences 1 .. B - 1 attend
        else:  # (reused: the caching allocator's blocks of a stream serve its next capture)
            self._stream = streams[0]
            self._side = list(streams[1:batch]) if batching.CONCURRENT else []
        self._split_gpu = batching.SPLIT_GPU
        self._shared = batching.SHARED_LAUNCHES
        self._keep: list = []  # the host tables the captured step's shared launches upload (BatchStep.keep)

    def __len__(self) -> int:
        return len(self._steps)

    def _forward(self) -> None:
        for b, step in enumerate(self._steps):
            if step.follow is not None:
                step.follow.begin(self.ids[b : b + 1])
        cache = BatchCache([step.cache for step in self._steps], self._keep)
        out = self.lm.model(input_ids=self.ids[:, None], position_ids=self.positions[:, None], past_key_values=cache,
                            use_cache=True, logits_to_keep=1,
                            squeeze_step=BatchStep(self._steps, self._side, split_gpu=self._split_gpu,
                                                                 shared=self._shared, keep=self._keep))
        self.logits = out.logits[:, -1]  # [B, V]
        self.ids.copy_(greedy(self.logits))
        self.positions.add_(1)

    def warm_and_capture(self, tokens: torch.Tensor, positions: list[int], warm: bool = True) -> torch.Tensor:
        """The step of tokens [B] int64 (on the device) at `positions`, and the capture of the step. warm: run it
        eagerly in the captured form first (it compiles the kernels for these shapes and sets up the stream's
        handles), then capture the next one; else capture at once and replay the capture for this step (turns that
        all ran in a captured step before). Returns this step's logits [B, V]; `ids` then holds its greedy
        tokens and `positions` the next ones, ready for `replay` (a sampled turn's choice goes into ids by `feed`)."""
        self.ids.copy_(tokens.reshape(-1))
        self.positions.copy_(torch.tensor(positions, dtype=torch.int64))
        for step, totals in zip(self._steps, self.totals):
            if step.recorder is not None:
                step.recorder.current = totals
                step.recorder.timing = False  # counted like the replays it stands for
        device = self.lm.device
        try:
            self._stream.wait_stream(torch.cuda.current_stream(device))
            if warm:
                with torch.cuda.stream(self._stream):
                    self._forward()
                torch.cuda.current_stream(device).wait_stream(self._stream)
                self.steps_run = self._counted = 1
                out = self.logits
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._stream, self._pool):
                self._forward()  # recorded, not run: the inputs stay as the warm step (or the caller) left them
            self.graph = graph
        finally:
            for step in self._steps:
                if step.recorder is not None:
                    step.recorder.current = None
                    step.recorder.timing = True
        return out if warm else self.replay()

    def replay(self) -> torch.Tensor:
        """One step of every turn; returns its logits [B, V] (the capture's buffer, valid until the next replay)."""
        self.graph.replay()
        self.steps_run += 1
        return self.logits

    def feed(self, b: int, token: torch.Tensor) -> None:
        """token [1] int64 on the device: turn b's next input instead of its greedy token (a sampled one)."""
        self.ids[b : b + 1].copy_(token.reshape(1))

    def flush(self) -> None:
        """Hand each turn's statistics of the steps run so far to its recorder, and the replayed steps' tokens to
        its cache's host count (a warm step counted its own), once: the graph is dropped after."""
        for step, totals in zip(self._steps, self.totals):
            if totals is not None:  # (a turn with a recorder)
                step.recorder.add_decode(totals, self.steps_run)
            step.cache.replayed(max(self.steps_run - self._counted, 0))
        self.steps_run = self._counted = 0
