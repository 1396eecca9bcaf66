"""Training data without downloads: a synthetic long-range task and byte-level text.

Both sources hand out batches deterministically from (seed, split, index), so a
resumed or distributed run sees exactly the sequences it would have seen.

* :class:`KeyValueTask` -- the first chunk(s) hold key->value pairs; after filler,
  keys are queried again and the model must produce the value.  The value
  tokens of the queries are the *far* targets: their loss can only fall by
  reading information one or more chunks back.
* :class:`TextCorpus` -- any text files (default: the Python standard library's own
  sources), tokenised as bytes (vocabulary 256) and cut into fixed-length
  sequences, with the last ``holdout`` fraction held out for evaluation.
"""

from __future__ import annotations

import stat
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import TEXT_VOCAB
from ..core.checks import as_float, as_int, check_key_value_task, check_seed, guard_memory

__all__ = ["Batch", "KeyValueTask", "TEXT_VOCAB", "TextCorpus", "default_text_paths", "read_text_bytes"]

SPLITS = ("train", "val")

@dataclass
class Batch:
    tokens: torch.Tensor  # (B, n)
    targets: torch.Tensor  # (B, n)
    far: torch.Tensor  # (B, n) bool: targets whose loss needs information from earlier chunks

    def far_targets(self, ignore_index: int = -100) -> torch.Tensor:
        return torch.where(self.far, self.targets, torch.full_like(self.targets, ignore_index))

    def slice(self, rows) -> Batch:
        return Batch(self.tokens[rows], self.targets[rows], self.far[rows])


class KeyValueTask:
    """Associative recall across chunks.

    Vocabulary: 0 is the query marker, keys lie in [1, 1+K), values in
    [1+K, 1+2K) and filler in [1+2K, vocab) with K = (vocab - 1) // 4.  A
    sequence starts with ``n_pairs`` (key, value) pairs, continues with random
    filler, and ends with the ``n_pairs`` keys queried again in random order as
    (0, key, value).  Values appear nowhere else, so the loss on a queried value
    -- a *far* target -- can only fall by reading the chunk that defined it.
    """

    name = "synthetic"

    def __init__(self, seq_len: int, vocab_size: int = 64, n_pairs: int = 1, seed: int = 0):
        seq_len, vocab_size = as_int(seq_len, "seq_len", 1), as_int(vocab_size, "vocab_size")
        n_pairs, seed = as_int(n_pairs, "n_pairs"), check_seed(seed)
        self.n_keys = check_key_value_task(seq_len, vocab_size, n_pairs)
        self.seq_len, self.vocab_size, self.n_pairs, self.seed = seq_len, vocab_size, n_pairs, seed

    def batch(self, split: str, index: int, size: int) -> Batch:
        index, size = check_batch_request(split, index, size, self.seq_len)
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, index])
        n, m, K = self.seq_len + 1, self.n_pairs, self.n_keys
        seqs = rng.integers(1 + 2 * K, self.vocab_size, size=(size, n))
        far = np.zeros((size, n), dtype=bool)
        q0 = n - 3 * m
        for b in range(size):
            keys = 1 + rng.choice(K, m, replace=False)
            vals = 1 + K + rng.integers(0, K, m)
            seqs[b, 0 : 2 * m : 2], seqs[b, 1 : 2 * m : 2] = keys, vals
            order = rng.permutation(m)
            seqs[b, q0::3], seqs[b, q0 + 1 :: 3], seqs[b, q0 + 2 :: 3] = 0, keys[order], vals[order]
            far[b, q0 + 2 :: 3] = True
        t = torch.as_tensor(seqs, dtype=torch.long)
        # position i predicts token i+1: a far target sits at i where token i+1 is a queried value
        return Batch(t[:, :-1], t[:, 1:], torch.as_tensor(far[:, 1:]))


