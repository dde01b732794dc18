"""One attention step: the function transformers calls at every layer (function.py) over the fixed-context cache
(cache.py, rows.py), the contract a method fulfils for it (method.py), the KV budget it reads (budget.py), the
follow rows every sparse step adds (follow.py) and the statistics a turn records (stats.py)."""
