"""Campaign 12 (/work/c12/report.md), G4 and G5: hand-edited audit units.  Each test fails on 336b4dc.

G4: a unit's values derived from its Gram matrices were never compared with them (strata.csv, bias.csv, mc.csv and
equal_compute.csv rewritten, exit 0).  G5: a cost row relabelled to another budget emptied equal_compute.csv of
that budget's scheme, exit 0 and no message."""

import json

import pytest
from helpers import csv_tables, edit_json

from seco_lab.cli import main
from seco_lab.studies.audit.stored import unit_problem


def _refused(out, capsys) -> str:
    before = csv_tables(out)
    capsys.readouterr()
    assert main(["audit", "--tables-only", "--out", str(out), "--no-progress"]) == 2
    assert csv_tables(out) == before
    return capsys.readouterr().err


@pytest.mark.parametrize("change, words", [
    (lambda u: u["norm_ratio"].__setitem__(1, u["norm_ratio"][1] * 3), "norm_ratio[1] 1.619"),
    (lambda u: u.update(remainder_ratio=0.3), "remainder_ratio 0.3 disagrees with its per_tensor_gram"),
    (lambda u: u["norm_ratio"].__setitem__(-1, u["norm_ratio"][-1] * (1 + 1e-5)), "norm_ratio[9]"),
    (lambda u: u["norm_ratio"].pop(), "per_tensor_gram has shape (120, 10, 10), not one 9 x 9 Gram"),
])
def test_g4_strata_values_are_checked_against_the_units_gram(change, words, audit_copy, capsys):
    """G4 (U01, U02): norm_ratio[1] x 3 rewrote strata.csv (0.5397 -> 1.6191), remainder_ratio 0.3 rewrote bias.csv's
    bounds, exit 0; both are sqrt(diag of the summed per_tensor_gram) / g_norm, to the last bit."""
    edit_json(audit_copy / "units/strata-s00.json", change)
    err = _refused(audit_copy, capsys)
    assert "strata-s00.json is damaged (a strata unit whose" in err and words in err
    assert "strata.csv: s00" in err


@pytest.mark.parametrize("i, j, by", [(0, 0, 4.0), (0, 0, 1.001), (3, 5, 1.01), (9, 9, 3.0), (1, 9, 1.1)])
def test_g4_mc_exact_gram_is_checked_against_the_strata_unit(i, j, by, audit_copy, capsys):
    """G4 (U10): mc-s00-t8-uniform's exact_gram[0][0] x 4 rewrote mc.csv and equal_compute.csv, exit 0; strata-s00
    holds the same strata's Gram (they agree to 2e-6 of the Cauchy-Schwarz bound)."""
    def change(u):
        u["exact_gram"][i][j] *= by
        if i != j:
            u["exact_gram"][j][i] *= by
    edit_json(audit_copy / "units/mc-s00-t8-uniform.json", change)
    err = _refused(audit_copy, capsys)
    assert "mc-s00-t8-uniform.json is damaged (a mc unit whose exact_gram differs from the Gram of the same strata " \
           "in strata-s00.json" in err
    assert "mc.csv: s00/8/uniform" in err


def test_g4_mc_units_matrices_must_have_the_draws_shapes(audit_copy, capsys):
    edit_json(audit_copy / "units/mc-s00-t16-bernoulli.json", lambda u: u["draw_exact"].pop())
    err = _refused(audit_copy, capsys)
    assert "mc-s00-t16-bernoulli.json is damaged" in err and "are not the matrices of" in err


def test_g4_a_uniform_mc_draw_of_the_wrong_size_is_damaged(audit_copy, capsys):
    edit_json(audit_copy / "units/mc-s00-t8-uniform.json", lambda u: u["subsets"][0].pop())
    assert "not 8 distinct chunks" in _refused(audit_copy, capsys)


def test_g5_a_cost_row_relabelled_to_another_budget_is_damaged(audit_copy, capsys):
    """G5 (U08): rows[2] (spaco paper, t 8, 8 chunks) relabelled t 16: cost.csv held two paper/16/0 rows, and
    equal_compute.csv lost every paper t = 8 row, exit 0 and no message."""
    edit_json(audit_copy / "units/cost-s00.json", lambda u: u["rows"][2].update(t=16))
    err = _refused(audit_copy, capsys)
    assert "cost-s00.json is damaged (a cost unit whose rows[2] (spaco paper, t 16, draw 0) backpropagated 8 " \
           "chunks, not its t = 16" in err


