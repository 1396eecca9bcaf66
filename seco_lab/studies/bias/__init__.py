"""The bias study: every SpaCO compensation scheme against the exact gradient.

``definition`` (grid, scheme variants, seeding rule, model/data builders), ``group``
(one (L, k, seed): checks, scheme metrics, engine check), ``paper`` (one paper-settings
group, k = 128 and up: exact metrics from hop strata, Monte Carlo by stratified sweeps), ``driver`` (resumable,
parallel, atomic, through ``seco_lab.store`` and ``seco_lab.studies.runner``; the ``seco-lab study bias``
command), ``cell`` (rebuild a stored group).  ``seco_lab.report`` renders the results.
"""

from ..._lazy import lazy_exports

__all__ = [
    "BERNOULLI", "CHECK_COLUMNS", "CONVERGENCE_COLUMNS", "Cell", "DEFAULT", "FALLING_FACTORIAL", "GROUP_COLUMNS",
    "GroupResult", "PAPER", "PAPER_CAPPED_2", "PAPER_CAPPED_4", "PAPER_CHAIN_CAPPED_2", "PAPER_CHAIN_CAPPED_4",
    "PAPER_COLUMNS", "Purpose", "QUICK", "RELEASED", "RELEASED_UNBIASED", "RESULT_COLUMNS", "SCHEMES",
    "SchemeVariant", "StudyConfig", "StudyDefinitionError", "build_model", "build_parser", "build_tokens",
    "load_cell", "load_study_config", "main", "run_group", "run_paper_group", "run_study", "seed_sequence",
]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".cell": ["Cell", "load_cell", "load_study_config"],
    ".definition": [
        "BERNOULLI", "CHECK_COLUMNS", "CONVERGENCE_COLUMNS", "DEFAULT", "FALLING_FACTORIAL", "GROUP_COLUMNS", "PAPER",
        "PAPER_CAPPED_2", "PAPER_CAPPED_4", "PAPER_CHAIN_CAPPED_2", "PAPER_CHAIN_CAPPED_4", "PAPER_COLUMNS", "QUICK",
        "RELEASED", "RELEASED_UNBIASED", "RESULT_COLUMNS", "SCHEMES", "Purpose", "SchemeVariant", "StudyConfig",
        "build_model", "build_tokens", "seed_sequence"
    ],
    ".driver": ["StudyDefinitionError", "build_parser", "main", "run_study"],
    ".group": ["GroupResult", "run_group"],
    ".paper": ["run_paper_group"],
})
