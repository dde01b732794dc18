"""Full attention: every key of the fixed context, no index (the baseline every method is compared with)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention.method import LayerIndex, Lookup, Method, StepPlan, Tensors
from kernels.selection import FollowRows


@dataclass(frozen=True)
class EveryKey(StepPlan):
    """Full attention's plan: every key, whatever the budget asked."""

    budget: float = 1.0

    def describe(self) -> str:
        return "every key of the document (full attention)"


class FullPolicy(Method):
    name: ClassVar[str] = "full"
    sparse: ClassVar[bool] = False

    def build(self, layer, required, prepared) -> Tensors:
        return {}

    def calibrate(self, layers, scale) -> Tensors:
        return {}

    def plan(self, calibration: Tensors, budget: float, reserve: tuple[float, float] = (0.0, 0.0)) -> StepPlan:
        return EveryKey()

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> StepPlan:
        return EveryKey()

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: StepPlan, scale: float, backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        return Lookup(selection=None, index_elements=q.new_zeros(0))  # no index read (and no launch: empty)
