"""Measure the unit loop and list its slow tests, so that `make test-unit` stays under a minute on 2 cores.

    python -m experiments.slow_unit_tests [--threshold 0.3] [--passes 3]

Runs ``pytest -n 2 -m "not integration"`` (what ``make test-unit`` runs) and records each test's time (setup + call +
teardown, from pytest's own reports).  Every test at or above the threshold is written to ``tests/slow_unit_tests.txt``
(atomically; one node id a line), which tests/conftest.py reads to mark those tests ``integration``: ``make test``
still runs them, ``make test-unit`` leaves them out.  The first pass measures without the list; each later pass
measures with the list applied and adds what became slow (a module-scoped fixture's cost moves to the next test of
its module when the first is listed), until a pass adds nothing.  Times are wall seconds on this machine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIST = ROOT / "tests" / "slow_unit_tests.txt"

PLUGIN = '''
import json, os
_times = {}
def pytest_runtest_logreport(report):
    _times[report.nodeid] = _times.get(report.nodeid, 0.0) + report.duration
def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):
        with open(os.environ["SLOW_UNIT_TESTS_OUT"], "w") as f:
            json.dump(_times, f)
'''


def measure(use_list: bool, workdir: Path) -> dict:
    (workdir / "slow_unit_tests_plugin.py").write_text(PLUGIN)
    out = workdir / "times.json"
    path = os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, SLOW_UNIT_TESTS_OUT=str(out), PYTHONPATH=path)
    if not use_list:
        env["SECO_LAB_TESTS_IGNORE_SLOW_LIST"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-p", "slow_unit_tests_plugin",
           "-m", "not integration"]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc != 0:
        raise SystemExit(f"the unit loop failed (exit {rc}); fix it before measuring")
    return json.loads(out.read_text())


def write_list(ids: set, threshold: float) -> None:
    text = (f"# Unit tests measured at {threshold:g} s or more (setup + call + teardown) by `python -m "
            "experiments.slow_unit_tests`;\n# tests/conftest.py marks them integration, so `make test-unit` leaves "
            "them out and `make test` runs them.\n" + "".join(f"{i}\n" for i in sorted(ids)))
    fd, tmp = tempfile.mkstemp(dir=LIST.parent, prefix=".slow_unit_tests.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, LIST)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threshold", type=float, default=0.3, help="seconds; tests at or above it are listed (0.3)")
    p.add_argument("--passes", type=int, default=3, help="at most this many measuring passes (3)")
    a = p.parse_args(argv)
    if not a.threshold > 0 or a.passes < 1:
        p.error("--threshold must be > 0 and --passes >= 1")
    slow: set = set()
    with tempfile.TemporaryDirectory() as d:
        for n in range(a.passes):
            times = measure(use_list=n > 0, workdir=Path(d))
            new = {i for i, t in times.items() if t >= a.threshold} - slow
            kept = sum(t for i, t in times.items() if i not in slow | new)
            print(f"pass {n + 1}: {len(times)} tests, {len(new)} newly listed; the rest take {kept:.1f} s in all")
            slow |= new
            write_list(slow, a.threshold)
            if not new:
                break
    print(f"{len(slow)} tests listed in {LIST.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
