"""seco-lab: chunk-wise long-context training (SeCO exact, SpaCO sparse) and exact
verification of the SpaCO gradient estimators.

    seco-lab train --mode spaco --scheme falling-factorial --budget 2 --run-dir runs/x
    seco-lab train --config configs/demo.toml --steps 20 --run-dir runs/demo
    seco-lab train --run-dir runs/x --resume             (continue; a larger --steps extends)
    seco-lab plot runs/a runs/b --out compare.png        (loss curves of several runs)
    seco-lab study bias [--quick] ...                    (a registered study; `bias-study` = `study bias`)
    seco-lab report bias                                 (reports from stored results)
    seco-lab audit [--quick] --model M --texts DIR ...   (audit an estimator on your model and text)

The studies and reports are those of ``seco_lab.studies.registry``.

Settings come from the defaults (or, with --resume, the run's saved config), then the
config file, then the flags given.  Launch under ``torchrun --nproc_per_node N`` for
data parallelism, with ``--shard fsdp`` for sharded (FSDP2) training.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import shlex
import sys
import time
import traceback
import typing
import warnings
from dataclasses import MISSING, fields
from pathlib import Path

from . import __version__
from .config import (
    FSDP_NEEDS_TORCHRUN,
    TEXT_VOCAB,
    RunControl,
    TrainConfig,
    check_fields,
    flag_of,
    has_gpu_driver,
    load_config_file,
    tiny_config_from_dict,
)
from .core.checks import recompute_mode
from .field_types import unwrap_optional
from .models.tiny_config import TinyConfig
from .store import DuplicateKeyError, check_image_target, loads_json
from .studies.registry import STUDIES, check_run_dirs, file_arg, report_main, study_main
from .training.memory_estimate import check_fits_in_memory
from .training.run_checks import check_usable

__all__ = ["fail", "main", "resolve_train_config"]

GROUPS = ("model", "data", "estimator", "optimisation", "run control", "HF")
DISTRIBUTED_HELP = ("distributed: launch under `torchrun --nproc_per_node N -m seco_lab.cli train ...`; "
                    "--batch-size is split over ranks and micro-batches, gradients are all-reduced once per step "
                    "(gloo on CPU, NCCL on GPU). --shard fsdp shards parameters, optimizer state and stored gradients "
                    "with FSDP2 (gradients reduce-scattered once per step; see docs/training.md).")
MODEL_HELP = {"vocab_size": f"vocabulary (synthetic data; text data is {TEXT_VOCAB} bytes)", "d_model": "width",
              "n_layers": "transformer blocks", "n_heads": "attention heads",
              "n_kv_heads": "key/value heads (grouped-query attention; default: n_heads)", "d_ff": "MLP hidden width",
              "max_positions": "longest sequence the model accepts", "rope_theta": "RoPE base",
              "norm_eps": "RMSNorm epsilon", "tie_embeddings": "share input and output embeddings",
              "dropout": "dropout probability"}


class UserError(ValueError):
    """Bad input from the command line; printed as ``seco-lab CMD: error: ...`` with exit status 2."""


def _kv(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key, loads_json(value)
    except DuplicateKeyError as e:
        raise argparse.ArgumentTypeError(f"{key}: {e}") from None
    except json.JSONDecodeError:
        return key, value


def _float_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _add_field(group, f, hint, dest: str, default, help_text: str) -> None:
    flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
    kw: dict = {"dest": dest}
    base, optional = unwrap_optional(hint)
    origin = typing.get_origin(base)
    if base is bool:
        if default:  # the flag turns it off, and its help says so
            flag, kw["action"] = "--no-" + flag[2:], "store_false"
            help_text = f.metadata.get("off_help") or f"turn off: {help_text}"
        else:
            kw["action"] = "store_true"
    elif base is int:
        kw.update(type=int, metavar="N")
    elif base is float:
        kw.update(type=_float_or_none if optional else float, metavar="X")
    elif base is str and "choices" in f.metadata:
        kw.update(choices=f.metadata["choices"], metavar="{" + ",".join(f.metadata["choices"]) + "}")
    elif base is str:
        kw.update(metavar=f.name.split("_")[-1].upper())
    elif origin is tuple:
        kw.update(type=float, nargs=2, metavar=("B1", "B2"))
    elif origin is list and f.name == "text_paths":
        kw.update(action="append", metavar="PATH")
    elif origin is list:
        kw.update(type=lambda s: [x for x in s.split(",") if x], metavar="A,B")
    elif base is dict:
        kw.update(type=_kv, action="append", metavar="FIELD=VALUE")
    shown = "off" if default is None else (",".join(default) if isinstance(default, list) else default)
    quiet = kw.get("action") in ("store_true", "store_false") or default in ({}, []) or "default:" in help_text
    suffix = "" if quiet else f" (default: {shown})"
    group.add_argument(flag, help=help_text + suffix, **kw)


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(cls)}


def train_parser(sub) -> argparse.ArgumentParser:
    """The ``train`` flags, generated from the fields of TrainConfig, TinyConfig and RunControl."""
    p = sub.add_parser("train", help="train a model with dense / SeCO / SpaCO gradients",
                       description="Train a chunk model; every flag is a TrainConfig / RunControl field.",
                       argument_default=argparse.SUPPRESS, epilog=DISTRIBUTED_HELP)
    # "--lr -1e-3": argparse (3.11) takes only -N and -N.N for negative numbers, so an exponent made the value look
    # like a flag ("expected one argument"); with it the value is parsed, and refused by the field's own check
    p._negative_number_matcher = re.compile(r"^-\d+$|^-\d*\.\d+$|^-(\d+\.?\d*|\.\d+)[eE][-+]?\d+$|^-(inf|nan)$",
                                            re.IGNORECASE)
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    groups["run control"].add_argument("--config", type=file_arg("run.toml"), metavar="FILE",
                                       help="JSON or TOML file of TrainConfig fields (a [model] table for the model)")
    tiny_defaults = _defaults(TinyConfig)
    for f in fields(TinyConfig):
        hint = typing.get_type_hints(TinyConfig)[f.name]
        _add_field(groups["model"], f, hint, "model." + f.name, tiny_defaults[f.name], MODEL_HELP.get(f.name, f.name))
    for cls in (TrainConfig, RunControl):
        hints, defaults = typing.get_type_hints(cls), _defaults(cls)
        for f in fields(cls):
            if f.name != "model" and f.metadata.get("cli", True):
                _add_field(groups[f.metadata["group"]], f, hints[f.name], f.name, defaults[f.name], f.metadata["help"])
    return p


def suggest(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """'unrecognized arguments: --chunk-sise; did you mean --chunk-size?'"""
    options = [o for a in parser._actions for o in a.option_strings]
    msg = f"unrecognized arguments: {' '.join(extras)}"
    for arg in extras:
        close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
        if arg.startswith("-") and close:
            msg += f"; did you mean {close[0]}?"
    return msg


def resolve_train_config(ns: dict) -> tuple[TrainConfig, RunControl]:
    """Defaults (or the resumed run's saved config) <- config file <- flags."""
    ns = dict(ns)
    run_names = {f.name for f in fields(RunControl)}
    source = str(ns.get("config", "")) or "config"
    file = load_config_file(ns.pop("config")) if "config" in ns else {}
    run = {k: v for k, v in {**file, **ns}.items() if k in run_names}
    file = {k: v for k, v in file.items() if k not in run_names}
    if file:  # types and ranges of the file alone, so that its errors name the file
        try:
            check_fields(TrainConfig.from_dict(file, source=f"config file {source}"))
        except ValueError as e:
            if str(e).startswith("config file"):
                raise
            raise UserError(f"config file {source}: {e}") from None
    run = RunControl(**run).validate()
    if run.shard == "fsdp" and not os.environ.get("WORLD_SIZE"):  # no launcher: no process group to join
        raise UserError(FSDP_NEEDS_TORCHRUN)
    check_usable(run.run_dir, run.resume, run.overwrite)  # again in Trainer.prepare; here before torch
    base = {}
    if run.resume:
        from .training.experiment import read_experiment
        from .training.trainer import experiment_from_record

        path = Path(run.run_dir) / "config.json"
        base = experiment_from_record(read_experiment(run.run_dir), str(path)).to_dict()
    flags = {k: v for k, v in ns.items() if k not in run_names and not k.startswith("model.")}
    if "hf_overrides" in flags:
        seen: dict = {}
        for key, value in flags["hf_overrides"]:  # the last would win without a word (campaign 31 U8)
            if key in seen and seen[key] != value:
                raise UserError(f"--hf-override {key} is given twice ({key}={json.dumps(seen[key])} and "
                                f"{key}={json.dumps(value)}); give each field once")
            seen[key] = value
        flags["hf_overrides"] = {**base.get("hf_overrides", {}), **file.get("hf_overrides", {}),
                                 **dict(flags["hf_overrides"])}
    merged = {**base, **file, **flags}
    model = {**base.get("model", {}), **file.get("model", {}),
             **{k[6:]: v for k, v in ns.items() if k.startswith("model.")}}
    if merged.get("data") == "text" and "vocab_size" not in model:
        model["vocab_size"] = TEXT_VOCAB
    merged["model"] = tiny_config_from_dict(model, "model flags")
    if isinstance(merged.get("hf_model"), str) and not merged["hf_model"].strip():
        raise UserError("--hf-model is empty; name an architecture (llama, qwen2), smollm2-135m or a local checkpoint "
                        "directory, or drop --hf-model for the tiny transformer")
    if merged.get("hf_model") is not None and any(k.startswith("model.") for k in ns):
        raise UserError("model flags (--d-model, ...) shape the tiny transformer; with --hf-model use --hf-override")
    spaco_only = sorted(k for k in ("scheme", "budget", "cap") if k in flags)
    if merged.get("mode", "seco") != "spaco" and spaco_only:
        raise UserError(f"--{', --'.join(spaco_only)} applies to --mode spaco only; add --mode spaco or drop it")
    try:
        cfg = TrainConfig.from_dict(merged).validate()
    except ValueError as e:  # a setting of the file that the flags contradict: say where it comes from
        changed = [f"{k} ({base[k]!r} -> {merged[k]!r})" for k in merged
                   if k in base and k not in ("steps", "lr_cycles", "model") and merged[k] != base[k]]
        if run.resume and changed:  # the resume refuses the change anyway: say that, not how to mend it (c29 S11)
            raise UserError(f"--resume: the config differs from the run in {run.run_dir} in: {', '.join(changed)}; "
                            "a resume keeps the run's settings (only --steps may grow): drop the changed flags or "
                            "start a new --run-dir") from None
        if run.resume and str(e).startswith("warmup=") and merged.get("warmup") == base.get("warmup"):
            # the warm-up is the run's own (a resume keeps it): the advice is about --steps (campaign 26 TA63)
            raise UserError(f"--steps {merged.get('steps')}: the run in {run.run_dir} warms up for "
                            f"{base.get('warmup')} steps (its config.json; a resume keeps that), so --steps must be "
                            f"larger; to extend the run, pass --steps above the {base.get('steps')} it has") from None
        raise UserError(_name_file_settings(str(e), file, flags, source)) from None
    if run.stop_at is not None and run.stop_at > cfg.steps:
        raise UserError(f"stop_at={run.stop_at} must lie in [1, steps={cfg.steps}]")
    if cfg.data == "text" and cfg.text_paths:  # the corpus reader says it too, after torch
        missing = [p for p in cfg.text_paths if str(p).strip() and not os.path.exists(p)]  # "": named later
        if missing:
            raise UserError(f"text path(s) not found: {', '.join(missing)}")
        odd = next((p for p in cfg.text_paths if str(p).strip() and not (os.path.isfile(p) or os.path.isdir(p))), None)
        if odd is not None:
            raise UserError(f"text path {odd} is not a regular file or folder (a FIFO, device or socket cannot be read "
                            "as a corpus); name text files or folders")
    if parse_device_kind(run.device) == "cpu":  # on a GPU the host holds the data only
        check_fits_in_memory(cfg)
    return cfg, run


def _name_file_settings(message: str, file: dict, flags: dict, source: str) -> str:
    """``message`` with a note on each flag it names whose value came from the config file, not the command line
    ("drop --budget" to someone who gave no --budget)."""
    from_file = [k for k in file if k not in flags and k in TrainConfig.__dataclass_fields__ and k != "model"
                 and re.search(re.escape(flag_of(k)) + r"(?![\w-])", message)]
    if not from_file:
        return message
    return message + "".join(f" ({flag_of(k)} is `{k}` in config file {source}: change it there)" for k in from_file)


def parse_device_kind(device: str) -> str:
    """'cpu' or 'cuda' for a --device value, without importing torch where the answer is plain."""
    if device == "cpu" or device.startswith("cpu:"):
        return "cpu"
    if device == "auto":
        if not has_gpu_driver():
            return "cpu"  # no GPU driver on this machine: torch would find no device either
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda"


def train_main(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    ns, extras = parser.parse_known_args(argv)
    if extras:
        parser.error(suggest(parser, extras))
    try:  # flags, config file and their combinations are checked before torch is imported
        cfg, run = resolve_train_config(vars(ns))
    except (ValueError, OSError) as e:
        return fail("train", e)
    import torch.distributed as dist

    from .training.launch import leave_process_group
    from .training.run_dir import RunDirError
    from .training.trainer import Trainer, init_distributed_from_env

    created = False  # a process group this command created (under torchrun), not one of its caller
    try:
        recompute_mode()  # a bad SECO_LAB_RECOMPUTE_CHECK is refused before anything starts
        created = init_distributed_from_env()
        trainer = Trainer(cfg, run)
        trainer.prepare()
    except (ValueError, OSError, ImportError, RunDirError) as e:  # bad input, missing files or extras: a message
        code = fail("train", e)
    else:
        try:
            code = run_training(trainer, cfg, run)
        except BaseException:
            if created and dist.is_initialized():
                dist.destroy_process_group()
            raise
    if created and dist.is_initialized():  # under torchrun: leave without the interpreter's teardown (see its doc)
        leave_process_group(code)
    return code


def run_training(trainer, cfg: TrainConfig, run: RunControl) -> int:
    """Fit a prepared trainer, turning its ends into messages and exit statuses."""
    from .core.checks import RecomputationError
    from .training.run_dir import RunDirError
    from .training.trainer import NonFiniteLoss, TrainingInterrupted

    lead = trainer.rank == 0
    if trainer.step >= cfg.steps:
        trainer.close()
        if lead:
            print(f"seco-lab train: {run.run_dir} is already complete at step {trainer.step}; pass a larger "
                  "--steps to extend it")
        return 0
    info = trainer.describe()
    start = (f"resuming {run.run_dir} from step {trainer.step} of {cfg.steps}" if trainer.step > 0 else
             f"{'restarting' if run.resume else 'starting'} {run.run_dir} at step 0 of {cfg.steps}"
             + (" (--resume found no checkpoint)" if run.resume else ""))
    if trainer.redone_steps:  # logged after the checkpoint (a kill between checkpoints): trained again
        redone = trainer.redone_steps
        start += (f" (metrics.jsonl's records of steps {redone[0]}-{redone[-1]}, logged after that checkpoint, are "
                  "dropped: those steps are trained again)" if len(redone) > 1 else
                  f" (metrics.jsonl's record of step {redone[0]}, logged after that checkpoint, is dropped: that "
                  "step is trained again)")
    if lead:
        try:
            print(f"seco-lab train: {start}: {info['model']}, {info['parameters']:,} parameters "
                  f"({info['trainable']:,} trainable), {info['tokens_per_step']:,} tokens per step, "
                  f"k={info['num_chunks']} chunks, budget t={info['budget']}{'' if cfg.mode == 'spaco' else ' (all)'}"
                  f", {cfg.mode} on {trainer.device}", flush=True)
        except StdoutClosed:  # nothing trained yet: a folder this command made goes, so a retry is a first try
            trainer.close()
            trainer.run_dir.remove_unused()
            raise
    first, began = trainer.step, time.perf_counter()
    try:
        last = trainer.fit()
    except (NonFiniteLoss, RunDirError, ValueError, RecomputationError) as e:  # a diverged run; a checkpoint that
        # could not be written; a check of the model at its first forward (dropout active in a checkpoint's config:
        # campaign 27 H20); a rebuilt chunk that did not reproduce its first pass (randomness in the forward)
        print(f"seco-lab train: error: {e}", file=sys.stderr)
        return 1
    except FloatingPointError as e:  # the engine refused a NaN/inf forward the trainer did not turn into a step
        print(f"seco-lab train: error: at step {trainer.step + 1}: {e}; stopped (the last checkpoint stays); "
              f"{trainer.non_finite_advice()}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if lead:
            draw_curve(run.run_dir)
            print(f"seco-lab train: interrupted; checkpoint at step {e.step} saved, resume with "
                  f"`seco-lab train --run-dir {run.run_dir} --resume`", file=sys.stderr)
        return 128 + e.signum  # 130 for SIGINT, 143 for SIGTERM, as the shell reports a process they end
    if lead:
        drawn = draw_curve(run.run_dir)  # loss.png, from the metrics the run stored
        print(end_summary(run.run_dir, first, trainer.step, cfg.steps, last, time.perf_counter() - began, drawn))
    return 0


def draw_curve(run_dir: str) -> bool:
    """``RUN_DIR/loss.png`` after a run (True once drawn); metrics it cannot draw (edited or damaged meanwhile) are
    a warning, not an error: the run itself trained and checkpointed."""
    from .folder_lock import FolderBusy, hold_lock, release_lock
    from .report.runs import plot_run
    from .training.run_checks import marker_run_id

    try:  # the trainer has let the folder go: drawn under its lock again, so a trainer that took the folder
        lock = hold_lock(Path(run_dir), "trainer", "the curve is left to it")  # meanwhile is not drawn into
    except (FolderBusy, OSError) as e:  # (campaign 35 M10)
        print(f"seco-lab train: warning: the loss curve was not drawn: {e}", file=sys.stderr)
        return False
    try:
        plot_run(run_dir, marker_run_id(Path(run_dir)))
    except (ValueError, OSError) as e:
        print(f"seco-lab train: warning: the loss curve was not drawn: {e}", file=sys.stderr)
        return False
    finally:
        release_lock(lock)
    return True


def end_summary(run_dir: str, first: int, step: int, steps: int, last: dict, seconds: float,
                drawn: bool = True) -> str:
    """One human-readable line at the end of a run; the metrics themselves stay in RUN_DIR/metrics.jsonl."""
    done = "finished" if step >= steps else f"stopped at step {step} of {steps} (--stop-at; --resume continues)"
    losses = ", ".join(f"{name.replace('_', ' ')} {last[name]:.4f}" for name in
                       ("loss", "eval_loss", "far_loss", "eval_far_loss") if isinstance(last.get(name), float))
    return (f"seco-lab train: {done}: steps {first}->{step} in {seconds:.1f} s; {losses or 'no loss logged'}; "
            f"metrics in {Path(run_dir) / 'metrics.jsonl'}, "
            + (f"curve in {Path(run_dir) / 'loss.png'}" if drawn else "no curve drawn (see the warning above)"))


def fail(command: str, e: Exception, path=None) -> int:
    """A one-line error; an OSError names its file, or ``path`` (what the command was writing) when the error
    carries none (a full disk: campaign 29 S10 printed "None: File too large")."""
    where = e.filename if isinstance(e, OSError) and e.filename is not None else path
    msg = e if not isinstance(e, OSError) or not e.strerror else f"{where}: {e.strerror}" if where else e.strerror
    print(f"seco-lab {command}: error: {msg}", file=sys.stderr)
    return 2


def plot_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="seco-lab plot", description="Draw several runs' loss curves on one figure.")
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    ap.add_argument("--out", type=file_arg("runs_loss.png"), default=Path("runs_loss.png"),
                    help="output image (default: runs_loss.png)")
    ns = ap.parse_args(argv)  # before matplotlib and pandas are imported: --help and usage errors answer at once
    try:
        check_image_target(ns.out)
        check_run_dirs(ns.run_dirs)
    except ValueError as e:
        return fail("plot", e)
    from .report.runs import plot_runs

    try:
        out = plot_runs(ns.run_dirs, ns.out)
    except (ValueError, OSError) as e:
        return fail("plot", e, ns.out)
    print(out)
    return 0


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"seco-lab: warning: {message}\n"


class StdoutClosed(Exception):
    """Whoever read the command's standard output has gone (``seco-lab ... | head -1`` ended early).  Not an
    OSError, so that no handler of the command takes it for its own files (campaign 28: "cannot write the results
    to b: Broken pipe")."""


class StdoutFailed(StdoutClosed):
    """A write to standard output failed for another reason (``seco-lab ... > /dev/full``: no space left): the
    command stops with one line on standard error (campaign 30 T10)."""

    def __init__(self, error: OSError):
        super().__init__(error)
        self.error = error


class _GuardedStdout:
    """``sys.stdout`` while a command runs: a write or flush into a closed pipe raises :class:`StdoutClosed`, any
    other error writing it :class:`StdoutFailed`."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise StdoutClosed from None
        except OSError as e:
            raise StdoutFailed(e) from None

    def flush(self):
        try:
            return self._stream.flush()
        except BrokenPipeError:
            raise StdoutClosed from None
        except OSError as e:
            raise StdoutFailed(e) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv=None) -> int:
    """The ``seco-lab`` command.  A stored file nested past Python's recursion limit (JSON or TOML of
    200,000 brackets) is a one-line error in every command, wherever it is read.  When the reader of its output
    goes away (a pipe to ``head``), the command ends quietly with status 141, as a Unix tool killed by SIGPIPE does;
    what it wrote before stands (every result is written atomically)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stdout = sys.stdout
    if not isinstance(stdout, _GuardedStdout) and stdout is not None:
        sys.stdout = _GuardedStdout(stdout)
    try:
        rc = _dispatch(argv)
        if sys.stdout is not None:
            sys.stdout.flush()  # a closed pipe is told here, not in the interpreter's own flush at exit
        return rc
    except StdoutFailed as e:
        command = argv[0] if argv and not argv[0].startswith("-") else ""
        reason = e.error.strerror or str(e.error) or type(e.error).__name__
        print(f"seco-lab{' ' + command if command else ''}: error: cannot write to standard output ({reason}); "
              "stopped there (the files it finished writing stand)", file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):  # the interpreter's flush at exit would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 1
    except StdoutClosed:
        with contextlib.suppress(OSError, ValueError):  # the rest of the buffered output goes nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        return 141
    except RecursionError as e:
        if not _raised_by_a_parser(e):  # our own recursion bug: a traceback, not a story about a file
            raise
        command = argv[0] if argv and not argv[0].startswith("-") else ""
        print(f"seco-lab{' ' + command if command else ''}: error: a file it read nests lists or tables too deeply "
              "to read (past Python's recursion limit); it is not a file seco-lab wrote -- check the paths given",
              file=sys.stderr)
        return 2
    finally:
        sys.stdout = stdout


def seal_main(argv: list[str]) -> int:
    """``seco-lab seal FOLDER...``: record the SHA-256 of every results file of each folder (and its subfolders) in
    ``checksums.sha256``, so that the reports read them: for results edited on purpose, or written by a seco-lab
    before checksums.  Every study and benchmark keeps the file up to date itself; a report refuses a results file
    that does not match it."""
    from .store import seal

    ap = argparse.ArgumentParser(prog="seco-lab seal", description=seal_main.__doc__.split("``: ")[1].replace(
        "``", "").replace("\n    ", " "))
    ap.add_argument("folders", nargs="+", metavar="FOLDER", help="a results folder (e.g. reports/bias_study)")
    a = ap.parse_args(argv)
    for folder in a.folders:
        if Path(folder).is_symlink() and Path(folder).is_dir():  # seal writes into a folder it is named, not via links
            ap.error(f"{folder} is a link to the folder {Path(folder).resolve()}: seal the folder itself "
                     f"(seco-lab seal {shlex.quote(str(Path(folder).resolve()))})")
        if not Path(folder).is_dir() or Path(folder).is_symlink():
            ap.error(f"{folder} is not a folder: name the results folder a report reads (its --results)")
    for folder in a.folders:
        try:
            written = seal(folder)
        except (OSError, ValueError) as e:  # no permission, a full disk, a damaged file in the way
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            where = "" if why.startswith(str(folder)) else f"{folder}: "  # named once ("b: b: ..." in campaign 28)
            print(f"seco-lab seal: error: {where}{why}"
                  f"{f' ({e.filename})' if isinstance(e, OSError) and e.filename else ''}", file=sys.stderr)
            return 2
        print(f"sealed {folder}: {len(written)} checksum file(s) ({', '.join(str(p) for p in written[:3])}"
              f"{' ...' if len(written) > 3 else ''})")
    return 0


def _raised_by_a_parser(e: RecursionError) -> bool:
    """Whether ``e`` was raised inside a JSON or TOML parser (a file nested past the recursion limit)."""
    frames = traceback.extract_tb(e.__traceback__)[-8:]
    return any(Path(f.filename).parent.name in ("json", "tomllib", "tomli") for f in frames)


def _dispatch(argv: list[str]) -> int:
    warnings.formatwarning = _one_line_warning  # the command line's warnings read like its errors
    ap = argparse.ArgumentParser(prog="seco-lab", description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 epilog="Run `seco-lab COMMAND --help` for a command's options.")
    ap.add_argument("--version", action="version", version=f"seco-lab {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = train_parser(sub)
    sub.add_parser("plot", help="draw several runs' loss curves on one figure", add_help=False)
    sub.add_parser("study", help="run a registered study (resumable): " + ", ".join(
        s.name for s in STUDIES.values() if s.run), add_help=False)
    sub.add_parser("bias-study", help="the same as `study bias`", add_help=False)
    sub.add_parser("report", help="generate a report from stored results", add_help=False)
    sub.add_parser("audit", help="audit a gradient estimator on a model and text (bias, noise, equal compute)",
                   add_help=False)
    sub.add_parser("seal", help="vouch for a results folder's files as they are (record their checksums)",
                   add_help=False)
    if argv and argv[0] in ("study", "bias-study", "audit") and not {"-h", "--help"} & set(argv):
        try:  # campaign 40 D4: a bad SECO_LAB_RECOMPUTE_CHECK is refused before a results folder is made
            recompute_mode()
        except ValueError as e:
            print(f"seco-lab {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    if argv and argv[0] == "study":
        return study_main(argv[1:])
    if argv and argv[0] == "bias-study":
        return study_main(argv[1:], prog="seco-lab bias-study")
    if argv and argv[0] == "report":
        return report_main(argv[1:])
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    if argv and argv[0] == "audit":
        from .studies.audit.options import build_parser as audit_parser
        from .studies.audit.options import check_args

        ns = audit_parser().parse_args(argv[1:])  # --help and usage errors before torch is imported
        try:
            check_args(ns)  # and settings out of range
        except (ValueError, TypeError) as e:
            print(f"seco-lab audit: error: {e}", file=sys.stderr)
            return 2
        from .studies.audit.driver import run_args

        return run_args(ns)
    if argv and argv[0] == "train":
        return train_main(train, argv[1:])
    if argv and argv[0] == "seal":
        return seal_main(argv[1:])
    commands = ("train", "plot", "study", "bias-study", "report", "audit", "seal")
    first = argv[0] if argv else ""
    if (first.startswith("-") and first not in ("-h", "--help", "--version")
            and not (first.startswith("--") and len(first) > 2 and any(o.startswith(first) for o in ("--help",
                                                                                                    "--version")))):
        ap.error(suggest(ap, [first]) + "; a command's options come after the command (seco-lab COMMAND --help)")
    close = difflib.get_close_matches(argv[0], commands, n=1) if argv and not argv[0].startswith("-") else []
    if close:
        ap.error(f"unknown command {argv[0]!r}; did you mean {close[0]}?")
    ap.parse_args(argv)  # --help, --version, or a usage error naming the commands
    return 2


if __name__ == "__main__":
    sys.exit(main())
