"""The trainer: exactness against dense, bit-for-bit resume, data parallelism, the step's parts."""

import datetime
import math
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from seco_lab.config import RunControl, TrainConfig
from seco_lab.estimators.schemes import SCHEME_NAMES, get_scheme
from seco_lab.training.launch import leaving_process_group
from seco_lab.training.run_dir import read_metrics
from seco_lab.training.step import allreduce_mean, lr_factor
from seco_lab.training.trainer import NonFiniteLoss, Trainer

TINY = dict(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=17)


def cfg_for(tmp_path, name="run", run=None, **kw):
    base = TrainConfig(mode="seco", data="synthetic", seq_len=40, chunk_size=8, batch_size=4, steps=5, lr=1e-2,
                       warmup=2, eval_every=2, eval_batches=1, ckpt_every=2, dtype="float64", model=dict(TINY))
    return replace(base, **kw), RunControl(run_dir=str(tmp_path / name), device="cpu", progress=False, **(run or {}))


def params_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_seco_training_equals_dense_training(tmp_path):
    runs = {}
    for mode in ("dense", "seco"):
        t = Trainer(*cfg_for(tmp_path, mode, mode=mode))
        t.fit()
        runs[mode] = (params_of(t), [r["loss"] for r in read_metrics(t.run_dir.path) if "loss" in r])
    assert rel_err(runs["seco"][0], runs["dense"][0]) <= 1e-10
    assert runs["seco"][1] == pytest.approx(runs["dense"][1], rel=1e-12)
    assert len(runs["seco"][1]) == 5


@pytest.mark.parametrize("mode", ["seco", "spaco"])
def test_stop_and_resume_matches_uninterrupted_run(tmp_path, mode):
    kw = dict(mode=mode, steps=6, **(dict(scheme="paper-capped", budget=2) if mode == "spaco" else {}))
    full = Trainer(*cfg_for(tmp_path, "full", **kw))
    full.fit()
    first = Trainer(*cfg_for(tmp_path, "split", run=dict(stop_at=3), **kw))
    first.fit()
    assert first.step == 3
    second = Trainer.resume(tmp_path / "split", device="cpu", progress=False)  # the saved config is the truth
    second.fit()
    assert second.step == 6
    a, b = params_of(full), params_of(second)
    assert all(torch.equal(a[n], b[n]) for n in a)
    la = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(full.run_dir.path)]
    lb = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(second.run_dir.path)]
    assert la == lb


def _dist_worker(rank, world, init_file, cfg_dict, run_dict, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of stalling it
    torch.set_num_threads(1)
    with leaving_process_group():  # exits the worker without the interpreter's teardown (see its docstring)
        t = Trainer(TrainConfig.from_dict(cfg_dict), RunControl(**run_dict))
        t.fit()
        if rank == 0:
            torch.save({"params": params_of(t), "allreduce_calls": t.allreduce_calls}, out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["seco", "spaco"])
def test_two_gloo_processes_match_one_process_on_the_full_batch(tmp_path, mode):
    kw = dict(mode=mode, steps=3, **(dict(budget=5) if mode == "spaco" else {}))  # t = k: deterministic
    single = Trainer(*cfg_for(tmp_path, "single", **kw))
    single.fit()
    cfg, run = cfg_for(tmp_path, "ddp", **kw)
    out = tmp_path / "ddp.pt"
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), cfg.to_dict(), asdict(run), str(out)), nprocs=2, join=True)
    got = torch.load(out)
    assert rel_err(got["params"], params_of(single)) <= 1e-10
    assert got["allreduce_calls"] == 3  # once per optimizer step (float64: gradients and stats in one buffer)


