"""Issue 19, fourth hostile campaign (a reviewer who wrote none of the fixes, on a fresh clone): the inputs
it found still mishandled, and the ones left over from campaign 3, each with the fix's test."""

import pytest


@pytest.mark.parametrize("name", ["", "   "])
def test_build_hf_model_refuses_an_empty_name_before_asking_the_hub(name):
    """``Path("")`` is the current directory: an empty name used to reach transformers' Hub lookup."""
    from seco_lab.models.hf import build_hf_model

    with pytest.raises(ValueError, match="must name an architecture .* or a local checkpoint directory"):
        build_hf_model(name)


def test_the_readme_names_build_hf_models_arguments_as_they_are():
    import inspect
    from pathlib import Path

    from seco_lab.models.hf import build_hf_model

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shown = readme.split("`build_hf_model(", 1)[1].split(")`", 1)[0]
    params = list(inspect.signature(build_hf_model).parameters)
    assert [a.strip() for a in shown.split(",")[1:]] == params[1: len(shown.split(","))], shown


# ------------------------------------------------------------------ reports on damaged results

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _bias_copy(tmp_path):
    import shutil

    folder = tmp_path / "b"
    shutil.copytree(ROOT / "reports/bias_study", folder, ignore=shutil.ignore_patterns("cells"))
    return folder


@pytest.mark.parametrize("table, drop, message", [
    # C4 r06b: one (cell, metric) row deleted: the report was written, its aggregates changed
    ("results.csv", lambda d: d.index == d.index[(d.L == 2) & (d.k == 8) & (d.t == 1) & (d.seed == 2)
                                                  & (d.scheme == "bernoulli") & (d.metric == "rel_mse")][0],
     "lacks 1 (cell, metric) rows (e.g. rel_mse at L=2, k=8, t=1, seed=2, bernoulli)"),
    # C4 r06: a whole metric deleted: a KeyError traceback
    ("results.csv", lambda d: d.metric == "rel_var", "lacks 1215 (cell, metric) rows (e.g. rel_var at L=1"),
    # a weight of the cell's own depth
    ("results.csv", lambda d: d.metric == "w_p3", "(e.g. w_p3 at L=3"),
    ("paper.csv", lambda d: (d.metric == "direction_bias") & (d.L == 4), "paper.csv lacks 54 (cell, metric) rows"),
])
def test_a_bias_report_refuses_results_lacking_a_metric(tmp_path, table, drop, message):
    import pandas as pd

    from seco_lab.report.bias_summary import load_bias
    from seco_lab.report.markdown import MissingResultsError

    folder = _bias_copy(tmp_path)
    df = pd.read_csv(folder / table)
    df[~drop(df)].to_csv(folder / table, index=False)
    with pytest.raises(MissingResultsError, match=__import__("re").escape(message)):
        load_bias(folder)


