"""engine.context.warm: a method run over a small random context when the model loads, so that its kernels are
compiled before a user's first question: the method's own sparse path runs (its statistics read a fraction of the
K/V near the asked budget), also for a method built on another (hsqueeze on squeeze), and the Triton kernels run
under the interpreter on the CPU (tiny models)."""

from __future__ import annotations

import pytest

from engine.context.warm import WARM_ANSWER_TOKENS, warm_method
from engine.methods import make_method
from engine.model.load import load_model
from kernels.backend import REFERENCE
from kernels.dispatch import backend_for

pytestmark = pytest.mark.parametrize("tiny_model_path", ["llama_gqa"], indirect=True)


@pytest.mark.parametrize("name", ["squeeze", "hsqueeze"])
def test_a_warmed_method_ran_its_own_sparse_steps(tiny_model_path, name):
    lm = load_model(str(tiny_model_path), device="cpu")
    answer = warm_method(lm, REFERENCE, make_method(name), 0.9, tokens=1024)
    assert 1 <= len(answer.tokens) <= WARM_ANSWER_TOKENS
    assert answer.stats.steps == len(answer.tokens)  # the prefill and each decode step
    assert 0.0 < answer.stats.kv_budget < 0.2  # a 10% budget asked (the follow rows and index bytes inside it)


def test_the_triton_kernels_warm_under_the_interpreter(tiny_model_path):
    lm = load_model(str(tiny_model_path), device="cpu")
    answer = warm_method(lm, backend_for(lm.device, "triton"), make_method("squeeze"), 0.9, tokens=512)
    assert 0.0 < answer.stats.kv_budget < 0.3
