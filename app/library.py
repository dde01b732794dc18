"""The Documents tab: upload (PDF, TXT, Markdown; several at once, size-limited), watch the preparation, and the
library of cached documents with open and delete. Progress is polled, so it is where the job is whenever the
page is (re)opened.

What the tab does in the background (the poll, a preparation that ends or fails, Cancel) changes the library's
lists only: never the session's state, the open document or the selected tab. Those change when the user opens a
document (Open, or Prepare while no document is open)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr
import gradio.utils

from app import render
from app.chat import ChatTab, to_chat_tab
from app.services import Services, doc_choices, doc_status, error_text, library_rows, library_table
from engine.serve import ContextSettings, document_id
from storage import NotFoundError
from storage.documents import KIND_BY_SUFFIX, UnsupportedTypeError, document_kind

HEADERS = ["Name", "Pages", "Tokens", "Status", "Added", "ID"]


class LibraryTab:
    def __init__(self, services: Services, state: gr.State, chat: ChatTab):
        self.services, self.state, self.chat = services, state, chat
        self.seen = gr.State(None)  # the library as the poll last sent it (to skip an unchanged one)
        self.to_open = gr.State(None)  # the document a Prepare opens, handed to the step that opens it

    def render(self) -> None:
        cfg = self.services.config
        with gr.Row(equal_height=False):
            with gr.Column(scale=4, min_width=320):
                self.files = gr.File(label=f"Upload PDF, TXT or Markdown (up to {cfg.max_files} files, "
                                           f"{cfg.max_upload_mb:g} MB each)", file_count="multiple",
                                     file_types=sorted(KIND_BY_SUFFIX), elem_id="sq-upload")
                self.truncate = gr.Checkbox(False, label="Keep the start of long documents",
                                            info="A document longer than the model's context is refused unless "
                                                 "this is ticked")
                self.upload_btn = gr.Button("Prepare", variant="primary", elem_id="sq-prepare")
                self.message = gr.HTML("", elem_id="sq-upload-message")
                gr.Markdown("#### Being prepared")
                self.jobs = gr.HTML(render.jobs_html([]), elem_id="sq-jobs")
            with gr.Column(scale=6, min_width=420):
                gr.Markdown("#### Library")
                self.table = gr.Dataframe(headers=HEADERS, value=[], interactive=False, wrap=True, elem_id="sq-library",
                                          column_widths=["26%", "8%", "9%", "30%", "14%", "13%"])
                with gr.Row():
                    self.selected = gr.Dropdown(label="Document", choices=[], value=None, scale=4,
                                                allow_custom_value=True, elem_id="sq-library-select")
                    self.open_btn = gr.Button("Open", scale=1, min_width=70, elem_id="sq-open")
                    self.cancel_btn = gr.Button("Cancel preparation", scale=1, min_width=70, elem_id="sq-cancel")
                    self.delete_btn = gr.Button("Delete", variant="stop", scale=1, min_width=70, elem_id="sq-delete")
                with gr.Row(visible=False, elem_id="sq-confirm-row") as self.confirm_row:
                    self.confirm_text = gr.HTML("", elem_id="sq-confirm-text")
                    self.confirm_btn = gr.Button("Delete it", variant="stop", scale=0, min_width=90,
                                                 elem_id="sq-confirm-delete")
                    self.keep_btn = gr.Button("Keep it", scale=0, min_width=90, elem_id="sq-keep")
                with gr.Row():
                    self.notice = gr.HTML("", elem_id="sq-library-message")
                    self.undo_btn = gr.Button("Undo", visible=False, scale=0, min_width=90, elem_id="sq-undo")

    @property
    def refresh_outputs(self) -> list:
        """The library's lists (the jobs, the table, the two document pickers' choices): what `refresh` returns."""
        return [self.jobs, self.table, self.selected, self.chat.doc]

    def wire(self, navigation: list, timer: gr.Timer) -> None:
        """The handlers; `navigation`: the tabs and the tab the browser keeps (what opening a document shows)."""
        chat = self.chat
        # Prepare: the files are handed to the worker; the last one accepted is picked in the library, and opens in
        # the Chat tab (which shows its progress) when no document is open there.
        self.upload_btn.click(
            self.upload, [self.files, self.truncate, self.state],
            [self.message, self.files, self.to_open, *self.refresh_outputs], api_name="upload",
        ).then(self.open, [self.to_open, self.state, chat.method, chat.sparsity],
               [*chat.open_outputs, *navigation], api_visibility="private")
        timer.tick(self.poll, [self.seen], [*self.refresh_outputs, self.seen], api_name="poll",
                   show_progress="hidden", concurrency_limit=None)
        self.table.select(self.pick_row, [self.table], [self.selected], api_visibility="private")
        self.open_btn.click(self.open, [self.selected, self.state, chat.method, chat.sparsity],
                            [*chat.open_outputs, *navigation], api_name="open")
        self.cancel_btn.click(self.cancel, [self.selected], [self.notice, *self.refresh_outputs], api_name="cancel")
        # Delete asks first (what goes: the document and how many chats), then hides the document for undo_s
        # (Undo brings it back); the poll deletes it for good after that.
        self.delete_btn.click(self.ask_delete, [self.selected], [self.confirm_row, self.confirm_text, self.notice],
                              api_name="ask_delete")
        self.selected.change(lambda _: gr.update(visible=False), [self.selected], [self.confirm_row],
                             api_visibility="private")
        self.keep_btn.click(lambda: [gr.update(visible=False), ""], None, [self.confirm_row, self.notice],
                            api_visibility="private")
        self.confirm_btn.click(self.delete, [self.selected, self.state],
                               [self.notice, *self.refresh_outputs, self.state, self.confirm_row, self.undo_btn],
                               api_name="delete").then(
            self._reopen_after_delete, [self.state, chat.method, chat.sparsity], chat.open_outputs,
            api_visibility="private")
        self.undo_btn.click(self.undo, [self.state], [self.notice, *self.refresh_outputs, self.state, self.undo_btn],
                            api_name="undo")

    # ------------------------------------------------------------------ handlers

    def upload(self, files, truncate: bool, state: dict) -> list:
        """Queue each file (too large, empty or of another type: refused in plain words). The last one accepted
        (and not refused at once) is picked in the library; it is the document to open (the third output) when no
        document is open in the Chat tab, else the open one stays and the message says how to open the new one."""
        cfg = self.services.config
        paths = [Path(f if isinstance(f, str) else getattr(f, "name", f)) for f in (files or [])]
        if not paths:
            return [render.notice_html("Choose one or more files first.", "error"), gr.skip(), None, *self.refresh()]
        lines, opened = [], None
        if len(paths) > cfg.max_files:
            lines.append((f"Only the first {cfg.max_files} files were taken (at most {cfg.max_files} per upload).",
                          "error"))
            paths = paths[: cfg.max_files]
        settings = ContextSettings()
        batch: dict[str, str] = {}  # doc id -> the name it came under in this upload
        for path in paths:
            name = path.name  # Gradio keeps an upload under its own name, in a folder of its own
            try:
                document_kind(name)
            except UnsupportedTypeError as exc:
                lines.append((str(exc), "error"))
                _discard_upload(path)
                continue
            size = path.stat().st_size
            if size > cfg.max_upload_bytes:
                lines.append((f"{name}: {size / 2**20:.1f} MB is over the {cfg.max_upload_mb:g} MB limit per file",
                              "error"))
                _discard_upload(path)
                continue
            if size == 0:  # (refused at extraction too, but as the job of whichever empty file came first)
                lines.append((f"{name}: the file is empty", "error"))
                _discard_upload(path)
                continue
            data = path.read_bytes()
            doc_id = document_id(data)
            if doc_id in batch:  # the same bytes under another name: one document, prepared once
                lines.append((f"{name}: the same file as {batch[doc_id]} (prepared once)", "ok"))
                continue
            batch[doc_id] = name
            cached = doc_status(self.services, doc_id)
            if cached.state == "ready" and cached.exact:  # the same bytes were prepared before: open it now
                opened = cached.doc_id
                lines.append((f"{name}: already in the library, ready", "ok"))
                continue
            job = self.services.worker.submit_bytes(data, name, settings, truncate=bool(truncate))
            view = self.services.worker.view(job.id)
            if view.status == "failed":
                lines.append((f"{name}: {error_text(view)}", "error"))
            else:
                opened = job.doc_id
                lines.append((f"{name}: {render.stage_text(view)}", "ok" if view.status == "done" else "wait"))
        to_open = opened if opened is not None and not state.get("doc_id") else None
        if opened is not None and to_open is None:
            lines.append((f"{batch[opened]} is picked in the library below: Open shows it on the Chat tab.", "ok"))
        message = "".join(render.notice_html(text, kind) for text, kind in lines)
        return [message, None, to_open, *self.refresh(picked=opened)]

    def open(self, doc_id: str | None, state: dict, method: str, sparsity: float, request: gr.Request = None) -> list:
        """Open a document in the Chat tab and show that tab (nothing happens without a document)."""
        if not doc_id:
            return [gr.skip()] * (len(self.chat.open_outputs) + 2)
        return [*self.chat.open_document(doc_id, state, method, sparsity, request=request), *to_chat_tab()]

    def pick_row(self, rows, evt: gr.SelectData):
        try:
            row = evt.index[0] if isinstance(evt.index, (list, tuple)) else int(evt.index)
            return gr.update(value=rows.iloc[row, HEADERS.index("ID")] if hasattr(rows, "iloc") else rows[row][-1])
        except (IndexError, KeyError, TypeError, ValueError):
            return gr.skip()

    def cancel(self, doc_id: str | None) -> list:
        """Stop the document's preparation (queued or running); it can be prepared again by uploading it. The open
        document, its status line and the tab stay as they are."""
        if not doc_id:
            return [render.notice_html("Pick a document whose preparation to cancel.", "error"), *self.refresh()]
        job = self.services.worker.latest_for_document(doc_id)
        if job is None or job.status not in ("queued", "running") or not self.services.worker.cancel(job.id):
            return [render.notice_html("That document is not being prepared.", "error"), *self.refresh()]
        return [render.notice_html(f"Cancelling the preparation of {job.name}: it stops at its next step.", "ok"),
                *self.refresh()]

    def ask_delete(self, doc_id: str | None) -> list:
        """The confirmation of a delete: what goes (the document, its chats), with the buttons to go on or not."""
        hidden = gr.update(visible=False)
        if not doc_id:
            return [hidden, "", render.notice_html("Pick a document to delete.", "error")]
        try:
            doc = self.services.store.documents.find(doc_id)
        except NotFoundError:
            return [hidden, "", render.notice_html("That document is not in the library any more.", "error")]
        chats = len(self.services.store.chats.list(doc["id"]))
        what = f"{doc['name']} and its {chats} chat{'s' if chats != 1 else ''}" if chats else doc["name"]
        return [gr.update(visible=True), render.notice_html(f"Delete {what}?", "wait"), ""]

    def delete(self, doc_id: str | None, state: dict) -> list:
        """Take the document out of the library; it is deleted for good (with its chats and files) after
        config.undo_s, unless Undo brings it back."""
        state = dict(state)
        done = [gr.update(visible=False), gr.update(visible=False)]  # the confirmation row, the undo button
        if not doc_id:
            return [render.notice_html("Pick a document to delete.", "error"), *self.refresh(), state, *done]
        job = self.services.worker.latest_for_document(doc_id)
        if job is not None and job.status in ("queued", "running"):
            return [render.notice_html(f"{job.name} is being prepared; delete it when that has finished.", "error"),
                    *self.refresh(), state, *done]
        try:
            doc = self.services.engine.hide_document(doc_id)
        except NotFoundError:
            return [render.notice_html("That document is not in the library any more.", "error"),
                    *self.refresh(), state, *done]
        self.services.inspector.forget()
        if state.get("doc_id") == doc["id"]:
            state.update(doc_id=None, chat_id=None, reopen=True)
        state["undo"] = doc["id"]
        refreshed = self.refresh()
        refreshed[2] = gr.update(choices=doc_choices(library_rows(self.services)), value=None)
        undo_s = self.services.config.undo_s
        note = f"Deleted {doc['name']} and its chats." + (f" Undo within {undo_s:g} s." if undo_s else "")
        return [render.notice_html(note, "ok"), *refreshed, state, gr.update(visible=False),
                gr.update(visible=undo_s > 0)]

    def undo(self, state: dict) -> list:
        """Bring back the document deleted last in this page, while its undo window lasts."""
        state = dict(state)
        doc_id = state.pop("undo", None)
        hide = gr.update(visible=False)
        if not doc_id:
            return [render.notice_html("Nothing to undo.", "error"), *self.refresh(), state, hide]
        try:
            doc = self.services.engine.unhide_document(doc_id)
        except NotFoundError:
            return [render.notice_html("Too late: that document is deleted for good.", "error"), *self.refresh(),
                    state, hide]
        return [render.notice_html(f"{doc['name']} is back, with its chats.", "ok"), *self.refresh(), state, hide]

    def _reopen_after_delete(self, state: dict, method: str, sparsity: float, request: gr.Request = None) -> list:
        if not state.get("reopen"):
            return [gr.skip()] * len(self.chat.open_outputs)
        return self.chat.open_document(None, {**state, "reopen": False}, method, sparsity, request=request)

    def poll(self, seen: list | None) -> list:
        """The progress and the library as they are now, and the library as sent (`seen`: as this returned it
        last; an unchanged library is skipped); documents deleted longer than the undo window ago are deleted for
        good. Never the session's state, the open document or its status line (the chat's own poll follows those:
        ChatTab.watch)."""
        self.services.engine.delete_hidden(self.services.config.undo_s)
        rows = library_rows(self.services)
        signature = [[r["id"], r["status"], r["tokens"]] for r in rows]
        if signature == seen:
            return [self.jobs_html(), gr.skip(), gr.skip(), gr.skip(), gr.skip()]
        return [*self.refresh(rows=rows), signature]

    def jobs_html(self) -> str:
        """The preparations under way and the latest ones that failed."""
        views = self.services.worker.views()
        active = [v for v in views if v.status in ("queued", "running")]
        recent = active + [v for v in views if v.status == "failed"][-3:]
        return render.jobs_html(sorted(recent, key=lambda v: v.id),
                                {v.id: error_text(v) for v in recent if v.status == "failed"})

    def refresh(self, picked: str | None = None, rows: list[dict] | None = None) -> list:
        """The library's lists as they are now (`refresh_outputs`): the jobs, the table, and the choices of the two
        document pickers, whose values stay (`picked`: the library's picker shows this document instead)."""
        rows = library_rows(self.services) if rows is None else rows
        choices = doc_choices(rows)
        selected = gr.update(choices=choices) if picked is None else gr.update(choices=choices, value=picked)
        return [self.jobs_html(), library_table(rows), selected, gr.update(choices=choices)]


def _discard_upload(path: Path) -> None:
    """Delete a refused upload's copy in Gradio's upload folder (never a file elsewhere: a path given to the
    handler outside that folder is left alone)."""
    folder = Path(gradio.utils.get_upload_folder()).resolve()
    try:
        if path.resolve().is_relative_to(folder):
            path.unlink(missing_ok=True)
    except OSError:
        pass
