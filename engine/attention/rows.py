"""Which token each row of a global layer's fixed K/V holds: the indexed tokens first, then the dense rows.

The fixed context is attended as a whole by every later token (no mask inside it), and its keys carry their
positions (RoPE applied), so its rows may sit in any order. A global layer stores them as

    rows [0, indexed)            tokens [sink, L - tail)     the part every method indexes (in token order)
    rows [indexed, L)            tokens [0, sink), then [L - tail, L)   the dense rows: read by every step

so that "the dense rows" is one range at the end, the one the sparse kernels already read after a selection (the
`tail` of kernels.selection.Selection and of engine.methods.LayerIndex). The sink is the attention sink of
StreamingLLM: the first tokens take a large share of most heads' weight (on the embedded Gemma 3 270M, 35-43% of
a decode step's weight at every global layer falls on the first token), so a selection that misses them distorts
every step it serves; a few rows cost nothing beside a budget (engine.context.settings's DEFAULT_SINK says how many, and
why). The calibration queries are the last tokens' (engine.context.settings.ContextSettings.calibration), tail or not.
Sliding-window layers keep their last window in token order (no index, no sink).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FixedRows:
    """tokens: L, the fixed context's length; sink: its first tokens read densely; tail: its last tokens read
    densely."""

    tokens: int
    sink: int
    tail: int

    @classmethod
    def of(cls, sink: int, tail: int, tokens: int) -> "FixedRows":
        """The rows of a context of `tokens` tokens under the settings' `sink` and `tail`, shortened so that at
        least one token is indexed (the tail first keeps it, then the sink)."""
        if tokens < 2:
            raise ValueError(f"the document has {tokens} token(s); at least 2 are needed")
        tail = min(tail, tokens - 1)
        return cls(tokens=tokens, sink=max(0, min(sink, tokens - 1 - tail)), tail=tail)

    @property
    def dense(self) -> int:
        """Rows at the end that every step reads: the sink's and the tail's."""
        return self.sink + self.tail

    @property
    def indexed(self) -> int:
        """Rows at the start that the methods index: tokens [sink, L - tail)."""
        return self.tokens - self.dense

    def order(self) -> torch.Tensor:
        """[L] int64: row r holds token order[r]."""
        return torch.cat([torch.arange(self.sink, self.tokens - self.tail), torch.arange(self.sink),
                          torch.arange(self.tokens - self.tail, self.tokens)])

    def arrange(self, kv: torch.Tensor) -> torch.Tensor:
        """K or V [H, L, D] in token order -> the same tensor with its rows in this order (in place; a no-op
        without a sink)."""
        if self.sink:
            kv[:, : self.tokens - self.tail] = torch.roll(kv[:, : self.tokens - self.tail], -self.sink, dims=1)
        return kv
