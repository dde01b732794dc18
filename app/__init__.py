"""The Gradio UI: `build_demo(engine, store)` builds it from an engine; `app.serve.serve` runs it."""

from app.demo import build_demo

__all__ = ["build_demo"]
