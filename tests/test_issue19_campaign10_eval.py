"""Campaign 10, K4: a distributed run evaluated rank 0's share only.  ``Trainer.evaluate`` built
``batch_size // world`` validation sequences -- the same ones on every rank -- and never combined the
ranks, so a 2-rank run's eval_loss was a 1-process ``--batch-size 1`` value (a resume across world sizes
showed a jump in the eval curve).  Now every rank evaluates its slice of the global validation batch and the
loss sums and target counts are all-reduced: the same numbers as one process, replicated or ``--shard fsdp``."""

import datetime
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from seco_lab.config import RunControl, TrainConfig
from seco_lab.training.launch import leaving_process_group
from seco_lab.training.run_dir import read_metrics
from seco_lab.training.trainer import Trainer

TINY = dict(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=17)
CFG = TrainConfig(mode="seco", data="synthetic", seq_len=32, chunk_size=8, batch_size=2, steps=1, lr=1e-2, warmup=0,
                  eval_every=1, eval_batches=2, ckpt_every=1, model=dict(TINY))  # float32, as the CLI's default
SHARDS = ("none", "fsdp")


def _worker(rank, world, init_file, root):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # a hang fails the test instead of stalling it
    torch.set_num_threads(1)
    with leaving_process_group():  # exits the worker without the interpreter's teardown (see its docstring)
        for shard in SHARDS:
            run = RunControl(run_dir=f"{root}/{shard}", device="cpu", progress=False, shard=shard)
            Trainer(replace(CFG), run).fit()


def _evals(run_dir):
    return {r["step"]: (r["eval_loss"], r["eval_far_loss"]) for r in read_metrics(run_dir) if "eval_loss" in r}


@pytest.mark.slow
def test_k4_two_ranks_evaluate_the_one_process_validation_batch(tmp_path):
    Trainer(replace(CFG), RunControl(run_dir=str(tmp_path / "single"), device="cpu", progress=False)).fit()
    single = _evals(tmp_path / "single")
    assert sorted(single) == [0, 1]
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for shard in SHARDS:
        got = _evals(tmp_path / shard)
        assert sorted(got) == [0, 1], shard
        for step in (0, 1):
            assert got[step] == pytest.approx(single[step], rel=1e-6), (shard, step, got[step], single[step])
    # the old value (rank 0's first sequence alone) differs from the global batch's by far more than the tolerance
    rank0 = Trainer(replace(CFG, batch_size=1),
                    RunControl(run_dir=str(tmp_path / "rank0"), device="cpu", progress=False)).evaluate()
    assert abs(rank0["eval_loss"] - single[0][0]) > 1e-4 * single[0][0]


def test_k4_a_slice_without_far_targets_adds_nothing(tmp_path):
    """A rank whose slice holds no far target contributes a zero sum and count (not a refused forward)."""
    t = Trainer(replace(CFG), RunControl(run_dir=str(tmp_path / "r"), device="cpu", progress=False))
    b = t.rank_slice(t.data.batch("val", 0, CFG.batch_size))
    assert t._loss_sum(b.tokens, torch.full_like(b.targets, -100), b.targets) == (0.0, 0)
    total, n = t._loss_sum(b.tokens, b.targets, b.targets)
    assert n == b.targets.numel() and total == pytest.approx(float(t.forward_loss(b.tokens, b.targets)) * n)
