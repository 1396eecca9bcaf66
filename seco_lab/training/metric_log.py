"""Metric logger: every record to ``metrics.jsonl`` and, when asked, to TensorBoard."""

from __future__ import annotations

from .run_dir import RunDir

__all__ = ["MetricLogger"]


class MetricLogger:
    """``log(record)`` appends one JSON line (fsynced) and writes the numbers as TensorBoard
    scalars under ``RUN_DIR/tensorboard`` when ``tensorboard`` is set."""

    def __init__(self, run_dir: RunDir, tensorboard: bool = False):
        self.run_dir = run_dir
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            run_dir.note_written("tensorboard")  # before the folder is made: --overwrite may then remove it
            self.writer = SummaryWriter(str(run_dir.path / "tensorboard"))

    def log(self, record: dict) -> None:
        self.run_dir.append_metrics(record)
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
