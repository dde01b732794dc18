"""Chats: earlier turns in a turn's input (oldest dropped first past a limit), chat templates split at the document
(the document's K/V the same for every turn; the turn's tokens as the template renders the whole conversation),
stop strings that do not cut an answer opening with blank lines, and the sampler (greedy by default, seeded
sampling reproducible, top-p and the repetition penalty as specified)."""

from __future__ import annotations

import pytest
import torch

from engine.context.ingest import ingest_tokens
from engine.context.session import ContextSession
from engine.context.settings import ContextSettings
from engine.methods import make_method
from engine.model.load import load_model
from engine.model.sampling import GenerationOptions, Sampler, greedy, top_p_filter
from engine.text.prompt import (
    BasePrompt,
    ChatPrompt,
    Exchange,
    answer_held_back,
    cut_answer,
    cut_at_stop,
    prompt_format,
    tokenize_document,
    turn_ids,
)
from kernels.backend import REFERENCE
from tests.engine.test_engine_tiny import plain_greedy
from tests.support.tiny_models import CHAT_TEMPLATE, byte_tokenizer, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

DOCUMENT = ("The ferry to Orsa leaves at 7:40 from pier 3. Tickets cost 12 crowns; bicycles travel free. "
            "In winter the last crossing is at 16:10, and the harbour office closes at noon on Sundays. ") * 2
HISTORY = [Exchange("When does the ferry leave?", "At 7:40."), Exchange("From which pier?", "Pier 3.")]
SETTINGS = ContextSettings(dense_tail=16)


def _chat_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_base_format_puts_the_latest_exchanges_that_fit_before_the_question():
    tok, fmt = byte_tokenizer(), BasePrompt()
    whole = turn_ids(tok, fmt, "And the price?", HISTORY)
    assert whole.history == 2
    text = tok.decode(whole.ids)
    assert text == ("\n\nQuestion: When does the ferry leave?\nAnswer: At 7:40.\n\nQuestion: From which pier?\n"
                    "Answer: Pier 3.\n\nQuestion: And the price?\nAnswer:")
    alone = turn_ids(tok, fmt, "And the price?").ids.numel()
    last = len("\n\nQuestion: From which pier?\nAnswer: Pier 3.")  # bytes = tokens
    assert turn_ids(tok, fmt, "And the price?", HISTORY, limit=last).history == 1  # the oldest dropped first
    assert turn_ids(tok, fmt, "And the price?", HISTORY, limit=last - 1).ids.numel() == alone
    assert turn_ids(tok, fmt, "And the price?", HISTORY, room=alone + last).history == 1  # the model's room too
    with pytest.raises(ValueError, match="has room for"):
        turn_ids(tok, fmt, "And the price?", room=alone - 1)
    with pytest.raises(ValueError, match="empty"):
        turn_ids(tok, fmt, "  \n ")


def test_chat_template_splits_at_the_document_and_renders_the_conversation():
    """fixed context + turn = the template's rendering of the whole conversation with the document, for every
    turn; the fixed part is the same whatever the turn."""
    tok = _chat_tokenizer()
    fmt = prompt_format(tok)
    assert isinstance(fmt, ChatPrompt) and fmt.stop_strings == ()
    assert fmt.document_prefix() == "<bos><start_of_turn>user\n"
    for history in ([], HISTORY[:1], HISTORY):
        asked = [e.question for e in history] + ["And the price?"]
        messages = []
        for i, q in enumerate(asked):
            messages.append({"role": "user", "content": f"{DOCUMENT}\n\n{q}" if i == 0 else q})
            if i < len(history):
                messages.append({"role": "assistant", "content": history[i].answer})
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert fmt.document_prefix() + DOCUMENT + fmt.turn_text(history, "And the price?") == want
    fixed = tokenize_document(tok, DOCUMENT, 4096, prefix=fmt.document_prefix())
    assert tok.decode(fixed.ids) == fmt.document_prefix() + DOCUMENT
    assert fixed.ids[0] == tok.bos_token_id and int((fixed.ids == tok.bos_token_id).sum()) == 1  # one BOS
    assert (fixed.offsets[:len("<start_of_turn>user\n") + 1] == -1).all()  # the template's tokens have no span
    assert isinstance(prompt_format(byte_tokenizer()), BasePrompt)


