"""Adapters that put seco_lab's chunk engine inside other libraries' training loops.

* :mod:`seco_lab.integrations.transformers` -- ``SeCOTrainer`` / ``SeCOTrainerMixin`` for the
  Hugging Face ``Trainer`` (and trainers built on it, e.g. TRL's ``SFTTrainer``), and
  :func:`~seco_lab.integrations.transformers.pack_dataset`, the ``datasets`` packing helper.

Imported lazily: ``import seco_lab`` never needs transformers.
"""

__all__: list[str] = []
