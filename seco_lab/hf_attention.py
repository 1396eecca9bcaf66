"""The chunk-wise KV cache and the chunk attention kernel behind :class:`seco_lab.hf.HFChunkModel`.

Chunk j of a sequence attends to the keys/values of chunks 0..j-1 (the *prefix*,
held by the engine as separate per-chunk leaf tensors) and causally to its own.

* :class:`PrefixCache` is a transformers ``Cache`` (public ``CacheLayerMixin``
  interface) built from the prefix leaves.  Each layer concatenates
  ``[prefix leaves..., own keys]`` exactly once when the model calls ``update``
  and records the chunk's own keys/values -- the tensors the model produced, not
  a slice of the concatenation -- so the chunk's cache output is an owned tensor
  of its c positions, and a seed on it does not zero-fill a (j+1)c buffer in
  backward.
* ``seco_sdpa`` (registered through ``AttentionInterface`` and
  ``AttentionMaskInterface``) computes the same attention as transformers'
  ``sdpa``.  For the chunk pattern -- query i at position P+i attends keys
  0..P+i, no padding -- it groups the query heads that share a key/value head
  into one query block, ``(B, H, c, d) -> (B, H_kv, (H/H_kv) c, d)``, so keys and
  values are never repeated across heads, and uses one additive mask of shape
  ``(1, 1, (H/H_kv) c, P + c)`` built once per forward (not once per layer).
  Every other pattern (full sequence, padding, generation) goes to transformers'
  own ``sdpa`` functions unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

__all__ = ["CHUNK_ATTENTION", "GroupedChunkMask", "PrefixCache", "chunk_sdpa_attention", "chunk_sdpa_mask", "register"]

CHUNK_ATTENTION = "seco_sdpa"


class PrefixLayer(CacheLayerMixin):
    """One layer's cache: the prefix chunks' keys/values, extended once by the running chunk."""

    is_sliding = False

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        super().__init__()
        self.prefix_keys, self.prefix_values = list(keys), list(values)
        self.length = sum(k.shape[-2] for k in self.prefix_keys)
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = bool(self.prefix_keys)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Return ``[prefix, own]`` along the sequence axis: one concatenation, nothing kept but the own part."""
        if self.own is not None:
            raise RuntimeError("a PrefixCache serves exactly one chunk forward; build a new one for the next chunk")
        self.own = (key_states, value_states)
        self.is_initialized = True
        self.length += key_states.shape[-2]
        if not self.prefix_keys:
            return key_states, value_states
        return (torch.cat([*self.prefix_keys, key_states], dim=-2),
                torch.cat([*self.prefix_values, value_states], dim=-2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1


class PrefixCache(Cache):
    """``Cache`` of one chunk forward: ``layers[l]`` holds the prefix leaves of layer l."""

    def __init__(self, past: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], n_layers: int):
        layers = [PrefixLayer([c[l][0] for c in past], [c[l][1] for c in past]) for l in range(n_layers)]
        super().__init__(layers=layers)

    def own(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The running chunk's keys/values per layer, as the model produced them."""
        if any(layer.own is None for layer in self.layers):
            raise RuntimeError("the model did not update every cache layer; is it a decoder with full attention?")
        return tuple(layer.own for layer in self.layers)


# ----------------------------------------------------------------------------- attention


class GroupedChunkMask(torch.Tensor):
    """Marker subclass: an additive mask laid out for grouped query heads, ``(1, 1, rep * c, P + c)``."""


def chunk_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=causal_mask_function, attention_mask=None, allow_is_causal_skip: bool = True,
                    dtype: torch.dtype = torch.float32, config=None, device="cpu", **kwargs):
    """The chunk pattern's grouped additive mask; transformers' ``sdpa_mask`` for every other pattern."""
    plain_causal = (mask_function is causal_mask_function and kv_offset == 0 and q_offset == kv_length - q_length
                    and (attention_mask is None or bool(attention_mask.all())))
    if plain_causal and 1 < q_length < kv_length and config is not None:
        cfg = config.get_text_config(decoder=True)
        rep = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        prefix = kv_length - q_length
        blocked = torch.arange(q_length, device=device)[:, None] + prefix < torch.arange(kv_length, device=device)
        mask = torch.zeros(q_length, kv_length, dtype=dtype, device=device).masked_fill_(blocked, float("-inf"))
        return mask.repeat(rep, 1)[None, None].as_subclass(GroupedChunkMask)
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, dtype=dtype, config=config, device=device, **kwargs)


def chunk_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """softmax(q k^T * scaling + mask) v with query heads grouped per key/value head (no K/V repeat)."""
    if not isinstance(attention_mask, GroupedChunkMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    grouped = query.reshape(b, kv_heads, (heads // kv_heads) * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask.as_subclass(torch.Tensor),
        dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation='seco_sdpa'`` available to every transformers model (idempotent)."""
    AttentionInterface.register(CHUNK_ATTENTION, chunk_sdpa_attention)
    AttentionMaskInterface.register(CHUNK_ATTENTION, chunk_sdpa_mask)
