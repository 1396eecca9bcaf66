"""The model, the gradient's parameters and the token windows of an audit, rebuilt from its definition.

* model: ``smollm2-135m`` or a ``.gguf`` file (Q4_1-dequantized through transformers, cached by
  :mod:`seco_lab.models.pretrained`), a local Hugging Face checkpoint folder, ``hf-llama`` (a tiny random
  Llama, byte tokens) or ``tiny`` (seco_lab's transformer, byte tokens);
* gradient: LoRA adapters (peft; A and B both random, seeded -- peft's B = 0 would zero A's
  gradient) or every parameter;
* text: windows of ``length`` + 1 consecutive tokens, inputs and next-token targets.

:func:`load_sequence` rebuilds any stored sequence's model, tokens and targets from a results
folder, as ``seco_lab.studies.bias.load_cell`` does for the bias study.
"""

from __future__ import annotations

import hashlib
import sysconfig
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ...data.sources import corpus_files
from ...data.token_corpus import BINARY, NOT_UTF8, read_text, skipped_note, text_or_why
from .config import AuditConfig

__all__ = ["SequenceSpec", "AuditSequence", "build_model", "sequence_specs", "sequence_tokens", "load_sequence",
           "text_sources", "BYTE_MODELS"]

BYTE_MODELS = ("tiny", "hf-llama")  # random models that read bytes (vocabulary 256)
#: the most of one text file an audit reads (its head): windows are taken from the start of each file, and the
#: same bound as ``seco-lab train --data text``'s corpus; a longer file's tail is not read
TEXT_MAX_BYTES = 16 << 20
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class SequenceSpec:
    """One window: its index, the text file, the kind given in the definition, the first token."""

    index: int
    path: str
    kind: str
    offset: int
    length: int

    @property
    def name(self) -> str:
        return f"s{self.index:02d}"


@dataclass
class AuditSequence:
    """A sequence as the audit built it: the chunk model (gradient parameters trainable), tokens, targets."""

    model: torch.nn.Module
    tokens: torch.Tensor
    targets: torch.Tensor
    spec: SequenceSpec
    config: AuditConfig


def _resolve(path: str) -> Path:
    p = Path(path)
    if p.exists():
        return p.resolve()
    std = Path(sysconfig.get_paths()["stdlib"]) / p
    if std.exists():
        return std
    raise FileNotFoundError(f"text {path!r} is neither a path nor a file of the Python standard library")


def _portable(path: Path) -> str:
    """The path as stored: relative to the standard library when inside it (the same text on any machine)."""
    std = Path(sysconfig.get_paths()["stdlib"])
    try:
        return Path(path).relative_to(std).as_posix()
    except ValueError:
        return str(path)


def _content_digest(path: Path) -> str:
    """SHA-256 of the part of a text the audit reads (its first :data:`TEXT_MAX_BYTES`): equal digests, equal
    windows."""
    h, left = hashlib.sha256(), TEXT_MAX_BYTES
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(min(1 << 20, left))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def text_sources(cfg: AuditConfig) -> list[tuple[str, Path]]:
    """(kind, file) per text entry ``[KIND:]PATH``; a folder contributes its text files, sorted.  A FIFO,
    device or binary file named directly is refused (inside a folder it is skipped): reading a FIFO blocks,
    a device never ends, and bytes decoded with replacement characters are not the text a user meant."""
    out, seen, contents, copies = [], {}, {}, []
    for entry in cfg.texts:
        kind, _, path = entry.rpartition(":") if ":" in entry and not Path(entry).exists() else ("", "", entry)
        if not path.strip():
            raise ValueError(f"text entry {entry!r} names no path: write [KIND:]PATH, e.g. prose:notes/")
        root = _resolve(path)
        files = corpus_files([root], "*")
        if not root.is_dir() and read_text(root, 1 << 20) is None:
            raise ValueError(f"text {path!r} is binary or not UTF-8 ({root}): name text files or folders")
        skipped: dict[str, list[Path]] = {BINARY: [], NOT_UTF8: []}
        for f in files:
            why = None if root.is_file() else text_or_why(f, 1 << 20)[1]
            if why is None:
                key = (st := f.stat()).st_dev, st.st_ino  # t.txt and ./t.txt, a link (hard too), a folder and a
                # file in it (campaign 30): its windows would be drawn twice as often as another text's
                if key in seen:
                    raise ValueError(f"texts name the file {f} twice ({seen[key]!r} and {entry!r}); name each text "
                                     "once")
                seen[key] = entry
                digest = _content_digest(f)  # a copy's windows are the same windows (campaign 31 U11)
                if digest in contents:
                    if root.is_file():
                        raise ValueError(f"texts {contents[digest]} and {f} hold the same bytes: one text named "
                                         "twice (a copy), whose windows would be audited twice as independent "
                                         "sequences; name each text once")
                    copies.append(f"{f} (a copy of {contents[digest]})")
                    continue
                contents[digest] = f
                out.append((kind or "text", f))
            else:  # said, never dropped without a word (campaign 24 AD22b)
                skipped[why].append(f)
        if note := skipped_note(skipped):
            warnings.warn(f"{entry}: {note}", stacklevel=2)
        if copies:
            warnings.warn(f"{entry}: {len(copies)} file(s) skipped as byte-identical copies of a text already read: "
                          f"{', '.join(copies[:5])}{' ...' if len(copies) > 5 else ''}", stacklevel=2)
            copies.clear()
    if not out:
        raise ValueError(f"no text file found in {list(cfg.texts)}")
    return out


