"""Associative recall at several chunk distances: the study's long-range task.

Vocabulary (K = (vocab - 1) // 4): 0 is the query marker, keys lie in [1, 1+K),
values in [1+K, 1+2K), filler in [1+2K, vocab).  A sequence of k chunks of c
tokens holds ``pairs`` (key, value) pairs, pair r in chunk k-1-d_r (d_r drawn
without replacement from ``distances``) at a random offset, and ends, in the
last chunk, with every key queried as (0, key, value) in random order.  Values
appear nowhere else, so the loss on a queried value -- a *far* target of
distance d -- can fall below ln K only by reading the cache of the chunk d back:
through a chain with at least one hop, which a sparse step keeps only when both
chunks are drawn (probability (t)_2/(k)_2 without replacement, rho^2 Bernoulli).

Every batch is a pure function of (seed, split, index): every arm of a study sees
the same token stream, and a resumed run sees what it would have seen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

SPLITS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class RecallBatch:
    tokens: torch.Tensor  # (B, n) long
    targets: torch.Tensor  # (B, n) long: targets[:, i] = tokens[:, i+1] (the last one: the final value)
    distance: torch.Tensor  # (B, n) long: d for a far target, 0 elsewhere

    @property
    def far(self) -> torch.Tensor:
        return self.distance > 0

    def rows(self, sl: slice) -> RecallBatch:
        return RecallBatch(self.tokens[sl], self.targets[sl], self.distance[sl])


@dataclass(frozen=True)
class RecallTask:
    """k = ``num_chunks`` chunks of ``chunk_size`` tokens, ``pairs`` pairs per sequence at chunk
    distances drawn from ``distances`` (1 <= d <= k-1), queried in the last chunk."""

    num_chunks: int = 16
    chunk_size: int = 8
    vocab_size: int = 32
    distances: tuple[int, ...] = (1, 7, 15)
    pairs: int = 3
    layout: str = "fixed"  # "fixed": pairs at chunk starts, queries in distance order; "random": both random

    def __post_init__(self):
        k, c = self.num_chunks, self.chunk_size
        if k < 2:
            raise ValueError(f"num_chunks must be >= 2 (a pair and a query chunk), got {k}")
        if self.vocab_size < 9:
            raise ValueError(f"vocab_size must be >= 9 (marker, keys, values, filler), got {self.vocab_size}")
        if not self.distances or any(not 1 <= d <= k - 1 for d in self.distances):
            raise ValueError(f"distances must lie in [1, num_chunks-1] = [1, {k - 1}], got {self.distances}")
        if len(set(self.distances)) != len(self.distances):
            raise ValueError(f"distances must be distinct, got {self.distances}")
        if not 1 <= self.pairs <= min(len(self.distances), self.n_keys):
            raise ValueError(f"pairs={self.pairs} must lie in [1, min(len(distances), K)] = "
                             f"[1, {min(len(self.distances), self.n_keys)}]")
        if self.layout not in ("fixed", "random"):
            raise ValueError(f"layout must be 'fixed' or 'random', got {self.layout!r}")
        if self.layout == "fixed" and self.pairs != len(self.distances):
            raise ValueError(f"the fixed layout queries every distance: pairs={self.pairs} must equal "
                             f"len(distances)={len(self.distances)}")
        if c < 2 or 3 * self.pairs > c + 1:
            raise ValueError(f"chunk_size={c} cannot hold a pair (needs >= 2) and {self.pairs} queries of 3 tokens "
                             f"in the last chunk (needs >= {3 * self.pairs - 1}); raise chunk_size or lower pairs")

    @property
    def n_keys(self) -> int:
        return (self.vocab_size - 1) // 4

    @property
    def seq_len(self) -> int:
        return self.num_chunks * self.chunk_size

    @property
    def chance_loss(self) -> float:
        """ln K: the far-token loss of a model that predicts a uniform value without reading back."""
        return math.log(self.n_keys)

    def to_dict(self) -> dict:
        return asdict(self)

    def batch(self, seed: int, split: str, index: int, size: int) -> RecallBatch:
        """Batch ``index`` of ``split`` ('train', 'val', 'test'): ``size`` sequences, deterministic."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
        rng = np.random.default_rng([int(seed), SPLITS[split], int(index)])
        k, c, m, K, n = self.num_chunks, self.chunk_size, self.pairs, self.n_keys, self.seq_len
        seq = rng.integers(1 + 2 * K, self.vocab_size, size=(size, n + 1))
        dist = np.zeros((size, n + 1), dtype=np.int64)
        q0 = n + 1 - 3 * m  # the queries fill the tail: (0, key, value) * m
        fixed = self.layout == "fixed"
        for b in range(size):
            keys = 1 + rng.choice(K, m, replace=False)
            vals = 1 + K + rng.integers(0, K, m)
            ds = np.sort(self.distances) if fixed else rng.choice(np.asarray(self.distances), m, replace=False)
            for key, val, d in zip(keys, vals, ds):
                pos = (k - 1 - int(d)) * c + (0 if fixed else int(rng.integers(0, c - 1)))
                seq[b, pos], seq[b, pos + 1] = key, val
            order = np.arange(m) if fixed else rng.permutation(m)
            seq[b, q0::3], seq[b, q0 + 1 :: 3], seq[b, q0 + 2 :: 3] = 0, keys[order], vals[order]
            dist[b, q0 + 2 :: 3] = ds[order]
        t = torch.as_tensor(seq, dtype=torch.long)
        # position i predicts token i+1, so a far target sits one position before its value
        return RecallBatch(t[:, :-1], t[:, 1:], torch.as_tensor(dist[:, 1:]))
