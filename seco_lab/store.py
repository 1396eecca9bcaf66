"""The study store: atomic result files, the software record and the definition fingerprint
(nothing heavy is imported before it is needed: the trainer loads this module too).

Every stored result of the package (a study's cells and tables, a training run's config,
checkpoints and metrics, a report) is written through :func:`atomic_write`: the bytes go to
``NAME.seco-tmp<pid>`` beside the target, are flushed to disk (``fsync``), and the temporary file
is renamed over the target (``os.replace``, atomic on POSIX), so a reader never sees half a file
and a kill leaves at most a stale ``NAME.seco-tmp<pid>`` (:func:`clear_stale` removes an empty one and keeps,
with a warning, one that holds something, which may be a user's: campaign 38 B9; the
tag is the package's own: a user's ``results.json.tmp2`` or ``metrics.jsonl.tmp`` is never taken for one).  The
argument order is always (path, content), like ``open(path)``.

A study's definition is a JSON-able dict; its fingerprint is

    fingerprint(d) = sha256(json.dumps(d, sort_keys=True))[:16]  (hex)

and equal fingerprints mean a folder's stored cells may be resumed (:class:`StudyFolder`).

Every stored file is read through a checked reader: :func:`checked_file` refuses a FIFO (a read would wait for a
writer forever), a device (``/dev/zero`` never ends), a folder or a file over a size limit before it is opened;
:func:`read_json` reads a stored JSON record through it (a bounded, non-blocking read), turning a file that is not
UTF-8, not JSON, nested past Python's recursion limit or of the wrong JSON type into one ValueError naming the file;
:func:`read_csv` does the same for a stored table (``pd.read_csv``), and :func:`file_sha256` hashes only a checked
file.  A missing file raises FileNotFoundError, so each caller keeps its own message for that.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import stat
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .folder_lock import hold_lock, lock_holder, release_lock

_HELD_LOCKS: dict[Path, IO] = {}  # study folders this process has locked (a rerun in the process reuses its lock)

__all__ = ["GENERATED_MARK", "REPORT_DIGEST", "is_generated_report", "report_problem", "with_report_digest",
           "COMPRESSED", "CONFIG_MAX_BYTES", "RECORD_MAX_BYTES", "TABLE_MAX_BYTES", "DefinitionMismatch", "StudyFolder",
           "StudyFolderError", "atomic_write", "atomic_write_csv", "atomic_write_json", "check_study_out",
           "check_table_content", "escaped_text", "checked_file", "clear_stale", "holds_nul", "open_decompressed",
           "quoted_names",
           "FIGURE_MARK_KEY", "FIGURE_MARK_VALUE", "PNG_SIGNATURE", "check_image_target", "check_parent_folder",
           "is_generated_png", "extra_fields", "file_sha256", "fingerprint", "lacking_files", "protected_paths",
           "read_csv", "read_json", "read_checked_bytes", "software_versions", "study_owner", "too_deep", "TEMP_TAG",
           "VerifiedFiles", "file_identity", "pinned", "pinned_bytes", "pinned_stream", "stored_stream",
           "pandas_source", "load_tensor",
           "DuplicateKeyError", "loads_json", "CHECKSUMS", "ChecksumError", "start_checksums", "record_checksum",
           "check_tables_unedited",
           "verify_checksums", "seal", "as_written", "forget_checksums"]

#: the tag of atomic_write's temporary files, ``NAME.seco-tmp<pid>``
TEMP_TAG = "seco-tmp"

#: the largest file read as a settings file (``--config``, a run's or an audit's ``config.json``): a few KiB in
#: practice, so a file above this is surely something else (a data file or checkpoint named by mistake)
CONFIG_MAX_BYTES = 1 << 20
#: the largest stored JSON record read whole (a study's ``study.json``, an audit unit)
RECORD_MAX_BYTES = 64 << 20
#: the largest stored table read whole (a results CSV, a run's ``metrics.jsonl``): far above any this tool writes
TABLE_MAX_BYTES = 1 << 30

_NOT_REGULAR = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO, a named pipe: reading it would wait for a "
                                                            "writer, maybe forever"),
                (stat.S_ISCHR, "a character device: reading it may never end"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice: json keeps the last silently, so which value a reader gets depends
    on the order of an edit; no file seco-lab writes has one."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def loads_json(text: str | bytes):
    """``json.loads`` that refuses an object naming a key twice (:class:`DuplicateKeyError`) instead of keeping the
    last value: every JSON file or line this tool reads (settings, records, metrics, markers) goes through it."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def too_deep(e: BaseException) -> BaseException | str:
    """What to say of a parse error: a RecursionError (JSON or TOML nested past Python's recursion limit) as
    what it means for the file, anything else as itself."""
    if isinstance(e, RecursionError):
        return "its lists or tables nest too deeply to read; it is not a file seco-lab wrote"
    return e


def checked_file(path: str | Path, what: str, max_bytes: int | None = None, fix: str = "") -> Path:
    """``path`` when it is a regular file (a symlink to one is followed) of at most ``max_bytes`` bytes; else a
    ValueError that names the file, says what it is and (``fix``) what to do.  Checked before the file is opened:
    a FIFO would block its reader forever, ``/dev/zero`` never ends, and a huge file read whole exhausts memory.
    A missing file raises the :class:`FileNotFoundError` of ``stat`` (callers keep their own message for it)."""
    path = Path(path)
    st = path.stat()  # follows a symlink: a link to /dev/zero is the device
    mode, size = st.st_mode, st.st_size
    fix = f"; {fix}" if fix else ""
    for test, kind in _NOT_REGULAR:
        if test(mode):
            raise ValueError(f"{what} {path} is not a regular file ({kind}){fix}")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} {path} is not a regular file{fix}")
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{what} {path} is {size:,} bytes, {size - max_bytes:,} over the limit of {max_bytes:,} "
                         f"bytes for a {what}: it is not one (named by mistake, or damaged){fix}")
    return path


# -- pinned results: what a report reads is what it verified ---------------------------------------------------------
#
# verify_checksums(..., pin=True) keeps each verified file's bytes (a file above PIN_BYTES_MAX: a descriptor of the
# file it hashed, so memory stays bounded); inside ``with pinned(verified):`` every reader of stored results here
# (read_checked_bytes, read_json, read_csv, stored_stream, pandas_source, load_tensor) reads those for a verified
# path, whatever the path holds by then -- a file, a folder or a symlink above it swapped for an edited copy while
# the report reads cannot reach it (a write into the very file it holds moves its identity on: VerifiedFiles.changed).

#: the largest file whose bytes are kept in memory when pinned; a larger one (an audit's flat vectors) is held open
PIN_BYTES_MAX = 16 << 20

_PINNED: dict[str, bytes | int] = {}


def _pin_key(path) -> str:
    return os.path.abspath(os.fspath(path))


def pinned_bytes(path) -> bytes | None:
    """The verified bytes of ``path`` inside :func:`pinned`, else None."""
    held = _PINNED.get(_pin_key(path)) if _PINNED else None
    if isinstance(held, int):  # a descriptor of the file verified
        with os.fdopen(os.dup(held), "rb") as f:
            f.seek(0)
            return f.read()
    return held


def pinned_stream(path) -> IO[bytes] | None:
    """A binary stream over the verified bytes of ``path`` inside :func:`pinned`, or None."""
    import io

    held = _PINNED.get(_pin_key(path)) if _PINNED else None
    if isinstance(held, int):
        f = os.fdopen(os.dup(held), "rb")
        f.seek(0)
        return f
    return None if held is None else io.BytesIO(held)


def stored_stream(path) -> IO[bytes]:
    """A binary stream of a stored file: its verified bytes inside :func:`pinned`, else the file opened."""
    return pinned_stream(path) or open(path, "rb")


#: the compression pandas infers from a table's name, which a stream does not carry
_PANDAS_COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zip": "zip", ".zst": "zstd", ".tar": "tar"}


