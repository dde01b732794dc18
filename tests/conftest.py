"""Shared fixtures: the real embedded model (loaded once per test session) and a throwaway cache directory."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in the interpreter on the CPU; set before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The README's command runs the suite in pytest-xdist workers (one per core): each worker's torch gets its share of
# the cores, not all of them (two workers of two threads each on two cores only add synchronisation).
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // XDIST_WORKERS))

from engine.model.load import LoadedModel, load_model

# SQUEEZE_KERNEL_LAUNCHES=FILE: record every kernel variant the run launches (tests/kernels/launches.py) into FILE
# (FILE.gwN in an xdist worker), for `python -m tests.kernels.compile_check --launches FILE*`
LAUNCHES = os.environ.get("SQUEEZE_KERNEL_LAUNCHES")
if LAUNCHES:
    from tests.kernels.launches import Recorder

    RECORDER = Recorder()
    RECORDER.install()


def pytest_sessionfinish(session):
    if LAUNCHES:
        from pathlib import Path

        worker = os.environ.get("PYTEST_XDIST_WORKER")
        RECORDER.save(Path(f"{LAUNCHES}.{worker}" if worker else LAUNCHES))


@pytest.fixture(scope="session")
def real_lm_load(tmp_path_factory) -> tuple[LoadedModel, list[tuple[str, int, int]]]:
    """The embedded Gemma 3 270M on the CPU (float32), dequantized once per test run into a temp dir (a first
    run), with the steps that first load reported. Under pytest-xdist the workers share the run's temp root: the
    first to take the lock dequantizes (a minute) and records its steps, the others load what it wrote."""
    from filelock import FileLock  # noqa: PLC0415 (a dependency of torch and transformers)

    base = tmp_path_factory.getbasetemp()
    root = base.parent if XDIST_WORKERS else base
    record = root / "embedded-first-load.json"
    with FileLock(str(root / "embedded.lock")):
        first = not record.exists()
        steps: list[tuple[str, int, int]] = []
        lm = load_model(None, "cpu", convert_dir=root / "embedded-models", progress=lambda *step: steps.append(step))
        if first:
            record.write_text(json.dumps(steps))
    return lm, [tuple(step) for step in json.loads(record.read_text())]


@pytest.fixture(scope="session")
def real_lm(real_lm_load) -> LoadedModel:
    return real_lm_load[0]


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: intra-op threads only add synchronisation, which costs seconds on a loaded
    2-core machine. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
