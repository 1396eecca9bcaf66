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
model's logits to float32), that loss's own rounding is measured on its code: it and the engine's chunks run again
on the same z with their casts kept in float64 (``_Widened``); widened, they must agree within float64's b plus half
of what sets them apart as they run, and the stock loss runs a third time as it is, to refuse randomness (campaign
58; campaigns 51-57 fooled every model of that rounding). So does any loss of a float64 model (it may compute
narrower than it returns), and where the first value check fails on a float64 model both sides run again widened,
within float64's a plus half what the widening moved them. Where neither can be paired, the values alone are
compared, warned. A check that passes on a train() call's or a changed loss's first micro-batch warns what it
cannot see (``_seco_warn_resolution``): a term that appears only between checks or only on tokens the checked
micro-batch lacks, and for a loss narrower than the model the term sizes below which a term is rounding to the check
(campaign 59: a term built from rounding error is rounding, amplified; no comparison tells them apart).

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

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.checkpoint

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


def _power_of_two(factor: float) -> bool:
    return factor > 0 and math.frexp(factor)[0] == 0.5


def _times(g: torch.Tensor, factor: float) -> torch.Tensor:
    """``g`` (in float32 at least) times ``factor``: in its dtype where that is exact (a power of two), else in
    float64, so that the stock loss's gradients are rescaled without a rounding of their own."""
    g = _widened(g)
    return g * factor if _power_of_two(factor) else g.double() * factor


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
        with torch._C.DisableTorchFunction():  # (of its own dtype, under _Widened too)
            into.append(first.detach().requires_grad_(True))
        return _with_first(out, into[-1])
    return hook


def _next_slice_of(whole: torch.Tensor, into: list, replaced: list | None = None):
    """A forward hook replacing each output of the layer (its first tensor) by the next positions of ``whole``
    (dim -2), in order, as a leaf of its own (kept in ``into``; the layer's own output, with its graph, in
    ``replaced``); an output that does not fit is left as it is (``into`` gets None)."""
    def hook(_module, _args, out):
        first = _first_tensor(out)
        start = sum(p.shape[-2] for p in into if p is not None)
        with torch._C.DisableTorchFunction():  # a leaf of whole's own dtype, under _Widened too (campaign 63 F4)
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


_NARROW = (torch.float32, torch.float16, torch.bfloat16)
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16,
          torch.Tensor.double: torch.float64, torch.Tensor.to: None, torch.Tensor.type: None,
          torch.Tensor.type_as: None}
_NOMINAL = "_seco_nominal"  # on a widened tensor: the dtype it has in the stock loss run as it is
_READS = {torch._C.TensorBase.__dict__[name]: name for name in ("dtype", "itemsize", "nbytes")}
_SHOWN = {torch.Tensor.numpy, torch.Tensor.untyped_storage, torch.Tensor.storage, torch.Tensor.__repr__,
          torch.Tensor.__format__, torch.Tensor.tolist}


def _nominal(t) -> torch.dtype:
    return getattr(t, _NOMINAL, t.dtype)


def _marked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype != t.dtype:
        setattr(t, _NOMINAL, dtype)
    return t


def _quantum(sites: list) -> float:
    """The largest rounding step of ``sites`` ((eps, largest magnitude, share) of each narrowing,
    :meth:`_Widened._site`): eps x the larger of its largest magnitude and its share of the gradient -- the arithmetic
    after a narrowing rounds at eps relative whatever the magnitude (plain cross-entropy on logits of magnitude 3e-3
    measured 0.25 eps of float32 apart on a float64 model; in bfloat16 on logits of 4e-3 with a float32 projection
    before it, campaign 61 J3), as much as that arithmetic carries of the compared gradient: the norm of the
    gradient w.r.t. the narrowed values times their largest magnitude, over the same of the compared output, at most
    1 (1 where it is not known); a narrowing of zeros or of values the loss barely reads rounds at next to nothing
    (campaign 60 J2)."""
    return max((eps * max(m, share) for eps, m, share in sites), default=0.0)


