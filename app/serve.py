"""`squeeze serve`: the app on the embedded model (or another), bound to localhost unless told otherwise."""

from __future__ import annotations

from pathlib import Path

from app.config import AppConfig


def serve(host: str = "127.0.0.1", port: int = 7860, model: str | None = None, cache_dir: str | Path | None = None,
          device: str = "auto", config: AppConfig | None = None, compile: str = "auto") -> None:
    """Build the engine and its ingest worker (which loads the model in the background), then serve until Ctrl-C."""
    from app.demo import build_demo, launch_kwargs  # noqa: PLC0415 - gradio is slow to import
    from engine.serve import Engine  # noqa: PLC0415

    config = config or AppConfig()
    engine = Engine(cache_dir, model=model, device=device, compile=compile)
    demo = build_demo(engine, engine.store, config=config)
    print(f"squeeze-chat: model {engine.model_id}, cache {engine.store.root}", flush=True)
    try:
        demo.launch(server_name=host, server_port=port, show_error=True, **launch_kwargs(config))
    finally:
        demo.services.worker.close()
