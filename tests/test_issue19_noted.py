"""Issue 19: small findings that earlier hostile campaigns noted and left (docs/hostile_campaign_16.md, _18.md)."""

import json

import pytest

from seco_lab.cli import main


def test_an_existing_file_without_suffix_as_report_target_gets_a_sensible_example(capsys, tmp_path, monkeypatch):
    """Campaign 16: `report real --out /dev/null` suggested `/dev/null/real_study.md`, a path under a device."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("mine\n")
    for out in ("/dev/null", "notes"):
        try:
            main(["report", "real", "--out", out])
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err
        assert "exists and is not a Markdown report" in err and "e.g. real_study.md" in err and f"{out}/" not in err
    assert (tmp_path / "notes").read_text() == "mine\n"


def test_a_byte_order_mark_before_the_first_metrics_record_is_not_a_torn_line(tmp_path, recwarn):
    """Campaign 18: a complete record behind a UTF-8 BOM (an editor's save) was dropped as "a torn last line"."""
    from seco_lab.training.run_dir import read_metrics

    (tmp_path / "metrics.jsonl").write_bytes(b'\xef\xbb\xbf{"step": 0, "eval_loss": 5.5}\n')
    assert read_metrics(tmp_path) == [{"step": 0, "eval_loss": 5.5}]
    assert not [w for w in recwarn if "torn" in str(w.message)]


def test_campaign21_c43_seal_refuses_what_is_not_a_results_folder_before_writing_anything(tmp_path, capsys):
    """Campaign 21 C43 (data loss): `seco-lab seal /` walked the whole file system, wrote a checksum file into every
    folder holding a .json or .csv and rewrote other tools' checksum files, then failed half way."""
    import hashlib
    import shutil
    from pathlib import Path

    from seco_lab import store

    home = tmp_path / "home"  # a user's folder: their files and their own sha256sum list
    (home / "project").mkdir(parents=True)
    (home / "project" / "package.json").write_text("{}\n")
    (home / "project" / "data.csv").write_text("a\n1\n")
    mine = f"{hashlib.sha256(b'x').hexdigest()}  data.csv\n{hashlib.sha256(b'y').hexdigest()}  photo.jpg\n"
    (home / "project" / store.CHECKSUMS).write_text(mine)
    for folder in (home, home / "project"):
        capsys.readouterr()
        assert main(["seal", str(folder)]) == 2
        err = capsys.readouterr().err
        assert "not a results folder seco-lab wrote" in err or "not a checksum file seco-lab wrote" in err
    assert not (home / store.CHECKSUMS).exists() and (home / "project" / store.CHECKSUMS).read_text() == mine
    # a results folder holding a subfolder with another tool's checksum file: refused before anything is written
    study = tmp_path / "bias_study"
    shutil.copytree(Path(__file__).resolve().parents[1] / "reports" / "bias_study", study,
                    ignore=shutil.ignore_patterns("cells"))
    before = (study / store.CHECKSUMS).read_text()
    (study / "results.csv").write_text((study / "results.csv").read_text() + "\n")  # edited: sealing would record it
    shutil.copytree(home / "project", study / "extra")
    assert main(["seal", str(study)]) == 2
    assert (study / store.CHECKSUMS).read_text() == before and (study / "extra" / store.CHECKSUMS).read_text() == mine
    shutil.rmtree(study / "extra")
    assert main(["seal", str(study)]) == 0 and (study / store.CHECKSUMS).read_text() != before


def test_campaign21_s15_trailing_spaces_after_a_checksum_name_are_damage_not_a_missing_file(tmp_path, monkeypatch):
    """Campaign 21 S15: `HASH  far_loss.csv   ` was read as a file named with trailing spaces, so the present
    far_loss.csv was reported "recorded but missing ... deleted or moved; restore it"."""
    import pytest

    from seco_lab import store

    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)  # tests/conftest.py turns verification off
    store.start_checksums(tmp_path)
    store.atomic_write(tmp_path / "far_loss.csv", "x\n1\n")
    cs = tmp_path / store.CHECKSUMS
    cs.write_text(cs.read_text().replace("far_loss.csv\n", "far_loss.csv   \n"))
    with pytest.raises(store.ChecksumError, match="line 1 is not `SHA256  NAME`.*trailing spaces"):
        store.verify_checksums(tmp_path, "the test")
    cs.write_text(cs.read_text().replace("   \n", "\r\n"))  # CRLF line ends (an editor's save) still read
    store.verify_checksums(tmp_path, "the test")


