"""The registry of studies: name -> how to run it, how to report it, where its results live.

    seco-lab study NAME [--quick] [--out DIR] [--jobs N] [--fresh] [--no-progress] [NAME's options]
    seco-lab report NAME [--quick] [--results DIR] [--out FILE]
    make NAME-study  =  seco-lab study NAME && seco-lab report NAME

Each default folder is written here and nowhere else.  A study's functions are named as
``"module:function"`` strings, imported only when that study runs, so the registry imports
nothing of the package (no import circles) and ``seco-lab --help`` stays fast.  The contract:

* ``run(args) -> int``: compute every missing cell into ``args.out`` (a Path, already set to the
  default folder -- ``quick_results`` with ``--quick`` -- unless ``--out`` was given;
  ``args.default_out`` says which), with ``args.quick``, ``args.jobs`` (None: the study's own
  default), ``args.fresh``, ``args.progress``; resumable through :class:`seco_lab.store.StudyFolder`
  and :func:`seco_lab.studies.runner.run_cells`.
* ``add_arguments(parser)``: the study's own options (optional).
* ``report(results, out_md) -> Path``: the Markdown report (and figures beside it) from stored
  results only; raises :class:`seco_lab.report.markdown.MissingResultsError` when they lack.

Registering a study is one line at the end of this module, e.g.::

    register(Study("audit", "what the audit measures", results="reports/audit", report_file="reports/audit.md",
                   report="seco_lab.studies.audit.report:audit_report",
                   run="seco_lab.studies.audit.study:run_from_args",
                   add_arguments="seco_lab.studies.audit.study:add_arguments",
                   quick_results="reports/_work/audit_quick"))

and its name added to ``STUDIES`` (and, with a quick mode, ``QUICK_STUDIES``) at the top of the Makefile,
whose pattern rules then give ``make audit-study`` (``seco-lab study audit`` then ``seco-lab report audit``),
``make audit-study-quick`` and a line of ``make report`` (``tests/test_studies.py`` checks the pairing).
Reports whose results come from a benchmark in ``experiments/`` register with ``run=None``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..store import (  # noqa: F401 (the report digests: defined here before)
    GENERATED_MARK,
    REPORT_DIGEST,
    check_parent_folder,
    is_generated_report,
    report_problem,
    with_report_digest,
)

__all__ = ["ALIASES", "STUDIES", "DefaultsHelpFormatter", "Study", "build_report_parser", "build_study_parser",
           "check_report_target", "file_arg", "path_arg", "register", "report_main", "report_problem", "resolve",
           "study_main", "with_report_digest"]


def path_arg(text: str) -> Path:
    """An argparse ``type`` for a folder option: an empty value is refused (``Path("")`` would silently mean the
    current directory, where a run or a report would then write)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder (use . for the current directory)")
    return Path(text)


def file_arg(example: str):
    """An argparse ``type`` for a file option, refusing an empty value with an ``example`` name (campaign 28: the
    folder advice "use ." led to a refusal of the folder)."""
    def parse(text: str) -> Path:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"is empty: name a file, e.g. {example}")
        return Path(text)
    return parse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (flags, defaults worked out later)."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.nargs == 0 or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


