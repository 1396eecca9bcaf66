"""Issue 19, hostile campaign 12, G1 and G2: `seco-lab report train` trusted the stored training study's rows and
tier folders over the runs' identities.

* G1: a row of ``runs.csv`` (main study, ``equal_compute/``, ``second_L4/``) or of ``results.csv.gz`` whose arm, lr,
  seed, mode, batch size, steps, chunk passes or backpropagated chunks disagree with its ``run_id`` (the id
  ``RunSpec.run_id`` built) moved the run into another arm or changed its compute, and the report was written;
* G2: the ``equal_compute/`` and ``second_L4/`` folders swapped (or one copied over the other) were reported as
  each other's tier.

Each is now refused with one line naming the file, the run or setting and the field, before anything is written."""

import csv
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from helpers import cut_train_study

from seco_lab.report.markdown import MissingResultsError

TRAIN_STUDY = Path(__file__).resolve().parents[1] / "reports" / "training_study"


@pytest.fixture(scope="module")
def small_study(tmp_path_factory):
    """The committed training study with its main part cut to its first 12 runs (fast to load; still complete)
    and its two tier folders as committed."""
    return cut_train_study(TRAIN_STUDY, tmp_path_factory.mktemp("train_small_c12"), tiers=True)


@pytest.fixture
def study_copy(small_study, tmp_path):
    return Path(shutil.copytree(small_study, tmp_path / "ts"))


