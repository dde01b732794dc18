"""The engine with the Triton backend against the engine with the PyTorch reference, on the tiny models.

On the CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), fp32; on a GPU they run
for real. Same document, same index, same calibration: only the backend differs, so the logits must agree to
float32 rounding (the kernels sum in another order) and the selections must be the same clusters.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.methods import SPARSE_METHODS
from engine.model.load import load_model
from engine.text.prompt import tokenize_document
from kernels.backend import REFERENCE, Backend
from kernels.dispatch import backend_for
from kernels.reference import centroid as reference
from kernels.selection import KeyCount
from tests.engine.test_engine_tiny import (  # the same document and index settings
    DOCUMENT,
    QUESTION,
    SETTINGS,
    all_methods,
)
from tests.support.tiny_models import gates_for

# On the CPU both backends compute in float32; the lookup scores differ by rounding only, and a cluster whose
# score sits within rounding of the threshold could flip (see TIE_RTOL); a flip would show as a logit difference
# far above this tolerance. On a GPU the model runs in bfloat16 and
# the kernels multiply in bfloat16 (the reference upcasts): the logits then agree to bfloat16 rounding only.
ON_GPU = torch.cuda.is_available()
TOL = dict(atol=5e-2, rtol=5e-2) if ON_GPU else dict(atol=2e-4, rtol=2e-4)


# A lookup score within this relative distance of the threshold is a tie: the kernels and the reference sum in
# different orders (and the kernels in base 2), so such a cluster may fall on either side. Calibrated thresholds
# are scores of the calibration queries, so exact ties do occur (qwen2_mha: S == T to the last bit in one step).
TIE_RTOL = 1e-5


@dataclasses.dataclass(frozen=True)
class CheckedBackend(Backend):
    """The Triton backend whose centroid-lookup family is `lookups` (the other families unchanged)."""

    lookups: object = None

    def kernel(self, family: str):
        return self.lookups if family == "centroid" else super().kernel(family)


class CheckedLookups:
    """The Triton lookups of a session, each compared on the spot with the reference on the same inputs: records
    the clusters kept by one and not the other, and whether each such cluster is a tie with the threshold. The
    family's other functions are the Triton ones."""

    def __init__(self, backend):
        self.flips: list[bool] = []  # one entry per flipped cluster: True when it is a tie
        self.score_rtol = 0.0  # largest relative score difference among scores above 1e-3 T
        self._triton = backend.kernel("centroid")
        self.backend = CheckedBackend(backend.name, lookups=self)

    def __getattr__(self, name: str):
        return getattr(self._triton, name)

    def _compare(self, keep, score, ref_keep, ref_score, threshold):
        for tie in ((ref_score - threshold).abs() <= TIE_RTOL * threshold)[keep != ref_keep].tolist():
            self.flips.append(tie)
        big = ref_score.abs() > 1e-3 * max(threshold, 1e-30)  # scores that matter for the decision
        if big.any():
            rel = ((score - ref_score).abs() / ref_score.abs().clamp(min=1e-30))[big]
            self.score_rtol = max(self.score_rtol, float(rel.max()))

    def cluster_select(self, q, centroids, counts, scale, threshold, rows, starts, total, tail=0, *, fixed=None,
                       step=None, valid=None, keys=None, sync=None):
        keep, score, sel = self._triton.cluster_select(q, centroids, counts, scale, threshold, rows, starts, total, tail,
                                                       fixed=fixed, step=step, valid=valid, keys=keys, sync=sync)
        ref = reference.cluster_select(q, centroids, counts, scale, threshold, rows, starts, total, tail, fixed=fixed,
                                       step=step, valid=valid, keys=keys)
        if keys is not None:  # a cut: the reference's threshold from its own histogram
            heads = counts.shape[0] if fixed is None else (~fixed.on).sum()
            threshold = float(reference.binned_cut(ref[1], counts, KeyCount.of(keys).value(device=q.device,
                                                                                           heads=heads)))
        self._compare(keep, score, *ref[:2], threshold)
        return keep, score, sel

    def cluster_keep_among(self, q, centroids, counts, scale, threshold, rows, candidates, *, step=None, valid=None,
                           read=None, keys=None):
        keep, score, elements = self._triton.cluster_keep_among(q, centroids, counts, scale, threshold, rows,
                                                                candidates, step=step, valid=valid, read=read,
                                                                keys=keys)
        return self._checked_among(q, centroids, counts, scale, threshold, rows, candidates, step, valid, read, keys,
                                   keep, score, elements)

    def cluster_select_among(self, q, centroids, counts, scale, threshold, rows, candidates, starts, total, tail=0, *,
                             step=None, valid=None, read=None, keys=None):
        keep, score, elements, sel = self._triton.cluster_select_among(q, centroids, counts, scale, threshold, rows,
                                                                       candidates, starts, total, tail, step=step,
                                                                       valid=valid, read=read, keys=keys)
        self._checked_among(q, centroids, counts, scale, threshold, rows, candidates, step, valid, read, keys, keep,
                            score, elements)
        return keep, score, elements, sel

    def _checked_among(self, q, centroids, counts, scale, threshold, rows, candidates, step, valid, read, keys, keep,
                       score, elements):
        """A level-2 lookup's keep and scores compared with the reference's on the same inputs."""
        ref = reference.cluster_keep_among(q, centroids, counts, scale, threshold, rows, candidates, step=step,
                                           valid=valid, read=read, keys=keys)
        if keys is not None:  # a cut: the reference's threshold from its own histogram of the candidates
            want = KeyCount.of(keys).value(ref[2], q.device, counts.shape[0])
            threshold = float(reference.binned_cut(ref[1], counts * candidates.to_mask(), want))
        self._compare(keep, score, *ref[:2], threshold)
        if read is None:
            assert elements is None and ref[2] is None
        else:
            torch.testing.assert_close(elements, ref[2], rtol=1e-6, atol=1e-3)
        return keep, score, elements


