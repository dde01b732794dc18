"""engine.bench.e2e on the CPU: the tiny shape through the engine's ingest, session and generation (PyTorch reference
kernels), every registered method timed with its KV budget and byte bound; and the transformers peer, which must be
the engine's own model (same weights, same logits) for its ratios to mean anything."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.bench.e2e.models import SHAPES, build_shape, even_device_map
from engine.bench.e2e.peer import measure_peer, peer_model
from engine.bench.e2e.report import main
from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.methods import REGISTRY, SPARSE_METHODS, build_order, make_method
from engine.model.generate import full_logits
from kernels.backend import REFERENCE
from tests.support.tiny_models import SMALL_SAAP, gates_for

# 1,024 tokens: duo's streaming window (64 + 256 tokens) is then a part of the context, as sparsity needs
CONTEXT, STEPS, QUESTIONS = 1024, 4, ("8", "16")
STAGES = {"prefill", "clustering", "calibrating"}  # engine.context.ingest's progress stages


@pytest.fixture(scope="module")
def run(one_thread, tmp_path_factory):
    """(exit code, the JSON printed on stdout, the JSON written by --out)."""
    out_file = tmp_path_factory.mktemp("e2e") / "e2e.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--shape", "tiny", "--device", "cpu", "--context", str(CONTEXT), "--steps", str(STEPS),
                     "--questions", ",".join(QUESTIONS), "--prefill-turns", "2", "--no-peer", "--out", str(out_file)]
                    + [a for name, value in SMALL_SAAP["saap"].items() for a in ("--set", f"saap.{name}={value}")])
    lines = stdout.getvalue().strip().splitlines()
    assert len(lines) == 1  # one JSON line on stdout; progress goes to stderr
    return code, json.loads(lines[0]), json.loads(out_file.read_text())


def test_exits_zero_and_writes_the_same_json(run):
    code, doc, written = run
    assert code == 0
    assert written == doc
    assert doc["device"] == "cpu" and doc["context"] == CONTEXT and doc["shape"] == "tiny"
    assert doc["peer"] == {"skipped": "--no-peer"}
    assert doc["settings"]["prefill_turns"] == 2


def test_every_registered_method_is_timed(run):
    _, doc, _ = run
    assert list(doc["methods"]) == list(REGISTRY)
    for name, row in doc["methods"].items():
        assert "error" not in row, (name, row)
        assert row["decode_ms_median"] > 0 and 0 < row["decode_ms_min"] <= row["decode_ms_median"]
        assert row["decode_steps_timed"] == STEPS - 2  # the first two decode steps are warm-up
        assert set(row["prefill_ms"]) == set(QUESTIONS) and all(ms > 0 for ms in row["prefill_ms"].values())
        # the fastest of the --prefill-turns timed turns, at most their median
        assert all(0 < row["prefill_ms_min"][n] <= row["prefill_ms"][n] for n in QUESTIONS)
        assert row["speedup_vs_full"] > 0 and row["speedup_vs_peer"] is None


def test_kv_budgets(run):
    """full reads every fixed-context key and no index; a sparse method at 90% reads a part of them."""
    _, doc, _ = run
    for name, row in doc["methods"].items():
        budgets = [row["kv_budget"], row["kv_budget_prefill"], row["kv_budget_decode"],
                   *row["prefill_kv_budget"].values()]
        if REGISTRY[name].sparse:
            assert all(0 < b < 1 for b in budgets), (name, budgets)
        else:
            assert all(abs(b - 1) <= 1e-6 for b in budgets), (name, budgets)


def test_ingest_stages(run):
    _, doc, _ = run
    ingest = doc["ingest"]
    assert "error" not in ingest
    assert STAGES <= set(ingest["stages"]) and all(s > 0 for s in ingest["stages"].values())
    # each figure is rounded to 1 ms: the stages' sum may pass the rounded total by half a ms per figure
    assert sum(ingest["stages"].values()) <= ingest["seconds"] + 0.5e-3 * (len(ingest["stages"]) + 1) + 1e-9
    assert doc["session"]["open_s"] >= 0


def test_byte_bound(run):
    """The bound's bytes, counted by hand for the tiny Llama (fp32), and a bound that falls with the KV budget."""
    _, doc, _ = run
    shape = SHAPES["tiny"]
    h, inter, d, kv = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["num_key_value_heads"]
    heads, layers, vocab = shape["num_attention_heads"], shape["num_hidden_layers"], shape["vocab_size"]
    per_layer = h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h  # q, o; k, v; MLP; two norms
    weights = layers * per_layer + h + vocab * h + h  # final norm, lm_head, one embedding row
    bound = doc["bound"]
    assert bound["weight_bytes"] == 4 * weights
    assert bound["global_fixed_kv_bytes"] == layers * CONTEXT * kv * 2 * d * 4
    assert bound["sliding_window_kv_bytes"] == 0 and bound["new_kv_bytes"] > 0
    assert doc["bandwidth_gbs"] > 0
    rows = doc["methods"]
    for row in rows.values():
        assert row["bound_ms"] > 0 and row["vs_bound"] > 0
        extra_ms = (row["kv_budget_decode"] - 1) * bound["global_fixed_kv_bytes"] / (doc["bandwidth_gbs"] * 1e6)
        assert row["bound_ms"] == pytest.approx(rows["full"]["bound_ms"] + extra_ms, rel=1e-3, abs=1e-4)
        if row is not rows["full"]:
            assert row["bound_ms"] < rows["full"]["bound_ms"]


