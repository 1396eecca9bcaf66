"""Argument types and checks shared by the benchmark scripts: a wrong argument is one line and exit 2 before
any measuring starts (``argparse.ArgumentTypeError`` from a type, ``ap.error`` from a check).

* :func:`at_least` -- an integer >= a minimum (counts, lengths, sizes), <= a maximum (:data:`MAX_SIZE`);
* :func:`positive_seconds` -- a finite number of seconds > 0 (timeouts);
* :func:`check_threads`, :func:`check_out_dir`, :func:`check_revision` -- checks of parsed arguments.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
from pathlib import Path

__all__ = ["MAX_SIZE", "at_least", "check_out_dir", "check_revision", "check_threads", "positive_seconds"]


#: the longest sequence (tokens) or largest size a benchmark option takes: beyond, a run would only end in
#: "out of memory" children after minutes (a 20-digit length once ran 40 s and ended in a C++ stack dump)
MAX_SIZE = 1 << 20


def at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum`` when given): a wrong count or a length no
    machine holds is refused before a minute of benchmarking."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:60]!r}"
                                             f"{'...' if len(text) > 60 else ''}") from None
        if value < minimum or (maximum is not None and value > maximum):
            shown = str(value) if len(str(value)) <= 30 else f"{str(value)[:30]}... ({len(str(value))} digits)"
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum:,}]"
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {shown}")
        return value
    parse.__name__ = f"integer >= {minimum}" if maximum is None else f"integer in [{minimum}, {maximum}]"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


positive_seconds.__name__ = "seconds"


def check_threads(ap: argparse.ArgumentParser, threads: int | None) -> None:
    """``--threads``: at most :data:`seco_lab.core.checks.MAX_THREADS` (torch fails to start far above)."""
    from seco_lab.core.checks import MAX_THREADS

    if threads is not None and threads > MAX_THREADS:
        ap.error(f"--threads {threads}: at most {MAX_THREADS} (this machine has {os.cpu_count()} cores)")


def check_out_dir(ap: argparse.ArgumentParser, out: Path | None, flag: str = "--out") -> None:
    """``out`` is a folder, or can be made one: no part of it is an existing file (checked before the run, whose
    results would otherwise be lost when it ends)."""
    if out is None:
        return
    for part in (Path(out), *Path(out).parents):
        if part.is_symlink() and not part.exists():
            ap.error(f"{flag} {out}: {part} is a symbolic link to {os.readlink(part)}, which does not exist; point it "
                     "at a folder, or pass another folder for the results")
        if part.exists():
            if not part.is_dir():
                ap.error(f"{flag} {out}: {part} is a file, not a folder; pass a folder for the results")
            if not os.access(part, os.W_OK | os.X_OK):
                ap.error(f"{flag} {out}: {part} is not writable; pass a folder you can write")
            return


def check_revision(ap: argparse.ArgumentParser, rev: str | None, root: Path, flag: str = "--before") -> None:
    """``rev`` names a commit of the repository at ``root`` (``git rev-parse --verify``)."""
    if rev is None:
        return
    if rev.startswith("-"):
        ap.error(f"{flag} {rev!r} is not a git revision")
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=root,
                           capture_output=True, text=True)
    if found.returncode != 0:
        ap.error(f"{flag} {rev}: no such commit in {root} (a branch, tag or hash of this repository)")
