"""Saap: RoPE undone, the partitions' training (buckets, targets, the classifier, resuming), the index and the lookup
against plain references, and the method through the engine and the CLI on a tiny Llama (RoPE, GQA 4/2)."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engine.attention.budget import byte_share
from engine.attention.method import LayerIndex, LayerKeys
from engine.index.rope import derope, rope_frequencies
from engine.methods.saap.partitions import (
    EMPTY,
    PartitionTraining,
    Prompt,
    bucket_labels,
    bucket_targets,
    classify,
    init_weights,
    kl_loss,
    recent_window,
    train_partitions,
)
from engine.methods.saap.policy import LOOKUP_PARTS, LookupParts, SaapPolicy, SaapSettings, room_keys, split_buckets
from kernels.backend import REFERENCE, TRITON
from kernels.reference.buckets import bucket_scores, ranking, take_best
from kernels.selection import FollowRows
from tests.support.tiny_models import QUICK_TRAINING, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# The tiny model's training: 2 prompts of 256 byte-tokens, 8 buckets, a few Adam steps.
SMALL = {"buckets": 8, "hidden": 16, **QUICK_TRAINING["saap"]}
TEXT = "The keeper logged the weather every four hours, rang the bell at dawn and wrote to the harbour master. "


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from engine.model.load import load_model

    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("saap"), "llama_gqa")), device="cpu")


def _corpus(lm) -> list[int]:
    return lm.tokenizer(TEXT * 12, add_special_tokens=False)["input_ids"]


def test_derope_undoes_the_models_rotary_embedding(tiny_llama):
    """derope(RoPE(x, p), p) == x with the frequencies read from the model's rotary module (its inv_freq buffer,
    or measured from its output: the same); atol 1e-3 at positions ~1000: the model's own float32 angles are off by
    up to position x 6e-8 radians."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = tiny_llama
    inv_freq = rope_frequencies(lm.model, None, lm.head_dim)
    rotary = lm.model.model.rotary_emb
    torch.testing.assert_close(inv_freq, rotary.inv_freq.float(), rtol=0, atol=0)
    measured = rope_frequencies(torch.nn.ModuleDict({"rotary_emb": _Measured(rotary)}), None, lm.head_dim)
    torch.testing.assert_close(measured, inv_freq, rtol=1e-5, atol=1e-6)
    x = torch.randn(1, 2, 50, lm.head_dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(1000, 1050)
    cos, sin = rotary(x, positions[None])
    rotated, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(derope(rotated[0], positions, inv_freq), x[0], rtol=0, atol=1e-3)


class _Measured(torch.nn.Module):
    """A rotary module without an inv_freq buffer (only its output tells the frequencies)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = [inner]

    def forward(self, x, position_ids):
        return self.inner[0](x, position_ids)


def test_derope_of_a_gemma_global_layer_uses_its_own_frequencies(tmp_path):
    """Gemma 3's global layers have their own RoPE base: rope_frequencies reads the layer type's."""
    from engine.model.load import load_model

    lm = load_model(str(make_tiny_model(tmp_path, "gemma3_hybrid")), device="cpu")
    rotary = lm.model.model.rotary_emb
    layer = lm.global_layers[0]
    kind = lm.config.layer_types[layer]
    got = rope_frequencies(lm.model, kind, lm.head_dim)
    torch.testing.assert_close(got, getattr(rotary, f"{kind}_inv_freq").float(), rtol=1e-5, atol=1e-6)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel runs compiled on a GPU, interpreted otherwise


@pytest.mark.parametrize("c", [20, 256])  # 256: the default buckets (1024 took 38 s in the interpreter)
def test_take_best_equals_a_sorted_loop_and_the_kernel_equals_it(c):
    """Buckets best first while the keys before them are fewer than the budget (ties broken by keeping every
    bucket tied at the last one), by a plain loop; the Triton kernel (compiled or interpreted) gives the same."""
    g = torch.Generator().manual_seed(c)
    score = torch.rand(3, c, generator=g)
    score[0, 5:9] = score[0, 4]  # ties
    score[2] -= 0.5  # negative scores and zeros of both signs order as floats do
    score[2, :3] = torch.tensor([0.0, -0.0, 0.0])
    sizes = torch.randint(0, 9, (3, c), generator=g)
    total = int(sizes.sum(-1).max())
    for budget in (0.0, 5.0, 17.0, total / 3, total + 1.0):
        want = torch.zeros(3, c, dtype=torch.bool)
        for h in range(3):
            taken, tau = 0, None
            for i in sorted(range(c), key=lambda i: -float(score[h, i])):
                if tau is not None and float(score[h, i]) < tau:
                    break
                want[h, i] = True
                taken += int(sizes[h, i])
                if taken >= max(budget, 1e-9) and tau is None:
                    tau = float(score[h, i])
        assert torch.equal(take_best(score, sizes, max(budget, 1e-9)), want), budget
        got = TRITON.kernel("buckets").take_best(score.to(DEVICE), sizes.to(DEVICE), max(budget, 1e-9))
        assert torch.equal(got.cpu(), want), budget


def test_bucket_scores_equal_each_heads_classifier_summed():
    """[Hkv, C]: each query head's softmax over its KV head's buckets, summed over the group, mean over tokens."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, c, lq = 4, 2, 16, 8, 3
    tensors = {**init_weights(hkv, d, 12, c, 3, "cpu"), "inv_freq": 10000.0 ** (-torch.arange(0, d, 2) / d)}
    q = torch.randn(hq, lq, d, generator=g)
    pos = torch.tensor([700, 701, 702])
    got = bucket_scores(q, pos, *(tensors[n] for n in LOOKUP_PARTS))
    want = torch.zeros(hkv, c)
    for h in range(hq):
        kv = h // (hq // hkv)
        for t in range(lq):
            x = F.normalize(derope(q[h, t:t + 1], pos[t:t + 1], tensors["inv_freq"]), dim=-1)
            one = {n: tensors[n][kv:kv + 1] for n in ("w1", "b1", "w2", "b2")}
            want[kv] += torch.softmax(classify(x[None], one)[0, 0], dim=-1) / lq
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hq,hkv,d,hidden,c,lq", [(4, 2, 16, 12, 8, 1), (4, 2, 16, 12, 8, 9), (8, 2, 32, 20, 300, 2), (2, 1, 32, 20, 200, 40)]
                         + ([(32, 8, 128, 128, 1024, 1), (32, 8, 128, 128, 1024, 1024)] if DEVICE == "cuda" else []))
