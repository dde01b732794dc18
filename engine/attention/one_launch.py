"""A backend whose one-token centroid lookups run both of their passes in one launch.

kernels.centroid_ops.cluster_select, given `sync` (counters zeroed once, used by one lookup at a time), runs a dense
decode lookup's denominator and score passes as two queues of one launch (the same results bit for bit, one launch
and one wait fewer on a step's chain). Each sequence's global layer holds such counters
(engine.attention.cache.FixedContextLayer.lookup_sync, made with its new-token buffers, before any capture), and a
sequence's lookups run one after another on its own stream, so no two lookups share them at once. `SyncedLookups`
hands a method its backend's kernels, except that the centroid family's cluster_select is given the layer's counters
(engine.attention.function does so for a decode step's lookups on the Triton backend).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from kernels.backend import Backend


class _SyncedSelects:
    """The centroid family's ops of `module`, cluster_select given `sync` unless the call gives its own."""

    def __init__(self, module: ModuleType, sync: torch.Tensor):
        self._module = module
        self._sync = sync

    def cluster_select(self, *args, **kwargs):
        """cluster_select's signature and results."""
        kwargs.setdefault("sync", self._sync)
        return self._module.cluster_select(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


@dataclass(frozen=True)
class SyncedLookups(Backend):
    """The kernels of `base` (any Backend: its own families as it gives them), the centroid family's cluster_select
    given `sync` (zeroed int32 counters, the family's lookup_sync, on the lookups' device). Made with `over`."""

    base: Backend | None = field(default=None, compare=False)
    sync: torch.Tensor | None = field(default=None, compare=False)

    @staticmethod
    def over(base: Backend, sync: torch.Tensor) -> "SyncedLookups":
        return SyncedLookups(base.name, base=base, sync=sync)

    def kernel(self, family: str):
        module = self.base.kernel(family) if self.base is not None else super().kernel(family)
        return _SyncedSelects(module, self.sync) if family == "centroid" and self.sync is not None else module
