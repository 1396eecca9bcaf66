"""SeCO / SpaCO backward inside the Hugging Face ``Trainer``.

``SeCOTrainer`` is ``transformers.Trainer`` with one method replaced: ``training_step``
runs each micro-batch's backward chunk by chunk through seco_lab's engine instead of one
full-sequence ``loss.backward()``.  Everything else -- optimizer, scheduler, gradient
accumulation, clipping, logging, evaluation, callbacks, checkpoints -- is the Trainer's own.
``SeCOTrainerMixin`` is the same override for any Trainer subclass (TRL's ``SFTTrainer``)::

    class SeCOSFTTrainer(SeCOTrainerMixin, SFTTrainer): ...

**The loss each micro-batch backpropagates** is the one the stock Trainer backpropagates.
With targets y_t = labels_{t+1} (the causal shift; ``shift_labels`` when the collator gives
them), n the number of targets != -100 in the micro-batch and S = sum_t CE(z_t, y_t):

    L = S / N * f                    (N = num_items_in_batch: the accumulated batch's target
                                      count, f = number of data-parallel processes when
                                      ``average_tokens_across_devices``, else 1)
    L = (S / n) / A                  (no num_items_in_batch; A = accumulation steps)

times the loss scale of a ``GradScaler`` when one is active.  The engine computes the
gradient of (S / n) * scale with scale = n * dL/dS exactly (SeCO, docs/estimators.md §2) or
as the unbiased sparse estimate (SpaCO, §3), and adds it into ``p.grad``.

**Draws.**  SpaCO's chunk set for micro-batch m of optimizer step s on process r is
``scheme.sampler.draw(k, budget, numpy.random.default_rng([seed, s, m, r]))``: a function of
the step counter the checkpoint stores, so a resumed run draws exactly what an uninterrupted
one would, and every process draws its own set.  Each checkpoint also holds
``seco_trainer.json`` (the settings and the next draw's key); resuming with other settings
warns.

**Data parallelism.**  The chunk backwards run on the unwrapped model, so DDP's reducer is
never armed; gradients are averaged over processes by one all-reduce of a flat buffer after
the last micro-batch of each optimizer step (when ``accelerator.sync_gradients``), i.e. once
per optimizer step, as DDP under ``no_sync`` does.

**The loss is checked, not assumed.** On the first micro-batch of every ``train()`` call, every 100 optimizer steps
(``seco_loss_check_every``), and again whenever ``compute_loss``, the model's ``forward`` or its ``loss_function``
is set on an instance or a forward hook is added to the model (or globally), the stock ``compute_loss`` runs once on
the micro-batch (the batch's labels and num_items_in_batch; where the whole one's float32 logits would take more
than 256 MiB, ``seco_loss_check_logits_bytes``, from its start to every row's first target, or the earliest row's:
warned, since a term on later positions is then not compared; the check holds about 4x those bytes and the stock
forward's activations on those tokens, and where it runs out of memory it lowers the bound and runs again, warned),
as the stock Trainer runs it but with the output layer's logits z made a leaf, and must agree with the engine's
cross-entropy up to rounding (``SeCOTrainerMixin._seco_loss_rounding``, ``_seco_same_output_rounding``):

    |L_stock - L_engine| <= a max(|L_engine|, 1)       (each on its own forward: a = 1024 eps, 4 eps in 16 bits)
    ||dL_stock/dz - dL_engine/dz|| / ||dL_engine/dz|| <= b,   |L_stock(z) - L_engine(z)| <= c max(|L_engine(z)|, 1)
                    (on the same z, so the forwards' rounding does not enter; in eps of the stock loss's dtype,
                     transformers' float32 for any model: b = 2 eps (2.4e-7), c = 64 eps (7.6e-6); 2 eps of a 16-bit
                     loss)

so a z-loss, label smoothing, a weight on some targets or any other term put in by a forward, a hook or a
``compute_loss`` -- where the class checks cannot see it -- is refused before any gradient is computed; so is a
stock loss whose gradient w.r.t. any trainable parameter differs from the engine's on the same z (none where the
engine's has none, however small: a penalty on the trainable weights, an early-exit or auxiliary loss, a head
outside the model, campaign 47 Q1/Q2 and 48 R2; within 16 eps, or 2 eps of 16-bit weights or autocast, for the
parameters after z, relative to the larger of their gradient's norm and the root sum of squares of its chunks'
parts: a penalty on the output layer, campaign 48 R3, 49 S2; a float16 model's gradients taken at a loss scale), a
loss that differentiates through the activations, and a loss that ignores the num_items_in_batch the Trainer passes
it (checked with twice the targets: campaign 47 Q3). Measured on the 2-layer test Llama: same-logits gradients
3.7e-8 apart in float64, 0 in float32, bfloat16 and float16; label smoothing 0.01 moves the gradient 1e-2. Where the
output layer does not compute the logits (TRL's SFTTrainer projects the decoder's output through a fused head; a
forward that uses the layer's weight itself), z is the decoder's last hidden state h (``base_model``'s first output)
and b is max(64, sqrt V) eps (dL/dh sums over the vocabulary: 0.11 sqrt(V) eps measured), at least 2 eps of 16-bit
weights or autocast (measured: 8e-8 apart through TRL's fused head in float32, 0 in bfloat16, 5e-6 in float16; label
smoothing 0.1 in bfloat16 moves dL/dh 0.099). Where the model is wider than its loss (transformers casts a float64
model's logits to float32), b is 2 eps plus twice that loss's own rounding of the cross-entropy on the same output,
measured (campaign 51). Where neither can be paired, the values alone are compared, warned.

**Padding.**  A right-padded batch (attention mask 1...1 0...0 per row, pad targets -100) is
exact: causal attention never lets a real token see a later pad.  Left padding or holes in
the mask would change what the real tokens attend to, and are refused.

:func:`pack_dataset` tokenizes text files or a ``datasets.Dataset`` and packs them into
fixed-length sequences for such training.

Here: the trainer mixin and ``SeCOTrainer``; the settings and the batch check are in :mod:`.trainer_args`, the
checkpoint callback in :mod:`.trainer_callbacks`, the packing helper in :mod:`.packing` (all re-exported here).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..core.checks import ceil_div, check_subset, checked_batch, checked_chunk, computed_dtype, recompute_mode
from ..core.engine import forward_loss, seco_step
from ..core.protocol import flat_cache, unflat_cache
from ..estimators.spaco import spaco_grad
from ..models.hf import HFChunkModel
from ..store import CONFIG_MAX_BYTES, read_json
from .packing import _text_files, pack_dataset  # noqa: F401 (re-export: defined here before)
from .trainer_args import KNOWN_INPUTS, MODES, SETTINGS_FILE, SeCOArguments, chunk_targets  # noqa: F401
from .trainer_callbacks import SeCOStateCallback

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - the hf extra is installed by make install
    raise ImportError("seco_lab.integrations.transformers needs transformers: pip install 'seco_lab[hf]'") from e

__all__ = [
    "SETTINGS_FILE",
    "SeCOArguments",
    "SeCOTrainer",
    "SeCOTrainerMixin",
    "chunk_targets",
    "pack_dataset",
]

logger = logging.getLogger(__name__)


@contextmanager
def _output_hook(layer, hook):
    handle = layer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least (float64 stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _first_tensor(out):
    """The layer output's first tensor: itself, a tuple's first item, or a ModelOutput's first field
    (``last_hidden_state`` of a decoder)."""
    if torch.is_tensor(out):
        return out
    first = out[0] if isinstance(out, tuple) and out else next(iter(out.values()), None) if isinstance(
        out, dict) else None
    return first if torch.is_tensor(first) else None


def _with_first(out, tensor):
    """``out`` with its first tensor (:func:`_first_tensor`) replaced by ``tensor``."""
    if torch.is_tensor(out):
        return tensor
    if isinstance(out, tuple):
        return (tensor, *out[1:])
    out[next(iter(out.keys()))] = tensor  # a ModelOutput: its attribute follows the item
    return out


def _as_leaf(into: list, width: int | None = None):
    """A forward hook replacing the layer's output (its first tensor: :func:`_first_tensor`) by a leaf that requires
    a gradient, kept in ``into`` -- where its last axis is ``width`` (the vocabulary for the output layer: one
    ``get_output_embeddings`` names that computes something else, or a hidden state that would pull the whole forward
    into the graph, is left as it is: campaign 43 N3); ``width=None`` takes any width."""
    def hook(_module, _args, out):
        first = _first_tensor(out)
        if first is None or first.dim() < 2 or not first.is_floating_point() or (
                width is not None and first.shape[-1] != width):
            into.append(None)
            return None
        into.append(first.detach().requires_grad_(True))
        return _with_first(out, into[-1])
    return hook


def _returned_logits(into: list):
    """A forward hook on the model that puts the ``logits`` of its output (detached), or None, in ``into``."""
    def hook(_module, _args, out):
        logits = out.get("logits") if isinstance(out, dict) else getattr(out, "logits", None)
        into.append(logits.detach() if torch.is_tensor(logits) and logits.is_floating_point() else None)
    return hook


def _next_slice_of(whole: torch.Tensor, into: list, replaced: list | None = None):
    """A forward hook replacing each output of the layer (its first tensor) by the next positions of ``whole``
    (dim -2), in order, as a leaf of its own (kept in ``into``; the layer's own output, with its graph, in
    ``replaced``); an output that does not fit is left as it is (``into`` gets None)."""
    def hook(_module, _args, out):
        first = _first_tensor(out)
        start = sum(p.shape[-2] for p in into if p is not None)
        piece = whole[..., start:start + first.shape[-2], :] if first is not None and first.dim() >= 2 else None
        if piece is None or piece.shape != first.shape:
            into.append(None)
            return None
        if replaced is not None:
            replaced.append(first)
        into.append(piece.detach().requires_grad_(True))
        return _with_first(out, into[-1])
    return hook


class _Effects:
    """J^T v summed over the chunks, for vectors v at the compared output (the logits or the hidden states) and J
    its Jacobian w.r.t. the trainable parameters before it through each chunk's own graph: what v gives the
    parameters a step moves.  A loss term moves them by its sum over the tokens, which grows with their number;
    rounding, as often of one sign as of the other, by much less (campaign 54 Y5: a z-loss 3e-7 7x the float32
    loss's rounding in dL/dz moved a float64 Llama's parameters 13x as far).  Kept for the parameters registered
    last, up to ``budget`` numbers (float64); none where no chunk's output reaches one."""

    def __init__(self, params: list, slots: int, budget: int = 1 << 22):
        self.params, total = [], 0
        for p in reversed(params):
            if total + p.numel() <= budget:
                self.params.append(p)
                total += p.numel()
        self.sums: list[list] = [[None] * len(self.params) for _ in range(slots)]

    def add(self, output: torch.Tensor | None, vectors: list) -> None:
        if not self.params:
            return
        if output is None or not output.requires_grad:
            self.params = []
            return
        for sums, v in zip(self.sums, vectors):
            try:
                grads = torch.autograd.grad(output, self.params, v.to(output.dtype), allow_unused=True,
                                            retain_graph=True)
            except RuntimeError as error:  # a graph that cannot be differentiated again (the gradients still are)
                if _out_of_memory(error):
                    raise
                self.params = []
                return
            for k, g in enumerate(grads):
                if g is not None:
                    sums[k] = g.double() if sums[k] is None else sums[k] + g.double()

    def norm(self, slot: int, largest: bool = False) -> float:
        """The L2 norm of slot ``slot``'s sums, or (``largest``) their largest magnitude."""
        sums = [g for g in self.sums[slot] if g is not None] if self.params else []
        if largest:
            return max((float(g.abs().max()) for g in sums if g.numel()), default=0.0)
        return sum(float(g.square().sum()) for g in sums) ** 0.5


