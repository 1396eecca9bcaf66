"""Shared Markdown helpers: number formatting, tables, atomic writing, provenance lines."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import pandas as pd

from ..store import (
    RECORD_MAX_BYTES,
    TABLE_MAX_BYTES,
    atomic_write,
    check_table_content,
    checked_file,
    extra_fields,
    lacking_files,
    pandas_source,
    quoted_names,
    read_csv,
    read_json,
    report_problem,
    with_report_digest,
)

__all__ = ["COUNT", "NON_NEGATIVE", "POSITIVE", "MissingResultsError", "check_bounds", "check_derived", "fmt",
           "generated_note", "left_out", "read_json_table", "read_results_csv", "read_stored_csv", "require",
           "stored_file", "stored_read_errors", "table", "verified_beside", "write_markdown"]


class MissingResultsError(FileNotFoundError):
    """A report's stored results are missing or incomplete."""


def require(folder: Path, names: tuple[str, ...], produce: str) -> None:
    """Refuse with a message naming the command (``produce``) that writes the missing files."""
    lacking = lacking_files(folder, names, produce)
    if lacking:
        raise MissingResultsError(lacking)


def stored_file(path: Path, what: str, max_bytes: int, produce: str) -> Path:
    """``path`` when it is a regular file of at most ``max_bytes`` (:func:`seco_lab.store.checked_file`); a FIFO,
    device, folder or huge file among the stored results is refused (a :class:`MissingResultsError` naming it and
    ``produce``), never opened: a read would block forever, never end or exhaust memory."""
    try:
        return checked_file(path, what, max_bytes, f"remove it and rerun {produce}")
    except ValueError as e:
        raise MissingResultsError(str(e)) from None


@contextlib.contextmanager
def stored_read_errors(path: Path, produce: str):
    """Translate a failed read of the stored file ``path`` into a :class:`MissingResultsError` naming it and
    ``produce``: a missing file, a refusal of :mod:`seco_lab.store` (a ValueError, said as is) or an OS error."""
    try:
        yield
    except FileNotFoundError:
        raise MissingResultsError(f"{path} is missing: run {produce} first, or pass the folder that holds it with "
                                  "--results") from None
    except (OSError, ValueError) as e:
        raise MissingResultsError(str(e) if isinstance(e, ValueError) else
                                  f"{path} cannot be read ({e.strerror or e}): rerun {produce}") from None


def _first_missing(path: Path, produce: str) -> Path | None:
    """Walk ``path`` from its first component: each one above the last must be a folder (or a link to one).  Returns
    the first component that does not exist (nothing there, not even a link), or None when all do.  A link to
    nothing, or a file where a folder belongs, is a :class:`MissingResultsError` naming it: taken for absent, it
    would leave the report's part out without a word (campaign 20)."""
    parts = path.parts
    for i in range(1, len(parts) + 1):
        here = Path(*parts[:i])
        if here.is_symlink() and not here.exists():
            raise MissingResultsError(f"this report also draws from {path}, but {here} is a link to nothing (to "
                                      f"{os.readlink(here)}): put the results themselves there, or rerun {produce}")
        if not here.exists():
            return here
        if i < len(parts) and not here.is_dir():
            raise MissingResultsError(f"this report also draws from {path}, but {here} is not a folder: move it "
                                      f"away, or rerun {produce}")
    return None


