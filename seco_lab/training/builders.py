"""What a training run is built from: the data, the model and the checks on both before training.

* :func:`build_data` -- the synthetic key->value task, the byte corpus, or (a pretrained LM or an HF
  checkpoint directory) a corpus read through the model's own tokenizer.
* :func:`build_model` -- the tiny transformer of ``cfg.model``, or the HF causal LM of ``cfg.hf_model``
  (with LoRA) wrapped as a chunk model (:class:`seco_lab.models.hf.HFChunkModel`).
* :func:`check_gather_policy` -- refuses ``--fsdp-gather chunk`` with a sampler whose subset size differs
  between ranks (before any collective).
* :func:`load_into` -- ``load_state_dict`` with a one-line error for a checkpoint of another architecture.

:class:`seco_lab.training.trainer.Trainer` calls them; the HF and tokenizer modules are imported only for HF runs.
"""

from __future__ import annotations

import torch

from ..config import DTYPES, HF_ARCHITECTURES, TrainConfig
from ..data.sources import KeyValueTask, TextCorpus
from ..models.tiny import TinyTransformer
from .run_dir import RunDirError
from .sharding import ShardingError

__all__ = ["build_data", "build_model", "check_gather_policy", "load_into"]


def load_into(model, state_dict: dict, where) -> None:
    """``model.load_state_dict`` with a one-line error when the checkpoint is of another architecture."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0] if lines else ""
        raise RunDirError(f"--resume: the checkpoint in {where} is of another model architecture ({detail[:200]}); "
                          "resume with the run's own model settings or start a new --run-dir") from None


def build_data(cfg: TrainConfig):
    """The run's data: the key->value task, the byte corpus, or text through an HF model's tokenizer."""
    if cfg.data == "synthetic":
        return KeyValueTask(cfg.seq_len, vocab_size=cfg.model.vocab_size, n_pairs=cfg.n_pairs, seed=cfg.seed)
    if cfg.hf_model is not None and cfg.hf_model not in HF_ARCHITECTURES:
        # a pretrained LM or a checkpoint directory reads text through its own tokenizer (packed and split like
        # the byte corpus): bytes are not its token ids
        from ..data.token_corpus import TokenCorpus
        from ..models.hf import checkpoint_tokenizer
        from ..models.pretrained import is_pretrained, load_tokenizer

        tokenizer = load_tokenizer(cfg.hf_model) if is_pretrained(cfg.hf_model) else checkpoint_tokenizer(cfg.hf_model)
        return TokenCorpus(cfg.seq_len, tokenizer, paths=cfg.text_paths or None, seed=cfg.seed)
    return TextCorpus(cfg.seq_len, paths=cfg.text_paths or None, seed=cfg.seed)


def check_gather_policy(gather: str, cfg: TrainConfig) -> None:
    """``--fsdp-gather chunk`` issues collectives per chunk forward and backward, so every rank must run
    the same number of them: refuse a sampler whose subset size differs between ranks (Bernoulli)."""
    if gather != "chunk" or cfg.mode != "spaco":
        return
    sampler = cfg.build_scheme().sampler
    if sampler.kind != "uniform":
        raise ShardingError(
            f"--fsdp-gather chunk with scheme {cfg.scheme!r}: its {sampler.kind} sampler draws a different number "
            "of chunks on each rank, so the ranks would issue different per-chunk all-gathers and deadlock; use "
            "--fsdp-gather step (one gather per step, any scheme) or a fixed-size (uniform) scheme")


def build_model(cfg: TrainConfig, vocab: int, device: torch.device):
    """The tiny transformer of ``cfg.model``, or the HF model (with LoRA) of ``cfg.hf_model``."""
    dtype = DTYPES[cfg.dtype]
    if cfg.hf_model is None:
        if cfg.model.vocab_size != vocab:
            raise ValueError(f"model vocab_size={cfg.model.vocab_size} does not match the data's vocabulary {vocab}")
        return TinyTransformer(cfg.model, seed=cfg.seed, dtype=dtype, device=device)
    from ..models.hf import HFChunkModel, add_lora, check_hf_overrides, random_fields
    from ..models.pretrained import build_causal_lm

    overrides = dict(cfg.hf_overrides)
    if cfg.hf_model in ("llama", "qwen2"):
        overrides.setdefault("vocab_size", vocab)
        overrides.setdefault("max_position_embeddings", max(cfg.seq_len, 16))
        check_hf_overrides(cfg.hf_model, cfg.hf_overrides)
    try:
        hf = build_causal_lm(cfg.hf_model, overrides, cfg.attn_implementation, dtype, cfg.seed)
    except (TypeError, AttributeError) as e:  # a transformers config or layer refusing a value
        raise ValueError(f"--hf-override {cfg.hf_overrides}: {e}") from None
    if hf.config.vocab_size < vocab:
        raise ValueError(f"{cfg.hf_model} has vocab_size {hf.config.vocab_size} < the data's {vocab}")
    max_pos = getattr(hf.config, "max_position_embeddings", None)
    if max_pos is not None and max_pos < cfg.seq_len:
        raise ValueError(f"{cfg.hf_model} has max_position_embeddings {max_pos} < --seq-len {cfg.seq_len}")
    config_dropouts = {f"{k}={v}" for k, v in random_fields(hf.config.get_text_config(decoder=True)).items()}
    dropouts = sorted(config_dropouts | {f"{name}.p={m.p}" for name, m in hf.named_modules()
                                         if isinstance(m, torch.nn.Dropout) and m.p > 0})
    if dropouts:  # campaign 27 Q5, 28: refused before the run folder is made, as --hf-override's dropout is
        raise ValueError(f"{cfg.hf_model} sets dropout ({', '.join(dropouts[:4])}): training runs chunk by chunk and "
                         "rebuilds each chunk's forward pass, which dropout would change (a wrong gradient); set the "
                         "dropout fields of its config.json to 0")
    if cfg.lora:
        hf = add_lora(hf, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets)
    model = HFChunkModel(hf).to(device)
    if cfg.mode != "dense":  # dense: one forward of the whole sequence
        model.check_chunk_layout(cfg.seq_len, min(cfg.chunk_size, cfg.seq_len))  # before the run folder is made
    return model
