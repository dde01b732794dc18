"""storage.blobs and storage.Store: round trips, damage detection, recovery, concurrency."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from storage import (
    AmbiguousIdError,
    DamagedArtifactError,
    MissingArtifactError,
    NotFoundError,
    StorageError,
    Store,
    load_document_bytes,
    read_tensors,
    salvage_index,
    write_tensors,
)
from storage.blobs import TEMP_SUFFIX, read_bytes, write_bytes
from storage.schema import MIGRATIONS, SCHEMA_VERSION
from tests.support.pdfs import make_text_pdf

MODEL = "tiny-test-model"
SETTINGS = {"method": "squeezed", "clusters": 8, "levels": [1, 2]}


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path):
    s = Store.memory() if request.param == "memory" else Store(tmp_path / "store")
    yield s
    s.close()


def make_doc(text: str = "hello world", name: str = "notes.txt"):
    return load_document_bytes(text.encode(), name)


def new_context(store: Store, text: str = "hello world") -> dict:
    doc_id, _ = store.documents.add(make_doc(text))
    return store.contexts.context_for(doc_id, MODEL, SETTINGS)


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40])
    return {
        "f32": torch.cat([torch.randn(3, 5, generator=g).flatten(), special]),
        "f16": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "bf16": torch.cat([torch.randn(7, generator=g), special]).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (4, 2), generator=g, dtype=torch.int64),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_bytes = [t.contiguous().view(torch.uint8) for t in (actual, expected)]
    assert torch.equal(*as_bytes)


def temp_files(root) -> list:
    return [p for p in root.rglob("*") if p.name.endswith(TEMP_SUFFIX) or p.name.startswith(".")]


# --------------------------------------------------------------------------- blobs


def test_blob_round_trip_is_bit_exact(tmp_path):
    tensors = sample_tensors()
    info = write_tensors(tmp_path / "b.safetensors", tensors)
    assert info.nbytes == (tmp_path / "b.safetensors").stat().st_size
    loaded = read_tensors(tmp_path / "b.safetensors", info.sha256)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert_bit_exact(loaded[name], tensor)
        assert loaded[name].is_contiguous()


def test_blob_write_is_atomic(tmp_path):
    path = tmp_path / "b.safetensors"
    first = write_tensors(path, {"x": torch.arange(4)})
    with pytest.raises(TypeError):
        write_tensors(path, {"x": torch.arange(8), "y": "not a tensor"})
    assert temp_files(tmp_path) == []
    assert torch.equal(read_tensors(path, first.sha256)["x"], torch.arange(4))  # old file intact


def test_blob_shared_storage_is_saved(tmp_path):
    base = torch.arange(6.0)
    info = write_tensors(tmp_path / "b.safetensors", {"a": base[:3], "b": base[3:], "c": base})
    loaded = read_tensors(tmp_path / "b.safetensors", info.sha256)
    assert [loaded[k].tolist() for k in "abc"] == [[0, 1, 2], [3, 4, 5], [0, 1, 2, 3, 4, 5]]


def test_blob_missing_and_damaged(tmp_path):
    path = tmp_path / "b.safetensors"
    with pytest.raises(MissingArtifactError, match="b.safetensors"):
        read_tensors(path, "0" * 64)
    info = write_tensors(path, {"x": torch.ones(16)})
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedArtifactError, match="b.safetensors") as err:
        read_tensors(path, info.sha256)
    assert err.value.expected == info.sha256 and err.value.actual != info.sha256


# --------------------------------------------------------------------------- documents


def test_document_round_trip_and_re_add_is_a_hit(store):
    doc = load_document_bytes(make_text_pdf(["page one", "page two"]), "two.pdf")
    doc_id, created = store.documents.add(doc)
    assert (doc_id, created) == (doc.doc_id, True)
    assert store.documents.get(doc_id) == doc
    again = load_document_bytes(make_text_pdf(["page one", "page two"]), "renamed.pdf")
    assert store.documents.add(again) == (doc_id, False)
    [row] = store.documents.list()
    assert (row["id"], row["name"], row["pages"]) == (doc_id, "two.pdf", 2)
    assert row["chars"] == len(doc.text)
    assert (row["status"], row["tokens"], row["context_id"]) == (None, None, None)


def test_find_document(store):
    a, _ = store.documents.add(make_doc("alpha", "same.txt"))
    b, _ = store.documents.add(make_doc("beta", "same.txt"))
    c, _ = store.documents.add(make_doc("gamma", "other.md"))
    assert store.documents.find(a)["id"] == a
    assert store.documents.find(a[:10].upper())["id"] == a
    assert store.documents.find("other.md")["id"] == c
    with pytest.raises(AmbiguousIdError, match="2 documents"):
        store.documents.find("same.txt")
    with pytest.raises(NotFoundError):
        store.documents.find("nope")
    with pytest.raises(NotFoundError):
        store.documents.get("0" * 16)
    assert {d["id"] for d in store.documents.list()} == {a, b, c}


def test_a_pdf_keeps_its_original_file_checked_and_deleted_with_it(store):
    data = make_text_pdf(["The secret passkey is 48213.", "The keeper rang the bell."])
    pdf = load_document_bytes(data, "keeper.pdf")
    doc_id, created = store.documents.add(pdf, source=data)
    assert created and store.documents.source(doc_id) == data
    path = store.documents.source_file(doc_id)
    assert path.parent == store.documents.source_dir and path.suffix == ".pdf" and path.read_bytes() == data
    assert store.remove_orphan_files() == 0 and path.exists()  # a kept file is no orphan
    assert store.documents.add(pdf, source=data) == (doc_id, False)  # a hit: the one file stays
    assert list(store.documents.source_dir.iterdir()) == [path]

    text_id, _ = store.documents.add(make_doc("hello world"))  # a text file keeps no file
    assert store.documents.source(text_id) is None and store.documents.source_file(text_id) is None
    with pytest.raises(ValueError, match="only the original file of a pdf"):
        store.documents.add(make_doc("other words"), source=b"other words")
    with pytest.raises(ValueError, match="sha256 differs"):
        store.documents.add(pdf, source=data + b"\n")
    assert list(store.documents.source_dir.iterdir()) == [path]  # (nothing written for a refused add)

    store.documents.hide(doc_id)  # out of the library: its file is not offered
    assert store.documents.source_file(doc_id) is None
    store.documents.unhide(doc_id)
    path.write_bytes(data[:-1] + b"?")  # same size: only the sha256 tells
    with pytest.raises(DamagedArtifactError):
        store.documents.source(doc_id)
    path.write_bytes(data[:-1])
    assert store.documents.source_file(doc_id) is None  # another size: not offered
    path.write_bytes(data)
    store.documents.delete(doc_id)
    assert not path.exists() and list(store.documents.source_dir.iterdir()) == []
    with pytest.raises(NotFoundError):
        store.documents.source(doc_id)


def test_a_document_stored_without_its_file_keeps_it_when_added_again_with_it(store):
    data = make_text_pdf(["Only page."])
    pdf = load_document_bytes(data, "one.pdf")
    doc_id, _ = store.documents.add(pdf)
    assert store.documents.source(doc_id) is None
    assert store.documents.add(pdf, source=data) == (doc_id, False)
    assert store.documents.source(doc_id) == data and store.documents.source_file(doc_id).is_file()
    path = store.documents.source_file(doc_id)
    path.unlink()
    with pytest.raises(MissingArtifactError):
        store.documents.source(doc_id)
    assert store.documents.source_file(doc_id) is None


def test_bytes_blob_round_trip_and_damage(tmp_path):
    info = write_bytes(tmp_path / "a" / "f.pdf", b"%PDF-1.4 body")
    assert info.nbytes == 13 and read_bytes(tmp_path / "a" / "f.pdf", info.sha256) == b"%PDF-1.4 body"
    assert temp_files(tmp_path) == []
    with pytest.raises(DamagedArtifactError):
        read_bytes(tmp_path / "a" / "f.pdf", "0" * 64)
    with pytest.raises(MissingArtifactError):
        read_bytes(tmp_path / "a" / "g.pdf", info.sha256)


# --------------------------------------------------------------------------- contexts & artifacts


def test_context_for_is_keyed_by_doc_model_and_settings(store):
    context = new_context(store)
    assert context["status"] == "pending" and context["settings"] == SETTINGS
    same = store.contexts.context_for(context["doc_id"], MODEL, dict(reversed(list(SETTINGS.items()))))
    assert same["id"] == context["id"]
    other = store.contexts.context_for(context["doc_id"], MODEL, {**SETTINGS, "clusters": 16})
    assert other["id"] != context["id"]
    third = store.contexts.context_for(context["doc_id"], "other-model", SETTINGS)
    assert third["id"] not in {context["id"], other["id"]}
    with pytest.raises(NotFoundError):
        store.contexts.context_for("0" * 16, MODEL, SETTINGS)


def test_artifacts_round_trip_and_ready(store):
    context = new_context(store)
    cid = context["id"]
    tensors = sample_tensors()
    for name, tensor in tensors.items():
        row = store.artifacts.save(cid, name, tensor)
        assert row["shape"] == list(tensor.shape) and row["dtype"] == str(tensor.dtype)[6:]
    loaded = store.artifacts.load(cid)
    assert list(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert_bit_exact(loaded[name], tensor)
    assert list(store.artifacts.load(cid, names=["i64", "bf16"])) == ["i64", "bf16"]
    with pytest.raises(NotFoundError, match="nope"):
        store.artifacts.load(cid, names=["nope"])
    assert temp_files(store.blob_dir) == []

    ready = store.contexts.mark_ready(cid, tokens=1234, required=["f32", "i64"])
    assert (ready["status"], ready["tokens"]) == ("ready", 1234)
    [row] = store.documents.list()
    assert (row["status"], row["tokens"], row["context_id"]) == ("ready", 1234, cid)


def test_save_artifact_overwrites_and_validates(store):
    cid = new_context(store)["id"]
    first = store.artifacts.save(cid, "keys", torch.zeros(2))
    second = store.artifacts.save(cid, "keys", torch.ones(3))
    assert first["path"] != second["path"]  # a fresh file per save; the old one is deleted
    assert [p.name for p in (store.blob_dir / cid).iterdir()] == [second["path"].split("/")[-1]]
    assert torch.equal(store.artifacts.load(cid)["keys"], torch.ones(3))
    assert len(store.artifacts.list(cid)) == 1
    with pytest.raises(ValueError):
        store.artifacts.save(cid, "../escape", torch.zeros(1))
    with pytest.raises(NotFoundError):
        store.artifacts.save("0" * 16, "keys", torch.zeros(1))


def test_damaged_artifact_is_detected_and_named(store):
    cid = new_context(store)["id"]
    store.artifacts.save(cid, "keys", torch.randn(64))
    store.artifacts.save(cid, "values", torch.randn(64))
    path = store.root / store.artifacts.list(cid)[1]["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedArtifactError, match=f"{cid}/values") as err:
        store.artifacts.load(cid)
    assert err.value.artifact == f"{cid}/values" and str(path) in str(err.value)
    assert store.artifacts.load(cid, names=["keys"])["keys"].shape == (64,)  # intact one loads


def test_missing_artifact_blocks_load_and_ready(store):
    cid = new_context(store)["id"]
    store.artifacts.save(cid, "keys", torch.randn(8))
    (store.root / store.artifacts.list(cid)[0]["path"]).unlink()
    with pytest.raises(MissingArtifactError, match=f"{cid}/keys"):
        store.artifacts.load(cid)
    with pytest.raises(MissingArtifactError):
        store.contexts.mark_ready(cid, tokens=8)
    with pytest.raises(MissingArtifactError, match="values"):
        store.contexts.mark_ready(cid, tokens=8, required=["values"])
    assert store.contexts.get(cid)["status"] == "pending"


def test_context_status_rules(store):
    cid = new_context(store)["id"]
    failed = store.contexts.set_status(cid, "failed", error="out of memory")
    assert (failed["status"], failed["error"]) == ("failed", "out of memory")
    running = store.contexts.set_status(cid, "running")
    assert (running["status"], running["error"]) == ("running", None)
    with pytest.raises(ValueError):
        store.contexts.set_status(cid, "ready")  # needs tokens, goes through mark_ready
    assert store.contexts.set_status(cid, "ready", tokens=5)["status"] == "ready"
    with pytest.raises(ValueError):
        store.contexts.set_status(cid, "done")
    with pytest.raises(ValueError):
        store.contexts.mark_ready(cid, tokens=-1)


# --------------------------------------------------------------------------- jobs


def new_job(store: Store, context: dict, **kwargs) -> int:
    return store.jobs.create(context["doc_id"], "notes.txt", MODEL, SETTINGS, context_id=context["id"], **kwargs)


def test_job_lifecycle(store):
    context = new_context(store)
    cid = context["id"]
    assert store.jobs.latest(context_id=cid) is None
    job_id = new_job(store, context, methods=["squeeze"])
    job = store.jobs.get(job_id)
    assert (job["status"], job["stage"], job["done"], job["total"], job["started_at"]) == ("queued", "queued", 0, 0,
                                                                                          None)
    assert (job["settings"], job["methods"], job["truncate"], job["cached"]) == (SETTINGS, ["squeeze"], False, False)
    assert store.jobs.start(job_id)["started_at"] is not None
    job = store.jobs.update(job_id, stage="prefill", done=1, total=4, tokens=40)
    assert (job["status"], job["stage"], job["done"], job["total"], job["tokens"]) == ("running", "prefill", 1, 4, 40)
    done = store.jobs.finish(job_id, context_id=cid, tokens=40, cached=True)
    assert (done["status"], done["stage"], done["cached"], done["finished_at"] is not None) == ("done", "ready", True,
                                                                                                True)
    assert store.jobs.latest(context_id=cid)["id"] == job_id
    assert store.jobs.latest(context_id=cid)["id"] < new_job(store, context) == store.jobs.latest(context_id=cid)["id"]
    with pytest.raises(ValueError):
        store.jobs.update(job_id, done=-1)
    with pytest.raises(ValueError):
        store.jobs.fail(job_id, "boom", kind="paused")
    with pytest.raises(NotFoundError):
        store.jobs.get(10_000)
    with pytest.raises(NotFoundError):
        store.jobs.update(job_id, context_id="0" * 16)


def test_a_job_precedes_its_document_and_context(store):
    """An upload's job exists before extraction: a doc_id without a document row, no context yet."""
    doc = make_doc("uploaded later")
    job_id, created = store.jobs.submit(doc.doc_id, "later.txt", MODEL, SETTINGS, truncate=True)
    assert created and store.jobs.get(job_id)["context_id"] is None and store.jobs.get(job_id)["truncate"]
    failed = store.jobs.fail(job_id, "later.txt: not a PDF", kind="document")
    assert (failed["status"], failed["stage"], failed["error_kind"]) == ("failed", "failed", "document")
    job_id, _ = store.jobs.submit(doc.doc_id, "later.txt", MODEL, SETTINGS)
    store.documents.add(doc)
    context = store.contexts.context_for(doc.doc_id, MODEL, SETTINGS)
    job = store.jobs.update(job_id, context_id=context["id"], chars=14, pages=1)
    assert (job["context_id"], job["chars"], job["pages"]) == (context["id"], 14, 1)
    store.documents.delete(doc.doc_id)  # with every job of the document, with or without a context
    assert store.jobs.latest(doc_id=doc.doc_id) is None


