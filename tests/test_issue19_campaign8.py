"""Issue 19, eighth hostile campaign (by a reviewer who wrote none of the fixes, on a fresh clone of 0a46358): each
finding with the test of its fix.  H-numbers are the campaign's (docs/hostile_campaign_8.md)."""

import shutil
from pathlib import Path

import pytest
import torch
from helpers import FAST
from helpers import copy_run as _copy

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_h3_a_sibling_copys_checkpoint_with_config_json_deleted_is_refused(r2, tmp_path, capsys):
    """H3: copies a (extended with --rewarm) and b (extended plainly, stopped at 3) of one run; b's config.json
    deleted and a's step-3 checkpoint copied over b's: the run id agrees, and with config.json gone the record
    recovered is the foreign checkpoint's own, so the schedule check passed too; b resumed on a's trajectory.
    Every checkpoint now records its step's loss, lr and gradient norm, and a resume compares them with
    metrics.jsonl; b's own continuation still resumes bit for bit."""
    a, b = _copy(r2, tmp_path / "a"), _copy(r2, tmp_path / "b")
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(a), "--resume", "--rewarm"]) == 0
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume", "--stop-at", "3"]) == 0
    own_b = _copy(b, tmp_path / "own_b")
    (b / "config.json").unlink()
    shutil.copy(a / "checkpoints/step_000003.pt", b / "checkpoints/step_000003.pt")
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "does not continue the history" in err and "lr" in err
    assert not (b / "checkpoints/step_000004.pt").exists()
    (own_b / "config.json").unlink()  # the run's own checkpoint, config.json gone: recovered and resumed
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(own_b), "--resume"]) == 0
    ref = _copy(r2, tmp_path / "ref")
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(ref), "--resume"]) == 0
    x, y = (torch.load(d / "checkpoints/step_000004.pt", weights_only=True) for d in (own_b, ref))
    assert all(torch.equal(x["model"][k], y["model"][k]) for k in x["model"])
    assert x["record"] == y["record"] and set(x["record"]) == {"step", "loss", "lr", "grad_norm"}


def test_h4_chain_weights_refuse_a_max_hops_far_past_any_chain():
    """H4: Scheme.chain_weights(5, 2, 10**5) computed 100,001 exact fractions for minutes (expected_weights
    refused); a chain of k chunks has at most k-1 hops."""
    from seco_lab import get_scheme
    from seco_lab.estimators.schemes import EXACT_TERMS

    with pytest.raises(ValueError, match="no chain of k=5 chunks has more than 4 hops"):
        get_scheme("paper").chain_weights(5, 2, 10**6)
    w = get_scheme("paper").chain_weights(5, 2, 4 + EXACT_TERMS)
    assert len(w) == 5 + EXACT_TERMS and w[3] == pytest.approx(2.5**3)


