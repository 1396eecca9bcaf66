"""Run an audit (resumable, unit by unit) and gather its tables; the ``seco-lab audit`` command.

    seco-lab audit [--quick | --committed] [--out DIR] [--tables-only] [--model M] [--params lora|full]
                   [--texts [KIND:]PATH ...] [--length N] [--chunk-size C] [--budgets T ...] [--schemes S ...]
                   [--max-hops P] [--num-sequences N] [--mc-draws N] [--mc-budgets T ...] [--data-sequences N] ...

Every unit (``measure``; their order: ``plan``) is one JSON file under OUT/units, written atomically and
skipped when present, so an interrupted run resumes where it stopped.  After every unit the tables are
rewritten from all stored units (``tables.write_results``).  Per-sequence flat gradients (float32) are kept
under OUT/vectors for cross-sequence Gram matrices; they are not committed, and a resumed run recomputes the
ones it needs, checked against the stored units.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ... import store
from ...folder_lock import LOCK_NAME, FolderBusy, locked
from . import measure
from .config import AuditConfig
from .options import (
    DEFAULT_OUT,
    add_arguments,
    build_parser,
    check_drop_missing_units,
    check_report_of,
    check_tables_only,
    config_from_args,
)
from .plan import data_name, plan_units, sequence_sets
from .sources import SequenceSpec, check_model_name
from .stored import missing_units, missing_units_advice, read_audit_config, read_unit
from .tables import check_units, derive_results, load_units, stale_reason, unusable_units, write_results

__all__ = ["run_audit", "main", "build_parser", "add_arguments", "run_from_args", "config_from_args",
           "check_audit_out", "rewrite_tables", "AUDIT_FILES", "DEFAULT_OUT", "run_args"]


def _check_folder(cfg: AuditConfig, out: Path) -> None:
    path = out / "config.json"
    if path.exists() or path.is_symlink():
        stored = read_audit_config(out)  # a damaged record is refused, named (check_audit_out let it by: not ours)
        if stored.identity() != cfg.identity():
            diff = sorted(k for k, v in cfg.identity().items() if stored.identity().get(k) != v)
            raise ValueError(f"{out} holds an audit of another definition (differs in {', '.join(diff)}); "
                             "use another --out, or the stored settings")
    store.atomic_write_json(path, {"config": cfg.to_json(), "digest": cfg.digest()})


def run_audit(cfg: AuditConfig, out: str | Path = DEFAULT_OUT, progress: bool = True) -> Path:
    """Run every missing unit of the audit into ``out`` and write its tables; returns ``out``.  The folder and
    the texts are checked before anything is written (a refused run leaves nothing behind)."""
    if not isinstance(cfg, AuditConfig):
        raise TypeError(f"cfg must be an AuditConfig (e.g. replace(QUICK, length=...)), got {type(cfg).__name__}")
    out = check_audit_out(out)
    check_model_name(cfg.model)  # offline: an unknown name is refused, never looked up on the hub
    sequence_sets(cfg)  # reads the texts: a missing, empty, binary or unreadable text is refused here
    (out / "units").mkdir(parents=True, exist_ok=True)
    with locked(out, "seco-lab audit", "wait for it to finish, or pass another --out"):
        return _run_units(cfg, out, progress)


#: the tables --tables-only computes from the units (and writes again)
DERIVED_TABLES = ("strata.csv", "bias.csv", "mc.csv", "cost.csv", "data.csv", "equal_compute.csv",
                  "recommendation.json", "audit.json")
# what an audit writes into its folder: a folder holding anything else is a user's, and is refused
AUDIT_FILES = frozenset({"config.json", "sequences.json", "audit.json", "recommendation.json", "strata.csv",
                         "bias.csv", "mc.csv", "cost.csv", "data.csv", "equal_compute.csv", "report.md",
                         "cross_gram.json", "data_gram.json",
                         ".gitignore", "units", "vectors", LOCK_NAME, store.CHECKSUMS})


def rewrite_tables(out: str | Path, drop_missing_units: bool = False) -> Path:
    """``seco-lab audit --tables-only``: every table of an existing audit folder, from its stored units (a
    table edited, damaged or deleted is written again); no unit is computed.  ``drop_missing_units``
    (``--drop-missing-units``): units the tables were made from that are now gone are left out (and out of
    ``audit.json``'s ``units_done``) instead of refused (:func:`check_units_kept`)."""
    out = check_audit_out(out)
    if not (out / "config.json").is_file():
        raise ValueError(f"{out} holds no audit (no config.json): --tables-only rewrites the tables of an audit "
                         "folder; run the audit first")
    with locked(out, "seco-lab audit", "wait for it to finish, or pass another --out"):
        # the units, settings and Grams the tables come from must be as the audit wrote them (the tables not:
        # they are what this writes again)
        verified = store.verify_checksums(out, "the audit (`seco-lab audit` with its settings and this --out)",
                                          skip=DERIVED_TABLES, pin=True)
        with store.pinned(verified):  # the tables are made from the bytes verified
            check_units_kept(out, drop_missing_units)
            if not drop_missing_units:
                check_no_rows_lost(out)
            written: dict[Path, tuple[int, ...] | None] = {}
            write_results(out, written=written)
        # a Gram this call stored again (recomputed from the verified vectors, e.g. without a dropped unit's rows)
        # is not another writer's change -- unless it changed again since
        changed = [p for p in verified.changed() if p not in written or store.file_identity(p) != written[p]]
        if changed:  # the tables may come from bytes that were not the ones verified: not taken as written
            store.forget_checksums(out, DERIVED_TABLES)
            raise ValueError(f"{changed[0]} changed while the tables were made from it (something writes into {out});"
                             " the tables written are not recorded as the audit's, so no report takes them: rerun "
                             "--tables-only once the writer is done")
        return out


#: the columns naming a row of a stored table: the unit it came from (for cost.csv the timed step, one per method,
#: scheme, budget and draw), or for equal_compute.csv the (t, scheme, B) it compares -- a field edited in a unit can
#: empty one (a cost row relabelled to another budget left equal_compute.csv without that budget's scheme)
UNIT_COLUMNS = {"strata.csv": ("sequence",), "bias.csv": ("sequence",),
                "cost.csv": ("sequence", "method", "scheme", "t", "draw"), "mc.csv": ("sequence", "t", "sampler"),
                "equal_compute.csv": ("t", "scheme", "B")}
#: the key columns a stored table may leave blank (cost.csv's forward and SeCO rows have no scheme)
BLANK_COLUMNS = {"cost.csv": ("scheme",)}


def check_no_rows_lost(out: Path) -> None:
    """Rebuild the tables in memory and refuse when a unit whose rows a stored table holds would have none (its
    file gone, or damaged and left out), or ``data.csv`` would count fewer sequences -- whatever ``audit.json`` says
    (it may be missing, damaged or edited) -- so no unit's rows are dropped unasked (``--drop-missing-units`` asks).
    A row of ``equal_compute.csv`` (t, scheme, B) or ``cost.csv`` (a timed step) that would be gone is refused too.
    Rows a table holds twice, cut or damaged values are not a loss: the table is written again."""
    lost, tables = [], []
    derived = derive_results(out)
    for name, columns in UNIT_COLUMNS.items():
        try:
            stored = store.read_csv(out / name, "stored table", dtype=str)
        except (OSError, ValueError):
            continue  # missing or damaged: written again
        if not set(columns) <= set(stored.columns):
            continue
        blank = {c: "" for c in BLANK_COLUMNS.get(name, ())}
        keys = {tuple(row) for row in stored[list(columns)].fillna(blank).dropna().astype(str).values}
        table = derived[name]
        kept = ({tuple(row) for row in table[list(columns)].fillna(blank).astype(str).values}
                if set(columns) <= set(table.columns) else set())  # no rows at all: no columns either
        gone = sorted(keys - kept)
        if gone:
            tables.append(name)
            lost.append(f"{name}: {', '.join('/'.join(k) for k in gone[:3])}{' ...' if len(gone) > 3 else ''}")
    try:
        stored = store.read_csv(out / "data.csv", "stored table")
        before = float(stored.loc[stored.metric == "n_sequences", "value"].iloc[0])
        after = derived["data.csv"].set_index("metric")["value"].get("n_sequences", 0)
        if after < before:
            lost.append(f"data.csv: {before:g} -> {after:g} sequences")
    except (OSError, ValueError, KeyError, IndexError, AttributeError, TypeError):
        pass  # missing or damaged: written again
    edited = [name for name in tables if not store.as_written(out / name)]
    if edited and not unusable_units(out) and not missing_units(out):  # the units are whole: a table edited
        # (campaign 30 T11: a row's sequence field edited was blamed on the units)
        what = ("it no longer matches the checksum recorded when it was" if len(edited) == 1 else
                "they no longer match the checksums recorded when they were")
        raise ValueError(f"--tables-only: {', '.join(edited)} hold{'s' if len(edited) == 1 else ''} rows that no unit "
                         f"in {out / 'units'} holds ({'; '.join(lost[:4])}), while every unit there loads and {what}"
                         " written: the table was edited.  Nothing is rewritten.  Restore it, or rebuild the tables "
                         f"from the units: `seco-lab audit --tables-only --drop-missing-units --out {out}`")
    if lost:
        raise ValueError(f"--tables-only: the units in {out / 'units'} would rebuild the tables without the rows of "
                         f"units they hold ({'; '.join(lost[:4])}): those units' files are gone or damaged (left "
                         "out, named above), or a unit's fields were edited; nothing is rewritten.  Restore those "
                         f"unit files, or rerun the audit with its stored settings and --out {out} to compute them "
                         "again, or pass --drop-missing-units to rebuild from the units present")


def check_units_kept(out: Path, drop_missing_units: bool = False) -> None:
    """Refuse to rewrite the tables when units they were made from (``audit.json``'s ``units_done``) are gone (their
    files deleted or moved): the rewritten tables would silently lose those units' rows, unless asked for with
    ``drop_missing_units``.  A unit still there but damaged is left out and named
    (:func:`~seco_lab.studies.audit.tables.unusable_units`).  Without a readable ``audit.json`` there is nothing to
    compare (the tables are made from the units present).  Tables from no usable unit at all are always refused."""
    if not load_units(out) and any((out / name).is_file() for name in ("strata.csv", "bias.csv", "cost.csv")):
        raise ValueError(f"--tables-only: {out / 'units'} holds no usable unit, so the tables would be rewritten "
                         "empty; nothing is rewritten.  Restore the units, or rerun the audit without --tables-only to "
                         "compute them again")
    lost = missing_units(out)
    if lost and not drop_missing_units:
        raise ValueError(f"--tables-only: {missing_units_advice(out, lost)}; nothing is rewritten (the tables "
                         "would lose their rows)")


def check_audit_out(out: str | Path) -> Path:
    """The audit's ``--out``, refused before anything is written when it is no folder of its own: ``""``, ``~``,
    a file, the root, the home or the current directory or an ancestor (:func:`store.check_study_out`), and an
    existing folder holding files but no audit's ``config.json`` (an audit would overwrite its tables)."""
    path = store.check_study_out(out)  # a StudyFolderError (a ValueError) names what is wrong
    config = path / "config.json"
    if config.is_file() and not _is_audit_config(config):
        raise store.StudyFolderError(f"--out {path} holds a config.json that is not an audit's: it is not a "
                                     "seco-lab audit folder, so nothing is written; pass a new or empty folder")
    if path.is_dir() and not config.is_file():
        foreign = sorted(p.name for p in path.iterdir() if p.name not in AUDIT_FILES
                         and not re.fullmatch(store.TEMP_FILE, p.name))
        theirs = sorted(p.name for p in path.iterdir() if p.name in AUDIT_FILES - {"units", "vectors", LOCK_NAME}
                        and p.is_file())
        if foreign or theirs:
            names = ", ".join((foreign + theirs)[:5]) + (" ..." if len(foreign + theirs) > 5 else "")
            raise store.StudyFolderError(f"--out {path} is not a seco-lab audit folder (no config.json) and holds "
                                         f"files "
                             f"({names}): an audit would overwrite them, so nothing is written; pass a new or "
                             "empty folder with --out")
    return path


def _is_audit_config(path: Path) -> bool:
    try:
        stored = store.read_json(path, "audit config", store.CONFIG_MAX_BYTES)
        return isinstance(stored, dict) and isinstance(stored.get("config"), dict) and "digest" in stored
    except (OSError, ValueError):
        return False


def unit_done(path: Path) -> bool:
    """A unit is done when its JSON file reads as one (a file cut short by a crash or damaged by hand is computed
    again, and the run says so)."""
    if not path.exists() and not path.is_symlink():
        return False
    unit = read_unit(path)  # a FIFO, device or huge file is not opened: damaged
    if unit is None:
        tqdm.write(f"audit: {path} is damaged (not a readable JSON object): the unit is computed again")
        return False
    if isinstance(unit, dict) and (why := stale_reason(unit)) is not None:
        tqdm.write(f"audit: {path} is stale -- {why}: the unit is computed again")
        return False
    if not store.as_written(path):
        tqdm.write(f"audit: {path} is not the unit this audit wrote (its SHA-256 differs from units/"
                   f"{store.CHECKSUMS}): the unit is computed again")
        return False
    return isinstance(unit, dict)


def _keep_tables_it_would_not_write(out: Path) -> None:
    """Before a rerun writes the tables again from the stored units: a stored table they do not give (an edit the
    user sealed with ``seco-lab seal``: campaign 41 E4) is kept as ``NAME.replaced-N.csv``, not written over."""
    from ..rerun_tables import keep_aside, table_difference

    for name, derived in derive_results(out, write_grams=False).items():
        path = out / name
        if not name.endswith(".csv") or not path.is_file():
            continue
        try:
            stored = store.read_csv(path, "stored table")
        except (OSError, ValueError):
            stored = None
        difference = None if stored is None else table_difference(stored, derived)
        if difference is None or difference > 1:
            aside = keep_aside(path)
            print(f"seco-lab audit: {name} is not what the stored units give (edited?): kept as {aside.name}",
                  file=sys.stderr)


def _run_units(cfg: AuditConfig, out: Path, progress: bool) -> Path:
    # a table the user edited (a column of notes added) is never replaced by the rerun's (campaign 39 C6)
    store.check_tables_unedited(out, [n for n in DERIVED_TABLES if n.endswith(".csv")], "the audit's rerun")
    (out / "vectors").mkdir(exist_ok=True)
    if not (out / ".gitignore").exists():  # the flat gradients are large and recomputable: never committed
        store.atomic_write(out / ".gitignore", "vectors/\n")
    for folder in (out, out / "units", out / "vectors"):  # every file written from now on is recorded (config.json
        store.start_checksums(folder)                     # too: _check_folder writes it)
    _check_folder(cfg, out)
    torch.set_num_threads(cfg.threads)
    strata, data = sequence_sets(cfg)
    names = {s.name: s for s in strata}
    names.update({data_name(cfg, s): s for s in data})
    store.atomic_write_json(out / "sequences.json", {n: vars(s) if not hasattr(s, "__dataclass_fields__") else
                       {f: getattr(s, f) for f in s.__dataclass_fields__} for n, s in names.items()})
    units = plan_units(cfg)
    todo = [(stem, job) for stem, job in units if not unit_done(out / "units" / f"{stem}.json")]
    check_units(cfg, load_units(out), out)  # a unit copied from another audit is refused, named
    if len(todo) < len(units):
        _keep_tables_it_would_not_write(out)
        write_results(out)  # the tables follow the settings just written to config.json
    for stem, job in (bar := tqdm(todo, desc="audit units", disable=not progress)):
        bar.set_postfix_str(stem)
        c, w = time.process_time(), time.perf_counter()
        kind = job[0]
        if kind == "exact":
            res = measure.exact_unit(cfg)
        elif kind == "strata":
            _restore_vectors(cfg, out, "strata", names)  # the cross-sequence Gram needs every sequence's rows
            res = measure.strata_unit(cfg, job[1], out / "vectors" / f"strata-{job[1].name}.pt")
        elif kind == "cost":
            res = measure.cost_unit(cfg, job[1], progress)
        elif kind == "mc":
            _strata_vectors(cfg, out, job[1])
            res = measure.mc_unit(cfg, job[1], job[2], job[3], out / "vectors" / f"strata-{job[1].name}.pt",
                                  progress)
        else:
            spec = job[1]
            sv = out / "vectors" / f"strata-{spec.name}.pt" if cfg.data_len == cfg.length else None
            if sv is not None and (out / "units" / f"strata-{spec.name}.json").is_file():
                _strata_vectors(cfg, out, spec)
            _restore_vectors(cfg, out, "data", names)
            res = measure.data_unit(cfg, spec, out / "vectors" / f"data-{data_name(cfg, spec)}.pt", sv)
        res.update(unit=stem, stage=kind, digest=cfg.digest(), unit_cpu_s=time.process_time() - c,
                   unit_wall_s=time.perf_counter() - w, threads=cfg.threads,
                   finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        store.atomic_write_json(out / "units" / f"{stem}.json", res)
        write_results(out)
    return write_results(out)


def _strata_vectors(cfg: AuditConfig, out: Path, spec: SequenceSpec) -> None:
    """Make sure the flat strata rows of a finished strata unit are on disk (recomputed and checked against the
    stored unit when absent: the vectors are not committed, so a fresh clone resuming an audit lacks them)."""
    path = out / "vectors" / f"strata-{spec.name}.pt"
    if path.is_file():
        return
    unit = out / "units" / f"strata-{spec.name}.json"
    tqdm.write(f"audit: recomputing the strata vectors of {spec.name} (not stored here; checked against {unit})")
    stored = read_unit(unit)
    if stored is None:
        raise ValueError(f"{unit} is damaged (not a readable JSON object): remove it and rerun the audit (the unit is "
                         "computed again)")
    measure.restore_strata_vectors(cfg, spec, path, stored)


def _restore_vectors(cfg: AuditConfig, out: Path, stage: str, specs: dict[str, SequenceSpec]) -> None:
    """Recompute the absent flat vectors of every finished ``stage`` unit ('strata' or 'data'), each checked
    against what its unit stored, so that the cross-sequence Gram matrices written after the next unit cover
    every finished sequence (a resumed audit on a fresh clone has the units' JSON but not the vectors)."""
    for path in sorted((out / "units").glob(f"{stage}-*.json")):
        name = path.stem.removeprefix(f"{stage}-")
        if (out / "vectors" / f"{path.stem}.pt").is_file():
            continue
        stored = read_unit(path)
        if stored is None or stale_reason(stored) is not None:
            continue  # a damaged unit is computed again (unit_done said so), its vectors with it
        tqdm.write(f"audit: recomputing the vectors of {path.stem} (not stored here; checked against {path})")
        if stage == "strata":
            _strata_vectors(cfg, out, specs[name])
            continue
        sv = out / "vectors" / f"strata-{name}.pt" if cfg.data_len == cfg.length else None
        res = measure.data_unit(cfg, specs[name], out / "vectors" / f"{path.stem}.pt", sv)
        diff = abs(res["g_norm"] - stored["g_norm"]) / max(stored["g_norm"], 1e-300)
        if not diff <= measure.RECOMPUTE_TOLERANCE:
            (out / "vectors" / f"{path.stem}.pt").unlink()
            store.forget_checksums(out / "vectors", [f"{path.stem}.pt"])
            raise ValueError(f"the gradient of {path.stem} recomputed here differs from the stored unit by {diff:.2e} "
                             f"(relative norm; tolerance {measure.RECOMPUTE_TOLERANCE:g}): the code or the model "
                             "changed since it was stored; rerun the audit into a new --out")


# --------------------------------------------------------------------------- tables


# --------------------------------------------------------------------------- command line


def run_from_args(args: argparse.Namespace) -> int:
    """Run the audit an argument namespace describes (``add_arguments`` plus quick/out/progress): for a study
    registry; ``--out`` defaults to the committed folder with --committed."""
    if not getattr(args, "quick", False):
        args.committed = True  # the registered study is the committed one
    cfg = config_from_args(args)
    run_audit(cfg, args.out, progress=getattr(args, "progress", True))
    return 0


def main(argv=None) -> int:
    """``seco-lab audit ARGS``."""
    return run_args(build_parser().parse_args(argv))


def run_args(ns: argparse.Namespace) -> int:
    """``seco-lab audit`` on parsed options (:func:`seco_lab.studies.audit.options.build_parser`)."""
    out = ns.out or (Path("audit-quick") if ns.quick else DEFAULT_OUT)
    try:
        report = check_report_of(ns, out)  # before anything is computed: never over a user's file or a folder
        if ns.tables_only:
            check_tables_only(ns)
            rewrite_tables(out, ns.drop_missing_units)
        else:
            check_drop_missing_units(ns)
            run_audit(config_from_args(ns), out, progress=not ns.no_progress)
        from ...report.audit import write_report

        report = write_report(out, report)
    except (ValueError, TypeError, FileNotFoundError, ImportError, MemoryError, FolderBusy) as e:
        print(f"seco-lab audit: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a report or results path the system refuses (a folder, no permission, a full disk)
        print(f"seco-lab audit: error: {e.filename or out}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"seco-lab audit: interrupted; the units finished so far are stored in {out}/units: rerun the same "
              "command to resume", file=sys.stderr)
        return 130
    print(f"seco-lab audit: results in {out}, report {report}")
    return 0
