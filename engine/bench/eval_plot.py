"""`squeeze eval`'s figures (PNGs through matplotlib's Agg backend: no display needed).

save_figure: one panel per measure against the KV budget, a line per method. Panels (those whose part ran): needles
as good as full attention; attention recall of decode steps, with the oracle top-k dashed; top-1 agreement with full
attention; KL(full || method) on a log scale.
save_tasks_figure: the needle tasks (`--tasks`) of several eval documents side by side, a panel each (e.g. the tuning
and the held-out essays, with and without the follow rows): a group of bars per task, a bar per method, the share of
cells as good as full attention.

    python -m engine.bench.eval_plot --tasks "LABEL=EVAL.json[+EVAL.json]" [...] --out FIGURE.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.bench.oracle import OraclePolicy

CEILING = OraclePolicy.name  # the eval's oracle top-k: its rows drawn dashed beside the methods
PANELS = (  # (summary key, title, y label, log scale)
    ("needles", "Needles", "as good as full attention", False),
    ("recall", "Attention recall (decode)", "share of full attention's weight", False),
    ("top1", "Top-1 agreement", "same next token as full attention", False),
    ("kl", "KL(full || method)", "nats per token", True),
)


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _write(plt, fig, path: str | Path) -> Path:
    """The figure written to a PNG at `path` (its folder made) and closed. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    plt = _pyplot()
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
    return _write(plt, fig, path)


def task_shares(summary: list[dict], budget: float | None = None) -> dict[str, dict[str, float]]:
    """task -> method -> the share of its cells as good as full attention, at `budget` (None: the summary's one
    budget; a ValueError where it has several): the passkey from the needles' share, every other task from its own
    entry (evaluate.py's summary rows)."""
    budgets = sorted({row["budget"] for row in summary})
    if budget is None:
        if len(budgets) != 1:
            raise ValueError(f"the summary has budgets {budgets}: name one")
        budget = budgets[0]
    out: dict[str, dict[str, float]] = {}
    for row in sorted(summary, key=lambda r: r["method"]):
        if row["budget"] != budget:
            continue
        if row.get("needles") is not None:
            out.setdefault("passkey", {})[row["method"]] = row["needles"]
        for task, got in (row.get("tasks") or {}).items():
            out.setdefault(task, {})[row["method"]] = got["as_good_as_full"]
    return out


def merged(docs: list[dict]) -> dict:
    """One eval document from several runs of one grid (each its methods): the first's fields, every run's summary
    rows (a method in several runs: the last run's)."""
    return {**docs[0], "summary": [row for doc in docs for row in doc["summary"]]}


def save_tasks_figure(panels: list[tuple[str, dict]], path: str | Path) -> Path:
    """Draw each (label, eval document) of `panels` as a panel of grouped bars (task_shares) into a PNG at `path`
    (its folder is made); a method keeps its colour in every panel, the oracle top-k is drawn grey. Returns the
    path."""
    plt = _pyplot()
    shares = [(label, task_shares(doc["summary"])) for label, doc in panels]
    if not shares or not all(s for _, s in shares):
        raise ValueError("every panel needs an eval document with needle results")
    methods = sorted({m for _, s in shares for by in s.values() for m in by} - {CEILING}) + [CEILING]
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    colors[CEILING] = "0.6"
    fig, axes = plt.subplots(1, len(shares), figsize=(4.6 * len(shares), 3.6), squeeze=False, sharey=True)
    width = 0.8 / len(methods)
    for ax, (label, by_task) in zip(axes[0], shares):
        tasks = list(by_task)
        for i, method in enumerate(methods):
            xs = [t + (i - (len(methods) - 1) / 2) * width for t in range(len(tasks))]
            ys = [by_task[task].get(method, float("nan")) for task in tasks]
            ax.bar(xs, ys, width, color=colors[method], label="oracle top-k" if method == CEILING else method)
        ax.set_xticks(range(len(tasks)), tasks)
        ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("cells as good as full attention")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(methods), fontsize=8)
    doc = panels[0][1]
    fig.suptitle(f"{doc.get('model', '?')} on {doc.get('device', '?')}: needle tasks", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return _write(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.eval_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", required=True, metavar="LABEL=FILE[+FILE]",
                        help="an eval document (squeeze eval --out) with needle tasks, and its panel's title; "
                             "FILE+FILE: the methods of several runs of one grid in one panel")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    panels = []
    for item in args.tasks:
        label, sep, file = item.rpartition("=")
        if not sep or not label:
            parser.error(f"--tasks takes LABEL=FILE, got {item!r}")
        panels.append((label, merged([json.loads(Path(f).read_text(encoding="utf-8")) for f in file.split("+")])))
    print(save_tasks_figure(panels, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
