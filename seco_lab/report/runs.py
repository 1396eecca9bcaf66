"""Loss curves of training runs, drawn from their ``metrics.jsonl`` (no global matplotlib state).

* :func:`plot_run` -- one run: train, far-token and eval losses -> ``RUN_DIR/loss.png``.
* :func:`plot_runs` -- several runs' train and eval losses on one figure (``seco-lab plot``).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ..run_dir import read_config, read_metrics
from .figures import save_figure

__all__ = ["plot_run", "plot_runs", "runs_figure"]


def run_label(run_dir) -> str:
    cfg = read_config(run_dir)
    mode = cfg["mode"] + (f" / {cfg['scheme']} t={cfg['budget']}" if cfg["mode"] == "spaco" else "")
    return f"{mode}, {cfg['data']} data, seq {cfg['seq_len']}, chunk {cfg['chunk_size']}"


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    sel = [r for r in rows if key in r]
    return [r["step"] for r in sel], [r[key] for r in sel]


def run_figure(run_dir) -> Figure:
    rows = read_metrics(run_dir)
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(*_series(rows, "loss"), lw=1, label="train loss")
    if any("far_loss" in r for r in rows):
        ax.plot(*_series(rows, "far_loss"), lw=1, label="train far-token loss")
    ax.plot(*_series(rows, "eval_loss"), "o-", ms=3, label="eval loss")
    if any("eval_far_loss" in r for r in rows):
        ax.plot(*_series(rows, "eval_far_loss"), "s-", ms=3, label="eval far-token loss")
    ax.set_title(run_label(run_dir), fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend(fontsize=8)
    return fig


def plot_run(run_dir) -> Path:
    out = Path(run_dir) / "loss.png"
    save_figure(run_figure(run_dir), out)
    return out


def runs_figure(run_dirs) -> Figure:
    """One line per run for the train loss, markers of the same colour for its eval loss."""
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, d in enumerate(run_dirs):
        rows, color = read_metrics(d), f"C{i % 10}"
        label = f"{Path(d).name}: {run_label(d)}"
        ax.plot(*_series(rows, "loss"), lw=1, color=color, label=label)
        if any("eval_loss" in r for r in rows):
            ax.plot(*_series(rows, "eval_loss"), "o", ms=3, color=color)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (line) / eval loss (dots), nats / token")
    ax.legend(fontsize=7)
    return fig


def plot_runs(run_dirs, out) -> Path:
    missing = [str(d) for d in run_dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        raise ValueError(f"not a run directory (no metrics.jsonl): {', '.join(missing)}")
    save_figure(runs_figure(run_dirs), out)
    return Path(out)
