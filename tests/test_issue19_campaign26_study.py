"""Issue 19, hostile campaign 26: the study runner's finding fixed after it (ST31b)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_issue19_campaign24 import _SIGTERM_SCRIPT, ROOT, _alive


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(") ", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
                found.append(int(name))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_st31b_sigkill_to_the_study_ends_its_workers(tmp_path):
    """Campaign 26 ST31b (hang): SIGKILL (kill -9, the OOM killer) to the parent of `seco-lab study bias --jobs 2`
    left its workers orphaned: they kept storing cells, then waited for ever.  Now each worker watches its parent and
    ends itself within a second of its death: no process of the study outlives it, and no cell finishes after it."""
    script = tmp_path / "sigkill.py"
    script.write_text(_SIGTERM_SCRIPT)  # the parent signals itself once both workers run a cell: here SIGKILL
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "log"  # a file, not a pipe: orphaned workers would hold a pipe open
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "SIGKILL"], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sid = proc.pid  # start_new_session: the parent leads a session of its own, which its workers share
    try:
        assert proc.wait(timeout=120) == -signal.SIGKILL, log.read_text()[-2000:]
        workers = [int(p.read_text()) for p in tmp_path.glob("worker*.pid")]
        assert len(workers) == 2
        deadline = time.monotonic() + 20  # generous: the watchdog looks every 0.5 s
        left = _session(sid)
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _session(sid)
        assert left == [], f"processes of the study outlived its SIGKILL: {left} (workers {workers})"
        assert not any(_alive(p) for p in workers)
        assert list(tmp_path.glob("late*")) == [], "a cell finished after the study was killed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            os.killpg(sid, signal.SIGKILL)  # the survivors of a failure: the study's workers, nothing else
        except (ProcessLookupError, PermissionError):
            pass


def test_sighup_stops_a_run_or_a_study_unless_it_was_started_under_nohup():
    """SG20: SIGHUP (the terminal closed) killed `train` without its checkpoint-and-stop; it is a stop signal now,
    as for a study (campaign 25 N2) -- except where the process was started with SIGHUP ignored (`nohup`), which
    the user chose so that the run outlives the terminal: kept, for a run and a study alike."""
    import signal

    from seco_lab.studies.runner import terminate_as_interrupt
    from seco_lab.training.launch import catch_stop_signals

    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        restore = catch_stop_signals(lambda signum: None)
        assert callable(signal.getsignal(signal.SIGHUP))  # caught
        restore()
        with terminate_as_interrupt():
            assert callable(signal.getsignal(signal.SIGHUP))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup
        restore = catch_stop_signals(lambda signum: None)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert callable(signal.getsignal(signal.SIGTERM))
        restore()
        with terminate_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
