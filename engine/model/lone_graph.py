"""A batch of one turn replayed from its session's own captured decode step (engine.model.graph.StepGraphs), in the
form of a BatchGraph (engine.model.batch_graph), so that a server answering turns together steps a lone turn as a
server of one turn at a time does.

A BatchGraph is captured for the turns in the batch, anew whenever one joins or leaves: a turn alone in the batch
would pay a capture at every question and again whenever it is left alone. Its session's decode step is captured once
per method, plan and recording (StepGraphs, the step a turn answered alone replays) and kept across the session's
turns, so a lone turn in the batch replays that one: captured at its session's first such step, replayed at every
later one, with no capture when the others leave it alone.
"""

from __future__ import annotations

import torch

from engine.attention.function import StepContext
from engine.model.graph import DecodeGraph


class LoneGraph:
    """The decode step of one turn (`step`: its session's StepContext, whose `graphs` are its session's StepGraphs),
    with what TurnBatch uses of a BatchGraph: ids [1] int64 the step's greedy token after a replay (the next input),
    steps_run (a warm step included), replay, feed, flush; captured: whether the session's step was captured before
    (else `warm_and_capture` captures it)."""

    def __init__(self, step: StepContext):
        if step.graphs is None:
            raise ValueError("a lone graph replays its session's captured step: the step has no graphs")
        self._step = step
        self._graph, self.captured = step.graphs.get(step)
        graph: DecodeGraph = self._graph
        self.ids = graph.ids.view(1)
        if graph.totals is not None:  # where the turn's statistics add up (None: it records none)
            graph.totals.reset()
        self.steps_run = 0
        self._counted = 0  # steps run eagerly (a warm one): the cache's host count holds their tokens already

    def warm_and_capture(self, tokens: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The step of tokens [1] int64 (on the device) at positions [1]: replayed where the session's step is
        captured, else run eagerly in the captured form and captured (DecodeGraph.warm_and_capture). Returns its
        logits [1, V]; `ids` then holds its greedy token."""
        graph: DecodeGraph = self._graph
        graph.set_input(tokens.reshape(1), positions[0])
        if self.captured:
            return self.replay()
        graph.warm_and_capture(self._step)
        self.captured = True
        self.steps_run = self._counted = 1
        return graph.warm_logits

    def replay(self) -> torch.Tensor:
        """One step; returns its logits [1, V] (the capture's buffer, valid until the next replay)."""
        self.steps_run += 1
        return self._graph.replay_logits()

    def feed(self, b: int, token: torch.Tensor) -> None:
        """token [1] int64 on the device: the next input instead of the greedy token (a sampled one)."""
        self._graph.feed(token.reshape(1))

    def flush(self) -> None:
        """Hand the turn's statistics of the steps run so far to its recorder, and the replayed steps' tokens to its
        cache's host count, once (as BatchGraph.flush)."""
        totals = self._graph.totals
        if totals is not None and self._step.recorder is not None:
            self._step.recorder.add_decode(totals, self.steps_run)
            totals.reset()
        self._step.cache.replayed(max(self.steps_run - self._counted, 0))
        self.steps_run = self._counted = 0
