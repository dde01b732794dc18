"""HTML for the app's views, from plain data (pure functions: no Gradio, no engine calls, no tensors).

Every view is self-contained markup with `sq-` classes (styled by assets/app.css); the two charts (the kept-fraction
heatmap, the key projection) are interactive plotly figures (app/figures.py), drawn with the colours defined here.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from engine.serve import LOADING, STAGES, full_attention_found

STAGE_LABELS = {
    LOADING: "loading model",
    "extracting": "extracting text",
    "tokenizing": "tokenizing",
    "prefill": "prefill",
    "clustering": "clustering",
    "calibrating": "calibrating",
    "saving": "saving",
}
STAGE_UNITS = {"prefill": "tokens", "clustering": "layers", "saving": "files", "extracting": "pages"}
COUNTED_AT_ONE = ("prefill", "clustering", "saving")  # stages whose count shows even where the whole is one
LOW, HIGH = (247, 251, 255), (8, 48, 107)  # heatmap colour scale: kept fraction 0 -> 1 (light to dark blue)
GOLDEN_ANGLE = 137.508  # degrees: consecutive cluster ids get well separated hues


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def time_left(eta_s: float | None, stage: str | None = None) -> str:
    """'about 12 s left', or why there is no estimate yet."""
    if stage == LOADING:
        return "the time left is known once the model is loaded (the first run of a model takes longest)"
    if eta_s is None:
        return "estimating the time left"
    return f"about {format_seconds(eta_s)} left"


RESUMED = "resumed after a restart"


def stage_text(view) -> str:
    """'prefill 2048/3970 tokens' for a JobView; a job that carries on one a stopped server left says so while it
    is active ('waiting: next after guide.pdf (resumed after a restart)')."""
    text = _stage_text(view)
    return f"{text} ({RESUMED})" if view.resumed and view.status in ("queued", "running") else text


def queue_text(view) -> str:
    """Where a queued job stands: 'next in the queue' (nothing ahead of it), 'waiting: next after guide.pdf' (behind
    the job being prepared), 'waiting: 3 ahead'; 'queued' for a job another process queued."""
    if not view.position:
        return "queued"
    if not view.ahead:
        return "next in the queue"
    if view.ahead == 1 and view.after:
        return f"waiting: next after {view.after}"
    return f"waiting: {view.ahead} ahead"


def _stage_text(view) -> str:
    if view.status == "queued":
        if view.stage == LOADING:  # the worker loads the model before its first job
            return ("waiting for the model to load" + (f" ({view.ahead} ahead)" if view.ahead else "")
                    + (f": {load_step_text(view)}" if view.detail else ""))
        return queue_text(view)
    if view.status == "done":
        return "ready (from the cache)" if view.cached else "ready"
    if view.status in ("failed", "cancelled"):
        return view.status
    if view.stage == LOADING and view.detail:
        return f"loading model: {load_step_text(view)}, {format_seconds(view.elapsed_s)} so far"
    if view.stage == LOADING and (view.elapsed_s or 0) >= 1:
        return f"loading model ({format_seconds(view.elapsed_s)} so far)"
    label = STAGE_LABELS.get(view.stage, view.stage)
    if view.total > 1 or view.stage in COUNTED_AT_ONE:  # (a text file's extraction is one step: no count)
        return f"{label} {view.done}/{view.total} {STAGE_UNITS.get(view.stage, '')}".rstrip()
    return label


def load_step_text(view) -> str:
    """'loading the weights (step 5 of 5)' for a JobView of a job waiting on the model's load."""
    return f"{view.detail} (step {min(view.done + 1, view.total)} of {view.total})"


