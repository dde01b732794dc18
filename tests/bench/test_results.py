"""The result files in engine/bench/results are the ones the docs cite (the rest live in git history), and every
result file a doc cites is there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "engine" / "bench" / "results"
DOCS = ("README.md", "engine/README.md", "engine/bench/README.md", "kernels/README.md", "app/README.md")
READ_BY_CODE = {"cpu-eval.json"}  # the embedded model's `squeeze eval` the app shows until one is recorded
NAME = re.compile(r"[\w.-]*\{[\w.,-]*\}[\w.-]*|[\w.-]+\.(?:json|png|txt)\b")


def cited(text: str) -> set[str]:
    """File names a text names, `run{A,B}.json` expanded into runA.json and runB.json."""
    out = set()
    for name in NAME.findall(text):
        if "{" in name:
            head, rest = name.split("{", 1)
            options, tail = rest.split("}", 1)
            out |= {head + option + tail for option in options.split(",")}
        else:
            out.add(name)
    return out


def test_cited_expands_braces():
    assert cited("see `h200-run{J,K}.json` and cpu-eval.png.") == {"h200-runJ.json", "h200-runK.json", "cpu-eval.png"}


def test_the_results_are_the_ones_the_docs_cite():
    names = set().union(*(cited((ROOT / doc).read_text(encoding="utf-8")) for doc in DOCS))
    kept = {p.name for p in RESULTS.iterdir() if p.is_file()}
    assert kept, "no result files"
    assert not kept - names - READ_BY_CODE, f"result files no doc cites: {sorted(kept - names - READ_BY_CODE)}"
    results = re.compile(r"(?:engine/bench/results/)([\w.{},-]+)")
    for doc in DOCS:
        for name in cited(" ".join(results.findall((ROOT / doc).read_text(encoding="utf-8")))):
            assert name in kept, f"{doc} cites engine/bench/results/{name}, which is not there"
