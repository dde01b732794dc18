"""What a turn's attention did: kept keys per layer and head, clusters retrieved, KV budget, timings."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from engine.attention.cache import capturing
from engine.attention.method import Lookup
from kernels.backend import REFERENCE, Backend
from kernels.selection import StepTally


@dataclass
class TurnStats:
    """A turn's statistics; `to_json()` is the public form (CLI, app, chat history).

    kept_fraction_prefill/decode: [global layer][query head] kept keys / fixed-context length
    kept_fraction: the same averaged over all steps (the question's prefill counts as one step, or as one per token
        with token lookups: TurnRecorder.lookups_per_step, or one per call of a long question's)
    kv_budget: fraction of the global layers' fixed-context K and V bytes read per step (index bytes included),
               averaged over the turn's steps; kv_budget_prefill / kv_budget_decode: the same for each phase
    clusters: per global layer, per selection row, the units (clusters, pages) the question's prefill retrieved
              (ids, sizes, and the lookup's scores of them; with token lookups, its last token's; of a question
              prefilled in several calls, its last call's)
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
    kv_budget_decode: float
    clusters: list[dict]
    timings: dict[str, float]
    steps: int
    new_tokens: int
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class StepTotals:
    """Sums over the steps of one phase, kept on the device (a captured decode step adds into them in place), and
    what the host knows of each layer's lookup (the same at every step of a method).

    kept: [global layers, Hq] keys attended per selection row (the first `rows[layer]` columns)
    read: [global layers] index elements read (and, where rows are query heads, the K/V elements of their union)
    rows: layer -> rows of its selections (Hkv or Hq); dense: layers that attended to every key (no device sums)
    steps: how many steps added into them (counted by the host)
    """

    kept: torch.Tensor
    read: torch.Tensor
    rows: dict[int, int] = field(default_factory=dict)
    dense: set[int] = field(default_factory=set)
    steps: int = 0
    unit_max: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [rows, U] the steps' best unit scores
    prefill: bool = False  # a question's prefill: its lookups' kept units are listed (clusters), not maxed
    # layer -> (kept [rows, U], sizes [Hkv, U], scores [rows, U] or None) of the question's prefill
    clusters: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    @classmethod
    def zeros(cls, layers: int, hq: int, device: torch.device, prefill: bool = False) -> "StepTotals":
        return cls(kept=torch.zeros(layers, hq, device=device), read=torch.zeros(layers, device=device),
                   prefill=prefill)

    def reset(self) -> None:
        self.kept.zero_()
        self.read.zero_()
        for best in self.unit_max.values():  # in place: a captured step keeps adding into these buffers
            best.fill_(float("-inf"))
        self.steps = 0


class TurnRecorder:
    """Collects per-step statistics into device buffers without host synchronisation (one launch of the tally kernel
    per global layer and step); `finish()` reads them once and turns them into a TurnStats. The first step is the
    question's prefill, the others decode steps.

    global_layers: indices of the layers that attend to the whole fixed context
    sync_cuda: on CUDA, time lookup and attention with CUDA events (read at finish) instead of the host clock
    """

    def __init__(self, global_layers: list[int], hq: int, hkv: int, head_dim: int, fixed_len: int, sync_cuda: bool):
        self.global_layers = list(global_layers)
        self.hq, self.hkv, self.head_dim, self.fixed_len = hq, hkv, head_dim, fixed_len
        self.cuda = sync_cuda and torch.cuda.is_available()
        self._index = {layer: i for i, layer in enumerate(self.global_layers)}
        self.prefill: StepTotals | None = None
        self.decode: StepTotals | None = None
        self.current: StepTotals | None = None  # where record() adds (a captured step points it at its own totals)
        self.seconds = {"lookup": 0.0, "attention": 0.0}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._step = -1
        self._prefill_lookups = 1  # lookups the question's prefill makes per global layer (lookups_per_step)
        self._prefill_before = 0  # of them, those of the prefill's earlier calls (a long question's)
        self.timing = True  # time lookup and attention (off for steps that are not counted in timed_steps)
        self.timed_steps = 0  # eager steps whose lookup and attention were timed (replayed ones cannot be)

    def totals(self, device: torch.device, prefill: bool = False) -> StepTotals:
        """Fresh totals for a phase on `device`."""
        return StepTotals.zeros(len(self.global_layers), self.hq, device, prefill)

    @property
    def prefill_clusters(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The question's prefill's kept units per global layer (StepTotals.clusters)."""
        return self.prefill.clusters if self.prefill is not None else {}

    def add_prefill(self, totals: StepTotals) -> None:
        """A question's prefill replayed from a CUDA graph, whose statistics are in `totals` (the graph's own
        buffers, overwritten by its next replay): copied, as the turn's prefill phase (device copies, no sync)."""
        if self._step >= 0:
            raise RuntimeError("a replayed prefill is the turn's first step")
        self._step = 0
        self.prefill = StepTotals(kept=totals.kept.clone(), read=totals.read.clone(), rows=dict(totals.rows),
                                  dense=set(totals.dense), steps=self._prefill_lookups, prefill=True,
                                  clusters={layer: tuple(t.clone() if t is not None else None for t in entry)
                                            for layer, entry in totals.clusters.items()})
        self.current = None

    def begin_step(self, continued: bool = False) -> None:
        """Called by the host before each eager step (replayed steps are handed over with add_decode). continued: a
        further call of the question's prefill (a long question, a chunk a call: engine.model.generate
        .QuestionPrefill), whose lookups count in the prefill phase beside its earlier calls'."""
        self.timed_steps += 1
        if continued:
            if self._step != 0:
                raise RuntimeError("only the question's prefill runs in several calls")
            self._prefill_before = self._prefill_lookups
            self._set_prefill_lookups(self._prefill_before + 1)
            return
        self._step += 1
        self.current = None
        if self._step > 0 and self.decode is not None:
            self.decode.steps += 1

    def add_decode(self, totals: StepTotals, steps: int) -> None:
        """Add `steps` replayed decode steps whose sums are in `totals` (a device add: read at finish, not now)."""
        if steps <= 0:
            return
        if self.decode is None:
            self.decode = self.totals(totals.kept.device)
        self.decode.kept += totals.kept
        self.decode.read += totals.read
        for layer, best in totals.unit_max.items():
            mine = self.decode.unit_max.get(layer)
            self.decode.unit_max[layer] = best.clone() if mine is None else torch.maximum(mine, best)
        self.decode.rows.update(totals.rows)
        self.decode.dense |= totals.dense
        self.decode.steps += steps

    @contextmanager
    def timed(self, kind: str):
        if not self.timing or capturing():  # a captured step is timed as a whole by its caller
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
            return
        start_s = time.perf_counter()
        yield
        self.seconds[kind] += time.perf_counter() - start_s

    def lookups_per_step(self, lookups: int) -> None:
        """The question's prefill looks up each of its `lookups` tokens on its own (engine.attention.function.StepContext.
        token_lookups): each global layer records that many lookups, and the phase's figures are their mean, as if
        each token were a step of its own. Called before the layers' first record (again by every layer: the same
        count). Decode steps, of one token, never call it."""
        if self._step > 0:
            raise RuntimeError("only the question's prefill looks up its tokens one by one")
        self._set_prefill_lookups(self._prefill_before + lookups)

    def _set_prefill_lookups(self, lookups: int) -> None:
        """The prefill phase's lookups per global layer so far (its figures are their mean)."""
        self._prefill_lookups = lookups
        if self.prefill is not None:
            self.prefill.steps = lookups

    def _phase_totals(self, device: torch.device) -> StepTotals:
        if self.current is None:
            if self._step <= 0:
                if self.prefill is None:
                    self.prefill = self.totals(device, prefill=True)
                    self.prefill.steps = self._prefill_lookups
                self.current = self.prefill
            else:
                if self.decode is None:
                    self.decode = self.totals(device)
                    self.decode.steps = 1
                self.current = self.decode
        return self.current

    def tally(self, layer_idx: int, lookup: Lookup) -> StepTally | None:
        """The sums one global layer's lookup adds into at the current step, for the union kernel to add them
        (kernels.selection.StepTally): where the rows are the KV heads and the sums sit on the lookup's device;
        None where `record` adds them itself. Call `record(..., tallied=the result)` after the union either way."""
        sel = lookup.selection
        totals = self._phase_totals(lookup.index_elements.device)
        if sel is None or sel.rows != self.hkv or totals.kept.device != sel.indptr.device:
            return None
        i = self._index[layer_idx]
        scores, best = self._unit_scores(totals, layer_idx, lookup)
        return StepTally(lookup.index_elements.contiguous(), totals.kept[i, : sel.rows], totals.read[i : i + 1],
                         scores, best)

    def _unit_scores(self, totals: StepTotals, layer_idx: int,
                     lookup: Lookup) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(scores, best): a decode step's unit scores and its layer's running max to take them into, or (None,
        None): a prefill (its units are listed, not maxed), no scores, or the phase's first step (whose scores
        become the buffer: a captured step finds it and maxes into it in place)."""
        if totals.prefill or lookup.scores is None:
            return None, None
        best = totals.unit_max.get(layer_idx)
        if best is None:
            totals.unit_max[layer_idx] = lookup.scores.detach().float().contiguous().clone()
            return None, None
        return (lookup.scores if lookup.scores.stride(-1) == 1 else lookup.scores.contiguous()), best

    def record(self, layer_idx: int, lookup: Lookup, backend: Backend = REFERENCE,
               fresh: torch.Tensor | None = None, tallied: StepTally | None = None) -> None:
        """One global layer's lookup at the current step (the prefill's kept units and their sizes are listed), and
        fresh [rows, M] bool: the follow rows (engine.attention.follow) each selection row read besides its
        selection, or None. tallied: what `tally` returned, which the union kernel has added (its sums are not
        added again). Otherwise, where the rows are the KV heads and the sums sit on the lookup's device, one
        launch of `backend`'s tally kernel adds it all."""
        totals = self._phase_totals(lookup.index_elements.device)
        i = self._index[layer_idx]
        sel = lookup.selection
        if sel is None:  # every key: known on the host, nothing to add on the device
            totals.dense.add(layer_idx)
            return
        totals.rows[layer_idx] = sel.rows
        if totals.prefill and lookup.units is not None and lookup.sizes is not None:
            totals.clusters[layer_idx] = (lookup.units, lookup.sizes, lookup.scores)
        if tallied is not None:
            return
        if sel.rows == self.hkv and totals.kept.device == sel.indptr.device:
            scores, best = self._unit_scores(totals, layer_idx, lookup)
            tally = backend.kernel("tally").tally_step
            tally(sel.indptr, lookup.index_elements.contiguous(), totals.kept[i, : sel.rows], totals.read[i : i + 1],
                  fresh, scores, best)
            return
        scores, best = self._unit_scores(totals, layer_idx, lookup)
        # one row per query head: a key several heads of a group selected (or followed) is read once
        totals.kept[i, : sel.rows] += (sel.indptr[1:] - sel.indptr[:-1]).to(totals.kept.device)
        index = lookup.index_elements.float().sum()
        if sel.rows != self.hkv:
            union = sel.to_mask().reshape(self.hkv, sel.rows // self.hkv, -1).any(dim=1).sum()
            index = index + union * (2 * self.head_dim)
        totals.read[i] += index.to(totals.read.device)
        if scores is not None:
            torch.maximum(best, scores.float().to(best.device), out=best)
        if fresh is not None:
            self._record_follow(totals, i, fresh)

    def _record_follow(self, totals: StepTotals, i: int, fresh: torch.Tensor) -> None:
        rows = fresh.shape[0]
        totals.kept[i, :rows] += fresh.sum(dim=1).to(totals.kept.device)
        if rows != self.hkv:  # (one row per KV head: its kept keys are its reads, _per_layer) read once per KV head
            keys = fresh.reshape(self.hkv, rows // self.hkv, -1).any(dim=1).sum()
            totals.read[i] += (keys * (2 * self.head_dim)).to(totals.read.device)

    def _per_layer(self, totals: StepTotals) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One phase's sums on the CPU: kept keys per query head [layers, Hq] and elements read [layers] (float64),
        and its steps."""
        kept = torch.zeros(len(self.global_layers), self.hq, dtype=torch.float64)
        read = torch.zeros(len(self.global_layers), dtype=torch.float64)
        dense_kv = 2 * self.head_dim * self.hkv * self.fixed_len
        t_kept, t_read = totals.kept.double().cpu(), totals.read.double().cpu()
        for layer, i in self._index.items():
            if layer in totals.dense:
                kept[i] += self.fixed_len * totals.steps
                read[i] += dense_kv * totals.steps
            elif layer in totals.rows:
                rows = totals.rows[layer]
                kept[i] += t_kept[i, :rows].repeat_interleave(self.hq // rows)
                read[i] += t_read[i] + (t_kept[i, :rows].sum() * 2 * self.head_dim if rows == self.hkv else 0.0)
        return kept, read, totals.steps

    def _kept_matrix(self, phases: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[list[float]]:
        steps = sum(n for _, _, n in phases)
        if not steps:
            return []
        mean = sum(kept for kept, _, _ in phases) / steps / max(1, self.fixed_len)  # [layers, Hq]
        return [[round(float(x), 6) for x in row] for row in mean]

    def _budget(self, phases: list[tuple[torch.Tensor, torch.Tensor, int]]) -> float:
        steps = sum(n for _, _, n in phases)
        if not steps or not self.global_layers:
            return 0.0
        dense = len(self.global_layers) * self.hkv * self.fixed_len * 2 * self.head_dim
        return float(sum(read.sum() for _, read, _ in phases)) / dense / steps

    def _clusters(self) -> list[dict]:
        out = []
        for layer in self.global_layers:
            if layer not in self.prefill_clusters:
                continue
            kept, counts, scores = self.prefill_clusters[layer]
            kept, counts = kept.cpu(), counts.cpu()
            scores = scores.float().cpu() if scores is not None else None
            rows = kept.shape[0]
            heads = []
            for r in range(rows):
                ids = kept[r].nonzero().flatten()
                sizes = counts[r * self.hkv // rows][ids]
                entry = {"row": r, "kv_head": r * self.hkv // rows, "ids": ids.tolist(), "sizes": sizes.tolist()}
                if scores is not None:  # tolist, not a loop over the tensor: an element each is a select and an item
                    entry["scores"] = [round(x, 6) for x in scores[r][ids].tolist()]
                heads.append(entry)
            out.append({"layer": layer, "rows": heads})
        return out

    def unit_scores(self) -> dict[int, dict[str, torch.Tensor]]:
        """What a turn's lookups scored, per global layer with units (clusters, pages), on the CPU: "question":
        [rows, U] the prefill lookup's scores, "answer": [rows, U] the best score of each unit over the decode steps
        (zeros without decode steps), "sizes": [Hkv, U] keys per unit. The explanations read these instead of
        running the model again."""
        out = {}
        for layer, (_, sizes, scores) in self.prefill_clusters.items():
            if scores is None:
                continue
            question = scores.float().cpu()
            best = self.decode.unit_max.get(layer) if self.decode is not None else None
            answer = best.float().cpu() if best is not None else torch.zeros_like(question)
            out[layer] = {"question": question, "answer": answer, "sizes": sizes.cpu()}
        return out

    def finish(self, method: str, sparsity: float, new_tokens: int, timings: dict[str, float]) -> TurnStats:
        if self._events:
            torch.cuda.synchronize()
            for kind, start, end in self._events:
                self.seconds[kind] += start.elapsed_time(end) / 1e3
            self._events.clear()
        prefill = [self._per_layer(self.prefill)] if self.prefill is not None else []  # read back once per phase
        decode = [self._per_layer(self.decode)] if self.decode is not None and self.decode.steps else []
        return TurnStats(
            method=method,
            sparsity=sparsity,
            global_layers=self.global_layers,
            fixed_len=self.fixed_len,
            kept_fraction=self._kept_matrix(prefill + decode),
            kept_fraction_prefill=self._kept_matrix(prefill),
            kept_fraction_decode=self._kept_matrix(decode),
            kv_budget=round(self._budget(prefill + decode), 6),
            kv_budget_prefill=round(self._budget(prefill), 6),
            kv_budget_decode=round(self._budget(decode), 6),
            clusters=self._clusters(),
            timings={**{f"{k}_s": round(v, 6) for k, v in self.seconds.items()}, "timed_steps": self.timed_steps,
                     **timings},
            steps=sum(n for _, _, n in prefill + decode),
            new_tokens=new_tokens,
        )
