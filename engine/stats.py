"""What a turn's attention did: kept keys per layer and head, clusters retrieved, KV budget, timings."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from engine.policies.base import Lookup


@dataclass
class TurnStats:
    """A turn's statistics; `to_json()` is the public form (CLI, app, chat history).

    kept_fraction_prefill/decode: [global layer][query head] kept keys / fixed-context length
    kept_fraction: the same averaged over all steps (the question's prefill counts as one step)
    kv_budget: fraction of the global layers' fixed-context K and V bytes read per step (index bytes included),
               averaged over the turn's steps
    clusters: per global layer, per selection row, the clusters the question's prefill retrieved (ids, sizes)
    """

    method: str
    sparsity: float
    global_layers: list[int]
    fixed_len: int
    kept_fraction: list[list[float]]
    kept_fraction_prefill: list[list[float]]
    kept_fraction_decode: list[list[float]]
    kv_budget: float
    kv_budget_prefill: float
    clusters: list[dict]
    timings: dict[str, float]
    steps: int
    new_tokens: int
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


class TurnRecorder:
    """Collects per-step tensors without host synchronisation; `finish()` turns them into a TurnStats.

    global_layers: indices of the layers that attend to the whole fixed context
    """

    def __init__(self, global_layers: list[int], hq: int, hkv: int, head_dim: int, fixed_len: int, sync_cuda: bool):
        self.global_layers = list(global_layers)
        self.hq, self.hkv, self.head_dim, self.fixed_len = hq, hkv, head_dim, fixed_len
        self.sync_cuda = sync_cuda
        self.kept: list[dict[int, torch.Tensor]] = []  # per step: layer -> [Hq] kept keys
        self.read: list[dict[int, torch.Tensor]] = []  # per step: layer -> [] elements read (K, V and index)
        self.prefill_clusters: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (kept [rows, C], counts)
        self.seconds = {"lookup": 0.0, "attention": 0.0}
        self._step = -1

    def begin_step(self) -> None:
        self._step += 1
        self.kept.append({})
        self.read.append({})

    @contextmanager
    def timed(self, kind: str):
        if self.sync_cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync_cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[kind] += time.perf_counter() - start

    def record(self, layer_idx: int, lookup: Lookup, counts: torch.Tensor | None) -> None:
        """One global layer's lookup at the current step. counts: [Hkv, C] cluster sizes (for the cluster list)."""
        d = self.head_dim
        if lookup.selection is None:
            kept_q = torch.full((self.hq,), float(self.fixed_len))
            union = torch.full((self.hkv,), float(self.fixed_len))
        else:
            sel = lookup.selection
            per_row = sel.counts().float()
            kept_q = per_row.repeat_interleave(self.hq // sel.rows)
            if sel.rows == self.hkv:
                union = per_row
            else:  # a key selected by several query heads of a group is read once
                union = sel.to_mask().reshape(self.hkv, sel.rows // self.hkv, -1).any(dim=1).sum(dim=1).float()
        elements = union.sum() * 2 * d + lookup.index_elements.float().sum().to(union.device)
        self.kept[self._step][layer_idx] = kept_q
        self.read[self._step][layer_idx] = elements
        if self._step == 0 and lookup.clusters is not None and counts is not None:
            self.prefill_clusters[layer_idx] = (lookup.clusters, counts)

    def _kept_matrix(self, steps: list[dict[int, torch.Tensor]]) -> list[list[float]]:
        if not steps:
            return []
        rows = []
        for layer in self.global_layers:
            mean = torch.stack([s[layer].cpu() for s in steps]).mean(dim=0) / max(1, self.fixed_len)
            rows.append([round(float(x), 6) for x in mean])
        return rows

    def _budget(self, steps: list[dict[int, torch.Tensor]]) -> float:
        if not steps or not self.global_layers:
            return 0.0
        dense = len(self.global_layers) * self.hkv * self.fixed_len * 2 * self.head_dim
        per_step = [sum(float(s[layer]) for layer in self.global_layers) / dense for s in steps]
        return sum(per_step) / len(per_step)

    def _clusters(self) -> list[dict]:
        out = []
        for layer in self.global_layers:
            if layer not in self.prefill_clusters:
                continue
            kept, counts = self.prefill_clusters[layer]
            kept, counts = kept.cpu(), counts.cpu()
            rows = kept.shape[0]
            heads = []
            for r in range(rows):
                ids = kept[r].nonzero().flatten()
                sizes = counts[r * self.hkv // rows][ids]
                heads.append({"row": r, "kv_head": r * self.hkv // rows, "ids": ids.tolist(), "sizes": sizes.tolist()})
            out.append({"layer": layer, "rows": heads})
        return out

    def finish(self, method: str, sparsity: float, new_tokens: int, timings: dict[str, float]) -> TurnStats:
        steps = [s for s in self.kept if s]
        reads = [r for r in self.read if r]
        return TurnStats(
            method=method,
            sparsity=sparsity,
            global_layers=self.global_layers,
            fixed_len=self.fixed_len,
            kept_fraction=self._kept_matrix(steps),
            kept_fraction_prefill=self._kept_matrix(steps[:1]),
            kept_fraction_decode=self._kept_matrix(steps[1:]),
            kv_budget=round(self._budget(reads), 6),
            kv_budget_prefill=round(self._budget(reads[:1]), 6),
            clusters=self._clusters(),
            timings={**{f"{k}_s": round(v, 6) for k, v in self.seconds.items()}, **timings},
            steps=len(steps),
            new_tokens=new_tokens,
        )