def job_html(view, error_text: str | None = None) -> str:
    """One job: name, a progress bar, the stages, the time left or the error in plain words."""
    pct = round(100 * view.fraction)
    state = view.status
    stages = []
    current = STAGES.index(view.stage) if view.stage in STAGES else (-1 if view.status != "done" else len(STAGES))
    for i, stage in enumerate(STAGES):
        running = i == current and state == "running"
        cls = "done" if i < current or view.status == "done" else ("now" if running else "todo")
        stages.append(f'<span class="sq-stage sq-{cls}">{esc(STAGE_LABELS[stage])}</span>')
    if state == "failed":
        detail = f'<div class="sq-error">Could not prepare it: {esc(error_text or view.error)}</div>'
    elif state == "cancelled":
        detail = '<div class="sq-error">Cancelled: its preparation was stopped.</div>'
    elif state == "done":
        detail = (f'<div class="sq-ok">{esc(stage_text(view))}: {view.tokens or 0} tokens, {view.pages or 0} '
                  'page(s)</div>')
    else:
        detail = f'<div class="sq-eta">{esc(stage_text(view))} · {esc(time_left(view.eta_s, view.stage))}</div>'
    return (
        f'<div class="sq-job sq-job-{esc(state)}" data-doc="{esc(view.doc_id)}" data-status="{esc(state)}">'
        f'<div class="sq-job-head"><b>{esc(view.name)}</b><span>{pct}%</span></div>'
        f'<div class="sq-bar"><div class="sq-fill" style="width:{pct}%"></div></div>'
        f'<div class="sq-stages">{"".join(stages)}</div>{detail}</div>'
    )


def jobs_html(views: Sequence, errors: dict[str, str] | None = None) -> str:
    """The jobs under "Being prepared": the queued and running ones (newest first), then those that ended without a
    document (failed, cancelled) under a heading of their own, so that none reads as still being prepared."""
    errors = errors or {}
    active = [v for v in views if v.status in ("queued", "running")]
    ended = [v for v in views if v.status in ("failed", "cancelled")]
    cards = "".join(job_html(v, errors.get(v.id)) for v in reversed(active))
    body = cards or '<div class="sq-empty">No document is being prepared.</div>'
    if ended:
        body += ('<div class="sq-jobs-ended"><div class="sq-jobs-ended-head">Could not be prepared</div>'
                 + "".join(job_html(v, errors.get(v.id)) for v in reversed(ended)) + "</div>")
    return f'<div class="sq-jobs{"" if active or ended else " sq-empty"}">{body}</div>'



def notice_html(text: str, kind: str = "info") -> str:
    """A one-line message; kind: info | ok | error | wait."""
    return f'<div class="sq-notice sq-{esc(kind)}">{esc(text)}</div>'


# ---------------------------------------------------------------------- (c) budget and time split

BUDGET_SLACK = 0.01  # read above the asked budget by more than this is explained beside the figures


