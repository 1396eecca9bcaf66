"""The study store, the study runner and the registry of studies (``seco_lab.store``,
``seco_lab.studies.runner``, ``seco_lab.studies.registry``)."""

import json
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from seco_lab.store import (
    DefinitionMismatch,
    StudyFolder,
    atomic_write,
    atomic_write_csv,
    atomic_write_json,
    fingerprint,
    software_versions,
)
from seco_lab.studies.registry import STUDIES, report_main, resolve, study_main
from seco_lab.studies.runner import run_cells, worker_count

ROOT = Path(__file__).resolve().parents[1]


def square_and_store(args):
    """A cell of a toy study: its result, stored as the cell's record."""
    out, x = args
    StudyFolder(out).write_cell(f"x{x}", {"x": x, "square": x * x, "pid": os.getpid()})
    return x * x


# --------------------------------------------------------------------------- store


def test_atomic_writes_round_trip_and_leave_no_temporary_file(tmp_path):
    atomic_write(tmp_path / "a.txt", "text")
    atomic_write(tmp_path / "b.bin", b"\x00\x01")
    atomic_write_json(tmp_path / "c.json", {"k": [1, 2]})
    df = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})
    atomic_write_csv(tmp_path / "d.csv.gz", df)
    assert (tmp_path / "a.txt").read_text() == "text" and (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert json.loads((tmp_path / "c.json").read_text()) == {"k": [1, 2]}
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "d.csv.gz"), df)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin", "c.json", "d.csv.gz"]


def test_a_failing_writer_keeps_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "f.txt"
    atomic_write(target, "old")

    def half_then_fail(f):
        f.write(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="mid-write"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_the_path_comes_first(tmp_path):
    with pytest.raises(TypeError, match="path comes first"):
        atomic_write("text", tmp_path / "x")
    with pytest.raises(TypeError, match="path comes first"):
        atomic_write_csv(pd.DataFrame({"a": [1]}), tmp_path / "x.csv")


def test_software_versions_records_extra_packages():
    v = software_versions("pandas", "surely-not-an-installed-distribution")
    assert v["pandas"] == pd.__version__ and v["surely-not-an-installed-distribution"] == "absent"
    assert {"python", "torch", "numpy", "scipy", "platform", "cpus"} <= set(v)


def test_fingerprint_ignores_key_order_and_sees_every_value():
    assert fingerprint({"a": 1, "b": [2, 3]}) == fingerprint({"b": [2, 3], "a": 1})
    assert fingerprint({"a": 1, "b": [2, 3]}) != fingerprint({"a": 1, "b": [3, 2]})
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint({}))


def test_study_folder_refuses_another_definition_and_fresh_discards_cells(tmp_path):
    folder = StudyFolder(tmp_path / "s")
    assert folder.open("aaaa") == {}
    folder.write_manifest({"fingerprint": "aaaa"})
    folder.write_cell("one", {"v": 1}, {"rows": pd.DataFrame({"a": [1]})})
    (folder.cells / "two.json.seco-tmp123").write_text("")  # left by a writer killed before its first byte
    assert folder.open("aaaa") == {"fingerprint": "aaaa"} and folder.done("one")
    assert not list(folder.cells.glob("*tmp*"))
    with pytest.raises(DefinitionMismatch, match="different study definition"):
        folder.open("bbbb")
    folder.open("bbbb", fresh=True)
    assert not folder.done("one") and [p.name for p in folder.cells.iterdir()] == ["checksums.sha256"]
    assert "one" not in (folder.cells / "checksums.sha256").read_text()  # the discarded cell's entry with it


# --------------------------------------------------------------------------- runner


def test_run_cells_in_spawned_workers_stores_every_cell(tmp_path):
    StudyFolder(tmp_path).open("toy")
    got = run_cells(square_and_store, [(tmp_path, x) for x in range(5)], jobs=2, progress=False)
    assert sorted(got) == [x * x for x in range(5)]
    folder = StudyFolder(tmp_path)
    records = [folder.read_cell(f"x{x}") for x in range(5)]
    assert [r["square"] for r in records] == [x * x for x in range(5)]
    assert os.getpid() not in {r["pid"] for r in records}  # computed in worker processes


