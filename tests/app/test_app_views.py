"""The views' data and markup without a model: engine.serve.explain over a hand-made context in an in-memory store
(which tokens and passages a turn retrieved, with pages; the key projection; the saved report), and app.render."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from app import figures, render
from engine.serve.explain import MIN_MARK, ContextInspector, retrieval_report
from engine.serve.jobs import JobView
from storage import Store, load_document_bytes
from tests.support.pdfs import make_text_pdf

PAGE1 = "Alpha beta gamma delta. The harbor wall is old and grey. Walkers come <every> day."
PAGE2 = "Storms came often. The secret passkey is 48213. Remember it. The keeper rang the bell."
LAYER, HKV, D, CLUSTERS, TAIL = 5, 2, 8, 5, 3
SECRET = {"passkey", "48213."}  # their tokens form cluster 0 of KV head 0


@pytest.fixture(scope="module", params=[0, 2], ids=["no-sink", "sink"])
def ctx(request):
    """A ready context of a two-page PDF: one token per word, one clustered layer with two KV heads; with a sink,
    its first tokens stored after the indexed ones (engine.attention.rows), which the labels then start after."""
    sink = request.param
    store = Store.memory()
    doc = load_document_bytes(make_text_pdf([PAGE1, PAGE2]), "guide.pdf")
    doc_id, _ = store.documents.add(doc)
    words = [(m.start(), m.end()) for m in re.finditer(r"\S+", doc.text)]
    offsets = torch.tensor([(-1, -1)] + words, dtype=torch.int64)  # BOS first
    n = offsets.shape[0]
    lc = n - TAIL - sink
    labels = torch.zeros(HKV, lc, dtype=torch.int64)  # per indexed row j: token sink + j
    for j in range(lc):
        t = sink + j
        s, e = offsets[t].tolist()
        word = doc.text[s:e] if s >= 0 else ""
        labels[0, j] = 0 if word in SECRET else 1 + t % (CLUSTERS - 1)
        labels[1, j] = t % CLUSTERS
    gen = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(torch.randn(HKV, CLUSTERS, D, generator=gen), dim=-1)
    keys = torch.stack([directions[h, labels[h]] for h in range(HKV)]) + 0.05 * torch.randn(HKV, lc, D, generator=gen)
    keys = torch.cat([keys, torch.randn(HKV, sink + TAIL, D, generator=gen)], dim=1)  # the dense rows
    counts = torch.stack([torch.bincount(labels[h], minlength=CLUSTERS) for h in range(HKV)])
    context = store.contexts.context_for(doc_id, "hand-made", {"dense_tail": TAIL, "sink": sink})
    for name, t in {f"squeeze.layer{LAYER}.labels": labels, f"layer{LAYER}.keys": keys,
                    f"layer{LAYER}.calib_queries": torch.zeros(2 * HKV, TAIL, D),
                    f"squeeze.layer{LAYER}.centroids": directions, f"squeeze.layer{LAYER}.counts": counts,
                    "offsets": offsets, "tokens": torch.arange(n)}.items():
        store.artifacts.save(context["id"], name, t)
    store.methods.mark_built(context["id"], "squeeze", {"squeeze": {"centroid_ratio": 0.05}})
    store.contexts.mark_ready(context["id"], n)
    yield store, context["id"], doc, labels, sink
    store.close()


def report(threshold=0.01):
    """Cluster 0 of head 0 retrieved by the answer (S 0.5), cluster 1 at the question's prefill (S at the threshold)."""
    return {"threshold": threshold, "layers": [{"layer": LAYER, "rows": [
        {"row": 0, "kv_head": 0, "ids": [0, 1], "sizes": [2, 5], "s_question": [0.001, threshold],
         "s_answer": [0.5, 0.0], "prefill": [False, True]},
        {"row": 1, "kv_head": 1, "ids": [], "sizes": [], "s_question": [], "s_answer": [], "prefill": []},
    ]}]}


