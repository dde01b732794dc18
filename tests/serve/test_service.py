"""Engine's evaluation records (record_eval, latest_eval) over its own store, without loading a model; the shipped
evaluation of the embedded model as the fallback."""

from __future__ import annotations

import json

import pytest

import engine.context.warm as warming
import engine.serve.service as service
from engine.model.load import EMBEDDED_MODEL, model_id_for
from engine.serve.service import Engine

MODEL = "tiny-eval-model"  # not a path and never loaded: the engine only names it


def eval_doc(model: str, budget: float = 0.1, **extra) -> dict:
    row = {"method": "squeeze", "budget": budget, "needles": 0.5, "recall": 0.91, "oracle": 0.97, "top1": 0.98,
           "kl": 0.012, "read_prefill": 0.101, "read_decode": 0.099}
    return {"bench": "eval", "model": model, "device": "cpu", "methods": ["squeeze"], "budgets": [budget],
            "created": "2025-01-02T03:04:05+00:00", "seconds": 81.5, "summary": [row],
            "full": {"needles_found": 6, "needles_cells": 6}, **extra}


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """SHIPPED_EVAL pointed at a file of the test's own (absent until written)."""
    path = tmp_path / "shipped" / "cpu-eval.json"
    monkeypatch.setattr(service, "SHIPPED_EVAL", path)
    return path


def test_record_and_latest_eval_by_model(tmp_path, shipped):
    engine = Engine(tmp_path / "cache", model=MODEL)
    assert engine.latest_eval() is None
    first = engine.record_eval(eval_doc(MODEL, 0.1))
    engine.record_eval(eval_doc("other-model", 0.2))
    newest = engine.record_eval(eval_doc(MODEL, 0.3, extra_key={"kept": True}))
    assert first < newest and not engine.model_loaded
    assert engine.latest_eval() == eval_doc(MODEL, 0.3, extra_key={"kept": True})  # the engine's model by default
    assert engine.latest_eval("other-model")["budgets"] == [0.2]
    assert [r["id"] for r in engine.store.evals.list(MODEL)] == [newest, first]
    shipped.parent.mkdir()
    shipped.write_text(json.dumps(eval_doc("unrecorded-model", 0.5)))
    assert engine.latest_eval("unrecorded-model") is None  # the shipped file stands in for the embedded model only
    for bad in ({"summary": []}, {"model": ""}, {"model": 3}):
        with pytest.raises(ValueError, match="model"):
            engine.record_eval(bad)
    assert not engine.model_loaded


def test_the_embedded_model_falls_back_to_the_shipped_eval(tmp_path, shipped):
    engine = Engine(tmp_path / "cache", model=EMBEDDED_MODEL)
    embedded = engine.model_id
    assert engine.latest_eval() is None  # no record, no shipped file
    shipped.parent.mkdir()
    shipped.write_text(json.dumps(eval_doc(embedded, 0.2)))
    assert engine.latest_eval() == eval_doc(embedded, 0.2)
    assert engine.latest_eval(embedded) == eval_doc(embedded, 0.2)
    shipped.write_text(json.dumps(eval_doc("other-weights@123", 0.2)))
    assert engine.latest_eval() is None  # the shipped results of other weights are not this model's
    shipped.write_text(json.dumps(eval_doc(embedded, 0.2)))
    engine.record_eval(eval_doc(embedded, 0.3))
    assert engine.latest_eval()["budgets"] == [0.3]  # a recorded one wins
    assert json.loads(shipped.read_text())["budgets"] == [0.2]  # the shipped file is only read
    shipped.write_text("{not json")
    other = Engine(tmp_path / "other-cache", model=EMBEDDED_MODEL)
    with pytest.raises(ValueError, match="cpu-eval.json"):
        other.latest_eval()
    assert not engine.model_loaded and not other.model_loaded


@pytest.mark.skipif(not service.SHIPPED_EVAL.exists(), reason="no evaluation shipped yet")
def test_the_shipped_eval_is_of_the_embedded_model():
    doc = json.loads(service.SHIPPED_EVAL.read_text())
    assert doc["model"] == model_id_for(EMBEDDED_MODEL) and doc["summary"]
    for row in doc["summary"]:
        assert {"method", "budget"} <= set(row) and 0 < row["budget"] <= 1


def test_a_method_revision_makes_only_builds_that_depend_on_it_stale(tmp_path):
    """A method's revision is part of the build key of what depends on it (duo and duo-squeeze, after duo's streaming
    windows were fitted to the budget), and nothing else's key moves: other methods' old builds stay valid."""
    from engine.attention.budget import CALIBRATION_VERSION
    from engine.methods import make_method

    engine = Engine(tmp_path / "cache", model=MODEL)
    duo = make_method("duo")
    assert duo.revision >= 1
    assert engine.build_key("duo")["duo"] == {**duo.settings.as_dict(), "revision": duo.revision}
    assert engine.build_key("duo-squeeze")["duo"]["revision"] == duo.revision
    assert engine.build_key("squeeze") == {"calibration": CALIBRATION_VERSION,
                                           "squeeze": make_method("squeeze").settings.as_dict()}
    assert duo.built_settings(duo.build_entry()) == duo.settings.as_dict()  # what a stored build is reopened with


def test_a_compiled_load_warms_the_default_method_as_a_stage_of_it(tmp_path, monkeypatch):
    """Where the layers are compiled (a GPU's default; here asked for, with the compilation itself left out), the
    load runs the default method over a small random context after the dense warm-up (engine.context.warm: its
    kernels compiled before the first question), reported as the compile stage and counted in compile_seconds."""
    from tests.support.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", "llama_gqa")
    monkeypatch.setattr(service, "compile_layers", lambda lm: 0)
    monkeypatch.setattr(warming, "warm_up", lambda lm, backend, batch: 0.0)
    warmed, stages = [], []

    def warm(lm, backend, method, sparsity, prepared=None):
        warmed.append((method.name, sparsity))
        return real(lm, backend, method, sparsity, prepared, tokens=512)

    real = warming.warm_method
    monkeypatch.setattr(warming, "warm_method", warm)
    engine = Engine(tmp_path / "cache", model=str(path), device="cpu", compile="on",
                    load_progress=lambda step, done, total: stages.append(step))
    assert engine.lm is not None
    assert warmed == [(name, service.DEFAULT_SPARSITY) for name in service.DEFAULT_METHODS]
    assert service.STEP_COMPILE in stages and engine.compile_seconds > 0