def pandas_source(path) -> dict:
    """``pd.read_csv(**pandas_source(path), ...)``: the verified bytes inside :func:`pinned`, else the path."""
    stream = pinned_stream(path)
    if stream is None:
        return {"filepath_or_buffer": path}
    return {"filepath_or_buffer": stream, "compression": _PANDAS_COMPRESSION.get(Path(path).suffix)}


def load_tensor(path):
    """``torch.load`` of a stored tensor file (weights only): its verified bytes inside :func:`pinned`."""
    import torch

    return torch.load(pinned_stream(path) or path, weights_only=True)


@contextmanager
def pinned(verified):
    """Within, the readers above return the bytes ``verified`` (:func:`verify_checksums` with ``pin=True``) holds
    for each verified file."""
    held = {_pin_key(p): data for p, data in verified.data.items()}
    _PINNED.update(held)
    try:
        yield
    finally:
        for key in held:
            _PINNED.pop(key, None)
        verified.release()


def read_checked_bytes(path: str | Path, what: str, max_bytes: int | None = RECORD_MAX_BYTES, fix: str = "") -> bytes:
    """The bytes of ``path``, checked by :func:`checked_file` and then read without blocking and without bound
    trouble: the file is opened ``O_NONBLOCK`` and checked again on the open descriptor (a FIFO or device swapped
    in after the check is refused, not waited on), and at most ``max_bytes`` bytes are read (a file that grew past
    the limit is refused).  A missing file raises :class:`FileNotFoundError`.  Inside :func:`pinned`, a verified
    file's bytes are the ones verified, whatever the path holds now."""
    held = pinned_bytes(path)
    if held is not None:
        return held
    path = checked_file(path, what, max_bytes, fix)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{what} {path} is not a regular file (it was replaced while being read){_fix(fix)}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"{what} {path} grew past the limit of {max_bytes:,} bytes while being read: it is not "
                         f"one{_fix(fix)}")
    return data


def _fix(fix: str) -> str:
    return f"; {fix}" if fix else ""


def _type_names(expect) -> str:
    names = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "true or false", type(None): "null"}
    kinds = expect if isinstance(expect, tuple) else (expect,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def read_json(path: str | Path, what: str, max_bytes: int | None = RECORD_MAX_BYTES, fix: str = "",
              expect: type | tuple[type, ...] | None = dict):
    """The JSON value a stored file holds, read by :func:`read_checked_bytes` (a FIFO, device, folder or file over
    ``max_bytes`` is refused before it is opened).  A file that is not UTF-8, not JSON or nested past Python's
    recursion limit, or whose value is not of the type ``expect`` (a JSON object by default; None: any), is one
    ValueError that names the file (``what PATH ...``) and says ``fix``.  A missing file raises
    :class:`FileNotFoundError` (callers keep their own message for it); other OS errors pass as they are."""
    path = Path(path)
    data = read_checked_bytes(path, what, max_bytes, fix)
    try:
        value = loads_json(data.decode("utf-8-sig"))  # a byte-order mark an editor saved in front is not JSON's
    except (UnicodeDecodeError, json.JSONDecodeError, DuplicateKeyError, RecursionError) as e:
        why = too_deep(e) if isinstance(e, RecursionError) else f"{type(e).__name__}: {str(e)[:80]}"
        raise ValueError(f"{what} {path} cannot be read as JSON ({why}): it is damaged or not a file seco-lab "
                         f"wrote{_fix(fix)}") from None
    kinds = expect if isinstance(expect, tuple) else (expect,)
    if expect is not None and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{what} {path} holds {_type_names(type(value))} where {_type_names(expect)} is expected: it "
                         f"is damaged or not a file seco-lab wrote{_fix(fix)}")
    return value


#: suffixes pandas reads as compressed tables (binary, NULs and all)
COMPRESSED = (".gz", ".bz2", ".zip", ".xz", ".zst", ".tar")


def holds_nul(path: str | Path, block: int = 1 << 20) -> bool:
    """Whether the (regular, checked) file holds a NUL byte, read block by block: no text table has one, and pandas
    given a long run of them reads it as one huge cell."""
    with stored_stream(path) as f:
        while chunk := f.read(block):
            if b"\0" in chunk:
                return True
    return False


def open_decompressed(path: Path, what: str, fix: str = "") -> IO[bytes]:
    """The decompressed stream of a table whose name ends in one of :data:`COMPRESSED` (as pandas would read it);
    a compression this tool cannot read in bounded blocks (``.zst``, ``.tar``) or a ``.zip`` of other than one
    member is a ValueError naming the file."""
    import bz2
    import gzip
    import lzma
    import zipfile

    name = path.name
    source = pinned_stream(path) or path  # inside pinned(): the bytes verified
    if name.endswith(".gz"):
        return gzip.open(source, "rb")
    if name.endswith(".bz2"):
        return bz2.open(source, "rb")
    if name.endswith(".xz"):
        return lzma.open(source, "rb")
    if name.endswith(".zip"):
        try:
            archive = zipfile.ZipFile(source)
        except zipfile.BadZipFile as e:
            raise ValueError(f"{what} {path} cannot be decompressed ({e}): it is damaged{_fix(fix)}") from None
        members = archive.namelist()
        if len(members) != 1:
            archive.close()
            raise ValueError(f"{what} {path} is a zip archive of {len(members)} files, not one table{_fix(fix)}")
        return archive.open(members[0])
    raise ValueError(f"{what} {path} is compressed as {path.suffix}: seco-lab reads tables as .csv, .csv.gz, "
                     f".csv.bz2, .csv.xz or .csv.zip; decompress it{_fix(fix)}")


def check_table_content(path: str | Path, what: str, max_bytes: int | None = TABLE_MAX_BYTES, fix: str = "",
                        block: int = 1 << 20) -> None:
    """Refuse (ValueError naming the file and ``fix``) a table holding NUL bytes -- no text table has one, and
    pandas given a long run of them reads it as one huge cell -- and a compressed table (:data:`COMPRESSED`) whose
    decompressed content passes ``max_bytes`` (a "gzip bomb" of a few MB unpacks to GBs).  A compressed table is
    decompressed block by block, at most ``max_bytes + 1`` bytes, and nothing is kept."""
    import lzma
    import zipfile
    import zlib

    path = Path(path)
    nul = (f"{what} {path} holds NUL bytes: it is binary, or was cut and padded with zeros (a table this tool "
           f"writes is text); it is damaged{_fix(fix)}")
    if not path.name.endswith(COMPRESSED):
        if holds_nul(path, block):
            raise ValueError(nul)
        return
    total = 0
    try:
        with open_decompressed(path, what, fix) as f:
            while chunk := f.read(block):
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    raise ValueError(f"{what} {path} decompresses to more than {max_bytes:,} bytes, the limit for a "
                                     f"{what}: it is not one (named by mistake, or damaged){_fix(fix)}")
                if b"\0" in chunk:
                    raise ValueError(nul.replace(" holds NUL bytes", " holds NUL bytes once decompressed"))
    except (OSError, EOFError, zlib.error, lzma.LZMAError, zipfile.BadZipFile) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{what} {path} cannot be decompressed ({str(e)[:120] or type(e).__name__}): it is "
                         f"damaged{_fix(fix)}") from None


def quoted_names(names, width: int = 60, most: int = 12) -> str:
    """A list of column names (or values) for a message: each cut to ``width`` characters, at most ``most`` of
    them (a damaged table's "column" may be megabytes of one byte)."""
    names = list(names)
    cut = [repr(n) if len(str(n)) <= width else f"{str(n)[:width]!r}... ({len(str(n)):,} characters)"
           for n in names[:most]]
    more = f", ... ({len(names):,} columns)" if len(names) > most else ""
    return f"[{', '.join(cut)}{more}]"


