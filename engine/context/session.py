"""A ready context on the device: the fixed-context cache with its methods' indexes, answering questions turn by
turn."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.attention.cache import FixedContextCache, FixedContextLayer
from engine.attention.follow import Follow, FollowSettings
from engine.attention.function import StepContext
from engine.attention.stats import TurnRecorder
from engine.context.ingest import build_methods
from engine.context.plan import follows, turn_plan
from engine.context.settings import ContextSettings
from engine.context.turn import Answer, Delta, Turn, check_answer_tokens
from engine.index import artifacts as names
from engine.methods import REGISTRY, LayerIndex, Method, StepPlan, Tensors, build_order, make_method
from engine.model.catalog import DEFAULT_METHOD, DEFAULT_SPARSITY
from engine.model.generate import full_logits, generate_tokens
from engine.model.graph import StepGraphs, graphs_supported
from engine.model.load import LoadedModel
from engine.model.prefill import Progress, global_scale, no_progress
from engine.model.sampling import GenerationOptions
from engine.text.prompt import HISTORY_TOKENS, Exchange, prompt_format, turn_ids
from kernels.backend import Backend


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

    def layout_key(self, method: str) -> str | None:
        """The order of the fixed K/V that `method`'s turns read: its name where it keeps them in an order of its
        own (Method.layout), None where it reads them as stored. Turns of one key can be under way together."""
        m = self.method(method)
        return m.name if type(m).layout is not Method.layout else None

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

    def turn(self, question: str, method: str = DEFAULT_METHOD, sparsity: float = DEFAULT_SPARSITY,
             max_new_tokens: int = 64, history: Sequence[Exchange] = (), options: GenerationOptions | None = None,
             history_tokens: int = HISTORY_TOKENS, until: Callable[[str], bool] | None = None,
             fork: bool = False) -> Turn:
        """A turn over this context (engine.context.turn; the arguments: stream's). fork: the turn reads a fork of
        the session's cache and follow rows, so that it may be under way beside another turn over the context (in
        the same layout: the method's), and steps eagerly (the session's captured steps read its own cache)."""
        check_answer_tokens(self.lm, self.fixed_len, max_new_tokens)  # (before the step context: it may put the
        # K/V in the method's layout)
        step = self.step_context(method, sparsity, self.recorder())
        if fork:
            step.cache = step.cache.fork()
            step.follow = step.follow.fork() if step.follow is not None else None
            step.graphs = None
        return Turn(self.lm, self.fixed_len, step, question, max_new_tokens, history, options, history_tokens, until)

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
        yield from self.run(self.turn(question, method, sparsity, max_new_tokens, history, options, history_tokens,
                                      until))

    def run(self, turn: Turn, stop: threading.Event | None = None) -> Iterator[Delta | Answer]:
        """A turn of this session's (`turn`) answered alone: its pieces, then its Answer (stream's events). On a GPU
        its decode steps are replayed from CUDA graphs. stop: once set, no more tokens are taken (the Answer then
        holds what was said)."""
        tokens = generate_tokens(self.lm, turn.step, turn.prompt, turn.max_new_tokens, turn.sampler)
        for token in tokens:
            piece = turn.feed(token)
            if piece is not None:
                yield piece
            if turn.done or (stop is not None and stop.is_set()):
                break
        tokens.close()  # hands the replayed steps' statistics to the recorder
        piece, answer = turn.finish()
        if piece is not None:
            yield piece
        yield answer

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
