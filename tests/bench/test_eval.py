"""`squeeze eval` (engine/bench/evaluate.py, fidelity.py, eval_plot.py): agreement and recall measures against
their definitions, the oracle against any selection of its size, full budget against full attention on a tiny
model, the summary, the table, the figure, and the command line."""

from __future__ import annotations

import json
import math

import pytest
import torch

from app.cli import main as cli_main
from engine.bench import evaluate, fidelity, needles
from engine.bench.eval_plot import main as plot_main
from engine.bench.eval_plot import merged, save_figure, save_tasks_figure, series, task_shares
from engine.bench.needles import context_session
from engine.bench.oracle import OraclePolicy
from engine.bench.passkey import PASSKEY_QUESTION
from engine.methods import SPARSE_METHODS, make_method
from engine.model.generate import full_logits
from engine.model.load import load_model
from engine.text.prompt import prompt_format, turn_ids
from tests.support.tiny_models import SMALL_SAAP, gates_for, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_agreement_of_identical_logits_is_total():
    logits = torch.randn(5, 40)
    agree, kl = fidelity.agreement_stats(logits, logits.clone())
    assert bool(agree.all())
    torch.testing.assert_close(kl, torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)


def test_kl_and_top1_against_a_hand_computation():
    """Two tokens: p = (0.75, 0.25) against q = (0.25, 0.75): KL = 0.5 ln 3, and the top tokens differ."""
    full = torch.log(torch.tensor([[0.75, 0.25]]))
    other = torch.log(torch.tensor([[0.25, 0.75]]))
    agree, kl = fidelity.agreement_stats(full, other)
    assert not bool(agree[0])
    assert math.isclose(float(kl[0]), 0.5 * math.log(3), rel_tol=1e-6)


def test_the_larger_question_set_holds_the_default_one_first():
    """assets/sample_facts_20.json (320 teacher-forced positions): the six default questions, then 14 more, none
    twice."""
    default = fidelity.load_questions()
    larger = fidelity.load_questions(fidelity.ASSETS / "sample_facts_20.json")
    assert len(larger) == 20 and larger[:len(default)] == default and len(set(larger)) == 20


