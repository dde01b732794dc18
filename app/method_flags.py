"""Every registered method's settings and their defaults, as the command line's flags (`--{method}-{setting}`) see
them: read here, with no method (and no torch) loaded, so that a flag of the wrong type or name is refused before
anything heavy loads. tests/app/test_cli.py holds this table to the registry's settings."""

from __future__ import annotations

METHOD_SETTINGS: dict[str, dict[str, bool | int | float | str]] = {
    "full": {},
    "squeeze": {
        "centroid_ratio": 0.05, "kmeans": "query", "kmeans_iters": 20, "seed": 0, "group": "kv",
        "prefill_threshold": "calibrated", "centroids": "int8",
    },
    "hsqueeze": {
        "level1_ratio": 0.01, "level1_prune": 0.5, "kmeans": "query", "kmeans_iters": 20, "seed": 0, "group": "kv",
        "prefill_threshold": "calibrated", "centroids": "int8",
    },
    "quest": {
        "page_size": 16, "group": "kv", "bounds": "exact",
    },
    "duo": {
        "sink": 64, "recent": 256, "train_steps": 100, "train_lr": 0.02, "train_reg": 0.05, "train_sink": 128,
        "train_recent": 256, "train_min_tokens": 1000, "train_max_tokens": 2048, "train_passkeys": 5,
        "train_words": 16, "seed": 0,
    },
    "duo-squeeze": {
        "retrieval": 0.5, "sink": 64, "recent": 256,
    },
    "saap": {
        "buckets": 256, "hidden": 128, "dense_first_layer": True, "rank": "per_key", "size_prior": True,
        "max_bucket": 4.0, "train_prompts": 4, "train_tokens": 4096, "train_queries": 512, "train_kmeans_iters": 10,
        "train_steps": 2000, "train_batch": 256, "train_lr": 0.001, "train_long_range": False, "seed": 0,
    },
}
