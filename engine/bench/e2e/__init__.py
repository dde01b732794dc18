"""End-to-end benchmark: ingest, question prefill and decode through the engine's own API, beside plain transformers.

    python -m engine.bench.e2e [--shape llama3-8b | --model M] [--context 131072] [--methods full,squeeze,hsqueeze]
                               [--sparsity 0.9] [--steps 32] [--questions 64,1024] [--prefill-turns 3]
                               [--peer/--no-peer] [--out FILE]
                               [--gpus 1] [--graphs/--no-graphs] [--compile [both]] [--profile FILE]

A random-weight model of a named shape (SHAPES; bf16 on CUDA, fp32 on the CPU, seed 0) or a real one (`--model`)
reads `--context` random token ids (or `--document`, tokenized with the model's tokenizer) through
`engine.context.ingest.ingest_tokens`, timed by stage after an untimed ingest of its first WARMUP_CONTEXT tokens (Triton
compiles and tunes there); `engine.context.session.ContextSession` opens the context; then each method answers turns
through `engine.model.generate.generate_tokens` with the product's TurnRecorder on: `--prefill-turns` short turns per
question length (the prefill's median and fastest) and one turn of `--steps` decode steps after the first length (the
median step, the first WARMUP_STEPS left out). In the same run:
- the peer (CUDA only): plain transformers with SDPA on the engine model's own tensors (shared, not copied), a
  StaticCache, chunked prefill of the same ids, then greedy decode eager and under torch.compile(mode=
  "reduce-overhead");
- the byte bound of a decode step: the bytes it must read (the weights, the global layers' fixed-context K/V times
  the decode steps' KV budget, the sliding layers' windows, the turn's new K/V) over the measured copy bandwidth;
- ratios against the engine's `full` and the peer's best decode, and of the ingest against the peer's prefill.
Weights are random: the figures are about time, not answers; so are what a method learns per model (duo's gates are
its stand-ins, Method.stand_in: settings.stand_in lists those methods). Progress goes to stderr; ends with one JSON line on
stdout. The exit status is 1 when a phase failed (its "error" is in the JSON).

Its modules: runner.py (the engine's phases), peer.py (plain transformers), bound.py (the byte bound), report.py
(the ratios, the JSON, the command line), models.py (the shapes and their placement), timing.py.
"""