class _Widened(torch.overrides.TorchFunctionMode):
    """Runs the torch calls made while it is active with every narrowing of float64 (``wide``: the model's dtype;
    float32 to a 16-bit dtype where that is float32) kept in float64: a cast of a float64 tensor to float32, float16
    or bfloat16 (``.float()``, ``.to(dtype)``, ``.type_as``...) returns a float64 copy, a narrower ``dtype`` argument
    (``log_softmax(x, dtype=torch.float32)``, ``torch.zeros(..., dtype=...)``) becomes float64, and narrower floating
    tensors passed to a call (a float32 class weight) are read in float64.
    Code that reads a widened tensor's ``dtype`` (``itemsize``, ``element_size()``, ``type()``; its ``numpy()``, its
    storages, its text, a ``view(dtype)`` of its bits) reads the dtype it has run as it is, so it takes the same
    branches (campaign 58; not ``isinstance(x, torch.FloatTensor)``, which torch checks in C).  The stock loss of a
    float64 model run so has no rounding but float64's (transformers casts its logits to float32): what the loss
    computes, exactly, to compare with the engine's cross-entropy; the loss run as it is, minus the same run
    widened, is the loss's own rounding, measured on its own code (campaigns 51-57 fooled every model of it).  A
    custom autograd Function's backward (TRL's fused head), which autograd runs without the modes of its forward,
    runs widened too while this is active.

    ``wide`` 16-bit (the compared output is: bfloat16 autocast logits, a bfloat16 model's), there is no narrower
    dtype to keep: the loss's own 16-bit arithmetic on it is kept in float32 instead -- a cast to the other 16-bit
    dtype returns a float32 copy, an op that reads 16-bit values computes in float32 and reports their dtype -- each
    a rounding step recorded (campaign 63 F4: a float16 cross-entropy, a log-softmax by hand in bfloat16)."""

    def __init__(self, wide: torch.dtype = torch.float64, sites: list | None = None):
        super().__init__()
        self.given = wide
        # a 16-bit output (bfloat16 logits, of autocast or of a bfloat16 model): the loss's own 16-bit arithmetic on
        # it -- a cross-entropy in float16, a log-softmax by hand in bfloat16 -- kept in float32 (campaign 63 F4)
        self.native = torch.finfo(wide).bits <= 16
        self.wide = torch.float32 if self.native else wide  # narrower floating dtypes are kept in it
        self.narrow = tuple(d for d in _NARROW if torch.finfo(d).bits < torch.finfo(self.wide).bits)
        self.sites = sites  # where given: (each narrowing's output, eps, largest magnitude), for the caller

    def _site(self, out: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Records the narrowing of ``x`` to ``dtype`` kept as ``out``: (out, eps of that dtype -- of autocast's, where
        that is narrower --, the largest magnitude of ``x``), for :func:`_quantum`."""
        if self.sites is not None and x.numel():
            if torch.is_autocast_enabled(x.device.type) and torch.finfo(torch.get_autocast_dtype(
                    x.device.type)).bits < torch.finfo(dtype).bits:
                dtype = torch.get_autocast_dtype(x.device.type)
            self.sites.append((out, torch.finfo(dtype).eps, _largest(x)))
        return out

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        """A narrower tensor an op reads, in the wide dtype.  On a 16-bit output (:attr:`native`), one copy per tensor
        (and version) for every op that reads it: its gradient then sums in float32 over them and rounds to its dtype
        once, as a float32 loss's does (campaign 66 LSE16: logsumexp(x) - x.gather(y) in bfloat16 summed the two in
        bfloat16 at the logits, 0.004 apart from the cross-entropy's)."""
        if not self.native:
            return t.to(self.wide)
        try:
            version = t._version
        except RuntimeError:  # (an inference tensor)
            return t.to(self.wide)
        key = (id(t), torch.is_grad_enabled())  # (a copy read under no_grad has no graph: campaign 67 NGREAD)
        hit = self._copies.get(key)
        if hit is None or hit[0] is not t or hit[1] != version:
            hit = self._copies[key] = (t, version, t.to(self.wide))
        return hit[2]

    def __enter__(self):
        self._copies: dict = {}  # (the tensor, its version, its wide copy) by id, for :meth:`_read`
        self._backward = torch.autograd.function.BackwardCFunction.apply

        def apply(node, *args, run=self._backward):
            with _Widened(self.given):
                return run(node, *args)
        torch.autograd.function.BackwardCFunction.apply = apply
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autograd.function.BackwardCFunction.apply = self._backward
        self._copies = {}
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        marked = torch.is_tensor(first) and hasattr(first, _NOMINAL)
        if not marked and torch.is_tensor(first) and first.dtype in self.narrow and (
                getattr(func, "__self__", None) in _READS or func is torch.Tensor.element_size or func in _SHOWN or
                func is torch.Tensor.view and any(isinstance(a, torch.dtype) for a in (*args[1:], *kwargs.values()))):
            # what a narrower tensor not kept wide (the 16-bit logits, a float32 class weight) is: as it is, not read
            # wide (campaign 69 review: bfloat16 logits' .dtype read float32, so torch.empty(z.shape, dtype=z.dtype)
            # made a float32 buffer, and a term gated on z.dtype was off in the widened run)
            return func(*args, **kwargs)
        if marked and getattr(func, "__self__", None) in _READS:
            read, nominal = _READS[func.__self__], getattr(first, _NOMINAL)
            size = torch.finfo(nominal).bits // 8
            return nominal if read == "dtype" else size if read == "itemsize" else size * first.numel()
        if marked and (func is torch.Tensor.element_size or func is torch.Tensor.type and len(args) == 1 and
                       not kwargs):
            shown = torch.empty(0, dtype=getattr(first, _NOMINAL), device=first.device)
            return shown.element_size() if func is torch.Tensor.element_size else shown.type()
        if marked and (func in _SHOWN or func is torch.Tensor.view and any(isinstance(a, torch.dtype) for a in (
                *args[1:], *kwargs.values()))):  # numpy, the storage, the text, the bits: of the narrower copy
            return func(first.detach().to(getattr(first, _NOMINAL)), *args[1:], **kwargs)
        if func is torch.result_type:  # on the dtypes the tensors have as they are
            return torch.result_type(*(torch.empty((1,) * a.dim(), dtype=_nominal(a)) if torch.is_tensor(a) else a
                                       for a in args), **kwargs)
        if func in _CASTS and torch.is_tensor(first):
            out = func(*args, **kwargs)
            if not torch.is_tensor(out):
                return out
            asked = _CASTS[func] or kwargs.get("dtype") or next(
                (a if isinstance(a, torch.dtype) else _nominal(a) for a in args[1:]
                 if isinstance(a, torch.dtype) or torch.is_tensor(a)), None)
            asked = out.dtype if asked is None and out.dtype != first.dtype else asked
            if first.dtype == self.wide and (out.dtype in self.narrow or asked in self.narrow):
                to = out.dtype if out.dtype in self.narrow else asked
                kept = _marked(first.to(out.device, copy=True), to)
                # a cast to a dtype that holds every value of the one it has as it runs (bfloat16 to float32) rounds
                # nothing (campaign 61 J3: a bfloat16 loss's .float())
                exact = marked and torch.promote_types(getattr(first, _NOMINAL), to) == to
                return kept if exact else self._site(kept, first, to)
            if self.native and not marked and first.dtype in self.narrow and out.dtype in self.narrow and (
                    out.dtype != first.dtype):  # a 16-bit tensor cast to the other 16-bit dtype (bfloat16 to float16)
                return self._site(_marked(first.to(out.device, self.wide, copy=True), out.dtype), first, out.dtype)
            if marked and asked == self.wide:  # back to the wide dtype: a tensor of its own, as the cast makes
                return first.to(out.device, copy=True)
            return _marked(out, getattr(first, _NOMINAL)) if marked and out is not first and \
                out.dtype == first.dtype else out
        narrow, wide = self.narrow, self.wide
        asked = kwargs.get("dtype") if kwargs.get("dtype") in narrow else next(
            (a for a in args if isinstance(a, torch.dtype) and a in narrow), None)
        if asked is not None:
            if kwargs.get("dtype") in narrow:
                kwargs["dtype"] = wide
            args = tuple(wide if isinstance(a, torch.dtype) and a in narrow else a for a in args)
        name = getattr(func, "__name__", "")  # add_, __iadd__, __setitem__ write into their first argument
        inplace = name.endswith("_") and not name.startswith("__") or name.startswith("__i") or "out" in kwargs or (
            func is torch.Tensor.__setitem__)
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                   if torch.is_tensor(t) and t.is_floating_point()]  # (torch.cat's list too)
        args = tuple(self._read(a) if torch.is_tensor(a) and a.dtype in narrow and not (inplace and i == 0) else a
                     for i, a in enumerate(args))
        kwargs = {k: self._read(v) if torch.is_tensor(v) and v.dtype in narrow else v for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if inplace:
            into = _nominal(first) if torch.is_tensor(first) and hasattr(first, _NOMINAL) else None
            wider = [t for t in tensors if t is not first and into is not None and torch.promote_types(
                _nominal(t), into) != into]
            # a write of wider values into a tensor kept wide that is narrower as it runs (copy_ into a bfloat16
            # buffer, buf[...] = z) rounds them there: a narrowing (campaign 68 copybuf); on a 16-bit output, a write
            # of its 16-bit values into a buffer of their dtype is the first step of the loss's 16-bit arithmetic on
            # them, as an op that reads them is (campaign 69 COPYSAME)
            native = [t for t in tensors if t is not first and into is not None and self.native and
                      t.dtype in narrow and not hasattr(t, _NOMINAL)]
            if wider or native:  # rounding the values stored (eps x the largest: a no-op add_ of a large constant
                # adds nothing), where the loss reads them: a view written into (big[..., :V].copy_(z)) is read
                # through its base (a fresh view of it), so the site is the base (campaign 69 review)
                base = first._base if first._base is not None and first._base.requires_grad else first
                self._site(base, first, into)
            return out
        # 16-bit arithmetic (on a 16-bit output: :attr:`native`), kept in float32: a rounding step as a cast of the
        # 16-bit values it reads would make (eps x their largest magnitude: a log-softmax by hand's first step on
        # the logits), or, after one, as much as it carries of the gradient (eps x its share, at most 1:
        # :func:`_quantum`)
        arithmetic = self.native and any(t.dtype in narrow or hasattr(t, _NOMINAL) for t in tensors)
        read = max((t for t in tensors if t.dtype in narrow and not hasattr(t, _NOMINAL)), key=_largest,
                   default=torch.zeros(1)) if arithmetic else None
        if asked is None and (arithmetic or any(hasattr(t, _NOMINAL) for t in tensors)):
            dims = [t for t in tensors if t.dim()] or tensors
            asked = _nominal(dims[0])
            for t in dims[1:]:
                asked = torch.promote_types(asked, _nominal(t))
        if asked is not None and asked != wide:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if torch.is_tensor(t) and t.dtype == wide:
                    _marked(t, asked)
                    if kwargs.get("dtype") is wide and torch.is_tensor(first) and first.dtype == wide:
                        self._site(t, first, asked)  # log_softmax(x, dtype=torch.float32)
                    elif arithmetic:  # 16-bit arithmetic kept in float32
                        self._site(t, read, asked)
        return out


def _computed_as(stock: torch.Tensor, output: torch.dtype) -> torch.Tensor:
    """``stock``, or a float32 stand-in where it is float64 and the model's output narrower: a loss returned in float64
    computes in float64 only on a float64 model's output, as far as the check can tell -- on float32 or 16-bit logits
    it may well compute in float32 (campaign 67 F32R64: a float32 cross-entropy returned in float64 on float16 logits
    was held to float64's 64 eps in value, 7.2e-8 apart)."""
    return torch.empty(0) if stock.dtype == torch.float64 and output != torch.float64 else stock


def _largest(t: torch.Tensor) -> float:
    """The largest finite magnitude in ``t`` (0 where it has none: a row of -inf masked logits)."""
    t = t.detach()
    return float(t.abs().nan_to_num(0.0, 0.0, 0.0).max()) if t.numel() else 0.0


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

    #: a narrowed loss's measured rounding may be at most this many times the largest step at which a narrowing
    #: its gradient goes through rounds (eps of its dtype times its largest magnitude: :func:`_quantum`)
    ROUNDING_STEPS = 16
    #: on a 16-bit compared output, gradient elements 1 ulp apart on at most this share of them are rounding (each
    #: side rounds its gradient to the dtype: computed apart by float32's rounding, 1e-4 of them flip; campaign 68)
    FLIPS = 0.01
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
        if (signature != self._seco_loss_checked or due) and self._seco_check_loss(model, adapter, inputs,
                                                                                    num_items_in_batch):
            if signature != self._seco_loss_checked:  # not a periodic recheck of the same loss: what it cannot see
                self._seco_warn_resolution()
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

    def _seco_check_loss(self, model, adapter: HFChunkModel, inputs, num_items_in_batch=None) -> bool:
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
            self._seco_check_resolution = None  # what a narrowed loss was compared to (_seco_check_loss_gradient)
            try:
                return self._seco_check_loss_within(model, adapter, inputs, self.seco_loss_check_logits_bytes,
                                                    num_items_in_batch)
            except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
                if isinstance(error, torch.utils.checkpoint.CheckpointError) or "torch.utils.checkpoint is " \
                        "incompatible with .grad()" in str(error):
                    # (campaign 70: a cross-entropy under torch.utils.checkpoint -- reentrant, which only .backward()
                    # runs; non-reentrant, whose recomputation, run by the check's autograd.grad, no longer has the
                    # check's float64 casts its first run had -- was a traceback)
                    raise ValueError(
                        "SeCOTrainer: the stock loss runs under torch.utils.checkpoint, which the loss check cannot "
                        f"differentiate as it needs ({str(error).splitlines()[0][:160]}): the SeCO step computes the "
                        "loss chunk by chunk, so checkpointing it saves nothing; remove the checkpoint from the loss, "
                        "or train that loss with the stock Trainer") from None
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

    def _seco_warn_resolution(self) -> None:
        """Where a loss check passed on the first micro-batch of a ``train()`` call or of a changed loss (not on the
        periodic rechecks of the same one): what it cannot see. It compares the stock loss on one
        micro-batch, at the first step, every ``seco_loss_check_every`` steps and when the loss's code changes, so a
        term that appears between checks (a call counter, the step) or only on tokens the checked micro-batch lacks is
        not seen (campaign 58 H4, 55 Z7). A loss narrower than the model (transformers' float32 loss on a float64
        model) is compared only to its own rounding (:meth:`_seco_check_loss_gradient`), measured: a term below half
        of it, or one its float64 run does not compute (gated on ``isinstance(x, torch.FloatTensor)``, built from its
        own rounding error) below ``ROUNDING_STEPS`` rounding steps, is rounding to the check -- in principle: a term
        made of rounding error is rounding, amplified (campaign 59 I1-I4). A loss in the model's dtype is told the
        allowance of that dtype, at least 2 eps of a 16-bit compared output, whose gradient rounds a smaller term's
        share away (campaign 63)."""
        every = self.seco_loss_check_every
        text = ("SeCOTrainer: the loss check passed: the stock compute_loss agrees with the cross-entropy the SeCO "
                "step trains on the checked micro-batch (it is checked again " +
                (f"every {every} optimizer steps and " if every else "") + "whenever the loss's code changes); a term "
                "that appears only between checks (one that depends on the step or on how often the loss has been "
                "called), only on other micro-batches (one that depends on how many targets a micro-batch holds, "
                "or on the num_items_in_batch the Trainer passes with it) or only on tokens absent from the checked "
                "micro-batch is not seen")
        shown = self._seco_check_resolution
        if shown is not None and shown["rounding"] is None:  # a loss in the model's dtype: that dtype's rounding
            text += (f". On the same {shown['what']} ({shown['model']}), the stock loss's gradient w.r.t. them and "
                     "the engine's were compared to rounding: a term smaller than "
                     f"{shown['visible']:.2g} relative is not seen" + (
                         f" ({shown['model']} rounds a smaller one's share of that gradient away)"
                         if shown["model"] in ("bfloat16", "float16") else ""))
        elif shown is not None:  # (on a float64 model whatever the loss computes in: campaign 63 F5)
            kept = (f"any casts to a dtype narrower than the {shown['model']} model's kept in {shown['model']}"
                    if shown["wide"] == shown["model"] else  # (a 16-bit output: campaign 63 F4)
                    f"its casts and 16-bit arithmetic on the {shown['model']} {shown['what']} kept in {shown['wide']}")
            text += (f". The loss was compared only to its own rounding, measured by running it as it is and with "
                     f"{kept}: its gradients w.r.t. the {shown['what']} in the two runs differ by, beyond the "
                     "engine's, "
                     f"{shown['rounding']:.2g} relative (all of it counted as rounding): a term smaller than "
                     f"{shown['visible']:.2g} relative is not seen")
            if shown["hidden"] is not None:
                text += (f", nor one below {shown['hidden']:.2g} that the loss leaves out in whole or in part when "
                         f"run with its casts {'' if shown['wide'] == shown['model'] else 'and 16-bit arithmetic '}"
                         f"kept in {shown['wide']} (a term gated on the tensor's type, as "
                         "isinstance(x, torch.FloatTensor), or on the values being numbers of the narrower dtype, or "
                         "built from its own rounding error)")
            if shown["rounding"] > 0:  # (a loss with nothing to widen computes in the model's dtype already)
                text += ("; compute the loss in the model's dtype (compute_loss_func) to check it to that dtype's "
                         "rounding")
        logger.warning(text)

    def _seco_check_loss_within(self, model, adapter: HFChunkModel, inputs, bound: int,
                                num_items_in_batch=None) -> bool:
        """Compare the stock ``compute_loss`` with the engine's cross-entropy on the micro-batch (where the whole
        one's float32 logits exceed ``bound`` bytes, on a prefix: below), with the batch's own labels
        and ``num_items_in_batch`` (a term that depends on which targets are masked, or on that argument, is seen:
        campaign 43 N2): in value given twice the span's targets (a loss that ignores the argument is refused), in
        gradient given the ``num_items_in_batch`` the Trainer passes this step where it passes one (campaign 63);
        raise ValueError if they differ by more than rounding allows (:meth:`_seco_loss_rounding`), in value on their
        own forwards and, on the same logits, in value and gradient (:meth:`_seco_check_loss_gradient`).  Returns
        False when there was nothing to compare (no target).

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
                               "compared on this micro-batch, nor one that depends on how many tokens or targets "
                               "the loss is given (the check gives it fewer); raise seco_loss_check_logits_bytes to "
                               "compare them",
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
        stock, logits = self._seco_stock_loss(unwrapped, prefix, items, head, vocab, "logits")
        allowed = self._seco_loss_rounding(_computed_as(stock, computed), computed)
        value = float(stock.detach()) * ratio
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
        if not abs(value - ours) <= allowed * max(abs(ours), 1.0) and (
                torch.finfo(computed).bits <= 16 < torch.finfo(stock.dtype).bits):
            # a 16-bit model's loss that computes in the other 16-bit dtype and returns wider (bfloat16 on a float16
            # model, whose value rounds beyond float16's 4 eps: 0.0047, campaign 66 F16BF): 4 eps of the narrowest
            # its gradient goes through
            allowed = max(allowed, 4 * self._seco_sixteen_bit(lambda: self._seco_stock_loss(
                unwrapped, prefix, items, head, vocab, "logits", widen=True)[0], computed))
        widened = ""
        if not abs(value - ours) <= allowed * max(abs(ours), 1.0) and (computed == torch.float64 or (
                self._seco_sixteen_bit(lambda: self._seco_stock_loss(unwrapped, prefix, items, head, vocab, "logits",
                                                                     widen=True)[0]))):
            # a float64 model whose loss computes narrower than the value it returns (a float32 loss cast back, a
            # custom Function), or rounds logits near 3e5 beyond 1024 eps; a float32 model whose loss computes in 16
            # bits (campaign 61 J4): both sides again, widened (:class:`_Widened`: to the model's dtype), within
            # 1024 eps of that dtype and half what the widening moved them
            with torch.no_grad(), _Widened(computed), self.compute_loss_context_manager(), \
                    self.accelerator.autocast():
                ours_w = float(forward_loss(adapter, tokens, targets, c))
            with _Widened(computed):
                stock_w = float(self._seco_stock_loss(unwrapped, prefix, items, head, vocab, "logits",
                                                      widen=True)[0].detach()) * ratio
            apart = abs(value - stock_w) + abs(ours - ours_w)
            widened = f" (both run with their casts in {str(computed).removeprefix('torch.')})"
            # (where widening did not move a float64 model's stock loss, it may compute in float32 out of torch's
            # sight -- numpy, a compiled kernel --: a float32 loss's 1024 eps; the same-output check then measures
            # what it can)
            unmoved = stock_w == value  # the stock loss: the same value widened
            allowed = 1024 * torch.finfo(torch.float32 if unmoved else computed).eps + apart / 2 / max(abs(ours), 1.0)
            value, ours = stock_w, ours_w
        if not abs(value - ours) <= allowed * max(abs(ours), 1.0):
            raise ValueError(
                f"SeCOTrainer: the loss the stock Trainer computes (compute_loss) on the first {span} tokens of this "
                f"batch is {value!r}" + (f" (given num_items_in_batch = {int(items)}, twice their targets, and "
                                         "doubled)" if ratio != 1 else "") +
                f", the causal-LM cross-entropy the SeCO step trains {ours!r}{widened} (relative difference "
                f"{abs(value - ours) / max(abs(ours), 1.0):.3g}, rounding allows {allowed:.2g}): something adds to or "
                "changes the loss where the trainer's class checks cannot see it -- a forward or compute_loss set on "
                "the instance, a forward hook on the model, a subclass's extra term, or randomness in the forward -- "
                "and the SeCO step would leave it out; remove it, or train that loss with the stock Trainer")
        # the gradients: of the stock loss given the num_items_in_batch the Trainer passes this step (campaign 63: a
        # term on where num_items_in_batch is not twice the targets was off in the check only), rescaled to the mean
        # (in float64: :func:`_times`)
        if ratio != 1 and num_items_in_batch is not None:
            real = float(num_items_in_batch.reshape(-1)[0] if torch.is_tensor(num_items_in_batch) else
                         num_items_in_batch)
            if real > 0 and real != float(items):
                del stock, logits
                items, ratio = num_items_in_batch, real / (n_targets * spread)
                stock, logits = self._seco_stock_loss(unwrapped, prefix, items, head, vocab, "logits")

        def rerun(layer, width, what):  # the stock loss (and its gradients) on given outputs of the layer, widened
            def run(given: torch.Tensor, widen: bool, graph: bool = False) -> tuple:
                """(value, the dtype it computed in -- as it runs, widened or not: a widened loss that still
                computes narrower narrows by a route :class:`_Widened` does not follow --, largest rounding step,
                gradients w.r.t. ``given`` and the trainable parameters);
                ``graph``: (the loss, the leaves) instead, its graph kept."""
                sites: list = []
                with _Widened(given.dtype, sites) if widen else nullcontext():  # its backward too (TRL's fused head)
                    loss, leaves = self._seco_stock_loss(unwrapped, prefix, items, layer, width, what, given, widen)
                    if graph:
                        return loss, leaves
                    if not self._seco_paired(leaves, loss, tokens):
                        raise ValueError(
                            f"SeCOTrainer: the stock compute_loss, run again on the same {what} to measure its "
                            f"rounding{' with its casts to narrower dtypes kept in float64' if widen else ''}, did not "
                            "read them as the first run did (randomness, or state that changes between calls, in the "
                            "forward or the loss): its gradient cannot be compared; train that loss with the stock "
                            "Trainer")
                    graphed = [site for site in sites if site[0].requires_grad]
                    grads = torch.autograd.grad(loss, [leaves[0]] + [p for _, p in trainable] + [
                        site[0] for site in graphed], allow_unused=True)
                # the largest rounding step of the narrowings the loss's gradient goes through (of all of them where
                # none is in the graph: a custom Function's, whose forward runs without one)
                through = grads[len(grads) - len(graphed):] if graphed else ()
                # each narrowing's share: |dL/d its values| x their largest magnitude over the same of the compared
                # output (unchanged by scaling the values before the cast and back after it)
                compared = float(grads[0].double().norm()) * float(given.abs().max()) if grads[0] is not None else 0.0
                quantum = _quantum([(eps, m, min(1.0, float(g.double().norm()) * m / compared) if compared > 0 else 1.0)
                                    for (_, eps, m), g in zip(graphed, through) if g is not None and bool(
                                        g.ne(0).any())] if graphed else [(*site[1:], 1.0) for site in sites])
                del sites, graphed, through
                return (float(loss.detach()) * ratio, loss.dtype, quantum,
                        *(None if g is None else g.double() * ratio for g in grads[:1 + len(trainable)]))
            return run

        same_logits = ("logits", head, logits, stock, trainable, rerun(head, vocab, "logits"), ratio)
        if self._seco_check_loss_gradient(unwrapped, adapter, same_logits, tokens, targets):
            return True
        del same_logits, logits, stock  # the first stock forward's graph
        if decoder is not None:
            # the output layer did not compute the logits (TRL's fused head projects the decoder's output itself):
            # pair on the decoder's last hidden state h instead
            stock_h, hidden = self._seco_stock_loss(unwrapped, prefix, items, decoder, None, "hidden states")
            same_hidden = ("hidden states", decoder, hidden, stock_h, trainable, rerun(decoder, None, "hidden states"),
                           ratio)
            if self._seco_check_loss_gradient(unwrapped, adapter, same_hidden, tokens, targets):
                return True
        logger.warning("SeCOTrainer: the loss check compared loss values only: neither the output layer (%s, "
                       "get_output_embeddings()) nor the decoder (%s, base_model) computed the logits or the hidden "
                       "states of this batch's %d tokens in one call, in the stock forward and in every chunk of the "
                       "engine's, so the gradients could not be paired", type(head).__name__,
                       type(decoder).__name__ if decoder is not None else "none", span)
        return True

    def _seco_stock_loss(self, unwrapped, prefix: dict, items, layer, width: int | None, what: str,
                         given: torch.Tensor | None = None, widen: bool = False):
        """The stock ``compute_loss`` on ``prefix`` as a function of ``layer``'s output (made a leaf by
        :func:`_as_leaf` where its last axis is ``width``; replaced by a leaf holding ``given`` where that is given):
        (loss, the leaves of each call of the layer); ``widen``: whether the caller runs it under :class:`_Widened`
        (its narrowing casts kept in float64).  It runs as the stock Trainer runs it,
        with the parameters' ``requires_grad`` as they are and a graph through the model (campaign 47 Q1: a penalty
        on the trainable parameters reads ``p.requires_grad``), so a term that reaches the parameters other than
        through the leaf is seen (:meth:`_seco_check_loss_gradient`); TRL's metrics and token counts are restored
        (this call is not a step)."""
        kept = copy.deepcopy({name: vars(self)[name] for name in ("_metrics", "_total_train_tokens")
                              if name in vars(self)})
        leaves: list[torch.Tensor | None] = []
        hook = _as_leaf(leaves, width) if given is None else _next_slice_of(given, leaves)
        try:
            with torch.enable_grad(), _output_hook(layer, hook), \
                    self.compute_loss_context_manager(), self.accelerator.autocast():
                stock = self.compute_loss(unwrapped, prefix, num_items_in_batch=items)
        except Exception as error:
            if _out_of_memory(error):
                raise
            if isinstance(error, RuntimeError) and any(text in str(error) for text in (
                    "differentiated Tensor", "does not require grad", "does not have a grad_fn")):
                # user code that differentiates through the model (campaign 47 Q1)
                raise ValueError(
                    f"SeCOTrainer: the stock compute_loss failed in the loss check, which cuts its graph at the "
                    f"{what} (the output of {type(layer).__name__}) to compare the loss as a function of them: "
                    f"{error} -- a loss that differentiates through the model's activations (an input-gradient "
                    "penalty, a gradient norm term) is not the causal-LM cross-entropy the SeCO step trains; train "
                    "it with the stock Trainer") from error
            if widen:
                raise ValueError(
                    "SeCOTrainer: the stock compute_loss failed when the loss check ran it again with its casts to "
                    "narrower dtypes kept in float64, to measure the rounding of a loss narrower than the model "
                    f"({type(error).__name__}: {error}) -- compute the loss in the model's dtype, or train that loss "
                    "with the stock Trainer") from error
            raise
        finally:
            vars(self).update(kept)
        return (stock[0] if isinstance(stock, tuple) else stock), leaves

    def _seco_sixteen_bit(self, run, output: torch.dtype = torch.float32) -> float:
        """Whether the stock loss computes in 16 bits on a float32 model (campaign 61 J4: a bfloat16 cross-entropy
        cast back to float32), or on 16-bit ``output`` (bfloat16 autocast logits, a bfloat16 model's; campaign 63 F4:
        a float16 cross-entropy, a log-softmax by hand in bfloat16, returned in float32): ``run()`` -- the stock loss,
        run here under :class:`_Widened` recording its narrowings (and, on a 16-bit output, its 16-bit arithmetic) --
        narrows to bfloat16 or float16 values its gradient goes through: the largest eps of them (0 where none).
        Asked only where the check would refuse: its rounding is then measured as a float64 model's float32 loss's
        is."""
        if output == torch.float32 and self._seco_check_computed != torch.float32:
            return 0.0
        sites: list = []
        try:
            with _Widened(output, sites):
                loss = run()
                graphed = [site for site in sites if site[0].requires_grad]
                grads = torch.autograd.grad(loss, [site[0] for site in graphed], allow_unused=True) if (
                    graphed and loss.requires_grad) else ()
        except Exception:  # noqa: BLE001 -- the refusal stands where it cannot be told
            return 0.0
        return max((site[1] for site, g in zip(graphed, grads) if g is not None and bool(g.ne(0).any())),
                   default=0.0)

    @staticmethod
    def _seco_paired(leaves: list, stock, tokens) -> bool:
        """Whether the layer ran once on the whole span (one leaf per token) and the stock loss is a function of it."""
        leaf = leaves[0] if len(leaves) == 1 else None
        return leaf is not None and tuple(leaf.shape[:-1]) == tuple(tokens.shape) and stock.requires_grad

    def _seco_check_loss_gradient(self, unwrapped, adapter: HFChunkModel, pair: tuple, tokens, targets,
                                  narrowed: bool = False, first: tuple | None = None) -> bool:
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
        layer runs on both sides). ``pair`` = (what, layer, its outputs in the stock forward as leaves, the stock
        loss, checked (name, parameter) pairs, ``rerun(given, widen)``: the stock loss's (value, dtype, gradients
        w.r.t. the output and ``checked``) on other outputs, widened or not, the ratio of the stock loss's scale to
        the mean's: its value and gradients are taken times it). Returns False where they cannot be
        paired: the layer not run once on the whole span, the stock loss not a function of its output, or an engine
        chunk that does not read it.

        **A stock loss narrower than the model** (transformers casts a float64 model's logits to float32) rounds its
        gradient by 1e-8..1e-3 relative (the logits' range and shift, a 16-bit copy, a float32 projection), where a
        term as small is still a term: campaigns 51-57 fooled every model of that rounding.  It is measured instead,
        on the code: the stock loss runs again on the same z with its casts kept in float64 (:class:`_Widened`; code
        that reads a tensor's dtype reads the one it has as it is), and so do the engine's chunks (a forward that
        narrows after z, as a float32 projection, rounds them too). The same holds for a float32 model whose loss
        computes in 16 bits (a bfloat16 cross-entropy cast back: campaign 61 J4), widened to float32: where the check
        in float32's rounding would refuse and the loss's gradient goes through such a narrowing (``narrowed``: the
        check again, so):

            d    = g_stock(z) - g_engine(z)                 (as they run: a term, and their rounding)
            d64  = the same, both widened                    (the term, exact up to float64's rounding)
            ||d64|| <= floor + ||d - d64|| / 2              (half the rounding that sets them apart)

        relative to ||g_engine||; floor: this check's allowance in the model's dtype (2 eps of float64 on the
        logits, max(64, sqrt V) on the hidden states).  The same is asked of what each moves the trainable parameters
        before z, summed over the tokens (:class:`_Effects`), in L2 and in the largest single move, and of the
        parameters after z; the value within twice its rounding.  The stock loss runs a third time as it is: a
        gradient that changes is randomness, refused.  ``first``: (value, gradient w.r.t. the output) of the call this
        check was first asked on, where it runs again on a new call (``narrowed`` after the fact: a float32 model's
        16-bit loss, a 16-bit output's): that call is the one compared with, so a term on it alone is not lost with
        it (campaign 70: smoothing 0.3 on the loss's first call only was accepted)."""
        what, layer, leaves, stock, checked, rerun, ratio = pair
        if not self._seco_paired(leaves, stock, tokens):
            return False
        span = tokens.shape[-1]
        leaf = leaves[0]
        params = [p for _, p in checked]
        batch = checked_batch(adapter, tokens, targets, self.seco_args.chunk_size)
        scale, grads = self._seco_scaled_grads(stock, [leaf] + params, batch.n_targets)
        stock_grad, *theirs_p = [None if g is None else _times(g, ratio / scale) for g in grads]
        del grads
        if stock_grad is None:  # the stock loss is not a function of this output
            return False
        same = leaf.detach()
        del leaf
        vocab = getattr(adapter, "vocab_size", None) or 0
        # a loss narrower than the output; on a float64 model any loss (it may compute narrower than it returns: a
        # float32 loss cast back, a custom Function), under autocast too, which leaves float64 alone (campaign 62 K1:
        # a bfloat16 loss returned in float64 was held to float64's rounding)
        narrowed = narrowed or torch.finfo(same.dtype).eps < torch.finfo(stock.dtype).eps or same.dtype == (
            torch.float64)
        # (the dtype a narrowed loss is widened to: float32 for a 16-bit output, whose loss's own 16-bit arithmetic
        # is kept in it -- campaign 63 F4 --, and what is kept so)
        sixteen = torch.finfo(same.dtype).bits <= 16
        wide_name = str(torch.promote_types(same.dtype, torch.float32)).removeprefix("torch.")
        kept = f"its casts {'and 16-bit arithmetic ' if sixteen else ''}kept in {wide_name}"
        value_stock = float(stock.detach()) * ratio
        opaque, modelled = False, None  # (modelled: that rounding, on the logits, where the loss is opaque)
        if narrowed:  # the loss run widened (its rounding: the difference), and once more as it is
            value_w, dtype_w, quantum, wide, *wide_p = rerun(same, True)
            again_value, _, _, again, *_ = (first[0], None, None, first[1]) if first is not None else rerun(same, False)
            again2 = float((again - stock_grad.double()).square().sum())
            own2 = float((stock_grad.double() - wide).square().sum())  # the stock loss's own rounding
            del again
            # widening changed nothing, yet the gradient is all float32 numbers: the loss computes in float32 where
            # torch does not see it (numpy, a compiled kernel); on the logits, its rounding is taken as twice
            # F.cross_entropy's in float32 on them (campaign 58 N-OPQ)
            opaque = same.dtype == torch.float64 and own2 == 0 and bool(wide.ne(0).any()) and bool(
                torch.equal(wide, wide.float().double()))
            if opaque and what == "logits":
                def ce(x):  # (its value, its gradient)
                    leaf = x.detach().requires_grad_(True)
                    loss = torch.nn.functional.cross_entropy(leaf.reshape(-1, leaf.shape[-1]), targets.reshape(-1),
                                                             ignore_index=batch.ignore_index, reduction="sum")
                    grad = torch.autograd.grad(loss / batch.n_targets, leaf)[0].double()
                    return float(loss.detach()) / batch.n_targets, grad
                (v32, g32), (v64, g64) = ce(same.float()), ce(same)
                modelled, modelled_value = 4 * (g32 - g64), 2 * abs(v32 - v64) + 64 * torch.finfo(torch.float32).eps

        def sweep(widen: bool, visit) -> tuple | None:
            """The engine's chunks on the same output, ``visit(rows, dL/d(its piece), the layer's own output)`` each
            (dL in float64, at ``scale``); (the parameters' gradients summed over the chunks in float64 -- campaign
            50: in float32 the sum's own rounding grew with the chunk count, 5.5 eps of float32 at 1024 chunks, 2.8
            in float64 --, the sum over the chunks of their squared norms -- the scale of the sum's rounding where
            they cancel --, the loss), or None where a chunk does not read the output."""
            pieces: list[torch.Tensor | None] = []
            replaced: list[torch.Tensor] = []
            past, sums, parts2, total = [], [None] * len(params), 0.0, 0.0
            with torch.enable_grad(), _output_hook(layer, _next_slice_of(same, pieces, replaced)), \
                    _Widened(same.dtype) if widen else nullcontext(), \
                    self.compute_loss_context_manager(), self.accelerator.autocast():
                for j in range(batch.num_chunks):
                    tok, tgt, start = batch.span(j, 1)
                    out = checked_chunk(adapter.chunk_forward(tok, tgt, past, start, batch.ignore_index), j)
                    past.append(unflat_cache([t.detach() for t in flat_cache(out.cache)]))
                    piece = pieces[-1] if len(pieces) == j + 1 else None
                    if piece is None or not out.loss_sum.requires_grad:  # the engine's chunk did not read them
                        return None
                    loss = out.loss_sum / batch.n_targets
                    ours, *chunk_p = torch.autograd.grad(loss * scale, [piece] + params, allow_unused=True)
                    got = [None if g is None else g.double() / scale for g in chunk_p]
                    sums = [a if g is None else g if a is None else a + g for a, g in zip(sums, got)]
                    parts2 += sum(float(g.square().sum()) for g in got if g is not None)
                    visit(slice(start, start + piece.shape[-2]), _widened(ours).double() / scale,
                          replaced[-1] if len(replaced) == j + 1 else None)
                    total += float(loss.detach())
            return sums, parts2, total

        if narrowed:
            # the engine as it is: the stock's difference from it, where rounding (its own, and the engine's where
            # the forward narrows after the output, as a float32 projection) is part of it
            def keep(rows, ours, _):
                apart[..., rows, :] -= ours
            apart = stock_grad.double().clone()
            swept = sweep(False, keep)
            if swept is None:
                return False
            ours_p_as, _, total_as = swept
        diff2, norm2, rho2 = 0.0, 0.0, 0.0
        # what the difference, the engine's gradient and the rounding between the stock and the engine give the
        # trainable parameters before the output through each chunk's graph (:class:`_Effects`), summed over chunks
        effects = _Effects(params if narrowed else [], 3)
        # a 16-bit output's gradient, rounded to its dtype on both sides: where the two computed it apart by float32's
        # rounding (a float64 cross-entropy, a log-softmax by hand in float32), a few elements round to either side
        # of a 16-bit step, 1 ulp apart (campaigns 66 WIDER16, 68 F16HAND: 1e-4 of them, 2.1e-6 relative).  Such
        # flips on at most FLIPS of the elements are rounding (a term of 1e-3 flips a quarter of bfloat16's; 1 ulp
        # on every element is within eps of the dtype, below the 2 eps the passing warning states)
        grid = not narrowed and torch.finfo(same.dtype).bits <= 16 and _power_of_two(ratio / scale)
        flips = {"one": 0, "all": 0, "rest2": 0.0}

        def compare(rows, ours, output):
            nonlocal diff2, norm2, rho2
            theirs = (wide if narrowed else stock_grad)[..., rows, :].double()
            if narrowed:  # the rounding: the difference as it is less the exact one (the engine's run widened too)
                rho = modelled[..., rows, :] if modelled is not None else apart[..., rows, :] - (theirs - ours)
                rho2 += float(rho.square().sum())
                effects.add(output, [theirs - ours, ours, rho])
            apart_by = theirs - ours
            if grid:  # (1 ulp of v in [2^(e-1), 2^e): eps x 2^(e-1))
                step = torch.ldexp(torch.full_like(apart_by, torch.finfo(same.dtype).eps),
                                   torch.frexp(torch.maximum(theirs.abs(), ours.abs()))[1] - 1)
                one = (apart_by != 0) & (apart_by.abs() <= step)
                flips["one"] += int(one.sum())
                flips["all"] += apart_by.numel()
                flips["rest2"] += float(apart_by[~one].square().sum())
            diff2 += float(apart_by.square().sum())
            norm2 += float(ours.square().sum())

        swept = sweep(narrowed, compare)
        if swept is None:
            return False
        ours_p, p_parts2, total = swept
        if narrowed:
            del apart
            rounded_p = [None if g is None or e is None or w is None or a is None else (g - a) - (w - e)
                         for g, a, w, e in zip(theirs_p, ours_p_as, wide_p, ours_p)]
            theirs_p = wide_p  # the parameters after the output: the widened loss's gradients
        # the parameters: no stock gradient where the engine's loss has none (a penalty on the weights, an early-exit
        # loss: campaign 47 Q1/Q2), and the same gradient where both have one (the output layer and what follows
        # it: a penalty there, campaign 48 R2/R3), up to the rounding of the model's dtype
        reached = [(name, float(g.double().norm())) for (name, _), g, e in zip(checked, theirs_p, ours_p)
                   if e is None and g is not None and bool(g.ne(0).any())]
        pairs = [(g, e) for g, e in zip(theirs_p, ours_p) if e is not None]
        p_diff2 = sum(float((e.double() - (0 if g is None else g.double())).square().sum()) for g, e in pairs)
        p_norm2 = max(sum(float(e.double().square().sum()) for _, e in pairs), p_parts2 if pairs else 0.0)
        p_diff = (p_diff2 / p_norm2) ** 0.5 if p_norm2 > 0 else float(p_diff2 > 0)
        # the dtype the parameters' gradients are computed in: autocast's where it is on (campaign 49 S1); a
        # narrowed loss's floor: float64's, where its widened run is compared (a 16-bit output's: the loss's dtype,
        # as where it is not narrowed -- both sides compute in float32 on it, widened, and round their gradient to it)
        own = narrowed and not torch.finfo(same.dtype).bits <= 16 < torch.finfo(stock.dtype).bits
        # (a 16-bit output's widened loss computes in float32, whatever it returns: float32's, not float64's, campaign
        # 67 -- a float16 model's float16 loss returned in float64 held to 4.4e-16)
        rounding = self._seco_same_output_rounding(same if own else _computed_as(stock, same.dtype),
                                                   same.dtype if own else self._seco_check_computed, what, vocab)
        rescaled = 0.0 if _power_of_two(ratio / scale) else torch.finfo(same.dtype).eps
        if rescaled:
            # the stock loss's gradients taken at the Trainer's num_items_in_batch and rescaled to the mean by a
            # ratio that is no power of two: each side has rounded its gradient w.r.t. the output in that output's
            # dtype at its own scale, up to eps of it apart (2.3e-3 on bfloat16 autocast logits, campaign 64)
            rounding["gradient"] += rescaled
            rounding["parameters"] += torch.finfo(self._seco_check_computed).eps
        allowed, v_allowed, p_allowed = rounding["gradient"], rounding["value"], rounding["parameters"]
        if grid and 0 < flips["one"] <= self.FLIPS * flips["all"]:
            diff2 = flips["rest2"]  # (measured["flips"]: how many)
        diff = (diff2 / norm2) ** 0.5 if norm2 > 0 else float(diff2 > 0)
        value = abs(value_stock - total) / max(abs(total), 1.0)
        measured = {}
        if narrowed:
            floor = allowed
            measured_rounding = (rho2 / norm2) ** 0.5 if norm2 > 0 else 0.0
            allowed, allowed_floor = floor + measured_rounding / 2, floor
            p_rounding = sum(float(g.square().sum()) for g in rounded_p if g is not None) ** 0.5
            p_allowed += (p_rounding / p_norm2 ** 0.5) / 2 if p_norm2 > 0 else 0.0
            v_rounding = (modelled_value if modelled is not None else abs(
                (value_stock - total_as) - (value_w - total))) / max(abs(total), 1.0)
            value = abs(value_w - total) / max(abs(total), 1.0)
            v_allowed += 2 * v_rounding
            measured = {"rounding": measured_rounding, "value_rounding": v_rounding, "quantum": quantum}
            # the loss run twice as it is: the same gradient, else what differs is not rounding (randomness)
            if norm2 > 0 and not (again2 / norm2) ** 0.5 <= floor + (own2 / norm2) ** 0.5 / 4 or not abs(
                    again_value - value_stock) / max(abs(total), 1.0) <= v_allowed / 4:
                unsteady = (again2 / norm2) ** 0.5
                raise ValueError(
                    f"SeCOTrainer: the stock compute_loss, run twice on the same {what} of the first {span} tokens of "
                    f"this batch, gave gradients {unsteady:.3g} relative apart and values "
                    f"{abs(again_value - value_stock):.3g} apart: randomness (or state that changes between calls) "
                    "in the loss after them -- a noise term, a dropout on the logits -- which the SeCO step would "
                    "leave out; remove it, or train that loss with the stock Trainer")
            reach, top = effects.norm(1), effects.norm(1, largest=True)
            for largest, by in ((False, reach), (True, top)):
                if by > 0:  # in L2 and in the largest single parameter's move (campaign 55 Z6)
                    this = (effects.norm(0, largest) / by, floor + effects.norm(2, largest) / by / 2)
                    if "effect" not in measured or this[0] / this[1] > measured["effect"] / measured["effect_allowed"]:
                        measured.update(effect=this[0], effect_allowed=this[1])
        if grid:
            measured["flips"] = flips["one"]
        self.seco_loss_check_measured = {"value": value, "value_allowed": v_allowed, "gradient": diff,
                                         "allowed": allowed, "tokens": span, "paired": what, "parameters": p_diff,
                                         "parameters_allowed": p_allowed, **measured}
        params_differ = bool(reached) or not p_diff <= p_allowed  # NaN: differ
        moved = "effect" in measured and not measured["effect"] <= measured["effect_allowed"]
        widened_note = (f" (the loss run with {kept} still computed in {str(dtype_w).removeprefix('torch.')}: it "
                        "narrows by a route the check does not widen, so its rounding counts as a term here)"
                        if narrowed and torch.finfo(dtype_w).bits < torch.finfo(
                            torch.promote_types(same.dtype, torch.float32)).bits else "")
        # a value apart with the same gradient w.r.t. the output: a term on the parameters says more (campaign 49 S2)
        refused = not diff <= allowed or moved or (not value <= v_allowed and not params_differ)
        # a 16-bit output (bfloat16 autocast) whose loss returns wider
        sixteen_out = torch.finfo(same.dtype).bits <= 16 < torch.finfo(stock.dtype).bits
        if (refused or params_differ and not reached) and not narrowed and (
                same.dtype == torch.float32 or sixteen_out) and (
                self._seco_sixteen_bit(lambda: rerun(same, False, graph=True)[0], same.dtype)):
            # a float32 model's loss that computes in 16 bits (campaign 61 J4), or a 16-bit output's loss whose own
            # arithmetic is 16-bit (campaign 63 F4): its rounding measured, on the same output, with the loss run
            # again to hold a graph
            again_stock, again_leaves = rerun(same, False, graph=True)
            return self._seco_check_loss_gradient(unwrapped, adapter, (what, layer, again_leaves, again_stock,
                                                                       checked, rerun, ratio), tokens, targets, True,
                                                  first=(value_stock, stock_grad))
        if refused:
            raise ValueError(
                f"SeCOTrainer: on the same {what} of the first {span} tokens of this batch, the loss the stock Trainer "
                f"computes (compute_loss){f' run in {wide_name}' if narrowed else ''} and the causal-LM "
                "cross-entropy the "
                f"SeCO step trains differ by {value:.3g} relative in value (rounding allows {v_allowed:.2g}) and "
                f"{diff:.3g} relative in their gradient w.r.t. the {what} (rounding allows {allowed:.2g}" + (
                    f": {rounding['gradient']:.2g} and half of the loss's own rounding, "
                    f"{allowed - rounding['gradient']:.2g} x 2, measured by running it as it is and with "
                    f"{kept}" if narrowed else "") + ")" + (
                    f", which moves the trainable parameters before them {measured['effect']:.3g} relative, summed "
                    f"over the tokens (rounding allows {measured['effect_allowed']:.2g})" if moved else "") +
                ": a term in the stock loss -- label smoothing, a weight on some targets, a scale, a penalty on the "
                "logits, put in by a hook, a forward or a compute_loss -- would be left out by the SeCO step; remove "
                "it, or train that loss with the stock Trainer" + widened_note + (
                    " (the loss computes in float32 where torch does not see it -- numpy, a compiled kernel -- so it "
                    "could not be run in float64" + (": its rounding was taken as twice F.cross_entropy's in float32 "
                                                     "on the same logits)" if what == "logits" else ")")
                    if narrowed and opaque else "") + (
                    f" (their gradients w.r.t. the {what} agree, and those w.r.t. the trainable parameters too: "
                    "a term that changes the value only -- a constant, or one computed outside autograd)"
                    if diff <= allowed and not moved else ""))
        # the rounding allowed for must be one the narrowings the loss's gradient goes through could make: at most
        # ROUNDING_STEPS x the largest step one of them rounds at (measured up to 4.9x, V 32000 with a head whose rows
        # share a vector); else what differs is a term the widened run leaves out (campaign 58 H1-H4)
        if narrowed and not opaque and not measured["rounding"] <= allowed_floor + self.ROUNDING_STEPS * quantum:
            raise ValueError(
                f"SeCOTrainer: on the same {what} of the first {span} tokens of this batch, the stock loss and the "
                f"cross-entropy the SeCO step trains differ by {measured['rounding']:.3g} relative (in their "
                f"gradient w.r.t. the {what}) beyond what the loss computes when run with {kept}, "
                f"more than rounding at the narrowings its gradient goes through can make ({self.ROUNDING_STEPS} x "
                f"the largest step, {quantum:.2g}): a term that depends on the dtype the loss computes in (tested by "
                "a route the check cannot follow: isinstance(x, torch.FloatTensor), ...), on how many times the "
                f"loss has been called, or built from its own rounding error, which the {wide_name} run leaves out "
                "and "
                "the SeCO step would too; remove it, or train that loss with the stock Trainer")
        # what the check could not tell from rounding (_seco_warn_resolution): a term below the allowance, or below
        # 2 eps of a 16-bit compared output's dtype, whose gradient w.r.t. it rounds a term's share away (bfloat16
        # weights or autocast: label smoothing 0.002 left it unchanged, campaign 63); a term the widened run leaves
        # out passes up to the ROUNDING_STEPS bound as rounding, and half of that buys a term it sees as much
        # (campaign 60 J1): the two together
        sixteen_floor = 2 * torch.finfo(same.dtype).eps if torch.finfo(same.dtype).bits <= 16 else 0.0
        self._seco_check_resolution = {
            "model": str(same.dtype).removeprefix("torch."), "what": what, "wide": wide_name,
            # (a term passes where it and that rescaling's rounding, up to eps, are within the allowance together:
            # campaign 65, label smoothing 0.026 on bfloat16 logits accepted within 0.0234)
            "rounding": measured["rounding"] if narrowed else None, "visible": max(allowed + rescaled, sixteen_floor),
            "hidden": allowed + allowed_floor + self.ROUNDING_STEPS * quantum if narrowed and not opaque else None}
        self.seco_loss_check_measured["not_seen_below"] = self._seco_check_resolution["visible"]  # (as warned)
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