def check_model_name(model: str) -> None:
    """Refuse a model the audit cannot build offline (nothing is downloaded): not a known name, an existing
    ``.gguf`` file, or a local Hugging Face folder (with its ``config.json``)."""
    from ...models import pretrained

    if model in BYTE_MODELS or model in pretrained.PRETRAINED:
        return
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        if not path.is_file():
            raise ValueError(f"model {model!r}: no such .gguf file")
        return
    if not (path / "config.json").is_file():
        known = ", ".join([*BYTE_MODELS, *pretrained.PRETRAINED])
        raise ValueError(f"model {model!r} is neither a known name ({known}) "
                         "nor a .gguf file nor a local Hugging Face folder with a config.json (nothing is downloaded: "
                         "save the checkpoint locally with save_pretrained and pass its folder)")


@lru_cache(maxsize=8)
def _tokenizer(model: str):
    if model in BYTE_MODELS:
        return None
    from ...models import pretrained

    if model in pretrained.PRETRAINED or model.endswith(".gguf"):
        return pretrained.load_tokenizer(model)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(_no_tokenizer(model, e)) from None


#: the files a Hugging Face tokenizer is saved as (``tokenizer.save_pretrained``), one of which a folder needs
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model")


def _no_tokenizer(model: str, error: Exception) -> str:
    """Why the checkpoint folder ``model`` gave no tokenizer, and what to do: the audit tokenizes its texts with the
    model's own tokenizer, saved beside the weights (transformers' own words -- e.g. install sentencepiece to
    convert a slow tokenizer -- do not help when the folder holds none)."""
    folder = Path(model).expanduser()
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        reason = f"it has no {', '.join(TOKENIZER_FILES[:3])} or the like"
    else:
        text = str(error).strip()
        reason = text.splitlines()[0][:200] if text else type(error).__name__
    return (f"model {model}: the checkpoint folder holds no tokenizer that loads offline ({reason}); the audit "
            "tokenizes its texts with the model's own tokenizer: save it beside the weights "
            f"(tokenizer.save_pretrained({model!r}))")


@lru_cache(maxsize=64)
def _file_ids(model: str, path: Path) -> np.ndarray:
    """The token ids of the file's first :data:`TEXT_MAX_BYTES` bytes (the whole file when it is not longer; a
    longer one is cut at the last line end within them, so no word is split), as bytes (``uint8``) for a byte
    model and ``int32`` otherwise: the windows come from the head of a file, and a 700 MB corpus is neither read
    whole nor widened to ``int64`` (:func:`sequence_tokens` widens a window)."""
    text = read_text(path, TEXT_MAX_BYTES)
    if text is None:
        raise ValueError(f"text {path} is binary or not UTF-8: name text files or folders")
    if path.stat().st_size > TEXT_MAX_BYTES and "\n" in text:
        text = text[: text.rindex("\n") + 1]
    tok = _tokenizer(model)
    if tok is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    from ...data.token_corpus import encode_text

    return np.asarray(encode_text(tok, text), dtype=np.int32)


