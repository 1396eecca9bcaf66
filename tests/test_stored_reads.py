"""Issue 19, campaign 7 G6/G7/G9 (docs/hostile_campaign_7.md): every stored file is read through a checked reader.

Before, ~33 stored JSON files were read with a bare ``json.loads(path.read_text())`` and ~20 tables with a bare
``pd.read_csv(path)``: a FIFO in a file's place hung the command forever (``open`` waits for a writer), a symlink to
``/dev/zero`` read until memory ran out, and a wrong JSON type (``[]`` for an object) gave a raw traceback.  Now
``seco_lab.store.read_json`` / ``read_csv`` (and the reports' ``read_json_table`` / ``read_stored_csv``) refuse a
FIFO, device, folder or oversize file before opening it, and a file that is not JSON, nests too deeply or holds the
wrong type is one error naming the file; where a damaged file means "not done", it counts as damaged.

Every test here is bounded so that the old code FAILS rather than hangs: a command runs in a subprocess with a
timeout and a cap on its memory, an in-process call under ``bounded`` (SIGALRM, and a cap on the memory it may
allocate, so that reading ``/dev/zero`` ends in MemoryError, not in the machine's memory)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

import seco_lab

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = Path(seco_lab.__file__).resolve().parents[1]  # the checkout whose package is under test
DEEP_JSON = "[" * 200_000 + "]" * 200_000
KINDS = ("fifo", "dev_zero", "wrong_type")
LIMIT_S = 60  # far above any of these reads; reached only by a read that blocks
MEMORY_CAP = 3 << 30  # a subprocess's data segment: well above what a command needs


def plant(path: Path, kind: str, wrong: str = "[1, 2]") -> Path:
    """Put a FIFO, a symlink to /dev/zero or JSON of the wrong type (``wrong``) in ``path``'s place."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    else:
        path.write_text(wrong)
    return path


def _vm_data() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    return 0


class Hung(BaseException):
    """A read still blocked after the time limit (a BaseException: no ``except OSError`` of the code swallows it)."""


@contextmanager
def bounded(seconds: int = LIMIT_S, extra_bytes: int = 1 << 30):
    """Fail, never hang: :class:`Hung` after ``seconds`` (a read blocked on a FIFO), and a MemoryError once the
    block allocates ``extra_bytes`` more (a read of /dev/zero).  Only around small readers that load no library:
    a command that imports pandas/pyarrow, matplotlib or trains a model (whose allocators reserve large arenas)
    runs in a subprocess under a fixed cap instead (:func:`cli`)."""
    def ring(signum, frame):
        raise Hung(f"blocked for {seconds} s (a read waiting on a FIFO?)")

    old_handler = signal.signal(signal.SIGALRM, ring)
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = _vm_data() + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_DATA, (MEMORY_CAP, resource.getrlimit(resource.RLIMIT_DATA)[1]))


