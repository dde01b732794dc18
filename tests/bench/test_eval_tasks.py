"""`squeeze eval`'s needle tasks (engine/bench/tasks.py): what each cell hides in its haystack and asks, checked on
the text itself: the paraphrase shares no two consecutive words with its question, one of four similar keys is
asked, a chain of assignments leads from the asked name back to the key; every cell repeatable. And the summary
and table keep each task apart."""

from __future__ import annotations

import re

import pytest

from engine.bench.evaluate import summarize as summarize_eval
from engine.bench.evaluate import table
from engine.bench.needles import summarize
from engine.bench.passkey import PASSKEY_QUESTION
from engine.bench.tasks import COLOURS, PARAPHRASE_SENTENCE, TASKS, place

HAYSTACK = " ".join(f"Sentence number {i} of the essay says little. " for i in range(400))
KEY = "48213"


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def pairs(text: str) -> set[tuple[str, str]]:
    w = words(text)
    return set(zip(w, w[1:]))


def sentence_with(text: str, needle: str) -> str:
    """The first sentence of `text` that holds `needle`."""
    return next(s for s in re.split(r"(?<=[.?!])\s+", text) if needle in s)


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.9, 1.0])
def test_every_task_hides_its_key_and_asks_a_question(task, depth):
    needle = place(task, HAYSTACK, KEY, depth, 1024)
    assert needle.key == KEY and KEY in needle.text and needle.question.endswith("?")
    assert needle.text.replace(" ", "").count("Sentencenumber") == 400  # the haystack is all there
    assert place(task, HAYSTACK, KEY, depth, 1024) == needle  # the same cell, the same needle
    assert place(task, HAYSTACK, "51234", depth, 1024).text != needle.text


def test_the_passkey_asks_in_the_needles_own_words():
    needle = place("passkey", HAYSTACK, KEY, 0.5, 1024)
    assert needle.question == PASSKEY_QUESTION
    assert pairs(needle.question) & pairs(sentence_with(needle.text, KEY))


def test_the_paraphrase_shares_no_word_pair_with_its_question():
    """What the follow rows match (the question's consecutive words where the document has them) finds nothing of
    the sentence that holds the key."""
    needle = place("paraphrase", HAYSTACK, KEY, 0.5, 1024)
    held = sentence_with(needle.text, KEY)
    assert held in PARAPHRASE_SENTENCE.format(key=KEY)
    assert not pairs(needle.question) & pairs(PARAPHRASE_SENTENCE.format(key=KEY))


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.95])
def test_multikey_asks_one_of_four_similar_needles(depth):
    needle = place("multikey", HAYSTACK, KEY, depth, 1024)
    doors = {c: re.search(rf"passkey of the {c} door is (\d+)\.", needle.text) for c in COLOURS}
    assert all(doors.values()), doors
    asked = re.search(r"of the (\w+) door\?", needle.question).group(1)
    assert doors[asked].group(1) == KEY
    others = [m.group(1) for c, m in doors.items() if c != asked]
    assert len(set(others)) == 3 and KEY not in others and all(len(k) == 5 for k in others)
    # the asked needle sits at the cell's depth (within the sentences placed before it)
    assert abs(needle.text.index(f"{asked} door is") / len(needle.text) - depth) < 0.1


@pytest.mark.parametrize("depth", [0.0, 0.4, 0.8])
def test_vartrack_chains_three_assignments_after_the_depth(depth):
    needle = place("vartrack", HAYSTACK, KEY, depth, 1024)
    asked = re.search(r"variable (\w+)\?", needle.question).group(1)
    chain, name = [], asked
    while True:  # follow the assignments back from the asked name
        m = re.search(rf"The variable {name} is set to (?:the value of (\w+)|(\d+))\.", needle.text)
        chain.append(needle.text.index(m.group(0)))
        if m.group(2):
            assert m.group(2) == KEY
            break
        name = m.group(1)
    assert len(chain) == 3 and chain == sorted(chain, reverse=True)  # each later in the text than the one it reads
    assert abs(chain[-1] / len(needle.text) - depth) < 0.05


def test_an_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown needle task"):
        place("riddle", HAYSTACK, KEY, 0.5, 1024)


def test_the_summary_and_the_table_keep_each_task_apart():
    cells = [{"task": task, "method": "squeeze", "budget": 0.1, "found": found, "full_found": True,
              "kv_budget_prefill": 0.1, "kv_budget_decode": 0.1}
             for task, found in (("passkey", True), ("passkey", True), ("multikey", True), ("multikey", False),
                                 ("vartrack", False))]
    rows = summarize(cells)
    assert {(r["task"], r["as_good_as_full"]) for r in rows} == {("passkey", 1.0), ("multikey", 0.5),
                                                                 ("vartrack", 0.0)}
    assert summarize([{k: v for k, v in c.items() if k != "task"} for c in cells[:2]])[0]["task"] == "passkey"
    doc = {"model": "m", "device": "cpu", "created": "now", "full": {}, "needles": {"summary": rows}}
    doc["summary"] = summarize_eval(doc)
    (row,) = doc["summary"]
    assert row["needles"] == 1.0 and row["tasks"] == {"multikey": {"as_good_as_full": 0.5, "found_decided": None},
                                                      "vartrack": {"as_good_as_full": 0.0, "found_decided": None}}
    text = table(doc)
    assert "| method | KV budget | needles as good as full" in text
    assert "| multikey (decided) | vartrack (decided) |" in text
    assert "| squeeze | 10% | 100% | 50% | 0% | - |" in text