def budget_html(stats: dict) -> str:
    """(c) The KV budget (turn and prefill), the plan the method used, and where the turn's time went."""
    t = stats.get("timings", {})
    total = float(t.get("total_s", 0.0))
    lookup, attention = float(t.get("lookup_s", 0.0)), float(t.get("attention_s", 0.0))
    rest = max(0.0, total - lookup - attention)
    parts = [("lookup", lookup), ("attention", attention), ("rest of the model", rest)]
    bar = "".join(
        f'<div class="sq-seg sq-seg-{i}" style="width:{100 * v / total if total else 0:.2f}%" '
        f'title="{esc(n)} {v:.3f} s"></div>'
        for i, (n, v) in enumerate(parts))
    keys = "".join(f'<span class="sq-key"><i class="sq-seg-{i}"></i>{esc(n)} {v:.2f} s</span>'
                   for i, (n, v) in enumerate(parts))
    timed, steps = int(t.get("timed_steps", stats.get("steps", 0))), int(stats.get("steps", 0))
    if timed < steps:  # decode steps replayed from a CUDA graph run as one launch: their parts are not timed
        keys += (f'<span class="sq-key sq-note">lookup and attention timed over {timed} of {steps} steps; the '
                 f'{steps - timed} replayed from a CUDA graph count in the rest</span>')
    budget, prefill = float(stats.get("kv_budget", 0.0)), float(stats.get("kv_budget_prefill", 0.0))
    decode = stats.get("kv_budget_decode")  # absent from turns recorded before it was counted
    method = stats.get("method", "?")
    sparsity = stats.get("sparsity", 0.0)
    plan = (stats.get("extra") or {}).get("plan", "")  # the plan the turn ran, in its own words
    asked = 1.0 - float(sparsity)
    return (
        '<div class="sq-budget" id="sq-budget">'
        f'<div class="sq-row"><b>{esc(method)}</b>{f" at {100 * sparsity:.0f}% sparsity" if sparsity else ""}'
        f'{f" · {esc(plan)}" if plan else ""}</div>'
        f'<div class="sq-row">KV budget <b class="sq-kv">{100 * budget:.1f}%</b> of the fixed context\'s K/V bytes per '
        f'step, asked <b class="sq-asked">{100 * asked:.1f}%</b> (question prefill {100 * prefill:.1f}%'
        f'{f", answer {100 * float(decode):.1f}%" if decode is not None else ""})</div>'
        f'{budget_note(budget, asked)}'
        f'<div class="sq-bar sq-kvbar"><div class="sq-fill" style="width:{min(100.0, 100 * budget):.1f}%"></div></div>'
        f'<div class="sq-row">Time {total:.2f} s · first token {float(t.get("first_token_s", 0.0)):.2f} s · '
        f'{float(t.get("tokens_per_s", 0.0)):.1f} tokens/s · {stats.get("new_tokens", 0)} tokens</div>'
        f'<div class="sq-stack">{bar}</div><div class="sq-keys">{keys}</div></div>'
    )


def budget_note(read: float, asked: float, slack: float = BUDGET_SLACK) -> str:
    """A line where a turn read more than it asked for (a document whose index and dense rows alone take more than
    the budget, or on a GPU a method that keeps a planned number of keys there and met more follow rows than its plan
    set aside); nothing where it read what it asked."""
    if read <= asked + slack:
        return ""
    return (f'<div class="sq-row sq-note">This turn read {100 * (read - asked):.1f} points more than asked: on this '
            f'document the method\'s index and the dense rows take that much of the budget (the slider\'s hint says '
            f'how low it reaches), or, on a GPU, the question met more of the document\'s follow rows than the '
            f'method\'s plan set aside (Quest, DuoAttention and Saap keep a planned number of keys there).</div>')


def compare_html(compare: dict | None) -> str:
    if not compare:
        return ""
    agree = compare.get("agree")
    badge = ('<span class="sq-badge sq-agree">answers agree</span>' if agree
             else '<span class="sq-badge sq-differ">answers differ</span>')
    return (f'<div class="sq-compare">{badge} Full attention said: <q>{esc(compare.get("answer", ""))}</q> '
            f'(KV budget 100%, {float(compare.get("total_s", 0.0)):.2f} s)</div>')


# ---------------------------------------------------------------------- methods against full attention


# The columns of the evaluation table, each with what it means (shown as the header's tooltip).
EVAL_COLUMNS = (
    ("method", "the sparse method"),
    ("KV budget", "the share of the context's K/V bytes a step may read, index included (100 - sparsity)"),
    ("needles as good as full (decided)", "share of the needle cells where the method did as well as full "
                                          "attention; in brackets the share it found of the cells full attention "
                                          "found with no near-tie on the way (top two tokens at least 0.5 nats "
                                          "apart at every answer token through the key)"),
    ("recall (unit ceiling; oracle)", "share of full attention's weight on the keys read; in brackets the best "
                                     "choice of the method's own units (clusters, pages) at the keys it read, and "
                                     "the best top-k keys at that budget"),
    ("top-1 (decided)", "next tokens the same as full attention's; in brackets over the positions where full "
                        "attention's top two tokens are at least 0.5 nats apart (its near-ties left out)"),
    ("KL", "mean KL(full || method) of the next-token distributions"),
    ("read (question / answer)", "KV budget measured in the question's prefill / the answer's steps"),
)
NO_VALUE = "–"


