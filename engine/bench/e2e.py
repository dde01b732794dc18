"""End-to-end benchmark: ingest, question prefill and decode through the engine's own API, beside plain transformers.

    python -m engine.bench.e2e [--shape llama3-8b | --model M] [--context 131072] [--methods full,squeeze,hsqueeze]
                               [--sparsity 0.9] [--steps 32] [--questions 64,1024] [--peer/--no-peer] [--out FILE]
                               [--gpus 1] [--graphs/--no-graphs] [--compile [both]] [--profile FILE]

A random-weight model of a named shape (SHAPES; bf16 on CUDA, fp32 on the CPU, seed 0) or a real one (`--model`)
reads `--context` random token ids (or `--document`, tokenized with the model's tokenizer) through
`engine.context.ingest.ingest_tokens`, timed by stage after an untimed ingest of its first WARMUP_CONTEXT tokens (Triton
compiles and tunes there); `engine.context.session.ContextSession` opens the context; then each method answers turns
through `engine.model.generate.generate_tokens` with the product's TurnRecorder on: short turns per question length (the
prefill's median) and one turn of `--steps` decode steps after the first length (the median step, the first
WARMUP_STEPS left out). In the same run:
- the peer (CUDA only): plain transformers with SDPA on the engine model's own tensors (shared, not copied), a
  StaticCache, chunked prefill of the same ids, then greedy decode eager and under torch.compile(mode=
  "reduce-overhead");
- the byte bound of a decode step: the bytes it must read (the weights, the global layers' fixed-context K/V times
  the decode steps' KV budget, the sliding layers' windows, the turn's new K/V) over the measured copy bandwidth;
- ratios against the engine's `full` and the peer's best decode, and of the ingest against the peer's prefill.
Weights are random: the figures are about time, not answers; so are what a method learns per model (duo's gates are
its stand-ins, Method.stand_in: settings.stand_in lists those methods). Progress goes to stderr; ends with one JSON line on
stdout. The exit status is 1 when a phase failed (its "error" is in the JSON).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import inspect
import json
import statistics
import sys
import time
from dataclasses import fields

import torch

from engine.attention.follow import OFF, FollowSettings
from engine.attention.stats import TurnStats
from engine.bench.settings import parse_settings
from engine.context.ingest import IngestOutput, ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.methods import METHODS, REGISTRY, Method, Tensors, build_order, make_method, stand_ins
from engine.model.compiled import compile_layers
from engine.model.generate import generate_tokens
from engine.model.load import LoadedModel, layer_devices, load_model
from kernels.backend import Backend
from kernels.dispatch import backend_for

GiB = 1 << 30
MiB = 1 << 20
SEED = 0
WARMUP_STEPS = 2  # decode steps of a turn left out of its timings (the first launches compile and warm up)
PREFILL_TURNS = 3  # timed turns per question length (after an untimed one); their prefills' median is reported
WARMUP_CONTEXT = 2048  # tokens of an untimed ingest before the timed one: Triton compiles and tunes the kernels there
PEER_WARMUP_STEPS = 3  # peer decode steps left out: torch.compile traces at the first, records CUDA graphs after
PEER_CACHE_MARGIN = 8  # spare StaticCache positions
# Where a compiled decode step has a shape that changes every step (Gemma 3's sliding layers in a StaticCache), a
# CUDA graph would be recorded at every step and never replayed: such graphs run compiled without CUDA graphs.
CUDAGRAPH_OPTIONS = {"triton.cudagraph_skip_dynamic_graphs": True}
CPU_COPY_BYTES = 64 * MiB  # the CPU's copy bandwidth is timed on smaller buffers than the GPU's 1 GiB
COPY_REPEATS = 5


def _gemma3_layer_types(layers: int, every: int = 6) -> list[str]:
    """Gemma 3's pattern: every `every`-th layer attends globally, the others to a sliding window."""
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


# Random-weight shapes: transformers model_type + config fields. Positions reach 1M (the benchmark's contexts may
# exceed a released model's window; random weights do not care) and no token is special.
SHAPES: dict[str, dict] = {
    "llama3-8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      rope_theta=500000.0, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064,
                       rope_theta=1e6, tie_word_embeddings=False),
    "gemma3-270m": dict(model_type="gemma3_text", num_hidden_layers=18, hidden_size=640, intermediate_size=2048,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                        sliding_window=512, layer_types=_gemma3_layer_types(18), query_pre_attn_scalar=256,
                        rope_theta=1e6, tie_word_embeddings=True),
    "tiny": dict(model_type="llama", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1024, rope_theta=500000.0,
                 tie_word_embeddings=False),
}
_SHAPE_COMMON = dict(max_position_embeddings=1 << 20, bos_token_id=None, eos_token_id=None, pad_token_id=None)


class BenchModel(LoadedModel):
    """A LoadedModel whose turns never end early: a benchmark times a fixed number of steps, whatever is generated."""

    def eos_ids(self) -> set[int]:
        return set()


