"""Kernel launch-parameter sweep on one benchmark configuration (GPU): which block sizes / warps to make default.

    python -m engine.bench.tune --capture FILE [--length 131072] [--sparsity 0.9]

Times each candidate config of the decode and prefill lookup (centroid_ops.cluster_select: both passes and the
expansion, as the policies run it) and sparse attention with CUDA graphs (GPU time without Python launch overhead)
and prints one JSON document, best first per kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace

import torch

from engine.bench.kernels import DENSE_TAIL, HEAD_DIM, bench_graph, build_indexes
from engine.methods.squeeze import code_step
from kernels import centroid_ops, sparse_ops
from kernels.compact_ops import expand_groups


def _sweep(name: str, configs, fn) -> list[dict]:
    rows = []
    for cfg in configs:
        try:
            ms = bench_graph(lambda: fn(cfg))
            rows.append({"config": {k: v for k, v in vars(cfg).items()}, "ms": round(ms, 4)})
        except Exception as exc:  # noqa: BLE001 - an invalid config is reported, not fatal
            rows.append({"config": {k: v for k, v in vars(cfg).items()}, "error": str(exc).splitlines()[0][:160]})
        print(name, rows[-1], file=sys.stderr, flush=True)
    return sorted(rows, key=lambda r: r.get("ms", 1e9))[:8]


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file

    from engine.bench.extend import extend

    parser = argparse.ArgumentParser(prog="python -m engine.bench.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--capture", required=True)
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--only", default="decode_attn,decode_lookup,prefill_attn,prefill_lookup")
    parser.add_argument("--score-only", action="store_true", help="prefill lookup: sweep the score pass's tiles only")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    q_all, k, v = extend(load_file(args.capture), args.length, args.hkv, args.hq, args.prefill + DENSE_TAIL, HEAD_DIM,
                         torch.bfloat16, dev)
    scale = HEAD_DIM ** -0.5
    indexes, calibrations, instances, _ = build_indexes(k, q_all[:, -DENSE_TAIL - 1 : -1].float(), ["squeeze"], scale,
                                                        DENSE_TAIL, {"squeeze": {"kmeans_iters": 5}})
    index = indexes["squeeze"]
    layout = instances["squeeze"].layout(index)
    kp, vp = layout.permute(k), layout.permute(v)
    (threshold,) = instances["squeeze"].plan(calibrations["squeeze"], 1.0 - args.sparsity).decode
    lc = index["labels"].shape[1]
    out: dict = {"length": args.length, "hq": args.hq, "hkv": args.hkv, "sparsity": args.sparsity}
    only = args.only.split(",")
    for phase, lq in (("decode", 1), ("prefill", args.prefill)):
        q = q_all[:, -lq:]
        keep, _ = centroid_ops.cluster_keep(q, index["centroids"], index["counts"], scale, threshold, args.hkv,
                                            step=code_step(index))
        sel = expand_groups(keep, index["key_starts"], lc, DENSE_TAIL)
        out[f"{phase}_kept_fraction"] = round(float(sel.counts().double().mean()) / args.length, 4)
        if f"{phase}_lookup" in only:
            base = centroid_ops.default_config(dev, lq, HEAD_DIM, num_centroids=index["centroids"].shape[1],
                                             units=args.hkv)
            if lq > 1 and args.score_only:  # the score pass's tiles and warps, the denominator pass at its default
                configs = [replace(base, score_block_m=sm, score_block_c=sc, score_warps=sw)
                           for sm, sc, sw in ((32, 256, 4), (32, 128, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4),
                                              (64, 128, 4), (128, 128, 8), (64, 128, 8), (128, 256, 8), (256, 64, 8))]
            elif lq > 1:  # the denominator pass's tiles x the score pass's tiles
                configs = [replace(base, block_m=m, block_c=c, num_warps=w, num_stages=st, score_block_m=sm,
                                   score_block_c=sc, score_warps=sw)
                           for (m, c, w), (sm, sc, sw), st in itertools.product(
                               ((64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8), (128, 256, 8), (64, 64, 4)),
                               ((128, 128, 4), (128, 256, 8), (64, 128, 8)), (3,))]
            else:  # centroid blocks and stages of the denominator pass, the score pass's block and stages
                configs = [replace(base, block_c=c, num_stages=st, score_block_c=sc, score_stages=sst)
                           for c, st, sc, sst in itertools.product((64, 256), (2, 3), (64, 128, 256), (1, 2))]

            def select(cfg=None):
                return centroid_ops.cluster_select(q, index["centroids"], index["counts"], scale, threshold, args.hkv,
                                                 index["key_starts"], lc, DENSE_TAIL, step=code_step(index), config=cfg)

            out[f"{phase}_lookup_default"] = {"config": vars(base), "ms": round(bench_graph(select), 4)}
            out[f"{phase}_lookup"] = _sweep(f"{phase}_lookup", configs, select)
        if f"{phase}_attn" in only:
            base = sparse_ops.plan(q.shape[0] // args.hkv * lq, args.hkv, HEAD_DIM, sel.indices.numel(), sel.num_keys,
                                      sparse_ops.num_sms(dev))
            out[f"{phase}_attn_default"] = {"config": vars(base), "ms": round(bench_graph(
                lambda: sparse_ops.sparse_attention(q, kp, vp, sel, scale)), 4)}
            if lq == 1:
                sms = sparse_ops.num_sms(dev)
                grid = itertools.product((64, 128, 256, 512), (32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (2, 3))
                configs = [sparse_ops.SparseAttentionConfig(split=True, block_m=16, block_n=n, num_warps=w, num_stages=st,
                                                               chunk=c, workers=wps * sms)
                           for c, n, w, wps, st in grid if n <= c]
            else:  # packed K/V (the default), whole blocks through tensor descriptors or plain loads
                tiles = ((64, 128, 4), (64, 64, 4), (128, 128, 8), (128, 64, 8), (128, 64, 4), (128, 32, 4))
                grid = itertools.product(tiles, (2, 3, 4), (True, False))
                configs = [sparse_ops.SparseAttentionConfig(split=False, block_m=m, block_n=n, num_warps=w,
                                                               num_stages=st, gather=True, tma=tma)
                           for (m, n, w), st, tma in grid]
            out[f"{phase}_attn"] = _sweep(f"{phase}_attn", configs,
                                          lambda cfg: sparse_ops.sparse_attention(q, kp, vp, sel, scale, config=cfg))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
