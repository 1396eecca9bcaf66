"""Issue 19, campaign 24 (data readers): the tokenizer corpus names every file it skips and why (F8), and
``pack_dataset`` checks each file before ``datasets`` sees it (F9)."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from test_corpus_bounds import ByteTokenizer  # the stand-in tokenizer of the corpus tests

from seco_lab.data.token_corpus import TokenCorpus
from seco_lab.integrations.packing import pack_dataset

ENGLISH = "The quick brown fox jumps over the lazy dog, and then it rests in the shade. " * 60


class CharTokenizer:
    """A stand-in for ``pack_dataset``: one id per character, eos = 0."""

    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) for c in t] for t in texts]}


def _folder(tmp_path, **files):
    d = tmp_path / "d"
    d.mkdir()
    for name, data in files.items():
        (d / name.replace("_", ".")).write_bytes(data)
    return d


def _corpus(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = TokenCorpus(*args, **kwargs)
    return corpus, [str(w.message) for w in caught]


# -- F8: TokenCorpus ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, why", [(b"some text\0more text " * 50, "binary"), (b"caf\xe9 " * 500, "not UTF-8")])
def test_token_corpus_names_each_file_it_skips_and_counts_only_files_read(tmp_path, bad, why):
    d = _folder(tmp_path, a_txt=ENGLISH.encode(), b_txt=bad)
    corpus, messages = _corpus(16, ByteTokenizer(), paths=[d], max_tokens=20_000)
    assert corpus.split_files["train"] + corpus.split_files["val"] == ["a.txt"]
    skipped = [m for m in messages if "skipped as" in m]
    assert len(skipped) == 1 and "1 text file(s) skipped as " + why in skipped[0] and str(d / "b.txt") in skipped[0]
    few = [m for m in messages if "too few to hold out whole files" in m]
    assert len(few) == 1 and "the 1 text file(s) read under" in few[0], messages  # was: "the 2 text file(s)"


def test_token_corpus_binary_skip_uses_the_byte_corpus_wording(tmp_path):
    from seco_lab.data.sources import TextCorpus

    d = _folder(tmp_path, a_txt=ENGLISH.encode(), b_txt=b"x\0y" * 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TextCorpus(16, paths=[d])
    byte_note = next(str(w.message) for w in caught if "skipped as binary" in str(w.message))
    _, messages = _corpus(16, ByteTokenizer(), paths=[d], max_tokens=20_000)
    assert byte_note in messages


def test_token_corpus_error_says_the_only_file_was_skipped_as_binary(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(ENGLISH.encode()[:18_000] + b"\0" * 4096)
    with pytest.raises(ValueError) as e:
        TokenCorpus(64, ByteTokenizer(), paths=[f], max_tokens=40_000)
    msg = str(e.value)
    assert "0 tokens" in msg and "skipped as binary" in msg and str(f) in msg and "\n" not in msg
    g = tmp_path / "latin.txt"
    g.write_bytes(b"caf\xe9 " * 500)
    with pytest.raises(ValueError, match=r"skipped as not UTF-8.*latin\.txt"):
        TokenCorpus(64, ByteTokenizer(), paths=[g], max_tokens=40_000)


def test_token_corpus_records_skipped_files(tmp_path):
    d = _folder(tmp_path, a_txt=ENGLISH.encode(), b_txt=b"\0", c_txt=b"\xff\xfe" * 10)
    corpus, _ = _corpus(16, ByteTokenizer(), paths=[d], max_tokens=20_000)
    assert corpus.binary_files == [d / "b.txt"] and corpus.non_utf8_files == [d / "c.txt"]


# -- F9: pack_dataset -----------------------------------------------------------------------------------------------


def test_pack_dataset_refuses_a_fifo_naming_it_without_opening_it(tmp_path):
    fifo = tmp_path / "f.txt"
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        from test_issue19_campaign24_data import CharTokenizer
        from seco_lab.integrations.packing import pack_dataset
        try:
            pack_dataset({str(fifo)!r}, CharTokenizer(), 4)
        except ValueError as e:
            print("refused:", e)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "refused:" in r.stdout and "not a regular file" in r.stdout and "FIFO" in r.stdout, r.stdout + r.stderr
    assert str(fifo) in r.stdout and "no such" not in r.stdout


@pytest.mark.parametrize("bad, why", [(bytes(range(256)) * 40, "binary"), (b"caf\xe9 " * 500, "not UTF-8")])
def test_pack_dataset_skips_binary_and_non_utf8_files_by_name(tmp_path, bad, why):
    d = _folder(tmp_path, a_txt=b"hello world " * 10, b_txt=bad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = pack_dataset(d, CharTokenizer(), 8)
    stream = [ord(c) for c in "hello world " * 10] + [0]
    assert rows["input_ids"] == [stream[i : i + 8] for i in range(0, len(stream) - 7, 8)]
    notes = [str(w.message) for w in caught if "skipped as" in str(w.message)]
    assert len(notes) == 1 and "1 text file(s) skipped as " + why in notes[0] and str(d / "b.txt") in notes[0]


@pytest.mark.parametrize("bad, why", [(os.urandom(4096) + b"\0", "binary"), (b"caf\xe9 " * 500, "not UTF-8")])
def test_pack_dataset_refuses_when_every_file_is_skipped(tmp_path, bad, why):
    f = tmp_path / "only.txt"
    f.write_bytes(bad)
    with pytest.raises(ValueError) as e:
        pack_dataset(f, CharTokenizer(), 8)
    msg = str(e.value)
    assert "skipped as " + why in msg and str(f) in msg and "no UTF-8 text" in msg and "\n" not in msg


def test_pack_dataset_turns_a_datasets_failure_into_one_line_naming_the_file(tmp_path, monkeypatch):
    import datasets

    f = tmp_path / "a.txt"
    f.write_text("hello world " * 10)

    def failing(*args, **kwargs):
        raise datasets.exceptions.DatasetGenerationError("An error occurred while generating the dataset")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(ValueError) as e:
        pack_dataset(f, CharTokenizer(), 8)
    assert str(f) in str(e.value) and "\n" not in str(e.value)
