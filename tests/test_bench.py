"""The benchmark driver's smoke run: it must really measure time and memory (not their values)."""

import numpy as np
import pandas as pd

from experiments.bench import QUICK, methods, run
from seco_lab.report import bench_report


def test_quick_benchmark_measures_every_configuration(tmp_path):
    df = run(QUICK, tmp_path / "bench", device="cpu")
    expected = {(n, m["method"]) for n in QUICK.lengths for m in methods(QUICK, n)}
    assert {(n, m) for n, m in zip(df.length, df.method)} == expected
    assert not (df.metric == "error").any(), df[df.metric == "error"]
    t = df[df.metric == "time_s"]
    m = df[df.metric == "peak_mib"]
    assert len(t) == len(m) == sum(len(methods(QUICK, n)) for n in QUICK.lengths)
    assert np.all(np.isfinite(t.value)) and (t.value > 0).all()
    assert np.all(np.isfinite(m.value)) and (m.value >= 0).all()
    # dense backprop keeps activations that a no-grad forward does not: memory was really measured
    piv = m.pivot_table(index="length", columns="label", values="value")
    assert (piv["dense"] > piv["forward"]).all()
    md = bench_report(tmp_path / "bench", tmp_path / "benchmarks.md")
    text = md.read_text()
    assert "SeCO/dense time" in text and pd.read_csv(tmp_path / "bench" / "results.csv").shape[0] == len(df)
