"""Saap's partitions ("Inference-time sparse attention with asymmetric indexing", sections 3-4 and appendix A), learned
once per model with the model frozen: per global layer and KV head, buckets of keys (spherical k-means on de-RoPE'd
keys) and a query classifier (a 2-layer MLP on de-RoPE'd queries that says which buckets hold a query's attention).

Training reads `prompts` prompts of real text, `tokens` tokens each (engine.text.corpus), through the engine's own
prefill (full attention), keeping every global layer's keys and queries:
1. buckets: spherical k-means (engine.index.kmeans) of each (layer, KV head)'s de-RoPE'd keys over all prompts, the
   attention sink (each prompt's first token) left out; `centroids` [Hkv, C, D] unit vectors; a key's bucket is
   its most similar centroid.
2. targets: for `queries` sampled query positions of each prompt that have long-range keys (at least `window`
   tokens before them, the dense part at deployment: `recent_window`), the share of the query's attention weight
   (the model's own softmax over the long-range keys, sink excluded) that each bucket holds; every query head of
   the KV head gives its own example (the paper's "each batch from one prompt, long-range pairs only").
3. the classifier, one per (layer, KV head), shared by its query heads (their scores are summed at search time,
   section 5): logits = W2 gelu(W1 q / |q| + b1) + b2, trained with Adam on the KL divergence between the targets
   and its softmax (equation 1), `steps` minibatches of `batch` examples. With `size_prior`, the softmax is over
   logits + log n_b, n_b the long-range keys bucket b holds for that query: the logits are then a bucket's weight
   per key, apart from how many keys the training text put in it, and a document's lookup adds its own counts
   (engine.methods.saap.policy: log n_b folded into b2 at ingest).
Resumable: the state (centroids, weights, Adam moments, step) goes to `save` every `checkpoint_every` steps; the
prompts and every minibatch are functions of (seed, step), so a resumed run ends where an uninterrupted one does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.index.kmeans import spherical_kmeans
from engine.index.rope import derope
from engine.model.prefill import prefill
from kernels.dispatch import backend_for
from kernels.reference.buckets import classify  # the one implementation (also the lookup kernel's reference)

PARAMS = ("w1", "b1", "w2", "b2")  # a classifier's weights (per unit: [D, H], [H], [H, C], [C])


def recent_window(tokens: int) -> int:
    """The dense part's recent tokens for a context of `tokens` tokens: 1/64 of it, at least 16 and at most 2047
    (the paper's "1 + 2047" at 128K tokens and above)."""
    return max(16, min(2047, round(tokens / 64)))


@dataclass(frozen=True)
class PartitionTraining:
    """buckets: C per (layer, KV head) (the paper: 1024 at 128K-500K-token prompts); hidden: the classifier's width;
    prompts, tokens: the training text; queries: examples per prompt and query head; kmeans_iters (the paper: 10);
    steps, batch, lr: the classifier's Adam; seed: which text and which examples; long_range: train only on the
    queries whose best-matching key (the sink aside) is at least the dense window back (the paper's filter,
    appendix A: the dense part serves the others); size_prior: the classifier's softmax is over its logits plus the
    log of each bucket's long-range keys (module docstring, step 3), not the paper's logits alone."""

    buckets: int = 256
    hidden: int = 128
    prompts: int = 4
    tokens: int = 4096
    queries: int = 512
    kmeans_iters: int = 10
    steps: int = 300
    batch: int = 256
    lr: float = 1e-3
    seed: int = 0
    long_range: bool = False
    size_prior: bool = True
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        if min(self.buckets, self.hidden, self.prompts, self.queries, self.kmeans_iters, self.steps, self.batch) < 1:
            raise ValueError(f"partition training needs positive sizes, got {self}")
        if self.tokens < 4 * recent_window(self.tokens) or self.lr <= 0:
            raise ValueError(f"partition training needs tokens >= {4 * 16} and lr > 0, got {self}")


@dataclass
class Prompt:
    """One prompt's tensors of one global layer: keys [Hkv, L, D] as the attention sees them and de-RoPE'd
    (`keys_pre`); the sampled queries [Hq, E, D] likewise, at positions `pos` [E] int64."""

    keys: torch.Tensor
    keys_pre: torch.Tensor
    queries: torch.Tensor
    queries_pre: torch.Tensor
    pos: torch.Tensor


@dataclass
class StepReport:
    step: int
    steps: int
    loss: float
    seconds: float
    stage: str


def train_partitions(lm, training: PartitionTraining, corpus: list[int], inv_freq: dict[int, torch.Tensor],
                     scale: dict[int, float], state: dict[str, torch.Tensor] | None = None,
                     save: Callable[[dict[str, torch.Tensor]], None] | None = None,
                     progress: Callable[[StepReport], None] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Buckets and classifiers of every global layer: layer -> {"centroids" [Hkv, C, D], "w1" [Hkv, D, H],
    "b1" [Hkv, H], "w2" [Hkv, H, C], "b2" [Hkv, C]} (float32, on the CPU), and "sizes" [Hkv, C] int64: the training
    keys in each bucket (their balance: engine.methods.saap.partitions.imbalance).

    corpus: token ids of real text (at least prompts x tokens); inv_freq: layer -> its RoPE frequencies
    (engine.index.rope.rope_frequencies); scale: layer -> its softmax scale. state: a checkpoint to resume from."""
    report = progress or (lambda r: None)
    started = time.perf_counter()

    def tell(step: int, steps: int, stage: str, loss: float = 0.0) -> None:
        report(StepReport(step, steps, loss, time.perf_counter() - started, stage))

    layers = list(lm.global_layers)
    prompts = collect(lm, training, corpus, inv_freq, layers, lambda n: tell(n, training.prompts, "reading prompts"))
    state = dict(state or {})
    centroids: dict[int, torch.Tensor] = {}
    labels: dict[int, list[torch.Tensor]] = {}  # layer -> per prompt [Hkv, L]: each key's bucket
    for n, i in enumerate(layers):
        name = f"layer{i}.centroids"
        if name not in state:
            tell(n, len(layers), "clustering keys")
            keys = torch.cat([p.keys_pre[:, 1:] for p in prompts[i]], dim=1)  # each prompt's sink left out
            found = spherical_kmeans(keys, training.buckets, iters=training.kmeans_iters, seed=training.seed)
            del keys
            state[name] = F.normalize(found.centroids, dim=-1).float().cpu()
            if save is not None:
                save(state)
        centroids[i] = state[name]
        labels[i] = [bucket_labels(p.keys_pre, centroids[i]) for p in prompts[i]]
    window = recent_window(training.tokens)
    examples = []
    for n, i in enumerate(layers):
        tell(n, len(layers), "bucket targets")
        examples.append(bucket_targets(prompts[i], labels[i], training.buckets, scale[i], window,
                                       sizes=training.size_prior))
    del prompts
    x = torch.cat([e[0] for e in examples])  # [U, E, D], U = layers x Hkv
    t = torch.cat([e[1] for e in examples])  # [U, E, C]
    usable = torch.cat([e[2] for e in examples]) if training.long_range else None  # [U, E]
    prior = torch.cat([e[3] for e in examples]) if training.size_prior else None  # [U, E, C]
    weights = train_classifiers(x, t, training, state, save, lambda step, loss: tell(
        step, training.steps, "training the classifier", loss), usable=usable, prior=prior)
    hkv = x.shape[0] // len(layers)
    return {i: {"centroids": centroids[i], **{n: w[k * hkv:(k + 1) * hkv].clone() for n, w in weights.items()},
                "sizes": bucket_sizes(labels[i], training.buckets)} for k, i in enumerate(layers)}


def bucket_labels(keys_pre: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """keys_pre [Hkv, L, D] de-RoPE'd -> [Hkv, L] int64: each key's bucket, its most similar centroid (the
    assignment an ingest makes: engine.methods.saap.policy), through the kernel backend of the keys' device."""
    found, _ = backend_for(keys_pre.device).kernel("assign").nearest_centroid(
        keys_pre, centroids.to(device=keys_pre.device, dtype=keys_pre.dtype))
    return found


def bucket_sizes(labels: list[torch.Tensor], buckets: int) -> torch.Tensor:
    """Per prompt labels [Hkv, L] -> [Hkv, C] int64 on the CPU: the training keys in each bucket, each prompt's
    sink (its first token) left out as in the k-means."""
    sizes = torch.zeros(labels[0].shape[0], buckets, dtype=torch.int64, device=labels[0].device)
    for found in labels:
        sizes.scatter_add_(1, found[:, 1:], torch.ones_like(found[:, 1:]))
    return sizes.cpu()


def collect(lm, training: PartitionTraining, corpus: list[int], inv_freq: dict[int, torch.Tensor],
            layers: list[int], progress: Callable[[int], None] = lambda n: None) -> dict[int, list[Prompt]]:
    """Each prompt through the model (the engine's prefill, full attention): every global layer's keys and the
    queries of `training.queries` positions drawn among those with long-range keys (at least recent_window(tokens)
    tokens before them), kept in the model's dtype on its device."""
    need = training.prompts * training.tokens
    if len(corpus) < need:
        raise ValueError(f"the corpus holds {len(corpus)} tokens; {training.prompts} prompts of {training.tokens} "
                         f"need {need}")
    window = recent_window(training.tokens)
    out: dict[int, list[Prompt]] = {i: [] for i in layers}
    gen = torch.Generator().manual_seed(training.seed)
    for n in range(training.prompts):
        progress(n)
        ids = torch.tensor(corpus[n * training.tokens:(n + 1) * training.tokens])
        cache, capture = prefill(lm, ids, training.tokens, backend_for(lm.device))
        eligible = torch.arange(2 * window, training.tokens)
        pick = eligible[torch.randperm(eligible.numel(), generator=gen)[: training.queries]].sort().values
        for i in layers:
            k = cache.layers[i].fixed_keys  # [Hkv, L, D] in token order (a prefill has no sink rows)
            q = torch.cat(capture.queries[i], dim=1)[:, pick.to(k.device)]  # [Hq, E, D]
            pos = pick.to(k.device)
            out[i].append(Prompt(keys=k.clone(), keys_pre=derope(k, torch.arange(k.shape[1], device=k.device),
                                                                  inv_freq[i]).to(k.dtype),
                                 queries=q.clone(), queries_pre=derope(q, pos, inv_freq[i]).to(q.dtype), pos=pos))
        del cache, capture
    progress(training.prompts)
    return out


def bucket_targets(prompts: list[Prompt], labels: list[torch.Tensor], c: int, scale: float, window: int,
                   sizes: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x [Hkv, E', D] unit de-RoPE'd queries, targets [Hkv, E', C], far [Hkv, E'] bool, log_sizes [Hkv, E', C])
    over the prompts, E' = prompts x G x E: each sampled query of each query head, the share of its attention over
    the long-range keys (at least `window` tokens before it, the sink excluded; the model's softmax renormalised
    over them) in each of the `c` buckets, whether its best-matching key (over all keys before it, the sink
    excluded) is one of them, and the log of each bucket's long-range keys (log_counts: EMPTY where none; None
    unless `sizes`: only the size prior needs them, as much memory as the targets); labels: per prompt, each key's
    bucket [Hkv, L] (bucket_labels)."""
    hkv = prompts[0].keys.shape[0]
    xs: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    ts: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    fs: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    ns: list[list[torch.Tensor]] = [[] for _ in range(hkv)]
    for p, found in zip(prompts, labels):
        key_pos = torch.arange(p.keys.shape[1], device=p.keys.device)
        far = (key_pos[None, :] <= p.pos[:, None] - window) & (key_pos[None, :] >= 1)  # [E, L]
        before = (key_pos[None, :] <= p.pos[:, None]) & (key_pos[None, :] >= 1)
        group = p.queries.shape[0] // hkv
        for h in range(hkv):
            q = p.queries[h * group:(h + 1) * group].float()  # [G, E, D]
            logits = torch.einsum("ged,ld->gel", q, p.keys[h].float()) * scale
            weights = torch.softmax(logits.masked_fill(~far[None], float("-inf")), dim=-1)
            target = torch.zeros(group, q.shape[1], c, device=q.device)
            target.scatter_add_(2, found[h][None, None, :].expand_as(weights), weights)
            xs[h].append(F.normalize(p.queries_pre[h * group:(h + 1) * group].float(), dim=-1).flatten(0, 1))
            ts[h].append(target.flatten(0, 1))
            best = logits.masked_fill(~before[None], float("-inf")).argmax(-1)  # [G, E]
            fs[h].append((best <= p.pos[None, :] - window).flatten())
            if sizes:
                counts = torch.zeros(q.shape[1], c, device=q.device).scatter_add_(
                    1, found[h][None, :].expand(q.shape[1], -1), far.float())  # [E, C]
                ns[h].append(log_counts(counts)[None].expand(group, -1, -1).flatten(0, 1))
    return (torch.stack([torch.cat(x) for x in xs]), torch.stack([torch.cat(t) for t in ts]),
            torch.stack([torch.cat(f) for f in fs]), torch.stack([torch.cat(n) for n in ns]) if sizes else None)


EMPTY = -1e4  # log_counts of an empty bucket: exp() of it is 0 in float32, and no product with it is NaN


def log_counts(sizes: torch.Tensor) -> torch.Tensor:
    """Keys per bucket (any shape, any dtype) -> float32 log of them, EMPTY where a bucket holds none: what a
    size-prior classifier adds to its logits (PartitionTraining.size_prior)."""
    sizes = sizes.float()
    return torch.where(sizes > 0, torch.log(sizes.clamp(min=1)), torch.full_like(sizes, EMPTY))


def imbalance(sizes: torch.Tensor) -> float:
    """sizes [..., C] keys per bucket -> the mean over heads of C x sum(n_c^2) / N^2: the keys a query reads
    from a bucket picked in proportion to its size, over those of perfectly even buckets (1: balanced; the
    paper's load-balance concern: a step waits for its largest buckets)."""
    s = sizes.reshape(-1, sizes.shape[-1]).double()
    n = s.sum(-1).clamp_min(1)
    return float((s.shape[-1] * (s ** 2).sum(-1) / n ** 2).mean())


def kl_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over examples of KL(targets || softmax(logits)) (equation 1)."""
    log_p = torch.log_softmax(logits, dim=-1)
    return (torch.xlogy(targets, targets) - targets * log_p).sum(-1).mean()


def init_weights(units: int, dim: int, hidden: int, buckets: int, seed: int, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w1": (torch.randn(units, dim, hidden, generator=gen) / math.sqrt(dim)).to(device),
            "b1": torch.zeros(units, hidden, device=device),
            "w2": (torch.randn(units, hidden, buckets, generator=gen) / math.sqrt(hidden)).to(device),
            "b2": torch.zeros(units, buckets, device=device)}


def train_classifiers(x: torch.Tensor, targets: torch.Tensor, training: PartitionTraining,
                      state: dict[str, torch.Tensor], save, progress: Callable[[int, float], None],
                      usable: torch.Tensor | None = None, prior: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Every unit's classifier at once (batched matrix products): x [U, E, D], targets [U, E, C] -> PARAMS
    [U, ...] float32 on the CPU. `state` holds a stopped run's weights and Adam moments ("classifier.*").
    usable [U, E] bool: each unit's batches drawn among its usable examples only (a unit with none uses all).
    prior [U, E, C]: added to the logits before the softmax (the size prior: log_counts of each example's
    buckets)."""
    units, examples, dim = x.shape
    if usable is not None:
        usable = usable.to(x.device).clone()
        usable[usable.sum(1) == 0] = True
        examples = int(usable.sum(1).min())
        draw_from = usable.float().cpu()  # [U, E]: each unit's batches are drawn among these (once, not per step)
    device = x.device
    if "classifier.step" in state:
        weights = {n: state[f"classifier.{n}"].to(device) for n in PARAMS}
        first = int(state["classifier.step"])
    else:
        weights = init_weights(units, dim, training.hidden, targets.shape[-1], training.seed, device)
        first = 0
    params = [weights[n].requires_grad_(True) for n in PARAMS]
    optimizer = torch.optim.Adam(params, lr=training.lr)
    if first:
        for n, param in zip(PARAMS, params):
            optimizer.state[param] = {"step": state["classifier.adam_step"].clone(),
                                      "exp_avg": state[f"classifier.exp_avg.{n}"].to(device),
                                      "exp_avg_sq": state[f"classifier.exp_avg_sq.{n}"].to(device)}
    batch = min(training.batch, examples)
    for step in range(first, training.steps):
        gen = torch.Generator().manual_seed(training.seed * 1_000_003 + step)
        if usable is None:
            pick = torch.randperm(examples, generator=gen)[:batch].to(device)
            xb, tb = x[:, pick], targets[:, pick]
            pb = None if prior is None else prior[:, pick]
        else:  # [U, batch]: each unit's own draw
            pick = torch.multinomial(draw_from, batch, generator=gen).to(device)
            xb = x.gather(1, pick[..., None].expand(-1, -1, x.shape[-1]))
            tb = targets.gather(1, pick[..., None].expand(-1, -1, targets.shape[-1]))
            pb = None if prior is None else prior.gather(1, pick[..., None].expand(-1, -1, prior.shape[-1]))
        logits = classify(xb, weights)
        loss = kl_loss(logits if pb is None else logits + pb, tb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done = step + 1
        progress(done, float(loss.detach()))
        if save is not None and (done % training.checkpoint_every == 0 or done == training.steps):
            state.update({f"classifier.{n}": weights[n].detach().cpu().clone() for n in PARAMS})
            for n, param in zip(PARAMS, params):
                state[f"classifier.exp_avg.{n}"] = optimizer.state[param]["exp_avg"].cpu().clone()
                state[f"classifier.exp_avg_sq.{n}"] = optimizer.state[param]["exp_avg_sq"].cpu().clone()
            state["classifier.adam_step"] = optimizer.state[params[0]]["step"].cpu().clone()
            state["classifier.step"] = torch.tensor(done)
            save(state)
    return {n: weights[n].detach().float().cpu() for n in PARAMS}