def cli(*args, cwd: Path) -> tuple[int, str]:
    """``seco-lab ARGS`` in a subprocess (the package under test), bounded in time and memory: (rc, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)}
    try:
        p = subprocess.run([sys.executable, "-m", "seco_lab.cli", *map(str, args)], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=LIMIT_S, preexec_fn=_cap_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"seco-lab {' '.join(map(str, args))} hung for {LIMIT_S} s (blocked reading a FIFO?)")
    return p.returncode, p.stderr


def no_traceback(err: str) -> None:
    assert "Traceback" not in err and "MemoryError" not in err, err[-2000:]


# --------------------------------------------------------------------------- G6: audit units


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_g6_report_audit_with_a_fifo_or_device_unit_ends_with_a_message(kind, audit_copy, tmp_path):
    """G6 reproducer 1/2: `report audit` on an audit whose unit cost-s00.json is a FIFO hung forever in open(); as a
    link to /dev/zero it read until memory ran out.  The unit is now damaged, named, and never opened: the stored
    tables (which counted it) no longer match, and the report says how to rewrite them."""
    plant(audit_copy / "units/cost-s00.json", kind)
    rc, err = cli("report", "audit", "--results", audit_copy, "--out", tmp_path / "r.md", cwd=tmp_path)
    no_traceback(err)
    assert rc == 2 and "cost-s00.json is damaged (not a regular file" in err
    assert "--tables-only" in err


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "huge"])
def test_g6_audit_tables_only_counts_a_fifo_device_or_huge_unit_as_damaged(kind, audit_copy, tmp_path):
    """G6: `audit --tables-only` hung on a FIFO unit, read /dev/zero without bound and a 300 MB unit whole.  Each is
    now a damaged unit, left out of the tables and named (a FIFO, device or file over the 64 MiB record limit is
    never opened); the report then renders and lists it as damaged.  (A unit of the wrong JSON type was damaged
    before too: test_issue19_campaign5.)"""
    unit = audit_copy / "units/cost-s00.json"
    if kind == "huge":
        unit.unlink()
        with open(unit, "wb") as f:
            f.truncate(300 << 20)  # sparse: no disk used
    else:
        plant(unit, kind)
    rc, err = cli("audit", "--tables-only", "--out", audit_copy, cwd=tmp_path)
    no_traceback(err)  # left out, its rows would go: refused unless asked for (campaign 10 K1)
    assert rc == 2 and "cost-s00.json is damaged (not a regular file of at most 64 MiB" in err
    assert "--drop-missing-units" in err
    rc, err = cli("audit", "--tables-only", "--drop-missing-units", "--out", audit_copy, cwd=tmp_path)
    assert rc == 0 and "cost-s00.json is damaged" in err
    rc, err = cli("report", "audit", "--results", audit_copy, "--out", tmp_path / "r.md", cwd=tmp_path)
    no_traceback(err)
    assert rc == 0 and "`cost-s00` is stored but damaged" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_audit_tables_units_in_process(kind, audit_copy):
    """studies/audit/tables.py load_units/unusable_units: a FIFO or device unit is damaged, never opened (a unit of
    the wrong JSON type was damaged before too)."""
    from seco_lab.studies.audit.tables import load_units, unusable_units

    plant(audit_copy / "units/cost-s00.json", kind)
    with bounded():
        units, bad = load_units(audit_copy), unusable_units(audit_copy)
    assert "cost-s00" not in units and "exact" in units
    assert bad["cost-s00"].startswith("damaged (not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_audit_report_stored_table_is_refused_by_name(kind, audit_copy, tmp_path):
    """report/audit.py verify_tables: a stored table (strata.csv) that is a FIFO hung the report, /dev/zero read
    without bound; now refused, named.  (audit.json holding a list was refused, named, before too.)  In a
    subprocess under a fixed cap (:func:`cli`): pyarrow and matplotlib reserve address space as they load, so a cap
    a little above this process's current use (:func:`bounded`) failed at random with ArrowMemoryError."""
    name = "strata.csv"
    plant(audit_copy / name, kind)
    rc, err = cli("report", "audit", "--results", audit_copy, "--out", tmp_path / "r.md", cwd=tmp_path)
    no_traceback(err)
    assert rc == 2 and name in err and "not a regular file" in err


@pytest.mark.parametrize("kind", KINDS)
def test_audit_driver_refuses_a_damaged_stored_config(kind, audit_copy):
    """studies/audit/driver.py _check_folder: config.json holding a list gave TypeError, a FIFO was silently written
    over; now a ValueError names the file."""
    from seco_lab.studies.audit.config import AuditConfig
    from seco_lab.studies.audit.driver import _check_folder

    plant(audit_copy / "config.json", kind)
    with bounded(), pytest.raises(ValueError, match=r"audit config .*config.json"):
        _check_folder(AuditConfig(), audit_copy)


@pytest.mark.parametrize("kind", KINDS)
def test_audit_sources_refuse_a_damaged_sequences_file(kind, audit_copy):
    """studies/audit/sources.py load_sequence: sequences.json as a FIFO hung, as /dev/zero read without bound, as a
    list gave a misleading "not a sequence"; now a ValueError names the file."""
    from seco_lab.studies.audit.sources import load_sequence

    plant(audit_copy / "sequences.json", kind)
    with bounded(), pytest.raises(ValueError, match=r"sequences.json"):
        load_sequence(audit_copy, "s00")


