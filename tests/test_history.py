"""The project's words are about the project: what it does, how, and what was measured where (a command, a commit,
a GPU, a result file), never the history of the work. No tracked text file (docs, help texts, comments, test names,
result files) names a numbered work period or an issue number."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(
    r"\bsessions?\s+\d+"  # a numbered work period, alone, as a range, or "since" one
    r"|\bwork\s+periods?\s+\d+"
    r"|\bissues?\s+#?\d+"  # an issue number
    r"|\(#\d+\)"  # a pull request's or issue's number in brackets
    r"|-s\d+\.(?:json|png)\b",  # a result file named after the period that made it
    re.IGNORECASE,
)
TEXT_SUFFIXES = {".py", ".md", ".json", ".toml", ".txt", ".cfg", ".yml", ".yaml", ".css", ".html", ".sh", ""}


def tracked_files() -> list[Path]:
    """The files git tracks (a checkout without git: every file under the rooms and the top level)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts]


def history_lines(text: str) -> list[tuple[int, str]]:
    return [(n, line.strip()[:160]) for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_the_pattern_finds_history_and_spares_the_project():
    # (the examples are put together here so that this file does not match its own pattern)
    period, issue = "session" + " 27", "issue" + " 13"
    found = [f"measured in {period}", f"S{period[1:]}-30 ran it", f"({issue})", "fixes (" + "#12)",
             "cpu-eval-s" + "27.json", f"since {period}'s run"]
    spared = ["a browser session's state", "ContextSession", "a test session fixture", "the sessions of two users",
              "h200-e2e-128k.json", "issues a warning", "the 13 issues of a PDF", "head_dim 256 (#heads 4)"]
    assert all(HISTORY.search(line) for line in found), [line for line in found if not HISTORY.search(line)]
    assert not any(HISTORY.search(line) for line in spared), [line for line in spared if HISTORY.search(line)]


def test_no_tracked_file_tells_the_history_of_the_work():
    files = [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES and p.is_file()]
    assert any(p.name == "README.md" for p in files)
    offenders = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = history_lines(text)
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines[:3]
    assert not offenders, f"history of the work in tracked files: {offenders}"


def test_the_readme_reads_in_two_minutes():
    """The README is for users: under 900 words (the measurement record lives in the detailed docs)."""
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words < 900, f"README.md has {words} words"