@pytest.mark.parametrize("text,want", [
    ("\n\nThe licence grants a patent licence.\n\nQuestion: more", ("\n\nThe licence grants a patent licence.", True)),
    ("\n \n", ("\n \n", False)),
    ("Pier 3.\nQuestion: and", ("Pier 3.", True)),
    ("Pier 3", ("Pier 3", False)),
])
def test_stop_strings_count_from_the_first_non_blank_character(text, want):
    assert cut_at_stop(text, ("\n\n", "\nQuestion:")) == want


@pytest.mark.parametrize("text,held", [("48213.\nAnswer", len("\nAnswer")), ("48213.", 0), ("Pier 3\n", 1),
                                       ("\n\n", 0), ("\n\nPier\nQues", len("\nQues")), ("Answer", 0)])
def test_a_stream_holds_back_what_could_start_a_stop_string(text, held):
    from engine.text.prompt import STOP_STRINGS, held_back

    assert held_back(text, STOP_STRINGS) == held


ANSWER = "The ferry leaves at 7:40 from pier 3."


@pytest.mark.parametrize("text,stops,final,want", [
    (f"{ANSWER}\n18\n\nFerry timetable", (), False, (ANSWER, True)),  # the document's footer, then its next page
    (f"{ANSWER}\n\n- 19 -\n", (), False, (ANSWER, True)),
    (f"{ANSWER}\nPage 20 of 40\n", (), False, (ANSWER, True)),
    (f"{ANSWER}\n18\n\nFerry", ("\n\n", "\nQuestion:"), False, (ANSWER, True)),  # cut at a stop string, then here
    (f"{ANSWER}\n21", (), False, (f"{ANSWER}\n21", False)),  # the line may still go on
    (f"{ANSWER}\n21", (), True, (ANSWER, True)),  # the answer is over: its last line is whole
    (f"{ANSWER}\n2. Bicycles travel free.", (), True, (f"{ANSWER}\n2. Bicycles travel free.", False)),  # a list
    ("The crossings leave at:\n7\n16\n", (), True, ("The crossings leave at:\n7\n16\n", False)),  # answers
    ("18", (), True, ("18", False)),  # an answer that is a number
])
def test_an_answer_ends_at_a_page_number_line_after_its_sentence(text, stops, final, want):
    """A model that reads a document's page footers writes the next one after its answer: a line of a page number
    alone after a finished sentence ends the answer there; numbers that answer stay."""
    assert cut_answer(text, stops, final) == want


@pytest.mark.parametrize("text,held", [(f"{ANSWER}\n1", 2), (f"{ANSWER}\n\nPag", 5), (f"{ANSWER}\n", 1),
                                       (f"{ANSWER}\n- 19 -", 7), (f"{ANSWER}\nBicycles", 0),
                                       ("The crossings leave at:\n7", 0), ("7", 0)])
def test_a_stream_holds_back_what_could_become_a_page_number_line(text, held):
    assert answer_held_back(text, ()) == held


@pytest.fixture(scope="module")
def chat_session(tmp_path_factory):
    """A tiny Llama whose tokenizer has a chat template, the document ingested as the engine does."""
    lm = load_model(str(make_tiny_model(tmp_path_factory.mktemp("chat"), "llama_gqa", CHAT_TEMPLATE)), device="cpu")
    fmt = prompt_format(lm.tokenizer)
    fixed = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context, prefix=fmt.document_prefix())
    methods = [make_method("squeeze")]
    out = ingest_tokens(lm, fixed.ids, SETTINGS, REFERENCE, methods)
    return lm, fixed.ids, ContextSession(lm, out.artifacts, SETTINGS, REFERENCE, methods={"squeeze": methods[0]})


def test_a_follow_up_reads_the_earlier_turns_as_a_plain_forward_does(chat_session):
    """Full attention over the cached document + the turn's tokens (history included) answers as transformers'
    own forward over the same token sequence from scratch, token by token."""
    lm, fixed_ids, session = chat_session
    fmt = prompt_format(lm.tokenizer)
    turn = turn_ids(lm.tokenizer, fmt, "And the price?", HISTORY)
    assert turn.history == 2
    answer = session.ask("And the price?", "full", 0.0, max_new_tokens=6, history=HISTORY)
    assert answer.history == 2 and answer.stats.extra["history"] == 2
    tokens = plain_greedy(lm, torch.cat([fixed_ids, turn.ids]), 6)
    assert answer.text == lm.tokenizer.decode(tokens, skip_special_tokens=True).strip()  # no stop strings here
    alone = session.ask("And the price?", "full", 0.0, max_new_tokens=6)
    assert alone.history == 0