def test_isolated_cells_each_get_a_fresh_process(tmp_path):
    StudyFolder(tmp_path).open("toy")
    run_cells(square_and_store, [(tmp_path, x) for x in range(3)], jobs=1, isolate=True, progress=False)
    pids = {StudyFolder(tmp_path).read_cell(f"x{x}")["pid"] for x in range(3)}
    assert len(pids) == 3 and os.getpid() not in pids


def test_workers_are_capped_by_the_work_and_the_cores():
    assert worker_count(8, 3) == min(3, os.cpu_count())
    assert worker_count(1, 100) == 1 and worker_count(4, 0) == 1
    assert worker_count(10**6, 10**6) == os.cpu_count()


# --------------------------------------------------------------------------- registry


def test_every_registered_function_resolves():
    for study in STUDIES.values():
        for ref in (study.report, study.run, study.add_arguments):
            if ref is not None:
                assert callable(resolve(ref)), ref


def test_default_folders_are_distinct_and_quick_ones_stay_out_of_the_committed_reports():
    folders = [s.results for s in STUDIES.values()] + [s.quick_results for s in STUDIES.values() if s.quick_results]
    assert len(set(folders)) == len(folders)
    for s in STUDIES.values():
        if s.quick_results is not None:
            assert s.quick_results.parts[:2] == ("reports", "_work")


def test_make_targets_pair_with_the_registry_and_call_only_seco_lab_for_studies():
    """`make NAME-study` runs `seco-lab study NAME` and `seco-lab report NAME` for every registered study,
    `make NAME-study-quick` the same with --quick, `make report` renders every registered report, and the
    Makefile never runs a study any other way."""
    make = (ROOT / "Makefile").read_text()
    listed = {name: re.search(rf"^{name}\s*:= (.*)$", make, flags=re.M).group(1).split()
              for name in ("STUDIES", "QUICK_STUDIES")}
    assert listed["STUDIES"] == [n for n, s in STUDIES.items() if s.run]
    assert listed["QUICK_STUDIES"] == [n for n, s in STUDIES.items() if s.run and s.quick_results]
    recipes = dict(re.findall(r"^.+?: (%-study(?:-quick)?): \$\(STAMP\)\n((?:\t.*\n)+)", make, flags=re.M))
    assert "seco-lab study $* --jobs" in recipes["%-study"] and "seco-lab report $*\n" in recipes["%-study"]
    assert "seco-lab study $* --quick" in recipes["%-study-quick"] and "report $* --quick" in recipes["%-study-quick"]
    report = re.search(r"^report: \$\(STAMP\)\n((?:\t.*\n)+)", make, flags=re.M).group(1)
    assert "for name in $(STUDIES); do $(BIN)/seco-lab report $$name" in report
    for name, study in STUDIES.items():
        if not study.run:
            assert f"seco-lab report {name};" in report, name
    assert "-m seco_lab" not in make and not re.search(r"experiments\.(bias|real|train)_study", make)


def test_report_of_missing_results_says_so_for_every_report(tmp_path, capsys):
    for name in [*STUDIES, "training-study"]:
        assert report_main([name, "--results", str(tmp_path / "none"), "--out", str(tmp_path / "o.md")]) == 2
        err = capsys.readouterr().err
        assert "lacks" in err and "cannot write" not in err, (name, err)


def test_study_command_refuses_a_report_only_name(capsys):
    assert study_main(["bench"]) == 2
    assert "make bench" in capsys.readouterr().err


def test_the_real_study_defaults_resume_the_committed_folder():
    """The default folder of `seco-lab study real` holds cells of the default definition (no drift)."""
    from seco_lab.studies.real import RealStudyConfig, study_folder

    folder = study_folder(ROOT / STUDIES["real"].results)
    assert folder.stored_fingerprint() == fingerprint(RealStudyConfig().definition())
