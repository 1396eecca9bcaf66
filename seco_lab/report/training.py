"""The training comparison report (``reports/training.md``) from ``experiments/train_compare.py``'s results."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from ..studies.registry import STUDIES
from .figures import figure_folder, new_figure, save_figure
from .markdown import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    MissingResultsError,
    generated_note,
    read_json_table,
    read_results_csv,
    require,
    table,
    write_markdown,
)

__all__ = ["load_training", "summarize_training", "training_report"]

PRODUCE_TRAINING = STUDIES["train-compare"].produce
TRAINING_FILES = STUDIES["train-compare"].stored_files
#: what training.json records that the report reads, with its JSON type
TRAINING_RECORD = {"n_keys": int, "demo": dict, "synthetic": dict, "software": dict}


def load_training(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The stored results, each checked before a number of it is used: the tables by
    :func:`~seco_lab.report.markdown.read_results_csv` (a FIFO, device or huge file is never opened; the columns
    the report reads, numbers, rows), ``training.json`` by :func:`~seco_lab.report.markdown.read_json_table` (a
    JSON object with the records the report reads); a refusal names the file and the command that writes it."""
    folder = Path(folder)
    require(folder, TRAINING_FILES, PRODUCE_TRAINING)
    throughput = read_results_csv(folder / "throughput.csv", ("mode", "tokens_per_s", "backprop_chunks", "k",
                                                              "steps_timed"), PRODUCE_TRAINING, text_columns=("mode",),
                                  more_columns=True, ranges={"tokens_per_s": POSITIVE, "backprop_chunks": NON_NEGATIVE,
                                                             "k": COUNT, "steps_timed": COUNT}, key=("mode",))
    far = read_results_csv(folder / "far_loss.csv", ("mode", "step", "eval_far_loss", "eval_loss"), PRODUCE_TRAINING,
                           text_columns=("mode",), more_columns=True,
                           ranges={"step": NON_NEGATIVE, "eval_far_loss": NON_NEGATIVE, "eval_loss": NON_NEGATIVE},
                           key=("mode", "step"))
    meta = read_json_table(folder / "training.json", PRODUCE_TRAINING)
    wrong = [k for k, kind in TRAINING_RECORD.items() if not isinstance(meta.get(k), kind) or isinstance(
        meta.get(k), bool) and kind is int]
    if wrong:
        raise MissingResultsError(f"{folder / 'training.json'} holds no readable training record ({', '.join(wrong)} "
                                  f"missing or of the wrong type): rerun {PRODUCE_TRAINING}")
    if not {"dense", "seco"} <= set(throughput["mode"]):
        raise MissingResultsError(f"{folder / 'throughput.csv'} lacks the dense or the seco row the throughput is "
                                  f"compared with: rerun {PRODUCE_TRAINING}")
    check_chunks(folder, throughput, meta)
    return throughput, far, meta


