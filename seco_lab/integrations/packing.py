"""Text for causal-LM training: :func:`pack_dataset` tokenizes text files or a ``datasets.Dataset`` and packs the
documents into rows of a fixed length (``datasets`` is imported when called)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ..core.checks import as_int

__all__ = ["pack_dataset"]


def pack_dataset(source, tokenizer, seq_len: int, *, text_column: str = "text", add_eos: bool = True,
                 num_proc: int | None = None):
    """Tokenize documents and pack them into rows of exactly ``seq_len`` tokens.

    ``source``: a ``datasets.Dataset`` with a ``text_column``, or text files (a path, a folder
    -- its files, recursively, sorted -- or a list of paths), read with
    ``datasets.load_dataset("text", sample_by="document")``: one document per file.  The
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
        files = _text_files(source)
        docs = datasets.load_dataset("text", data_files=[str(f) for f in files], sample_by="document", split="train")
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
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such text file or folder: {path}")
    if not files:
        raise ValueError(f"no text files found in {source!r}")
    return files