def check_batch_request(split, index, size, seq_len: int | None = None) -> tuple[int, int]:
    """A batch request of any corpus: ``split`` is 'train' or 'val' (no silent fallback to
    'val' for 'test'), ``index`` an integer >= 0, ``size`` an integer >= 1 whose batch (``seq_len`` + 1
    tokens a sequence: int64 inputs, targets and the far-token mask) fits under the memory guard."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    index, size = as_int(index, "batch index", 0), as_int(size, "batch size", 1)
    if seq_len is not None:
        guard_memory(f"a batch of {size:,} sequences", 3 * 8 * size * (seq_len + 1),
                     f"{seq_len + 1} int64 tokens each, as inputs, targets and mask", "lower the batch size",
                     force=None)
    return index, size


def as_path_list(paths, what: str = "paths") -> list[Path] | None:
    """None, one path (str or os.PathLike) or a sequence of them, as a list of Paths."""
    if paths is None:
        return None
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    try:
        paths = list(paths)
        if any(isinstance(p, (str, bytes)) and not p.strip() for p in paths):  # Path("") would be the cwd
            raise ValueError(f"{what}: an empty path ('') names no file; name text files or folders (the current "
                             "directory is '.')")
        out = [Path(p) for p in paths]
    except TypeError:
        raise TypeError(f"{what} must be a path or a list of paths, got {paths!r}") from None
    if not out:
        raise ValueError(f"{what} is empty; pass None for the default corpus, or name files or folders")
    return out


def default_text_paths() -> list[Path]:
    """The Python standard library's own sources: present on every machine with Python."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def corpus_files(paths, pattern: str) -> list[Path]:
    """The regular files a corpus reads: each named file, and the files under each named folder matching
    ``pattern`` (sorted: the corpus is the same on every run).  A FIFO, device or socket named directly
    is refused -- reading it could block forever (a FIFO) or never end (``/dev/zero``); inside a folder
    it is skipped, never opened."""
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"text path(s) not found: {', '.join(missing)}")
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob(pattern) if is_regular_file(f)))
        elif is_regular_file(p):
            files.append(p)
        else:
            raise ValueError(f"text path {p} is not a regular file or folder (a FIFO, device or socket "
                             "cannot be read as a corpus); name text files or folders")
    # a file named twice (or named and inside a named folder) is read once: a copy would put training text
    # into the held-out split
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def read_text_bytes(files, max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the text files' concatenation (binary files skipped, see
    :func:`read_text_files`)."""
    return read_text_files(files, max_bytes)[0]


def read_text_files(files, max_bytes: int, block: int = 1 << 20) -> tuple[bytes, list[Path]]:
    """The first ``max_bytes`` bytes of the files' concatenation, and the files skipped as binary.

    Each file is read only as far as the budget needs, in blocks; a file is binary when any byte
    read from it is NUL -- anywhere in the part used, not only in its first block, so a text head
    followed by megabytes of NULs is skipped rather than trained on."""
    parts, skipped, total = [], [], 0
    for f in files:
        if total >= max_bytes:
            break
        chunks, want = [], max_bytes - total
        try:
            with open(f, "rb") as fh:
                while want > 0:
                    data = fh.read(min(block, want))
                    if not data:
                        break
                    if b"\0" in data:  # binary, not text
                        chunks = None
                        break
                    chunks.append(data)
                    want -= len(data)
        except OSError as e:
            raise ValueError(f"cannot read text file {f}: {e.strerror}") from None
        if chunks is None:
            skipped.append(Path(f))
            continue
        parts.append(b"".join(chunks))
        total += len(parts[-1])
    return b"".join(parts), skipped



class TextCorpus:
    """Byte-level text, packed into sequences of ``seq_len`` + 1 bytes."""

    name = "text"
    vocab_size = TEXT_VOCAB

    def __init__(self, seq_len: int, paths=None, holdout: float = 0.05, max_bytes: int = 16 << 20,
                 pattern: str | None = None, seed: int = 0):
        seq_len, max_bytes, seed = as_int(seq_len, "seq_len", 1), as_int(max_bytes, "max_bytes", 1), check_seed(seed)
        holdout = as_float(holdout, "holdout")
        # default corpus: the standard library's *.py; a folder the user names: every text file in it
        paths = as_path_list(paths, "text paths")
        pattern = pattern or ("*" if paths else "*.py")
        paths = [Path(p) for p in (paths or default_text_paths())]
        files = corpus_files(paths, pattern)
        if not 0.0 < holdout < 1.0:
            raise ValueError(f"holdout must lie in (0, 1), got {holdout}")
        text, binary = read_text_files(files, max_bytes)
        stream = np.frombuffer(text, dtype=np.uint8)
        n = seq_len + 1
        n_seq = len(stream) // n
        n_val = max(1, int(round(n_seq * holdout)))
        if n_seq - n_val < 1:
            skipped = (f"; {len(binary)} file(s) skipped as binary (a NUL byte): "
                       f"{', '.join(map(str, binary[:3]))}{' ...' if len(binary) > 3 else ''}" if binary else "")
            raise ValueError(
                f"the text under {', '.join(map(str, paths))} has {len(stream):,} bytes of text{skipped}: too few "
                f"for sequences of {seq_len} tokens with a held-out split (need at least {2 * n:,})"
            )
        if binary:
            warnings.warn(f"{len(binary)} text file(s) skipped as binary (a NUL byte): "
                          f"{', '.join(map(str, binary[:3]))}{' ...' if len(binary) > 3 else ''}", stacklevel=2)
        seqs = torch.as_tensor(stream[: n_seq * n].reshape(n_seq, n).astype(np.int64))
        self.train, self.val = seqs[: n_seq - n_val], seqs[n_seq - n_val :]
        self.seq_len, self.seed, self.files, self.num_bytes = seq_len, seed, len(files), len(stream)
        self.binary_files = binary  # skipped: a NUL byte in the part read

    def batch(self, split: str, index: int, size: int) -> Batch:
        return pool_batch(self, split, index, size)


def pool_batch(corpus, split: str, index: int, size: int) -> Batch:
    """``size`` packed sequences of ``corpus.train`` / ``corpus.val`` (rows of seq_len + 1 tokens) drawn from
    (seed, split, index): the batch of a text corpus (byte or token); no far-token mask."""
    index, size = check_batch_request(split, index, size, corpus.seq_len)
    pool = corpus.train if split == "train" else corpus.val
    rng = np.random.default_rng([corpus.seed, 0 if split == "train" else 1, index])
    rows = torch.as_tensor(rng.integers(0, len(pool), size))
    s = pool[rows]
    return Batch(s[:, :-1], s[:, 1:], torch.zeros(s.shape[0], s.shape[1] - 1, dtype=torch.bool))