def read_csv(path: str | Path, what: str, max_bytes: int | None = TABLE_MAX_BYTES, fix: str = "", **kwargs):
    """``pd.read_csv(path, **kwargs)`` of a stored table checked by :func:`checked_file` first (pandas would block
    on a FIFO and read a device without end); a table that does not parse (an empty file included) is a
    ValueError naming the file and saying ``fix``.  A missing file raises :class:`FileNotFoundError`."""
    import pandas as pd

    path = checked_file(path, what, max_bytes, fix) if pinned_bytes(path) is None else Path(path)
    check_table_content(path, what, max_bytes, fix)
    try:
        df = pd.read_csv(**pandas_source(path), **kwargs)
    except (ValueError, EOFError, RecursionError) as e:  # ParserError, EmptyDataError, UnicodeDecodeError
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise ValueError(f"{what} {path} cannot be read as CSV ({first}): it is damaged{_fix(fix)}") from None
    if "index_col" not in kwargs and (problem := extra_fields(df)):
        raise ValueError(f"{what} {path}: {problem}: it is damaged{_fix(fix)}")
    return df


def extra_fields(df) -> str | None:
    """What is wrong when rows of a table read by ``pd.read_csv`` hold more fields than its header: pandas then
    takes the first fields for an index (a row number would be a tuple or a text); None when they do not."""
    import pandas as pd

    if isinstance(df.index, pd.RangeIndex):
        return None
    return f"rows hold more fields than the header's {len(df.columns)} (the extra first fields became an index)"


def escaped_text(text: str) -> str:
    """``text`` as UTF-8 can hold it: a name that is not UTF-8 (its bytes decoded by Python as surrogates, e.g. a
    Latin-1 folder ``r\xe9s``) spelled with the bytes' escapes, ``r\\xe9s`` -- not refused halfway through writing a
    report or drawing a legend (campaign 26)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    escapable = all("\udc80" <= c <= "\udcff" for c in text if "\ud800" <= c <= "\udfff")
    raw = text.encode("utf-8", "surrogateescape" if escapable else "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


def _replace(tmp: Path, path: Path) -> None:
    """``os.replace(tmp, path)``; a refusal names ``path``, the file the user knows, not the temporary one (campaign 34
    X7: an immutable metrics.jsonl was reported as "metrics.jsonl.seco-tmp24697: Operation not permitted")."""
    try:
        os.replace(tmp, path)
    except OSError as e:
        raise type(e)(e.errno, f"{e.strerror or e} (it cannot be replaced: read-only, immutable or in a folder "
                      "that is; make it writable)", str(path)) from None


def atomic_write(path: str | Path, content: str | bytes | Callable[[IO[bytes]], object]) -> Path:
    """Write ``content`` (text, bytes, or a function that writes to a binary file object) to ``path``
    through a temporary file, ``fsync`` and a rename: readers never see half a file."""
    if isinstance(content, (Path, os.PathLike)) or hasattr(path, "to_csv"):
        raise TypeError("atomic_write(path, content): the path comes first")
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{TEMP_TAG}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(escaped_text(content).encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        if path.name != CHECKSUMS and (path.parent / CHECKSUMS).is_file():
            with _folder_flock(path.parent):  # renamed and recorded at once: a verifier never sees one unrecorded
                _replace(tmp, path)
                _record_checksum_locked(path)
        else:
            _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# -- checksums: what a study wrote, so that a report reads nothing else ---------------------------------------------
#
# A results folder holds ``checksums.sha256`` (sha256sum's format: ``HEX  NAME`` per line, ``sha256sum -c`` checks
# it) once a writer started it (:func:`start_checksums`); from then on every :func:`atomic_write` into the folder
# records the file's SHA-256 there.  A report verifies every results file it could read against it
# (:func:`verify_checksums`): a value edited by hand, a file damaged, or copied in from another study is refused
# before anything is computed from it -- whatever the per-file consistency checks would or would not notice.

#: the checksum file of a results folder
CHECKSUMS = "checksums.sha256"
#: the files a report may read, which must be recorded: tables, records, tensors (a user's notes are not)
RESULT_FILE = r"[^/]+\.(csv|csv\.gz|json|pt)"
#: set to 1 to read results without their checksums (the test suite's tests of the per-file checks, which edit
#: stored files on purpose); never needed otherwise: ``seco-lab seal FOLDER`` vouches for edited files instead.
#: Files are still recorded; only the verifications are skipped, among them a rerun's check that its tables are
#: unedited (:func:`check_tables_unedited`): the rerun then replaces a stored table it does not reproduce, and says so
NO_CHECKSUMS_ENV = "SECO_LAB_NO_CHECKSUMS"


class ChecksumError(ValueError):
    """A results file that is not what the tool wrote (or a results folder without its checksums)."""


def _read_checksums(folder: Path) -> dict[str, str]:
    path = folder / CHECKSUMS
    text = read_checked_bytes(path, "checksum file", RECORD_MAX_BYTES).decode("utf-8", errors="replace")
    out: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-f]{64}) [ *](\S(?:.*\S)?)", line)  # a name never ends in a space seco-lab wrote
        if not m or "/" in m.group(2) or m.group(2) in out:
            raise ChecksumError(f"{path}: line {i} is not `SHA256  NAME` for a new file of this folder (a name with "
                                "trailing spaces, a path, a repeated name?): the checksum file is damaged; rerun what "
                                "wrote the folder, or `seco-lab seal "
                                f"{folder}` to vouch for its files as they are")
        out[m.group(2)] = m.group(1)
    return out


def _check_checksum_name(path: Path, then: str) -> None:
    """Refuse a checksum file's name taken by something else than a regular file (a folder, a link to nothing)."""
    if (path.exists() or path.is_symlink()) and not path.is_file():
        what = "a folder" if path.is_dir() else "a dangling link" if not path.exists() else "not a regular file"
        raise ChecksumError(f"{path} is {what}: that name is the folder's checksum file, which records what is "
                            f"written here; move it away{then}")


def _write_checksums(folder: Path, sums: dict[str, str]) -> None:
    text = "".join(f"{h}  {n}\n" for n, h in sorted(sums.items()))
    path = folder / CHECKSUMS
    _check_checksum_name(path, "")
    if path.is_file() and path.read_text(errors="replace") == text:
        return  # unchanged: a rerun that rewrites the same files leaves a committed folder as it was
    tmp = folder / f"{CHECKSUMS}.{TEMP_TAG}{os.getpid()}"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _folder_flock(folder: Path):
    """Exclusive flock on the folder itself (not its ``.lock``, which a study holds all along): the workers of one
    study record their files one at a time."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def record_checksum(path: str | Path) -> None:
    """Record ``path``'s SHA-256 in its folder's checksum file (which must exist; :func:`atomic_write` calls this
    for every file it writes into such a folder)."""
    path = Path(path)
    with _folder_flock(path.parent):
        _record_checksum_locked(path)


def _record_checksum_locked(path: Path) -> None:
    sums = _read_checksums(path.parent)
    sums[path.name] = file_sha256(path)
    _write_checksums(path.parent, sums)


def forget_checksums(folder: str | Path, names) -> None:
    """Drop ``names`` (files the tool removed) from ``folder``'s checksum file, where there is one."""
    folder = Path(folder)
    if not (folder / CHECKSUMS).is_file():
        return
    with _folder_flock(folder):
        sums = _read_checksums(folder)
        _write_checksums(folder, {n: h for n, h in sums.items() if n not in set(names)})


def start_checksums(folder: str | Path) -> None:
    """Make ``folder`` record the checksum of every file written into it from now on (nothing changes where it is
    started).  Results files already there without a checksum file (written by a seco-lab before checksums, or
    the file was removed) are recorded as nothing: what nobody vouches for is not taken as written -- a study
    computes such cells again, a report refuses such tables -- unless ``seco-lab seal`` vouches for them first."""
    folder = Path(folder)
    path = folder / CHECKSUMS
    if path.is_file():
        return
    _check_checksum_name(path, " (nothing was written)")
    unrecorded = [p.name for p in sorted(folder.iterdir()) if re.fullmatch(RESULT_FILE, p.name)]
    if unrecorded:
        print(f"seco-lab: {folder} holds results ({', '.join(unrecorded[:3])}{', ...' if len(unrecorded) > 3 else ''})"
              f" but no {CHECKSUMS}: they are not taken as written (a study computes them again, a report refuses "
              f"them); to keep them, stop and run `seco-lab seal {folder}` first", file=sys.stderr)
    with _folder_flock(folder):
        _write_checksums(folder, {})