def test_top_margin_is_the_gap_between_the_top_two_log_probabilities():
    """p = (0.5, 0.3, 0.2): ln(0.5 / 0.3); a tie: 0; the logits' offset does not matter."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2]])) + 3.0
    torch.testing.assert_close(fidelity.top_margin(logits), torch.tensor([math.log(0.5 / 0.3), 0.0],
                               dtype=torch.float64), atol=1e-6, rtol=0)


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2), (2, 2)])
def test_the_oracle_beats_every_selection_of_its_size(hq, hkv, pool):
    """Per KV head, k keys; the group's weight on them is at least that of 200 random selections of k keys each
    (one per step, or one for all steps when pooled) and of the top-k of any single query head."""
    torch.manual_seed(0)
    t, length, k = 3, 64, 9
    probs = torch.softmax(torch.randn(hq, t, length) * 3, dim=-1)
    mask = fidelity.oracle_mask(probs, hkv, k, pool)
    assert mask.shape == probs.shape
    per_kv = mask.reshape(hkv, hq // hkv, t, length)
    assert bool((per_kv == per_kv[:, :1]).all())  # one selection per KV head serves its group
    assert bool((mask.sum(dim=-1) == k).all())

    def mass(m: torch.Tensor) -> torch.Tensor:  # the group's weight, per KV head (and step unless pooled)
        w = (probs * m).sum(dim=-1).reshape(hkv, hq // hkv, t).sum(dim=1)
        return w.sum(dim=1) if pool else w

    best = mass(mask)
    for _ in range(200):
        rand = torch.zeros(hkv, 1 if pool else t, length, dtype=torch.bool)
        rand.scatter_(-1, torch.rand(hkv, rand.shape[1], length).argsort(dim=-1)[..., :k], True)
        rand = rand.expand(hkv, t, length).repeat_interleave(hq // hkv, dim=0)
        assert bool((mass(rand) <= best + 1e-6).all())
    one_head = probs[:: hq // hkv].topk(k, dim=-1).indices  # the first head of each group: its own top-k
    single = torch.zeros(hkv, t, length, dtype=torch.bool).scatter_(-1, one_head, True)
    if not pool:
        assert bool((mass(single.repeat_interleave(hq // hkv, dim=0)) <= best + 1e-6).all())


def _doc(summary: list[dict]) -> dict:
    return {"model": "tiny", "device": "cpu", "created": "2026-11-24T00:00:00+00:00", "summary": summary}


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 1), (4, 2)])
def test_units_best_takes_whole_units_by_weight_per_key_within_the_keys_read(hq, hkv, pool):
    """units_mask: whole units only, the dense rows always, at most `read` indexed keys, one selection per KV head;
    with units of one size it holds at least the group's weight of any choice of as many units (brute force); with
    `read` covering every indexed key it is every key."""
    import itertools

    torch.manual_seed(1)
    t, indexed, dense, size = 2, 24, 4, 4
    probs = torch.softmax(torch.randn(hq, t, indexed + dense) * 3, dim=-1)
    labels = torch.stack([torch.randperm(indexed) // size for _ in range(hkv)])  # [Hkv, I]: 6 units of 4 keys
    steps = 1 if pool else t
    read = torch.full((hkv, steps), 3 * size + 2)  # room for three units, not four
    mask = fidelity.units_mask(probs, labels, read, pool)
    assert mask.shape == probs.shape and bool(mask[..., indexed:].all())
    per_kv = mask.reshape(hkv, hq // hkv, t, -1)
    assert bool((per_kv == per_kv[:, :1]).all())
    group = probs.reshape(hkv, hq // hkv, t, -1).sum(dim=1)
    if pool:
        group = group.sum(dim=1, keepdim=True)
    for h in range(hkv):
        for step in range(steps):
            chosen = per_kv[h, 0, step, :indexed]
            units = {int(u) for u in labels[h][chosen]}
            assert len(units) == 3 and int(chosen.sum()) == 3 * size  # whole units, within the keys read
            mass = {u: float(group[h, step, :indexed][labels[h] == u].sum()) for u in range(indexed // size)}
            best = max(sum(mass[u] for u in combo) for combo in itertools.combinations(mass, 3))
            assert sum(mass[u] for u in units) == pytest.approx(best)
    everything = fidelity.units_mask(probs, labels, torch.full((hkv, steps), indexed), pool)
    assert bool(everything.all())


def test_summary_joins_the_parts_per_method_and_budget():
    doc = {"needles": {"summary": [{"method": "squeeze", "budget": 0.1, "as_good_as_full": 0.8,
                                    "read_prefill": 0.1, "read_decode": 0.12}]},
           "recall": {"rows": [{"method": "squeeze", "budget": 0.1,
                                "decode": {"recall": 0.7, "units": 0.8, "oracle": 0.9}},
                               {"method": "quest", "budget": 0.1, "prefill": {"recall": 0.5, "oracle": 0.8}}]},
           "agreement": {"rows": [{"method": "squeeze", "budget": 0.1, "top1": 0.9, "top1_decided": 1.0,
                                   "kl": 0.1, "read_prefill": 0.08, "read_decode": None}]}}
    rows = {(r["method"], r["budget"]): r for r in evaluate.summarize(doc)}
    assert rows["squeeze", 0.1] == {"method": "squeeze", "budget": 0.1, "needles": 0.8, "needles_short": None,
                                    "needles_decided": None, "recall": 0.7,
                                    "units": 0.8, "oracle": 0.9, "top1": 0.9, "top1_decided": 1.0, "kl": 0.1,
                                    "read_prefill": 0.09,
                                    "read_decode": 0.12, "tasks": {}}
    assert rows["quest", 0.1]["recall"] == 0.5 and rows["quest", 0.1]["top1"] is None  # decode absent: prefill's
    text = evaluate.table(_doc(evaluate.summarize(doc)))
    assert "| squeeze | 10% | 80% | 0.700 (0.800; 0.900) | 90.0% (100.0%) | 0.1000 | 0.090 / 0.120 |" in text
    assert "| quest | 10% | - | 0.500 (-; 0.800) | - | - | - / - |" in text


def test_the_figure_is_a_png_with_a_panel_per_measure(tmp_path):
    summary = [{"method": m, "budget": b, "needles": 1.0, "recall": 0.5 + b, "oracle": 0.6 + b, "top1": 0.9,
                "kl": 0.01 / b, "read_prefill": b, "read_decode": b} for m in ("squeeze", "quest") for b in (0.1, 0.3)]
    assert series(summary, "recall")["quest"] == ([0.1, 0.3], [0.6, 0.8])
    path = save_figure(_doc(summary), tmp_path / "figs" / "eval.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(data[16:20], "big")
    assert width > 4 * 300  # four panels side by side
    with pytest.raises(ValueError):
        save_figure(_doc([{"method": "squeeze", "budget": 0.1}]), tmp_path / "empty.png")


def _tasks_summary(passkey: float) -> list[dict]:
    return [{"method": m, "budget": 0.1, "needles": passkey if m != "oracle" else 1.0,
             "tasks": {"multikey": {"as_good_as_full": 0.8 if m == "quest" else 1.0, "found_decided": None}}}
            for m in ("squeeze", "quest", "oracle")]


def test_the_tasks_figure_has_a_panel_per_document_and_a_bar_per_task_and_method(tmp_path):
    shares = task_shares(_tasks_summary(0.4))
    assert shares == {"passkey": {"oracle": 1.0, "quest": 0.4, "squeeze": 0.4},
                      "multikey": {"oracle": 1.0, "quest": 0.8, "squeeze": 1.0}}
    with pytest.raises(ValueError):  # two budgets: which one is not said
        task_shares(_tasks_summary(0.4) + [{"method": "squeeze", "budget": 0.3, "needles": 1.0}])
    files = []
    for name, passkey in (("with.json", 1.0), ("without.json", 0.4)):
        files.append(tmp_path / name)
        files[-1].write_text(json.dumps(_doc(_tasks_summary(passkey))))
    out = tmp_path / "figs" / "tasks.png"
    assert plot_main(["--tasks", f"with follow rows={files[0]}", f"without={files[1]}", "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") > 2 * 300  # two panels
    with pytest.raises(ValueError):  # a document without needles has nothing to draw
        save_tasks_figure([("recall only", _doc([{"method": "squeeze", "budget": 0.1}]))], tmp_path / "x.png")
    with pytest.raises(SystemExit):
        plot_main(["--tasks", str(files[0]), "--out", str(out)])  # no label


def test_a_tasks_panel_may_join_the_methods_of_several_runs_of_one_grid(tmp_path):
    """FILE+FILE: the summaries of two runs (other methods, the oracle in both) in one panel."""
    first = _doc(_tasks_summary(1.0))
    second = _doc([{"method": "duo", "budget": 0.1, "needles": 0.2,
                    "tasks": {"multikey": {"as_good_as_full": 0.6, "found_decided": None}}},
                   {"method": "oracle", "budget": 0.1, "needles": 1.0,
                    "tasks": {"multikey": {"as_good_as_full": 1.0, "found_decided": None}}}])
    assert task_shares(merged([first, second])["summary"]) == {
        "passkey": {"duo": 0.2, "oracle": 1.0, "quest": 1.0, "squeeze": 1.0},
        "multikey": {"duo": 0.6, "oracle": 1.0, "quest": 0.8, "squeeze": 1.0}}
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for f, doc in zip(files, (first, second)):
        f.write_text(json.dumps(doc))
    out = tmp_path / "joined.png"
    assert plot_main(["--tasks", f"every method={files[0]}+{files[1]}", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GQA Llama (byte tokenizer) over a short document with every method built."""
    path = make_tiny_model(tmp_path_factory.mktemp("eval_model"), "llama_gqa")
    lm = load_model(str(path), device="cpu")
    text = " ".join(f"Line {i}: the harbour light turns every {i % 7 + 2} seconds." for i in range(12))
    # duo's streaming windows scaled to this ~700-token document (its defaults, 64 + 256 keys, would read half of it
    # at any budget: the method's floor)
    small = {"sink": 4, "recent": 24}
    settings = {"duo": small, "duo-squeeze": small, **SMALL_SAAP}
    return lm, context_session(lm, text, list(SPARSE_METHODS), settings, extra=[OraclePolicy()],
                               prepared=gates_for(lm, [make_method(n, settings.get(n)) for n in SPARSE_METHODS])), path


