"""Where a step's GPU time goes: per-kernel times of the lookup and the sparse attention, and of the ingest k-means.

    python -m engine.bench.profile --capture FILE [--lengths 131072,524288] [--phases 1,1024] [--sparsity 0.9]

The kernel benchmark (engine.bench.kernels) gives totals; this module explains them. Each configuration's step
(policy.lookup + sparse attention, exactly as the benchmark runs it) is replayed under torch.profiler and the CUDA
kernels' times are summed by kernel name and divided by the number of steps. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import torch

from engine.bench.kernels import DENSE_TAIL, HEAD_DIM, build_indexes, kmeans_seconds
from engine.methods import SPARSE_METHODS
from kernels.dispatch import backend_for

STEPS = 50


def kernel_times(fn, steps: int = STEPS) -> dict[str, float]:
    """Microseconds per call of fn() by CUDA kernel name (kernels of one name summed), largest first."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:80]] += event.device_time / steps
    return {name: round(us, 2) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def kmeans_profile(k: torch.Tensor, ratio: float, iters: int) -> dict:
    """Wall seconds of the ingest k-means on k [Hkv, L, D], and its kernels' times over the whole run."""
    from engine.index.kmeans import spherical_kmeans

    clusters = max(1, round(k.shape[1] * ratio))
    seconds = kmeans_seconds(k, ratio, iters)
    kernels = kernel_times(lambda: spherical_kmeans(k, clusters, iters=iters), steps=1)
    return {"seconds": round(seconds, 3), "clusters": clusters, "kernels_us": dict(list(kernels.items())[:12])}


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    parser = argparse.ArgumentParser(prog="python -m engine.bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True)
    parser.add_argument("--lengths", default="131072,524288")
    parser.add_argument("--phases", default="1,1024")
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--methods", default=",".join(SPARSE_METHODS))
    parser.add_argument("--kmeans", action="store_true", help="also profile the 128K-token, 8-head k-means")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    backend = backend_for(dev, "triton")
    captured = load_file(args.capture)
    settings = {"squeeze": {"kmeans_iters": 10}, "hsqueeze": {"kmeans_iters": 10}}
    methods = args.methods.split(",")
    scale = HEAD_DIM ** -0.5
    phases = [int(p) for p in args.phases.split(",")]
    out: dict = {"device": torch.cuda.get_device_name(dev), "sparsity": args.sparsity, "steps": []}
    for length in (int(x) for x in args.lengths.split(",")):
        q_all, k, v = extend(captured, length, args.hkv, args.hq, max(phases) + DENSE_TAIL, HEAD_DIM,
                             torch.bfloat16, dev)
        indexes, calibrations, instances, build_s = build_indexes(k, q_all[:, -DENSE_TAIL - 1 : -1].float(), methods,
                                                                  scale, DENSE_TAIL, settings)
        for name in methods:
            policy, index = instances[name], indexes[name]
            layout = policy.layout(index)
            kp, vp = (k, v) if layout is None else (layout.permute(k), layout.permute(v))
            plan = policy.plan(calibrations[name], 1.0 - args.sparsity)
            for lq in phases:
                q = q_all[:, -lq:]

                at = torch.arange(index.num_keys, index.num_keys + lq, device=q.device)

                def step():
                    found = policy.lookup(q, index, plan, scale, backend, at)
                    return backend.kernel("sparse").sparse_attention(q, kp, vp, found.selection, scale)

                row = {"length": length, "method": name, "new_tokens": lq, "index_build_s": build_s[name],
                       "kernels_us": kernel_times(step)}
                row["total_us"] = round(sum(row["kernels_us"].values()), 2)
                out["steps"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
            del kp, vp
        del q_all, k, v, indexes
        torch.cuda.empty_cache()
    if args.kmeans:
        _, k, _ = extend(captured, 131072, 8, 32, 1, HEAD_DIM, torch.bfloat16, dev)
        out["kmeans_128k_8heads_10iters"] = kmeans_profile(k, 0.05, 10)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
