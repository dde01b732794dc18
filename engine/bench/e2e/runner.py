"""The engine's phases: the ingest timed by stage, the session's opening, each method's question prefills and decode
steps through the product's own generation and statistics, and their profiles."""

from __future__ import annotations

import gc
import time

import torch

from engine.attention.follow import FollowSettings
from engine.attention.stats import TurnStats
from engine.bench.e2e.models import SEED, gib, model_gpus, peak_gib, reset_peaks
from engine.bench.e2e.timing import error_text, log, median_ms, synchronize
from engine.context.ingest import IngestOutput, ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.methods import Method, Tensors, build_order, make_method, stand_ins
from engine.model.generate import generate_tokens
from engine.model.load import LoadedModel
from kernels.backend import Backend

WARMUP_STEPS = 2  # decode steps of a turn left out of its timings (the first launches compile and warm up)

PREFILL_TURNS = 3  # timed turns per question length (after an untimed one) by default (--prefill-turns); their
# prefills' median and fastest are reported

WARMUP_CONTEXT = 2048  # tokens of an untimed ingest before the timed one: Triton compiles and tunes the kernels there

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
            log(f"ingest: {stage} ({total})")

    def close(self, sync: bool = True) -> None:
        """End the current stage (sync=False after an error: the device may not answer)."""
        if self.stage is not None:
            if sync:
                synchronize(self.device)
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
        report["error"] = error_text(exc)
        report["failed_stage"] = clock.stage
        clock.close(sync=False)
    report["seconds"] = round(time.perf_counter() - start, 3)
    report["stages"] = clock.rounded()
    report["peak_gib"] = peak_gib(lm)
    return ingest, report

def timed_turn(lm: LoadedModel, session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
               tokens: int) -> tuple[list[float], TurnStats]:
    """One turn of `tokens` greedy tokens with the product's statistics on. Returns the seconds between the turn's
    start and its first token (the question's prefill), then between one token and the next (a decode step), as a
    user receives them: a token is yielded once the step that made it has run, and a replayed step is launched
    before its predecessor's token is read (engine.model.generate), so nothing here waits for the GPU besides."""
    recorder = session.recorder(sync_cuda=False)
    step = session.step_context(method, sparsity, recorder)
    times: list[float] = []
    try:
        synchronize(lm.device)
        last = time.perf_counter()
        for _ in generate_tokens(lm, step, prompt, tokens):
            now = time.perf_counter()
            times.append(now - last)
            last = now
    finally:
        session.cache.reset_dynamic()
    stats = recorder.finish(method, round(1.0 - step.plan.budget, 6), len(times), {})
    return times, stats

def decode_budget(stats: TurnStats) -> float:
    """The KV budget of the turn's decode steps alone (TurnStats.kv_budget averages the prefill in as one step)."""
    if stats.steps < 2:
        return stats.kv_budget
    return (stats.kv_budget * stats.steps - stats.kv_budget_prefill) / (stats.steps - 1)

def measure_method(lm: LoadedModel, session: ContextSession, method: str, sparsity: float,
                   prompts: dict[int, torch.Tensor], steps: int, prefill_turns: int = PREFILL_TURNS) -> dict:
    """A method's question prefill per length (after an untimed turn, the median and the fastest of `prefill_turns`
    one-token turns) and its decode steps (one turn of steps + 1 tokens after the first length's prompt; the first
    WARMUP_STEPS left out)."""
    out: dict = {"prefill_ms": {}, "prefill_ms_min": {}, "prefill_kv_budget": {}}
    for length, prompt in prompts.items():
        timed_turn(lm, session, method, sparsity, prompt, 2)  # untimed: compiles this method's kernels at this length
        seconds = []
        for _ in range(prefill_turns):
            times, stats = timed_turn(lm, session, method, sparsity, prompt, 1)
            seconds.append(times[0])
        out["prefill_ms"][length] = median_ms(seconds)
        out["prefill_ms_min"][length] = round(min(seconds) * 1e3, 3)
        out["prefill_kv_budget"][length] = stats.kv_budget_prefill
    times, stats = timed_turn(lm, session, method, sparsity, next(iter(prompts.values())), steps + 1)
    decode = times[1 + WARMUP_STEPS :]
    out.update(decode_ms_median=median_ms(decode), decode_ms_min=round(min(decode) * 1e3, 3),
               decode_steps_timed=len(decode), kv_budget=stats.kv_budget, kv_budget_prefill=stats.kv_budget_prefill,
               kv_budget_decode=round(decode_budget(stats), 6))
    return out