@pytest.mark.parametrize("change, words", [
    (lambda u: u["rows"][2].update(t=16, chunks=16), "rows[9] and rows[2] are both the step spaco/paper/16/0"),
    (lambda u: u["rows"][1].update(method="forward"), "rows[1] and rows[0] are both the step forward"),
    (lambda u: u["rows"][1].update(chunks=8), "rows[1] (seco) carries a scheme, t, draw or chunks"),
    (lambda u: u["rows"][2].update(scheme="nonesuch"), "names no known scheme ('nonesuch')"),
    (lambda u: u["rows"][2].update(method="dense"), "rows[2] is not a timed step of one of forward, seco, spaco"),
])
def test_g5_cost_rows_are_one_step_each(change, words, audit_copy, capsys):
    edit_json(audit_copy / "units/cost-s00.json", change)
    err = _refused(audit_copy, capsys)
    assert "cost-s00.json is damaged (a cost unit whose " in err and words in err


@pytest.mark.parametrize("change, words", [
    # a Bernoulli draw has no fixed size: its relabel is caught by the grid of rows
    (lambda u: u["rows"][8].update(chunks=129), "its row spaco/bernoulli/8/0 records 129 chunks, above k = 128"),
    (lambda u: u["rows"][8].update(t=16, draw=1), "lacking bernoulli/8/0; extra bernoulli/16/1"),
    (lambda u: u["rows"].pop(3), "lacking paper-capped/8/0"),
])
def test_g5_cost_rows_are_this_audits_draws(change, words, audit_copy, capsys):
    edit_json(audit_copy / "units/cost-s00.json", change)
    err = _refused(audit_copy, capsys)
    assert "cost-s00.json is damaged: its" in err and words in err


def test_g5_a_rebuild_losing_equal_compute_rows_is_refused(audit_copy, capsys):
    """K1's rule for a loss reached through a field edit: a stored equal_compute.csv row (t, scheme, B) the rebuilt
    tables would lack is refused, whatever caused it (here a stored row no unit gives, as a unit edit would)."""
    path = audit_copy / "equal_compute.csv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines, lines[1].replace("8,bernoulli,1,", "4,bernoulli,1,", 1)]) + "\n")
    err = _refused(audit_copy, capsys)
    assert "equal_compute.csv: 4/bernoulli/1" in err


def test_g4_g5_the_committed_units_pass_and_rebuild_byte_identical(audit_copy, capsys):
    from pathlib import Path

    units = {p.stem: json.loads(p.read_text()) for p in (audit_copy / "units").glob("*.json")}
    for stem, unit in units.items():
        assert unit_problem(unit, stem, units.get(f"strata-{unit.get('sequence')}")) is None, stem
    # audit.json records the command (and checksums.sha256 its SHA-256): every table is rebuilt, the same rows and
    # text, every number to float64 rounding.  Not byte for byte: the statistics go through BLAS (einsum, matmul),
    # whose kernels sum in another order on another CPU (AVX2 against AVX-512: 1.2e-14 relative on mc.csv)
    import numpy as np
    import pandas as pd

    tables = sorted(p.name for p in audit_copy.glob("*.csv"))
    before = {name: pd.read_csv(audit_copy / name, keep_default_na=False) for name in tables}
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 0
    assert sorted(p.name for p in audit_copy.glob("*.csv")) == tables
    for name, old in before.items():
        new = pd.read_csv(audit_copy / name, keep_default_na=False)
        assert list(new.columns) == list(old.columns) and new.shape == old.shape, name
        for c in old.columns:
            if old[c].dtype.kind in "fi" and new[c].dtype.kind in "fi":
                y = old[c].to_numpy(float)
                scale = np.nanmax(np.abs(y)) if np.isfinite(y).any() else 0.0
                np.testing.assert_allclose(new[c].to_numpy(float), y, rtol=1e-12, atol=1e-14 * scale,
                                           equal_nan=True, err_msg=f"{name} {c}")
            else:
                assert (new[c].astype(str) == old[c].astype(str)).all(), (name, c)
    assert Path(audit_copy / "audit.json").is_file()