def check_chunks(folder: Path, throughput: pd.DataFrame, meta: dict) -> None:
    """throughput.csv's k against the demo configuration it was measured on (training.json): every row ran
    k = ceil(seq_len / chunk_size) chunks and backpropagated at most k of them; the report prints one k and one
    count of timed steps, so every row holds the same.  A value the configuration contradicts is refused."""
    path, record = folder / "throughput.csv", folder / "training.json"
    demo = meta["demo"]
    size = {c: demo.get(c) for c in ("seq_len", "chunk_size")}
    if wrong := [c for c, v in size.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]:
        raise MissingResultsError(f"{record}: demo.{wrong[0]} = {size[wrong[0]]!r} is not a positive integer: the "
                                  f"record is damaged; rerun {PRODUCE_TRAINING}")
    k = -(-size["seq_len"] // size["chunk_size"])
    for col, ok, says in (("k", throughput.k == k, f"k = ceil(seq_len / chunk_size) = ceil({size['seq_len']} / "
                                                   f"{size['chunk_size']}) = {k} from {record}'s demo"),
                          ("backprop_chunks", throughput.backprop_chunks <= k, f"at most k = {k} chunks backpropagate"),
                          ("steps_timed", throughput.steps_timed == throughput.steps_timed.iloc[0],
                           f"every mode was timed over the same steps ({int(throughput.steps_timed.iloc[0])}, "
                           "row 2)")):
        if not ok.all():
            row = int((~ok).idxmax())
            raise MissingResultsError(f"{path}: row {row + 2} ({throughput['mode'][row]}) holds {col} = "
                                      f"{throughput[col][row]:g}, but {says}: the file was edited or is damaged; "
                                      f"rerun {PRODUCE_TRAINING}")


def summarize_training(throughput: pd.DataFrame, far: pd.DataFrame, meta: dict) -> dict:
    """Throughput relative to dense and SeCO; far-token loss at the start and at each mode's last step."""
    tp = throughput.copy()
    rate = tp.set_index("mode").tokens_per_s
    tp["vs dense"] = tp.tokens_per_s / float(rate["dense"])
    tp["vs seco"] = tp.tokens_per_s / float(rate["seco"])
    final = far.loc[far.groupby("mode", sort=False).step.idxmax(), ["mode", "eval_far_loss", "eval_loss"]]
    return {"throughput": tp[["mode", "tokens_per_s", "backprop_chunks", "vs dense", "vs seco"]],
            "final": final.rename(columns={"eval_far_loss": "final far-token loss", "eval_loss": "final loss"}),
            "start_far_loss": float(far[far.step == 0].eval_far_loss.mean()),
            "ln_keys": float(np.log(meta["n_keys"])), "k": int(tp.k.iloc[0]),
            "steps_timed": int(tp.steps_timed.iloc[0])}


def fig_far_loss(far: pd.DataFrame, ln_keys: float, out: Path) -> str:
    fig, axes = new_figure(figsize=(8, 4.6))
    ax = axes[0][0]
    for mode, d in far.groupby("mode", sort=False):
        ax.plot(d.step, d.eval_far_loss, marker="o", ms=3, label=mode)
    ax.axhline(ln_keys, color="k", ls=":", lw=1, label="ln K: best loss without reading chunk 0")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out far-token loss (nats)")
    ax.set_title("Synthetic key-value recall across chunks", fontsize=9)
    fig.legend(loc="outside right upper", fontsize=7)
    return save_figure(fig, out / "far_loss.png")


def training_report(folder: Path, out_md: Path) -> Path:
    folder, out_md = Path(folder), Path(out_md)
    tp, far, meta = load_training(folder)
    s = summarize_training(tp, far, meta)
    figdir = figure_folder(out_md, "training", "training")
    f_far = fig_far_loss(far, s["ln_keys"], figdir)
    demo, syn, sw = meta["demo"], meta["synthetic"], meta["software"]
    rel = os.path.relpath(figdir, out_md.parent)
    md = ["# Training modes compared\n",
          generated_note(STUDIES["train-compare"].name, folder, out_md, PRODUCE_TRAINING)]
    if meta.get("quick"):
        md.append("**Quick smoke run: too few steps for the numbers below to mean anything.**\n")
    md.append("## Throughput on the demo configuration\n")
    md.append(f"Byte-level text (Python standard library), sequences of {demo['seq_len']} tokens in chunks of "
              f"{demo['chunk_size']} (k = {s['k']}), batch {demo['batch_size']}, model {demo['model']}, "
              f"{demo['dtype']} on {sw['cpus']} CPUs; median tokens/s over {s['steps_timed']} optimizer "
              "steps after two warm-up steps, every mode in one process, one after the other.\n")
    md.append(table(s["throughput"]) + "\n")
    md.append("## Far-token loss on the synthetic long-range task\n")
    md.append(f"One key-value pair in chunk 0 of {syn['seq_len'] // syn['chunk_size']}, queried in the last chunk "
              f"(sequence {syn['seq_len']}, chunk {syn['chunk_size']}, batch {syn['batch_size']}, {syn['steps']} "
              f"steps, lr {syn['lr']}, model {syn['model']}). The value is uniform over K = {meta['n_keys']} "
              f"tokens, so a model that does not read chunk 0 cannot go below ln K = {s['ln_keys']:.3f}. Far-token "
              f"loss at step 0: {s['start_far_loss']:.3f}.\n")
    md.append(table(s["final"]) + "\n")
    md.append(f"![far-token loss]({rel}/{f_far})\n")
    md.append(f"Software: Python {sw['python']}, torch {sw['torch']}; {sw['platform']}.\n")
    return write_markdown(md, out_md)
