"""Campaign 12 (/work/c12/report.md) G6 and G8.  Each test fails on 336b4dc, the commit the campaign probed.

G6: the bias report printed a failed exactness check (checks.csv) as a result, and claimed "exactly unbiased"
over a stored relative bias above its own 1e-10 rule.  G8: ``examples/lora_trainer.py --report`` checked
nothing in memory.json (two stock runs, negative peaks, different setups, a missing or truncated file)."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _set(path: Path, prefix: str, value: str) -> None:
    """The value of the one CSV row starting with ``prefix`` (its last field) set to ``value``."""
    lines = path.read_text().splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert len(hits) == 1, prefix
    lines[hits[0]] = prefix + value
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def damaged_bias(tmp_path_factory):
    """The committed bias study with a failed exactness check (S08), falling-factorial's paper-settings relative
    bias at a t ≥ L+1 cell set 0 -> 0.5 (S03), and the same in the small grid plus one Bernoulli cell; the report's
    Markdown from it through the CLI (exit status 0: the flags are shown, as in the audit report)."""
    base = tmp_path_factory.mktemp("g6")
    folder = base / "bias_study"
    shutil.copytree(ROOT / "reports/bias_study", folder)
    _set(folder / "checks.csv", "1,4,0,0,chain_sum_vs_dense,", "0.3")
    _set(folder / "paper.csv", "2,128,0,8,falling-factorial,rel_bias,", "0.5")
    _set(folder / "results.csv", "2,16,0,4,falling-factorial,rel_bias,", "0.5")
    _set(folder / "results.csv", "1,4,0,2,bernoulli,rel_bias,", "0.25")
    assert main(["report", "bias", "--results", str(folder), "--out", str(base / "r.md")]) == 0
    return folder, (base / "r.md").read_text()


def test_g6_a_failed_exactness_check_is_flagged_as_in_the_audit_report(damaged_bias):
    _, md = damaged_bias
    section = md[md.index("## Exactness checks run inside the study"):md.index("## Settings")]
    assert "| 0.300 |" in section  # the stored value is shown ...
    assert "**Not exact: chain_sum_vs_dense above 1e-10.**" in section  # ... with the audit report's verdict
    # and said before anything else, since every exact number of the report rests on the checks
    assert md.index("**Not exact: chain_sum_vs_dense above 1e-10.**") < md.index("## The question")


def test_g6_the_exactness_rule_is_one_shared_piece():
    from seco_lab.report import audit, bias_paper, bias_summary
    from seco_lab.report.exactness import EXACT_TOL, above_tol, not_exact

    assert audit.EXACT_TOL is EXACT_TOL and bias_summary.UNBIASED_TOL is EXACT_TOL is bias_paper.UNBIASED_TOL
    assert above_tol({"a": 1e-16, "b": 0.3, "c": float("nan")}, ("a", "b", "c")) == ["b", "c"]
    assert above_tol({"a": 1e-16}, ("a", "paper"), skip_missing=True) == []
    assert not_exact(["b"]) == "**Not exact: b above 1e-10.**"


def test_g6_no_exactly_unbiased_claim_over_a_bias_above_the_threshold(damaged_bias):
    _, md = damaged_bias
    bullet = re.search(r"- \*\*When each scheme is unbiased\.\*\*.*", md).group(0)
    assert "exactly when t ≥ L+1" not in bullet
    assert "**not exactly unbiased where t ≥ L+1**" in bullet and "largest relative bias there 0.500, above 1e-10" \
        in bullet
    assert "the stored cells above break it" in re.search(r"- \*\*In short\.\*\*.*", md).group(0)
    headline = re.search(r"- \*\*Unbiased schemes\.\*\*.*", md).group(0)  # the small grid (results.csv)
    assert "is exactly unbiased when t ≥ L+1" not in headline
    assert "**not exactly unbiased in every cell with t ≥ L+1**" in headline and "unbiased in 53/54" in headline
    assert "107/108 cells with t < k (**not every one**" in headline


def test_g6_a_negative_check_value_is_refused(tmp_path, capsys):
    folder = tmp_path / "bias_study"
    shutil.copytree(ROOT / "reports/bias_study", folder)
    _set(folder / "checks.csv", "1,4,0,0,chain_sum_vs_dense,", "-0.3")
    capsys.readouterr()
    assert main(["report", "bias", "--results", str(folder), "--out", str(tmp_path / "r.md")]) == 2
    assert "checks.csv holds 1 impossible value(s) (e.g. chain_sum_vs_dense = -0.3" in capsys.readouterr().err


# --- G8: examples/lora_trainer.py --report -------------------------------------------------------------------

EXAMPLE = ROOT / "examples" / "lora_trainer.py"


@pytest.fixture(scope="module")
def lora_example():
    spec = importlib.util.spec_from_file_location("lora_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib imports only at the top: cheap
    return module


def _run(field, value):
    def edit(d):
        d["runs"][1][field] = value
    return edit


@pytest.mark.parametrize("edit, words", [
    (_run("trainer", "stock"), "holds the runs ['stock', 'stock'], not one 'stock' and one 'seco'"),  # M04
    (_run("peak_rss_mib", -5), "peak_rss_mib = -5 is impossible"),  # M02
    (_run("seq_len", 512), "the runs differ in seq_len (stock: 4096, seco: 512)"),  # M05
    (_run("model", "other"), "the runs differ in model"),
    (_run("peak_rss_mib", 490.0), "peak RSS 490 MiB is below the RSS before training"),  # M07
    (_run("rss_before_train_mib", 0), "rss_before_train_mib = 0 is impossible"),
    (_run("steps", True), "'steps' is True, not an integer"),
    (_run("cpu_seconds", float("nan")), "cpu_seconds = nan is impossible"),
    (lambda d: d["runs"].pop(1), "holds the runs ['stock'], not one 'stock' and one 'seco'"),  # M06
    (lambda d: d["runs"][1].pop("peak_rss_mib"), "run 1 has no 'peak_rss_mib'"),
    (lambda d: d.pop("runs"), '"runs" is not a list of objects'),
])
def test_g8_memory_json_is_checked_before_the_table(edit, words, lora_example, tmp_path, capsys):
    d = json.loads((ROOT / "reports/trainer_memory/memory.json").read_text())
    edit(d)
    (tmp_path / "memory.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit) as exit_:
        lora_example.main(["--report", "--output-dir", str(tmp_path)])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("content, words", [
    (None, "memory.json is missing: run `python examples/lora_trainer.py --compare-memory"),  # M09
    ('{"command": "x", "runs": [{"tra', "cannot be read as JSON"),  # M08: truncated
    ("[]", "holds a list where an object is expected"),
])
def test_g8_a_missing_or_damaged_memory_json_is_one_line_not_a_traceback(content, words, tmp_path):
    if content is not None:
        (tmp_path / "memory.json").write_text(content)
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--report", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and words in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
