"""DuoAttention (engine/methods/duo/policy.py, engine/methods/duo/gates.py, engine/methods/duo/data.py): the heads' selections against a mask
built by hand, the budget a plan reads, the training attention against its two references, gate training on tiny
models (deterministic, resumable, stored once per model), and the method end to end through the engine and the CLI.
The method contract's own checks (tests/engine/test_methods_contract.py) run it too."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from engine.attention.method import CalibrationSet
from engine.methods import LayerIndex, make_method
from engine.methods.duo.data import GateData, training_sequence
from engine.methods.duo.gates import GateMix, GateTraining, mixed_attention, rank_heads, train_gates
from engine.methods.duo.policy import HeadPlan, Window, head_selection
from kernels.selection import FollowRows
from tests.support.tiny_models import QUICK_TRAINING, byte_tokenizer, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

INDEXED, TAIL = 200, 10
SMALL = {"sink": 4, "recent": 30, **QUICK_TRAINING["duo"]}


def expected_rows(rank: torch.Tensor, window: Window, plan: HeadPlan, num_keys: int) -> torch.Tensor:
    """The keys each head must read, by hand: [Hkv, num_keys] bool."""
    mask = torch.zeros(rank.numel(), num_keys, dtype=torch.bool)
    for h, r in enumerate(rank.tolist()):
        if r < plan.full:
            mask[h] = True
            continue
        back = window.back + (plan.extra if r == plan.full else 0)
        back = min(back, window.indexed - window.front)
        mask[h, : window.front] = True
        mask[h, window.indexed - back :] = True  # the last indexed keys, then the dense rows
    return mask


@pytest.mark.parametrize("full,extra", [(0, 0), (0, 7), (2, 0), (2, 50), (3, 0), (5, 0), (1, 1000)])
def test_head_selection_is_the_window_or_every_key(full, extra):
    rank = torch.tensor([3, 0, 4, 1, 2])
    layer = LayerIndex(tensors={"rank": rank}, num_keys=INDEXED + TAIL, tail=TAIL)
    window = Window(front=4, back=20, indexed=INDEXED)
    sel = head_selection(layer, window, HeadPlan(budget=0.5, full=full, extra=extra), torch.device("cpu"))
    assert torch.equal(sel.to_mask(), expected_rows(rank, window, HeadPlan(0.5, full, extra), INDEXED + TAIL))
    for r in range(sel.rows):  # rows sorted, no repeats (the kernels' contract)
        row = sel.indices[sel.indptr[r] : sel.indptr[r + 1]].long()
        assert bool((row[1:] > row[:-1]).all())


def test_window_keeps_the_sink_and_the_recent_keys_the_tail_lacks():
    duo = make_method("duo", {"sink": 64, "recent": 256}).settings
    assert Window.of(duo, 4000, 100) == Window(front=64, back=156, indexed=4000)
    assert Window.of(duo, 150, 100) == Window(front=64, back=86, indexed=150)  # a short context: all of it
    assert Window.of(duo, 4000, 300) == Window(front=64, back=0, indexed=4000)  # the tail holds the recent keys


def calibrated(method, layers: int = 3, hkv: int = 2):
    artifacts = method.stand_in(list(range(layers)), hkv, 8)
    sets = [CalibrationSet(index=LayerIndex({"rank": artifacts[f"layer{i}.rank"]}, INDEXED + TAIL, TAIL),
                           queries=torch.zeros(2 * hkv, 1, 8)) for i in range(layers)]
    return artifacts, sets, method.calibrate(sets, 1.0)


@pytest.mark.parametrize("budget", [0.3, 0.45, 0.6, 0.77, 0.9, 1.0])
def test_a_budget_reads_what_it_says(budget):
    """Every head's reads (indexed keys by the plan + the dense rows) over every head's K/V is the budget (a whole
    number of keys off at most), in both phases; the heads that read everything are the highest gates."""
    method = make_method("duo", {"sink": 4, "recent": 30})
    artifacts, sets, calibration = calibrated(method)
    plan = method.plan(calibration, budget)
    read = 0
    for i, s in enumerate(sets):
        for q in (torch.zeros(4, 1, 8), torch.zeros(4, 5, 8)):
            found = method.lookup(q, s.index, plan, 1.0, None)
            if q.shape[1] == 1:
                read += int(found.selection.counts().sum())
            assert not bool(found.index_elements.any())
        gates, rank = artifacts[f"layer{i}.gates"], artifacts[f"layer{i}.rank"]
        counts = found.selection.counts()
        assert all(counts[h] == INDEXED + TAIL for h in range(2) if rank[h] < plan.full)
        assert all(bool(gates[h] >= g) for h in range(2) if rank[h] < plan.full for g in gates[rank >= plan.full])
    assert abs(read / (6 * (INDEXED + TAIL)) - budget) <= 1.0 / (6 * (INDEXED + TAIL)) + 1e-9


@pytest.mark.parametrize("budget", [0.15, 0.05])
def test_below_the_windows_every_head_streams_through_a_window_fitted_to_the_budget(budget):
    """The windows alone read (4 + 20 + 10) / 210 = 0.162: below that every head streams through a window shrunk to
    the budget, read within a key (at 0.15 the sink's 4 keys kept and the recent ones cut; at 0.05, which the dense
    rows nearly fill, what is left goes to the first head's recent keys)."""
    method = make_method("duo", {"sink": 4, "recent": 30})
    _, sets, calibration = calibrated(method)
    plan = method.plan(calibration, budget)
    assert plan.full == 0 and plan.fit < 1.0 and "fitted" in plan.describe()
    selections = [method.lookup(torch.zeros(4, 1, 8), s.index, plan, 1.0, None).selection for s in sets]
    read = sum(int(sel.counts().sum()) for sel in selections)
    assert abs(read / (6 * (INDEXED + TAIL)) - budget) <= 1.0 / (6 * (INDEXED + TAIL)) + 1e-9
    if budget > 0.1:
        assert all(bool(sel.to_mask()[:, :4].all()) for sel in selections)  # the sink


def test_window_fitted_to_a_share_of_the_keys():
    duo = make_method("duo", {"sink": 64, "recent": 256}).settings
    assert Window.of(duo, 2000, 32, fit=0.05) == Window(front=22, back=78, indexed=2000)  # 64 : 224 in proportion
    assert Window.of(duo, 2000, 32, fit=0.5) == Window.of(duo, 2000, 32)  # room for both: as they are
    assert Window.of(duo, 2000, 32, fit=0.002) == Window(front=4, back=0, indexed=2000)  # the sink's 4 first


def test_the_selection_is_made_once_per_plan():
    """A step that keeps its plan (a GPU's: no room to cut to) reuses the layer's selection of that plan."""
    method = make_method("duo", {"sink": 4, "recent": 30})
    _, sets, calibration = calibrated(method)
    index = sets[0].index

    def kept(budget):
        return replace(method.plan(calibration, budget), room=None)

    a, b = (method.lookup(torch.zeros(4, 1, 8), index, kept(0.5), 1.0, None) for _ in range(2))
    assert a.selection is b.selection
    other = method.lookup(torch.zeros(4, 1, 8), index, kept(0.8), 1.0, None)
    assert other.selection is not a.selection


def test_a_step_with_follow_rows_leaves_them_their_keys():
    """On the CPU a step counts its own indexed follow rows (each KV head's) inside the budget and gives the heads
    the rest: the more rows, the fewer keys the heads read, all of it within a key of the budget."""
    method = make_method("duo", {"sink": 4, "recent": 30})
    _, sets, calibration = calibrated(method)
    plan = method.plan(calibration, 0.5)
    reads = []
    for rows in (0, 12, 40):
        follow = FollowRows(torch.arange(rows, dtype=torch.int64) * 3, 0, INDEXED)
        reads.append(sum(int(method.lookup(torch.zeros(4, 1, 8), s.index, plan, 1.0, None, follow=follow)
                             .selection.counts().sum()) for s in sets))
    assert reads[0] > reads[1] > reads[2]
    assert all(abs(r + 6 * rows - 0.5 * 6 * (INDEXED + TAIL)) <= 1 for r, rows in zip(reads, (0, 12, 40)))


def test_rank_heads_orders_by_gate_then_position():
    gates = torch.tensor([[0.5, 1.0], [1.0, 0.0]])
    assert rank_heads(gates).tolist() == [[2, 0], [1, 3]]


class _Module:
    layer_idx = 3


def _attention(q, k, v, allowed, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_mixed_attention_is_alpha_full_plus_streaming(alpha):
    """Row 0 is full causal attention; row 1 alpha * full + (1 - alpha) * attention over the context's first `sink`
    and last `recent` tokens and the new ones (reference: masked softmax written out)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, s, lq, d = 4, 2, 40, 5, 8
    q = torch.randn(2, hq, lq, d, generator=g)
    k = torch.randn(1, hkv, s, d, generator=g).expand(2, -1, -1, -1)
    v = torch.randn(1, hkv, s, d, generator=g).expand(2, -1, -1, -1)
    gates = torch.tensor([[alpha, 1.0 - alpha]])
    mix = GateMix(gates=gates, rows={3: 0}, sink=3, recent=6, context_len=s - lq)
    out, _ = mixed_attention(_Module(), q, k, v, None, scaling=d ** -0.5, duo_mix=mix)  # [2, Lq, Hq, D]
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    qpos, kpos = torch.arange(s - lq, s)[:, None], torch.arange(s)[None, :]
    causal = kpos <= qpos
    stream = causal & ((kpos < 3) | (kpos >= s - lq - 6))
    full = _attention(q, kr, vr, causal, d ** -0.5)
    streaming = _attention(q, kr, vr, stream, d ** -0.5)
    a = torch.tensor([alpha, alpha, 1 - alpha, 1 - alpha])[None, :, None, None]
    torch.testing.assert_close(out[0], full[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], (a * full + (1 - a) * streaming)[1].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_training_sequences_are_a_function_of_seed_and_step():
    tok = byte_tokenizer()
    corpus = tok("lorem ipsum dolor sit amet " * 80, add_special_tokens=False)["input_ids"]
    data = GateData(min_tokens=300, max_tokens=900, passkeys=3, words=4)
    a, b = (training_sequence(tok, corpus, data, 0, 5, 2048) for _ in range(2))
    assert a == b and a != training_sequence(tok, corpus, data, 0, 6, 2048)
    text = tok.decode(a.context)
    assert text.count("passkey to the vault:") == 3 and "</book>" in text
    assert tok.decode(a.new).count("Passkey: ") == 3
    assert len(a.context) + len(a.new) <= 2048
    with pytest.raises(ValueError, match="does not fit"):
        training_sequence(tok, corpus[:100], data, 0, 0, 2048)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    from engine.model.load import load_model

    return load_model(str(make_tiny_model(tmp_path_factory.mktemp("duo"), "gemma3_hybrid")), device="cpu")


def _training(steps: int) -> GateTraining:
    return GateTraining(steps=steps, sink=4, recent=16, data=GateData(min_tokens=120, max_tokens=200, passkeys=2,
                                                                       words=3))


def _corpus(lm) -> list[int]:
    return lm.tokenizer("The keeper logged the weather every four hours and rang the bell. " * 40,
                        add_special_tokens=False)["input_ids"]


def test_gate_training_moves_the_gates_and_resumes_where_it_stopped(tiny_gemma):
    """Gates start at 1 and move within [0, 1]; a run stopped at a checkpoint and resumed ends bit for bit where an
    uninterrupted one does; the model is left as it was (attention implementation, no gradients)."""
    lm = tiny_gemma
    attn = lm.model.config._attn_implementation
    saved = []
    whole = train_gates(lm, _training(6), _corpus(lm), save=saved.append, checkpoint_every=2)
    assert whole.shape == (len(lm.global_layers), lm.num_kv_heads)
    assert bool(((whole >= 0) & (whole <= 1)).all()) and not bool((whole == 1).all())
    assert [int(s["step"]) for s in saved] == [2, 4, 6]
    resumed = train_gates(lm, _training(6), _corpus(lm), state=saved[1])
    assert torch.equal(resumed, whole)
    assert lm.model.config._attn_implementation == attn
    assert not any(p.requires_grad for p in lm.model.parameters()) or all(
        p.grad is None for p in lm.model.parameters())


def test_engine_trains_once_stores_the_gates_and_drops_the_checkpoint(tiny_gemma, tmp_path):
    """Engine.prepared: the gates are trained with progress, stored per model (keyed by the training settings
    only), reused by a restarted engine; a checkpoint left by a stopped run is resumed from (here one at the last
    step: its gates are the result) and removed once the gates are stored."""
    from engine.serve.service import CHECKPOINT, Engine

    engine = Engine(tmp_path / "cache", lm=tiny_gemma, methods={"duo": SMALL})
    method = engine.method("duo")
    key = method.prepare_key()
    assert "sink" not in key and key["train_steps"] == 3
    planted = torch.tensor([[0.25]])
    state = {"gates": planted, "exp_avg": torch.zeros(1, 1), "exp_avg_sq": torch.zeros(1, 1),
             "step": torch.tensor(3)}
    for name, t in state.items():
        engine.store.models.save(engine.model_id, "duo" + CHECKPOINT, key, name, t)
    seen = []
    found = engine.prepared("duo", lambda stage, done, total: seen.append((stage, done, total)))
    layer = tiny_gemma.global_layers[0]
    assert found[f"layer{layer}.gates"].tolist() == [0.25] and seen == []  # nothing left to train
    assert engine.store.models.names(engine.model_id, "duo" + CHECKPOINT, key) == []
    other = Engine(tmp_path / "cache2", lm=tiny_gemma, methods={"duo": {**SMALL, "seed": 1}})
    trained = other.prepared("duo", lambda stage, done, total: seen.append((stage, done, total)))
    assert [d for _, d, _ in seen] == [1, 2, 3] and seen[-1][0].startswith("training duo: step 3/3")
    assert sorted(trained) == [f"layer{layer}.gates", f"layer{layer}.rank"]
    restarted = Engine(tmp_path / "cache2", lm=tiny_gemma, methods={"duo": {**SMALL, "seed": 1, "sink": 8}})
    assert torch.equal(restarted.prepared("duo")[f"layer{layer}.gates"], trained[f"layer{layer}.gates"])


def test_duo_answers_through_the_engine_and_equals_full_attention_at_budget_1(tiny_gemma, tmp_path):
    from engine.serve.service import Engine

    engine = Engine(tmp_path / "cache", lm=tiny_gemma, methods={"duo": SMALL})
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper rang the bell at dawn and logged the weather every four hours. " * 8)
    context = engine.ingest(doc, methods=("duo",)).context_id
    session = engine.session(context)
    full = session.logits("Who rang the bell?", "full")
    torch.testing.assert_close(session.logits("Who rang the bell?", "duo", 0.0), full, atol=1e-4, rtol=1e-4)
    answer = engine.ask(context, "Who rang the bell?", "duo", 0.7, 4)
    assert answer.stats.method == "duo" and 0.0 < answer.stats.kv_budget_decode <= 0.3 + 0.02


def test_cli_trains_duo(tmp_path, capsys):
    from app.cli import main

    path = make_tiny_model(tmp_path, "gemma3_hybrid")
    args = ["train", "duo", "--model", str(path), "--cache-dir", str(tmp_path / "c"), "--device", "cpu", "--json",
            "--quiet"] + [a for k, v in SMALL.items() for a in (f"--duo-{k.replace('_', '-')}", str(v))]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "duo" and len(out["artifacts"]) == 2
    gates = next(v for k, v in out["artifacts"].items() if k.endswith(".gates"))
    assert all(0.0 <= g <= 1.0 for g in gates) and not math.isnan(sum(gates))


def test_replace_rows_equals_the_mask_by_hand():
    from kernels.selection import Selection, replace_rows

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 30, generator=g) < 0.3
    fixed = torch.stack([torch.randperm(30, generator=g)[:6].sort().values for _ in range(4)]).to(torch.int32)
    take = torch.tensor([True, False, False, True])
    got = replace_rows(Selection.from_mask(mask), take, fixed)
    want = mask.clone()
    for r in (0, 3):
        want[r] = False
        want[r, fixed[r].long()] = True
    assert torch.equal(got.to_mask(), want)
    assert got.counts().tolist() == [6, int(mask[1].sum()), int(mask[2].sum()), 6]


def duo_squeeze_context(seed: int, queries: int):
    """duo-squeeze (sink 4, recent 30) built with what it requires over two layers of random keys (2 KV heads,
    4 query heads, d 8, INDEXED + TAIL keys), stand-in gates: (the method, every artifact by its full name, the
    layers' calibration queries [4, queries, 8])."""
    from engine.context.ingest import build_methods
    from engine.methods import build_order, stand_ins

    g = torch.Generator().manual_seed(seed)
    hkv, hq, d, n = 2, 4, 8, INDEXED + TAIL
    keys = {0: torch.randn(hkv, n, d, generator=g), 1: torch.randn(hkv, n, d, generator=g)}
    calibration = {i: torch.randn(hq, queries, d, generator=g) for i in keys}
    methods = [make_method(m, {"sink": 4, "recent": 30} if m != "squeeze" else None)
               for m in build_order(["duo-squeeze"])]
    artifacts = build_methods(keys, calibration, TAIL, methods, d ** -0.5, torch.device("cpu"),
                              prepared=stand_ins(methods, [0, 1], hkv, d))
    return methods[-1], artifacts, calibration


def named(artifacts: dict, prefix: str) -> dict:
    """The artifacts under `prefix` ("method.layer0.", "method.calib."), by their short names."""
    return {k.removeprefix(prefix): t for k, t in artifacts.items() if k.startswith(prefix)}


def test_duo_squeeze_streams_the_low_heads_and_looks_up_the_high_ones():
    """duo-squeeze: the heads of rank >= its retrieval share read their window (the sink's and the recent tokens,
    found in squeeze's layout, then the dense rows); the others exactly squeeze's selection at the plan's threshold."""
    from kernels.backend import REFERENCE

    d, n = 8, INDEXED + TAIL
    method, artifacts, queries = duo_squeeze_context(seed=1, queries=TAIL)
    part, calib, sq = (named(artifacts, prefix) for prefix in ("duo-squeeze.layer0.", "duo-squeeze.calib.",
                                                                "squeeze.layer0."))
    plan = method.plan(calib, 0.4)
    assert plan.retrieval_heads == 2  # half of the model's four KV heads
    index = LayerIndex(part, n, TAIL)
    q = queries[0][:, -1:]
    got = method.lookup(q, index, plan, d ** -0.5, REFERENCE).selection.to_mask()
    squeeze = make_method("squeeze").lookup(q, LayerIndex(sq, n, TAIL), plan, d ** -0.5, REFERENCE).selection.to_mask()
    order = method.layout(index).order  # original position of each place
    for h in range(part["rank"].numel()):
        if int(part["rank"][h]) < plan.retrieval_heads:
            assert torch.equal(got[h], squeeze[h])
        else:
            tokens = set(order[h][got[h]].tolist())
            assert tokens == set(range(4)) | set(range(INDEXED - 20, n))  # sink 4; recent 30 = 20 + the tail's 10


def test_duo_squeeze_reads_every_plan_as_its_lookups_do():
    """DuoSqueezePolicy.reads scores once for all the plans; each value equals Lookup.read_fraction of its own lookup
    at that plan (Method.reads): streaming heads' windows, retrieval heads' clusters and tail, every head's
    centroids; decode steps and a question's prefill alike, at every share of retrieval heads the grid reaches."""
    from engine.attention.budget import KEYS_GRID
    from engine.attention.method import Method

    d, n = 8, INDEXED + TAIL
    method, artifacts, queries = duo_squeeze_context(seed=3, queries=TAIL + 8)
    part, calib = named(artifacts, "duo-squeeze.layer0."), named(artifacts, "duo-squeeze.calib.")
    index = LayerIndex(part, n, TAIL)
    plans = [method.plan_keys(calib, f, f, f) for f in KEYS_GRID]
    assert len({p.retrieval_heads for p in plans}) > 1  # every head retrieves at the full budget, a share below
    q = queries[0]
    for step, pos in ((q[:, -1:], torch.tensor([n - 1])), (q[:, 2:14], torch.arange(n - 12, n))):
        fast = method.reads(step, index, plans, d ** -0.5, pos)
        assert fast == pytest.approx(Method.reads(method, step, index, plans, d ** -0.5, pos), abs=1e-12)
        assert len(set(fast)) > 3  # the plans read different amounts


def test_gate_training_bench_prints_its_json(capsys):
    """engine.bench.gates on the tiny random shape (a word-level stand-in tokenizer): one JSON line, times > 0."""
    from engine.bench.gates import main as bench

    assert bench(["--shape", "tiny", "--steps", "2", "--min-tokens", "300", "--max-tokens", "400", "--device", "cpu",
                  "--passkeys", "2", "--words", "3"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["bench"] == "gates" and doc["weights"] == "random" and doc["steps_timed"] == 2
    assert doc["seconds_per_step"] > 0 and 0.0 <= doc["gates_mean"] <= 1.0


def test_preparer_reports_progress_a_failure_once_then_retries():
    """engine.serve.preparer.Preparer with a stand-in engine: a run reports its steps and an estimate of the time left;
    a failure is shown once with its error, and the next start tries again; nothing to prepare gives None."""
    import threading
    import time

    from engine.serve.preparer import Preparer

    class FakeEngine:
        def __init__(self):
            self.calls, self.fail, self.done, self.gate = 0, True, False, threading.Event()

        def needs_preparation(self, name):
            return [] if self.done else ["duo"]

        def prepared(self, name, progress):
            self.calls += 1
            progress("training duo: step 1/4", 1, 4)
            time.sleep(0.01)
            progress("training duo: step 2/4", 2, 4)
            self.gate.wait(5)
            if self.fail:
                raise RuntimeError("out of memory\nmore lines")
            self.done = True

    engine = FakeEngine()
    preparer = Preparer(engine)
    first = preparer.start("duo")
    assert first.state == "running"
    deadline = time.monotonic() + 5
    while preparer.view("duo").done < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    running = preparer.start("duo")  # under way: the same run, not a second one
    assert running.state == "running" and running.done == 2 and running.seconds_left is not None
    engine.gate.set()
    while preparer.view("duo").state == "running" and time.monotonic() < deadline:
        time.sleep(0.005)
    failed = preparer.start("duo")
    assert (failed.state, failed.error, engine.calls) == ("failed", "out of memory", 1)
    engine.fail = False
    assert preparer.start("duo").state == "running" and engine.calls >= 1  # retried
    while preparer.view("duo").state == "running" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert preparer.view("duo").state == "done" and engine.calls == 2 and preparer.start("duo") is None


def test_a_preparation_is_cancelled_at_its_next_step_and_its_expected_time_comes_from_the_ingest_rate():
    """Preparer.cancel stops a run at its next progress report (state "cancelled"; the next start runs it again);
    before its first step a run's time left is the expected time: the method's work in ingest tokens times the
    seconds per token the ingests took."""
    import threading
    import time

    from engine.methods import make_method
    from engine.serve.preparer import CANCELLED, Preparer

    class FakeEngine:
        def __init__(self):
            self.calls, self.done, self.first_step, self.go = 0, False, threading.Event(), threading.Event()

        def needs_preparation(self, name):
            return [] if self.done else ["duo"]

        def method(self, name):
            return make_method(name)

        def prepared(self, name, progress):
            self.calls += 1
            self.go.wait(5)
            for step in range(1, 1000):
                progress(f"training duo: step {step}/999", step, 999)
                self.first_step.set()
                time.sleep(0.01)

    engine = FakeEngine()
    preparer = Preparer(engine, seconds_per_token=lambda: 0.0034)  # the embedded model's ingest on 2 CPU cores
    expected = preparer.expected_seconds("duo")
    assert expected == pytest.approx(0.0034 * make_method("duo").preparation_work())
    assert 15 * 60 < expected < 19 * 60  # the defaults trained in 17 min there
    assert Preparer(engine).expected_seconds("duo") is None  # no ingest timed yet: no estimate
    first = preparer.start("duo")
    assert first.state == "running" and first.seconds_left == pytest.approx(expected)
    engine.go.set()
    assert engine.first_step.wait(5)
    assert preparer.cancel("duo")
    deadline = time.monotonic() + 5
    while preparer.view("duo").state == "running" and time.monotonic() < deadline:
        time.sleep(0.005)
    cancelled = preparer.view("duo")
    assert (cancelled.state, cancelled.error) == ("cancelled", CANCELLED) and cancelled.done < 999
    assert not preparer.cancel("duo")  # nothing under way
    assert preparer.start("duo").state == "running" and engine.calls >= 1  # started again
    assert preparer.cancel("duo")


def test_saap_expected_training_time_matches_its_measured_one():
    """Saap's defaults trained in 161 s on 2 CPU cores with the embedded model, which ingests 3.4 ms per token."""
    from engine.methods import make_method

    assert 0.0034 * make_method("saap").preparation_work() == pytest.approx(161, rel=0.05)
    assert make_method("squeeze").preparation_work() == 0.0
