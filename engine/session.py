"""A ready context on the device: the fixed-context cache with its indexes, answering questions turn by turn."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from engine.attention import StepContext
from engine.config import IndexSettings
from engine.fixed_cache import FixedContextCache, FixedContextLayer
from engine.generate import full_logits, greedy_tokens
from engine.graph import DecodeGraphs, graphs_supported
from engine.model import LoadedModel
from engine.policies import get_policy
from engine.prompt import STOP_STRINGS, question_ids
from engine.stats import TurnRecorder, TurnStats
from kernels.backend import Backend
from kernels.layout import ClusterLayout


@dataclass
class Delta:
    """A piece of the answer's text, streamed as it is generated."""

    text: str


@dataclass
class Answer:
    """The whole answer and what attention did while producing it."""

    text: str
    stats: TurnStats


class ContextSession:
    """Answers questions over one fixed context. Built from a context's artifacts (see engine.ingest)."""

    def __init__(self, lm: LoadedModel, artifacts: dict[str, torch.Tensor], settings: IndexSettings, backend: Backend,
                 graphs: bool = True):
        """artifacts: a context's tensors by name (engine.ingest). The fixed K/V are taken out of the dict (popped)
        layer by layer as they move into the session's cache, so that the session holds the only copy of the
        fixed context on the device (an ingest's K/V are reused in place where they sit on the right device).
        graphs: replay decode steps from CUDA graphs where the model allows (engine.graph); False: every step
        eager (benchmarks compare the two)."""
        self.lm, self.backend = lm, backend
        self.tokens = artifacts["tokens"]
        self.fixed_len = int(self.tokens.numel())
        self.settings = replace(settings, dense_tail=min(settings.dense_tail, self.fixed_len - 1))
        self.calibration = {k: v for k, v in artifacts.items() if k.startswith("calib.")}
        layers = []
        for i, window in enumerate(lm.sliding_windows):
            dev = lm.layer_devices[i]
            prefix = f"layer{i}."
            index = {k[len(prefix):]: v.to(dev) for k, v in artifacts.items()
                     if k.startswith(prefix) and k not in (prefix + "keys", prefix + "values", prefix + "calib_queries")}
            keys = artifacts.pop(prefix + "keys").to(dev, lm.dtype)
            values = artifacts.pop(prefix + "values").to(dev, lm.dtype)
            if "labels" in index:  # the fixed context as an inverted file: each cluster's keys contiguous
                layout = ClusterLayout.from_labels(index["labels"], index["counts"].shape[1], keys.shape[1] - index["labels"].shape[1])
                keys = layout.permute(keys)  # positions as index["key_starts"] says; the original order is dropped
                values = layout.permute(values)
            layers.append(FixedContextLayer(fixed_keys=keys, fixed_values=values, fixed_len=self.fixed_len,
                                            sliding_window=window, index=index))
        self.cache = FixedContextCache(layers)
        self.graphs = DecodeGraphs(lm) if graphs and backend.name == "triton" and graphs_supported(lm) else None

    def thresholds(self, method: str, sparsity: float) -> tuple[float, ...]:
        policy = get_policy(method)
        calib = {k.split(".", 2)[2]: v for k, v in self.calibration.items() if k.startswith(f"calib.{method}.")}
        return policy.thresholds(calib, sparsity) if policy.sparse else ()

    def step_context(self, method: str, sparsity: float, recorder: TurnRecorder | None = None) -> StepContext:
        return StepContext(cache=self.cache, policy=get_policy(method), thresholds=self.thresholds(method, sparsity),
                           settings=self.settings, backend=self.backend, recorder=recorder, graphs=self.graphs)

    def logits(self, question: str, method: str = "full", sparsity: float = 0.0) -> torch.Tensor:
        """[Lq, V] logits of the question's prompt tokens (tests: the sparse path against full attention)."""
        return full_logits(self.lm, self.step_context(method, sparsity, None), question_ids(self.lm.tokenizer, question))

    def stream(self, question: str, method: str = "squeeze", sparsity: float = 0.9,
               max_new_tokens: int = 64) -> Iterator[Delta | Answer]:
        """Yield Delta pieces of the answer, then one Answer with the turn's statistics."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        lm = self.lm
        on_cuda = lm.device.type == "cuda"
        recorder = TurnRecorder(lm.global_layers, lm.num_heads, lm.num_kv_heads, lm.head_dim, self.fixed_len, sync_cuda=on_cuda)
        step = self.step_context(method, sparsity, recorder)
        prompt = question_ids(lm.tokenizer, question)
        eos = lm.eos_ids()
        generated: list[int] = []
        text = ""
        start = time.perf_counter()
        first = None
        tokens = greedy_tokens(lm, step, prompt, max_new_tokens)
        for token in tokens:
            first = first if first is not None else time.perf_counter() - start
            if token in eos:
                break
            generated.append(token)
            new_text = lm.tokenizer.decode(generated, skip_special_tokens=True)
            stop = min((new_text.find(s) for s in STOP_STRINGS if s in new_text), default=-1)
            if stop >= 0:
                new_text = new_text[:stop]
            if new_text.startswith(text) and len(new_text) > len(text):
                yield Delta(new_text[len(text):])
            text = new_text
            if stop >= 0:
                break
        tokens.close()  # hands the replayed steps' statistics to the recorder
        self.cache.reset_dynamic()
        total = time.perf_counter() - start
        decode_s = max(total - (first or 0.0), 1e-9)
        timings = {
            "first_token_s": round(first or 0.0, 6),
            "total_s": round(total, 6),
            "tokens_per_s": round((len(generated) - 1) / decode_s, 3) if len(generated) > 1 else 0.0,
        }
        stats = recorder.finish(method, sparsity if get_policy(method).sparse else 0.0, len(generated), timings)
        yield Answer(text=text.strip(), stats=stats)

    def ask(self, question: str, method: str = "squeeze", sparsity: float = 0.9, max_new_tokens: int = 64) -> Answer:
        """The whole answer at once."""
        for event in self.stream(question, method, sparsity, max_new_tokens):
            if isinstance(event, Answer):
                return event
        raise AssertionError("stream ended without an answer")
