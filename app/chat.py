"""The Chat tab: pick a document, set the method and sparsity, ask; answers stream in, can be stopped, and are
saved per document; beside them, what attention did in each turn (app.views)."""

from __future__ import annotations

import re
import secrets

import gradio as gr

from app import render
from app.config import (
    CENTROID_RATIOS,
    LEVEL1_RATIOS,
    MAX_NEW_MIN,
    REPETITIONS,
    SPARSITY_MAX,
    SPARSITY_MIN,
    TEMPERATURES,
    TOP_PS,
    method_settings,
)
from app.services import Services, doc_choices, doc_status, library_rows, needs_preparing, session_of
from app.settings import ChatSettings
from app.views import TurnViews
from app.waits import Asked, WaitEnded, expected_text, index_text, load_text, queue_text, training_text, waits
from engine.serve import (
    METHODS,
    REGISTRY,
    ContextSettings,
    Delta,
    GenerationOptions,
    Waiting,
    build_order,
    plain_error,
)
from storage import NotFoundError, StorageError


def new_state(config) -> dict:
    """A browser session's state: the open document and chat, and the methods' settings its index sliders ask for
    (this user's: they go with each of its requests, never into the engine's shared state); "owner": whose chats it
    sees and starts (owner_of)."""
    return {"doc_id": None, "chat_id": None, "centroid_ratio": config.centroid_ratio,
            "level1_ratio": config.level1_ratio, "library": None, "owner": None}


OWNER_TOKEN = re.compile(r"[0-9a-f]{32}")
CHAT_TAB, LIBRARY_TAB = "chat", "library"  # the tabs' ids (the browser keeps the one it shows)


def to_chat_tab() -> list:
    """What shows the Chat tab: the tabs' update, and the tab the browser keeps (app.demo.Page's navigation)."""
    return [gr.Tabs(selected=CHAT_TAB), CHAT_TAB]


def owner_of(state: dict) -> str:
    """The token of the session's owner: the chats it lists, reopens and starts are that owner's only. A browser
    keeps its token across reloads and restarts (app.demo restores it at each page load); a session without one (an
    API client that never resumed: `resume_chats`) gets a new one here, kept in `state` (the caller's copy, which
    it returns)."""
    if not (isinstance(state.get("owner"), str) and OWNER_TOKEN.fullmatch(state["owner"])):
        state["owner"] = secrets.token_hex(16)
    return state["owner"]


def turn_messages(turn: dict) -> list[dict]:
    """A saved turn as chat messages (the question, the answer, and full attention's answer when compared)."""
    out = [{"role": "user", "content": turn["question"]}, {"role": "assistant", "content": turn["answer"] or "…"}]
    compare = turn["stats"].get("compare")
    if compare:
        out.append({"role": "assistant", "content": compare_message(compare)})
    return out


def overrides(state: dict) -> dict:
    """The methods' settings this browser session's index sliders ask for (app.config.method_settings)."""
    return method_settings(state["centroid_ratio"], state["level1_ratio"])


def has_setting(method: str, name: str) -> bool:
    """Whether `method` or a method it builds on has the setting `name` (which index sliders apply to it)."""
    return any(name in REGISTRY[m].Settings.__dataclass_fields__ for m in build_order([method]))


def compare_message(compare: dict) -> str:
    verdict = "✓ the answers agree" if compare["agree"] else "✗ the answers differ"
    return f"Full attention: {compare['answer']}\n\n{verdict}"


