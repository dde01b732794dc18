"""Turns answered together: each question prefilled alone when its turn joins, then every turn's next token from one
forward call a step (engine.model.batch.forward_batch), each turn over its own context, method and plan.

A turn may join between any two steps and leaves when its answer ends; the others go on undisturbed. A question longer
than its step's prefill_chunk is prefilled a call between two steps of the others (the calls a lone turn runs back to
back: engine.model.generate.QuestionPrefill), so that it holds them up one call at a time. With greedy choice a turn's
tokens are those it gets alone (tests/engine/test_batching.py). Where every turn's session replays its steps from CUDA
graphs (one GPU), the batch's step is captured too (engine.model.batch_graph.BatchGraph), anew each time a turn joins or
leaves, and replayed while the same turns stay; a turn alone in the batch replays its session's own captured step, kept
across the session's turns (engine.model.lone_graph.LoneGraph: no capture of its own); elsewhere (the CPU) every call
runs eagerly. A joining question's prefill runs as a lone turn's does (replayed at a padded length where its session has
graphs and it fits one call). With `TurnBatch.ahead` each step is launched before the previous one's tokens are read
back, as a lone turn's replayed steps are (engine.model.generate): a turn that leaves (its end-of-sequence token, its
reader gone) has then run one step more than it answers, which its statistics count.
"""

from __future__ import annotations

import torch

from engine.context.turn import Delta, Turn
from engine.model import capture
from engine.model.batch import forward_batch
from engine.model.batch_graph import BatchGraph
from engine.model.generate import QuestionPrefill
from engine.model.load import LoadedModel
from engine.model.lone_graph import LoneGraph
from engine.model.sampling import choose

# Whether a GPU's batch launches each step before reading the previous one's tokens back (TurnBatch.ahead), as a lone
# turn's own path does (engine.model.generate): on an H100, 8 x 32K (engine/bench/README.md, "Several users on one
# GPU": h100-serve-8x32k-split.json), one turn 6.84 ms a step against 6.91 without (6.85 on its session's own path),
# eight 10.29 against 10.43
AHEAD = True
# Steps a GPU's batch runs eagerly after its turns change before it captures their step (TurnBatch.capture_after):
# a capture costs about as much as an eager step and its recording; turns that stay only a few steps are cheaper
# uncaptured. 0: captured at the first step, as a lone turn's session does
CAPTURE_AFTER = 0
# Whether a GPU's batch whose turns all ran in its last captured step (a turn left) captures their step without a warm
# step first (BatchGraph.warm_and_capture: the capture, then its replay): their kernels, and those of the batch's
# dense part at every size (engine.model.compiled.warm_up), have run already (measured with capture.SYNC_FIRST off)
CAPTURE_UNWARMED = True


