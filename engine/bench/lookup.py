"""A decode step's centroid lookup, layer after layer: with a calibrated threshold against a cut at a number of keys.

    python -m engine.bench.lookup [--shape llama3-8b] [--context 131072] [--budget 0.1] [--batch B]
                                  [--tiles C/S/SC,...] [--out FILE]

Every global layer of the shape gets its own index (one-byte centroid codes, 5% of the keys; cluster sizes skewed:
each key's label the smaller of two uniform ones) and query, so the layers' centroids stream from memory as in a
decode step rather than from the L2 cache a single repeated lookup would keep them in. Times, replayed from one
CUDA graph over all layers, `kernels.centroid_ops.cluster_select` (the lookup's passes and the expansion into
positions) (a) at a threshold, (b) with `keys=`: the budget's share of every KV head's keys, asked as a
KeyCount 64 higher less 64 listed follow positions (worked out on the device, as a step's is), (c) that cut
with the denominator pass reading its centroids only after its wait on the queries (LookupConfig.read_ahead off),
and (d) that cut with both passes in one launch (each layer's lookup given counters of its own: `sync`), without
and with a block of centroids read ahead of the wait (LookupConfig.one_launch_ahead), with the cut decided in the
same launch (kernels.centroid_ops.ONE_LAUNCH "cut"), and with the expansion too ("expand": the whole lookup in one
launch).
With `--batch B`, each layer has B sequences' indexes and queries (a decode step of B turns answered together) and
their cut lookups are timed in one launch of each kernel (`select_now`, BATCHED: what a shared step runs, its
tables' uploads captured with it, as a batch graph captures them) against one after another, for the default tiles
and each of `--tiles` (the denominator pass's centroid block / its pipeline stages / the score pass's centroid
block). Prints one JSON document: microseconds per layer, the kernels' time per layer from the profiler, the keys
the cut kept.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from engine.bench.e2e.models import SHAPES
from engine.bench.e2e.report import emit
from engine.bench.kernels import bench_eager, bench_graph
from engine.methods.squeeze import SqueezeSettings, num_centroids
from kernels import centroid_ops
from kernels.layout import group_starts
from kernels.selection import KeyCount

TAIL = 32  # dense tail positions per KV head
FOLLOW = 64  # listed positions taken out of the keys, as a step's follow rows are


def layer_index(hkv: int, n: int, d: int, gen: torch.Generator, device: torch.device) -> dict:
    """One layer's lookup inputs: centroids [Hkv, C, D] uint8 codes with step [Hkv, D], counts [Hkv, C] and starts
    [Hkv, C + 1] of n - TAIL keys (sizes skewed: the smaller of two uniform labels)."""
    c = num_centroids(n, SqueezeSettings().centroid_ratio)
    labels = torch.minimum(torch.randint(0, c, (hkv, n - TAIL), generator=gen),
                           torch.randint(0, c, (hkv, n - TAIL), generator=gen)).to(device)
    starts = group_starts(labels, c)
    return {"centroids": torch.randint(0, 256, (hkv, c, d), dtype=torch.uint8, generator=gen).to(device),
            "step": (torch.rand(hkv, d, generator=gen) * 0.04).to(device),
            "counts": (starts[:, 1:] - starts[:, :-1]).to(torch.int32), "starts": starts}


def asked_keys(budget: float, hkv: int, n: int, device: torch.device) -> KeyCount:
    """The cut's keys: `budget` of every KV head's n keys, asked as a step asks them (FOLLOW more, less FOLLOW
    listed positions within the context, worked out on the device)."""
    listed = torch.arange(FOLLOW, device=device) * (n // FOLLOW)
    return KeyCount(budget * hkv * n + FOLLOW, listed=listed, lo=0, hi=n, per_listed=1.0)


def parse_tiles(text: str) -> list[tuple[int, int, int]]:
    """"C/S/SC,..." -> [(denominator block_c, num_stages, score block_c), ...] ("" -> [])."""
    tiles = []
    for item in filter(None, text.split(",")):
        parts = item.split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"a tile is C/S/SC (three integers), got {item!r}")
        tiles.append(tuple(int(p) for p in parts))
    return tiles


def batched_cases(queries: list[list[torch.Tensor]], indexes: list[list[dict]], n: int, budget: float, scale: float,
                  default: centroid_ops.LookupConfig, tiles: list[tuple[int, int, int]]) -> dict:
    """The cut lookups of B sequences at every layer (queries[layer][b] [Hq, 1, D], indexes[layer][b]), in one
    launch of each kernel and one sequence after another, with the default config and each tile of `tiles`:
    {case: {"us_per_layer", "kernels_us_per_layer"}}."""
    from kernels.reference.centroid import SelectCall

    hkv = indexes[0][0]["counts"].shape[0]
    keys = asked_keys(budget, hkv, n, queries[0][0].device)

    def lookups(config, together, keep):
        def fn():
            for qs, ixs in zip(queries, indexes):
                pending: list = []
                for q, ix in zip(qs, ixs):
                    centroid_ops.select_later(SelectCall(q, ix["centroids"], ix["counts"], scale, 0.05, hkv,
                                                         ix["starts"], n - TAIL, TAIL, step=ix["step"], keys=keys),
                                              pending, config=config)
                    if not together:
                        centroid_ops.select_now(pending)
                centroid_ops.select_now(pending, keep)
        return fn

    layers = len(queries)
    configs = {"default": default} | {f"{c}/{s}/{sc}": replace(default, block_c=c, num_stages=s, score_block_c=sc)
                                      for c, s, sc in tiles}
    out = {}
    for name, config in configs.items():
        for together in (True, False):
            keep: list = []  # the captured uploads' host tables, kept as long as the graph
            graph = captured(lookups(config, together, keep))
            case = f"{'batched' if together else 'one_after_another'} {name}"
            out[case] = {"us_per_layer": round(bench_eager(graph.replay) * 1000 / layers, 2),
                         "kernels_us_per_layer": kernel_us(graph.replay, layers)}
    return out


def captured(fn) -> torch.cuda.CUDAGraph:
    """fn run once eagerly (its kernels compiled), then captured in a graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_us(replay, layers: int) -> dict:
    """Each kernel's GPU time per layer (us) over 20 calls of replay() (a CUDA graph's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            replay()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 20 / layers, 2) for e in prof.key_averages()
            if e.key.endswith("_kernel")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.lookup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="llama3-8b")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--budget", type=float, default=0.1, help="the cut's share of the keys")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences per layer: B > 1 times their lookups batched against one after another")
    parser.add_argument("--tiles", default="", help="with --batch: more configs to time, C/S/SC,... (the "
                        "denominator pass's centroid block / its stages / the score pass's centroid block)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    try:
        tiles = parse_tiles(args.tiles)
    except ValueError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        print("engine.bench.lookup needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    n, layers = args.context, shape["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    scale = d ** -0.5
    if args.batch > 1:
        indexes = [[layer_index(hkv, n, d, gen, device) for _ in range(args.batch)] for _ in range(layers)]
        queries = [[(torch.randn(hq, 1, d, generator=gen) * 2).to(device, torch.bfloat16) for _ in range(args.batch)]
                   for _ in range(layers)]
        default = centroid_ops.default_config(device, 1, d, torch.bfloat16, int(indexes[0][0]["counts"].shape[1]),
                                              hkv)
        emit({"bench": "lookup", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "shape": args.shape, "context": n, "layers": layers, "budget": args.budget, "batch": args.batch,
              "centroids": int(indexes[0][0]["counts"].shape[1]),
              "cases": batched_cases(queries, indexes, n, args.budget, scale, default, tiles)}, args.out)
        return 0
    indexes = [layer_index(hkv, n, d, gen, device) for _ in range(layers)]
    queries = [(torch.randn(hq, 1, d, generator=gen) * 2).to(device, torch.bfloat16) for _ in range(layers)]
    keys = asked_keys(args.budget, hkv, n, device)
    kept = []

    default = centroid_ops.default_config(device, 1, d, torch.bfloat16, int(indexes[0]["counts"].shape[1]), hkv)

    syncs = [centroid_ops.lookup_sync(device) for _ in range(layers)]

    def lookups(k, config, one_launch=False):
        def fn():
            kept.clear()
            for q, ix, sync in zip(queries, indexes, syncs):
                keep, _, _ = centroid_ops.cluster_select(q, ix["centroids"], ix["counts"], scale, 0.05, hkv,
                                                         ix["starts"], n - TAIL, TAIL, step=ix["step"], keys=k,
                                                         config=config, sync=sync if one_launch else None)
                kept.append(keep)
        return fn

    out: dict = {"bench": "lookup", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "shape": args.shape, "context": n, "layers": layers, "budget": args.budget,
                 "centroids": int(indexes[0]["counts"].shape[1]), "cases": {}}
    product_mode = centroid_ops.ONE_LAUNCH
    ahead = replace(default, one_launch_ahead=True)
    for case, k, config, mode in (("threshold", None, default, "off"), ("cut", keys, default, "off"),
                                  ("cut_read_after_wait", keys, replace(default, read_ahead=False), "off"),
                                  ("cut_one_launch", keys, default, "passes"),
                                  ("cut_one_launch_read_ahead", keys, ahead, "passes"),
                                  ("cut_one_launch_with_cut", keys, default, "cut"),
                                  ("cut_one_launch_with_expansion", keys, default, "expand")):
        centroid_ops.ONE_LAUNCH = mode  # read as the lookups are launched (and captured)
        fn = lookups(k, config, mode != "off")
        us = bench_graph(fn) * 1000 / layers
        out["cases"][case] = {"us_per_layer": round(us, 2),
                              "kernels_us_per_layer": kernel_us(captured(fn).replay, layers)}
    centroid_ops.ONE_LAUNCH = product_mode
    fn = lookups(keys, default)
    fn()  # the cut's lookups once more, eagerly: `kept` holds their keep
    held = sum(float((ix["counts"] * keep).sum()) for ix, keep in zip(indexes, kept)) / layers
    out["cases"]["cut"]["keys_kept_share"] = round(held / (hkv * n), 5)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