def format_date(iso: str | None) -> str:
    """An ISO time as local 'YYYY-MM-DD HH:MM' ('-' for none; as given when it is no ISO time)."""
    if not iso:
        return "-"
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except (TypeError, ValueError):
        return str(iso)


def _number(value: object, spec: str, scale: float = 1.0, unit: str = "") -> str:
    """A number formatted (times `scale`, then `unit`), or NO_VALUE for a missing one (null, or no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NO_VALUE
    return format(value * scale, spec) + unit


def eval_rows(doc: dict) -> list[list[str]]:
    """The summary of a `squeeze eval` document as table cells, in its order (one row per method and budget)."""
    rows = []
    for r in doc.get("summary") or []:
        recall, units, oracle = (_number(r.get(k), ".2f") for k in ("recall", "units", "oracle"))
        top1, decided = (_number(r.get(k), ".0f", 100, "%") for k in ("top1", "top1_decided"))
        needles, needles_decided = (_number(r.get(k), ".0f", 100, "%") for k in ("needles", "needles_decided"))
        rows.append([
            str(r.get("method", "?")),
            _number(r.get("budget"), ".0f", 100, "%"),
            needles if needles_decided == NO_VALUE else f"{needles} ({needles_decided})",
            recall if recall == NO_VALUE else f"{recall} ({units}; {oracle})",
            top1 if decided == NO_VALUE else f"{top1} ({decided})",
            _number(r.get("kl"), ".3g"),
            f"{_number(r.get('read_prefill'), '.3f')} / {_number(r.get('read_decode'), '.3f')}",
        ])
    return rows


def eval_html(doc: dict | None, model: str) -> str:
    """The latest `squeeze eval` of `model`: every sparse method beside full attention at equal KV budgets, with the
    date and the model of the results; one plain line when there is none."""
    if not doc or not doc.get("summary"):
        return notice_html(f"No evaluation yet for {model}: run `squeeze eval` (about 15 minutes on a CPU).")
    head = "".join(f'<th title="{esc(why)}">{esc(name)}</th>' for name, why in EVAL_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in eval_rows(doc))
    caption = f"Latest squeeze eval of {doc.get('model', model)}, {format_date(doc.get('created'))}"
    ran = [str(doc["device"])] if doc.get("device") else []
    if isinstance(doc.get("seconds"), (int, float)):
        ran.append(format_seconds(doc["seconds"]))
    if ran:
        caption += f" ({', '.join(ran)})"
    found = full_attention_found(doc.get("full") or {})
    if found:
        caption += f"; {found}"
    return (f'<div class="sq-eval" id="sq-eval"><div class="sq-caption">{esc(caption)}</div>'
            f'<table class="sq-eval-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')


# ---------------------------------------------------------------------- (b) passages


def _marked(text: str, start: int, end: int, marks: Sequence[tuple[int, int, float]]) -> str:
    """text[start:end] with the marked spans wrapped in <mark> (opacity by weight)."""
    out, pos = [], start
    for s, e, w in marks:
        s, e = max(s, pos), min(e, end)
        if e <= s:
            continue
        out.append(esc(text[pos:s]))
        out.append(f'<mark class="sq-hit" style="--w:{w:.2f}">{esc(text[s:e])}</mark>')
        pos = e
    out.append(esc(text[pos:end]))
    return "".join(out)


def page_anchor(page: int) -> str:
    """The id of page `page`'s marker in the document view (`document_html`)."""
    return f"sq-page-{page}"


def passage_anchor(rank: int) -> str:
    """The id of the place where the passage `rank` (1-based, as listed by `passages_html`) starts in the document
    view."""
    return f"sq-passage-{rank}"


def is_paged(page_starts: Sequence[int]) -> bool:
    """Whether a document has pages to cite (a text file is one page: its passages are cited by their place)."""
    return len(page_starts) > 1


