"""A transformers `Cache` that keeps the fixed context (the document) apart from the new tokens of a turn.

The new tokens live in static per-layer buffers written at a device-side offset (as transformers' StaticLayer
does), so a decode step touches no host state and can be replayed from a CUDA graph: slot i of a layer's buffers
holds the new token at position fixed_len + i, and attention masks unwritten slots by position (they lie after
every query).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kernels.dispatch import backend_for
from kernels.tables import Keep

MIN_NEW_CAPACITY = 64  # new-token slots allocated at least (a turn that needs more grows them before it starts)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (the call is recorded, not run)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FixedContextLayer(DynamicLayer):
    """One decoder layer's cache: a fixed part that turns never change, and a static buffer for new tokens.

    fixed_keys, fixed_values: [Hkv, Lkept, D] the fixed context's K/V (a sliding-window layer keeps only its
        last `sliding_window` tokens, so Lkept <= fixed_len); views of a preallocated store during an ingest
    fixed_len: tokens in the whole fixed context; new tokens take positions fixed_len, fixed_len + 1, ...
    indexes: method name -> the layer's index of that method (engine.methods.LayerIndex; global layers only);
        the fixed K/V are in the layout of one of them, or in original order (engine.context.session.ContextSession.arrange)
    new_keys, new_values: [Hkv, capacity, D] the turn's new tokens (slot i = position fixed_len + i)
    new_len: [1] int64 on the device, slots written so far (advanced in place: graph-replayable)
    lookup_sync: a global layer's counters for its one-launch decode lookups (engine.attention.one_launch: the Triton
        backend's; the reference ignores them), made with the new-token buffers; None on a sliding layer
    """

    def __init__(
        self,
        fixed_keys: torch.Tensor | None = None,
        fixed_values: torch.Tensor | None = None,
        fixed_len: int = 0,
        sliding_window: int | None = None,
        indexes: dict | None = None,
        fixed_capacity: int = 0,
    ):
        super().__init__()
        self.fixed_keys = fixed_keys
        self.fixed_values = fixed_values
        self.fixed_len = fixed_len
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.indexes = indexes or {}
        self.fixed_capacity = fixed_capacity  # ingest: the global layers' K/V are preallocated for this many tokens
        self._store: tuple[torch.Tensor, torch.Tensor] | None = None
        self.new_keys: torch.Tensor | None = None
        self.new_values: torch.Tensor | None = None
        self.new_len: torch.Tensor | None = None
        self.lookup_sync: torch.Tensor | None = None
        self.host_new = 0  # slots written, as the host knows it (eager calls only; a graph replay does not move it)

    # ------------------------------------------------------------------------------------------- the new tokens
    def reserve(self, like: torch.Tensor, slots: int) -> None:
        """Make room for `slots` new tokens (like: a [.., Hkv, n, D] tensor giving dtype, device and shape).
        Keeps what is written; reallocates only when the capacity is short (never during a graph capture)."""
        hkv, d = like.shape[-3], like.shape[-1]
        if self.lookup_sync is None and self.sliding_window is None and not capturing():
            self.lookup_sync = backend_for(like.device).kernel("centroid").lookup_sync(like.device)
        if self.new_keys is not None and self.new_keys.shape[1] >= slots:
            return
        if capturing():
            raise RuntimeError("new-token buffers must be reserved before a CUDA graph is captured")
        cap = max(1 << (slots - 1).bit_length(), MIN_NEW_CAPACITY)  # a power of two: a few more tokens fit next time
        keys = like.new_zeros(hkv, cap, d)
        values = like.new_zeros(hkv, cap, d)
        if self.new_keys is not None and self.host_new:
            keys[:, : self.host_new] = self.new_keys[:, : self.host_new]
            values[:, : self.host_new] = self.new_values[:, : self.host_new]
        self.new_keys, self.new_values = keys, values
        if self.new_len is None:
            self.new_len = torch.zeros(1, dtype=torch.int64, device=like.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the call's new K/V ([1, Hkv, n, D]) at slots new_len ... (device offset). Returns them unchanged:
        the attention function reads the layer's buffers itself."""
        n = key_states.shape[-2]
        self.reserve(key_states[0], self.host_new + n)
        backend_for(self.new_keys.device).kernel("append").append_tokens(  # one launch on a GPU
            key_states[0], value_states[0], self.new_keys, self.new_values, self.new_len)
        self.appended(n)
        return key_states, value_states

    def appended(self, n: int) -> None:
        """n new tokens were written at the device count (eager calls move the host's count too)."""
        if not capturing():
            self.host_new += n

    def new_kv(self, static: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' K/V to attend to: [Hkv, n, D] each. static (a captured step): every slot, the unwritten
        ones masked by position; else the written slots only."""
        n = self.new_keys.shape[1] if static else self.host_new
        return self.new_keys[:, :n], self.new_values[:, :n]

    def dynamic_length(self) -> int:
        return self.host_new

    def get_seq_length(self) -> int:
        return self.fixed_len + self.dynamic_length()

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        # Our attention function builds its own masks from positions; these sizes describe the dynamic part.
        return self.dynamic_length() + query_length, 0

    def reset_dynamic(self) -> None:
        """Forget the turn's new tokens; the fixed part stays (the buffers are kept for the next turn)."""
        self.host_new = 0
        if self.new_len is not None:
            with torch.inference_mode():  # the counter may be an inference tensor (made inside a turn)
                self.new_len.zero_()

    # ------------------------------------------------------------------------------------------- the fixed part
    def commit(self) -> None:
        """Append the written new tokens to the fixed part (chunked ingest), trimming sliding layers to their
        window. A global layer with a fixed_capacity writes into a store allocated once (no copy of the past)."""
        n = self.host_new
        if n == 0:
            return
        k, v = self.new_keys[:, :n], self.new_values[:, :n]  # [Hkv, n, D]
        if self.sliding_window is None and self.fixed_capacity >= self.fixed_len + n:
            if self._store is None:
                shape = (k.shape[0], self.fixed_capacity, k.shape[2])
                self._store = (k.new_empty(shape), v.new_empty(shape))
            ks, vs = self._store
            ks[:, self.fixed_len : self.fixed_len + n] = k
            vs[:, self.fixed_len : self.fixed_len + n] = v
            self.fixed_keys, self.fixed_values = ks[:, : self.fixed_len + n], vs[:, : self.fixed_len + n]
        else:
            if self.fixed_keys is None:
                self.fixed_keys, self.fixed_values = k.clone(), v.clone()
            else:
                self.fixed_keys = torch.cat([self.fixed_keys, k], dim=1)
                self.fixed_values = torch.cat([self.fixed_values, v], dim=1)
            if self.sliding_window is not None:
                self.fixed_keys = self.fixed_keys[:, -self.sliding_window :].contiguous()
                self.fixed_values = self.fixed_values[:, -self.sliding_window :].contiguous()
        self.fixed_len += n
        self.reset_dynamic()

    def release_new(self) -> None:
        """Free the new-token buffers (the end of an ingest: the session allocates its own)."""
        self.new_keys = self.new_values = self.new_len = None
        self.host_new = 0

    def fork(self) -> "FixedContextLayer":
        """The same fixed part (its K/V tensors and indexes, not copies) with new-token buffers of its own: another
        sequence over the same context."""
        return FixedContextLayer(self.fixed_keys, self.fixed_values, self.fixed_len, self.sliding_window, self.indexes)


class FixedContextCache(Cache):
    """One FixedContextLayer per decoder layer. `reset_dynamic()` between turns keeps the document cached."""

    def __init__(self, layers: list[FixedContextLayer]):
        super().__init__(layers=layers)
        for i, layer in enumerate(layers):
            layer.layer_idx = i

    @torch.compiler.disable  # opaque to torch.compile'd decoder layers (engine.model.compiled): it moves host-side counters
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache.update without offloading or lazily added layers (this cache has one layer per decoder layer)."""
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    @classmethod
    def empty(cls, sliding_windows: list[int | None], capacity: int = 0) -> "FixedContextCache":
        """A cache with no fixed context yet (the start of an ingest). sliding_windows: per layer, None = global;
        capacity: the context's length when known (the global layers' K/V are then allocated once, at full size)."""
        return cls([FixedContextLayer(sliding_window=w, fixed_capacity=capacity if w is None else 0)
                    for w in sliding_windows])

    @property
    def fixed_len(self) -> int:
        return self.layers[0].fixed_len

    def reset_dynamic(self) -> None:
        for layer in self.layers:
            layer.reset_dynamic()

    def keep_new(self, count: torch.Tensor, n: int | None = None) -> None:
        """Keep only the first count[0] of the new tokens written (count: [1] int64 on the device: a padded call's real
        tokens; the padding's slots are written over by the next tokens, and masked by position until then); n: the
        same count on the host (None while a CUDA graph is being captured: the caller sets it after each replay)."""
        for layer in self.layers:
            if layer.new_len is not None:
                layer.new_len.copy_(count)
                if n is not None:
                    layer.host_new = n

    def replayed(self, steps: int) -> None:
        """`steps` steps replayed from a CUDA graph each wrote a token at the device offset: the host's count of the
        new tokens follows (an eager call after them reads them all)."""
        for layer in self.layers:
            if layer.new_len is not None:
                layer.host_new += steps

    def reserve(self, slots: int) -> None:
        """Room for `slots` new tokens in every layer that holds a fixed part (a turn over a ready context)."""
        for layer in self.layers:
            if layer.fixed_keys is not None:
                layer.reserve(layer.fixed_keys, slots)

    def commit(self) -> None:
        for layer in self.layers:
            layer.commit()

    def release_new(self) -> None:
        for layer in self.layers:
            layer.release_new()

    def fork(self) -> "FixedContextCache":
        """Another sequence over the same fixed context: every layer's fixed part shared (FixedContextLayer.fork),
        new-token buffers of its own (allocated by its first turn's reserve)."""
        return FixedContextCache([layer.fork() for layer in self.layers])


class BatchCache(FixedContextCache):
    """The cache of one call over several sequences (engine.attention.function.BatchStep), each with its own
    FixedContextCache: row b of a layer's new K/V goes to caches[b]. What transformers asks of a cache besides
    (the sequence length, the mask sizes) is the first sequence's; the engine's attention masks each sequence by
    its own positions. A layer's new K/V go to every sequence's buffers in one launch on a GPU
    (kernels.append_ops.append_tokens_batch); keep: where that launch leaves its tables' host copies, to live as long
    as a CUDA graph that captured their upload (engine.model.batch_graph), or None (an eager step's)."""

    def __init__(self, caches: list[FixedContextCache], keep: Keep = None):
        if not caches or len({len(c.layers) for c in caches}) != 1:
            raise ValueError("a batch needs one or more caches of as many layers each")
        super().__init__(caches[0].layers)
        self.caches = caches
        self.keep = keep

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states / value_states: [B, Hkv, n, D], row b for caches[b]. Returns them unchanged."""
        if key_states.shape[0] != len(self.caches):
            raise ValueError(f"{key_states.shape[0]} rows of new K/V for {len(self.caches)} sequences")
        layers = [cache.layers[layer_idx] for cache in self.caches]
        n = key_states.shape[-2]
        for b, layer in enumerate(layers):
            layer.reserve(key_states[b], layer.host_new + n)
        backend_for(key_states.device).kernel("append").append_tokens_batch(
            key_states, value_states, [layer.new_keys for layer in layers], [layer.new_values for layer in layers],
            [layer.new_len for layer in layers], self.keep)
        for layer in layers:
            layer.appended(n)
        return key_states, value_states
