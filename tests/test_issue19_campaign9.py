"""Campaign 9 (docs/hostile_campaign_9.md): resume identity -- J2 (the text a run trains on), J6 (a config.json
lacking fields), J10 (a damaged metrics.jsonl blamed on the checkpoint) and a NaN step record.  Each test fails on
7c98ce7."""

import json
import math
import os

import pytest
import torch
from helpers import FAST, assert_refused_before_torch, copy_run

from seco_lab.cli import main
from seco_lab.training.experiment import check_step_record
from seco_lab.training.run_checks import RunDirError
from seco_lab.training.run_dir import RunDir

TEXT = "the quick brown fox jumps over the lazy dog; " * 40


@pytest.fixture
def in_folder(tmp_path):
    here = os.getcwd()
    yield tmp_path
    os.chdir(here)


def _text_run(folder, text):
    (folder / "t.txt").write_text(text)
    os.chdir(folder)
    assert main(["train", *FAST, "--steps", "4", "--stop-at", "2", "--data", "text", "--text", "t.txt",
                 "--run-dir", "s"]) == 0
    return folder / "s"


def test_j2_a_text_run_resumed_on_other_text_is_refused(in_folder, capsys):
    """J2: the corpus was recorded by its path only, so a relative --text path resumed from another folder (or the
    file edited) trained steps 3-4 on other text without a word.  Checkpoints record a digest of the token rows;
    the same text, from any folder, still resumes and equals the uninterrupted run bit for bit."""
    s = _text_run(in_folder, TEXT)
    ref = copy_run(s, in_folder / "ref")
    other = in_folder / "other"
    other.mkdir()
    (other / "t.txt").write_text(TEXT.replace("fox", "cat"))
    os.chdir(other)
    capsys.readouterr()
    resume = ["train", *FAST, "--steps", "4", "--data", "text", "--text", "t.txt", "--resume"]
    assert main([*resume, "--run-dir", "../s"]) == 2
    err = capsys.readouterr().err
    assert "not the text the checkpoint of step 2 was trained on" in err and "t.txt" in err
    assert not (s / "checkpoints/step_000003.pt").exists()
    os.chdir(in_folder)
    (in_folder / "t.txt").write_text("T" + TEXT[1:])  # edited in place
    assert main([*resume, "--run-dir", "s"]) == 2
    assert "corpus digest" in capsys.readouterr().err
    (in_folder / "t.txt").write_text(TEXT)  # the same text, named from another folder: resumed
    (other / "t.txt").write_text(TEXT)
    os.chdir(other)
    assert main([*resume, "--run-dir", "../s"]) == 0
    os.chdir(in_folder)
    assert main([*resume, "--run-dir", "ref"]) == 0
    x, y = (torch.load(d / "checkpoints/step_000004.pt", weights_only=True) for d in (s, ref))
    assert isinstance(x["corpus"], str) and x["corpus"] == y["corpus"]
    assert x["record"] == y["record"]


@pytest.mark.parametrize("drop", ["warmup", "model.d_model", "model", "clip"])
def test_j6_a_config_json_lacking_a_field_is_named_not_filled_with_a_default(drop, r2, tmp_path, capsys):
    """J6: with warmup (or the model's d_model) deleted from config.json, the default was shown as the run's
    setting ("the config differs ... warmup (20 -> 0)").  Every field the run wrote must be there."""
    r = copy_run(r2, tmp_path / "r")
    record = json.loads((r / "config.json").read_text())
    if "." in drop:
        del record["model"][drop.split(".")[1]]
    else:
        del record[drop]
    (r / "config.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(r), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"lacks {drop}" in err and "config.json" in err and "differs" not in err


def test_j6_a_record_older_than_lr_cycles_still_resumes(r2, tmp_path):
    """lr_cycles came after the first release: a record without it is an older run's, and resumes."""
    r = copy_run(r2, tmp_path / "r")
    record = json.loads((r / "config.json").read_text())
    assert record.pop("lr_cycles") == []
    (r / "config.json").write_text(json.dumps(record))
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r), "--resume"]) == 0


@pytest.mark.parametrize("damage, words", [
    (lambda rec: rec.update(grad_norm=str(rec["grad_norm"])), "grad_norm '"),
    (lambda rec: rec.pop("loss"), "loss missing"),
])
def test_j10_a_damaged_metrics_record_is_named_as_metrics_damage(damage, words, r2, tmp_path, capsys):
    """J10: the step-2 record's grad_norm written as a string (or its loss removed) was reported as the checkpoint
    being another run's; it is metrics.jsonl that is damaged."""
    r = copy_run(r2, tmp_path / "r")
    lines = [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()]
    rec = next(x for x in lines if x.get("step") == 2 and "grad_norm" in x)
    damage(rec)
    (r / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl is damaged" in err and words in err and "another run" not in err


def test_a_nan_step_record_matches_its_own_nan_in_metrics(tmp_path):
    """A step whose loss was NaN logs NaN; the checkpoint's own NaN must match it (NaN != NaN), while a number
    against NaN still differs."""
    run = RunDir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": math.nan, "lr": 0.1, "grad_norm": 2.0})
                                            + "\n")
    check_step_record(run, {"record": {"step": 1, "loss": math.nan, "lr": 0.1, "grad_norm": 2.0}})
    with pytest.raises(RunDirError, match="does not continue the history"):
        check_step_record(run, {"record": {"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": 2.0}})


@pytest.mark.parametrize("argv", [["train", "--run-dir", ""], ["train", "--device", "cuda:0"],
                                  ["train", "--device", "tpu"], ["train", "--steps", "2", "--stop-at", "9"],
                                  ["train", "--data", "text", "--text", "no/such/t.txt"],
                                  ["train", "--data", "text", "--text", "/dev/zero"],
                                  ["train", "--run-dir", "no/such/run", "--resume"],
                                  ["study", "bias", "--draws", "-1"], ["bias-study", "--paper-draws", "3"],
                                  ["audit", "--tables-only", "--out", "no/such/audit"],
                                  ["audit", "--model", "no/such/model.gguf"], ["report", "bias", "--results", "."],
                                  ["report", "train", "--results", "."]])
def test_campaign9_slow_refusals_answer_before_torch(argv, tmp_path):
    """Campaign 9 timed these at 1.8-5 s: the run folder, the device, --stop-at and a missing --text were checked
    after torch was imported and the model built."""
    assert_refused_before_torch(argv, tmp_path,
                                "import seco_lab.config\nseco_lab.config.GPU_DRIVER_FILES = ()  # no GPU driver")


def test_j1_without_audit_json_the_tables_never_lose_rows_unasked(tmp_path, capsys):
    """J1, rest: with audit.json deleted and one unit moved away, --tables-only rebuilt the tables from the units
    left (bias.csv 1,071 -> 714 rows), exit 0.  The tables are rebuilt in memory and a unit whose rows a stored table
    holds must keep them (campaign 10 K1: also with audit.json edited); --drop-missing-units asks for the rebuild."""
    import shutil
    from pathlib import Path

    out = tmp_path / "a"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports/audit/k128", out,
                    ignore=shutil.ignore_patterns("vectors"))
    (out / "audit.json").unlink()
    (out / "units/strata-s00.json").rename(tmp_path / "strata-s00.json")
    before = {p.name: p.read_bytes() for p in out.glob("*.csv")}
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "without the rows of units they hold" in err and "bias.csv: s00" in err and "--drop-missing-units" in err
    assert {p.name: p.read_bytes() for p in out.glob("*.csv")} == before
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(out)]) == 0
    assert (out / "bias.csv").read_text().count("\n") == 715
