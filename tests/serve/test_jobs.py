"""The background ingest worker (engine.serve.jobs) with a scripted engine: stages in order, the estimate of the time
left, one job at a time, errors in plain words, recovery of interrupted jobs. No model, a fake clock."""

from __future__ import annotations

import threading
import time

import pytest

from engine.context.settings import ContextSettings
from engine.model.load import STEP_TOKENIZER, STEP_WEIGHTS, LoadStep
from engine.serve.jobs import CANCELLED, DEFAULT_STAGE_SHARE, LOADING, STAGES, IngestWorker, document_id
from engine.serve.service import IngestReport
from engine.text.prompt import DocumentTooLongError
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

    def __init__(self, store: Store, clock: Clock, fail: Exception | None = None, gate: threading.Event | None = None,
                 stages: tuple[str, ...] = STAGES):
        self.store, self.clock, self.fail, self.gate, self.stages = store, clock, fail, gate, stages
        self.model_id = "scripted"
        self.model_loaded = False
        self.load_step: LoadStep | None = None
        self.worker: IngestWorker | None = None
        self.snapshots: list = []
        self.running = 0
        self.max_running = 0
        self.calls: list[tuple[str, ContextSettings]] = []
        self.lm_stages: list[str] = []
        self.lm_texts: list[str] = []
        self.on_report = lambda stage, done: None  # what the test does at each progress report
        self._lock = threading.Lock()

    @property
    def lm(self):
        from app.render import stage_text

        for done, step in enumerate((STEP_TOKENIZER, STEP_WEIGHTS)):  # as Engine.lm: the load's steps, 5 s each
            self.load_step = LoadStep(step, done, 2)
            self.clock.now += 5
            view = self.worker.views()[-1]
            self.lm_stages.append(view.stage)
            self.lm_texts.append(stage_text(view))
        self.load_step = None
        self.model_loaded = True
        return object()

    def ingest(self, doc, settings, truncate=False, progress=None, methods=(), job=None, overrides=None):
        """As Engine.ingest: the progress goes into the given job's row (the worker finishes the job)."""

        def report(stage, done, total):
            self.store.jobs.update(job, stage=stage, done=done, total=total)
            self.on_report(stage, done)
            progress(stage, done, total)

        with self._lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            if self.gate is not None:
                assert self.gate.wait(10)
            self.calls.append((doc.name, settings))
            doc_id, _ = self.store.documents.add(doc)
            ctx = self.store.contexts.context_for(doc_id, self.model_id, settings.as_dict())
            if self.fail is not None:
                raise self.fail
            for stage in self.stages:
                total = TOKENS if stage == "prefill" else 4
                report(stage, 0, total)
                self.clock.now += INGEST_S * DEFAULT_STAGE_SHARE[stage] / 2
                report(stage, total // 2, total)
                self.snapshots.append(self.worker.view(self.worker.views()[-1].id))
                self.clock.now += INGEST_S * DEFAULT_STAGE_SHARE[stage] / 2
                report(stage, total, total)
            self.store.contexts.mark_ready(ctx["id"], TOKENS)
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
    engine = ScriptedEngine(store, clock, **{k: kwargs.pop(k) for k in ("fail", "gate", "stages") if k in kwargs})
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
        view = worker.view(job.id)
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


def test_an_index_rebuild_counts_only_the_stages_it_runs(store):
    """A job over a stored context (an index rebuilt for new settings) passes tokenizing and the prefill without
    running them: its fraction is of its own stages and its time left what those have left, not the rest of a whole
    ingest extrapolated from a fraction that counted the prefill as done."""
    index_only = ("extracting", "clustering", "calibrating", "saving")
    engine, worker = make(store, stages=index_only, seconds_per_token=INGEST_S / TOKENS)
    try:
        worker.submit_bytes(TEXT, "guide.txt")
        assert worker.wait_idle(10)
        own = sum(DEFAULT_STAGE_SHARE[s] for s in index_only)
        # (while it extracts, nothing says the context is stored: it is estimated as a whole ingest)
        for stage, snap in list(zip(index_only, engine.snapshots))[1:]:
            after = sum(DEFAULT_STAGE_SHARE[s] for s in index_only[index_only.index(stage) + 1 :])
            left = INGEST_S * (DEFAULT_STAGE_SHARE[stage] / 2 + after)  # half of this stage, then the rest
            assert snap.fraction == pytest.approx(1 - left / (INGEST_S * own), rel=1e-6)
            assert snap.eta_s == pytest.approx(left, rel=1e-6)
    finally:
        worker.close()


def test_the_model_loads_first_as_its_own_stage(store):
    engine, worker = make(store)
    try:
        job = worker.submit_bytes(TEXT, "guide.txt")
        assert worker.wait_idle(10)
        assert engine.lm_stages == [LOADING, LOADING]
        assert engine.lm_texts == ["loading model: loading the tokenizer (step 1 of 2), 5 s so far",
                                   "loading model: loading the weights (step 2 of 2), 10 s so far"]
        assert worker.view(job.id).status == "done"
    finally:
        worker.close()


def test_queued_jobs_have_positions_and_an_estimate_from_the_learned_rate(store):
    engine, worker = make(store, start=False, seconds_per_token=0.05)
    first = worker.submit_bytes(TEXT, "a.txt")
    second = worker.submit_bytes(TEXT + b" more", "b.txt")
    v1, v2 = worker.view(first.id), worker.view(second.id)
    assert (v1.status, v1.position, v2.position) == ("queued", 1, 2)
    guess = 0.05 * len(TEXT) / 4  # bytes / CHARS_PER_TOKEN before the text is extracted
    assert v1.eta_s == pytest.approx(guess)
    assert v2.eta_s == pytest.approx(guess + 0.05 * (len(TEXT) + 5) / 4)
    assert worker.submit_bytes(TEXT, "a.txt").id == first.id  # the same work is not queued twice
    worker.start()
    try:
        assert worker.wait_idle(10)
        # Learned from the two timed ingests (INGEST_S / TOKENS = 0.1 s per token), each blended in by half.
        later = worker.submit_bytes(TEXT + b" again", "c.txt")
        assert worker.view(later.id).eta_s is not None
        assert worker.wait_idle(10)
        assert worker.view(later.id).status == "done"
    finally:
        worker.close()


def test_a_queued_job_says_what_it_waits_for(store):
    """Behind the job being prepared, a queued job names it; further back, how many jobs are ahead (the running one
    counted); with nothing running, the first queued job is next."""
    from app.render import stage_text

    gate = threading.Event()
    engine, worker = make(store, gate=gate, start=False)
    try:
        first = worker.submit_bytes(TEXT + b"A", "a.txt")
        assert stage_text(worker.view(first.id)) == "next in the queue"
        second = worker.submit_bytes(TEXT + b"B", "b.txt")
        third = worker.submit_bytes(TEXT + b"C", "c.txt")
        assert stage_text(worker.view(second.id)) == "waiting: 1 ahead"
        worker.start()
        deadline = time.monotonic() + 10
        while engine.running == 0 and time.monotonic() < deadline:  # a.txt is being prepared, held by the gate
            time.sleep(0.01)
        views = {v.name: v for v in worker.views()}
        assert [(views[n].status, views[n].position, views[n].ahead) for n in ("a.txt", "b.txt", "c.txt")] == [
            ("running", 0, 0), ("queued", 1, 1), ("queued", 2, 2)]
        assert views["b.txt"].after == "a.txt" and views["a.txt"].after is None
        assert [stage_text(views["b.txt"]), stage_text(views["c.txt"])] == ["waiting: next after a.txt",
                                                                            "waiting: 2 ahead"]
        gate.set()
        assert worker.wait_idle(10)
        assert [worker.view(j.id).status for j in (first, second, third)] == ["done"] * 3
    finally:
        gate.set()
        worker.close()


def test_one_job_at_a_time(store):
    gate = threading.Event()
    engine, worker = make(store, gate=gate)
    try:
        ids = [worker.submit_bytes(TEXT + bytes([65 + i]), f"{i}.txt").id for i in range(3)]
        gate.set()
        assert worker.wait_idle(10)
        assert engine.max_running == 1
        assert [c[0] for c in engine.calls] == ["0.txt", "1.txt", "2.txt"]
        assert all(worker.view(i).status == "done" for i in ids)
    finally:
        worker.close()


def test_errors_in_plain_words(store):
    engine, worker = make(store, fail=DocumentTooLongError(9000, 3072))
    try:
        bad = worker.submit_bytes(b"%PDF-1.4 this is not really a PDF", "broken.pdf")
        long = worker.submit_bytes(TEXT, "long.txt")
        assert worker.wait_idle(10)
        vb, vl = worker.view(bad.id), worker.view(long.id)
        assert (vb.status, vb.error_kind) == ("failed", "document")
        assert vb.error.startswith("broken.pdf: ")
        assert (vl.status, vl.error_kind) == ("failed", "too_long")
        assert "9000 tokens" in vl.error and vl.eta_s is None
        # the too-long upload is not kept in the library (only its start fits: it is uploaded again, truncated);
        # its failed job stays, telling why
        assert [d["name"] for d in store.documents.list()] == []
        assert worker.view(long.id).error_kind == "too_long"
    finally:
        worker.close()


def test_resume_requeues_what_an_earlier_process_left_unfinished(store):
    from storage import load_document_bytes

    doc = load_document_bytes(TEXT, "guide.txt")
    doc_id, _ = store.documents.add(doc)
    settings = ContextSettings(dense_tail=50)
    ctx = store.contexts.context_for(doc_id, "scripted", settings.as_dict())
    job = store.jobs.create(doc_id, "guide.txt", "scripted", settings.as_dict(), context_id=ctx["id"])
    store.jobs.start(job)
    with store.transaction() as db:  # the process that ran it is gone
        db.execute("UPDATE jobs SET pid = ? WHERE id = ?", [2**22 + 12345, job])
    store.contexts.set_status(ctx["id"], "running")
    assert store.jobs.recover_interrupted() == 1
    assert store.contexts.get(ctx["id"])["error"] == "interrupted"
    engine, worker = make(store, resume=True)
    try:
        assert worker.wait_idle(10)
        assert engine.calls == [("guide.txt", settings)]
        assert store.contexts.get(ctx["id"])["status"] == "ready"
        [resumed] = worker.views()  # the interrupted job is history; the new one is listed
        assert (resumed.status, resumed.context_id, resumed.resumed) == ("done", ctx["id"], True)
    finally:
        worker.close()


def test_the_store_is_the_record_of_every_job(store):
    engine, worker = make(store, start=False, seconds_per_token=0.05)
    data = [TEXT + bytes([65 + i]) for i in range(3)]
    jobs = [worker.submit_bytes(d, f"{i}.txt") for i, d in enumerate(data)]
    row = store.jobs.get(jobs[0].id)  # before extraction: no document row, no context yet
    assert (row["status"], row["name"], row["doc_id"], row["context_id"]) == ("queued", "0.txt", document_id(data[0]),
                                                                             None)
    own = 0.05 * len(data[0]) / 4
    assert [worker.view(j.id).eta_s for j in jobs] == pytest.approx([own, 2 * own, 3 * own])  # each job ahead once
    restarted = IngestWorker(engine, start=False)  # another worker on the same store sees the active jobs...
    assert [(v.id, v.status, v.position, v.eta_s) for v in restarted.views()] == [(j.id, "queued", 0, None)
                                                                                   for j in jobs]
    worker.start()
    try:
        assert worker.wait_idle(10)
        assert [restarted.view(j.id).status for j in jobs] == ["done"] * 3  # ...and how they ended
        row = store.jobs.get(jobs[0].id)
        assert (row["status"], row["stage"], row["tokens"], row["pages"], row["chars"]) == ("done", "ready", TOKENS, 1,
                                                                                          len(data[0]))
        assert restarted.views() == [] == IngestWorker(engine, start=False).views()  # older, finished: history
    finally:
        worker.close()


def test_a_running_preparation_is_cancelled_at_its_next_step(store):
    """Cancel while it runs: the ingest stops at its next progress report, the job ends cancelled (in plain words),
    the context is not ready; preparing the document again then completes."""
    engine, worker = make(store)
    stages: list[str] = []
    try:
        job = worker.submit_bytes(TEXT, "guide.txt")

        def cancel_in_clustering(stage, done):
            stages.append(stage)
            if stage == "clustering":
                assert worker.cancel(job.id)

        engine.on_report = cancel_in_clustering
        assert worker.wait_idle(10)
        view = worker.view(job.id)
        assert (view.status, view.error) == ("cancelled", CANCELLED)
        assert "calibrating" not in stages  # stopped at the report after the cancel
        assert all(c["status"] != "ready" for c in store.contexts.list(view.doc_id))
        assert not worker.cancel(job.id)  # no longer active
        engine.on_report = lambda stage, done: None
        again = worker.submit_bytes(TEXT, "guide.txt")
        assert worker.wait_idle(10) and worker.view(again.id).status == "done"
    finally:
        worker.close()


def test_a_queued_preparation_is_cancelled_before_it_starts(store):
    engine, worker = make(store, start=False)
    try:
        first = worker.submit_bytes(TEXT, "a.txt")
        second = worker.submit_bytes(TEXT.replace(b"keeper", b"warden"), "b.txt")
        assert worker.cancel(second.id) and not worker.cancel(123456)
        worker.start()
        assert worker.wait_idle(10)
        assert worker.view(first.id).status == "done"
        assert worker.view(second.id).status == "cancelled"
        assert [name for name, _ in engine.calls] == ["a.txt"]  # the cancelled one never ran
    finally:
        worker.close()


def test_jobs_queued_while_the_model_preloads_say_so(store):
    """A worker that loads the model at start-up: a job submitted meanwhile reads "waiting for the model to
    load" and the load's step, not a bare queue position."""
    from app.render import stage_text

    gate = threading.Event()

    class SlowModel(ScriptedEngine):
        @property
        def lm(self):
            self.load_step = LoadStep(STEP_WEIGHTS, 1, 2)
            assert gate.wait(10)
            self.load_step = None
            self.model_loaded = True
            return object()

    engine = SlowModel(store, Clock())
    worker = IngestWorker(engine, clock=engine.clock, preload=True)
    engine.worker = worker
    try:
        job = worker.submit_bytes(TEXT, "guide.txt")
        deadline = time.monotonic() + 10
        while engine.load_step is None and time.monotonic() < deadline:
            time.sleep(0.01)
        view = worker.view(job.id)
        assert (view.status, view.stage, view.done, view.total) == ("queued", LOADING, 1, 2)
        assert stage_text(view) == "waiting for the model to load: loading the weights (step 2 of 2)"
        gate.set()
        assert worker.wait_idle(10) and worker.view(job.id).status == "done"
    finally:
        gate.set()
        worker.close()


@pytest.mark.parametrize("name,stored", [("../../etc/evil.txt", "evil.txt"), ("C:\\Users\\x\\notes.txt", "notes.txt"),
                                         ("\udcffbad\x00name.txt", "\ufffdbad\ufffdname.txt"),
                                         ("n" * 1000 + ".txt", "n" * 195 + "\u2026.txt")])
def test_hostile_upload_names_are_stored_as_plain_labels(store, name, stored):
    """An upload's name is only a label: its last path component, control characters and undecodable bytes
    replaced, at most 200 characters; the job and the document are stored and prepared under it."""
    engine, worker = make(store)
    try:
        job = worker.submit_bytes(TEXT + str(len(name)).encode(), name)  # (a document of its own)
        assert worker.wait_idle(10)
        view = worker.view(job.id)
        assert (view.status, view.error, view.name) == ("done", None, stored)
        assert store.documents.get(view.doc_id).name == stored
    finally:
        worker.close()


def test_a_queued_upload_outlives_a_killed_server(tmp_path):
    """An upload still waiting when its server is killed (its job left "queued" by a dead process) is queued again
    by the next server's worker and prepared; the file it waited in is gone once extracted."""
    with Store(tmp_path / "cache") as store:
        engine, worker = make(store, start=False)
        view = worker.submit_bytes(TEXT, "guide.txt")
        spooled = tmp_path / "cache" / "uploads" / view.doc_id
        assert spooled.read_bytes() == TEXT
        worker.close()  # never started: the job stays queued, as a kill leaves it
        with store.transaction() as db:  # the process that queued it is gone
            db.execute("UPDATE jobs SET pid = ? WHERE id = ?", [2**22 + 12345, view.id])
        assert store.jobs.recover_interrupted() == 1  # what the next engine does at its start
    with Store(tmp_path / "cache") as store:
        engine, worker = make(store, resume=True, start=False)
        try:
            fresh = worker.submit_bytes(TEXT + b" more", "fresh.txt")
            resumed = {v.name: v.resumed for v in worker.views()}
            assert resumed == {"guide.txt": True, "fresh.txt": False}
            assert fresh.resumed is False and store.jobs.get(fresh.id)["status"] == "queued"
            worker.start()
            assert worker.wait_idle(10)
            assert [name for name, _ in engine.calls] == ["guide.txt", "fresh.txt"]
            doc = store.documents.find("guide.txt")
            assert doc["id"] == view.doc_id and doc["status"] == "ready"
            assert not spooled.exists()
        finally:
            worker.close()


def test_a_refused_upload_leaves_no_waiting_file(tmp_path):
    with Store(tmp_path / "cache") as store:
        engine, worker = make(store)
        try:
            view = worker.submit_bytes(b"\x00\x01binary" * 50, "broken.txt")
            assert worker.wait_idle(10)
            assert worker.view(view.id).status == "failed"
            assert not (tmp_path / "cache" / "uploads" / view.doc_id).exists()
        finally:
            worker.close()


def test_a_new_worker_starts_from_the_ingest_rate_of_earlier_jobs(store):
    """The seconds per token (the measure of every estimate before a job is timed) come from the quickest of the
    latest finished ingests the store recorded for the model; cached ones (an index rebuilt, a copy) do not count."""
    engine, worker = make(store)
    first = worker.submit_bytes(TEXT, "guide.txt")
    assert worker.wait_idle(10)
    worker.close()
    context = worker.view(first.id).context_id
    jobs = [first.id]
    for _ in range(2):
        jobs.append(store.jobs.create(document_id(TEXT), "guide.txt", engine.model_id, ContextSettings().as_dict()))
        store.jobs.start(jobs[-1])
    for job, (seconds, tokens, cached) in zip(jobs, ((40.0, 1000, False), (12.0, 4000, False), (1.0, 4000, True))):
        if job != first.id:
            store.jobs.finish(job, context_id=context, tokens=tokens, cached=cached)
        with store.transaction() as db:
            db.execute("UPDATE jobs SET started_at = ?, finished_at = ?, tokens = ? WHERE id = ?",
                       ["2026-01-01T00:00:00+00:00", f"2026-01-01T00:00:{seconds:06.3f}+00:00", tokens, job])
    _, later = make(store, start=False)
    assert later.seconds_per_token == pytest.approx(12.0 / 4000)
    assert make(store, start=False, seconds_per_token=0.5)[1].seconds_per_token == 0.5  # a given prior wins


def test_a_pdfs_extraction_tells_its_pages_and_stops_at_a_cancel(store):
    """A PDF's text is extracted a page at a time into the job's row (pages read of its pages, the last page always);
    cancelled mid-extraction, the job stops at the next page, cancelled, and nothing of it is stored."""
    from tests.support.pdfs import make_text_pdf

    pdf = make_text_pdf([f"Page {i} of the keeper's log: the weather every four hours." for i in range(1, 6)])
    engine, worker = make(store)
    told: list[tuple[int, int]] = []
    update = store.jobs.update

    def spy(job_id, **fields):
        if fields.get("stage") == "extracting" and fields.get("total") in (3, 5):  # the PDFs' pages (the scripted
            # ingest reports its stages out of 4)
            told.append((fields["done"], fields["total"]))
        return update(job_id, **fields)

    store.jobs.update = spy
    try:
        job = worker.submit_bytes(pdf, "log.pdf")
        assert worker.wait_idle(10) and worker.view(job.id).status == "done"
        assert told[0] == (1, 5) and told[-1] == (5, 5)  # the first page, and the last whatever the clock

        told.clear()

        def cancel_at_the_first_page(job_id, **fields):
            spy(job_id, **fields)
            if told == [(1, 3)]:
                assert worker.cancel(job_id)

        store.jobs.update = cancel_at_the_first_page
        again = worker.submit_bytes(make_text_pdf(["Another log.", "Its second page.", "Its third."]), "other.pdf")
        assert worker.wait_idle(10)
        view = worker.view(again.id)
        assert (view.status, view.error) == ("cancelled", CANCELLED)
        assert told == [(1, 3)] and len(store.documents.list()) == 1  # stopped at the next page; not stored
    finally:
        store.jobs.update = update
        worker.close()
