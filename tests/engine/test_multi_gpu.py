"""The engine with a model spread over two GPUs (`--device auto`: accelerate's device_map) against one GPU.

A tiny random-weight model is loaded twice through `load_model`: with device="auto" and a `max_memory` budget that
forces accelerate to put its first half on cuda:0 and the rest on cuda:1, and with device="cuda" (every layer on
cuda:0). Each ingests the same document; then both answer the same question over the same context with `full` and
`squeeze` (sparsity 0: every cluster kept; 0.7: calibrated pruning), through the Triton backend. The split model
must place each layer's fixed K/V and index on that layer's GPU, launch every kernel on the GPU that holds its
tensors, and give the one-GPU logits, at the question's prefill and at every decode step.

Needs two CUDA GPUs (skipped otherwise); meant to take well under a minute, most of it compiling Triton kernels.
    python -m pytest -q -p no:cacheprovider tests/engine/test_multi_gpu.py
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.model.generate import forward_step, generate_tokens
from engine.model.load import LoadedModel, load_model
from engine.text.prompt import question_ids, tokenize_document
from kernels.backend import REFERENCE, Backend
from kernels.dispatch import backend_for
from tests.engine.test_engine_tiny import (  # the same document and index settings
    DOCUMENT,
    QUESTION,
    SETTINGS,
    all_methods,
)

# Llama (GQA, two global layers: one per GPU, so calibration pools scores from both) and the Gemma 3 hybrid
# (sliding layers on both GPUs, its global layer on cuda:1).
SPLIT_ARCHS = ("llama_gqa", "gemma3_hybrid")
CASES = [("full", 0.0), ("squeeze", 0.0), ("squeeze", 0.7)]
NEW_TOKENS = 4
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
# Both models run in bfloat16 with the same weights and kernels on the same kind of GPU; only where each layer runs
# differs, so the logits should agree to the bit. The tolerance still allows bfloat16 rounding (8-bit mantissa,
# ~4e-3 relative per rounding, a few per layer, on logits of order 1), in case a table or a GEMM algorithm differs
# by device: the one test_engine_triton uses for bf16 logits of these models on a GPU. A layer whose attention read
# the wrong GPU's memory, a stale stream or a wrong selection would miss it by far more.
TOL = dict(atol=5e-2, rtol=5e-2)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.parametrize("tiny_model_path", SPLIT_ARCHS, indirect=True),
]


@dataclass
class Pair:
    """One tiny model loaded split over two GPUs and on one GPU, the document ingested by each."""

    arch: str
    split: LoadedModel  # device="auto", layers on cuda:0 and cuda:1
    single: LoadedModel  # device="cuda", every layer on cuda:0
    split_ingest_devices: dict[str, torch.device]  # artifact -> where the split ingest left it
    split_artifacts: dict[str, torch.Tensor]  # the split model's own context, on the CPU as storage keeps it
    single_artifacts: dict[str, torch.Tensor]  # the one-GPU context, on the CPU

    def session(self, lm: LoadedModel, artifacts: dict[str, torch.Tensor], backend: Backend | None = None):
        return ContextSession(lm, dict(artifacts), SETTINGS, backend or backend_for(lm.device))


def split_max_memory(path: Path) -> dict[int, int | str]:
    """accelerate's max_memory that puts the embeddings and the first half of the decoder layers on cuda:0 and the
    rest on cuda:1. accelerate fills cuda:0 in module order and keeps room there for the largest layer (to bring
    back offloaded weights), so cuda:0 gets the embeddings, the first half, that reserve and half a layer of slack."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    size = lambda module: sum(p.numel() * p.element_size() for p in module.parameters())  # noqa: E731
    layers = model.get_decoder().layers
    layer = max(size(m) for m in layers)
    first = size(model.get_input_embeddings()) + (len(layers) // 2 + 1) * layer + layer // 2
    return {0: first, 1: "1GiB"}


def ingest(lm: LoadedModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.device]]:
    """The document's artifacts moved to the CPU (as engine.serve.service stores them), and where the ingest left them."""
    fixed = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    out = ingest_tokens(lm, fixed.ids, SETTINGS, backend_for(lm.device), all_methods())
    return {k: t.detach().cpu() for k, t in out.artifacts.items()}, {k: t.device for k, t in out.artifacts.items()}


