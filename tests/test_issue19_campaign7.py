"""Issue 19, seventh hostile campaign (244 probes by a reviewer who wrote none of the fixes, on a fresh clone of
626a65f): each finding with the test of its fix.  G-numbers are the campaign's (docs/hostile_campaign_7.md)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FAST, copy_run

from seco_lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """r2 (2 steps) and r4 (4 steps): equal settings but the schedule length, so equal fingerprints."""
    base = tmp_path_factory.mktemp("runs")
    assert main(["train", *FAST, "--run-dir", str(base / "r2")]) == 0
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(base / "r4")]) == 0
    return base


def _resume(run, capsys, *extra):
    capsys.readouterr()
    rc = main(["train", *FAST, "--steps", "3", "--run-dir", str(run), "--resume", *extra])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("marker", ["deleted", "garbage", "a list", "over 4 KiB", "no run id"])
def test_g1_without_a_readable_marker_another_runs_checkpoint_is_still_refused(marker, runs, tmp_path, capsys):
    """G1: with the marker deleted or damaged the run-id check switched itself off, and r4's step-2 checkpoint
    copied over r2's resumed with r4's learning rates.  A damaged marker is refused by name; a missing one (or
    one older than run ids) is replaced by the id the folder's checkpoints agree on, and checkpoints of two
    runs in one folder are refused."""
    r = copy_run(runs / "r2", tmp_path / "r")
    m = r / ".seco-lab-run"
    if marker == "deleted":
        m.unlink()
    elif marker == "garbage":
        m.write_text("x")
    elif marker == "a list":
        m.write_text(json.dumps({"tool": "seco-lab", "run_id": ["x"]}))
    elif marker == "over 4 KiB":
        m.write_text(json.dumps({"tool": "seco-lab", "run_id": json.loads(m.read_text())["run_id"], "x": "y" * 5000}))
    else:  # a folder made before run ids had {"tool": "seco-lab"}
        m.write_text(json.dumps({"tool": "seco-lab"}))
    shutil.copy(runs / "r4/checkpoints/step_000002.pt", r / "checkpoints/step_000002.pt")
    rc, err = _resume(r, capsys)
    assert rc == 2 and "Traceback" not in err
    if marker in ("deleted", "no run id"):
        assert "different runs" in err and "step_000002.pt" in err
    else:
        assert "marker" in err and "damaged" in err
    assert not (r / "checkpoints/step_000003.pt").exists()


def test_g1_a_deleted_marker_is_written_again_from_the_checkpoints_and_the_run_continues_exactly(runs, tmp_path,
                                                                                                  capsys):
    """G1 (B12): a resume in a folder without its marker recorded run id None in its new checkpoints, so the
    folder stayed unprotected.  The marker comes back with the id the checkpoints record, and the continuation
    equals the undamaged folder's continuation bit for bit."""
    own = copy_run(runs / "r2", tmp_path / "own")
    r = copy_run(runs / "r2", tmp_path / "r")
    run_id = json.loads((r / ".seco-lab-run").read_text())["run_id"]
    (r / ".seco-lab-run").unlink()
    assert _resume(own, capsys)[0] == 0
    assert _resume(r, capsys)[0] == 0
    assert json.loads((r / ".seco-lab-run").read_text())["run_id"] == run_id
    a, b = (torch.load(d / "checkpoints/step_000003.pt", weights_only=True) for d in (own, r))
    assert b["run_id"] == run_id
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_g1_a_lone_foreign_checkpoint_without_a_marker_is_refused_by_its_schedule(runs, tmp_path, capsys):
    """G1 (V1a with one checkpoint): no sibling to disagree with, but r4's checkpoint was trained on a 4-step
    schedule while r2's config.json records 2 steps."""
    r = copy_run(runs / "r2", tmp_path / "r")
    (r / ".seco-lab-run").unlink()
    (r / "checkpoints/step_000001.pt").unlink()
    shutil.copy(runs / "r4/checkpoints/step_000002.pt", r / "checkpoints/step_000002.pt")
    rc, err = _resume(r, capsys)
    assert rc == 2 and "another learning-rate schedule" in err and "[[0, 4]]" in err and "[[0, 2]]" in err


def test_g2_copies_of_one_run_extended_differently_do_not_swap_checkpoints(runs, tmp_path, capsys):
    """G2: a and b are copies of r2 (one run id).  a was extended with --rewarm, b without; a's step-3 checkpoint
    copied into b resumed b on a's trajectory.  The checkpoint's schedule up to its step must be the one b's
    config.json records; b's own continuation still resumes."""
    a, b = copy_run(runs / "r2", tmp_path / "a"), copy_run(runs / "r2", tmp_path / "b")
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(a), "--resume", "--rewarm"]) == 0
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume", "--stop-at", "3"]) == 0
    own = tmp_path / "own.pt"
    shutil.copy(b / "checkpoints/step_000003.pt", own)
    shutil.copy(a / "checkpoints/step_000003.pt", b / "checkpoints/step_000003.pt")
    capsys.readouterr()
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "another learning-rate schedule" in err and "[[0, 2], [2, 4]]" in err
    shutil.copy(own, b / "checkpoints/step_000003.pt")
    assert main(["train", *FAST, "--steps", "4", "--run-dir", str(b), "--resume"]) == 0