def test_every_scheme_trains_with_its_budget_and_moves_the_parameters(tmp_path):
    for name in SCHEME_NAMES:
        cfg, run = cfg_for(tmp_path, name, mode="spaco", scheme=name, budget=2, steps=2, warmup=1)
        t = Trainer(cfg, run)
        before = params_of(t)
        t.fit()
        recs = [r for r in read_metrics(t.run_dir.path) if "loss" in r]
        sampler = get_scheme(name).sampler
        # an independent redraw with the trainer's seeding rule [seed, step, micro, rank]
        expect = [len(sampler.draw(cfg.num_chunks, cfg.budget, np.random.default_rng([cfg.seed, s, 0, 0])))
                  for s in range(2)]
        assert [r["backprop_chunks"] for r in recs] == expect, name
        if sampler.kind == "uniform":
            assert expect == [cfg.budget, cfg.budget]
        assert all(math.isfinite(r["loss"]) for r in recs)
        moved = params_of(t)
        assert all(not torch.equal(before[n], moved[n]) for n in before), name


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    one = Trainer(*cfg_for(tmp_path, "one", steps=2, warmup=1))
    one.fit()
    acc = Trainer(*cfg_for(tmp_path, "acc", steps=2, warmup=1, grad_accum=2))
    acc.fit()
    assert rel_err(params_of(acc), params_of(one)) <= 1e-10


def test_a_non_finite_loss_stops_the_run_and_keeps_the_checkpoint_before(tmp_path):
    cfg, run = cfg_for(tmp_path, "nan", steps=6)
    Trainer(cfg, replace(run, stop_at=2)).fit()
    t = Trainer(cfg, replace(run, resume=True))
    t.prepare()
    with torch.no_grad():
        next(iter(t.model.parameters())).fill_(float("nan"))
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 3"):
        t.fit()
    assert (t.run_dir.checkpoints / "latest").read_text() == "step_000002.pt"
    assert not (t.run_dir.checkpoints / "step_000003.pt").exists()
    assert max(r["step"] for r in read_metrics(t.run_dir.path)) == 2
    again = Trainer(cfg, replace(run, resume=True))  # the run stays resumable, and the lock was released
    again.fit()
    assert again.step == 6


def test_allreduce_keeps_the_statistics_in_float64_whatever_the_parameters_dtype():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    p.grad = torch.tensor([2.0, 4.0, 6.0], dtype=torch.bfloat16)
    stats, calls = allreduce_mean([p], {"loss": 4.654321987, "chunks": 7}, count=2, world=1)
    assert stats == {"loss": 4.654321987 / 2, "chunks": 3.5}  # bfloat16 would give 2.328125
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)) and calls == 0


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    w, s, r = 4, 20, 0.1
    assert [lr_factor(i, w, s, r) for i in range(w)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(w, w, s, r) == 1.0 and lr_factor(s, w, s, r) == pytest.approx(r, abs=1e-15)
    mid = w + (s - w) // 2
    assert lr_factor(mid, w, s, r) == pytest.approx(r + (1 - r) / 2, abs=1e-15)
    assert lr_factor(10 * s, w, s, r) == pytest.approx(r, abs=1e-15)
    assert lr_factor(0, 0, s, r) == 1.0


@pytest.mark.slow
def test_seco_learns_the_long_range_task(tmp_path):
    """The queried value is uniform over K values and appears only in chunk 0 of 4: a model
    that ignores earlier chunks cannot get its loss below ln K. SeCO must get well below."""
    cfg = TrainConfig(mode="seco", data="synthetic", seq_len=32, chunk_size=8, batch_size=16, steps=300, lr=3e-3,
                      warmup=20, eval_every=300, eval_batches=4, ckpt_every=300, dtype="float32", seed=0,
                      model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=32))
    t = Trainer(cfg, RunControl(run_dir=str(tmp_path / "kv"), device="cpu", progress=False))
    last = t.fit()
    start = read_metrics(t.run_dir.path)[0]["eval_far_loss"]
    floor_without_memory = math.log(t.data.n_keys)
    assert last["eval_far_loss"] < 0.5 * floor_without_memory < start