@pytest.mark.parametrize("table, column, value, bound", [
    ("results.csv", "rel_bias", -5.0, "[0, inf]"),  # C4 r30: -5.000 was reported
    ("results.csv", "direction_bias", 2.5, "[0, 2]"),
    ("results.csv", "best_scale_residual", 1.5, "[0, 1]"),
    ("strata.csv", "norm_ratio", -0.1, "[0, inf]"),
])
def test_the_real_report_refuses_impossible_values(tmp_path, capsys, table, column, value, bound):
    import shutil

    import pandas as pd

    from seco_lab.studies.registry import report_main

    folder = tmp_path / "r"
    shutil.copytree(ROOT / "reports/real_study/k16x16", folder)
    df = pd.read_csv(folder / table)
    df.loc[3, column] = value
    df.to_csv(folder / table, index=False)
    assert report_main(["real", "--results", str(folder), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert f"holds 1 impossible value(s) of {column} (e.g. {value:g} on line 5; it lies in {bound})" in err, err
    assert not (tmp_path / "r.md").exists()


# ------------------------------------------------------------- the audit report checks its tables against the units

@pytest.fixture(scope="module")
def tiny_audit(tmp_path_factory):
    from dataclasses import replace

    from seco_lab.studies.audit import AuditConfig, run_audit

    cfg = AuditConfig(model="tiny", params="full", dtype="float64", length=16, chunk_size=4, budgets=(2,),
                      max_hops=1, num_sequences=2, mc_sequences=1, mc_budgets=(2,), mc_draws=8, cost_sequences=1,
                      data_sequences=3, exact_length=8, exact_chunk_size=4, threads=1, batch_sizes=(1, 4))
    out = tmp_path_factory.mktemp("audit") / "a"
    run_audit(replace(cfg), out, progress=False)
    return out


def _damage_first_value(name, value):
    def damage(folder):
        import pandas as pd

        df = pd.read_csv(folder / name)
        df.loc[0, df.select_dtypes("number").columns[-1]] = value
        df.to_csv(folder / name, index=False)
    return damage


def _truncate(name, rows):
    def damage(folder):
        import pandas as pd

        pd.read_csv(folder / name).head(rows).to_csv(folder / name, index=False)
    return damage


def _duplicate(name):
    def damage(folder):
        import pandas as pd

        df = pd.read_csv(folder / name)
        pd.concat([df, df.head(3)]).to_csv(folder / name, index=False)
    return damage


def _write(name, text):
    return lambda folder: (folder / name).write_text(text)


@pytest.mark.parametrize("damage, words", [
    (_truncate("bias.csv", 5), "bias.csv does not match the audit's stored units"),          # C4 r33
    (_write("strata.csv", "sequence,kind,p,norm_ratio\n"), "strata.csv does not match"),      # C4 r34
    (_damage_first_value("bias.csv", float("nan")), "bias.csv does not match"),              # C4 r35
    (_duplicate("bias.csv"), "bias.csv does not match"),                                     # C4 r36
    (lambda f: (f / "strata.csv").unlink(), "strata.csv is missing"),                        # C4 r37
    (_write("audit.json", ""), "audit.json cannot be read as JSON"),                        # C4 r38a
    (_write("audit.json", "[1, 2]"), "audit.json does not match"),                           # C4 r38b
    (_write("audit.json", '{"digest": "x", "study": "bias"}'), "audit.json does not match"),  # C4 r39a
    (_write("bias.csv", "L,k,seed,t,scheme,metric,value\n1,4,0,1,paper,rel_bias,0.5\n"), "bias.csv does not match"),
    (_damage_first_value("equal_compute.csv", 123.0), "equal_compute.csv does not match"),
    (_write("recommendation.json", "{}"), "recommendation.json does not match"),
])
def test_the_audit_report_refuses_tables_that_are_not_its_units(tiny_audit, tmp_path, capsys, damage, words):
    import shutil

    from seco_lab.cli import main

    folder = tmp_path / "a"
    shutil.copytree(tiny_audit, folder)
    damage(folder)
    assert main(["report", "audit", "--results", str(folder), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err
    assert f"seco-lab audit --tables-only --out {folder}" in err or "is not readable" in err or "missing" in err
    assert not (tmp_path / "r.md").exists()
    # the fix the message names: the tables written again from the units, then the report is written
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 0
    assert main(["report", "audit", "--results", str(folder), "--out", str(tmp_path / "r.md")]) == 0


def test_an_intact_audit_reports_and_tables_only_computes_nothing(tiny_audit, tmp_path):
    import shutil

    from seco_lab.cli import main

    folder = tmp_path / "a"
    shutil.copytree(tiny_audit, folder)
    units = {p.name: p.read_bytes() for p in (folder / "units").iterdir()}
    tables = {p.name: p.read_bytes() for p in folder.glob("*.csv")}
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 0
    assert {p.name: p.read_bytes() for p in (folder / "units").iterdir()} == units
    assert {p.name: p.read_bytes() for p in folder.glob("*.csv")} == tables
    assert main(["audit", "--tables-only", "--out", str(tmp_path / "none"), "--no-progress"]) == 2


def test_a_unit_copied_from_another_audit_is_refused_naming_it(tiny_audit, tmp_path, capsys):
    """C4 a09: a k = 128 strata unit copied into a quick audit gave 'expected_weights must have 10 entries'."""
    import json
    import shutil

    from seco_lab.cli import main

    folder = tmp_path / "a"
    shutil.copytree(tiny_audit, folder)
    unit = json.loads((ROOT / "reports/audit/k128/units/strata-s00.json").read_text())  # P = 8, k = 128
    (folder / "units" / "strata-s00.json").write_text(json.dumps(unit))
    assert main(["report", "audit", "--results", str(folder), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "units/strata-s00.json is not a unit of this audit (num_chunks 128, this audit's 4)" in err, err
    # a unit this code wrote records the audit's digest: another audit's is refused whatever its shape
    own = json.loads((tiny_audit / "units" / "strata-s01.json").read_text())
    assert own["digest"]
    (folder / "units" / "strata-s00.json").write_text(json.dumps({**own, "unit": "strata-s00", "sequence": "s00",
                                                                 "digest": "0" * 16}))
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 2
    assert "(digest '0000000000000000', this audit's" in capsys.readouterr().err


# ------------------------------------------------------------------ --overwrite and a user's look-alike run folder

@pytest.mark.parametrize("record", [
    {"mode": "train", "steps": 1000, "my": "experiment"},  # C4 d01: deleted with the user's metrics.jsonl
    {"mode": "seco", "steps": 1000},                         # a run's mode, but not a run's record
    {"mode": "seco", "steps": 10, "seq_len": 64, "chunk_size": 16, "seed": 0, "lr": 0.1, "my_key": 1},
])
def test_overwrite_leaves_a_user_folder_whose_config_json_merely_looks_like_a_run(tmp_path, capsys, record):
    import json

    from test_issue19_inputs import FAST

    from seco_lab.cli import main

    user = tmp_path / "u"
    user.mkdir()
    (user / "config.json").write_text(json.dumps(record))
    (user / "metrics.jsonl").write_text('{"step": 1, "acc": 0.9}\n')
    before = {p.name: p.read_bytes() for p in user.iterdir()}
    assert main(["train", *FAST, "--run-dir", str(user), "--overwrite"]) == 2
    assert "is not a seco-lab run directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in user.iterdir()} == before


def test_a_run_written_before_the_marker_is_still_recognised_by_its_full_record(tmp_path, capsys):
    from test_issue19_inputs import FAST

    from seco_lab.cli import main
    from seco_lab.training.run_dir import MARKER_NAME

    run = tmp_path / "run"
    assert main(["train", *FAST, "--run-dir", str(run)]) == 0
    (run / MARKER_NAME).unlink()
    assert main(["train", *FAST, "--run-dir", str(run), "--overwrite"]) == 0
    assert (run / MARKER_NAME).is_file()


def test_a_run_dir_under_a_file_says_so(tmp_path, capsys):
    """C4 d03b: 'f is not writable' for --run-dir f/sub where f is a file."""
    from test_issue19_inputs import FAST

    from seco_lab.cli import main

    (tmp_path / "f").write_text("mine")
    assert main(["train", *FAST, "--run-dir", str(tmp_path / "f" / "sub")]) == 2
    assert "f is a file, so no directory can be made under it" in capsys.readouterr().err
    assert (tmp_path / "f").read_text() == "mine"


# ------------------------------------------------------------------ API: gradient dicts and user factor functions

def test_gradient_dict_helpers_refuse_what_is_not_one():
    import torch

    from seco_lab import TinyConfig, TinyTransformer, accumulate_grads, flatten, unflatten

    model = TinyTransformer(TinyConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=8), seed=0)
    grads = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="flatten: the gradient dict is empty"):
        flatten({})                                          # C4: a raw torch.cat error
    with pytest.raises(TypeError, match="flatten: expected a dict of gradient tensors"):
        flatten(list(grads.values()))                        # C4: AttributeError 'values'
    with pytest.raises(TypeError, match="unflatten's like: expected a dict"):
        unflatten(flatten(grads), model)                     # C4: AttributeError
    name = next(iter(grads))
    with pytest.raises(ValueError, match=f"the gradient of {name} must be a tensor of"):
        accumulate_grads(model, {name: grads[name].double()})   # C4: a raw dtype RuntimeError
    accumulate_grads(model, grads)
    with pytest.raises(ValueError, match=f"the gradient of {name} must be a tensor of"):
        accumulate_grads(model, {name: torch.ones(1)})       # would broadcast into .grad: a silent wrong sum
    assert torch.equal(dict(model.named_parameters())[name].grad, grads[name])


@pytest.mark.parametrize("value, error", [(float("nan"), ValueError), ("a", TypeError), (-1.0, ValueError)])
def test_a_user_factor_function_returning_no_factor_is_named(value, error):
    """C4: make_scheme(direct=lambda ...: nan) failed inside fractions ('cannot convert NaN to integer ratio')."""
    from seco_lab import make_scheme

    scheme = make_scheme("mine", direct=lambda k, t, rho: value, hop=1.0)
    with pytest.raises(error, match=r"scheme 'mine': direct\(k=4, t=2, rho\) returned, but c_0"):
        scheme.expected_weights(4, 2, 3)
    scheme = make_scheme("mine", direct=1.0, hop=lambda q, k, t, rho: value)
    with pytest.raises(error, match=r"scheme 'mine': hop\(q=1, k=4, t=2, rho\) returned, but c_q"):
        scheme.expected_weights(4, 2, 3)


# ------------------------------------------------------------------ a real tokenizer's corpus from one or a few files

def test_a_token_corpus_of_one_file_holds_out_its_last_sequences(tmp_path):
    """C4 t01-t03: one text file (or a few, none in the held-out share) was refused with advice naming options the
    command line does not have; the byte corpus took the same file.  The last sequences are held out instead."""
    import sysconfig
    import warnings
    from pathlib import Path

    import torch

    from seco_lab.data.token_corpus import TokenCorpus, held_out
    from seco_lab.models.pretrained import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    (tmp_path / "only.py").write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        corpus = TokenCorpus(64, tokenizer, paths=[tmp_path / "only.py"], max_tokens=20_000)
    assert corpus.held_out_by == "position" and any("held out instead" in str(w.message) for w in caught)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    budget = 1_000 if held_out("only.py", 0.05) else 19_000  # the split's share of max_tokens
    n_seq = min(len(ids), budget) // 65
    n_val = max(1, round(n_seq * 0.05))
    flat = torch.cat([corpus.train.reshape(-1), corpus.val.reshape(-1)]).tolist()
    assert flat == ids[: n_seq * 65] and len(corpus.val) == n_val and len(corpus.train) == n_seq - n_val


def test_a_folder_of_user_files_named_like_temporaries_is_not_a_study_folder(tmp_path, capsys):
    """C4 s09 (data loss): a folder holding only draft.tmp2 and report.tmp1 was taken as an empty study folder and
    both files deleted as stale temporaries; only NAME.tmp<pid> of a file a study writes is one."""
    from seco_lab.cli import main
    from seco_lab.store import StudyFolder, clear_stale

    user = tmp_path / "u"
    user.mkdir()
    for name in ("draft.tmp2", "report.tmp1"):
        (user / name).write_text("mine")
    with pytest.raises(SystemExit) as e:
        main(["study", "bias", "--quick", "--out", str(user), "--no-progress"])
    assert e.value.code == 2 and "is not a seco-lab study folder" in capsys.readouterr().err
    assert sorted(p.name for p in user.iterdir()) == ["draft.tmp2", "report.tmp1"]
    (user / "results.csv.seco-tmp4242").touch()  # an interrupted atomic write of the study's, before any byte
    clear_stale(user)
    assert sorted(p.name for p in user.iterdir()) == ["draft.tmp2", "report.tmp1"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "study.json.seco-tmp77").write_text("{")  # a study killed while writing its first record
    StudyFolder(fresh).check_usable()


@pytest.mark.parametrize("subset, error, words", [
    ((0.7, 2.9), TypeError, "a subset's chunk index must be an integer, got 0.7"),  # C4: trained on (0, 2)
    ("13", TypeError, "subset must be a sequence of chunk indices"),               # C4: became (1, 3)
    ((0, -1), ValueError, "a subset's chunk index must be an integer >= 0"),
])
def test_seco_arguments_refuse_a_subset_that_is_not_chunk_indices(subset, error, words):
    from seco_lab.integrations.trainer_args import SeCOArguments

    args = dict(chunk_size=16, mode="spaco", scheme="falling-factorial", budget=2)
    with pytest.raises(error, match=words):
        SeCOArguments(**args, subset=subset)
    assert SeCOArguments(**args, subset=[0, 2]).subset == (0, 2)


# ------------------------------------------------------- a user's .lock; a full disk before the first checkpoint

def test_a_users_own_lock_file_is_never_truncated(tmp_path, capsys):
    """C4 d04: a folder holding only the user's .lock was taken as empty and the file truncated to a pid."""
    from test_issue19_inputs import FAST

    from seco_lab.cli import main
    from seco_lab.folder_lock import is_own_lock

    user = tmp_path / "u"
    user.mkdir()
    (user / ".lock").write_text("my notes\n")
    assert main(["train", *FAST, "--run-dir", str(user)]) == 2
    assert "exists, is not empty and is not a seco-lab run" in capsys.readouterr().err
    assert (user / ".lock").read_text() == "my notes\n" and not is_own_lock(user / ".lock")
    with pytest.raises(SystemExit) as e:
        main(["study", "bias", "--quick", "--out", str(user), "--no-progress"])
    assert e.value.code == 2 and "(.lock)" in capsys.readouterr().err
    assert sorted(p.name for p in user.iterdir()) == [".lock"] and (user / ".lock").read_text() == "my notes\n"
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / ".lock").write_text("12345")  # a lock a dead run left: taken over
    assert is_own_lock(tmp_path / "stale" / ".lock")


def test_a_full_disk_at_the_first_checkpoint_gives_advice_that_works(tmp_path, monkeypatch):
    """C4 d13b: 'free disk space ... resume with --resume' although no checkpoint existed to resume from."""
    from seco_lab.training import run_dir as rd

    run = rd.RunDir(tmp_path / "r")
    run.open(resume=False, overwrite=False)

    def full(path, content):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rd, "atomic_write", full)
    with pytest.raises(rd.RunDirError, match="No space left on device; .* start the run again with --overwrite"):
        run.save_checkpoint({"step": 2})
    (run.checkpoints / "step_000001.pt").write_bytes(b"x")
    with pytest.raises(rd.RunDirError, match=r"resume with --resume \(from step 1\)"):
        run.save_checkpoint({"step": 2})


# ------------------------------------------------------------------ empty path options

@pytest.mark.parametrize("argv", [["report", "bias", "--out", ""], ["report", "bias", "--results", " "],
                                  ["audit", "--quick", "--out", ""], ["audit", "--quick", "--report", ""],
                                  ["plot", "runs/x", "--out", ""], ["train", "--config", ""]])
def test_an_empty_path_option_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch, capsys, argv):
    """``Path("")`` is ``Path(".")``: an empty --out used to become the current directory (the report then said
    '--out . is a folder ... e.g. ..md'); every path option now refuses it by name, and nothing is written."""
    from seco_lab.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_report_out_folder_is_answered_with_a_file_in_it(tmp_path, capsys):
    from seco_lab.cli import main

    with pytest.raises(SystemExit):
        main(["report", "bias", "--out", str(tmp_path)])
    assert f"e.g. {tmp_path / 'bias_study.md'}" in capsys.readouterr().err


def test_the_bias_report_prices_unbiasedness_at_matched_scale(tmp_path):
    """Issue 21 §4: the 'variance price of unbiasedness' was a raw variance ratio (17x), which a learning rate
    undoes; the bullet now leads with noise-to-signal Var/||E g_hat||^2, recomputed here from results.csv."""
    import re

    import pandas as pd

    from seco_lab.report.bias import bias_report

    out = bias_report(ROOT / "reports/bias_study", tmp_path / "b.md")
    line = next(x for x in out.read_text().splitlines() if x.startswith("- Unbiasedness costs noise, at matched"))
    shown = [float(v) for v in re.findall(r"is ([0-9.]+)×", line)]
    res = pd.read_csv(ROOT / "reports/bias_study/results.csv")
    wide = res.pivot_table(index=["L", "k", "seed", "t", "scheme"], columns="metric", values="value").reset_index()
    mean = wide.groupby(["L", "k", "t", "scheme"]).mean(numeric_only=True)

    def ratio(metric):
        a = mean.xs("falling-factorial", level="scheme")[metric]
        b = mean.xs("paper", level="scheme")[metric]
        r = (a / b).dropna()
        r = r[r.index.get_level_values("t") < r.index.get_level_values("k")]
        return float(r[r.abs() < float("inf")].median())

    assert shown[0] == pytest.approx(ratio("noise_to_signal"), rel=2e-3)
    assert shown[1] == pytest.approx(ratio("rel_var"), rel=2e-3)


def test_cost_units_of_engines_that_ran_pass_1_differently_are_not_averaged(tiny_audit, tmp_path, capsys):
    """A cost unit records how its engine ran pass 1 (pass1_tokens; none recorded: chunk by chunk, as before
    pass-1 spans); units that differ make --tables-only and the report refuse, naming them, instead of averaging
    times that do not compare into the equal-compute table."""
    import json
    import shutil

    from seco_lab.cli import main

    folder = tmp_path / "a"
    shutil.copytree(tiny_audit, folder)
    unit = json.loads((folder / "units" / "cost-s00.json").read_text())
    assert "pass1_tokens" in unit and unit["pass1_tokens"] is None  # the tiny model: chunk by chunk
    (folder / "units" / "cost-s01.json").write_text(json.dumps({**unit, "unit": "cost-s01", "sequence": "s01",
                                                                "pass1_tokens": 512}))
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cost units measured by engines that ran pass 1 differently (cost-s00: pass 1 chunk by chunk; " \
           "cost-s01: pass 1 in spans of 512 tokens)" in err, err
    (folder / "units" / "cost-s01.json").write_text(json.dumps({**unit, "unit": "cost-s01", "sequence": "s01"}))
    assert main(["audit", "--tables-only", "--out", str(folder), "--no-progress"]) == 0
