"""A decode step's attention at one layer: the union kernel against the kernels it replaces.

    python -m engine.bench.union [--shape llama3-8b] [--context 131072] [--budget 0.1] [--follow 72] [--run 64]
                                 [--sweep] [--batch B] [--out FILE]

One global layer of the shape (random bf16 K/V, Hq/Hkv heads), one query token: a selection of `budget` of the
keys per KV head in contiguous runs (a clustered layout's ranges), `follow` follow rows through a layout order, and
a new-token buffer with `--new` visible slots. Times, replayed from CUDA graphs, (a) kernels.union_ops
(one split-KV launch over the selection, the new tokens and the follow rows, one merge into the model's layout) and
(b) the sparse, follow and causal kernels in turn (kernels.union_ops.union_in_turn: four launches), for the
selection and for every key (full attention); checks that both give the same output. Prints one JSON document (us
per call), with the registers and spills of the kernels where Triton reports them. `--sweep` also times the union
kernel over the selection at every split-KV tiling of SWEEP (kernels.sparse_ops.DecodeTiles: keys per inner step,
warps, pipeline stages, workers per SM), fastest first, each checked against the default's output. `--batch B` also
times B sequences over contexts of their own (a batched decode step's attention at one layer): one shared launch of
each union kernel against a launch each (`batched`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import asdict

import torch

from engine.bench.e2e.models import SHAPES
from engine.bench.e2e.report import emit
from engine.bench.kernels import bench_graph
from kernels import sparse_ops, union_ops
from kernels.backend import TRITON
from kernels.jit.sparse import sparse_attn_fwd_kernel
from kernels.jit.union import union_attn_fwd_kernel
from kernels.selection import FollowRows, Selection


def clustered_selection(hkv: int, n: int, budget: float, run: int, gen: torch.Generator,
                        device: torch.device) -> Selection:
    """`budget` of each KV head's n keys in runs of `run` consecutive keys (random runs, sorted)."""
    runs = n // run
    keep = torch.rand(hkv, runs, generator=gen).argsort(dim=1)[:, : max(1, int(runs * budget))].sort(dim=1).values
    keys = (keep[:, :, None] * run + torch.arange(run)).reshape(hkv, -1)  # [Hkv, kept]
    indptr = torch.arange(hkv + 1) * keys.shape[1]
    return Selection(indptr.to(device), keys.reshape(-1).to(device, torch.int32), n)