def test_submit_reuses_an_identical_active_job(store):
    doc_id = make_doc().doc_id
    first, created = store.jobs.submit(doc_id, "a.txt", MODEL, SETTINGS, methods=["squeeze"])
    assert created
    same = dict(reversed(list(SETTINGS.items())))  # the same settings, in another order
    assert store.jobs.submit(doc_id, "a.txt", MODEL, same, methods=["squeeze"]) == (first, False)
    others = [store.jobs.submit(doc_id, "a.txt", MODEL, {**SETTINGS, "clusters": 4})[0],
              store.jobs.submit(doc_id, "a.txt", MODEL, SETTINGS, methods=["quest"])[0],
              store.jobs.submit(doc_id, "a.txt", "other-model", SETTINGS, methods=["squeeze"])[0]]
    assert first not in others and len(set(others)) == 3
    store.jobs.fail(first, "boom")
    again, created = store.jobs.submit(doc_id, "a.txt", MODEL, SETTINGS, methods=["squeeze"])
    assert created and again != first  # a finished job is history, not reused


def test_list_jobs_active_and_recent(store):
    doc_id = make_doc().doc_id
    assert store.jobs.last_id() == 0
    old = store.jobs.create(doc_id, "old.txt", MODEL, SETTINGS)
    waiting = store.jobs.create(doc_id, "waiting.txt", MODEL, SETTINGS)  # active: listed whenever it was created
    store.jobs.fail(old, "boom")
    after = store.jobs.last_id()
    assert after == waiting
    recent = [store.jobs.create(doc_id, f"{i}.txt", MODEL, SETTINGS) for i in range(3)]
    for job_id in recent:
        store.jobs.fail(job_id, "boom")
    other = store.jobs.create(doc_id, "other.txt", "other-model", SETTINGS)
    assert [j["id"] for j in store.jobs.list(model=MODEL)] == [old, waiting, *recent]
    assert [j["id"] for j in store.jobs.list(model=MODEL, after=after)] == [waiting, *recent]
    assert [j["id"] for j in store.jobs.list(model=MODEL, after=after, limit=1)] == [waiting, recent[-1]]
    assert store.jobs.latest(doc_id=doc_id, model=MODEL, settings=SETTINGS)["id"] == recent[-1]
    assert store.jobs.latest(doc_id=doc_id, model=MODEL, settings={"x": 1}) is None
    assert store.jobs.latest(doc_id=doc_id, model="other-model", after=store.jobs.last_id())["id"] == other  # active
    store.jobs.fail(other, "boom")
    assert store.jobs.latest(doc_id=doc_id, model="other-model", after=store.jobs.last_id()) is None


