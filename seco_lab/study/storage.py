"""Atomic result files and the software record every stored result carries."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pandas as pd


def atomic_write_text(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def atomic_write_csv(df: pd.DataFrame, path: Path) -> None:
    """``df.to_csv(path, index=False)``, atomically."""
    atomic_write_text(df.to_csv(index=False), path)


def atomic_write_json(obj, path: Path) -> None:
    atomic_write_text(json.dumps(obj, indent=2) + "\n", path)


def software_versions() -> dict:
    """Versions of Python and the numerical stack, platform and CPU count."""
    import matplotlib
    import numpy as np
    import scipy
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__,
            "scipy": scipy.__version__, "pandas": pd.__version__, "matplotlib": matplotlib.__version__,
            "platform": platform.platform(), "cpus": os.cpu_count()}
