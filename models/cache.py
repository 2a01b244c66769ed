"""A KV cache that appends in place: transformers' DynamicCache with layers that keep spare room.

transformers' `DynamicLayer.update` concatenates the cache with the new entries, so every forward
copies the whole cache, and that copy grows with the cache until it is most of a decode or
verification step (55 % of a one-token step of the toy target over an 8,100-token cache, 2 CPU cores). `GrowingLayer` writes new entries into a buffer with room to spare (growing
it by a quarter when full, so a long decode reallocates a handful of times), and hands attention
views of the filled part. Rolling back (`crop`, or assigning a leading view of the buffer, which
is what `crop` does) only moves the length; the next entries overwrite what was dropped. Assigning
any other tensor (pruning's `index_select`) makes it the new buffer.

    cache = growing_cache(config)          # a DynamicCache whose layers are GrowingLayer
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE = 0.25        # room added when a layer's buffer is full, as a share of what it then holds
MIN_SPARE = 64      # ... and at least this many entries (a decode step adds one)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views of buffers with spare capacity."""

    def __init__(self, **kwargs):
        self._buffers: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._length = {"keys": 0, "values": 0}
        super().__init__(**kwargs)

    def _get(self, name: str) -> torch.Tensor | None:
        buf = self._buffers[name]
        if buf is None or buf.dim() != 4:
            return buf
        return buf[..., : self._length[name], :]

    def _set(self, name: str, tensor: torch.Tensor | None) -> None:
        buf = self._buffers[name]
        if (tensor is not None and buf is not None and tensor.dim() == 4 and buf.dim() == 4
                and tensor.data_ptr() == buf.data_ptr() and tensor.stride() == buf.stride()
                and tensor.shape[:2] == buf.shape[:2] and tensor.shape[-1] == buf.shape[-1]
                and tensor.shape[-2] <= buf.shape[-2]):
            self._length[name] = tensor.shape[-2]      # a leading view of our buffer: a rollback
            return
        self._buffers[name] = tensor
        self._length[name] = tensor.shape[-2] if tensor is not None and tensor.dim() == 4 else 0

    keys = property(lambda self: self._get("keys"), lambda self, t: self._set("keys", t))
    values = property(lambda self: self._get("values"), lambda self, t: self._set("values", t))

    def _append(self, name: str, new: torch.Tensor) -> None:
        buf, length = self._buffers[name], self._length[name]
        need = length + new.shape[-2]
        if buf is None or buf.dim() != 4 or need > buf.shape[-2]:
            capacity = need + max(MIN_SPARE, int(need * SPARE))
            # zeros, not garbage: a writer that attends over the whole buffer with the spare slots
            # masked (a captured CUDA graph) would still get NaN from a masked NaN times zero
            grown = new.new_zeros(*new.shape[:2], capacity, new.shape[-1])
            if buf is not None and buf.dim() == 4 and length:
                grown[..., :length, :] = buf[..., :length, :]
            self._buffers[name] = buf = grown
        buf[..., length:need, :] = new
        self._length[name] = need

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append("keys", key_states)
        self._append("values", value_states)
        return self.keys, self.values

    def reserve(self, n: int) -> None:
        """Make room for `n` more entries without adding any (growing as an append would)."""
        for name in ("keys", "values"):
            buf = self._buffers[name]
            length = self._length[name]
            if buf is None or buf.dim() != 4:
                raise ValueError("reserve: the layer holds no entries yet (prefill first)")
            if length + n > buf.shape[-2]:
                self._append(name, buf.new_zeros(*buf.shape[:2], n, buf.shape[-1]))
                self._length[name] = length

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys' and values' whole buffers [b, kv_heads, capacity, head_dim], spare room included."""
        return self._buffers["keys"], self._buffers["values"]

    def advance(self, n: int) -> None:
        """Count `n` entries written into the buffers past the filled part (by a writer that was
        handed `buffers()`, such as a captured CUDA graph) as held."""
        for name in ("keys", "values"):
            if self._length[name] + n > self._buffers[name].shape[-2]:
                raise ValueError(f"advance by {n}: only {self._buffers[name].shape[-2] - self._length[name]} slots left")
            self._length[name] += n

    def held(self) -> int:
        """Entries held (get_seq_length without building a view: a captured step asks every layer
        before each replay)."""
        return self._length["keys"]

    def get_seq_length(self) -> int:
        buf = self._buffers["keys"]
        return self._length["keys"] if buf is not None and buf.dim() == 4 else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove entries (transformers 5's convention): only the length
        moves, as the base class's slicing would end in, without building a view per layer (a
        speculative round rolls back every layer once a round)."""
        buf = self._buffers["keys"]
        if tokens_to_remove > 0 or buf is None or buf.dim() != 4:
            return super().crop(tokens_to_remove)       # its error for a positive count; its path otherwise
        for name in ("keys", "values"):
            self._length[name] = max(0, self._length[name] + tokens_to_remove)

    def capacity(self) -> int:
        """Entries the layer's buffers can hold before the next reallocation."""
        buf = self._buffers["keys"]
        return buf.shape[-2] if buf is not None and buf.dim() == 4 else 0


def growing_cache(text_config) -> DynamicCache:
    """A DynamicCache for `text_config` whose layers append in place (see the module doc).
    Sliding-window layers, which transformers manages differently, stay as they are."""
    cache = DynamicCache(config=text_config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
