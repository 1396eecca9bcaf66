"""The training study's command-line options, importable without torch or pandas (``seco-lab study train
--help`` answers at once)."""

from __future__ import annotations

__all__ = ["add_arguments"]


def add_arguments(ap) -> None:
    """The training study's own options of ``seco-lab study train``."""
    ap.add_argument("--collect-only", action="store_true",
                    help="assemble the runs finished so far (status 'partial') without running anything")
    ap.add_argument("--part", default="all",
                    help="'main' (issue 14's study), 'extensions' (issue 22's tiers in priority order: equal compute, "
                         "replays with noise probes, L = 4, ...), one tier's name, or 'all' (default)")