def test_full_margin_is_the_one_pass_logits_least_gap(tiny):
    """needles.full_margin (the turn's prefill of the passkey question, then a decode step per answer token) equals
    the least top-two gap of the logits of one pass over the question and the answer (engine.model.generate.full_logits)
    at the answer's positions, within 1e-3 nats (float32 logits through two paths)."""
    lm, session, _ = tiny
    answer = [11, 45, 46, 47]
    prompt = turn_ids(lm.tokenizer, prompt_format(lm.tokenizer), PASSKEY_QUESTION).ids
    logits = full_logits(lm, session.step_context("full", 0.0), torch.cat([prompt, torch.tensor(answer[:-1])]))
    want = float(fidelity.top_margin(logits[prompt.numel() - 1:]).min())
    assert needles.full_margin(session, answer) == pytest.approx(want, abs=1e-3)


def test_full_budget_agrees_with_full_attention(tiny):
    """At a budget of 1 every method reads every key: the same next token at every answer position, KL ~ 0, recall
    and the oracle's 1, and it read the whole context (and its index)."""
    lm, session, _ = tiny
    agreement, recall = fidelity.run(session, list(SPARSE_METHODS), [1.0], ["Which light?", "How often?"], 6,
                                     ceiling="oracle")
    assert {r["method"] for r in agreement["rows"]} == {*SPARSE_METHODS, "oracle"}
    for row in agreement["rows"]:
        assert row["positions"] == sum(a["tokens"] for a in agreement["answers"])
        assert row["top1"] == 1.0 and row["kl"] < 1e-6, row
        assert row["miss_margins"] == [] and row["top1_decided"] in (1.0, None)
        assert 1.0 <= row["read_prefill"] <= 1.1  # every key, and the lookup still reads its index
    for row in recall["rows"]:
        for phase in ("decode", "prefill"):
            assert row[phase]["recall"] == pytest.approx(1.0, abs=1e-4)
            assert row[phase]["oracle"] == pytest.approx(1.0, abs=1e-4)
            assert len(row[phase]["by_layer_head"]) == len(lm.global_layers)
            assert len(row[phase]["by_layer_head"][0]) == lm.num_heads


