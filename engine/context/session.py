"""A ready context on the device: the fixed-context cache with its methods' indexes, answering questions turn by
turn."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.cache import FixedContextCache, FixedContextLayer
from engine.attention.follow import Follow, FollowSettings
from engine.attention.function import StepContext
from engine.attention.stats import TurnRecorder, TurnStats
from engine.context.ingest import build_methods
from engine.context.plan import follows, turn_plan
from engine.context.settings import ContextSettings
from engine.index import artifacts as names
from engine.methods import REGISTRY, LayerIndex, Method, StepPlan, Tensors, build_order, make_method
from engine.model.catalog import DEFAULT_METHOD, DEFAULT_SPARSITY
from engine.model.generate import full_logits, generate_tokens
from engine.model.graph import StepGraphs, graphs_supported
from engine.model.load import LoadedModel
from engine.model.prefill import Progress, global_scale, no_progress
from engine.model.sampling import GenerationOptions, Sampler
from engine.text.prompt import HISTORY_TOKENS, Exchange, answer_held_back, cut_answer, prompt_format, turn_ids
from kernels.backend import Backend


@dataclass
class Delta:
    """A piece of the answer's text, streamed as it is generated."""

    text: str


@dataclass
class Answer:
    """The whole answer and what attention did while producing it.

    plan: the plan the turn's lookups used; unit_scores: what they scored (engine.attention.stats.TurnRecorder.unit_scores:
    the explanations' input, tensors that are not part of the saved statistics)
    """

    text: str
    stats: TurnStats
    plan: StepPlan | None = None
    unit_scores: dict = field(default_factory=dict)
    history: int = 0  # earlier exchanges of the chat in the turn's input
    follow: list[int] = field(default_factory=list)  # document tokens the turn read as follow rows (engine.attention.follow)
    tokens: list[int] = field(default_factory=list)  # the answer's token ids (through the one that ends a stop string)

    @property
    def empty(self) -> bool:
        """The model said nothing (it ended at once, or only with blank lines)."""
        return not self.text.strip()


