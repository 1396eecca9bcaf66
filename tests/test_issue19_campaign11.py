"""Campaign 11 (docs/hostile_campaign_11.md): F1-F8.  Each test fails on 33ee24b, the commit the campaign probed."""

import shutil
from pathlib import Path

import pytest
from helpers import FAST, csv_tables, edit_json

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]



@pytest.mark.parametrize("name, update, words", [
    ("data-s02.json", {"sequence": "s05"}, "named 'data-s02' that holds sequence 's05'"),
    ("strata-s01.json", {"sequence": "s02"}, "named 'strata-s01' that holds sequence 's02'"),
    ("cost-s00.json", {"unit": "cost-s01", "sequence": "s01"}, "in the file of 'cost-s00'"),
])
def test_f1_a_unit_whose_name_is_not_its_sequences_is_damaged(name, update, words, audit_copy, capsys):
    """F1: a unit's `sequence` was never compared with its name: data-s02 holding s05 counted s05 twice (exit 0,
    tr_sigma_data changed); two strata units with their sequences swapped put s02's profile under s01's name."""
    edit_json(audit_copy / "units" / name, lambda u: u.update(update))
    before = csv_tables(audit_copy)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert words in err and "--drop-missing-units" in err
    assert csv_tables(audit_copy) == before


@pytest.mark.parametrize("gram_file, where", [("data_gram.json", (0, 1)), ("cross_gram.json", (0, 1))])
def test_f2_a_stored_gram_no_vectors_have_is_refused(gram_file, where, audit_copy, capsys):
    """F2: an off-diagonal entry of 1e6 in data_gram.json gave tr_sigma_data -35711.9, exit 0 (Cauchy-Schwarz)."""
    def change(d):
        i, j = where
        d["gram"][i][j] = d["gram"][j][i] = 1e6
    edit_json(audit_copy / gram_file, change)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert f"{gram_file} is damaged: it is no Gram matrix" in capsys.readouterr().err


def test_f2_a_units_gram_matrix_is_checked_too(audit_copy, capsys):
    def change(u):
        u["per_tensor_gram"][0][0][1] *= 1e6
    edit_json(audit_copy / "units/strata-s00.json", change)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "per_tensor_gram[0] is not a Gram matrix" in capsys.readouterr().err


def test_f3_the_kind_column_is_never_written_blank(audit_copy, capsys):
    """F3: without sequences.json every row's kind (prose, code) became blank, exit 0."""
    (audit_copy / "sequences.json").unlink()
    before = csv_tables(audit_copy)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "sequences.json is missing or holds no record of s00" in capsys.readouterr().err
    assert csv_tables(audit_copy) == before


def test_f4_a_failed_exactness_check_is_said_and_losses_are_checked(audit_copy, tmp_path, capsys):
    """F4: seco_vs_dense 0.5 in the exact unit was printed as a result; a loss of -3 in far_loss.csv was reported."""
    from seco_lab.report.audit import write_report

    edit_json(audit_copy / "units/exact.json", lambda u: u.update(seco_vs_dense=0.5))
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 0
    md = Path(write_report(audit_copy, tmp_path / "r.md")).read_text()
    assert "**Not exact: seco_vs_dense above 1e-10.**" in md
    assert "exact to float64 rounding" in (ROOT / "reports/audit.md").read_text()
    folder = tmp_path / "t"
    shutil.copytree(ROOT / "reports/training", folder)
    lines = (folder / "far_loss.csv").read_text().splitlines()
    lines[1] = ",".join(lines[1].split(",")[:-1] + ["-3"])
    (folder / "far_loss.csv").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["report", "train-compare", "--results", str(folder), "--out", str(tmp_path / "t.md")]) == 2
    assert "'eval_loss' holds -3 (row 2), but it must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("study, folder, table, prefix", [("bias", "bias_study", "results.csv", "x,y,"),
                                                          ("real", "real_study/k16x16", "results.csv", "x,"),
                                                          ("training", "training", "throughput.csv", ",,,")])
def test_f5_a_row_with_more_fields_than_the_header_is_named(study, folder, table, prefix, tmp_path, capsys):
    """F5: pandas took the extra first fields for an index, and the row number became a tuple or a text: a
    TypeError/ValueError traceback from every report."""
    results = tmp_path / "r"
    shutil.copytree(ROOT / "reports" / folder, results)
    lines = (results / table).read_text().splitlines()
    lines[1] = prefix + lines[1]
    (results / table).write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(["report", study, "--results", str(results), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "rows hold more fields than the header" in err and "Traceback" not in err


def test_f6_f7_a_dangling_out_link_is_refused_before_a_benchmark_runs(tmp_path, capsys):
    from experiments import bench, bench_hf

    (tmp_path / "d").symlink_to(tmp_path / "nowhere" / "zz")
    for module in (bench, bench_hf):
        with pytest.raises(SystemExit) as e:
            module.main(["--out", str(tmp_path / "d")])
        assert e.value.code == 2 and "is a symbolic link to" in capsys.readouterr().err


def test_f8_negative_infinity_is_a_value_not_a_flag(tmp_path, capsys):
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "r"), "--lr", "-inf"]) == 2
    assert "lr must be finite, got -inf" in capsys.readouterr().err
