"""Rebuild one group of a stored study from the definition in its ``study.json``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...core.checks import as_int, check_seed
from ...store import RECORD_MAX_BYTES, read_json
from .definition import StudyConfig, build_model, build_tokens

__all__ = ["Cell", "load_cell", "load_study_config"]


@dataclass
class Cell:
    """One group as the study built it: the float64 model, tokens, targets, and the definition."""

    model: torch.nn.Module
    tokens: torch.Tensor
    targets: torch.Tensor
    config: StudyConfig


def load_study_config(results_dir: Path) -> StudyConfig:
    """The study definition stored in ``results_dir/study.json``."""
    path = Path(results_dir) / "study.json"
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"{path} does not exist: pass the folder a bias study wrote (it holds study.json)")
    try:
        record = read_json(path, "study record", RECORD_MAX_BYTES, "the study's record is damaged; rerun the study "
                           "(seco-lab study bias)")
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): rerun the study (seco-lab study bias)") from None
    try:
        return StudyConfig.from_json(record["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path} holds no readable study definition ({type(e).__name__}: {e}): pass the folder a "
                         "bias study wrote, or rerun the study") from None


def load_cell(results_dir: Path, n_layers: int, num_chunks: int, seed: int) -> Cell:
    """The model, tokens and targets of group (L = n_layers, k = num_chunks, seed) of a stored study
    (a chain-basis or a paper-settings group), exactly as the study built them, so any stored number
    can be recomputed from them."""
    n_layers, num_chunks = as_int(n_layers, "n_layers L", 1), as_int(num_chunks, "num_chunks k", 1)
    seed = check_seed(seed)
    cfg = load_study_config(results_dir)
    if (n_layers, num_chunks, seed) not in cfg.groups() + cfg.paper_groups():
        raise ValueError(f"(L={n_layers}, k={num_chunks}, seed={seed}) is not a group of the study in {results_dir}: "
                         f"depths {cfg.depths}, chunk counts {cfg.chunk_counts}, seeds {cfg.seeds}; paper-settings "
                         f"(L, k) {cfg.paper_cells}, seeds {cfg.paper_seeds}")
    model = build_model(cfg, n_layers, num_chunks, seed)
    tokens, targets = build_tokens(cfg, n_layers, num_chunks, seed)
    return Cell(model, tokens, targets, cfg)
