"""The studies (``seco-lab study NAME``, ``seco-lab report NAME``): one subpackage or module per NAME, with the registry
and the runner they share; results are stored through :mod:`seco_lab.store`.

* :mod:`.registry`     -- the registry: name -> run, report, default results folder
* :mod:`.runner`       -- every missing cell of a study, each in a spawned worker
* :mod:`.rerun_tables` -- a rerun's tables kept when they reproduce the stored ones up to rounding
* :mod:`.bias`         -- the bias study: every compensation scheme against the exact gradient
* :mod:`.train`        -- the training study: does the bias change what a model learns?
* :mod:`.real`         -- hop strata and exact bias on the pretrained SmolLM2-135M
* :mod:`.audit`        -- an estimator audited on a model and text of your choice
"""

__all__: list[str] = []
