"""The peer: plain transformers with SDPA on the engine model's own tensors (shared, not copied), a StaticCache,
chunked prefill of the same ids, then greedy decode eager and under torch.compile(mode="reduce-overhead")."""

from __future__ import annotations

import copy
import gc
import inspect
import time

import torch

from engine.bench.e2e.models import peak_gib, reset_peaks
from engine.bench.e2e.timing import error_text, log, median_ms, synchronize
from engine.model.fused import unfused_state_dict
from engine.model.load import LoadedModel

PEER_WARMUP_STEPS = 3  # peer decode steps left out: torch.compile traces at the first, records CUDA graphs after

PEER_CACHE_MARGIN = 8  # spare StaticCache positions

# Where a compiled decode step has a shape that changes every step (Gemma 3's sliding layers in a StaticCache), a
# CUDA graph would be recorded at every step and never replayed: such graphs run compiled without CUDA graphs.
CUDAGRAPH_OPTIONS = {"triton.cudagraph_skip_dynamic_graphs": True}

def peer_model(lm: LoadedModel) -> torch.nn.Module:
    """Plain transformers with SDPA: the engine model's class and config, its very parameters and buffers (shared,
    not copied: a second 16 GB copy of an 8B model would not fit beside the K/V), its fused projections
    (engine.model.fused) seen as the separate ones the class defines."""
    cfg = copy.deepcopy(lm.model.config)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        peer = type(lm.model)(cfg)
    peer.load_state_dict(unfused_state_dict(lm.model), assign=True)
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
    synchronize(ids.device)
    start = time.perf_counter()
    for s in range(0, ids.shape[1], chunk):
        _peer_call(peer, ids[:, s : s + chunk], s, cache, with_cp)
    synchronize(ids.device)
    return time.perf_counter() - start

def _peer_decode(fn, first: torch.Tensor, start: int, cache, steps: int, with_cp: bool) -> list[float]:
    """Greedy decode steps from token `first` [1, 1] at position `start`; seconds per step."""
    token, times = first, []
    for i in range(steps):
        synchronize(token.device)
        t = time.perf_counter()
        token = _peer_call(fn, token, start + i, cache, with_cp).argmax(-1)
        synchronize(token.device)
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
    out.update(dynamic_decode_ms_median=median_ms(timed), dynamic_decode_ms_min=round(min(timed) * 1e3, 3))
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
        synchronize(device)
        t = time.perf_counter()
        token = _peer_call(peer, prompt, context, cache, with_cp).argmax(-1)
        synchronize(device)
        out["question_prefill_ms"] = round((time.perf_counter() - t) * 1e3, 3)
        pos = context + lq
        eager = _peer_decode(peer, token, pos, cache, decode_steps, with_cp)[PEER_WARMUP_STEPS:]
        pos += decode_steps
        out.update(eager_decode_ms_median=median_ms(eager), eager_decode_ms_min=round(min(eager) * 1e3, 3))
        decodes = {"eager": out["eager_decode_ms_median"]}
        if compile:
            try:
                import torch._inductor.config as inductor_config

                compiled = torch.compile(peer.forward, mode="reduce-overhead")
                with inductor_config.patch(CUDAGRAPH_OPTIONS):
                    times = _peer_decode(compiled, token, pos, cache, decode_steps, with_cp)
                out["compile_first_step_s"] = round(times[0], 3)
                timed = times[PEER_WARMUP_STEPS:]
                out.update(compiled_decode_ms_median=median_ms(timed),
                           compiled_decode_ms_min=round(min(timed) * 1e3, 3))
                decodes["compiled"] = out["compiled_decode_ms_median"]
            except Exception as exc:  # noqa: BLE001 - reported; the eager caches still give the peer a figure
                out["compile_error"] = error_text(exc)
                log(f"peer: torch.compile failed ({out['compile_error']}); DynamicCache decode as well")
        if "compile_error" in out:
            del cache
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                decodes["dynamic"] = _dynamic_decode(peer, cfg, ids, prompt, decode_steps, chunk, with_cp, out)
            except Exception as exc:  # noqa: BLE001
                out["dynamic_error"] = error_text(exc)
    out["best_decode"] = min(decodes, key=decodes.get)
    out["best_decode_ms"] = decodes[out["best_decode"]]
    if device.type == "cuda":
        out["peak_gib"] = peak_gib(lm)
    return out
