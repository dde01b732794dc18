"""The Chat tab: pick a document, set the method and sparsity, ask; answers stream in, can be stopped, and are
saved per document; beside them, what attention did in each turn (app.views)."""

from __future__ import annotations

import gradio as gr

from app import render
from app.config import CENTROID_RATIOS, LEVEL1_RATIOS, SPARSITY_MAX, SPARSITY_MIN, index_settings
from app.services import Services, doc_choices, doc_status, library_rows
from app.views import TurnViews
from engine.explain import explain_turn
from engine.jobs import plain_error
from engine.policies import METHODS, get_policy
from engine.session import Answer, Delta
from storage import NotFoundError, StorageError

STOPPED_MARK = " [stopped]"


def new_state(config) -> dict:
    """A browser session's state: the open document and chat, and the index settings the controls ask for."""
    return {"doc_id": None, "chat_id": None, "centroid_ratio": config.centroid_ratio,
            "level1_ratio": config.level1_ratio, "library": None}


def same_answer(a: str, b: str) -> bool:
    """Whether two answers say the same, ignoring case, spacing and trailing punctuation."""
    def norm(s: str) -> str:
        return " ".join(s.lower().split()).rstrip(" .!")
    return norm(a) == norm(b)


def turn_messages(turn: dict) -> list[dict]:
    """A saved turn as chat messages (the question, the answer, and full attention's answer when compared)."""
    out = [{"role": "user", "content": turn["question"]}, {"role": "assistant", "content": turn["answer"] or "…"}]
    compare = turn["stats"].get("compare")
    if compare:
        out.append({"role": "assistant", "content": compare_message(compare)})
    return out


def compare_message(compare: dict) -> str:
    verdict = "✓ the answers agree" if compare["agree"] else "✗ the answers differ"
    return f"Full attention: {compare['answer']}\n\n{verdict}"


