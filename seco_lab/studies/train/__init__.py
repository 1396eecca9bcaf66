"""Does the bias matter?  A training study of the SpaCO schemes against SeCO (issue 14), and at equal
compute (issue 22).

A recipe on the library's low-level API (model, gradient engines, hop strata, exact bias metrics), using the
trainer's learning-rate schedule and chunk gradient (:mod:`seco_lab.training.step`):

* :mod:`.task`     -- :class:`RecallTask`, key->value pairs at several chunk distances;
* :mod:`.run_spec` -- what defines a run: :class:`Arm`, :class:`RunSpec`, :class:`TrainSettings`;
* :mod:`.runner`   -- one run (arm x optimizer x learning rate x seed) -> tidy rows;
* :mod:`.study`    -- the grid, resumable, in a process pool -> ``results.csv.gz``, ``runs.csv``, ``study.json``;
* :mod:`.extensions`, :mod:`.driver` -- issue 22's equal-compute tiers and ``seco-lab study train``;
* :mod:`.stored`   -- the stored results, read and checked;
* :mod:`.summary` / :mod:`.stats` -- tables with t-intervals, paired comparisons, power;
* :mod:`.report`, :mod:`.sections`, :mod:`.verdict`, :mod:`.figures`, :mod:`.report_format` -- the main report
  (Markdown + figures);
* :mod:`.equal_report` with :mod:`.equal_levels`, :mod:`.equal_prediction`, :mod:`.equal_runs`,
  :mod:`.equal_finals`, :mod:`.equal_format` -- its equal-compute sections.
"""

from ..._lazy import lazy_exports

__all__ = ["Arm", "RecallBatch", "RecallTask", "RunSpec", "StudyConfig", "TrainSettings", "default_arms",
           "detectable_difference", "paired_difference", "quick_config", "run_study", "t_interval", "train_run"]

__getattr__, __dir__ = lazy_exports(__name__, {
    ".runner": ["Arm", "RunSpec", "TrainSettings", "train_run"],
    ".stats": ["detectable_difference", "paired_difference", "t_interval"],
    ".study": ["StudyConfig", "default_arms", "quick_config", "run_study"],
    ".task": ["RecallBatch", "RecallTask"],
})