# --------------------------------------------------------------------------- G7: the HF trainer's settings file


@pytest.mark.parametrize("content", ["[1, 2]", "{not json", "{}", "deep", "fifo", "dev_zero"])
def test_g7_a_damaged_seco_trainer_json_is_one_value_error(content, tmp_path):
    """G7: `SeCOTrainer.train(resume_from_checkpoint=DIR)` with DIR/seco_trainer.json holding [1, 2], `{not json`,
    {} or 100,000-deep nesting gave TypeError / JSONDecodeError / KeyError / RecursionError tracebacks (a FIFO or a
    link to /dev/zero was silently skipped).  Now one ValueError names the file: its SeCO settings are damaged and
    cannot be compared."""
    from trainer_case import make_trainer

    from seco_lab.integrations.transformers import SeCOArguments

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    path = ckpt / "seco_trainer.json"
    if content in ("fifo", "dev_zero"):
        plant(path, content)
    else:
        path.write_text("[" * 100_000 + "]" * 100_000 if content == "deep" else content)
    trainer = make_trainer(tmp_path / "out", SeCOArguments(chunk_size=3))
    # HF's Trainer imports and allocates more than a small reader: 4 GiB of headroom (an unbounded read of
    # /dev/zero still meets the cap), so the test cannot fail on the libraries' arenas
    with bounded(extra_bytes=4 << 30), pytest.raises(ValueError, match=r"seco_trainer.json.*SeCO settings are damaged"):
        trainer.train(resume_from_checkpoint=str(ckpt))


# --------------------------------------------------------------------------- G9: the training comparison report


@pytest.mark.parametrize("what", ["list", "empty_object", "fifo", "dev_zero", "csv_fifo"])
def test_g9_report_train_compare_refuses_a_damaged_stored_file(what, tmp_path):
    """G9: `report train-compare` with training.json = [] gave `TypeError: list indices must be integers`; {} a
    KeyError; a FIFO (training.json or a CSV) hung; /dev/zero read without bound.  Each is now one line naming the
    file and the command that writes it."""
    tr = tmp_path / "tr"
    shutil.copytree(ROOT / "reports/training", tr)
    name = "throughput.csv" if what == "csv_fifo" else "training.json"
    kind = {"list": "wrong_type", "empty_object": "wrong_type", "csv_fifo": "fifo"}.get(what, what)
    plant(tr / name, kind, "[]" if what == "list" else "{}")
    rc, err = cli("report", "train-compare", "--results", tr, "--out", tmp_path / "r.md", cwd=tmp_path)  # pandas
    no_traceback(err)  # and matplotlib loaded: in a subprocess, as above
    assert rc == 2 and name in err and "train" in err and len(err.strip().splitlines()) == 1, err


# --------------------------------------------------------------------------- the other modules changed


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "deep", "not_utf8"])
def test_store_read_json_refuses_by_name(kind, tmp_path):
    """store.py read_json: one ValueError naming the file for a FIFO, a device, nesting past the recursion limit,
    bytes that are not UTF-8, and a value of the wrong type; a missing file stays FileNotFoundError."""
    from seco_lab.store import read_json

    path = tmp_path / "record.json"
    if kind == "deep":
        path.write_text(DEEP_JSON)
    elif kind == "not_utf8":
        path.write_bytes(b'{"a": "\xff"}')
    else:
        plant(path, kind)
    with bounded(), pytest.raises(ValueError, match=r"stored record .*record.json"):
        read_json(path, "stored record")
    path.unlink()
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"holds a list where an object is expected"):
        read_json(path, "stored record")
    assert read_json(path, "stored record", expect=list) == []
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "absent.json", "stored record")


