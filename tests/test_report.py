"""The report package: pure summaries against direct computations on the stored results, the
command line, and no global matplotlib state."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from seco_lab.report import build_parser, main, summarize_bench, summarize_training
from seco_lab.report.bench import load_bench
from seco_lab.report.bench_hf import clock
from seco_lab.report.markdown import table
from seco_lab.report.training import load_training

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_reports_leaves_matplotlib_alone():
    # read the raw rcParams entry: matplotlib.get_backend() would itself import pyplot to resolve it
    code = ("import matplotlib, sys; raw = lambda: dict.__getitem__(matplotlib.rcParams, 'backend'); before = raw(); "
            "import seco_lab.report; assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'; "
            "assert raw() == before, (before, raw()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


def test_training_summary_matches_the_stored_csv():
    tp, far, meta = load_training(ROOT / "reports" / "training")
    s = summarize_training(tp, far, meta)
    rate = dict(zip(tp["mode"], tp.tokens_per_s))
    for r in s["throughput"].itertuples():
        assert r._4 == pytest.approx(rate[r.mode] / rate["dense"], rel=1e-12)  # "vs dense"
    last = far.sort_values("step").groupby("mode").tail(1).set_index("mode").eval_far_loss
    got = s["final"].set_index("mode")["final far-token loss"]
    assert got.to_dict() == pytest.approx(last.to_dict(), rel=1e-12)


def test_bench_summary_matches_the_stored_csv():
    df, meta = load_bench(ROOT / "reports" / "bench")
    s = summarize_bench(df, meta)
    time_s = df[df.metric == clock(df)].set_index(["length", "label"]).value
    for r in s["core"].itertuples():
        assert r._2 == pytest.approx(time_s[(r.length, "seco")] / time_s.get((r.length, "dense"), float("nan")),
                                   rel=1e-12, nan_ok=True)
    # SpaCO rows are identified by the stored method/scheme/ratio columns, not by parsing labels
    assert set(s["spaco"].method) == set(df[df.method == "spaco"].label)


def test_table_prints_integer_columns_as_integers():
    text = table(pd.DataFrame({"length": [1024.0], "ratio": [0.5]}), integer_columns=("length",))
    assert text.splitlines()[2] == "| 1024 | 0.500 |"


def test_cli_help_lists_every_option_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith("usage: seco-lab report")
    for option in ("--results", "--out", "bias", "bench", "training", "reports/bias_study"):
        assert option in help_text
    assert build_parser().prog == "seco-lab report"


def test_cli_missing_results_is_a_clear_error(tmp_path, capsys):
    assert main(["bias", "--results", str(tmp_path / "nothing"), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "seco-lab bias-study" in err and "make bias-study" in err and "--results" in err
    with pytest.raises(SystemExit):
        main(["nonsense"])


def test_every_unmet_hf_target_says_what_stands_in_the_way():
    """The stored HF benchmark's target table, recomputed; each target that is not met is followed by its
    reason in the rendered section (a renamed target would otherwise lose its explanation silently)."""
    from seco_lab.report.bench_hf import NOT_MET_REASONS, render, summarize, targets

    df = pd.read_csv(ROOT / "reports" / "bench" / "hf_results.csv")
    tgt = targets(summarize(df), df)
    text = "".join(render(ROOT / "reports" / "bench"))
    for t in set(tgt.target[tgt.met == "not met"]):
        assert t in NOT_MET_REASONS and f"- *{t}*: {NOT_MET_REASONS[t]}" in text
    assert set(tgt.met) <= {"met", "not met"} and len(tgt) >= 10
