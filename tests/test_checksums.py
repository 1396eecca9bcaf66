"""Issue 19, the class behind campaigns 11-13's silent-wrong results: a report read whatever a stored file held, so
a value edited by hand (or a file damaged, or copied in from another study) was reported whenever no per-file
consistency check happened to cover it.  Every writer now records the SHA-256 of what it writes in its folder's
``checksums.sha256`` (sha256sum's format) and every report verifies the files it could read first
(seco_lab.store.verify_checksums); ``seco-lab seal`` vouches for files edited on purpose.  These tests turn the
verification on (tests/conftest.py turns it off for the tests of the per-file checks)."""

import csv
import json
import multiprocessing
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seco_lab import store
from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]
#: every committed results folder and the report that reads it
COMMITTED = {"bias": "bias_study", "train": "training_study", "real": "real_study/k16x16", "audit": "audit/k128",
             "bench": "bench", "train-compare": "training"}


@pytest.fixture(autouse=True)
def verified(monkeypatch):
    monkeypatch.delenv(store.NO_CHECKSUMS_ENV, raising=False)


def _report(kind, folder, out, capsys):
    capsys.readouterr()
    rc = main(["report", kind, "--results", str(folder), "--out", str(out)])
    return rc, capsys.readouterr().err


def _edit_cell(path, row, column, value):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows[row][rows[0].index(column)] = value
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def test_every_committed_results_folder_is_recorded_and_verifies():
    """Each committed folder's checksum files cover every results file it holds, as committed (a study rerun that
    changed a file without its checksum, or a hand edit, fails here)."""
    for folder in COMMITTED.values():
        store.verify_checksums(ROOT / "reports" / folder, "the study")
    store.verify_checksums(ROOT / "reports" / "trainer_memory", "lora_trainer", only=("memory.json",))
    listed = (ROOT / "reports/bias_study" / store.CHECKSUMS).read_text().splitlines()
    assert any(line.endswith("  results.csv") for line in listed)
    assert all(len(line.split("  ")[0]) == 64 for line in listed)  # `sha256sum -c checksums.sha256` reads it


@pytest.mark.parametrize("kind", ["bench", "train-compare", "real"])
def test_a_plausible_edit_is_refused_before_anything_is_written(kind, tmp_path, capsys):
    """One number changed to another plausible one (campaign 13: a cpu_s, a backprop count, a norm ratio): the
    report refuses it, names the file, and writes nothing."""
    folder = tmp_path / "r"
    shutil.copytree(ROOT / "reports" / COMMITTED[kind], folder)
    table = {"bench": "hf_results.csv", "train-compare": "throughput.csv", "real": "strata.csv"}[kind]
    column = {"bench": "value", "train-compare": "tokens_per_s", "real": "norm_ratio"}[kind]
    with open(folder / table, newline="") as f:
        first = next(r for r in csv.DictReader(f) if r[column] not in ("", "nan"))
    _edit_cell(folder / table, 1 + 0, column, str(float(first[column]) * 1.01))
    rc, err = _report(kind, folder, tmp_path / "r.md", capsys)
    assert rc == 2 and f"{folder / table} is not the file seco-lab wrote" in err and "seco-lab seal" in err
    assert not (tmp_path / "r.md").exists()


def test_a_copied_in_file_and_a_missing_checksum_file_are_refused_and_seal_vouches(tmp_path, capsys):
    folder = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    shutil.copy(folder / "results.csv", folder / "results_old.csv")
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "results_old.csv is not recorded in" in err
    (folder / "results_old.csv").unlink()
    (folder / store.CHECKSUMS).unlink()
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "but no checksums.sha256" in err
    assert main(["seal", str(folder)]) == 0  # the user vouches for the files as they are
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 0, err
    (folder / store.CHECKSUMS).write_text("not a checksum line\n")
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "the checksum file is damaged" in err


