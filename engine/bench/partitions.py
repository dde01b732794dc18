"""How long Saap's training takes (engine.methods.saap.partitions) on a model shape: `python -m engine.bench.partitions --shape
llama3-8b --prompts 2 --tokens 32768` prints JSON (seconds per stage, peak memory, the buckets' balance).

A random-weight shape (engine.bench.e2e.models.SHAPES) reads random ids (no tokenizer), so the partitions it learns mean
nothing; the time of each stage (the prompts' prefill, k-means per layer, the targets, the classifier's steps) is
what is measured. `--model` trains a real model on the corpus (engine.text.corpus).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.bench.e2e.models import SHAPES, device_name, open_model, peak_gib, reset_peaks, training_corpus
from engine.bench.e2e.report import emit
from engine.index.rope import rope_frequencies
from engine.methods.saap.partitions import PartitionTraining, imbalance, train_partitions
from engine.model.prefill import attention_scale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.partitions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b")
    parser.add_argument("--model", default=None, help="a real model instead (its corpus: engine.text.corpus)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--buckets", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lm = open_model(None if args.model else args.shape, args.model, args.device)
    training = PartitionTraining(buckets=args.buckets, hidden=args.hidden, prompts=args.prompts, tokens=args.tokens,
                                 queries=args.queries, steps=args.steps, batch=args.batch)
    corpus = training_corpus(lm, args.prompts * args.tokens)
    layers = list(lm.global_layers)
    types = getattr(lm.config, "layer_types", None)
    inv_freq = {i: rope_frequencies(lm.model, types[i] if types else None, lm.head_dim) for i in layers}
    scale = {i: attention_scale(lm, i) for i in layers}
    stages: dict[str, float] = {}
    last = {"stage": None, "t": time.perf_counter()}
    losses: list[float] = []

    def report(r) -> None:
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        now = time.perf_counter()
        if last["stage"] is not None:
            stages[last["stage"]] = stages.get(last["stage"], 0.0) + now - last["t"]
        last.update(stage=r.stage, t=now)
        if r.stage.startswith("training"):
            losses.append(r.loss)

    reset_peaks(lm)
    start = time.perf_counter()
    found = train_partitions(lm, training, corpus, inv_freq, scale, progress=report)
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    total = time.perf_counter() - start
    stages[last["stage"]] = stages.get(last["stage"], 0.0) + time.perf_counter() - last["t"]
    balance = bucket_balance(found)
    doc = {"bench": "partitions", "model": lm.model_id, "device": device_name(lm.device),
           "weights": "random" if args.model is None else "real",
           "global_layers": len(layers), "kv_heads": lm.num_kv_heads, "head_dim": lm.head_dim,
           "settings": training.__dict__, "seconds": round(total, 1),
           "stages_s": {k: round(v, 1) for k, v in stages.items()},
           "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)] if losses else None,
           "peak_gib": peak_gib(lm), **balance}
    emit(doc, args.out)
    return 0


def bucket_balance(found: dict[int, dict[str, torch.Tensor]]) -> dict:
    """The training keys' spread over the buckets: the imbalance factor (engine.methods.saap.partitions.imbalance; 1 is even)
    over all layers and heads, its worst layer, and the largest bucket over the mean."""
    per_layer = [imbalance(parts["sizes"]) for parts in found.values()]
    sizes = torch.stack([parts["sizes"] for parts in found.values()]).double()  # [layers, Hkv, C]
    return {"imbalance_mean": round(sum(per_layer) / len(per_layer), 3), "imbalance_max": round(max(per_layer), 3),
            "largest_over_mean": round(float((sizes.amax(-1) / sizes.mean(-1).clamp_min(1e-9)).mean()), 2)}


if __name__ == "__main__":
    raise SystemExit(main())
