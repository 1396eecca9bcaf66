"""Issue 19, stored-file consistency found before campaign 13: a JSON object naming one key twice (json keeps the
last value silently) is refused in every JSON reader, and the FSDP benchmark section refuses rows of two
configurations, a missing rank and a round without its baseline.  Each test fails on 7974107."""

import csv
import shutil
from pathlib import Path

import pytest
from helpers import assert_refused_before_torch

from seco_lab.cli import main
from seco_lab.config import load_config_file
from seco_lab.store import DuplicateKeyError, loads_json, read_json

ROOT = Path(__file__).resolve().parents[1]


def test_loads_json_refuses_a_key_named_twice_and_keeps_nested_objects():
    assert loads_json('{"a": 1, "b": {"a": 2}}') == {"a": 1, "b": {"a": 2}}
    with pytest.raises(DuplicateKeyError, match="'a' appears twice"):
        loads_json('{"a": 1, "b": 2, "a": 3}')
    with pytest.raises(DuplicateKeyError, match="'x' appears twice"):
        loads_json('[{"x": 1, "x": 1}]')  # even with equal values: the file is not one this tool wrote


def test_stored_record_with_a_repeated_key_is_refused(tmp_path):
    path = tmp_path / "study.json"
    path.write_text('{"seeds": 20, "depths": [1, 2], "seeds": 2}')
    with pytest.raises(ValueError, match=r"study record .*study.json cannot be read as JSON .*'seeds' appears twice"):
        read_json(path, "study record")


def test_json_config_with_a_repeated_setting_is_refused(tmp_path, capsys):
    """`--config c.json` with "steps" twice trained the last value without a word."""
    cfg = tmp_path / "c.json"
    cfg.write_text('{"steps": 2, "seq_len": 32, "steps": 400}')
    with pytest.raises(ValueError, match="cannot parse .*'steps' appears twice"):
        load_config_file(cfg)
    rc = main(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--no-progress"])
    assert rc == 2 and "'steps' appears twice" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_metrics_line_with_a_repeated_key_is_damage(tmp_path):
    from seco_lab.training.run_dir import RunDirError
    from seco_lab.training.run_files import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "loss": 9.0}\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(RunDirError, match="line 2 is not a record .*'loss' appears twice"):
        read_metrics(tmp_path)


# -- the FSDP section of `report bench` ----------------------------------------------------------------------------

def _bench(tmp_path):
    out = tmp_path / "bench"
    shutil.copytree(ROOT / "reports" / "bench", out)
    return out