def test_peer_is_the_engine_model(one_thread):
    """The peer shares the engine model's tensors, gives the engine's full-attention logits over the same tokens,
    and its measurement runs eagerly on the CPU (the benchmark itself times it on CUDA only)."""
    lm = build_shape("tiny", "cpu")
    peer = peer_model(lm)
    storage = lambda model: {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}  # noqa: E731
    assert storage(peer) == storage(lm.model)  # (the fused projections' rows are views of their fused weights)
    assert peer.config._attn_implementation == "sdpa" and lm.model.config._attn_implementation == "squeeze"
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPES["tiny"]["vocab_size"], (48,), generator=gen)
    prompt = torch.randint(0, SHAPES["tiny"]["vocab_size"], (6,), generator=gen)
    settings = ContextSettings(dense_tail=8)
    methods = [make_method(n, {"kmeans_iters": 2} if n in ("squeeze", "hsqueeze") else None)
               for n in build_order(SPARSE_METHODS)]
    session = ContextSession(lm, ingest_tokens(lm, ids, settings, REFERENCE, methods, prepared=gates_for(lm, methods)).artifacts,
                             settings, REFERENCE)
    ours = full_logits(lm, session.step_context("full", 0.0), prompt)
    with torch.inference_mode():
        theirs = peer(input_ids=torch.cat([ids, prompt])[None]).logits[0, -prompt.numel():]
    torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=1e-4)
    report = measure_peer(lm, ids, prompt, steps=3, chunk=16, compile=False)
    assert report["prefill_s"] > 0 and report["question_prefill_ms"] > 0
    assert report["best_decode"] == "eager" and report["best_decode_ms"] == report["eager_decode_ms_median"] > 0
    assert report["max_cache_len"] >= ids.numel() + prompt.numel() + 3


@pytest.mark.parametrize("shape", ["llama3-8b", "gemma3-270m"])
@pytest.mark.parametrize("gpus", [2, 3])
def test_even_device_map(shape, gpus):
    """--gpus N: the decoder layers in N equal runs in order; embeddings first, the head last (or with its tied
    embeddings), every module of the model placed."""
    fields_ = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields_.pop("model_type"), **fields_)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device_map = even_device_map(model, gpus)
    layers = [device_map[f"model.layers.{i}"] for i in range(config.num_hidden_layers)]
    assert layers == sorted(layers) and set(layers) == set(range(gpus))
    runs = [layers.count(g) for g in range(gpus)]
    assert max(runs) - min(runs) <= 1, runs
    assert device_map["model.embed_tokens"] == 0 and device_map["model.norm"] == gpus - 1
    assert device_map["lm_head"] == (0 if config.tie_word_embeddings else gpus - 1)
    placed = {name for name, module in model.named_modules()
              if any(name == k or name.startswith(k + ".") for k in device_map)}
    assert placed | {"", "model", "model.layers"} == {name for name, _ in model.named_modules()}
    with pytest.raises(ValueError, match="cannot split"):
        even_device_map(model, config.num_hidden_layers + 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_split_over_two_gpus(tmp_path):
    """--gpus 2 on CUDA: the tiny shape's two layers on two GPUs, every method timed eagerly (no CUDA graphs across
    devices), the peer skipped."""
    out_file = tmp_path / "e2e.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["--shape", "tiny", "--gpus", "2", "--context", str(CONTEXT), "--steps", str(STEPS),
                     "--questions", QUESTIONS[0], "--out", str(out_file)])
    doc = json.loads(out_file.read_text())
    assert code == 0, doc
    assert doc["gpus"] == 2 and doc["layers_per_device"] == {"cuda:0": 1, "cuda:1": 1}
    assert doc["session"]["graphs"] is False and "skipped" in doc["peer"]
    assert all(row["decode_ms_median"] > 0 for row in doc["methods"].values())


