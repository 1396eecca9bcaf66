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

A file that is binary (a NUL byte, the byte corpus's test) or not UTF-8 in the part read is skipped and named
in a warning (or in the error, when too little text is left); :func:`skipped_note` says it the same way for
:func:`seco_lab.integrations.packing.pack_dataset`.
"""

from __future__ import annotations

import codecs
import hashlib
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from .sources import Batch, corpus_files, default_text_paths, is_regular_file, pool_batch, read_text_files

#: bytes read per token of the budget at most: real text averages 3-5 bytes per BPE token
BYTES_PER_TOKEN_BOUND = 16

__all__ = ["BINARY", "NOT_UTF8", "TokenCorpus", "decode_utf8", "file_tokens", "held_out", "read_text", "skipped_note",
           "text_or_why"]

#: why a file is not read as text: the reasons :func:`text_or_why` gives
BINARY, NOT_UTF8 = "binary (a NUL byte)", "not UTF-8"


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
    return text_or_why(path, max_bytes)[0]


def text_or_why(path: Path, max_bytes: int | None = None) -> tuple[str | None, str | None]:
    """(the file as text, None) as :func:`read_text` reads it, or (None, why): :data:`BINARY` when a byte read is
    NUL (the byte corpus's test, :func:`seco_lab.data.sources.read_text_files`), :data:`NOT_UTF8` when the bytes
    read do not decode.  Only regular files are opened: a FIFO or device is refused, never read."""
    path = Path(path)
    if not is_regular_file(path):
        raise ValueError(f"{path} is not a regular file (a FIFO, device or socket cannot be read as text)")
    limit = sys.maxsize if max_bytes is None else max_bytes
    data, binary = read_text_files([path], limit)
    if binary:  # anywhere in the part read: a text head does not make a binary file text
        return None, BINARY
    return decode_utf8(data, final=max_bytes is None or len(data) < max_bytes)


def decode_utf8(data: bytes, final: bool = True) -> tuple[str | None, str | None]:
    """(text, None), or (None, :data:`BINARY` / :data:`NOT_UTF8`); ``final=False``: ``data`` is a prefix, and a cut
    inside a multi-byte character at its end drops that character, not the file."""
    if b"\0" in data:
        return None, BINARY
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(data, final=final), None
    except UnicodeDecodeError:
        return None, NOT_UTF8


def skipped_note(skipped: dict[str, list[Path]]) -> str:
    """``N text file(s) skipped as WHY: a, b, c ...`` for each reason with files (the byte corpus's wording),
    joined by '; '; '' when none."""
    return "; ".join(f"{len(files)} text file(s) skipped as {why}: "
                     f"{', '.join(map(str, files[:3]))}{' ...' if len(files) > 3 else ''}"
                     for why, files in skipped.items() if files)


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens added (a BOS would break packing)."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a plain tokenizer without that keyword
        return list(tokenizer.encode(text))


def file_tokens(tokenizer, path, length: int, offset: int = 0) -> torch.Tensor:
    """``length`` consecutive token ids of one file from token ``offset`` (a single long real-text window)."""
    text, why = text_or_why(Path(path))
    if text is None:
        raise ValueError(f"{path} is not a UTF-8 text file ({why}); name a text file")
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
        skipped: dict[str, list[Path]] = {BINARY: [], NOT_UTF8: []}
        read = hashlib.sha256()  # the text read, before its tokenizer: tells a changed text from a changed tokenizer
        for name, path in files:
            split = "val" if held_out(name, holdout) else "train"
            if len(streams[split]) >= budget[split]:
                if all(len(streams[s]) >= budget[s] for s in streams):
                    break
                continue
            if bytes_left <= 0:
                break
            text, why = text_or_why(path, bytes_left)
            if text is None:
                skipped[why].append(path)
                continue
            bytes_left -= len(text.encode())
            read.update(f"{name}\0{len(text)}\0".encode())
            read.update(text.encode())
            ids = encode_text(tokenizer, text)
            streams[split].extend(ids + ([eos] if eos is not None else []))
            self.split_files[split].append(name)
        n = seq_len + 1
        self.held_out_by = "file"  # "position" when the files are too few to hold out whole ones
        where = ", ".join(map(str, paths or default_text_paths()))
        note = skipped_note(skipped)
        self.binary_files, self.non_utf8_files = skipped[BINARY], skipped[NOT_UTF8]  # skipped, in the part read
        streams = {split: np.asarray(ids[: budget[split]], dtype=np.int64) for split, ids in streams.items()}
        if min(len(v) for v in streams.values()) < n:
            # too few files for a split by file (one file, or none fell into the held-out share): hold out the
            # text's last sequences instead, as the byte corpus does, and say so
            stream = np.concatenate([streams["train"], streams["val"]])
            n_seq = len(stream) // n
            n_val = max(1, int(round(n_seq * holdout)))
            if n_seq - n_val < 1:
                raise ValueError(f"the text under {where} has {len(stream):,} tokens{'; ' + note if note else ''}: "
                                 f"too few for sequences of {seq_len} tokens with a held-out split (need at least "
                                 f"{2 * n:,}); add text or shorten --seq-len")
            n_read = len(self.split_files["train"]) + len(self.split_files["val"])
            warnings.warn(f"the {n_read} text file(s) read under {where} are too few to hold out whole files: the "
                          f"last {n_val} of {n_seq} sequences are held out instead", stacklevel=2)
            streams = {"train": stream[: (n_seq - n_val) * n], "val": stream[(n_seq - n_val) * n: n_seq * n]}
            self.split_files = {"train": [*self.split_files["train"], *self.split_files["val"]], "val": []}
            self.held_out_by = "position"
        if note:
            warnings.warn(note, stacklevel=2)
        pools = {split: torch.as_tensor(v[: len(v) // n * n].reshape(-1, n)) for split, v in streams.items()}
        self.train, self.val = pools["train"], pools["val"]
        self.seq_len, self.seed, self.holdout = seq_len, seed, holdout
        self.text_digest = read.hexdigest()[:16]
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size

    def batch(self, split: str, index: int, size: int) -> Batch:
        return pool_batch(self, split, index, size)