@contextlib.contextmanager
def verified_beside(folder: Path, produce: str, file: str | None = None):
    """Around reading another study's results ``folder`` (or its one ``file``) that a report also draws from (the
    real-LM section of the bias report, the audit's reference curves), the way the report's own results are read:
    verified against their checksum files, read as verified (:func:`seco_lab.store.pinned`) and compared again
    afterwards.  Yields True when the part is there, False when it is absent: the caller then leaves its part out
    and says so in the report (:func:`left_out`).

    Absent means only: ``folder`` does not exist at all (every existing folder above it a folder, no link to
    nothing on the way), or ``file`` does not exist in a ``folder`` that passes
    :func:`seco_lab.store.verify_checksums` whole -- so a file deleted together with the checksum file that
    recorded it is refused while the folder's other results stay, and so is one recorded but missing.  Anything
    else -- a link to nothing, a file where a folder belongs, ``file`` not a regular file, a file not as written,
    or changed meanwhile -- is a :class:`MissingResultsError` naming it."""
    from ..store import pinned, verify_checksums

    folder = Path(folder)
    path = folder / file if file else folder
    missing = _first_missing(path, produce)
    if missing is not None and (not file or missing != path):  # the folder is absent: nothing of the study there
        yield False
        return
    if missing is None and not (path.is_file() if file else path.is_dir()):
        kind = "regular file (a folder, FIFO or device)" if file else "folder"
        raise MissingResultsError(f"this report also draws from {path}, which is not a {kind}: move it away, or "
                                  f"rerun {produce}")
    try:  # one file: its folder's own files (a study's cells below are not read); a folder: everything in it
        verified = verify_checksums(folder, produce, subfolders=not file, pin=missing is None)
    except ValueError as e:
        raise MissingResultsError(f"this report also draws from {path}, which is not as its study wrote it: {e}") \
            from None
    with pinned(verified):
        yield missing is None
    changed = verified.changed()
    if changed:
        raise MissingResultsError(f"this report also draws from {changed[0]}, which changed while the report read it "
                                  "(something writes there); rerun the report once the writer is done")


def left_out(what: str, path: Path, why: str, produce: str) -> str:
    """The report's line for a part it leaves out: what, which path, why, and what would write it."""
    return f"*Left out: {what} -- `{path}` {why}; {produce} writes it.*\n"


def read_json_table(path: Path, produce: str, expect: type | tuple[type, ...] | None = dict):
    """A stored JSON file of a report (``study.json``, ``bench.json``), read by :func:`seco_lab.store.read_json`:
    a FIFO, device, folder or huge file, parse errors, an empty file or a value other than ``expect`` (a JSON
    object by default) are refused with a :class:`MissingResultsError` naming the file and ``produce``."""
    path = Path(path)
    with stored_read_errors(path, produce):
        return read_json(path, "stored record", RECORD_MAX_BYTES, f"remove it and rerun {produce}", expect)


def read_stored_csv(path: Path, produce: str, **kwargs) -> pd.DataFrame:
    """A stored table of a report read whole, unchecked beyond parsing (:func:`read_results_csv` checks columns
    and values): a FIFO, device, folder or huge file (a compressed one: decompressed), NUL bytes, or a file that
    does not parse, is a :class:`MissingResultsError` naming it and ``produce``."""
    path = Path(path)
    with stored_read_errors(path, produce):
        return read_csv(path, "stored results table", TABLE_MAX_BYTES, f"rerun {produce}", **kwargs)


#: :func:`read_results_csv` range rules: a count (layers, chunk size, length), a time/size/memory, a ratio
COUNT, NON_NEGATIVE, POSITIVE = (">=", 1), (">=", 0), (">", 0)


