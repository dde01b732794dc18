"""Methods' model-level artifacts (Method.prepare: DuoAttention's gates, Saap's partitions) learned in the background,
so that a question never waits minutes in silence: the first ask of such a method starts it, is told how far it is
and how long is left, and can cancel it; before that, `expected_seconds` says how long it should take."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.serve.service import Engine

CANCELLED = "cancelled by the user"


@dataclass(frozen=True)
class PrepView:
    """Where one method's preparation stands. state: "running" | "failed" | "cancelled" | "done"; done/total: its
    steps so far; stage: its last progress line; seconds_left: estimated from the steps so far (before the first:
    the expected time, `Preparer.expected_seconds`, when one is known; else None)."""

    method: str
    state: str
    done: int
    total: int
    stage: str
    error: str | None
    seconds_left: float | None


class PreparationCancelled(Exception):
    """A preparation stopped at its next step because its user asked (Preparer.cancel)."""


class Preparer:
    """One background thread per method being prepared (the engine holds the device meanwhile).

    seconds_per_token: what an ingest takes per token with this engine's model on this machine, as the ingest worker
    has learned it (IngestWorker.seconds_per_token; None while unknown): the measure of the expected times."""

    def __init__(self, engine: Engine, seconds_per_token: Callable[[], float | None] = lambda: None):
        self.engine = engine
        self.seconds_per_token = seconds_per_token
        self._lock = threading.Lock()
        self._runs: dict[str, dict] = {}

    def start(self, name: str) -> PrepView | None:
        """Start preparing what `name` learns per model (itself, or what it requires: duo-squeeze's is duo's gates)
        unless it is prepared or under way; its view, or None when nothing is needed. A failed run's view is returned
        once (with its error), then the next call starts it again; a cancelled one starts again at the next call."""
        with self._lock:
            needed = self.engine.needs_preparation(name)
            key = needed[0] if needed else name  # a run is the first method it trains: one run per training
            run = self._runs.get(key)
            if run is not None and run["state"] == "running":
                return self._view(key, run)
            if run is not None and run["state"] == "failed" and not run["told"]:  # said once; the next start retries
                run["told"] = True
                return self._view(key, run)
            if not needed:
                return None
            run = {"state": "running", "done": 0, "total": 0, "stage": "starting", "error": None,
                   "first": None, "told": False, "cancel": False, "expected": self.expected_seconds(name)}
            self._runs[key] = run
        threading.Thread(target=self._run, args=(name, run), name=f"prepare-{key}", daemon=True).start()
        return self._view(key, run)

    def view(self, name: str) -> PrepView | None:
        """Where the preparation of what `name` needs stands (None: none was started here)."""
        with self._lock:
            needed = self.engine.needs_preparation(name)
            key = needed[0] if needed else name
            run = self._runs.get(key)
            return None if run is None else self._view(key, run)

    def running(self) -> list[PrepView]:
        """The preparations under way (each holds the model's device until it ends)."""
        with self._lock:
            return [self._view(name, run) for name, run in self._runs.items() if run["state"] == "running"]

    def cancel(self, name: str) -> bool:
        """Stop the preparation of what `name` needs at its next step (what it learned up to its last checkpoint is
        kept: the next start goes on from there). False when it is not under way."""
        with self._lock:
            needed = self.engine.needs_preparation(name)
            run = self._runs.get(needed[0]) if needed else None
            if run is None or run["state"] != "running":
                return False
            run["cancel"] = True
            return True

    def expected_seconds(self, name: str) -> float | None:
        """How long preparing `name` (and what it requires) should take on this machine: the methods' work in
        tokens of an ingest (Method.preparation_work) times the seconds per token that ingests take here; None
        while no ingest has been timed (or nothing is to be learned)."""
        rate = self.seconds_per_token()
        if rate is None:
            return None
        work = sum(self.engine.method(n).preparation_work() for n in self.engine.needs_preparation(name))
        return rate * work if work else None

    def _run(self, name: str, run: dict) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            with self._lock:
                if run["cancel"]:
                    raise PreparationCancelled(CANCELLED)
                if run["first"] is None:
                    run["first"] = (time.monotonic(), done)
                run.update(stage=stage, done=done, total=total)

        try:
            for needed in self.engine.needs_preparation(name):  # the method's own, or what it requires (duo's gates)
                self.engine.prepared(needed, progress)
            state, error = "done", None
        except PreparationCancelled:
            state, error = "cancelled", CANCELLED
        except Exception as exc:  # noqa: BLE001 - reported to whoever asks next, in plain words
            state, error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with self._lock:
            run.update(state=state, error=error)

    @staticmethod
    def _view(name: str, run: dict) -> PrepView:
        left = run["expected"]  # until two steps give a rate
        if run["first"] is not None and run["total"] and run["done"] > run["first"][1]:
            t0, d0 = run["first"]
            rate = (time.monotonic() - t0) / (run["done"] - d0)
            left = rate * (run["total"] - run["done"])
        return PrepView(method=name, state=run["state"], done=run["done"], total=run["total"], stage=run["stage"],
                        error=run["error"], seconds_left=left)
