"""Issue 19, ninth hostile campaign (docs/hostile_campaign_9.md): J8 (files replaced on a signature or a name only)
and J7 (`report audit` advising a command that refuses), with the H1 refusal's advice (docs/hostile_campaign_8.md)
now an explicit flag instead of deleting audit.json.  Each test fails on the code before the fix."""

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import FAST, copy_run
from matplotlib.figure import Figure

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
USER_PNG = b"\x89PNG\r\n\x1a\nmy holiday photo"  # a PNG signature, then a user's bytes


# --------------------------------------------------------------------------- J8: figures


def test_j8_plot_never_writes_over_a_png_seco_lab_did_not_write(r2, tmp_path, capsys):
    """J8: `plot r --out photo.png` replaced any file starting with the PNG signature.  Every figure now carries a
    seco-lab mark in its PNG metadata, and only a marked file is written over (a second plot to the same file)."""
    from seco_lab.store import is_generated_png

    photo = tmp_path / "photo.png"
    photo.write_bytes(USER_PNG)
    capsys.readouterr()
    assert main(["plot", str(r2), "--out", str(photo)]) == 2
    err = capsys.readouterr().err
    assert str(photo) in err and "not a figure seco-lab wrote" in err and len(err.strip().splitlines()) == 1, err
    assert photo.read_bytes() == USER_PNG
    ours = tmp_path / "ours.png"
    assert main(["plot", str(r2), "--out", str(ours)]) == 0 and is_generated_png(ours)
    assert main(["plot", str(r2), "--out", str(ours)]) == 0  # a figure seco-lab wrote is written over
    assert is_generated_png(r2 / "loss.png")  # the run's own curve is marked too


def test_j8_every_figure_writer_marks_its_png_and_refuses_a_users_file(tmp_path):
    """Every place a figure is written (the reports' save_figure, the training study's save, write_png) goes through
    one function: the mark is in the file, and a user's file at the path is refused by name, left as it was."""
    from seco_lab.report.figures import FigureTargetError, save_figure, write_png
    from seco_lab.store import is_generated_png
    from seco_lab.studies.train.figures import save

    for i, writer in enumerate((save_figure, save, lambda f, p: write_png(f, p, dpi=50))):
        fig = Figure(figsize=(1, 1))
        fig.add_subplot().plot([0, 1])
        target = tmp_path / f"f{i}.png"
        writer(fig, target)
        assert is_generated_png(target)
        user = tmp_path / f"user{i}.png"
        user.write_bytes(USER_PNG)
        with pytest.raises(FigureTargetError, match=f"user{i}.png exists and is not a figure seco-lab wrote"):
            writer(fig, user)
        assert user.read_bytes() == USER_PNG


def test_j8_the_committed_figures_carry_the_mark_so_the_reports_can_be_made_again_in_place():
    from seco_lab.store import is_generated_png

    committed = sorted((ROOT / "reports/figures").rglob("*.png"))
    assert committed and [p.name for p in committed if not is_generated_png(p)] == []