def source_link(passage, rank: int, paged: bool, label: str | None = None, pdf: str | None = None) -> str:
    """A link to a passage in the document view (label: "p. N", or "passage N" where the document has no pages),
    followed by a link to its page in the document's PDF (`pdf_link`) where `pdf` gives the PDF's address.

    Its href is the passage's page marker (`page_anchor`; its place, `passage_anchor`, where there are no pages);
    its data-target is the passage's place, where the app's click handler (app.views.GOTO_JS) scrolls to."""
    href = page_anchor(passage.page) if paged else passage_anchor(rank)
    label = label or (f"p. {passage.page}" if paged else f"passage {rank}")
    link = (f'<a class="sq-goto" href="#{href}" data-target="{passage_anchor(rank)}" '
            f'title="show it in the whole document, the passage highlighted">{esc(label)}</a>')
    return f"{link} · {pdf_link(pdf, passage.page)}" if pdf and paged else link


PDF_ROUTE = "gradio_api/file="  # Gradio's file route, relative to the app's address


def pdf_url(path: str | Path) -> str:
    """The address the app serves a document's kept PDF at: Gradio's file route for the file's path, allowed for
    the folder of kept PDFs only (app.demo.launch_kwargs)."""
    return PDF_ROUTE + quote(str(path))


def pdf_link(pdf: str, page: int) -> str:
    """A link that opens the PDF at `pdf` (`pdf_url`) at page `page` in a new tab."""
    return (f'<a class="sq-pdf" href="{esc(pdf)}#page={page}" target="_blank" rel="noopener" '
            f'title="open the PDF at page {page} in a new tab">PDF p. {page}</a>')


def passages_html(text: str, passages: Sequence, context_chars: int = 80, paged: bool = True,
                  pdf: str | None = None) -> str:
    """(b) The passages whose tokens the lookup retrieved, best first, each with its page number linking to that page
    in the document view (`document_html`), or to the passage's place there when the document has no pages, and to
    that page of the document's PDF where `pdf` gives its address (`pdf_url`)."""
    if not passages:
        return '<div class="sq-passages sq-empty">No clusters retrieved (full attention reads every key).</div>'
    items = []
    for rank, p in enumerate(passages, 1):
        a = max(0, p.start - context_chars)
        b = min(len(text), p.end + context_chars)
        body = ("…" if a > 0 else "") + _marked(text, a, b, p.marks) + ("…" if b < len(text) else "")
        link = source_link(p, rank, paged, label=f"p. {p.page}", pdf=pdf)
        items.append(f'<li class="sq-passage" data-page="{p.page}"><span class="sq-page">{link}</span>'
                     f'<span class="sq-text">{body}</span></li>')
    return '<ol class="sq-passages" id="sq-passages">' + "".join(items) + "</ol>"


def cited_answer_html(answer: str, citations: Sequence, passages: Sequence, paged: bool,
                      pdf: str | None = None) -> str:
    """The answer with a citation after each sentence that a retrieved passage supports (app.citations.cite): a
    superscript link per source, "[p. 3]" to the page in the document view, or "[passage 2]" to the passage's place
    where the document has no pages; with "PDF p. 3" beside it, to that page of the document's PDF, where `pdf`
    gives its address (`pdf_url`). The answer's text is shown as it is (escaped); unsupported sentences cite
    nothing."""
    if not answer.strip():
        return ""
    out, pos = [], 0
    for c in citations:
        out.append(esc(answer[pos:c.end]))
        pos = c.end
        if c.sources:
            links = ", ".join(source_link(passages[i], i + 1, paged, pdf=pdf) for i in c.sources)
            out.append(f'<sup class="sq-cite">[{links}]</sup>')
    out.append(esc(answer[pos:]))
    cited = sum(1 for c in citations if c.sources)
    note = (f"{cited} of {len(citations)} sentence(s) cited: each links to the "
            f"{'page' if paged else 'place'} of the retrieved passage that best supports it")
    if not passages:
        note = "No passage was retrieved (full attention reads every key): there is nothing to cite."
    elif cited < len(citations):
        note += "; a sentence without one has no retrieved passage that holds its words"
    return (f'<div class="sq-answer" id="sq-answer"><div class="sq-answer-text">{"".join(out)}</div>'
            f'<div class="sq-caption">{esc(note)}</div></div>')


