"""What the benchmark drivers share: one measurement in a fresh Python process, and the resident set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child(module: str, job: dict, timeout: float, preexec=None, code: Path | None = None) -> dict | list:
    """Run ``python -m module --child <job as JSON>`` from the repository root and return the JSON its
    last stdout line holds, or ``{"error": ...}``: a timeout, out of memory (killed, or "memory" in its
    error output), else the last line of its error output.  ``code``: a folder whose ``seco_lab`` the
    child imports instead of this checkout's (another revision, for before/after benchmarks)."""
    path = ([str(code)] if code is not None else []) + [str(ROOT)] + [os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    try:
        p = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(job)], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=ROOT, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    if p.returncode != 0:
        if "memory" in p.stderr.lower() or p.returncode in (-9, 137):
            return {"error": "out of memory"}
        tail = p.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit code {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def rss_bytes() -> int:
    """This process's resident set now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Restart this process's resident-set high-water mark (``ru_maxrss``) from its resident set now
    (Linux ``/proc/self/clear_refs``), so that a later peak measures what runs after this call, not
    the imports before it (pandas imports pyarrow when installed: ~35 MiB of import-time peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the import-time high-water mark stays (a lower bound)
        pass