def test_interrupted_ingest_leaves_no_context_ready(store):
    context = new_context(store)
    cid = context["id"]
    store.contexts.set_status(cid, "running")
    job_id = new_job(store, context)
    store.jobs.start(job_id)
    store.jobs.update(job_id, stage="prefill", done=2, total=4)
    upload, _ = store.jobs.submit("f" * 16, "upload.txt", MODEL, SETTINGS)  # never extracted: no context
    store.artifacts.save(cid, "keys", torch.randn(4, 8))  # ...and the process dies before mark_ready
    assert store.jobs.recover_interrupted() == 0  # the jobs' pid (this process) is alive
    assert store.jobs.recover_interrupted(all=True) == 2
    job, context = store.jobs.get(job_id), store.contexts.get(cid)
    assert (job["status"], job["error"], job["finished_at"] is not None) == ("failed", "interrupted", True)
    assert (context["status"], context["error"]) == ("failed", "interrupted")
    assert store.jobs.get(upload)["status"] == "failed"
    assert store.documents.list()[0]["status"] == "failed"
    assert store.jobs.recover_interrupted(all=True) == 0


def test_recover_fails_jobs_of_dead_processes_only(store):
    ready = new_context(store, "ready doc")
    store.contexts.mark_ready(ready["id"], tokens=3)
    busy = new_context(store, "live doc")
    dead_job, ready_job = new_job(store, busy), new_job(store, ready)
    live_job = new_job(store, busy)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now free: a job "owned" by it can never finish
    with store.transaction() as db:
        db.execute(
            "UPDATE jobs SET status = 'running', pid = ? WHERE id IN (?, ?)",
            [child.pid, dead_job, ready_job],
        )
    assert store.jobs.recover_interrupted() == 2
    statuses = [store.jobs.get(j)["status"] for j in (dead_job, ready_job, live_job)]
    assert statuses == ["failed", "failed", "queued"]
    assert store.contexts.get(ready["id"])["status"] == "ready"  # a ready context stays ready
    assert store.contexts.get(busy["id"])["status"] == "failed"


