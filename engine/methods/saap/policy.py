"""Saap ("Inference-time sparse attention with asymmetric indexing"): asymmetric partitions. Keys go to buckets by
their nearest centroid (spherical k-means of de-RoPE'd keys), queries to buckets by a learned classifier (an MLP on
de-RoPE'd queries); both learned once per model (engine.methods.saap.partitions), the document's keys only assigned at ingest.

Index (per global layer): each indexed key's bucket (`labels`; a bucket of more than `max_bucket` times the mean
cut into chunks of consecutive keys, each a bucket with its share of the score: split_buckets), in the
cluster-permuted layout squeeze uses (an inverted file the sparse kernel reads as ranges), plus one more group, the
dense part "1 + W": the context's first token and its last W indexed tokens (W = engine.methods.saap.partitions.recent_window of
the context's length, the paper's 2047 at 128K), read at every step with the engine's dense rows. The model's layer
0, when it is a global layer, reads every key (section 3: its attention is spread over all keys).

Lookup (no host synchronisation: fixed shapes, the budget a number of keys known on the host): the step's queries
de-RoPE'd at their positions, each query head's classifier scores (softmax over buckets; with the size prior, the
default, over its logits plus the log of each bucket's keys in the document, held in the index's b2), summed over the
KV head's query heads (section 5) and averaged over the step's tokens; buckets taken best first (by that score per
key by default, or by the score: `SaapSettings.rank`), their keys counted, until the plan's share of the indexed keys
is reached (on the CPU: the keys the step's room leaves once its own follow rows are counted, `room_keys`; the bucket
that crosses it included, a chunk at most past it: kernels/jit/buckets.py, a threshold found
without sorting); the expansion to key positions is squeeze's kernel. The classifier's weights are what a step reads
of the index (counted in the budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.attention.budget import KEYS_GRID, byte_share, exact_room
from engine.attention.curves import budget_curves
from engine.attention.method import (
    CalibrationSet,
    LayerIndex,
    LayerKeys,
    Lookup,
    Method,
    MethodSettings,
    Preparation,
    StepPlan,
    Tensors,
    check_budget,
)
from engine.index.artifacts import layer_name
from engine.index.rope import derope
from engine.methods.saap.partitions import (
    EMPTY,
    PARAMS,
    PartitionTraining,
    StepReport,
    bucket_labels,
    init_weights,
    log_counts,
    recent_window,
)
from engine.model.prefill import attention_scale
from kernels.backend import REFERENCE, Backend
from kernels.layout import ClusterLayout, group_starts
from kernels.selection import FollowRows

TRAINING_PREFIX = "train_"
# A prompt token of the training costs about three tokens of an ingest: the defaults (4 prompts of 4,096 tokens)
# trained in 161 s on 2 CPU cores with the embedded model, which ingests 3.4 ms per token.
INGEST_TOKENS_PER_PROMPT_TOKEN = 2.9
MODEL_PARTS = ("centroids", *PARAMS, "inv_freq")  # a layer's model-level artifacts
LOOKUP_PARTS = ("inv_freq", *PARAMS)  # what a lookup reads of them (the bucket_scores kernel's order): copied
# into each context's index
CHUNK_TIE = 1e-4  # the share of its score a bucket's chunk gives up per chunk before it (SaapPolicy.build)
CORPUS_SPARE = 2  # corpus tokens read: this many times what the prompts need (they must not run short)


@dataclass(frozen=True)
class SaapSettings(MethodSettings):
    """buckets, hidden: the partitions' size (C per layer and KV head; the paper: 1024) and the classifier's width;
    dense_first_layer: the model's layer 0 reads every key when it is a global layer (the paper's choice);
    rank: what the buckets are taken best first by until the budget: "per_key" (default), the score over the
    bucket's keys in the document (the predicted weight a key of the budget buys), or "mass", the classifier's
    score alone (the paper's top buckets, whose buckets are balanced; ours are not: engine/bench/README.md,
    "Ranking buckets per key");
    size_prior: the classifier's softmax over its logits plus log n_b, n_b the keys in bucket b (the training
    prompt's long-range ones in training, the document's at ingest, folded into the index's copy of b2): its
    logits are a bucket's weight per key, whatever the sizes of the buckets in the training text
    (engine.methods.saap.partitions, PartitionTraining.size_prior; engine/bench/README.md, "The classifier's
    size prior");
    max_bucket: with rank "per_key", a bucket holding more than this many times the document's mean of indexed keys
    per bucket is cut at ingest into chunks of consecutive keys, each at most that size, each a bucket of the index
    with the bucket's classifier column and its share of the score (split_buckets: per key every chunk ranks as its
    bucket did), so that the bucket crossing the budget, read whole, overshoots it by one chunk at most; 0: never
    (engine/bench/README.md, "Big buckets cut at ingest");
    train_*: engine.methods.saap.partitions.PartitionTraining (prompts x tokens of text, sampled queries per prompt and head,
    k-means iterations, Adam steps, batch, learning rate, long-range queries only); seed: the training's. All but
    dense_first_layer, rank and max_bucket are the key of the stored partitions."""

    RANKS: ClassVar[tuple[str, ...]] = ("mass", "per_key")
    LOOKUP_ONLY: ClassVar[tuple[str, ...]] = ("dense_first_layer", "rank", "max_bucket")  # not the partitions' key

    buckets: int = 256
    hidden: int = 128
    dense_first_layer: bool = True
    rank: str = "per_key"
    size_prior: bool = True
    max_bucket: float = 4.0
    train_prompts: int = 4
    train_tokens: int = 4096
    train_queries: int = 512
    train_kmeans_iters: int = 10
    train_steps: int = 2000  # 6 s on 2 CPU cores for the embedded model: the KL still falls after 300
    train_batch: int = 256
    train_lr: float = 1e-3
    train_long_range: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.training()  # validates the sizes
        if self.rank not in self.RANKS:
            raise ValueError(f"saap rank must be one of {self.RANKS}, got {self.rank!r}")
        if not (self.max_bucket == 0 or self.max_bucket >= 1):
            raise ValueError(f"saap max_bucket must be 0 (off) or at least 1, got {self.max_bucket}")

    def training(self) -> PartitionTraining:
        return PartitionTraining(buckets=self.buckets, hidden=self.hidden, prompts=self.train_prompts,
                                 tokens=self.train_tokens, queries=self.train_queries,
                                 kmeans_iters=self.train_kmeans_iters, steps=self.train_steps,
                                 batch=self.train_batch, lr=self.train_lr, seed=self.seed,
                                 long_range=self.train_long_range, size_prior=self.size_prior)


@dataclass(frozen=True)
class BucketPlan(StepPlan):
    """Each step reads the best buckets until `decode` (one token) or `prefill` (a question) of the indexed keys.
    room: as ThresholdPlan's (engine.attention.budget.exact_room: on the CPU a step counts its own follow rows and
    its buckets take the keys the rest of the budget pays for)."""

    decode: float = 1.0
    prefill: float = 1.0
    room: tuple[float, float] | None = None

    def at(self, new_tokens: int) -> float:
        return self.decode if new_tokens == 1 else self.prefill

    def describe(self) -> str:
        return f"best buckets up to {self.decode:.1%} of the keys (prefill {self.prefill:.1%})"


class SaapPolicy(Method):
    name: ClassVar[str] = "saap"
    Settings: ClassVar[type] = SaapSettings
    unit: ClassVar[str] = "bucket"

    def prepare_key(self) -> dict:
        return {f.name: getattr(self.settings, f.name) for f in fields(self.settings)
                if f.name not in SaapSettings.LOOKUP_ONLY}

    def preparation_work(self) -> float:
        """The training's prompts at INGEST_TOKENS_PER_PROMPT_TOKEN each (their queries' collection, k-means and the
        classifiers' steps included)."""
        return self.settings.train_prompts * self.settings.train_tokens * INGEST_TOKENS_PER_PROMPT_TOKEN

    def prepare(self, lm, preparation: Preparation | None = None) -> Tensors:
        """Train the partitions (engine.methods.saap.partitions) on the corpus (engine.text.corpus): `layer{i}.centroids`, the
        classifier's `w1`, `b1`, `w2`, `b2`, and the layer's RoPE frequencies `inv_freq`."""
        from engine.index.rope import rope_frequencies
        from engine.methods.saap.partitions import train_partitions
        from engine.text.corpus import corpus_ids

        prep = preparation or Preparation()
        training = self.settings.training()
        if training.tokens > lm.max_context:  # a model of a shorter context trains on prompts it can read
            training = replace(training, tokens=lm.max_context)
        layers = list(lm.global_layers)
        types = getattr(lm.config, "layer_types", None)
        inv_freq = {i: rope_frequencies(lm.model, types[i] if types else None, lm.head_dim) for i in layers}
        scale = {i: attention_scale(lm, i) for i in layers}
        corpus = corpus_ids(lm.tokenizer, CORPUS_SPARE * training.prompts * training.tokens)

        def report(r: StepReport) -> None:
            loss = f", loss {r.loss:.4f}" if r.stage.startswith("training") else ""
            prep.progress(r.step, r.steps, f"{r.stage} {r.step}/{r.steps}{loss} ({r.seconds:.0f} s)")

        found = train_partitions(lm, training, corpus, inv_freq, scale, state=prep.load() or None, save=prep.save,
                                 progress=report)
        return partition_artifacts({i: {**found[i], "inv_freq": inv_freq[i]} for i in layers})

    def stand_in(self, layers: list[int], num_kv_heads: int, head_dim: int) -> Tensors:
        """Random unit centroids and an untrained classifier (the default RoPE's frequencies): the shapes a
        trained model gives, for timing and for the mechanics."""
        s = self.settings
        gen = torch.Generator().manual_seed(s.seed)
        out = {}
        for i in layers:
            weights = init_weights(num_kv_heads, head_dim, s.hidden, s.buckets, s.seed + i, "cpu")
            centroids = F.normalize(torch.randn(num_kv_heads, s.buckets, head_dim, generator=gen), dim=-1)
            inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            out[i] = {"centroids": centroids, **weights, "inv_freq": inv_freq}
        return partition_artifacts(out)

    def build(self, layer: LayerKeys, required: dict[str, Tensors], prepared: Tensors) -> Tensors:
        """`labels` [Hkv, Lc] int64 (bucket of each indexed key: its nearest centroid's, or with `max_bucket` a chunk
        of it, split_buckets: C' >= C buckets; C' = the dense part "1 + W"), `counts` [Hkv, C' + 1], `key_starts`
        [Hkv, C' + 2] (where each group lies in the layout), `dense` [1] bool (a layer read whole), and a copy of the
        classifier (a chunk with its bucket's column) and the RoPE frequencies (LOOKUP_PARTS: the index is whole
        without the model's artifacts, and a retrained model's contexts are rebuilt: the training settings are part
        of its key)."""
        missing = [n for n in MODEL_PARTS if n not in prepared]
        if missing:
            raise ValueError("saap needs its trained partitions (`squeeze train saap`, or the app's first use of the "
                             f"method); missing {', '.join(missing)}")
        keys = layer.keys
        hkv, lc = keys.shape[:2]
        device = keys.device
        centroids = prepared["centroids"].to(device)
        c = centroids.shape[1]
        positions = torch.arange(layer.first, layer.first + lc, device=device)
        points = derope(keys, positions, prepared["inv_freq"])
        labels = bucket_labels(points, centroids)
        recent = min(lc, recent_window(layer.first + lc + layer.tail))
        labels[:, lc - recent:] = c  # the dense part: the last W indexed tokens ...
        if layer.first == 0:
            labels[:, 0] = c  # ... and the first token (with a sink, the context's first tokens are dense rows)
        parts = {n: prepared[n].to(device=device, dtype=torch.float32).clone() for n in LOOKUP_PARTS}
        s = self.settings
        parent = None
        if s.rank == "per_key" and s.max_bucket > 0:  # big buckets cut into chunks, each a bucket of the index
            indexed = int((labels[0] < c).sum())  # (the dense part holds the same keys in every KV head)
            labels, parent, piece = split_buckets(labels, c, max(1, math.ceil(s.max_bucket * indexed / c)))
            column = parent.clamp(min=0)  # [Hkv, C']: each bucket's classifier column (padding: any, never read)
            parts["w2"] = parts["w2"].gather(2, column[:, None, :].expand(-1, parts["w2"].shape[1], -1))
            # a bucket's later chunks score a hair lower, so that a threshold between equal scores cannot take them
            # all (the pick keeps every bucket at or above it): they are read in token order
            parts["b2"] = parts["b2"].gather(1, column) + piece * math.log1p(-CHUNK_TIE)
            c = parent.shape[1]
        starts = group_starts(labels, c + 1)
        counts = starts[:, 1:] - starts[:, :-1]
        if s.size_prior:  # the document's buckets' keys enter the classifier's softmax (a chunk's own, a padding's
            parts["b2"] = parts["b2"] + log_counts(counts[:, :c])  # none: EMPTY)
        elif parent is not None:  # without it a chunk takes its share of its bucket's score
            parts["b2"] = parts["b2"] + chunk_log_shares(counts[:, :c], parent)
        dense = layer.layer_idx == 0 and s.dense_first_layer
        return {"labels": labels, "counts": counts, "key_starts": starts,
                "dense": torch.tensor([dense], device=device), **parts}

    def calibrate(self, layers: list[CalibrationSet], scale: float) -> Tensors:
        """The budget curves measured over the sparse layers, then averaged with the dense ones' reads by their
        numbers (the engine measures a few layers evenly spaced: a dense layer among them would count for more
        than its share)."""
        dense = [s for s in layers if bool(s.index["dense"].any())]
        sparse = [s for s in layers if not bool(s.index["dense"].any())]
        parts = [(len(group), budget_curves(self, group, scale, {})) for group in (sparse, dense) if group]
        total = sum(n for n, _ in parts)
        return {name: sum(n * curves[name] for n, curves in parts) / total
                for name in ("budget_decode", "budget_prefill")}

    def plan_keys(self, calibration: Tensors, budget: float, decode_keys: float, prefill_keys: float) -> BucketPlan:
        return BucketPlan(budget=check_budget(budget), decode=check_budget(decode_keys),
                          prefill=check_budget(prefill_keys))

    def lookup(self, q: torch.Tensor, layer: LayerIndex, plan: BucketPlan, scale: float, backend: Backend,
               positions: torch.Tensor | None = None, valid: torch.Tensor | None = None,
               follow: FollowRows | None = None) -> Lookup:
        """One selection row per KV head: its query heads' bucket scores summed, the best buckets up to the plan's
        keys, the dense part, every bucket in a dense layer."""
        if positions is None:
            raise ValueError("saap classifies de-RoPE'd queries: its lookup needs the queries' positions")
        parts = layer.memo(("saap", q.device), lambda: LookupParts.of(layer, q.device))
        budget = float("inf") if parts.whole else plan.at(q.shape[1]) * float(layer.indexed)  # inf: every bucket
        cut = exact_room(plan, q, follow, parts.sizes.shape[0])
        if cut is not None and not parts.whole and plan.budget < 1.0:
            budget = room_keys(layer, parts, q.shape[2], *cut)
        # the dense part, the same keys in every KV head and the last group of the layout, is read with the tail
        score, keep, selection = backend.kernel("buckets").select_buckets(
            q, positions, *(layer[n] for n in LOOKUP_PARTS), parts.sizes, budget, parts.starts,
            layer.indexed - parts.dense, layer.tail + parts.dense, per_key=self.settings.rank == "per_key",
            valid=valid)  # score, keep [Hkv, C]
        return Lookup(selection=selection, index_elements=parts.read, units=keep, scores=score, sizes=parts.sizes)

    def reads(self, q: torch.Tensor, layer: LayerIndex, plans: list[BucketPlan], scale: float,
              positions: torch.Tensor | None = None) -> list[float]:
        """Method.reads with the buckets scored, ranked and counted once for every plan (what the buckets at or
        above each one hold does not depend on the budget): each KV head reads its best buckets' keys up to the
        plan's keys, the dense part and the tail, and the lookup's index elements, as read_fraction counts the
        lookup's selection (tests/engine/test_budget.py holds it to the lookups')."""
        if positions is None:
            raise ValueError("saap classifies de-RoPE'd queries: its lookup needs the queries' positions")
        parts = layer.memo(("saap", q.device), lambda: LookupParts.of(layer, q.device))
        hkv, d = parts.sizes.shape[0], q.shape[2]
        buckets = REFERENCE.kernel("buckets")
        score = buckets.bucket_scores(q, positions, *(layer[n] for n in LOOKUP_PARTS))
        rank = buckets.ranking(score, parts.sizes, self.settings.rank == "per_key")
        held = buckets.held_keys(rank, parts.sizes)
        index, rest = float(parts.read.double().sum()), hkv * (layer.tail + parts.dense)
        out = []
        for plan in plans:
            budget = float("inf") if parts.whole else plan.at(q.shape[1]) * float(layer.indexed)
            keep = buckets.take_best_held(rank, held, budget)
            out.append(byte_share(float((parts.sizes * keep).sum()) + rest, index, hkv, layer.num_keys, d))
        return out

    def layout(self, layer: LayerIndex) -> ClusterLayout:
        return ClusterLayout.from_labels(layer["labels"], layer["counts"].shape[1], layer.tail)

    def unit_labels(self, layer: LayerIndex) -> torch.Tensor:
        return layer["labels"]