def test_token_weights_scale_from_the_threshold_to_the_best_cluster(ctx):
    store, cid, doc, labels, sink = ctx
    inspector = ContextInspector(store)
    w = inspector.token_weights(cid, report())
    lc = labels.shape[1]
    indexed = w[sink : sink + lc]  # the indexed tokens
    assert np.allclose(indexed[labels[0].numpy() == 0], 1.0)
    assert np.allclose(indexed[labels[0].numpy() == 1], MIN_MARK)
    assert (indexed[labels[0].numpy() >= 2] == 0).all()  # not retrieved
    assert (w[:sink] == 0).all() and (w[sink + lc :] == 0).all()  # the sink and the dense tail: in no cluster
    assert (inspector.token_weights(cid, report(), kv_head=1) == 0).all()
    built = store.methods.get(cid, "squeeze")["built_at"]
    assert np.allclose(inspector.token_weights(cid, {**report(), "built_at": built}), w)
    stale = {**report(), "built_at": "2000-01-01T00:00:00+00:00"}  # made with an index rebuilt since
    assert (inspector.token_weights(cid, stale) == 0).all()


def test_follow_rows_weigh_one_in_every_layer_and_head_and_make_a_passage(ctx):
    """The tokens a turn read as follow rows (the report's `follow`) weigh 1 whatever the selection, in every layer
    and KV head, and even when the index was rebuilt since; positions outside the context are ignored."""
    store, cid, doc, labels, sink = ctx
    inspector = ContextInspector(store)
    n = inspector.data(cid).fixed_len
    read = [3, 4, 5, n - 1]
    follow = {**report(), "follow": read + [-1, n + 5]}
    w = inspector.token_weights(cid, follow)
    assert (w[read] == 1.0).all()
    others = np.ones(n, dtype=bool)
    others[read] = False
    assert np.allclose(w[others], inspector.token_weights(cid, report())[others])
    assert (inspector.token_weights(cid, follow, kv_head=1)[read] == 1.0).all()
    stale = {**follow, "built_at": "2000-01-01T00:00:00+00:00"}
    w = inspector.token_weights(cid, stale)
    assert (w[read] == 1.0).all() and w[others].sum() == 0
    passages = inspector.passages(cid, w, top=2)
    s, e = inspector.data(cid).offsets[4].tolist()
    assert any(p.start <= s and e <= p.end for p in passages)


def test_the_strongest_passage_comes_first_with_its_page(ctx):
    store, cid, doc, _, _ = ctx
    inspector = ContextInspector(store)
    w = inspector.token_weights(cid, report())
    passages = inspector.passages(cid, w, top=3)
    best = passages[0]
    assert best.page == 2 and "48213" in doc.text[best.start:best.end]
    marked = {doc.text[s:e] for s, e, weight in best.marks if weight == pytest.approx(1.0)}
    assert marked == SECRET
    assert [p.score for p in passages] == sorted((p.score for p in passages), reverse=True)
    spans = sorted((p.start, p.end) for p in passages)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # passages do not overlap
    assert inspector.cluster_pages(cid, "squeeze", LAYER, 0, [0])[0] == [2]
    assert "passkey" in inspector.cluster_preview(cid, "squeeze", LAYER, 0, 0)


def test_a_units_preview_shows_the_words_its_tokens_belong_to(ctx, monkeypatch):
    """A unit whose tokens are bits of words (a full stop, the end of a number: what a cluster of punctuation looks
    like under a sub-word tokenizer) previews the words they belong to, not the marks alone."""
    store, cid, doc, _, _ = ctx
    inspector = ContextInspector(store)
    data = inspector.data(cid)
    spans = data.offsets.tolist()
    words = [t for t, (s, e) in enumerate(spans) if s >= 0 and e - s > 2][:6:2]  # three words, none adjacent
    offsets = data.offsets.copy()
    for t in words:  # each token only the last character of its word
        offsets[t, 0] = offsets[t, 1] - 1
    labels = {LAYER: np.full((1, data.fixed_len), -1)}
    labels[LAYER][0, words] = 7
    monkeypatch.setattr(inspector, "data", lambda context_id: dataclasses.replace(data, offsets=offsets))
    monkeypatch.setattr(inspector, "unit_labels", lambda context_id, method: labels)
    preview = inspector.cluster_preview(cid, "squeeze", LAYER, 0, 7, chars=400)
    assert preview.split(" · ") == [doc.text[spans[t][0]:spans[t][1]].strip() for t in words]


