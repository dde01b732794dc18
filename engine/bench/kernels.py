"""Kernel benchmark: the Triton lookup + sparse attention against dense SDPA over the whole fixed context, on a GPU.

    python -m engine.bench.kernels --capture FILE [--lengths 32768,131072,524288] [--json]

Keys, values and queries come from a real model reading a real document (engine.bench.capture), extended to each
length (engine.bench.extend says how). For each configuration the whole lookup (centroid scores, threshold,
expansion of the kept clusters into key positions) and the sparse attention over the cluster-permuted K/V are
timed from CUDA-graph replays (`triton.testing.do_bench_cudagraph`), beside
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

from engine.config import PREFILL_THRESHOLDS, IndexSettings
from engine.policies.base import CalibrationSet
from engine.policies.hsqueeze import HierarchicalSqueezePolicy
from engine.policies.squeeze import SqueezePolicy
from kernels.backend import Backend
from kernels.dispatch import backend_for
from kernels.layout import ClusterLayout

DENSE_TAIL = 100  # the engine's default: the last context tokens stay dense and calibrate the threshold
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


def build_index(k: torch.Tensor, settings: IndexSettings, heads_per_kmeans: int,
                policies=(SqueezePolicy(), HierarchicalSqueezePolicy())) -> tuple[dict, float]:
    """Both methods' index over k [Hkv, L, D] (the dense tail excluded), k-means over heads in chunks.

    Returns (index, seconds of clustering). k may be on the CPU (the CPU benchmark modules use it too).
    """
    clustered = k[:, : k.shape[1] - settings.dense_tail]
    parts: list[dict] = []
    if k.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for h in range(0, clustered.shape[0], heads_per_kmeans):
        index: dict = {}
        chunk = clustered[h : h + heads_per_kmeans]
        for policy in policies:
            index.update(policy.build(chunk, settings, index))
        parts.append(index)
    if k.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {name: torch.cat([p[name] for p in parts], dim=0) for name in parts[0]}, seconds


def kmeans_seconds(k: torch.Tensor, ratio: float, iters: int) -> float:
    """Wall time of the ingest's k-means on k [Hkv, L, D] into ratio x L centroids, `iters` iterations."""
    from engine.kmeans import spherical_kmeans

    spherical_kmeans(k[:, :4096], 64, iters=2)  # warm up kernels and allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    spherical_kmeans(k, max(1, round(k.shape[1] * ratio)), iters=iters)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(policy, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, index: dict, thresholds, scale: float,
            settings: IndexSettings, backend: Backend, flex=None) -> dict:
    """Time one configuration: lookup alone, sparse attention alone, and both (the step's fixed-context work).
    flex: the compiled flex_attention (engine.bench.flex) to time as the peer given the same selection, or None."""
    lookup = policy.lookup(q, index, thresholds, scale, settings, backend)
    sel = lookup.selection
    peer = {}
    if flex is not None:
        from engine.bench.flex import block_mask_from_selection, flex_sparse

        mask, _ = block_mask_from_selection(sel, q.shape[0], q.shape[1])
        ours, _ = backend.sparse_attention(q, kp, vp, sel, scale)
        peer = {"flex_ms": round(bench_graph(lambda: flex_sparse(flex, q, kp, vp, mask, scale)), 4),
                "flex_max_abs_diff": round(float((flex_sparse(flex, q, kp, vp, mask, scale).float() - ours).abs().max()), 5)}
        del mask

    def total():
        found = policy.lookup(q, index, thresholds, scale, settings, backend)
        return backend.sparse_attention(q, kp, vp, found.selection, scale)

    lookup_ms = bench_graph(lambda: policy.lookup(q, index, thresholds, scale, settings, backend))
    sparse_ms = bench_graph(lambda: backend.sparse_attention(q, kp, vp, sel, scale))
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
        "bandwidth_GBps": round((key_bytes + index_bytes) / (total_ms * 1e-3) / 1e9, 1),
        **peer,
    }


