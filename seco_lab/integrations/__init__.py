"""Adapters that put seco_lab's chunk engine inside other libraries' training loops.

* :mod:`seco_lab.integrations.transformers` -- ``SeCOTrainer`` / ``SeCOTrainerMixin`` for the
  Hugging Face ``Trainer`` (and trainers built on it, e.g. TRL's ``SFTTrainer``), and
  :func:`~seco_lab.integrations.transformers.pack_dataset`, the ``datasets`` packing helper;
* :mod:`.trainer_args` -- :class:`SeCOArguments`, the trainer's SeCO settings and the file that records them;
* :mod:`.trainer_callbacks` -- the callback that writes the run's SeCO record and metrics;
* :mod:`.packing` -- tokenize and pack text files or a ``datasets.Dataset`` into fixed-length rows.

Imported lazily: ``import seco_lab`` never needs transformers.
"""

__all__: list[str] = []
