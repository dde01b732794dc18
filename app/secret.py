"""The key the browser's kept values are encrypted with (`gr.BrowserState`: the open document, the token a
browser's chats are kept under, its tab and settings), kept in the cache so that they survive a restart of the
server: with a key made per process, every browser lost its chats' token and its settings at each restart."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SECRET_FILE = "browser-secret"


def browser_secret(root: Path) -> str | None:
    """The cache's key (made once, readable by its owner only), or None where the cache cannot keep one (a
    read-only cache: the values then last as long as the server process, gradio's own key)."""
    path = Path(root) / SECRET_FILE
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    key = secrets.token_urlsafe(32)
    temp = path.with_name(f".{SECRET_FILE}.{os.getpid()}")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
        try:
            os.link(temp, path)  # the first process to make one wins; the others read it
        except FileExistsError:
            pass
        finally:
            temp.unlink(missing_ok=True)
        return path.read_text().strip() or None
    except OSError:
        return None