def test_bucket_scores_kernel_equals_the_reference(hq, hkv, d, hidden, c, lq):
    """The Triton kernels (compiled, or interpreted on the CPU) against the reference, decode and prefill (the
    reference's scores, the kernel's pick), padded head and hidden sizes, buckets over several programs, at positions
    of a 128K context (the angles reduced in float64) and on a strided query slice as the engine passes it.
    Tolerance 2e-5 relative to the scores' sum; the pick equals the reference's pick of the same scores."""
    g = torch.Generator().manual_seed(hq + d + lq)
    weights = init_weights(hkv, d, hidden, c, 5, "cpu")
    weights = {n: w + 0.1 * torch.randn(w.shape, generator=g) for n, w in weights.items()}  # biases not zero
    inv_freq = 500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    q = torch.randn(hq, lq + 2, d, generator=g)[:, 1:-1]  # not contiguous
    pos = torch.arange(131_000, 131_000 + lq)
    args = (inv_freq, weights["w1"], weights["b1"], weights["w2"], weights["b2"])
    want = bucket_scores(q, pos, *args)
    got = TRITON.kernel("buckets").bucket_scores(*(t.to(DEVICE) for t in (q, pos, *args))).cpu()
    assert got.shape == (hkv, c)
    torch.testing.assert_close(got.sum(-1), torch.full((hkv,), float(hq // hkv)), rtol=0, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5 * (hq // hkv))
    sizes = torch.randint(0, 50, (hkv, c), generator=g)
    for budget, per_key in itertools.product((0.2 * float(sizes.sum(-1).min()), float("inf")), (False, True)):
        # (inf: every bucket, a layer read whole)
        score, keep = TRITON.kernel("buckets").best_buckets(*(t.to(DEVICE) for t in (q, pos, *args, sizes)), budget,
                                                            per_key=per_key)
        torch.testing.assert_close(score.cpu(), want, rtol=0, atol=2e-5 * (hq // hkv))
        # the pick of its own scores (per key: of the same division, in float32 alike)
        assert torch.equal(keep.cpu(), take_best(ranking(score.cpu(), sizes, per_key), sizes, budget)), budget


@pytest.mark.parametrize("c,low,high", [(300, 0, 50), (40, 64, 140), (8, 0, 50)])
@pytest.mark.parametrize("lq", [1, 9])
def test_selected_buckets_expand_as_the_reference(c, low, high, lq):
    """select_buckets: the pick and the expansion of the kept buckets into positions (then the tail), against the
    reference's best_buckets and expand_groups. In a decode step the pick kernel sums the kept positions per block of
    buckets (clusters' tiles: 300 buckets of ~25 keys; large buckets' tiles: 40 of ~100); a prefill (or buckets fewer
    than a block) takes the standalone expansion."""
    from kernels.reference.buckets import select_buckets
    from kernels.reference.compact import expand_groups

    hq, hkv, d, hidden = 4, 2, 16, 12
    g = torch.Generator().manual_seed(c + lq)
    weights = {n: w + 0.1 * torch.randn(w.shape, generator=g) for n, w in init_weights(hkv, d, hidden, c, 5,
                                                                                         "cpu").items()}
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    q, pos = torch.randn(hq, lq, d, generator=g), torch.arange(5000, 5000 + lq)
    base = torch.randint(low, high, (c,), generator=g)
    sizes = torch.stack([base[torch.randperm(c, generator=g)] for _ in range(hkv)])  # the same keys in each head
    starts = torch.cat([torch.zeros(hkv, 1, dtype=torch.int64), sizes.cumsum(1)], dim=1)
    total, tail = int(base.sum()), 7
    args = (q, pos, inv_freq, weights["w1"], weights["b1"], weights["w2"], weights["b2"], sizes)
    budget = 0.3 * total
    want_score, want_keep, want = select_buckets(*args, budget, starts, total, tail)
    on = [t.to(DEVICE) for t in args]
    score, keep, got = TRITON.kernel("buckets").select_buckets(*on, budget, starts.to(DEVICE), total, tail)
    torch.testing.assert_close(score.cpu(), want_score, rtol=0, atol=2e-5 * (hq // hkv))
    assert torch.equal(keep.cpu(), take_best(ranking(score.cpu(), sizes, False), sizes, budget))
    mask = got.to_mask().cpu()  # the kernel's positions are the reference expansion of the kernel's own pick
    assert torch.equal(mask, expand_groups(keep.cpu(), starts, total, tail).to_mask())
    assert torch.equal(got.indptr.cpu(), expand_groups(keep.cpu(), starts, total, tail).indptr)
    if torch.equal(keep.cpu(), want_keep):
        assert torch.equal(mask, want.to_mask())


@pytest.mark.parametrize("lq,pad", [(1, 5), (6, 10)])
def test_bucket_scores_of_a_padded_question_count_its_real_tokens(lq, pad):
    """With `valid`, the bucket scores (reference and wrapper) of a question padded after its real tokens equal its
    real tokens' alone; the padding would move them."""
    g = torch.Generator().manual_seed(lq)
    hq, hkv, d, hidden, c = 4, 2, 16, 12, 8
    weights = {n: w + 0.1 * torch.randn(w.shape, generator=g) for n, w in init_weights(hkv, d, hidden, c, 5, "cpu").items()}
    args = (500000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d), weights["w1"], weights["b1"], weights["w2"],
            weights["b2"])
    q = torch.randn(hq, lq + pad, d, generator=g)
    pos = torch.arange(1000, 1000 + lq + pad)
    valid = torch.tensor([lq])
    want = bucket_scores(q[:, :lq], pos[:lq], *args)
    assert not torch.allclose(bucket_scores(q, pos, *args), want)
    torch.testing.assert_close(bucket_scores(q, pos, *args, valid), want)
    got = TRITON.kernel("buckets").bucket_scores(*(t.to(DEVICE) for t in (q, pos, *args)), valid=valid.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=2e-5 * (hq // hkv))


def test_ranking_per_key_takes_the_most_score_for_the_keys():
    """A big bucket with the most score and small ones with less: by mass the big one is taken first and fills a
    small budget; per key the small ones that score more for each key they cost are, and the big one only when the
    budget reaches it."""
    score = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]])
    sizes = torch.tensor([[100, 10, 10, 50, 0]])
    by_mass = take_best(ranking(score, sizes, False), sizes, 20.0)
    by_key = take_best(ranking(score, sizes, True), sizes, 20.0)
    assert by_mass.tolist() == [[True, False, False, False, False]]
    assert by_key.tolist() == [[False, True, True, False, False]]
    assert take_best(ranking(score, sizes, True), sizes, 100.0).tolist() == [[True, True, True, False, False]]
    torch.testing.assert_close(ranking(score, sizes, True), torch.tensor([[0.005, 0.03, 0.015, 0.001, 0.0]]))


def test_targets_are_the_long_range_attention_per_bucket():
    """bucket_targets: each row is a distribution over the buckets (sums to 1) equal to the softmax over the keys
    at least `window` tokens back (sink excluded), summed per bucket; an example is a long-range query where its
    best-matching key is one of those; log_sizes: the log of each bucket's keys among those (EMPTY where none), None
    when not asked for."""
    g = torch.Generator().manual_seed(4)
    hkv, hq, length, d, c, window = 1, 2, 40, 8, 4, 6
    keys = torch.randn(hkv, length, d, generator=g)
    queries = torch.randn(hq, 3, d, generator=g)
    pos = torch.tensor([15, 30, 39])
    centroids = F.normalize(torch.randn(hkv, c, d, generator=g), dim=-1)
    prompt = Prompt(keys=keys, keys_pre=keys, queries=queries, queries_pre=queries, pos=pos)
    x, t, usable, log_sizes = bucket_targets([prompt], [bucket_labels(keys, centroids)], c, 0.5, window)
    assert x.shape == (hkv, hq * 3, d) and t.shape == (hkv, hq * 3, c) and usable.shape == (hkv, hq * 3)
    assert log_sizes.shape == t.shape
    torch.testing.assert_close(t.sum(-1), torch.ones(hkv, hq * 3))
    labels = (keys[0] @ centroids[0].T).argmax(-1)
    for qh in range(hq):
        for e, p in enumerate(pos.tolist()):
            far = torch.zeros(length, dtype=torch.bool)
            far[1:p - window + 1] = True
            w = torch.softmax((queries[qh, e] @ keys[0].T * 0.5).masked_fill(~far, float("-inf")), dim=-1)
            want = torch.zeros(c).index_add_(0, labels, w)
            torch.testing.assert_close(t[0, qh * 3 + e], want, rtol=1e-5, atol=1e-6)
            sizes = torch.zeros(c).index_add_(0, labels, far.float())
            want_log = torch.where(sizes > 0, sizes.clamp(min=1).log(), torch.full_like(sizes, EMPTY))
            torch.testing.assert_close(log_sizes[0, qh * 3 + e], want_log)
            best = int((queries[qh, e] @ keys[0, 1:p + 1].T).argmax()) + 1  # the best key before it, sink aside
            assert bool(usable[0, qh * 3 + e]) == (best <= p - window)
    same = bucket_targets([prompt], [bucket_labels(keys, centroids)], c, 0.5, window, sizes=False)
    assert same[3] is None  # without the size prior: no log sizes, the rest the same
    for a, b in zip(same[:3], (x, t, usable)):
        torch.testing.assert_close(a, b)


def test_long_range_training_draws_only_usable_examples():
    """train_classifiers with `usable`: each unit learns its usable examples' targets (bucket 0) and never sees the
    others' (bucket 1); a unit with no usable example trains on all of them."""
    from engine.methods.saap.partitions import train_classifiers

    g = torch.Generator().manual_seed(8)
    units, examples, d, c = 2, 64, 8, 4
    x = F.normalize(torch.randn(units, examples, d, generator=g), dim=-1)
    usable = torch.zeros(units, examples, dtype=torch.bool)
    usable[0, ::2] = True  # unit 1: none usable
    targets = torch.zeros(units, examples, c)
    targets[..., 0] = usable.float()
    targets[..., 1] = 1 - usable.float()
    training = PartitionTraining(buckets=c, hidden=8, steps=150, batch=16, lr=0.05, tokens=256)
    weights = train_classifiers(x, targets, training, {}, None, lambda step, loss: None, usable=usable)
    probs = torch.softmax(classify(x, weights), dim=-1)
    assert float(probs[0, :, 0].min()) > 0.9  # unit 0 learnt bucket 0 everywhere: it never drew a bucket-1 example
    assert float(probs[1, :, 1].min()) > 0.9  # unit 1 (nothing usable) trained on all its examples


def test_a_size_prior_classifier_learns_the_weight_per_key():
    """Targets that are one density over the buckets (softmax of `a`) times each example's bucket sizes, the same
    query for every example: with the sizes as a prior (log_counts added before the softmax) the classifier fits
    them all, its logits' softmax the density within 0.02; without, one output cannot fit sizes that differ."""
    from engine.methods.saap.partitions import log_counts, train_classifiers

    g = torch.Generator().manual_seed(9)
    units, examples, d, c = 1, 128, 8, 5
    x = F.normalize(torch.randn(d, generator=g), dim=0).expand(units, examples, d).contiguous()
    a = torch.tensor([2.0, 0.0, -1.0, 1.0, 0.5])
    sizes = torch.randint(0, 40, (units, examples, c), generator=g)
    sizes[..., 0] = sizes[..., 0].clamp(min=1)  # every example holds some keys
    prior = log_counts(sizes)
    targets = torch.softmax(a + prior, dim=-1)
    training = PartitionTraining(buckets=c, hidden=8, steps=400, batch=32, lr=0.02, tokens=256, size_prior=True)
    weights = train_classifiers(x, targets, training, {}, None, lambda step, loss: None, prior=prior)
    logits = classify(x, weights)
    torch.testing.assert_close(torch.softmax(logits[0, 0], -1), torch.softmax(a, -1), atol=0.02, rtol=0)
    fitted = float(kl_loss(logits + prior, targets))
    plain = train_classifiers(x, targets, training, {}, None, lambda step, loss: None)
    assert fitted < 0.01 < float(kl_loss(classify(x, plain), targets))


@pytest.mark.parametrize("long_range", [False, True])
def test_training_learns_and_resumes_where_it_stopped(tiny_llama, long_range):
    """The classifier's KL falls over the steps; a run resumed from its checkpoint at step 4 ends bit for bit where
    the whole run does; every artifact has its shape. Also with batches of long-range queries only."""
    lm = tiny_llama
    training = SaapSettings(**SMALL, train_long_range=long_range).training()
    layers = list(lm.global_layers)
    inv_freq = {i: rope_frequencies(lm.model, None, lm.head_dim) for i in layers}
    scale = {i: lm.head_dim ** -0.5 for i in layers}
    saved, losses = [], []
    whole = train_partitions(lm, PartitionTraining(**{**training.__dict__, "checkpoint_every": 2}), _corpus(lm),
                             inv_freq, scale, save=lambda s: saved.append(dict(s)),
                             progress=lambda r: losses.append(r.loss) if r.stage.startswith("training") else None)
    assert len(losses) == training.steps and losses[-1] < losses[0]
    resumed = train_partitions(lm, training, _corpus(lm), inv_freq, scale,
                               state=next(s for s in saved if int(s.get("classifier.step", 0)) == 4))
    hkv, d, c, h = lm.num_kv_heads, lm.head_dim, training.buckets, training.hidden
    for i in layers:
        assert whole[i]["centroids"].shape == (hkv, c, d) and whole[i]["w1"].shape == (hkv, d, h)
        assert whole[i]["w2"].shape == (hkv, h, c)
        torch.testing.assert_close(whole[i]["centroids"].norm(dim=-1), torch.ones(hkv, c))
        for name, t in whole[i].items():
            assert torch.equal(resumed[i][name], t), name


def test_kl_loss_is_zero_at_the_target():
    t = torch.softmax(torch.randn(2, 5, 7), dim=-1)
    assert float(kl_loss(torch.log(t), t)) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(torch.zeros(2, 5, 7), t)) > 0


def test_build_assigns_de_roped_keys_and_keeps_the_dense_part():
    """labels: the nearest centroid of each de-RoPE'd key; the context's first token and its last W indexed tokens
    are group C (read at every step); layer 0 is read whole."""
    g = torch.Generator().manual_seed(5)
    hkv, d, lc, tail = 2, 16, 300, 10
    method = SaapPolicy(SaapSettings(buckets=8, hidden=4, max_bucket=0))  # (no chunks: split_buckets' test)
    prepared = {k.split(".", 1)[1]: v for k, v in method.stand_in([0], hkv, d).items()}
    keys = torch.randn(hkv, lc, d, generator=g)
    index = method.build(LayerKeys(layer_idx=3, keys=keys, tail=tail), {}, prepared)
    pre = derope(keys, torch.arange(lc), prepared["inv_freq"])
    want = torch.einsum("hld,hcd->hlc", pre, prepared["centroids"]).argmax(-1)
    w = recent_window(lc + tail)
    want[:, lc - w:] = 8
    want[:, 0] = 8
    assert torch.equal(index["labels"], want)
    assert index["counts"].shape == (hkv, 9) and int(index["counts"][0, 8]) == w + 1 and not bool(index["dense"])
    shifted = method.build(LayerKeys(layer_idx=0, keys=keys, tail=tail, first=4), {}, prepared)
    assert int(shifted["counts"][0, 8]) == w and bool(shifted["dense"])  # a sink's rows are dense rows already


def test_lookup_reads_the_best_buckets_and_the_dense_part():
    hkv, hq, d, lc, tail = 2, 4, 16, 400, 8
    g = torch.Generator().manual_seed(6)
    method = SaapPolicy(SaapSettings(buckets=16, hidden=8, rank="mass", size_prior=False))  # the paper's
    prepared = {k.split(".", 1)[1]: v for k, v in method.stand_in([2], hkv, d).items()}
    keys = torch.randn(hkv, lc + tail, d, generator=g)
    built = method.build(LayerKeys(layer_idx=2, keys=keys[:, :lc], tail=tail), {}, prepared)
    layer = LayerIndex(built, lc + tail, tail)  # the index holds what the lookup reads
    q = torch.randn(hq, 1, d, generator=g)
    pos = torch.tensor([lc + tail + 3])
    plan = method.plan_keys({}, 0.3, 0.3, 0.3)
    found = method.lookup(q, layer, plan, d ** -0.5, REFERENCE, pos)
    score = bucket_scores(q, pos, *(layer[n] for n in LOOKUP_PARTS))
    keep = take_best(score, built["counts"][:, :16], 0.3 * lc)  # the reference
    assert torch.equal(found.units, keep)  # the buckets (the dense part is read with the tail)
    mask = found.selection.to_mask()
    layout = method.layout(layer)
    for h in range(hkv):
        kept_keys = torch.isin(built["labels"][h], torch.nonzero(found.units[h])[:, 0]) | (built["labels"][h] == 16)
        want = torch.zeros(lc + tail, dtype=torch.bool)
        want[:lc] = kept_keys
        want[lc:] = True
        assert torch.equal(mask[h], want[layout.order[h]])
    with pytest.raises(ValueError, match="positions"):
        method.lookup(q, layer, plan, d ** -0.5, REFERENCE)
    per_key = SaapPolicy(SaapSettings(buckets=16, hidden=8, size_prior=False))
    found = per_key.lookup(q, layer, plan, d ** -0.5, REFERENCE, pos)
    sizes = built["counts"][:, :16]
    assert torch.equal(found.units, take_best(score / sizes.clamp(min=1), sizes, 0.3 * lc))
    assert per_key.prepare_key() == method.prepare_key()  # the same trained partitions
    # with the size prior the index's b2 holds the document's log sizes: the scores are softmax(logits + log n)
    prior = SaapPolicy(SaapSettings(buckets=16, hidden=8, max_bucket=0))  # the default but for chunks (below)
    assert prior.prepare_key() != method.prepare_key()  # partitions of their own
    with_prior = LayerIndex(prior.build(LayerKeys(layer_idx=2, keys=keys[:, :lc], tail=tail), {}, prepared),
                            lc + tail, tail)
    torch.testing.assert_close(with_prior["b2"], prepared["b2"] + torch.where(
        sizes > 0, sizes.clamp(min=1).float().log(), torch.full(sizes.shape, EMPTY)))
    x = F.normalize(derope(q, pos, prepared["inv_freq"]), dim=-1).reshape(hkv, hq // hkv, d)
    logits = classify(x, {n: prepared[n] for n in ("w1", "b1", "w2", "b2")})  # [Hkv, G, C]
    want = torch.softmax(logits + with_prior["b2"][:, None] - prepared["b2"][:, None], dim=-1).sum(1)
    found = prior.lookup(q, with_prior, plan, d ** -0.5, REFERENCE, pos)
    torch.testing.assert_close(found.scores, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(found.units, take_best(want / sizes.clamp(min=1), sizes, 0.3 * lc))
    with pytest.raises(ValueError, match="rank"):
        SaapSettings(rank="size")


def test_a_cpu_step_counts_its_follow_rows_and_reads_its_budget():
    """On the CPU a plan with room (Method.plan gives it one) takes out of the budget what the step reads besides its
    buckets: the classifier, the dense part and tail, its follow rows (each indexed one per KV head); the buckets
    then hold the keys left (room_keys, half a mean bucket less), and the step reads the budget within a bucket."""
    hkv, hq, d, lc, tail, c = 2, 4, 16, 2000, 8, 32
    g = torch.Generator().manual_seed(7)
    method = SaapPolicy(SaapSettings(buckets=c, hidden=8, max_bucket=0))
    prepared = {k.split(".", 1)[1]: v for k, v in method.stand_in([2], hkv, d).items()}
    keys = torch.randn(hkv, lc + tail, d, generator=g)
    layer = LayerIndex(method.build(LayerKeys(layer_idx=2, keys=keys[:, :lc], tail=tail), {}, prepared), lc + tail,
                       tail)
    q = torch.randn(hq, 1, d, generator=g)
    pos = torch.tensor([lc + tail + 3])
    budget = 0.3
    plan = replace(method.plan_keys({}, budget, 0.3, 0.3), room=(budget - 0.02, budget - 0.05))
    follow = FollowRows(positions=torch.tensor([5, 6, 7, 900, -1, lc + 2]), first=0, indexed=lc)
    found = method.lookup(q, layer, plan, d ** -0.5, REFERENCE, pos, follow=follow)
    parts = LookupParts.of(layer, q.device)
    left = room_keys(layer, parts, d, budget, 4 * hkv)  # 4 indexed follow rows per KV head
    sizes = parts.sizes
    score = bucket_scores(q, pos, *(layer[n] for n in LOOKUP_PARTS))
    assert torch.equal(found.units, take_best(score / sizes.clamp(min=1), sizes, left))  # per key, the default
    held = (sizes * found.units).sum(1).float()  # [Hkv] the buckets' keys each head reads
    assert bool((held >= left).all()) and bool((held < left + sizes.max()).all())
    read = byte_share(float(held.sum()) + hkv * (tail + parts.dense + 4), float(parts.read.sum()), hkv, lc + tail, d)
    assert abs(read - budget) <= float(sizes.max()) / (lc + tail)
    without = method.lookup(q, layer, replace(plan, room=None), d ** -0.5, REFERENCE, pos, follow=follow)
    assert torch.equal(without.units, take_best(score / sizes.clamp(min=1), sizes, 0.3 * layer.indexed))  # the plan's


def test_split_buckets_cuts_big_buckets_into_consecutive_chunks():
    """split_buckets against a loop: every bucket of more than `cap` keys becomes chunks of its keys in token order,
    of near-equal sizes at most `cap`; the first keeps its id, the others take new ones with their parent; the dense
    part moves to the last id; a head with fewer chunks pads with empty buckets (parent -1)."""
    g = torch.Generator().manual_seed(11)
    hkv, lc, c, cap = 2, 300, 6, 20
    labels = torch.randint(0, c, (hkv, lc), generator=g)
    labels[0, torch.rand(lc, generator=g) < 0.5] = 2  # head 0: one big bucket
    labels[:, -30:] = c  # the dense part
    labels[:, 0] = c
    out, parent, piece = split_buckets(labels, c, cap)
    c2 = parent.shape[1]
    for h in range(hkv):
        extra = c
        for b in range(c):
            where = torch.nonzero(labels[h] == b)[:, 0]  # token order
            n = where.numel()
            pieces = max(1, -(-n // cap))
            got = out[h, where]
            want = torch.tensor([b if (i * pieces) // n == 0 else extra + (i * pieces) // n - 1 for i in range(n)],
                                dtype=torch.int64)
            assert torch.equal(got, want)
            assert int(piece[h, b]) == 0
            for j in range(1, pieces):
                assert int(parent[h, extra + j - 1]) == b and int(piece[h, extra + j - 1]) == j
            extra += pieces - 1
        assert int(parent[h, :c].ne(torch.arange(c)).sum()) == 0
        assert torch.equal(parent[h, extra:], torch.full((c2 - extra,), -1))  # padding
        assert torch.equal(out[h] == c2, labels[h] == c)  # the dense part, last
        sizes = torch.bincount(out[h], minlength=c2 + 1)[:c2]
        assert int(sizes.max()) <= cap and int(sizes[extra:].sum()) == 0
    assert c2 > c and int((parent[1] >= 0).sum()) < c2  # head 0 cut its big bucket, head 1 pads
    same, plain, first = split_buckets(labels, c, lc)  # a cap no bucket reaches: nothing changes
    assert torch.equal(same, labels) and torch.equal(plain, torch.arange(c).expand(hkv, c)) and not bool(first.any())


@pytest.mark.parametrize("size_prior", [True, False])
def test_chunks_keep_each_buckets_score_and_bound_the_read(size_prior):
    """An index with big buckets cut into chunks (max_bucket): each bucket's score is its chunks' sum and each chunk's
    score per key its bucket's (with or without the size prior; within CHUNK_TIE per chunk, which orders a bucket's
    chunks), and a lookup reads at most one chunk past the budget, where with the size prior the whole crossing
    bucket overshoots (stand-in centroids crowd the keys into a few buckets; without the prior a big bucket's
    share per key ranks it last here)."""
    hkv, hq, d, lc, tail, c = 2, 4, 16, 600, 8, 16
    g = torch.Generator().manual_seed(12)
    whole = SaapPolicy(SaapSettings(buckets=c, hidden=8, size_prior=size_prior, max_bucket=0))
    cut = SaapPolicy(SaapSettings(buckets=c, hidden=8, size_prior=size_prior, max_bucket=2))
    prepared = {k.split(".", 1)[1]: v for k, v in whole.stand_in([2], hkv, d).items()}
    keys = torch.randn(hkv, lc + tail, d, generator=g) + 2.0 * torch.randn(1, 1, d, generator=g)  # crowded
    a = LayerIndex(whole.build(LayerKeys(layer_idx=2, keys=keys[:, :lc], tail=tail), {}, prepared), lc + tail, tail)
    b = LayerIndex(cut.build(LayerKeys(layer_idx=2, keys=keys[:, :lc], tail=tail), {}, prepared), lc + tail, tail)
    def parent_of(h: int, j: int) -> int:  # the bucket a chunk's keys had (-1: padding)
        held = a["labels"][h][b["labels"][h] == j]
        return j if j < c else (int(held[0]) if held.numel() else -1)

    parent = torch.tensor([[parent_of(h, j) for j in range(b["counts"].shape[1] - 1)] for h in range(hkv)])
    indexed = int((a["labels"][0] < c).sum())
    cap = math.ceil(2 * indexed / c)
    assert parent.shape[1] > c and int(b["counts"][:, :-1].max()) <= cap < int(a["counts"][:, :-1].max())
    overshoots = False
    for step in range(3):
        q = torch.randn(hq, 1, d, generator=g)
        pos = torch.tensor([lc + tail + step])
        plan = whole.plan_keys({}, 0.2, 0.2, 0.2)
        fa = whole.lookup(q, a, plan, d ** -0.5, REFERENCE, pos)
        fb = cut.lookup(q, b, plan, d ** -0.5, REFERENCE, pos)
        summed = torch.zeros(hkv, c).scatter_add_(1, parent.clamp(min=0), fb.scores * (parent >= 0))
        torch.testing.assert_close(summed, fa.scores, rtol=1e-3, atol=1e-6)
        sizes_a, sizes_b = a["counts"][:, :c].float(), b["counts"][:, :-1].float()
        real = (parent >= 0) & (sizes_b > 0)
        per_key_b = fb.scores / sizes_b.clamp(min=1)
        per_key_a = (fa.scores / sizes_a.clamp(min=1)).gather(1, parent.clamp(min=0))
        torch.testing.assert_close(per_key_b[real], per_key_a[real], rtol=1e-3, atol=1e-7)
        if size_prior:  # the Triton lookup (compiled or interpreted) of an index of C' = 20 buckets keeps the same
            on_device = LayerIndex({k: v.to(DEVICE) for k, v in b.tensors.items()}, lc + tail, tail)
            ft = cut.lookup(q.to(DEVICE), on_device, plan, d ** -0.5, TRITON, pos.to(DEVICE))
            assert torch.equal(ft.units.cpu(), fb.units)
        read = (fb.units.float() * sizes_b).sum(1)
        assert bool((read <= 0.2 * indexed + cap).all()) and bool((read >= 0.2 * indexed).all())
        over = (fa.units.float() * sizes_a).sum(1)
        overshoots = overshoots or bool((over > 0.2 * indexed + cap).any())
    assert overshoots or not size_prior  # with the prior, unchunked, some step read a whole big bucket past it


def test_saap_through_the_engine_trains_once_and_equals_full_attention_at_budget_1(tiny_llama, tmp_path):
    from engine.serve.service import Engine

    engine = Engine(tmp_path / "cache", lm=tiny_llama, methods={"saap": SMALL})
    assert engine.needs_preparation("saap") == ["saap"]
    seen = []
    found = engine.prepared("saap", lambda stage, done, total: seen.append(stage))
    assert engine.needs_preparation("saap") == [] and any("training the classifier" in s for s in seen)
    assert {n.split(".", 1)[1] for n in found} == {"centroids", "w1", "b1", "w2", "b2", "inv_freq"}
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT * 6)
    context = engine.ingest(doc, methods=("saap",)).context_id
    session = engine.session(context)
    full = session.logits("Who rang the bell?", "full")
    torch.testing.assert_close(session.logits("Who rang the bell?", "saap", 0.0), full, atol=1e-4, rtol=1e-4)
    answer = engine.ask(context, "Who rang the bell?", "saap", 0.5, 4)  # layer 0 of the two reads everything
    assert answer.stats.method == "saap" and 0.5 < answer.stats.kv_budget_decode < 1.0
    assert answer.stats.kept_fraction[0] == [1.0] * len(answer.stats.kept_fraction[0])
    assert max(answer.stats.kept_fraction[1]) < 1.0
    # big buckets cut into chunks at ingest: the same trained partitions, an index of more buckets, calibrated
    # with its own classifier columns, equal to full attention at budget 1
    chunked = Engine(tmp_path / "cache", lm=tiny_llama, methods={"saap": {**SMALL, "max_bucket": 1.0}})
    assert chunked.needs_preparation("saap") == []
    context = chunked.ingest(doc, methods=("saap",)).context_id
    session = chunked.session(context)
    counts = [layer.indexes["saap"]["counts"] for layer in session.cache.layers if "saap" in layer.indexes]
    assert max(c.shape[1] for c in counts) > SMALL["buckets"] + 1
    torch.testing.assert_close(session.logits("Who rang the bell?", "saap", 0.0), full, atol=1e-4, rtol=1e-4)
    answer = chunked.ask(context, "Who rang the bell?", "saap", 0.5, 4)
    assert 0.5 < answer.stats.kv_budget_decode < 1.0


def test_cli_trains_saap(tmp_path, capsys):
    from app.cli import main

    path = make_tiny_model(tmp_path, "llama_gqa")
    args = ["train", "saap", "--model", str(path), "--cache-dir", str(tmp_path / "c"), "--device", "cpu", "--json",
            "--quiet"] + [a for k, v in SMALL.items() for a in (f"--saap-{k.replace('_', '-')}", str(v))]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "saap"
    w1 = next(v for k, v in out["artifacts"].items() if k.endswith(".w1"))
    assert w1["shape"][2] == SMALL["hidden"] and not math.isnan(w1["mean"])


def test_training_bench_prints_its_json(capsys):
    from engine.bench.partitions import main

    assert main(["--shape", "tiny", "--prompts", "2", "--tokens", "256", "--buckets", "8", "--queries", "16",
                 "--steps", "3", "--device", "cpu"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["bench"] == "partitions" and doc["weights"] == "random" and doc["imbalance_mean"] >= 1.0
    assert set(doc["stages_s"]) == {"reading prompts", "clustering keys", "bucket targets", "training the classifier"}
