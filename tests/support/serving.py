"""A Gradio app served for a test: on 127.0.0.1, a free port, in the background."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_locally(demo, **options) -> str:
    """Launch `demo` on a free local port without blocking (`options`: more of Gradio's launch options). Returns its
    URL."""
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            **options)
    return url