def run(capture_path: str, lengths: list[int], heads: list[tuple[int, int]], sparsities: list[float],
        phases: list[int], methods: list[str], device: str = "cuda", flex: bool = True,
        prefill_threshold: str = "decode") -> dict:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    dev = torch.device(device)
    backend = backend_for(dev, "triton")
    captured = load_file(capture_path)
    policies = {"squeeze": SqueezePolicy(), "hsqueeze": HierarchicalSqueezePolicy()}
    settings = IndexSettings(centroid_ratio=0.05, level1_ratio=0.01, level1_prune=0.5, dense_tail=DENSE_TAIL,
                             kmeans_iters=KMEANS_ITERS,  # the shapes: 5% centroids; the paper's level 1
                             prefill_threshold=prefill_threshold)
    scale = HEAD_DIM ** -0.5
    out: dict = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "dtype": "bfloat16",
        "head_dim": HEAD_DIM,
        "centroid_ratio": settings.centroid_ratio,
        "level1_ratio": settings.level1_ratio,
        "prefill_threshold": settings.prefill_threshold,
        "copy_bandwidth_GBps": round(copy_bandwidth(dev), 1),
        "results": [],
        "kmeans": [],
    }
    longest_q = max(phases)
    flex_fn = None
    if flex:
        from engine.bench.flex import BLOCK, flex_attention_fn

        flex_fn = flex_attention_fn()
    for length in lengths:
        for hq, hkv in heads:
            q_all, k, v = extend(captured, length, hkv, hq, longest_q + DENSE_TAIL, HEAD_DIM, torch.bfloat16, dev)
            index, build_s = build_index(k, settings, heads_per_kmeans=8)
            layout = ClusterLayout.from_labels(index["labels"], index["counts"].shape[1], DENSE_TAIL)
            kp, vp = layout.permute(k), layout.permute(v)
            calib = CalibrationSet(index=index, queries=q_all[:, -DENSE_TAIL - 1 : -1].float())
            for name in methods:
                policy = policies[name]
                calibration = policy.calibrate([calib], scale, settings)
                for lq in phases:
                    q = q_all[:, -lq:]
                    dense_ms = bench_graph(lambda: dense_sdpa(q, k, v, scale))
                    for sparsity in sparsities:
                        thresholds = policy.thresholds(calibration, sparsity)
                        row = {"length": length, "hq": hq, "hkv": hkv, "method": name, "sparsity": sparsity,
                               "phase": "decode" if lq == 1 else f"prefill{lq}", "new_tokens": lq,
                               "prefill_threshold": settings.prefill_threshold if lq > 1 else None,
                               "dense_ms": round(dense_ms, 4)}
                        peer = flex_fn if flex_fn is not None and lq % BLOCK == 0 and length % BLOCK == 0 else None
                        row.update(measure(policy, q, kp, vp, index, thresholds, scale, settings, backend, peer))
                        if "flex_ms" in row:
                            row["flex_speedup"] = round(dense_ms / row["flex_ms"], 2)
                        row["speedup"] = round(dense_ms / row["total_ms"], 2)
                        out["results"].append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            out["kmeans"].append({"length": length, "hkv": hkv, "index_build_s": round(build_s, 3),
                                  "iters": KMEANS_ITERS})
            del q_all, k, v, kp, vp, index
            torch.cuda.empty_cache()
    # The k-means target: a 128K-token layer, 8 KV heads, d = 128, 5% centroids, 10 iterations.
    _, k, _ = extend(captured, 131072, 8, 32, 1, HEAD_DIM, torch.bfloat16, dev)
    out["kmeans_128k_8heads_10iters_s"] = round(kmeans_seconds(k, settings.centroid_ratio, 10), 3)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="squeeze bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True, help="keys captured by `squeeze bench capture`")
    parser.add_argument("--lengths", default="32768,131072,524288")
    parser.add_argument("--heads", default="32/8,32/32", help="query/KV heads, comma-separated")
    parser.add_argument("--sparsities", default="0.7,0.8,0.9")
    parser.add_argument("--phases", default="1,1024,4096", help="new tokens: 1 = decode, more = prefill")
    parser.add_argument("--methods", default="squeeze,hsqueeze")
    parser.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (prefill only)")
    parser.add_argument("--prefill-threshold", choices=PREFILL_THRESHOLDS, default="decode",
                        help="the prefill lookup's thresholds (IndexSettings.prefill_threshold)")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    result = run(args.capture, _ints(args.lengths), heads, [float(s) for s in args.sparsities.split(",")],
                 _ints(args.phases), args.methods.split(","), flex=not args.no_flex,
                 prefill_threshold=args.prefill_threshold)
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
