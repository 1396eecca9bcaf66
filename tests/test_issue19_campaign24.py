"""Issue 19, hostile campaign 24 (docs/hostile_campaign_24.md): the findings fixed after it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_SIGTERM_SCRIPT = """
import os, pathlib, signal, sys, threading, time
from seco_lab.studies.runner import Terminated, run_cells, terminate_as_interrupt

HERE = pathlib.Path(sys.argv[1])

def work(i):
    (HERE / f"worker{i}.pid").write_text(str(os.getpid()))
    time.sleep(120)
    (HERE / f"late{i}").touch()  # a cell finishing after the command ended: what must not happen
    return i

def terminate_when_running():
    while len(list(HERE.glob("worker*.pid"))) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # kill/timeout/schedulers, or a closed terminal: the parent

if __name__ == "__main__":
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as under a terminal, also where the suite itself runs under nohup
    threading.Thread(target=terminate_when_running, daemon=True).start()
    try:
        with terminate_as_interrupt():
            run_cells(work, range(4), jobs=2, progress=False)
    except Terminated:
        sys.exit(143)
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])  # SIGHUP: campaign 25 N2 (the terminal closed)
def test_f1_sigterm_stops_a_study_and_its_workers(tmp_path, signame):
    """Campaign 24 F1 (hang): SIGTERM killed only the parent of `seco-lab study bias --jobs 2`; its workers, reparented
    to init, kept writing cells into the folder after the command had exited, then blocked for ever."""
    import time

    script = tmp_path / "sigterm.py"
    script.write_text(_SIGTERM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), signame], capture_output=True, text=True,
                          timeout=180, env=env, start_new_session=True)
    pids = [int(p.read_text()) for p in tmp_path.glob("worker*.pid")]
    try:
        assert proc.returncode == 143, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert len(pids) == 2
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            time.sleep(0.1)
        assert alive == [], "the study's workers outlived it"
    finally:
        for p in pids:
            if _alive(p):
                os.kill(p, 9)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie is gone (its parent, pid 1, reaps it)
    except (FileNotFoundError, IndexError):
        return False


def test_f1_the_study_command_says_terminated_and_exits_143(tmp_path, capsys, monkeypatch):
    """The study command's handler: SIGTERM (Terminated) is said as such, with the resume hint, exit 143."""
    from seco_lab.cli import main
    from seco_lab.studies.bias import driver
    from seco_lab.studies.runner import Terminated

    def terminated(args):
        raise Terminated()

    monkeypatch.setattr(driver, "run_from_args", terminated)
    assert main(["study", "bias", "--quick", "--out", str(tmp_path / "q"), "--no-progress"]) == 143
    err = capsys.readouterr().err
    assert "terminated; the cells finished so far are stored in" in err and "Traceback" not in err


@pytest.mark.parametrize("kind, stem", [("train-compare", "other"), ("audit", "other"), ("audit", "report")])
def test_f2_a_report_of_other_results_beside_a_committed_one_leaves_its_figures_alone(tmp_path, capsys, kind, stem):
    """Campaign 24 F2 (silent-wrong): `report bias --results q --out reports/quick_bias.md` redrew the figures of the
    committed bias_study.md (figures/bias_study/*.png): it showed a k = 32 figure beside k = 128 tables.  Figures
    go to figures/<the report's name>, the committed report's own name keeping its folder.  Campaign 25 N6: an
    audit report named ``report.md`` (the name of the report inside an audit's own folder) beside the committed
    audit.md still drew into audit.md's figure."""
    import shutil

    from seco_lab.cli import main

    reports = tmp_path / "reports"
    results, committed, fig = {"train-compare": ("training", "training.md", "figures/training/far_loss.png"),
                               "audit": ("audit/k128", "audit.md", "figures/audit_strata_profile.png")}[kind]
    shutil.copytree(ROOT / "reports" / results, reports / results)
    for name in (committed, fig):
        (reports / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "reports" / name, reports / name)
    if kind == "audit":  # its reference curves: the other studies beside it
        for other in ("bias_study", "real_study"):
            shutil.copytree(ROOT / "reports" / other, reports / other, ignore=shutil.ignore_patterns("cells"))
    (reports / fig).write_bytes((reports / fig).read_bytes())  # the committed figure, as committed
    before = (reports / fig).read_bytes()
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["report", kind, "--results", str(reports / results), "--out", f"reports/{stem}.md"]) == 0
    finally:
        os.chdir(cwd)
    assert (reports / fig).read_bytes() == before  # the committed report's figure untouched
    text = (reports / f"{stem}.md").read_text()
    drawn = sorted(p.relative_to(reports).as_posix() for p in (reports / "figures" / stem).glob("*.png"))
    assert drawn and all(f"({name})" in text for name in drawn)


def test_f10_two_runs_with_the_same_folder_name_get_legend_labels_that_tell_them_apart(tmp_path):
    """Campaign 24 F10: `plot a/r b/r` labelled both curves "r: seco, synthetic data, ...": each label true, the
    figure unable to say which run is which."""
    from seco_lab.report.runs import distinct_names

    assert distinct_names([tmp_path / "a" / "r", tmp_path / "b" / "r"]) == ["a/r", "b/r"]
    assert distinct_names([tmp_path / "a" / "r", tmp_path / "b" / "s"]) == ["r", "s"]
    names = distinct_names([tmp_path / "x" / "a" / "r", tmp_path / "y" / "a" / "r", tmp_path / "z"])
    assert names[:2] == ["x/a/r", "y/a/r"] and names[2].endswith("/z")  # as many parts as the closest pair needs


def test_f8_the_audits_folder_walk_names_the_files_it_skips(tmp_path):
    """Campaign 24 AD22b (F8's class): `audit --texts d` skipped d/b.txt (a stray NUL) without a word, then said the
    texts "hold only 2 windows"."""
    from dataclasses import replace

    from seco_lab.studies.audit.config import DEFAULT
    from seco_lab.studies.audit.sources import text_sources

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("some prose. " * 50)
    (d / "b.txt").write_bytes(b"notes\0 more notes\n")
    (d / "c.txt").write_bytes(b"caf\xe9 " * 50)
    with pytest.warns(UserWarning, match=r"1 text file\(s\) skipped as binary.*b\.txt.*1 text file\(s\) skipped as "
                                         r"not UTF-8.*c\.txt"):
        got = text_sources(replace(DEFAULT, texts=(f"prose:{d}",)))
    assert got == [("prose", d / "a.txt")]
