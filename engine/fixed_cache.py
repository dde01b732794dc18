"""A transformers `Cache` that keeps the fixed context (the document) apart from the new tokens of a turn."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class FixedContextLayer(DynamicLayer):
    """One decoder layer's cache: a fixed part that turns never change, and a dynamic part for new tokens.

    fixed_keys, fixed_values: [Hkv, Lkept, D] the fixed context's K/V (a sliding-window layer keeps only its
        last `sliding_window` tokens, so Lkept <= fixed_len)
    fixed_len: tokens in the whole fixed context; new tokens take positions fixed_len, fixed_len + 1, ...
    index: the layer's sparse-attention artifacts (global layers only)
    The dynamic part is DynamicLayer's `keys`/`values`: [1, Hkv, Lnew, D].
    """

    def __init__(
        self,
        fixed_keys: torch.Tensor | None = None,
        fixed_values: torch.Tensor | None = None,
        fixed_len: int = 0,
        sliding_window: int | None = None,
        index: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.fixed_keys = fixed_keys
        self.fixed_values = fixed_values
        self.fixed_len = fixed_len
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.index = index or {}

    def dynamic_length(self) -> int:
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.fixed_len + self.dynamic_length()

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # Our attention function builds its own masks from positions; these sizes describe the dynamic part.
        return self.dynamic_length() + query_length, 0

    def reset_dynamic(self) -> None:
        """Forget the turn's new tokens; the fixed part stays."""
        self.keys = self.values = None
        self.is_initialized = False

    def commit(self) -> None:
        """Append the dynamic part to the fixed part (chunked ingest), trimming sliding layers to their window."""
        if self.dynamic_length() == 0:
            return
        k, v = self.keys[0], self.values[0]  # [Hkv, Lnew, D]
        n = k.shape[1]
        if self.fixed_keys is None:
            self.fixed_keys, self.fixed_values = k, v
        else:
            self.fixed_keys = torch.cat([self.fixed_keys, k], dim=1)
            self.fixed_values = torch.cat([self.fixed_values, v], dim=1)
        if self.sliding_window is not None:
            self.fixed_keys = self.fixed_keys[:, -self.sliding_window :].contiguous()
            self.fixed_values = self.fixed_values[:, -self.sliding_window :].contiguous()
        self.fixed_len += n
        self.reset_dynamic()


class FixedContextCache(Cache):
    """One FixedContextLayer per decoder layer. `reset_dynamic()` between turns keeps the document cached."""

    def __init__(self, layers: list[FixedContextLayer]):
        super().__init__(layers=layers)
        for i, layer in enumerate(layers):
            layer.layer_idx = i

    @classmethod
    def empty(cls, sliding_windows: list[int | None]) -> "FixedContextCache":
        """A cache with no fixed context yet (the start of an ingest). sliding_windows: per layer, None = global."""
        return cls([FixedContextLayer(sliding_window=w) for w in sliding_windows])

    @property
    def fixed_len(self) -> int:
        return self.layers[0].fixed_len

    def reset_dynamic(self) -> None:
        for layer in self.layers:
            layer.reset_dynamic()

    def commit(self) -> None:
        for layer in self.layers:
            layer.commit()
