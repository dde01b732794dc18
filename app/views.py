"""The panel beside the chat: what attention did in a chosen turn (heatmap, KV budget and time split, retrieved
clusters and passages, the answer with each sentence's page, key projection). Rendered from a turn's saved
statistics and the context's artifacts; the heatmap and the projection are interactive figures (app/figures.py)."""

from __future__ import annotations

import gradio as gr

from app import figures, render
from app.citations import cite
from app.services import Services
from storage import StorageError

CLUSTER_ROWS = 60  # rows of the retrieved-units table at most (best scores first)
# A unit is what a method's lookup keeps: a cluster (squeeze, hsqueeze: its score is S of eq. 1) or a page (quest:
# its score is the bound of q . k over the page).
CLUSTER_HEADERS = ["layer", "KV head", "unit", "keys", "score (question)", "score (answer)", "prefill", "pages",
                   "text (first tokens)"]
TOP_PASSAGES = 5
ALL = "all"
DOCUMENT_BOX = "sq-document-box"  # the accordion that holds the whole document
# A click on a link to a passage (render.source_link) opens the whole document's accordion when it is closed,
# scrolls the document to the passage's place, flashes it and keeps every piece of its text highlighted
# (sq-current, until another passage is followed). Runs once per component (Gradio's js_on_load, with `element`
# the component's node); the links are plain anchors without it (the passage's first piece is their :target).
# A link that opens the PDF (render.pdf_link) is left to the browser.
GOTO_JS = """
if (element.dataset.sqGoto) return;
element.dataset.sqGoto = "1";
element.addEventListener("click", (event) => {
  const link = event.target.closest("a.sq-goto");
  if (!link) return;
  event.preventDefault();
  const id = link.dataset.target;
  const show = (tries) => {
    const target = document.getElementById(id);
    if (target && target.offsetParent !== null) {
      target.scrollIntoView({block: "center"});
      document.querySelectorAll(".sq-flash").forEach((e) => e.classList.remove("sq-flash"));
      document.querySelectorAll(".sq-current").forEach((e) => e.classList.remove("sq-current"));
      document.querySelectorAll(`[data-passage="${id}"]`).forEach((e) => e.classList.add("sq-current"));
      void target.offsetWidth;
      target.classList.add("sq-flash");
      return;
    }
    if (tries === 0) {
      const toggle = document.querySelector("#%s .label-wrap");
      if (toggle && !toggle.classList.contains("open")) toggle.click();
    }
    if (tries < 40) setTimeout(() => show(tries + 1), 50);
  };
  show(0);
});
""" % DOCUMENT_BOX


def turn_label(turn: dict) -> str:
    question = " ".join(turn["question"].split())
    return f"{turn['idx'] + 1}. {question[:48]}{'…' if len(question) > 48 else ''}"