@pytest.fixture(scope="module")
def pair(tiny_model_path) -> Pair:
    path = str(tiny_model_path)
    split = load_model(path, device="auto", max_memory=split_max_memory(tiny_model_path))
    single = load_model(path, device="cuda")
    split_artifacts, split_devices = ingest(split)
    single_artifacts, _ = ingest(single)
    return Pair(tiny_model_path.name, split, single, split_devices, split_artifacts, single_artifacts)


def forced_step_logits(session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
                       answer: list[int]) -> torch.Tensor:
    """[1 + len(answer), V] float32 logits of each step of a turn that is fed `answer`'s tokens: the question's
    prefill (Lq > 1), then one decode step (Lq == 1) per token, the forward calls of engine.model.generate.generate_tokens.
    Fed the same tokens, two models can be compared at every step without a near-tie argmax forking the answers."""
    lm, step = session.lm, session.step_context(method, sparsity, None)
    cache = step.cache
    cache.reset_dynamic()
    cache.reserve(prompt.numel() + len(answer))
    ids, rows = prompt.to(lm.device), []
    with torch.inference_mode():
        for token in [*answer, None]:
            rows.append(forward_step(lm, step, ids, cache.get_seq_length())[0].float().cpu())
            if token is not None:
                ids = torch.tensor([token], device=lm.device)
    cache.reset_dynamic()
    return torch.stack(rows)


def _tensor_devices(obj) -> set[torch.device]:
    """Devices of the tensors in a kernel's arguments (tensors, Selections, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return {obj.device}
    if isinstance(obj, (list, tuple)):
        return set().union(*(_tensor_devices(x) for x in obj))
    if is_dataclass(obj) and not isinstance(obj, type):
        return _tensor_devices([getattr(obj, f.name) for f in fields(obj)])
    return set()


def recording(backend: Backend, calls: list[tuple[str, int, set[torch.device]]]) -> Backend:
    """`backend` with every kernel wrapped to record (name, current CUDA device, devices of its tensor arguments)."""

    def wrap(name, fn):
        def call(*args, **kwargs):
            calls.append((name, torch.cuda.current_device(), _tensor_devices([args, list(kwargs.values())])))
            return fn(*args, **kwargs)

        return call

    kernels = [f.name for f in fields(Backend) if f.name != "name"]
    return replace(backend, **{name: wrap(name, getattr(backend, name)) for name in kernels})


# --------------------------------------------------------------------------- placement


def test_layers_are_split_over_two_gpus(pair):
    split, single = pair.split, pair.single
    device_map = split.model.hf_device_map
    placed = {torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in device_map.values()}
    assert placed == {CUDA0, CUDA1}, f"max_memory did not split the model: {device_map}"
    for layer, device in zip(split.model.get_decoder().layers, split.layer_devices):
        assert {p.device for p in layer.parameters()} == {device}
    assert split.layer_devices == sorted(split.layer_devices, key=lambda d: d.index), device_map  # in layer order
    assert set(split.layer_devices) == {CUDA0, CUDA1}, device_map
    assert split.device == CUDA0  # the embeddings, where the engine puts the input ids
    if pair.arch == "llama_gqa":  # the global layers, which hold the index, on both GPUs
        assert {split.layer_devices[i] for i in split.global_layers} == {CUDA0, CUDA1}
    assert set(single.layer_devices) == {CUDA0} and single.device == CUDA0


def test_fixed_context_sits_on_its_layers_gpu(pair):
    """The ingest leaves each layer's K/V and index on that layer's GPU; a session puts them back there from the CPU;
    a turn's new K/V grow there too."""
    split = pair.split
    prefixes = [f"layer{i}." for i in range(split.num_layers)]
    for i, prefix in enumerate(prefixes):
        names = [n for n in pair.split_ingest_devices if n.startswith(prefix)]
        assert {pair.split_ingest_devices[n] for n in names} == {split.layer_devices[i]}, prefix
    for artifacts in (pair.split_artifacts, pair.single_artifacts):  # its own context, and the one-GPU model's
        session = pair.session(split, artifacts)
        for i, (layer, device) in enumerate(zip(session.cache.layers, split.layer_devices)):
            assert layer.fixed_keys.device == layer.fixed_values.device == device
            assert bool(layer.index) == (i in split.global_layers)
            assert {t.device for t in layer.index.values()} <= {device}
        prompt = question_ids(split.tokenizer, QUESTION)
        tokens = generate_tokens(split, session.step_context("squeeze", 0.7, None), prompt, 2)
        next(tokens)  # the question's prefill has run: its K/V are the dynamic part of every layer
        for layer, device in zip(session.cache.layers, split.layer_devices):
            assert layer.dynamic_length() == prompt.numel() and layer.new_keys.device == layer.new_values.device == device
        tokens.close()
        session.cache.reset_dynamic()


