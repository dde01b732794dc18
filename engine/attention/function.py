"""The attention function registered with transformers: fixed context (sparse or dense) + new tokens, merged.

Registered under ATTN_NAME through `AttentionInterface` (with a mask function that builds nothing: positions are
enough to mask here). The per-call state arrives as the `squeeze_step` keyword, which transformers forwards
from the model's forward call to every attention layer.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from engine.attention.cache import FixedContextCache, FixedContextLayer
from engine.attention.follow import Follow, layout_order
from engine.attention.later import LaterLookups
from engine.attention.method import Lookup, Method, StepPlan
from engine.attention.one_launch import SyncedLookups
from engine.attention.stats import TurnRecorder
from kernels.backend import TRITON, Backend
from kernels.reference.union import UnionCall
from kernels.selection import FollowRows, StepTally
from kernels.tables import Keep

ATTN_NAME = "squeeze"
# A question's prompt of more tokens is prefilled this many a call: the longest prefill a GPU replays from a CUDA graph
# (engine.model.generate.PREFILL_LENGTHS), and a joining turn's longest hold on the turns answered with it.
PREFILL_CHUNK = 1024


@dataclass
class QueryCapture:
    """Keeps the queries of positions >= `start` at global layers (the calibration queries of an ingest) and, when
    `moments` is a dict, the sums of every query's unit outer product per global layer and query head (the second
    moment a query-aware clustering weighs keys by: engine.index.kmeans.query_metric)."""

    start: int
    queries: dict[int, list[torch.Tensor]]  # layer -> chunks of [Hq, n, D]
    moments: dict[int, torch.Tensor] | None = None  # layer -> [Hq, D, D] float32 sums over every position seen
    seen: dict[int, int] = field(default_factory=dict)  # layer -> positions summed into its moments

    def take(self, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor) -> None:
        keep = q_pos >= self.start
        if bool(keep.any()):
            self.queries.setdefault(layer_idx, []).append(q[:, keep].detach().clone())
        if self.moments is not None:
            qn = torch.nn.functional.normalize(q.detach().float(), dim=-1)  # [Hq, n, D]
            outer = qn.transpose(1, 2) @ qn  # [Hq, D, D]
            self.moments[layer_idx] = self.moments[layer_idx] + outer if layer_idx in self.moments else outer
            self.seen[layer_idx] = self.seen.get(layer_idx, 0) + q.shape[1]

    def moment(self, layer_idx: int, kv_heads: int) -> torch.Tensor:
        """A layer's second moment of the unit queries, per KV head (the mean over its group's query heads and every
        position seen): [Hkv, D, D] float32."""
        if self.moments is None or layer_idx not in self.moments:
            raise KeyError(f"no query moments kept for layer {layer_idx}")
        m = self.moments[layer_idx] / self.seen[layer_idx]  # [Hq, D, D]
        return m.reshape(kv_heads, m.shape[0] // kv_heads, *m.shape[1:]).mean(dim=1)


@dataclass
class StepContext:
    """Everything one forward call over new tokens needs; passed to the model as `squeeze_step=`.

    positions: [Lq] int64 on the model's device, the call's query positions (the position_ids the model gets);
        set by the caller before each call (a captured step reads them from this same buffer at every replay)
    static: the call is being captured in a CUDA graph: attend over every new-token slot, masked by position
    graphs: where greedy generation finds (or captures) its decode step; None runs every step eagerly
    follow: the context's follow rows (engine.attention.follow), added to every sparse selection; None: none. The
    caller of a forward call runs `follow.begin(ids)` before it (engine.model.generate, engine.model.graph)
    valid: [1] int64 on the model's device, how many of the call's tokens are real (the first ones: a question
        padded to a captured length, engine.model.graph.PrefillGraph); each pooled lookup counts those only; None:
        every token
    prefill_chunk: a question's prompt of more tokens is prefilled this many a call (engine.model.generate
        .QuestionPrefill: a joining turn then holds the others up one call at a time)
    token_lookups: a call over several tokens (a question's prefill) looks up each token's keys on its own, as a
        decode step does (each at the decode plan), instead of one lookup whose selection all its tokens share (the
        Squeezed Attention paper's prefill: S averaged over the tokens); engine/bench/README.md, "One lookup per
        question token"
    """

    cache: FixedContextCache
    method: Method | None  # None: every key of the fixed context, no index (an ingest's prefill)
    plan: StepPlan | None
    backend: Backend
    recorder: TurnRecorder | None = None
    capture: QueryCapture | None = None
    positions: torch.Tensor | None = None
    static: bool = False
    graphs: object | None = None  # engine.model.graph.StepGraphs: prefills and decode steps replayed from CUDA graphs
    follow: Follow | None = None
    token_lookups: bool = False
    valid: torch.Tensor | None = None
    prefill_chunk: int = PREFILL_CHUNK


@dataclass
class BatchStep:
    """One forward call over one token of each of several sequences (a batched decode step): steps[b] is sequence
    b's StepContext, with its own cache (engine.attention.cache.BatchCache holds them for the call), method, plan,
    recorder, follow rows and position. Each sequence's attention is the one a call of its own would compute.

    streams: with none the sequences attend one after another; given B - 1 CUDA streams, sequence 0 attends on the
    current stream and sequence b on streams[b - 1], all at once, forked from the current stream and joined back
    into it at each layer (a CUDA graph captures them as parallel branches). A layer's lookups and attention of one
    decode token are short, latency-bound launches that leave most of a GPU idle; several sequences' fill it.
    split_gpu: with streams, each sequence's union kernels are planned for its 1 / B share of the GPU's workers (items
    B times longer), so that the B launches at a layer fill the GPU once together, rather than each planned for all
    of it and queued behind the others.
    shared: at a global layer, the sequences' attentions over what their lookups selected go to the union kernels
    together, after every lookup (the backend's union_attention_batch: on a GPU one split and one merge launch for
    those of one kind, each sequence's tensors read from a table); else each right after its own lookup. The lookups
    of methods that allow it (Method.batched_lookup) are planned and then launched together as well
    (engine.attention.later: one launch of each lookup kernel for those of one kind).
    keep: where such a launch leaves the host copies of its tables, to live as long as a CUDA graph that captured
    their upload (engine.model.batch_graph); None: an eager step's, freed once copied."""

    steps: list[StepContext]
    streams: list = field(default_factory=list)  # [B - 1] torch.cuda.Stream on the sequences' device, or none
    split_gpu: bool = False
    shared: bool = False
    keep: Keep = None


@dataclass
class _Pending:
    """A sequence's attention at a global layer whose lookup ran, or was planned (engine.attention.later), and
    whose union kernels wait for the batch's (BatchStep.shared)."""

    step: StepContext
    layer: FixedContextLayer
    lookup: Lookup
    q: torch.Tensor  # [Hq, Lq, D]
    q_pos: torch.Tensor  # [Lq]
    scale: float
    k_new: torch.Tensor  # [Hkv, n, D]
    v_new: torch.Tensor
    out: torch.Tensor  # [Hq, Lq, D]
    rows: FollowRows | None

    def call(self, tally: StepTally | None) -> UnionCall:
        """Its union_attention arguments, the step's statistics added by the union's merge (tally)."""
        layer, selection = self.layer, self.lookup.selection
        return UnionCall(self.q, layer.fixed_keys, layer.fixed_values, selection, self.scale, self.k_new, self.v_new,
                         self.q_pos, layer.fixed_len, self.rows if selection is not None else None, self.out, tally)


def _fixed_part(layer: FixedContextLayer, q: torch.Tensor, q_pos: torch.Tensor, scale: float, step: StepContext):
    """Attention of q over the layer's fixed context where no method's lookup runs: a sliding layer's last window
    (dense, masked by distance), an ingest's prefill (every key). Returns (out [Hq, Lq, D], lse [Hq, Lq]) float32."""
    kf, vf = layer.fixed_keys, layer.fixed_values
    if layer.sliding_window is not None:
        k_start = layer.fixed_len - kf.shape[1]
        return step.backend.kernel("causal").causal_attention(q, kf, vf, scale, q_pos, k_start, layer.sliding_window)
    return step.backend.kernel("sparse").attention_with_lse(q, kf, vf, scale)


def _looked_up(layer: FixedContextLayer, q: torch.Tensor, q_pos: torch.Tensor, scale: float, step: StepContext,
               k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor,
               later: dict[str, LaterLookups] | None = None, share: int = 1) -> _Pending | None:
    """A global layer's attention with a method: one lookup for the call's tokens (or, with
    StepContext.token_lookups, one per token of a prefill), then the union kernel, written into out [Hq, Lq, D];
    given `later` (a batched step's: a backend's name -> its LaterLookups), a single lookup's union kernels are left
    to the caller (returned), and a Method.batched_lookup's lookup kernels are planned into later's too."""
    method, lq = step.method, q.shape[1]
    index = layer.indexes.get(method.name)
    if index is None and method.sparse:
        raise RuntimeError(f"layer {layer.layer_idx} has no {method.name} index: build the method for this context")
    if not (step.token_lookups and method.sparse and lq > 1):
        return _union(layer, index, q, q_pos, scale, step, k_new, v_new, out, later, share)
    if step.recorder is not None:
        step.recorder.lookups_per_step(lq)
    for t in range(lq):
        _union(layer, index, q[:, t : t + 1], q_pos[t : t + 1], scale, step, k_new, v_new, out[:, t : t + 1])


def _union(layer: FixedContextLayer, index, q: torch.Tensor, q_pos: torch.Tensor, scale: float, step: StepContext,
           k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor,
           later: dict[str, LaterLookups] | None = None, share: int = 1) -> _Pending | None:
    """One lookup for q's Lq tokens, then their attention over the union of the keys it selected, the follow rows
    and the new tokens their positions see (kernels/union_ops.py), written into out [Hq, Lq, D]; given `later` the
    attention is returned, to run with the batch's (_union_together), and a Method.batched_lookup's lookup is
    planned there as well (engine.attention.later); share: union_attention's (the sequences attending at once)."""
    method, recorder = step.method, step.recorder
    timed = recorder.timed if recorder is not None else (lambda kind: nullcontext())
    follow, rows = step.follow, None
    if method.sparse and follow is not None and follow.positions.numel():
        rows = FollowRows(follow.positions.to(q.device), follow.fixed_rows.sink, follow.fixed_rows.indexed,
                          layout_order(method, index))
    backend = step.backend
    if later is not None and method.batched_lookup:
        backend = later.setdefault(backend.name, LaterLookups(backend.name))
    elif layer.lookup_sync is not None and q.shape[1] == 1 and backend.name == TRITON.name:  # a decode lookup's
        # passes in one launch (the reference has none to save)
        backend = SyncedLookups.over(backend, layer.lookup_sync)
    with timed("lookup"):
        lookup = method.lookup(q, index, step.plan, scale, backend, q_pos, step.valid, rows)
    pending = _Pending(step, layer, lookup, q, q_pos, scale, k_new, v_new, out, rows)
    if later is not None:
        return pending
    tally = recorder.tally(layer.layer_idx, lookup) if recorder is not None else None
    with timed("attention"):
        _, _, fresh = step.backend.kernel("union").union_attention(*pending.call(tally).args(), share=share)
    if recorder is not None:
        recorder.record(layer.layer_idx, lookup, step.backend, fresh, tallied=tally)
    return None


def _union_together(pending: list[_Pending], later: dict[str, LaterLookups], keep: Keep) -> None:
    """The batch's planned lookups, then its deferred attentions at one layer through their backends'
    union_attention_batch, each sequence's statistics recorded after. (A recorder's tally may read a lookup's
    scores: it is taken once the lookups ran.)"""
    for lookups in later.values():
        lookups.run(keep)
    backends: dict[int, list[_Pending]] = {}
    for p in pending:
        backends.setdefault(id(p.step.backend), []).append(p)
    for group in backends.values():
        tallies = [p.step.recorder.tally(p.layer.layer_idx, p.lookup) if p.step.recorder is not None else None
                   for p in group]
        calls = [p.call(tally) for p, tally in zip(group, tallies)]
        fresh = group[0].step.backend.kernel("union").union_attention_batch(calls, keep)
        for p, tally, rows in zip(group, tallies, fresh):
            if p.step.recorder is not None:
                p.step.recorder.record(p.layer.layer_idx, p.lookup, p.step.backend, rows, tallied=tally)


@torch.compiler.disable  # opaque to torch.compile'd decoder layers (engine.model.compiled): host logic, our own kernels
def squeeze_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    squeeze_step: StepContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [B, Hq, Lq, D] (the call's tokens; their K/V are already in the layers' new-token buffers): B = 1 with
    a StepContext, or one row per sequence of a BatchStep.

    Returns (out [B, Lq, Hq, D] in the query's dtype, None).
    """
    if squeeze_step is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_NAME!r} needs a squeeze_step=StepContext(...) keyword in the model call; "
            "use engine.context.session.Session to run the model"
        )
    if softcap is not None or getattr(module, "attn_logit_softcapping", None):
        raise NotImplementedError("attention logit soft-capping (e.g. Gemma 2) is not supported by the engine")
    steps = squeeze_step.steps if isinstance(squeeze_step, BatchStep) else [squeeze_step]
    if query.shape[0] != len(steps):
        raise ValueError(f"a call over {len(steps)} sequence(s) got a batch of {query.shape[0]}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    batch, hq, lq, d = query.shape
    out = torch.empty(batch, lq, hq, d, device=query.device, dtype=query.dtype)
    together = isinstance(squeeze_step, BatchStep) and batch > 1
    streams = squeeze_step.streams[: batch - 1] if together else []
    if len(streams) < batch - 1 or (streams and streams[0].device != query.device):  # (a layer on another GPU than
        streams = []  # the streams': device_map="auto")
    later = {} if together and squeeze_step.shared else None  # a backend's name -> its planned lookups
    share = len(streams) + 1 if streams and squeeze_step.split_gpu else 1  # sequences attending at once
    main = torch.cuda.current_stream(query.device) if streams else None
    for stream in streams:
        stream.wait_stream(main)  # the new tokens' K/V are in, the queries written
    pending = []
    for b, step in enumerate(steps):
        with torch.cuda.stream(streams[b - 1]) if streams and b else nullcontext():
            pending.append(_attend(module, query[b], scale, step, out[b], later, share))
    for stream in streams:
        main.wait_stream(stream)
    pending = [p for p in pending if p is not None]
    if pending:
        _union_together(pending, later, squeeze_step.keep)
    return out, None


def _attend(module: torch.nn.Module, q: torch.Tensor, scale: float, step: StepContext, out: torch.Tensor,
            later: dict[str, LaterLookups] | None = None, share: int = 1) -> _Pending | None:
    """One sequence's attention at `module`'s layer, q [Hq, Lq, D], written into out [Lq, Hq, D] (q's dtype); given
    `later` (BatchStep.shared) a global layer's union kernels are returned to run with the batch's (_looked_up);
    share: the sequences attending at once on streams, whose union kernels each plan for their share of the GPU
    (BatchStep.split_gpu)."""
    if step.positions is None:
        raise RuntimeError("StepContext.positions must hold the call's query positions")
    layer: FixedContextLayer = step.cache.layers[module.layer_idx]
    with _current_device(q.device):
        q_pos = step.positions.to(q.device)  # [Lq]; a no-op unless layers sit on several devices
        k_new, v_new = layer.new_kv(step.static)  # [Hkv, n, D], slot i at position fixed_len + i
        if step.capture is not None and layer.sliding_window is None:
            step.capture.take(module.layer_idx, q, q_pos)
        has_fixed = layer.fixed_keys is not None and layer.fixed_keys.shape[1] > 0
        if has_fixed and layer.sliding_window is None and step.method is not None:
            return _looked_up(layer, q, q_pos, scale, step, k_new, v_new, out.transpose(0, 1), later, share)
        else:
            fixed = _fixed_part(layer, q, q_pos, scale, step) if has_fixed else None
            # the new tokens' part, merged with the fixed part's straight into the layout the model reads next
            step.backend.kernel("causal").causal_attention(q, k_new, v_new, scale, q_pos, layer.fixed_len,
                                                           layer.sliding_window, prior=fixed, out=out.transpose(0, 1))
    return None


def _current_device(device: torch.device):
    """Make the layer's GPU the current CUDA device while it attends. Triton launches a kernel on the current device
    and its current stream, not on its tensors' device; with device_map="auto" a layer may sit on another GPU than
    cuda:0 (accelerate moves the tensors but never switches the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _no_mask(*args, **kwargs) -> None:
    """Mask function for ATTN_NAME: the attention function masks by positions, so nothing is materialised."""
    return None


def register() -> str:
    """Register the attention and mask functions (idempotent). Returns the attn_implementation name."""
    AttentionInterface.register(ATTN_NAME, squeeze_attention)
    AttentionMaskInterface.register(ATTN_NAME, _no_mask)
    return ATTN_NAME
