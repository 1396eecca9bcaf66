"""Issue 19, hangs and memory (items 12-13): every corpus reader refuses FIFOs and devices and reads a
bounded number of bytes, whatever the files' size."""

import os
import subprocess
import sys
import textwrap

import pytest

from seco_lab.data.token_corpus import TokenCorpus, read_text


class ByteTokenizer:
    """A tokenizer stand-in: one token per UTF-8 byte, end-of-sequence 256."""

    eos_token_id = 256

    def encode(self, text):
        return list(text.encode())

    def __len__(self):
        return 257


def test_token_corpus_refuses_a_fifo_instead_of_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from test_corpus_bounds import ByteTokenizer
        from seco_lab.data.token_corpus import TokenCorpus
        try:
            TokenCorpus(8, ByteTokenizer(), paths=[{str(fifo)!r}])
        except ValueError as e:
            print("refused:", e)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "refused:" in r.stdout and "not a regular file" in r.stdout, r.stderr  # on the old reader: a timeout


def test_token_corpus_refuses_devices_and_skips_them_in_folders(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        TokenCorpus(8, ByteTokenizer(), paths=["/dev/zero"])
    with pytest.raises(ValueError, match="not a regular file"):
        read_text("/dev/zero")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "zero").symlink_to("/dev/zero")
    os.mkfifo(folder / "pipe")
    for name in "abcdefgh":
        (folder / f"{name}.txt").write_text("hello world, " * 20)
    corpus = TokenCorpus(8, ByteTokenizer(), paths=[folder], holdout=0.5, max_tokens=10_000)
    assert sorted(corpus.split_files["train"] + corpus.split_files["val"]) == [f"{n}.txt" for n in "abcdefgh"]


def test_token_corpus_reads_a_bounded_prefix_of_a_huge_file(tmp_path):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:  # 6 GB, sparse: text at the start, then zeros (read whole, it would not fit)
        f.write("é abc ".encode() * 1024)
        f.truncate(6 << 30)
    # 1002 bytes (143 x 7-byte "é abc ", then half an "é"): the cut character is dropped, the file kept
    text = read_text(huge, 1002)
    assert len(text.encode()) == 1001 and text.startswith("é abc ")
    folder = tmp_path / "small"
    folder.mkdir()
    for name in "abcdefgh":
        (folder / f"{name}.txt").write_text("x" * 100)
    corpus = TokenCorpus(8, ByteTokenizer(), paths=[folder, huge], holdout=0.5, max_tokens=10**6, max_bytes=5000)
    assert "huge.txt" in corpus.split_files["train"] + corpus.split_files["val"]
    tokens = corpus.train.numel() + corpus.val.numel()
    assert 4000 < tokens <= 5000 + 9  # the byte budget, one token per byte and one end-of-file token per file
