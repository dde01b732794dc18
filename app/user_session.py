"""One simulated user of the app, through its HTTP API (`gradio_client`): what `squeeze bench users`
(app/bench_users.py) runs in a process of its own per user, so that the users' clients take no time from the
server's process. Imports nothing of the project (a user's process loads neither torch nor the app)."""

from __future__ import annotations

import time


def answer_text(chat: list) -> str:
    """The text of the last assistant message of a Chatbot value (messages as dicts whose content is a string or a
    list of parts, Gradio 6's {"type": "text", "text": ...}; or [user, assistant] pairs)."""
    for message in reversed(chat or []):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return content if isinstance(content, str) else ""
        if isinstance(message, (list, tuple)) and len(message) == 2:
            return message[1] or ""
    return ""


def ask(url: str, doc_id: str, question: str, controls: tuple, waiting: str, ready=None) -> dict:
    """A session on `url` opens the document and a new chat, waits for `ready` (anything with .wait(): all users
    at once), then asks. controls: the /ask endpoint's values after the question and the history (method,
    sparsity, the index sliders, compare, answer tokens, temperature, top-p, repetition penalty); waiting: how a
    queued question's place begins in its answer's place. Returns {first_s (to the first piece of answer; its end
    if none), total_s, waited (told its place in the queue), text}, times from the ask."""
    from gradio_client import Client  # noqa: PLC0415 - a user's only dependency

    client = Client(url, verbose=False)
    client.predict(doc_id, controls[0], controls[1], api_name="/open_document")
    client.predict(api_name="/new_chat")
    if ready is not None:
        ready.wait()
    start = time.perf_counter()
    job = client.submit(question, [], *controls, api_name="/ask")
    first, text, waited = None, "", False
    for update in job:
        text = answer_text(update[0]) if update else text
        if text.startswith(waiting):
            waited = True
        elif first is None and text.strip():
            first = time.perf_counter() - start
    text = answer_text(job.result()[0])  # (an error of the app's is raised here)
    total = time.perf_counter() - start
    return {"first_s": round(first if first is not None else total, 4), "total_s": round(total, 4),
            "waited": waited, "text": text.strip()}


def user_process(index: int, url: str, doc_id: str, question: str, controls: tuple, waiting: str, barrier,
                 results) -> None:
    """A user's process: `ask` once the barrier lets every user go; puts (index, its figures) on `results`, or
    (index, {"error": ...}) when the app refused or failed (breaking the barrier first, so that nobody waits for a
    user who will not come)."""
    try:
        results.put((index, ask(url, doc_id, question, controls, waiting, barrier)))
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        barrier.abort()
        results.put((index, {"error": f"{type(exc).__name__}: {exc}"}))