@pytest.mark.parametrize("where", ["marker_fifo", "marker_dev_zero", "table_fifo", "table_dev_zero"])
def test_store_study_folder_counts_a_fifo_or_device_cell_as_not_done(where, tmp_path):
    """store.py StudyFolder.done: a cell record or table that is a FIFO hung (read_text, read_bytes for the
    checksum), a link to /dev/zero read without bound; the cell is now not done (computed again)."""
    from seco_lab.store import StudyFolder

    folder = StudyFolder(tmp_path / "s")
    folder.cells.mkdir(parents=True)
    folder.write_cell("c", {"x": 1}, {"t": pd.DataFrame({"a": [1]})})
    assert folder.done("c")
    plant(folder.marker("c") if where.startswith("marker") else folder.cells / "c.t.csv",
          where.split("_", 1)[1])
    with bounded():
        assert not folder.done("c")


def test_store_read_cell_refuses_a_wrong_type_by_name(tmp_path):
    """store.py StudyFolder.read_cell: a record holding a list gave AttributeError ('list' has no 'pop')."""
    from seco_lab.store import StudyFolder

    folder = StudyFolder(tmp_path / "s")
    folder.cells.mkdir(parents=True)
    plant(folder.marker("c"), "wrong_type")
    with pytest.raises(ValueError, match=r"cell record .*c.json holds a list"):
        folder.read_cell("c")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_bias_study_record_is_refused_by_name(kind, tmp_path):
    """studies/bias/cell.py load_study_config: a FIFO or device study.json was said not to exist; now named as
    what it is."""
    from seco_lab.studies.bias.cell import load_study_config

    plant(tmp_path / "study.json", kind)
    with bounded(), pytest.raises(ValueError, match=r"study.json is not a regular file"):
        load_study_config(tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_bias_group_record_is_refused_by_name(kind, tmp_path):
    """studies/bias/driver.py timing_summary: a group's timing record as a FIFO hung, as /dev/zero read without
    bound, as a list gave TypeError; now a ValueError names it."""
    from seco_lab.studies.bias.definition import QUICK
    from seco_lab.studies.bias.driver import all_groups, group_stem, timing_summary

    kind_, (L, k, seed) = all_groups(QUICK)[0]
    path = group_stem(tmp_path, L, k, seed, kind_).with_suffix(".json")
    path.parent.mkdir(parents=True)
    plant(path, kind)
    with bounded(), pytest.raises(ValueError, match=r"group record .*\.json"):
        timing_summary(QUICK, tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_real_study_counts_a_damaged_cell_as_not_run(kind, tmp_path):
    """studies/real.py load_cells: a FIFO cell hung, /dev/zero read without bound, a list was taken as a cell;
    now each is left out (not run)."""
    from seco_lab.studies.real import load_cells

    (tmp_path / "cells").mkdir()
    (tmp_path / "cells/lora.json").write_text(json.dumps({"gram": [[1.0]]}))
    plant(tmp_path / "cells/exact-lora.json", kind)
    with bounded():
        assert list(load_cells(tmp_path)) == ["lora"]


def test_rerun_tables_rewrites_a_stored_table_over_the_limit(tmp_path):
    """studies/rerun_tables.py write_tables: a stored table over the 1 GiB table limit (sparse here) was read whole
    to compare it; now it counts as differing and is written again, unread."""
    from seco_lab.studies.rerun_tables import write_tables

    with open(tmp_path / "t.csv", "wb") as f:
        f.truncate((1 << 30) + 1)
    with bounded(extra_bytes=512 << 20):
        check = write_tables(tmp_path, {"t": pd.DataFrame({"a": [1.0]})})
    assert not check.kept and (tmp_path / "t.csv").read_text() == "a\n1.0\n"


def _train_study(tmp_path):
    from seco_lab.studies.train.study import quick_config

    cfg = quick_config()
    (tmp_path / "runs").mkdir()
    return cfg


@pytest.mark.parametrize("kind", KINDS)
def test_train_study_record_is_refused_by_name(kind, tmp_path):
    """studies/train/study.py collect_partial: study.json as a FIFO hung, as a list gave AttributeError; now a
    ValueError names it."""
    from seco_lab.studies.train.study import collect_partial

    cfg = _train_study(tmp_path)
    plant(tmp_path / "study.json", kind)
    with bounded(), pytest.raises(ValueError, match=r"study record .*study.json"):
        collect_partial(cfg, tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_train_study_collect_skips_a_damaged_run(kind, tmp_path):
    """studies/train/study.py collect: a finished run whose record became a FIFO hung (its table was read, then
    the record); now the run is not finished and is left out."""
    from seco_lab.studies.train.study import collect, study_folder

    cfg = _train_study(tmp_path)
    specs = cfg.runs()[:2]
    folder = study_folder(tmp_path)
    for s in specs:
        folder.write_cell(s.run_id, {"run_id": s.run_id, "wall_s": 1.0}, {"rows": pd.DataFrame({"step": [0]})},
                          table_suffix=".csv")
    plant(folder.marker(specs[0].run_id), kind)
    with bounded():
        runs = collect(tmp_path, specs)
    assert list(runs.run_id) == [specs[1].run_id]


@pytest.mark.parametrize("kind", KINDS)
def test_train_extension_files_are_refused_by_name(kind, tmp_path):
    """studies/train/equal_finals.py load_folder, equal_runs.py _status_line, extensions.py _main_tables: an
    extension folder's study.json as a FIFO hung, as a list gave AttributeError or was returned as a record; now
    each refuses with a MissingResultsError naming the file and the command that writes it."""
    from seco_lab.report.markdown import MissingResultsError
    from seco_lab.studies.train.equal_finals import load_folder
    from seco_lab.studies.train.equal_runs import _status_line
    from seco_lab.studies.train.extensions import _main_tables

    sub = tmp_path / "equal_compute"
    sub.mkdir()
    for name in ("results.csv.gz", "runs.csv"):
        pd.DataFrame({"run_id": ["a"]}).to_csv(sub / name, index=False)
    plant(sub / "study.json", kind)
    for call in (lambda: load_folder(sub), lambda: _status_line(tmp_path, "equal_compute"),
                 lambda: _main_tables(sub)):
        with bounded(), pytest.raises(MissingResultsError, match=r"study.json.*seco-lab study train"):
            call()


@pytest.mark.parametrize("what", ["results_fifo", "bench_list", "hf_fifo", "fsdp_dev_zero"])
def test_bench_reports_refuse_damaged_stored_files(what, tmp_path):
    """report/bench.py, bench_hf.py, bench_fsdp.py: results.csv, hf_results.csv or fsdp_results.csv as a FIFO
    hung, as /dev/zero read without bound; bench.json as a list gave a TypeError.  Each is one line naming the
    file and the command that writes it."""
    b = tmp_path / "b"
    shutil.copytree(ROOT / "reports/bench", b)
    name, kind = {"results_fifo": ("results.csv", "fifo"), "bench_list": ("bench.json", "wrong_type"),
                  "hf_fifo": ("hf_results.csv", "fifo"), "fsdp_dev_zero": ("fsdp_results.csv", "dev_zero")}[what]
    plant(b / name, kind)
    rc, err = cli("report", "bench", "--results", b, "--out", tmp_path / "r.md", cwd=tmp_path)  # a subprocess, as
    no_traceback(err)  # for the other reports: pandas and matplotlib loaded under a fixed cap
    assert rc == 2 and name in err and "bench" in err and len(err.strip().splitlines()) == 1, err


def test_run_files_metrics_line_nested_too_deeply_is_named(tmp_path):
    """training/run_files.py read_metrics: a metrics line nested past the recursion limit raised RecursionError;
    now it is a damaged line, named (read_config and is_run go through read_json too: same refusals as before)."""
    from seco_lab.training.run_checks import RunDirError
    from seco_lab.training.run_files import read_metrics

    (tmp_path / "metrics.jsonl").write_text(DEEP_JSON + "\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(RunDirError, match=r"line 1 is not JSON"):
        read_metrics(tmp_path)