def test_kernels_run_on_their_layers_gpu(pair):
    """Every kernel call gets tensors of one GPU, and that GPU is the current device (Triton launches on the current
    device and stream, whatever its tensors' device): the new tokens' attention on both GPUs, the index's lookup
    and sparse attention on the GPUs of the global layers (both for Llama, cuda:1 for the Gemma 3 hybrid)."""
    split = pair.split
    backend = backend_for(split.device)
    assert backend.name == "triton"
    calls: list[tuple[str, int, set[torch.device]]] = []
    session = pair.session(split, pair.single_artifacts, recording(backend, calls))
    for method in ("squeeze", "hsqueeze"):
        answer = session.ask(QUESTION, method, 0.7, max_new_tokens=NEW_TOKENS)
        assert 1 <= answer.stats.steps <= NEW_TOKENS + 1
        assert 0 < answer.stats.kv_budget <= 1.1
        assert len(answer.stats.kept_fraction) == len(split.global_layers)
    for name, current, devices in calls:
        assert devices == {torch.device("cuda", current)}, f"{name} ran with cuda:{current} current on {devices}"
    assert {current for _, current, _ in calls} == {0, 1}
    triton = {f.name for f in fields(Backend)
              if f.name != "name" and getattr(backend, f.name) is not getattr(REFERENCE, f.name)}  # its own kernels
    on_gpu = {current for name, current, _ in calls if name in triton}
    assert on_gpu == {0, 1}, f"Triton kernels ran on {on_gpu}: {triton}"  # every layer attends to its new tokens
    lookup = {current for name, current, _ in calls if name.startswith("cluster_") or name == "sparse_attention"}
    assert lookup == {split.layer_devices[i].index for i in split.global_layers}  # the index's kernels: global layers


# --------------------------------------------------------------------------- the same numbers as one GPU


def test_split_ingest_matches_one_gpu(pair):
    """The split model's context: the same artifacts, the same fixed K/V; and its own calibration is usable."""
    split, single = pair.split_artifacts, pair.single_artifacts
    assert sorted(split) == sorted(single)
    for name in split:
        assert split[name].shape == single[name].shape, name
    for i in range(pair.split.num_layers):
        for part in ("keys", "values"):
            torch.testing.assert_close(split[f"layer{i}.{part}"].float(), single[f"layer{i}.{part}"].float(), **TOL)
    assert torch.isfinite(split["calib.squeeze.threshold"]).all()
    assert (split["calib.squeeze.threshold"] > 0).any()  # positive thresholds above sparsity 0
    # at sparsity 0 every key is attended to, so the answer does not depend on how the keys were clustered
    own, reference = pair.session(pair.split, split), pair.session(pair.single, single)
    for method in ("full", "squeeze"):
        torch.testing.assert_close(own.logits(QUESTION, method, 0.0), reference.logits(QUESTION, method, 0.0), **TOL)


@pytest.mark.parametrize("method,sparsity", CASES)
def test_logits_match_one_gpu(pair, method, sparsity):
    """The question's prompt over the same context (the one-GPU ingest): every position's logits, the last one being
    the answer's first step."""
    split = pair.session(pair.split, pair.single_artifacts)
    single = pair.session(pair.single, pair.single_artifacts)
    assert split.backend.name == single.backend.name == "triton"
    got, expected = split.logits(QUESTION, method, sparsity), single.logits(QUESTION, method, sparsity)
    assert got.device == expected.device == CUDA0
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("method,sparsity", CASES)
def test_decode_steps_match_one_gpu(pair, method, sparsity):
    """The one-GPU model's greedy answer fed to both: the prefill and each decode step (the Lq == 1 kernels) agree."""
    split = pair.session(pair.split, pair.single_artifacts)
    single = pair.session(pair.single, pair.single_artifacts)
    prompt = question_ids(pair.single.tokenizer, QUESTION)
    answer = list(generate_tokens(pair.single, single.step_context(method, sparsity, None), prompt, NEW_TOKENS))
    single.cache.reset_dynamic()
    expected = forced_step_logits(single, method, sparsity, prompt, answer)
    assert expected[: len(answer)].argmax(dim=-1).tolist() == answer  # the forced steps are generate_tokens' steps
    torch.testing.assert_close(forced_step_logits(split, method, sparsity, prompt, answer), expected, **TOL)
