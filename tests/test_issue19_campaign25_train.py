"""Campaign 25 (docs/hostile_campaign_25.md), N7: ``--resume`` from a checkpoint whose weights hold a NaN trained one
step and stopped with "loss is nan at step 3 ...; lower --lr, or train in --dtype float32/float64" -- advice that
cannot help (the weights were NaN before the step, and a changed --lr is refused on resume).  A checkpoint's weights
and optimizer state are now checked when it is loaded, and a non-finite one is refused by name, without falling
back to an earlier one (the file reads well: a silent fall-back would train the steps after that one again).  The
refusals fail on the code before the fix."""

import warnings
from dataclasses import replace

import pytest
import torch
from helpers import FAST, copy_run

from seco_lab.cli import main
from seco_lab.config import RunControl
from seco_lab.training.experiment import experiment_from_record, read_experiment
from seco_lab.training.run_dir import read_metrics
from seco_lab.training.trainer import NonFiniteLoss, Trainer

TENSOR = "blocks.0.attn.k_proj.weight"  # a tensor in the middle of the model's state dict, not its first


def _poison(run, step=2, where="model", name=TENSOR, value=float("nan")):
    """Write ``value`` into one element of tensor ``name`` of ``where`` (``model``, or ``optimizer``: parameter
    ``name``'s ``exp_avg``) in the checkpoint of ``step``, everything else kept."""
    path = run / "checkpoints" / f"step_{step:06d}.pt"
    state = torch.load(path, weights_only=False)
    t = state["model"][name] if where == "model" else state["optimizer"]["state"][name]["exp_avg"]
    t.view(-1)[t.numel() // 2] = value
    torch.save(state, path)
    return path


def _resume(run, capsys, steps=3):
    capsys.readouterr()
    rc = main(["train", *FAST, "--steps", str(steps), "--run-dir", str(run), "--resume"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_n7_a_checkpoint_with_non_finite_weights_is_refused_by_name(value, r2, tmp_path, capsys):
    run = copy_run(r2, tmp_path / "r")
    path = _poison(run, value=value)
    before = path.read_bytes(), (run / "metrics.jsonl").read_text()
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert f"--resume: checkpoint step_000002.pt holds non-finite weights ({TENSOR})" in err, err
    assert "damaged or was saved from a diverged run" in err and "start a new --run-dir" in err, err
    assert "lower --lr" not in err and "loss is" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    # refused before training: nothing written, no fall-back to step_000001.pt
    assert (path.read_bytes(), (run / "metrics.jsonl").read_text()) == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001.pt", "step_000002.pt"]


def test_n7_following_the_advice_resumes_from_the_checkpoint_before(r2, tmp_path, capsys):
    """The message says to move the damaged checkpoint away and delete ``checkpoints/latest``: that resumes."""
    run = copy_run(r2, tmp_path / "r")
    path = _poison(run)
    path.rename(tmp_path / path.name)
    (run / "checkpoints" / "latest").unlink()
    rc, err = _resume(run, capsys)
    assert rc == 0, err
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


def test_n7_a_non_finite_optimizer_state_is_refused_by_name(r2, tmp_path, capsys):
    run = copy_run(r2, tmp_path / "r")
    _poison(run, where="optimizer", name=3, value=float("-inf"))
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert ("--resume: checkpoint step_000002.pt holds non-finite optimizer state (optimizer state of parameter 3 "
            "(exp_avg))") in err, err
    assert "lower --lr" not in err, err


def test_n7_an_intact_checkpoint_still_resumes(r2, tmp_path, capsys):
    run = copy_run(r2, tmp_path / "r")
    rc, err = _resume(run, capsys)
    assert rc == 0, err
    assert "non-finite" not in err
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]


def test_n7_a_sharded_checkpoint_with_non_finite_weights_is_refused_by_name(r2, tmp_path, capsys):
    """A ``.dcp`` checkpoint (written by --shard fsdp runs) is read straight into the model: checked there."""
    from seco_lab.training import sharded_checkpoint

    run = copy_run(r2, tmp_path / "r")
    t = Trainer.resume(run, device="cpu", progress=False)
    t.prepare()  # step_000002.pt read into the model and optimizer
    t.close()
    state = torch.load(run / "checkpoints" / "step_000002.pt", weights_only=False)
    with torch.no_grad():
        dict(t.model.named_parameters())[TENSOR].view(-1)[0] = float("nan")
    with warnings.catch_warnings():  # DCP in one process without a process group: intended
        warnings.simplefilter("ignore")
        sharded_checkpoint.save(run / "checkpoints", 2, t.model, t.opt,
                                {k: v for k, v in state.items() if k not in ("model", "optimizer", "content_digest")})
    for p in (run / "checkpoints").glob("step_*.pt"):
        p.unlink()
    (run / "checkpoints" / "latest").write_text("step_000002.dcp")
    rc, err = _resume(run, capsys)
    assert rc == 2, err
    assert f"--resume: checkpoint step_000002.dcp holds non-finite weights ({TENSOR})" in err, err
    assert "lower --lr" not in err, err


def _trainer_with_nan_weights(r2, run, resume=True):
    """A prepared trainer of r2's experiment, resumed from a copy of r2 (or, ``resume=False``, a fresh run in
    ``run``), whose tensor TENSOR is then made NaN."""
    cfg = experiment_from_record(read_experiment(r2), str(r2))
    if resume:
        copy_run(r2, run)
    t = Trainer(replace(cfg, steps=3), RunControl(run_dir=str(run), resume=resume, device="cpu", progress=False))
    t.prepare()
    with torch.no_grad():
        dict(t.model.named_parameters())[TENSOR].fill_(float("nan"))
    return t


def test_n7_nan_weights_at_a_step_are_not_blamed_on_the_learning_rate(r2, tmp_path):
    """Weights made NaN after loading (given so, or overflowed by an earlier step): the NaN loss that follows says
    so, and does not send the user to --lr."""
    t = _trainer_with_nan_weights(r2, tmp_path / "r")
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 3") as err:
        t.fit()
    assert f"the model's weights were already non-finite before this step ({TENSOR})" in str(err.value)
    assert "lower --lr" not in str(err.value)


def test_first_non_finite_names_the_first_bad_tensor_and_skips_integers():
    from seco_lab.core.checks import first_non_finite

    sd = {"a": torch.zeros(2), "b": torch.tensor([1.0, float("inf")]), "c": torch.tensor([float("nan")]),
          "steps": torch.tensor([3])}
    assert first_non_finite(sd) == "b"
    assert first_non_finite({"a": torch.zeros(2), "steps": torch.tensor([3])}) is None
    opt = {"state": {0: {"step": torch.tensor(2.0), "exp_avg_sq": torch.tensor([float("nan")])}}, "param_groups": []}
    assert first_non_finite(opt) == "optimizer state of parameter 0 (exp_avg_sq)"
    assert first_non_finite(None) is None and first_non_finite(torch.zeros(3)) is None  # damaged entries: not here


def test_a_nan_validation_loss_is_one_message_saying_what_is_at_fault(r2, tmp_path, capsys):
    """Campaign 26 (MD32): a model that gives NaN at the first evaluation (step 0: a checkpoint with a zero rope base)
    ended in a raw FloatingPointError traceback from the engine; at a later evaluation too.  Before any step the
    model, not the training, is at fault; later the weights are checked as for a training step."""
    t = _trainer_with_nan_weights(r2, tmp_path / "r")
    with pytest.raises(NonFiniteLoss, match="the validation loss is nan at step 2") as err:
        t.evaluate()
    assert f"already non-finite before this step ({TENSOR})" in str(err.value)
    t = _trainer_with_nan_weights(r2, tmp_path / "fresh", resume=False)
    with pytest.raises(NonFiniteLoss, match="the validation loss is nan at step 0") as err:
        t.fit()
    assert "before any training step" in str(err.value) and "nothing was trained" in str(err.value)
    assert "lower --lr" not in str(err.value)
