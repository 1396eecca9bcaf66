"""The trainer (``seco-lab train``) and its parts: the step, the data-parallel strategies, the run directory.

* :mod:`.trainer`            -- the Trainer: the loop, evaluation, checkpoints, data parallelism
* :mod:`.step`               -- the pieces of one optimizer step, as plain functions
* :mod:`.builders`           -- a run's data and model, built and checked before training
* :mod:`.replicated`         -- replicated data parallelism (the default strategy)
* :mod:`.sharding`           -- sharded training with FSDP2 (the same interface)
* :mod:`.sharded_checkpoint` -- sharded checkpoints (torch.distributed.checkpoint)
* :mod:`.launch`             -- the process group and the stop signals
* :mod:`.memory_estimate`    -- an up-front estimate of a run's host memory
* :mod:`.experiment`         -- what identifies a run: config record, fingerprint, resume checks
* :mod:`.run_dir`            -- a run's directory: one owner, atomic files, torn-write recovery
* :mod:`.run_checks`         -- what a run directory holds and when one is refused
* :mod:`.run_files`          -- reading a run's checkpoints, config.json and metrics.jsonl
* :mod:`.metric_log`         -- every metric record to metrics.jsonl (and TensorBoard)
"""

__all__: list[str] = []
