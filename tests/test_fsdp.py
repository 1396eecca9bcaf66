"""Sharded training with FSDP2 (``--shard fsdp``) on 2 gloo processes against one process on the full batch.

Each 2-process launch runs several jobs in one process group (start-up costs seconds); the
single-process references are computed here.  What is checked:

* exactness (float64, <= 1e-10 relative on the parameters after 3 optimizer steps) for SeCO,
  SpaCO with t = k (constant relay) and SpaCO on a fixed subset with a hop-dependent scheme,
  with both gather policies and gradient accumulation, for the tiny model and a tiny HF Llama + LoRA;
* the collectives of every optimizer step against seco_lab.training.sharding's documented counts;
* sharded checkpoints: stop + resume = uninterrupted, bit for bit; a 2-rank checkpoint continued
  in one process (no process group, unsharded) = the 2-rank continuation to <= 1e-10; a replicated
  run's ``.pt`` checkpoint continued with --shard fsdp = the replicated continuation to <= 1e-10.
"""

import collections
import contextlib
import datetime
import shutil
from dataclasses import asdict, dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from seco_lab.config import RunControl, TrainConfig
from seco_lab.estimators.schemes import Sampler
from seco_lab.training.launch import leaving_process_group
from seco_lab.training.run_dir import checkpoint_steps, read_metrics
from seco_lab.training.sharding import ShardingError, count_collectives
from seco_lab.training.trainer import Trainer

TINY = dict(d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=17)
K = 4  # seq_len 32, chunk_size 8


@dataclass(frozen=True)
class FixedSubset(Sampler):
    """A uniform sampler that always draws ``subset`` (so one process and two ranks use the same I)."""

    subset: tuple = ()

    def draw(self, k, t, rng):
        return self.subset


def job(name, shard=True, gather="step", subset=None, stop_at=None, **kw):
    cfg = TrainConfig(mode="seco", data="synthetic", seq_len=32, chunk_size=8, batch_size=4, steps=3, lr=1e-2,
                      warmup=1, eval_every=100, eval_batches=1, ckpt_every=2, dtype="float64", model=dict(TINY))
    cfg = replace(cfg, **kw).validate()
    run = dict(device="cpu", progress=False, stop_at=stop_at)
    if shard:
        run.update(shard="fsdp", fsdp_gather=gather)
    return {"name": name, "cfg": cfg.to_dict(), "run": run, "subset": subset}