# --------------------------------------------------------------------------- chats, delete


def test_chats_and_turns(store):
    context = new_context(store)
    doc_id, cid = context["doc_id"], context["id"]
    chat_id = store.chats.create(doc_id, cid)
    stats = {"ms": 12.5, "n": torch.tensor(3)}
    first = store.chats.add_turn(chat_id, "What is it about?\n", "Fruit.", "squeezed", 0.9, stats)
    store.chats.add_turn(chat_id, "And then?", "Cherries.", "dense", None, {})
    turns = store.chats.turns(chat_id)
    assert [t["idx"] for t in turns] == [0, 1] and turns[0]["id"] == first
    assert turns[0]["stats"] == {"ms": 12.5, "n": 3} and turns[1]["sparsity"] is None
    [chat] = store.chats.list(doc_id)
    assert (chat["id"], chat["context_id"], chat["turn_count"]) == (chat_id, cid, 2)
    assert chat["title"] == "What is it about?"  # untitled: named after the first question
    other = new_context(store, "another document")
    with pytest.raises(ValueError):
        store.chats.create(doc_id, other["id"])
    with pytest.raises(NotFoundError):
        store.chats.add_turn(10_000, "q", "a", None, None, {})


def test_chats_are_listed_per_owner(store):
    """A chat belongs to the owner that started it: listed for that owner only (None: chats without one); every
    owner's without the argument."""
    context = new_context(store)
    doc_id, cid = context["doc_id"], context["id"]
    a1 = store.chats.create(doc_id, cid, owner="browser-a")
    b1 = store.chats.create(doc_id, cid, owner="browser-b")
    a2 = store.chats.create(doc_id, cid, owner="browser-a")
    cli = store.chats.create(doc_id, cid)
    assert [c["id"] for c in store.chats.list(doc_id, "browser-a")] == [a2, a1]
    assert [c["id"] for c in store.chats.list(doc_id, "browser-b")] == [b1]
    assert [c["id"] for c in store.chats.list(doc_id, None)] == [cli]
    assert store.chats.list(doc_id, "nobody") == []
    assert {c["id"] for c in store.chats.list(doc_id)} == {a1, b1, a2, cli}
    assert store.chats.get(b1)["owner"] == "browser-b"


def test_delete_document_removes_rows_and_blob_files(store):
    context = new_context(store)
    doc_id, cid = context["doc_id"], context["id"]
    keep = new_context(store, "keep me")
    store.artifacts.save(cid, "keys", torch.randn(8))
    store.artifacts.save(keep["id"], "keys", torch.randn(8))
    store.chats.add_turn(store.chats.create(doc_id, cid), "q", "a", None, None, {})
    new_job(store, context)
    files = [store.root / a["path"] for a in store.artifacts.list(cid)]
    assert all(f.exists() for f in files)

    store.documents.delete(doc_id)
    assert not any(f.exists() for f in files) and not (store.blob_dir / cid).exists()
    for lookup in (lambda: store.documents.get(doc_id), lambda: store.contexts.get(cid)):
        with pytest.raises(NotFoundError):
            lookup()
    assert store.chats.list(doc_id) == [] and store.jobs.latest(context_id=cid) is None
    assert [d["id"] for d in store.documents.list()] == [keep["doc_id"]]
    assert store.artifacts.load(keep["id"])["keys"].shape == (8,)
    with pytest.raises(NotFoundError):
        store.documents.delete(doc_id)


def test_remove_orphan_files(store):
    cid = new_context(store)["id"]
    store.artifacts.save(cid, "keys", torch.arange(3))
    orphan = store.blob_dir / cid / "keys.deadbeef.safetensors"  # written, never indexed
    orphan.write_bytes(b"x")
    stray = store.blob_dir / "0123456789abcdef" / f".keys.abc{TEMP_SUFFIX}"  # a crashed write
    stray.parent.mkdir()
    stray.write_bytes(b"y")
    assert store.remove_orphan_files() == 2
    assert not orphan.exists() and not stray.parent.exists()
    assert torch.equal(store.artifacts.load(cid)["keys"], torch.arange(3))


# --------------------------------------------------------------------------- method builds


