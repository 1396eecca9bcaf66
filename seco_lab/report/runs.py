"""Loss curves of training runs, drawn from their ``metrics.jsonl`` (no global matplotlib state).

* :func:`plot_run` -- one run: train, far-token and eval losses -> ``RUN_DIR/loss.png``.
* :func:`plot_runs` -- several runs' train and eval losses on one figure (``seco-lab plot``).
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

from matplotlib.figure import Figure

from ..store import RUN_FIGURE_KEY, check_image_target, escaped_text, holds_nul
from ..studies.registry import check_run_dirs
from ..training.run_dir import read_config, read_metrics
from .figures import save_figure

__all__ = ["LABEL_KEYS", "LOSSES", "MAX_RUNS", "distinct_names", "literal", "plot_run", "plot_runs", "run_label",
           "runs_figure"]

LOSSES = ("loss", "far_loss", "eval_loss", "eval_far_loss")
LABEL_KEYS = ("mode", "data", "seq_len", "chunk_size")
#: the runs one figure tells apart: 10 colours, times 4 line styles (and eval markers) past the first 10
_LINE_STYLES = ("-", "--", ":", "-.")
_EVAL_MARKERS = ("o", "s", "^", "D")
MAX_RUNS = 10 * len(_LINE_STYLES)


def literal(text: str) -> str:
    """``text`` as matplotlib draws it literally: a ``$`` escaped (two of them, as in a folder ``$x^2$``, would
    otherwise be drawn as mathtext: campaign 25 N1), and a name that is not UTF-8 (its bytes decoded as surrogates,
    which the font renderer refuses: campaign 26) spelled with escapes, ``caf\\xe9``."""
    return escaped_text(str(text)).replace("$", r"\$")


def run_label(run_dir) -> str:
    cfg = read_config(run_dir)
    lacking = [k for k in LABEL_KEYS + (("scheme", "budget") if cfg.get("mode") == "spaco" else ()) if k not in cfg]
    if lacking:
        raise ValueError(f"{Path(run_dir) / 'config.json'} lacks {', '.join(lacking)}: not the config of a "
                         "`seco-lab train` run")
    mode = cfg["mode"] + (f" / {cfg['scheme']} t={cfg['budget']}" if cfg["mode"] == "spaco" else "")
    return f"{mode}, {cfg['data']} data, seq {cfg['seq_len']}, chunk {cfg['chunk_size']}"


def plotted_metrics(run_dir) -> list[dict]:
    """The run's metric records, checked for plotting: at least one, each with an integer ``step``, every
    loss a number.  Non-finite losses (a diverged step) are left out of the curves with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    with warnings.catch_warnings(record=True) as torn:  # a torn last line: said below when it is all there is
        warnings.simplefilter("always")
        rows = read_metrics(run_dir)
    if not rows:
        if path.exists() and path.stat().st_size and (holds_nul(path) or torn):
            what = "holds NUL bytes" if holds_nul(path) else "holds only a torn line"
            raise ValueError(f"{path} {what} and no complete record: the metrics file is damaged (cut and padded "
                             "with zeros, or overwritten); restore it from a copy, or rerun the run")
        raise ValueError(f"{path} holds no metrics yet: nothing to plot (has the run taken a step?)")
    for w in torn:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    dropped = 0
    out = []
    for i, r in enumerate(rows, 1):
        step = r.get("step") if isinstance(r, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}: record {i} has no integer 'step' ({str(r)[:60]}): the file is damaged")
        row = {"step": step}
        for key in LOSSES:
            if key not in r:
                continue
            v = r[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{path}: record {i} (step {step}) has {key} = {v!r}, not a number: the file is "
                                 "damaged")
            if math.isfinite(v):
                row[key] = float(v)
            else:
                dropped += 1
        out.append(row)
        if len(out) > 1 and step <= out[-2]["step"]:
            raise ValueError(f"{path}: record {i} has step {step} after step {out[-2]['step']} (steps repeat or go "
                             "backwards): the file was edited or two runs' metrics were joined; a curve would "
                             "zig-zag, so nothing is drawn")
    if not any(k in r for r in out for k in LOSSES):
        raise ValueError(f"{path} holds no finite loss value ({dropped} NaN or inf): nothing to plot (the run "
                         "diverged from its first logged step?)")
    if dropped:
        warnings.warn(f"{path}: {dropped} non-finite loss value(s) (NaN or inf) are not drawn", stacklevel=2)
    return out


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    sel = [r for r in rows if key in r]
    return [r["step"] for r in sel], [r[key] for r in sel]