def full_params(model) -> dict:
    """Every parameter as a whole tensor (a DTensor shard is gathered: collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def run_job(spec, root, resume=False) -> dict:
    """Train one job (counting the collectives of every optimizer step) and return its results."""
    run = RunControl(run_dir=str(root / spec["name"]), **spec["run"])
    if resume:
        t = Trainer.resume(run.run_dir, **{k: v for k, v in asdict(run).items() if k not in ("run_dir", "resume")})
    else:
        t = Trainer(TrainConfig.from_dict(spec["cfg"]), run)
    if spec["subset"] is not None:
        t.scheme = replace(t.scheme, sampler=FixedSubset(subset=tuple(spec["subset"])))
    counts, work, step = [], [], t.train_step

    def counted(batch):
        with count_collectives() as c, count_engine_work(t.engine_model) as w:
            out = step(batch)
        counts.append(dict(c))
        work.append(dict(w))
        return out

    t.train_step = counted
    t.fit()
    return {"params": full_params(t.model), "counts": counts, "work": work, "step": t.step}


@contextlib.contextmanager
def count_engine_work(model):
    """Count the engine's chunk forwards (``model.chunk_forward`` calls) and backward passes
    (``torch.autograd.backward`` / ``torch.autograd.grad`` calls) inside the block."""
    work = collections.Counter()
    saved = {"forward": model.chunk_forward, "backward": torch.autograd.backward, "grad": torch.autograd.grad}

    def counting(kind, fn):
        def call(*args, **kwargs):
            work["forward" if kind == "forward" else "backward"] += 1
            return fn(*args, **kwargs)

        return call

    model.chunk_forward = counting("forward", saved["forward"])
    torch.autograd.backward, torch.autograd.grad = (counting(k, saved[k]) for k in ("backward", "grad"))
    try:
        yield work
    finally:
        del model.chunk_forward  # the instance attribute: the class's method shows again
        torch.autograd.backward, torch.autograd.grad = saved["backward"], saved["grad"]


def _worker(rank, world, init_file, jobs, root):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a hang fails the test instead of stalling it
    torch.set_num_threads(1)
    with leaving_process_group():  # exits the worker without the interpreter's teardown (see its docstring)
        for spec in jobs:
            if "copy" in spec:  # rank 0 copies a run directory (a checkpoint for the 1-process resume)
                if rank == 0:
                    shutil.copytree(root / spec["copy"], root / spec["to"])
                dist.barrier()
                continue
            res = run_job(spec, root, resume=spec.get("resume", False))
            if rank == 0:
                torch.save(res, root / f"{spec['name']}{'.resumed' if spec.get('resume') else ''}.result.pt")


def launch(jobs, root):
    mp.spawn(_worker, args=(2, str(root / "init"), jobs, root), nprocs=2, join=True)


def reference(spec, root) -> dict:
    """The same job in this process, unsharded, on the full batch."""
    ref = dict(spec, name=spec["name"] + "_single", run={"device": "cpu", "progress": False})
    return run_job(ref, root)


def groups_of(hf: bool) -> tuple[int, int]:
    """(G, G_t): FSDP groups (2 blocks + root) and those with trainable parameters (LoRA: the blocks)."""
    return 3, (2 if hf else 3)


def expected_counts(spec, work: dict, hf=False) -> dict:
    """seco_lab.training.sharding's documented collectives per optimizer step; ``work``: the step's engine
    chunk forwards F and backward passes B (``chunk``: one all-gather per group for each)."""
    g, g_t = groups_of(hf)
    gathers = g if spec["run"]["fsdp_gather"] == "step" else g * (work["forward"] + work["backward"])
    return {"all_gather": gathers, "reduce_scatter": g_t, "all_reduce": 2}


def engine_work(spec) -> dict:
    """F and B of one optimizer step: per micro-batch, SeCO's pass 1 forwards k - 1 chunks without a graph
    (the last chunk's cache is never read) and runs k rebuilds, each with one backward; constant-relay SpaCO
    forwards k chunks without a graph and runs t rebuilds with one backward each.  Pass 1 takes one forward
    per span of chunks (seco_lab.core.engine.pass1_span: the HF model forwards up to pass1_tokens at once,
    the tiny model one chunk at a time)."""
    from seco_lab.models.hf import HFChunkModel

    c = spec["cfg"]
    span = max(1, HFChunkModel.pass1_tokens // c["chunk_size"]) if c.get("hf_model") else 1

    def pass1(n):
        return -(-n // span)

    if c["mode"] == "seco":
        return {"forward": c["grad_accum"] * (pass1(K - 1) + K), "backward": c["grad_accum"] * K}
    return {"forward": c["grad_accum"] * (pass1(K) + c["budget"]), "backward": c["grad_accum"] * c["budget"]}


def check_against_single_process(jobs, root, hf=False):
    for spec in jobs:
        got = torch.load(root / f"{spec['name']}.result.pt")
        ref = reference(spec, root)
        err = rel_err(got["params"], ref["params"])
        assert err <= 1e-10, f"{spec['name']}: FSDP vs one process, relative error {err:.2e}"
        moved = rel_err(ref["params"], {n: p for n, p in full_params(
            Trainer(TrainConfig.from_dict(spec["cfg"]), RunControl(run_dir=str(root / "x"), device="cpu")).model
        ).items()})
        assert moved > 1e-6, f"{spec['name']}: the parameters did not move; the comparison proves nothing"
        # every rank does the one process's chunk forwards; a sharded model runs each chunk graph's
        # products fused (seco_lab.core.engine._products), so a hop-dependent relay may take fewer backward calls
        assert [w["forward"] for w in got["work"]] == [w["forward"] for w in ref["work"]], spec["name"]
        assert all(g["backward"] <= r["backward"] for g, r in zip(got["work"], ref["work"])), spec["name"]
        if spec["subset"] is None:  # SeCO and constant relay: the work itself is fixed
            assert got["work"] == [engine_work(spec)] * spec["cfg"]["steps"], spec["name"]
        assert got["counts"] == [expected_counts(spec, w, hf) for w in got["work"]], spec["name"]
        assert ref["counts"] == [{}] * spec["cfg"]["steps"]  # one process: no collective at all


@pytest.mark.slow
def test_fsdp_tiny_model_matches_one_process_and_issues_the_documented_collectives(tmp_path):
    jobs = [
        job("seco_step"),
        job("seco_chunk_accum", gather="chunk", grad_accum=2, clip=0.05),  # clipping scales every step
        job("spaco_tk_step_accum", mode="spaco", scheme="paper-capped", budget=K, grad_accum=2),
        job("spaco_subset_chunk", gather="chunk", mode="spaco", scheme="falling-factorial", budget=3,
            subset=(0, 2, 3)),  # hop-dependent factors: the per-hop relay path (autograd.grad)
    ]
    launch(jobs, tmp_path)
    check_against_single_process(jobs, tmp_path)


@pytest.mark.slow
def test_fsdp_hf_llama_with_lora_matches_one_process(tmp_path):
    hf = dict(hf_model="llama", lora=True, model=None)
    jobs = [
        job("hf_seco_step", clip=0.05, **hf),  # the sharded global norm clips every step
        job("hf_spaco_subset_chunk", gather="chunk", mode="spaco", scheme="falling-factorial", budget=3,
            subset=(0, 1, 3), **hf),
    ]
    launch(jobs, tmp_path)
    check_against_single_process(jobs, tmp_path, hf=True)
    from safetensors.torch import load_file  # the adapter a sharded run writes = the one-process run's

    for name in ("hf_seco_step", "hf_spaco_subset_chunk"):
        a, b = (load_file(tmp_path / n / "adapter" / "adapter_model.safetensors") for n in (name, name + "_single"))
        assert sorted(a) == sorted(b) and len(a) == 8  # lora_A, lora_B on q_proj, v_proj of 2 layers
        assert rel_err(a, b) <= 1e-10, name


@pytest.mark.slow
def test_sharded_checkpoints_resume_bit_for_bit_on_one_rank_and_from_replicated(tmp_path):
    spaco = dict(mode="spaco", scheme="paper-capped", budget=2, steps=4)  # rank-dependent random draws
    jobs = [
        job("spaco_full", **spaco),
        job("spaco_split", stop_at=2, **spaco),
        dict(job("spaco_split", **spaco), resume=True),
        job("seco_full", steps=4, gather="chunk"),
        job("seco_split", stop_at=2, steps=4, gather="chunk"),
        {"copy": "seco_split", "to": "seco_one_rank"},
        dict(job("seco_split", steps=4, gather="chunk"), resume=True),
        job("rep_full", shard=False, steps=4),  # replicated (2 ranks), its .pt checkpoint continued sharded
        job("rep_split", shard=False, stop_at=2, steps=4),
        dict(job("rep_split", steps=4), resume=True),
    ]
    launch(jobs, tmp_path)
    for name in ("spaco", "seco"):
        full = torch.load(tmp_path / f"{name}_full.result.pt")
        resumed = torch.load(tmp_path / f"{name}_split.resumed.result.pt")
        assert resumed["step"] == 4 and checkpoint_steps(tmp_path / f"{name}_split") == [2, 4]
        assert all(torch.equal(full["params"][n], resumed["params"][n]) for n in full["params"]), name
        la = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(tmp_path / f"{name}_full")]
        lb = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(tmp_path / f"{name}_split")]
        assert la == lb, name
    assert sorted(p.name for p in (tmp_path / "seco_full" / "checkpoints").iterdir()) == [
        "latest", "step_000002.dcp", "step_000004.dcp"]
    # the 2-rank checkpoint of step 2, continued by one unsharded process
    one = Trainer.resume(tmp_path / "seco_one_rank", device="cpu", progress=False)
    assert one.sharded is None
    one.fit()
    full = torch.load(tmp_path / "seco_full.result.pt")["params"]
    err = rel_err(full_params(one.model), full)
    assert err <= 1e-10, f"2-rank checkpoint continued on 1 rank: relative error {err:.2e}"
    # a replicated run's step_2.pt continued with --shard fsdp = the replicated run's own continuation
    rep = torch.load(tmp_path / "rep_full.result.pt")["params"]
    err = rel_err(torch.load(tmp_path / "rep_split.resumed.result.pt")["params"], rep)
    assert err <= 1e-10, f"replicated checkpoint continued sharded: relative error {err:.2e}"
    assert checkpoint_steps(tmp_path / "rep_split") == [2, 4]
    assert (tmp_path / "rep_split" / "checkpoints" / "step_000004.dcp").is_dir()


def test_shard_fsdp_without_a_process_group_says_how_to_launch(tmp_path):
    spec = job("nopg")
    with pytest.raises(ShardingError, match="needs a process group: launch under torchrun"):
        Trainer(TrainConfig.from_dict(spec["cfg"]), RunControl(run_dir=str(tmp_path / "r"), **spec["run"]))


def test_chunk_gather_refuses_a_sampler_whose_draw_size_differs_between_ranks(tmp_path):
    """Per-chunk gathers need the same number of chunk forwards/backwards on every rank; a Bernoulli
    draw differs per rank (a reviewer's 2-rank run deadlocked), so it is refused before any collective."""
    spec = job("bern", gather="chunk", mode="spaco", scheme="bernoulli", budget=2)
    with pytest.raises(ShardingError, match="draws a different number of chunks on each rank"):
        Trainer(TrainConfig.from_dict(spec["cfg"]), RunControl(run_dir=str(tmp_path / "r"), **spec["run"]))
    for gather, scheme in (("chunk", "falling-factorial"), ("step", "bernoulli")):  # allowed: reaches the launch check
        spec = job("ok", gather=gather, mode="spaco", scheme=scheme, budget=2)
        with pytest.raises(ShardingError, match="needs a process group"):
            Trainer(TrainConfig.from_dict(spec["cfg"]), RunControl(run_dir=str(tmp_path / gather), **spec["run"]))


def test_gather_policy_is_validated_and_needs_shard_fsdp():
    with pytest.raises(ValueError, match="--fsdp-gather applies to --shard fsdp only"):
        RunControl(fsdp_gather="chunk").validate()
    with pytest.raises(ValueError, match="unknown fsdp_gather 'layer'"):
        RunControl(shard="fsdp", fsdp_gather="layer").validate()


def test_cli_shard_fsdp_outside_torchrun_fails_with_the_launch_recipe(tmp_path, capsys):
    from seco_lab.cli import main

    code = main(["train", "--shard", "fsdp", "--run-dir", str(tmp_path / "r"), "--steps", "1", "--device", "cpu"])
    assert code == 2
    assert "--shard fsdp needs a process group: launch under torchrun" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_fsdp_bench_section_takes_ratios_within_each_round():
    import pandas as pd

    from seco_lab.report.bench_fsdp import summarize

    rows = []
    for rnd, slow in ((0, 1.0), (1, 2.0), (2, 4.0)):  # a machine slowing down: ratios stay 0.5 / 1.5
        for mode, peak, step in (("replicated", 900, 1.0), ("fsdp step", 600, 1.5), ("fsdp chunk", 500, 3.0)):
            for rank in (0, 1):
                rows.append(dict(round=rnd, mode=mode, rank=rank, base_mib=300, peak_mib=peak + rank,
                                 step_s=step * slow * (1 + 0.1 * rank), all_gather=3, reduce_scatter=3, all_reduce=2))
    s = summarize(pd.DataFrame(rows)).set_index("mode")
    assert list(s.index) == ["replicated", "fsdp step", "fsdp chunk"]
    assert s.loc["fsdp step", "memory_ratio"] == pytest.approx(601 / 901)
    assert s.loc["fsdp step", "above_ratio"] == pytest.approx(301 / 601)
    assert s.loc["fsdp chunk", "time_ratio"] == pytest.approx(3.0)
    assert s.loc["replicated", "rounds"] == 3 and s.loc["replicated", "step_s"] == pytest.approx(2.2)


def test_stored_fsdp_benchmark_shows_the_documented_collectives_and_less_memory():
    """reports/bench/fsdp_results.csv (make bench-fsdp): 8 blocks + root = 9 groups, k = 4, one micro-batch."""
    import json
    from pathlib import Path

    import pandas as pd

    from seco_lab.report.bench_fsdp import summarize

    df = pd.read_csv(Path(__file__).parents[1] / "reports" / "bench" / "fsdp_results.csv")
    g = json.loads(df.model.iloc[0])["n_layers"] + 1
    k = int(df.seq_len.iloc[0] // df.chunk_size.iloc[0])
    s = summarize(df).set_index("mode")
    assert s.loc["fsdp step", ["all_gather", "reduce_scatter", "all_reduce"]].tolist() == [g, g, 2]
    assert s.loc["fsdp chunk", ["all_gather", "reduce_scatter", "all_reduce"]].tolist() == [g * (3 * k - 1), g, 2]
    assert s.loc["replicated", ["all_gather", "reduce_scatter"]].tolist() == [0, 0]
    assert s.loc["fsdp chunk", "memory_ratio"] < s.loc["fsdp step", "memory_ratio"] < 1.0