def test_h1_audit_tables_only_never_empties_the_tables_of_missing_units(audit_copy, capsys):
    """H1: with units/ moved away, `audit --tables-only` rewrote every table empty and exited 0.  The units the
    stored tables were made from (audit.json's units_done) must still be there; removing audit.json asks for
    tables from the units left."""
    before = {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")}
    shutil.move(audit_copy / "units", audit_copy.parent / "units-moved")
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "holds no usable unit" in capsys.readouterr().err  # (some units gone: test_audit, "units now missing")
    assert {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")} == before


@pytest.mark.parametrize("content, words", [("{}", "no audit stage"), ('{"stage": "cost", "unit": "cost-s00"}',
                                                                       "a cost unit without")])
def test_h5_an_audit_unit_without_its_fields_is_damaged_not_a_traceback(content, words, audit_copy, capsys):
    """H5: a unit holding {} raised KeyError: 'stage' from --tables-only.  A unit lacking what its stage's tables
    read counts as damaged: left out of the tables and named, with why (as a unit that is not JSON is)."""
    (audit_copy / "units/cost-s00.json").write_text(content)
    before = (audit_copy / "cost.csv").read_bytes()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2  # its rows would go
    out = capsys.readouterr()
    assert "cost-s00" in out.out + out.err and words in out.out + out.err and "Traceback" not in out.err
    assert "cost.csv: s00/forward" in out.err and (audit_copy / "cost.csv").read_bytes() == before
    assert main(["audit", "--tables-only", "--drop-missing-units", "--out", str(audit_copy), "--no-progress"]) == 0


def test_h5_a_unit_value_of_the_wrong_kind_is_named(audit_copy):
    import json

    from seco_lab.studies.audit.driver import rewrite_tables

    unit = json.loads((audit_copy / "units/cost-s00.json").read_text())
    (audit_copy / "units/cost-s00.json").write_text(json.dumps({**unit, "rows": 5}))
    with pytest.raises(ValueError, match="holds a value of the wrong kind"):
        rewrite_tables(audit_copy)


def test_h2_a_table_padded_with_nul_bytes_is_refused_without_reading_it_as_one_cell(tmp_path, capsys):
    """H2: a results table extended to 300 MB with NUL bytes (`truncate -s 300M`) was parsed by pandas as one huge
    cell, and the refusal quoted it whole: MemoryError at 3.8 GB.  NUL bytes are refused before pandas (a sparse
    file: nothing is written to disk)."""
    b = tmp_path / "b"
    shutil.copytree(ROOT / "reports/bias_study", b)
    with open(b / "groups.csv", "r+b") as f:
        f.truncate(300 << 20)
    assert main(["report", "bias", "--results", str(b), "--out", str(tmp_path / "r.md")]) == 2
    assert "holds NUL bytes" in capsys.readouterr().err


@pytest.mark.parametrize("damage, words", [("header only", "has a header but no rows"),
                                           ("nan length", "is empty or NaN")])
def test_h6_damaged_benchmark_tables_are_named(damage, words, tmp_path, capsys):
    """H6: `report bench` raised IndexError on a header-only results.csv and 'cannot convert float NaN to integer'
    on a NaN in hf_results.csv: the bench tables are read with their columns checked."""
    b = tmp_path / "bench"
    shutil.copytree(ROOT / "reports/bench", b)
    if damage == "header only":
        (b / "results.csv").write_text((b / "results.csv").read_text().splitlines()[0] + "\n")
    else:
        lines = (b / "hf_results.csv").read_text().splitlines()
        head = lines[0].split(",")
        row = lines[1].split(",")
        row[head.index("length")] = "nan"
        (b / "hf_results.csv").write_text("\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n")
    assert main(["report", "bench", "--results", str(b), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_h7_combine_refuses_unordered_weights():
    """H7: HopStrata.combine({0: 1.0, 1: 2.0}) iterated the dict's keys, so it equalled combine([0, 1])."""
    from seco_lab import TinyConfig, TinyTransformer, hop_strata

    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32)).double()
    t = torch.randint(0, 32, (2, 20))
    s = hop_strata(model, t, t, 4)
    for weights in ({0: 1.0, 1: 2.0}, {1.0, 2.0}):
        with pytest.raises(TypeError, match="in hop order"):
            s.combine(weights)


def test_h8_a_users_file_is_never_written_over_by_a_report_figure_or_pruning(r2, tmp_path, capsys):
    """H8: `report bias --out notes.md` overwrote a user's notes, `plot --out mine.png` a non-PNG file, and
    --keep-checkpoints 1 deleted a text file named checkpoints/step_000000.pt.  A report overwrites only a report it
    generated, a figure only a PNG, pruning only torch archives."""
    notes, mine = tmp_path / "notes.md", tmp_path / "mine.png"
    notes.write_text("my notes\n")
    mine.write_text("mine\n")
    with pytest.raises(SystemExit):
        main(["report", "bias", "--results", str(ROOT / "reports/bias_study"), "--out", str(notes)])
    assert main(["plot", str(r2), "--out", str(mine)]) == 2
    assert notes.read_text() == "my notes\n" and mine.read_text() == "mine\n"
    report = tmp_path / "r.md"  # a report it generated is rewritten
    assert main(["report", "bias", "--results", str(ROOT / "reports/bias_study"), "--out", str(report)]) == 0
    assert main(["report", "bias", "--results", str(ROOT / "reports/bias_study"), "--out", str(report)]) == 0
    r = _copy(r2, tmp_path / "r")
    (r / "checkpoints/step_000000.pt").write_text("precious\n")
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r), "--resume", "--keep-checkpoints", "1"]) == 0
    assert (r / "checkpoints/step_000000.pt").read_text() == "precious\n"
    assert sorted(p.name for p in (r / "checkpoints").glob("step_*.pt")) == ["step_000000.pt", "step_000003.pt"]


def test_h9_the_benchmark_runs_under_an_address_space_limit():
    """H9: under `ulimit -v` the benchmark's memory cap raised the hard limit in the child's preexec_fn, which
    failed: SubprocessError.  The cap is the lower of the two, and the hard limit is left alone."""
    import resource
    import subprocess
    import sys

    from experiments.bench import _limit_memory

    code = "import resource; print(*resource.getrlimit(resource.RLIMIT_AS))"

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # as `prlimit --as` does
        _limit_memory(14.0)()

    out = subprocess.run([sys.executable, "-c", code], preexec_fn=limited, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [str(6 << 30)] * 2


@pytest.mark.parametrize("config, words", [("folder", "not a regular file (a folder)"), ("{}", "lacks mode, steps")])
def test_h11_a_config_json_that_is_a_folder_or_empty_is_named(config, words, r2, tmp_path, capsys):
    """H11: a config.json that is a folder gave 'config.json.seco-tmpNNN: Is a directory' (a name the user never
    made); {} listed the defaults as the run's settings."""
    r = _copy(r2, tmp_path / "r")
    (r / "config.json").unlink()
    if config == "folder":
        (r / "config.json").mkdir()
    else:
        (r / "config.json").write_text(config)
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "3", "--run-dir", str(r), "--resume"]) == 2
    err = capsys.readouterr().err
    assert words in err and "seco-tmp" not in err