def test_seeded_sampling_is_reproducible_and_greedy_is_the_default(chat_session):
    lm, _, session = chat_session
    greedy = session.ask("And the price?", "squeeze", 0.5, max_new_tokens=8)
    assert session.ask("And the price?", "squeeze", 0.5, 8, options=GenerationOptions()).text == greedy.text
    hot = GenerationOptions(temperature=1.5, top_p=0.9, repetition_penalty=1.3, seed=7)
    first = session.ask("And the price?", "squeeze", 0.5, 8, options=hot)
    assert session.ask("And the price?", "squeeze", 0.5, 8, options=hot).text == first.text
    assert first.stats.extra["generation"]["temperature"] == 1.5


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 7, 256, 257, 262144, 128256])
def test_greedy_picks_the_first_maximum_as_argmax_does(device, vocab):
    gen = torch.Generator().manual_seed(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(1, vocab, generator=gen).to(device, dtype)
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))
        tied = torch.full((1, vocab), float("-inf"), device=device, dtype=dtype)
        tied[0, vocab // 3:] = 2.0  # every slice from a third on holds the maximum: the first one is picked
        assert int(greedy(tied)) == vocab // 3 == int(tied.argmax())
    assert greedy(logits).dtype == torch.int64 and greedy(logits).shape == (1,)
    assert greedy(logits[0]).shape == (1,)
    rows = torch.randn(5, vocab, generator=gen).to(device)  # a batched step's rows, each its own first maximum
    rows[3] = 0.0
    assert torch.equal(greedy(rows), rows.argmax(dim=-1))
    with pytest.raises(ValueError, match="a token a row"):
        greedy(torch.zeros(2, 1, vocab, device=device))


def test_sampler_applies_penalty_temperature_and_top_p():
    logits = torch.tensor([[4.0, 2.0, -1.0, 0.5]])
    greedy = Sampler(GenerationOptions(), 4, torch.device("cpu"))
    assert int(greedy.pick(logits)) == 0
    penalised = Sampler(GenerationOptions(repetition_penalty=3.0), 4, torch.device("cpu"))
    assert int(penalised.pick(logits)) == 0  # 4 is seen now: 4 / 3 < 2
    assert int(penalised.pick(logits)) == 1
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(top_p_filter(probs, 0.8), torch.tensor([0.5, 0.3, 0.0, 0.0]))
    torch.testing.assert_close(top_p_filter(probs, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]))
    torch.testing.assert_close(top_p_filter(probs, 0.1), torch.tensor([0.5, 0.0, 0.0, 0.0]))
    sampler = Sampler(GenerationOptions(temperature=1.0, top_p=0.5, seed=0), 4, torch.device("cpu"))
    assert {int(sampler.pick(logits)) for _ in range(20)} == {0}  # the nucleus of 0.5 is token 0 alone
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"repetition_penalty": 0.5}, {"temperature": float("nan")}):
        with pytest.raises(ValueError):
            GenerationOptions(**bad)


def test_the_stream_says_the_answer_and_never_a_stop_string(tmp_path):
    """The pieces a turn streams add up to its answer, and never show a stop string (nor, held back, its start)
    past the first non-blank character. A random tiny model sampled hot emits newlines often."""
    from engine.context.session import Delta
    from engine.text.prompt import STOP_STRINGS

    lm = load_model(str(make_tiny_model(tmp_path, "llama_gqa")), device="cpu")
    fixed = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    methods = [make_method("squeeze")]
    session = ContextSession(lm, ingest_tokens(lm, fixed.ids, SETTINGS, REFERENCE, methods).artifacts, SETTINGS,
                             REFERENCE, methods={"squeeze": methods[0]})
    stopped = 0
    for seed in range(12):
        pieces, answer = [], None
        for event in session.stream("And the price?", "squeeze", 0.5, 40,
                                    options=GenerationOptions(temperature=2.0, seed=seed)):
            if isinstance(event, Delta):
                pieces.append(event.text)
                said = "".join(pieces)
                body = said[len(said) - len(said.lstrip()):]
                assert not any(s in body for s in STOP_STRINGS), said
            else:
                answer = event
        assert "".join(pieces).strip() == answer.text
        stopped += answer.stats.new_tokens < 40
    assert stopped  # some answers did end at a stop string