def room_keys(layer: LayerIndex, parts: "LookupParts", head_dim: int, room: float, besides) -> float:
    """The bucket keys a KV head may read at a step whose `room` (a share of the fixed K/V bytes) also pays for the
    classifier's elements, the dense part and the dense tail, and the keys it reads besides (its follow rows,
    `besides` over the KV heads), less half a mean bucket (the one that reaches the count is read whole: half a
    bucket over on average); at least the fewest keys a plan keeps (KEYS_GRID's last share)."""
    hkv, c = parts.sizes.shape
    keys = (room * layer.num_keys - float(parts.read[0]) / (2 * head_dim) - layer.tail - parts.dense
            - float(besides) / hkv - 0.5 * (layer.indexed - parts.dense) / c)
    return max(keys, KEYS_GRID[-1] * float(layer.indexed))


@dataclass(frozen=True)
class LookupParts:
    """What every lookup of one index reads besides the step's queries, made once per index (LayerIndex.memo, at a
    turn's first step: the captured steps find it made): the buckets' sizes [Hkv, C] and starts [Hkv, C + 1] in the
    layout (the dense part after them), the dense part's keys (a host number: one per index, the same in every KV
    head), whether the layer is read whole, and the index elements a lookup reads per KV head [Hkv] (the
    classifier and the sizes)."""

    sizes: torch.Tensor
    starts: torch.Tensor
    dense: int
    whole: bool
    read: torch.Tensor

    @staticmethod
    def of(layer: LayerIndex, device: torch.device) -> "LookupParts":
        counts = layer["counts"].to(device)  # [Hkv, C + 1]
        hkv, c = counts.shape[0], counts.shape[1] - 1
        dense = counts[:, c]
        if bool((dense != dense[0]).any()):
            raise ValueError("saap's dense part must hold the same keys in every KV head")
        d, hidden = layer["w1"].shape[1:]
        read = torch.full((hkv,), float(d * hidden + hidden + hidden * c + 2 * c), device=device)
        starts = layer["key_starts"][:, :c + 1].to(device).contiguous()
        return LookupParts(sizes=counts[:, :c].contiguous(), starts=starts, dense=int(dense[0]),
                           whole=bool(layer["dense"].any()), read=read)