def test_recall_falls_with_the_budget_and_stays_under_the_oracle(tiny):
    """At a 30% budget each method reads at most about 30% of the bytes (its keys fewer, as its index costs some)
    and holds less weight than full attention; its decode recall is at most the oracle's at that budget (the
    oracle reads 30% of the keys, the method fewer), within the budget's calibration tolerance."""
    _, session, _ = tiny
    agreement, recall = fidelity.run(session, list(SPARSE_METHODS), [0.3], ["Which light?"], 6, ceiling="oracle")
    units = {name for name in SPARSE_METHODS if name not in ("duo",)}  # the methods that keep whole units
    for row in recall["rows"]:
        assert row["decode"]["recall"] < 1.0
        assert row["decode"]["recall"] <= row["decode"]["oracle"] + 0.03, row
        for phase in ("decode", "prefill"):  # the unit ceiling: none for DuoAttention (heads, not units)
            best = row[phase]["units"]
            assert (best is None) == (row["method"] not in units), row
            assert best is None or 0.0 < best <= row[phase]["oracle"] + 0.03, row
    for row in agreement["rows"]:
        assert 0.0 <= row["top1"] <= 1.0 and row["kl"] >= 0.0
        assert row["read_prefill"] <= 0.33 + 1e-9, row
        misses = row["miss_margins"]  # full attention's margin at each miss, and top-1 where it is decided
        assert len(misses) == round((1.0 - row["top1"]) * row["positions"]) and misses == sorted(misses)
        assert 0 <= row["decided"] <= row["positions"]
        decided_misses = sum(m >= fidelity.DECIDED_MARGIN for m in misses)
        if row["decided"]:
            assert row["top1_decided"] == pytest.approx(1.0 - decided_misses / row["decided"], abs=1e-4)
    (oracle,) = [r for r in agreement["rows"] if r["method"] == "oracle"]
    assert oracle["read_prefill"] == pytest.approx(0.3, abs=0.01)  # its keys only: its index is not counted
    assert oracle["read_decode"] == pytest.approx(0.3, abs=0.01)


def test_the_oracle_method_keeps_the_heaviest_keys_of_the_group(tiny):
    """The oracle's lookup at a decode step and at a question's prefill keeps, per KV head, the keys with the most
    softmax weight over the indexed keys summed over the group (and the tokens), and the whole dense tail."""
    from engine.model.prefill import global_scale
    from kernels.backend import REFERENCE

    lm, session, _ = tiny
    layer = session.cache.layers[lm.global_layers[0]]
    index = layer.indexes["oracle"]
    keys = index["keys"].float()  # [Hkv, Lc, D]
    hkv, indexed = keys.shape[:2]
    scale = global_scale(lm)
    plan = session.plan("oracle", 0.6)
    for lq in (1, 5):
        q = torch.randn(lm.num_heads, lq, keys.shape[2])
        sel = session.method("oracle").lookup(q, index, plan, scale, REFERENCE).selection
        mask = sel.to_mask()  # [Hkv, L]
        assert bool(mask[:, indexed:].all())
        probs = torch.softmax(torch.einsum("hgtd,hkd->hgtk", q.reshape(hkv, -1, lq, q.shape[2]), keys) * scale, -1)
        weight = probs.sum(dim=(1, 2))  # [Hkv, Lc]
        k = plan.count(indexed)
        assert bool((mask[:, :indexed].sum(dim=1) == k).all())
        kept = torch.where(mask[:, :indexed], weight, torch.inf).amin(dim=1)
        dropped = torch.where(mask[:, :indexed], -torch.inf, weight).amax(dim=1)
        assert bool((kept >= dropped - 1e-6).all())


