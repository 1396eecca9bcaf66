"""The audit's command-line options, importable without torch (``seco-lab audit --help`` and ``seco-lab study
audit --help`` answer at once); :mod:`.driver` runs what they ask for."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..registry import file_arg, path_arg
from .config import COMMITTED, DEFAULT, QUICK, STAGES, AuditConfig

__all__ = ["DEFAULT_OUT", "add_arguments", "build_parser", "check_args", "check_report_of", "check_drop_missing_units",
           "check_tables_only", "config_from_args"]

DEFAULT_OUT = Path("audit-results")
DESCRIPTION = ("Audit a chunk-wise gradient estimator on a model and text: exact bias from hop strata, sampling noise "
               "against data noise, and the answer at equal compute (resumable, unit by unit).")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="seco-lab audit", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny random HF Llama, < 2 minutes (tests, first look)")
    ap.add_argument("--out", type=path_arg, default=None, help=f"results folder (default: ./{DEFAULT_OUT})")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", type=file_arg("report.md"), default=None, help="also write the Markdown report here")
    ap.add_argument("--tables-only", action="store_true",
                    help="rewrite the tables (and the report) of --out from its stored units; compute nothing")
    ap.add_argument("--drop-missing-units", action="store_true",
                    help="with --tables-only: rebuild the tables from the units present even when units they were "
                         "made from are gone (their rows are dropped, and they leave audit.json's units_done)")
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The audit's own options (also for a study registry's ``seco-lab study audit``)."""
    d = DEFAULT
    ap.add_argument("--committed", action="store_true", help="the committed study's settings (issue 21 §4)")
    ap.add_argument("--model", help=f"smollm2-135m | a .gguf file | a local HF folder | tiny | hf-llama "
                                    f"(default: {d.model})")
    ap.add_argument("--params", choices=["lora", "full"])
    ap.add_argument("--lora-r", type=int)
    ap.add_argument("--lora-alpha", type=int)
    ap.add_argument("--lora-targets", nargs="+")
    ap.add_argument("--texts", nargs="+", metavar="[KIND:]PATH",
                    help="text files or folders (windows come from the first 16 MiB of each file)")
    ap.add_argument("--length", type=int, help=f"tokens per sequence (default: {d.length})")
    ap.add_argument("--chunk-size", type=int, help=f"(default: {d.chunk_size})")
    ap.add_argument("--dtype", choices=["float32", "float64"])
    ap.add_argument("--budgets", type=int, nargs="+", metavar="T")
    ap.add_argument("--schemes", nargs="+")
    ap.add_argument("--max-hops", type=int, metavar="P")
    ap.add_argument("--num-sequences", type=int)
    ap.add_argument("--mc-draws", type=int)
    ap.add_argument("--mc-budgets", type=int, nargs="+", metavar="T")
    ap.add_argument("--mc-sequences", type=int)
    ap.add_argument("--cost-sequences", type=int)
    ap.add_argument("--cost-draws", type=int)
    ap.add_argument("--data-sequences", type=int)
    ap.add_argument("--data-length", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--stages", nargs="+", choices=STAGES)


def config_from_args(ns: argparse.Namespace) -> AuditConfig:
    if getattr(ns, "quick", False) and ns.committed:
        raise ValueError("--quick and --committed exclude each other")
    base = QUICK if getattr(ns, "quick", False) else COMMITTED if ns.committed else DEFAULT
    keys = ("model", "params", "lora_r", "lora_alpha", "lora_targets", "texts", "length", "chunk_size", "dtype",
            "budgets", "schemes", "max_hops", "num_sequences", "mc_draws", "mc_budgets", "mc_sequences",
            "cost_sequences", "cost_draws", "data_sequences", "data_length", "threads", "stages")
    given = {k: getattr(ns, k) for k in keys if getattr(ns, k) is not None}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    if "budgets" in given and "mc_budgets" not in given:
        given["mc_budgets"] = tuple(t for t in base.mc_budgets if t in given["budgets"]) or given["budgets"][:1]
    return replace(base, **given)


def check_tables_only(ns: argparse.Namespace) -> None:
    """``--tables-only`` computes nothing: the audit's settings are the stored ones, so a setting given with it
    would be silently ignored -- refused, naming it."""
    probe = build_parser().parse_args([])
    given = [f"--{k.replace('_', '-')}" for k, v in vars(ns).items()
             if k not in ("out", "report", "no_progress", "tables_only", "drop_missing_units")
             and v != getattr(probe, k, v)
             and not (k == "quick" and ns.out is None)]  # --quick without --out names the folder audit-quick
    if given:
        raise ValueError(f"--tables-only rewrites the tables of the audit stored in --out with its stored settings; "
                         f"{', '.join(given)} would be ignored: drop {'it' if len(given) == 1 else 'them'}, or run "
                         "the audit without --tables-only")


def check_drop_missing_units(ns: argparse.Namespace) -> None:
    """``--drop-missing-units`` only changes what ``--tables-only`` does: refused without it, not ignored."""
    if getattr(ns, "drop_missing_units", False) and not ns.tables_only:
        raise ValueError("--drop-missing-units rebuilds the stored tables without the units gone from --out's units/ "
                         "and works with --tables-only only: add --tables-only (an audit run computes missing units "
                         "again)")


def check_report_of(ns: argparse.Namespace, out: Path) -> Path:
    """The report the audit writes (``--report``, by default ``OUT/report.md``), refused before anything is computed
    when it is a folder or a file seco-lab did not generate (a user's notes saved as ``OUT/report.md`` included)."""
    from ..registry import check_report_target

    report = Path(ns.report) if ns.report is not None else Path(out) / "report.md"
    check_report_target(report, out, "report.md", "--report" if ns.report is not None else "the report")
    return report


def check_args(ns: argparse.Namespace) -> None:
    """What ``seco-lab audit`` checks before torch is imported (a refused argument answers at once): the report
    target, ``--tables-only`` with settings it would ignore, and the audit's settings (:class:`AuditConfig`)."""
    out = ns.out or (Path("audit-quick") if ns.quick else DEFAULT_OUT)
    check_report_of(ns, out)
    if ns.tables_only:
        check_tables_only(ns)
        if not Path(out).exists():  # the driver says the same again, under the folder's lock
            raise ValueError(f"{out} holds no audit (no such folder): --tables-only rewrites the tables of an audit "
                             "folder; run the audit first")
        if Path(out).is_dir() and not (Path(out) / "config.json").is_file():
            raise ValueError(f"{out} holds no audit (no config.json): --tables-only rewrites the tables of an audit "
                             "folder; run the audit first")
    else:
        check_drop_missing_units(ns)
        cfg = config_from_args(ns)
        model = str(getattr(cfg, "model", ""))
        if model.lower().endswith(".gguf") and not Path(model).expanduser().is_file():
            raise ValueError(f"model {model!r}: no such .gguf file")  # as sources.check_model_name, before torch