def measure_engine(lm: LoadedModel, ids: torch.Tensor, settings: ContextSettings, backend: Backend, methods: list[str],
                   sparsity: float, prompts: dict[int, torch.Tensor], steps: int, profile: str | None = None,
                   graphs: bool = True, tag: str = "", method_settings: dict[str, dict] | None = None,
                   follow: FollowSettings | None = None, token_lookups: bool = False,
                   prefill_turns: int = PREFILL_TURNS) -> dict:
    """The engine's phases: the ingest (after an untimed one of the first WARMUP_CONTEXT tokens), the session's
    opening, each method's turns (and, with `profile` on CUDA, profiles of its decode steps and of each question's
    prefill written there).
    graphs: the session replays decode steps from CUDA graphs where it can (False: every step eager); tag: a prefix
    of the profile's section titles; method_settings: method -> its settings (the others at their defaults);
    follow: the session's follow rows (engine.attention.follow; None: the defaults); token_lookups: a question's prefill looks
    up each token on its own (engine.context.session.ContextSession); prefill_turns: timed one-token turns per question
    length.
    Returns the report's "ingest", "session" and "methods"; the session and its K/V are freed before returning."""
    cuda = lm.device.type == "cuda"
    warmup = ids[:WARMUP_CONTEXT]
    log(f"warm-up ingest of {warmup.numel()} tokens")
    start = time.perf_counter()
    instances = [make_method(m, (method_settings or {}).get(m)) for m in build_order(methods)]
    # what a method learns per model (duo's gates, saap's partitions) is not trained here: stand-ins of its shapes
    prepared = stand_ins(instances, lm.global_layers, lm.num_kv_heads, lm.head_dim)
    try:
        ingest_tokens(lm, warmup, settings, backend, instances, prepared=prepared)
        warmup_error = None
    except Exception as exc:  # noqa: BLE001 - the timed ingest reports what fails
        warmup_error = error_text(exc)
    warmup_s = round(time.perf_counter() - start, 3)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    log(f"ingest of {ids.numel()} tokens")
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
            synchronize(lm.device)
            out["session"] = {"open_s": round(time.perf_counter() - start, 3), "graphs": session.graphs is not None}
        except Exception as exc:  # noqa: BLE001
            out["session"] = {"error": error_text(exc)}
    del ingest  # the session holds what it needs; the artifacts must not outlive it
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        out["session"]["memory_gib"] = gib(sum(torch.cuda.memory_allocated(d) for d in model_gpus(lm)))
    if session is None:
        return out
    for method in methods:
        log(f"method {tag}{method}")
        try:
            out["methods"][method] = measure_method(lm, session, method, sparsity, prompts, steps, prefill_turns)
            if profile and cuda:
                out["methods"][method]["profile"] = profile_decode(lm, session, method, sparsity,
                                                                   next(iter(prompts.values())), profile, tag)
                out["methods"][method]["profile_prefill"] = {
                    str(n): profile_prefill(lm, session, method, sparsity, prompts[n], profile, tag)
                    for n in sorted(prompts)}
        except Exception as exc:  # noqa: BLE001
            out["methods"][method] = {"error": error_text(exc)}
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
        synchronize(lm.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILE_STEPS):
                next(tokens)
            synchronize(lm.device)
    finally:
        tokens.close()
        session.cache.reset_dynamic()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    with open(path, "a") as f:
        f.write(f"== {tag}{method}, {PROFILE_STEPS} decode steps\n")
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30) + "\n")
    kernels = kernel_spans(prof)
    # steps whose kernels the profile holds: every kernel of a replayed step runs once or more in each, and the
    # profiler may miss the first launch of its window
    steps = min((e.count for e in events), default=PROFILE_STEPS) or PROFILE_STEPS
    return {"steps_profiled": steps, "kernels_per_step": sum(e.count for e in events) / steps,
            "kernel_ms_per_step": round(sum(e.self_device_time_total for e in events) / steps / 1e3, 3),
            **idle_time(kernels, steps)}


def kernel_spans(prof) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU kernel a torch.profiler run recorded."""
    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


HOST_GAP_US = 50.0  # an idle GPU for longer than this between two kernels of replayed steps is waiting on the host


def idle_time(kernels: list[tuple[float, float]], steps: int) -> dict:
    """Where the GPU is busy and where it idles over `steps` decode steps, from their kernels' (start, end) times in
    microseconds: busy while any kernel runs (kernels launched with PDL overlap the one before them, waiting in it,
    so their summed times, kernel_ms_per_step, exceed the step); idle between two kernels of a step (the launch of the
    next, ~1 us each inside a CUDA graph without PDL), or waiting for the host (a gap over HOST_GAP_US: the host
    reading a token back, launching the next step). Milliseconds per step."""
    busy = between = waiting = 0.0
    last_end = None
    for start, end in sorted(kernels):
        if last_end is not None and start > last_end:
            gap = start - last_end
            if gap > HOST_GAP_US:
                waiting += gap
            else:
                between += gap
        busy += max(0.0, end - max(start, last_end if last_end is not None else start))
        last_end = end if last_end is None else max(last_end, end)
    return {"gpu_busy_ms_per_step": round(busy / steps / 1e3, 3),
            "idle_between_kernels_ms_per_step": round(between / steps / 1e3, 3),
            "idle_waiting_host_ms_per_step": round(waiting / steps / 1e3, 3)}


def profile_prefill(lm: LoadedModel, session: ContextSession, method: str, sparsity: float, prompt: torch.Tensor,
                    path: str, tag: str = "") -> dict:
    """torch.profiler over one question's prefill (a turn of one token, after an untimed one of the same length),
    appending its table by host time and by GPU time to `path`. Returns the question's tokens, the profiled turn's
    wall milliseconds (its statistics, TurnRecorder.finish, and the profiler's own cost included), the GPU's busy
    milliseconds (while any kernel runs; kernel_ms: their times summed) and the kernels it runs: a GPU time far
    under the wall time says the prefill waits on the host."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    timed_turn(lm, session, method, sparsity, prompt, 1)
    synchronize(lm.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        timed_turn(lm, session, method, sparsity, prompt, 1)
        synchronize(lm.device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = kernel_spans(prof)
    with open(path, "a") as f:
        f.write(f"== {tag}{method}, a {prompt.numel()}-token question's prefill, by host time\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        f.write(f"== {tag}{method}, a {prompt.numel()}-token question's prefill, by GPU time\n")
        f.write(averages.table(sort_by="self_device_time_total", row_limit=20) + "\n")
    return {"tokens": int(prompt.numel()), "wall_ms": round(wall * 1e3, 3),
            "gpu_ms": idle_time(kernels, 1)["gpu_busy_ms_per_step"],
            "kernel_ms": round(sum(e.self_device_time_total for e in events) / 1e3, 3),
            "kernels": sum(e.count for e in events)}