class TurnViews:
    """Components for one turn's views; `outputs` is the list every handler that shows a turn updates."""

    def __init__(self, services: Services):
        self.services = services

    def render(self) -> None:
        self.turn = gr.Dropdown(label="Turn", choices=[], value=None, interactive=True, allow_custom_value=True,
                                elem_id="sq-turn")
        gr.Markdown("**(a) Kept fraction** per global layer (rows) and query head (columns)")
        self.heatmap = gr.Plot(figures.message_figure("Ask a question to see what attention kept."), show_label=False,
                               elem_id="sq-view-heatmap")
        gr.Markdown("**(c) KV budget and time**")
        self.budget = gr.HTML("", elem_id="sq-view-budget")
        self.compare = gr.HTML("", elem_id="sq-view-compare")
        gr.Markdown("**(b) Retrieved units** (clusters, or pages for Quest): kept by the question's lookup, or by "
                    "the answer's steps (their best score passed the threshold), and the passages their keys come "
                    "from, with the follow rows (the text right after the question's words and the answer's last "
                    "tokens, read by token ids) at full weight")
        self.clusters = gr.Dataframe(headers=CLUSTER_HEADERS, value=[], interactive=False, wrap=True, max_height=260,
                                     elem_id="sq-view-clusters")
        gr.Markdown("**The answer with its sources**: after each sentence, the page of the retrieved passage that "
                    "best supports it (its words and how strongly attention retrieved it); a click shows the passage "
                    "highlighted in the whole document below, and \"PDF p. N\" opens an uploaded PDF at that page")
        self.answer = gr.HTML("", elem_id="sq-view-answer", js_on_load=GOTO_JS)
        self.passages = gr.HTML("", elem_id="sq-view-passages", js_on_load=GOTO_JS)
        with gr.Accordion("Whole document, retrieved tokens highlighted", open=False, elem_id=DOCUMENT_BOX):
            self.document = gr.HTML("", elem_id="sq-view-document", max_height=500)
        gr.Markdown("**(d) Keys of one layer and KV head**, projected on two principal components")
        with gr.Row():
            self.layer = gr.Dropdown(label="Layer", choices=[], value=None, interactive=True, allow_custom_value=True,
                                     elem_id="sq-layer")
            self.head = gr.Dropdown(label="KV head", choices=[], value=None, interactive=True, allow_custom_value=True,
                                    elem_id="sq-head")
        self.projection = gr.Plot(None, show_label=False, elem_id="sq-view-projection")

    @property
    def outputs(self) -> list:
        """Everything `show` returns, in order."""
        return [self.heatmap, self.budget, self.compare, self.clusters, self.passages, self.document,
                self.layer, self.head, self.projection, self.answer]

    def empty(self, message: str = "Ask a question to see what attention kept.") -> list:
        return [figures.message_figure(message), "", "", [], "", "", gr.update(choices=[], value=None),
                gr.update(choices=[], value=None), None, ""]

    def turn_choices(self, turns: list[dict]):
        return [(turn_label(t), t["idx"]) for t in turns]

    def show(self, turn: dict | None, layer: int | None = None, kv_head: int | None = None) -> list:
        """The views of one saved turn (a row of store.chats.turns)."""
        if turn is None:
            return self.empty()
        stats = turn["stats"]
        if stats.get("stopped") or "kept_fraction_prefill" not in stats:
            return self.empty("This answer was stopped before it finished: no statistics were kept.")
        ctx = stats.get("context_id")
        try:
            data = self.services.inspector.data(ctx)
        except (StorageError, KeyError, TypeError) as exc:
            out = self.empty(f"The index of this turn is gone ({exc}); its numbers are below.")
            out[0] = figures.heatmap_figure(stats)
            out[1] = render.budget_html(stats)
            return out
        report = stats.get("retrieval") or {"layers": []}
        inspector = self.services.inspector
        weights = inspector.token_weights(ctx, report)
        passages = inspector.passages(ctx, weights, top=TOP_PASSAGES)
        tail = data.offsets[data.tail_start:] if data.tail_start < data.fixed_len else None
        tail_start = int(tail[tail[:, 0] >= 0][0, 0]) if tail is not None and (tail[:, 0] >= 0).any() else None
        layers = data.global_layers
        layer = layer if layer in layers else (layers[0] if layers else None)
        heads = list(range(data.kv_heads))
        kv_head = kv_head if kv_head in heads else 0
        doc, paged = data.doc, render.is_paged(data.doc.page_starts)
        pdf = self.pdf_address(doc.doc_id) if paged else None
        shown = [] if report.get("error") else passages
        answer = turn.get("answer") or ""
        return [
            figures.heatmap_figure(stats),
            render.budget_html(stats),
            render.compare_html(stats.get("compare")),
            self._cluster_rows(ctx, report),
            render.notice_html(f"The retrieved passages could not be worked out: {report['error']}", "error")
            if report.get("error") else render.passages_html(doc.text, passages, paged=paged, pdf=pdf),
            render.document_html(doc.text, inspector.marks(ctx, weights), doc.page_starts, tail_start, shown),
            gr.update(choices=[(f"layer {i}", i) for i in layers], value=layer),
            gr.update(choices=[(f"KV head {h}", h) for h in heads], value=kv_head),
            self.projection_view(ctx, report, layer, kv_head),
            render.cited_answer_html(answer, cite(doc.text, doc.page_starts, shown, answer), shown, paged, pdf=pdf),
        ]

    def pdf_address(self, doc_id: str) -> str | None:
        """Where the app serves the document's original PDF (render.pdf_url), or None where it was not kept."""
        try:
            path = self.services.store.documents.source_file(doc_id)
        except StorageError:
            return None
        return render.pdf_url(path) if path is not None else None

    def projection_view(self, ctx: str, report: dict, layer: int | None, kv_head: int):
        """(d) The projection figure of one layer and KV head, or a figure saying why there is none."""
        if layer is None:
            return figures.message_figure("This model has no clustered layer.")
        retrieved = sorted({cid for entry in report.get("layers", []) if entry["layer"] == layer
                            for row in entry["rows"] if row["kv_head"] == kv_head for cid in row["ids"]})
        try:
            proj = self.services.inspector.projection(ctx, report.get("method", "squeeze"), layer, kv_head, retrieved)
        except (StorageError, ValueError) as exc:
            return figures.message_figure(f"No projection: {exc}")
        return figures.projection_figure(proj)

    def _cluster_rows(self, ctx: str, report: dict) -> list[list]:
        """The retrieved clusters, largest S first: at the question's prefill (exact) or by the answer's tokens."""
        inspector = self.services.inspector
        method = report.get("method", "squeeze")
        rows = []
        for entry in report.get("layers", []):
            for row in entry["rows"]:
                for i, cid in enumerate(row["ids"]):
                    sq, sa = row["s_question"][i], row["s_answer"][i]
                    rows.append((max(sq, sa), entry["layer"], row["kv_head"], cid, row["sizes"][i], sq, sa,
                                 row["prefill"][i]))
        rows.sort(key=lambda r: -r[0])
        out = []
        for _, layer, head, cid, size, sq, sa, prefill in rows[:CLUSTER_ROWS]:
            pages = inspector.cluster_pages(ctx, method, layer, head, [cid])[cid]
            out.append([layer, head, cid, size, f"{sq:.4f}", f"{sa:.4f}", "yes" if prefill else "-",
                        render.pages_text(pages), inspector.cluster_preview(ctx, method, layer, head, cid)])
        return out
