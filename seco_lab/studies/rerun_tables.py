"""A rerun's tables against the stored ones: keep the stored files when the rerun reproduces them.

A committed study is recomputed on every fresh clone (its cells are not committed).  Another CPU's
floating-point kernels sum in another order, so a float can come back a few units in the last place
away, and a plain rewrite would change committed files although the result did not change.  A rerun's
table *reproduces* a stored one when both have the same columns and rows, every non-float cell is
equal, and every float cell satisfies

    |new - stored| <= RTOL * max(|new|, |stored|) + ATOL * max|stored column| + floor(row)   (NaN only where NaN)

with RTOL = 1e-9 and ATOL = 1e-12: rounding, not a change of result (a Monte Carlo mean or a p-value
that moved would move by far more).  ``floor`` is a study's own absolute allowance for rows whose value is
rounding itself: a residual sqrt(max(q, 0)) of a quadratic form q that is 0 in exact arithmetic is
sqrt(rounding) ~ 1e-8, and a check's value *is* a rounding error (~1e-16).  Measured: the bias study rerun
with torch's and MKL's AVX2 kernels instead of AVX-512 (``ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2``, one machine) moved best_scale_residual by up to 2.6e-8 (0 -> 2.6e-8) and
the checks by up to 5.2e-15 (168x and 1e9x the tolerance without floors: the WARNING a fresh clone on
another CPU printed); every other value by at most 1.6e-13 of its column's largest.

:func:`write_tables` then keeps every stored file byte for byte; otherwise it writes the rerun's tables
(atomically), keeps each stored one that differed as ``NAME.replaced-N.csv`` (it may hold edits the user sealed with
``seco-lab seal``), and says which differed, by how much, and where they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..store import CHECKSUMS, atomic_write_csv, read_csv, record_checksum

__all__ = ["ATOL", "RTOL", "TableCheck", "keep_aside", "table_difference", "values_close", "write_tables"]

RTOL, ATOL = 1e-9, 1e-12


def table_difference(stored: pd.DataFrame, new: pd.DataFrame, floor: np.ndarray | None = None) -> float | None:
    """The largest float difference of ``new`` from ``stored`` in units of the tolerance above (<= 1:
    reproduced; 0.0: the same values), or None when the tables differ in columns, rows or a non-float cell.
    ``floor``: the rows' absolute allowances (default 0)."""
    if list(stored.columns) != list(new.columns) or len(stored) != len(new):
        return None
    worst = 0.0
    for col in new.columns:
        a, b = stored[col], new[col]
        numeric = pd.api.types.is_numeric_dtype(a) and pd.api.types.is_numeric_dtype(b)
        if numeric and (pd.api.types.is_float_dtype(a) or pd.api.types.is_float_dtype(b)):
            a, b = a.to_numpy(np.float64), b.to_numpy(np.float64)
            if not np.array_equal(np.isnan(a), np.isnan(b)) or not np.array_equal(a[np.isinf(a)], b[np.isinf(b)]):
                return None
            ok = np.isfinite(a)
            extra = np.zeros(int(ok.sum())) if floor is None else np.asarray(floor, dtype=np.float64)[ok]
            a, b = a[ok], b[ok]
            if len(a):
                scale = RTOL * np.maximum(np.abs(a), np.abs(b)) + ATOL * np.abs(a).max() + extra
                diff = np.abs(a - b)
                worst = max(worst, float(np.max(np.where(diff == 0, 0.0, diff / np.where(scale > 0, scale, 1e-300)))))
        elif not _text(a).equals(_text(b)):
            return None
    return worst