def test_campaign21_q25_a_second_study_on_a_new_folder_another_study_is_filling_names_that_study(tmp_path):
    """Campaign 21 Q25: two studies started on one new --out: the second blamed "files" (the first's cells) that a
    study would overwrite; the folder belongs to the first, still running."""
    import os

    import pytest

    from seco_lab import store
    from seco_lab.folder_lock import hold_lock, release_lock

    root = tmp_path / "q"
    (root / "cells").mkdir(parents=True)
    (root / "cells" / "c1.json").write_text("{}\n")  # the first study's first cell, before its study.json
    first = hold_lock(root, "seco-lab study", "")
    try:
        busy = f"is in use by another seco-lab study \\(pid {os.getpid()}\\)"
        with pytest.raises(store.StudyFolderError, match=busy):
            store.StudyFolder(root, study=None).check_usable()
    finally:
        release_lock(first)
    with pytest.raises(store.StudyFolderError, match="holds files"):  # nobody holds it: the files are not a study's
        store.StudyFolder(root, study=None).check_usable()


def test_campaign22_n3_a_resume_removes_the_temporaries_a_killed_run_left_and_nothing_else(tmp_path):
    """Campaign 22 N3: kill -9 during a checkpoint write left ``step_000016.pt.seco-tmpPID`` in checkpoints/, and
    the resumed run kept it for ever.  A resume (holding the lock) removes the run's own torn writes only."""
    import torch

    from seco_lab.training.run_dir import RunDir

    rd = RunDir(tmp_path / "r").open(resume=False, overwrite=False)
    rd.save_checkpoint({"step": 3, "model": {"w": torch.arange(4.0)}, "optimizer": {}, "scheduler": {},
                        "torch_rng": None, "numpy_rng": None})
    rd.close()
    torn = [rd.checkpoints / "step_000016.pt.seco-tmp4242", rd.checkpoints / "latest.seco-tmp4242",
            rd.path / "metrics.jsonl.seco-tmp7"]
    for p in torn:  # killed before a byte was written (campaign 37 A5: one holding something is kept, below)
        p.write_bytes(b"")
    kept = [rd.checkpoints / "step_000016.pt.seco-tmp", rd.checkpoints / "notes.seco-tmp1"]  # not the run's names
    for p in kept:
        p.write_text("mine")
    half = rd.checkpoints / "step_000017.pt.seco-tmp4243"  # torn half-way, or a user's: kept, with a warning
    half.write_bytes(b"half")
    with pytest.warns(UserWarning, match="kept .*step_000017.pt.seco-tmp4243"):
        RunDir(rd.path).open(resume=True, overwrite=False).close()
    assert [p for p in torn if p.exists()] == [] and all(p.read_text() == "mine" for p in kept)
    assert half.read_bytes() == b"half"
    assert (rd.checkpoints / "step_000003.pt").is_file()


def test_campaign22_n6_a_byte_order_mark_is_read_in_every_json_and_toml_settings_file(tmp_path):
    """Campaign 22 N6: metrics.jsonl accepted a UTF-8 BOM but config.json and a --config file refused one."""
    from seco_lab.config import load_config_file
    from seco_lab.training.run_files import read_config

    bom = b"\xef\xbb\xbf"
    settings = {"mode": "seco", "steps": 2, "seq_len": 64, "chunk_size": 16, "seed": 0, "lr": 1e-3}
    (tmp_path / "config.json").write_bytes(bom + json.dumps(settings).encode())
    assert read_config(tmp_path) == settings
    (tmp_path / "c.toml").write_bytes(bom + b"steps = 3\n")
    assert load_config_file(tmp_path / "c.toml") == {"steps": 3}
    (tmp_path / "c.json").write_bytes(bom + b'{"steps": 4}')
    assert load_config_file(tmp_path / "c.json") == {"steps": 4}


def test_campaign22_n5_the_cap_hint_fits_the_cap_given(tmp_path):
    """Campaign 22 N5: cap=-1 on 'paper-chain-capped' got a hint to use 'paper' instead of 'paper-capped' for
    C = infinity: another scheme, and a hint meant for an infinite cap."""
    import pytest

    from seco_lab.estimators.schemes import get_scheme

    for cap in (-1, 0, -0.5):
        with pytest.raises(ValueError, match="cap must be a finite number > 0.*C must be > 0") as e:
            get_scheme("paper-chain-capped", cap=cap)
        assert "infinity" not in str(e.value)
    with pytest.raises(ValueError, match="for C = infinity use the scheme's name without '-capped'"):
        get_scheme("paper-chain-capped", cap=float("inf"))
