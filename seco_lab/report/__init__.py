"""Reports and figures generated from stored results (never from memory or by hand).

One module per report -- ``bias`` (the bias study), ``bench`` (time and memory),
``training`` (training modes compared) -- each with a pure ``summarize_*`` step
(numbers, no plotting) and a renderer; ``markdown`` and ``figures`` hold the shared
helpers.  Command line: ``seco-lab report NAME`` (the names are those of ``seco_lab.studies.registry``).
"""

from ..studies.registry import build_report_parser as build_parser
from ..studies.registry import report_main as main
from .bench import bench_report, summarize_bench
from .bias import bias_report
from .bias_summary import BiasStudy, load_bias, summarize_bias
from .markdown import MissingResultsError
from .training import summarize_training, training_report

__all__ = ["BiasStudy", "MissingResultsError", "bench_report", "bias_report", "build_parser", "load_bias", "main",
           "summarize_bench", "summarize_bias", "summarize_training", "training_report"]
