"""`build_demo(engine, store) -> gr.Blocks`: the whole UI as a function of an engine (no model code here, no globals)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.chat import ChatTab, new_state, owner_of
from app.config import AppConfig
from app.library import LibraryTab
from app.services import Services
from engine.serve import ContextInspector, Engine, IngestWorker
from storage import Store

CSS_PATH = Path(__file__).resolve().parents[1] / "assets" / "app.css"
LAST_DOC_KEY = "squeeze-chat-last-document"  # the browser remembers the open document across reloads
OWNER_KEY = "squeeze-chat-owner"  # and the token its chats are kept under (app.chat.owner_of)

INTRO = (
    "### squeeze-chat\n"
    "The whole document is the model's context; each answer reads only the part of its attention memory that the "
    "chosen sparse-attention method selects, within the KV budget you set. Upload on **Documents**, then ask on "
    "**Chat** (follow-up questions know the chat so far); the panel beside the chat shows what attention kept in "
    "each turn."
)


def build_demo(engine: Engine, store: Store | None = None, *, worker: IngestWorker | None = None,
               config: AppConfig | None = None) -> gr.Blocks:
    """The app for one engine (one model).

    store: the engine's store (the default; another store would index documents the engine cannot answer from)
    worker: the background ingest worker (default: a new one that loads the model at once and resumes the
            jobs an earlier process left unfinished); `demo.services.worker.close()` stops it
    """
    store = store or engine.store
    if store is not engine.store:
        raise ValueError("build_demo needs the engine's own store (engine.store)")
    config = config or AppConfig()
    worker = worker or IngestWorker(engine, preload=True, resume=True)
    services = Services(engine=engine, store=store, worker=worker, inspector=ContextInspector(store), config=config)

    with gr.Blocks(title=config.title, fill_width=True, analytics_enabled=False) as demo:
        state = gr.State(new_state(config))
        last_doc = gr.BrowserState(None, storage_key=LAST_DOC_KEY)
        owner = gr.BrowserState(None, storage_key=OWNER_KEY)
        gr.Markdown(INTRO, elem_id="sq-intro")
        chat = ChatTab(services, state, last_doc)
        library = LibraryTab(services, state, chat)
        with gr.Tabs(selected="library") as tabs:
            with gr.Tab("Documents", id="library", elem_id="sq-tab-library"):
                library.render()
            with gr.Tab("Chat", id="chat", elem_id="sq-tab-chat"):
                chat.render()
        timer = gr.Timer(config.poll_s)
        chat.wire(timer)
        library.wire(tabs, timer)

        # Coming back to the page: the browser's own chats (its token, made at its first visit), the library and jobs
        # where they are, and the last document open again.
        def restore(last, token, state, method, sparsity):
            state = {**state, "owner": token}
            token = owner_of(state)  # (a new browser: a new token, which it keeps)
            jobs, rows, selected, doc, status, state = library.refresh(state)
            if last and _exists(services, last):
                return [jobs, rows, selected, *chat.open_document(last, state, method, sparsity),
                        gr.Tabs(selected="chat"), token]
            rest = [gr.skip()] * (len(chat.open_outputs) - 3)
            return [jobs, rows, selected, state, doc, status, *rest, gr.skip(), token]

        demo.load(restore, [last_doc, owner, state, chat.method, chat.sparsity],
                  [library.jobs, library.table, library.selected, *chat.open_outputs, tabs, owner],
                  api_visibility="private")
        demo.load(chat.evaluation_html, None, [chat.evaluation], api_name="evaluation", show_progress="hidden")
    demo.queue(max_size=config.queue_size, default_concurrency_limit=2)
    demo.services = services  # for the caller: the worker to close, the store, the engine
    return demo


def _exists(services: Services, doc_id: str) -> bool:
    try:
        services.store.documents.find(doc_id)
        return True
    except Exception:  # noqa: BLE001 - gone, or an id prefix that is now ambiguous
        return False


def launch_kwargs(config: AppConfig) -> dict:
    """What `demo.launch` needs besides host and port (Gradio 6 takes the CSS at launch)."""
    # Gradio refuses uploads over twice the limit outright; between the two, the upload handler says why.
    kwargs = {"max_file_size": 2 * config.max_upload_bytes, "footer_links": ["api"]}
    if CSS_PATH.is_file():
        kwargs["css_paths"] = [CSS_PATH]
    return kwargs
