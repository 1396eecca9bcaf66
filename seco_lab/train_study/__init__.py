"""Does the bias matter?  A training study of the SpaCO schemes against SeCO (issue 14).

A recipe on the library's low-level API (model, gradient engines, hop strata, exact bias metrics):

* :mod:`.task`    -- :class:`RecallTask`, key->value pairs at several chunk distances;
* :mod:`.runner`  -- one run (arm x optimizer x learning rate x seed) -> tidy rows;
* :mod:`.study`   -- the grid, resumable, in a process pool -> ``results.csv.gz``, ``runs.csv``, ``study.json``;
* :mod:`.summary` / :mod:`.stats` -- tables with t-intervals, paired comparisons, power;
* :mod:`.report`  -- ``summarize`` and ``render`` (Markdown + figures).
"""

from .runner import Arm, RunSpec, TrainSettings, train_run
from .stats import detectable_difference, paired_difference, t_interval
from .study import StudyConfig, default_arms, quick_config, run_study
from .task import RecallBatch, RecallTask

__all__ = ["Arm", "RecallBatch", "RecallTask", "RunSpec", "StudyConfig", "TrainSettings", "default_arms",
           "detectable_difference", "paired_difference", "quick_config", "run_study", "t_interval", "train_run"]