def _edit(path: Path, run_id: str, column: str, value: str) -> None:
    """Set one cell of a stored CSV by hand (csv module: the rest of the file stays byte for byte)."""
    rows = list(csv.reader(path.open()))
    col = rows[0].index(column)
    (row,) = [r for r in rows[1:] if r[0] == run_id]
    row[col] = value
    with path.open("w") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def _refused(folder: Path, capsys, *needles: str) -> None:
    """`seco-lab report train --results folder` exits 2 with one line holding every needle and writes nothing."""
    from seco_lab.studies.registry import report_main

    out = folder.parent / "out" / "r.md"
    rc = report_main(["train", "--results", str(folder), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    assert not out.parent.exists()


# --------------------------------------------------------------------------- G1: the main study's runs.csv


@pytest.mark.parametrize("run_id, column, value, needle", [
    # T02 / the reproducer: a paper t=4 run relabelled as released t=4
    ("paper_t4__adamw__lr0.001__s0", "arm", "released t=4", "arm is 'released t=4'"),
    # T01: the lr of a run (the md kept, the lr figure redrawn)
    ("dense__adamw__lr0.001__s0", "lr", "0.003", "lr is 0.003"),
    # T14: SeCO backpropagates all k = 8 chunks per step
    ("seco__adamw__lr0.001__s0", "backprop_chunks_per_step", "2.0", "backprop_chunks_per_step is 2.0"),
    ("seco__adamw__lr0.001__s0", "mode", "dense", "mode is 'dense'"),
    ("paper_t4__adamw__lr0.001__s0", "budget", "2", "budget is 2"),
    ("paper_t4__adamw__lr0.001__s0", "scheme", "released", "scheme is 'released'"),
    ("released_t4__adamw__lr0.001__s0", "seed", "1", "seed is 1"),
    # a uniform sampler draws exactly t = 4 chunks
    ("paper_t4__adamw__lr0.001__s0", "backprop_chunks_per_step", "3.5", "backprop_chunks_per_step is 3.5"),
])
def test_g1_a_main_runs_row_that_disagrees_with_its_run_id_is_refused(study_copy, capsys, run_id, column, value,
                                                                       needle):
    from seco_lab.studies.train.report import load

    _edit(study_copy / "runs.csv", run_id, column, value)
    with pytest.raises(MissingResultsError) as e:
        load(study_copy)
    msg = str(e.value)
    assert f"{study_copy}/runs.csv" in msg and run_id in msg and needle in msg, msg
    _refused(study_copy, capsys, "runs.csv", run_id, needle)


def test_g1_a_run_id_that_is_not_a_run_of_the_recorded_study_is_refused(study_copy):
    """A run renamed in both tables (here to a rate the grid does not have) is no run of the study."""
    from seco_lab.studies.train.report import load

    old, new = "dense__adamw__lr0.001__s0", "dense__adamw__lr0.002__s0"
    for name in ("runs.csv", "results.csv.gz"):
        df = pd.read_csv(study_copy / name)
        df.loc[df.run_id == old, ["run_id", "lr"]] = new, 0.002
        df.to_csv(study_copy / name, index=False)
    with pytest.raises(MissingResultsError, match=f"run {new} is not a run of the study"):
        load(study_copy)


def test_g1_results_rows_relabelled_to_another_arm_are_refused(study_copy):
    """results.csv.gz repeats each run's arm, optimizer, lr and seed; the curves are grouped by them."""
    from seco_lab.studies.train.report import load

    run = "paper_t4__adamw__lr0.001__s0"
    df = pd.read_csv(study_copy / "results.csv.gz")
    df.loc[df.run_id == run, "arm"] = "released t=4"
    df.to_csv(study_copy / "results.csv.gz", index=False)
    with pytest.raises(MissingResultsError, match=rf"results.csv.gz: \d+ row\(s\) of run {run} give arm"):
        load(study_copy)


def test_g1_a_study_json_whose_design_was_edited_is_refused(study_copy):
    """The runs' fields are checked against the design study.json records, so the design must be the one its
    fingerprint hashes (here: the sequences per step doubled)."""
    from seco_lab.studies.train.report import load

    study = json.loads((study_copy / "study.json").read_text())
    study["design"]["settings"]["batch_size"] = 32
    (study_copy / "study.json").write_text(json.dumps(study))
    with pytest.raises(MissingResultsError, match="study.json: its design has fingerprint .* the record was edited"):
        load(study_copy)


# --------------------------------------------------------------------------- G1: the tiers' runs.csv


@pytest.mark.parametrize("sub, run_id, column, value, needle", [
    # T09: SeCO at SpaCO's compute on 20 sequences per step doubled its compute
    ("equal_compute", "seco_B10__sgd__lr0.3__s0", "batch_size", "20", "batch_size is 20"),
    # T13: a second-configuration SeCO run moved into an arm that did not run there
    ("second_L4", "seco__adamw__lr0.01__s0", "arm", "bernoulli t=4", "arm is 'bernoulli t=4'"),
    ("equal_compute", "seco_B10__sgd__lr0.3__s0", "passes_per_step", "100.0", "passes_per_step is 100.0"),
    ("equal_compute", "seco_B10__sgd__lr0.3__s0", "steps", "161", "steps is 161"),
    ("second_L4", "falling-factorial_t4__adamw__lr0.01__s0", "backprop_chunks_per_step", "8.0",
     "backprop_chunks_per_step is 8.0"),
    ("second_L4", "seco_B10__adamw__lr0.01__s0", "lr", "0.003", "lr is 0.003"),
])
def test_g1_a_tier_runs_row_that_disagrees_with_its_run_id_is_refused(study_copy, capsys, sub, run_id, column,
                                                                       value, needle):
    _edit(study_copy / sub / "runs.csv", run_id, column, value)
    _refused(study_copy, capsys, f"{sub}/runs.csv", run_id, needle)


# --------------------------------------------------------------------------- G2: the tier folders


def _swap(folder: Path) -> None:
    (folder / "equal_compute").rename(folder / "x")
    (folder / "second_L4").rename(folder / "equal_compute")
    (folder / "x").rename(folder / "second_L4")


def _second_over_equal(folder: Path) -> None:
    shutil.rmtree(folder / "equal_compute")
    shutil.copytree(folder / "second_L4", folder / "equal_compute")


def _equal_over_second(folder: Path) -> None:
    shutil.rmtree(folder / "second_L4")
    shutil.copytree(folder / "equal_compute", folder / "second_L4")


@pytest.mark.parametrize("damage, needle", [
    # T08 / the reproducer: the L = 4 folder read as the equal-compute tier of the L = 2 study
    (_swap, "equal_compute/study.json records settings.model.n_layers = 4"),
    (_second_over_equal, "equal_compute/study.json records settings.model.n_layers = 4"),
    (_equal_over_second, "second_L4/study.json records settings.model.n_layers = 2"),
])
def test_g2_a_tier_folder_from_the_other_tier_is_refused(study_copy, capsys, damage, needle):
    damage(study_copy)
    _refused(study_copy, capsys, needle, "from another tier or study")


def test_g2_a_tier_of_another_study_is_refused(study_copy, capsys):
    """A tier folder whose own record is consistent (a tier's fingerprint hashes its settings only) but whose
    study is not this one (another seed grid)."""
    path = study_copy / "second_L4" / "study.json"
    study = json.loads(path.read_text())
    study["design"]["seeds"] = [0, 1, 2, 3]
    path.write_text(json.dumps(study))
    _refused(study_copy, capsys, "second_L4/study.json records seeds = [0, 1, 2, 3]", "from another tier or study")
