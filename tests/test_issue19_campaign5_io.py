"""Issue 19, fifth hostile campaign (findings F6-F10): files the tool reads -- a config, a run's files on
``--resume`` and in ``seco-lab plot``, stored results in ``seco-lab report``, an audit's texts -- were opened
without checking that they are regular files of a sane size (``seco_lab.store.checked_file`` now does).

The FIFO tests cannot hang: a watcher thread opens each FIFO for writing whenever a reader has it open (which
unblocks that reader at once, with end of file) and records that it was opened; the fix refuses the FIFO before
any open.  The device test refuses any open of ``/dev/zero`` (a read of it never ends)."""

import builtins
import io
import os
import shutil
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_cli import run_cli  # the command line in-process: exit status, stdout, stderr

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--seq-len", "64", "--chunk-size", "32", "--steps", "2", "--warmup", "1", "--batch-size", "2",
        "--eval-batches", "1", "--no-progress", "--device", "cpu", "--d-model", "16", "--d-ff", "16",
        "--n-layers", "1", "--n-heads", "2"]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs and /dev/zero are POSIX")


def _one_line_error(rc, err, command, *needles):
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"seco-lab {command}: error: "), err
    for needle in needles:
        assert needle in err, err


@contextmanager
def watched_fifo(path):
    """Make ``path`` a FIFO; yields a list that holds True once any reader opened it (and was released)."""
    os.mkfifo(path)
    opened, stop = [], threading.Event()

    def watch():
        while not stop.wait(0.01):
            try:  # succeeds only while a reader has the FIFO open (or waits in open()): release it with EOF
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            opened.append(True)
            os.close(fd)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield opened
    finally:
        stop.set()
        t.join()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished two-step run (checkpoint step_000002.pt, config.json, metrics.jsonl) to copy and damage."""
    from seco_lab.cli import main

    run = tmp_path_factory.mktemp("c5io") / "run"
    assert main(["train", "--run-dir", str(run), *FAST]) == 0
    return run


def _copy(run, tmp_path):
    out = tmp_path / "r"
    shutil.copytree(run, out)
    return out


# ------------------------------------------------------------------ F6: a huge --config file


def test_a_huge_config_file_is_refused_by_its_size_not_read(tmp_path, capsys):
    """F6: ``truncate -s 4G c.json; seco-lab train --config c.json`` read 4 GiB, then a MemoryError traceback.
    (A sparse file: no disk is used; 64 MiB keeps the old reader's cost small.)"""
    config = tmp_path / "c.json"
    with open(config, "wb") as f:
        f.truncate(64 << 20)
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), *FAST, "--config", str(config))
    _one_line_error(rc, err, "train", f"config file {config} is 67,108,864 bytes", "over the limit of 1,048,576 bytes",
                    "name a JSON or TOML file")
    assert not run.exists()


def test_checked_file_names_the_file_what_it_is_and_the_fix(tmp_path):
    from seco_lab.store import checked_file

    small = tmp_path / "ok.json"
    small.write_text("{}")
    assert checked_file(small, "config file", 10) == small
    with pytest.raises(ValueError, match=r"config file .*ok.json is 2 bytes, 1 over the limit of 1 bytes"):
        checked_file(small, "config file", 1)
    with pytest.raises(ValueError, match=r"is not a regular file \(a folder\); do this"):
        checked_file(tmp_path, "thing", fix="do this")
    with pytest.raises(ValueError, match=r"/dev/null is not a regular file \(a character device"):
        checked_file("/dev/null", "thing")
    with pytest.raises(FileNotFoundError):
        checked_file(tmp_path / "missing", "thing")


# ------------------------------------------------------------------ F7: --config X.TOML


@pytest.mark.parametrize("name", ["c.TOML", "c.Toml"])
def test_an_upper_case_toml_suffix_is_read_as_toml(tmp_path, name):
    """F7: ``c.TOML`` holding valid TOML was parsed as JSON: 'cannot parse (Expecting value ...)'."""
    from seco_lab.config import load_config_file

    path = tmp_path / name
    path.write_text('steps = 2\nmode = "seco"\n')
    assert load_config_file(path) == {"steps": 2, "mode": "seco"}


# ------------------------------------------------------------------ F8: FIFOs in a run or results folder


@pytest.mark.parametrize("name, what", [("metrics.jsonl", "metrics file"),
                                        ("checkpoints/step_000002.pt", "checkpoint")])
def test_resume_refuses_a_fifo_in_the_run_directory_without_opening_it(trained_run, tmp_path, capsys, name, what):
    """F8: a FIFO in place of metrics.jsonl or a checkpoint blocked ``train --resume`` forever."""
    run = _copy(trained_run, tmp_path)
    (run / name).unlink()
    with watched_fifo(run / name) as opened:
        rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", *FAST[:4], "--steps", "3",
                             *FAST[6:])
    assert not opened, f"{name} was opened: {err}"
    _one_line_error(rc, err, "train", f"{what} {run / name} is not a regular file (a FIFO",
                    "remove it, or restore the file the run wrote")