class ContextSession:
    """Answers questions over one fixed context with any method built for it. Built from a context's artifacts
    (engine.index.artifacts names them; engine.context.ingest makes them)."""

    def __init__(self, lm: LoadedModel, artifacts: dict[str, torch.Tensor], settings: ContextSettings,
                 backend: Backend, methods: dict[str, Method] | None = None, graphs: bool = True,
                 prepared: dict[str, Tensors] | None = None, follow: FollowSettings | None = None,
                 token_lookups: bool = False):
        """artifacts: a context's tensors by name. The fixed K/V are taken out of the dict (popped) layer by layer
        as they move into the session's cache, so that the session holds the only copy of the fixed context on the
        device (an ingest's K/V are reused in place where they sit on the right device).
        methods: the methods to open, with the settings they were built with, by name (the artifacts of others
            are ignored); None: every method whose artifacts are there, with its default settings. "full" is always
            there.
        graphs: replay decode steps from CUDA graphs where the model allows (engine.model.graph); False: every step
        eager (benchmarks compare the two).
        prepared: method -> its model-level artifacts (Method.prepare; `layer{i}.{name}` join layer i's index).
        follow: the follow rows every sparse step adds (engine.attention.follow; None: the defaults, engine.attention.follow.OFF: none).
        token_lookups: a question's prefill looks up each of its tokens' keys on its own (engine.attention.function.
        StepContext.token_lookups); False: one lookup for the question, the paper's."""
        self.lm, self.backend = lm, backend
        self.token_lookups = token_lookups
        parsed = names.parse(artifacts, tuple(REGISTRY))
        self.tokens = parsed.tokens
        self.fixed_len = int(self.tokens.numel())
        self.settings = settings
        self.rows = settings.rows(self.fixed_len)  # which token each global layer's K/V row holds
        self.tail = self.rows.dense  # the rows every step reads (the sink's and the tail's)
        self.queries = {i: q.cpu() for i, q in parsed.queries.items()}  # calibration queries, to build methods later
        self.moments = {i: m.cpu() for i, m in parsed.moments.items()}  # query moments (a context stored before: none)
        layers = []
        for i, window in enumerate(lm.sliding_windows):
            dev = lm.layer_devices[i]
            keys = artifacts.pop(names.layer_name(i, "keys")).to(dev, lm.dtype)
            values = artifacts.pop(names.layer_name(i, "values")).to(dev, lm.dtype)
            layers.append(FixedContextLayer(fixed_keys=keys, fixed_values=values, fixed_len=self.fixed_len,
                                            sliding_window=window))
        self.cache = FixedContextCache(layers)
        self._arranged_for: str | None = None  # the method whose layout the K/V are in (None: as stored, engine.attention.rows)
        self.methods: dict[str, Method] = {"full": make_method("full")}
        self.calibration: dict[str, dict[str, torch.Tensor]] = {"full": {}}
        for name, part in parsed.methods.items():
            if methods is None or name in methods:
                self.add_method(methods[name] if methods is not None else make_method(name), part,
                                (prepared or {}).get(name))
        follow = FollowSettings() if follow is None else follow
        self.follow_settings = follow
        self.follow = Follow(self.tokens.to(lm.device), self.rows, follow) if follow.on else None
        self.graphs = StepGraphs(lm) if graphs and backend.name == "triton" and graphs_supported(lm) else None

    def add_method(self, method: Method, part: names.MethodArtifacts, prepared: Tensors | None = None) -> None:
        """Make a method's index (per global layer, with its model-level artifacts of the layer) and calibration
        available to the turns."""
        for i, tensors in part.layers.items():
            layer = self.cache.layers[i]
            dev = layer.fixed_keys.device
            tensors = {**names.layer_part(prepared or {}, i), **tensors}
            layer.indexes[method.name] = LayerIndex(tensors={k: t.to(dev) for k, t in tensors.items()},
                                                    num_keys=layer.fixed_keys.shape[1], tail=self.tail)
        self.methods[method.name] = method
        self.calibration[method.name] = dict(part.calibration)

    def build(self, method: Method, progress: Progress | None = None,
              prepared: Tensors | None = None) -> dict[str, torch.Tensor]:
        """Build `method` (and what it requires, when not open) from the session's own K/V, calibration queries and
        query moments, replacing an index of the same method; returns the new artifacts by name (for the store).
        prepared: the method's model-level artifacts (Method.prepare)."""
        self.arrange(None)  # as stored: what a method builds from
        global_layers = [i for i, layer in enumerate(self.cache.layers) if layer.sliding_window is None]
        keys = {i: self.cache.layers[i].fixed_keys for i in global_layers}
        queries = {i: self.queries[i] for i in global_layers}
        made: dict[str, torch.Tensor] = {}
        for name in [*build_order(list(method.requires)), method.name]:  # a method need not be registered
            if name != method.name and name in self.methods:
                continue  # a requirement built before
            m = method if name == method.name else make_method(name)
            have = {r: {i: self.cache.layers[i].indexes[r].tensors for i in global_layers} for r in m.requires
                    if r in self.methods}
            mine = prepared if m is method else None
            built = build_methods(keys, queries, self.tail, [m], global_scale(self.lm), self.lm.device,
                                  progress or no_progress, prepared={name: mine or {}}, required=have,
                                  first=self.rows.sink, moments=self.moments)
            made.update(built)
            self.add_method(m, names.parse(built, (name,)).methods.get(name, names.MethodArtifacts()), mine)
        return made

    def method(self, name: str) -> Method:
        """A built method by name (ValueError for one not built for this context: see `build`)."""
        if name not in self.methods:
            raise ValueError(f"{name} is not built for this context (built: {', '.join(self.methods)})")
        return self.methods[name]

    def plan(self, method: str, sparsity: float) -> StepPlan:
        """The plan of a turn with `method` at `sparsity` (engine.context.plan.turn_plan)."""
        follow = self.follow_settings if self.follow is not None else None  # (None: the session reads none)
        return turn_plan(self.method(method), self.calibration[method], sparsity, follow, self.rows.tokens)

    def follows(self, method: Method) -> bool:
        """Whether `method`'s steps read the follow rows (engine.attention.follow)."""
        return self.follow is not None and follows(method, self.follow_settings)

    def arrange(self, method: Method | None) -> None:
        """Put every global layer's fixed K/V in `method`'s layout (None: as stored, engine.attention.rows), in place: the tensors
        keep their storage, so captured decode steps stay valid. A copy of one layer at a time; the layouts are
        computed again from the methods' indexes rather than kept (an order is 8 bytes per key and head)."""
        current = self.methods.get(self._arranged_for) if self._arranged_for is not None else None
        if (method.name if method is not None else None) == self._arranged_for:
            return
        with torch.inference_mode():  # the K/V are inference tensors (made by an ingest under inference mode)
            for layer in self.cache.layers:
                here, want = _order(current, layer), _order(method, layer)
                if here is None and want is None:
                    continue
                hkv, n = layer.fixed_keys.shape[:2]
                identity = torch.arange(n, device=layer.fixed_keys.device).expand(hkv, n)
                here = identity if here is None else here
                want = identity if want is None else want
                where = torch.empty_like(here).scatter_(1, here, identity.contiguous())  # original -> current row
                src = torch.gather(where, 1, want)  # [Hkv, n]: the current row that goes to each row
                for x in (layer.fixed_keys, layer.fixed_values):
                    x.copy_(torch.gather(x, 1, src[:, :, None].expand(-1, -1, x.shape[2])))
        self._arranged_for = method.name if method is not None else None

    def recorder(self, sync_cuda: bool | None = None) -> TurnRecorder:
        """A turn's statistics collector for this context and model. sync_cuda: time lookup and attention with CUDA
        events (TurnRecorder); None: where the model runs on CUDA."""
        lm = self.lm
        return TurnRecorder(lm.global_layers, lm.num_heads, lm.num_kv_heads, lm.head_dim, self.fixed_len,
                            sync_cuda=lm.device.type == "cuda" if sync_cuda is None else sync_cuda)

    def step_context(self, method: str, sparsity: float, recorder: TurnRecorder | None = None) -> StepContext:
        m = self.method(method)
        self.arrange(m)
        return StepContext(cache=self.cache, method=m, plan=self.plan(method, sparsity), backend=self.backend,
                           recorder=recorder, graphs=self.graphs, follow=self.follow if self.follows(m) else None,
                           token_lookups=self.token_lookups)

    def logits(self, question: str, method: str = "full", sparsity: float = 0.0) -> torch.Tensor:
        """[Lq, V] logits of the question's prompt tokens (tests: the sparse path against full attention)."""
        prompt = turn_ids(self.lm.tokenizer, prompt_format(self.lm.tokenizer), question).ids
        return full_logits(self.lm, self.step_context(method, sparsity, None), prompt)

    def stream(self, question: str, method: str = DEFAULT_METHOD, sparsity: float = DEFAULT_SPARSITY,
               max_new_tokens: int = 64,
               history: Sequence[Exchange] = (), options: GenerationOptions | None = None,
               history_tokens: int = HISTORY_TOKENS, until: Callable[[str], bool] | None = None,
               ) -> Iterator[Delta | Answer]:
        """Yield Delta pieces of the answer, then one Answer with the turn's statistics.

        history: the chat's earlier exchanges, oldest first (the latest that fit `history_tokens` and the model's
        context go into the input, after the document: new tokens, read densely); options: how tokens are chosen
        (None: greedy). The answer's stop strings count from its first non-blank character (engine.text.prompt.cut_at_stop):
        an answer that opens with blank lines goes on; it also ends at a line that is only a page number after a
        finished sentence (engine.text.prompt.cut_answer); a piece that could begin a stop string or such a line is
        held back until the next tokens tell (engine.text.prompt.answer_held_back), so a stream never shows either.
        until: the answer also ends once until(its text so far) holds (squeeze eval's needles: the key said)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        lm = self.lm
        most = lm.max_context - self.fixed_len - 1  # the question needs a token at least
        if max_new_tokens > most:
            raise ValueError(f"an answer of {max_new_tokens} tokens does not fit: the model's context holds "
                             f"{lm.max_context} tokens and the document takes {self.fixed_len}; ask for at most "
                             f"{max(most, 0)} (less a long question's tokens)")
        fmt = prompt_format(lm.tokenizer)
        turn = turn_ids(lm.tokenizer, fmt, question, history, history_tokens,
                        room=lm.max_context - self.fixed_len - max_new_tokens)
        recorder = self.recorder()
        step = self.step_context(method, sparsity, recorder)
        opts = options or GenerationOptions()
        sampler = None if opts.greedy else Sampler(opts, lm.model.config.vocab_size, lm.device)
        eos = lm.eos_ids()
        generated: list[int] = []
        ended = False  # by an end-of-sequence token: the step after the last answer token ran too
        text = ""
        start = time.perf_counter()
        first = None
        tokens = generate_tokens(lm, step, turn.ids, max_new_tokens, sampler)
        shown = ""  # what the pieces have said (a possible stop string's start is held back)
        for token in tokens:
            first = first if first is not None else time.perf_counter() - start
            if token in eos:
                ended = True
                break
            generated.append(token)
            text, stopped = cut_answer(lm.tokenizer.decode(generated, skip_special_tokens=True), fmt.stop_strings)
            visible = text if stopped else text[:len(text) - answer_held_back(text, fmt.stop_strings)]
            visible = visible.rstrip("\ufffd")  # (a character whose bytes are not all there yet decodes as U+FFFD)
            if visible.startswith(shown) and len(visible) > len(shown):
                yield Delta(visible[len(shown):])
                shown = visible
            if stopped or (until is not None and until(text)):
                break
        tokens.close()  # hands the replayed steps' statistics to the recorder
        text = cut_answer(text, fmt.stop_strings, final=True)[0]  # (its last line is a whole one now)
        if text.startswith(shown) and len(text) > len(shown):  # the end held back: no stop string after all
            yield Delta(text[len(shown):])
        self.cache.reset_dynamic()
        total = time.perf_counter() - start
        decode_s = max(total - (first or 0.0), 1e-9)
        timings = {
            "first_token_s": round(first or 0.0, 6),
            "total_s": round(total, 6),
            "tokens_per_s": round((len(generated) - 1) / decode_s, 3) if len(generated) > 1 else 0.0,
        }
        stats = recorder.finish(method, round(1.0 - step.plan.budget, 6), len(generated), timings)  # the plan's
        stats.extra.update(unit=step.method.unit, plan=step.plan.describe(), history=turn.history,
                           generation=opts.to_json())
        follow = []
        if step.follow is not None:  # the decode steps' inputs: every answer token but the last, unless eos came
            inputs = generated if ended else generated[:-1]
            follow = step.follow.turn_positions(turn.ids, torch.tensor(inputs, dtype=torch.int64))
        yield Answer(text=text.strip(), stats=stats, plan=step.plan, unit_scores=recorder.unit_scores(),
                     history=turn.history, follow=follow, tokens=generated)

    def ask(self, question: str, method: str = DEFAULT_METHOD, sparsity: float = DEFAULT_SPARSITY,
            max_new_tokens: int = 64,
            history: Sequence[Exchange] = (), options: GenerationOptions | None = None,
            until: Callable[[str], bool] | None = None) -> Answer:
        """The whole answer at once (until: stream's)."""
        for event in self.stream(question, method, sparsity, max_new_tokens, history, options, until=until):
            if isinstance(event, Answer):
                return event
        raise AssertionError("stream ended without an answer")


def _order(method: Method | None, layer: FixedContextLayer) -> torch.Tensor | None:
    """[Hkv, L] the original position of each row of the layer's K/V in `method`'s layout, or None (original
    order: no method, a layer without its index, or a method that reads positions)."""
    index = layer.indexes.get(method.name) if method is not None else None
    layout = method.layout(index) if index is not None else None
    return layout.order if layout is not None else None