def test_method_builds_round_trip(store):
    cid = new_context(store)["id"]
    assert store.methods.get(cid, "quest") is None and store.methods.list(cid) == []
    built = store.methods.mark_built(cid, "quest", {"page_size": 16, "calib": [1, 2]})
    assert (built["method"], built["settings"]) == ("quest", {"page_size": 16, "calib": [1, 2]})
    store.methods.mark_built(cid, "squeeze", {"centroid_ratio": 0.05})
    store.methods.mark_built(cid, "quest", {"page_size": 32})  # rebuilt with other settings: replaces the row
    assert [(b["method"], b["settings"]) for b in store.methods.list(cid)] == [
        ("quest", {"page_size": 32}), ("squeeze", {"centroid_ratio": 0.05})]
    assert store.methods.get(cid, "quest")["built_at"] is not None
    with pytest.raises(NotFoundError):
        store.methods.mark_built("0" * 16, "quest", {})
    with pytest.raises(ValueError):
        store.methods.mark_built(cid, "a.b", {})  # a dot would blur the artifacts' "{method}." prefix


def test_remove_method_build_deletes_only_its_artifacts(store):
    cid = new_context(store)["id"]
    for name in ("offsets", "quest.layer3.page_min", "quest.calib.x", "quest_v2.layer3.x", "squeeze.layer3.keys"):
        store.artifacts.save(cid, name, torch.arange(3))
    store.methods.mark_built(cid, "quest", {"page_size": 16})
    store.methods.mark_built(cid, "squeeze", {})
    quest_files = [store.root / a["path"] for a in store.artifacts.list(cid) if a["name"].startswith("quest.")]
    assert store.methods.remove(cid, "quest") == 2
    assert not any(f.exists() for f in quest_files)
    assert [a["name"] for a in store.artifacts.list(cid)] == ["offsets", "quest_v2.layer3.x", "squeeze.layer3.keys"]
    assert store.methods.get(cid, "quest") is None and store.methods.get(cid, "squeeze") is not None
    assert store.methods.remove(cid, "quest") == 0  # nothing left: a no-op
    store.artifacts.save(cid, "quest.layer0.page_max", torch.ones(2))  # an unfinished build, no row
    assert store.methods.remove(cid, "quest") == 1
    assert torch.equal(store.artifacts.load(cid, ["squeeze.layer3.keys"])["squeeze.layer3.keys"], torch.arange(3))
    with pytest.raises(NotFoundError):
        store.methods.remove("0" * 16, "quest")


def test_method_builds_go_with_their_document(store):
    context = new_context(store)
    store.artifacts.save(context["id"], "quest.layer0.page_min", torch.zeros(2))
    store.methods.mark_built(context["id"], "quest", {})
    store.documents.delete(context["doc_id"])
    with store.transaction() as db:
        assert db.execute("SELECT COUNT(*) FROM method_builds").fetchone()[0] == 0


# --------------------------------------------------------------------------- model-level artifacts

GATES = {"threshold": 0.5, "layers": [0, 3]}


def test_model_artifacts_round_trip(store):
    assert store.models.load(MODEL, "duo", GATES) == {} and store.models.names(MODEL, "duo", GATES) == []
    tensors = sample_tensors()
    for name, tensor in tensors.items():
        row = store.models.save(MODEL, "duo", GATES, name, tensor)
        assert row["shape"] == list(tensor.shape) and row["settings"] == GATES
        assert row["path"].startswith("blobs/models/")
    loaded = store.models.load(MODEL, "duo", dict(reversed(list(GATES.items()))))  # same settings, other order
    assert sorted(loaded) == sorted(tensors) == store.models.names(MODEL, "duo", GATES)
    for name, tensor in tensors.items():
        assert_bit_exact(loaded[name], tensor)
    # other settings, method or model: another set
    assert store.models.load(MODEL, "duo", {**GATES, "threshold": 0.6}) == {}
    assert store.models.load(MODEL, "other", GATES) == {} and store.models.load("m2", "duo", GATES) == {}
    first = store.models.save(MODEL, "duo", GATES, "f32", torch.ones(2))  # replaced: the old file goes
    assert [p.name for p in (store.root / first["path"]).parent.iterdir() if p.name.startswith("f32.")] == [
        first["path"].split("/")[-1]]
    with pytest.raises(ValueError):
        store.models.save(MODEL, "duo", GATES, "../escape", torch.zeros(1))
    with pytest.raises(TypeError):
        store.models.save(MODEL, "duo", GATES, "x", [1, 2])
    assert temp_files(store.blob_dir) == []


