"""What a turn's attention looked at, in terms a reader can check: the units' (clusters', pages') scores for the
question and the answer, the document passages their keys come from (with page numbers), and a 2-D projection of
a layer's keys.

The app renders these; everything that touches tensors is here. A turn's report comes from what its own lookups
scored (engine.context.session.Answer.unit_scores); the rest works from a context's stored artifacts alone, so a turn saved
in the chat history can be shown again after a restart without loading the model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.rows import FixedRows
from engine.context.session import Answer
from engine.context.settings import ContextSettings
from engine.index import artifacts as names
from engine.methods import REGISTRY, LayerIndex, Method, make_method
from engine.methods.squeeze import float_centroids
from storage import Document, Store

PASSAGE_CONTEXT_CHARS = 80  # text shown around a passage, each side
PROJECTION_POINTS = 1500  # keys drawn in the projection at most (retrieved clusters' keys first)
CACHED_CONTEXTS = 2  # contexts whose artifacts the inspector keeps in memory
MAX_REPORTED = 200  # clusters saved per layer and row with a turn at most (best S first)
WORD_REACH = 16  # characters a unit's preview reaches past its tokens to show the words they belong to
PASSAGE_RADIUS = 14  # tokens each side of a strongly retrieved token that make up its passage
MIN_MARK = 0.08  # highlight weight of a token whose cluster's S is just at the threshold
MAX_FOLLOW = 4096  # follow rows saved with a turn at most (engine.attention.follow: read in every layer and head)


def retrieval_report(clusters: list[dict], scores: dict[int, dict[str, torch.Tensor]], counts: dict[int, torch.Tensor],
                     threshold: float, max_rows: int = MAX_REPORTED) -> dict:
    """What a turn retrieved, per global layer and selection row, as JSON for the chat history.

    clusters: TurnStats.clusters (the clusters the question's prefill lookup kept: exact, from the engine)
    scores: `turn_scores`; counts: layer -> [Hkv, C] cluster sizes
    threshold: S above which a cluster counts as retrieved by the answer's tokens (the squeeze threshold at the
               turn's sparsity; an estimate of what the decode lookups kept)
    Each row lists up to `max_rows` clusters, best S first: ids, sizes, s_question, s_answer, prefill (bool).
    """
    kept = {(e["layer"], r["row"]): set(r["ids"]) for e in clusters for r in e["rows"]}
    layers = []
    for layer_idx in sorted(scores):
        sq, sa = scores[layer_idx]["question"], scores[layer_idx]["answer"]
        rows = sq.shape[0]
        hkv = counts[layer_idx].shape[0]
        out_rows = []
        for r in range(rows):
            kv_head = r * hkv // rows
            sizes = counts[layer_idx][kv_head]
            prefill = kept.get((layer_idx, r), set())
            by_answer = set(torch.nonzero((sa[r] > threshold) & (sizes > 0)).flatten().tolist())
            ids = sorted(prefill | by_answer, key=lambda c: -max(float(sq[r, c]), float(sa[r, c])))[:max_rows]
            out_rows.append({
                "row": r, "kv_head": kv_head, "ids": ids,
                "sizes": [int(sizes[c]) for c in ids],
                "s_question": [round(float(sq[r, c]), 6) for c in ids],
                "s_answer": [round(float(sa[r, c]), 6) for c in ids],
                "prefill": [c in prefill for c in ids],
            })
        layers.append({"layer": layer_idx, "rows": out_rows})
    return {"threshold": float(threshold), "layers": layers}


def unit_report(clusters: list[dict], unit_scores: dict[int, dict] | None = None) -> dict:
    """The retrieval report of a method without a threshold (e.g. Quest's pages, kept by rank): the units the
    question's prefill kept, with their sizes, their lookup scores as s_question where the turn has them, and as
    s_answer the best score the answer's steps gave each (unit_scores: Answer.unit_scores; 0 without)."""
    layers = []
    for entry in clusters:
        rows = []
        best = (unit_scores or {}).get(entry["layer"], {}).get("answer")  # [rows, U]
        for row in entry["rows"]:
            scores = row.get("scores") or [0.0] * len(row["ids"])
            order = sorted(range(len(row["ids"])), key=lambda i: -scores[i])[:MAX_REPORTED]
            ids = [row["ids"][i] for i in order]
            rows.append({"row": row["row"], "kv_head": row["kv_head"], "ids": ids,
                         "sizes": [row["sizes"][i] for i in order],
                         "s_question": [round(float(scores[i]), 6) for i in order],
                         "s_answer": [round(float(best[row["row"], c]), 6) for c in ids] if best is not None
                         else [0.0] * len(order),
                         "prefill": [True] * len(order)})
        layers.append({"layer": entry["layer"], "rows": rows})
    return {"threshold": 0.0, "layers": layers, "scored": False}


def explain_turn(answer: Answer, method: str) -> dict:
    """The retrieval report of a finished turn, from what its own lookups scored (Answer.unit_scores: no second pass
    of the model). A plan with a threshold (the cluster methods): `retrieval_report`, the units passing it at a
    decode step counting as retrieved by the answer; a top-K plan (pages): `unit_report`. The report names its
    method and unit, and lists the document tokens the turn read as follow rows (`follow`: token positions)."""
    head = {"method": method, "unit": REGISTRY[method].unit, "follow": answer.follow[:MAX_FOLLOW]}
    clusters = answer.stats.clusters
    threshold = answer.plan.retrieval_threshold() if answer.plan is not None else None
    if threshold is None or not answer.unit_scores:
        return {**unit_report(clusters, answer.unit_scores), **head}
    scores = {layer: {"question": s["question"], "answer": s["answer"]} for layer, s in answer.unit_scores.items()}
    counts = {layer: s["sizes"] for layer, s in answer.unit_scores.items()}
    return {**retrieval_report(clusters, scores, counts, threshold), "scored": True, **head}


@dataclass
class ContextData:
    """A ready context's artifacts that the views need, on the CPU.

    offsets: [L, 2] character span of each token in doc.text ((-1, -1) for specials)
    global_layers: the layers with an index; kv_heads: KV heads per layer; rows: which token each K/V row holds
        (the indexed tokens, then the dense rows: the sink and the tail; engine.attention.rows)
    units: (method, its build's time) -> global layer -> [Hkv, L - tail] unit (cluster, page) of each token before
        the dense tail (-1: a sink token, read by every step), filled on first use (ContextInspector.unit_labels)
    """

    context_id: str
    doc_id: str
    doc: Document
    settings: dict
    fixed_len: int
    offsets: np.ndarray
    global_layers: list[int]
    kv_heads: int
    rows: FixedRows
    units: dict[tuple, dict[int, np.ndarray]] = field(default_factory=dict)
    _token_pages: np.ndarray | None = field(default=None, repr=False)

    @property
    def clustered(self) -> int:
        """Indexed tokens (the rest are the sink's and the tail's, read by every step)."""
        return self.rows.indexed

    @property
    def tail_start(self) -> int:
        """The first token of the dense tail (the context's last tokens, read by every step)."""
        return self.fixed_len - self.rows.tail

    @property
    def token_pages(self) -> np.ndarray:
        """[L] 1-based page of each token (a special token without text takes the page of the token after it)."""
        if self._token_pages is None:
            starts = self.offsets[:, 0].copy()
            for i in range(len(starts) - 2, -1, -1):
                if starts[i] < 0:
                    starts[i] = starts[i + 1]
            starts = np.clip(starts, 0, max(0, len(self.doc.text) - 1))
            self._token_pages = np.searchsorted(np.asarray(self.doc.page_starts), starts, side="right")
        return self._token_pages

    def page_of_token(self, token: int) -> int | None:
        start = int(self.offsets[token, 0])
        if start < 0 or start >= len(self.doc.text):
            return None
        return self.doc.page_of(start)


@dataclass
class Passage:
    """A stretch of the document whose tokens the lookup retrieved.

    start, end: character span in the document text; page: 1-based page of its start
    marks: (start, end, weight) of each retrieved token inside the span (weight in (0, 1])
    score: the summed weight of the window around its seed token (what passages are ranked by)
    """

    start: int
    end: int
    page: int
    score: float
    marks: list[tuple[int, int, float]]


@dataclass
class Projection:
    """Keys of one layer and KV head projected on their first two principal components (of the L2-normalised
    keys, the space k-means clusters in).

    points: [N, 2] drawn keys; labels: [N] their clusters; centroids: [C, 2]; retrieved: clusters the lookup kept;
    explained: share of the variance the two components hold; total: keys before subsampling
    """

    layer: int
    kv_head: int
    points: np.ndarray
    labels: np.ndarray
    centroids: np.ndarray
    sizes: np.ndarray
    retrieved: list[int]
    explained: float
    total: int


class ContextInspector:
    """Reads contexts' artifacts from the store (a few kept in memory) and turns a turn's clusters into passages
    and projections. Thread-safe."""

    def __init__(self, store: Store, cached: int = CACHED_CONTEXTS):
        self.store = store
        self._cached = cached
        self._data: OrderedDict[str, ContextData] = OrderedDict()
        self._lock = threading.Lock()

    def data(self, context_id: str) -> ContextData:
        with self._lock:
            if context_id in self._data:
                self._data.move_to_end(context_id)
                return self._data[context_id]
        ctx = self.store.contexts.get(context_id)
        rows = {a["name"]: a for a in self.store.artifacts.list(context_id)}
        layers = sorted(p[0] for p in map(names.split_layer, rows) if p is not None and p[1] == names.CALIB_QUERIES)
        offsets = self.store.artifacts.load(context_id, [names.OFFSETS])[names.OFFSETS].numpy()
        fixed_len = int(ctx["tokens"] or offsets.shape[0])
        keys = rows.get(names.layer_name(layers[0], "keys")) if layers else None
        data = ContextData(context_id=context_id, doc_id=ctx["doc_id"], doc=self.store.documents.get(ctx["doc_id"]),
                           settings=ctx["settings"], fixed_len=fixed_len, offsets=offsets, global_layers=layers,
                           kv_heads=int(keys["shape"][0]) if keys else 0,
                           rows=ContextSettings.from_dict(ctx["settings"]).rows(fixed_len))
        with self._lock:
            self._data[context_id] = data
            while len(self._data) > self._cached:
                self._data.popitem(last=False)
        return data

    def forget(self, context_id: str | None = None) -> None:
        with self._lock:
            if context_id is None:
                self._data.clear()
            else:
                self._data.pop(context_id, None)

    def _built(self, context_id: str, method: str):
        """The method as built for the context (its settings from the store), or None when it is not built."""
        build = self.store.methods.get(context_id, method)
        if build is None or method not in REGISTRY:
            return None
        entry = build["settings"].get(method)
        return make_method(method, Method.built_settings(entry) if isinstance(entry, dict) else entry)

    def _method_layer(self, context_id: str, method: str, layer: int) -> LayerIndex:
        """A method's artifacts of one layer (CPU) as a lookup sees them."""
        data = self.data(context_id)
        prefix = names.method_layer_name(method, layer, "")
        wanted = [a["name"] for a in self.store.artifacts.list(context_id) if a["name"].startswith(prefix)]
        tensors = {n[len(prefix):]: t for n, t in self.store.artifacts.load(context_id, wanted).items()}
        return LayerIndex(tensors=tensors, num_keys=data.fixed_len, tail=data.rows.dense)

    def unit_labels(self, context_id: str, method: str) -> dict[int, np.ndarray]:
        """global layer -> [Hkv, L - tail] the unit of each token before the dense tail under `method` as built now
        (-1 for the sink's tokens, which no unit holds; {} for a method not built; a rebuild with other settings is
        another entry)."""
        data = self.data(context_id)
        build = self.store.methods.get(context_id, method)
        key = (method, build["built_at"] if build else None)
        with self._lock:
            if key in data.units:
                return data.units[key]
        built = self._built(context_id, method)
        out = {}
        if built is not None:
            for layer in data.global_layers:
                labels = built.unit_labels(self._method_layer(context_id, method, layer))
                if labels is not None:  # per indexed row, i.e. token sink + row: the sink's tokens first, as -1
                    labels = labels.cpu().numpy()
                    out[layer] = np.concatenate([np.full((labels.shape[0], data.rows.sink), -1, labels.dtype), labels],
                                                axis=1)
        with self._lock:
            data.units[key] = out
        return out

    # ------------------------------------------------------------------ passages

    def token_weights(self, context_id: str, report: dict, layer: int | None = None,
                      kv_head: int | None = None) -> np.ndarray:
        """[L] how strongly each token's cluster was retrieved, in [0, 1] (0: not retrieved; the dense tail, always
        attended, is 0 here too): the largest S (question or answer) over the report's selections, on a log scale
        from the threshold (MIN_MARK) to the turn's largest S (1). layer / kv_head: only those selections. A token
        the turn read as a follow row (the report's `follow`: read in every layer and head) weighs 1. Only those
        when the method's index was rebuilt since the turn (the report's unit ids are the old index's)."""
        weights = self._cluster_weights(context_id, report, layer, kv_head)
        follow = np.asarray(report.get("follow") or [], dtype=np.int64)
        weights[follow[(follow >= 0) & (follow < weights.shape[0])]] = 1.0
        return weights

    def _cluster_weights(self, context_id: str, report: dict, layer: int | None, kv_head: int | None) -> np.ndarray:
        """`token_weights` of the report's units alone."""
        data = self.data(context_id)
        method = report.get("method", "squeeze")
        best = np.zeros(data.fixed_len, dtype=np.float64)  # largest S of each token's retrieved clusters
        build = self.store.methods.get(context_id, method)
        if report.get("built_at") and (build is None or build["built_at"] != report["built_at"]):
            return best  # the method's index was rebuilt since the turn (other settings): its unit ids name others
        units = self.unit_labels(context_id, method)
        scored = report.get("scored", True)
        for entry in report.get("layers", []):
            labels = units.get(entry["layer"])
            if labels is None or (layer is not None and entry["layer"] != layer):
                continue
            for row in entry["rows"]:
                if (kv_head is not None and row["kv_head"] != kv_head) or not row["ids"]:
                    continue
                s = np.maximum(np.asarray(row["s_question"], dtype=np.float64),
                               np.asarray(row["s_answer"], dtype=np.float64)) if scored else np.ones(len(row["ids"]))
                per_cluster = np.zeros(int(labels.max()) + 1, dtype=np.float64)
                per_cluster[np.asarray(row["ids"], dtype=np.int64)] = np.maximum(s, 1e-12)
                head_labels = labels[row["kv_head"]]
                got = np.where(head_labels >= 0, per_cluster[np.maximum(head_labels, 0)], 0.0)  # -1: the sink
                np.maximum(best[: head_labels.shape[0]], got, out=best[: head_labels.shape[0]])
        hit = best > 0
        if not hit.any():
            return best
        floor = max(float(report.get("threshold") or 0.0), float(best[hit].min()) * 0.999, 1e-12)
        top = float(best.max())
        span = np.log(top / floor) if top > floor else 1.0
        weights = np.zeros_like(best)
        weights[hit] = MIN_MARK + (1 - MIN_MARK) * np.clip(np.log(np.maximum(best[hit], floor) / floor) / span, 0, 1)
        return weights

    def marks(self, context_id: str, weights: np.ndarray, lo: int = 0,
              hi: int | None = None) -> list[tuple[int, int, float]]:
        """(start, end, weight) character spans of the tokens in [lo, hi) with weight > 0, in document order;
        neighbouring tokens of about the same weight are joined."""
        data = self.data(context_id)
        hi = data.fixed_len if hi is None else hi
        out: list[tuple[int, int, float]] = []
        for t in np.nonzero(weights[lo:hi] > 0)[0] + lo:
            start, end = (int(x) for x in data.offsets[t])
            if start < 0 or end <= start:
                continue
            w = float(weights[t])
            if out and out[-1][1] == start and abs(out[-1][2] - w) < 0.05:
                out[-1] = (out[-1][0], end, max(out[-1][2], w))
            else:
                out.append((start, end, w))
        return out

    def passages(self, context_id: str, weights: np.ndarray, top: int = 5) -> list[Passage]:
        """Up to `top` passages where the retrieval is strongest, strongest first: each is the tokens within
        PASSAGE_RADIUS of a retrieved seed token, seeds ranked by the summed weight of that window and skipped
        when inside a passage already taken."""
        data = self.data(context_id)
        pages = data.token_pages
        window = np.zeros_like(weights)  # summed weight within PASSAGE_RADIUS tokens on the same page
        kernel = np.ones(2 * PASSAGE_RADIUS + 1)
        bounds = np.flatnonzero(np.diff(pages)) + 1
        for a, b in zip(np.r_[0, bounds], np.r_[bounds, len(pages)]):
            window[a:b] = np.convolve(weights[a:b], kernel)[PASSAGE_RADIUS : PASSAGE_RADIUS + b - a]
        order = np.lexsort((-weights, -window))  # by window sum, then by the seed's own weight
        taken: list[tuple[int, int, float]] = []  # token windows [lo, hi) with their seed's window sum
        for t in order:
            if len(taken) >= top:
                break
            if weights[t] <= 0:
                continue
            if any(a <= t < b for a, b, _ in taken):
                continue
            lo, hi = max(0, int(t) - PASSAGE_RADIUS), min(data.fixed_len, int(t) + PASSAGE_RADIUS + 1)
            while lo < t and pages[lo] != pages[t]:  # a passage stays on its seed's page
                lo += 1
            while hi - 1 > t and pages[hi - 1] != pages[t]:
                hi -= 1
            for a, b, _ in taken:  # do not overlap a stronger passage (t lies outside each of them)
                if a < hi and lo < b:
                    lo, hi = (max(lo, b), hi) if t >= b else (lo, min(hi, a))
            taken.append((lo, hi, float(window[t])))
        merged: list[list] = []  # windows that touch (on one page) become one passage
        for lo, hi, score in sorted(taken):
            if merged and lo <= merged[-1][1] and pages[lo] == pages[merged[-1][1] - 1]:
                merged[-1][1], merged[-1][2] = max(merged[-1][1], hi), max(merged[-1][2], score)
            else:
                merged.append([lo, hi, score])
        out = []
        for lo, hi, score in sorted(merged, key=lambda m: -m[2]):
            spans = [(int(data.offsets[k, 0]), int(data.offsets[k, 1])) for k in range(lo, hi) if data.offsets[k, 0] >= 0]
            if not spans:
                continue
            start, end = spans[0][0], spans[-1][1]
            out.append(Passage(start=start, end=end, page=data.doc.page_of(start), score=score,
                               marks=self.marks(context_id, weights, lo, hi)))
        return out

    def cluster_pages(self, context_id: str, method: str, layer: int, kv_head: int,
                      cluster_ids: list[int]) -> dict[int, list[int]]:
        """For each unit id (cluster, page) of `method`: the document pages its keys' tokens lie on."""
        data = self.data(context_id)
        labels = self.unit_labels(context_id, method)[layer][kv_head]
        out = {}
        for cid in cluster_ids:
            tokens = np.nonzero(labels == cid)[0]
            pages = {data.page_of_token(int(t)) for t in tokens}
            out[cid] = sorted(p for p in pages if p is not None)
        return out

    def cluster_preview(self, context_id: str, method: str, layer: int, kv_head: int, cluster_id: int,
                        chars: int = 60) -> str:
        """The text of a unit's first few tokens, each run of adjacent ones widened to the words it touches (a
        cluster of commas or quotes shows the words they close, not "' · ' · '"), runs joined with " · "."""
        data = self.data(context_id)
        text = data.doc.text
        tokens = np.nonzero(self.unit_labels(context_id, method)[layer][kv_head] == cluster_id)[0]
        runs, last = [], None  # [start, end) of each run of adjacent tokens
        for t in tokens[:12]:
            s, e = (int(x) for x in data.offsets[t])
            if s < 0:
                continue
            if runs and last is not None and t == last + 1:
                runs[-1][1] = e
            else:
                runs.append([s, e])
            last = t
        pieces = []
        for s, e in runs:
            lo, hi = s, e
            while lo > max(0, s - WORD_REACH) and not text[lo - 1].isspace():
                lo -= 1
            while hi < min(len(text), e + WORD_REACH) and not text[hi].isspace():
                hi += 1
            piece = " ".join(text[lo:hi].split())
            if piece and (not pieces or pieces[-1] != piece):
                pieces.append(piece)
        return " · ".join(pieces)[:chars]

    # ------------------------------------------------------------------ projection

    def projection(self, context_id: str, method: str, layer: int, kv_head: int, retrieved: list[int],
                   max_points: int = PROJECTION_POINTS, seed: int = 0) -> Projection:
        """PCA (torch.pca_lowrank) of the layer's indexed keys for one KV head, with a cluster method's centroids."""
        if REGISTRY[method].unit == "head":
            raise ValueError(f"{method} keeps whole heads (every key, or a sink and a recent window), not clusters "
                             "of keys: there is nothing to project")
        data = self.data(context_id)
        units = self.unit_labels(context_id, method)
        if not units:
            raise ValueError(f"no {method} index for this document yet (its first question builds it)")
        if layer not in units:
            raise ValueError(f"layer {layer} has no {method} index; choose one of {sorted(units)}")
        if not 0 <= kv_head < data.kv_heads:
            raise ValueError(f"kv_head must be in [0, {data.kv_heads}), got {kv_head}")
        index = self._method_layer(context_id, method, layer)
        if "centroids" not in index:
            raise ValueError(f"{method} has no centroids to project (its units are {REGISTRY[method].unit}s)")
        lc = data.clustered
        keys = self.store.artifacts.load(context_id, [names.layer_name(layer, "keys")])[names.layer_name(layer, "keys")]
        keys = torch.nn.functional.normalize(keys[kv_head, :lc].float(), dim=-1)  # [Lc, D]
        centroids = torch.nn.functional.normalize(float_centroids(index)[kv_head], dim=-1)  # [C, D]
        mean = keys.mean(dim=0, keepdim=True)
        torch.manual_seed(seed)
        _, s, v = torch.pca_lowrank(keys - mean, q=min(6, *keys.shape), center=False, niter=4)
        basis = v[:, :2]  # [D, 2]
        total_var = float(((keys - mean) ** 2).sum())
        explained = float((s[:2] ** 2).sum()) / total_var if total_var > 0 else 0.0
        points = ((keys - mean) @ basis).numpy()
        labels = units[layer][kv_head][data.rows.sink :]  # the indexed rows' (the sink's tokens are not indexed)
        keep = _subsample(labels, set(retrieved), max_points, seed)
        return Projection(layer=layer, kv_head=kv_head, points=points[keep], labels=labels[keep],
                          centroids=((centroids - mean) @ basis).numpy(),
                          sizes=index["counts"][kv_head].numpy(), retrieved=sorted(retrieved),
                          explained=explained, total=lc)


def _subsample(labels: np.ndarray, retrieved: set[int], max_points: int, seed: int) -> np.ndarray:
    """Indices of at most max_points keys: the retrieved clusters' keys first, the rest drawn at random."""
    n = labels.shape[0]
    if n <= max_points:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    hit = np.isin(labels, list(retrieved))
    first = np.nonzero(hit)[0]
    if first.size >= max_points:
        return np.sort(rng.choice(first, max_points, replace=False))
    rest = np.nonzero(~hit)[0]
    return np.sort(np.concatenate([first, rng.choice(rest, max_points - first.size, replace=False)]))
