"""The oracle top-k as a method the engine can run: the ceiling of `squeeze eval`'s agreement part.

Not a sparse-attention method (it is not registered: the app and the CLI never offer it). To choose, it reads every
indexed key: per KV head and step, the exact softmax weights of the step's queries over the indexed keys, summed over
the group's query heads and the step's tokens, and it keeps the `keys x indexed` keys with the most weight (plus the
dense tail, as every method does). Its index is a copy of the keys, which it does not count: what a turn reports
that it read is the keys it attends to only, so that at a budget b it attends to b of the K/V, the best any
selection of that size can do for the group. The same oracle the recall part computes in closed form
(engine.bench.fidelity.oracle_mask), here inside the model's forward so that its next-token distributions can be
compared with full attention's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.attention.method import LayerIndex, LayerKeys, Lookup, Method, StepPlan, Tensors, check_budget
from engine.bench.recall import full_probs
from kernels.backend import Backend
from kernels.selection import FollowRows


@dataclass(frozen=True)
class KeysPlan(StepPlan):
    """The oracle's turn: the share of the indexed keys each step keeps."""

    keys: float

    def describe(self) -> str:
        return f"the {self.keys:.1%} heaviest keys"

    def count(self, indexed: int) -> int:
        return 0 if indexed == 0 else max(1, min(indexed, round(self.keys * indexed)))


class OraclePolicy(Method):
    name: ClassVar[str] = "oracle"
    follows: ClassVar[bool] = False  # the best selection of its size on its own: no rows besides it
    unit: ClassVar[str] = "key"

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        return {"keys": layer.keys}  # [Hkv, Lc, D]: the indexed keys, in original order

    def calibrate(self, layers, scale: float) -> Tensors:
        return {}

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> KeysPlan:
        return KeysPlan(budget=check_budget(budget), keys=check_budget(decode_keys))

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: KeysPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """q: [Hq, Lq, D] -> the selection of the heaviest keys per KV head (one for the step's Lq tokens)."""
        keys = layer["keys"]
        hkv, indexed = keys.shape[:2]
        probs = full_probs(q, keys, scale)  # [Hq, Lq, Lc]
        if valid is not None:  # a padded question: its real tokens' weight only
            probs = probs * (torch.arange(q.shape[1], device=q.device) < valid)[None, :, None].to(probs.dtype)
        weight = probs.reshape(hkv, -1, indexed).sum(dim=1)  # [Hkv, Lc]: the group's and the step's weight on each key
        _, selection = backend.kernel("pages").select_pages(weight, plan.count(indexed), 1, layer.num_keys)
        return Lookup(selection=selection, index_elements=torch.zeros(hkv, device=q.device))
