"""Campaign 10 (docs/hostile_campaign_10.md): K1-K3, K5-K8 (K4, distributed evaluation: its own file).
Each test fails on 8b485ad, the commit the campaign probed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _tables(out):
    return {p.name: p.read_bytes() for p in out.glob("*.csv")}


@pytest.mark.parametrize("summary", [None, "[]", '{"units_done": []}'])
def test_k1_a_units_rows_are_never_dropped_unasked_whatever_audit_json_says(summary, audit_copy, capsys):
    """K1: with audit.json deleted, holding [] or an edited units_done, `audit --tables-only` rebuilt the tables
    without a removed unit's rows (bias.csv lost its 357 s01 rows), exit 0.  The rebuilt tables must keep the rows
    of every unit the stored ones hold, unless --drop-missing-units asks."""
    if summary is None:
        (audit_copy / "audit.json").unlink()
    else:
        (audit_copy / "audit.json").write_text(summary)
    (audit_copy / "units/strata-s01.json").unlink()
    before = _tables(audit_copy)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bias.csv: s01" in err and "--drop-missing-units" in err
    assert _tables(audit_copy) == before


def test_k2_tables_only_never_writes_over_a_users_report_md(audit_copy, capsys):
    """K2: `audit --tables-only --out a` replaced a user's notes saved as a/report.md (only an explicit --report was
    checked)."""
    (audit_copy / "report.md").write_text("# my notes\n")
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "is not a report seco-lab generated" in capsys.readouterr().err
    assert (audit_copy / "report.md").read_text() == "# my notes\n"


def test_k3_dropped_units_leave_the_stored_gram_too(audit_copy):
    """K3: with three data units dropped (--drop-missing-units) data.csv still said n_sequences 8 and its numbers
    were unchanged: the stored Gram (data_gram.json, used when the flat vectors are not kept) was read whole.  It is
    restricted to the units kept: the data noise equals the one of the sub-matrix, computed here by hand."""
    from seco_lab.studies.audit.stats import data_noise

    stored = json.loads((audit_copy / "data_gram.json").read_text())
    names, gram = stored["names"], np.array(stored["gram"])
    for n in ("s03", "s04", "s05"):
        (audit_copy / f"units/data-{n}.json").unlink()
    keep = [i for i, n in enumerate(names) if n not in ("s03", "s04", "s05")]
    expected = data_noise(gram[np.ix_(keep, keep)])
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(audit_copy), "--no-progress"]) == 0
    rows = dict(line.split(",") for line in (audit_copy / "data.csv").read_text().splitlines()[1:])
    assert float(rows["n_sequences"]) == 5
    assert float(rows["tr_sigma_data"]) == pytest.approx(expected["tr_sigma_data"], rel=1e-12)
    assert float(rows["tr_sigma_data"]) != pytest.approx(data_noise(gram)["tr_sigma_data"], rel=1e-3)


def test_k3_a_unit_missing_from_the_stored_gram_is_named(audit_copy, capsys):
    stored = json.loads((audit_copy / "data_gram.json").read_text())
    stored["names"][0] = "zz"
    (audit_copy / "data_gram.json").write_text(json.dumps(stored))
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "data_gram.json holds no Gram row for s00" in capsys.readouterr().err


def test_k5_negative_times_and_squared_norms_are_damage(audit_copy, capsys):
    """K5: a cost unit's cpu_s = -5 was reported ("x forward -60.2"), a Gram diagonal of -1e9 gave a negative data
    variance, exit 0."""
    unit = json.loads((audit_copy / "units/cost-s00.json").read_text())
    unit["rows"][0]["cpu_s"] = -5.0
    (audit_copy / "units/cost-s00.json").write_text(json.dumps(unit))
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cost-s00" in err and "rows[0].cpu_s is -5.0" in err
    shutil.copy(ROOT / "reports/audit/k128/units/cost-s00.json", audit_copy / "units/cost-s00.json")
    stored = json.loads((audit_copy / "data_gram.json").read_text())
    stored["gram"][0][0] = -1e9
    (audit_copy / "data_gram.json").write_text(json.dumps(stored))
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "data_gram.json is damaged: its diagonal" in capsys.readouterr().err


def test_k6_bench_hf_refuses_a_file_as_its_out_folder(tmp_path, capsys):
    from experiments import bench_hf

    mine = tmp_path / "mine.txt"
    mine.write_text("mine\n")
    with pytest.raises(SystemExit) as e:
        bench_hf.main(["--out", str(mine)])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert mine.read_text() == "mine\n"


def test_k7_k8_a_dangling_link_and_a_negative_exponent_are_named(tmp_path, capsys):
    """K7: a run folder that is a link to nowhere answered "File exists" after 4 s.  K8: `--lr -1e-3` was "expected
    one argument" (argparse took it for a flag); `--lr=-1e-3` was already "lr must be > 0"."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "dangling")]) == 2
    assert "is a symbolic link to" in capsys.readouterr().err and not (tmp_path / "nowhere").exists()
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "r"), "--lr", "-1e-3"]) == 2
    assert "lr must be > 0, got -0.001" in capsys.readouterr().err