def values_close(a, b) -> bool:
    """JSON-like values equal but for float rounding (the same tolerance: RTOL relative plus ATOL absolute)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(values_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, bool) or isinstance(b, bool) or not all(isinstance(v, (int, float)) for v in (a, b)):
            return False
        if np.isnan(a) or np.isnan(b):
            return bool(np.isnan(a) and np.isnan(b))
        return a == b or abs(a - b) <= RTOL * max(abs(a), abs(b)) + ATOL
    return type(a) is type(b) and a == b


def _text(column: pd.Series) -> pd.Series:
    """A non-float column as its CSV text (an empty field reads back as NaN; None and "" write as one)."""
    return column.astype(object).where(column.notna(), "").astype(str).reset_index(drop=True)


@dataclass
class TableCheck:
    """What :func:`write_tables` did: ``kept`` (every stored table reproduced, none rewritten), the largest
    difference found (in tolerance units), and the stored tables that the rerun did not reproduce."""

    kept: bool
    worst: float = 0.0
    differed: dict[str, float | None] = field(default_factory=dict)
    moved: dict[str, Path] = field(default_factory=dict)  # a stored table the rerun did not reproduce: where it went

    def summary(self) -> str:
        if self.kept:
            return (f"the rerun reproduces the stored tables (largest difference {self.worst:.2g} of the "
                    f"tolerance, {RTOL:g} relative): they are kept byte for byte")
        if not self.differed:
            return "tables written"
        what = ", ".join(f"{name} ({'other rows or columns' if d is None else f'{d:.3g} x the tolerance'})"
                         for name, d in self.differed.items())
        aside = ", ".join(str(p.name) for p in self.moved.values())
        return (f"WARNING: the rerun does not reproduce the stored {what}; the rerun's tables are written and the "
                f"stored ones kept as {aside}" if aside else
                f"WARNING: the rerun does not reproduce the stored {what}; the rerun's tables replace them")


def write_tables(folder: str | Path, tables: dict[str, pd.DataFrame], compare: bool = True,
                 floors: dict[str, Callable[[pd.DataFrame], np.ndarray]] | None = None) -> TableCheck:
    """Write ``folder/NAME.csv`` for each table, unless ``compare`` and every one of them is stored already
    and reproduced by the new values (then nothing is written).  ``floors[NAME](stored table)`` gives that
    table's per-row absolute allowances (see the module docstring).  A stored table the new values do not
    reproduce is never written over, whether compared or not (``--fresh``) and whether or not the others are
    stored: it is kept as ``NAME.replaced-N.csv`` (campaigns 40 D5, 41 E5: an edit sealed with ``seco-lab seal``)."""
    folder = Path(folder)
    paths = {name: folder / f"{name}.csv" for name in tables}
    worst, differed = 0.0, {}
    for name, df in tables.items():
        if not paths[name].is_file():
            continue
        try:  # a damaged stored table (huge, not CSV) differs: it is kept aside too
            stored = read_csv(paths[name], "stored table")
        except (OSError, ValueError):
            stored = None
        if stored is None:
            d = None
        else:
            floor = floors[name](stored) if floors and name in floors and len(stored) == len(df) else None
            d = table_difference(stored, df, floor)
        if d is None or d > 1:
            differed[name] = d
        else:
            worst = max(worst, d)
    if compare and not differed and all(p.is_file() for p in paths.values()):
        for p in paths.values():  # reproduced by the rerun: recorded as if written now (checksums)
            if (folder / CHECKSUMS).is_file():
                record_checksum(p)
        return TableCheck(kept=True, worst=worst)
    moved = {name: keep_aside(paths[name]) for name in differed}
    for name, df in tables.items():
        atomic_write_csv(paths[name], df)
    return TableCheck(kept=False, worst=worst, differed=differed, moved=moved)


def keep_aside(path: Path) -> Path:
    """Rename a stored table the rerun did not reproduce to ``NAME.replaced-N.csv`` (the first free N) rather than
    write over it: it may hold edits the user sealed (campaign 40 D5), and a table is cheap to keep."""
    for n in range(1, 10_000):
        aside = path.with_name(f"{path.stem}.replaced-{n}{path.suffix}")
        if not aside.exists() and not aside.is_symlink():
            os.rename(path, aside)
            if (path.parent / CHECKSUMS).is_file():  # still a file of the results folder, as it was
                record_checksum(aside)
            return aside
    raise FileExistsError(f"{path.parent} holds 9999 tables named {path.stem}.replaced-N{path.suffix}: move them "
                          "away and rerun")
