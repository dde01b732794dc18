"""The Gradio UI and the command line: `build_demo(engine, store)` builds the UI from an engine; `app.serve.serve`
runs it; `app.cli` is the `squeeze` command. Gradio is imported only where the UI is built (`build_demo` is
resolved lazily), so that `squeeze --help` and the commands that need no UI do not load it."""

from __future__ import annotations

__all__ = ["build_demo"]


def __getattr__(name: str):
    if name == "build_demo":
        from app.demo import build_demo  # noqa: PLC0415 - gradio is slow to import

        return build_demo
    raise AttributeError(f"module 'app' has no attribute {name!r}")
