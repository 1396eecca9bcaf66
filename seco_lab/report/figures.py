"""Shared figure helpers: object-oriented matplotlib (``matplotlib.figure.Figure``, no pyplot
state, no global backend switch) and one style per scheme variant of the study."""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path

from matplotlib.figure import Figure

from ..store import FIGURE_MARK_KEY, FIGURE_MARK_VALUE, atomic_write, check_image_target
from ..studies.bias.definition import (
    BERNOULLI,
    FALLING_FACTORIAL,
    PAPER,
    PAPER_CAPPED_2,
    PAPER_CHAIN_CAPPED_2,
    RELEASED,
    RELEASED_UNBIASED,
    SCHEMES,
)

__all__ = ["SCHEME_COLOURS", "FigureTargetError", "figure_folder", "new_figure", "save_figure", "scheme_marker",
           "scheme_offset", "scheme_order", "scheme_style", "staged_figures", "write_png"]

# colour per scheme family; within a family the first variant is solid, the others dashed
SCHEME_COLOURS = {PAPER.name: "tab:red", PAPER_CAPPED_2.name: "tab:orange", PAPER_CHAIN_CAPPED_2.name: "tab:brown",
                  RELEASED.name: "tab:purple", RELEASED_UNBIASED.name: "tab:pink",
                  FALLING_FACTORIAL.name: "tab:blue", BERNOULLI.name: "tab:green"}
FIGURE_DPI = 110


def scheme_style(label: str) -> tuple[str, str]:
    """(colour, line style) of a scheme variant by its label; grey dotted for a label the study does not know."""
    variant = next((v for v in SCHEMES if v.label == label), None)
    if variant is None:
        return "gray", ":"
    first = next(v for v in SCHEMES if v.name == variant.name)
    return SCHEME_COLOURS.get(variant.name, "gray"), "-" if variant == first else "--"


# one marker per variant, so curves that coincide (the paper family where no cap binds) stay distinguishable
SCHEME_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h")


def scheme_marker(label: str) -> str:
    """The variant's marker (by its position in the study's scheme list); '.' for an unknown label."""
    labels = [v.label for v in SCHEMES]
    return SCHEME_MARKERS[labels.index(label) % len(SCHEME_MARKERS)] if label in labels else "."


def scheme_offset(label: str, spread: float = 0.06) -> float:
    """A small multiplicative x offset per variant (for log-x axes): coinciding points sit side by side."""
    labels = [v.label for v in SCHEMES]
    i = labels.index(label) if label in labels else len(labels) // 2
    return 2.0 ** (spread * (i - (len(labels) - 1) / 2))


def scheme_order(labels) -> list[str]:
    """The labels present, in the study's scheme order (unknown labels last, as found)."""
    present = list(dict.fromkeys(labels))
    known = [v.label for v in SCHEMES if v.label in present]
    return known + [s for s in present if s not in known]


def new_figure(nrows: int = 1, ncols: int = 1, figsize=(7, 4.8), **subplot_kw) -> tuple[Figure, list]:
    """A figure and its axes as a 2-D list, laid out by constrained layout."""
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **subplot_kw)
    return fig, [list(row) for row in axes]


class FigureTargetError(ValueError):
    """A figure's path holds something seco-lab did not write (a user's file, a folder): nothing is written over it."""


#: the figures a :func:`staged_figures` block has drawn, written when it ends (None outside one)
_STAGED: list[tuple[Path, bytes]] | None = None


@contextmanager
def staged_figures():
    """Within the block, :func:`write_png` checks each figure's path and draws it in memory; the files are written
    when the block ends without an error.  A report refused at its third figure (a user's file there) has then
    written nothing: no figure, and no report (it is written after its figures are drawn)."""
    global _STAGED
    outer, _STAGED = _STAGED, []
    try:
        yield
        staged = _STAGED
    finally:
        _STAGED = outer
    for path, _ in staged:
        _check_target(path)  # again: a file put there while the report was drawn is not written over either
    for path, data in staged:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data)


def _check_target(path: Path) -> None:
    try:
        check_image_target(path, None)
    except ValueError as e:
        raise FigureTargetError(str(e)) from None


def write_png(fig: Figure, path: Path, **savefig_kw) -> Path:
    """``fig.savefig(path, format="png", **savefig_kw)``, atomically, creating the folder.  Every figure this tool
    writes goes through here: it carries the ``seco-lab: generated`` mark in its PNG metadata, and an existing file
    is written over only when it carries the mark (:class:`FigureTargetError` naming it otherwise; a user's image
    is never replaced)."""
    path = Path(path)
    _check_target(path)
    savefig_kw["metadata"] = {**savefig_kw.get("metadata", {}), FIGURE_MARK_KEY: FIGURE_MARK_VALUE}
    if _STAGED is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", **savefig_kw)
        _STAGED.append((path, buf.getvalue()))
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", **savefig_kw))


def figure_folder(out_md: Path, default_stem: str | tuple[str, ...], default_folder: str) -> Path:
    """Where the figures of the report ``out_md`` go: ``figures/<default_folder>`` beside it for the report's own
    name (``default_stem``: the committed ``bias_study.md`` keeps ``figures/bias_study``), ``figures/<stem>`` for any
    other name, so that a report of other results written beside a committed one never replaces the committed
    one's figures (campaign 24 F2: ``--out reports/quick_bias.md`` redrew ``bias_study.md``'s figures)."""
    out_md = Path(out_md)
    stems = (default_stem,) if isinstance(default_stem, str) else default_stem
    return out_md.parent / "figures" / (default_folder if out_md.stem in stems else out_md.stem)


def save_figure(fig: Figure, path: Path, marks: dict[str, str] | None = None) -> str:
    """Save atomically as PNG (the reports' resolution, tight, no software stamp, ``marks`` as more PNG text) and
    return the file name."""
    return write_png(fig, path, dpi=FIGURE_DPI, bbox_inches="tight", metadata={"Software": None, **(marks or {})}).name
