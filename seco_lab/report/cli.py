"""``seco-lab report {bias,bench,training,real}``: a report and its figures from stored results."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..study.driver import DefaultsHelpFormatter
from ..train_study.report import training_study_report
from .bench import bench_report
from .bias import bias_report
from .markdown import MissingResultsError
from .real import DEFAULT_DIR as REAL_DIR
from .real import real_report
from .training import training_report

# report -> (function, default results folder, default Markdown file), relative to the current directory
REPORTS = {
    "bias": (bias_report, Path("reports/bias_study"), Path("reports/bias_study.md")),
    "bench": (bench_report, Path("reports/bench"), Path("reports/benchmarks.md")),
    "training": (training_report, Path("reports/training"), Path("reports/training.md")),
    "real": (real_report, REAL_DIR, Path("reports/real_study.md")),
    "training-study": (training_study_report, Path("reports/training_study"), Path("reports/training_study.md")),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="seco-lab report", formatter_class=DefaultsHelpFormatter,
        description="Write a Markdown report and its figures (in figures/ beside it) from stored results; every "
                    "number comes from the stored files. Paths are relative to the current directory.")
    ap.add_argument("which", choices=tuple(REPORTS), help="bias: the bias study; bench: time and memory "
                    "benchmarks; training: the training-modes comparison; real: hop strata and scheme bias on the "
                    "pretrained SmolLM2-135M; training-study: does the bias change what a model learns")
    ap.add_argument("--results", type=Path, default=None,
                    help="folder of stored results (default: " + ", ".join(
                        f"{k}: {v[1]}" for k, v in REPORTS.items()) + ")")
    ap.add_argument("--out", type=Path, default=None, help="Markdown file to write (default: " + ", ".join(
        f"{k}: {v[2]}" for k, v in REPORTS.items()) + ")")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    make, results, out = REPORTS[a.which]
    results = a.results if a.results is not None else results
    out = a.out if a.out is not None else out
    if out.is_dir():
        ap.error(f"--out {out} is a folder: pass the Markdown file to write, e.g. {out / out.name}.md")
    try:
        path = make(results, out)
    except MissingResultsError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{ap.prog}: error: cannot write {out}: {e.strerror or e} (pass a writable path with --out)",
              file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
