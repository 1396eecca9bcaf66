"""The Hugging Face Trainer callback of :class:`~seco_lab.integrations.transformers.SeCOTrainerMixin`: it writes
the SeCO settings and the next draw's key into every checkpoint folder."""

from __future__ import annotations

from pathlib import Path

from ..store import atomic_write_json
from .trainer_args import SETTINGS_FILE

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # pragma: no cover - the hf extra is installed by make install
    raise ImportError("seco_lab.integrations.transformers needs transformers: pip install 'seco_lab[hf]'") from e

__all__ = ["SeCOStateCallback"]


class SeCOStateCallback(TrainerCallback):
    """Writes ``seco_trainer.json`` (settings + the next draw's key) into every checkpoint folder."""

    def __init__(self, trainer: Trainer):  # a SeCOTrainerMixin trainer (it has seco_args)
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return control
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            payload = {"settings": self.trainer.seco_args.to_dict(),
                       "next_draw_key": {"seed": self.trainer.seco_args.seed, "step": state.global_step, "micro": 0}}
            atomic_write_json(folder / SETTINGS_FILE, payload)  # a temporary file, fsync, rename
        return control
