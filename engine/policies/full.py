"""Full attention: every key of the fixed context, no index."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine.policies.base import Lookup, Policy


class FullPolicy(Policy):
    name: ClassVar[str] = "full"
    sparse: ClassVar[bool] = False

    def build(self, keys, settings, index):
        return {}

    def calibrate(self, layers, scale, settings):
        return {}

    def thresholds(self, calibration, sparsity):
        return ()

    def lookup(self, q, index, thresholds, scale, settings, backend) -> Lookup:
        return Lookup(selection=None, clusters=None, index_elements=torch.zeros(1, device=q.device))