def test_projection_of_one_head_marks_the_retrieved_clusters(ctx):
    store, cid, _, labels, _ = ctx
    proj = ContextInspector(store).projection(cid, "squeeze", LAYER, 0, retrieved=[0], max_points=10)
    assert proj.points.shape == (10, 2) and proj.centroids.shape == (CLUSTERS, 2)
    assert (proj.labels == 0).sum() == (labels[0] == 0).sum()  # every retrieved key is drawn
    assert 0.5 < proj.explained <= 1.0  # five tight clusters in 8-D: two components hold most of the spread
    fig = figures.projection_figure(proj)
    drawn = {t.name: t for t in fig.data}
    assert len(drawn["keys of retrieved clusters"].x) == int((labels[0] == 0).sum())
    assert len(drawn["retrieved centroids"].x) == 1 and drawn["retrieved centroids"].marker.symbol == "diamond"
    assert "cluster %{customdata[0]}" in drawn["other keys"].hovertemplate.replace("key of ", "")
    assert fig.layout.title.text.startswith(f"layer {LAYER}, KV head 0: 10 of ")
    # the legend hangs under the x axis's title (its tick labels and title take AXIS_TITLE_PX), inside the margin
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    legend_top_px = -fig.layout.legend.y * plot_px
    assert fig.layout.legend.yanchor == "top" and legend_top_px >= figures.AXIS_TITLE_PX - 1
    assert fig.layout.margin.b >= legend_top_px + figures.LEGEND_PX - 1
    with pytest.raises(ValueError, match="no squeeze index"):
        ContextInspector(store).projection(cid, "squeeze", LAYER + 1, 0, [])
    assert ContextInspector(store).unit_labels(cid, "quest") == {}  # not built for this context
    with pytest.raises(ValueError, match="no quest index for this document yet"):
        ContextInspector(store).projection(cid, "quest", LAYER, 0, [])
    with pytest.raises(ValueError, match="duo keeps whole heads .* nothing to project"):  # never "choose one of []"
        ContextInspector(store).projection(cid, "duo", LAYER, 0, [])


def test_retrieval_report_flags_prefill_and_answer_clusters():
    sq = torch.tensor([[0.30, 0.01, 0.02, 0.00]])
    sa = torch.tensor([[0.10, 0.00, 0.40, 0.05]])
    counts = {3: torch.tensor([[4, 3, 2, 0]])}
    clusters = [{"layer": 3, "rows": [{"row": 0, "kv_head": 0, "ids": [0], "sizes": [4]}]}]
    out = retrieval_report(clusters, {3: {"question": sq, "answer": sa}}, counts, threshold=0.03)
    row = out["layers"][0]["rows"][0]
    assert row["ids"] == [2, 0]  # by the answer (S 0.4 > T), then the prefill's; cluster 3 is empty
    assert row["prefill"] == [False, True] and row["sizes"] == [2, 4]
    assert row["s_answer"] == [pytest.approx(0.4), pytest.approx(0.1)]


def test_document_markup_escapes_text_and_marks_pages(ctx):
    store, cid, doc, _, _ = ctx
    inspector = ContextInspector(store)
    w = inspector.token_weights(cid, report())
    html = render.document_html(doc.text, inspector.marks(cid, w), doc.page_starts)
    assert html.count('class="sq-pagebreak"') == 2
    assert "&lt;every&gt;" in html and "<every>" not in html
    assert re.search(r'<mark class="sq-hit" style="--w:1.00">passkey</mark>', html)
    plain = re.sub(r"<div class=\"sq-pagebreak\"[^>]*>page \d</div>|<[^>]+>", "", html)
    assert plain.replace("&lt;", "<").replace("&gt;", ">") == doc.text
    passages = render.passages_html(doc.text, inspector.passages(cid, w, top=2))
    assert passages.startswith('<ol class="sq-passages"') and "p. 2" in passages


