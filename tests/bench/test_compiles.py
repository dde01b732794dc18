"""engine.bench.compiles: a Triton compilation reported through Triton's post-compile hook while a RunEvents is open
is recorded with its time (the hook called as Triton calls it: keyword arguments, a JitFunctionInfo), the hook set
before is still called and restored on exit, and the run's counts are differences over the run."""

import time

import pytest
import torch

from engine.bench.compiles import RunEvents


def _report_compiled(name: str) -> None:
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    knobs.runtime.jit_post_compile_hook(key="k", repr=name, fn=JitFunctionInfo("tests", name, None), compile={},
                                        is_manual_warmup=False, already_compiled=False)


def test_a_kernel_compiled_in_the_run_is_recorded_at_its_time_and_the_hook_restored():
    pytest.importorskip("triton")
    from triton import knobs

    calls = []

    def earlier(**kwargs):
        calls.append(kwargs["fn"].name)

    saved = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = earlier
    try:
        with RunEvents(torch.device("cpu")) as events:
            start = time.perf_counter()
            _report_compiled("first_kernel")
            middle = time.perf_counter()
            _report_compiled("second_kernel")
            end = time.perf_counter()
        assert knobs.runtime.jit_post_compile_hook is earlier  # restored
        _report_compiled("after_the_run")  # not recorded
    finally:
        knobs.runtime.jit_post_compile_hook = saved
    assert calls == ["first_kernel", "second_kernel", "after_the_run"]  # the earlier hook still called
    assert events.compiled_between(start, end) == ["first_kernel", "second_kernel"]
    assert events.compiled_between(middle, end) == ["second_kernel"]
    assert events.compiled_between(end, end + 60) == []
    summary = events.summary()
    assert summary["triton_compiles"] == 2 and summary["dynamo_graphs"] == 0