def test_until_ends_an_answer_once_it_holds_and_the_next_turn_is_unchanged(tmp_path):
    """`stream(..., until=f)` (squeeze eval's needles: an answer ends once it has said the key): the answer is the
    uninterrupted one's first tokens, through the first whose text makes f hold; Answer.tokens are the ids it said;
    and the turn after it answers as the first did (the cache's dynamic part was reset)."""
    lm = load_model(str(make_tiny_model(tmp_path, "llama_gqa")), device="cpu")
    fixed = tokenize_document(lm.tokenizer, DOCUMENT, lm.max_context)
    methods = [make_method("squeeze")]
    session = ContextSession(lm, ingest_tokens(lm, fixed.ids, SETTINGS, REFERENCE, methods).artifacts, SETTINGS,
                             REFERENCE, methods={"squeeze": methods[0]})
    whole = session.ask("And the price?", "squeeze", 0.5, 24)
    assert whole.stats.new_tokens == len(whole.tokens) >= 8
    piece = lm.tokenizer.decode(whole.tokens[:6], skip_special_tokens=True)[-2:]
    first = next(n for n in range(1, len(whole.tokens) + 1)
                 if piece in lm.tokenizer.decode(whole.tokens[:n], skip_special_tokens=True))
    short = session.ask("And the price?", "squeeze", 0.5, 24, until=lambda text: piece in text)
    assert short.tokens == whole.tokens[:first] and short.stats.new_tokens == first
    again = session.ask("And the price?", "squeeze", 0.5, 24)
    assert again.tokens == whole.tokens and again.text == whole.text


def test_an_oversized_document_is_refused_from_its_start_alone(monkeypatch):
    """A text far longer than the limit could hold is tokenized from its start only: refused as more than the limit,
    or truncated to the same tokens the whole text would give."""
    from engine.text import prompt  # noqa: PLC0415

    seen = []

    class Counting:  # the byte tokenizer, telling the length of every text it is given
        def __init__(self, tok):
            self.tok = tok

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return self.tok(text, **kwargs)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    tok = Counting(byte_tokenizer())
    text = "harbour wall " * 2000  # 26,000 characters, a token each
    max_context = prompt.ANSWER_RESERVE + 100  # a limit of 100 tokens: the start is 101 * 64 characters
    with pytest.raises(prompt.DocumentTooLongError, match="more than 100 tokens"):
        tokenize_document(tok, text, max_context)
    assert max(seen) == 101 * prompt.MAX_CHARS_PER_TOKEN
    seen.clear()
    cut = tokenize_document(tok, text, max_context, truncate=True)
    assert cut.truncated and max(seen) == 101 * prompt.MAX_CHARS_PER_TOKEN
    monkeypatch.setattr(prompt, "MAX_CHARS_PER_TOKEN", 10**6)  # the whole text tokenized
    whole = tokenize_document(tok, text, max_context, truncate=True)
    assert torch.equal(cut.ids, whole.ids) and torch.equal(cut.offsets, whole.offsets)


@pytest.mark.parametrize("after,pulled", [("\n18\n\nOrsa ferry guide\nThe ferry", "\n18\n"), ("\n19", "\n19<eos>")])
def test_a_stream_ends_at_the_page_number_a_model_writes_after_its_answer(chat_session, monkeypatch, after, pulled):
    """The model's tokens after its answer (scripted here) go on with the document's footer: the stream shows the
    answer alone, never a piece of the number, and stops taking tokens once the number's line has ended (or at the
    end-of-sequence token after it)."""
    import engine.context.session

    lm, _, session = chat_session
    tok = lm.tokenizer
    ids = tok(ANSWER + after, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    taken = []

    def scripted(lm, step, prompt, max_new_tokens, sampler=None):
        for token in ids[:max_new_tokens]:
            taken.append(token)
            yield token

    monkeypatch.setattr(engine.context.session, "generate_tokens", scripted)
    events = list(session.stream("When does the ferry leave?", "full", 0.0, max_new_tokens=len(ids)))
    shown = "".join(e.text for e in events[:-1])
    assert shown == events[-1].text == ANSWER
    assert tok.decode(taken) == ANSWER + pulled
