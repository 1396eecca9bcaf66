"""Replicated data-parallel training: every rank holds the whole model, optimizer state and gradient.

:class:`ReplicatedModel` is the trainer's default strategy; it has the interface of
:class:`seco_lab.training.sharding.ShardedModel` (``--shard fsdp``), so :class:`seco_lab.training.trainer.Trainer`
runs one code path for both:

* ``view`` -- the model the engine runs: the model itself;  ``gather`` -- None (nothing is gathered).
* ``step()`` -- the context of one optimizer step: nothing to do.
* ``accumulate(grads)`` -- adds a micro-batch's gradients into the parameters' ``.grad``.
* ``reduce_mean(stats, count, world)`` -- the mean over micro-batches and ranks of the gradient and the
  statistics (:func:`seco_lab.training.step.allreduce_mean`: per step one all-reduce in float64, else two; none
  in one process).
* ``clip_grads(max_norm)`` -- ``torch.nn.utils.clip_grad_norm_`` (None: the norm only).
* ``save_checkpoint``, ``load_whole_state`` -- rank 0 writes the whole state as one ``.pt`` file
  (:meth:`seco_lab.training.run_dir.RunDir.save_checkpoint`); every rank loads it whole.
* ``collective`` -- False: running the model or reading its weights is rank-local, so rank 0 alone
  saves the adapter (``full_state_dict()`` is None: the model holds whole weights).  Evaluation runs on
  every rank either way: each evaluates its slice of the global validation batch, and the sums are all-reduced.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ..core.grads import accumulate_grads
from .builders import load_into
from .run_dir import RunDirError
from .step import allreduce_mean

__all__ = ["ReplicatedModel"]


class ReplicatedModel:
    """A chunk model replicated on every rank; gradients are all-reduced once per optimizer step."""

    #: running the model or reading its weights issues no collective: a rank does it alone
    collective = False
    #: no parameter gathering (:class:`~seco_lab.training.sharding.ShardedModel` has "step" or "chunk")
    gather = None

    def __init__(self, model: nn.Module):
        self.root = self.view = model
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        #: the trainable parameters, in ``model.parameters()`` order (the optimizer's)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def step(self):
        """One optimizer step: no context needed."""
        return contextlib.nullcontext()

    def accumulate(self, grads: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's gradients (by name) into the parameters' ``.grad``."""
        accumulate_grads(self.root, grads)

    def reduce_mean(self, stats: dict[str, float], count: int, world: int) -> tuple[dict[str, float], int]:
        """Each ``.grad`` and ``stats`` averaged over ``count`` micro-batches and ``world`` ranks, with the
        number of all-reduces issued (:func:`seco_lab.training.step.allreduce_mean`)."""
        return allreduce_mean(self.params, stats, count, world)

    def clip_grads(self, max_norm: float | None) -> float:
        """The gradients' global norm, clipping them to ``max_norm`` (None: no clipping)."""
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf")))

    def save_checkpoint(self, run_dir, optimizer, extra: dict) -> None:
        """Rank 0 writes ``extra`` with the whole model and ``optimizer`` state as ``run_dir``'s next ``.pt``."""
        if self.rank == 0:
            run_dir.save_checkpoint({**extra, "model": self.root.state_dict(), "optimizer": optimizer.state_dict()})

    def load_whole_state(self, state: dict, optimizer, where) -> None:
        """Load a ``.pt`` checkpoint's model and optimizer state; a mismatch is a :class:`RunDirError`
        naming ``where`` (the checkpoints folder)."""
        load_into(self.root, state["model"], where)
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError, TypeError, AttributeError, IndexError) as e:
            raise RunDirError(f"--resume: the optimizer state in {where} does not fit this model "
                              f"({str(e).splitlines()[0]})") from None

    def full_state_dict(self) -> None:
        """None: the model's parameters are whole already (a reader uses the model itself)."""
        return None
