"""Issue 19, fifth hostile campaign (413 probes by a reviewer who wrote none of the fixes, on a fresh clone of
a5339a7): the command-line findings, each with the test of its fix.  F-numbers are the campaign's."""

import json
import shutil
from pathlib import Path

import pytest

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _audit_copy(tmp_path):
    folder = tmp_path / "a"
    shutil.copytree(ROOT / "reports/audit/k128", folder, ignore=shutil.ignore_patterns("vectors"))
    return folder


# ------------------------------------------------------------------ data loss

def test_f2_f3_audit_report_is_never_written_over_a_users_file_or_a_folder(tmp_path, capsys):
    """F2: `audit --tables-only --report notes.txt` replaced the user's notes.txt; F3: a folder gave a traceback.
    Both are refused before anything is computed, as `seco-lab report` refuses them."""
    folder = _audit_copy(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    (tmp_path / "d").mkdir()
    for target, words in ((notes, "is not a Markdown report"), (tmp_path / "d", "is a folder")):
        assert main(["audit", "--tables-only", "--out", str(folder), "--report", str(target)]) == 2
        assert words in capsys.readouterr().err
    assert notes.read_text() == "my notes" and list((tmp_path / "d").iterdir()) == []


def test_f22_overwrite_never_takes_a_users_file_for_a_run_temporary(tmp_path, capsys):
    """F22: `--overwrite` deleted a user's config.json.tmp1 and metrics.jsonl.tmp as the run's own temporaries;
    the package's temporaries are now NAME.seco-tmp<pid>, so such files make the run folder a user's."""
    from test_issue19_inputs import FAST

    run = tmp_path / "r"
    assert main(["train", *FAST, "--run-dir", str(run)]) == 0
    for name in ("config.json.tmp1", "metrics.jsonl.tmp"):
        (run / name).write_text("mine")
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 2
    capsys.readouterr()
    assert (run / "config.json.tmp1").read_text() == "mine" and (run / "metrics.jsonl.tmp").read_text() == "mine"
    (run / "config.json.tmp1").unlink()
    (run / "metrics.jsonl.tmp").unlink()
    torn = (run / "metrics.jsonl").read_text()[:40]  # a killed writer's own temporary (a torn log) still goes
    assert torn.startswith('{"step": ') and "\n" not in torn
    (run / "metrics.jsonl.seco-tmp4242").write_text(torn)
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 0
    assert not (run / "metrics.jsonl.seco-tmp4242").exists()


def test_f23_a_study_never_clears_a_users_file_named_like_a_temporary(tmp_path):
    """F23: `study bias --quick --out out` deleted the user's out/results.json.tmp2 as a stale temporary."""
    import re

    from seco_lab.store import TEMP_FILE, clear_stale

    for name in ("results.json.tmp2", "notes.md.tmp1", "x.csv.gz.tmp3", ".gitignore.tmp4"):
        assert not re.fullmatch(TEMP_FILE, name), name
        (tmp_path / name).write_text("important")
    (tmp_path / "results.csv.seco-tmp99").touch()  # a write killed before it wrote anything
    clear_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gitignore.tmp4", "notes.md.tmp1", "results.json.tmp2",
                                                         "x.csv.gz.tmp3"]
    (tmp_path / "results.csv.seco-tmp99").write_text("torn")  # torn, or a user's under that name: kept (c38 B9)
    with pytest.warns(UserWarning, match="kept .*results.csv.seco-tmp99: a write killed half-way"):
        clear_stale(tmp_path)
    assert (tmp_path / "results.csv.seco-tmp99").read_text() == "torn"


def test_atomic_write_leaves_only_a_tagged_temporary(tmp_path, monkeypatch):
    """What F22/F23 rest on: a write killed half-way leaves NAME.seco-tmp<pid>, the one name the cleanups take."""
    import os

    from seco_lab.store import atomic_write

    def boom(f):
        f.write(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "study.json", boom)
    left = [p.name for p in tmp_path.iterdir()]
    assert left in ([], [f"study.json.seco-tmp{os.getpid()}"])


# ------------------------------------------------------------------ silent wrong results