def test_heatmap_figure_and_budget_markup():
    stats = {"global_layers": [5, 11], "kept_fraction_prefill": [[0.2, 0.3], [0.25, 1.0]],
             "kept_fraction_decode": [[0.1, 0.1], [0.2, 0.2]], "steps": 5, "method": "squeeze", "sparsity": 0.8,
             "kv_budget": 0.2, "kv_budget_prefill": 0.26, "new_tokens": 5,
             "timings": {"lookup_s": 0.1, "attention_s": 0.3, "total_s": 1.0, "first_token_s": 0.2, "tokens_per_s": 5}}
    stats["fixed_len"] = 400
    fig = figures.heatmap_figure(stats)
    prefill, decode = fig.data
    assert prefill.y == ("L5", "L11") and prefill.x == ("h0", "h1") and len(decode.z) == 2
    assert prefill.z[1][1] == 100.0 and prefill.customdata[1][1] == 400 and prefill.customdata[0][0] == 80
    assert "layer %{y}, head %{x}<br>%{z:.1f}% of the keys kept (%{customdata} of 400)" in prefill.hovertemplate
    assert list(prefill.text[0]) == ["20", "30"]
    stats["extra"] = {"plan": "threshold 0.000265 (prefill 0.000301)", "unit": "cluster"}
    budget = render.budget_html(stats)
    assert "20.0%" in budget and "26.0%" in budget and "threshold 0.000265 (prefill 0.000301)" in budget
    assert 'asked <b class="sq-asked">20.0%</b>' in budget and "more than asked" not in budget
    over = render.budget_html({**stats, "sparsity": 0.9})  # read 20% where 10% was asked: said beside the figures
    assert 'asked <b class="sq-asked">10.0%</b>' in over and "read 10.0 points more than asked" in over
    assert "rest of the model 0.60 s" in budget and "replayed" not in budget  # old turns: no timed_steps
    replayed = {**stats, "timings": {**stats["timings"], "timed_steps": 2}}  # 2 eager steps timed, 3 replayed
    assert "lookup and attention timed over 2 of 5 steps; the 3 replayed from a CUDA graph" in render.budget_html(replayed)
    assert "top 10% of the pages" in render.budget_html({**stats, "method": "quest",
                                                          "extra": {"plan": "top 10% of the pages"}})
    full = render.budget_html({**stats, "sparsity": 0.0, "method": "full",
                               "extra": {"plan": "every key of the document (full attention)"}})
    assert "threshold" not in full and "sparsity" not in full and "every key of the document" in full
    one_token = figures.heatmap_figure({**stats, "kept_fraction_decode": []})
    assert len(one_token.data) == 1 and any("no steps" in a.text for a in one_token.layout.annotations)
    assert not any("retrieval head" in (a.text or "") for a in fig.layout.annotations)


def test_heatmap_marks_duo_heads_as_retrieval_or_streaming():
    """DuoAttention's units are heads: a head that read every key is a retrieval head (R), the others streaming (S)."""
    stats = {"global_layers": [5, 11], "kept_fraction_prefill": [[1.0, 1.0], [0.08, 0.08]],
             "kept_fraction_decode": [[1.0, 1.0], [0.08, 0.08]], "steps": 3, "extra": {"unit": "head"}}
    fig = figures.heatmap_figure(stats)
    assert [list(row) for row in fig.data[0].text] == [["R", "R"], ["S", "S"]]
    note = next(a for a in fig.layout.annotations if "R: a retrieval head (every key)" in a.text)
    # under the head labels (not on them), in a bottom margin made for it
    assert note.y == 0 and note.yanchor == "top" and note.yshift <= -figures.TICK_LABELS_PX
    assert fig.layout.margin.b >= figures.TICK_LABELS_PX + 16  # a line of 12-px text


