"""Methods' model-level artifacts (Method.prepare: DuoAttention's gates) learned in the background, so that a
question never waits minutes in silence: the first ask of such a method starts it and is told how far it is."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from engine.serve.service import Engine


@dataclass(frozen=True)
class PrepView:
    """Where one method's preparation stands. state: "running" | "failed" | "done"; done/total: its steps so far;
    stage: its last progress line; seconds_left: estimated from the steps so far (None before the first)."""

    method: str
    state: str
    done: int
    total: int
    stage: str
    error: str | None
    seconds_left: float | None


class Preparer:
    """One background thread per method being prepared (the engine holds the device meanwhile)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._runs: dict[str, dict] = {}

    def start(self, name: str) -> PrepView | None:
        """Start preparing `name` unless it is prepared or under way; its view, or None when nothing is needed. A
        failed run's view is returned once (with its error), then the next call starts it again."""
        with self._lock:
            run = self._runs.get(name)
            if run is not None and run["state"] == "running":
                return self._view(name, run)
            if run is not None and run["state"] == "failed" and not run["told"]:  # said once; the next start retries
                run["told"] = True
                return self._view(name, run)
            if not self.engine.needs_preparation(name):
                return None
            run = {"state": "running", "done": 0, "total": 0, "stage": "starting", "error": None,
                   "first": None, "told": False}
            self._runs[name] = run
        threading.Thread(target=self._run, args=(name, run), name=f"prepare-{name}", daemon=True).start()
        return self._view(name, run)

    def view(self, name: str) -> PrepView | None:
        with self._lock:
            run = self._runs.get(name)
            return None if run is None else self._view(name, run)

    def _run(self, name: str, run: dict) -> None:
        def progress(stage: str, done: int, total: int) -> None:
            with self._lock:
                if run["first"] is None:
                    run["first"] = (time.monotonic(), done)
                run.update(stage=stage, done=done, total=total)

        try:
            for needed in self.engine.needs_preparation(name):  # the method's own, or what it requires (duo's gates)
                self.engine.prepared(needed, progress)
            state, error = "done", None
        except Exception as exc:  # noqa: BLE001 - reported to whoever asks next, in plain words
            state, error = "failed", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        with self._lock:
            run.update(state=state, error=error)

    @staticmethod
    def _view(name: str, run: dict) -> PrepView:
        left = None
        if run["first"] is not None and run["total"] and run["done"] > run["first"][1]:
            t0, d0 = run["first"]
            rate = (time.monotonic() - t0) / (run["done"] - d0)
            left = rate * (run["total"] - run["done"])
        return PrepView(method=name, state=run["state"], done=run["done"], total=run["total"], stage=run["stage"],
                        error=run["error"], seconds_left=left)