def sequence_specs(cfg: AuditConfig, count: int, length: int) -> list[SequenceSpec]:
    """The first ``count`` windows of ``length`` + 1 tokens: file after file in turn, consecutive windows of
    each file; a file with no window left is skipped.  The same definition always gives the same windows."""
    sources = text_sources(cfg)
    taken = [0] * len(sources)
    out: list[SequenceSpec] = []
    while len(out) < count:
        progressed = False
        for f, (kind, path) in enumerate(sources):
            if len(out) == count:
                break
            n = len(_file_ids(cfg.model, path))
            start = taken[f] * (length + 1)
            if start + length + 1 > n:
                continue
            out.append(SequenceSpec(len(out), _portable(path), kind, start, length))
            taken[f] += 1
            progressed = True
        if not progressed:
            raise ValueError(f"the texts {list(cfg.texts)} hold only {len(out)} windows of {length + 1} tokens "
                             f"(in the first {TEXT_MAX_BYTES >> 20} MiB of each file, all an audit reads); {count} are "
                             "needed: add texts or ask for fewer sequences")
    return out


def sequence_tokens(cfg: AuditConfig, spec: SequenceSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of a window: ids[offset : offset + length] and the next token of each."""
    ids = torch.from_numpy(_file_ids(cfg.model, _resolve(spec.path))[spec.offset: spec.offset + spec.length + 1]
                           .astype(np.int64))
    return ids[:-1], ids[1:]


def build_model(cfg: AuditConfig, dtype: str | None = None) -> torch.nn.Module:
    """The chunk model of the audit in ``dtype`` (default ``cfg.dtype``), only the gradient's parameters trainable."""
    torch_dtype = DTYPES[dtype or cfg.dtype]
    seed = int(np.random.SeedSequence([cfg.seed, 7]).generate_state(1)[0])
    if cfg.model == "tiny":
        from ...models.tiny import TinyConfig, TinyTransformer

        return TinyTransformer(TinyConfig(**cfg.tiny), seed=seed, dtype=torch_dtype)
    from ...models.hf import HFChunkModel, add_lora, build_hf_model
    from ...models.pretrained import build_causal_lm

    attn = "eager_exact" if torch_dtype == torch.float64 else "sdpa"
    if cfg.model == "hf-llama":
        t = cfg.tiny
        overrides = dict(vocab_size=t["vocab_size"], hidden_size=t["d_model"], num_hidden_layers=t["n_layers"],
                         num_attention_heads=t["n_heads"], num_key_value_heads=t["n_kv_heads"],
                         intermediate_size=t["d_ff"], max_position_embeddings=t["max_positions"])
        model = build_hf_model("llama", overrides, attn, torch_dtype, seed)
    else:
        model = build_causal_lm(cfg.model, None, attn, torch_dtype)
    model.eval()
    if cfg.params == "lora":
        torch.manual_seed(seed)
        model = add_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets, init_lora_weights=False).to(torch_dtype)
    return HFChunkModel(model)


def load_sequence(results_dir: str | Path, name: str, dtype: str | None = None) -> AuditSequence:
    """Sequence ``name`` (e.g. ``s00``) of a stored audit: its model, tokens and targets as the audit built them."""
    results_dir = Path(results_dir)
    path = results_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a folder an audit wrote (it holds config.json)")
    from .stored import read_audit_config, read_sequences

    cfg = read_audit_config(results_dir)  # a damaged record: a ValueError naming it
    specs = read_sequences(results_dir)
    if name not in specs:
        raise ValueError(f"{name!r} is not a sequence of the audit in {results_dir}; sequences: {', '.join(specs)}")
    spec = SequenceSpec(**specs[name])
    tokens, targets = sequence_tokens(cfg, spec)
    return AuditSequence(build_model(cfg, dtype), tokens, targets, spec, cfg)
