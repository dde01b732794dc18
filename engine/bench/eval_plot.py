"""`squeeze eval`'s figure: one panel per measure against the KV budget, a line per method (a PNG through
matplotlib's Agg backend: no display needed).

Panels (those whose part ran): needles as good as full attention; attention recall of decode steps, with the oracle
top-k dashed; top-1 agreement with full attention; KL(full || method) on a log scale.
"""

from __future__ import annotations

from pathlib import Path

from engine.bench.oracle import OraclePolicy

CEILING = OraclePolicy.name  # the eval's oracle top-k: its rows drawn dashed beside the methods
PANELS = (  # (summary key, title, y label, log scale)
    ("needles", "Needles", "as good as full attention", False),
    ("recall", "Attention recall (decode)", "share of full attention's weight", False),
    ("top1", "Top-1 agreement", "same next token as full attention", False),
    ("kl", "KL(full || method)", "nats per token", True),
)


def series(summary: list[dict], key: str) -> dict[str, tuple[list[float], list[float]]]:
    """method -> (budgets, values) of one summary key, in budget order, skipping cells without a value."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in sorted(summary, key=lambda r: (r["method"], r["budget"])):
        if row.get(key) is not None:
            xs, ys = out.setdefault(row["method"], ([], []))
            xs.append(row["budget"])
            ys.append(row[key])
    return out


def save_figure(doc: dict, path: str | Path) -> Path:
    """Draw the summary of an eval document into a PNG at `path` (its folder is made). Returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if series(doc["summary"], p[0])]
    if not panels:
        raise ValueError("the eval document has no measures to draw")
    methods = sorted({row["method"] for row in doc["summary"]} - {CEILING})
    colors = {m: f"C{i}" for i, m in enumerate(methods)}  # a method keeps its colour in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (key, title, ylabel, log) in zip(axes[0], panels):
        for method, (xs, ys) in series(doc["summary"], key).items():
            if method == CEILING:  # the ceiling of any selection at that budget
                ax.plot(xs, ys, linestyle="--", color="black", label="oracle top-k")
            else:
                ax.plot(xs, ys, marker="o", color=colors[method], label=method)
        if key in ("needles", "recall", "top1"):
            ax.set_ylim(-0.02, 1.02)
        if log:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("KV budget (share of K/V bytes read)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = {}
    for ax in axes[0]:  # one legend: every method and the oracle, wherever they were drawn
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=8)
    fig.suptitle(f"{doc.get('model', '?')} on {doc.get('device', '?')}: sparse methods against full attention",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
