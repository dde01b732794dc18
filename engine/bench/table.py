"""The README's kernel table, from the benchmark's JSON files (later files override earlier ones per configuration).

    python -m engine.bench.table [--sparsity 0.9] [--heads 32/8] engine/bench/results/h200-run{J,K,L}.json
"""

from __future__ import annotations

import json
import sys

KEY = ("length", "hq", "hkv", "method", "sparsity", "phase", "prefill_threshold")


def rows_of(paths: list[str]) -> tuple[dict, dict]:
    """Configuration -> (result row, run name), the last file winning; and the first file's header fields."""
    best: dict = {}
    header: dict = {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        header = header or {k: v for k, v in doc.items() if k not in ("results", "kmeans")}
        for row in doc["results"]:
            best[tuple(row.get(k) for k in KEY)] = (row, doc.get("run", path))
    return best, header


def _flex(row: dict) -> str:
    """FlexAttention over the same selection (prefill rows of runs that timed it), with its speedup over dense."""
    return f"{row['flex_ms']:.4f} ({row['flex_speedup']:.2f}x)" if "flex_ms" in row else "-"


def markdown(paths: list[str], sparsity: float | None = None, heads: str | None = None) -> str:
    best, header = rows_of(paths)
    best = {k: v for k, v in best.items() if (sparsity is None or k[4] == sparsity)
            and (heads is None or f"{k[1]}/{k[2]}" == heads)}
    lines = [
        f"{header.get('device')} · torch {header.get('torch')} · triton {header.get('triton')} · bf16 · head_dim "
        f"{header.get('head_dim')} · centroids {header.get('centroid_ratio')} · copy bandwidth "
        f"{header.get('copy_bandwidth_GBps')} GB/s",
        "",
        "| context | heads q/kv | method | sparsity | step | prefill T | kept | dense SDPA ms | lookup ms | sparse attn ms | total ms "
        "| speedup | GB/s | FlexAttention ms | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(best, key=lambda k: (k[5] != "decode", k[5], k[0], k[2], k[3], k[4], k[6] or ""))
    for key in order:
        r, run = best[key]
        lines.append(
            f"| {r['length'] // 1024}K | {r['hq']}/{r['hkv']} | {r['method']} | {r['sparsity']:.0%} | {r['phase']} | "
            f"{r.get('prefill_threshold') or '-'} | "
            f"{r['kept_fraction']:.3f} | {r['dense_ms']:.4f} | {r['lookup_ms']:.4f} | {r['sparse_ms']:.4f} | "
            f"{r['total_ms']:.4f} | **{r['speedup']:.2f}x** | {r['bandwidth_GBps']:.0f} | "
            f"{_flex(r)} | {run} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m engine.bench.table", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--sparsity", type=float, default=None)
    parser.add_argument("--heads", default=None, help="e.g. 32/8")
    args = parser.parse_args(argv)
    print(markdown(args.files, args.sparsity, args.heads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
