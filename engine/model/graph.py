"""A decode step, and a question's prefill at a padded length, captured once in a CUDA graph and replayed: no Python
between their kernels.

A captured decode step reads everything that changes between tokens from device buffers: its input token and
position (`DecodeGraph.ids`, `.positions`, advanced by the step itself, so replays chain without the host), the
new-token K/V slots and their count (engine.attention.cache), and it adds its statistics into device totals
(engine.attention.stats). A captured prefill (`PrefillGraph`) reads the question's tokens padded to its length and
the count of the real ones (`ids`, `valid`): every pooled lookup counts those only (engine.methods' `valid`), the
padding's attention is masked by position from theirs, and the cache keeps the real tokens' K/V only. What a capture
fixes: the method and its plan (a budget), whether statistics are recorded, the prefill's length, and the new-token
buffers; `StepGraphs` keeps the last few captures of each kind for a session and drops them when the buffers move.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.attention.function import StepContext
from engine.attention.stats import StepTotals
from engine.model.capture import capturing
from engine.model.generate import padded_forward
from engine.model.load import LoadedModel
from engine.model.sampling import greedy

MAX_GRAPHS = 2  # decode captures kept per session (each holds its own memory pool: lookups' scratch, selections)
MAX_PREFILL_GRAPHS = 3  # prefill captures kept per session (one per padded length in use)


def graphs_supported(lm: LoadedModel) -> bool:
    """A decode step can be captured: the whole model on one CUDA device."""
    devices = {torch.device(d) for d in lm.layer_devices} | {lm.device}
    return lm.device.type == "cuda" and len({(d.type, d.index or 0) for d in devices}) == 1


class TokenReadback:
    """Tokens copied from the device into pinned host memory without waiting: `stage(token)` queues the copy of
    token [1] int64 (on the device) behind the work queued so far and returns a ticket; `read(ticket)` waits for that
    copy alone and returns the token. Two slots, used in turn: a ticket stays readable until two more are staged (a
    replayed step's token is read while its successor runs)."""

    def __init__(self):
        self.slots = [torch.zeros(1, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def stage(self, token: torch.Tensor) -> int:
        ticket = self.turn
        self.turn ^= 1
        self.slots[ticket].copy_(token.view(1), non_blocking=True)
        self.events[ticket].record()
        return ticket

    def read(self, ticket: int) -> int:
        self.events[ticket].synchronize()
        return int(self.slots[ticket])


class DecodeGraph:
    """One captured decode step. ids: [1, 1] int64 the step's input token; positions: [1] int64 its position;
    next_token: [1] int64 the greedy token it produced (also copied into ids; positions advance by one);
    logits: [1, V] the last step's logits.

    totals: where the step adds its statistics (None: recorded nothing); zeroed by the caller at a turn's start.
    Replays chain on the device (each step's input is its predecessor's token, written by the step itself or by
    `feed`), so `launch` queues a step and returns a ticket for its token, which `read` returns once the step has
    run: a caller launches step t + 1 before reading step t's token, and the GPU never waits for the host.
    """

    def __init__(self, lm: LoadedModel, step: StepContext):
        self.lm = lm
        self.ids = torch.zeros(1, 1, dtype=torch.int64, device=lm.device)
        self.positions = torch.zeros(1, dtype=torch.int64, device=lm.device)
        self.next_token = torch.zeros(1, dtype=torch.int64, device=lm.device)
        self.logits: torch.Tensor | None = None
        self.warm_logits: torch.Tensor | None = None
        self.totals: StepTotals | None = None
        if step.recorder is not None:  # the capture records statistics
            self.totals = StepTotals.zeros(len(lm.global_layers), lm.num_heads, lm.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.ready = False  # captured completely (a capture that raised is redone at the next turn)
        self._stream = torch.cuda.Stream(device=lm.device)
        self._step = replace(step, positions=self.positions, static=True, graphs=None)
        self._readback = TokenReadback()

    def _forward(self, step: StepContext) -> None:
        if step.follow is not None:
            step.follow.begin(self.ids)
        out = self.lm.model(input_ids=self.ids, position_ids=self.positions[None], past_key_values=step.cache,
                            use_cache=True, logits_to_keep=1, squeeze_step=step)
        self.logits = out.logits[0, -1:]  # [1, V]: after a replay, that step's logits (the capture's output buffer)
        self.next_token.copy_(greedy(self.logits))
        self.ids.copy_(self.next_token.view(1, 1))
        self.positions.add_(1)

    def set_input(self, token: torch.Tensor, position: int) -> None:
        """token: [1] int64 on the device (no host round trip); position: the token's position."""
        self.ids.copy_(token.view(1, 1))
        self.positions.fill_(position)

    def warm_and_capture(self, step: StepContext) -> int:
        """Run one real decode step eagerly in the captured form (on the capture stream: it compiles the kernels
        for these shapes and sets up the stream's handles), then capture the next one. Returns the warm step's
        token; the inputs then hold it and its successor's position, ready for `replay`."""
        recorder = step.recorder
        warm = replace(self._step, recorder=recorder)
        if recorder is not None:
            recorder.current = self.totals
            recorder.timing = False  # counted like the replays it stands for: not in the lookup/attention split
        self._stream.wait_stream(torch.cuda.current_stream(self.lm.device))
        with torch.cuda.stream(self._stream):
            self._forward(warm)
        torch.cuda.current_stream(self.lm.device).wait_stream(self._stream)
        token = int(self.next_token)
        self.warm_logits = self.logits  # the warm step's own (the capture below replaces self.logits)
        self.graph = torch.cuda.CUDAGraph()
        with capturing(self.graph, self._stream):
            self._forward(warm)  # recorded, not run: the inputs stay as the warm step left them
        if recorder is not None:
            recorder.current = None
            recorder.timing = True
        self._step = None  # the capture holds what it needs; drop the turn's recorder
        self.ready = True
        return token

    def replay(self) -> int:
        """One decode step; returns its token (the one host synchronisation of a step)."""
        self.graph.replay()
        return int(self.next_token)

    def replay_logits(self) -> torch.Tensor:
        """One decode step, its logits [1, V] (the capture's buffer, valid until the next replay); nothing is read
        back. The step's greedy token is its successor's input unless `feed` replaces it."""
        self.graph.replay()
        return self.logits

    def feed(self, token: torch.Tensor) -> None:
        """token [1] int64 on the device: the next step's input instead of the greedy one (a sampled token)."""
        self.ids.copy_(token.view(1, 1))

    def launch(self, pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
        """Queue one decode step without waiting for it: the greedy token, or pick(logits [1, V]) -> [1] int64 on
        the device (a sampler's choice, then fed to the next step). Returns the ticket `read` takes."""
        self.graph.replay()
        if pick is None:
            return self._readback.stage(self.next_token)
        token = pick(self.logits)
        self.feed(token)
        return self._readback.stage(token)

    def read(self, ticket: int) -> int:
        """The token of the step `launch` returned `ticket` for, once that step has run (valid until two more
        launches)."""
        return self._readback.read(ticket)


class PrefillGraph:
    """A question's prefill at one padded length, captured once: ids [length] int64 the question's tokens then
    padding, valid [1] int64 how many are real, positions [length] int64; logits [1, V] the last real token's.

    totals: the prefill's statistics (None: recorded nothing), handed to each turn's recorder after a replay."""

    def __init__(self, lm: LoadedModel, step: StepContext, length: int):
        self.lm, self.length = lm, length
        self.ids = torch.zeros(length, dtype=torch.int64, device=lm.device)
        self.valid = torch.ones(1, dtype=torch.int64, device=lm.device)
        self.positions = torch.zeros(length, dtype=torch.int64, device=lm.device)
        self.logits: torch.Tensor | None = None
        self.totals: StepTotals | None = None
        if step.recorder is not None:
            self.totals = StepTotals.zeros(len(lm.global_layers), lm.num_heads, lm.device, prefill=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self._stream = torch.cuda.Stream(device=lm.device)
        self._step = replace(step, positions=self.positions, valid=self.valid, static=True, graphs=None)

    def _forward(self, step: StepContext) -> None:
        self.logits = padded_forward(self.lm, step, self.ids, self.valid)
        step.cache.keep_new(self.valid)

    def set_input(self, prompt: torch.Tensor, start: int) -> None:
        """prompt: [n] int64 on the device (n <= length); start: its first position."""
        n = prompt.numel()
        self.ids[:n].copy_(prompt)
        self.ids[n:].zero_()
        self.valid.fill_(n)
        torch.arange(start, start + self.length, device=self.lm.device, out=self.positions)

    def run(self, step: StepContext, prompt: torch.Tensor, start: int) -> torch.Tensor:
        """The prefill of `prompt` at positions start..: replayed, or (the first time) run eagerly in the captured
        form on the capture stream, then captured for the next questions. Returns the last real token's logits
        [1, V] (the graph's buffer: valid until its next replay); the recorder, if any, gets the statistics."""
        recorder = step.recorder
        self.set_input(prompt, start)
        if self.totals is not None:
            self.totals.reset()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._warm_and_capture(step)
        step.cache.keep_new(self.valid, prompt.numel())
        if recorder is not None and self.totals is not None:
            recorder.add_prefill(self.totals)
        return self.logits

    def _warm_and_capture(self, step: StepContext) -> None:
        """The question's prefill eagerly in the captured form (it compiles the kernels for these shapes and sets up
        the stream's handles), then the capture of the same call, which is recorded, not run: the inputs, the
        caches' counts and the statistics stay as the warm call left them."""
        recorder = step.recorder
        warm = replace(self._step, recorder=recorder)
        if recorder is not None:
            recorder.current = self.totals
            recorder.timing = False
        device = self.lm.device
        self._stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(self._stream):
                self._forward(warm)
            torch.cuda.current_stream(device).wait_stream(self._stream)
            warm.cache.reset_dynamic()  # the capture records the call as a turn's first (run() then keeps the real
            # tokens' count); the warm call's K/V stay in the buffers
            # The capture runs nothing: the totals' sums stay the warm call's, but its logits and its kept units become
            # the graph's own (unwritten) buffers, into which the warm call's, this question's, are copied.
            warm_logits = self.logits
            warm_clusters = dict(self.totals.clusters) if self.totals is not None else {}
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._stream):
                self._forward(warm)
            for layer, entry in warm_clusters.items():
                for buffer, value in zip(self.totals.clusters[layer], entry):
                    if buffer is not None:
                        buffer.copy_(value)
            self.logits.copy_(warm_logits)
            self.graph = graph
        finally:
            if recorder is not None:
                recorder.current = None
                recorder.timing = True
        self._step = None


class StepGraphs:
    """The captured decode steps of one session, by (method, plan, recording), and its captured prefills, by
    (method, plan, recording, length); most recent last."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self._graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()
        self._prefills: OrderedDict[tuple, PrefillGraph] = OrderedDict()
        self._buffers: tuple[int, ...] = ()

    def _check_buffers(self, step: StepContext) -> None:
        buffers = tuple(layer.new_keys.data_ptr() if layer.new_keys is not None else 0 for layer in step.cache.layers)
        if buffers != self._buffers:  # the new-token buffers were reallocated: every capture points at old ones
            self._graphs.clear()
            self._prefills.clear()
            self._buffers = buffers

    def prefill(self, step: StepContext, prompt: torch.Tensor, start: int, length: int) -> torch.Tensor:
        """The question's prefill padded to `length` (PrefillGraph.run): the last real token's logits [1, V]."""
        self._check_buffers(step)
        key = (step.method.name, step.plan, step.recorder is not None, length)
        graph = self._prefills.get(key)
        if graph is None or graph.graph is None:
            self._prefills.pop(key, None)
            while len(self._prefills) >= MAX_PREFILL_GRAPHS:
                self._prefills.popitem(last=False)
            graph = PrefillGraph(self.lm, step, length)
            self._prefills[key] = graph
        self._prefills.move_to_end(key)
        return graph.run(step, prompt, start)

    def get(self, step: StepContext) -> tuple[DecodeGraph, bool]:
        """The decode graph for `step`, and whether it is captured already (else the caller runs
        warm_and_capture)."""
        self._check_buffers(step)
        key = (step.method.name, step.plan, step.recorder is not None)
        graph = self._graphs.get(key)
        if graph is not None and graph.ready:
            self._graphs.move_to_end(key)
            return graph, True
        self._graphs.pop(key, None)
        while len(self._graphs) >= MAX_GRAPHS:
            self._graphs.popitem(last=False)
        graph = DecodeGraph(self.lm, step)
        self._graphs[key] = graph
        return graph, False

    def clear(self) -> None:
        self._graphs.clear()
        self._prefills.clear()
