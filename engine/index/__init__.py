"""The math indexes are built from: k-means (kmeans.py), calibrated thresholds (thresholds.py), RoPE undone
(rope.py); and the names of a context's stored tensors (artifacts.py)."""
