"""How long DuoAttention's gate training takes (engine.methods.duo.gates) on a model shape: `python -m engine.bench.gates
--shape llama3-8b --steps 8 --max-tokens 32768` prints JSON (seconds per step, peak memory).

A random-weight shape (engine.bench.e2e.models.SHAPES) has no tokenizer: its sequences are made with a word-level stand-in
(each word one id) over random ids for the haystack, so the gates it learns mean nothing; the time of a step
(the context's prefill, a batch of two over the new tokens with the mix in every global layer, the backward pass
through the layers after the first global one) is what is measured. `--model` times a real model on the corpus.
"""

from __future__ import annotations

import argparse
import time
import zlib

import torch

from engine.bench.e2e.models import SHAPES, device_name, open_model, peak_gib, reset_peaks, training_corpus
from engine.bench.e2e.report import emit
from engine.methods.duo.data import GateData
from engine.methods.duo.gates import GateTraining, train_gates


class WordIds:
    """A tokenizer stand-in for random-weight shapes: one id per word (its CRC32 modulo `vocab`, + 2), BOS = 1; about
    as many tokens per passkey and question as a real subword tokenizer gives."""

    bos_token_id = 1

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [zlib.crc32(w.encode()) % (self.vocab - 2) + 2 for w in text.split()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.gates", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama3-8b")
    parser.add_argument("--model", default=None, help="a real model instead (its corpus: engine.text.corpus)")
    parser.add_argument("--steps", type=int, default=8, help="steps timed (after one untimed)")
    parser.add_argument("--min-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32768)
    parser.add_argument("--passkeys", type=int, default=10)
    parser.add_argument("--words", type=int, default=32)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lm = open_model(None if args.model else args.shape, args.model, args.device)
    corpus = training_corpus(lm, 4 * args.max_tokens)
    if lm.tokenizer is None:  # the passkeys and questions need one
        lm.tokenizer = WordIds(lm.model.config.vocab_size)
    data = GateData(min_tokens=args.min_tokens, max_tokens=args.max_tokens, passkeys=args.passkeys, words=args.words)
    times: list[float] = []
    stamp = [0.0]

    def step(_result) -> None:
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        now = time.perf_counter()
        times.append(now - stamp[0])
        stamp[0] = now

    reset_peaks(lm)
    stamp[0] = time.perf_counter()
    gates = train_gates(lm, GateTraining(steps=args.steps + 1, data=data), corpus, progress=step)
    timed = times[1:]  # the first step compiles and warms the allocator
    doc = {"bench": "gates", "model": lm.model_id, "device": device_name(lm.device),
           "weights": "random" if args.model is None else "real",
           "global_layers": len(lm.global_layers), "kv_heads": lm.num_kv_heads,
           "tokens": [args.min_tokens, args.max_tokens], "passkeys": args.passkeys, "words": args.words,
           "steps_timed": len(timed), "seconds_per_step": round(sum(timed) / max(1, len(timed)), 3),
           "seconds_per_step_max": round(max(timed, default=0.0), 3),
           "seconds_for_2000_steps": round(2000 * sum(timed) / max(1, len(timed)), 1),
           "peak_gib": peak_gib(lm),
           "gates_mean": round(float(gates.mean()), 4)}
    emit(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