class _SoftmaxInputs(torch.overrides.TorchFunctionMode):
    """Records (detached) the first argument of the softmax-family calls made while it is active -- the logits a
    loss normalises (F.cross_entropy, log_softmax, softmax, logsumexp) -- where its last axis is ``width`` and it
    has a gradient."""

    CALLS = {torch.nn.functional.cross_entropy, torch.nn.functional.log_softmax, torch.nn.functional.softmax,
             torch.log_softmax, torch.softmax, torch.logsumexp, torch.Tensor.log_softmax, torch.Tensor.softmax,
             torch.Tensor.logsumexp, torch.special.log_softmax, torch.special.softmax}

    def __init__(self, width: int, into: list):
        super().__init__()
        self.width, self.into = width, into

    def __torch_function__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if func in self.CALLS and torch.is_tensor(first) and first.is_floating_point() and first.requires_grad:
            # (a metric under no_grad is not the loss); cross_entropy's classes may be on axis 1: (B, V, T)
            if first.dim() >= 1 and first.shape[-1] == self.width:
                self.into.append(first.detach())
            elif func is torch.nn.functional.cross_entropy and first.dim() >= 3 and first.shape[1] == self.width:
                self.into.append(first.detach().movedim(1, -1))
        return func(*args, **(kwargs or {}))


class _Rounding(NamedTuple):
    """One chunk's measurement of the stock loss's own rounding (:meth:`SeCOTrainerMixin._seco_narrowed_rounding2`):
    in the gradient, with the projection in the loss's dtype too (or None), the float64 gradient through the
    projector, the value's rounding, whether the projection ran in 16 bits (the model's autocast), and what a
    per-row scale of the probabilities moves the gradient."""
    own: torch.Tensor
    in_loss: torch.Tensor | None
    gate: torch.Tensor
    value: float
    in_16: bool
    normalising: torch.Tensor  # J^T p over the rows: what a per-row scale of the probabilities moves
    seen: bool  # the logits the loss's softmax read were seen


def _loss_logits(normalised: list, returned: list, targets: torch.Tensor, vocab: int) -> tuple:
    """The candidates for the logits the stock loss rounded, shaped (*targets.shape, V): (the inputs of its softmax
    that hold one row per token -- or one per target, or per token but the last of each row (a loss on the rows
    with targets, on logits[:, :-1]: campaign 56 W1/W2/W4); the other rows NaN --, the logits of the model's only
    call or None)."""
    shape, keep = (*targets.shape, vocab), targets != -100
    read = []
    for c in normalised:
        rows = c.numel() // max(vocab, 1)
        if rows == keep.numel():
            read.append(c.reshape(shape))
        elif rows in (int(keep.sum()), keep.numel() - math.prod(keep.shape[:-1])):
            full = torch.full(shape, math.nan, dtype=c.dtype, device=c.device)
            if rows == int(keep.sum()):
                full[keep] = c.reshape(-1, vocab)
            else:
                full[..., :-1, :] = c.reshape(*keep.shape[:-1], keep.shape[-1] - 1, vocab)
            read.append(full)
    only = returned[0] if len(returned) == 1 and returned[0] is not None and tuple(returned[0].shape) == shape \
        else None
    return tuple(read), only


