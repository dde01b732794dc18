"""Settings that decide what an ingest builds; they are part of the cache key of a context."""

from __future__ import annotations

from dataclasses import asdict, dataclass

DEFAULT_DENSE_TAIL = 100  # last context tokens: kept dense, and their queries calibrate the threshold (paper, app. C)
PROMPT_VERSION = 1  # bump when the document/question template changes: old contexts are then not reused
INDEX_VERSION = 3  # bump when how indexes are built changes (2: k-means++ seeding; 3: level-2 ids grouped by parent)
# Calibrated sparsities: a requested sparsity maps to its threshold by interpolation between these points.
SPARSITY_GRID = (0.0, 0.3, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.97, 0.98, 0.99)
LEVEL1_PRUNE = 0.5  # hierarchical: the level-1 threshold rules out about this fraction of the keys (paper, 6.1)
PREFILL_THRESHOLDS = ("calibrated", "decode")  # IndexSettings.prefill_threshold


@dataclass(frozen=True)
class IndexSettings:
    """How the fixed context is indexed.

    centroid_ratio: level-2 (single-level) centroids as a fraction of the clustered keys (paper: 5%)
    level1_ratio:   hierarchical level-1 centroids as a fraction of the clustered keys (paper: 1%)
    dense_tail:     last context tokens kept dense and used as calibration queries
    kmeans_iters:   maximum Lloyd iterations
    level1_prune:   hierarchical: fraction of the keys the level-1 threshold rules out (paper: about half)
    seed:           k-means initialisation seed
    group:          "kv": one selection per KV head from the mean of its query heads' scores (each selected key
                    is read once per GQA group); "query": one selection per query head (the paper's MHA form)
    prefill_threshold: the threshold(s) of the question's prefill lookup (Lq > 1 tokens, scored by
                    max(mean over the tokens of S, the last token's S)): "decode": the decode step's (the default;
                    the union of the two terms then keeps up to twice 1 - s of the keys); "calibrated": their own,
                    calibrated on that score over windows of the calibration queries, so that a sparsity s keeps
                    about 1 - s in the prefill too (it lost the passkey at 90% in 2/15 draws per method where
                    "decode" lost none: README, "Prefill lookup")
    """

    centroid_ratio: float = 0.05
    level1_ratio: float = 0.01
    dense_tail: int = DEFAULT_DENSE_TAIL
    kmeans_iters: int = 20
    level1_prune: float = LEVEL1_PRUNE
    seed: int = 0
    group: str = "kv"
    prefill_threshold: str = "decode"

    def __post_init__(self) -> None:
        if not 0 < self.centroid_ratio <= 1:
            raise ValueError(f"centroid_ratio must be in (0, 1], got {self.centroid_ratio}")
        if not 0 < self.level1_ratio <= self.centroid_ratio:
            raise ValueError(f"level1_ratio must be in (0, centroid_ratio={self.centroid_ratio}], got {self.level1_ratio}")
        if self.dense_tail < 1:
            raise ValueError(f"dense_tail must be at least 1, got {self.dense_tail}")
        if not 0 <= self.level1_prune < 1:
            raise ValueError(f"level1_prune must be in [0, 1), got {self.level1_prune}")
        if self.kmeans_iters < 1:
            raise ValueError(f"kmeans_iters must be at least 1, got {self.kmeans_iters}")
        if self.group not in ("kv", "query"):
            raise ValueError(f"group must be 'kv' or 'query', got {self.group!r}")
        if self.prefill_threshold not in PREFILL_THRESHOLDS:
            raise ValueError(f"prefill_threshold must be one of {PREFILL_THRESHOLDS}, got {self.prefill_threshold!r}")

    def as_dict(self) -> dict:
        """The settings as stored and as part of a context's cache key. prefill_threshold is left out at its default,
        with which the stored artifacts are what they were before the option existed (so those caches stay valid);
        "calibrated" adds the prefill thresholds, and its own key."""
        out = asdict(self)
        if out["prefill_threshold"] == "decode":
            del out["prefill_threshold"]
        return {**out, "prompt_version": PROMPT_VERSION, "index_version": INDEX_VERSION}

    def num_centroids(self, clustered: int, ratio: float | None = None) -> int:
        """Centroids for `clustered` keys at `ratio` (default: centroid_ratio): at least 1, at most `clustered`."""
        return max(1, min(clustered, round(clustered * (self.centroid_ratio if ratio is None else ratio))))