@pytest.mark.parametrize("steps, words", [("1e400", "steps"), ('"2"', "steps"), ("4", "another learning-rate "
                                                                                     "schedule"),
                                          ("0", "steps")])
def test_g3_an_edited_schedule_in_config_json_is_refused_on_resume(steps, words, runs, tmp_path, capsys):
    """G3: config.json's steps edited to 1e400 or 4 was used unchecked (a wrong continuation), "2" raised a
    TypeError from the schedule.  The record is checked as the command line is, and its schedule against the
    checkpoint's."""
    r = copy_run(runs / "r2", tmp_path / "r")
    text = (r / "config.json").read_text()
    assert '"steps": 2' in text
    (r / "config.json").write_text(text.replace('"steps": 2', f'"steps": {steps}'))
    rc, err = _resume(r, capsys)
    assert rc == 2 and words in err and "config.json" in err and "Traceback" not in err


def test_g5_chain_basis_estimate_checks_its_subset_and_weights():
    """G5: ChainBasis.estimate truncated 2.7 to 2, took index 7 of a 5-chunk sequence as absent, and raised
    OverflowError / 'negative shift count' / a bare IndexError.  It checks them as spaco_grad does; a valid
    subset still gives the enumeration's number (sum of W(p) v_c over the chains inside it)."""
    from seco_lab import TinyConfig, TinyTransformer, chain_basis, get_scheme

    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32)).double()
    t = torch.randint(0, 32, (2, 20))
    cb = chain_basis(model, t, t, 4, max_hops=4)
    w = get_scheme("paper").chain_weights(5, 2, 4)
    for bad in ([0, 2.7], [0, 7], [99], [-1], [1, 1], "01"):
        with pytest.raises((TypeError, ValueError), match="subset"):
            cb.estimate(bad, w)
    for weights in (w[:3], [float("nan")] * 5, [[1.0] * 5]):
        with pytest.raises(ValueError, match="chain_weights"):
            cb.estimate([0, 2], weights)
    inside = [c for c, chain in enumerate(cb.chains) if set(chain) <= {0, 2}]
    want = sum(float(w[cb.hops[c]]) * cb.vectors[c] for c in inside)
    assert torch.allclose(cb.estimate([2, 0], w), want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("script, argv, words", [
    ("bench", ["--threads", "0"], "--threads"), ("bench", ["--lengths", "-5"], "--lengths"),
    ("bench", ["--lengths", "0"], "--lengths"), ("bench", ["--device", "tpu"], "unknown device"),
    ("bench_fsdp", ["--quick", "--rounds", "0"], "--rounds"), ("bench_fsdp", ["--steps", "-1"], "--steps"),
    ("bench_strata", ["--length", "-5"], "--length"), ("bench_strata", ["--chunk-size", "0"], "--chunk-size"),
    ("bench_strata", ["--timeout", "nan"], "--timeout"), ("bench_strata", ["--before", "no-such-rev"], "no such "
                                                                                                      "commit"),
    ("bench_strata", ["--length", "100"], "at least 4 chunks"), ("strata_cost", ["--chunks", "0"], "--chunks"),
    ("strata_cost", ["--layers", "-1"], "--layers"), ("train_compare", [], "not a folder"),
    ("bench", [], "not a folder"), ("bench_fsdp", [], "not a folder"), ("bench_strata", [], "not a folder"),
])
def test_g4_every_benchmark_script_refuses_bad_arguments_before_measuring(script, argv, words, tmp_path, capsys):
    """G4: the benchmark scripts other than bench_hf took these: `bench_fsdp --rounds 0` wrote an empty table and
    exited 0, `bench --threads 0` was ignored, `bench_strata --length -5` ran 22 s into a KeyError, `--timeout nan`
    and `strata_cost --chunks 0` raised tracebacks, `train_compare --out /dev/null/x` failed after training.
    (--out lies under a file unless the case is about it: an argument accepted again fails at once instead of
    measuring.)"""
    import importlib

    (tmp_path / "file").write_text("")
    module = importlib.import_module(f"experiments.{script}")
    out = [] if script == "strata_cost" else ["--out", str(tmp_path / "file" / "o")]
    with pytest.raises(SystemExit) as stop:
        module.main([*argv, *out])
    assert stop.value.code == 2
    assert words in capsys.readouterr().err


def test_g8_metrics_whose_steps_repeat_are_refused_before_training(runs, tmp_path, capsys):
    """G8: metrics.jsonl with its records doubled resumed, trained step 3, then died drawing the curve with a
    traceback.  The resume refuses it first (nothing trained); a curve that cannot be drawn after a run is a
    warning, not a failure of the run."""
    r = copy_run(runs / "r2", tmp_path / "r")
    text = (r / "metrics.jsonl").read_text()
    (r / "metrics.jsonl").write_text(text + text)
    rc, err = _resume(r, capsys)
    assert rc == 2 and "steps repeat or go backwards" in err and "Traceback" not in err
    assert not (r / "checkpoints/step_000003.pt").exists()
    from seco_lab.cli import draw_curve

    draw_curve(str(r))
    assert "the loss curve was not drawn" in capsys.readouterr().err


def test_g10_a_model_with_gradient_checkpointing_enabled_is_refused_by_name():
    """G10: hf.gradient_checkpointing_enable() (transformers then drops the KV cache in training) gave a shape
    mismatch from deep inside the attention; SeCOTrainer refused only TrainingArguments(gradient_checkpointing)."""
    from seco_lab import seco_grad
    from seco_lab.models.hf import HFChunkModel, build_hf_model

    hf = build_hf_model("llama")
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()  # newer name first
    model = HFChunkModel(hf).train()
    t = torch.randint(0, 64, (1, 24))
    with pytest.raises(ValueError, match="gradient checkpointing is enabled"):
        seco_grad(model, t, t, 4)
    model.eval()  # in eval mode transformers keeps the cache: allowed
    seco_grad(model, t, t, 4)


def test_g11_report_quick_with_results_and_out_is_refused(tmp_path, capsys):
    """G11: `report bias --quick --results DIR --out FILE` silently dropped --quick (it only picks folders)."""
    with pytest.raises(SystemExit) as stop:
        main(["report", "bias", "--quick", "--results", str(ROOT / "reports/bias_study"), "--out",
              str(tmp_path / "x.md")])
    assert stop.value.code == 2 and "drop --quick" in capsys.readouterr().err
    assert not (tmp_path / "x.md").exists()


def test_g12_messages_say_what_is_wrong(runs, tmp_path, capsys):
    """G12: HopStrata.combine([nan]) said the weight 'exceeds the range of its dtype'; combine(None) a bare
    'NoneType is not iterable'; accumulate_grads with a complex gradient torch's cast error; `plot` on a
    metrics.jsonl that is a FIFO 'not a run directory (no metrics.jsonl)'."""
    import os

    from seco_lab import TinyConfig, TinyTransformer, hop_strata
    from seco_lab.core.grads import accumulate_grads

    torch.manual_seed(0)
    model = TinyTransformer(TinyConfig(vocab_size=32, d_model=16, d_ff=32)).double()
    t = torch.randint(0, 32, (2, 20))
    hs = hop_strata(model, t, t, 4, max_hops=4)
    with pytest.raises(ValueError, match="W\\(0\\) is NaN"):
        hs.combine([float("nan")] * 5)
    with pytest.raises(TypeError, match="weights must be a sequence"):
        hs.combine(None)
    name, p = next(iter(model.named_parameters()))
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="accumulate_grads: the gradient of"):
        accumulate_grads(model, {name: torch.zeros_like(p, dtype=torch.complex128)})
    r = copy_run(runs / "r2", tmp_path / "r")
    (r / "metrics.jsonl").unlink()
    os.mkfifo(r / "metrics.jsonl")
    capsys.readouterr()
    assert main(["plot", str(r), "--out", str(tmp_path / "p.png")]) == 2
    assert "FIFO" in capsys.readouterr().err