# In the interpreter every kernel program runs as Python, and the MHA model (a KV head per query head) cost ~150 of
# this file's ~290 s on 2 loaded cores. On the CPU the engine is checked on the GQA and hybrid models;
# the G = 1 case is in the kernels' own tests (the GQA lists of tests/kernels/test_causal_kernels.py and
# test_sparse_kernels.py) and in the reference-backend engine tests (tests/engine/test_engine_tiny.py). On a GPU: all three.
INTERPRETER_SKIPS = ("qwen2_mha",)


@pytest.fixture(scope="module")
def ingested(tiny_model_path):
    """The tiny model and the document's artifacts (ingested once, by the reference), shared by the sessions."""
    if not ON_GPU and tiny_model_path.name in INTERPRETER_SKIPS:
        pytest.skip("the MHA model in Triton's interpreter: its kernels' G = 1 case is tested apart (above)")
    lm = load_model(str(tiny_model_path), device="cuda" if ON_GPU else "cpu")
    fc = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    return lm, ingest_tokens(lm, fc.ids, SETTINGS, REFERENCE, all_methods(),
                  prepared=gates_for(lm, all_methods())).artifacts


def own(artifacts: dict) -> dict:
    """A session's own copy: a session takes its K/V over and arranges them in place for each method."""
    return {name: t.clone() for name, t in artifacts.items()}


@pytest.fixture(scope="module")
def sessions(ingested):
    lm, artifacts = ingested
    triton = backend_for(lm.device, "triton")
    return ContextSession(lm, own(artifacts), SETTINGS, REFERENCE), ContextSession(lm, own(artifacts), SETTINGS, triton)


@pytest.fixture(scope="module")
def checked(ingested):
    """A session on the Triton backend whose every lookup is compared with the reference's."""
    lm, artifacts = ingested
    lookups = CheckedLookups(backend_for(lm.device, "triton"))
    return ContextSession(lm, own(artifacts), SETTINGS, lookups.backend), lookups


@pytest.mark.parametrize("method,sparsity", [("full", 0.0), ("squeeze", 0.0), ("squeeze", 0.7), ("hsqueeze", 0.7),
                                             ("quest", 0.7)])
def test_triton_backend_matches_reference_logits(sessions, method, sparsity):
    ref, tri = sessions
    torch.testing.assert_close(tri.logits(QUESTION, method, sparsity), ref.logits(QUESTION, method, sparsity), **TOL)


def assert_same_turn(a, b) -> None:
    """Two answers (reference, Triton) to the same question: the same text and units, kept fractions within a
    cluster tied with the threshold (test_lookups_agree_but_for_ties checks such a turn's lookups one by one)."""
    assert b.text == a.text
    units = lambda stats: [[(r["ids"], r["sizes"]) for r in c["rows"]] for c in stats.clusters]  # noqa: E731
    assert units(b.stats) == units(a.stats)
    flat = lambda m: [x for row in m for x in row]  # noqa: E731
    assert flat(b.stats.kept_fraction) == pytest.approx(flat(a.stats.kept_fraction), abs=0.02)


# A turn's tokens: the question's prefill (the Lq > 1 kernels) and one decode step (the Lq == 1 ones); in the
# interpreter each step of the MHA model costs seconds.
TOKENS = 2

# On the CPU squeeze's and hsqueeze's turns are the checked ones below (a Triton session whose lookups are also
# compared one by one): the same turn twice in the interpreter cost ~60 s of the suite.
CHECKED = ("squeeze", "hsqueeze")


@pytest.mark.parametrize("method", [m for m in SPARSE_METHODS if ON_GPU or m not in CHECKED])
def test_triton_backend_answers_like_reference(sessions, method):
    """Prefill and decode steps (Lq > 1 and Lq == 1 kernels), with the statistics of the turn."""
    ref, tri = sessions
    a = ref.ask(QUESTION, method, 0.7, max_new_tokens=TOKENS)
    b = tri.ask(QUESTION, method, 0.7, max_new_tokens=TOKENS)
    if ON_GPU:  # bfloat16 rounding may move a near-tie cluster or token of a random model: check the run only
        assert 1 <= b.stats.steps <= TOKENS + 1
        assert 0 < b.stats.kv_budget <= 1.1
        return
    assert_same_turn(a, b)


@pytest.mark.skipif(ON_GPU, reason="bfloat16 on the GPU: near-ties are not rounding-level there")
@pytest.mark.parametrize("method", CHECKED)
def test_lookups_agree_but_for_ties(sessions, checked, method):
    """Every Triton lookup of a turn (prefill and decode steps) keeps the clusters the reference keeps on the same
    inputs, but for clusters whose score ties with the threshold, and scores them to float32 rounding; the turn
    answers as the reference's does (test_triton_backend_answers_like_reference)."""
    session, lookups = checked
    lookups.flips.clear()
    b = session.ask(QUESTION, method, 0.7, max_new_tokens=TOKENS)
    assert all(lookups.flips), f"{lookups.flips.count(False)} clusters flipped away from the threshold"
    assert lookups.score_rtol < 1e-5
    assert_same_turn(sessions[0].ask(QUESTION, method, 0.7, max_new_tokens=TOKENS), b)
