"""Number and table formatting shared by the equal-compute sections of the training study's report."""

from __future__ import annotations

import numpy as np

__all__ = ["ci", "fmt", "md_table"]


def fmt(x, digits: int = 3) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def ci(m, lo, hi, digits: int = 3) -> str:
    return f"{fmt(m, digits)} [{fmt(lo, digits)}, {fmt(hi, digits)}]"


def md_table(header, rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows] + [""]
