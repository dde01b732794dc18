"""engine.model.batch_graph: the decode step of several turns captured in one CUDA graph and replayed, against the
same turns' eager batched steps fed the same tokens (logits within bf16 tolerance, greedy tokens or bf16 ties),
with turns over two documents of different lengths, different methods and budgets and a fork in one batch; and turns
answered together through TurnBatch, one joining and one leaving mid-answer (each a new capture), against the same
batch run eagerly: the same statistics where their tokens are the same; the sequences attending at once on
streams of their own against one after another; and a turn alone in the batch replaying its session's own captured
step (tiny models on CUDA, Triton backend, bf16).
On the CPU a batch steps eagerly (tests/engine/test_batching.py): these tests are skipped there."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.context.batching import TurnBatch
from engine.context.session import ContextSession
from engine.model import batch as batching
from engine.model import capture
from engine.model.batch import forward_batch, side_streams
from engine.model.batch_graph import BatchGraph
from engine.model.generate import forward_step
from engine.model.load import load_model
from engine.text.prompt import question_ids
from kernels.dispatch import backend_for
from tests.engine.test_batch_step import SEQUENCES, _sessions
from tests.engine.test_batching import MAX_TOKENS, _run
from tests.engine.test_engine_graph import LOGIT_TOL, _tie

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 5


@pytest.fixture(scope="module")
def sessions(tiny_model_path) -> list[ContextSession]:
    lm = load_model(str(tiny_model_path), device="cuda")
    return _sessions(lm, backend_for(lm.device, "triton"))


def _steps(sessions: list[ContextSession], graphs: bool) -> list:
    """SEQUENCES' step contexts (a second one over a document reads a fork), each with room for its question and
    STEPS + 1 answer tokens, its question prefilled eagerly; with their first tokens [B] and next positions."""
    steps, seen, tokens, positions = [], set(), [], []
    for doc, method, sparsity, question in SEQUENCES:
        session = sessions[doc]
        step = session.step_context(method, sparsity)
        if doc in seen:
            step = replace(step, cache=step.cache.fork(),
                           follow=step.follow.fork() if step.follow is not None else None)
        if not graphs:
            step = replace(step, graphs=None)
        seen.add(doc)
        prompt = question_ids(session.lm.tokenizer, question).to(session.lm.device)
        step.cache.reset_dynamic()
        step.cache.reserve(prompt.numel() + STEPS + 1)
        start = step.cache.get_seq_length()
        tokens.append(forward_step(session.lm, step, prompt, start).argmax(dim=-1).reshape(1))
        positions.append(start + prompt.numel())
        steps.append(step)
    return steps, torch.cat(tokens), positions


@pytest.mark.parametrize("shared", [False, True])
def test_a_replayed_batch_step_is_the_eager_batch_step(sessions, shared, monkeypatch):
    """shared: the batch's attentions at a global layer in shared launches (union_attention_batch), captured with
    their tables' uploads, eager and replayed alike."""
    monkeypatch.setattr(batching, "SHARED_LAUNCHES", shared)
    lm = sessions[0].lm
    with torch.inference_mode():
        steps, first, positions = _steps(sessions, graphs=True)
        graph = BatchGraph(lm, steps)
        graph.warm_and_capture(first, positions)
        fed = [first, graph.ids.clone()]  # each step's input tokens [B]: the prefills', then the warm step's
        replayed = []
        for _ in range(STEPS):
            replayed.append(graph.replay().float().clone())
            fed.append(graph.ids.clone())
        graph.flush()
        for step in steps:
            assert step.cache.layers[0].host_new == step.cache.layers[0].new_len.item()  # replays counted
        eager_steps, eager_first, eager_positions = _steps(sessions, graphs=False)
        assert torch.equal(eager_first, first) and eager_positions == positions
        for i in range(STEPS + 1):
            logits = forward_batch(lm, eager_steps, fed[i], [p + i for p in positions]).float()
            if i == 0:
                continue  # the warm step: run eagerly itself
            torch.testing.assert_close(replayed[i - 1], logits, **LOGIT_TOL)
            for b in range(len(steps)):
                token = int(fed[i + 1][b])
                assert int(logits[b].argmax()) == token or _tie(logits[b : b + 1], token), (i, b)
    for step in (*steps, *eager_steps):
        step.cache.reset_dynamic()


# forward_batch's options in each way a batch's sequences attend (test_sequences_attending_at_once_...)
ATTENDING = {"streams": dict(split_gpu=False), "one after another": dict(streams=[]),
             "streams, each its share of the GPU": dict(split_gpu=True), "shared": dict(shared=True)}


def test_sequences_attending_at_once_on_streams_match_one_after_another(sessions):
    """The eager batched step with each sequence on a stream of its own (the default on a GPU) against the same
    step with the sequences attending one after another on the current stream: the same kernels on the same
    inputs, so the logits are bitwise equal, step after step (nothing read before it was written). Fed the same
    tokens, within bf16 tolerance (the kernels' split of the keys differs): on streams with each sequence's union
    kernels planned for its share of the GPU (engine.model.batch.SPLIT_GPU), and with their attentions in shared
    launches."""
    lm = sessions[0].lm
    with torch.inference_mode():
        got, fed = {}, []
        for mode, options in ATTENDING.items():
            steps, tokens, positions = _steps(sessions, graphs=False)
            seen = []
            for i in range(STEPS):
                if mode in ("streams, each its share of the GPU", "shared"):
                    tokens = fed[i]
                logits = forward_batch(lm, steps, tokens, [p + i for p in positions], **options)
                if mode == "streams":
                    fed.append(tokens)
                tokens = logits.argmax(dim=-1)
                seen.append(logits.float().clone())
            got[mode] = torch.stack(seen)
            for step in steps:
                step.cache.reset_dynamic()
    assert len(side_streams(lm.device, len(SEQUENCES))) == len(SEQUENCES) - 1
    assert torch.equal(got["streams"], got["one after another"])
    torch.testing.assert_close(got["streams, each its share of the GPU"], got["streams"], **LOGIT_TOL)
    torch.testing.assert_close(got["shared"], got["streams"], **LOGIT_TOL)


