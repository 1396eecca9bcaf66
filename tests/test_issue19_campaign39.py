"""Issue 19, campaign 39 (on 9be73a1): each data-loss finding of section (c) has a test here that fails on that commit.

C5 (data loss, arguable): ``train --lora --overwrite`` of a run saved before the adapter digests (its marker without
``adapter_files``) deleted notes appended to ``adapter/README.md``; C6: a plain rerun of a study or an audit replaced a
results table the user edited (the folder's checksums already showed it); C7: a rerun wrote over a generated report
to which the user appended notes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seco_lab.cli import main

NOTES = "\n## My notes\nTrained for the ACL paper; keep.\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("option", ["--overwrite", "--resume"])
def test_c5_a_lora_run_saved_before_the_adapter_digests_keeps_its_adapter_folder(tmp_path, capsys, option):
    """Campaign 39 C5: a LoRA run whose marker records no adapter_files (saved by a seco-lab before campaign 38 B8)
    fell back to content checks, which a README.md with notes appended under peft's front matter passes:
    --overwrite deleted the notes.  Nothing proves such files the run's: --overwrite and a LoRA --resume refuse."""
    from test_issue19_campaign30 import _lora_flags

    run = tmp_path / "r"
    assert main(["train", *_lora_flags(), "--run-dir", str(run)]) == 0
    marker = run / ".seco-lab-run"
    record = json.loads(marker.read_text())
    del record["adapter_files"]  # as an older seco-lab wrote it
    marker.write_text(json.dumps(record) + "\n")
    readme = run / "adapter" / "README.md"
    readme.write_text(readme.read_text() + NOTES)
    content = readme.read_bytes()
    capsys.readouterr()
    flags = _lora_flags("--steps", "3") if option == "--resume" else _lora_flags()
    assert main(["train", *flags, "--run-dir", str(run), option]) == 2
    err = capsys.readouterr().err
    assert f"{option}: {run} is a LoRA run saved by a seco-lab that predates adapter digests" in err
    assert f"move or delete {run / 'adapter'} yourself" in err and len(err.strip().splitlines()) == 1
    assert readme.read_bytes() == content
    for path in run.joinpath("adapter").iterdir():  # and once the user moved adapter/ away, the run is usable
        path.unlink()
    run.joinpath("adapter").rmdir()
    assert main(["train", *flags, "--run-dir", str(run), option]) == 0
    assert "adapter_files" in json.loads(marker.read_text())


def _add_column(path):
    lines = path.read_text().splitlines()
    notes = [line + ",keep: seed 0 looked odd" for line in lines[1:]]
    path.write_text("\n".join([lines[0] + ",my_note", *notes]) + "\n")


@pytest.mark.parametrize("table", ["results.csv", "checks.csv"])
def test_c6_a_study_rerun_refuses_a_table_the_user_edited(tmp_path, monkeypatch, table):
    """Campaign 39 C6: a plain rerun of ``study bias`` replaced a results.csv (checks.csv) with a column of the
    user's notes added -- the folder's checksums.sha256 already showed the edit -- and warned only afterwards.  The
    rerun (and one with --fresh, which discards only cells) refuses before any work, naming the file."""
    from dataclasses import replace

    from seco_lab.store import NO_CHECKSUMS_ENV, StudyFolderError
    from seco_lab.studies.bias.driver import QUICK, run_study

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")  # the tests' switch: checksums as a user has them
    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100, paper_cells=())
    run_study(cfg, tmp_path, progress=False)
    run_study(cfg, tmp_path, progress=False)  # its own tables: a rerun keeps them
    _add_column(tmp_path / table)
    edited, cells = (tmp_path / table).read_bytes(), sorted((tmp_path / "cells").iterdir())
    for fresh in (False, True):
        with pytest.raises(StudyFolderError, match=f"{table} was edited after seco-lab wrote it .* move it away "
                           r"\(or restore it\) and rerun"):
            run_study(cfg, tmp_path, fresh=fresh, progress=False)
        assert (tmp_path / table).read_bytes() == edited and sorted((tmp_path / "cells").iterdir()) == cells
    (tmp_path / table).unlink()  # moved away: the rerun writes it again
    run_study(cfg, tmp_path, progress=False)
    assert "my_note" not in (tmp_path / table).read_text()