def read_results_csv(path: Path, columns: tuple[str, ...], produce: str, text_columns=("scheme", "metric", "check"),
                     nan_allowed=None, key: tuple[str, ...] | None = None, more_columns: bool = False,
                     inf_allowed=None, ranges: dict[str, tuple[str, float]] | None = None,
                     keyed=None) -> pd.DataFrame:
    """A stored results table, checked before any number of it is reported: it parses, has exactly
    ``columns`` (with ``more_columns``: at least these, the others unchecked), at least one row, numbers in
    every other than ``text_columns``, and no infinity (but where ``inf_allowed(df)`` allows it); NaN only
    where ``nan_allowed(df)`` (a boolean row mask) allows it; no two rows with the same ``key`` columns (a
    repeated or conflicting result); with ``ranges`` (column -> ``(">=", 1)``, ``(">", 0)``, ...: use
    :data:`COUNT`, :data:`NON_NEGATIVE`, :data:`POSITIVE`) every number of the column in its range (a negative
    layer count or time is damage, not a result).  ``keyed(df)`` (a boolean row mask) limits the ``key`` check to
    the rows it selects (e.g. not the error rows, which carry no value); the ``key`` columns must all be there.
    Each refusal names the file, the column, the row and the fix."""
    path = Path(path)
    stored_file(path, "stored results table", TABLE_MAX_BYTES, produce)  # pandas would block on a FIFO
    try:  # NUL bytes; a compressed table: its decompressed size too (read in bounded blocks, nothing kept)
        check_table_content(path, "stored results table", TABLE_MAX_BYTES, f"rerun {produce}")
    except ValueError as e:
        raise MissingResultsError(str(e)) from None
    try:
        df = pd.read_csv(**pandas_source(path))  # inside store.pinned: the bytes verified
    except pd.errors.EmptyDataError:
        raise MissingResultsError(f"{path} is empty (no header, no rows): rerun {produce}") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError, EOFError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise MissingResultsError(f"{path} cannot be parsed as CSV ({first}): rerun {produce}") from None
    if problem := extra_fields(df):
        raise MissingResultsError(f"{path}: {problem}: the file is damaged; rerun {produce}")
    if (not set(columns) <= set(df.columns)) if more_columns else tuple(df.columns) != tuple(columns):
        raise MissingResultsError(f"{path} has columns {quoted_names(df.columns)}, not {list(columns)}: it was "
                                  f"written by another version or is damaged; rerun {produce} (with --fresh)")
    if df.empty:
        raise MissingResultsError(f"{path} has a header but no rows: the results are missing; rerun {produce}")
    for c in columns:
        if c in text_columns:
            continue
        values = pd.to_numeric(df[c], errors="coerce")
        garbage = values.isna() & df[c].notna()
        if garbage.any():
            raise MissingResultsError(f"{path}: column {c!r} holds non-numbers (row {int(garbage.idxmax()) + 2}: "
                                      f"{str(df[c][garbage].iloc[0])[:60]!r}): the file is damaged; rerun {produce}")
        df[c] = values
        inf = np.isinf(values) & ~(inf_allowed(df) if inf_allowed is not None else False)
        if inf.any():
            raise MissingResultsError(f"{path}: column {c!r} holds infinity (row {int(inf.idxmax()) + 2}):"
                                      f" not a result; rerun {produce}")
        missing = values.isna() & ~(nan_allowed(df) if nan_allowed is not None else False)
        if missing.any():
            raise MissingResultsError(f"{path}: column {c!r} is empty or NaN in {int(missing.sum())} row(s) (first: "
                                      f"row {int(missing.idxmax()) + 2}): the results are incomplete; rerun {produce}")
    for c, (op, bound) in (ranges or {}).items():
        values = pd.to_numeric(df[c], errors="coerce")
        bad = values.notna() & ~(values >= bound if op == ">=" else values > bound)
        if bad.any():
            row = int(bad.idxmax())
            raise MissingResultsError(f"{path}: column {c!r} holds {values[row]:g} (row {row + 2}), but it must be "
                                      f"{op} {bound:g}: the file is damaged or was edited; rerun {produce}")
    if key is not None:
        if lacking := [c for c in key if c not in df.columns]:
            raise MissingResultsError(f"{path} lacks the column(s) {lacking} that tell its rows apart: it was written "
                                      f"by another version or is damaged; rerun {produce}")
        repeated = df.duplicated(list(key), keep="first")
        if keyed is not None:
            rows = np.asarray(keyed(df), dtype=bool)
            repeated = df[rows].duplicated(list(key), keep="first").reindex(df.index, fill_value=False)
        if repeated.any():
            row = int(repeated.idxmax())
            first = ", ".join(f"{c}={str(df[c].iloc[row])[:60]}" for c in key)
            raise MissingResultsError(f"{path} holds {int(repeated.sum())} row(s) whose ({', '.join(key)}) repeats an "
                                      f"earlier row (first: row {row + 2}, {first}): repeated or conflicting results "
                                      f"(two studies joined?); rerun {produce}")
    return df


def check_bounds(path: Path, df: pd.DataFrame, bounds: dict[str, tuple[float, float]], produce: str) -> None:
    """Refuse values no computation gives (a negative norm ratio, a 1 - cos above 2, ...): ``bounds`` maps a
    column to its closed range; a table edited by hand or damaged is not reported as if it were a result."""
    for col, (lo, hi) in bounds.items():
        bad = df[(df[col] < lo) | (df[col] > hi)]
        if len(bad):
            raise MissingResultsError(f"{path} holds {len(bad)} impossible value(s) of {col} (e.g. "
                                      f"{bad[col].iloc[0]:g} on line {bad.index[0] + 2}; it lies in [{lo:g}, {hi:g}]): "
                                      f"the table was edited or damaged; rerun {produce}")