def test_resume_refuses_a_huge_checkpoint_pointer_by_its_size(trained_run, tmp_path, capsys):
    """``checkpoints/latest`` holds one name: a huge one is refused by its size, not read whole."""
    run = _copy(trained_run, tmp_path)
    with open(run / "checkpoints/latest", "r+b") as f:
        f.truncate(64 << 20)
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", *FAST[:4], "--steps", "3", *FAST[6:])
    _one_line_error(rc, err, "train", f"checkpoint pointer {run / 'checkpoints/latest'} is 67,108,864 bytes",
                    "over the limit of 4,096 bytes")


def test_plot_refuses_a_fifo_config_without_opening_it(trained_run, tmp_path, capsys):
    """F8: ``seco-lab plot r`` with r/config.json a FIFO blocked forever."""
    run = _copy(trained_run, tmp_path)
    (run / "config.json").unlink()
    with watched_fifo(run / "config.json") as opened:
        rc, _, err = run_cli(capsys, "plot", str(run), "--out", str(tmp_path / "p.png"))
    assert not opened, err
    _one_line_error(rc, err, "plot", f"run config {run / 'config.json'} is not a regular file (a FIFO")
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("name", ["results.csv", "study.json"])
def test_report_bias_refuses_a_fifo_among_the_stored_results_without_opening_it(tmp_path, capsys, name):
    """F8: ``seco-lab report bias --results b`` with b/results.csv a FIFO blocked forever (pandas opened it)."""
    folder = tmp_path / "b"
    shutil.copytree(ROOT / "reports/bias_study", folder, ignore=shutil.ignore_patterns("cells"))
    (folder / name).unlink()
    with watched_fifo(folder / name) as opened:
        rc, _, err = run_cli(capsys, "report", "bias", "--results", str(folder), "--out", str(tmp_path / "b.md"))
    assert not opened, err
    assert rc == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("seco-lab report: error: "), err
    assert f"{folder / name} is not a regular file (a FIFO" in err and "remove it and rerun" in err, err
    assert not (tmp_path / "b.md").exists()


# ------------------------------------------------------------------ F9: config.json -> /dev/zero


@pytest.fixture
def dev_zero_never_opened(monkeypatch):
    """Any open of /dev/zero fails the test at once (the old reader read it until memory ran out)."""
    real = builtins.open

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.realpath(file) == "/dev/zero":
            raise AssertionError(f"{file} (/dev/zero) was opened")
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)
    monkeypatch.setattr(io, "open", guarded)


def test_plot_refuses_a_config_json_that_is_a_device(trained_run, tmp_path, capsys, dev_zero_never_opened):
    """F9: ``ln -sf /dev/zero r/config.json; seco-lab plot r`` -> MemoryError traceback."""
    run = _copy(trained_run, tmp_path)
    (run / "config.json").unlink()
    (run / "config.json").symlink_to("/dev/zero")
    rc, _, err = run_cli(capsys, "plot", str(run), "--out", str(tmp_path / "p.png"))
    _one_line_error(rc, err, "plot", f"run config {run / 'config.json'} is not a regular file (a character device")


def test_resume_refuses_a_metrics_file_that_is_a_device(trained_run, tmp_path, capsys, dev_zero_never_opened):
    run = _copy(trained_run, tmp_path)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/dev/zero")
    rc, _, err = run_cli(capsys, "train", "--run-dir", str(run), "--resume", *FAST[:4], "--steps", "3", *FAST[6:])
    _one_line_error(rc, err, "train", "metrics file", "is not a regular file (a character device")


# ------------------------------------------------------------------ F10: audit --texts BIG


def test_an_audit_reads_only_the_head_of_a_huge_text_and_keeps_it_narrow(tmp_path):
    """F10: ``audit --quick --texts big.txt`` (700 MB) read the whole file and widened it to int64 (5.5 GiB) for
    3 windows of 257 tokens.  Now an audit reads the first 16 MiB of a file.  The file here: 16 MiB of text, then
    a sparse tail of zero bytes to 64 MiB (no disk) -- read whole, as before, it is refused as binary."""
    from dataclasses import replace

    import numpy as np

    from seco_lab.studies.audit import QUICK, sequence_specs, sequence_tokens
    from seco_lab.studies.audit.sources import _file_ids

    head = 16 << 20  # seco_lab.studies.audit.sources.TEXT_MAX_BYTES
    line = b"the quick brown fox jumps over the lazy dog\n"
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.write(line * (head // len(line) + 1))
        f.truncate(64 << 20)
    cfg = replace(QUICK, texts=(str(big),))
    specs = sequence_specs(cfg, 3, 256)
    assert [(s.offset, s.length) for s in specs] == [(0, 256), (257, 256), (514, 256)]
    ids = _file_ids(cfg.model, big.resolve())
    assert len(ids) <= head and ids.dtype == np.uint8  # the head only, one byte per byte token
    assert bytes(ids[-len(line):]) == line  # cut at a line end
    tokens, targets = sequence_tokens(cfg, specs[1])
    assert tokens.dtype == targets.dtype == __import__("torch").int64
    want = (line * 40)[257:514]
    assert bytes(tokens.tolist()) + bytes(targets[-1:].tolist()) == want
