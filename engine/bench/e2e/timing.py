"""Helpers of the end-to-end benchmark: a progress line, an error in one line, the devices synchronised, a median in
milliseconds."""

from __future__ import annotations

import statistics
import sys
import time

import torch


def log(message: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"

def synchronize(device: torch.device) -> None:
    """Wait for the GPUs (all of them: a model split over several runs its layers on each) or nothing on the CPU."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)

def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)
