"""Turns answered together: each question prefilled alone when its turn joins, then every turn's next token from
one forward call a step (engine.model.batch.forward_batch), each turn over its own context, method and plan.

A turn may join between any two steps and leaves when its answer ends; the others go on undisturbed. A question
longer than its step's prefill_chunk is prefilled a call between two steps of the others (the calls a lone turn
runs back to back: engine.model.generate.QuestionPrefill), so that it holds them up one call at a time. With greedy
choice a turn's tokens are those it gets alone (tests/engine/test_batching.py). Where every turn's session replays
its steps from CUDA graphs (one GPU), the batch's step is captured too (engine.model.batch_graph.BatchGraph), anew
each time a turn joins or leaves, and replayed while the same turns stay; elsewhere (the CPU) every call runs
eagerly. A joining question's prefill runs as a lone turn's does (replayed at a padded length where its session has
graphs and it fits one call).
"""

from __future__ import annotations

import torch

from engine.context.turn import Delta, Turn
from engine.model.batch import forward_batch
from engine.model.batch_graph import BatchGraph
from engine.model.generate import QuestionPrefill
from engine.model.load import LoadedModel
from engine.model.sampling import choose


class TurnBatch:
    """The turns being answered together over one model."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.turns: list[Turn] = []  # the turns taking a token a step, in the order they joined
        self.joining: list[tuple[Turn, QuestionPrefill]] = []  # turns whose long question is still being prefilled
        self._next: dict[int, tuple[torch.Tensor, int]] = {}  # id(turn) -> (its next input token [1], position)
        self._graph: BatchGraph | None = None  # the captured step of `turns` as they are now (a GPU's)

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
        prefill; the step it ends at gives that turn its first token (and piece) too."""
        out = []
        if self.joining:
            turn, prefill = self.joining[0]
            if prefill.advance():
                self.joining.pop(0)
                out.append((turn, self._first(turn, prefill)))
        if not self.turns:
            return out
        inputs = [self._next[id(t)] for t in self.turns]
        with torch.inference_mode():
            if self._replayable():
                tokens = self._replayed(inputs)
            else:
                logits = forward_batch(self.lm, [t.step for t in self.turns], torch.cat([tok for tok, _ in inputs]),
                                       [pos for _, pos in inputs])
                tokens = [choose(logits[b : b + 1], t.sampler) for b, t in enumerate(self.turns)]
            values = torch.cat(tokens).tolist()  # (one read back for the batch)
        for turn, token, value, (_, position) in zip(list(self.turns), tokens, values, inputs):
            out.append((turn, turn.feed(value)))
            if turn.done:
                self.leave(turn)
            else:
                self._next[id(turn)] = (token, position + 1)
        return out

    def _replayable(self) -> bool:
        """Whether the step is captured: every turn's session replays its own steps (one GPU, the Triton kernels)."""
        return all(t.step.graphs is not None for t in self.turns)

    def _replayed(self, inputs: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """The step from the batch's graph (captured first where the turns changed: its warm step is this one).
        Returns each turn's token [1] int64 on the device: greedy, or its sampler's (fed to the next step)."""
        if self._graph is None:
            self._graph = BatchGraph(self.lm, [t.step for t in self.turns])
            logits = self._graph.warm_and_capture(torch.cat([tok for tok, _ in inputs]), [pos for _, pos in inputs])
        else:
            logits = self._graph.replay()
        graph = self._graph
        for b, turn in enumerate(self.turns):
            if turn.sampler is not None:  # (a greedy turn's token is the next step's input already)
                graph.feed(b, turn.sampler.pick(logits[b : b + 1]))
        chosen = graph.ids.clone()  # [B]: what the step chose, kept past the next replay
        return [chosen[b : b + 1] for b in range(len(self.turns))]

    def _drop_graph(self) -> None:
        """The turns change: the captured step's statistics go to its turns' recorders, and the next step is
        captured anew."""
        if self._graph is not None:
            with torch.inference_mode():
                self._graph.flush()
            self._graph = None

    def leave(self, turn: Turn) -> None:
        """Take a turn out of the batch (its answer ended, or it was cancelled); the others are not touched."""
        if turn in self.turns:
            self._drop_graph()
            self.turns.remove(turn)
            del self._next[id(turn)]
        self.joining = [(t, p) for t, p in self.joining if t is not turn]
