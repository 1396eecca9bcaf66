"""LoRA fine-tuning of SmolLM2-135M on long real text with ``SeCOTrainer`` (the transformers Trainer,
chunk-wise backward).

    python examples/lora_trainer.py                          # SeCO, 4096-token rows, chunks of 512
    python examples/lora_trainer.py --mode spaco --budget 4  # SpaCO: 4 of the 8 chunks per row
    python examples/lora_trainer.py --trainer stock          # the stock Trainer on the same batches
    python examples/lora_trainer.py --compare-memory --max-steps 2 --threads 1

The text is Python's own ``pydoc_data/topics.py`` (the language reference, ~750 KB; any text
files or folders via ``--text``), tokenized and packed into rows of ``--seq-len`` tokens by
``seco_lab.integrations.transformers.pack_dataset``.  The model is the offline SmolLM2-135M
(``seco_lab.models.pretrained``), with peft LoRA adapters on q_proj and v_proj.

``--compare-memory`` trains the stock Trainer and SeCOTrainer on the same batches, each in a fresh
process, and writes ``memory.json`` (peak resident set of each) into ``--output-dir``; the table it
prints is regenerated from that file by ``--report``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--trainer", choices=["seco", "stock"], default="seco", help="SeCOTrainer or the stock Trainer")
    p.add_argument("--mode", choices=["seco", "spaco"], default="seco")
    p.add_argument("--scheme", default="falling-factorial", help="SpaCO compensation scheme")
    p.add_argument("--budget", type=int, default=4, help="SpaCO: chunks backpropagated per row")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per training row")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU or GPU)")
    p.add_argument("--text", nargs="+", default=None, help="text files or folders (default: pydoc_data/topics.py)")
    p.add_argument("--model", default="smollm2-135m", help="a seco_lab pretrained name, a .gguf file or a folder")
    p.add_argument("--output-dir", default="runs/lora_trainer")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-memory", action="store_true", help="stock vs SeCO peak memory, fresh process each")
    p.add_argument("--report", action="store_true", help="print the table of --output-dir/memory.json")
    return p.parse_args(argv)


def default_text() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.__file__]


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def train(args: argparse.Namespace) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments, default_data_collator

    from seco_lab.integrations.transformers import SeCOArguments, SeCOTrainer, pack_dataset
    from seco_lab.models.hf import add_lora
    from seco_lab.models.pretrained import build_causal_lm, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    rows = pack_dataset(args.text or default_text(), tokenizer, args.seq_len)
    model = add_lora(build_causal_lm(args.model), r=args.lora_rank, alpha=2 * args.lora_rank)
    model.print_trainable_parameters()
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps, learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=0,
        logging_steps=1, save_strategy="no", report_to=[], bf16=args.bf16, seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
    )
    common = dict(model=model, args=training, train_dataset=rows, data_collator=default_data_collator)
    if args.trainer == "stock":
        trainer = Trainer(**common)
    else:
        spaco = dict(scheme=args.scheme, budget=args.budget, seed=args.seed) if args.mode == "spaco" else {}
        seco = SeCOArguments(chunk_size=args.chunk_size, mode=args.mode, **spaco)
        trainer = SeCOTrainer(seco_args=seco, **common)
    before = rss_mib()
    start = time.process_time()
    result = trainer.train()
    out = {"trainer": "stock" if args.trainer == "stock" else args.mode,
           "seq_len": args.seq_len, "chunk_size": args.chunk_size, "rows": len(rows), "steps": args.max_steps,
           "train_loss": result.training_loss, "cpu_seconds": time.process_time() - start,
           "rss_before_train_mib": before, "peak_rss_mib": peak_rss_mib(),
           "threads": torch.get_num_threads(), "model": args.model}
    model.save_pretrained(Path(args.output_dir) / "adapter")
    return out


def compare_memory(args: argparse.Namespace, argv: list[str]) -> None:
    """Train stock and SeCO, each in a fresh process on the same batches; write memory.json."""
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for trainer in ("stock", "seco"):
        child = [a for a in argv if a != "--compare-memory"]
        child += ["--trainer", trainer, "--output-dir", str(out_dir / trainer), "--result-json"]
        proc = subprocess.run([sys.executable, __file__, *child], stdout=subprocess.PIPE, text=True, check=True)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)  # the child's Trainer logs
        results.append(json.loads(lines[-1]))
    payload = {"command": " ".join(["python", "examples/lora_trainer.py", *argv]), "runs": results}
    from seco_lab.store import atomic_write_json, start_checksums

    start_checksums(out_dir)  # --report verifies memory.json against what was written
    atomic_write_json(out_dir / "memory.json", payload, indent=1)
    print(memory_table(payload))


REPORT_PRODUCE = "`python examples/lora_trainer.py --compare-memory --output-dir DIR`"
#: what one run of memory.json holds: field -> (types, lower bound or None, strict); bools are not numbers here
RUN_FIELDS = {"trainer": (str, None, False), "seq_len": (int, 1, False), "chunk_size": (int, 1, False),
              "rows": (int, 1, False), "steps": (int, 1, False), "train_loss": ((int, float), 0, False),
              "cpu_seconds": ((int, float), 0, False), "rss_before_train_mib": ((int, float), 0, True),
              "peak_rss_mib": ((int, float), 0, True), "threads": (int, 1, False), "model": (str, None, False)}
#: the fields that identify the setup: stock and SeCO must share them for their peaks to be compared
SETUP_FIELDS = ("seq_len", "model", "rows", "steps", "threads")


class MemoryRecordError(ValueError):
    """memory.json is missing, unreadable, or not one stock and one SeCO run of the same setup."""


def read_memory(output_dir: str | Path) -> dict:
    """``output_dir/memory.json`` read by the project's stored-record reader and checked (:func:`check_memory`);
    any failure is one :class:`MemoryRecordError` naming the file."""
    from seco_lab.store import RECORD_MAX_BYTES, read_json, verify_checksums

    path = Path(output_dir) / "memory.json"
    try:  # a FIFO, folder or huge file, not UTF-8, not JSON, not an object: a ValueError naming the file
        read_json(path, "memory record", RECORD_MAX_BYTES, f"rerun {REPORT_PRODUCE}")  # damage named first
        verified = verify_checksums(path.parent, REPORT_PRODUCE, only=("memory.json",))  # as written, not edited
        payload = read_json(path, "memory record", RECORD_MAX_BYTES, f"rerun {REPORT_PRODUCE}")
        verified.check_unchanged(REPORT_PRODUCE)  # and what was read is what was verified
    except FileNotFoundError:
        raise MemoryRecordError(f"{path} is missing: run {REPORT_PRODUCE} first, or pass the folder that holds it "
                                "with --output-dir") from None
    except ValueError as e:
        raise MemoryRecordError(str(e)) from None
    except OSError as e:
        raise MemoryRecordError(f"{path} cannot be read ({e.strerror or e}): rerun {REPORT_PRODUCE}") from None
    check_memory(payload, path)
    return payload


def check_memory(payload: dict, path: str | Path = "memory.json") -> None:
    """Refuse (:class:`MemoryRecordError`) a record the table would misreport: no ``command`` string, other than
    exactly one stock and one SeCO (or SpaCO) run, a field missing, of the wrong type, not finite or out of range,
    a peak below the resident set before training, or two runs of different setups (:data:`SETUP_FIELDS`)."""
    def bad(why: str) -> MemoryRecordError:
        return MemoryRecordError(f"{path}: {why}: it is damaged or not written by --compare-memory; rerun "
                                 f"{REPORT_PRODUCE}")

    if not isinstance(payload.get("command"), str):
        raise bad('no "command" string')
    runs = payload.get("runs")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise bad('"runs" is not a list of objects')
    for i, r in enumerate(runs):
        for field, (kinds, low, strict) in RUN_FIELDS.items():
            v = r.get(field)
            if not isinstance(v, kinds) or isinstance(v, bool):
                raise bad(f"run {i} has no {field!r}" if v is None else f"run {i}: {field!r} is {v!r}, not "
                          + ("text" if kinds is str else "an integer" if kinds is int else "a number"))
            if low is not None and not (math.isfinite(v) and (v > low if strict else v >= low)):
                raise bad(f"run {i}: {field} = {v!r} is impossible (it must be {'>' if strict else '≥'} {low})")
        if r["peak_rss_mib"] < r["rss_before_train_mib"]:
            raise bad(f"run {i} ({r['trainer']}): peak RSS {r['peak_rss_mib']:g} MiB is below the RSS before "
                      f"training, {r['rss_before_train_mib']:g} MiB (a peak is a high-water mark)")
    trainers = sorted(r["trainer"] for r in runs)
    if len(runs) != 2 or trainers[0] not in ("seco", "spaco") or trainers[1] != "stock":
        raise bad(f"it holds the runs {trainers}, not one 'stock' and one 'seco' (or 'spaco') to compare")
    for field in SETUP_FIELDS:
        if runs[0][field] != runs[1][field]:
            raise bad(f"the runs differ in {field} ({runs[0]['trainer']}: {runs[0][field]!r}, {runs[1]['trainer']}: "
                      f"{runs[1][field]!r}), so their peaks are not comparable")


def memory_table(payload: dict) -> str:
    check_memory(payload)
    runs = payload["runs"]
    stock = next(r for r in runs if r["trainer"] == "stock")

    def own(r):  # training's own peak: above the resident set of the loaded model and data
        return r["peak_rss_mib"] - r["rss_before_train_mib"]

    lines = [f"`{payload['command']}`", "",
             "| trainer | seq len | chunk | peak RSS (MiB) | peak - RSS before train (MiB) | CPU s | train loss |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['trainer']} | {r['seq_len']} | {r['chunk_size'] if r['trainer'] != 'stock' else '-'} "
                     f"| {r['peak_rss_mib']:.0f} | {own(r):.0f} "
                     f"| {r['cpu_seconds']:.0f} | {r['train_loss']:.4f} |")
    for r in runs:
        if r is not stock:  # the stock run's own peak can be 0 (no growth past the loaded model): no ratio then
            ratio = f"{own(r) / own(stock):.2f}x" if own(stock) > 0 else "n/a (the stock run's is 0)"
            lines.append(f"\n{r['trainer']}: peak RSS {r['peak_rss_mib'] / stock['peak_rss_mib']:.2f}x the stock "
                         f"Trainer's; training's own peak {ratio}")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--result-json" in argv
    argv = [a for a in argv if a != "--result-json"]
    args = parse_args(argv)
    if args.report or args.compare_memory:
        try:
            if args.report:
                print(memory_table(read_memory(args.output_dir)))
            else:
                compare_memory(args, argv)
        except MemoryRecordError as e:
            print(f"lora_trainer.py: error: {e}", file=sys.stderr)
            sys.exit(2)
    else:
        result = train(args)
        print(json.dumps(result) if as_json else f"peak resident set {result['peak_rss_mib']:.0f} MiB "
              f"({result['rss_before_train_mib']:.0f} MiB before training)")


if __name__ == "__main__":
    main()
