"""One float64 exactness rule for every report: a relative error (or a norm that must vanish) counts as exact
below :data:`EXACT_TOL`, and a check above it is flagged "Not exact: NAME above TOL" in the report (the audit
report's exactness section, the bias report's exactness checks and its "unbiased" claims).  A report prints the
flag and keeps its exit status 0: the stored numbers are shown with a visible verdict, not refused."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["EXACT_TOL", "is_exact", "not_exact", "above_tol"]

#: above this relative error a float64 check fails (rounding stays near 1e-14 at the sizes studied)
EXACT_TOL = 1e-10


def is_exact(value: float, tol: float = EXACT_TOL) -> bool:
    """Whether ``value`` is at most ``tol``; NaN is not (an undefined check passes nothing)."""
    return bool(value <= tol)


def above_tol(values: Mapping[str, float], names: Iterable[str], tol: float = EXACT_TOL,
              skip_missing: bool = False) -> list[str]:
    """The ``names`` whose value in ``values`` is not within ``tol`` (NaN included), in the given order; with
    ``skip_missing`` a name absent from ``values`` (or NaN there: a check the run had no cell for) is left out."""
    out = []
    for name in names:
        v = values.get(name, math.nan)
        if skip_missing and (name not in values or v != v):
            continue
        if not is_exact(v, tol):
            out.append(name)
    return out


def not_exact(failed: Iterable[str], tol: float = EXACT_TOL) -> str:
    """The flag a report prints for failed checks: ``**Not exact: a, b above 1e-10.**``."""
    return f"**Not exact: {', '.join(failed)} above {tol:g}.**"
