"""Associative recall at several chunk distances: the study's long-range task.

Vocabulary (K = (vocab - 1) // 4): 0 is the query marker, keys lie in [1, 1+K),
values in [1+K, 1+2K), filler in [1+2K, vocab).  A sequence of k chunks of c tokens
holds ``pairs`` (key, value) pairs and queries every key once as (0, key, value); the
value of a query is a *far* target of distance d when its pair lies d chunks before
the query's chunk.  Values appear nowhere else, so a far target's loss can fall below
ln K only by reading that chunk's cache: through a chain with at least one hop, which a
sparse step keeps only when both chunks are drawn (probability (t)_2/(k)_2 without
replacement, rho^2 Bernoulli).

Layouts:

* ``anchored`` (default): chunk 0 opens with every pair (k_1 v_1 k_2 v_2 ...); the query
  of pair r opens chunk d_r, d_r the r-th smallest of ``distances`` -- one far target per
  distance and sequence.  A 2-layer model learns it in ~150 steps (exactly computed
  gradient), so the study has room to see a scheme learn late or not at all.
* ``random``: pair r in chunk k-1-d_r at a random offset (d_r drawn without replacement),
  queries shuffled at the end of the last chunk: content-based recall (an induction
  circuit), which the tiny model does not learn within a few hundred steps.

Filler: ``counting`` (f, f+1, f+2, ... mod F from a random start: locally predictable, so
its loss falls fast and the far targets carry the remaining signal) or ``random`` (iid).

Every batch is a pure function of (seed, split, index): every arm of a study sees the
same token stream, and a resumed run sees what it would have seen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

__all__ = ["RecallBatch", "RecallTask"]

SPLITS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class RecallBatch:
    tokens: torch.Tensor  # (B, n) long
    targets: torch.Tensor  # (B, n) long: targets[:, i] = tokens[:, i+1] (the last one: the next token)
    distance: torch.Tensor  # (B, n) long: d for a far target, 0 elsewhere

    @property
    def far(self) -> torch.Tensor:
        return self.distance > 0

    def rows(self, sl: slice) -> RecallBatch:
        return RecallBatch(self.tokens[sl], self.targets[sl], self.distance[sl])


@dataclass(frozen=True)
class RecallTask:
    """k = ``num_chunks`` chunks of ``chunk_size`` tokens, ``pairs`` pairs per sequence at chunk
    distances from ``distances`` (1 <= d <= k-1); see the module docstring for the layouts."""

    num_chunks: int = 8
    chunk_size: int = 8
    vocab_size: int = 32
    distances: tuple[int, ...] = (1, 4, 7)
    pairs: int = 3
    layout: str = "anchored"
    filler: str = "counting"

    def __post_init__(self):
        k, c, m = self.num_chunks, self.chunk_size, self.pairs
        if k < 2:
            raise ValueError(f"num_chunks must be >= 2 (a pair and a query chunk), got {k}")
        if self.vocab_size < 9:
            raise ValueError(f"vocab_size must be >= 9 (marker, keys, values, filler), got {self.vocab_size}")
        if not self.distances or any(not 1 <= d <= k - 1 for d in self.distances):
            raise ValueError(f"distances must lie in [1, num_chunks-1] = [1, {k - 1}], got {self.distances}")
        if len(set(self.distances)) != len(self.distances):
            raise ValueError(f"distances must be distinct, got {self.distances}")
        if self.filler not in ("counting", "random"):
            raise ValueError(f"filler must be 'counting' or 'random', got {self.filler!r}")
        if self.layout == "anchored":
            if m != len(self.distances):
                raise ValueError(f"the anchored layout queries every distance once: pairs={m} must equal "
                                 f"len(distances)={len(self.distances)}")
            if c < 3 or 2 * m > c:
                raise ValueError(f"the anchored layout needs chunk_size >= max(3, 2*pairs) = {max(3, 2 * m)} "
                                 f"(pairs in chunk 0, a 3-token query per chunk), got {c}")
        elif self.layout == "random":
            if c < 2 or 3 * m > c + 1:
                raise ValueError(f"chunk_size={c} cannot hold a pair (needs >= 2) and {m} queries of 3 tokens "
                                 f"in the last chunk (needs >= {3 * m - 1}); raise chunk_size or lower pairs")
        else:
            raise ValueError(f"layout must be 'anchored' or 'random', got {self.layout!r}")
        if not 1 <= m <= min(len(self.distances), self.n_keys):
            raise ValueError(f"pairs={m} must lie in [1, min(len(distances), K)] = "
                             f"[1, {min(len(self.distances), self.n_keys)}]")

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
        K, n = self.n_keys, self.seq_len
        F = self.vocab_size - 1 - 2 * K
        if self.filler == "random":
            seq = rng.integers(1 + 2 * K, self.vocab_size, size=(size, n + 1))
        else:
            seq = 1 + 2 * K + (rng.integers(0, F, size=(size, 1)) + np.arange(n + 1)) % F
        dist = np.zeros((size, n + 1), dtype=np.int64)
        place = self._anchored if self.layout == "anchored" else self._random
        for b in range(size):
            keys = 1 + rng.choice(K, self.pairs, replace=False)
            vals = 1 + K + rng.integers(0, K, self.pairs)
            place(rng, seq[b], dist[b], keys, vals)
        t = torch.as_tensor(seq, dtype=torch.long)
        # position i predicts token i+1, so a far target sits one position before its value
        return RecallBatch(t[:, :-1], t[:, 1:], torch.as_tensor(dist[:, 1:]))

    def _anchored(self, rng, seq, dist, keys, vals) -> None:
        m, c = self.pairs, self.chunk_size
        seq[0 : 2 * m : 2], seq[1 : 2 * m : 2] = keys, vals
        for r, d in enumerate(sorted(self.distances)):
            q = int(d) * c
            seq[q : q + 3] = 0, keys[r], vals[r]
            dist[q + 2] = d

    def _random(self, rng, seq, dist, keys, vals) -> None:
        k, c, m, n = self.num_chunks, self.chunk_size, self.pairs, self.seq_len
        ds = rng.choice(np.asarray(self.distances), m, replace=False)
        for key, val, d in zip(keys, vals, ds):
            pos = (k - 1 - int(d)) * c + int(rng.integers(0, c - 1))
            seq[pos], seq[pos + 1] = key, val
        order = rng.permutation(m)
        q0 = n + 1 - 3 * m  # the queries fill the tail: (0, key, value) * m
        seq[q0::3], seq[q0 + 1 :: 3], seq[q0 + 2 :: 3] = 0, keys[order], vals[order]
        dist[q0 + 2 :: 3] = ds[order]