class ChatTab:
    def __init__(self, services: Services, state: gr.State, last_doc: gr.BrowserState,
                 kept_settings: gr.BrowserState):
        """last_doc, kept_settings: what the browser keeps across reloads (the open document; the controls, as
        `ChatSettings.as_stored`)."""
        self.services, self.state, self.last_doc, self.kept_settings = services, state, last_doc, kept_settings
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
                    # shown while a question waits for a training, an index build or the model's load
                    self.cancel_btn = gr.Button("Cancel", scale=1, min_width=70, visible=False,
                                                elem_id="sq-cancel-wait")
                self.seen = gr.State({})  # what the poll last showed above the chat and under the sparsity
                with gr.Accordion("Method and sparsity", open=True):
                    self.method = gr.Radio(list(METHODS), value=cfg.method, label="Method", elem_id="sq-method")
                    self.sparsity = gr.Slider(SPARSITY_MIN, SPARSITY_MAX, value=cfg.sparsity, step=0.01,
                                              label="Sparsity: the share of the document's K/V bytes a step skips "
                                                    "(1 - the KV budget; index and follow rows inside the budget)",
                                              elem_id="sq-sparsity")
                    self.threshold = gr.Markdown("", elem_id="sq-threshold")
                    with gr.Row():
                        self.centroid = gr.Slider(*CENTROID_RATIOS, value=cfg.centroid_ratio, step=0.01,
                                                  label="Centroid ratio (changing it re-indexes in the background)",
                                                  visible=has_setting(cfg.method, "centroid_ratio"),
                                                  elem_id="sq-centroid")
                        self.level1 = gr.Slider(*LEVEL1_RATIOS, value=cfg.level1_ratio, step=0.002,
                                                label="Level-1 ratio", visible=has_setting(cfg.method, "level1_ratio"),
                                                elem_id="sq-level1")
                    with gr.Row():
                        self.compare = gr.Checkbox(False, label="Compare with full attention", elem_id="sq-compare")
                        self.max_new = gr.Slider(MAX_NEW_MIN, cfg.max_new_tokens_limit, value=cfg.max_new_tokens,
                                                 step=MAX_NEW_MIN, label="Max answer tokens", elem_id="sq-max-new")
                    with gr.Row():
                        self.chats = gr.Dropdown(label="Chats of this document (newest first)", choices=[],
                                                 value=None, scale=4, elem_id="sq-chats")
                        self.new_chat = gr.Button("New chat", size="sm", scale=1, min_width=70)
                        # the API's way back to its own chats from another session (a browser keeps its token)
                        self.owner_token = gr.Textbox(visible=False)
                        self.resume_btn = gr.Button(visible=False)
                with gr.Accordion("Advanced: how the answer's words are chosen", open=False):
                    gr.Markdown("Greedy (temperature 0) by default: the same question gets the same answer. "
                                "The repetition penalty counts the answer's own words only, never the document's.")
                    with gr.Row():
                        self.temperature = gr.Slider(*TEMPERATURES, value=TEMPERATURES[0], step=0.05,
                                                     label="Temperature", elem_id="sq-temperature")
                        self.top_p = gr.Slider(*TOP_PS, value=TOP_PS[1], step=0.05, label="Top-p",
                                               elem_id="sq-top-p")
                        self.repetition = gr.Slider(*REPETITIONS, value=REPETITIONS[0], step=0.05,
                                                    label="Repetition penalty", elem_id="sq-repetition")
                with gr.Accordion("The methods against full attention at equal KV budgets", open=False):
                    self.evaluation = gr.HTML("", elem_id="sq-evaluation")  # filled at each page load (app.demo)
            with gr.Column(scale=6, min_width=420, elem_id="sq-views"):
                gr.Markdown("### What attention did")
                self.views.render()

    @property
    def open_inputs(self) -> list:
        return [self.doc, self.state, self.method, self.sparsity]

    @property
    def setting_controls(self) -> list:
        """The controls the browser keeps across reloads, in `ChatSettings`' field order."""
        return [self.method, self.sparsity, self.max_new, self.temperature, self.top_p, self.repetition, self.compare,
                self.centroid, self.level1]

    @property
    def open_outputs(self) -> list:
        """What opening a document updates (the browser remembers it, to open it again after a reload)."""
        return [self.state, self.doc, self.status, self.chatbot, self.views.turn, self.threshold, *self.views.outputs,
                self.evaluation, self.last_doc, self.chats]

    def wire(self, timer: gr.Timer) -> None:
        """The handlers; `timer` keeps the status line and the plan hint where the engine is (a training, an index
        build, the model's load) for this session's method and settings."""
        controls = [self.method, self.sparsity, self.centroid, self.level1]
        ask_inputs = [self.question, self.chatbot, self.state, *controls, self.compare, self.max_new,
                      self.temperature, self.top_p, self.repetition]
        ask_outputs = [self.chatbot, self.question, self.state, self.status, self.views.turn, *self.views.outputs,
                       self.chats, self.cancel_btn]
        at_once = self.services.config.questions_at_once  # the engine's scheduler batches or queues them
        for asked in (self.ask_btn.click(self.ask, ask_inputs, ask_outputs, api_name="ask", concurrency_id="model",
                                         concurrency_limit=at_once, show_progress="minimal"),
                      self.question.submit(self.ask, ask_inputs, ask_outputs, api_visibility="private",
                                           concurrency_id="model", concurrency_limit=at_once,
                                           show_progress="minimal")):
            # the turn may have built the method's index: the hint then names the plan it runs, not the build
            asked.then(self.show_threshold, [self.state, *controls], [self.threshold], api_visibility="private",
                       show_progress="hidden")
        self.stop_btn.click(self.stop, None, None, api_name="stop", queue=False)
        self.cancel_btn.click(self.cancel_wait, None, None, api_name="cancel_wait", queue=False)
        timer.tick(self.watch, [self.state, *controls, self.seen], [self.status, self.threshold, self.seen],
                   api_name="watch", show_progress="hidden", concurrency_limit=None)
        self.doc.input(self.open_document, self.open_inputs, self.open_outputs, api_name="open_document")
        chat_outputs = [self.state, self.chatbot, self.views.turn, *self.views.outputs, self.chats]
        self.new_chat.click(self.start_new_chat, [self.state], chat_outputs, api_name="new_chat")
        self.chats.input(self.open_chat, [self.chats, self.state], chat_outputs, api_name="open_chat")
        self.resume_btn.click(self.resume_chats, [self.owner_token, self.state], [self.owner_token, self.state],
                              api_name="resume_chats")
        self.views.turn.input(self.show_turn, [self.views.turn, self.state], self.views.outputs, api_name="show_turn")
        proj_inputs = [self.views.turn, self.views.layer, self.views.head, self.state]
        for dd in (self.views.layer, self.views.head):
            dd.input(self.show_projection, proj_inputs, [self.views.projection], api_name="show_projection",
                     api_visibility="public" if dd is self.views.layer else "private")
        for control in self.setting_controls:  # (set by the user, or restored at a page load)
            control.change(self.remember, self.setting_controls, [self.kept_settings], api_visibility="private",
                           show_progress="hidden", queue=False)
        self.method.change(lambda m: [gr.update(visible=has_setting(m, "centroid_ratio")),
                                      gr.update(visible=has_setting(m, "level1_ratio"))],
                           [self.method], [self.centroid, self.level1], api_visibility="private")
        self.sparsity.change(self.show_threshold, [self.state, *controls], [self.threshold], api_name="threshold",
                             show_progress="hidden")
        self.method.change(self.show_threshold, [self.state, *controls], [self.threshold],
                           api_visibility="private", show_progress="hidden")
        for slider in (self.centroid, self.level1):
            slider.release(self.reindex, [self.state, self.centroid, self.level1], [self.state, self.status],
                           api_name="reindex" if slider is self.centroid else None,
                           api_visibility="public" if slider is self.centroid else "private").then(
                self.show_threshold, [self.state, *controls], [self.threshold], api_visibility="private",
                show_progress="hidden")

    # ------------------------------------------------------------------ opening a document

    def open_document(self, doc_id: str | None, state: dict, method: str | None = None,
                      sparsity: float | None = None, prepare: bool = True, request: gr.Request = None) -> list:
        """Show a document: its status, its latest chat, the views of its last turn. `prepare`: a document of the
        library with no context for this model (never prepared for it, its context dropped, or its preparation
        cancelled) is prepared again from its stored text, its progress shown as any preparation's (the user opened
        it; a page coming back to the document it showed passes False)."""
        cfg = self.services.config
        method, sparsity = method or cfg.method, cfg.sparsity if sparsity is None else sparsity
        state = dict(state)
        store = self.services.store
        if not doc_id:
            state.update(doc_id=None, chat_id=None)
            self.services.shown.show(session_of(request), None, None)
            return [state, gr.update(value=None), render.notice_html("No document open."), [],
                    gr.update(choices=[], value=None), "", *self.views.empty(), self.evaluation_html(), None,
                    gr.update(choices=[], value=None)]
        status = doc_status(self.services, doc_id, method, overrides(state))
        if prepare and needs_preparing(self.services, status):
            self.services.worker.submit_document(doc_id, ContextSettings())
            status = doc_status(self.services, doc_id, method, overrides(state))
        try:
            chats = store.chats.list(doc_id, owner_of(state))  # this browser's chats only
        except StorageError:
            chats = []
        turns = store.chats.turns(chats[0]["id"]) if chats else []
        state.update(doc_id=doc_id, chat_id=chats[0]["id"] if chats else None)
        self.services.shown.show(session_of(request), doc_id, state["chat_id"])
        history = [m for t in turns for m in turn_messages(t)]
        last = turns[-1] if turns else None
        return [state, gr.update(value=doc_id, choices=doc_choices(library_rows(self.services))),
                self.status_html(status), history,
                gr.update(choices=self.views.turn_choices(turns), value=last["idx"] if last else None),
                self.threshold_text(state, method, sparsity),
                *self.views.show(last), self.evaluation_html(), doc_id,
                self.chat_choices(doc_id, state["chat_id"], state["owner"])]

    def evaluation_html(self) -> str:
        """The latest `squeeze eval` of the model that answers the open document (the engine's: an app serves one
        model), or how to make one."""
        model = self.services.model_id
        try:
            doc = self.services.engine.latest_eval(model)
        except (StorageError, ValueError) as exc:
            return render.notice_html(f"The evaluation of {model} could not be read: {plain_error(exc)}", "error")
        return render.eval_html(doc, model)

    def status_html(self, status) -> str:
        if status.state == "preparing" and status.job is not None:
            return render.job_html(status.job)
        kind = {"ready": "ok", "failed": "error", "preparing": "wait"}.get(status.state, "info")
        if status.state == "ready" and not status.exact:
            kind = "wait"
        return render.notice_html(f"{status.name}: {status.message}", kind)

    # ------------------------------------------------------------------ asking

    def ask(self, question, history, state, method, sparsity, centroid, level1, compare, max_new,
            temperature=0.0, top_p=1.0, repetition=1.0, request: gr.Request = None):
        """Stream an answer (the chat's earlier turns are its input too); then save the turn and show its views.
        Refuses, saying why, when it cannot answer."""
        services, store = self.services, self.services.store
        history = list(history or [])
        state = dict(state)
        skip_views = [gr.skip()] * (len(self.views.outputs) + 2)  # (the views, the chats list, Cancel)
        hidden = gr.update(visible=False)
        question = " ".join((question or "").split())

        def refuse(text: str, kind: str = "error"):
            """Why no answer comes: in the status line above the chat and as a toast, never inside the chat (which
            stays as it was; the question stays in its box)."""
            gr.Warning(text)
            return [history, question, state, render.notice_html(text, kind), gr.skip(), *skip_views]

        if not state.get("doc_id"):
            yield refuse("Open a document first: upload one on the Documents tab, or pick one above.")
            return
        if not question:
            yield refuse("Type a question first.")
            return
        try:
            options = GenerationOptions(temperature=float(temperature), top_p=float(top_p),
                                        repetition_penalty=float(repetition))
        except (TypeError, ValueError) as exc:
            yield refuse(f"Cannot answer with these settings: {exc}.")
            return
        asked = method_settings(centroid, level1)  # this user's index settings, for this request only
        status = doc_status(services, state["doc_id"], method, asked)
        if status.state != "ready":
            if status.state == "preparing":
                yield refuse(f"{status.name} is not ready yet: {status.message}. Ask again when it is ready.", "wait")
            else:
                yield refuse(f"{status.name} cannot be asked: {status.message}.")
            return
        ctx = status.context_id
        session = session_of(request)
        stop, cancel = services.stops.flag(session), services.cancels.flag(session)
        stop.clear()
        cancel.clear()
        where = [state["doc_id"], state.get("chat_id")]  # the chat the answer goes into
        cancel_hidden = False

        def on_page(outputs: list) -> list:
            """`outputs` while the session shows the chat the answer goes into; while it shows another document or
            chat (opened meanwhile), nothing but Cancel hidden once: the page stays on what the user opened, and the
            turn is still saved to its own chat."""
            nonlocal cancel_hidden
            if services.shown.shows(session, *where):
                return outputs
            update = [gr.skip()] * (len(outputs) - 1) + [gr.skip() if cancel_hidden else hidden]
            cancel_hidden = True
            return update

        history += [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
        yield [history, "", state, self.status_html(status), gr.skip(), *skip_views]
        try:  # the pending answer's place says what the question waits for, until the turn can start
            for wait in waits(services, Asked(state["doc_id"], ctx, method, asked), stop, cancel):
                history[-1] = {"role": "assistant", "content": wait.text}
                yield on_page([history, gr.skip(), gr.skip(), render.notice_html(wait.text, "wait"), gr.skip(),
                               *skip_views[:-1], gr.update(visible=True, interactive=wait.cancellable)])
        except WaitEnded as ended:  # no answer: the chat keeps only questions and answers; the question goes back
            del history[-2:]
            gr.Warning(ended.text)
            yield on_page([history, question, state, render.notice_html(ended.text, ended.kind), gr.skip(),
                           *skip_views[:-1], hidden])
            return
        if state.get("chat_id") is None:
            state["chat_id"] = store.chats.create(state["doc_id"], ctx, owner=owner_of(state))
            if services.shown.shows(session, *where):  # the session shows the new chat from now on
                services.shown.show(session, state["doc_id"], state["chat_id"])
            where[1] = state["chat_id"]
        history[-1] = {"role": "assistant", "content": ""}
        yield on_page([history, gr.skip(), state,
                       self.status_html(doc_status(services, state["doc_id"], method, asked)), gr.skip(),
                       *skip_views[:-1], hidden])

        text, recorded = "", None
        turn = services.turns.answer(state["chat_id"], ctx, question, method, float(sparsity), int(max_new), compare,
                                     stop, options, overrides=asked)
        try:
            told = None
            for event in turn:
                if isinstance(event, Delta):
                    text += event.text
                    history[-1] = {"role": "assistant", "content": text}
                    yield on_page([history, gr.skip(), gr.skip(), gr.skip(), gr.skip(), *skip_views])
                elif isinstance(event, Waiting):  # other users' questions fill the model's batch: its place
                    if event.ahead != told:
                        told = event.ahead
                        wait = queue_text(event.ahead)
                        history[-1] = {"role": "assistant", "content": wait}
                        yield on_page([history, gr.skip(), gr.skip(), render.notice_html(wait, "wait"), gr.skip(),
                                       *skip_views])
                else:
                    recorded = event
        except Exception as exc:  # noqa: BLE001 - shown in plain words, the app keeps running
            history[-1] = {"role": "assistant", "content": f"*Could not answer: {plain_error(exc)}*"}
            yield on_page([history, gr.skip(), state, render.notice_html(plain_error(exc), "error"), gr.skip(),
                           *skip_views])
            return
        finally:
            turn.close()
        history[-1:] = turn_messages(recorded.row)[1:]
        turns = store.chats.turns(state["chat_id"])
        yield on_page([history, gr.skip(), state,
                       self.status_html(doc_status(services, state["doc_id"], method, asked)),
                       gr.update(choices=self.views.turn_choices(turns), value=recorded.row["idx"]),
                       *self.views.show(recorded.row),
                       self.chat_choices(state["doc_id"], state["chat_id"], owner_of(state)), hidden])

    def stop(self, request: gr.Request) -> None:
        self.services.stops.stop(session_of(request))

    def cancel_wait(self, request: gr.Request) -> None:
        """Cancel what this session's question waits for (a training, an index build): it stops at its next step,
        and the question is not answered. (During the model's load: stop waiting; the load goes on.)"""
        session = session_of(request)
        self.services.cancels.stop(session)
        self.services.stops.stop(session)

    # ------------------------------------------------------------------ the rest of the controls

    def remember(self, *values) -> dict:
        """What the browser keeps of the controls (`setting_controls`' values), to restore them at the next page
        load (app.demo.Page.restore)."""
        return ChatSettings.from_controls(values, self.services.config).as_stored()

    def start_new_chat(self, state: dict, request: gr.Request = None) -> list:
        state = {**state, "chat_id": None}
        self.services.shown.show(session_of(request), state.get("doc_id"), None)
        return [state, [], gr.update(choices=[], value=None), *self.views.empty(),
                self.chat_choices(state.get("doc_id"), None, owner_of(state))]

    def resume_chats(self, token: str, state: dict) -> list:
        """Take up an owner's chats in this session: `token` (as this returns it, 32 hex digits) becomes the
        session's owner; an empty or malformed token keeps the session's own. Returns the session's token (keep it
        to come back) and state. What a browser does by itself at each page load, for an API client."""
        state = dict(state)
        token = (token or "").strip().lower()
        if OWNER_TOKEN.fullmatch(token):
            state["owner"], state["chat_id"] = token, None
        return [owner_of(state), state]

    def chat_choices(self, doc_id: str | None, chat_id: int | None, owner: str):
        """The open document's chats of `owner` for the list (newest first: when, how many turns, the first
        question)."""
        choices = []
        if doc_id:
            try:
                for chat in self.services.store.chats.list(doc_id, owner):
                    turns = self.services.store.chats.turns(chat["id"]) if chat["turn_count"] else []
                    first = turns[0]["question"] if turns else "(no question yet)"
                    first = first if len(first) <= 48 else first[:47] + "…"
                    label = f"{render.format_date(chat['created_at'])} · {chat['turn_count']} turn(s) · {first}"
                    choices.append((label, chat["id"]))
            except StorageError:
                choices = []
        return gr.update(choices=choices, value=chat_id if any(c[1] == chat_id for c in choices) else None)

    def open_chat(self, chat_id, state: dict, request: gr.Request = None) -> list:
        """Reopen an earlier chat of the open document: its turns shown, the next question goes on from them."""
        state = dict(state)
        try:
            chat = self.services.store.chats.get(int(chat_id)) if chat_id is not None else None
        except (NotFoundError, TypeError, ValueError):
            chat = None
        owner = owner_of(state)
        if chat is None or chat["doc_id"] != state.get("doc_id") or chat["owner"] != owner:  # another's: never
            return [state, gr.skip(), gr.skip(), *[gr.skip()] * len(self.views.outputs),
                    self.chat_choices(state.get("doc_id"), state.get("chat_id"), owner)]
        turns = self.services.store.chats.turns(chat["id"])
        state["chat_id"] = chat["id"]
        self.services.shown.show(session_of(request), state.get("doc_id"), chat["id"])
        last = turns[-1] if turns else None
        return [state, [m for t in turns for m in turn_messages(t)],
                gr.update(choices=self.views.turn_choices(turns), value=last["idx"] if last else None),
                *self.views.show(last), self.chat_choices(state["doc_id"], chat["id"], owner)]

    def _turn(self, state: dict, idx) -> dict | None:
        if state.get("chat_id") is None or idx is None:
            return None
        try:
            turns = self.services.store.chats.turns(state["chat_id"])
        except NotFoundError:
            return None
        return next((t for t in turns if t["idx"] == int(idx)), None)

    def show_turn(self, idx, state: dict) -> list:
        return self.views.show(self._turn(state, idx))

    def show_projection(self, idx, layer, head, state: dict):
        turn = self._turn(state, idx)
        if turn is None or "context_id" not in turn["stats"]:
            return None
        return self.views.projection_view(turn["stats"]["context_id"], turn["stats"].get("retrieval") or {},
                                          layer, int(head or 0))

    def threshold_text(self, state: dict, method: str, sparsity: float, centroid: float | None = None,
                       level1: float | None = None) -> str:
        """What a turn of `method` at `sparsity` would run on the open document: the plan the turn itself runs
        (Engine.plan); else what its first question waits for: the training the method needs once per model (with
        the time it should take here), or the build of its index (under way in the background, or at the first
        question)."""
        if not state.get("doc_id"):
            return ""
        asked = method_settings(centroid if centroid is not None else state["centroid_ratio"],
                                level1 if level1 is not None else state["level1_ratio"])
        status = doc_status(self.services, state["doc_id"], method, asked)
        if status.context_id is None:
            return ""
        learning = self.learning_text(method)
        if learning:
            return learning
        try:
            planned = self.services.engine.plan_and_floor(status.context_id, method, float(sparsity), asked)
        except (StorageError, ValueError):
            return ""
        if planned is None:
            job = status.job
            if job is not None and job.active:
                return f"{index_text(method, job)} A question waits for it."
            return f"The {method} index is built at the first question (or in the background after a slider change)."
        plan, lowest = planned
        text = f"At {float(sparsity):.0%} sparsity, {method} uses: {plan.describe()}"
        if lowest is not None and 1.0 - float(sparsity) < lowest:
            text += (f". On this document {method} reads at least {lowest:.1%} of the K/V bytes (its index and the "
                     f"dense rows): sparsity above {1.0 - lowest:.0%} reads that")
        return text

    def learning_text(self, method: str) -> str | None:
        """What `method` still has to learn once per model before it answers (None: nothing): how far its training
        is, or how long it should take (before any question started it)."""
        preparer = self.services.preparer
        needed = self.services.engine.needs_preparation(method)
        if not needed:
            return None
        view = preparer.view(method)
        if view is not None and view.state == "running":
            return training_text(view, method)
        what = needed[0] if needed[0] == method else f"{needed[0]} (what {method} builds on)"
        return (f"{method} learns what it needs once per model, before its first answer: training {what} takes "
                f"{expected_text(preparer.expected_seconds(method))}. The first question starts it (Cancel stops it).")

    def status_line(self, state: dict, method: str, centroid: float, level1: float) -> str:
        """The line above the chat: where the open document stands for `method` and these settings, and what the
        engine is busy with meanwhile (the model's load, the method's training)."""
        services = self.services
        status = doc_status(services, state["doc_id"], method, method_settings(centroid, level1))
        if status.state == "ready":
            if not services.engine.model_loaded and services.engine.load_step is not None:
                return render.notice_html(load_text(services), "wait")
            view = services.preparer.view(method) if services.engine.needs_preparation(method) else None
            if view is not None and view.state == "running":
                return render.notice_html(training_text(view, method), "wait")
        return self.status_html(status)

    def watch(self, state: dict, method: str, sparsity: float, centroid: float, level1: float, seen: dict) -> list:
        """The poll's look at the open document for this session's controls: the status line and the plan hint,
        sent only when they changed (a training's step, an index built or under way, the model loaded)."""
        if not state.get("doc_id"):
            return [gr.skip(), gr.skip(), seen]
        line = self.status_line(state, method, centroid, level1)
        key = [state["doc_id"], method, sparsity, centroid, level1, line]
        if key == (seen or {}).get("key"):
            return [gr.skip(), gr.skip(), seen]
        return [line, self.threshold_text(state, method, sparsity, centroid, level1), {"key": key}]

    def show_threshold(self, state, method, sparsity, centroid, level1) -> str:
        return self.threshold_text(state, method, sparsity, centroid, level1)

    def reindex(self, state: dict, centroid: float, level1: float) -> list:
        """Apply the index sliders: the methods already built for the open document whose settings they change are
        rebuilt in the background (the others when first asked for)."""
        state = {**state, "centroid_ratio": float(centroid), "level1_ratio": float(level1)}
        if not state.get("doc_id"):
            return [state, gr.skip()]
        engine, asked = self.services.engine, overrides(state)
        status = doc_status(self.services, state["doc_id"])
        if status.context_id is not None:
            built = [b["method"] for b in self.services.store.methods.list(status.context_id)]
            stale = engine.stale_methods(status.context_id, built, asked)
            job = status.job
            if stale and (job is None or job.status not in ("queued", "running")):
                self.services.worker.submit_document(state["doc_id"], ContextSettings(), methods=tuple(stale),
                                                     overrides=asked)
            status = doc_status(self.services, state["doc_id"], stale[-1] if stale else None, asked)
        return [state, self.status_html(status)]