def test_atomic_write_records_only_where_checksums_were_started(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    store.atomic_write_json(plain / "a.json", {"x": 1})
    assert not (plain / store.CHECKSUMS).exists()  # a run folder, a user's folder: nothing added
    tracked = tmp_path / "tracked"
    tracked.mkdir()
    (tracked / "old.csv").write_text("a\n1\n")  # no checksum file vouches for it (campaign 14 RS02, AQ01)
    store.start_checksums(tracked)
    store.atomic_write_json(tracked / "a.json", {"x": 1})
    store.atomic_write_json(tracked / "a.json", {"x": 2})  # rewritten: the new content is recorded
    with pytest.raises(store.ChecksumError, match="old.csv is not recorded"):
        store.verify_checksums(tracked, "the test")
    assert not store.as_written(tracked / "old.csv")
    store.seal(tracked)  # the user vouches for it
    store.verify_checksums(tracked, "the test")
    (tracked / "a.json").write_text('{"x": 3}\n')
    with pytest.raises(store.ChecksumError, match="a.json is not the file seco-lab wrote"):
        store.verify_checksums(tracked, "the test")
    before = (tracked / store.CHECKSUMS).stat().st_mtime_ns
    store.atomic_write_json(tracked / "a.json", {"x": 2})
    store.atomic_write_json(tracked / "a.json", {"x": 2})
    assert (tracked / store.CHECKSUMS).read_text().count("a.json") == 1
    assert (tracked / store.CHECKSUMS).stat().st_mtime_ns >= before


def _write_many(folder, worker):
    for i in range(15):
        store.atomic_write_json(Path(folder) / f"w{worker}-{i}.json", {"i": i})


def test_concurrent_writers_of_one_folder_lose_no_checksum(tmp_path):
    """A study's workers write their cells into one folder at once: each record is read, updated and replaced under
    the folder's flock, so none is lost (without the lock, interleaved updates drop entries)."""
    store.start_checksums(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(tmp_path), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store.verify_checksums(tmp_path, "the test")
    assert len((tmp_path / store.CHECKSUMS).read_text().splitlines()) == 45


def test_study_cell_edited_after_it_was_written_is_not_done(tmp_path):
    """Campaign 13 Y03: a cell record replaced by {} was counted done (and then a KeyError).  A cell whose record is
    not what the study wrote is computed again."""
    sf = store.StudyFolder(tmp_path / "s", study=None)
    sf.open("d1")
    sf.write_cell("c1", {"value": 1.0})
    assert sf.done("c1")
    sf.marker("c1").write_text("{}\n")
    assert not sf.done("c1")
    sf.write_cell("c1", {"value": 1.0})
    assert sf.done("c1")
    sf.close()


def test_audit_tables_only_verifies_the_units_but_rewrites_an_edited_table(tmp_path, capsys):
    folder = tmp_path / "k128"
    shutil.copytree(ROOT / "reports" / "audit" / "k128", folder, ignore=shutil.ignore_patterns("vectors"))
    _edit_cell(folder / "strata.csv", 1, "norm_ratio", "0.31")
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 0, capsys.readouterr().err
    assert (folder / "strata.csv").read_bytes() == (ROOT / "reports/audit/k128/strata.csv").read_bytes()
    store.verify_checksums(folder, "the audit")  # the rewritten tables are recorded again
    unit = folder / "units" / "data-s01.json"
    record = json.loads(unit.read_text())
    record["loss"] = record["loss"] * 1.01
    unit.write_text(json.dumps(record, indent=2) + "\n")
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 2
    assert "data-s01.json is not the file seco-lab wrote" in capsys.readouterr().err


def test_lora_trainer_report_refuses_an_edited_memory_record(tmp_path):
    folder = tmp_path / "mem"
    shutil.copytree(ROOT / "reports" / "trainer_memory", folder)
    run = [sys.executable, str(ROOT / "examples" / "lora_trainer.py"), "--report", "--output-dir", str(folder)]
    env = {k: v for k, v in __import__("os").environ.items() if k != store.NO_CHECKSUMS_ENV}
    ok = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    record = json.loads((folder / "memory.json").read_text())
    record["runs"][1]["peak_rss_mib"] *= 0.9
    (folder / "memory.json").write_text(json.dumps(record, indent=1))
    bad = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "memory.json is not the file seco-lab wrote" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_seal_refuses_what_is_not_a_folder(tmp_path, capsys):
    (tmp_path / "f.csv").write_text("a\n")
    with pytest.raises(SystemExit):
        main(["seal", str(tmp_path / "f.csv")])
    assert "is not a folder" in capsys.readouterr().err


def test_a_symlinked_subfolder_is_verified_through_the_link(tmp_path, capsys):
    """Campaign 14 T03/T04/A02: a tier folder (or the audit's units) replaced by a symlink to an edited copy was read
    through the link but not verified (subfolders behind links were skipped)."""
    study = tmp_path / "ts"
    shutil.copytree(ROOT / "reports" / "training_study", study)
    edited = tmp_path / "elsewhere"
    shutil.move(study / "second_L4", edited)
    (study / "second_L4").symlink_to(edited, target_is_directory=True)
    rc, err = _report("train", study, tmp_path / "t.md", capsys)
    assert rc == 0, err  # a link to the files as written is fine
    _edit_cell(edited / "runs.csv", 1, "cpu_s", "30.0")
    rc, err = _report("train", study, tmp_path / "t.md", capsys)
    assert rc == 2 and "runs.csv is not the file seco-lab wrote" in err
    (edited / "loop").symlink_to(study, target_is_directory=True)  # a link loop ends where it started
    store.seal(edited)
    store.verify_checksums(study, "the study")


def test_removing_a_checksum_file_does_not_let_a_resumed_study_keep_edited_cells(tmp_path, capsys):
    """Campaign 14 RS02 / AQ01: with cells/checksums.sha256 removed, a resumed study sealed the cells as they were
    (edited ones included) and rebuilt its tables from them.  Now such cells are not taken as written: computed
    again (and said so)."""
    sf = store.StudyFolder(tmp_path / "s", study=None)
    sf.open("d1")
    sf.write_manifest({"fingerprint": "d1"})
    sf.write_cell("c1", {"value": 1.0})
    sf.close()
    record = json.loads(sf.marker("c1").read_text())
    record["value"] = 2.0
    sf.marker("c1").write_text(json.dumps(record))
    (sf.cells / store.CHECKSUMS).unlink()
    again = store.StudyFolder(tmp_path / "s", study=None)
    capsys.readouterr()
    again.open("d1")
    assert "but no checksums.sha256: they are not taken as written" in capsys.readouterr().err
    assert not again.done("c1")
    again.close()


def test_a_cell_copied_from_a_study_of_another_definition_with_its_checksums_is_not_done(tmp_path, capsys):
    """Campaign 13 Y12: a cell from a --draws 100 study in a --draws 200 study.  Copying the whole cells folder,
    checksum file and all, keeps every file 'as written' -- but each record names its study's definition."""
    other = store.StudyFolder(tmp_path / "other", study=None)
    other.open("draws100")
    other.write_cell("c1", {"value": 1.0})
    other.close()
    mine = store.StudyFolder(tmp_path / "mine", study=None)
    mine.open("draws200")
    mine.close()
    shutil.rmtree(mine.cells)
    shutil.copytree(other.cells, mine.cells)
    capsys.readouterr()
    assert not mine.done("c1")
    assert "of study definition 'draws100', not cell 'c1' of 'draws200'" in capsys.readouterr().err
    assert other.done("c1") and other.read_cell("c1") == {"value": 1.0}
    shutil.copy(other.marker("c1"), other.marker("c2"))  # a cell record under another cell's name
    store.seal(other.cells)
    assert not other.done("c2")


def test_a_checksum_file_that_is_a_folder_is_named_as_such(tmp_path):
    """Campaign 14 AQ03: the error named the temporary file ('Is a directory')."""
    (tmp_path / store.CHECKSUMS).mkdir()
    with pytest.raises(store.ChecksumError, match=r"checksums.sha256 is a folder: that name is the folder's checksum"):
        store.start_checksums(tmp_path)
    assert not list(tmp_path.glob("*seco-tmp*"))
    sub = tmp_path / "sub"  # K47: `seco-lab seal` with a subfolder's checksum file a folder was a traceback
    sub.mkdir()
    (sub / "a.csv").write_text("a\n1\n")
    (sub / store.CHECKSUMS).mkdir()
    with pytest.raises(store.ChecksumError, match=r"sub/checksums.sha256 is a folder"):
        store.seal(sub)
    assert not list(sub.glob("*seco-tmp*"))


def test_a_recorded_file_that_is_missing_is_refused(tmp_path, capsys):
    """Campaign 15 B01/B02/B05: a recorded hf_results.csv, profile or strata_cost.csv deleted left its whole section
    out of `report bench`, exit 0."""
    folder = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    (folder / "strata_cost.csv").unlink()
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "strata_cost.csv is recorded in" in err and "but missing" in err


def test_tables_a_rerun_reproduces_are_recorded_as_written(tmp_path):
    """Campaign 15 BQ12: with the root checksum file removed, a rerun that kept the reproduced tables byte for byte
    recorded nothing, so the report refused them ever after ('rerun' never healed it)."""
    import pandas as pd

    from seco_lab.studies.rerun_tables import write_tables

    df = pd.DataFrame({"a": [1.0, 2.0]})
    store.start_checksums(tmp_path)
    (tmp_path / "t.csv").write_text(df.to_csv(index=False))  # not recorded: written by someone else
    with pytest.raises(store.ChecksumError, match="t.csv is not recorded"):
        store.verify_checksums(tmp_path, "the test")
    assert write_tables(tmp_path, {"t": df}).kept  # the rerun computes the same table: kept, and recorded
    store.verify_checksums(tmp_path, "the test")


def test_a_file_replaced_while_the_report_reads_it_is_caught(tmp_path, capsys, monkeypatch):
    """Campaign 15 K32: results.csv atomically replaced by an edited copy after the checksums were verified was
    reported (verified before, read after).  The report compares the files again once written."""
    import seco_lab.report.bench as bench

    folder = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    real = bench.bench_report

    def racing(results, out):
        path = real(results, out)
        text = (folder / "results.csv").read_text()
        (folder / "results.csv").write_text(text.replace(",", ", ", 1))  # a writer replaces it meanwhile
        return path

    monkeypatch.setattr(bench, "bench_report", racing)
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "results.csv changed while the report read it" in err
    assert not (tmp_path / "b.md").exists()


def _swapped_out_and_back(path, edit):
    """A context in which ``path`` holds ``edit(its text)`` (an edited copy renamed over it), the original renamed
    back afterwards: the same bytes, inode and modification time as before -- only its status-change time moved."""
    import contextlib
    import os

    @contextlib.contextmanager
    def swap():
        aside = path.with_name(path.name + ".aside")
        st = os.stat(path)
        os.replace(path, aside)
        path.write_text(edit(aside.read_text()))
        try:
            yield
        finally:
            os.replace(aside, path)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    return swap()


def test_a_file_swapped_out_and_back_while_the_report_reads_it_is_caught(tmp_path, capsys, monkeypatch):
    """Campaign 16 M1: an edited results.csv renamed in after the verification and the original renamed back before
    the report's second comparison: the bytes compared were the original's, the bytes reported the edit's."""
    import seco_lab.report.bench as bench

    folder = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    real = bench.bench_report

    def racing(results, out):
        with _swapped_out_and_back(folder / "results.csv", lambda text: text.replace(",82.046875,", ",8.046875,", 1)):
            return real(results, out)

    monkeypatch.setattr(bench, "bench_report", racing)
    rc, err = _report("bench", folder, tmp_path / "b.md", capsys)
    assert rc == 2 and "results.csv changed while the report read it" in err
    assert not (tmp_path / "b.md").exists()
    store.verify_checksums(folder, "the test")  # the folder itself verifies: only the read was not the verified bytes


def test_audit_tables_made_while_a_unit_was_swapped_out_and_back_are_not_recorded(tmp_path, capsys, monkeypatch):
    """Campaign 16 M1, in ``audit --tables-only``: the tables it writes from a unit swapped out and back are not
    recorded as the audit's, so no report takes them; the next --tables-only writes them again."""
    import seco_lab.studies.audit.driver as driver

    folder = tmp_path / "k128"
    shutil.copytree(ROOT / "reports" / "audit" / "k128", folder, ignore=shutil.ignore_patterns("vectors"))
    real = driver.write_results

    def racing(out, **kw):
        edit = lambda text: text.replace('"loss": ', '"loss": 1', 1)  # noqa: E731
        with _swapped_out_and_back(folder / "units" / "data-s01.json", edit):
            return real(out, **kw)

    monkeypatch.setattr(driver, "write_results", racing)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 2
    assert "data-s01.json changed while the tables were made from it" in capsys.readouterr().err
    with pytest.raises(store.ChecksumError, match="is not recorded"):
        store.verify_checksums(folder, "the test")
    monkeypatch.setattr(driver, "write_results", real)
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 0
    store.verify_checksums(folder, "the test")
    assert (folder / "data.csv").read_bytes() == (ROOT / "reports/audit/k128/data.csv").read_bytes()


def test_verified_files_name_a_file_written_again_with_its_own_bytes(tmp_path):
    store.start_checksums(tmp_path)
    store.atomic_write(tmp_path / "a.csv", "x\n1\n")
    store.atomic_write(tmp_path / "b.csv", "x\n2\n")
    verified = store.verify_checksums(tmp_path, "the test")
    assert verified.changed() == []
    verified.check_unchanged("the test")
    store.atomic_write(tmp_path / "b.csv", "x\n2\n")  # the same bytes, written again (another file there now)
    assert verified.changed() == [tmp_path / "b.csv"]
    with pytest.raises(store.ChecksumError, match="b.csv changed while it was read"):
        verified.check_unchanged("the test")


def test_a_cell_swapped_out_and_back_while_a_study_gathers_leaves_its_tables_unrecorded(tmp_path):
    """Campaign 16 M1's class in a study: the tables a study makes from its cells are recorded as the study's, so a
    cell read while an edited copy stood in its place would reach every report.  Gathering compares the cells
    again once the tables are written."""
    sf = store.StudyFolder(tmp_path / "s", study=None)
    sf.open("d1")
    sf.write_cell("c1", {"value": 1.0})
    sf.write_cell("c2", {"value": 2.0})
    with sf.gathering_cells(["table.csv"]):  # nothing changed: the table stays recorded
        store.atomic_write(sf.root / "table.csv", "value\n3.0\n")
    store.verify_checksums(sf.root, "the test")
    with pytest.raises(store.StudyFolderError, match="c2.json changed while the study's tables were made from it"):
        with sf.gathering_cells(["table.csv"]):
            with _swapped_out_and_back(sf.marker("c2"), lambda text: text.replace("2.0", "20.0")):
                value = sum(sf.read_cell(c)["value"] for c in ("c1", "c2"))
            store.atomic_write(sf.root / "table.csv", f"value\n{value}\n")
    assert value == 3.0  # what was read was what was verified (store.pinned), not the edit
    with pytest.raises(store.ChecksumError, match="table.csv is not recorded"):
        store.verify_checksums(sf.root, "the test")
    sf.marker("c1").write_text('{"value": 10.0}\n')  # edited before the gathering: refused up front
    with pytest.raises(store.StudyFolderError, match="c1.json is not the file seco-lab wrote"):
        with sf.gathering_cells(["table.csv"]):
            pass
    sf.close()


def test_a_bias_study_whose_group_is_swapped_while_it_gathers_records_no_table(tmp_path, monkeypatch):
    from dataclasses import replace

    from seco_lab.studies.bias import QUICK, driver, run_study

    cfg = replace(QUICK, depths=(1,), chunk_counts=(4,), seeds=(0,), draws=100)
    run_study(cfg, tmp_path, progress=False)
    store.verify_checksums(tmp_path, "the test")
    real = driver.gather
    table = next((tmp_path / "cells").glob("*.results.csv"))

    def racing(cfg, out):
        lines = table.read_text().splitlines(keepends=True)
        with _swapped_out_and_back(table, lambda text: "".join([lines[0], *lines[2:]])):  # a row dropped
            return real(cfg, out)

    monkeypatch.setattr(driver, "gather", racing)
    with pytest.raises(store.StudyFolderError, match="changed while the study's tables were made from it"):
        run_study(cfg, tmp_path, progress=False)
    with pytest.raises(store.ChecksumError, match="is not recorded"):
        store.verify_checksums(tmp_path, "the test")
    monkeypatch.setattr(driver, "gather", real)
    # campaign 39 C6: a rerun keeps a table its folder's checksums do not list (it cannot tell it from a user's
    # edit); the tables unrecorded are named, and once removed the rerun writes them again, recorded
    with pytest.raises(store.StudyFolderError, match="results.csv was edited after seco-lab wrote it"):
        run_study(cfg, tmp_path, progress=False)
    for name in driver.TABLES:
        (tmp_path / f"{name}.csv").unlink()
    run_study(cfg, tmp_path, progress=False)
    store.verify_checksums(tmp_path, "the test")


@pytest.mark.parametrize("swap", ["folder", "symlink"])
def test_a_results_folder_swapped_for_an_edited_copy_while_the_report_reads_is_not_what_it_reads(
        swap, tmp_path, capsys, monkeypatch):
    """Campaign 17 F1: the whole results folder renamed away and an edited copy renamed in (or ``--results``, a
    symlink, repointed) after the verification, and put back before the second comparison: every file was back
    as verified, so the report printed the edit.  A report now reads the bytes it verified (store.pinned)."""
    import os

    import seco_lab.report.bench as bench

    folder = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", folder)
    edited = tmp_path / "edited"
    shutil.copytree(folder, edited)
    text = (edited / "results.csv").read_text()
    (edited / "results.csv").write_text(text.replace(",82.046875,", ",8.046875,", 1))
    store.seal(edited)  # a consistent copy: only the swap makes it wrong
    results = folder
    if swap == "symlink":
        results = tmp_path / "results"
        results.symlink_to(folder)
    rc, err = _report("bench", results, tmp_path / "ref.md", capsys)
    assert rc == 0, err
    real = bench.bench_report

    def racing(res, out):
        if swap == "folder":
            os.rename(folder, tmp_path / "aside")
            os.rename(edited, folder)
        else:
            (tmp_path / "link").symlink_to(edited)
            os.replace(tmp_path / "link", results)
        try:
            return real(res, out)
        finally:
            if swap == "folder":
                os.rename(folder, edited)
                os.rename(tmp_path / "aside", folder)
            else:
                (tmp_path / "link").symlink_to(folder)
                os.replace(tmp_path / "link", results)

    monkeypatch.setattr(bench, "bench_report", racing)
    rc, err = _report("bench", results, tmp_path / "b.md", capsys)
    assert rc == 0, err
    def numbers(md):  # the provenance line names the folder the link resolved to then (edited/): display only;
        # the figures are under figures/<the report's name> (ref/, b/); the digest line hashes both
        return [line.replace(f"figures/{md.stem}/", "figures/") for line in md.read_text().splitlines()
                if not line.startswith(("_Generated by", "<!-- seco-lab report sha256:"))]

    assert numbers(tmp_path / "b.md") == numbers(tmp_path / "ref.md")  # the verified bytes, not the edit


def test_a_results_file_replaced_by_a_link_to_its_own_copy_is_named_as_a_link(tmp_path):
    """Campaign 17 Q11: the refusal said the link's SHA-256 differed, which it did not."""
    (tmp_path / "s").mkdir()
    store.start_checksums(tmp_path / "s")
    store.atomic_write(tmp_path / "s" / "a.csv", "x\n1\n")
    shutil.copy(tmp_path / "s" / "a.csv", tmp_path / "copy.csv")
    (tmp_path / "s" / "a.csv").unlink()
    (tmp_path / "s" / "a.csv").symlink_to(tmp_path / "copy.csv")
    with pytest.raises(store.ChecksumError, match="a.csv is a symbolic link .* put the file itself in its place"):
        store.verify_checksums(tmp_path / "s", "the test")


def test_a_report_refuses_another_studys_results_it_also_draws_from_when_edited(tmp_path, capsys):
    """Campaign 18: the bias report's real-LM section read reports/real_study/k16x16 beside it, and the audit's
    reference curves read the bias and real studies' tables, without their checksums: an edited value there was
    printed or plotted."""
    from seco_lab.report.markdown import MissingResultsError, verified_beside

    reports = tmp_path / "reports"
    shutil.copytree(ROOT / "reports" / "real_study" / "k16x16", reports / "real_study" / "k16x16")
    shutil.copytree(ROOT / "reports" / "bias_study", reports / "bias_study", ignore=shutil.ignore_patterns("cells"))
    real = reports / "real_study" / "k16x16"
    with verified_beside(real, "the test"):  # as written: read, pinned
        assert store.pinned_bytes(real / "results.csv") == (real / "results.csv").read_bytes()
    with verified_beside(tmp_path / "absent", "the test") as present:  # absent: the caller leaves its part out
        assert present is False
    _edit_cell(real / "results.csv", 1, "rel_bias", "0.112")
    with pytest.raises(MissingResultsError, match="also draws from .*results.csv is not the file seco-lab wrote"):
        with verified_beside(real, "the test"):
            pass
    with pytest.raises(MissingResultsError, match="draws from .*strata.csv, which is not as .*results.csv is not"):
        with verified_beside(real, "the test", "strata.csv"):  # one file of it: its folder's files are verified
            pass
    rc, err = _report("bias", reports / "bias_study", reports / "bias_study.md", capsys)
    assert rc == 2 and "also draws from" in err and "real_study" in err
    shutil.copy(ROOT / "reports" / "real_study" / "k16x16" / "results.csv", real / "results.csv")
    with verified_beside(real, "the test", "strata.csv") as present:
        assert present and store.pinned_bytes(real / "strata.csv") is not None
        assert store.pinned_bytes(real / "cells" / "exact-full.json") is None  # not below it


def test_a_large_pinned_file_is_held_open_not_in_memory_and_still_read_as_verified(tmp_path, monkeypatch):
    """Campaign 18 F5: pinning kept every verified file's bytes in memory (an audit's flat vectors: GBs).  Files
    above PIN_BYTES_MAX are held open instead; a swap of the path still cannot reach the reader."""
    import os

    monkeypatch.setattr(store, "PIN_BYTES_MAX", 8)
    store.start_checksums(tmp_path)
    store.atomic_write(tmp_path / "big.csv", "x\n" + "1\n" * 20)
    store.atomic_write(tmp_path / "small.csv", "x\n1\n")
    verified = store.verify_checksums(tmp_path, "the test", pin=True)
    assert isinstance(verified.data[tmp_path / "big.csv"], int) and isinstance(verified.data[tmp_path / "small.csv"],
                                                                               bytes)
    with store.pinned(verified):
        os.rename(tmp_path / "big.csv", tmp_path / "aside.csv")
        (tmp_path / "big.csv").write_text("x\n9\n")  # an edited copy in its place
        assert store.read_csv(tmp_path / "big.csv", "t").x.tolist() == [1] * 20
        assert store.pinned_bytes(tmp_path / "big.csv") == (tmp_path / "aside.csv").read_bytes()
    assert tmp_path / "big.csv" not in verified.data  # its descriptor released when the pinned block ended


def test_a_recorded_file_missing_or_changed_beside_the_report_is_refused_not_left_out(tmp_path, monkeypatch):
    """Campaign 19: a recorded study.json (or reference table) deleted beside the report left its section or curve
    out without a word; a file held open and rewritten in place while read was drawn."""
    import os

    from seco_lab.report.markdown import MissingResultsError, verified_beside

    real = tmp_path / "real"
    shutil.copytree(ROOT / "reports" / "real_study" / "k16x16", real)
    (real / "study.json").unlink()
    with pytest.raises(MissingResultsError, match="study.json is recorded in .* but missing"):
        with verified_beside(real, "the test"):
            pass
    with pytest.raises(MissingResultsError, match="from .*strata.csv, .*strata.csv is recorded in .* but missing"):
        (real / "strata.csv").unlink()
        with verified_beside(real, "the test", "strata.csv"):
            pass
    for name in ("study.json", "strata.csv"):
        shutil.copy(ROOT / "reports" / "real_study" / "k16x16" / name, real / name)
    monkeypatch.setattr(store, "PIN_BYTES_MAX", 8)  # results.csv held open: rewritten in place while read
    with pytest.raises(MissingResultsError, match="results.csv, which changed while the report read it"):
        with verified_beside(real, "the test", "results.csv"):
            text = (real / "results.csv").read_text()
            with open(real / "results.csv", "r+") as f:
                f.write(text[:-2] + "9\n")
            os.utime(real / "results.csv", ns=(0, 0))
