"""``seco_lab.audit``: audit a chunk-wise gradient estimator on your own model and text, from Python.

The public front of :mod:`seco_lab.studies.audit` (where the implementation lives beside the other studies),
under the name the command line uses (``seco-lab audit``)::

    from seco_lab.audit import QUICK, run_audit, load_sequence
    out = run_audit(QUICK, "audit-quick")
    seq = load_sequence(out, "s00")          # the model, tokens and targets of a stored sequence
"""

from .studies import audit as _impl
from .studies.audit import *  # noqa: F403

__all__ = list(_impl.__all__)
