"""`build_demo(engine, store) -> gr.Blocks`: the whole UI as a function of an engine (no model code here, no
globals)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.chat import CHAT_TAB, LIBRARY_TAB, ChatTab, new_state, owner_of
from app.config import AppConfig
from app.library import LibraryTab
from app.secret import browser_secret
from app.services import Services
from app.settings import ChatSettings
from engine.serve import ContextInspector, Engine, IngestWorker
from storage import Store

CSS_PATH = Path(__file__).resolve().parents[1] / "assets" / "app.css"
LAST_DOC_KEY = "squeeze-chat-last-document"  # the browser remembers the open document across reloads
OWNER_KEY = "squeeze-chat-owner"  # and the token its chats are kept under (app.chat.owner_of)
TAB_KEY = "squeeze-chat-tab"  # and the tab it shows
SETTINGS_KEY = "squeeze-chat-settings"  # and the chat's controls (app.settings.ChatSettings)

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
        page = Page(services)
        page.render()
        page.wire(demo)
    demo.queue(max_size=config.queue_size, default_concurrency_limit=2)
    demo.services = services  # for the caller: the worker to close, the store, the engine
    demo.page = page  # its tabs and handlers
    return demo


class Page:
    """The page: the two tabs, the session's state, and what the browser keeps across reloads (the open document,
    the token its chats are kept under, the tab it shows, the chat's controls). Built inside a `gr.Blocks`."""

    def __init__(self, services: Services):
        config = services.config
        self.services = services
        self.state = gr.State(new_state(config))
        key = browser_secret(services.store.database.root)  # the same after a restart: kept values still read
        self.last_doc = gr.BrowserState(None, storage_key=LAST_DOC_KEY, secret=key)
        self.owner = gr.BrowserState(None, storage_key=OWNER_KEY, secret=key)
        self.kept_tab = gr.BrowserState(None, storage_key=TAB_KEY, secret=key)
        self.kept_settings = gr.BrowserState(None, storage_key=SETTINGS_KEY, secret=key)
        self.chat = ChatTab(services, self.state, self.last_doc, self.kept_settings)
        self.library = LibraryTab(services, self.state, self.chat)

    def render(self) -> None:
        gr.Markdown(INTRO, elem_id="sq-intro")
        with gr.Tabs(selected=LIBRARY_TAB) as self.tabs:
            with gr.Tab("Documents", id=LIBRARY_TAB, elem_id="sq-tab-library") as self.library_tab:
                self.library.render()
            with gr.Tab("Chat", id=CHAT_TAB, elem_id="sq-tab-chat") as self.chat_tab:
                self.chat.render()
        self.timer = gr.Timer(self.services.config.poll_s)

    @property
    def restore_outputs(self) -> list:
        """What a page load sets: `restore`'s outputs, in order."""
        return [self.library.jobs, self.library.table, self.library.selected, *self.chat.open_outputs, self.tabs,
                self.owner, *self.chat.setting_controls]

    def wire(self, demo: gr.Blocks) -> None:
        chat, library = self.chat, self.library
        chat.wire(self.timer)
        library.wire([self.tabs, self.kept_tab], self.timer)
        for tab, tab_id in ((self.library_tab, LIBRARY_TAB), (self.chat_tab, CHAT_TAB)):
            tab.select(lambda tab_id=tab_id: tab_id, None, [self.kept_tab], api_visibility="private", queue=False,
                       show_progress="hidden")
        demo.load(self.restore, [self.last_doc, self.owner, self.kept_tab, self.kept_settings, self.state],
                  self.restore_outputs, api_visibility="private")
        demo.load(chat.evaluation_html, None, [chat.evaluation], api_name="evaluation", show_progress="hidden")

    def restore(self, last: str | None, token: str | None, tab: str | None, kept: dict | None, state: dict,
                request: gr.Request = None) -> list:
        """Coming back to the page: the browser's own chats (its token, made at its first visit), the library and
        jobs where they are, the chat's controls as this browser left them (`ChatSettings.restored`: a value no
        longer valid is the default), the last document open again, and the tab it showed (else the Chat tab when a
        document opens, the Documents tab when none does)."""
        settings = ChatSettings.restored(kept, self.services.config)
        state = {**state, "owner": token, "centroid_ratio": settings.centroid_ratio,
                 "level1_ratio": settings.level1_ratio}
        token = owner_of(state)  # (a new browser: a new token, which it keeps)
        jobs, table, selected, _doc = self.library.refresh()
        controls = settings.values() if kept is not None else [gr.skip()] * len(settings.values())
        opens = bool(last) and _exists(self.services, last)
        if tab not in (LIBRARY_TAB, CHAT_TAB):
            tab = CHAT_TAB if opens else LIBRARY_TAB
        if opens:
            opened = self.chat.open_document(last, state, settings.method, settings.sparsity, prepare=False,
                                             request=request)
        else:
            opened = [state, *[gr.skip()] * (len(self.chat.open_outputs) - 1)]
        return [jobs, table, selected, *opened, gr.Tabs(selected=tab), token, *controls]


def _exists(services: Services, doc_id: str) -> bool:
    try:
        services.store.documents.find(doc_id)
        return True
    except Exception:  # noqa: BLE001 - gone, or an id prefix that is now ambiguous
        return False


def launch_kwargs(config: AppConfig, store: Store | None = None) -> dict:
    """What `demo.launch` needs besides host and port (Gradio 6 takes the CSS at launch). store: the app's store,
    whose folder of kept PDFs (and nothing else of it) Gradio's file route may serve, for the "PDF p. N" links."""
    # Gradio refuses uploads over twice the limit outright; between the two, the upload handler says why.
    kwargs = {"max_file_size": 2 * config.max_upload_bytes, "footer_links": ["api"]}
    if CSS_PATH.is_file():
        kwargs["css_paths"] = [CSS_PATH]
    if store is not None:
        kwargs["allowed_paths"] = [str(store.documents.source_dir.resolve())]
    return kwargs