def partition_artifacts(layers: dict[int, Tensors]) -> Tensors:
    """layer -> its MODEL_PARTS -> `layer{i}.{name}` (float32 copies)."""
    return {layer_name(i, n): parts[n].float().clone() for i, parts in layers.items() for n in MODEL_PARTS}


def split_buckets(labels: torch.Tensor, c: int, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buckets of more than `cap` keys cut into chunks of consecutive keys (in token order, near-equal sizes, each at
    most `cap`). labels [Hkv, Lc] int64 in [0, c] (c: the dense part, left whole) -> (labels [Hkv, Lc] in [0, C'],
    the dense part now C'; parent [Hkv, C'] int64: the bucket each new one was cut from, -1 for padding; piece
    [Hkv, C'] int64: its place among its bucket's chunks, 0 for the first and for a bucket left whole). A bucket's
    first chunk keeps its id, the others take ids from c up; every KV head has C' = c + the most extra chunks of any
    head (a head with fewer pads with empty buckets)."""
    hkv, lc = labels.shape
    device = labels.device
    bounds = group_starts(labels, c + 1)  # [Hkv, c + 2]: where each bucket's keys begin, sorted by bucket
    starts, sizes = bounds[:, :c], bounds.diff(dim=1)[:, :c]  # [Hkv, c] each
    pieces = ((sizes + cap - 1) // cap).clamp(min=1)  # chunks per bucket
    first_extra = c + torch.cumsum(pieces - 1, dim=1) - (pieces - 1)  # [Hkv, c]: the id of each bucket's 2nd chunk
    extra = int((pieces - 1).sum(dim=1).max())
    c2 = c + extra
    order = torch.argsort(labels * lc + torch.arange(lc, device=device), dim=1)  # by bucket, then token
    sorted_labels = labels.gather(1, order)
    bucket = sorted_labels.clamp(max=c - 1)
    rank = torch.arange(lc, device=device) - starts.gather(1, bucket)  # each key's place in its bucket
    dense = sorted_labels == c
    piece = torch.where(dense, 0, rank * pieces.gather(1, bucket) // sizes.gather(1, bucket).clamp(min=1))
    new = torch.where(piece == 0, bucket, first_extra.gather(1, bucket) + piece - 1)
    new = torch.where(dense, c2, new)  # the dense part, last
    out = torch.empty_like(labels).scatter_(1, order, new)
    parent = torch.full((hkv, c2 + 1), -1, dtype=torch.int64, device=device)  # (a spare column: the others' writes)
    parent[:, :c] = torch.arange(c, device=device)
    parent.scatter_(1, torch.where(piece > 0, new, c2), torch.where(piece > 0, bucket, -1))
    place = torch.zeros(hkv, c2 + 1, dtype=torch.int64, device=device)
    place.scatter_(1, torch.where(piece > 0, new, c2), piece)
    return out, parent[:, :c2], place[:, :c2]


def chunk_log_shares(counts: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """counts [Hkv, C'] keys of each bucket of a split index, parent [Hkv, C'] (split_buckets) -> [Hkv, C'] float32:
    log(a chunk's keys / its bucket's), 0 for a bucket left whole (empty ones too), EMPTY for padding."""
    n = counts.float()
    column = parent.clamp(min=0)
    whole = torch.zeros_like(n).scatter_add_(1, column, n).gather(1, column)  # each one's bucket's keys
    share = torch.where(whole > 0, n / whole.clamp(min=1), torch.ones_like(n))
    return torch.where(parent >= 0, share.clamp(min=1e-30).log(), EMPTY)