def test_j8_a_report_refuses_a_users_file_at_a_figure_path_before_writing_anything(tmp_path, capsys):
    """J8: `report bias --out r.md` wrote its figures over a user's file at figures/bias_study/<name>.png.  Every
    figure's path is checked before anything is written: the report, and the figures before the refused one."""
    fig_dir = tmp_path / "figures/r"  # the figures of r.md (campaign 24 F2: named after the report)
    fig_dir.mkdir(parents=True)
    (fig_dir / "far_loss.png").write_text("my notes\n")
    capsys.readouterr()
    assert main(["report", "train-compare", "--results", str(ROOT / "reports/training"),
                 "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "far_loss.png" in err and "not a figure seco-lab wrote" in err and len(err.strip().splitlines()) == 1
    assert (fig_dir / "far_loss.png").read_text() == "my notes\n" and not (tmp_path / "r.md").exists()


def test_j8_a_report_refused_at_a_later_figure_has_written_no_earlier_one(tmp_path):
    """Within a report (staged_figures), a figure refused after others were drawn leaves no file behind."""
    from seco_lab.report.figures import FigureTargetError, save_figure, staged_figures

    (tmp_path / "c.png").write_bytes(USER_PNG)
    fig = Figure(figsize=(1, 1))
    with pytest.raises(FigureTargetError, match="c.png"), staged_figures():
        save_figure(fig, tmp_path / "a.png")
        save_figure(fig, tmp_path / "b.png")
        save_figure(fig, tmp_path / "c.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.png"]
    with staged_figures():
        save_figure(fig, tmp_path / "a.png")
        assert not (tmp_path / "a.png").exists()  # drawn, written when the block ends
    assert (tmp_path / "a.png").is_file()


# --------------------------------------------------------------------------- J8: checkpoints


def test_j8_keep_checkpoints_deletes_only_the_checkpoints_this_run_wrote(r2, tmp_path, capsys):
    """J8: `--keep-checkpoints 1` deleted any zip archive named step_000000.pt (a user's zip holding mine.txt).
    Only torch checkpoints recording this run's id (and their own step) are pruned; another run's is kept too."""
    r = copy_run(r2, tmp_path / "r")
    ckpts = r / "checkpoints"
    with zipfile.ZipFile(ckpts / "step_000000.pt", "w") as z:
        z.writestr("mine.txt", "my file")
    user_zip = (ckpts / "step_000000.pt").read_bytes()
    other = torch.load(ckpts / "step_000001.pt", weights_only=True)
    torch.save({**other, "run_id": "0123456789abcdef"}, tmp_path / "other.pt")
    shutil.copy(tmp_path / "other.pt", ckpts / "step_000001.pt")  # another run's checkpoint at an old step
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(r), "--resume", "--keep-checkpoints", "1"]) == 0
    assert (ckpts / "step_000000.pt").read_bytes() == user_zip
    assert (ckpts / "step_000001.pt").read_bytes() == (tmp_path / "other.pt").read_bytes()
    assert sorted(p.name for p in ckpts.glob("step_*.pt")) == ["step_000000.pt", "step_000001.pt", "step_000004.pt"]


# --------------------------------------------------------------------------- J7 + H1: the advice that works


def test_j7_report_audit_names_the_missing_unit_and_advice_that_works(audit_copy, tmp_path, capsys):
    """J7: with a unit file removed, `report audit` advised `audit --tables-only --out a`, which then refused.  The
    message names the missing unit and the ways out; the command it gives works, and the report follows."""
    (audit_copy / "units/data-s01.json").unlink()
    capsys.readouterr()
    assert main(["report", "audit", "--results", str(audit_copy), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "data-s01" in err and "Restore" in err and "rerun the audit" in err and len(err.strip().splitlines()) == 1
    advised = err.split("`")[1]
    assert advised == f"seco-lab audit --tables-only --drop-missing-units --out {audit_copy}"
    assert main(advised.split()[1:] + ["--no-progress"]) == 0
    done = json.loads((audit_copy / "audit.json").read_text())["units_done"]
    assert "data-s01" not in done and "data-s00" in done
    assert main(["report", "audit", "--results", str(audit_copy), "--out", str(tmp_path / "r.md")]) == 0


def test_h1_the_refusal_names_the_flag_not_a_file_to_delete(audit_copy, capsys):
    """H1's refusal told the user to delete audit.json to rebuild from the units left; it now names the flag."""
    before = {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")}
    (audit_copy / "units/data-s01.json").unlink()
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "data-s01" in err and "--drop-missing-units" in err and "remove" not in err, err
    assert {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")} == before
    assert main(["audit", "--drop-missing-units", "--out", str(audit_copy)]) == 2  # without --tables-only: refused
    assert "--drop-missing-units" in capsys.readouterr().err


def test_drop_missing_units_still_refuses_tables_from_no_unit(audit_copy, capsys):
    """The flag drops the units gone; it never makes every table empty (J1)."""
    shutil.rmtree(audit_copy / "units")
    (audit_copy / "units").mkdir()
    before = {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")}
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "holds no usable unit" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")} == before

