"""Every registered method's settings, their defaults and the ranges of their numbers, as the command line's flags
(`--{method}-{setting}`) see them: read here, with no method (and no torch) loaded, so that a flag of the wrong type,
name or range is refused before anything heavy loads. tests/app/test_cli.py holds this table to the registry's
settings, each range to what the method's own settings refuse, and each relation between two settings (ORDERED:
duo's train_min_tokens <= train_max_tokens) to what they refuse too."""

from __future__ import annotations

from dataclasses import dataclass

METHOD_SETTINGS: dict[str, dict[str, bool | int | float | str]] = {
    "full": {},
    "squeeze": {
        "centroid_ratio": 0.05, "kmeans": "query", "kmeans_iters": 20, "seed": 0, "group": "kv",
        "prefill_threshold": "calibrated", "centroids": "int8",
    },
    "hsqueeze": {
        "level1_ratio": 0.01, "level1_prune": 0.5, "kmeans": "query", "kmeans_iters": 20, "seed": 0, "group": "kv",
        "prefill_threshold": "calibrated", "centroids": "int8", "level1": "cut",
    },
    "quest": {
        "page_size": 16, "group": "kv", "bounds": "int8",
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


@dataclass(frozen=True)
class Range:
    """The values a number setting takes: from `low` (None: no bound; `low_open`: excluded) to `high` (likewise);
    pow2: a power of two; zero: 0 allowed too (an "off" value below the range)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    pow2: bool = False
    zero: bool = False

    def allows(self, value: float) -> bool:
        if self.zero and value == 0:
            return True
        if self.pow2 and (value < 1 or int(value) != value or int(value) & (int(value) - 1)):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def text(self) -> str:
        """'in (0, 1]', 'at least 1', 'above 0', 'a power of two', '0 or at least 1'."""
        if self.pow2:
            return "a power of two"
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is None and self.high is None:
            return "any number"
        said = f"{'above' if self.low_open else 'at least'} {self.low:g}" if self.low is not None else \
            f"{'below' if self.high_open else 'at most'} {self.high:g}"
        return f"0 or {said}" if self.zero else said


SHARE = Range(0, 1, low_open=True)  # (0, 1]
COUNT = Range(1)  # a whole number of things, at least one
SIZE = Range(0)  # tokens or a weight: none or more
RATE = Range(0, low_open=True)  # a learning rate

RANGES: dict[tuple[str, str], Range] = {
    ("squeeze", "centroid_ratio"): SHARE, ("squeeze", "kmeans_iters"): COUNT,
    ("hsqueeze", "level1_ratio"): SHARE, ("hsqueeze", "level1_prune"): Range(0, 1, high_open=True),
    ("hsqueeze", "kmeans_iters"): COUNT,
    ("quest", "page_size"): Range(pow2=True),
    ("duo", "sink"): SIZE, ("duo", "recent"): SIZE, ("duo", "train_steps"): COUNT, ("duo", "train_lr"): RATE,
    ("duo", "train_reg"): SIZE, ("duo", "train_sink"): SIZE, ("duo", "train_recent"): SIZE,
    ("duo", "train_min_tokens"): COUNT, ("duo", "train_max_tokens"): COUNT, ("duo", "train_passkeys"): Range(1, 10),
    ("duo", "train_words"): COUNT,
    ("duo-squeeze", "retrieval"): Range(0, 1), ("duo-squeeze", "sink"): SIZE, ("duo-squeeze", "recent"): SIZE,
    ("saap", "buckets"): COUNT, ("saap", "hidden"): COUNT, ("saap", "max_bucket"): Range(1, zero=True),
    ("saap", "train_prompts"): COUNT, ("saap", "train_tokens"): Range(64), ("saap", "train_queries"): COUNT,
    ("saap", "train_kmeans_iters"): COUNT, ("saap", "train_steps"): COUNT, ("saap", "train_batch"): COUNT,
    ("saap", "train_lr"): RATE,
}


# (method, a, b): setting a may not exceed setting b (each at its default where not given)
ORDERED: tuple[tuple[str, str, str], ...] = (("duo", "train_min_tokens", "train_max_tokens"),)


def unordered(given: dict[str, dict]) -> str | None:
    """What is wrong with the settings `given` (method -> {setting: value}) taken with the others' defaults: the
    first ORDERED pair out of order, said in the flags' words; None where all are in order."""
    for method, low, high in ORDERED:
        mine = given.get(method, {})
        if low not in mine and high not in mine:
            continue
        a, b = mine.get(low, METHOD_SETTINGS[method][low]), mine.get(high, METHOD_SETTINGS[method][high])
        if a > b:
            flag = lambda name: f"--{method}-{name.replace('_', '-')}"  # noqa: E731
            return f"{flag(low)} ({a}) may not exceed {flag(high)} ({b})"
    return None
