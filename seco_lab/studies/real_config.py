"""The real-LM study's definition (:class:`RealStudyConfig`) and command-line options, importable without
torch, numpy or pandas (``seco-lab study real --help`` answers at once); :mod:`.real` computes its cells."""

from __future__ import annotations

import json
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.checks import as_int, check_threads

__all__ = ["CELLS", "MAX_WINDOW_TOKENS", "RUN_ONLY", "RealStudyConfig", "add_arguments", "text_path"]

CELLS = ("exact-lora", "exact-full", "lora", "full")
MAX_WINDOW_TOKENS = 8192  # SmolLM2-135M's context (max_position_embeddings)
RUN_ONLY = ("cells", "threads")  # fields that choose what to run now, not what a cell holds


@dataclass
class RealStudyConfig:
    model: str = "smollm2-135m"
    text_file: str = "argparse.py"  # relative to the standard library (or an absolute path)
    offset: int = 0  # first token of the window
    num_chunks: int = 16
    chunk_size: int = 16  # the stored study (reports/real_study/k16x16); 128 is a 2K window
    strata_dtype: str = "float32"
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_seed: int = 0  # adapters: A and B random (peft's B = 0 would zero A's gradient)
    layers_per_group: int = 8  # full-parameter groups: embedding + final norm, then layers in runs of this size
    budget_fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4)
    check_tokens: int = 256  # float64 exactness window (LoRA); the full-parameter check uses a quarter
    check_chunk: int = 32
    threads: int = 2
    cells: tuple[str, ...] = field(default=("exact-lora", "exact-full", "lora"))  # "full": every parameter group

    def validate(self) -> RealStudyConfig:
        """Refuse (ValueError naming the option) what would fail only inside a cell's process, after the model
        loaded and study.json was written: counts below 1, a window beyond the model's context (the cost
        guard: memory and time grow with it), a text file that is not there."""
        for name in ("num_chunks", "chunk_size", "layers_per_group"):
            as_int(getattr(self, name), f"--{name.replace('_', '-')}", 1)
        check_threads(self.threads, "--threads")
        as_int(self.offset, "offset", 0)
        if self.num_tokens > MAX_WINDOW_TOKENS:
            raise ValueError(f"--num-chunks {self.num_chunks} x --chunk-size {self.chunk_size} = {self.num_tokens:,} "
                             f"tokens, beyond the {MAX_WINDOW_TOKENS:,}-token context of {self.model} (and memory and "
                             "time grow with the window); lower --num-chunks or --chunk-size")
        if not str(self.text_file).strip():
            raise ValueError("--text-file is empty; name a text file (relative names are read from the standard "
                             "library, e.g. argparse.py)")
        path = text_path(self)
        if not path.exists():
            raise ValueError(f"--text-file {self.text_file}: {path} does not exist (relative names are read from the "
                             "standard library); name an existing text file")
        if not path.is_file():
            raise ValueError(f"--text-file {self.text_file}: {path} is not a regular file; name a text file")
        return self

    def definition(self) -> dict:
        """What the stored cells depend on: every field but the cells chosen and the thread count."""
        return {k: v for k, v in json.loads(json.dumps(asdict(self))).items() if k not in RUN_ONLY}

    @property
    def num_tokens(self) -> int:
        return self.num_chunks * self.chunk_size


def text_path(cfg: RealStudyConfig) -> Path:
    p = Path(cfg.text_file)
    return p if p.is_absolute() else Path(sysconfig.get_paths()["stdlib"]) / p


def add_arguments(ap) -> None:
    """The real study's own options of ``seco-lab study real``."""
    d = RealStudyConfig()
    ap.add_argument("--cells", nargs="+", choices=CELLS, default=list(d.cells),
                    help="cells to compute ('full': every parameter group of the full model)")
    ap.add_argument("--text-file", default=d.text_file, help="text, relative to the standard library")
    ap.add_argument("--num-chunks", type=int, default=d.num_chunks, help="chunks k of the window")
    ap.add_argument("--chunk-size", type=int, default=d.chunk_size, help="tokens per chunk")
    ap.add_argument("--strata-dtype", choices=["float32", "float64"], default=d.strata_dtype, help="strata dtype")
    ap.add_argument("--layers-per-group", type=int, default=d.layers_per_group,
                    help="layers per full-parameter group")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads of each cell's process")
