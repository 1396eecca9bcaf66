"""Text tokenized with a real model's tokenizer, packed like the byte corpus.

:class:`TokenCorpus` reads text files (default: the Python standard library's
``*.py``), tokenizes each file with the tokenizer (any object with
``encode(text) -> list[int]``, e.g. a transformers tokenizer), ends each file
with the tokenizer's end-of-sequence token, and packs each split's token stream
into sequences of ``seq_len`` + 1 tokens.  The held-out split is made *by file*:
a file is held out when the CRC-32 of its path relative to its root falls in the
lowest ``holdout`` fraction, so no file contributes to both splits and the split
does not depend on which other files exist.  Batches are deterministic from
(seed, split, index), as in :mod:`seco_lab.data.sources`.
"""

from __future__ import annotations

import codecs
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from .sources import Batch, corpus_files, default_text_paths, is_regular_file, pool_batch

#: bytes read per token of the budget at most: real text averages 3-5 bytes per BPE token
BYTES_PER_TOKEN_BOUND = 16

__all__ = ["TokenCorpus", "file_tokens", "held_out", "read_text"]


def text_files(paths=None, pattern: str | None = None) -> list[tuple[str, Path]]:
    """(relative name, path) of every text file under ``paths``, sorted; default: the stdlib's ``*.py``.
    FIFOs and devices are refused when named, skipped inside folders (:func:`seco_lab.data.sources.corpus_files`)."""
    pattern = pattern or ("*" if paths else "*.py")
    roots = [Path(p) for p in (paths or default_text_paths())]
    out = []
    for root in roots:
        files = corpus_files([root], pattern)
        out.extend((f.relative_to(root).as_posix() if root.is_dir() else root.name, f) for f in files)
    return out


def held_out(name: str, holdout: float) -> bool:
    """True when the file ``name`` belongs to the held-out split (a stable hash of its name)."""
    return zlib.crc32(name.encode()) / 2**32 < holdout


def read_text(path: Path, max_bytes: int | None = None) -> str | None:
    """The file as text (its first ``max_bytes`` bytes, cut at a character boundary), or None when it is
    binary or not UTF-8.  Only regular files are opened: a FIFO or device is refused, never read."""
    path = Path(path)
    if not is_regular_file(path):
        raise ValueError(f"{path} is not a regular file (a FIFO, device or socket cannot be read as text)")
    with open(path, "rb") as f:
        data = f.read() if max_bytes is None else f.read(max_bytes)
    if b"\0" in data:  # anywhere: a text head does not make a binary file text
        return None
    try:  # a cut inside a multi-byte character drops that character, not the file
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=max_bytes is None or len(data) < max_bytes)
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
                 pattern: str | None = None, seed: int = 0, max_bytes: int | None = None):
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"holdout must lie in (0, 1), got {holdout}")
        if seq_len < 1 or max_tokens < 2 * (seq_len + 1):
            raise ValueError(f"seq_len={seq_len}, max_tokens={max_tokens}: need seq_len >= 1 and max_tokens >= "
                             f"2 * (seq_len + 1)")
        eos = getattr(tokenizer, "eos_token_id", None)
        files = text_files(paths, pattern)
        # each split gets its share of the token budget; files are read in sorted order until it is spent
        budget = {"train": max_tokens - int(max_tokens * holdout), "val": int(max_tokens * holdout)}
        # and a byte budget: the files read stop at it whatever their size (a 6 GB log, a huge single file)
        bytes_left = BYTES_PER_TOKEN_BOUND * max_tokens if max_bytes is None else max_bytes
        streams: dict[str, list[int]] = {"train": [], "val": []}
        self.split_files: dict[str, list[str]] = {"train": [], "val": []}
        for name, path in files:
            split = "val" if held_out(name, holdout) else "train"
            if len(streams[split]) >= budget[split]:
                if all(len(streams[s]) >= budget[s] for s in streams):
                    break
                continue
            if bytes_left <= 0:
                break
            text = read_text(path, bytes_left)
            if text is None:
                continue
            bytes_left -= len(text.encode())
            ids = encode_text(tokenizer, text)
            streams[split].extend(ids + ([eos] if eos is not None else []))
            self.split_files[split].append(name)
        n = seq_len + 1
        self.held_out_by = "file"  # "position" when the files are too few to hold out whole ones
        where = ", ".join(map(str, paths or default_text_paths()))
        streams = {split: np.asarray(ids[: budget[split]], dtype=np.int64) for split, ids in streams.items()}
        if min(len(v) for v in streams.values()) < n:
            # too few files for a split by file (one file, or none fell into the held-out share): hold out the
            # text's last sequences instead, as the byte corpus does, and say so
            stream = np.concatenate([streams["train"], streams["val"]])
            n_seq = len(stream) // n
            n_val = max(1, int(round(n_seq * holdout)))
            if n_seq - n_val < 1:
                raise ValueError(f"the text under {where} has {len(stream):,} tokens: too few for sequences of "
                                 f"{seq_len} tokens with a held-out split (need at least {2 * n:,}); add text or "
                                 "shorten --seq-len")
            warnings.warn(f"the {len(files)} text file(s) under {where} are too few to hold out whole files: the "
                          f"last {n_val} of {n_seq} sequences are held out instead", stacklevel=2)
            streams = {"train": stream[: (n_seq - n_val) * n], "val": stream[(n_seq - n_val) * n: n_seq * n]}
            self.split_files = {"train": [*self.split_files["train"], *self.split_files["val"]], "val": []}
            self.held_out_by = "position"
        pools = {split: torch.as_tensor(v[: len(v) // n * n].reshape(-1, n)) for split, v in streams.items()}
        self.train, self.val = pools["train"], pools["val"]
        self.seq_len, self.seed, self.holdout = seq_len, seed, holdout
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size

    def batch(self, split: str, index: int, size: int) -> Batch:
        return pool_batch(self, split, index, size)
