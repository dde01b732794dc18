"""storage.blobs and storage.Store: round trips, damage detection, recovery, concurrency."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from pdfs import make_text_pdf

from storage import (
    AmbiguousIdError,
    DamagedArtifactError,
    MissingArtifactError,
    NotFoundError,
    StorageError,
    Store,
    load_document_bytes,
    read_tensors,
    write_tensors,
)
from storage.blobs import TEMP_SUFFIX

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
    doc_id, _ = store.add_document(make_doc(text))
    return store.context_for(doc_id, MODEL, SETTINGS)


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
    doc_id, created = store.add_document(doc)
    assert (doc_id, created) == (doc.doc_id, True)
    assert store.get_document(doc_id) == doc
    again = load_document_bytes(make_text_pdf(["page one", "page two"]), "renamed.pdf")
    assert store.add_document(again) == (doc_id, False)
    [row] = store.list_documents()
    assert (row["id"], row["name"], row["pages"]) == (doc_id, "two.pdf", 2)
    assert row["chars"] == len(doc.text)
    assert (row["status"], row["tokens"], row["context_id"]) == (None, None, None)


def test_find_document(store):
    a, _ = store.add_document(make_doc("alpha", "same.txt"))
    b, _ = store.add_document(make_doc("beta", "same.txt"))
    c, _ = store.add_document(make_doc("gamma", "other.md"))
    assert store.find_document(a)["id"] == a
    assert store.find_document(a[:10].upper())["id"] == a
    assert store.find_document("other.md")["id"] == c
    with pytest.raises(AmbiguousIdError, match="2 documents"):
        store.find_document("same.txt")
    with pytest.raises(NotFoundError):
        store.find_document("nope")
    with pytest.raises(NotFoundError):
        store.get_document("0" * 16)
    assert {d["id"] for d in store.list_documents()} == {a, b, c}


# --------------------------------------------------------------------------- contexts & artifacts


def test_context_for_is_keyed_by_doc_model_and_settings(store):
    context = new_context(store)
    assert context["status"] == "pending" and context["settings"] == SETTINGS
    same = store.context_for(context["doc_id"], MODEL, dict(reversed(list(SETTINGS.items()))))
    assert same["id"] == context["id"]
    other = store.context_for(context["doc_id"], MODEL, {**SETTINGS, "clusters": 16})
    assert other["id"] != context["id"]
    third = store.context_for(context["doc_id"], "other-model", SETTINGS)
    assert third["id"] not in {context["id"], other["id"]}
    with pytest.raises(NotFoundError):
        store.context_for("0" * 16, MODEL, SETTINGS)


def test_artifacts_round_trip_and_ready(store):
    context = new_context(store)
    cid = context["id"]
    tensors = sample_tensors()
    for name, tensor in tensors.items():
        row = store.save_artifact(cid, name, tensor)
        assert row["shape"] == list(tensor.shape) and row["dtype"] == str(tensor.dtype)[6:]
    loaded = store.load_artifacts(cid)
    assert list(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert_bit_exact(loaded[name], tensor)
    assert list(store.load_artifacts(cid, names=["i64", "bf16"])) == ["i64", "bf16"]
    with pytest.raises(NotFoundError, match="nope"):
        store.load_artifacts(cid, names=["nope"])
    assert temp_files(store.blob_dir) == []

    ready = store.mark_ready(cid, tokens=1234, required=["f32", "i64"])
    assert (ready["status"], ready["tokens"]) == ("ready", 1234)
    [row] = store.list_documents()
    assert (row["status"], row["tokens"], row["context_id"]) == ("ready", 1234, cid)


def test_save_artifact_overwrites_and_validates(store):
    cid = new_context(store)["id"]
    first = store.save_artifact(cid, "keys", torch.zeros(2))
    second = store.save_artifact(cid, "keys", torch.ones(3))
    assert first["path"] != second["path"]  # a fresh file per save; the old one is deleted
    assert [p.name for p in (store.blob_dir / cid).iterdir()] == [second["path"].split("/")[-1]]
    assert torch.equal(store.load_artifacts(cid)["keys"], torch.ones(3))
    assert len(store.list_artifacts(cid)) == 1
    with pytest.raises(ValueError):
        store.save_artifact(cid, "../escape", torch.zeros(1))
    with pytest.raises(NotFoundError):
        store.save_artifact("0" * 16, "keys", torch.zeros(1))


def test_damaged_artifact_is_detected_and_named(store):
    cid = new_context(store)["id"]
    store.save_artifact(cid, "keys", torch.randn(64))
    store.save_artifact(cid, "values", torch.randn(64))
    path = store.root / store.list_artifacts(cid)[1]["path"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedArtifactError, match=f"{cid}/values") as err:
        store.load_artifacts(cid)
    assert err.value.artifact == f"{cid}/values" and str(path) in str(err.value)
    assert store.load_artifacts(cid, names=["keys"])["keys"].shape == (64,)  # intact one loads


def test_missing_artifact_blocks_load_and_ready(store):
    cid = new_context(store)["id"]
    store.save_artifact(cid, "keys", torch.randn(8))
    (store.root / store.list_artifacts(cid)[0]["path"]).unlink()
    with pytest.raises(MissingArtifactError, match=f"{cid}/keys"):
        store.load_artifacts(cid)
    with pytest.raises(MissingArtifactError):
        store.mark_ready(cid, tokens=8)
    with pytest.raises(MissingArtifactError, match="values"):
        store.mark_ready(cid, tokens=8, required=["values"])
    assert store.get_context(cid)["status"] == "pending"


def test_context_status_rules(store):
    cid = new_context(store)["id"]
    failed = store.set_context_status(cid, "failed", error="out of memory")
    assert (failed["status"], failed["error"]) == ("failed", "out of memory")
    running = store.set_context_status(cid, "running")
    assert (running["status"], running["error"]) == ("running", None)
    with pytest.raises(ValueError):
        store.set_context_status(cid, "ready")  # needs tokens, goes through mark_ready
    assert store.set_context_status(cid, "ready", tokens=5)["status"] == "ready"
    with pytest.raises(ValueError):
        store.set_context_status(cid, "done")
    with pytest.raises(ValueError):
        store.mark_ready(cid, tokens=-1)


# --------------------------------------------------------------------------- jobs


def test_job_lifecycle(store):
    cid = new_context(store)["id"]
    assert store.latest_job(cid) is None
    job_id = store.create_job(cid)
    job = store.get_job(job_id)
    assert (job["status"], job["progress"], job["started_at"]) == ("queued", 0.0, None)
    job = store.update_job(job_id, status="running", stage="prefill", progress=0.25, message="1/4")
    assert (job["status"], job["stage"], job["progress"]) == ("running", "prefill", 0.25)
    assert job["message"] == "1/4"
    assert job["started_at"] is not None
    assert store.update_job(job_id, status="done")["progress"] == 1.0
    assert store.latest_job(cid)["id"] == job_id
    assert store.latest_job(cid)["id"] < store.create_job(cid) == store.latest_job(cid)["id"]
    with pytest.raises(ValueError):
        store.update_job(job_id, progress=1.5)
    with pytest.raises(ValueError):
        store.update_job(job_id, status="paused")
    with pytest.raises(NotFoundError):
        store.get_job(10_000)


def test_interrupted_ingest_leaves_no_context_ready(store):
    cid = new_context(store)["id"]
    store.set_context_status(cid, "running")
    job_id = store.create_job(cid)
    store.update_job(job_id, status="running", stage="prefill", progress=0.5)
    store.save_artifact(cid, "keys", torch.randn(4, 8))  # ...and the process dies before mark_ready
    assert store.recover_interrupted() == 0  # the job's pid (this process) is alive
    assert store.recover_interrupted(all=True) == 1
    job, context = store.get_job(job_id), store.get_context(cid)
    assert (job["status"], job["error"]) == ("failed", "interrupted")
    assert (context["status"], context["error"]) == ("failed", "interrupted")
    assert store.list_documents()[0]["status"] == "failed"
    assert store.recover_interrupted(all=True) == 0


def test_recover_fails_jobs_of_dead_processes_only(store):
    ready_cid = new_context(store, "ready doc")["id"]
    store.mark_ready(ready_cid, tokens=3)
    busy_cid = new_context(store, "live doc")["id"]
    dead_job, ready_job = store.create_job(busy_cid), store.create_job(ready_cid)
    live_job = store.create_job(busy_cid)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now free: a job "owned" by it can never finish
    with store.transaction() as db:
        db.execute(
            "UPDATE jobs SET status = 'running', pid = ? WHERE id IN (?, ?)",
            [child.pid, dead_job, ready_job],
        )
    assert store.recover_interrupted() == 2
    statuses = [store.get_job(j)["status"] for j in (dead_job, ready_job, live_job)]
    assert statuses == ["failed", "failed", "queued"]
    assert store.get_context(ready_cid)["status"] == "ready"  # a ready context stays ready
    assert store.get_context(busy_cid)["status"] == "failed"


# --------------------------------------------------------------------------- chats, delete


def test_chats_and_turns(store):
    context = new_context(store)
    doc_id, cid = context["doc_id"], context["id"]
    chat_id = store.create_chat(doc_id, cid)
    stats = {"ms": 12.5, "n": torch.tensor(3)}
    first = store.add_turn(chat_id, "What is it about?\n", "Fruit.", "squeezed", 0.9, stats)
    store.add_turn(chat_id, "And then?", "Cherries.", "dense", None, {})
    turns = store.get_turns(chat_id)
    assert [t["idx"] for t in turns] == [0, 1] and turns[0]["id"] == first
    assert turns[0]["stats"] == {"ms": 12.5, "n": 3} and turns[1]["sparsity"] is None
    [chat] = store.list_chats(doc_id)
    assert (chat["id"], chat["context_id"], chat["turn_count"]) == (chat_id, cid, 2)
    assert chat["title"] == "What is it about?"  # untitled: named after the first question
    other = new_context(store, "another document")
    with pytest.raises(ValueError):
        store.create_chat(doc_id, other["id"])
    with pytest.raises(NotFoundError):
        store.add_turn(10_000, "q", "a", None, None, {})


def test_delete_document_removes_rows_and_blob_files(store):
    context = new_context(store)
    doc_id, cid = context["doc_id"], context["id"]
    keep = new_context(store, "keep me")
    store.save_artifact(cid, "keys", torch.randn(8))
    store.save_artifact(keep["id"], "keys", torch.randn(8))
    store.add_turn(store.create_chat(doc_id, cid), "q", "a", None, None, {})
    store.create_job(cid)
    files = [store.root / a["path"] for a in store.list_artifacts(cid)]
    assert all(f.exists() for f in files)

    store.delete_document(doc_id)
    assert not any(f.exists() for f in files) and not (store.blob_dir / cid).exists()
    for lookup in (lambda: store.get_document(doc_id), lambda: store.get_context(cid)):
        with pytest.raises(NotFoundError):
            lookup()
    assert store.list_chats(doc_id) == [] and store.latest_job(cid) is None
    assert [d["id"] for d in store.list_documents()] == [keep["doc_id"]]
    assert store.load_artifacts(keep["id"])["keys"].shape == (8,)
    with pytest.raises(NotFoundError):
        store.delete_document(doc_id)


def test_remove_orphan_files(store):
    cid = new_context(store)["id"]
    store.save_artifact(cid, "keys", torch.arange(3))
    orphan = store.blob_dir / cid / "keys.deadbeef.safetensors"  # written, never indexed
    orphan.write_bytes(b"x")
    stray = store.blob_dir / "0123456789abcdef" / f".keys.abc{TEMP_SUFFIX}"  # a crashed write
    stray.parent.mkdir()
    stray.write_bytes(b"y")
    assert store.remove_orphan_files() == 2
    assert not orphan.exists() and not stray.parent.exists()
    assert torch.equal(store.load_artifacts(cid)["keys"], torch.arange(3))


# --------------------------------------------------------------------------- transactions, threads


def test_transaction_rolls_back_on_error(store):
    cid = new_context(store)["id"]
    with pytest.raises(RuntimeError):
        with store.transaction() as db:
            db.execute("UPDATE contexts SET status = 'failed' WHERE id = ?", [cid])
            raise RuntimeError("boom")
    assert store.get_context(cid)["status"] == "pending"


def test_disk_store_persists_migrates_and_uses_wal(tmp_path):
    with Store(tmp_path) as store:
        cid = new_context(store)["id"]
        store.save_artifact(cid, "keys", torch.arange(5))
        store.mark_ready(cid, tokens=5)
        assert store.schema_version() == 1
        with store.transaction() as db:
            assert db.journal_mode == "wal"
    assert (tmp_path / "index.db").exists() and (tmp_path / "blobs").is_dir()
    with Store(tmp_path) as store:
        assert store.get_context(cid)["status"] == "ready"
        assert torch.equal(store.load_artifacts(cid)["keys"], torch.arange(5))
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
        store.list_documents()


def test_concurrent_turns_from_many_threads(store):
    context = new_context(store)
    chat_id = store.create_chat(context["doc_id"], context["id"])
    threads_n, turns_n = 8, 20
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads_n + 1)

    def writer(worker: int) -> None:
        try:
            barrier.wait()
            for i in range(turns_n):
                store.add_turn(chat_id, f"q{worker}.{i}", "a", "dense", 0.0, {"worker": worker})
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def reader() -> None:
        try:
            barrier.wait()
            for _ in range(turns_n):
                turns = store.get_turns(chat_id)
                assert [t["idx"] for t in turns] == list(range(len(turns)))
                store.list_documents()
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
    turns = store.get_turns(chat_id)
    assert [t["idx"] for t in turns] == list(range((threads_n - 1) * turns_n))
    assert len({t["question"] for t in turns}) == len(turns)
