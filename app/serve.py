"""`squeeze serve`: the app on the embedded model (or another), bound to localhost unless told otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the checks below run before torch and gradio load: `squeeze serve` refuses at once)
    from app.config import AppConfig

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")  # addresses only this machine reaches


def parse_auth(value: str | None = None, path: str | Path | None = None) -> list[tuple[str, str]]:
    """The logins the app accepts: `value` "USER:PASSWORD", and each non-empty line "USER:PASSWORD" of the file at
    `path` (no password on the command line, where other users of the machine can read it)."""
    lines = [value] if value else []
    if path is not None:
        lines += [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    logins = []
    for line in lines:
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise ValueError("a login is USER:PASSWORD, both non-empty")
        logins.append((user, password))
    return logins


def check_exposure(host: str, auth: list[tuple[str, str]]) -> None:
    """Refuse to serve every document and chat to the network without a login: a host other than this machine's
    needs `auth`."""
    if host not in LOCAL_HOSTS and not auth:
        raise ValueError(f"--host {host} lets anyone who can reach this machine read every document and chat: give "
                         "--auth-file FILE (lines USER:PASSWORD) or --auth USER:PASSWORD, or serve on 127.0.0.1")


def serve(host: str = "127.0.0.1", port: int = 7860, model: str | None = None, cache_dir: str | Path | None = None,
          device: str = "auto", config: AppConfig | None = None, compile: str = "auto",
          auth: list[tuple[str, str]] | None = None, batch: int | None = None) -> None:
    """Build the engine and its ingest worker (which loads the model in the background), then serve until Ctrl-C.
    auth: the logins the app asks for (Gradio's login page), required for a host other than this machine's; batch:
    the questions answered together (engine.serve.Engine's max_batch; None: its default for the device)."""
    check_exposure(host, auth or [])
    from app.config import AppConfig  # noqa: PLC0415
    from app.demo import build_demo, launch_kwargs  # noqa: PLC0415 - gradio is slow to import
    from engine.serve import Engine  # noqa: PLC0415

    config = config or AppConfig()
    engine = Engine(cache_dir, model=model, device=device, compile=compile, max_batch=batch)
    demo = build_demo(engine, engine.store, config=config)
    print(f"squeeze-chat: model {engine.model_id}, cache {engine.store.root}", flush=True)
    try:
        demo.launch(server_name=host, server_port=port, show_error=True, auth=auth or None,
                    **launch_kwargs(config, engine.store))
    finally:
        demo.services.worker.close()