def run_figure(run_dir) -> Figure:
    rows = plotted_metrics(run_dir)
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(*_series(rows, "loss"), lw=1, label="train loss")
    if any("far_loss" in r for r in rows):
        ax.plot(*_series(rows, "far_loss"), lw=1, label="train far-token loss")
    ax.plot(*_series(rows, "eval_loss"), "o-", ms=3, label="eval loss")
    if any("eval_far_loss" in r for r in rows):
        ax.plot(*_series(rows, "eval_far_loss"), "s-", ms=3, label="eval far-token loss")
    ax.set_title(literal(run_label(run_dir)), fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend(fontsize=8)
    return fig


def plot_run(run_dir, run_id: str | None = None) -> Path:
    """``RUN_DIR/loss.png``, marked as the run ``run_id``'s where one is given."""
    out = Path(run_dir) / "loss.png"
    save_figure(run_figure(run_dir), out, {RUN_FIGURE_KEY: run_id} if run_id else None)
    return out


def distinct_names(run_dirs) -> list[str]:
    """Each run's name in a legend: its folder's name, or as many trailing path parts as tell it from the others
    (``a/r`` and ``b/r``, not ``r`` twice: campaign 24 F10); the whole resolved path where nothing shorter does."""
    paths = [Path(os.path.abspath(d)).parts for d in run_dirs]
    for n in range(1, max((len(p) for p in paths), default=0) + 1):
        names = ["/".join(p[-n:]) for p in paths]
        if len(set(names)) == len(names):
            return names
    return [str(Path(os.path.abspath(d))) for d in run_dirs]


def runs_figure(run_dirs) -> Figure:
    """One line per run for the train loss, markers of the same colour for its eval loss.  Every run has its own
    colour and line style (10 colours, then the next line style: at most :data:`MAX_RUNS` runs) and a legend entry
    that reads as its folder's name -- handed to the legend explicitly, since matplotlib leaves out a label that
    starts with ``_`` (a folder ``_base``), with ``$`` escaped (campaign 25 N1)."""
    if isinstance(run_dirs, (str, bytes, os.PathLike)):  # iterated, "run00" would be the runs r, u, n, 0, 0
        raise TypeError(f"runs_figure takes a list of run folders, got the single path {run_dirs!r}: pass "
                        f"[{run_dirs!r}]")
    run_dirs = list(run_dirs)
    if not run_dirs:
        raise ValueError("runs_figure: no run folder given; name at least one RUN_DIR")
    check_run_dirs(run_dirs)  # a missing folder is named as such, not as a run without metrics
    if len(run_dirs) > MAX_RUNS:
        raise ValueError(f"{len(run_dirs)} runs in one figure: at most {MAX_RUNS} can be told apart (10 colours x "
                         f"{len(_LINE_STYLES)} line styles); plot them in groups of at most {MAX_RUNS}")
    many = len(run_dirs) > 10  # the legend beside the axes, not over the curves
    fig = Figure(figsize=(13 if many else 8, max(4.8, 1.5 + 0.14 * len(run_dirs))), layout="constrained")
    ax = fig.add_subplot()
    names = distinct_names(run_dirs)
    handles, labels = [], []
    for i, d in enumerate(run_dirs):
        rows, color, style = plotted_metrics(d), f"C{i % 10}", _LINE_STYLES[i // 10]
        (line,) = ax.plot(*_series(rows, "loss"), lw=1, color=color, linestyle=style)
        handles.append(line)
        labels.append(literal(f"{names[i]}: {run_label(d)}"))
        if any("eval_loss" in r for r in rows):
            ax.plot(*_series(rows, "eval_loss"), _EVAL_MARKERS[i // 10], ms=3, color=color)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (line) / eval loss (dots), nats / token")
    ax.legend(handles, labels, fontsize=7, **({"loc": "upper left", "bbox_to_anchor": (1.01, 1)} if many else {}))
    return fig


def plot_runs(run_dirs, out) -> Path:
    out = Path(out)
    check_image_target(out)
    save_figure(runs_figure(run_dirs), out)  # a metrics.jsonl that is a FIFO, a device or a folder: plotted_metrics
    return Path(out)