def as_written(path: str | Path) -> bool:
    """Whether ``path`` is as the tool wrote it, by its folder's checksum file (True where the folder has none:
    :func:`start_checksums` was never called on it, and the caller judges it by its content alone)."""
    path = Path(path)
    if not (path.parent / CHECKSUMS).is_file():
        return True
    try:
        return _read_checksums(path.parent).get(path.name) == file_sha256(path)
    except (OSError, ValueError):
        return False


def check_tables_unedited(folder: str | Path, names, rerun: str) -> None:
    """Before a rerun (``rerun``: what it is, "the study's rerun") writes the tables ``names`` of ``folder`` again,
    refuse (:class:`ChecksumError`, naming the file) where one of them is no longer the file seco-lab wrote: its SHA-256
    differs from the one in the folder's checksum file, or the checksum file does not list it -- a table the user
    edited (a column of notes added) would be replaced (campaign 39 C6).  Nothing to compare where the folder has no
    checksum file (written before checksums: :func:`start_checksums` says what becomes of its tables) or where
    :data:`NO_CHECKSUMS_ENV` is 1 (the test suite's switch: the tables are then judged by the rerun alone)."""
    folder = Path(folder)
    if os.environ.get(NO_CHECKSUMS_ENV) == "1" or not (folder / CHECKSUMS).is_file():
        return
    sums = _read_checksums(folder)
    for name in names:
        path = folder / name
        if not (path.exists() or path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file():
            what = "a link" if path.is_symlink() else "a directory" if path.is_dir() else "not a regular file"
            raise ChecksumError(f"{path} is {what}, not the table seco-lab wrote, and {rerun} would write a table "
                                "there, so nothing is done; move it away and rerun")
        if sums.get(name) != file_sha256(path, max_bytes=None):
            how = ("its SHA-256 differs from the one in" if name in sums else "it is not listed in")
            raise ChecksumError(f"{path} was edited after seco-lab wrote it ({how} {folder / CHECKSUMS}) and "
                                f"{rerun} would replace it, so nothing is done; move it away (or restore it) and "
                                "rerun")


#: the record at the top of every results folder a seco-lab study, audit or benchmark wrote before it kept checksums
RESULTS_RECORDS = ("study.json", "audit.json", "bench.json", "training.json", "memory.json")
#: the provenance every such record carries, one of these keys at least (a file that merely has the name does not)
RECORD_PROVENANCE = ("software", "versions", "command")


def _is_results_record(path: Path) -> bool:
    """Whether ``path`` is a record a seco-lab study, audit or benchmark wrote: a regular JSON object (read by
    :func:`read_json`, so a FIFO or a huge file is not opened) carrying one of :data:`RECORD_PROVENANCE`.  Another
    tool's ``study.json`` -- not JSON, ``{}``, a list -- does not make its folder a seco-lab results folder."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        record = read_json(path, "record")
    except (OSError, ValueError):
        return False
    return any(k in record for k in RECORD_PROVENANCE)


#: what else seco-lab's own writes record in a results folder's checksum file (a study's report.md, a
#: .gitignore, a figure): not results, but no sign of another tool's list either (campaign 24 F6: seal refused
#: every folder ``seco-lab audit`` writes, for its report.md)
RECORDED_BESIDE = r"[^/]+\.(md|png)|\.gitignore"


#: a results name that is not UTF-8 (Latin-1 from an old tool or archive): a checksum file, UTF-8 text, cannot
#: record it, so neither seal nor a study can vouch for it (campaign 25 N4)
_NOT_UTF8_NAME = ("{folder}: the results file {name!r} is not named in UTF-8, which a checksum file (UTF-8 text) "
                  "cannot record; rename it in UTF-8 or move it away")


def _unrecordable(folder: Path, name: str) -> str | None:
    """Why a checksum line cannot record the results name ``name`` of ``folder``, or None: not UTF-8 (as Python
    decodes it: undecodable bytes as surrogates), a line break, or a leading or trailing space (sha256sum's ``HEX
    NAME`` line does not keep them: campaign 26 P5)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return _NOT_UTF8_NAME.format(folder=folder, name=os.fsencode(name))
    if name.splitlines() != [name] or name != name.strip():  # \v, \f, U+2028 ... end a line as well (campaign 27)
        return (f"{folder}: the results file {name!r} is named with a line break or a leading or trailing space, "
                "which a checksum line cannot hold; rename it or move it away")
    return None


def _sealable_entries(folder: Path) -> None:
    """Refuse, before anything is written, a results name seal cannot record as a regular file: a FIFO, device,
    folder or link by a results file's name, or a name with a line break or trailing space (a checksum line
    cannot hold it) -- skipped without a word, it left a folder that every report refuses (campaign 24 F4)."""
    for p in sorted(folder.iterdir()):
        if not re.fullmatch(RESULT_FILE, p.name, re.DOTALL):
            continue
        if _unrecordable(folder, p.name):
            raise ChecksumError(f"{_unrecordable(folder, p.name)}, then seal; nothing was written")
        if p.is_symlink() or not p.is_file():
            what = ("a link" if p.is_symlink() else "a folder" if p.is_dir() else "not a regular file (a FIFO or "
                    "device)")
            raise ChecksumError(f"{p} is {what}: seal records only regular files (a report reads a results file "
                                "only as the file seco-lab wrote); put the file itself in its place, or move it "
                                "away, then seal; nothing was written")


def _own_checksums(folder: Path) -> dict[str, str]:
    """The checksum file of ``folder`` when seco-lab wrote it (every name a results file), {} when there is none;
    a :class:`ChecksumError` for one that is a folder or a link to nothing, damaged, or another tool's (it lists
    other files): seal never writes over a file it did not write."""
    path = folder / CHECKSUMS
    _check_checksum_name(path, ", or seal a folder seco-lab wrote")
    if not path.is_file():
        return {}
    try:
        sums = _read_checksums(folder)
    except ChecksumError as e:  # the reports' remedy names seal itself: here say what seal needs instead
        raise ChecksumError(f"{str(e).split(': the checksum file is damaged')[0]}: it is not a checksum file "
                            "seco-lab wrote (another tool's format, or damaged); seal does not write over it -- move "
                            "it away (it may be yours), then seal") from None
    foreign = sorted(n for n in sums if not re.fullmatch(RESULT_FILE, n) and not re.fullmatch(RECORDED_BESIDE, n))
    if foreign:
        raise ChecksumError(f"{path} lists {foreign[0]}, which is not a results file: it is not a checksum file "
                            "seco-lab wrote (sha256sum's, kept by you?) and is not written over; seal only a results "
                            "folder seco-lab wrote")
    return sums


def seal(folder: str | Path, recurse: bool = True) -> list[Path]:
    """Record the results files of ``folder`` (and, with ``recurse``, of its subfolders that hold any) as they are
    now: the user vouches for them (``seco-lab seal``).  Returns the checksum files written.

    Only a results folder seco-lab wrote is sealed: one with its checksum file, or (written before checksums) one
    of :data:`RESULTS_RECORDS`; anything else -- ``/``, a home folder, a project of yours -- is refused before a
    file is written, and so is a folder whose checksum file seco-lab did not write (every folder is checked first,
    then all are written)."""
    folder = Path(folder)
    own = _own_checksums(folder)
    if not (folder / CHECKSUMS).is_file() and not any(_is_results_record(folder / r) for r in RESULTS_RECORDS):
        raise ChecksumError(f"{folder} is not a results folder seco-lab wrote (no {CHECKSUMS}, no "
                            f"{', '.join(RESULTS_RECORDS)} that seco-lab wrote -- a JSON object with its "
                            f"{'/'.join(RECORD_PROVENANCE)}): seal vouches for a study's, audit's or benchmark's "
                            "results, e.g. reports/bias_study; nothing was written")
    plan = {folder: own}
    if recurse:
        busy = [p for p in (folder, *folder.rglob("*")) if p.is_dir() and not p.is_symlink() and lock_holder(p)]
    else:
        busy = [folder] if lock_holder(folder) else []
    if busy:  # campaign 34 T03: a folder a study or audit is writing was sealed halfway through its work
        raise ChecksumError(f"{busy[0]} is in use by a running seco-lab process (pid {lock_holder(busy[0])}): seal "
                            "vouches for finished results; wait for it to finish, then seal; nothing was written")
    if recurse:
        for sub in sorted(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()
                          and not any(q.is_symlink() for q in p.relative_to(folder).parents if q != Path("."))):
            if (sub / CHECKSUMS).exists() or any(re.fullmatch(RESULT_FILE, p.name) for p in sub.iterdir()):
                plan[sub] = _own_checksums(sub)
    for sub in plan:
        _sealable_entries(sub)
    written = []
    for sub, old in plan.items():
        with _folder_flock(sub):
            sums = {p.name: file_sha256(p) for p in sorted(sub.iterdir())
                    if re.fullmatch(RESULT_FILE, p.name) and p.is_file() and not p.is_symlink()}
            if sums != old or not (sub / CHECKSUMS).is_file():
                _write_checksums(sub, sums)
        written.append(sub / CHECKSUMS)
    return written


def _folders_within(folder: Path) -> list[Path]:
    """``folder`` and every folder below it, symlinked ones followed (a report reads through them), each real folder
    once (a link loop ends there)."""
    out, seen = [], set()
    for root, dirs, _ in os.walk(folder, followlinks=True):
        dirs.sort()
        real = os.path.realpath(root)
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        out.append(Path(root))
    return out


def file_identity(path: Path) -> tuple[int, ...] | None:
    """What tells one state of a file from another without reading it: device, inode, size, modification and
    status-change times (ns).  Any write, a rename over it, or a swap out and back (``mv``, ``cp``) moves its
    status-change time on, which no user can set back; None where nothing is there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class VerifiedFiles(dict):
    """``{path: SHA-256}`` of the files :func:`verify_checksums` verified, with each file's
    :func:`file_identity` taken before it was hashed.  :meth:`changed` names the files that are not in that
    state any more: the bytes a reader parsed since may not be the bytes verified, even when the file is back to
    them (an edited copy swapped in for the read and the original swapped back)."""

    def __init__(self):
        super().__init__()
        self.identity: dict[Path, tuple[int, ...] | None] = {}
        self.data: dict[Path, bytes | int] = {}  # with pin: the bytes hashed (or the file's descriptor)

    def add(self, path: Path, pin: bool = False) -> str:
        self.identity[path] = file_identity(path)
        if not pin:
            self[path] = file_sha256(path)
        elif os.stat(path).st_size <= PIN_BYTES_MAX:
            self.data[path] = read_checked_bytes(path, "stored results file", TABLE_MAX_BYTES)
            self[path] = hashlib.sha256(self.data[path]).hexdigest()
        else:  # held open: the file hashed is the file read, in bounded memory
            checked_file(path, "stored results file", TABLE_MAX_BYTES)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ValueError(f"stored results file {path} is not a regular file (it was replaced while being "
                                 "read)")
            self.data[path] = fd
            h = hashlib.sha256()
            with os.fdopen(os.dup(fd), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            self[path] = h.hexdigest()
        return self[path]

    def release(self) -> None:
        """Close the descriptors of pinned files held open."""
        for path, held in list(self.data.items()):
            if isinstance(held, int):
                os.close(held)
                del self.data[path]

    def changed(self) -> list[Path]:
        return [p for p, h in self.items()
                if file_identity(p) != self.identity[p] or not p.is_file() or file_sha256(p) != h]

    def check_unchanged(self, produce: str) -> None:
        """Refuse (:class:`ChecksumError`) when a verified file :meth:`changed` since: what was read after the
        verification is not known to be what was verified."""
        changed = self.changed()
        if changed:
            raise ChecksumError(f"{changed[0]} changed while it was read (something writes into {changed[0].parent},"
                                f" or it was swapped out and back): rerun {produce} once the writer is done")


def verify_checksums(folder: str | Path, produce: str, skip: tuple[str, ...] = (),
                     only: tuple[str, ...] | None = None, pin: bool = False, subfolders: bool = True
                     ) -> VerifiedFiles:
    """Every results file (``*.csv``, ``*.csv.gz``, ``*.json``, ``*.pt``) of ``folder`` and its subfolders must be
    recorded in its folder's checksum file with the SHA-256 it has now; a folder with results files but no checksum
    file is refused too.  Each refusal (:class:`ChecksumError`) names the file and says ``produce`` (what writes
    it) or ``seco-lab seal`` (to vouch for a file edited on purpose); so is a recorded file that is missing.
    Returns each verified file's SHA-256 and state (:class:`VerifiedFiles`: a caller asks it after reading which
    files changed meanwhile, swapped out and back included).  ``skip``: names of files of ``folder`` itself not
    verified (tables the caller writes again from the others); ``only``: just these files of ``folder`` (no
    subfolder), e.g. a record beside files another library wrote; ``subfolders=False``: all of ``folder``'s own
    files, none below.  ``pin``: keep each file's bytes, hashed as read,
    for :func:`pinned`.  Skipped (an empty dict) where :data:`NO_CHECKSUMS_ENV` is 1."""
    verified = VerifiedFiles()
    if os.environ.get(NO_CHECKSUMS_ENV) == "1":
        return verified
    folder = Path(folder)
    vouch = f"`seco-lab seal {folder}` vouches for the files as they are"
    for sub in [folder] if only is not None or not subfolders else _folders_within(folder):
        results = sorted(p for p in sub.iterdir() if re.fullmatch(RESULT_FILE, p.name) and not p.is_dir()
                         and not (sub == folder and p.name in skip) and (only is None or p.name in only))
        if not results and not (sub / CHECKSUMS).is_file():
            continue
        if not (sub / CHECKSUMS).is_file():
            raise ChecksumError(f"{sub} holds results ({results[0].name}, ...) but no {CHECKSUMS}: they were "
                                "written by a seco-lab before checksums, or the file was removed, so nothing tells "
                                f"whether they are what was computed; rerun {produce}, or {vouch}")
        sums = _read_checksums(sub)
        gone = sorted(n for n in sums if (only is None or n in only) and not (sub == folder and n in skip)
                      and not (sub / n).exists() and not (sub / n).is_symlink())
        if gone:
            raise ChecksumError(f"{sub / gone[0]} is recorded in {sub / CHECKSUMS} but missing"
                                f"{f' (and {len(gone) - 1} more)' if len(gone) > 1 else ''}: it was deleted or moved "
                                f"after it was written, and a report without it would leave out what it held; restore "
                                f"it, rerun {produce}; if you removed it on purpose, {vouch}")
        for p in results:
            if _unrecordable(sub, p.name):  # seal cannot vouch for it either: the remedy is its name
                raise ChecksumError(f"{_unrecordable(sub, p.name)}; then {vouch}")
            if p.name not in sums:
                raise ChecksumError(f"{p} is not recorded in {sub / CHECKSUMS}: seco-lab did not write it there "
                                    f"(copied in, or renamed?); remove it, rerun {produce}, or {vouch}")
            if p.is_symlink():
                raise ChecksumError(f"{p} is a symbolic link (to {os.readlink(p)}): a results file is read only as "
                                    f"the file seco-lab wrote there, not through a link; put the file itself in its "
                                    f"place, or rerun {produce}")
            if p.is_file():
                verified.add(p, pin)
            if not p.is_file() or verified[p] != sums[p.name]:
                raise ChecksumError(f"{p} is not the file seco-lab wrote (its SHA-256 differs from the one in "
                                    f"{sub / CHECKSUMS}): it was edited, damaged or replaced after it was written; "
                                    f"rerun {produce}; if you changed it on purpose, {vouch}")
    return verified


def atomic_write_csv(path: str | Path, df) -> Path:
    """``df.to_csv(path, index=False)`` atomically (gzip-compressed when ``path`` ends in ``.gz``)."""
    if not hasattr(df, "to_csv"):
        raise TypeError("atomic_write_csv(path, df): the path comes first")
    gz = str(path).endswith(".gz")
    return atomic_write(path, lambda f: df.to_csv(f, index=False, compression="gzip" if gz else None))


def atomic_write_json(path: str | Path, obj, indent: int = 2) -> Path:
    """``obj`` as indented JSON with a final newline, atomically."""
    return atomic_write(path, json.dumps(obj, indent=indent) + "\n")


#: a temporary file :func:`atomic_write` leaves in a study folder when killed: ``NAME.seco-tmp<pid>`` for a NAME a
#: study writes there (``*.json``, ``*.csv``, ``*.csv.gz``, ``*.md``, ``.gitignore``); a user's ``draft.tmp2`` or
#: ``results.json.tmp2`` is not one, and is neither counted as the study's nor removed
TEMP_FILE = r"[^/]*\.(json|csv|csv\.gz|md|gitignore)\." + TEMP_TAG + r"\d+"
#: what a cell record says of itself (:meth:`StudyFolder.write_cell`): its name and its study's definition digest
CELL_KEY, DEFINITION_KEY = "cell_name", "study_definition"
#: the files a study writes for a cell: ``NAME.json`` and its tables ``NAME.TABLE.csv[.gz]`` / ``NAME.csv``
CELL_FILE = r"[^/]+\.(json|csv|csv\.gz)"


def clear_stale(folder: str | Path) -> None:
    """Remove the temporary files an interrupted :func:`atomic_write` left in ``folder`` (not in
    subfolders): only ``NAME.seco-tmp<pid>`` files, never anything else a user keeps there, and only empty ones; one
    holding something -- a write killed half-way, or a user's file under such a name (campaign 38 B9) -- is kept,
    with a warning."""
    for stale in Path(folder).iterdir():
        if _own_temporary(stale):
            stale.unlink()
        elif re.fullmatch(TEMP_FILE, stale.name) and stale.is_file() and not stale.is_symlink():
            warnings.warn(f"kept {stale}: a write killed half-way leaves such a file, and seco-lab cannot tell it "
                          "from a file of yours under that name; delete it if that is what it is", stacklevel=2)


def _own_temporary(path: Path) -> bool:
    """``path`` is a temporary file of :func:`atomic_write` a study may remove: its name, a regular file, empty."""
    return bool(re.fullmatch(TEMP_FILE, path.name)) and path.is_file() and not path.is_symlink() \
        and path.stat().st_size == 0


def software_versions(*packages: str) -> dict:
    """Versions of Python and the numerical stack, platform and CPU count, plus each of ``packages``
    (distribution names; 'absent' when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    import matplotlib
    import numpy as np
    import pandas as pd
    import scipy
    import torch

    out = {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
           "scipy": scipy.__version__, "pandas": pd.__version__, "matplotlib": matplotlib.__version__,
           "platform": platform.platform(), "cpus": os.cpu_count()}
    for dist in packages:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:  # a missing optional package is recorded as absent
            out[dist] = "absent"
    return out


def file_sha256(path: str | Path, what: str = "stored table", max_bytes: int | None = TABLE_MAX_BYTES) -> str:
    """The SHA-256 of a stored file, read in blocks after :func:`checked_file` (a FIFO, device, folder or file over
    ``max_bytes`` raises ValueError, never blocks or reads without end)."""
    path = checked_file(path, what, max_bytes)
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{what} {path} is not a regular file (it was replaced while being read)")
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(definition: dict) -> str:
    """16 hex digits of the SHA-256 of the definition's sorted JSON."""
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()[:16]


class StudyFolderError(ValueError):
    """A results folder that cannot be used as asked (the message says why and what to do)."""


class DefinitionMismatch(StudyFolderError):
    """The results folder holds results of a different study definition."""


def protected_paths() -> dict[Path, str]:
    """Directories no run or study may take over: the filesystem root, the home directory, the current
    directory and every ancestor of the last two."""
    out = {}
    for what, base in (("the current directory", Path.cwd()), ("your home directory", Path.home())):
        base = base.resolve()
        out.setdefault(base, what)
        for anc in base.parents:
            out.setdefault(anc, f"an ancestor of {what}")
    out[Path("/").resolve()] = "the filesystem root"
    return out


def check_study_out(out: str | os.PathLike) -> Path:
    """A study's ``--out`` that is no folder of its own is refused before anything is written: ``""`` (the
    current directory), a literal ``~``, a file, and the filesystem root, the home directory, the current
    directory and their ancestors (a study writes results.csv, study.json, ... straight into its folder)."""
    text = os.fspath(out)
    if not str(text).strip():
        raise StudyFolderError("--out is empty; name a folder for the study's results, e.g. --out results/study")
    if str(text) == "~" or str(text).startswith("~/"):
        raise StudyFolderError(f"--out {text}: a literal '~' (the shell did not expand it); write the path out")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise StudyFolderError(f"--out {path} is a file, not a folder: pass a folder path")
    what = protected_paths().get(path.resolve())
    if what is not None:
        raise StudyFolderError(f"--out {path} is {path.resolve()}, {what}: a study writes its tables straight into "
                               "its folder; pass a folder of its own, e.g. --out results/study")
    return path


def study_owner(manifest: dict) -> str | None:
    """Which of this tool's studies wrote a ``study.json`` (its ``"study"`` stamp; for folders written before
    the stamp, recognised by the keys only that study writes), or None: not a seco-lab study's record."""
    if not isinstance(manifest, dict):
        return None
    if isinstance(manifest.get("study"), str):
        return manifest["study"]
    if "digest" in manifest and "study_format" in manifest:
        return "bias"
    if "design" in manifest and "fingerprint" in manifest:
        return "train"
    if "gguf_sha256_16" in manifest or {"config", "cells", "exactness"} <= manifest.keys():
        return "real"
    return None


class StudyFolder:
    """A study's results folder: ``ROOT/study.json`` (the manifest: the definition's fingerprint under
    ``key``, the software, the status) and one file set per cell under ``ROOT/CELLS/``, whose
    ``NAME.json`` is written last and so marks the cell done.

    ``stored_fingerprint(manifest)`` reads the fingerprint of a stored manifest (default:
    ``manifest[key]``); a study whose older folders stored it differently passes its own.  ``keeps``: files
    the study may write before its manifest and never overwrites (kept when they exist), so a folder holding
    only these is still one to start the study in.  ``tables``: the tables the study writes into ``ROOT`` from its
    cells, which a rerun (``--fresh`` too) refuses to start over while one is not as written
    (:func:`check_tables_unedited`).
    """

    def __init__(self, root: str | Path, cells: str = "cells", key: str = "fingerprint",
                 stored_fingerprint: Callable[[dict], str | None] | None = None, keeps: tuple[str, ...] = (),
                 study: str | None = None, tables: tuple[str, ...] = ()):
        if not str(os.fspath(root)).strip():
            raise StudyFolderError("--out is empty; name a folder for the study's results, e.g. --out results/study")
        self.root, self.key, self.keeps, self.study = Path(root), key, tuple(keeps), study
        self.tables = tuple(tables)
        self.definition: str | None = None  # the digest open() was given: each cell written records it
        self.cells = self.root / cells
        self.manifest_path = self.root / "study.json"
        self._stored = stored_fingerprint or (lambda m: m.get(key))

    def read_manifest(self) -> dict:
        """The stored manifest ({} when there is none); a damaged one is refused, naming the file."""
        if not self.manifest_path.exists():
            return {}
        try:
            return read_json(self.manifest_path, "study record", RECORD_MAX_BYTES,
                             "remove the folder's results (or pass another --out) and rerun the study")
        except FileNotFoundError:  # removed since the check above
            return {}
        except (OSError, ValueError) as e:
            raise StudyFolderError(str(e) if isinstance(e, ValueError) else
                                   f"{self.manifest_path} cannot be read ({e.strerror or e}): pass another --out") \
                from None

    def check_usable(self) -> None:
        """Refuse a folder that is not this tool's to write into: see :func:`check_study_out`, and a folder
        holding files but no ``study.json`` (a user's folder: a study would overwrite its results.csv, ...)."""
        check_study_out(self.root)
        if not self.root.is_dir() or self.manifest_path.exists():
            return
        from .folder_lock import LOCK_NAME, is_own_lock

        foreign = [p for p in sorted(self.root.iterdir())
                   if not (p.name == LOCK_NAME and is_own_lock(p) or re.fullmatch(TEMP_FILE, p.name)
                           or p.name in self.keeps or p.name == CHECKSUMS and p.is_file() and not p.is_symlink()
                           or p == self.cells and p.is_dir() and not p.is_symlink() and not any(p.iterdir()))]
        if foreign and is_own_lock(self.root / LOCK_NAME):  # a study started there and still running: say so
            from .folder_lock import FolderBusy, hold_lock, release_lock

            try:
                release_lock(hold_lock(self.root, "seco-lab study", "wait for it to finish, or pass another --out"))
            except FolderBusy as e:
                raise StudyFolderError(str(e)) from None
        if foreign:
            names = ", ".join(p.name for p in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
            raise StudyFolderError(f"--out {self.root} is not a seco-lab study folder (no study.json) and holds files "
                                   f"({names}): a study would overwrite them, so nothing is written; pass a new or "
                                   "empty folder with --out")

    def stored_fingerprint(self) -> str | None:
        """The fingerprint of the definition whose cells the folder holds (None: no manifest)."""
        manifest = self.read_manifest()
        return self._stored(manifest) if manifest else None

    def open(self, digest: str, fresh: bool = False) -> dict:
        """Create and lock the folder (``ROOT/.lock``, held until this process exits or :meth:`close`: a second
        run into the same folder is refused, a lock left by a dead process is taken over), remove stale
        temporary files, refuse a folder of another definition (unless ``fresh``: then its cells are
        discarded); return the stored manifest ({} if none)."""
        self.check_usable()
        self.definition = str(digest)
        stored = self.read_manifest()  # a damaged record is refused before anything is written
        self._check_owner(stored)  # as is a record this study did not write
        try:  # a table the user edited is never replaced (campaign 39 C6)
            check_tables_unedited(self.root, self.tables, "the study's rerun")
        except ChecksumError as e:
            raise StudyFolderError(str(e)) from None
        self.cells.mkdir(parents=True, exist_ok=True)
        key = self.root.resolve()
        if key not in _HELD_LOCKS:
            _HELD_LOCKS[key] = hold_lock(self.root, "study run", "wait for it to finish, or pass another --out")
        clear_stale(self.cells)
        clear_stale(self.root)
        start_checksums(self.root)  # every file the study writes from now on is recorded (a report verifies them)
        start_checksums(self.cells)
        old = {} if fresh else stored
        if old and self._stored(old) != digest:
            raise DefinitionMismatch(
                f"{self.root} holds results of a different study definition (fingerprint {self._stored(old)} != "
                f"{digest}); pass --fresh to discard them or --out to write elsewhere")
        if fresh:  # only the cells' own files (and their temporaries): anything else in the folder stays
            discarded = self._cell_files()[0]
            for f in discarded:
                f.unlink()
            forget_checksums(self.cells, [f.name for f in discarded])
        return old

    def _check_owner(self, manifest: dict) -> None:
        """A ``study.json`` this tool did not write, or another study's, is refused (``--fresh`` included):
        discarding cells is for a changed definition of the same study, never for someone else's folder."""
        if not manifest or self.study is None:
            return
        owner = study_owner(manifest)
        if owner is None:
            raise StudyFolderError(f"{self.manifest_path} was not written by seco-lab (no study's record): the "
                                   "folder is not a study folder, so nothing is written or discarded; pass another "
                                   "--out")
        if owner != self.study:
            raise StudyFolderError(f"{self.root} holds the results of the {owner} study, not of the {self.study} "
                                   f"study: nothing is written or discarded; pass another --out (or `seco-lab "
                                   f"report {owner} --results {self.root}` to read them)")

    def _cell_files(self) -> tuple[list[Path], list[str]]:
        """(the files of the cells folder this study wrote, the names of any others -- a user's, which --fresh
        keeps).  Ours: temporaries, each cell's record ``NAME.json`` (a JSON object) and the files ``NAME.*``
        beside it; a file that merely has a cell's extension (a user's ``notes.json``) is not."""
        files = [f for f in self.cells.iterdir() if f.name != CHECKSUMS]  # kept: it records what is rewritten
        stems = set()
        for f in files:
            if f.suffix == ".json" and f.is_file() and not f.is_symlink():
                try:
                    read_json(f, "cell record")
                    stems.add(f.name[: -len(".json")])
                except (OSError, ValueError):  # not a cell's record (a FIFO is not a file here, never opened)
                    pass
        ours, foreign = [], []
        for f in files:
            temporary = re.fullmatch(TEMP_FILE, f.name)  # ours only empty (clear_stale)
            mine = _own_temporary(f) if temporary else any(f.name == s + ".json" or f.name.startswith(s + ".")
                                                           for s in stems)
            if mine and re.fullmatch(f"{CELL_FILE}|{TEMP_FILE}", f.name) and f.is_file() and not f.is_symlink():
                ours.append(f)
            else:
                foreign.append(f.name)
        return ours, sorted(foreign)

    def marker(self, name: str) -> Path:
        """The file whose presence marks cell ``name`` done."""
        return self.cells / f"{name}.json"

    def close(self) -> None:
        """Release the folder's lock (also released when the process exits)."""
        held = _HELD_LOCKS.pop(self.root.resolve(), None)
        if held is not None:
            release_lock(held)

    def done(self, name: str) -> bool:
        """The cell's record exists and every table it lists is on disk with the recorded SHA-256: a deleted
        or altered table makes the cell not done (it is computed again), rather than a "complete" study
        with rows missing.  A record without the list (older folders) needs only to exist."""
        try:  # a damaged record (a FIFO, a device, too large, not JSON) marks the cell not done: it is computed again
            record = read_json(self.marker(name), "cell record", expect=None)
        except (OSError, ValueError):
            return False
        if not as_written(self.marker(name)):  # edited, or copied in from another cell or study
            return False
        if isinstance(record, dict) and not self._own_cell(name, record):
            return False
        files = record.get("files") if isinstance(record, dict) else None
        if files is None:
            return isinstance(record, dict)
        try:
            return all(file_sha256(self.cells / table_file) == entry["sha256"] for table_file, entry in files.items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # a table missing, not a file, too large
            return False

    def _own_cell(self, name: str, record: dict) -> bool:
        """A record names the cell and the study definition it was computed for (records written before carry
        neither and are judged by their tables): one copied from another cell, or from a study of another
        definition (another --draws, ...) with its checksum file, is not this cell's."""
        cell, definition = record.get(CELL_KEY, name), record.get(DEFINITION_KEY, self.definition)
        if cell == name and (self.definition is None or definition == self.definition):
            return True
        print(f"{self.marker(name)} holds cell {cell!r} of study definition {definition!r}, not cell {name!r} of "
              f"{self.definition!r}: it was copied in from elsewhere; the cell is computed again", file=sys.stderr)
        return False

    def write_cell(self, name: str, record: dict, tables: dict | None = None,
                   table_suffix: str = ".{table}.csv") -> None:
        """Write a cell's tables (``NAME.TABLE.csv``), then its record ``NAME.json`` with each table's row
        count and SHA-256: the cell is done only once every table is on disk as recorded."""
        files = {}
        for table, df in (tables or {}).items():
            path = self.cells / (name + table_suffix.format(table=table))
            atomic_write_csv(path, df)
            files[path.name] = {"rows": len(df), "sha256": file_sha256(path)}
        own = {CELL_KEY: name, **({DEFINITION_KEY: self.definition} if self.definition is not None else {})}
        atomic_write_json(self.marker(name), {**record, **own, "files": files} if files else {**record, **own})

    def read_cell(self, name: str) -> dict:
        """The cell's record as written (without the table checksums :meth:`write_cell` adds)."""
        record = read_json(self.marker(name), "cell record", fix="remove it and rerun the study (the cell is "
                           "computed again)")
        for key in ("files", CELL_KEY, DEFINITION_KEY):
            record.pop(key, None)
        return record

    @contextmanager
    def gathering_cells(self, written):
        """Around reading the cells into the study's tables (files ``written`` into the root): every cell file is
        verified first, as its worker wrote it, and read as verified (:func:`pinned`); compared again once the
        tables are written, a cell changed
        meanwhile -- swapped out and back included -- leaves those tables unrecorded (no report takes them) and
        raises :class:`StudyFolderError`."""
        redo = "the study again (a cell that is not as written is computed again)"
        verified = VerifiedFiles()
        if self.cells.is_dir():
            try:
                with _folder_flock(self.cells):  # a worker's cell is renamed and recorded at once (atomic_write)
                    verified = verify_checksums(self.cells, redo, pin=True)
            except ChecksumError as e:
                raise StudyFolderError(str(e)) from None
        with pinned(verified):  # the tables are made from the bytes verified
            yield
        changed = verified.changed()
        if changed:
            forget_checksums(self.root, list(written))
            raise StudyFolderError(f"{changed[0]} changed while the study's tables were made from it (something "
                                   f"writes into {self.cells}); those tables are not recorded as the study's, so no "
                                   f"report takes them (nor a rerun, which keeps a table it cannot tell from one of "
                                   f"yours): remove {', '.join(written)} from {self.root} and rerun {redo}")

    def write_manifest(self, manifest: dict) -> None:
        """Write ``study.json``, stamped with the study's name (:func:`study_owner` reads it back)."""
        atomic_write_json(self.manifest_path, manifest if self.study is None else {"study": self.study, **manifest})


def lacking_files(folder, names, produce: str) -> str | None:
    """The message for a results ``folder`` lacking some of ``names`` (None when it holds them all), naming the
    command (``produce``) that writes them."""
    missing = [f for f in names if not (Path(folder) / f).exists()]
    if not missing:
        return None
    return (f"{folder} lacks {', '.join(missing)}: run {produce} first, or pass the folder that holds them with "
            "--results")


#: the PNG tEXt chunk (keyword NUL text) every figure seco-lab writes carries (``seco_lab.report.figures.write_png``):
#: an existing PNG is written over only when it carries it, so a user's image is never replaced
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURE_MARK_KEY, FIGURE_MARK_VALUE = "seco-lab", "generated"
#: the PNG text key naming the run a run folder's ``loss.png`` was drawn for (its marker's run id): --overwrite
#: replaces a ``loss.png`` only when it is that run's (campaign 34 X3: a copy of an audit figure was replaced)
RUN_FIGURE_KEY = "seco-lab run"
_PNG_MAX_CHUNKS = 64  # the mark sits before the image data, among the first few chunks


def png_text(path: Path) -> dict[str, str] | None:
    """The tEXt chunks (keyword -> text) before the image data of the PNG ``path``; None for anything but a regular
    file that starts as a PNG.  Reads at most a few chunks (the image data is never read; a FIFO or device is never
    opened)."""
    out: dict[str, str] = {}
    try:
        with open(checked_file(path, "figure"), "rb") as f:
            if f.read(8) != PNG_SIGNATURE:
                return None
            for _ in range(_PNG_MAX_CHUNKS):
                head = f.read(8)
                if len(head) < 8:
                    return out
                length, kind = int.from_bytes(head[:4], "big"), head[4:]
                if kind in (b"IDAT", b"IEND"):
                    return out
                if kind == b"tEXt" and length <= 4096:
                    key, _, text = f.read(length).partition(b"\x00")
                    out.setdefault(key.decode("latin-1"), text.decode("latin-1"))
                    f.seek(4, 1)
                else:
                    f.seek(length + 4, 1)  # the chunk's data and its CRC
    except (OSError, ValueError):
        return None
    return out


def is_generated_png(path: Path) -> bool:
    """``path`` is a PNG seco-lab wrote: a regular file whose chunks before the image data hold the tEXt chunk
    ``seco-lab: generated`` (:func:`png_text`); False for anything else."""
    return (png_text(path) or {}).get(FIGURE_MARK_KEY) == FIGURE_MARK_VALUE


def check_image_target(out: Path, option: str | None = "--out") -> None:
    """Refuse a figure target that is a folder, not a ``.png`` file (PNG bytes would be written under another
    suffix), or an existing file that is not a figure seco-lab wrote (:func:`is_generated_png`: a user's image,
    even a PNG, is never written over); ValueError naming it.  ``option``: the option that named it (None for a
    figure a report or a run writes by name).  Importable without matplotlib: ``seco-lab plot`` refuses at once."""
    out = Path(out)
    name = f"{option} {out}" if option else str(out)
    if out.is_dir():
        raise ValueError(f"{name} is a folder: " + (f"name the image file to write, e.g. {out / 'runs_loss.png'}"
                                                   if option else "the figure of that name is not written; move "
                                                   "the folder away"))
    if out.suffix.lower() != ".png":
        raise ValueError(f"{name}: the figure is written as a PNG image; give the file a .png suffix")
    check_parent_folder(out, option or "figure")
    if (out.exists() or out.is_symlink()) and not is_generated_png(out):
        raise ValueError(f"{name} exists and is not a figure seco-lab wrote (no \"{FIGURE_MARK_KEY}: "
                         f"{FIGURE_MARK_VALUE}\" mark in its PNG metadata): it is not written over (it could be a "
                         "file of yours); " + ("pass another .png file, or remove it first" if option else
                                               "move it away or remove it, then run the command again"))


def check_parent_folder(out: Path, option: str) -> None:
    """The folder ``out`` goes in is a folder, or can be made one (no part of it is a file)."""
    for part in Path(out).parents:
        if part.exists():
            if not part.is_dir():
                raise ValueError(f"{option} {out}: {part} is not a folder, so nothing can be written under it")
            return


# --------------------------------------------------------------------------- generated reports

#: the start of the line every generated report carries (seco_lab.report.markdown.generated_note)
GENERATED_MARK = "_Generated by `seco-lab report"


#: the last line of every generated report: the SHA-256 of all of its bytes before that line, so that a report is
#: written over only where it is exactly what seco-lab wrote (campaign 39 C7: notes appended to one were lost)
REPORT_DIGEST = "<!-- seco-lab report sha256:{} -->"


def with_report_digest(text: str) -> bytes:
    """The bytes of the report ``text`` (ending in a newline) followed by its :data:`REPORT_DIGEST` line."""
    body = escaped_text(text).encode("utf-8")
    body += b"" if body.endswith(b"\n") else b"\n"
    return body + REPORT_DIGEST.format(hashlib.sha256(body).hexdigest()).encode() + b"\n"


def report_problem(path: Path) -> str | None:
    """None where ``path`` is a report exactly as seco-lab wrote it (its last line the :data:`REPORT_DIGEST` of
    the bytes before it); otherwise why it may not be written over, a phrase that follows the file's name."""
    if not is_generated_report(path):
        return (f"exists and is not a report seco-lab generated (no \"{GENERATED_MARK}\" line): it is not written "
                "over (it could be a file of yours); pass another .md file, or remove it first")
    try:
        data = read_checked_bytes(path, "report", 1 << 26)
    except (OSError, ValueError):
        data = b""
    body, _, last = data[:-1].rpartition(b"\n")
    m = re.fullmatch(rb"<!-- seco-lab report sha256:([0-9a-f]{64}) -->", last) if data.endswith(b"\n") else None
    if m and hashlib.sha256(body + b"\n").hexdigest() == m.group(1).decode():
        return None
    move = "it is not written over; move or rename it, or pass another .md file"
    if m or b"<!-- seco-lab report sha256:" in data:
        return f"was edited after seco-lab generated it (its text no longer matches the digest it recorded): {move}"
    return (f"carries no digest of its text (written by a seco-lab before reports recorded one), so nothing shows "
            f"that it was not edited: {move}")


def is_generated_report(path: Path) -> bool:
    """Whether ``path`` is a regular file whose first 16 KiB hold :data:`GENERATED_MARK` (a FIFO, a device or a
    file of someone else's is not)."""
    try:
        with open(checked_file(path, "report"), "rb") as f:
            return GENERATED_MARK.encode() in f.read(1 << 14)
    except (OSError, ValueError):
        return False