def test_model_artifacts_are_verified_and_removed_per_method(store):
    store.models.save(MODEL, "duo", GATES, "gates", torch.randn(16))
    store.models.save(MODEL, "duo", {"threshold": 0.9}, "gates", torch.randn(16))
    store.models.save(MODEL, "razor", {}, "heads", torch.randn(4))
    [row] = [r for r in store.models.list(MODEL, "duo", GATES)]
    path = store.root / row["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedArtifactError, match=f"{MODEL}/duo/gates"):
        store.models.load(MODEL, "duo", GATES)
    path.unlink()
    with pytest.raises(MissingArtifactError, match=f"{MODEL}/duo/gates"):
        store.models.load(MODEL, "duo", GATES)
    store.models.save(MODEL, "duo", {"threshold": 0.5}, "gates", torch.randn(16))
    assert store.models.remove(MODEL, "duo", {"threshold": 0.5}) == 1  # one set: the others stay
    assert list(store.models.load(MODEL, "duo", {"threshold": 0.9})) == ["gates"]
    assert store.models.remove(MODEL, "duo") == 2  # every settings of the method
    assert store.models.load(MODEL, "duo", {"threshold": 0.9}) == {}
    assert not path.parent.exists()  # its emptied folder goes too
    assert list(store.models.load(MODEL, "razor", {})) == ["heads"]


def test_model_artifacts_outlive_documents_and_orphan_sweeps(store):
    context = new_context(store)
    store.models.save(MODEL, "duo", GATES, "gates", torch.arange(4))
    store.documents.delete(context["doc_id"])
    assert store.remove_orphan_files() == 0
    assert torch.equal(store.models.load(MODEL, "duo", GATES)["gates"], torch.arange(4))


# --------------------------------------------------------------------------- evaluations


def eval_doc(model: str = MODEL, budget: float = 0.1, **extra) -> dict:
    """An evaluation document of the shape `squeeze eval` writes (with a key the store does not know)."""
    row = {"method": "squeeze", "budget": budget, "needles": 0.5, "recall": 0.91, "oracle": 0.97, "top1": None,
           "kl": float("nan"), "read_prefill": 0.101, "read_decode": 0.099}
    return {"bench": "eval", "model": model, "device": "cpu", "methods": ["squeeze"], "budgets": [budget],
            "created": "2025-01-02T03:04:05+00:00", "seconds": 81.5, "summary": [row],
            "full": {"needles_found": 6, "needles_cells": 6}, "needles": {"cells": []}, "opaque": [1, {"x": 2}],
            **extra}


def test_evals_round_trip_newest_first_per_model(store):
    assert store.evals.latest(MODEL) is None and store.evals.list() == []
    first = store.evals.add(MODEL, eval_doc(budget=0.1))
    other = store.evals.add("m2", eval_doc("m2", budget=0.2))
    newest = store.evals.add(MODEL, eval_doc(budget=0.3))
    assert first < other < newest
    latest = store.evals.latest(MODEL)
    kl = latest["summary"][0].pop("kl")
    assert kl != kl  # NaN comes back as NaN
    expected = eval_doc(budget=0.3)
    del expected["summary"][0]["kl"]
    assert latest == expected  # the whole document, unknown keys included
    assert store.evals.latest("m2")["budgets"] == [0.2] and store.evals.latest("m3") is None
    assert store.evals.get(first)["budgets"] == [0.1]
    listed = store.evals.list(MODEL)
    assert [r["id"] for r in listed] == [newest, first] and all(r["model"] == MODEL for r in listed)
    assert set(listed[0]) == {"id", "model", "created_at", "summary"} and listed[0]["summary"][0]["budget"] == 0.3
    assert [r["id"] for r in store.evals.list()] == [newest, other, first]
    assert listed[0]["created_at"] >= listed[1]["created_at"]
    with pytest.raises(NotFoundError):
        store.evals.get(10_000)
    for model, doc in (("", eval_doc()), (None, eval_doc()), (MODEL, [1]), (MODEL, {"summary": {"a": 1}})):
        with pytest.raises(ValueError):
            store.evals.add(model, doc)
    with pytest.raises(TypeError):
        store.evals.add(MODEL, {"summary": [], "bad": object()})
    assert len(store.evals.list()) == 3  # nothing stored by the refused ones


# --------------------------------------------------------------------------- migrations


def test_a_version_1_index_is_migrated_with_its_jobs(tmp_path, monkeypatch):
    import storage.database

    monkeypatch.setattr(storage.database, "MIGRATIONS", MIGRATIONS[:1])
    monkeypatch.setattr(storage.database, "SCHEMA_VERSION", 1)
    with Store(tmp_path) as old:
        context = new_context(old)
        with old.transaction() as db:
            db.table("jobs").insert({"context_id": context["id"], "status": "running", "stage": "prefill",
                                     "progress": 0.25, "pid": 1, "created_at": "t0", "updated_at": "t1"})
            db.table("jobs").insert({"context_id": context["id"], "status": "done", "progress": 1.0,
                                     "created_at": "t2", "updated_at": "t3"})
        assert old.schema_version() == 1
    monkeypatch.undo()
    with Store(tmp_path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        running, done = (store.jobs.get(i) for i in (1, 2))
        assert (running["doc_id"], running["name"], running["model"], running["settings"]) == (
            context["doc_id"], "notes.txt", MODEL, SETTINGS)
        assert (running["status"], running["stage"], running["done"], running["total"]) == ("running", "prefill",
                                                                                            25, 100)
        assert (running["finished_at"], done["finished_at"], done["stage"]) == (None, "t3", "queued")
        assert store.methods.list(context["id"]) == []
        assert store.jobs.create(context["doc_id"], "n", MODEL, SETTINGS) == 3  # the ids go on


def test_a_version_3_index_gains_evals_and_keeps_its_rows(tmp_path, monkeypatch):
    import storage.database

    monkeypatch.setattr(storage.database, "MIGRATIONS", MIGRATIONS[:3])
    monkeypatch.setattr(storage.database, "SCHEMA_VERSION", 3)
    with Store(tmp_path) as old:
        context = new_context(old)
        chat_id = old.chats.create(context["doc_id"], context["id"])
        old.chats.add_turn(chat_id, "q", "a", "squeeze", 0.9, {"ms": 1.0})
        with old.transaction() as db:
            assert "evals" not in db.table_names()
    monkeypatch.undo()
    with Store(tmp_path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert [t["answer"] for t in store.chats.turns(chat_id)] == ["a"]
        assert store.evals.latest(MODEL) is None
        eval_id = store.evals.add(MODEL, eval_doc())
    with Store(tmp_path) as store:  # kept on disk
        assert store.evals.list(MODEL)[0]["id"] == eval_id and store.evals.latest(MODEL)["bench"] == "eval"


def test_a_version_7_index_leaves_page_furniture_out_of_its_pdfs(tmp_path, monkeypatch):
    """A PDF stored with its page furniture gets the text and page map extraction makes now; its contexts (made
    from the old text) go, their files at the next clean-up, while its chats and jobs stay without them. A PDF
    without furniture and a text file keep their text and contexts."""
    import storage.database
    from storage.documents import PAGE_SEPARATOR, Document

    bodies = ["1 Scope\nThe widget bus carries frames.", "2 Frames\nA frame holds 64 bytes.",
              "3 Timing\nA node answers in 250 us.", "4 Errors\nA node resets after 3 misses."]
    pages = [f"Widget Bus Specification\n{body}\n{n}" for n, body in enumerate(bodies, start=1)]
    starts = tuple(sum(len(p) + len(PAGE_SEPARATOR) for p in pages[:i]) for i in range(len(pages)))
    furnished = Document(name="spec.pdf", kind="pdf", text=PAGE_SEPARATOR.join(pages), page_starts=starts,
                         sha256="1" * 64)  # as extraction stored it before
    clean = load_document_bytes(make_text_pdf(bodies[:2]), "clean.pdf")
    monkeypatch.setattr(storage.database, "MIGRATIONS", MIGRATIONS[:7])
    monkeypatch.setattr(storage.database, "SCHEMA_VERSION", 7)
    with Store(tmp_path) as old:
        spec_id, _ = old.documents.add(furnished)
        context = old.contexts.context_for(spec_id, MODEL, SETTINGS)
        path = old.root / old.artifacts.save(context["id"], "offsets", torch.zeros(3, 2))["path"]
        old.contexts.mark_ready(context["id"], 3)
        chat_id = old.chats.create(spec_id, context["id"])
        job_id = old.jobs.create(spec_id, "spec.pdf", MODEL, SETTINGS, context_id=context["id"])
        kept = [old.contexts.context_for(old.documents.add(d)[0], MODEL, SETTINGS)["id"]
                for d in (clean, make_doc("Page 1\n\nhello"))]
    monkeypatch.undo()
    with Store(tmp_path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        doc = store.documents.get(spec_id)
        assert doc.text == PAGE_SEPARATOR.join(bodies)
        assert [doc.text[s:s + len(b)] for s, b in zip(doc.page_starts, bodies)] == bodies
        assert store.documents.find(spec_id)["chars"] == len(doc.text)
        assert store.contexts.list(spec_id) == []
        assert store.chats.get(chat_id)["context_id"] is None and store.jobs.get(job_id)["context_id"] is None
        assert [store.contexts.get(c)["id"] for c in kept] == kept
        assert path.exists() and store.remove_orphan_files() == 1 and not path.exists()


def test_a_version_8_index_keeps_its_documents_without_their_files(tmp_path, monkeypatch):
    """Documents stored before original files were kept have none (their views show no PDF link); an upload of
    the same PDF again keeps its file."""
    import storage.database

    data = make_text_pdf(["The secret passkey is 48213."])
    pdf = load_document_bytes(data, "keeper.pdf")
    monkeypatch.setattr(storage.database, "MIGRATIONS", MIGRATIONS[:8])
    monkeypatch.setattr(storage.database, "SCHEMA_VERSION", 8)
    with Store(tmp_path) as old:
        doc_id, _ = old.documents.add(pdf)
        with old.transaction() as db:
            assert "source_path" not in db.table("documents").columns_dict
    monkeypatch.undo()
    with Store(tmp_path) as store:
        assert store.schema_version() == SCHEMA_VERSION == 9
        assert store.documents.get(doc_id) == pdf
        assert store.documents.source(doc_id) is None and store.documents.source_file(doc_id) is None
        store.documents.add(pdf, source=data)
    with Store(tmp_path) as store:  # kept on disk
        assert store.documents.source(doc_id) == data


def test_a_failed_migration_changes_nothing(tmp_path, monkeypatch):
    import storage.database

    with Store(tmp_path):
        pass
    broken = (SCHEMA_VERSION + 1, "CREATE TABLE half_done (x INTEGER);\nINSERT INTO no_such_table VALUES (1);")
    monkeypatch.setattr(storage.database, "MIGRATIONS", (*MIGRATIONS, broken))
    monkeypatch.setattr(storage.database, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(Exception, match="no_such_table"):
        Store(tmp_path)
    monkeypatch.undo()
    with Store(tmp_path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        with store.transaction() as db:
            assert "half_done" not in db.table_names()


# --------------------------------------------------------------------------- transactions, threads


def test_transaction_rolls_back_on_error(store):
    cid = new_context(store)["id"]
    with pytest.raises(RuntimeError):
        with store.transaction() as db:
            db.execute("UPDATE contexts SET status = 'failed' WHERE id = ?", [cid])
            raise RuntimeError("boom")
    assert store.contexts.get(cid)["status"] == "pending"


def test_disk_store_persists_migrates_and_uses_wal(tmp_path):
    with Store(tmp_path) as store:
        cid = new_context(store)["id"]
        store.artifacts.save(cid, "keys", torch.arange(5))
        store.contexts.mark_ready(cid, tokens=5)
        assert store.schema_version() == SCHEMA_VERSION
        with store.transaction() as db:
            assert db.journal_mode == "wal"
    assert (tmp_path / "index.db").exists() and (tmp_path / "blobs").is_dir()
    with Store(tmp_path) as store:
        assert store.contexts.get(cid)["status"] == "ready"
        assert torch.equal(store.artifacts.load(cid)["keys"], torch.arange(5))
        with store.transaction() as db:
            db.table("schema_version").insert({"version": 99, "applied_at": "later"})
    with pytest.raises(StorageError, match="newer"):
        Store(tmp_path)


def test_store_needs_exactly_one_of_root_or_memory(tmp_path):
    with pytest.raises(ValueError):
        Store()
    with pytest.raises(ValueError):
        Store(tmp_path, memory=True)
    store = Store(memory=True)
    root = store.root
    store.close()
    assert not root.exists()
    with pytest.raises(StorageError, match="closed"):
        store.documents.list()


def test_concurrent_turns_from_many_threads(store):
    context = new_context(store)
    chat_id = store.chats.create(context["doc_id"], context["id"])
    threads_n, turns_n = 8, 20
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n + 1)

    def writer(worker: int) -> None:
        try:
            barrier.wait()
            for i in range(turns_n):
                store.chats.add_turn(chat_id, f"q{worker}.{i}", "a", "dense", 0.0, {"worker": worker})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            barrier.wait()
            for _ in range(turns_n):
                turns = store.chats.turns(chat_id)
                assert [t["idx"] for t in turns] == list(range(len(turns)))
                store.documents.list()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(threads_n - 1)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    assert errors == []
    turns = store.chats.turns(chat_id)
    assert [t["idx"] for t in turns] == list(range((threads_n - 1) * turns_n))
    assert len({t["question"] for t in turns}) == len(turns)


def test_a_read_only_cache_lists_and_reads_and_refuses_writes_in_plain_words(tmp_path, monkeypatch, capsys):
    """A cache this process may not write (a read-only mount, another user's files: os.access says so; root ignores
    permissions, so the test tells it) opens read-only: documents and contexts list and read, `squeeze list` works,
    and a write is refused with what to do, not "unable to open database file"."""
    import json as json_module
    import os

    import storage.database
    from app.cli import main

    with Store(tmp_path) as store:
        context = new_context(store)
        store.artifacts.save(context["id"], "keys", torch.randn(8))
    monkeypatch.setattr(storage.database.os, "access", lambda path, mode: not mode & os.W_OK)
    with Store(tmp_path) as store:
        assert store.database.read_only
        assert [d["name"] for d in store.documents.list()] == ["notes.txt"]
        assert store.artifacts.load(context["id"])["keys"].shape == (8,)
        assert store.jobs.recover_interrupted() == 0 and store.remove_orphan_files() == 0
        with pytest.raises(StorageError, match="read-only here: listing and reading work"):
            store.documents.hide(context["doc_id"])
    assert main(["list", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert [d["name"] for d in json_module.loads(capsys.readouterr().out)] == ["notes.txt"]


def test_a_damaged_index_is_refused_at_open_with_what_to_do(tmp_path):
    """Bytes of index.db overwritten (a disk fault, a bad copy): opening the cache fails at once with a plain line
    that says what to do, not "database disk image is malformed" from some later query or write."""
    with Store(tmp_path) as store:
        for i in range(40):  # a few pages of rows
            new_context(store, text=f"note {i} " * 50)
    index = tmp_path / "index.db"
    data = bytearray(index.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page : 3 * page] = b"\xa5" * page  # a whole b-tree page garbled
    index.write_bytes(bytes(data))
    with pytest.raises(StorageError, match=r"index\.db is damaged .* `squeeze repair --cache-dir .*` rebuilds it"):
        Store(tmp_path)


def _filled_cache(root, documents: int = 40) -> None:
    """A cache with `documents` documents, each a context and a chat of two turns (a few pages of each table)."""
    with Store(root) as store:
        for i in range(documents):
            context = new_context(store, text=f"note {i} " * 50)
            chat = store.chats.create(context["doc_id"], context["id"])
            for t in range(2):
                store.chats.add_turn(chat, f"question {i}.{t}?", f"answer {i}.{t} " * 20, "squeeze", 0.9, {"n": t})


def _rows(path, table: str) -> list[tuple]:
    import sqlite3

    with sqlite3.connect(path) as conn:
        return conn.execute(f'SELECT * FROM "{table}" ORDER BY rowid').fetchall()


def test_an_intact_index_salvaged_keeps_every_row(tmp_path):
    """The salvage of an index nothing damaged copies every row of every table as it was (the reference case of
    the salvage: the same rows, ids included), keeps the old file beside it, and the cache opens as before."""
    _filled_cache(tmp_path, documents=5)
    report = salvage_index(tmp_path)
    assert report.damaged.is_file() and report.damaged.name.startswith("index.db.damaged-")
    assert sum(report.lost.values()) == 0 and report.copied["documents"] == 5 and report.copied["turns"] == 10
    for table in ("documents", "contexts", "chats", "turns", "jobs", "artifacts"):
        assert _rows(tmp_path / "index.db", table) == _rows(report.damaged, table), table
    with Store(tmp_path) as store:
        assert len(store.documents.list()) == 5
    assert "documents: 5 kept" in report.lines()


def test_a_salvage_that_fails_puts_the_damaged_index_back(tmp_path, monkeypatch):
    """A salvage stopped by an error (here: the fresh index cannot be made) leaves the damaged index where it was,
    nothing in its place, so the cache still refuses to open rather than opening empty."""
    import storage.salvage

    _filled_cache(tmp_path, documents=2)
    before = (tmp_path / "index.db").read_bytes()

    def no_database(root):
        raise StorageError("disk full")

    monkeypatch.setattr(storage.salvage, "Database", no_database)
    with pytest.raises(StorageError, match="disk full"):
        salvage_index(tmp_path)
    assert (tmp_path / "index.db").read_bytes() == before
    assert not list(tmp_path.glob("index.db.damaged-*"))


def test_a_damaged_index_is_rebuilt_from_the_rows_it_can_read(tmp_path, capsys):
    """A garbled page of index.db: `squeeze repair` keeps every row it can still read, drops the rows whose parent
    was lost (a chat without its document), keeps the damaged file, and the cache opens, lists and reads again."""
    import sqlite3

    from app.cli import main

    _filled_cache(tmp_path)
    index = tmp_path / "index.db"
    before = {t: len(_rows(index, t)) for t in ("documents", "contexts", "chats", "turns")}
    data = bytearray(index.read_bytes())
    page = 4096
    hit = data.index(b"note 20 note 20") // page  # a leaf page of the documents table
    data[hit * page : (hit + 1) * page] = b"\xa5" * page  # garbled
    index.write_bytes(bytes(data))
    with pytest.raises(StorageError, match="squeeze repair"):
        Store(tmp_path)
    assert main(["repair", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "the damaged index is kept as" in out and "lost" in out
    damaged = next(p for p in tmp_path.glob("index.db.damaged-*") if not p.name.endswith(("-wal", "-shm")))
    with sqlite3.connect(index) as conn:
        assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    after = {t: len(_rows(index, t)) for t in before}
    assert 0 < after["documents"] < before["documents"]  # the garbled page's documents lost, the others kept
    assert after["chats"] == after["contexts"] == after["documents"]  # a lost document's rows went with it
    assert after["turns"] == 2 * after["chats"]
    with Store(tmp_path) as store:
        docs = store.documents.list()
        assert len(docs) == after["documents"]
        for doc in docs:  # every kept chat's turns read back
            for chat in store.chats.list(doc["id"]):
                assert all(t["question"].startswith("question ") for t in store.chats.turns(chat["id"]))
    assert damaged.stat().st_size == len(data)


def test_many_artifacts_load_at_once_in_the_order_asked(store):
    """A context's files are read and hashed by several threads at once: every tensor comes back under its name, in
    the order asked; of two damaged files the error names the first in that order, whichever thread got to it first."""
    cid = new_context(store)["id"]
    saved = {f"layer{i}.keys": torch.randn(257) + i for i in range(12)}
    for name, tensor in saved.items():
        store.artifacts.save(cid, name, tensor)
    order = list(reversed(saved))
    loaded = store.artifacts.load(cid, names=order)
    assert list(loaded) == order
    for name in order:
        assert torch.equal(loaded[name], saved[name]), name
    rows = {r["name"]: r for r in store.artifacts.list(cid)}
    for name in ("layer3.keys", "layer9.keys"):
        path = store.root / rows[name]["path"]
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(DamagedArtifactError, match=f"{cid}/layer9.keys"):
        store.artifacts.load(cid, names=order)  # layer9 comes before layer3 in this order
    with pytest.raises(DamagedArtifactError, match=f"{cid}/layer3.keys"):
        store.artifacts.load(cid, names=sorted(saved, key=lambda n: int(n[5:-5])))