def _held_in(t: torch.Tensor) -> torch.dtype:
    """The narrowest floating dtype that holds every number of ``t`` (a 16-bit copy cast back: campaign 56 W4)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if torch.finfo(dtype).bits < torch.finfo(t.dtype).bits and bool(torch.equal(t, t.to(dtype).to(t.dtype))):
            return dtype
    return t.dtype


def _shifted_by_rows(candidate: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether ``candidate`` is ``z`` plus a constant per row, up to the rounding of the dtype that holds it."""
    if candidate.shape != z.shape:
        return False
    known = torch.isfinite(candidate).all(-1, keepdim=True)  # rows the loss did not read are NaN
    if not bool(known.any()):
        return False
    held = _held_in(candidate[known.expand_as(candidate)])
    candidate = torch.where(known, candidate, z.to(candidate.dtype))
    d = candidate.double() - z.double()
    d = d - d.mean(-1, keepdim=True)
    scale = candidate.double().abs().amax(-1, keepdim=True) + z.double().abs().amax(-1, keepdim=True)
    return bool((d.abs() <= 8 * torch.finfo(held).eps * scale).all())


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (CPU: "can't allocate memory"; CUDA: torch.OutOfMemoryError)."""
    text = str(error).lower()
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text or (
        "out of memory" in text)


def _defined_in(cls: type, name: str) -> str:
    """The module of the function ``cls.name`` (a library class's method replaced by the user's own function names
    the user's module, not the library's), else of the class."""
    return getattr(vars(cls)[name], "__module__", None) or cls.__module__


class SeCOTrainerMixin:
    """Replaces ``Trainer.training_step`` by a chunk-wise SeCO / SpaCO backward.

    Put it first in the bases: ``class MyTrainer(SeCOTrainerMixin, SomeTrainer)``.  Pass the
    settings as ``seco_args=SeCOArguments(...)``.  ``seco_draws`` lists ``(step, micro, subset)``
    of every SpaCO draw this process made.
    """

    #: the loss cross-check (``_seco_check_loss``) runs again every this many optimizer steps (0: only when what
    #: decides the loss changes), and on the whole micro-batch when its float32 logits take at most this many bytes
    #: (the check holds about 4x that besides the model: campaign 46 P3), else on a prefix, warned
    seco_loss_check_every = 100
    seco_loss_check_logits_bytes = 256 << 20

    def __init__(self, *args, seco_args: SeCOArguments, **kwargs):
        if not isinstance(seco_args, SeCOArguments):
            raise TypeError(f"seco_args must be a SeCOArguments, got {type(seco_args).__name__}")
        self.seco_args = seco_args
        self.seco_draws: list[tuple[int, int, tuple[int, ...]]] = []
        self._seco_micro = 0
        self._seco_adapters: dict[int, HFChunkModel] = {}
        self._seco_loss_checked = None  # the loss signature (_seco_loss_signature) the loss was last checked under
        self._seco_loss_checked_at = None  # ... and the optimizer step
        super().__init__(*args, **kwargs)
        recompute_mode()  # a bad SECO_LAB_RECOMPUTE_CHECK is refused here, not at the first rebuilt chunk
        self._seco_refuse_unsupported()
        self.seco_adapter(self.model)  # a model the engine cannot drive fails here, with the reason
        self.add_callback(SeCOStateCallback(self))

    # ------------------------------------------------------------------ checks

    def _seco_refuse_unsupported(self) -> None:
        from accelerate.utils import DistributedType

        args, acc = self.args, self.accelerator
        reasons = []
        if self.label_smoother is not None:
            reasons.append("label_smoothing_factor > 0 (the engine computes plain cross-entropy; set it to 0)")
        if self.compute_loss_func is not None:
            reasons.append("compute_loss_func (the engine computes the causal-LM cross-entropy itself)")
        if getattr(args, "loss_type", None) not in (None, "nll"):  # TRL's SFTConfig (campaign 39 C9: 'dft')
            reasons.append(f"loss_type={args.loss_type!r} (the SeCO step computes the causal-LM cross-entropy, "
                           "TRL's 'nll'; set loss_type='nll' or train that loss with the stock trainer)")
        owner = next(c for c in type(self).__mro__ if "compute_loss" in vars(c))
        if _defined_in(owner, "compute_loss").split(".")[0] not in ("transformers", "trl", "seco_lab"):  # c38 B4
            reasons.append(f"compute_loss overridden in {owner.__qualname__} (the SeCO training step computes the "
                           "causal-LM cross-entropy chunk by chunk and would not call it; train that loss with the "
                           "stock Trainer)")
        if getattr(args, "activation_checkpointing", None) or args.gradient_checkpointing:
            reasons.append("activation_checkpointing=True (a recomputed layer would update the chunk cache twice; "
                           "SeCO already keeps only one chunk's activations: set it to False)")
        if getattr(args, "torch_compile", False):
            reasons.append("torch_compile=True (the SeCO engine runs the model chunk by chunk with its own KV-cache "
                           "relay, which a compiled model does not support: set torch_compile=False)")
        if args.neftune_noise_alpha is not None:
            reasons.append("neftune_noise_alpha (random embedding noise: a rebuilt chunk would not reproduce its "
                           "first pass)")
        if args.n_gpu > 1:
            reasons.append(f"torch.nn.DataParallel over {args.n_gpu} GPUs (launch one process per GPU with torchrun "
                           "or accelerate instead)")
        if acc.distributed_type not in (DistributedType.NO, *self._seco_ddp_types()):
            reasons.append(f"distributed type {acc.distributed_type} (only DDP-style data parallelism is supported: "
                           "FSDP/DeepSpeed shard the gradients the chunk sweep accumulates)")
        for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
            size = getattr(self, name, lambda: 1)()
            if size > 1:
                reasons.append(f"{name[4:6]} parallelism of size {size} (it splits the sequence or the layers)")
        inner = self.accelerator.unwrap_model(self.model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        forward = next(c for c in type(inner).__mro__ if "forward" in vars(c))
        if not _defined_in(forward, "forward").startswith(("transformers.", "transformers_modules.")) \
                and getattr(inner, "seco_loss_is_cross_entropy", False) is not True:  # campaign 38: a z-loss added
            reasons.append(f"a forward of your own model class ({forward.__qualname__}): a loss it adds to the "
                           "cross-entropy would be left out, since the SeCO step computes the causal-LM cross-entropy "
                           "from the logits chunk by chunk; if its loss is that cross-entropy, set "
                           f"{forward.__qualname__}.seco_loss_is_cross_entropy = True")
        if not self._seco_causal_lm_loss(inner):
            # by the loss the forward computes, not the Trainer's loss_type: GPT-2's is None and its loss transformers'
            # causal-LM one (campaign 36 V5); a loss_function set on the model is not (campaign 37 A4)
            own, loss_type = getattr(inner, "_loss_function", None), getattr(inner, "loss_type", None)
            reasons.append(
                f"a loss_function set on the model ({getattr(own, '__name__', type(own).__name__)}), which the engine "
                "would not call: it computes transformers' causal-LM cross-entropy itself (remove it with "
                "del model._loss_function, or train that loss with the stock Trainer)" if own is not None else
                f"a model whose loss is not the causal-LM cross-entropy (loss_type {loss_type!r}: the engine computes "
                "that cross-entropy)")
        text = self.accelerator.unwrap_model(self.model).config
        text = text.get_text_config(decoder=True) if hasattr(text, "get_text_config") else text
        if getattr(text, "output_router_logits", False) and (getattr(text, "router_aux_loss_coef", 0) or 0) > 0:
            reasons.append("output_router_logits=True (the stock loss adds router_aux_loss_coef times the MoE "
                           "router's load-balancing loss, which the engine's cross-entropy leaves out: campaign 35; "
                           "set model.config.output_router_logits = False, or router_aux_loss_coef = 0)")
        if reasons:
            raise ValueError("SeCOTrainer cannot train with " + "; ".join(reasons))

    @staticmethod
    def _seco_causal_lm_loss(model) -> bool:
        """The model's forward computes transformers' causal-LM cross-entropy (``ForCausalLMLoss``), decoder-only."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        try:
            return model.loss_function is ForCausalLMLoss
        except (AttributeError, KeyError):
            return False

    @staticmethod
    def _seco_ddp_types():
        from accelerate.utils import DistributedType

        return tuple(t for t in DistributedType if t.name.startswith("MULTI_"))

    # ------------------------------------------------------------------ the step

    def seco_adapter(self, model) -> HFChunkModel:
        """The chunk-model view of the Trainer's (possibly DDP- or peft-wrapped) model, made once."""
        inner = self.accelerator.unwrap_model(model)
        adapter = self._seco_adapters.get(id(inner))
        if adapter is None or adapter.model is not inner:
            adapter = HFChunkModel(inner)
            self._seco_adapters = {id(inner): adapter}
        return adapter

    def seco_loss_factor(self, num_items_in_batch, n_targets: int) -> float:
        """dL/dS: the coefficient of the summed token loss S in the loss the stock Trainer backpropagates
        (``compute_loss`` with the model's causal-LM loss, then ``training_step``'s scaling)."""
        by_items = bool(self.model_accepts_loss_kwargs) and num_items_in_batch is not None
        if by_items:  # the model's loss is S / num_items_in_batch
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.reshape(-1)[0]
            items = float(num_items_in_batch)
            # no target in the whole batch (every label -100): no micro-batch has a loss; the stock Trainer
            # would divide by 0 (NaN); training_step skips such micro-batches, so the factor is never used
            factor = 1.0 / items if items > 0 else 0.0
            if self.args.average_tokens_across_devices:
                factor *= self.accelerator.num_processes // self.get_tp_size()
        else:  # the model's loss is the micro-batch mean S / n
            factor = 1.0 / max(n_targets, 1)
        scaled_for_ga = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else by_items
        if not scaled_for_ga:
            factor /= self.current_gradient_accumulation_steps
        return factor / self.accelerator.gradient_accumulation_steps

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: chunk-wise backward into ``p.grad``; returns the loss the stock Trainer would."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        tokens, targets = chunk_targets(inputs)
        adapter = self.seco_adapter(model)
        signature = self._seco_loss_signature(model)
        every = self.seco_loss_check_every
        due = bool(every) and self.state.global_step % every == 0 and self._seco_micro == 0 \
            and self.state.global_step != self._seco_loss_checked_at  # a loss that changes by itself (campaign 41 E2)
        if (signature != self._seco_loss_checked or due) and self._seco_check_loss(model, adapter, inputs):
            self._seco_loss_checked, self._seco_loss_checked_at = signature, self.state.global_step
        params = [p for p in adapter.parameters() if p.requires_grad]
        n_targets = int((targets != -100).sum())
        factor = self.seco_loss_factor(num_items_in_batch, n_targets)
        scaler = getattr(self.accelerator, "scaler", None)
        grad_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        if n_targets == 0:  # nothing to predict in this micro-batch: no loss, no gradient
            loss = torch.zeros((), device=tokens.device)
        else:
            with self.compute_loss_context_manager(), self.accelerator.autocast():
                loss = self._seco_backward(adapter, tokens, targets, n_targets * factor * grad_scale)
        for p in params:  # every process must all-reduce the same buffers
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.accelerator.sync_gradients:
            self._seco_micro = 0
            self._seco_allreduce(params)
        else:
            self._seco_micro += 1
        return (loss.detach() * (n_targets * factor)).to(self.args.device)

    def _seco_loss_signature(self, model) -> tuple:
        """What can change the loss ``compute_loss`` returns while every class stays the same (campaign 39 C2):
        ``compute_loss``/``forward`` set on the instance, the model's ``loss_function`` (set on it, or transformers'
        ``LOSS_MAPPING`` patched), forward hooks on the model or its wrappers, global ones."""
        from torch.nn.modules import module as M

        unwrapped = self.accelerator.unwrap_model(model)
        chain = [model, unwrapped, unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped]
        try:  # a loss_function set on the model, or transformers' LOSS_MAPPING entry patched (campaign 40 D1)
            loss_function = id(chain[-1].loss_function)
        except (AttributeError, KeyError):
            loss_function = None
        return (id(vars(self).get("compute_loss")), id(vars(self).get("compute_loss_func")), loss_function,
                tuple((id(m), id(vars(m).get("forward")), tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
                      for m in chain),
                tuple(M._global_forward_hooks), tuple(M._global_forward_pre_hooks))

    def _seco_check_loss(self, model, adapter: HFChunkModel, inputs) -> bool:
        """:meth:`_seco_check_loss_within` ``seco_loss_check_logits_bytes``; where the check runs out of memory
        (campaign 46 P3: it holds the logits, their gradient and the loss's own buffers, about 4x the logits), the
        bound is lowered to a quarter of what failed for the rest of the run, warned, and the check runs again on
        the shorter span; where even two chunks do not fit, a MemoryError names what to change."""
        bound = self.seco_loss_check_logits_bytes
        if isinstance(bound, bool) or not isinstance(bound, (int, np.integer)) or bound < 0:
            raise ValueError(f"SeCOTrainer: seco_loss_check_logits_bytes must be a whole number of bytes >= 0 (the "
                             f"largest float32 logits the loss check compares at once; default {256 << 20}), got "
                             f"{bound!r:.80} ({type(bound).__name__}) (campaign 52)")
        while True:
            self._seco_check_tried = None  # (tokens, bytes of their float32 logits) once the span is known
            try:
                return self._seco_check_loss_within(model, adapter, inputs, self.seco_loss_check_logits_bytes)
            except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
                if not _out_of_memory(error) or self._seco_check_tried is None:
                    raise
                tried = self._seco_check_tried
            gc.collect()  # what the failed attempt held
            n, c = inputs["input_ids"].shape[-1], self.seco_args.chunk_size
            if tried[0] <= min(n, 2 * c):
                raise MemoryError(
                    f"SeCOTrainer: the loss check ran out of memory on the first {tried[0]} tokens of this micro-batch "
                    f"(their float32 logits take {tried[1] / 2**20:.0f} MiB; the check needs about 4x that besides the "
                    "model), the fewest it can compare; free memory, use a smaller per_device_train_batch_size or "
                    "chunk_size") from None
            self.seco_loss_check_logits_bytes = tried[1] // 4
            logger.warning("SeCOTrainer: the loss check ran out of memory on the first %d tokens of this micro-batch "
                           "(their float32 logits take %.0f MiB; the check needs about 4x that besides the model): "
                           "seco_loss_check_logits_bytes is lowered to %d for this trainer and the check runs again",
                           tried[0], tried[1] / 2**20, self.seco_loss_check_logits_bytes)

    def _seco_check_loss_within(self, model, adapter: HFChunkModel, inputs, bound: int) -> bool:
        """Compare the stock ``compute_loss`` with the engine's cross-entropy on the micro-batch (where the whole
        one's float32 logits exceed ``bound`` bytes, on a prefix: below), with the batch's own labels
        and ``num_items_in_batch`` (a term that depends on which targets are masked, or on that argument, is seen:
        campaign 43 N2); raise ValueError if they differ by more than rounding allows (:meth:`_seco_loss_rounding`),
        in value on their own forwards and, on the same logits, in value and gradient
        (:meth:`_seco_check_loss_gradient`).  Returns False when there was nothing to compare (no target).

        The prefix, where the whole micro-batch's logits exceed ``bound``: the whole chunks that fit within max(bound,
        two chunks), where they hold every row's first target, else up to the chunk that holds the earliest row's;
        warned, since a term on the positions after it (or on the rows it leaves out) is not compared (campaign 46
        P1); where not even that fits, warned that the check could not run (it runs on the next micro-batch)."""
        n, c = inputs["input_ids"].shape[-1], self.seco_args.chunk_size
        vocab = getattr(adapter, "vocab_size", None) or 0
        row_bytes = inputs["input_ids"].numel() // n * vocab * 4  # one position's float32 logits, every row
        span = n  # the whole micro-batch where its logits fit (campaign 41 E1)
        if n * row_bytes > bound:
            # else from the start to the chunk after every row's first target where that fits, else after the
            # earliest row's (campaign 44 M2, 45 O1/O2: the first two chunks may hold no target), within the bound
            _, all_targets = chunk_targets(inputs)
            rows = (all_targets != -100).reshape(-1, n)
            firsts = [int(r.nonzero()[0]) for r in rows if bool(r.any())]
            if not firsts:  # no target: nothing to compare, as on the whole micro-batch (campaign 46 P2)
                return False
            fits = max(bound, 2 * c * row_bytes) // max(row_bytes, 1)
            spans = [min(n, max(2 * c, -(-(f + 2) // c) * c)) for f in (max(firsts), min(firsts))]
            span = next((s for s in spans if s <= fits), None)
            if span is None:
                logger.warning("SeCOTrainer: the loss check could not run on this micro-batch: its earliest target "
                               "is at position %d, beyond the %d positions whose logits fit "
                               "seco_loss_check_logits_bytes (%d); it runs on the next micro-batch that has one within "
                               "them", min(firsts), fits, bound)
                return False
            span = max(span, min(n, fits // c * c))  # as many chunks as fit (campaign 50: the warning said so)
            if span < n:
                left_out = sum(f + 2 > span for f in firsts)
                logger.warning("SeCOTrainer: the loss check runs on the first %d of this micro-batch's %d tokens (%s "
                               "seco_loss_check_logits_bytes, %d)%s: a loss term on the later positions is not "
                               "compared on this micro-batch; raise seco_loss_check_logits_bytes to compare them",
                               span, n, "the positions whose float32 logits fit" if span * row_bytes <= bound else
                               "the fewest chunks that hold a target; their float32 logits exceed", bound,
                               f", where {left_out} of its {len(rows)} rows have no target" if left_out else "")
        self._seco_check_tried = (span, span * row_bytes)
        prefix = {key: value[..., :span].contiguous() for key, value in inputs.items()  # (a view .view()s badly:
                  if torch.is_tensor(value) and value.dim() >= 1 and value.shape[-1] == n}  # campaign 44 M3)
        if "labels" not in prefix and "shift_labels" not in prefix:
            return False
        tokens, targets = chunk_targets(prefix)
        n_targets = int((targets != -100).sum())
        if not n_targets:
            return False
        # the stock loss given num_items_in_batch: S / items, times the processes where tokens are averaged across
        # them (Trainer.compute_loss): items = the span's targets (times the processes) make it the mean S / n
        spread = self.accelerator.num_processes // self.get_tp_size() if (
            self.args.average_tokens_across_devices and self.model_accepts_loss_kwargs) else 1
        # where the Trainer passes num_items_in_batch to the model (model_accepts_loss_kwargs), the SeCO step trains
        # S / num_items_in_batch: twice the span's targets are passed and the loss doubled, so a loss that ignores
        # the argument (the micro-batch mean) differs by 2x (campaign 47 Q3)
        ratio = 2 if self.model_accepts_loss_kwargs else 1
        items = torch.tensor(n_targets * spread * ratio, device=tokens.device)
        unwrapped = self.accelerator.unwrap_model(model)  # no DDP collective
        causal = adapter.model.get_base_model() if hasattr(adapter.model, "get_base_model") else adapter.model
        head = causal.get_output_embeddings()
        decoder = getattr(causal, "base_model", None)
        decoder = decoder if isinstance(decoder, torch.nn.Module) and decoder is not causal else None
        # every trainable parameter: their gradients of the stock loss and of the engine's on the same output must
        # agree (campaign 47 Q1/Q2, 48 R2/R3: a penalty on the weights, an early-exit loss, a head outside the model)
        trainable = [(name, p) for name, p in unwrapped.named_parameters() if p.requires_grad]
        with torch.no_grad(), self.compute_loss_context_manager(), self.accelerator.autocast():
            ours = float(forward_loss(adapter, tokens, targets, c))  # first: the adapter's probe names dropout
            computed = computed_dtype(next(iter(adapter.parameters())))  # autocast's dtype where it is on
        self._seco_check_computed = computed
        # the stock loss as a function of the logits: a graph from the output layer's output on, none before
        normalised: list[torch.Tensor] = []  # what the stock loss's softmax read (campaign 55)
        stock, logits = self._seco_stock_loss(unwrapped, prefix, items, head, vocab, "logits", None, normalised)
        stock = stock * ratio if ratio != 1 else stock
        allowed = self._seco_loss_rounding(stock, computed)
        value = float(stock.detach())
        # nearer the micro-batch mean than S / num_items_in_batch, and within 1% of it (campaign 49 S3: a loss
        # scaled by 1.9 is not one that ignores the count)
        if ratio != 1 and abs(value / ratio - ours) < min(abs(value - ours), 0.01 * max(abs(ours), 1.0)):
            besides = abs(value / ratio - ours) / max(abs(ours), 1.0)
            raise ValueError(
                "SeCOTrainer: the model's forward accepts **kwargs, so the Trainer passes it num_items_in_batch and "
                "trains S / num_items_in_batch (without dividing by the gradient accumulation steps), but its loss "
                f"does not use it: for num_items_in_batch = {int(items)} (twice the targets of the first {span} "
                f"tokens of this batch) it returned {value / ratio!r}, where the causal-LM cross-entropy the SeCO "
                f"step trains is the micro-batch mean {ours!r} halved" + (
                    f" (and it differs from that mean by {besides:.3g} relative, beyond the rounding {allowed:.2g}: "
                    "a term besides)" if besides > allowed else "") +
                " -- or it is that loss times exactly 2; either way the SeCO step and the stock Trainer would "
                "train differently: divide the summed loss by num_items_in_batch in the forward, or set "
                "trainer.model_accepts_loss_kwargs = False (the Trainer then averages the micro-batch means)")
        if not abs(value - ours) <= allowed * max(abs(ours), 1.0):
            raise ValueError(
                f"SeCOTrainer: the loss the stock Trainer computes (compute_loss) on the first {span} tokens of this "
                f"batch is {value!r}" + (f" (given num_items_in_batch = {int(items)}, twice their targets, and "
                                         "doubled)" if ratio != 1 else "") +
                f", the causal-LM cross-entropy the SeCO step trains {ours!r} (relative difference "
                f"{abs(value - ours) / max(abs(ours), 1.0):.3g}, rounding allows {allowed:.2g}): something adds to or "
                "changes the loss where the trainer's class checks cannot see it -- a forward or compute_loss set on "
                "the instance, a forward hook on the model, a subclass's extra term, or randomness in the forward -- "
                "and the SeCO step would leave it out; remove it, or train that loss with the stock Trainer")
        same_logits = ("logits", head, logits, stock, trainable, None, _loss_logits(normalised, [], targets, vocab))
        if self._seco_check_loss_gradient(unwrapped, adapter, same_logits, tokens, targets):
            return True
        del same_logits, logits, stock  # the first stock forward's graph
        if decoder is not None:
            # the output layer did not compute the logits (TRL's fused head projects the decoder's output itself):
            # pair on the decoder's last hidden state h instead; the output layer then runs in the model's dtype
            # on both sides, so its rounding is allowed for
            # the logits the model returns and those its loss normalises, where they can be told (campaigns 54-55)
            returned: list[torch.Tensor | None] = []
            normalised = []
            stock_h, hidden = self._seco_stock_loss(unwrapped, prefix, items, decoder, None, "hidden states",
                                                    returned, normalised, vocab)
            stock_h = stock_h * ratio if ratio != 1 else stock_h
            same_hidden = ("hidden states", decoder, hidden, stock_h, trainable, head,
                           _loss_logits(normalised, returned, targets, vocab))
            if self._seco_check_loss_gradient(unwrapped, adapter, same_hidden, tokens, targets):
                return True
        logger.warning("SeCOTrainer: the loss check compared loss values only: neither the output layer (%s, "
                       "get_output_embeddings()) nor the decoder (%s, base_model) computed the logits or the hidden "
                       "states of this batch's %d tokens in one call, in the stock forward and in every chunk of the "
                       "engine's, so the gradients could not be paired", type(head).__name__,
                       type(decoder).__name__ if decoder is not None else "none", span)
        return True

    def _seco_stock_loss(self, unwrapped, prefix: dict, items, layer, width: int | None, what: str,
                         returned: list | None = None, normalised: list | None = None, vocab: int = 0):
        """The stock ``compute_loss`` on ``prefix`` as a function of ``layer``'s output (made a leaf by
        :func:`_as_leaf` where its last axis is ``width``): (loss, the leaves of each call of the layer); the
        ``logits`` each call of the model returns (detached; None where it returns none) are put in ``returned``,
        what the loss's softmax-family calls read with ``vocab`` (or ``width``) columns in ``normalised``.
        It runs as the stock Trainer runs it, with the parameters' ``requires_grad`` as they are and a graph
        through the model (campaign 47 Q1: a penalty on the trainable parameters reads ``p.requires_grad``), so a
        term that reaches the parameters other than through the leaf is seen (:meth:`_seco_check_loss_gradient`);
        TRL's metrics and token counts are restored (this call is not a step)."""
        kept = copy.deepcopy({name: vars(self)[name] for name in ("_metrics", "_total_train_tokens")
                              if name in vars(self)})
        leaves: list[torch.Tensor | None] = []
        try:
            with torch.enable_grad(), _output_hook(layer, _as_leaf(leaves, width)), \
                    _output_hook(unwrapped, _returned_logits(returned)) if returned is not None else nullcontext(), \
                    _SoftmaxInputs(width or vocab or 0, normalised) if normalised is not None else nullcontext(), \
                    self.compute_loss_context_manager(), self.accelerator.autocast():
                stock = self.compute_loss(unwrapped, prefix, num_items_in_batch=items)
        except RuntimeError as error:  # user code that differentiates through the model (campaign 47 Q1)
            if _out_of_memory(error) or not any(text in str(error) for text in (
                    "differentiated Tensor", "does not require grad", "does not have a grad_fn")):
                raise
            raise ValueError(
                f"SeCOTrainer: the stock compute_loss failed in the loss check, which cuts its graph at the {what} "
                f"(the output of {type(layer).__name__}) to compare the loss as a function of them: {error} -- a "
                "loss that differentiates through the model's activations (an input-gradient penalty, a gradient "
                "norm term) is not the causal-LM cross-entropy the SeCO step trains; train it with the stock "
                "Trainer") from error
        finally:
            vars(self).update(kept)
        return (stock[0] if isinstance(stock, tuple) else stock), leaves

    @staticmethod
    def _seco_paired(leaves: list, stock, tokens) -> bool:
        """Whether the layer ran once on the whole span (one leaf per token) and the stock loss is a function of it."""
        leaf = leaves[0] if len(leaves) == 1 else None
        return leaf is not None and tuple(leaf.shape[:-1]) == tuple(tokens.shape) and stock.requires_grad

    def _seco_check_loss_gradient(self, unwrapped, adapter: HFChunkModel, pair: tuple, tokens, targets) -> bool:
        """The second half of the loss check (campaign 42 F1): on the *same* logits z (the stock forward's output
        layer), the stock loss and the engine's cross-entropy must agree in value and in gradient dL/dz up to the
        rounding of the loss (:meth:`_seco_same_output_rounding`): the two forwards' rounding no longer enters, so a
        term far below the value allowance (label smoothing 0.01: 3.7e-5 of the value, 1e-2 of the gradient) is
        refused. The engine's side runs chunk by chunk, each chunk's gradient compared with its slice of the stock
        one as it comes (memory: the stock forward's graph, then one chunk's; campaign 43 N4: one step of a V =
        32000 Llama on 2 x 1024 tokens peaks at 1518 MiB RSS with the check, the stock Trainer at 1293 MiB). No
        gradient of the stock loss may reach the parameters before the compared output (``checked``: the decoder's,
        and the output layer's where the logits are compared) other than through it: a penalty on the weights or an
        early-exit loss is refused (campaign 47 Q1/Q2). Where the output layer does not compute the logits (TRL's
        fused head; a forward of the user's own), ``pair`` holds the decoder's last hidden state h instead, and
        dL/dh is compared with the allowance of the model's dtype (:meth:`_seco_same_output_rounding`: the output
        layer runs on both sides). ``pair`` = (what, layer, its outputs in the stock forward as leaves, the stock loss,
        allowance, checked (name, parameter) pairs). Returns False where they cannot be paired: the layer not run
        once on the whole span, the stock loss not a function of its output, or an engine chunk that does not read
        it."""
        what, layer, leaves, stock, checked, head, seen = pair
        if not self._seco_paired(leaves, stock, tokens):
            return False
        span = tokens.shape[-1]
        leaf = leaves[0]
        params = [p for _, p in checked]
        batch = checked_batch(adapter, tokens, targets, self.seco_args.chunk_size)
        scale, grads = self._seco_scaled_grads(stock, [leaf] + params, batch.n_targets)
        stock_grad, *theirs_p = [None if g is None else _widened(g) / scale for g in grads]
        del grads
        if stock_grad is None:  # the stock loss is not a function of this output
            return False
        same = leaf.detach()
        del leaf
        pieces: list[torch.Tensor | None] = []
        # the engine's, summed over the chunks in float64 (campaign 50: in float32 the sum's own rounding grew with
        # the chunk count, 5.5 eps of float32 at 1024 chunks, 2.8 in float64); p_parts2 = sum over chunks
        # of their squared norms, the scale of the sum's rounding where the chunks' gradients cancel
        ours_p: list[torch.Tensor | None] = [None] * len(params)
        past, total, diff2, norm2, p_parts2 = [], 0.0, 0.0, 0.0, 0.0
        # logits wider than the stock loss (a float64 model's, transformers' loss float32): the stock's own rounding
        # of the cross-entropy on them, measured chunk by chunk (campaign 51)
        narrowed = torch.finfo(same.dtype).eps < torch.finfo(stock.dtype).eps
        vocab = getattr(adapter, "vocab_size", None) or 0
        # on the hidden states, the ways the output layer maps them to logits (its call, its weight): each one's
        # measurement is used only where its float64 gradient is the engine's (campaign 53 X1)
        projectors = [None] if what == "logits" or not narrowed else self._seco_projectors(head, same, vocab)
        if narrowed and not projectors:
            narrowed = False
            logger.warning("SeCOTrainer: the model computes in %s and its loss in %s, and its output layer (%s, "
                           "get_output_embeddings()) could not be applied to the hidden states to measure that "
                           "loss's rounding: the gradients are compared on the hidden states within max(64, sqrt V) "
                           "eps of %s, so a loss term smaller than that is not seen (campaign 52)", same.dtype,
                           stock.dtype, type(head).__name__, stock.dtype)
        # per projector: the loss's own rounding, that with the projection in the loss's dtype too (None where the
        # projector cannot run in it), and its float64 gradient against the engine's
        own2, in_loss2, projected2, values = ([0.0] * len(projectors) for _ in range(4))
        in_16 = [False] * len(projectors)  # the projection in the loss's dtype ran in 16 bits (autocast)
        normalising = [0.0] * len(projectors)
        unseen = [False] * len(projectors)  # a chunk whose loss's softmax was not seen (a fused head, by hand)
        # the stock's dL/dh made of float32 numbers: it projected in float32 too (TRL's fused head; campaign 53 X3)
        in_loss = narrowed and what != "logits" and self._seco_computed_in(stock_grad, stock.dtype)
        # what the difference, the engine's gradient and each projector's rounding give the trainable parameters
        # before the output through each chunk's graph (:class:`_Effects`), summed over the chunks
        effects = _Effects(params if narrowed else [], 2 + 2 * len(projectors))
        replaced: list[torch.Tensor] = []
        with torch.enable_grad(), _output_hook(layer, _next_slice_of(same, pieces, replaced)), \
                self.compute_loss_context_manager(), self.accelerator.autocast():
            for j in range(batch.num_chunks):
                tok, tgt, start = batch.span(j, 1)
                out = checked_chunk(adapter.chunk_forward(tok, tgt, past, start, batch.ignore_index), j)
                past.append(unflat_cache([t.detach() for t in flat_cache(out.cache)]))
                piece = pieces[-1] if len(pieces) == j + 1 else None
                if piece is None or not out.loss_sum.requires_grad:  # the engine's chunk did not read them
                    return False
                loss = out.loss_sum / batch.n_targets
                ours, *chunk_p = torch.autograd.grad(loss * scale, [piece] + params, allow_unused=True)
                ours = _widened(ours) / scale
                wide = [None if g is None else g.double() / scale for g in chunk_p]
                ours_p = [a if g is None else g if a is None else a + g for a, g in zip(ours_p, wide)]
                p_parts2 += sum(float(g.square().sum()) for g in wide if g is not None)
                theirs = stock_grad[..., start:start + piece.shape[-2], :]
                rows = slice(start, start + piece.shape[-2])
                roundings, normals = [], []
                for i, project in enumerate(projectors if narrowed else []):
                    r = self._seco_narrowed_rounding2(
                        same[..., rows, :], tgt, stock.dtype, batch.ignore_index, batch.n_targets, project,
                        (tuple(c[..., rows, :] for c in seen[0]), None if seen[1] is None else seen[1][..., rows, :]))
                    if r is None:  # the projector fails on these positions: not the forward's
                        projected2[i] = math.inf
                        roundings.append(torch.zeros_like(ours, dtype=torch.float64))
                        normals.append(roundings[-1])
                        continue
                    own2[i] += float(r.own.square().sum())
                    in_loss2[i] = None if r.in_loss is None or in_loss2[i] is None else \
                        in_loss2[i] + float(r.in_loss.square().sum())
                    in_16[i] = in_16[i] or r.in_16
                    normalising[i] += float(r.normalising.square().sum())
                    unseen[i] = unseen[i] or not r.seen
                    values[i] += r.value
                    projected2[i] += float((r.gate - ours.double()).square().sum()) if project is not None else 0.0
                    roundings.append(r.in_loss if in_loss and r.in_loss is not None else r.own)
                    normals.append(r.normalising)
                effects.add(replaced[-1] if len(replaced) == j + 1 else None,
                            [theirs.double() - ours.double(), ours.double(), *roundings, *normals])
                diff2 += float((theirs.double() - ours.double()).square().sum())
                norm2 += float(ours.double().square().sum())
                total += float(loss.detach())
        # the parameters: no stock gradient where the engine's loss has none (a penalty on the weights, an early-exit
        # loss: campaign 47 Q1/Q2), and the same gradient where both have one (the output layer and what follows
        # it: a penalty there, campaign 48 R2/R3), up to the rounding of the model's dtype
        reached = [(name, float(g.double().norm())) for (name, _), g, e in zip(checked, theirs_p, ours_p)
                   if e is None and g is not None and bool(g.ne(0).any())]
        pairs = [(g, e) for g, e in zip(theirs_p, ours_p) if e is not None]
        p_diff2 = sum(float((e.double() - (0 if g is None else g.double())).square().sum()) for g, e in pairs)
        p_norm2 = max(sum(float(e.double().square().sum()) for _, e in pairs), p_parts2 if pairs else 0.0)
        p_diff = (p_diff2 / p_norm2) ** 0.5 if p_norm2 > 0 else float(p_diff2 > 0)
        # the dtype the parameters' gradients are computed in: autocast's where it is on (campaign 49 S1)
        # (autocast does not reach a float64 model's own operations: its 16-bit floor only where the measurement
        # below shows a projection in 16 bits, as TRL's fused head under bf16=True; campaign 55)
        rounding = self._seco_same_output_rounding(stock, same.dtype if narrowed else self._seco_check_computed,
                                                   what, vocab)
        allowed, v_allowed, p_allowed = rounding["gradient"], rounding["value"], rounding["parameters"]
        eps = torch.finfo(stock.dtype).eps
        effect = effect_allowed = None  # measured where the stock loss is narrower than the model (below)
        unseen_best = False  # the measurement's loss softmax was not seen
        trusted = [i for i, project in enumerate(projectors) if project is None or (
            norm2 > 0 and (projected2[i] / norm2) ** 0.5 <= 2 * eps)]
        if narrowed and norm2 > 0 and not trusted:
            # the output layer is not what the forward projects with (a softcap or a scale after it, another
            # head): its measurement says nothing of the model's loss (campaign 53)
            narrowed = False
            logger.warning("SeCOTrainer: the model computes in %s and its loss in %s, and the cross-entropy of its "
                           "output layer's logits (%s, get_output_embeddings()) differs from the model's by %.3g "
                           "relative in its gradient w.r.t. the hidden states, so that loss's rounding could not be "
                           "measured: the gradients are compared on the hidden states within max(64, sqrt V) eps of "
                           "%s, and a loss term smaller than that is not seen", same.dtype, stock.dtype,
                           type(head).__name__, (min(projected2) / norm2) ** 0.5, stock.dtype)
        if narrowed and norm2 > 0:
            # the stock loss's own rounding, measured (the least of the trusted projectors': a call that adds a
            # constant to every logit is trusted, being shift-invariant, but its logits are not the model's,
            # campaign 54 Y1), twice on top of half an eps, also for the parameters after the output (a float64
            # model, V 262144: 6.1e-6 apart); on the hidden states of a wider model the output layer sums over the
            # vocabulary in that model's dtype on both sides (campaign 51 U1: 64 eps of float32 let terms pass).
            # campaign 54 Y5: 2 eps on top let a z-loss 3e-7 of a float64 Llama pass at 13x its effect's rounding
            best = min(trusted, key=lambda i: own2[i])
            own2_best = own2[best]
            measured = [i for i in trusted if in_loss2[i] is not None]
            if in_loss and measured:
                # the stock projected in float32 too (campaign 53 X3: 3.6e-7 apart at V 8192 where the loss's own
                # rounding was 5e-8): that rounding measured with a projector that runs in float32 (campaign 54 Y4:
                # 0.11 sqrt(V) eps added to every float64 model's let label smoothing 2e-6 pass at V 32000)
                best = min(measured, key=lambda i: in_loss2[i])
                own2_best = max(own2_best, in_loss2[best])
            # a loss computed by another implementation than F.cross_entropy (a fused head, a softmax by hand):
            # 4 eps of each row's normalisation on top, which it rounds apart (campaign 55)
            unseen_best = unseen[best] and not in_loss
            apart = 4 * eps if in_loss or unseen[best] else 0.0
            own = ((own2_best + apart ** 2 * normalising[best]) / norm2) ** 0.5
            if in_loss and not measured:  # no projector runs in float32: campaign 51's measure, 0.11 sqrt(V) eps
                own = max(own, 0.11 * vocab ** 0.5 * eps)
            allowed = 0.5 * eps + 2 * own
            p_allowed += 2 * own
            # the value: twice its measured rounding on top (campaign 55: logits shifted by 10^4-10^5 round the
            # float32 loss's value by 1.4e-5-3.1e-5, beyond 64 eps)
            v_allowed += 2 * abs(values[best]) / max(abs(total), 1.0)
            reach, top = effects.norm(1), effects.norm(1, largest=True)
            if reach > 0 and (not in_loss or measured):
                # in L2 and in the largest single parameter's move, which a term concentrates where rounding
                # spreads (campaign 55 Z6: a z-loss 2e-7 at V 4096, 95% of the L2 allowance, moved the largest
                # parameter 19x as far as rounding did); the rounding's and the normalisation's in quadrature
                slot, normal = 2 + best, 2 + len(projectors) + best
                for largest, scale in ((False, reach), (True, top)):
                    moved_by = (effects.norm(slot, largest) ** 2 + (apart * effects.norm(normal, largest)) ** 2) ** 0.5
                    this = (effects.norm(0, largest) / scale, 0.5 * eps + 3 * moved_by / scale)
                    if scale > 0 and (effect is None or this[0] / this[1] > effect / effect_allowed):
                        effect, effect_allowed = this
            if in_loss and measured and in_16[best]:  # the projection in 16 bits: that dtype's floor
                computed = self._seco_check_computed
                floor = 2 * torch.finfo(computed if torch.finfo(computed).bits <= 16 else torch.bfloat16).eps
                allowed, p_allowed, v_allowed = max(allowed, floor), max(p_allowed, floor), max(v_allowed, floor)
                effect_allowed = None if effect is None else max(effect_allowed, floor)
        diff = (diff2 / norm2) ** 0.5 if norm2 > 0 else float(diff2 > 0)
        value = abs(float(stock.detach()) - total) / max(abs(total), 1.0)
        self.seco_loss_check_measured = {"value": value, "value_allowed": v_allowed, "gradient": diff,
                                         "allowed": allowed, "tokens": span, "paired": what, "parameters": p_diff,
                                         "parameters_allowed": p_allowed}
        if effect is not None:
            self.seco_loss_check_measured.update(effect=effect, effect_allowed=effect_allowed)
        params_differ = bool(reached) or not p_diff <= p_allowed  # NaN: differ
        moved = effect is not None and not effect <= effect_allowed
        # a value apart with the same gradient w.r.t. the output: a term on the parameters says more (campaign 49 S2)
        if not diff <= allowed or moved or (not value <= v_allowed and not params_differ):
            raise ValueError(
                f"SeCOTrainer: on the same {what} of the first {span} tokens of this batch, the loss the stock Trainer "
                f"computes (compute_loss) and the causal-LM cross-entropy the SeCO step trains differ by {value:.3g} "
                f"relative in value (rounding allows {v_allowed:.2g}) and {diff:.3g} relative in their gradient "
                f"w.r.t. the {what} (rounding allows {allowed:.2g})" + (
                    f", which moves the trainable parameters before them {effect:.3g} relative, summed over the "
                    f"tokens (the float32 loss's rounding allows {effect_allowed:.2g})" if moved else "") +
                ": a term in the stock loss -- label smoothing, a "
                "weight on some targets, a scale, "
                "a penalty on the logits, put in by a hook, a forward or a compute_loss -- would be left out by the "
                "SeCO step; remove it, or train that loss with the stock Trainer" + (
                    " (the loss's own softmax was not seen -- a softmax by hand, on a slice of the logits or in "
                    "another layout -- so its float32 rounding was measured on the smaller of the logits the model "
                    "returns and those of its output layer; a loss that rounds larger logits than it returns is "
                    "refused too: compute it with F.cross_entropy on one row of logits per token)"
                    if unseen_best and not diff <= allowed else "") + (
                    f" (their gradients w.r.t. the {what} agree, and those w.r.t. the trainable parameters too: "
                    "a term that changes the value only -- a constant, or one computed outside autograd)"
                    if diff <= allowed and not moved else ""))
        if params_differ:
            names = ", ".join(f"{name} ({norm:.3g})" for name, norm in reached[:4])
            raise ValueError(
                f"SeCOTrainer: the stock loss on the first {span} tokens of this batch reaches the model's parameters "
                f"other than through the {what}: " + (
                    f"{len(reached)} parameter(s) get a gradient from it, e.g. {names}" if reached else
                    f"the gradient of the parameters that follow them differs by {p_diff:.3g} relative from the "
                    f"cross-entropy's (rounding allows {p_allowed:.2g})") +
                " -- a penalty on the weights, an auxiliary or early-exit loss, a trainable head the loss reads, a "
                "term put in by a hook, a forward or a compute_loss; the SeCO step trains only the causal-LM "
                "cross-entropy and would leave it out; remove it (a weight decay belongs in the optimizer: "
                "weight_decay), or train that loss with the stock Trainer")
        return True

    @staticmethod
    def _seco_projectors(head, hidden, vocab: int = 0) -> list:
        """The functions that may map the hidden states to logits with the output layer ``head``: the layer itself
        (its output's first tensor) and its ``weight`` (V, hidden) through F.linear -- a forward that projects with
        the weight need not call the layer (campaign 52 V1) -- those that give V logits (campaign 53 X2: a head
        returning (aux, logits)) with a gradient (campaign 54 Y2: a call that returns zeros or detached logits) on
        one position."""
        if not isinstance(head, torch.nn.Module):
            return []
        weight = getattr(head, "weight", None)
        candidates = [lambda h: _first_tensor(head(h))]
        if torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[-1] == hidden.shape[-1]:
            candidates.append(lambda h: torch.nn.functional.linear(h, weight.to(h.dtype)))
        found = []
        for project in candidates:
            one = hidden[..., :1, :].detach().requires_grad_(True)
            try:
                with torch.enable_grad():
                    out = project(one)
            except Exception:  # an output layer of the user's own
                continue
            if torch.is_tensor(out) and out.shape[:-1] == one.shape[:-1] and out.requires_grad and (
                    not vocab or out.shape[-1] == vocab):
                found.append(project)
        return found

    @staticmethod
    def _seco_computed_in(grad: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the wider ``grad`` holds only numbers of the narrower ``dtype`` (it was computed in that dtype)."""
        return grad.dtype != dtype and bool(torch.equal(grad, grad.to(dtype).to(grad.dtype)))

    @staticmethod
    def _seco_narrowed_rounding2(x, tgt, dtype: torch.dtype, ignore_index: int, n_targets: int, project=None,
                                 seen: tuple = ()) -> _Rounding | None:
        """What the narrower ``dtype`` of the stock loss (transformers casts a float64 model's logits to float32)
        puts into the cross-entropy sum / n_targets and its gradient w.r.t. ``x`` -- the logits, or the hidden
        states that ``project`` (:meth:`_seco_projectors`) maps to them: its rounding, which grows with the logits'
        range and the vocabulary (campaign 51: 2-50 eps of float32 on float64 models with peaked logits, V
        8192-262144).  None where ``project`` fails on these positions (an output layer of the user's own).

        The loss's logits are, of what its softmax calls read (``seen[0]``) that is the float64 logits z shifted by
        a constant per row, the one whose rounding is the smallest; where none is, the one of the model's returned
        logits (``seen[1]``, where so shifted) and z whose rounding is the smaller (campaign 56 W1/W3: a metric's
        or an attention's softmax read first, a softmax by hand, a slice, another layout): a shift changes neither
        loss, and the float32 rounding of z + c grows with c (campaign 54 Y1/Y3, 55: a call, a forward or a loss
        that adds to the logits what another does not; where it cannot be told which, the smaller rounding refuses
        a term rather than passes it).  A loss on a 16-bit copy is measured in that dtype.
        r = J^T (dL/dz in ``dtype`` on them - in x's dtype on z), J the projector's Jacobian (the identity on the
        logits; not centred over the vocabulary: the rows of an output layer may share a common vector, which
        pulls the sum of the float32 softmax's rounding back, campaign 55); r_proj the same with the projector run
        in ``dtype`` (under the model's autocast, as a fused head that projects in float32 or bfloat16: campaign 53
        X3), None where it does not run so."""
        def ce(z):  # (the cross-entropy sum / n_targets, and dL/dz) in z's dtype
            leaf = z.detach().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(leaf.reshape(-1, leaf.shape[-1]), tgt.reshape(-1),
                                                     ignore_index=ignore_index, reduction="sum") / n_targets
            return float(loss.detach()), torch.autograd.grad(loss, leaf)[0]

        leaf = x.detach().requires_grad_(True)
        try:
            z = project(leaf) if project is not None else leaf
            if z.shape != (*x.shape[:-1], z.shape[-1]) or not z.requires_grad:
                return None
        except Exception:  # an output layer of the user's own that takes other positions
            return None
        z64 = z.detach()
        wide_value, wide_z = ce(z64)
        # what the loss's softmax read where it was seen; else the smaller rounding of the returned logits' and
        # the projector's (a loss that normalises by hand may round either: the smaller refuses, never passes)
        read, returned = seen if seen else ((), None)
        options = [c for c in read if c is not None and _shifted_by_rows(c, z64)]
        softmax_seen = bool(options)
        if not softmax_seen:
            options = [c for c in (returned,) if c is not None and _shifted_by_rows(c, z64)] + [z64]
        tried = []
        for loss_of in options:
            known = torch.isfinite(loss_of).all(-1, keepdim=True)  # the rows the loss read (others: z's)
            held = _held_in(loss_of[known.expand_as(loss_of)])  # a loss on a 16-bit copy rounds its gradient too
            loss_of = torch.where(known, loss_of, z64.to(loss_of.dtype))
            narrow_value, narrow_z = ce(loss_of.to(dtype))
            narrow_z = narrow_z.to(held).to(dtype) if torch.finfo(held).bits < torch.finfo(dtype).bits else narrow_z
            tried.append((float((narrow_z.double() - wide_z.double()).square().sum()), loss_of, narrow_value,
                          narrow_z))
        _, loss_of, narrow_value, narrow_z = min(tried, key=lambda t: t[0])
        rounding = narrow_z.to(z64.dtype) - wide_z

        def pulled(v):  # J^T v (the graph of z kept for the next)
            if project is None:
                return v.double()
            g = torch.autograd.grad(z, leaf, v.to(z.dtype), retain_graph=True, allow_unused=True)[0]
            return torch.zeros_like(x, dtype=torch.float64) if g is None else g.double()

        gate = pulled(wide_z)
        own = pulled(rounding)
        # another implementation's normalisation (a fused head's running logsumexp, a softmax by hand) scales each
        # row's probabilities by its own 1 + delta: J^T p per row, which a head whose rows share a common vector
        # makes large (campaign 55: TRL, 1.52e-5 apart where F.cross_entropy's rounding measured 7.5e-6)
        keep = (tgt != ignore_index).unsqueeze(-1).to(z64.dtype)
        normalising = pulled(torch.softmax(z64, -1) * keep / n_targets)
        in_loss, in_16 = None, False
        if project is not None:
            narrow = x.detach().to(dtype).requires_grad_(True)
            try:
                z_narrow = project(narrow)
                if z_narrow.requires_grad and z_narrow.shape == z.shape and torch.finfo(
                        z_narrow.dtype).bits <= torch.finfo(dtype).bits:
                    _, d = ce((loss_of if loss_of is not z64 else z_narrow.detach()).to(z_narrow.dtype).to(dtype))
                    g = torch.autograd.grad(z_narrow, narrow, d.to(z_narrow.dtype), allow_unused=True)[0]
                    in_loss = None if g is None else g.double() - gate
                    in_16 = torch.finfo(z_narrow.dtype).bits <= 16

            except Exception:  # a call that does not run in the loss's dtype (a float64 layer)
                pass
        return _Rounding(own, in_loss, gate, narrow_value - wide_value, in_16, normalising, softmax_seen)

    def _seco_scaled_grads(self, stock, inputs: list, n_targets: int) -> tuple[float, tuple]:
        """The stock loss's gradients w.r.t. ``inputs``, and the power of two they were taken at (campaign 50):
        where the model computes in float16 (its weights, or autocast), the loss is scaled by 2^ceil(log2
        n_targets), as GradScaler does, so that dL/dz ~ (p - y) / n_targets does not flush to float16's subnormals
        (below 6.1e-5: at V = 32000 and 1024 tokens the output layer's gradient came 2.2 eps of float16 apart from
        the engine's); divided by 16 until every gradient is finite.  The engine's side is taken at the same scale.
        1 in other dtypes."""
        scale = 1.0
        if self._seco_check_computed == torch.float16:
            scale = float(2 ** math.ceil(math.log2(max(n_targets, 1))))
        while True:
            grads = torch.autograd.grad(stock * scale if scale != 1 else stock, inputs, allow_unused=True,
                                        retain_graph=scale != 1)
            if scale == 1 or all(g is None or bool(torch.isfinite(g).all()) for g in grads):
                return scale, grads
            scale = max(scale / 16, 1.0)

    @staticmethod
    def _seco_same_output_rounding(stock, dtype: torch.dtype, what: str = "logits", vocab: int = 0) -> dict:
        """What rounding may put between the stock loss and the engine's cross-entropy on the same compared output
        (campaign 49 S2: 1024 eps of float32 let a term of 20-40x the rounding pass), relative, in eps of the stock
        loss's dtype (a 16-bit model's transformers loss is float32) and at least 2 eps of 16-bit weights or
        autocast ``dtype`` (each side rounds its gradient once to it: relative RMS eps/(2 sqrt 3) = 0.29 eps):

        * ``gradient`` on the same logits, 2 eps, whatever the model's dtype: elementwise, the same softmax on both
          sides (measured 0 in float32, bfloat16 and float16 models, also under autocast; 0.37 eps of float32 for a
          float64 model, whose transformers loss is float32; campaign 50 T1: at 64 eps a z-loss 1e-6 passed, 40x
          the rounding of a float64 run); on the same hidden states max(64, sqrt V) eps: dL/dh = W^T dL/dz sums
          over the vocabulary, in blocks that depend on the number of rows (measured 0.11 sqrt(V) eps: 19 eps of
          float32 at V = 32000, 56 at V = 262144);
        * ``value``, 64 eps: a sum over the tokens (measured <= 1.1 eps of float32, 3.8 eps of a float64 loss);
          a term that changes the value and no gradient would not change training;
        * ``parameters`` after the compared output (the engine's summed over the chunks in float64), 16 eps:
          measured <= 2.8 eps of float32 for 48-2048 tokens, 1-1024 chunks, V 64-32000; 0.25-0.32 eps of bfloat16
          and float16 (the latter at a loss scale, :meth:`_seco_scaled_grads`).

        Where the stock loss is narrower than the logits (transformers casts a float64 model's to float32), twice
        its own rounding of the cross-entropy is allowed on top (:meth:`_seco_narrowed_rounding2`; on the hidden
        states, twice dL/dh's difference for the parameters): 2-50 eps of float32 with peaked logits (campaign 51)."""
        loss = stock.dtype if torch.is_tensor(stock) and stock.is_floating_point() else torch.float32
        eps, low = torch.finfo(loss).eps, torch.finfo(loss).bits <= 16
        floor = 2 * torch.finfo(dtype).eps if torch.finfo(dtype).bits <= 16 else 0.0
        if what == "logits":  # the loss's own rounding only: z is the same tensor on both sides
            return {"gradient": 2 * eps, "value": (2 if low else 64) * eps,
                    "parameters": max(floor, (2 if low else 16) * eps)}
        return {"gradient": max(floor, (2 if low else max(64.0, vocab ** 0.5)) * eps),
                "value": max(floor, (2 if low else 64) * eps),
                "parameters": max(floor, (2 if low else 16) * eps)}

    @staticmethod
    def _seco_loss_rounding(stock, dtype: torch.dtype) -> float:
        """The relative difference rounding may put between the stock loss and the engine's on the same tokens,
        each on its own forward: 1024 eps of a 32- or 64-bit stock loss (transformers' loss is float32 whatever
        the model's: 1.2e-4; float64: 2.3e-13), 4 eps of a loss computed in 16 bits (campaign 44 M1), and at least
        4 eps of 16-bit weights or autocast, whose two forwards round apart (0.031 in bfloat16, 0.0039 in float16).
        Measured on the 2-layer test Llama: 9.3e-8 in float64 (float32 loss), 0 in float32 (also under bf16
        autocast), 1.2e-3 in bfloat16, 1.9e-4 in float16.  A term this lets pass is still seen on the same output
        (:meth:`_seco_same_output_rounding`)."""
        dtype_loss = stock.dtype if torch.is_tensor(stock) and stock.is_floating_point() else torch.float32
        allowed = (4 if torch.finfo(dtype_loss).bits <= 16 else 1024) * torch.finfo(dtype_loss).eps
        return max(allowed, 4 * torch.finfo(dtype).eps) if torch.finfo(dtype).bits <= 16 else allowed

    def _seco_backward(self, adapter: HFChunkModel, tokens, targets, scale: float) -> torch.Tensor:
        """Add ``scale`` times the gradient (SeCO) or its estimate (SpaCO) of the mean token loss into
        ``p.grad``; return the mean token loss."""
        s = self.seco_args
        if s.mode == "seco":
            return seco_step(adapter, tokens, targets, s.chunk_size, scale=scale)
        k = ceil_div(tokens.shape[-1], s.chunk_size)
        if s.subset is not None:
            subset = check_subset(s.subset, k)
        else:
            rng = np.random.default_rng([s.seed, self.state.global_step, self._seco_micro, self.args.process_index])
            subset = s.build_scheme().sampler.draw(k, s.budget, rng)
        self.seco_draws.append((self.state.global_step, self._seco_micro, tuple(subset)))
        if not subset:  # an empty Bernoulli draw: forward only, zero gradient
            return forward_loss(adapter, tokens, targets, s.chunk_size)
        loss, grads = spaco_grad(adapter, tokens, targets, s.chunk_size, s.build_scheme(), s.budget, subset=subset)
        named = dict(adapter.named_parameters())
        for name, g in grads.items():
            p = named[name]
            if p.grad is None:
                p.grad = g.mul_(scale)
            else:
                p.grad.add_(g, alpha=scale)
        return loss

    def _seco_allreduce(self, params) -> None:
        """Average ``p.grad`` over the data-parallel processes: one all-reduce of a flat buffer per dtype."""
        world = self.accelerator.num_processes
        if world == 1 or self.accelerator.distributed_type not in self._seco_ddp_types():
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            pos = 0
            for g in grads:
                g.copy_(flat[pos : pos + g.numel()].view_as(g))
                pos += g.numel()
        self.seco_allreduce_calls = getattr(self, "seco_allreduce_calls", 0) + len(by_dtype)

    # ------------------------------------------------------------------ resume

    @staticmethod
    def _saved_settings(folder) -> dict | None:
        """The SeCO settings a checkpoint folder's ``seco_trainer.json`` records (None: the folder has none, as a
        checkpoint written by a plain Trainer).  A damaged file (a FIFO or device, too large, not JSON, nested too
        deeply, not the object the trainer writes) is a ValueError naming it: its settings cannot be compared."""
        path = Path(folder) / SETTINGS_FILE
        if not path.exists() and not path.is_symlink():
            return None
        fix = ("its SeCO settings are damaged and cannot be compared with this run's; restore the file the checkpoint "
               "was written with, or remove it to resume without the comparison")
        try:
            record = read_json(path, "SeCO settings file", CONFIG_MAX_BYTES, fix)
        except OSError as e:  # a dangling link, no permission
            raise ValueError(f"SeCO settings file {path} cannot be read ({e.strerror or e}); {fix}") from None
        if not isinstance(record.get("settings"), dict):
            raise ValueError(f"SeCO settings file {path} records no settings (no \"settings\" object); {fix}")
        return record["settings"]

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; on resume, warns when the checkpoint was written with other SeCO settings."""
        folder = resume_from_checkpoint
        if folder is True:
            from transformers.trainer_utils import get_last_checkpoint

            folder = get_last_checkpoint(self.args.output_dir)
        saved = self._saved_settings(folder) if isinstance(folder, (str, os.PathLike)) else None
        if saved is not None:
            if saved != self.seco_args.to_dict():
                logger.warning("resuming from %s, written with SeCO settings %s, with %s: the run will not equal an "
                               "uninterrupted one", folder, saved, self.seco_args.to_dict())
        self._seco_micro = 0
        self._seco_loss_checked = self._seco_loss_checked_at = None  # every train() checks its first micro-batch
        return super().train(resume_from_checkpoint, *args, **kwargs)


class SeCOTrainer(SeCOTrainerMixin, Trainer):
    """``transformers.Trainer`` whose backward runs chunk by chunk (SeCO or SpaCO); see the module docstring."""