def _edit(path, change):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows = change(rows) or rows
    with open(path, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


def _report(folder, tmp_path, capsys):
    capsys.readouterr()
    rc = main(["report", "bench", "--results", str(folder), "--out", str(tmp_path / "b.md")])
    return rc, capsys.readouterr().err


def test_fsdp_rows_of_another_sequence_length_are_refused(tmp_path, capsys):
    """The report printed row 2's sequence length and chunk size for every row."""
    folder = _bench(tmp_path)

    def change(rows):
        rows[-1][rows[0].index("seq_len")] = str(2 * int(rows[-1][rows[0].index("seq_len")]))
    _edit(folder / "fsdp_results.csv", change)
    rc, err = _report(folder, tmp_path, capsys)
    assert rc == 2 and "holds seq_len = " in err and "two configurations joined" in err


def test_fsdp_round_missing_a_rank_or_its_baseline_is_refused(tmp_path, capsys):
    folder = _bench(tmp_path)
    path = folder / "fsdp_results.csv"
    _edit(path, lambda rows: rows[:-1])  # the last rank row of the last (round, mode)
    rc, err = _report(folder, tmp_path, capsys)
    assert rc == 2 and "a rank's row is missing or extra" in err

    shutil.copy(ROOT / "reports" / "bench" / "fsdp_results.csv", path)

    def drop_baseline_of_last_round(rows):
        head, rnd = rows[0], rows[-1][rows[0].index("round")]
        return [head] + [r for r in rows[1:] if not (r[head.index("round")] == rnd
                                                     and r[head.index("mode")] == "replicated")]
    _edit(path, drop_baseline_of_last_round)
    rc, err = _report(folder, tmp_path, capsys)
    assert rc == 2 and "has no 'replicated' rows" in err


def test_committed_fsdp_results_still_report(tmp_path, capsys):
    rc, err = _report(_bench(tmp_path), tmp_path, capsys)
    assert rc == 0, err
    assert "Sharded training: FSDP" in (tmp_path / "b.md").read_text()


# -- the audit's cross-sequence Grams against their units ------------------------------------------------------------

def test_audit_tables_refuse_a_scaled_data_vector(tmp_path, capsys):
    """A data sequence's flat vector times 2 changed the data-noise and equal-compute tables without a word (its
    unit's g_norm still said the old norm).  The vectors are not committed: on a fresh clone the tables read the
    stored data_gram.json, scaled here as the vector's Gram would be (row and column of s01 times 2)."""
    import json

    import numpy as np

    folder = tmp_path / "k128"
    shutil.copytree(ROOT / "reports" / "audit" / "k128", folder, ignore=shutil.ignore_patterns("vectors"))
    stored = json.loads((folder / "data_gram.json").read_text())
    g = np.array(stored["gram"])
    i = stored["names"].index("s01")
    scale = np.ones(len(g))
    scale[i] = 2.0
    stored["gram"] = (g * np.outer(scale, scale)).tolist()
    (folder / "data_gram.json").write_text(json.dumps(stored))
    capsys.readouterr()
    rc = main(["audit", "--tables-only", "--out", str(folder), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "sequence s01's data vector" in err and "disagrees with its unit" in err
    assert (folder / "data.csv").read_bytes() == (ROOT / "reports" / "audit" / "k128" / "data.csv").read_bytes()

def test_gram_blocks_are_checked_against_the_units():
    import numpy as np

    from seco_lab.studies.audit.tables import check_gram_against_units

    rng = np.random.default_rng(0)
    v = rng.standard_normal((3, 2, 50))  # 3 sequences, 2 strata rows each
    g = np.einsum("ird,jsd->irjs", v, v)
    own = {n: g[i, :, i, :].copy() for i, n in enumerate("abc")}
    check_gram_against_units(Path("x"), "strata", (list("abc"), g), own)  # consistent: passes
    swapped = g[[1, 0, 2]][:, :, [1, 0, 2]]  # the vectors of a and b swapped
    with pytest.raises(ValueError, match="sequence a's strata vector"):
        check_gram_against_units(Path("x"), "strata", (list("abc"), swapped), own)
    flat = rng.standard_normal((3, 40))
    gd = flat @ flat.T
    norms2 = {n: float(gd[i, i]) for i, n in enumerate("abc")}
    check_gram_against_units(Path("x"), "data", (list("abc"), gd), norms2)
    norms2["c"] *= 1 + 1e-4  # an edited g_norm
    with pytest.raises(ValueError, match="sequence c's data vector"):
        check_gram_against_units(Path("x"), "data", (list("abc"), gd), norms2)


@pytest.mark.parametrize("kw, words", [(dict(subset=(3, 3), budget=2), "repeats a chunk"),
                                       (dict(subset=(0, 2)), "holds 2 chunk.* but budget = 1")])
def test_seco_arguments_refuse_a_subset_the_trainer_would_refuse_at_its_first_step(kw, words):
    """SeCOArguments(subset=(3, 3)) was accepted and failed inside the first training step."""
    from seco_lab.integrations.trainer_args import SeCOArguments

    with pytest.raises(ValueError, match=words):
        SeCOArguments(chunk_size=16, mode="spaco", **kw)
    assert SeCOArguments(chunk_size=16, mode="spaco", budget=2, subset=(2, 0)).subset == (2, 0)


@pytest.mark.parametrize("argv", [["audit", "--tables-only", "--out", "."],
                                  ["train", "--tensorboard", "--steps", "1", "--run-dir", "run"]])
def test_refusals_campaign12_timed_slow_answer_before_torch(argv, tmp_path):
    """Campaign 12 timed these at 4.4 s (an existing folder without an audit) and 2.4 s (--tensorboard without the
    tensorboard package, which was asked by importing torch.utils.tensorboard)."""
    assert_refused_before_torch(argv, tmp_path, "sys.modules['tensorboard'] = None  # as if it were not installed")
    assert not (tmp_path / "run").exists()
