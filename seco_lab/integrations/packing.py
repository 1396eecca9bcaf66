"""Text for causal-LM training: :func:`pack_dataset` tokenizes text files or a ``datasets.Dataset`` and packs the
documents into rows of a fixed length (``datasets`` is imported when called).  Each file is checked before
``datasets`` reads it: a FIFO, device or socket named is refused (never opened), and a binary or non-UTF-8 file is
skipped with a warning that names it, as :class:`seco_lab.data.token_corpus.TokenCorpus` does."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from pathlib import Path

from ..core.checks import as_int
from ..data.sources import is_regular_file
from ..data.token_corpus import BINARY, NOT_UTF8, decode_utf8, skipped_note
from ..store import checked_file, read_checked_bytes

#: what to do about a text file that cannot be read
_FIX = "name text files or folders of them"

__all__ = ["pack_dataset"]


def pack_dataset(source, tokenizer, seq_len: int, *, text_column: str = "text", add_eos: bool = True,
                 num_proc: int | None = None):
    """Tokenize documents and pack them into rows of exactly ``seq_len`` tokens.

    ``source``: a ``datasets.Dataset`` with a ``text_column``, or text files (a path, a folder
    -- its files, recursively, sorted -- or a list of paths), read with
    ``datasets.load_dataset("text", sample_by="document")``: one document per file.  A FIFO, device or
    socket named is refused (inside a folder: skipped, never opened); a binary (a NUL byte) or non-UTF-8 file is
    skipped with a warning naming it, and when every file is, a ValueError says so.  The
    documents' tokens (each followed by ``tokenizer.eos_token_id`` when ``add_eos``) are
    concatenated in order and cut into rows of ``seq_len``; the incomplete tail is dropped.
    Returns a ``datasets.Dataset`` with ``input_ids`` and ``labels`` (a copy: every token is a
    target; the causal shift happens in the loss).
    """
    import datasets

    seq_len = as_int(seq_len, "seq_len", 2)
    if isinstance(source, datasets.Dataset):
        docs = source
    else:
        files = _utf8_files(_text_files(source), source)
        try:
            docs = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document",
                                         split="train")
        except (datasets.exceptions.DatasetsError, OSError, ValueError) as e:  # e.g. a file changed since checked
            cause = e.__cause__ or e.__context__ or e
            raise ValueError(f"datasets could not read the text file(s) {_names(files)}: "
                             f"{type(cause).__name__}: {' '.join(str(cause).split())}; {_FIX}") from None
    if text_column not in docs.column_names:
        raise ValueError(f"the dataset has no column {text_column!r} (columns: {docs.column_names})")
    if len(docs) == 0:
        raise ValueError("the dataset holds no documents: there is nothing to tokenize and pack")
    eos = tokenizer.eos_token_id
    if add_eos and eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass add_eos=False or set tokenizer.eos_token")

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] if add_eos else x for x in ids]}

    def group(batch):
        flat = [t for ids in batch["ids"] for t in ids]
        rows = [flat[i : i + seq_len] for i in range(0, len(flat) - seq_len + 1, seq_len)]
        return {"input_ids": rows, "labels": [list(r) for r in rows]}

    tokenized = docs.map(tokenize, batched=True, remove_columns=docs.column_names, num_proc=num_proc,
                         desc="tokenize")
    # one batch holding every document: rows may span documents, and only the very end is dropped
    packed = tokenized.map(group, batched=True, batch_size=None, remove_columns=["ids"], desc=f"pack {seq_len}")
    if len(packed) == 0:
        total = sum(len(x) for x in tokenized["ids"])
        raise ValueError(f"the text holds {total} tokens, fewer than one row of seq_len={seq_len}")
    return packed


def _text_files(source) -> list[Path]:
    items: Iterable = [source] if isinstance(source, (str, os.PathLike)) else source
    files: list[Path] = []
    for item in items:
        path = Path(item)
        if path.is_dir():  # a FIFO, device or socket inside is skipped, never opened
            files.extend(sorted(p for p in path.rglob("*") if is_regular_file(p)))
        elif path.exists():
            files.append(checked_file(path, "text file", fix=_FIX))  # a FIFO, device or socket: refused, named
        else:
            raise FileNotFoundError(f"no such text file or folder: {path}")
    if not files:
        raise ValueError(f"no text files found in {source!r}")
    return files


def _utf8_files(files: list[Path], source) -> list[Path]:
    """The files that are UTF-8 text; each other one is skipped with a warning naming it (binary: a NUL byte;
    not UTF-8), as the token corpus does.  A ValueError when none is left."""
    skipped: dict[str, list[Path]] = {BINARY: [], NOT_UTF8: []}
    kept = []
    for f in files:
        try:  # never opens a FIFO or device (one swapped in since it was listed is refused)
            data = read_checked_bytes(f, "text file", max_bytes=None, fix=_FIX)
        except OSError as e:
            raise ValueError(f"cannot read text file {f}: {e.strerror or e}; {_FIX}") from None
        why = decode_utf8(data)[1]
        del data
        if why is None:
            kept.append(f)
        else:
            skipped[why].append(f)
    note = skipped_note(skipped)
    if not kept:
        raise ValueError(f"{source!r} holds no UTF-8 text to pack: {note}; {_FIX}")
    if note:
        warnings.warn(note, stacklevel=3)
    return kept


def _names(files: list[Path]) -> str:
    return f"{', '.join(map(str, files[:3]))}{' ...' if len(files) > 3 else ''}"
