"""A backend whose centroid lookups are planned now and launched later, together with other sequences'.

In a batched decode step (engine.attention.function.BatchStep.shared) each sequence's lookup at a global layer is a
few short launches. `LaterLookups` hands a method the kernels of its backend, except that the centroid family's
`cluster_select` only plans: it returns the lookup's output tensors at once and puts the launches in `pending`;
the step then runs every sequence's pending lookups through the family's `select_now` (on a GPU: one launch of
each lookup kernel for those of one kind, kernels/centroid_ops.py), before any kernel reads what they write.

Only a method whose lookup's kernels write nothing but what its `lookup` returns, through one `cluster_select`
(Method.batched_lookup), is handed this backend: one whose second launch reads the first's output (hsqueeze's two
levels) would read it before it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

from kernels.backend import Backend
from kernels.reference.centroid import SelectCall
from kernels.tables import Keep


class _PlannedSelects:
    """The centroid family's ops of `module`, with cluster_select planned into `pending` (select_later)."""

    def __init__(self, module: ModuleType, pending: list):
        self._module = module
        self._pending = pending

    def cluster_select(self, *args, **kwargs):
        """cluster_select's signature and results; its kernels run at the family's select_now(pending)."""
        return self._module.select_later(SelectCall(*args, **kwargs), self._pending)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


@dataclass(frozen=True)
class LaterLookups(Backend):
    """`name`'s kernels with the centroid family's cluster_select planned into `pending` (see the module's
    docstring); run them with `run(keep)`."""

    pending: list = field(default_factory=list, compare=False)

    def kernel(self, family: str):
        module = super().kernel(family)
        return _PlannedSelects(module, self.pending) if family == "centroid" else module

    def run(self, keep: Keep = None) -> None:
        """Launch the pending lookups (kernels.centroid_ops.select_now); keep: as union_attention_batch's (the host
        copies of tables a CUDA graph captured the upload of)."""
        if self.pending:
            super().kernel("centroid").select_now(self.pending, keep)