class ChatTab:
    def __init__(self, services: Services, state: gr.State, last_doc: gr.BrowserState):
        self.services, self.state, self.last_doc = services, state, last_doc
        self.views = TurnViews(services)

    # ------------------------------------------------------------------ layout

    def render(self) -> None:
        cfg = self.services.config
        with gr.Row(equal_height=False):
            with gr.Column(scale=5, min_width=360):
                self.doc = gr.Dropdown(label="Document", choices=[], value=None, interactive=True,
                                       allow_custom_value=True, elem_id="sq-doc-select")
                self.status = gr.HTML(render.notice_html("Upload a document on the Documents tab, or pick one above."),
                                      elem_id="sq-doc-status")
                # Plain text: answers are a base model's words, and Markdown would turn "48213." into an ordered list item.
                self.chatbot = gr.Chatbot(label="Chat", height=420, elem_id="sq-chatbot", buttons=["copy"],
                                          render_markdown=False)
                with gr.Row():
                    self.question = gr.Textbox(placeholder="Ask about the document…", show_label=False, scale=6,
                                               elem_id="sq-question", submit_btn=False, lines=1, max_lines=4)
                    self.ask_btn = gr.Button("Ask", variant="primary", scale=1, min_width=70, elem_id="sq-ask")
                    self.stop_btn = gr.Button("Stop", variant="stop", scale=1, min_width=70, elem_id="sq-stop")
                with gr.Accordion("Method and sparsity", open=True):
                    self.method = gr.Radio(list(METHODS), value=cfg.method, label="Method", elem_id="sq-method")
                    self.sparsity = gr.Slider(SPARSITY_MIN, SPARSITY_MAX, value=cfg.sparsity_pct, step=1,
                                              label="Sparsity (%): share of the document's keys skipped",
                                              elem_id="sq-sparsity")
                    self.threshold = gr.Markdown("", elem_id="sq-threshold")
                    with gr.Row():
                        self.centroid = gr.Slider(*CENTROID_RATIOS, value=cfg.centroid_ratio, step=0.01,
                                                  label="Centroid ratio (changing it re-indexes in the background)",
                                                  elem_id="sq-centroid")
                        self.level1 = gr.Slider(*LEVEL1_RATIOS, value=cfg.level1_ratio, step=0.002,
                                                label="Level-1 ratio (hsqueeze)", visible=cfg.method == "hsqueeze",
                                                elem_id="sq-level1")
                    with gr.Row():
                        self.compare = gr.Checkbox(False, label="Compare with full attention", elem_id="sq-compare")
                        self.max_new = gr.Slider(8, cfg.max_new_tokens_limit, value=cfg.max_new_tokens, step=8,
                                                 label="Max answer tokens")
                    self.new_chat = gr.Button("New chat", size="sm")
            with gr.Column(scale=6, min_width=420, elem_id="sq-views"):
                gr.Markdown("### What attention did")
                self.views.render()

    @property
    def open_inputs(self) -> list:
        return [self.doc, self.state, self.method, self.sparsity]

    @property
    def open_outputs(self) -> list:
        """What opening a document updates (the browser remembers it, to open it again after a reload)."""
        return [self.state, self.doc, self.status, self.chatbot, self.views.turn, self.threshold, *self.views.outputs,
                self.last_doc]

    def wire(self) -> None:
        controls = [self.method, self.sparsity, self.centroid, self.level1]
        ask_inputs = [self.question, self.chatbot, self.state, *controls, self.compare, self.max_new]
        ask_outputs = [self.chatbot, self.question, self.state, self.status, self.views.turn, *self.views.outputs]
        self.ask_btn.click(self.ask, ask_inputs, ask_outputs, api_name="ask", concurrency_id="model",
                           concurrency_limit=1, show_progress="minimal")
        self.question.submit(self.ask, ask_inputs, ask_outputs, api_visibility="private", concurrency_id="model",
                             concurrency_limit=1, show_progress="minimal")
        self.stop_btn.click(self.stop, None, None, api_name="stop", queue=False)
        self.doc.input(self.open_document, self.open_inputs, self.open_outputs, api_name="open_document")
        self.new_chat.click(self.start_new_chat, [self.state], [self.state, self.chatbot, self.views.turn,
                                                                *self.views.outputs], api_name="new_chat")
        self.views.turn.input(self.show_turn, [self.views.turn, self.state], self.views.outputs, api_name="show_turn")
        proj_inputs = [self.views.turn, self.views.layer, self.views.head, self.state]
        for dd in (self.views.layer, self.views.head):
            dd.input(self.show_projection, proj_inputs, [self.views.projection], api_name="show_projection",
                     api_visibility="public" if dd is self.views.layer else "private")
        self.method.change(lambda m: gr.update(visible=m == "hsqueeze"), [self.method], [self.level1],
                           api_visibility="private")
        self.sparsity.change(self.show_threshold, [self.state, *controls], [self.threshold], api_name="threshold",
                             show_progress="hidden")
        self.method.change(self.show_threshold, [self.state, *controls], [self.threshold],
                           api_visibility="private", show_progress="hidden")
        self.centroid.release(self.reindex, [self.state, self.centroid, self.level1], [self.state, self.status],
                              api_name="reindex")
        self.level1.release(self.reindex, [self.state, self.centroid, self.level1], [self.state, self.status],
                            api_visibility="private")

    # ------------------------------------------------------------------ opening a document

    def open_document(self, doc_id: str | None, state: dict, method: str | None = None,
                      sparsity_pct: float | None = None) -> list:
        """Show a document: its status, its latest chat, the views of its last turn."""
        cfg = self.services.config
        method, sparsity_pct = method or cfg.method, sparsity_pct or cfg.sparsity_pct
        state = dict(state)
        store = self.services.store
        if not doc_id:
            state.update(doc_id=None, chat_id=None)
            return [state, gr.update(value=None), render.notice_html("No document open."), [],
                    gr.update(choices=[], value=None), "", *self.views.empty(), None]
        settings = index_settings(state["centroid_ratio"], state["level1_ratio"])
        status = doc_status(self.services, doc_id, settings)
        try:
            chats = store.list_chats(doc_id)
        except StorageError:
            chats = []
        turns = store.get_turns(chats[0]["id"]) if chats else []
        state.update(doc_id=doc_id, chat_id=chats[0]["id"] if chats else None)
        history = [m for t in turns for m in turn_messages(t)]
        last = turns[-1] if turns else None
        return [state, gr.update(value=doc_id, choices=doc_choices(library_rows(self.services))),
                self.status_html(status), history,
                gr.update(choices=self.views.turn_choices(turns), value=last["idx"] if last else None),
                self.threshold_text(state, method, sparsity_pct),
                *self.views.show(last), doc_id]

    def status_html(self, status) -> str:
        if status.state == "preparing" and status.job is not None:
            return render.job_html(status.job)
        kind = {"ready": "ok", "failed": "error", "preparing": "wait"}.get(status.state, "info")
        if status.state == "ready" and not status.exact:
            kind = "wait"
        return render.notice_html(f"{status.name}: {status.message}", kind)

    # ------------------------------------------------------------------ asking

    def ask(self, question, history, state, method, sparsity_pct, centroid, level1, compare, max_new,
            request: gr.Request):
        """Stream an answer; then save the turn and show its views. Refuses, saying why, when it cannot answer."""
        services, store = self.services, self.services.store
        history = list(history or [])
        state = dict(state)
        skip_views = [gr.skip()] * len(self.views.outputs)
        question = " ".join((question or "").split())

        def refuse(text: str, keep_question: bool = True):
            msgs = history + ([{"role": "user", "content": question}] if question else [])
            msgs.append({"role": "assistant", "content": f"*{text}*"})
            return [msgs, question if keep_question else "", state, gr.skip(), gr.skip(), *skip_views]

        if not state.get("doc_id"):
            yield refuse("Open a document first: upload one on the Documents tab, or pick one above.")
            return
        if not question:
            yield refuse("Type a question first.")
            return
        settings = index_settings(centroid, level1)
        status = doc_status(services, state["doc_id"], settings)
        if status.state != "ready":
            if status.state == "preparing":
                text = f"{status.name} is not ready yet: {status.message}. Ask again when it is ready."
            else:
                text = f"{status.name} cannot be asked: {status.message}."
            yield [*refuse(text)[:3], self.status_html(status), gr.skip(), *skip_views]
            return
        if not status.exact and (status.job is None or status.job.status not in ("queued", "running")):
            services.worker.submit_document(state["doc_id"], settings)  # the controls ask for another index
        ctx = status.context_id
        sparse = get_policy(method).sparse
        sparsity = sparsity_pct / 100.0 if sparse else 0.0
        if state.get("chat_id") is None:
            state["chat_id"] = store.create_chat(state["doc_id"], ctx)
        stop = services.stops.flag(request.session_hash if request is not None else "-")
        stop.clear()
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
        yield [history, "", state, self.status_html(status), gr.skip(), *skip_views]

        answer, text, stopped = None, "", False
        stream = services.engine.stream(ctx, question, method, sparsity, int(max_new))
        try:
            for event in stream:
                if isinstance(event, Delta):
                    text += event.text
                    history[-1] = {"role": "assistant", "content": text}
                    yield [history, gr.skip(), gr.skip(), gr.skip(), gr.skip(), *skip_views]
                elif isinstance(event, Answer):
                    answer = event
                if stop.is_set():
                    stopped = answer is None
                    break
        except Exception as exc:  # noqa: BLE001 - shown in plain words, the app keeps running
            history[-1] = {"role": "assistant", "content": f"*Could not answer: {plain_error(exc)}*"}
            yield [history, gr.skip(), state, render.notice_html(plain_error(exc), "error"), gr.skip(), *skip_views]
            return
        finally:
            stream.close()

        if stopped:
            text = text.strip()
            history[-1] = {"role": "assistant", "content": (text or "…") + STOPPED_MARK}
            stats = {"stopped": True, "context_id": ctx, "method": method, "sparsity": sparsity}
            store.add_turn(state["chat_id"], question, text + STOPPED_MARK, method, sparsity, stats)
        else:
            history[-1] = {"role": "assistant", "content": answer.text or "…"}
            stats = self._turn_stats(ctx, question, answer, method, sparsity, sparsity_pct / 100.0)
            if compare and get_policy(method).sparse:
                stats = self.ask_compare(stats, ctx, question, answer, int(max_new))
            if stats.get("compare"):
                history.append({"role": "assistant", "content": compare_message(stats["compare"])})
            store.add_turn(state["chat_id"], question, answer.text, method, sparsity, stats)
        turns = store.get_turns(state["chat_id"])
        last = turns[-1]
        yield [history, gr.skip(), state, self.status_html(status),
               gr.update(choices=self.views.turn_choices(turns), value=last["idx"]), *self.views.show(last)]

    def _turn_stats(self, ctx: str, question: str, answer: Answer, method: str, sparsity: float,
                    shown_sparsity: float) -> dict:
        """The statistics saved with a turn: TurnStats, the thresholds, the context, and the retrieval report
        (engine.explain) the views are drawn from."""
        stats = answer.stats.to_json()
        stats["context_id"] = ctx
        session = self.services.engine.session(ctx)
        if get_policy(method).sparse:
            stats["thresholds"] = [float(t) for t in session.thresholds(method, sparsity)]
        try:
            stats["retrieval"] = explain_turn(session, question, answer.text, stats["clusters"], shown_sparsity)
        except Exception as exc:  # noqa: BLE001 - the answer stands; the views say what is missing
            stats["retrieval"] = {"layers": [], "error": plain_error(exc)}
        return stats

    def ask_compare(self, stats: dict, ctx: str, question: str, answer: Answer, max_new: int) -> dict:
        full = self.services.engine.ask(ctx, question, "full", 0.0, max_new)
        return {**stats, "compare": {"answer": full.text, "agree": same_answer(full.text, answer.text),
                                     "total_s": full.stats.timings.get("total_s", 0.0),
                                     "first_token_s": full.stats.timings.get("first_token_s", 0.0)}}

    def stop(self, request: gr.Request) -> None:
        self.services.stops.stop(request.session_hash if request is not None else "-")

    # ------------------------------------------------------------------ the rest of the controls

    def start_new_chat(self, state: dict) -> list:
        state = {**state, "chat_id": None}
        return [state, [], gr.update(choices=[], value=None), *self.views.empty()]

    def _turn(self, state: dict, idx) -> dict | None:
        if state.get("chat_id") is None or idx is None:
            return None
        try:
            turns = self.services.store.get_turns(state["chat_id"])
        except NotFoundError:
            return None
        return next((t for t in turns if t["idx"] == int(idx)), None)

    def show_turn(self, idx, state: dict) -> list:
        return self.views.show(self._turn(state, idx))

    def show_projection(self, idx, layer, head, state: dict) -> str:
        turn = self._turn(state, idx)
        if turn is None or "context_id" not in turn["stats"]:
            return ""
        return self.views.projection_html(turn["stats"]["context_id"], turn["stats"].get("retrieval") or {},
                                          layer, int(head or 0))

    def threshold_text(self, state: dict, method: str, sparsity_pct: float, centroid: float | None = None,
                       level1: float | None = None) -> str:
        if not state.get("doc_id") or not get_policy(method).sparse:
            return "Full attention reads every key." if state.get("doc_id") else ""
        settings = index_settings(centroid if centroid is not None else state["centroid_ratio"],
                                  level1 if level1 is not None else state["level1_ratio"])
        status = doc_status(self.services, state["doc_id"], settings)
        if status.context_id is None:
            return ""
        try:
            ts = self.services.inspector.thresholds(status.context_id, method, sparsity_pct / 100.0)
        except (StorageError, ValueError):
            return ""
        levels = get_policy(method).levels
        names = ("T",) if levels == 1 else ("T₁ (level 1)", "T₂ (level 2)")
        shown = ", ".join(f"{n} = {t:.3g}" for n, t in zip(names, ts[:levels]))
        if len(ts) >= 2 * levels:  # the question's prefill has its own (index version >= 4)
            short = ("T",) if levels == 1 else ("T₁", "T₂")
            shown += " (question prefill: " + ", ".join(f"{n} = {t:.3g}" for n, t in zip(short, ts[levels:])) + ")"
        return f"Calibrated threshold at {sparsity_pct:.0f}% sparsity: {shown} (interpolated on the calibration grid)"

    def show_threshold(self, state, method, sparsity_pct, centroid, level1) -> str:
        return self.threshold_text(state, method, sparsity_pct, centroid, level1)

    def reindex(self, state: dict, centroid: float, level1: float) -> list:
        """Ask for the index the sliders describe; it is built in the background if it does not exist."""
        state = {**state, "centroid_ratio": float(centroid), "level1_ratio": float(level1)}
        if not state.get("doc_id"):
            return [state, gr.skip()]
        settings = index_settings(centroid, level1)
        status = doc_status(self.services, state["doc_id"], settings)
        if not status.exact and status.state != "unknown":
            job = status.job
            if job is None or job.status not in ("queued", "running") or job.settings != settings.as_dict():
                self.services.worker.submit_document(state["doc_id"], settings)
            status = doc_status(self.services, state["doc_id"], settings)
        return [state, self.status_html(status)]