# what the methods that learn per model train on here: a little (what this test checks is the command's outputs; the
# training itself: tests/engine/test_duo.py, tests/engine/test_saap.py)
TRAINING = ("saap.buckets=8", "saap.hidden=8", "saap.train_steps=50", "saap.train_prompts=1", "duo.train_steps=5")


def test_the_command_writes_json_table_figure_and_records_them(tiny, tmp_path, capsys):
    _, _, model_path = tiny
    doc_path = tmp_path / "doc.txt"
    doc_path.write_text("The tide table says the harbour opens at six. " * 8, encoding="utf-8")
    questions = tmp_path / "q.json"
    questions.write_text(json.dumps([{"question": "When does it open?"}]), encoding="utf-8")
    out, plot, cache = tmp_path / "eval.json", tmp_path / "eval.png", tmp_path / "cache"
    code = cli_main(["eval", "--parts", "recall,agreement", "--model", str(model_path), "--device", "cpu",
                     "--budgets", "0.5,1.0", "--document", str(doc_path), "--questions", str(questions),
                     "--answer-tokens", "4", "--out", str(out), "--plot", str(plot), "--cache-dir", str(cache),
                     "--table", "--sink", "2", "--dense-tail", "5", "--follow", "lead=2", "--document-tokens", "900",
                     "--token-lookups", *(f"--set={s}" for s in TRAINING)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| method | KV budget |" in printed
    doc = json.loads(out.read_text())
    assert doc["bench"] == "eval" and doc["parts"] == ["recall", "agreement"]
    assert (doc["context"]["sink"], doc["context"]["dense_tail"]) == (2, 5)  # the contexts it measured
    assert doc["method_settings"] == {"saap": {"buckets": 8, "hidden": 8, "train_steps": 50, "train_prompts": 1},
                                      "duo": {"train_steps": 5}}
    assert doc["follow"]["lead"] == 2
    assert doc["token_lookups"] is True  # one lookup per question token: at budget 1.0 still full attention (below)
    assert doc["document"]["in_essays"] and abs(doc["document"]["tokens"] - 900) <= 8  # the document amid essays
    assert {(r["method"], r["budget"]) for r in doc["summary"]} == {
        (m, b) for m in (*SPARSE_METHODS, "oracle") for b in (0.5, 1.0)}  # the oracle's agreement: the ceiling
    assert all(r["top1"] == 1.0 for r in doc["summary"] if r["budget"] == 1.0)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    from engine.serve.service import Engine

    assert Engine(cache, str(model_path), "cpu").latest_eval()["created"] == doc["created"]


@pytest.mark.parametrize("argv,message", [
    (["--parts", "needles,bogus"], "--parts"),
    (["--methods", "nope"], "unknown method"),
    (["--budgets", "0,0.5"], "budgets must be in"),
    (["--sink", "-1"], "--sink must be"),
    (["--dense-tail", "0"], "--dense-tail must be"),
    (["--needle-tokens", "0"], "--needle-tokens must be"),
    (["--document-tokens", "0"], "--document-tokens must be"),
    (["--follow", "lead=2", "--no-follow"], "exclude each other"),
])
def test_the_command_refuses_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["eval", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_command_says_what_is_missing_before_loading_a_model(tmp_path, capsys):
    code = cli_main(["eval", "--parts", "recall", "--document", str(tmp_path / "missing.md")])
    assert code == 2
    assert "no document at" in capsys.readouterr().err
    code = cli_main(["eval", "--parts", "agreement", "--set", "saap.nope=1"])
    assert code == 2
    assert "saap has no setting 'nope'" in capsys.readouterr().err
    code = cli_main(["eval", "--parts", "agreement", "--follow", "nope=1"])
    assert code == 2
    assert "with a follow setting" in capsys.readouterr().err
