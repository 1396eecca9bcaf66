"""The chunk-model protocol: the only thing the engines know about a model.

A causal LM is driven chunk by chunk.  Chunk ``j`` sees the key/value caches of
all earlier chunks and its own global start position, and returns the *summed*
token loss of the chunk together with its own per-layer keys and values::

    out = model.chunk_forward(tokens_j, targets_j, past, start=j * c)
    out.loss_sum                  # scalar: sum of token losses (ignore_index excluded)
    out.cache                     # ((k_1, v_1), ..., (k_L, v_L)) of this chunk only

``past`` is a list with one entry per earlier chunk, in order; each entry is the
``cache`` tuple that chunk returned.  Keys/values must carry the autograd graph
back to whatever produced them, so that gradients flow into cache leaves.

The engine, not the model, normalises the loss (by the number of target tokens
of the whole sequence), so the normalisation is identical for every engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

__all__ = ["ChunkCache", "ChunkModel", "ChunkOutput", "flat_cache", "unflat_cache"]

LayerKV = tuple[torch.Tensor, torch.Tensor]
ChunkCache = tuple[LayerKV, ...]


@dataclass
class ChunkOutput:
    loss_sum: torch.Tensor
    cache: ChunkCache


@runtime_checkable
class ChunkModel(Protocol):
    """Anything with ``chunk_forward`` (and ideally ``max_positions``/``vocab_size``)."""

    def chunk_forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None,
        past: Sequence[ChunkCache],
        start: int,
        ignore_index: int = -100,
    ) -> ChunkOutput: ...

    def parameters(self): ...

    def named_parameters(self): ...


def flat_cache(cache: ChunkCache) -> list[torch.Tensor]:
    """Flatten ((k1, v1), ..., (kL, vL)) into [k1, v1, ..., kL, vL]."""
    return [t for kv in cache for t in kv]


def unflat_cache(tensors: Sequence[torch.Tensor]) -> ChunkCache:
    it = iter(tensors)
    return tuple((k, v) for k, v in zip(it, it))