def test_compile_both_measures_the_engine_twice_in_one_run(one_thread, tmp_path):
    """--compile both: the engine's phases without, then with compiled decoder layers (engine.model.compiled), each with
    its ratios, and the compiled decode's speedup over the uncompiled one of the same run."""
    out_file = tmp_path / "e2e.json"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["--shape", "tiny", "--device", "cpu", "--context", str(CONTEXT), "--steps", str(STEPS),
                     "--questions", QUESTIONS[0], "--methods", "full,squeeze", "--no-peer", "--compile", "both",
                     "--out", str(out_file)])
    doc = json.loads(out_file.read_text())
    assert code == 0 and doc["settings"]["compile"] == "both"
    compiled = doc["compiled"]
    assert set(compiled) == {"ingest", "session", "methods"} and set(compiled["ingest"]["stages"]) == STAGES
    for method, row in compiled["methods"].items():
        assert row["decode_ms_median"] > 0 and row["bound_ms"] > 0
        assert row["speedup_vs_uncompiled"] == pytest.approx(
            doc["methods"][method]["decode_ms_median"] / row["decode_ms_median"], rel=1e-2)
    assert compiled["methods"]["full"]["speedup_vs_full"] == 1.0


def test_kernel_bench_parses_method_settings():
    """`squeeze bench kernels --set quest.bounds=int8`: typed like the setting's default; unknown ones refused."""
    from engine.bench.settings import parse_settings

    assert parse_settings(["quest.bounds=int8", "quest.page_size=8", "squeeze.centroid_ratio=0.1"]) == {
        "quest": {"bounds": "int8", "page_size": 8}, "squeeze": {"centroid_ratio": 0.1}}
    for bad in ("quest.colour=red", "nope.bounds=int8", "quest.bounds", "quest.page_size=x"):
        with pytest.raises(ValueError):
            parse_settings([bad])


def test_follow_settings_parse_from_the_command_line():
    """`squeeze eval --follow lead=4 --follow carry=false`: typed like the defaults; unknown or bad ones refused."""
    from engine.attention.follow import FollowSettings
    from engine.bench.settings import parse_follow

    assert parse_follow(["lead=4", "carry=false"]) == FollowSettings(lead=4, carry=False)
    for bad in ("colour=red", "lead", "lead=x", "lead=-1", "carry=perhaps"):
        with pytest.raises(ValueError):
            parse_follow([bad])


def test_token_lookups_are_timed_and_read_their_budget(one_thread):
    """`--token-lookups`: the question's tokens each look up their own keys; the run says so, and each question's
    prefill still reads a part of the keys (the mean over its tokens)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["--shape", "tiny", "--device", "cpu", "--context", str(CONTEXT), "--steps", str(STEPS),
                     "--questions", ",".join(QUESTIONS), "--methods", "full,squeeze", "--no-peer", "--token-lookups"])
    doc = json.loads(stdout.getvalue().strip().splitlines()[-1])
    assert code == 0 and doc["token_lookups"] is True
    row = doc["methods"]["squeeze"]
    assert set(row["prefill_ms"]) == set(QUESTIONS)
    assert all(0 < b < 1 for b in row["prefill_kv_budget"].values()), row["prefill_kv_budget"]


def test_idle_time_splits_gaps_between_kernels_from_waits_on_the_host():
    """Two steps of three kernels (us): 1 us between kernels, 200 us waiting between the steps; an overlapping
    kernel (a second stream, or one launched with PDL waiting in the one before) leaves no gap and adds no busy
    time: 10 + 9 + 9 us a step."""
    from engine.bench.e2e.runner import idle_time

    step = [(0.0, 10.0), (11.0, 20.0), (15.0, 19.0), (21.0, 30.0)]
    kernels = step + [(start + 230.0, end + 230.0) for start, end in step]
    assert idle_time(kernels, 2) == {"gpu_busy_ms_per_step": 0.028, "idle_between_kernels_ms_per_step": 0.002,
                                     "idle_waiting_host_ms_per_step": 0.1}
