"""Text tokenized with a real model's tokenizer, packed like the byte corpus.

:class:`TokenCorpus` reads text files (default: the Python standard library's
``*.py``), tokenizes each file with the tokenizer (any object with
``encode(text) -> list[int]``, e.g. a transformers tokenizer), ends each file
with the tokenizer's end-of-sequence token, and packs each split's token stream
into sequences of ``seq_len`` + 1 tokens.  The held-out split is made *by file*:
a file is held out when the CRC-32 of its path relative to its root falls in the
lowest ``holdout`` fraction, so no file contributes to both splits and the split
does not depend on which other files exist.  Batches are deterministic from
(seed, split, index), as in :mod:`seco_lab.data`.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from .data import Batch, default_text_paths

__all__ = ["TokenCorpus", "file_tokens", "held_out", "read_text"]


def text_files(paths=None, pattern: str | None = None) -> list[tuple[str, Path]]:
    """(relative name, path) of every text file under ``paths``, sorted; default: the stdlib's ``*.py``."""
    pattern = pattern or ("*" if paths else "*.py")
    roots = [Path(p) for p in (paths or default_text_paths())]
    missing = [str(p) for p in roots if not p.exists()]
    if missing:
        raise FileNotFoundError(f"text path(s) not found: {', '.join(missing)}")
    out = []
    for root in roots:
        if root.is_dir():
            out.extend((f.relative_to(root).as_posix(), f) for f in sorted(root.rglob(pattern)) if f.is_file())
        else:
            out.append((root.name, root))
    return out


def held_out(name: str, holdout: float) -> bool:
    """True when the file ``name`` belongs to the held-out split (a stable hash of its name)."""
    return zlib.crc32(name.encode()) / 2**32 < holdout


def read_text(path: Path) -> str | None:
    """The file as text, or None when it is binary or not UTF-8."""
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added (a BOS would break packing)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a plain tokenizer without that keyword
        return list(tokenizer.encode(text))


def file_tokens(tokenizer, path, length: int, offset: int = 0) -> torch.Tensor:
    """``length`` consecutive token ids of one file from token ``offset`` (a single long real-text window)."""
    text = read_text(Path(path))
    if text is None:
        raise ValueError(f"{path} is not a UTF-8 text file")
    ids = encode_text(tokenizer, text)
    if offset < 0 or offset + length > len(ids):
        raise ValueError(f"{path} has {len(ids):,} tokens: the window [{offset}, {offset + length}) does not fit; "
                         "take a longer file or a shorter window")
    return torch.tensor(ids[offset : offset + length], dtype=torch.long)


class TokenCorpus:
    """Tokenized text in sequences of ``seq_len`` + 1 tokens, held-out split by file."""

    name = "text"

    def __init__(self, seq_len: int, tokenizer, paths=None, holdout: float = 0.05, max_tokens: int = 1 << 21,
                 pattern: str | None = None, seed: int = 0):
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"holdout must lie in (0, 1), got {holdout}")
        if seq_len < 1 or max_tokens < 2 * (seq_len + 1):
            raise ValueError(f"seq_len={seq_len}, max_tokens={max_tokens}: need seq_len >= 1 and max_tokens >= "
                             f"2 * (seq_len + 1)")
        eos = getattr(tokenizer, "eos_token_id", None)
        files = text_files(paths, pattern)
        # each split gets its share of the token budget; files are read in sorted order until it is spent
        budget = {"train": max_tokens - int(max_tokens * holdout), "val": int(max_tokens * holdout)}
        streams: dict[str, list[int]] = {"train": [], "val": []}
        self.split_files: dict[str, list[str]] = {"train": [], "val": []}
        for name, path in files:
            split = "val" if held_out(name, holdout) else "train"
            if len(streams[split]) >= budget[split]:
                if all(len(streams[s]) >= budget[s] for s in streams):
                    break
                continue
            text = read_text(path)
            if text is None:
                continue
            ids = encode_text(tokenizer, text)
            streams[split].extend(ids + ([eos] if eos is not None else []))
            self.split_files[split].append(name)
        n = seq_len + 1
        pools = {}
        for split, ids in streams.items():
            stream = np.asarray(ids[: budget[split]], dtype=np.int64)
            if len(stream) < n:
                raise ValueError(
                    f"the {split} split of the text under {', '.join(map(str, paths or default_text_paths()))} has "
                    f"{len(stream):,} tokens ({len(self.split_files[split])} files): too few for one sequence of "
                    f"{seq_len} tokens; add files, raise holdout/max_tokens or shorten seq_len")
            pools[split] = torch.as_tensor(stream[: len(stream) // n * n].reshape(-1, n))
        self.train, self.val = pools["train"], pools["val"]
        self.seq_len, self.seed, self.holdout = seq_len, seed, holdout
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size

    def batch(self, split: str, index: int, size: int) -> Batch:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        pool = self.train if split == "train" else self.val
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, index])
        rows = torch.as_tensor(rng.integers(0, len(pool), size))
        s = pool[rows]
        return Batch(s[:, :-1], s[:, 1:], torch.zeros(s.shape[0], s.shape[1] - 1, dtype=torch.bool))