# The tilings --sweep times: keys per inner step x warps x pipeline stages x workers per SM
SWEEP = {"block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4), "workers_per_sm": (2, 3, 4)}


def sweep(call, want: torch.Tensor) -> list[dict]:
    """call(tiles) -> the union's output [Hq, Lq, D]: each tiling of SWEEP timed from a CUDA graph (us), fastest
    first; a tiling that fails to compile or run is listed with its error, one whose output differs from `want`
    by more than bf16's rounding with its difference."""
    rows = []
    for values in itertools.product(*SWEEP.values()):
        tiles = sparse_ops.DecodeTiles(**dict(zip(SWEEP, values)))
        entry = dict(zip(SWEEP, values))
        try:
            error = float((call(tiles).float() - want).abs().max())
            entry.update(union_us=round(bench_graph(lambda t=tiles: call(t)) * 1e3, 2), max_abs_diff=error,
                         same=error <= 2e-2)
        except Exception as exc:  # noqa: BLE001 - a tiling the GPU cannot run is reported, not fatal
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(entry)
    return sorted(rows, key=lambda r: r.get("union_us", float("inf")))


def registers(kernel) -> list[dict]:
    """(registers, spills) of each compiled specialisation of a @triton.jit kernel, where Triton exposes them."""
    found = []
    try:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                found.append({"registers": compiled.n_regs, "spills": compiled.n_spills})
    except (AttributeError, IndexError, TypeError):
        pass
    return found


def batched(batch: int, shape: dict, n: int, budget: float, run: int, new: int, gen: torch.Generator,
            device: torch.device) -> dict:
    """`batch` sequences, each over K/V of n keys of its own with its own selection and new-token buffers, their
    query positions sliced out of one [batch] tensor as a captured batched step's are (engine.model.batch_graph):
    us of union_attention_batch (one split and one merge launch for all) and of a union_attention each, one after
    another, for the selections and for every key; both checked against each other."""
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    positions = torch.full((batch,), n + new - 1, device=device)
    q = torch.randn(batch, hq, 1, d, device=device, dtype=torch.bfloat16)
    out = torch.empty(batch, 1, hq, d, device=device, dtype=torch.bfloat16)
    seqs = [dict(k=torch.randn(hkv, n, d, device=device, dtype=torch.bfloat16),
                 v=torch.randn(hkv, n, d, device=device, dtype=torch.bfloat16),
                 k_new=torch.randn(hkv, 256, d, device=device, dtype=torch.bfloat16),
                 v_new=torch.randn(hkv, 256, d, device=device, dtype=torch.bfloat16),
                 selection=clustered_selection(hkv, n, budget, run, gen, device)) for _ in range(batch)]
    keep: list = []  # the tables' host copies, alive as long as the graphs that captured their upload
    found = {}
    for case, sparse in (("selection", True), ("every key", False)):
        calls = [union_ops.UnionCall(q[b], s["k"], s["v"], s["selection"] if sparse else None, d ** -0.5, s["k_new"],
                                     s["v_new"], positions[b : b + 1], n, None, out[b].transpose(0, 1))
                 for b, s in enumerate(seqs)]

        def shared(calls=calls):
            union_ops.union_attention_batch(calls, keep)
            return out

        def each(calls=calls):
            for call in calls:
                union_ops.union_attention(*call.args())
            return out

        a = shared().float().clone()
        error = float((each().float() - a).abs().max())
        found[case] = {"shared_us": round(bench_graph(shared) * 1e3, 2), "each_us": round(bench_graph(each) * 1e3, 2),
                       "max_abs_diff": error}
    return {"sequences": batch, **found}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.union", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="llama3-8b")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--follow", type=int, default=72, help="follow rows (a decode step: 8 of its own, 64 carried)")
    parser.add_argument("--new", type=int, default=100, help="new-token slots the query sees")
    parser.add_argument("--registers", default=f"{union_ops.MAX_REGISTERS},0",
                        help="kernels.union_ops.MAX_REGISTERS values to time (0: no cap)")
    parser.add_argument("--run", type=int, default=64, help="keys per run of the selection (a cluster, a page)")
    parser.add_argument("--sweep", action="store_true", help="also time the split launch's tilings (SWEEP)")
    parser.add_argument("--batch", type=int, default=0,
                        help="also time this many sequences over contexts of their own: one shared launch of each "
                             "union kernel (union_attention_batch) against a launch each, one after another")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine.bench.union needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    n, slots = args.context, 4096
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(hkv, n, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    k_new, v_new = (torch.randn(hkv, slots, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(hq, 1, d, device=device, dtype=torch.bfloat16)
    k_start = n
    q_pos = torch.tensor([k_start + args.new - 1], device=device)
    selection = clustered_selection(hkv, n, args.budget, args.run, gen, device)
    indexed = n - 64
    order = torch.stack([torch.randperm(indexed, generator=gen) for _ in range(hkv)]).to(device, torch.int32)
    follow = FollowRows(torch.randperm(indexed, generator=gen)[: args.follow].to(device), 0, indexed, order)
    out = torch.empty(1, hq, d, device=device, dtype=torch.bfloat16).transpose(0, 1)
    scale = d ** -0.5
    result: dict = {"bench": "union", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "shape": args.shape, "context": n, "budget": args.budget, "follow_rows": args.follow,
                    "new_tokens": args.new, "run": args.run, "cases": {}}
    caps = [int(x) for x in args.registers.split(",")]
    for (case, sel, rows), cap in ((c, cap) for c in (("selection", selection, follow), ("every key", None, None))
                                   for cap in caps):
        union_ops.MAX_REGISTERS = cap
        def one(sel=sel, rows=rows):
            return union_ops.union_attention(q, k, v, sel, scale, k_new, v_new, q_pos, k_start, rows, out=out)

        def in_turn(sel=sel, rows=rows):
            return union_ops.union_in_turn(TRITON, q, k, v, sel, scale, k_new, v_new, q_pos, k_start, rows, out)

        a = one()[0].float().clone()
        b = in_turn()[0].float().clone()
        error = float((a - b).abs().max())
        result["cases"][f"{case}, registers {cap or 'uncapped'}"] = {
            "union_us": round(bench_graph(one) * 1e3, 2), "in_turn_us": round(bench_graph(in_turn) * 1e3, 2),
            "max_abs_diff": error}
    if args.sweep:
        union_ops.MAX_REGISTERS = caps[0]

        def tiled(tiles):
            return union_ops.union_attention(q, k, v, selection, scale, k_new, v_new, q_pos, k_start, follow,
                                             out=out, tiles=tiles)[0]

        result["default_tiles"] = asdict(sparse_ops.DecodeTiles())
        result["sweep"] = sweep(tiled, tiled(sparse_ops.DecodeTiles()).float().clone())
    if args.batch:
        union_ops.MAX_REGISTERS = caps[0]
        result["batch"] = batched(args.batch, shape, n, args.budget, args.run, args.new, gen, device)
    result["registers"] = {"union_attn_fwd_kernel": registers(union_attn_fwd_kernel),
                           "sparse_attn_fwd_kernel": registers(sparse_attn_fwd_kernel)}
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
