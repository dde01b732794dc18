"""The engine: a document as a model's fixed context, answered with sparse attention over it.

Its rooms, each importing only those listed before it (tests/test_rooms.py):
    text/       documents and chats as tokens; real text for haystacks and training
    index/      the math an index is built from (k-means, thresholds, RoPE undone) and the stored tensors' names
    attention/  one attention step: the function transformers calls, the fixed-context cache, the contract a
                method fulfils for it, the KV budget, the follow rows, the turn's statistics
    model/      the model: loading, the forward passes (prefill, generation, CUDA graphs), sampling
    methods/    the sparse-attention methods, a module or a folder each, and their registry
    context/    a document's context: ingest, and the session that answers its turns
    serve/      what the app and the command line use: the engine, jobs, turns, explanations
    bench/      benchmarks and `squeeze eval`
"""