def test_h11_integer_tensors_are_chunk_indices_and_complex_weights_are_named():
    """H11: a 1-D integer tensor subset was refused ('tensor(1) ... must be integers'); complex chain weights gave a
    bare float() error (and a complex tensor's imaginary part would have been dropped by a cast)."""
    from seco_lab import TinyConfig, TinyTransformer, chain_basis, get_scheme, spaco_grad

    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32)).double()
    t = torch.randint(0, 32, (2, 20))
    a = spaco_grad(model, t, t, 4, scheme="paper", budget=2, subset=torch.tensor([1, 3]))
    b = spaco_grad(model, t, t, 4, scheme="paper", budget=2, subset=[1, 3])
    assert all(torch.equal(a[1][k], b[1][k]) for k in b[1])  # (loss, grads): the same draw, the same estimate
    cb = chain_basis(model, t, t, 4, max_hops=4)
    w = get_scheme("paper").chain_weights(5, 2, 4)
    assert torch.equal(cb.estimate(torch.tensor([0, 2]), w), cb.estimate([0, 2], w))
    for weights in ([1j] * 5, torch.tensor([1j] * 5)):
        with pytest.raises(ValueError, match="chain_weights must be real numbers"):
            cb.estimate([0, 2], weights)
    with pytest.raises(TypeError, match="must be integers"):
        cb.estimate([torch.tensor(True)], w)


@pytest.mark.parametrize("argv", [["plot", "r", "--out", "/dev/null/x.png"], ["report", "bias", "--out", "d/"],
                                  ["report", "bias", "--results", "/no/such/folder"],
                                  ["plot", "/no/such/run"], ["train", "--shard", "fsdp"],
                                  ["train", "--vocab-size", "1"], ["train", "--n-pairs", "1000"],
                                  ["train", "--batch-size", "3", "--grad-accum", "2"]])
def test_h12_these_refusals_answer_before_torch_or_pandas(argv):
    """H12: each took 1.5-5 s (torch or pandas imported first); `report --out d/` wrote a file named d."""
    import subprocess
    import sys

    heavy = ("torch", "pandas", "scipy")
    code = ("import sys\nfrom seco_lab.cli import main\nrc = main(sys.argv[1:])\n"
            f"print('RC', rc, [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "RC 2 []" in out.stdout or ("RC" not in out.stdout and "usage:" in out.stderr), out.stdout + out.stderr


def test_h10_a_damaged_shard_of_a_sharded_checkpoint_is_one_named_error(tmp_path):
    """H10: a truncated shard of a `--shard fsdp` checkpoint gave raw RuntimeError tracebacks on every rank (DCP
    wraps them in a CheckpointException, a BaseException).  One process reads a DCP checkpoint without a process
    group, so the load path is tested here directly: a named RunDirError."""
    import warnings

    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from seco_lab import TinyConfig, TinyTransformer
    from seco_lab.training import sharded_checkpoint
    from seco_lab.training.run_dir import RunDirError

    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32))
    opt = torch.optim.AdamW(model.parameters())
    path = tmp_path / "step_000002.dcp"
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
    torch.save({"step": 2}, path / sharded_checkpoint.EXTRA)
    assert sharded_checkpoint.load(path, model, opt)["step"] == 2  # intact: loads
    shard = next(path.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(RunDirError, match="sharded checkpoint .*step_000002.dcp is damaged"):
        sharded_checkpoint.load(path, model, opt)



@pytest.mark.parametrize("summary", ["{}", None])
def test_j1_tables_are_never_rewritten_empty_without_audit_json(summary, audit_copy, capsys):
    """Campaign 9, J1: with audit.json damaged ({}) or deleted -- as the H1 message advised -- and units/ emptied,
    --tables-only rewrote every table from no unit (1145 lines down to 3), exit 0."""
    before = {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")}
    if summary is None:
        (audit_copy / "audit.json").unlink()
    else:
        (audit_copy / "audit.json").write_text(summary)
    shutil.move(audit_copy / "units", audit_copy.parent / "units-moved")
    (audit_copy / "units").mkdir()
    assert main(["audit", "--tables-only", "--out", str(audit_copy), "--no-progress"]) == 2
    assert "holds no usable unit" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in audit_copy.glob("*.csv")} == before
