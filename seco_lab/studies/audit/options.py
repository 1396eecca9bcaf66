"""The audit's command-line options, importable without torch (``seco-lab audit --help`` and ``seco-lab study
audit --help`` answer at once); :mod:`.driver` runs what they ask for."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..registry import path_arg
from .config import DEFAULT, STAGES

__all__ = ["DEFAULT_OUT", "add_arguments", "build_parser"]

DEFAULT_OUT = Path("audit-results")
DESCRIPTION = ("Audit a chunk-wise gradient estimator on a model and text: exact bias from hop strata, sampling noise "
               "against data noise, and the answer at equal compute (resumable, unit by unit).")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="seco-lab audit", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny random HF Llama, < 2 minutes (tests, first look)")
    ap.add_argument("--out", type=path_arg, default=None, help=f"results folder (default: ./{DEFAULT_OUT})")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--report", type=path_arg, default=None, help="also write the Markdown report here")
    ap.add_argument("--tables-only", action="store_true",
                    help="rewrite the tables (and the report) of --out from its stored units; compute nothing")
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