def test_f13_audit_refuses_lora_settings_for_a_full_parameter_audit(tmp_path, capsys):
    assert main(["audit", "--quick", "--out", str(tmp_path / "o"), "--params", "full", "--lora-r", "4"]) == 2
    assert "lora_r apply to params='lora' only" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_f14_a_damaged_unit_is_named_in_the_tables_run_and_the_report(tmp_path, capsys):
    """F14: a damaged cost unit silently emptied the cost and equal-compute tables; it is now named, on stderr
    and in the report, as stored but damaged (not as 'not yet run')."""
    folder = _audit_copy(tmp_path)
    (folder / "units" / "cost-s00.json").write_text("{tr")
    # its rows would leave the tables: refused unless asked for (campaign 10 K1), then rebuilt without it
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 2
    assert "cost-s00.json is damaged" in capsys.readouterr().err
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(folder), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "cost-s00.json is damaged" in err
    report = (folder / "report.md").read_text()
    assert "`cost-s00` is stored but damaged" in report


# ------------------------------------------------------------------ hangs and tracebacks

def test_f11_audit_draws_are_bounded_up_front(tmp_path, capsys):
    for flag in ("--mc-draws", "--cost-draws"):
        assert main(["audit", "--quick", "--out", str(tmp_path / "o"), flag, "1000000000000"]) == 2
        assert "above the 10,000 an audit takes" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model, words", [("nope", "neither a known name"), ("x.gguf", "no such .gguf file")])
def test_f12_an_unknown_audit_model_is_refused_offline(tmp_path, capsys, model, words):
    assert main(["audit", "--quick", "--out", str(tmp_path / "o"), "--model", model]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and "huggingface.co" not in err


@pytest.mark.parametrize("argv, words", [
    (["--committed"], "--quick and --committed exclude each other"),
    (["--length", "-5"], "length must be >= 1"),
])
def test_f1_study_audit_refusals_are_one_line_errors(tmp_path, capsys, argv, words):
    rc = main(["study", "audit", "--quick", "--out", str(tmp_path / "o"), *argv])
    assert rc == 2 and words in capsys.readouterr().err


# ------------------------------------------------------------------ misleading errors

def test_f4_collect_only_on_a_folder_without_a_study_says_so(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["study", "train", "--quick", "--collect-only", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no study was started" in err and "writable" not in err


def test_f5_an_unknown_part_is_named_before_any_folder_is_read(tmp_path, capsys):
    assert main(["study", "train", "--quick", "--part", "bogus", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "unknown --part 'bogus'" in err and "run the main study first" not in err


def test_the_stale_unit_record_is_json(tmp_path):
    """audit.json lists unusable units as {stem: why} (the report reads it)."""
    folder = _audit_copy(tmp_path)
    (folder / "units" / "cost-s00.json").write_text("[]")
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(folder), "--no-progress"]) == 0
    assert "cost-s00" in json.loads((folder / "audit.json").read_text())["units_unusable"]


def test_f16_an_hf_dropout_override_is_refused_before_the_run_folder_exists(tmp_path, capsys):
    argv = ["train", "--hf-model", "llama", "--hf-override", "attention_dropout=0.5", "--steps", "2", "--warmup", "0",
            "--seq-len", "32", "--chunk-size", "8", "--batch-size", "2", "--no-progress", "--run-dir",
            str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "attention_dropout=0.5" in err and "Traceback" not in err and not (tmp_path / "r").exists()


def test_f15_an_hf_model_takes_a_sequence_beyond_the_tiny_models_position_limit():
    """F15: --seq-len 5000 with an HF model was refused by the tiny transformer's max_positions (4096), with advice
    (--max-positions) that --hf-model refuses; the HF model's own limit is the builder's to check."""
    from seco_lab.config import TrainConfig

    cfg = TrainConfig(hf_model="llama", data="text", seq_len=5000, chunk_size=1000, steps=2, warmup=0)
    assert cfg.validate().seq_len == 5000
    with pytest.raises(ValueError, match="max_positions=4096 < seq_len=5000"):
        TrainConfig(data="text", seq_len=5000, chunk_size=1000, steps=2, warmup=0).validate()