@pytest.mark.parametrize("ahead,capture_after,unwarmed", [(False, 0, False), (True, 0, False), (True, 1, False),
                                                          (True, 0, True)])
def test_turns_answered_together_from_captured_steps_answer_as_eagerly(sessions, ahead, capture_after, unwarmed,
                                                                       monkeypatch):
    """Two turns over their own documents, a third (a fork of the second's document) joining after two steps and
    the first leaving after three: the batch is captured, captured anew when the third joins (a fork steps
    eagerly: so does the batch from then on, its turns' replayed tokens counted), and gives each turn the tokens and
    the statistics of the same batch run eagerly; with `ahead` (each replay launched before the previous step's
    tokens are read back) the same, the turn that leaves counting the step launched for it ahead; with capture_after
    1 the first two turns' first step runs eagerly, the next is captured and the one after it replayed; unwarmed,
    the two turns left when the first leaves are captured without a warm step (the capture's replay is that step),
    every capture without a device synchronisation or an emptied cache, into one memory pool (engine.model.capture)."""
    monkeypatch.setattr(capture, "SYNC_FIRST", not unwarmed)
    lm = sessions[0].lm
    got = {}
    for graphs in (True, False):
        joining = []
        for at, key, doc, method, sparsity, question, fork in ((0, 0, *SEQUENCES[0], False),
                                                               (0, 1, *SEQUENCES[1], False),
                                                               (2, 2, *SEQUENCES[3], True)):
            turn = sessions[doc].turn(question, method, sparsity, MAX_TOKENS, fork=fork)
            if not graphs:
                turn.step.graphs = None
            joining.append((at, key, turn))
        batch = TurnBatch(lm, ahead=ahead and graphs, capture_after=capture_after, unwarmed=unwarmed)
        got[graphs] = _run(batch, joining, cancel_after={0: 3})
        assert batch._graph is None and not len(batch)
        assert (batch.captures > 0) == graphs
    assert set(got[True]) == set(got[False]) == {0, 1, 2}
    same = 0
    for key, (_, tokens, _, answer) in got[False].items():
        replayed_tokens, replayed = got[True][key][1], got[True][key][3]
        if replayed_tokens != tokens:  # a bf16 tie between a replayed and an eager call may take another token
            continue
        same += 1
        extra = int(ahead and key == 0)  # (left with a step launched ahead for it)
        assert replayed.stats.steps in (answer.stats.steps, answer.stats.steps + extra), key  # the replayed steps
        # counted, the warm one too
        assert replayed.stats.kv_budget == pytest.approx(answer.stats.kv_budget, rel=0.02, abs=1e-4), key
        torch.testing.assert_close(torch.tensor(replayed.stats.kept_fraction_decode),
                                   torch.tensor(answer.stats.kept_fraction_decode), atol=0.02, rtol=0.0)
    assert same >= 1  # (the first test holds every replayed step to the eager one, ties apart)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_turn_alone_in_the_batch_replays_its_session_s_own_step(sessions, ahead):
    """A turn alone in a TurnBatch steps through its session's captured decode step (engine.model.lone_graph): after
    the session answered the question alone twice (its step captured, then replayed), the batch answers it with
    the same tokens and statistics as the second answer (the same captured step replayed) and captures nothing; with
    the session's captures dropped, the batch's lone turn captures its session's step once, and the session's next
    answer alone replays that capture."""
    session = sessions[0]
    _, method, sparsity, question = SEQUENCES[0]
    lm = session.lm
    session.graphs.clear()
    session.ask(question, method, sparsity, MAX_TOKENS)  # captures the session's decode step
    alone = session.ask(question, method, sparsity, MAX_TOKENS)  # replays it
    captured = dict(session.graphs._graphs)
    batch = TurnBatch(lm, ahead=ahead)
    got = _run(batch, [(0, 0, session.turn(question, method, sparsity, MAX_TOKENS))], {})
    _, tokens, text, answer = got[0]
    assert batch.captures == 0 and dict(session.graphs._graphs) == captured
    assert tokens == alone.tokens and text == alone.text
    # (alone, a turn that ends at its end-of-sequence token counts the step launched after it; in a batch without
    # `ahead`, none is launched)
    assert answer.stats.steps in (alone.stats.steps, alone.stats.steps - int(not ahead))
    assert answer.stats.kv_budget == pytest.approx(alone.stats.kv_budget, rel=0.02, abs=1e-4)
    torch.testing.assert_close(torch.tensor(answer.stats.kept_fraction_decode),
                               torch.tensor(alone.stats.kept_fraction_decode), atol=0.02, rtol=0.0)
    session.graphs.clear()
    batch = TurnBatch(lm, ahead=ahead)
    first = _run(batch, [(0, 0, session.turn(question, method, sparsity, MAX_TOKENS))], {})[0]
    assert batch.captures == 1
    captured = dict(session.graphs._graphs)
    again = session.ask(question, method, sparsity, MAX_TOKENS)
    assert dict(session.graphs._graphs) == captured  # replayed the batch's capture: no new one
    assert again.tokens == alone.tokens  # both replayed throughout
    assert first[1][0] == alone.tokens[0]  # the prefill's (replayed); then its warm step's: a bf16 tie may differ
    session.cache.reset_dynamic()
