"""`squeeze bench users` on a tiny model on the CPU: three browser sessions (gradio_client) over their own
documents ask through the app's HTTP API at once and get the answers they get one after another; the report's
figures are consistent (the first piece before the end, p50 <= p95, every user's tokens counted)."""

from __future__ import annotations

import json
import time

import pytest

from app.bench_users import main
from app.user_session import answer_text
from engine.bench import serve as workload
from tests.support.tiny_models import make_tiny_model


def test_answer_text_is_the_last_assistant_message():
    messages = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    assert answer_text(messages) == "A."
    assert answer_text([["Q?", "B."]]) == "B."
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "C"}, {"type": "text", "text": "D."}]}]
    assert answer_text(parts) == "CD."  # (Gradio 6's messages)
    assert answer_text([]) == "" and answer_text([{"role": "user", "content": "Q?"}]) == ""


@pytest.mark.usefixtures("one_thread")
def test_three_users_through_the_app_get_their_lone_answers(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "model", "llama_gqa")
    out = tmp_path / "users.json"
    assert main(["--model", str(model), "--device", "cpu", "--users", "3", "--tokens", "8", "--batch", "3",
                 "--methods", "squeeze", "--out", str(out)], workload) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["batch"] == 3 and report["documents"] == 3 and set(report["methods"]) == {"squeeze"}
    entry = report["methods"]["squeeze"]
    assert entry["same_answers"] == 3
    together = entry["together"]
    assert together["tokens"] == sum(u["tokens"] for u in entry["per_user"]) > 0
    assert together["first_s_p50"] <= together["first_s_p95"]
    assert all(u["first_s"] <= u["total_s"] for u in entry["per_user"])


def test_a_user_who_cannot_reach_the_app_fails_the_run_at_once():
    """A user's process that fails before its question (no app at the address) breaks the start barrier: the run
    stops with its error instead of waiting for it."""
    from types import SimpleNamespace

    from app.bench_users import USER_START_S, _at_once, controls, free_port

    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="users failed before asking"):
        _at_once(f"http://127.0.0.1:{free_port()}/", [(SimpleNamespace(doc_id="x"), "q?")], controls("full", 8))
    assert time.perf_counter() - start < USER_START_S / 4
