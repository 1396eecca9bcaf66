"""Reports and figures generated from stored results (never from memory or by hand).

One module per report -- ``bias`` (the bias study), ``bench`` (time and memory),
``training`` (training modes compared) -- each with a pure ``summarize_*`` step
(numbers, no plotting) and a renderer; ``markdown`` and ``figures`` hold the shared
helpers.  Command line: ``seco-lab report NAME`` (the names are those of ``seco_lab.studies.registry``).
"""

from .._lazy import lazy_exports

# lazy (PEP 562): a light module of the package (e.g. ``bench_hf``'s labels, read by a benchmark's argument
# parser) imports without pandas, matplotlib and torch
__getattr__, __dir__ = lazy_exports(__name__, {
    ".bench": ["bench_report", "summarize_bench"],
    ".bias": ["bias_report"],
    ".bias_summary": ["BiasStudy", "load_bias", "summarize_bias"],
    ".markdown": ["MissingResultsError"],
    ".training": ["summarize_training", "training_report"],
})


def build_parser(*args, **kwargs):
    """The ``seco-lab report`` parser (:func:`seco_lab.studies.registry.build_report_parser`)."""
    from ..studies.registry import build_report_parser

    return build_report_parser(*args, **kwargs)


def main(*args, **kwargs):
    """``seco-lab report`` (:func:`seco_lab.studies.registry.report_main`)."""
    from ..studies.registry import report_main

    return report_main(*args, **kwargs)


__all__ = ["BiasStudy", "MissingResultsError", "bench_report", "bias_report", "build_parser", "load_bias", "main",
           "summarize_bench", "summarize_bias", "summarize_training", "training_report"]