def document_html(text: str, marks: Sequence[tuple[int, int, float]], page_starts: Sequence[int],
                  tail_start: int | None = None, passages: Sequence = ()) -> str:
    """The whole document with the retrieved tokens highlighted, a marker where each page starts, and each of
    `passages` held in a highlight of its own.

    Every page has an anchor (`page_anchor`: its marker, or an empty one for a page without text or a document of
    one page). Each passage's text is wrapped in `<mark class="sq-cited" data-passage="sq-passage-N">` pieces (one
    per stretch between page markers), the first of which carries its anchor (`passage_anchor`, by its rank): the
    target of the links of `passages_html` and `cited_answer_html`, highlighted when followed (`:target`, or the
    app's click handler, which marks every piece). A passage without text keeps an empty anchor where it starts.
    tail_start: character where the dense tail begins (always attended; shown underlined)."""
    paged = is_paged(page_starts)
    spans = [(rank, min(max(0, p.start), len(text)), min(max(0, p.end), len(text)))
             for rank, p in enumerate(passages, 1)]
    bounds_at = {s for _, s, _ in spans} | {e for _, _, e in spans}
    cuts = sorted({0, *page_starts, *bounds_at} | ({tail_start} if tail_start is not None else set()))
    cuts = [c for c in cuts if c <= len(text)]
    out = ['<div class="sq-doc" id="sq-doc">']
    bounds = cuts + [len(text)]
    anchored: set[int] = set()  # passages whose anchor is placed
    mi = 0
    for i, start in enumerate(cuts):
        end = bounds[i + 1]
        pages = [n for n, s in enumerate(page_starts, 1) if s == start]  # several: pages without text before one
        for page in pages[:-1] if paged else pages:
            out.append(f'<span class="sq-anchor" id="{page_anchor(page)}"></span>')
        if paged and pages:
            out.append(f'<div class="sq-pagebreak" id="{page_anchor(pages[-1])}">page {pages[-1]}</div>')
        for rank, s, e in spans:  # passages without text: an empty anchor where they start
            if s == e == start and rank not in anchored:
                anchored.add(rank)
                out.append(f'<span class="sq-anchor" id="{passage_anchor(rank)}"></span>')
        if start == end:
            continue
        while mi < len(marks) and marks[mi][1] <= start:
            mi += 1
        inner = [m for m in marks[mi:] if m[0] < end]
        chunk = _marked(text, start, end, inner)
        if tail_start is not None and start >= tail_start:
            chunk = f'<span class="sq-tail" title="dense tail: always attended">{chunk}</span>'
        for rank, s, e in reversed(spans):  # the passages over this stretch, the best outermost
            if s <= start and end <= e:
                anchor = passage_anchor(rank)
                ident = "" if rank in anchored else f' id="{anchor}"'  # the first piece holds the anchor
                anchored.add(rank)
                chunk = f'<mark class="sq-cited"{ident} data-passage="{anchor}">{chunk}</mark>'
        out.append(chunk)
    for rank, _, _ in spans:  # (a passage past the text's end)
        if rank not in anchored:
            out.append(f'<span class="sq-anchor" id="{passage_anchor(rank)}"></span>')
    out.append("</div>")
    return "".join(out)


# ---------------------------------------------------------------------- (d) projection


def cluster_colour(cid: int, alpha: float = 1.0, light: bool = False) -> str:
    hue = (cid * GOLDEN_ANGLE) % 360
    return f"hsla({hue:.0f},{45 if light else 70}%,{75 if light else 45}%,{alpha})"


def pages_text(pages: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    if not pages:
        return "-"
    ranges, start, prev = [], pages[0], pages[0]
    for p in list(pages[1:]) + [math.inf]:
        if p == prev + 1:
            prev = p
            continue
        ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = p
    return ", ".join(ranges)
