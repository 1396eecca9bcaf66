"""The ``seco-lab`` command.

    seco-lab train [--config run.json|run.toml] [--mode seco] [--scheme ...] [--budget T] ...
    seco-lab bias-study [--quick] [--jobs 2] ...     (= python -m experiments.bias_study)
    seco-lab report bias                               (= python -m seco_lab.report bias)

Settings come from the defaults, then the config file, then the flags given.
Launch ``seco-lab train`` under ``torchrun --nproc_per_node N`` for data parallelism.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

import tomllib

from .schemes import SCHEME_NAMES
from .train import DTYPES, MODES, TrainConfig

MODEL_FLAGS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")


def _train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a model with dense / SeCO / SpaCO gradients",
                       argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="JSON or TOML file with TrainConfig fields")
    p.add_argument("--run-dir", dest="run_dir")
    p.add_argument("--mode", choices=MODES)
    p.add_argument("--scheme", help=f"SpaCO scheme: {', '.join(SCHEME_NAMES)}")
    p.add_argument("--budget", type=int, help="SpaCO budget t (chunks backpropagated per sequence)")
    p.add_argument("--cap", type=float, help="cap C of a capped scheme")
    p.add_argument("--data", choices=("synthetic", "text"))
    p.add_argument("--text", dest="text_paths", action="append", help="text file or folder (repeatable)")
    for name, typ in [("seq_len", int), ("chunk_size", int), ("batch_size", int), ("grad_accum", int),
                      ("steps", int), ("lr", float), ("weight_decay", float), ("warmup", int),
                      ("min_lr_ratio", float), ("clip", float), ("eval_every", int), ("eval_batches", int),
                      ("ckpt_every", int), ("seed", int), ("n_pairs", int), ("stop_at", int)]:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ)
    p.add_argument("--dtype", choices=tuple(DTYPES))
    p.add_argument("--device", help="auto (CUDA when present), cpu, cuda, cuda:1, ...")
    for name in MODEL_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest="model." + name, type=int)
    p.add_argument("--hf-model", dest="hf_model",
                   help="HF causal LM: a local checkpoint directory or 'llama' / 'qwen2' (random weights)")
    p.add_argument("--hf-override", dest="hf_overrides", type=_kv, action="append",
                   help="config field of a named HF architecture, e.g. hidden_size=64 (repeatable)")
    p.add_argument("--attn", dest="attn_implementation", choices=("eager", "sdpa", "eager_exact"))
    p.add_argument("--lora", action="store_true", help="train peft LoRA adapters only")
    p.add_argument("--lora-r", dest="lora_r", type=int)
    p.add_argument("--lora-alpha", dest="lora_alpha", type=int)
    p.add_argument("--lora-targets", dest="lora_targets", type=lambda s: s.split(","),
                   help="comma-separated module names (default q_proj,v_proj)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _kv(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def load_config_file(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


def resolve_train_config(ns: dict) -> TrainConfig:
    base = TrainConfig().to_dict()
    if "config" in ns:
        base.update(load_config_file(ns.pop("config")))
    model = dict(base.get("model", {}))
    if "hf_overrides" in ns:
        ns["hf_overrides"] = {**base.get("hf_overrides", {}), **dict(ns["hf_overrides"])}
    for key, value in ns.items():
        if key.startswith("model."):
            model[key[6:]] = value
        else:
            base[key] = value
    base["model"] = model
    known = {f.name for f in fields(TrainConfig)}
    unknown = set(base) - known
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
    return TrainConfig.from_dict(base)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="seco-lab", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    sub.add_parser("bias-study", help="run the bias study (arguments as experiments.bias_study)", add_help=False)
    sub.add_parser("report", help="generate a report from stored results", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bias-study":
        from .study import main as study_main

        study_main(argv[1:])
        return 0
    if argv and argv[0] == "report":
        from .report import main as report_main

        report_main(argv[1:])
        return 0
    ns = vars(ap.parse_args(argv))
    ns.pop("command")
    try:
        cfg = resolve_train_config(ns)
        from .train import Trainer, init_distributed_from_env

        init_distributed_from_env()
        trainer = Trainer(cfg)
        trainer.prepare()
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"seco-lab train: error: {e}", file=sys.stderr)
        return 2
    try:
        last = trainer.fit()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if trainer.rank == 0:
        print(json.dumps({"run_dir": cfg.run_dir, **last}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