def tiny_audit_config():
    """A whole audit of the tiny float64 model in seconds (shared with tests/test_issue19_campaign40.py)."""
    from seco_lab.studies.audit import AuditConfig

    return AuditConfig(model="tiny", params="full", dtype="float64", length=16, chunk_size=4, budgets=(2,),
                       max_hops=1, num_sequences=2, mc_sequences=1, mc_budgets=(2,), mc_draws=8, cost_sequences=1,
                       data_sequences=3, exact_length=8, exact_chunk_size=4, threads=1, batch_sizes=(1, 4))


def test_c6_an_audit_rerun_refuses_a_table_the_user_edited(tmp_path, monkeypatch, capsys):
    """Campaign 39 C6: ``seco-lab audit --out a`` rerun over a finished audit replaced a bias.csv with a column of
    the user's added, without a word; it now refuses before any work, naming the file."""
    from dataclasses import replace

    from seco_lab.store import NO_CHECKSUMS_ENV, ChecksumError
    from seco_lab.studies.audit import run_audit

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")
    cfg = tiny_audit_config()
    out = tmp_path / "a"
    run_audit(replace(cfg), out, progress=False)
    _add_column(out / "bias.csv")
    edited = (out / "bias.csv").read_bytes()
    with pytest.raises(ChecksumError, match=r"bias.csv was edited after seco-lab wrote it .* the audit's rerun would "
                       r"replace it, so nothing is done; move it away \(or restore it\) and rerun"):
        run_audit(replace(cfg), out, progress=False)
    assert (out / "bias.csv").read_bytes() == edited


def test_c6_a_table_the_checksums_do_not_list_is_refused_too_and_nothing_without_checksums(tmp_path, monkeypatch):
    """Campaign 39 C6: a table the tool writes that the folder's checksum file does not list is not known to be the
    tool's either; a folder without a checksum file (before checksums) and the tests' switch compare nothing."""
    from seco_lab.store import CHECKSUMS, NO_CHECKSUMS_ENV, ChecksumError, check_tables_unedited, start_checksums

    monkeypatch.setenv(NO_CHECKSUMS_ENV, "0")
    (tmp_path / "results.csv").write_text("a,b\n1,2\n")
    check_tables_unedited(tmp_path, ["results.csv"], "the study's rerun")  # no checksum file: nothing to compare
    start_checksums(tmp_path)
    with pytest.raises(ChecksumError, match=f"results.csv was edited after seco-lab wrote it \\(it is not listed in "
                       f".*{CHECKSUMS}\\) and the study's rerun would replace it"):
        check_tables_unedited(tmp_path, ["results.csv", "checks.csv"], "the study's rerun")
    monkeypatch.setenv(NO_CHECKSUMS_ENV, "1")
    check_tables_unedited(tmp_path, ["results.csv"], "the study's rerun")


def test_c7_report_writes_over_only_a_report_exactly_as_it_wrote_it(tmp_path, capsys):
    """Campaign 39 C7: ``report bias --out rep.md`` run again after notes were appended to rep.md wrote over them
    (the file carried the "_Generated by" line).  A report's last line records the SHA-256 of its text: an edited
    report, or one without the digest (an older seco-lab's), is refused with one line and kept."""
    rep = tmp_path / "rep.md"
    argv = ["report", "bias", "--results", str(ROOT / "reports/bias_study"), "--out", str(rep)]
    assert main(argv) == 0 and main(argv) == 0  # its own report: written over
    assert rep.read_text().splitlines()[-1].startswith("<!-- seco-lab report sha256:")
    own = rep.read_text()
    for text, why in ((own + "\n## My notes\nunit 3 looks off, ask Ana.\n", "was edited after seco-lab generated it"),
                      (own.replace("seed", "SEED", 1), "was edited after seco-lab generated it"),
                      (own.rsplit("<!--", 1)[0], "carries no digest of its text")):
        rep.write_text(text)
        capsys.readouterr()
        with pytest.raises(SystemExit, match="2"):  # argparse's error: usage, then the one line
            main(argv)
        err = capsys.readouterr().err
        assert f"--out {rep} {why}" in err and "move or rename it, or pass another .md file" in err
        assert rep.read_text() == text


def test_c7_an_audit_rerun_keeps_notes_appended_to_its_report(audit_copy, capsys):
    """Campaign 39 C7: an audit rerun (here --tables-only, which writes the tables and OUT/report.md again) replaced
    a report.md to which the user appended notes, rc 0, without a word."""
    argv = ["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]
    assert main(argv) == 0
    report = audit_copy / "report.md"
    report.write_text(report.read_text() + "\n## My notes\nunit 3 looks off, ask Ana. Keep.\n")
    notes = report.read_text()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{report} was edited after seco-lab generated it" in err and len(err.strip().splitlines()) == 1
    assert report.read_text() == notes
