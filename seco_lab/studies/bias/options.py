"""The bias study's command-line options, importable without torch, numpy or pandas (``seco-lab study bias
--help`` answers at once), and the draw counts they show, which :mod:`.definition` uses as its defaults."""

from __future__ import annotations

import argparse

__all__ = ["BATCHES", "COST_GUARD_HOURS", "DEFAULT_DRAWS", "DEFAULT_PAPER_DRAWS", "MAX_DRAWS", "MAX_PAPER_DRAWS",
           "PAPER_BATCHES", "QUICK_DRAWS", "QUICK_PAPER_BATCHES", "QUICK_PAPER_DRAWS", "add_arguments", "check_draws"]

#: Monte Carlo draws per cell and sampler (chain-basis groups / paper-settings groups), default and --quick
DEFAULT_DRAWS, QUICK_DRAWS = 10_000, 2000
DEFAULT_PAPER_DRAWS, QUICK_PAPER_DRAWS = 30, 12
#: the most Monte Carlo draws per cell and sampler the command line takes (1000 times the defaults): beyond it
#: a draw count is a typo, not a study
MAX_DRAWS, MAX_PAPER_DRAWS = 1000 * DEFAULT_DRAWS, 1000 * DEFAULT_PAPER_DRAWS
#: jackknife batches of the Monte Carlo draws: chain-basis cells, paper-settings cells (default, --quick)
BATCHES, PAPER_BATCHES, QUICK_PAPER_BATCHES = 50, 10, 3
#: a study estimated above this much worker time is refused unless --force
COST_GUARD_HOURS = 48


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The bias study's own options of ``seco-lab study bias`` (``seco_lab.studies.registry`` adds the common ones)."""
    ap.add_argument("--draws", type=int, default=None,
                    help=f"Monte Carlo draws per cell and sampler (default: {DEFAULT_DRAWS}, {QUICK_DRAWS} "
                         "with --quick; rounded down to a multiple of the batch count)")
    ap.add_argument("--paper-draws", type=int, default=None,
                    help=f"Monte Carlo draws per paper-settings cell and sampler (default: {DEFAULT_PAPER_DRAWS}, "
                         f"{QUICK_PAPER_DRAWS} with --quick; rounded down to a multiple of the batch count; 0 skips "
                         "the paper-settings groups)")
    ap.add_argument("--arch", default="tiny", choices=("tiny", "hf-llama", "hf-qwen2"),
                    help="model of every cell (HF architectures need the [hf] extra; the default folder gets the "
                         "suffix _ARCH)")
    ap.add_argument("--force", action="store_true",
                    help=f"run a study estimated above {COST_GUARD_HOURS} hours of worker time (refused otherwise)")


def check_draws(args: argparse.Namespace) -> None:
    """The draw counts of the command line, checked before torch is imported (a refused count answers at once):
    ValueError for a count above the most the study takes or below two draws per jackknife batch."""
    quick = getattr(args, "quick", False)
    for flag, value, most in (("--draws", args.draws, MAX_DRAWS), ("--paper-draws", args.paper_draws, MAX_PAPER_DRAWS)):
        if value is not None and value > most:
            raise ValueError(f"{flag} {value:,} is above the {most:,} the study takes (1000 times the default); "
                             f"lower {flag}")
    if args.draws is not None and args.draws < 2 * BATCHES:
        raise ValueError(f"--draws must be at least {2 * BATCHES} (two draws per batch of the jackknife)")
    paper_batches = QUICK_PAPER_BATCHES if quick else PAPER_BATCHES
    if args.paper_draws is not None and args.paper_draws != 0 and args.paper_draws < 2 * paper_batches:
        raise ValueError(f"--paper-draws must be 0 or at least {2 * paper_batches} (two draws per jackknife batch)")
