"""Kernel benchmark: every sparse method's lookup + the sparse attention against dense SDPA over the whole fixed
context, on a GPU, at equal budgets.

    python -m engine.bench.kernels --capture FILE [--lengths 32768,131072,524288] [--methods squeeze,quest] [--json]

Keys, values and queries come from a real model reading a real document (engine.bench.capture), extended to each
length (engine.bench.extend says how). Each method (engine.methods.REGISTRY) builds its index through the engine's
own `build_methods`; for each configuration its whole lookup (scores, selection, expansion into key positions) and
the sparse attention over the K/V in the method's layout are timed from CUDA-graph replays (`triton.testing.do_bench_cudagraph`), beside
`torch.nn.functional.scaled_dot_product_attention` over the whole fixed context (what the engine would do without
the method) and the device's copy bandwidth, in the same run.
Ends with one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.attention.one_launch import SyncedLookups
from engine.bench.settings import parse_settings
from engine.context.ingest import build_methods
from engine.index.artifacts import MethodArtifacts
from engine.index.artifacts import parse as parse_artifacts
from engine.methods import SPARSE_METHODS, LayerIndex, Method, StepPlan, build_order, make_method, stand_ins
from engine.methods.saap.partitions import imbalance
from kernels.backend import Backend
from kernels.dispatch import backend_for

DENSE_TAIL = 100  # the last context tokens: dense, and the calibration queries (the bench's own setting)
KMEANS_ITERS = 10
HEAD_DIM = 128
MiB = 1 << 20


def bench_graph(fn, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() replayed from a CUDA graph: the GPU's time without Python's launch overhead.

    Every path timed here (dense SDPA, the lookup, the sparse attention) runs without host synchronisation, so it
    can be captured; an engine step replayed from a graph pays the same.
    """
    import triton.testing

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def bench_eager(fn, rep_ms: int = 100) -> float:
    """Median milliseconds of fn() launched from Python each time (triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))



def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second), 1 GiB buffers."""
    src = torch.empty(512 * MiB, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = bench_eager(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The baseline: q [Hq, Lq, D] over every fixed-context key, k/v [Hkv, L, D] (GQA through enable_gqa)."""
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=True)


BENCH_LAYER = 1  # the layer index the benchmarked indexes are built as


def build_indexes(k: torch.Tensor, queries: torch.Tensor, names: list[str], scale: float,
                  tail: int = DENSE_TAIL, settings: dict[str, dict] | None = None,
                  ) -> tuple[dict[str, LayerIndex], dict[str, dict], dict[str, Method], dict]:
    """The indexes of `names` (and what they require) over one layer's k [Hkv, L, D] (the last `tail` keys dense),
    calibrated on queries [Hq, n, D]; settings: method -> its settings (others at their defaults). Returns
    (method -> LayerIndex, method -> calibration, method -> instance, method -> seconds to build and calibrate it)."""
    indexes, calibrations, methods, seconds = {}, {}, {}, {}
    for name in build_order(names):
        method = make_method(name, (settings or {}).get(name))
        required = {r: {BENCH_LAYER: indexes[r].tensors} for r in method.requires}
        if k.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        # as layer 1: a model's first layer may be read whole (Saap's choice), the bench times a typical one
        made = build_methods({BENCH_LAYER: k}, {BENCH_LAYER: queries}, tail, [method], scale, k.device,
                             required=required,  # untrained model-level artifacts: time is what is measured
                             prepared=stand_ins([method], [BENCH_LAYER], k.shape[0], k.shape[-1]))
        if k.is_cuda:
            torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - start, 3)
        part = parse_artifacts(made, (name,)).methods.get(name, MethodArtifacts())
        indexes[name] = LayerIndex(tensors=part.layers.get(BENCH_LAYER, {}), num_keys=k.shape[1], tail=tail)
        calibrations[name] = part.calibration
        methods[name] = method
    return indexes, calibrations, methods, seconds


def kmeans_seconds(k: torch.Tensor, ratio: float, iters: int) -> float:
    """Wall time of the ingest's k-means on k [Hkv, L, D] into ratio x L centroids, `iters` iterations."""
    from engine.index.kmeans import spherical_kmeans

    spherical_kmeans(k[:, :4096], 64, iters=2)  # warm up kernels and allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    spherical_kmeans(k, max(1, round(k.shape[1] * ratio)), iters=iters)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(method: Method, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, index: LayerIndex, plan: StepPlan,
            scale: float, backend: Backend, flex=None) -> dict:
    """Time one configuration: lookup alone, sparse attention alone, and both (the step's fixed-context work).
    kp, vp: the K/V in the method's layout. flex: the compiled flex_attention (engine.bench.flex) to time as the
    peer given the same selection, or None. A decode lookup on a GPU runs as a step's does: both passes in one
    launch (engine.attention.one_launch)."""
    sparse = backend.kernel("sparse")
    if q.shape[1] == 1 and q.device.type == "cuda":
        backend = SyncedLookups.over(backend, backend.kernel("centroid").lookup_sync(q.device))
    at = torch.arange(index.num_keys, index.num_keys + q.shape[1], device=q.device)  # a question after the context
    lookup = method.lookup(q, index, plan, scale, backend, at)
    sel = lookup.selection
    peer = {}
    if flex is not None:
        from engine.bench.flex import block_mask_from_selection, flex_sparse

        mask, _ = block_mask_from_selection(sel, q.shape[0], q.shape[1])
        ours, _ = sparse.sparse_attention(q, kp, vp, sel, scale)
        peer = {"flex_ms": round(bench_graph(lambda: flex_sparse(flex, q, kp, vp, mask, scale)), 4),
                "flex_max_abs_diff": round(float((flex_sparse(flex, q, kp, vp, mask, scale).float() - ours).abs().max()), 5)}
        del mask

    def total():
        found = method.lookup(q, index, plan, scale, backend, at)
        return sparse.sparse_attention(q, kp, vp, found.selection, scale)

    lookup_ms = bench_graph(lambda: method.lookup(q, index, plan, scale, backend, at))
    sparse_ms = bench_graph(lambda: sparse.sparse_attention(q, kp, vp, sel, scale))
    total_ms = bench_graph(total)
    total_eager_ms = bench_eager(total)
    hkv, length, d = kp.shape
    kept = sel.counts().double()  # [rows]
    rows = sel.rows
    key_bytes = float(kept.reshape(hkv, rows // hkv).sum(dim=1).sum()) * 2 * d * kp.element_size()  # K and V
    index_bytes = float(lookup.index_elements.double().sum()) * kp.element_size()
    return {
        "kept_fraction": round(float(kept.mean()) / length, 5),
        "lookup_ms": round(lookup_ms, 4),
        "sparse_ms": round(sparse_ms, 4),
        "total_ms": round(total_ms, 4),
        "total_eager_ms": round(total_eager_ms, 4),
        "bytes_read": int(key_bytes + index_bytes),
        "kv_read": round((key_bytes + index_bytes) / (hkv * length * 2 * d * kp.element_size()), 4),
        "index_bytes": int(index_bytes),
        "bandwidth_GBps": round((key_bytes + index_bytes) / (total_ms * 1e-3) / 1e9, 1),
        **peer,
    }


def run(capture_path: str, lengths: list[int], heads: list[tuple[int, int]], budgets: list[float],
        phases: list[int], methods: list[str], device: str = "cuda", flex: bool = True,
        settings: dict[str, dict] | None = None) -> dict:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    dev = torch.device(device)
    backend = backend_for(dev, "triton")
    captured = load_file(capture_path)
    scale = HEAD_DIM ** -0.5
    out: dict = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": "bfloat16",
        "head_dim": HEAD_DIM,
        "dense_tail": DENSE_TAIL,
        "method_settings": {m: make_method(m, (settings or {}).get(m)).settings.as_dict() for m in build_order(methods)},
        "copy_bandwidth_GBps": round(copy_bandwidth(dev), 1),
        "results": [],
        "builds": [],
    }
    longest_q = max(phases)
    flex_fn = None
    if flex:
        from engine.bench.flex import BLOCK, flex_attention_fn

        flex_fn = flex_attention_fn()
    for length in lengths:
        for hq, hkv in heads:
            q_all, k, v = extend(captured, length, hkv, hq, longest_q + DENSE_TAIL, HEAD_DIM, torch.bfloat16, dev)
            calib_q = q_all[:, -DENSE_TAIL - 1 : -1]  # in the keys' dtype, as an ingest captures them
            indexes, calibrations, instances, build_s = build_indexes(k, calib_q, methods, scale, settings=settings)
            out["builds"].append({"length": length, "hq": hq, "hkv": hkv, "seconds": build_s,
                                  "imbalance": {n: round(imbalance(i["counts"][:, :-1].cpu()), 3)
                                                for n, i in indexes.items() if n == "saap"}})
            dense_ms = {lq: bench_graph(lambda q=q_all[:, -lq:]: dense_sdpa(q, k, v, scale)) for lq in phases}
            for name in methods:  # every method against the same dense timings
                method, index = instances[name], indexes[name]
                layout = method.layout(index)
                kp, vp = (k, v) if layout is None else (layout.permute(k), layout.permute(v))
                for lq in phases:
                    q = q_all[:, -lq:]
                    for budget in budgets:
                        plan = method.plan(calibrations[name], budget)
                        row = {"length": length, "hq": hq, "hkv": hkv, "method": name, "budget": budget,
                               "plan": plan.describe(), "phase": "decode" if lq == 1 else f"prefill{lq}",
                               "new_tokens": lq, "dense_ms": round(dense_ms[lq], 4)}
                        peer = flex_fn if flex_fn is not None and lq % BLOCK == 0 and length % BLOCK == 0 else None
                        row.update(measure(method, q, kp, vp, index, plan, scale, backend, peer))
                        if "flex_ms" in row:
                            row["flex_speedup"] = round(dense_ms[lq] / row["flex_ms"], 2)
                        row["speedup"] = round(dense_ms[lq] / row["total_ms"], 2)
                        out["results"].append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
                del kp, vp
            del q_all, k, v, indexes
            torch.cuda.empty_cache()
    if "squeeze" in build_order(methods):  # the k-means target: a 128K layer, 8 KV heads, d 128, 5% centroids
        _, k, _ = extend(captured, 131072, 8, 32, 1, HEAD_DIM, torch.bfloat16, dev)
        out["kmeans_128k_8heads_10iters_s"] = round(kmeans_seconds(k, make_method("squeeze").settings.centroid_ratio, 10), 3)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True, help="keys captured by `squeeze bench capture`")
    parser.add_argument("--lengths", default="32768,131072,524288")
    parser.add_argument("--heads", default="32/8,32/32", help="query/KV heads, comma-separated")
    parser.add_argument("--budgets", default="0.1,0.2,0.3",
                        help="KV budgets: shares of the fixed context's K/V bytes a step reads, index included (each "
                             "method's calibration turns one into a key fraction; each row reports kv_read)")
    parser.add_argument("--phases", default="1,1024,4096", help="new tokens: 1 = decode, more = prefill")
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS),
                        help=f"comma-separated, of {', '.join(SPARSE_METHODS)}")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (prefill only)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.SETTING=VALUE",
                        help="a method's setting (repeatable), e.g. --set quest.bounds=int8")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    args = parser.parse_args(argv)
    try:
        settings = parse_settings(args.set)
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("error: the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in SPARSE_METHODS]
    if unknown:
        parser.error(f"unknown sparse method(s) {', '.join(unknown)}; choose from {', '.join(SPARSE_METHODS)}")
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    result = run(args.capture, _ints(args.lengths), heads, [float(b) for b in args.budgets.split(",")],
                 _ints(args.phases), methods, flex=not args.no_flex, settings=settings)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
