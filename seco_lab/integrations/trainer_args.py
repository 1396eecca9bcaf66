"""The settings of :class:`~seco_lab.integrations.transformers.SeCOTrainer` (:class:`SeCOArguments`), the file a
checkpoint stores them in, and :func:`chunk_targets`: a Trainer batch as the chunk engine's tokens and targets,
refused where the engine would get it wrong.  Needs torch only (not transformers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from fractions import Fraction

import torch

from ..core.checks import as_int, check_chunk_size
from ..estimators.schemes import get_scheme

__all__ = ["KNOWN_INPUTS", "MODES", "SETTINGS_FILE", "SeCOArguments", "chunk_targets"]

SETTINGS_FILE = "seco_trainer.json"
MODES = ("seco", "spaco")
# batch keys the chunk engine understands; anything else would be silently dropped, so it is refused
KNOWN_INPUTS = ("input_ids", "labels", "attention_mask", "shift_labels", "position_ids")


@dataclass(frozen=True)
class SeCOArguments:
    """How ``SeCOTrainer`` backpropagates each micro-batch.

    ``chunk_size``: tokens per chunk (the last chunk of a sequence may be shorter).
    ``mode``: ``"seco"`` (exact gradient) or ``"spaco"`` (sparse unbiased estimate).
    ``scheme``/``budget``: SpaCO's compensation scheme (``seco_lab.SCHEME_NAMES``) and the
    number t of chunks backpropagated (the mean number for Bernoulli schemes).
    ``seed``: the SpaCO draw seed.  ``subset``: a fixed chunk set instead of draws (ablations, tests).
    ``cap``: the cap C of a capped scheme (``paper-capped``, ``paper-chain-capped``) in place of its default 2,
    as ``seco-lab train --cap``; refused for any other scheme.
    """

    chunk_size: int
    mode: str = "seco"
    scheme: str = "falling-factorial"
    budget: int = 1
    seed: int = 0
    subset: tuple[int, ...] | None = None
    cap: float | None = None

    def __post_init__(self):
        check_chunk_size(self.chunk_size)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        as_int(self.budget, "budget", 1)
        as_int(self.seed, "seed", 0)
        spaco_only = [f.name for f in fields(self) if f.name in ("scheme", "budget", "seed", "cap")
                      and getattr(self, f.name) != f.default]
        if self.mode == "seco" and spaco_only:  # SeCO is exact: it draws nothing and needs no scheme
            raise ValueError(f"{', '.join(spaco_only)} {'is' if len(spaco_only) == 1 else 'are'} SpaCO's and would be "
                             "ignored with mode='seco' (the exact gradient): set mode='spaco', or drop "
                             f"{'it' if len(spaco_only) == 1 else 'them'}")
        scheme = self.build_scheme()  # unknown names, and a cap of a scheme without one, fail here
        if self.cap is not None:  # validated: stored as a plain float (numpy scalars and Fractions are not JSON)
            object.__setattr__(self, "cap", float(self.cap))
        if self.subset is not None:
            if self.mode != "spaco":
                raise ValueError("subset fixes SpaCO's chunk set; it needs mode='spaco'")
            if isinstance(self.subset, (str, bytes)) or not hasattr(self.subset, "__iter__"):
                raise TypeError(f"subset must be a sequence of chunk indices, e.g. (0, 2), got {self.subset!r}")
            object.__setattr__(self, "subset", tuple(as_int(j, "a subset's chunk index", 0) for j in self.subset))
            if len(set(self.subset)) != len(self.subset):
                raise ValueError(f"subset {self.subset} repeats a chunk: a chunk set names each chunk once")
            if scheme.sampler.kind == "uniform" and len(self.subset) != self.budget:
                raise ValueError(f"subset {self.subset} holds {len(self.subset)} chunk(s) but budget = {self.budget}: "
                                 f"scheme {scheme.name!r} draws exactly t = budget chunks, and its weights depend on "
                                 f"t; pass budget={len(self.subset)}")

    def build_scheme(self):
        """The compensation scheme these settings name (with ``cap`` applied)."""
        return get_scheme(self.scheme) if self.cap is None else get_scheme(self.scheme, cap=self.cap)

    def to_dict(self) -> dict:
        """The settings as stored in a checkpoint's ``seco_trainer.json``; ``cap`` only when it is not the scheme's
        default (2), so that settings stored before it existed, or naming the default, compare equal to the same
        settings now."""
        out = asdict(self)
        out["subset"] = None if self.subset is None else list(self.subset)
        if self.cap is None or Fraction(self.cap) == get_scheme(self.scheme).cap:
            del out["cap"]
        return out


def chunk_targets(inputs: Mapping[str, torch.Tensor], ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)`` of a Trainer batch for the chunk engine, with targets[t] = labels[t + 1].

    Refuses (ValueError, one line) what the engine would get wrong: keys it does not
    understand, left padding or holes in the attention mask, targets on padded positions,
    and position ids other than 0..n-1.
    """
    unknown = sorted(set(inputs) - set(KNOWN_INPUTS))
    packed = sorted(set(unknown) & {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"})
    if packed:  # campaign 47 Q4: a padding-free collator's keys, not the dataset's
        raise ValueError(f"SeCOTrainer got the batch keys {packed} of a padding-free collator (transformers' "
                         "DataCollatorWithFlattening, TRL's packing=True or padding_free=True): documents packed into "
                         "one row attend only within themselves, which the chunk engine's cache does not support; "
                         "use a padding collator (DataCollatorWithPadding, DataCollatorForLanguageModeling), or in "
                         "TRL set packing=False and padding_free=False (or packing_strategy='wrapped', which packs "
                         "into plain rows)")
    if unknown:
        raise ValueError(f"SeCOTrainer understands the batch keys {KNOWN_INPUTS}, got also {unknown}; remove them "
                         "in the collator (or set remove_unused_columns=True)")
    if "input_ids" not in inputs:
        raise ValueError("SeCOTrainer needs input_ids in every batch (inputs_embeds are not supported)")
    tokens = inputs["input_ids"]
    if "shift_labels" in inputs:
        targets = inputs["shift_labels"]
    elif "labels" in inputs:
        labels = inputs["labels"]
        targets = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
    else:
        raise ValueError("SeCOTrainer needs labels (or shift_labels) in every batch: the chunk engine computes the "
                         "causal-LM loss itself")
    if targets.shape != tokens.shape:
        raise ValueError(f"labels shape {tuple(targets.shape)} does not match input_ids shape {tuple(tokens.shape)}")
    positions = inputs.get("position_ids")
    if positions is not None:
        expected = torch.arange(tokens.shape[-1], device=positions.device).expand_as(positions)
        if not torch.equal(positions, expected):
            raise ValueError("position_ids other than 0..n-1 (packed sequences restarting positions, padding-free "
                             "collators) are not supported by SeCOTrainer; pack into plain fixed-length rows instead")
    mask = inputs.get("attention_mask")
    if mask is not None:
        if mask.shape != tokens.shape:
            raise ValueError(f"attention_mask shape {tuple(mask.shape)} does not match input_ids {tuple(tokens.shape)}")
        m = mask.to(torch.int64)
        if bool(((m != 0) & (m != 1)).any()) or bool((m[..., 1:] > m[..., :-1]).any()):
            raise ValueError("SeCOTrainer needs right padding (attention_mask 1...1 0...0 per row): left padding or "
                             "holes change what the real tokens attend to; set tokenizer.padding_side = 'right'")
        if bool((targets[m == 0] != ignore_index).any()):
            raise ValueError(f"labels predict from padded positions (attention_mask 0 but target != {ignore_index}); "
                             f"set the labels of padding to {ignore_index}")
    return tokens, targets
