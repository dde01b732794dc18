"""The contract every method follows: an offline index per layer, a calibration, and an online lookup."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.config import IndexSettings
from kernels.backend import Backend
from kernels.selection import Selection

LayerIndex = dict[str, torch.Tensor]  # one global-attention layer's artifacts, by name


@dataclass
class Lookup:
    """What a lookup decided for one layer and one step.

    selection: keys of the fixed K/V to attend to; None means all of them (dense)
    clusters: [rows, C] bool kept clusters, or None for methods without clusters
    index_elements: [Hkv] elements of index metadata read per KV head (centroids, counts, bounds)
    scores: [rows, C] float32 the clusters' scores (S of eq. 1, reduced over the step), or None
    """

    selection: Selection | None
    clusters: torch.Tensor | None
    index_elements: torch.Tensor
    scores: torch.Tensor | None = None


@dataclass
class CalibrationSet:
    """One global-attention layer's index and calibration queries (q: [Hq, Nc, D])."""

    index: LayerIndex
    queries: torch.Tensor


class Policy(ABC):
    """A sparse-attention method: `build` offline, `calibrate` once per context, `lookup` at every step."""

    name: ClassVar[str]
    sparse: ClassVar[bool] = True
    levels: ClassVar[int] = 0  # thresholds per phase (one per level of the lookup)

    @abstractmethod
    def build(self, keys: torch.Tensor, settings: IndexSettings, index: LayerIndex) -> LayerIndex:
        """keys: [Hkv, Lc, D] clustered keys of one layer; `index` holds what earlier policies built.

        Returns only the artifacts this policy adds.
        """

    @abstractmethod
    def calibrate(self, layers: list[CalibrationSet], scale: float, settings: IndexSettings) -> dict[str, torch.Tensor]:
        """Thresholds over the sparsity grid (SPARSITY_GRID), one global set for all layers and heads."""

    @abstractmethod
    def thresholds(self, calibration: dict[str, torch.Tensor], sparsity: float) -> tuple[float, ...]:
        """The thresholds a turn at `sparsity` uses: the decode step's (one per level), then the question prefill's
        (as many) where the calibration has them (see `step_thresholds`)."""

    @abstractmethod
    def lookup(
        self,
        q: torch.Tensor,
        index: LayerIndex,
        thresholds: tuple[float, ...],
        scale: float,
        settings: IndexSettings,
        backend: Backend,
    ) -> Lookup:
        """q: [Hq, Lq, D] the step's queries (Lq > 1 in the question's prefill: scores averaged over tokens)."""


def group_rows(settings: IndexSettings, hq: int, hkv: int) -> int:
    """Rows of a selection: one per KV head (shared by its query heads) or one per query head."""
    return hkv if settings.group == "kv" else hq



def step_thresholds(thresholds: tuple[float, ...], levels: int, lq: int, settings: IndexSettings) -> tuple[float, ...]:
    """A step's thresholds out of a policy's `thresholds` (decode's `levels` ones, then the prefill's where the
    calibration has them): a question's prefill (Lq > 1 tokens, scored by max(token mean, last token)) uses the
    prefill ones, calibrated on that score, where settings.prefill_threshold is "calibrated"; otherwise decode's."""
    if lq > 1 and settings.prefill_threshold == "calibrated" and len(thresholds) >= 2 * levels:
        return thresholds[levels : 2 * levels]
    return thresholds[:levels]