def test_a_recursion_error_of_our_own_code_is_not_blamed_on_a_file(monkeypatch):
    """The command line turns a RecursionError into "a file it read nests too deeply" (campaign 6, F2) only when
    a JSON or TOML parser raised it: a recursion bug of the package itself keeps its traceback."""
    import seco_lab.cli as cli

    def bug(_argv):
        def down(n):
            return down(n + 1)
        return down(0)

    monkeypatch.setattr(cli, "plot_main", bug)
    with pytest.raises(RecursionError):
        main(["plot", "x"])


def test_a_damaged_model_cell_of_the_fsdp_table_is_named(tmp_path):
    """Noticed in the stored-reads round: `render` parsed the CSV's model column with a bare json.loads, so a
    damaged cell gave a JSONDecodeError traceback from `seco-lab report bench`."""
    import pandas as pd

    from seco_lab.report.bench_fsdp import render
    from seco_lab.report.markdown import MissingResultsError

    df = pd.read_csv(ROOT / "reports/bench/fsdp_results.csv")
    assert render(ROOT / "reports/bench")  # the committed table renders
    for cell in ("{not json", "[1, 2]"):
        df.assign(model=cell).to_csv(tmp_path / "fsdp_results.csv", index=False)
        with pytest.raises(MissingResultsError, match="model column"):
            render(tmp_path)
