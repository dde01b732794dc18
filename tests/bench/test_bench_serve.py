"""`squeeze bench serve` on a tiny model on the CPU: three users over their own documents asked at once, every
method's answers the same as each user's lone answer, and the report's figures consistent (first token before the
end, p50 <= p95, every user's tokens counted)."""

from __future__ import annotations

import json

import pytest

from engine.bench.serve import checkpoint, main, percentile, staggered
from engine.context import batching as turn_batching
from engine.model import batch as batching
from engine.model import capture
from tests.support.tiny_models import make_tiny_model


def test_percentiles_interpolate_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 95) == pytest.approx(1.95)
    assert percentile([], 50) == 0.0


@pytest.mark.usefixtures("one_thread")
def test_three_users_at_once_get_their_lone_answers(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "model", "llama_gqa")
    out = tmp_path / "serve.json"
    assert main(["--model", str(model), "--device", "cpu", "--users", "3", "--tokens", "6", "--batch", "3",
                 "--methods", "squeeze,full", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["batch"] == 3 and report["documents"] == 3 and set(report["methods"]) == {"squeeze", "full"}
    for entry in report["methods"].values():
        assert entry["same_answers"] == 3
        together = entry["together"]
        assert together["tokens"] == sum(u["tokens"] for u in entry["per_user"]) > 0
        assert together["first_s_p50"] <= together["first_s_p95"]
        assert all(u["first_s"] <= u["total_s"] for u in entry["per_user"])


@pytest.mark.usefixtures("one_thread")
def test_a_random_weight_shape_serves_documents_of_the_asked_length(tmp_path, capsys, monkeypatch):
    """--shape: the shape's random weights through the byte tokenizer, each document --context tokens (its <bos>
    too), every answer its lone answer, and beside the time per answer token the byte bound of a step at the batch
    (the weights once: more than alone, less than that many steps alone); each ingest timed by stage, the
    scheduler's steps by batch size and its turns' starts, and with --profile the scheduler thread's profile of each
    method's users at once, through the batched forward; with --steps the median step of one turn and of the batch
    in each way a batch attends (and of one turn through its session's own path), and with --kernel-profile the
    profiler's table of the full batch's steps in each way; with --stagger the users' answers end at different
    steps."""
    for module, name in ((turn_batching, "AHEAD"), (turn_batching, "CAPTURE_AFTER"),
                         (turn_batching, "CAPTURE_UNWARMED"), (capture, "SYNC_FIRST"), (batching, "CONCURRENT"),
                         (batching, "SPLIT_GPU"), (batching, "SHARED_LAUNCHES")):
        monkeypatch.setattr(module, name, getattr(module, name))  # the switches main sets, as they were after
    out, profile, kernels = tmp_path / "serve.json", tmp_path / "serve-profile.txt", tmp_path / "kernels.txt"
    assert main(["--shape", "tiny", "--context", "300", "--device", "cpu", "--users", "2", "--tokens", "4",
                 "--batch", "2", "--methods", "squeeze,full", "--out", str(out), "--profile", str(profile),
                 "--steps", "3", "--kernel-profile", str(kernels), "--stagger", "--ahead", "--split-gpu",
                 "--capture-after", "2", "--capture-unwarmed", "--sync-captures"]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "random-tiny" and report["shape"] == "tiny" and report["complete"]
    assert report["ahead"] and report["split_gpu"] and report["capture_after"] == 2  # (a GPU's ways: nothing
    assert report["capture_unwarmed"] and report["sync_captures"]  # changes on the CPU)
    assert [set(stages) >= {"prefill", "saving"} for stages in report["ingest_s"]] == [True, True]
    sections = profile.read_text().split("=== ")[1:]
    assert [s.split(":")[0] for s in sections] == ["squeeze", "full"]
    assert all("forward_batch" in s and "scheduler.py" in s for s in sections)
    assert report["context_tokens"] == [301, 301] and report["bandwidth_gbs"] > 0
    for name, entry in report["methods"].items():
        assert entry["same_answers"] == 2, name
        # a shape's turns never end early: each answer as long as --stagger let it be (the second user's shorter)
        assert [u["tokens"] for u in entry["per_user"]] == report["tokens_per_user"] == [4, 3]
        assert entry["step_ms"]["together"] > 0 and entry["step_ms"]["alone"] > 0 and entry["first_round_s"] > 0
        scheduler = entry["scheduler"]  # the users' turns admitted one by one, then stepped together
        assert scheduler["starts"]["count"] == 2 and scheduler["starts"]["total_s"] > 0
        assert "2" in scheduler["steps"] and all(s["count"] > 0 and s["median_ms"] > 0
                                                 for s in scheduler["steps"].values())
        slowest = scheduler["slowest_steps"]  # the slowest steps first, each with the kernels compiled in it
        assert slowest and [s["ms"] for s in slowest] == sorted((s["ms"] for s in slowest), reverse=True)
        assert slowest[0]["ms"] == max(s["max_ms"] for s in scheduler["steps"].values())
        assert all(isinstance(s["triton_compiles"], list) for s in slowest)
        assert {"triton_compiles", "dynamo_graphs"} <= set(scheduler["events"])
        bound = entry["bound_ms"]
        assert bound["alone"] < bound["batch"] < 2 * bound["alone"]
        steps = entry["batch_steps"]
        ways = {"concurrent_ms", "split_ms", "shared_ms", "one_after_another_ms", "ahead_ms"}
        profiled = steps.pop("profiled")  # --kernel-profile: the full batch's steps in each way, profiled
        assert set(profiled) == ways and all("gpu_busy_ms_per_step" in p for p in profiled.values()), profiled
        assert steps["1"].pop("session_ms") > 0  # one turn through its session's own path, beside the batch's
        assert set(steps) == {"1", "2"} and all(set(s) == ways and min(s.values()) > 0 for s in steps.values()), steps
    assert report["methods"]["full"]["bound_ms"]["batch"] > report["methods"]["squeeze"]["bound_ms"]["batch"]
    headings = [line for line in kernels.read_text().splitlines() if line.startswith("== ")]
    assert headings == [f"== {m}, 2 turns, {w}: 4 steps" for m in ("squeeze", "full")
                        for w in ("concurrent_ms", "split_ms", "ahead_ms", "shared_ms", "one_after_another_ms")]


def test_a_shape_and_a_model_are_refused_together(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--shape", "tiny", "--model", "x", "--device", "cpu"])
    assert stop.value.code == 2
    assert "exclude each other" in capsys.readouterr().err


def test_staggered_answers_end_one_after_another():
    assert staggered(48, 8) == [48, 45, 42, 39, 36, 33, 30, 27]
    assert staggered(4, 3) == [4, 4, 3] and min(staggered(2, 5)) == 2


def test_a_run_stopped_midway_leaves_what_it_measured_marked_incomplete(tmp_path):
    """What a run measured so far goes to --out as it goes (a GPU call's time limit may stop it), marked incomplete
    until the whole report replaces it."""
    out = tmp_path / "serve.json"
    checkpoint({"methods": {"squeeze": {"batch_steps": {"1": {"concurrent_ms": 6.9}}}}}, str(out))
    report = json.loads(out.read_text())
    assert report["complete"] is False and report["methods"]["squeeze"]["batch_steps"]["1"]["concurrent_ms"] == 6.9
    checkpoint({}, None)  # no --out: nothing written, nothing raised
