"""Issue 19, campaign 22 (docs/hostile_campaign_22.md) F1: `seco-lab report train` dropped whole sections without a
word when an extension tier's folder was absent, emptied, a file, a link to nothing, or lacked a table: "At equal
compute", "The prediction, tested", and the intact "A second configuration" with them (510 -> 217 lines, rc 0).
Now a tier that is not there is said ("Left out: ..."), a file or dangling link in its place is refused, and the
other tier's section stands on its own."""

import shutil
from pathlib import Path

import pytest

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def study(tmp_path):
    out = tmp_path / "training_study"
    shutil.copytree(ROOT / "reports" / "training_study", out)
    return out


def _report(study, capsys):
    capsys.readouterr()
    out = study.parent / "ts.md"
    rc = main(["report", "train", "--results", str(study), "--out", str(out)])
    return rc, capsys.readouterr().err, (out.read_text() if out.exists() else "")


@pytest.mark.parametrize("damage", ["deleted", "emptied", "runs.csv deleted"])
def test_f1_an_absent_equal_compute_tier_is_said_and_the_second_configuration_stays(study, capsys, damage):
    tier = study / "equal_compute"
    if damage == "deleted":
        shutil.rmtree(tier)
    elif damage == "emptied":
        shutil.rmtree(tier)
        tier.mkdir()
    else:
        (tier / "runs.csv").unlink()
    rc, err, text = _report(study, capsys)
    assert rc == 0, err
    assert "*Left out: the sections At equal compute and The prediction, tested -- `equal_compute`" in text
    assert "## A second configuration: L = 4 layers" in text  # its results are intact: not dropped with the other


@pytest.mark.parametrize("what", ["a regular file", "a link to nothing"])
def test_f1_a_file_or_a_link_to_nothing_in_the_tiers_place_is_refused(study, capsys, what):
    tier = study / "equal_compute"
    shutil.rmtree(tier)
    if what == "a regular file":
        tier.write_text("x\n")
    else:
        tier.symlink_to(study.parent / "no-such-folder")
    rc, err, _ = _report(study, capsys)
    assert rc == 2 and ("equal_compute is not a folder" in err or "equal_compute is a link to nothing" in err)


def test_f1_the_cost_model_table_and_the_second_tier_when_absent_are_said(study, capsys):
    (study / "equal_compute" / "costs.csv").unlink()
    shutil.rmtree(study / "second_L4")
    rc, err, text = _report(study, capsys)
    assert rc == 0, err
    assert "*Left out: the cost model against measured CPU time -- `equal_compute/costs.csv` does not exist" in text
    assert "*Left out: the section A second configuration -- `second_L4` does not exist" in text
    assert "## At equal compute" in text or "At equal compute" in text


def test_the_bench_report_says_which_benchmark_it_leaves_out(tmp_path, capsys):
    """The same class in the bench report: hf_results.csv, fsdp_results.csv and strata_cost.csv each come from
    their own benchmark; one deleted together with its checksum line dropped its whole section without a word."""
    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", bench)
    (bench / "fsdp_results.csv").unlink()
    capsys.readouterr()
    rc = main(["report", "bench", "--results", str(bench), "--out", str(tmp_path / "b.md")])
    text = (tmp_path / "b.md").read_text()
    assert rc == 0, capsys.readouterr().err
    assert "*Left out: the FSDP benchmark -- `fsdp_results.csv` does not exist" in text and "make bench-fsdp" in text
    assert "Left out: the HF model benchmarks" not in text  # present: drawn as before


def test_the_audit_report_says_when_its_bias_or_cost_table_holds_nothing(tmp_path):
    """The same class in the audit report: an exact-bias or cost table without rows dropped its section silently
    (an audit whose strata or cost units have not finished, or a table emptied)."""
    from seco_lab.report.audit import _bias, _cost

    (tmp_path / "bias.csv").write_text("sequence,t,scheme,metric,value\n")
    (tmp_path / "cost.csv").write_text("method,scheme,t,cpu_s,chunks\n")
    assert "*Left out: the exact bias per scheme -- `bias.csv` is absent or empty" in "".join(_bias(tmp_path))
    assert "*Left out: the cost of one step -- `cost.csv` is absent or has no SeCO row" in "".join(
        _cost(tmp_path, {"threads": 1}))


def test_campaign23_f2_a_sealed_cost_table_without_rows_is_said_not_a_traceback(study, capsys):
    """Campaign 23 F2: costs.csv cut to its header (or without SeCO rows) and sealed: a raw IndexError/KeyError."""
    costs = study / "equal_compute" / "costs.csv"
    costs.write_text(costs.read_text().splitlines()[0] + "\n")
    rc, err, text = _report(study, capsys)
    assert rc == 0, err
    assert "*Left out: the cost model against measured CPU time -- `equal_compute/costs.csv` has no SeCO row" in text



def test_campaign23_noted_an_arm_measured_at_other_batches_than_seco_is_compared_where_both_were(study):
    """Another arm without a B = 16 row was compared at its own middle batch, which SeCO may not have (a raw
    KeyError); a damaged cost table (a column missing, a repeated row) went unchecked into the ratios."""
    import pandas as pd

    from seco_lab.report.markdown import MissingResultsError
    from seco_lab.studies.train.equal_runs import costs_lines

    costs = study / "equal_compute" / "costs.csv"
    c = pd.read_csv(costs)
    c = c[(c.arm == "seco") | (c.batch != 16)]  # the other arms lack B = 16: compared at a batch SeCO measured
    c.loc[c.arm == "truncated", "batch"] = c.loc[c.arm == "truncated", "batch"].replace({8: 64, 32: 8})
    c.to_csv(costs, index=False)
    row = next(line for line in costs_lines(study, 16) if line.startswith("| truncated"))
    seco8, trunc8 = (c[(c.arm == a) & (c.batch == 8)].iloc[0] for a in ("seco", "truncated"))
    assert row.startswith(f"| truncated | {trunc8.passes / seco8.passes:.3f} (at B = 8) |")
    c.loc[c.arm == "truncated", "batch"] = 64  # no batch in common: said in its row
    c.drop_duplicates(["arm", "batch"]).to_csv(costs, index=False)
    assert "| truncated | no batch in common with SeCO |" in "\n".join(costs_lines(study, 16))
    c.to_csv(costs, index=False)  # truncated at B = 64 twice: a repeated result
    with pytest.raises(MissingResultsError, match="costs.csv"):
        costs_lines(study, 16)
    c.drop_duplicates(["arm", "batch"]).drop(columns="passes").to_csv(costs, index=False)
    with pytest.raises(MissingResultsError, match="passes"):
        costs_lines(study, 16)