def check_one_setting(path: Path, df: pd.DataFrame, columns: tuple[str, ...], produce: str) -> None:
    """Refuse a table whose rows disagree on a setting the report prints once (a model, a length, a chunk size):
    each of ``columns`` must hold one value in every row; rows of another configuration joined in would
    otherwise be reported under the first row's setting."""
    for col in columns:
        values = df[col].astype(str)
        other = values.ne(values.iloc[0])
        if other.any():
            row = int(other.idxmax())
            raise MissingResultsError(f"{path}: row {row + 2} holds {col} = {values[row][:60]}, row 2 "
                                      f"{values.iloc[0][:60]}: the report states one {col} for every row (results "
                                      f"of two configurations joined?); rerun {produce}")


def _half_unit(text) -> float:
    """Half a unit of the last digit of a number as stored (``"3.09"`` -> 0.005, ``"2.5e-03"`` -> 5e-5): what
    rounding to the stored digits can account for."""
    text = str(text).strip().lower()
    mantissa, _, exponent = text.partition("e")
    decimals = len(mantissa.partition(".")[2])
    try:
        return 0.5 * 10.0 ** (int(exponent or 0) - decimals)
    except ValueError:
        return 0.0


def check_derived(path: Path, df: pd.DataFrame, column: str, expected: pd.Series, formula: str, produce: str,
                  rows=None) -> None:
    """Refuse a stored value that disagrees with what it derives from: ``column`` (as stored, in the rows selected
    by the boolean mask ``rows``, default all) must equal ``expected`` (computed from the other columns by
    ``formula``, e.g. ``"strata_cpu_s / seco_cpu_s"``) up to the rounding of its stored digits (half a unit of its
    last digit) and float noise (1e-9 relative).  A hand-edited or damaged derived value is named (file, row, both
    values), never printed as a result."""
    path = Path(path)
    text = pd.read_csv(**pandas_source(path), dtype=str, keep_default_na=False)[column]  # the stored digits
    stored = pd.to_numeric(df[column], errors="coerce")
    expected = pd.Series(expected, index=df.index, dtype=float)
    tol = text.map(_half_unit).reindex(df.index).fillna(0.0) + 1e-9 * expected.abs()
    bad = ~((stored - expected).abs() <= tol)
    if rows is not None:
        bad &= np.asarray(rows, dtype=bool)
    if bad.any():
        row = bad.idxmax()
        raise MissingResultsError(f"{path}: row {int(row) + 2} holds {column} = {text[row]}, but {formula} = "
                                  f"{expected[row]:.6g} from its other columns: the file was edited or is damaged; "
                                  f"rerun {produce}")


def fmt(x, digits: int = 3) -> str:
    """A number for a table: fixed point in [10^-digits, 10^4), scientific outside, '–' for missing."""
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "–"
    if x == 0:
        return "0"
    if abs(x) < 10 ** -digits or abs(x) >= 1e4:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}f}"


def table(df: pd.DataFrame, integer_columns: tuple[str, ...] = ()) -> str:
    """A Markdown table; ``integer_columns`` print as integers, strings as they are, numbers through ``fmt``."""
    df = df.copy()
    for c in integer_columns:
        if c in df.columns:
            df[c] = df[c].map(lambda v: str(int(v)) if pd.notna(v) else "–")
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(v if isinstance(v, str) else fmt(v) for v in r.values) + " |")
    return "\n".join(lines)


def generated_note(report: str, results: Path, out_md: Path, produce: str) -> str:
    """The italic line that says how a report was generated and how to rerun what it reports (``produce``)."""
    src = os.path.relpath(Path(results).resolve(), Path(out_md).parent.resolve())
    return (f"_Generated by `seco-lab report {report}` (in the repository: `make report`) from the stored results "
            f"in `{src}/`; rerun them with {produce}. Do not edit by hand._\n")


def write_markdown(lines: list[str], out_md: Path) -> Path:
    """Write the report ``lines`` to ``out_md`` with its digest as the last line; an existing file is written over
    only where it is a report exactly as seco-lab wrote it (ValueError otherwise: campaign 39 C7)."""
    out_md = Path(out_md)
    problem = report_problem(out_md) if out_md.exists() or out_md.is_symlink() else None
    if problem:
        raise ValueError(f"{out_md} {problem}")
    out_md.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out_md, with_report_digest("\n".join(lines)))