@dataclass(frozen=True)
class Study:
    """One registered study (or benchmark report): see the module docstring for the contract."""

    name: str
    summary: str
    results: Path  # default results folder, relative to the current directory
    report_file: Path  # default Markdown report
    report: str  # "module:function" (results, out_md) -> Path
    run: str | None = None  # "module:function" (args) -> int; None: produced by `produce`
    add_arguments: str | None = None  # "module:function" (parser) -> None
    quick_results: Path | None = None  # default results folder of --quick (None: no quick mode)
    produce: str = ""  # how the results are produced, for messages (default: `make NAME-study`)
    check_args: str | None = None  # "module:function" (args) -> None, without torch: ValueError for a refused option
    stored_files: tuple[str, ...] = ()  # what its report reads from the results folder (checked before pandas)
    aliases: tuple[str, ...] = field(default=())

    def __post_init__(self):
        for name in ("results", "report_file", "quick_results"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if not self.produce:
            object.__setattr__(self, "produce", f"`make {self.name}-study` (`seco-lab study {self.name}`)")

    @property
    def quick_report_file(self) -> Path | None:
        return None if self.quick_results is None else self.quick_results / "report.md"


STUDIES: dict[str, Study] = {}
ALIASES: dict[str, str] = {}  # old report names -> registered names


def register(study: Study) -> Study:
    """Add ``study`` to the registry (its name and aliases must be new)."""
    for name in (study.name, *study.aliases):
        if name in STUDIES or name in ALIASES:
            raise ValueError(f"a study named {name!r} is already registered")
    STUDIES[study.name] = study
    ALIASES.update({alias: study.name for alias in study.aliases})
    return study


def resolve(ref: str) -> Callable:
    """The function a ``"module:function"`` string names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def lookup(name: str) -> Study:
    return STUDIES[ALIASES.get(name, name)]


# --------------------------------------------------------------------------- seco-lab study NAME


def build_study_parser(study: Study, prog: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog or f"seco-lab study {study.name}", formatter_class=DefaultsHelpFormatter,
                                 description=f"{study.summary} Resumable: a rerun skips finished cells.")
    if study.quick_results is not None:
        ap.add_argument("--quick", action="store_true", help=f"a small grid, for a smoke run (results in "
                                                             f"{study.quick_results})")
    ap.add_argument("--out", default=None, help=f"results folder, relative to the current directory "
                    f"(default: {study.results}" + (f", {study.quick_results} with --quick)"
                                                    if study.quick_results else ")"))
    ap.add_argument("--jobs", type=int, default=None, help="worker processes (default: the study's own; never "
                                                           "more than the cells to compute or the CPU count)")
    ap.add_argument("--fresh", action="store_true", help="discard results already stored in --out")
    ap.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    if study.add_arguments:
        resolve(study.add_arguments)(ap)
    return ap


def study_main(argv=None, prog: str | None = None) -> int:
    """``seco-lab study NAME ...`` (``prog`` names an alias command, e.g. ``seco-lab bias-study``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    runnable = [s.name for s in STUDIES.values() if s.run]
    if prog is None:
        if not argv or argv[0] in ("-h", "--help"):
            print(f"usage: seco-lab study NAME [options]\n\nstudies: {', '.join(runnable)} "
                  "(`seco-lab study NAME --help` for a study's options)")
            return 0 if argv else 2
        if argv[0] not in STUDIES or not STUDIES[argv[0]].run:
            known = STUDIES.get(argv[0])
            why = f"its results come from {known.produce}" if known else f"studies: {', '.join(runnable)}"
            print(f"seco-lab study: error: {argv[0]!r} is not a study to run here; {why}", file=sys.stderr)
            return 2
        study, argv = STUDIES[argv[0]], argv[1:]
    else:
        study = STUDIES[prog.split()[-1].removesuffix("-study")]
    ap = build_study_parser(study, prog)
    args = ap.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs must be >= 1")
    quick = getattr(args, "quick", False)
    args.quick, args.default_out = quick, args.out is None
    from ..folder_lock import FolderBusy
    from ..store import StudyFolderError, check_study_out

    try:
        default = study.quick_results if quick else study.results
        args.out = check_study_out(default if args.out is None else args.out)
    except StudyFolderError as e:
        ap.error(str(e))
    if study.check_args:  # before torch: a refused option answers at once
        try:
            resolve(study.check_args)(args)
        except ValueError as e:
            print(f"{ap.prog}: error: {e}", file=sys.stderr)
            return 2
    from .runner import Terminated, WorkerDied, terminate_as_interrupt

    try:
        with terminate_as_interrupt():  # SIGTERM stops the study (and its workers) as Ctrl-C does
            return resolve(study.run)(args)
    except (StudyFolderError, FolderBusy) as e:
        ap.error(str(e))
    except KeyboardInterrupt as e:
        print(f"{ap.prog}: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; the cells finished so "
              f"far are stored in {args.out}: rerun the same command to resume", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    except WorkerDied as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:  # a study's own refusal of its settings (they name what is wrong)
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # a stored file the run needs is absent (e.g. --collect-only on no study)
        print(f"{ap.prog}: error: {e.strerror + ': ' + str(e.filename) if e.filename else e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{ap.prog}: error: cannot write the results to {args.out}: {e.strerror or e} "
              "(pass a writable folder with --out)", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- seco-lab report NAME


def build_report_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="seco-lab report", formatter_class=DefaultsHelpFormatter,
        description="Write a Markdown report and its figures (in figures/ beside it) from stored results; every "
                    "number comes from the stored files. Paths are relative to the current directory.")
    ap.add_argument("which", choices=(*STUDIES, *ALIASES), metavar="NAME",
                    help="; ".join(f"{s.name}: {s.summary.rstrip('.')}" for s in STUDIES.values())
                    + " (old names: " + ", ".join(f"{a} = {n}" for a, n in ALIASES.items()) + ")")
    ap.add_argument("--quick", action="store_true", help="report the --quick results (into their folder)")
    ap.add_argument("--results", type=path_arg, default=None, help="folder of stored results (default: " + ", ".join(
        f"{s.name}: {s.results}" for s in STUDIES.values()) + ")")
    ap.add_argument("--out", type=file_arg("report.md"), default=None, help="Markdown file to write (default: "
                    + ", ".join(f"{s.name}: {s.report_file}" for s in STUDIES.values()) + ")")
    return ap


def check_report_target(out: Path, results: str | Path, name: str, option: str) -> None:
    """Refuse a Markdown report target that is a folder, not a ``.md`` file, under a file, or an existing file that
    is not a report seco-lab generated (a user's file is never written over); ValueError naming it.  ``results``:
    the stored results the report is made from (a ``.md`` is never one of them)."""
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{option} {out} is a folder: pass the Markdown file to write, e.g. {out / name}")
    if out.suffix.lower() != ".md":
        example = out.with_suffix(".md") if out.suffix else Path(name) if out.exists() else out / name
        if out.exists() or out.is_symlink():
            raise ValueError(f"{option} {out} exists and is not a Markdown report: the report is not written over it "
                             f"(it could be a file of yours or one of the stored results); pass a .md file, e.g. "
                             f"{example}")
        raise ValueError(f"{option} {out} is not a Markdown report file (the report is Markdown): pass a .md file, "
                         f"e.g. {example}")
    check_parent_folder(out, option)
    try:
        os.fsdecode(out).encode("utf-8")
    except UnicodeEncodeError:  # its figures are linked by their path, in UTF-8 Markdown text
        raise ValueError(f"{option} {os.fsencode(out)!r} is not named in UTF-8, which the report's links to its "
                         "figures (UTF-8 text) cannot spell; name the report in UTF-8") from None
    problem = report_problem(out) if out.exists() or out.is_symlink() else None
    if problem:
        raise ValueError(f"{option} {out} {problem}")


def check_run_dirs(run_dirs) -> None:
    """Each of ``run_dirs`` holds a ``metrics.jsonl`` (what a run writes first), and each is named once (by any
    path: a run drawn twice would be two identical curves under two labels); ValueError naming the others."""
    missing = [str(d) for d in run_dirs if not (Path(d) / "metrics.jsonl").exists()]
    if missing:
        raise ValueError(f"not a run directory (no metrics.jsonl): {', '.join(missing)}")
    seen: dict[str, str] = {}
    for d in run_dirs:
        real = os.path.realpath(d)
        if real in seen:
            same = f"{seen[real]} and {d} are the same run" if str(d) != seen[real] else f"{d} is named twice"
            raise ValueError(f"{same}: name each run once")
        seen[real] = str(d)


def report_main(argv=None) -> int:
    """``seco-lab report NAME [--quick] [--results DIR] [--out FILE]``."""
    ap = build_report_parser()
    a = ap.parse_args(argv)  # before any report module is imported: --help and usage errors answer at once
    study = lookup(a.which)
    if a.quick and study.quick_results is None:
        ap.error(f"{study.name} has no --quick mode")
    if a.quick and a.results and a.out:
        ap.error(f"--quick only chooses the default folders (results {study.quick_results}, report "
                 f"{study.quick_report_file}); with --results and --out both given it would change nothing: drop "
                 "--quick (the report is made from whatever study --results holds)")
    results = a.results or (study.quick_results if a.quick else study.results)
    out = a.out or (study.quick_report_file if a.quick else study.report_file)
    try:
        check_report_target(out, results, study.report_file.name, "--out")
    except ValueError as e:
        ap.error(str(e))
    produce = (f"`make {study.name}-study-quick` (`seco-lab study {study.name} --quick`)"
               if a.quick and not a.results else study.produce)
    if not Path(results).is_dir():  # said before pandas and matplotlib are imported
        print(f"{ap.prog}: error: {results} lacks the stored results (no such folder): run {produce} first, "
              "or pass the folder that holds them with --results", file=sys.stderr)
        return 2
    from ..store import lacking_files, pinned, verify_checksums

    lacking = lacking_files(results, study.stored_files, study.produce)
    if lacking:
        print(f"{ap.prog}: error: {lacking}", file=sys.stderr)
        return 2
    try:  # every results file as the study wrote it (its checksum file): an edited value is never reported
        verified = verify_checksums(results, study.produce, pin=True)  # the report reads the bytes verified
    except (OSError, ValueError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    from ..report.figures import FigureTargetError, staged_figures  # matplotlib: after the argument checks
    from ..report.markdown import MissingResultsError  # pandas

    try:
        with staged_figures(), pinned(verified):  # every figure's path checked before anything is written
            path = resolve(study.report)(results, out)
    except (MissingResultsError, FigureTargetError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        reading = e.filename is not None and Path(e.filename).resolve().is_relative_to(Path(results).resolve())
        if reading or not Path(results).is_dir():  # the stored results, not the report, are the problem
            print(f"{ap.prog}: error: cannot read the results in {results}: {e.strerror or e} (run `seco-lab "
                  f"study {study.name}` first, or pass the folder that holds them with --results)", file=sys.stderr)
        else:
            print(f"{ap.prog}: error: cannot write {out}: {e.strerror or e} (pass a writable path with --out)",
                  file=sys.stderr)
        return 2
    changed = verified.changed()
    if changed:  # replaced while the report read it (a writer at work, or swapped out and back): what was read is
        # not known to be what was verified
        Path(path).unlink(missing_ok=True)
        print(f"{ap.prog}: error: {changed[0]} changed while the report read it (something writes into {results}); "
              f"the report it gave may mix two versions and was removed: rerun the report once the writer is done",
              file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------- the registered studies

register(Study("bias", "every SpaCO compensation scheme against the exact gradient, over depths L, chunk counts k, "
               "budgets t and seeds.", results="reports/bias_study", report_file="reports/bias_study.md",
               quick_results="reports/_work/bias_study_quick", report="seco_lab.report.bias:bias_report",
               run="seco_lab.studies.bias.driver:run_from_args",
               add_arguments="seco_lab.studies.bias.options:add_arguments",
               check_args="seco_lab.studies.bias.options:check_draws",
               stored_files=("results.csv", "paper.csv", "checks.csv", "groups.csv", "convergence.csv", "study.json"),
               produce="`make bias-study` (`seco-lab study bias`, alias `seco-lab bias-study`)"))
register(Study("train", "does the bias change what a model learns? every scheme trained against SeCO.",
               results="reports/training_study", report_file="reports/training_study.md",
               quick_results="reports/_work/training_study_quick", aliases=("training-study",),
               report="seco_lab.studies.train.report:training_study_report",
               stored_files=("results.csv.gz", "runs.csv", "study.json"),
               run="seco_lab.studies.train.driver:run_from_args",
               add_arguments="seco_lab.studies.train.options:add_arguments"))
register(Study("real", "hop strata and each scheme's exact bias on the pretrained SmolLM2-135M (stdlib text).",
               results="reports/real_study/k16x16", report_file="reports/real_study.md",
               report="seco_lab.report.real:real_report", run="seco_lab.studies.real:run_from_args",
               stored_files=("study.json", "strata.csv", "results.csv"),
               add_arguments="seco_lab.studies.real_config:add_arguments"))
register(Study("audit", "a gradient estimator audited on SmolLM2-135M at k = 128: strata with the remainder, exact "
               "bias, sampling against data noise, cost, equal compute.", results="reports/audit/k128",
               report_file="reports/audit.md", quick_results="reports/_work/audit_quick",
               report="seco_lab.report.audit:write_report", run="seco_lab.studies.audit.driver:run_from_args",
               stored_files=("config.json", "audit.json"),  # a training run's folder is no audit (campaign 34 X5)
               add_arguments="seco_lab.studies.audit.options:add_arguments",
               produce="`make audit` (`seco-lab study audit`, or `seco-lab audit --committed`)"))
register(Study("bench", "time and memory of every method as sequences grow (benchmarks in experiments/).",
               results="reports/bench", report_file="reports/benchmarks.md",
               report="seco_lab.report.bench:bench_report", stored_files=("results.csv", "bench.json"),
               produce="`make bench` (`python -m experiments.bench` in the repository)"))
register(Study("train-compare", "the training modes compared: throughput and far-token loss (experiments/).",
               results="reports/training", report_file="reports/training.md", aliases=("training",),
               report="seco_lab.report.training:training_report",
               stored_files=("throughput.csv", "far_loss.csv", "training.json"),
               produce="`make train-compare` (`python -m experiments.train_compare` in the repository)"))
