"""The app's settings: limits, defaults of the controls, and how often the page polls for progress."""

from __future__ import annotations

from dataclasses import dataclass

from engine.serve import (
    DEFAULT_METHOD,
    DEFAULT_SPARSITY,
    MAX_SPARSITY,
    HierarchicalSettings,
    SqueezeSettings,
    make_method,
)

SPARSITY_MIN, SPARSITY_MAX = 0.5, MAX_SPARSITY  # the slider's range
CENTROID_RATIOS = (0.01, 0.2)  # the centroid-ratio slider's range
LEVEL1_RATIOS = (0.002, 0.05)  # the level-1 ratio slider's range (clamped to the centroid ratio)
MAX_NEW_MIN = 8  # the fewest answer tokens the slider offers (its maximum: AppConfig.max_new_tokens_limit)
TEMPERATURES = (0.0, 2.0)  # the Advanced sliders' ranges (0: greedy; 1: no top-p cut; 1: no penalty)
TOP_PS = (0.05, 1.0)
REPETITIONS = (1.0, 2.0)


@dataclass(frozen=True)
class AppConfig:
    """max_upload_mb: per file; max_files: per upload; queue_size: requests waiting in Gradio's queue at most
    (beyond it a request is refused at once); questions_at_once: questions handed to the engine at once (its
    scheduler answers up to its batch of them together and tells the others their place; beyond this many, Gradio's
    queue holds them); poll_s: how often an open page refreshes the progress; undo_s: how long a deleted document
    can be brought back."""

    max_upload_mb: float = 50.0
    max_files: int = 10
    queue_size: int = 32
    questions_at_once: int = 8
    poll_s: float = 1.0
    undo_s: float = 30.0  # a deleted document can be brought back this long (then it is deleted for good)
    method: str = DEFAULT_METHOD
    sparsity: float = DEFAULT_SPARSITY  # the engine's and the command line's default
    max_new_tokens: int = 64
    max_new_tokens_limit: int = 512
    centroid_ratio: float = SqueezeSettings.centroid_ratio
    level1_ratio: float = HierarchicalSettings.level1_ratio
    title: str = "squeeze-chat"

    def __post_init__(self) -> None:
        if self.max_upload_mb <= 0:
            raise ValueError(f"max_upload_mb must be positive, got {self.max_upload_mb}")
        if self.max_files < 1:
            raise ValueError(f"max_files must be at least 1, got {self.max_files}")
        if self.queue_size < 1:
            raise ValueError(f"queue_size must be at least 1, got {self.queue_size}")
        if self.questions_at_once < 1:
            raise ValueError(f"questions_at_once must be at least 1, got {self.questions_at_once}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be positive, got {self.poll_s}")
        if self.undo_s < 0:
            raise ValueError(f"undo_s must be at least 0, got {self.undo_s}")
        if not SPARSITY_MIN <= self.sparsity <= SPARSITY_MAX:
            raise ValueError(f"sparsity must be in [{SPARSITY_MIN}, {SPARSITY_MAX}], got {self.sparsity}")
        if not 1 <= self.max_new_tokens <= self.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be in [1, {self.max_new_tokens_limit}], got {self.max_new_tokens}")
        method_settings(self.centroid_ratio, self.level1_ratio)  # validates both
        make_method(self.method)  # a registered method

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)


def method_settings(centroid_ratio: float, level1_ratio: float) -> dict:
    """The methods' settings a user's index sliders ask for (level 1 never above level 2; the rest at the
    defaults): method name -> its settings, the `overrides` of that user's requests (Engine.stream)."""
    centroid_ratio = round(float(centroid_ratio), 4)
    level1 = min(round(float(level1_ratio), 4), centroid_ratio)
    return {"squeeze": SqueezeSettings(centroid_ratio=centroid_ratio),
            "hsqueeze": HierarchicalSettings(level1_ratio=level1)}
