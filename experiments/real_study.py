"""The real-LM cells: SmolLM2-135M on stdlib text, hop strata and each scheme's exact bias.

    python -m experiments.real_study [--out reports/real_study/k16x128] [--cells exact-lora exact-full lora full]
                                     [--num-chunks 16] [--chunk-size 128] [--strata-dtype float32]

Resumable: each cell is one JSON file under OUT/cells, skipped when present.  Then
OUT/results.csv, OUT/strata.csv and OUT/study.json are written, and the Markdown
section is printed (``python -m seco_lab.real_report OUT`` prints it again).
"""

from __future__ import annotations

import argparse

from seco_lab.real_report import render
from seco_lab.real_study import RealStudyConfig, run_study


def main(argv=None) -> None:
    d = RealStudyConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="reports/real_study/k16x128")
    ap.add_argument("--cells", nargs="+", default=list(d.cells), help="exact-lora exact-full lora full")
    ap.add_argument("--text-file", default=d.text_file)
    ap.add_argument("--num-chunks", type=int, default=d.num_chunks)
    ap.add_argument("--chunk-size", type=int, default=d.chunk_size)
    ap.add_argument("--strata-dtype", choices=["float32", "float64"], default=d.strata_dtype)
    ap.add_argument("--layers-per-group", type=int, default=d.layers_per_group)
    ap.add_argument("--threads", type=int, default=d.threads)
    a = ap.parse_args(argv)
    cfg = RealStudyConfig(text_file=a.text_file, num_chunks=a.num_chunks, chunk_size=a.chunk_size,
                          strata_dtype=a.strata_dtype, layers_per_group=a.layers_per_group, threads=a.threads,
                          cells=tuple(a.cells))
    out = run_study(cfg, a.out)
    print(render(out))


if __name__ == "__main__":
    main()