def test_small_formatters():
    assert render.pages_text([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert render.pages_text([]) == "-"
    assert render.time_left(12.4) == "about 12 s left"
    assert render.time_left(None) == "estimating the time left"
    assert render.format_seconds(600) == "10 min"
    view = JobView(id=1, name="a.pdf", doc_id="ab", context_id=None, status="failed", stage="failed", detail=None,
                   done=0, total=0, fraction=0.0, eta_s=None, elapsed_s=1.0, position=0, tokens=None, pages=None,
                   cached=False,
                   error="a.pdf: not a PDF file (no %PDF header)", error_kind="document", settings={},
                   methods=("squeeze",))
    html = render.jobs_html([view])
    assert "Could not prepare it: a.pdf: not a PDF file (no %PDF header)" in html and 'data-status="failed"' in html
    # a failed job is listed apart from the ones being prepared, never among them
    assert html.index("No document is being prepared.") < html.index("Could not be prepared") < html.index("a.pdf")
    running = dataclasses.replace(view, id=2, name="b.txt", status="running", stage="prefill", error=None)
    html = render.jobs_html([view, running])
    assert "No document is being prepared." not in html
    assert html.index("b.txt") < html.index("Could not be prepared") < html.index("a.pdf")
    # a PDF's extraction counts its pages; a text file's is one step, with no count
    extracting = dataclasses.replace(running, stage="extracting", done=12, total=300)
    assert render.stage_text(extracting) == "extracting text 12/300 pages"
    assert render.stage_text(dataclasses.replace(extracting, done=0, total=1)) == "extracting text"


# --------------------------------------------------------------------------- the latest `squeeze eval`

EVAL_MODEL = "tiny-eval-<model>"  # escaped where it is shown


def eval_doc(model: str = EVAL_MODEL) -> dict:
    """A `squeeze eval` document as the command writes it: a row with every figure, one with nulls."""
    return {"bench": "eval", "model": model, "device": "cpu", "methods": ["squeeze", "quest"], "budgets": [0.1],
            "created": "2025-01-02T03:04:05+00:00", "seconds": 812.3, "opaque": {"kept": True},
            "summary": [{"method": "squeeze", "budget": 0.1, "needles": 0.833, "recall": 0.912, "units": 0.931,
                         "oracle": 0.974,
                         "top1": 0.98, "top1_decided": 1.0, "kl": 0.0123, "read_prefill": 0.1012,
                         "read_decode": 0.0994},
                        {"method": "quest", "budget": 0.1, "needles": 0.5, "needles_decided": 0.75, "recall": None,
                         "oracle": None, "top1": None, "kl": None, "read_prefill": 0.1, "read_decode": None}],
            "full": {"needles_found": 6, "needles_cells": 6, "needles_decided": 4}}


def test_eval_table_from_a_document():
    assert render.eval_rows(eval_doc()) == [
        ["squeeze", "10%", "83%", "0.91 (0.93; 0.97)", "98% (100%)", "0.0123", "0.101 / 0.099"],
        ["quest", "10%", "50% (75%)", "–", "–", "–", "0.100 / –"],
    ]
    html = render.eval_html(eval_doc(), EVAL_MODEL)
    assert [h for h, _ in render.EVAL_COLUMNS] == re.findall(r'<th title="[^"]*">([^<]*)</th>', html)
    assert html.count("<tr>") == 3 and "<td>0.91 (0.93; 0.97)</td>" in html
    caption = re.search(r'<div class="sq-caption">([^<]*)</div>', html).group(1)
    local = render.format_date("2025-01-02T03:04:05+00:00")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", local)
    assert caption == (f"Latest squeeze eval of tiny-eval-&lt;model&gt;, {local} (cpu, 14 min); "
                       "full attention found 6/6 needles, 4 with no near-tie")
    assert render.format_date("not a time") == "not a time" and render.format_date(None) == "-"


def test_no_eval_is_one_plain_line():
    expected = "No evaluation yet for m&lt;1&gt;: run `squeeze eval` (about 15 minutes on a CPU)."
    for doc in (None, {"model": "m<1>", "summary": []}):
        html = render.eval_html(doc, "m<1>")
        assert html == f'<div class="sq-notice sq-info">{expected}</div>'


def test_the_chat_tab_shows_the_latest_eval_of_its_model(tmp_path, monkeypatch):
    import engine.serve.service as service
    from app.chat import ChatTab, new_state
    from app.config import AppConfig
    from app.services import Services
    from engine.serve.jobs import IngestWorker
    from engine.serve.service import Engine

    monkeypatch.setattr(service, "SHIPPED_EVAL", tmp_path / "absent.json")
    engine = Engine(tmp_path / "cache", model=EVAL_MODEL)  # named, never loaded
    services = Services(engine=engine, store=engine.store, worker=IngestWorker(engine, start=False),
                        inspector=ContextInspector(engine.store), config=AppConfig())
    chat = ChatTab(services, state=None, last_doc=None, kept_settings=None)
    assert "No evaluation yet for tiny-eval-&lt;model&gt;" in chat.evaluation_html()
    engine.record_eval(eval_doc("another-model"))
    assert "No evaluation yet" in chat.evaluation_html()  # another model's results are not this one's
    engine.record_eval(eval_doc())
    newer = eval_doc()
    newer["summary"][0]["needles"] = 0.5
    engine.record_eval(newer)
    html = chat.evaluation_html()
    assert html == render.eval_html(newer, EVAL_MODEL) and "<td>50%</td>" in html
    opened = chat.open_document(None, new_state(AppConfig()))  # opening (or closing) a document shows it again
    assert opened[-3] == html and not engine.model_loaded  # (then the last document, the chats list)
    engine.store.close()