def _log(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _sync(device: torch.device) -> None:
    """Wait for the GPUs (all of them: a model split over several runs its layers on each) or nothing on the CPU."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)


def model_gpus(lm: LoadedModel) -> list[torch.device]:
    """The CUDA devices holding the model's embeddings or layers, in index order."""
    devices = {torch.device(d) for d in [lm.device, *lm.layer_devices]}
    return sorted((d for d in devices if d.type == "cuda"), key=lambda d: d.index or 0)


def reset_peaks(lm: LoadedModel) -> None:
    for device in model_gpus(lm):
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(lm: LoadedModel) -> float | None:
    """Peak allocated GPU memory since reset_peaks, summed over the model's GPUs (None on the CPU)."""
    gpus = model_gpus(lm)
    return _gib(sum(torch.cuda.max_memory_allocated(d) for d in gpus)) if gpus else None


def layers_per_device(lm: LoadedModel) -> dict[str, int]:
    out: dict[str, int] = {}
    for device in lm.layer_devices:
        out[str(device)] = out.get(str(device), 0) + 1
    return out


def _gib(n_bytes: float) -> float:
    return round(n_bytes / GiB, 3)


def _median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def even_device_map(model: torch.nn.Module, gpus: int) -> dict[str, int]:
    """accelerate's device_map that runs the decoder layers in `gpus` equal runs, in order, on cuda:0 .. gpus-1:
    the input embeddings (and an output head tied to them) on cuda:0; the decoder's other modules (final norm,
    rotary embedding) and the output head on the last GPU."""
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    layers = len(decoder.layers)
    if not 2 <= gpus <= layers:
        raise ValueError(f"cannot split {layers} decoder layers over {gpus} GPUs")
    last = gpus - 1
    out = {f"{prefix}.layers.{i}": i * gpus // layers for i in range(layers)}
    embedding = model.get_input_embeddings()
    for name, child in decoder.named_children():
        if name != "layers":
            out[f"{prefix}.{name}"] = 0 if child is embedding else last
    parts = prefix.split(".")  # the decoder's siblings along its path (the output head)
    for depth in range(len(parts)):
        parent = ".".join(parts[:depth])
        for name, child in model.get_submodule(parent).named_children():
            full = f"{parent}.{name}" if parent else name
            if full != ".".join(parts[: depth + 1]):
                tied = getattr(child, "weight", None) is embedding.weight
                out[full] = 0 if tied else last
    return out


def spread(model: torch.nn.Module, gpus: int) -> None:
    """Dispatch a model built on cuda:0 over cuda:0 .. cuda:gpus-1 with accelerate's hooks (as `load_model(device=
    "auto")` places a real one, but in equal runs of layers: even_device_map); each layer's inputs move to its GPU."""
    from accelerate import dispatch_model

    dispatch_model(model, even_device_map(model, gpus))


def build_shape(name: str, device: str, gpus: int = 1) -> BenchModel:
    """The random-weight model of SHAPES[name], built on `device` (bf16 on CUDA, fp32 on the CPU), seed SEED,
    with the engine's attention; with gpus > 1 spread over that many GPUs (spread). No tokenizer: its ids are
    random."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.attention.function import register

    fields_ = dict(SHAPES[name])
    cfg = AutoConfig.for_model(fields_.pop("model_type"), **fields_, **_SHAPE_COMMON)
    cfg._attn_implementation = register()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    with torch.device(device if gpus == 1 else "cuda:0"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if gpus > 1:
        spread(model, gpus)
    return BenchModel(model=model, tokenizer=None, model_id=f"random-{name}",
                      device=model.get_input_embeddings().weight.device, dtype=dtype,
                      layer_devices=layer_devices(model))


def open_model(shape: str | None, model: str | None, device: str, gpus: int = 1) -> BenchModel:
    """The named random-weight shape or the real model `model`, on one device or split over `gpus` GPUs."""
    if model is None:
        return build_shape(shape, device, gpus)
    lm = load_model(model, device)
    if gpus > 1:
        spread(lm.model, gpus)
        lm.layer_devices = layer_devices(lm.model)
    return BenchModel(**{f.name: getattr(lm, f.name) for f in fields(lm)})


def training_corpus(lm: LoadedModel, tokens: int) -> list[int]:
    """`tokens` ids of training text: the corpus (engine.text.corpus) through the model's tokenizer, or random ids (seed
    0) for a random-weight shape, which has none (what its training learns means nothing; its time is measured)."""
    if lm.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(2, lm.model.config.vocab_size, (tokens,), generator=g).tolist()
    from engine.text.corpus import corpus_ids

    return corpus_ids(lm.tokenizer, tokens)


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def emit(doc: dict, out: str | None) -> None:
    """A benchmark's JSON document on stdout, and into `out` when given."""
    text = json.dumps(doc)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    print(text, flush=True)


def context_ids(lm: LoadedModel, length: int, document: str | None) -> torch.Tensor:
    """[L] int64: the document's tokens (its first `length` at most) or `length` random ids (seed SEED)."""
    if document is None:
        return torch.randint(0, lm.config.vocab_size, (length,), generator=torch.Generator().manual_seed(SEED))
    from engine.text.prompt import tokenize_document
    from storage.documents import load_document

    ids = tokenize_document(lm.tokenizer, load_document(document).text, lm.max_context, truncate=True).ids
    return ids[:length]


def question_prompts(lm: LoadedModel, lengths: list[int]) -> dict[int, torch.Tensor]:
    """Per question length, [Lq] random ids (seeded: the same prompts for every method)."""
    gen = torch.Generator().manual_seed(SEED + 1)
    return {n: torch.randint(0, lm.config.vocab_size, (n,), generator=gen) for n in lengths}


def copy_bandwidth(device: torch.device) -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second): on CUDA the kernel benchmark's (1 GiB,
    triton's do_bench median); on the CPU the median of COPY_REPEATS copies of CPU_COPY_BYTES."""
    if device.type == "cuda":
        from engine.bench.kernels import copy_bandwidth as cuda_copy_bandwidth

        return cuda_copy_bandwidth(device)
    src = torch.ones(CPU_COPY_BYTES // 2, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    seconds = []
    for _ in range(COPY_REPEATS):
        start = time.perf_counter()
        dst.copy_(src)
        seconds.append(time.perf_counter() - start)
    return 2 * CPU_COPY_BYTES / statistics.median(seconds) / 1e9


class StageClock:
    """The ingest's progress callback: wall seconds per stage (a stage ends where the next begins; the device is
    synchronised at each change so that queued work counts in its own stage), and one line per stage on stderr."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.stage: str | None = None
        self.since = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.close()
            self.stage, self.since = stage, time.perf_counter()
            _log(f"ingest: {stage} ({total})")

    def close(self, sync: bool = True) -> None:
        """End the current stage (sync=False after an error: the device may not answer)."""
        if self.stage is not None:
            if sync:
                _sync(self.device)
            self.seconds[self.stage] = self.seconds.get(self.stage, 0.0) + time.perf_counter() - self.since
            self.stage = None

    def rounded(self) -> dict[str, float]:
        return {stage: round(s, 3) for stage, s in self.seconds.items()}


def run_ingest(lm: LoadedModel, ids: torch.Tensor, settings: ContextSettings, backend: Backend,
               instances: list[Method], prepared: dict[str, Tensors]) -> tuple[IngestOutput | None, dict]:
    """engine.context.ingest.ingest_tokens, timed; the report has the error (an OOM, say) and the peak memory either way."""
    clock = StageClock(lm.device)
    reset_peaks(lm)
    report: dict = {}
    ingest = None
    start = time.perf_counter()
    try:
        ingest = ingest_tokens(lm, ids, settings, backend, instances, clock, prepared=prepared)
        clock.close()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        report["error"] = _error(exc)
        report["failed_stage"] = clock.stage
        clock.close(sync=False)
    report["seconds"] = round(time.perf_counter() - start, 3)
    report["stages"] = clock.rounded()
    report["peak_gib"] = peak_gib(lm)
    return ingest, report


def timed_turn(lm: LoadedModel, session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
               tokens: int) -> tuple[list[float], TurnStats]:
    """One turn of `tokens` greedy tokens with the product's statistics on. Returns the seconds of each forward call
    (the first is the question's prefill, each later one a decode step) and the turn's statistics."""
    recorder = session.recorder(sync_cuda=False)
    step = session.step_context(method, sparsity, recorder)
    times: list[float] = []
    try:
        _sync(lm.device)
        last = time.perf_counter()
        for _ in generate_tokens(lm, step, prompt, tokens):
            _sync(lm.device)
            now = time.perf_counter()
            times.append(now - last)
            last = now
    finally:
        session.cache.reset_dynamic()
    stats = recorder.finish(method, sparsity if step.method.sparse else 0.0, len(times), {})
    return times, stats


def decode_budget(stats: TurnStats) -> float:
    """The KV budget of the turn's decode steps alone (TurnStats.kv_budget averages the prefill in as one step)."""
    if stats.steps < 2:
        return stats.kv_budget
    return (stats.kv_budget * stats.steps - stats.kv_budget_prefill) / (stats.steps - 1)


def measure_method(lm: LoadedModel, session: ContextSession, method: str, sparsity: float,
                   prompts: dict[int, torch.Tensor], steps: int) -> dict:
    """A method's question prefill per length (after an untimed turn, the median of PREFILL_TURNS one-token turns)
    and its decode steps (one turn of steps + 1 tokens after the first length's prompt; the first WARMUP_STEPS left
    out)."""
    out: dict = {"prefill_ms": {}, "prefill_kv_budget": {}}
    for length, prompt in prompts.items():
        timed_turn(lm, session, method, sparsity, prompt, 2)  # untimed: compiles this method's kernels at this length
        seconds = []
        for _ in range(PREFILL_TURNS):
            times, stats = timed_turn(lm, session, method, sparsity, prompt, 1)
            seconds.append(times[0])
        out["prefill_ms"][length] = _median_ms(seconds)
        out["prefill_kv_budget"][length] = stats.kv_budget_prefill
    times, stats = timed_turn(lm, session, method, sparsity, next(iter(prompts.values())), steps + 1)
    decode = times[1 + WARMUP_STEPS :]
    out.update(decode_ms_median=_median_ms(decode), decode_ms_min=round(min(decode) * 1e3, 3),
               decode_steps_timed=len(decode), kv_budget=stats.kv_budget, kv_budget_prefill=stats.kv_budget_prefill,
               kv_budget_decode=round(decode_budget(stats), 6))
    return out


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads: every parameter once (tied ones once), but of the input embedding
    table only one row, unless it is also the output projection."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= (embedding.shape[0] - 1) * embedding.shape[1] * embedding.element_size()
    return total


def byte_bound(lm: LoadedModel, fixed_len: int, new_tokens: float) -> dict:
    """What a decode step reads besides the global layers' fixed context, and that context's dense K/V bytes.

    new_tokens: the turn's new tokens a timed decode step attends to, on average (question + answer so far)."""
    itemsize = torch.empty((), dtype=lm.dtype).element_size()
    per_token = lm.num_kv_heads * 2 * lm.head_dim * itemsize  # one token's K and V in one layer
    windows = lm.sliding_windows
    return {
        "weight_bytes": weight_bytes(lm.model),
        "global_fixed_kv_bytes": len(lm.global_layers) * fixed_len * per_token,  # x the step's KV budget
        "sliding_window_kv_bytes": sum(min(w, fixed_len) for w in windows if w is not None) * per_token,
        "new_kv_bytes": round(len(windows) * new_tokens * per_token),
    }


def bound_ms(bound: dict, kv_budget: float, bandwidth_gbs: float) -> float:
    """Milliseconds to read a step's bytes at the copy bandwidth: weights + kv_budget x the global layers' fixed K/V
    (index bytes included in the budget) + the sliding windows + the new tokens' K/V."""
    read = (bound["weight_bytes"] + kv_budget * bound["global_fixed_kv_bytes"] + bound["sliding_window_kv_bytes"]
            + bound["new_kv_bytes"])
    return read / (bandwidth_gbs * 1e9) * 1e3


def peer_model(lm: LoadedModel) -> torch.nn.Module:
    """Plain transformers with SDPA: the engine model's class and config, its very parameters and buffers (shared,
    not copied: a second 16 GB copy of an 8B model would not fit beside the K/V)."""
    cfg = copy.deepcopy(lm.model.config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        peer = type(lm.model)(cfg)
    peer.load_state_dict(lm.model.state_dict(), assign=True)
    for name, buffer in lm.model.named_buffers():  # non-persistent ones (RoPE frequencies) are not in the state dict
        owner, _, attr = name.rpartition(".")
        setattr(peer.get_submodule(owner), attr, buffer)
    return peer.eval()


def takes_cache_position(model: torch.nn.Module) -> bool:
    """Whether the installed transformers' forward takes cache_position (newer versions dropped it)."""
    return "cache_position" in inspect.signature(model.forward).parameters


def _peer_call(fn, ids: torch.Tensor, start: int, cache, with_cache_position: bool):
    """One forward of ids [1, n] at positions start..start+n-1 over `cache`; returns the last token's logits."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    extra = {"cache_position": positions[0]} if with_cache_position else {}
    return fn(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1,
              **extra).logits[:, -1:]


def _peer_prefill(peer, ids: torch.Tensor, cache, chunk: int, with_cp: bool) -> float:
    _sync(ids.device)
    start = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        _peer_call(peer, ids[:, s : s + chunk], s, cache, with_cp)
    _sync(ids.device)
    return time.perf_counter() - start


def _peer_decode(fn, first: torch.Tensor, start: int, cache, steps: int, with_cp: bool) -> list[float]:
    """Greedy decode steps from token `first` [1, 1] at position `start`; seconds per step."""
    token, times = first, []
    for i in range(steps):
        _sync(token.device)
        t = time.perf_counter()
        token = _peer_call(fn, token, start + i, cache, with_cp).argmax(-1)
        _sync(token.device)
        times.append(time.perf_counter() - t)
    return times


def _dynamic_decode(peer, cfg, ids: torch.Tensor, prompt: torch.Tensor, decode_steps: int, chunk: int,
                    with_cp: bool, out: dict) -> float:
    """The peer's fallback when torch.compile fails: a DynamicCache's chunked prefill and eager decode, into `out`.
    Returns the decode's median milliseconds."""
    from transformers import DynamicCache

    cache = DynamicCache(config=cfg)
    out["dynamic_prefill_s"] = round(_peer_prefill(peer, ids, cache, chunk, with_cp), 3)
    token = _peer_call(peer, prompt, ids.shape[1], cache, with_cp).argmax(-1)
    times = _peer_decode(peer, token, ids.shape[1] + prompt.shape[1], cache, decode_steps, with_cp)
    timed = times[PEER_WARMUP_STEPS:]
    out.update(dynamic_decode_ms_median=_median_ms(timed), dynamic_decode_ms_min=round(min(timed) * 1e3, 3))
    return out["dynamic_decode_ms_median"]


def measure_peer(lm: LoadedModel, ids: torch.Tensor, prompt: torch.Tensor, steps: int, chunk: int,
                 compile: bool = True) -> dict:
    """The transformers peer on the same weights and ids: after an untimed chunk, chunked prefill of the context into
    a StaticCache, the question's prefill, eager decode, then decode under torch.compile(mode="reduce-overhead");
    where that fails, its error and also a DynamicCache's prefill and eager decode. Every decode is greedy from the
    question."""
    from transformers import StaticCache

    device = lm.device
    peer = peer_model(lm)
    cfg = peer.config.get_text_config()
    with_cp = takes_cache_position(peer)
    ids, prompt = ids.to(device)[None], prompt.to(device)[None]
    context, lq = ids.shape[1], prompt.shape[1]
    decode_steps = PEER_WARMUP_STEPS + steps
    max_len = context + lq + 2 * decode_steps + PEER_CACHE_MARGIN  # eager, then compiled decode
    out: dict = {"model": "transformers", "attn_implementation": "sdpa", "cache": "StaticCache", "chunk": chunk,
                 "max_cache_len": max_len, "cache_position": with_cp, "warmup_steps": PEER_WARMUP_STEPS,
                 "compile": {"mode": "reduce-overhead", **CUDAGRAPH_OPTIONS} if compile else None}
    with torch.inference_mode():  # untimed: one chunk into a throwaway cache (library and kernel start-up costs)
        warmup = ids[:, :chunk]
        _peer_prefill(peer, warmup, StaticCache(config=cfg, max_cache_len=warmup.shape[1]), chunk, with_cp)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        reset_peaks(lm)
    cache = StaticCache(config=cfg, max_cache_len=max_len)
    with torch.inference_mode():
        out["prefill_s"] = round(_peer_prefill(peer, ids, cache, chunk, with_cp), 3)
        _sync(device)
        t = time.perf_counter()
        token = _peer_call(peer, prompt, context, cache, with_cp).argmax(-1)
        _sync(device)
        out["question_prefill_ms"] = round((time.perf_counter() - t) * 1e3, 3)
        pos = context + lq
        eager = _peer_decode(peer, token, pos, cache, decode_steps, with_cp)[PEER_WARMUP_STEPS:]
        pos += decode_steps
        out.update(eager_decode_ms_median=_median_ms(eager), eager_decode_ms_min=round(min(eager) * 1e3, 3))
        decodes = {"eager": out["eager_decode_ms_median"]}
        if compile:
            try:
                import torch._inductor.config as inductor_config

                compiled = torch.compile(peer.forward, mode="reduce-overhead")
                with inductor_config.patch(CUDAGRAPH_OPTIONS):
                    times = _peer_decode(compiled, token, pos, cache, decode_steps, with_cp)
                out["compile_first_step_s"] = round(times[0], 3)
                timed = times[PEER_WARMUP_STEPS:]
                out.update(compiled_decode_ms_median=_median_ms(timed),
                           compiled_decode_ms_min=round(min(timed) * 1e3, 3))
                decodes["compiled"] = out["compiled_decode_ms_median"]
            except Exception as exc:  # noqa: BLE001 - reported; the eager caches still give the peer a figure
                out["compile_error"] = _error(exc)
                _log(f"peer: torch.compile failed ({out['compile_error']}); DynamicCache decode as well")
        if "compile_error" in out:
            del cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                decodes["dynamic"] = _dynamic_decode(peer, cfg, ids, prompt, decode_steps, chunk, with_cp, out)
            except Exception as exc:  # noqa: BLE001
                out["dynamic_error"] = _error(exc)
    out["best_decode"] = min(decodes, key=decodes.get)
    out["best_decode_ms"] = decodes[out["best_decode"]]
    if device.type == "cuda":
        out["peak_gib"] = peak_gib(lm)
    return out


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def measure_engine(lm: LoadedModel, ids: torch.Tensor, settings: ContextSettings, backend: Backend, methods: list[str],
                   sparsity: float, prompts: dict[int, torch.Tensor], steps: int, profile: str | None = None,
                   graphs: bool = True, tag: str = "", method_settings: dict[str, dict] | None = None,
                   follow: FollowSettings | None = None, token_lookups: bool = False) -> dict:
    """The engine's phases: the ingest (after an untimed one of the first WARMUP_CONTEXT tokens), the session's
    opening, each method's turns (and, with `profile` on CUDA, profiles of its decode steps and of its shortest
    question's prefill written there).
    graphs: the session replays decode steps from CUDA graphs where it can (False: every step eager); tag: a prefix
    of the profile's section titles; method_settings: method -> its settings (the others at their defaults);
    follow: the session's follow rows (engine.attention.follow; None: the defaults); token_lookups: a question's prefill looks
    up each token on its own (engine.context.session.ContextSession).
    Returns the report's "ingest", "session" and "methods"; the session and its K/V are freed before returning."""
    cuda = lm.device.type == "cuda"
    warmup = ids[:WARMUP_CONTEXT]
    _log(f"warm-up ingest of {warmup.numel()} tokens")
    start = time.perf_counter()
    instances = [make_method(m, (method_settings or {}).get(m)) for m in build_order(methods)]
    # what a method learns per model (duo's gates, saap's partitions) is not trained here: stand-ins of its shapes
    prepared = stand_ins(instances, lm.global_layers, lm.num_kv_heads, lm.head_dim)
    try:
        ingest_tokens(lm, warmup, settings, backend, instances, prepared=prepared)
        warmup_error = None
    except Exception as exc:  # noqa: BLE001 - the timed ingest reports what fails
        warmup_error = _error(exc)
    warmup_s = round(time.perf_counter() - start, 3)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    _log(f"ingest of {ids.numel()} tokens")
    ingest, report = run_ingest(lm, ids, settings, backend, instances, prepared)
    report.update(warmup_tokens=int(warmup.numel()), warmup_s=warmup_s)
    if warmup_error:
        report["warmup_error"] = warmup_error
    out: dict = {"ingest": report, "session": {"skipped": "the ingest failed"}, "methods": {}}
    session = None
    if ingest is not None:
        try:
            start = time.perf_counter()
            session = ContextSession(lm, ingest.artifacts, settings, backend, graphs=graphs,  # takes the artifacts' K/V
                                     prepared=prepared, methods={m.name: m for m in instances}, follow=follow,
                                     token_lookups=token_lookups)
            _sync(lm.device)
            out["session"] = {"open_s": round(time.perf_counter() - start, 3), "graphs": session.graphs is not None}
        except Exception as exc:  # noqa: BLE001
            out["session"] = {"error": _error(exc)}
    del ingest  # the session holds what it needs; the artifacts must not outlive it
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        out["session"]["memory_gib"] = _gib(sum(torch.cuda.memory_allocated(d) for d in model_gpus(lm)))
    if session is None:
        return out
    for method in methods:
        _log(f"method {tag}{method}")
        try:
            out["methods"][method] = measure_method(lm, session, method, sparsity, prompts, steps)
            if profile and cuda:
                out["methods"][method]["profile"] = profile_decode(lm, session, method, sparsity,
                                                                   next(iter(prompts.values())), profile, tag)
                shortest = min(prompts)
                out["methods"][method]["profile_prefill"] = profile_prefill(lm, session, method, sparsity,
                                                                            prompts[shortest], profile, tag)
        except Exception as exc:  # noqa: BLE001
            out["methods"][method] = {"error": _error(exc)}
            session.cache.reset_dynamic()
    del session
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


PROFILE_STEPS = 4  # replayed decode steps under torch.profiler (--profile)


def profile_decode(lm: LoadedModel, session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
                   path: str, tag: str = "") -> dict:
    """torch.profiler over PROFILE_STEPS decode steps of one turn (after WARMUP_STEPS), appending the GPU kernels'
    table to `path`. Returns the GPU time per step and the kernels a step runs."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    step = session.step_context(method, sparsity, session.recorder(sync_cuda=False))
    tokens = generate_tokens(lm, step, prompt, 1 + WARMUP_STEPS + PROFILE_STEPS)
    try:
        for _ in range(1 + WARMUP_STEPS):
            next(tokens)
        _sync(lm.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                next(tokens)
            _sync(lm.device)
    finally:
        tokens.close()
        session.cache.reset_dynamic()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(path, "a") as f:
        f.write(f"== {tag}{method}, {PROFILE_STEPS} decode steps\n")
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30) + "\n")
    return {"kernels_per_step": sum(e.count for e in events) / PROFILE_STEPS,
            "gpu_ms_per_step": round(sum(e.self_device_time_total for e in events) / PROFILE_STEPS / 1e3, 3)}


def profile_prefill(lm: LoadedModel, session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
                    path: str, tag: str = "") -> dict:
    """torch.profiler over one question's prefill (a turn of one token, after an untimed one of the same length),
    appending its table by host time and by GPU time to `path`. Returns the question's tokens, the profiled turn's
    wall milliseconds (its statistics, TurnRecorder.finish, and the profiler's own cost included), the GPU's busy
    milliseconds (its kernels' times summed) and the kernels it runs: a GPU time far under the wall time says the
    prefill waits on the host."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    timed_turn(lm, session, method, sparsity, prompt, 1)
    _sync(lm.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        timed_turn(lm, session, method, sparsity, prompt, 1)
        _sync(lm.device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(path, "a") as f:
        f.write(f"== {tag}{method}, a {prompt.numel()}-token question's prefill, by host time\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        f.write(f"== {tag}{method}, a {prompt.numel()}-token question's prefill, by GPU time\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=20) + "\n")
    return {"tokens": int(prompt.numel()), "wall_ms": round(wall * 1e3, 3),
            "gpu_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 3),
            "kernels": sum(e.count for e in events)}


def add_ratios(out: dict) -> None:
    """Per method: the byte bound and the decode's distance to it, decode speedups against the engine's `full` and
    the peer's best decode, prefill speedups against `full`; the ingest against the peer's chunked prefill."""
    full = out["methods"].get("full", {})
    peer_ms = out["peer"].get("best_decode_ms")
    for row in out["methods"].values():
        if "decode_ms_median" not in row:
            continue
        if out["bandwidth_gbs"]:  # full's budget is 1: its recorder counts every key and no index
            row["bound_ms"] = round(bound_ms(out["bound"], row["kv_budget_decode"], out["bandwidth_gbs"]), 4)
            row["vs_bound"] = _ratio(row["decode_ms_median"], row["bound_ms"])
        row["speedup_vs_full"] = _ratio(full.get("decode_ms_median"), row["decode_ms_median"])
        row["speedup_vs_peer"] = _ratio(peer_ms, row["decode_ms_median"])
        row["prefill_speedup_vs_full"] = {n: _ratio(full.get("prefill_ms", {}).get(n), ms)
                                          for n, ms in row["prefill_ms"].items()}
    out["ingest"]["vs_peer_prefill"] = _ratio(out["ingest"]["seconds"], out["peer"].get("prefill_s"))


def run(args: argparse.Namespace) -> dict:
    """The whole benchmark; each phase's exception is recorded as an "error" string where it happened."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    methods = args.methods.split(",") if args.methods else list(METHODS)
    questions = [int(x) for x in args.questions.split(",") if x]
    settings = ContextSettings()
    method_settings = parse_settings(args.set)
    follow = None if args.follow else OFF
    out: dict = {"bench": "e2e", "device": device_name(device), "gpus": args.gpus,
                 **_versions(), "shape": args.shape if args.model is None else None, "model": args.model,
                 "follow": args.follow, "token_lookups": args.token_lookups}
    _log(f"building {args.model or args.shape} on {device}" + (f" and {args.gpus - 1} more GPUs" * (args.gpus > 1)))
    lm = open_model(args.shape, args.model, args.device, args.gpus)
    if args.compile == "on":
        compile_layers(lm)  # each shape compiles at its first call: in the warm-up ingest and the untimed turns
    backend = backend_for(lm.device)
    ids = context_ids(lm, args.context, args.document)
    fixed_len = int(ids.numel())
    out.update(model_id=lm.model_id, dtype=str(lm.dtype).removeprefix("torch."), backend=backend.name,
               config={"layers": lm.num_layers, "global_layers": lm.global_layers, "heads": lm.num_heads,
                       "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim, "vocab": lm.config.vocab_size,
                       "sliding_window": max((w for w in lm.sliding_windows if w is not None), default=None)},
               layers_per_device=layers_per_device(lm), context=fixed_len,
               settings={"sparsity": args.sparsity, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                         "prefill_turns": PREFILL_TURNS, "questions": questions, "methods": methods,
                         "document": args.document, "peer_chunk": args.chunk, "graphs": args.graphs, "compile": args.compile,
                         "context_settings": settings.as_dict(),
                         "method_settings": {m: make_method(m, method_settings.get(m)).settings.as_dict()
                                             for m in build_order(methods)},
                         # what a method learns per model (duo's gates) is not trained here: Method.stand_in
                         "stand_in": [m for m in build_order(methods) if REGISTRY[m].learns_per_model()]})
    try:
        _log("copy bandwidth")
        out["bandwidth_gbs"] = round(copy_bandwidth(device), 1)
    except Exception as exc:  # noqa: BLE001
        out["bandwidth_gbs"] = None
        out["bandwidth_error"] = _error(exc)
    if cuda:
        torch.cuda.empty_cache()

    prompts = question_prompts(lm, questions)
    new_tokens = questions[0] + (WARMUP_STEPS + 1 + args.steps) / 2  # mean over the timed decode steps
    out["bound"] = byte_bound(lm, fixed_len, new_tokens)
    out.update(measure_engine(lm, ids, settings, backend, methods, args.sparsity, prompts, args.steps, args.profile,
                              args.graphs, method_settings=method_settings, follow=follow,
                              token_lookups=args.token_lookups))
    if not args.peer:
        out["peer"] = {"skipped": "--no-peer"}
    elif args.gpus > 1:
        out["peer"] = {"skipped": "--gpus > 1: the peer runs on one GPU (torch.compile with CUDA graphs)"}
    elif not cuda:
        out["peer"] = {"skipped": "the peer runs on CUDA only (torch.compile with CUDA graphs)"}
    else:
        _log("peer: transformers sdpa, StaticCache")
        try:
            out["peer"] = measure_peer(lm, ids, prompts[questions[0]], args.steps, args.chunk)
        except Exception as exc:  # noqa: BLE001
            out["peer"] = {"error": _error(exc), "peak_gib": peak_gib(lm)}
        gc.collect()
        torch.cuda.empty_cache()
    add_ratios(out)

    if args.compile == "both":  # the same phases again with compiled layers, in this run (same-run ratios)
        _log("compiling the decoder layers (engine.model.compiled); the engine's phases again")
        compile_layers(lm)
        compiled = measure_engine(lm, ids, settings, backend, methods, args.sparsity, prompts, args.steps,
                                  args.profile, args.graphs, tag="compiled ", method_settings=method_settings,
                                  follow=follow, token_lookups=args.token_lookups)
        add_ratios({**compiled, "peer": out["peer"], "bound": out["bound"], "bandwidth_gbs": out["bandwidth_gbs"]})
        for method, row in compiled["methods"].items():
            row["speedup_vs_uncompiled"] = _ratio(out["methods"].get(method, {}).get("decode_ms_median"),
                                                  row.get("decode_ms_median"))
        out["compiled"] = compiled
    return out


def failed(result: dict) -> bool:
    """Whether a phase failed: the bandwidth, the ingest, the session, a method or the peer (a peer whose compile
    failed but whose eager decode was timed has not)."""
    compiled = result.get("compiled", {})
    phases = [result.get("ingest", {}), result.get("session", {}), result.get("peer", {}),
              *result.get("methods", {}).values(), compiled.get("ingest", {}), compiled.get("session", {}),
              *compiled.get("methods", {}).values()]
    return "bandwidth_error" in result or any("error" in phase for phase in phases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench e2e", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b", help="random-weight shape")
    model.add_argument("--model", default=None, help="a transformers model id or path (engine.model.load.load_model)")
    parser.add_argument("--context", type=int, default=131072, help="fixed-context tokens (random ids)")
    parser.add_argument("--document", default=None, help="with --model: read this file instead (its first "
                                                         "--context tokens)")
    parser.add_argument("--methods", default="", help=f"comma-separated (default: all, {','.join(METHODS)})")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=32,
                        help=f"decode steps per turn; the first {WARMUP_STEPS} are warm-up, the median of the rest")
    parser.add_argument("--questions", default="64,1024", help="question prefill lengths; decode follows the first")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpus", type=int, default=1, help="CUDA: split the model's layers evenly over this many "
                                                            "GPUs with accelerate (as --device auto does)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                        help="replay decode steps from CUDA graphs where the model allows (one GPU)")
    parser.add_argument("--compile", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                        help="torch.compile the decoder layers around the engine's attention (engine.model.compiled); "
                             "'both': the engine's phases without, then with compiled layers, in one run")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                        help="also time plain transformers (CUDA only)")
    parser.add_argument("--chunk", type=int, default=4096, help="the peer's prefill chunk")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.SETTING=VALUE",
                        help="a method's setting (repeatable), e.g. --set saap.buckets=1024")
    parser.add_argument("--follow", action=argparse.BooleanOptionalAction, default=True,
                        help="sparse steps also read the follow rows (engine.attention.follow)")
    parser.add_argument("--token-lookups", action="store_true",
                        help="a question's prefill looks up each of its tokens' keys on its own (engine.attention.function)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--profile", default=None, help="CUDA: append torch.profiler tables of each method's "
                                                        "decode steps and of its shortest question's prefill to this "
                                                        "file (kernels and GPU time in the JSON)")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    if args.context < 2 or args.chunk < 1 or not args.questions.strip(","):
        parser.error("--context must be at least 2, --chunk positive and --questions non-empty")
    unknown = [m for m in args.methods.split(",") if m and m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.document and not args.model:
        parser.error("--document needs --model: a random-weight shape has no tokenizer")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.gpus < 1 or (args.gpus > 1 and (args.device != "cuda" or torch.cuda.device_count() < args.gpus)):
        parser.error(f"--gpus {args.gpus}: needs --device cuda and that many GPUs "
                     f"({torch.cuda.device_count()} here)")
    result = run(args)
    emit(result, args.out)
    return 1 if failed(result) else 0


if __name__ == "__main__":
    raise SystemExit(main())
