"""Settings of a context (what every method shares); each method's own settings live with the method
(engine.methods). Both are part of the cache key of what they build."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.attention.rows import FixedRows

# Last context tokens read densely by every step: 32, apart from the 100 of the calibration. On 2-4K-token documents
# a tail of 100 took 2.5-5 points of a 10% budget; at 32 `squeeze eval` on the embedded model agrees better with full
# attention at 10% (squeeze: top-1 83% -> 89%, KL 0.21 -> 0.15, recall 0.737 -> 0.759, needles 20% -> 30%) and
# the shipped passkey holds (10/12 cells, 9/12 at 100); 16 found more needles (60%) but lost the passkey in 5/12
# cells (engine/bench/README.md, "The dense tail").
DEFAULT_DENSE_TAIL = 32
DEFAULT_CALIBRATION = 100  # last context tokens whose queries calibrate the methods (the paper's app. C)
# First context tokens kept dense: the attention sink (engine.attention.rows). Off by default: one sink token improves
# `squeeze eval` on the embedded model (KL to full attention at a 20% budget 0.110 -> 0.046 for squeeze, 0.125 -> 0.049
# for hsqueeze; engine/bench/results/cpu-eval-sink1.json) but loses the shipped passkey at depth 0.1 with hsqueeze at
# 85% and Quest at 60% (tests/engine/test_real_model.py), and four tokens lost a 1K-token needle with hsqueeze and Quest.
DEFAULT_SINK = 0
PROMPT_VERSION = 2  # bump when the document/question template changes: old contexts are then not reused (2: a chat
# template's head before the document when the tokenizer has one)
CONTEXT_VERSION = 5  # bump when what a context stores changes (5: a sink's rows after the indexed ones)


@dataclass(frozen=True)
class ContextSettings:
    """How a document becomes a context, whatever the methods.

    dense_tail: last context tokens every method reads densely
    sink: first context tokens every method reads densely (the attention sink; 0: none). Both are stored after
        the indexed rows of a global layer's K/V: engine.attention.rows
    calibration: last context tokens whose queries are the calibration queries (they may reach past the dense
        tail, into the indexed tokens)
    """

    dense_tail: int = DEFAULT_DENSE_TAIL
    sink: int = DEFAULT_SINK
    calibration: int = DEFAULT_CALIBRATION

    def __post_init__(self) -> None:
        if self.dense_tail < 1:
            raise ValueError(f"dense_tail must be at least 1, got {self.dense_tail}")
        if self.calibration < 1:
            raise ValueError(f"calibration must be at least 1, got {self.calibration}")
        if self.sink < 0:
            raise ValueError(f"sink must be at least 0, got {self.sink}")

    def rows(self, tokens: int) -> FixedRows:
        """Which token each fixed K/V row of a global layer holds, for a context of `tokens` tokens."""
        return FixedRows.of(self.sink, self.dense_tail, tokens)

    def as_dict(self) -> dict:
        """The settings as stored and as part of a context's cache key."""
        return {**asdict(self), "prompt_version": PROMPT_VERSION, "context_version": CONTEXT_VERSION}

    @classmethod
    def from_dict(cls, data: dict) -> "ContextSettings":
        """Back from `as_dict` (the version fields and unknown keys are ignored; a context stored before the sink
        existed has none, and one stored before `calibration` existed was calibrated by its dense tail's queries)."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{"sink": 0, "calibration": fields.get("dense_tail", DEFAULT_DENSE_TAIL), **fields})