class _Launched:
    """A step launched for `turns` (in the batch's order then): chosen [B] int64 each turn's token on the device,
    copied into pinned host memory behind the step without waiting (on a GPU); positions: each turn's input
    position; graph: the batch graph it replayed (None: run eagerly)."""

    def __init__(self, turns: list[Turn], chosen: torch.Tensor, positions: list[int],
                 graph: BatchGraph | LoneGraph | None):
        self.turns, self.chosen, self.positions, self.graph = turns, chosen, positions, graph
        self._host, self._event = chosen, None
        if chosen.device.type == "cuda":
            self._host = torch.empty(chosen.shape, dtype=chosen.dtype, pin_memory=True)
            self._host.copy_(chosen, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def values(self) -> list[int]:
        """The turns' tokens, once the step has run (waits for it alone, not for a step launched after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class TurnBatch:
    """The turns being answered together over one model. ahead: launch each step before the previous one's tokens
    are read back, so that the GPU does not wait for the host between steps (None: AHEAD on a GPU; on the CPU a
    step computed ahead only delays the tokens of the one before). capture_after: on a GPU, the steps run eagerly
    each time the turns change before their step is captured (None: CAPTURE_AFTER). unwarmed: capture without a warm
    step where every turn ran in the last captured step (None: CAPTURE_UNWARMED)."""

    def __init__(self, lm: LoadedModel, ahead: bool | None = None, capture_after: int | None = None,
                 unwarmed: bool | None = None):
        self.lm = lm
        self.ahead = ahead if ahead is not None else AHEAD and lm.device.type == "cuda"
        self.capture_after = CAPTURE_AFTER if capture_after is None else capture_after
        if self.capture_after < 0:
            raise ValueError(f"capture_after must be >= 0, got {self.capture_after}")
        self.unwarmed = CAPTURE_UNWARMED if unwarmed is None else unwarmed
        self._captured: list[Turn] = []  # the turns of the last captured step
        self._pool = None  # the memory pool the batch's captures share (capture.SharedPool; None: each its own)
        self._streams: list = []  # the CUDA streams they share (with the pool)
        self._uncaptured = 0  # eager steps the turns as they are now have run on a replayable batch
        self.captures = 0  # the batch's steps captured so far
        self._ahead: _Launched | None = None  # the step launched ahead, not read back yet
        self.turns: list[Turn] = []  # the turns taking a token a step, in the order they joined
        self.joining: list[tuple[Turn, QuestionPrefill]] = []  # turns whose long question is still being prefilled
        self._next: dict[int, tuple[torch.Tensor, int]] = {}  # id(turn) -> (its next input token [1], position)
        self._graph: BatchGraph | LoneGraph | None = None  # the captured step of `turns` as they are now (a GPU's)

    def __len__(self) -> int:
        return len(self.turns) + len(self.joining)

    def join(self, turn: Turn) -> Delta | None:
        """Start the turn's question's prefill alone: its first call, and, where that was the last (a question of
        at most its step's prefill_chunk tokens), its first token: the piece it shows, if any. A longer question
        goes on a call a step (`step`). A turn whose answer ends at its first token (turn.done) does not stay."""
        prefill = QuestionPrefill(self.lm, turn.step, turn.prompt, turn.max_new_tokens, turn.sampler)
        if not prefill.advance():
            self.joining.append((turn, prefill))
            return None
        return self._first(turn, prefill)

    def _first(self, turn: Turn, prefill: QuestionPrefill) -> Delta | None:
        """The turn's first token, from its finished prefill: it takes a token a step from now on, unless done."""
        token, position = prefill.result
        piece = turn.feed(int(token))
        if not turn.done:
            self._drop_graph()
            self.turns.append(turn)
            self._next[id(turn)] = (token, position)
        return piece

    def step(self) -> list[tuple[Turn, Delta | None]]:
        """One forward call over every turn's last token: each turn with the piece its next token shows. Turns
        whose answer ended leave the batch (turn.done). Before it, the next call of the first joining turn's
        prefill; the step it ends at gives that turn its first token (and piece) too. With `ahead`, the next step
        is launched before this one's tokens are read back (where every turn can take one more token and none
        joins or leaves in between): this call's step may be the one the previous call launched."""
        out = []
        if self.joining:
            turn, prefill = self.joining[0]
            if prefill.advance():
                self.joining.pop(0)
                out.append((turn, self._first(turn, prefill)))
        current, self._ahead = self._ahead, None
        if current is None:
            if not self.turns:
                return out
            with torch.inference_mode():
                current = self._launch()
        if self.ahead and self._graph is current.graph and current.turns == self.turns and all(
                len(t.generated) + 1 < t.max_new_tokens for t in current.turns):
            with torch.inference_mode():
                self._ahead = self._launch_after(current)
        values = current.values()  # (one read back for the batch: its step alone)
        for b, turn in enumerate(current.turns):
            if turn not in self.turns:  # it left while its step ran
                continue
            out.append((turn, turn.feed(values[b])))
            if turn.done:
                self.leave(turn)
            else:
                self._next[id(turn)] = (current.chosen[b : b + 1], current.positions[b] + 1)
        return out

    def _replayable(self) -> bool:
        """Whether the step is captured: every turn's session replays its own steps (one GPU, the Triton kernels)."""
        return all(t.step.graphs is not None for t in self.turns)

    def _launch(self) -> _Launched:
        """The step of every turn from its last token (`_run`)."""
        inputs = [self._next[id(t)] for t in self.turns]
        return self._run(torch.cat([tok for tok, _ in inputs]), [pos for _, pos in inputs])

    def _run(self, tokens: torch.Tensor, positions: list[int]) -> _Launched:
        """The step of every turn from tokens [B] at `positions`: replayed from the batch's graph (whose buffers hold
        the inputs already), captured first (its warm step, or the capture's first replay, is this one) once the
        turns as they are now have run capture_after steps eagerly, or run eagerly."""
        if self._graph is not None:
            return self._picked(self._graph.replay(), positions)
        if not self._replayable():
            return self._eager(tokens, positions)
        if len(self.turns) == 1:  # its session's own captured step, kept across its turns (LoneGraph), as a lone
            # turn's own path replays it (whatever capture_after)
            self._graph = LoneGraph(self.turns[0].step)
            self.captures += 0 if self._graph.captured else 1
            self._captured = list(self.turns)
            return self._picked(self._graph.warm_and_capture(tokens, positions), positions)
        if self._uncaptured < self.capture_after:
            self._uncaptured += 1
            return self._eager(tokens, positions)
        warm = not (self.unwarmed and all(any(t is c for c in self._captured) for t in self.turns))
        streams = None
        if not capture.SYNC_FIRST:  # (a capture that empties the caches frees a dead one's memory anyway)
            if self._pool is None:
                self._pool = capture.SharedPool(self.lm.device)
            while len(self._streams) < len(self.turns):
                self._streams.append(torch.cuda.Stream(device=self.lm.device))
            streams = self._streams
        self._graph = BatchGraph(self.lm, [t.step for t in self.turns], self._pool and self._pool.id, streams)
        self.captures += 1
        self._captured = list(self.turns)
        return self._picked(self._graph.warm_and_capture(tokens, positions, warm=warm), positions)

    def _launch_after(self, current: _Launched) -> _Launched:
        """The step after `current` (launched, not read back yet): its inputs are the tokens `current` chose, already
        in the graph's buffers where it was replayed (`_run`)."""
        return self._run(current.chosen, [p + 1 for p in current.positions])

    def _eager(self, tokens: torch.Tensor, positions: list[int]) -> _Launched:
        """The step of every turn from tokens [B] at `positions`, run eagerly: greedy or each turn's sampler."""
        logits = forward_batch(self.lm, [t.step for t in self.turns], tokens, positions)
        chosen = torch.cat([choose(logits[b : b + 1], t.sampler) for b, t in enumerate(self.turns)])
        return _Launched(list(self.turns), chosen, positions, None)

    def _picked(self, logits: torch.Tensor, positions: list[int]) -> _Launched:
        """A replayed step's tokens: greedy (the graph's own), or each sampled turn's pick fed to the next step."""
        graph = self._graph
        for b, turn in enumerate(self.turns):
            if turn.sampler is not None:  # (a greedy turn's token is the next step's input already)
                graph.feed(b, turn.sampler.pick(logits[b : b + 1]))
        return _Launched(list(self.turns), graph.ids.clone(), positions, graph)  # [B]: kept past the next replay

    def _drop_graph(self) -> None:
        """The turns change: the captured step's statistics go to its turns' recorders, and the next step is
        captured anew."""
        if self._graph is not None:
            with torch.inference_mode():
                self._graph.flush()
            self._graph = None
        self._uncaptured = 0

    def leave(self, turn: Turn) -> None:
        """Take a turn out of the batch (its answer ended, or it was cancelled); the others are not touched."""
        if turn in self.turns:
            self._drop_graph()
            self.turns.remove(turn)
            del self._next[id(turn)]
            if not self.turns:  # a step launched ahead has no one left to answer
                self._ahead = None
        self.joining = [(t, p) for t, p in self.joining if t is not turn]
