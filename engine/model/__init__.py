"""The model: loading it (load.py; catalog.py the names known before anything heavy loads), its forward passes
over a fixed context (prefill.py, generate.py, graph.py: decode steps replayed from CUDA graphs, compiled.py),
and how the next token is chosen (sampling.py)."""
