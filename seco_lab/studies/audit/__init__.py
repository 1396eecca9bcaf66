"""Audit a chunk-wise gradient estimator on a model and text of your choice (``seco-lab audit``).

Per sequence: the hop strata g(p), p <= P, and the measured remainder g(>P) = g_SeCO - sum_p g(p) (per
Monte Carlo draw: a stratum of the sweep itself, see docs/audit.md §1);
every scheme's exact bias from their Gram matrices; Monte Carlo sampling variance through the real
sparse sweep (relative to ||g||^2 and as noise-to-signal tr Sigma / ||E g_hat||^2); the data noise
tr Sigma_d across sequences; the measured cost of each scheme on random draws; the equal-compute
best-scale MSE against SeCO, its crossover batch, and a recommendation per budget.  The formulas are
in :mod:`seco_lab.studies.audit.stats` and derived in docs/audit.md.

    from seco_lab.studies.audit import QUICK, run_audit, load_sequence
    out = run_audit(QUICK, "audit-quick")
    seq = load_sequence(out, "s00")          # the model, tokens and targets of a stored sequence
"""

from ..._lazy import lazy_exports

__all__ = ["AuditConfig", "AuditSequence", "COMMITTED", "DEFAULT", "DEFAULT_OUT", "QUICK", "STAGES", "SequenceSpec",
           "build_model", "crossover_batch", "data_noise", "equal_compute_mse", "load_sequence", "main", "mc_stats",
           "plan_units", "population_terms", "remainder_bound", "run_audit", "sequence_specs", "sequence_tokens",
           "strata_bias", "write_results"]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".config": ["COMMITTED", "DEFAULT", "QUICK", "STAGES", "AuditConfig"],
    ".driver": ["DEFAULT_OUT", "main", "run_audit"],
    ".plan": ["plan_units"],
    ".sources": ["AuditSequence", "SequenceSpec", "build_model", "load_sequence", "sequence_specs", "sequence_tokens"],
    ".stats": [
        "crossover_batch", "data_noise", "equal_compute_mse", "mc_stats", "population_terms", "remainder_bound",
        "strata_bias"
    ],
    ".tables": ["write_results"],
})
