"""A decoder layer's matrix-vector products at batch 1, as separate projections and as the engine fuses them.

    python -m engine.bench.gemv [--shape llama3-8b] [--out FILE]

Builds every layer's projection weights of the shape (random, bf16, on the GPU: a copy per layer, so nothing is
served from L2), then times one token through all layers' products in a CUDA graph, the products as transformers
defines them (q, k, v, o, gate, up, down) and as engine.model.fused runs them (q/k/v and gate/up each one product
over the concatenated rows), and each projection on its own; each beside its byte bound at the copy bandwidth
measured in the same run (engine.bench.e2e.bound). Prints one JSON document (ms per token through all layers).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.nn import functional as F

from engine.bench.e2e.bound import copy_bandwidth
from engine.bench.e2e.models import SHAPES
from engine.bench.e2e.report import emit
from engine.bench.kernels import bench_graph
from kernels.gemv_ops import GemvConfig, gemv


def layer_weights(shape: dict, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Per layer: {q, k, v, o, gate, up, down} [out, in] and the fused {qkv, gate_up}."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    sizes = {"q": (heads * head_dim, hidden), "k": (kv_heads * head_dim, hidden), "v": (kv_heads * head_dim, hidden),
             "o": (hidden, heads * head_dim), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = []
    for _ in range(shape["num_hidden_layers"]):
        w = {name: torch.randn(*size, generator=gen, device=device, dtype=dtype) * 0.02 for name, size in sizes.items()}
        w["qkv"] = torch.cat([w.pop("q"), w.pop("k"), w.pop("v")])
        w["gate_up"] = torch.cat([w.pop("gate"), w.pop("up")])
        q_rows, k_rows = sizes["q"][0], sizes["k"][0]
        w["q"], w["k"], w["v"] = w["qkv"].split([q_rows, k_rows, k_rows])
        w["gate"], w["up"] = w["gate_up"][:inter], w["gate_up"][inter:]
        layers.append(w)
    return layers


SWEEP = [GemvConfig(block_n=n, block_k=k, num_warps=w, num_stages=st)
         for n in (8, 16, 32) for k in (256, 512, 1024) for w in (4, 8) for st in (1, 3)]


def sweep(layers: list[dict[str, torch.Tensor]], inputs: dict[str, torch.Tensor], x: torch.Tensor,
          bandwidth: float) -> dict:
    """Per fused projection (qkv, o, gate_up, down) through all layers in a CUDA graph: the Triton kernel's ms at
    each SWEEP configuration, its best, and the byte bound."""
    out = {}
    for name in ("qkv", "o", "gate_up", "down"):
        nbytes = layers[0][name].numel() * layers[0][name].element_size() * len(layers)
        bound = nbytes / bandwidth / 1e6
        timings = {}
        for cfg in SWEEP:
            def fn(cfg=cfg):
                for w in layers:
                    gemv(inputs.get(name, x), w[name], config=cfg)
            key = f"{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
            try:
                timings[key] = round(bench_graph(fn, rep_ms=30), 4)
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is reported, not fatal
                timings[key] = str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
        best = min((v, k) for k, v in timings.items() if isinstance(v, float))
        out[name] = {"bound_ms": round(bound, 4), "best": best[1], "best_ms": best[0],
                     "best_x_bound": round(best[0] / bound, 3), "ms": timings}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "tiny"], default="llama3-8b")
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true",
                        help="also time kernels/gemv_ops.py's kernel at every SWEEP configuration, per projection")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("engine.bench.gemv needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    shape = SHAPES[args.shape]
    layers = layer_weights(shape, device, torch.bfloat16)
    x = torch.randn(1, shape["hidden_size"], device=device, dtype=torch.bfloat16)
    m = torch.randn(1, shape["intermediate_size"], device=device, dtype=torch.bfloat16)
    inputs = {"down": m}
    bandwidth = copy_bandwidth(device)  # GB/s

    def run(names: list[str]):
        def fn():
            for w in layers:
                for name in names:
                    F.linear(inputs.get(name, x), w[name])
        return fn

    cases = {"separate": ["q", "k", "v", "o", "gate", "up", "down"], "fused": ["qkv", "o", "gate_up", "down"],
             **{name: [name] for name in ("q", "k", "o", "qkv", "gate", "gate_up", "down")}}
    out: dict = {"bench": "gemv", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "shape": args.shape, "layers": shape["num_hidden_layers"], "bandwidth_gbs": round(bandwidth, 1),
                 "cases": {}}
    for case, names in cases.items():
        ms = bench_graph(run(names))
        nbytes = sum(layers[0][n].numel() * layers[0][n].element_size() for n in names) * len(layers)
        bound = nbytes / bandwidth / 1e6
        out["cases"][case] = {"ms": round(ms, 3), "bound_ms": round(bound, 3), "x_bound": round(ms / bound, 3),
                              "launches": len(names) * len(layers)}
    if args.sweep:
        out["triton"] = sweep(layers, inputs, x, bandwidth)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
