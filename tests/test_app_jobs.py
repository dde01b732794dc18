"""The background ingest worker (engine.jobs) with a scripted engine: stages in order, the estimate of the time
left, one job at a time, errors in plain words, recovery of interrupted jobs. No model, a fake clock."""

from __future__ import annotations

import threading

import pytest

from engine.config import IndexSettings
from engine.jobs import DEFAULT_STAGE_SHARE, LOADING, STAGES, IngestWorker, document_id
from engine.prompt import DocumentTooLongError
from engine.service import IngestReport
from storage import Store

TEXT = ("The keeper logged the weather every four hours. " * 40).encode()
TOKENS = 1000
INGEST_S = 100.0  # the scripted ingest takes this long on the fake clock, each stage its default share


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedEngine:
    """Engine stand-in: `ingest` reports every stage, advancing the fake clock by the stage's default share of
    INGEST_S, and snapshots the worker's view of the job half-way through each stage."""

    def __init__(self, store: Store, clock: Clock, fail: Exception | None = None, gate: threading.Event | None = None):
        self.store, self.clock, self.fail, self.gate = store, clock, fail, gate
        self.model_id = "scripted"
        self.model_loaded = False
        self.worker: IngestWorker | None = None
        self.snapshots: list = []
        self.running = 0
        self.max_running = 0
        self.calls: list[tuple[str, IndexSettings]] = []
        self.lm_stages: list[str] = []
        self._lock = threading.Lock()

    @property
    def lm(self):
        self.lm_stages.append(self.worker.views()[-1].stage)
        self.model_loaded = True
        return object()

    def ingest(self, doc, settings, truncate=False, progress=None):
        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if self.gate is not None:
                assert self.gate.wait(10)
            self.calls.append((doc.name, settings))
            doc_id, _ = self.store.add_document(doc)
            ctx = self.store.context_for(doc_id, self.model_id, settings.as_dict())
            if self.fail is not None:
                raise self.fail
            for stage in STAGES:
                total = TOKENS if stage == "prefill" else 4
                progress(stage, 0, total)
                self.clock.now += INGEST_S * DEFAULT_STAGE_SHARE[stage] / 2
                progress(stage, total // 2, total)
                self.snapshots.append(self.worker.view(self.worker.views()[-1].key))
                self.clock.now += INGEST_S * DEFAULT_STAGE_SHARE[stage] / 2
                progress(stage, total, total)
            self.store.mark_ready(ctx["id"], TOKENS)
            return IngestReport(doc_id, ctx["id"], TOKENS, doc.pages, INGEST_S, cached=False)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
def store():
    with Store.memory() as s:
        yield s


def make(store, **kwargs):
    clock = Clock()
    engine = ScriptedEngine(store, clock, **{k: kwargs.pop(k) for k in ("fail", "gate") if k in kwargs})
    start = kwargs.pop("start", True)
    worker = IngestWorker(engine, clock=clock, start=False, **kwargs)
    engine.worker = worker
    if start:
        worker.start()
    return engine, worker


def test_stages_in_order_and_the_time_left_shrinks_as_it_runs(store):
    engine, worker = make(store)
    try:
        job = worker.submit_bytes(TEXT, "guide.txt")
        assert worker.wait_idle(10)
        view = worker.view(job.key)
        assert (view.status, view.stage, view.fraction, view.eta_s, view.tokens) == ("done", "ready", 1.0, 0.0, TOKENS)
        assert view.doc_id == document_id(TEXT) and view.context_id is not None
        stages = [s.stage for s in engine.snapshots]
        assert stages == list(STAGES)
        fractions = [s.fraction for s in engine.snapshots]
        assert fractions == sorted(fractions) and 0 < fractions[0] < fractions[-1] < 1
        # Each stage took exactly its default share, so elapsed / fraction predicts the rest exactly
        # (once the fraction is large enough to extrapolate from).
        for snap in engine.snapshots[2:]:
            assert snap.eta_s == pytest.approx(INGEST_S * (1 - snap.fraction), rel=1e-6)
        assert [s.eta_s for s in engine.snapshots[2:]] == sorted((s.eta_s for s in engine.snapshots[2:]), reverse=True)
    finally:
        worker.close()


def test_the_model_loads_first_as_its_own_stage(store):
    engine, worker = make(store)
    try:
        job = worker.submit_bytes(TEXT, "guide.txt")
        assert worker.wait_idle(10)
        assert engine.lm_stages == [LOADING]
        assert worker.view(job.key).status == "done"
    finally:
        worker.close()


def test_queued_jobs_have_positions_and_an_estimate_from_the_learned_rate(store):
    engine, worker = make(store, start=False, seconds_per_token=0.05)
    first = worker.submit_bytes(TEXT, "a.txt")
    second = worker.submit_bytes(TEXT + b" more", "b.txt")
    v1, v2 = worker.view(first.key), worker.view(second.key)
    assert (v1.status, v1.position, v2.position) == ("queued", 1, 2)
    guess = 0.05 * len(TEXT) / 4  # bytes / CHARS_PER_TOKEN before the text is extracted
    assert v1.eta_s == pytest.approx(guess)
    assert v2.eta_s == pytest.approx(guess + 0.05 * (len(TEXT) + 5) / 4)
    assert worker.submit_bytes(TEXT, "a.txt") is first  # the same work is not queued twice
    worker.start()
    try:
        assert worker.wait_idle(10)
        # Learned from the two timed ingests (INGEST_S / TOKENS = 0.1 s per token), each blended in by half.
        later = worker.submit_bytes(TEXT + b" again", "c.txt")
        assert worker.view(later.key).eta_s is not None
        assert worker.wait_idle(10)
        assert worker.view(later.key).status == "done"
    finally:
        worker.close()


def test_one_job_at_a_time(store):
    gate = threading.Event()
    engine, worker = make(store, gate=gate)
    try:
        keys = [worker.submit_bytes(TEXT + bytes([65 + i]), f"{i}.txt").key for i in range(3)]
        gate.set()
        assert worker.wait_idle(10)
        assert engine.max_running == 1
        assert [c[0] for c in engine.calls] == ["0.txt", "1.txt", "2.txt"]
        assert all(worker.view(k).status == "done" for k in keys)
    finally:
        worker.close()


def test_errors_in_plain_words(store):
    engine, worker = make(store, fail=DocumentTooLongError(9000, 3072))
    try:
        bad = worker.submit_bytes(b"%PDF-1.4 this is not really a PDF", "broken.pdf")
        long = worker.submit_bytes(TEXT, "long.txt")
        assert worker.wait_idle(10)
        vb, vl = worker.view(bad.key), worker.view(long.key)
        assert (vb.status, vb.error_kind) == ("failed", "document")
        assert vb.error.startswith("broken.pdf: ")
        assert (vl.status, vl.error_kind) == ("failed", "too_long")
        assert "9000 tokens" in vl.error and vl.eta_s is None
    finally:
        worker.close()


def test_resume_requeues_what_an_earlier_process_left_unfinished(store):
    from storage import load_document_bytes

    doc = load_document_bytes(TEXT, "guide.txt")
    doc_id, _ = store.add_document(doc)
    settings = IndexSettings(centroid_ratio=0.1, level1_ratio=0.02)
    ctx = store.context_for(doc_id, "scripted", settings.as_dict())
    job = store.create_job(ctx["id"])
    store.update_job(job, status="running")
    with store.transaction() as db:  # the process that ran it is gone
        db.execute("UPDATE jobs SET pid = ? WHERE id = ?", [2**22 + 12345, job])
    store.set_context_status(ctx["id"], "running")
    assert store.recover_interrupted() == 1
    assert store.get_context(ctx["id"])["error"] == "interrupted"
    engine, worker = make(store, resume=True)
    try:
        assert worker.wait_idle(10)
        assert engine.calls == [("guide.txt", settings)]
        assert store.get_context(ctx["id"])["status"] == "ready"
    finally:
        worker.close()
