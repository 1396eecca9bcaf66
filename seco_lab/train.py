"""A SeCO / SpaCO trainer: AdamW, warm-up + cosine, accumulation, clipping,
evaluation, checkpoints that resume bit for bit, and data-parallel training.

Gradients of one optimizer step come from ``grad_accum`` micro-batches on every
rank; each micro-batch uses the chosen engine (``dense``, ``seco`` or ``spaco``),
and ranks all-reduce the accumulated gradient once per optimizer step (a single
flat buffer), never per chunk backward.  SpaCO draws its chunk subsets from
``numpy.random.default_rng([seed, step, micro, rank])``: every rank draws its own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .data import Batch, KeyValueTask, TextCorpus
from .engine import cache_leaves, dense_grad, prepare, seco_grad
from .estimators import spaco_grad
from .model import TinyConfig, TinyTransformer
from .schemes import SCHEME_NAMES, get_scheme

MODES = ("dense", "seco", "spaco")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# Fields that may differ between a run and its resumption.
RESUME_FREE = ("stop_at", "resume", "overwrite", "progress")


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    mode: str = "seco"
    scheme: str = "falling-factorial"
    budget: int = 2
    cap: float | None = None
    data: str = "synthetic"  # "synthetic" or "text"
    text_paths: list[str] = field(default_factory=list)  # empty: the Python standard library
    seq_len: int = 256
    chunk_size: int = 32
    batch_size: int = 8  # sequences per optimizer step, summed over ranks and micro-batches
    grad_accum: int = 1
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup: int = 20
    min_lr_ratio: float = 0.1
    clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 2
    ckpt_every: int = 50
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    n_pairs: int = 1
    model: dict = field(default_factory=lambda: dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128))
    # Hugging Face model instead of the tiny transformer: a local checkpoint directory, or an architecture
    # name ("llama", "qwen2") built with random weights from `hf_overrides`
    hf_model: str | None = None
    hf_overrides: dict = field(default_factory=dict)
    attn_implementation: str = "sdpa"
    lora: bool = False
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    stop_at: int | None = None  # stop (after checkpointing) at this step; the schedule still spans `steps`
    resume: bool = False
    overwrite: bool = False
    progress: bool = True

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.mode == "spaco":
            if self.scheme not in SCHEME_NAMES:
                raise ValueError(f"unknown scheme {self.scheme!r}; valid schemes: {', '.join(SCHEME_NAMES)}")
            self.build_scheme()
        if self.data not in ("synthetic", "text"):
            raise ValueError(f"unknown data {self.data!r}; choose 'synthetic' or 'text'")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("seq_len", "chunk_size", "batch_size", "grad_accum", "steps", "eval_batches", "ckpt_every",
                     "eval_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        k = self.num_chunks
        if self.mode == "spaco" and not 1 <= self.budget <= k:
            raise ValueError(f"budget t={self.budget} must lie in [1, k] with k = ceil(seq_len / chunk_size) = {k}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in [1, steps={self.steps}], got {self.stop_at}")
        for p in self.text_paths:
            if not Path(p).exists():
                raise FileNotFoundError(f"text path not found: {p}")

    @property
    def num_chunks(self) -> int:
        return -(-self.seq_len // self.chunk_size)

    def build_scheme(self):
        return get_scheme(self.scheme) if self.cap is None else get_scheme(self.scheme, cap=self.cap)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown config keys: {', '.join(sorted(unknown))}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_lr_ratio`` at ``steps``."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda requested but CUDA is not available")
    return torch.device(name)


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class Trainer:
    """Train a chunk model with dense backprop, SeCO or SpaCO.

    ``Trainer(cfg).fit()`` returns the final metrics; the run directory holds
    ``config.json``, ``metrics.jsonl``, ``checkpoints/`` and ``loss.png``.
    """

    def __init__(self, cfg: TrainConfig, model=None, data=None):
        cfg.validate()
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if cfg.batch_size % (self.world * cfg.grad_accum):
            raise ValueError(
                f"batch_size={cfg.batch_size} must be divisible by world_size x grad_accum = "
                f"{self.world} x {cfg.grad_accum}"
            )
        self.device = pick_device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.data = data or self._build_data()
        self.model = model or self._build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        self.step = 0
        self.run_dir = Path(cfg.run_dir)
        self.allreduce_calls = 0
        self._prepared = False
        self._step_batch: Batch | None = None
        self.scheme = cfg.build_scheme() if cfg.mode == "spaco" else None

    # ------------------------------------------------------------------ setup
    def _build_model(self):
        cfg, vocab = self.cfg, self.data.vocab_size
        if cfg.hf_model:
            from .hf import HFChunkModel, add_lora, build_hf_model

            overrides = dict(cfg.hf_overrides)
            if cfg.hf_model in ("llama", "qwen2"):
                overrides.setdefault("vocab_size", vocab)
                overrides.setdefault("max_position_embeddings", max(cfg.seq_len, 16))
            hf = build_hf_model(cfg.hf_model, overrides, cfg.attn_implementation, self.dtype, cfg.seed)
            if hf.config.vocab_size < vocab:
                raise ValueError(f"{cfg.hf_model} has vocab_size {hf.config.vocab_size} < the data's {vocab}")
            if cfg.lora:
                hf = add_lora(hf, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets)
            return HFChunkModel(hf).to(self.device)
        if cfg.lora:
            raise ValueError("--lora needs an HF model (--hf-model); the tiny transformer trains all weights")
        arch = {k: v for k, v in cfg.model.items() if k != "vocab_size"}
        if cfg.model.get("vocab_size", vocab) != vocab:
            raise ValueError(f"model vocab_size={cfg.model['vocab_size']} does not match the data's vocabulary {vocab}")
        return TinyTransformer(TinyConfig(vocab_size=vocab, max_positions=max(cfg.seq_len, 16), **arch),
                               seed=cfg.seed, dtype=self.dtype, device=self.device)

    def save_adapter(self) -> Path | None:
        """peft's own adapter format, under run_dir/adapter (LoRA runs only)."""
        inner = getattr(self.model, "model", None)
        if not self.cfg.lora or inner is None or not hasattr(inner, "save_pretrained"):
            return None
        out = self.run_dir / "adapter"
        inner.save_pretrained(str(out))
        return out

    def _build_data(self):
        c = self.cfg
        if c.data == "synthetic":
            vocab = int(c.model.get("vocab_size", 64))
            return KeyValueTask(c.seq_len, vocab_size=vocab, n_pairs=c.n_pairs, seed=c.seed)
        return TextCorpus(c.seq_len, paths=c.text_paths or None, seed=c.seed)

    def prepare(self) -> None:
        """Check and create (or reload) the run directory; idempotent.  Errors come before any training."""
        if not self._prepared:
            self._prepare_run_dir()
            self._prepared = True

    def _prepare_run_dir(self) -> None:
        cfg, d = self.cfg, self.run_dir
        saved = d / "config.json"
        if cfg.resume:
            if not saved.exists():
                raise FileNotFoundError(f"--resume: {d} holds no run (no config.json)")
            old = json.loads(saved.read_text())
            new = cfg.to_dict()
            diff = sorted(k for k in new if k not in RESUME_FREE and old.get(k) != new[k])
            if diff:
                raise ValueError(
                    f"--resume: the config differs from the run in {d} in: "
                    + ", ".join(f"{k} ({old.get(k)!r} -> {new[k]!r})" for k in diff)
                )
            self._load_latest()
            return
        self._barrier()  # every rank looks before rank 0 creates anything
        occupied = d.exists() and any(d.iterdir())
        self._barrier()
        if occupied and not cfg.overwrite:
            raise FileExistsError(f"run directory {d} exists and is not empty; pass --overwrite or --resume")
        if self.rank == 0:
            if occupied:
                shutil.rmtree(d)
            (d / "checkpoints").mkdir(parents=True, exist_ok=True)
            tmp = saved.with_name("config.json.tmp")
            tmp.write_text(json.dumps(cfg.to_dict(), indent=2))
            os.replace(tmp, saved)
        self._barrier()

    def _barrier(self):
        if self.world > 1:
            dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "config": self.cfg.to_dict(),
        }
        ckdir = self.run_dir / "checkpoints"
        ckdir.mkdir(parents=True, exist_ok=True)
        _atomic_torch_save(state, ckdir / f"step_{self.step:06d}.pt")
        tmp = ckdir / "latest.tmp"
        tmp.write_text(f"step_{self.step:06d}.pt")
        os.replace(tmp, ckdir / "latest")

    def _load_latest(self) -> None:
        ckdir = self.run_dir / "checkpoints"
        if not (ckdir / "latest").exists():  # nothing checkpointed yet: start again from step 0
            if self.rank == 0:
                (self.run_dir / "metrics.jsonl").unlink(missing_ok=True)
            return
        state = torch.load(ckdir / (ckdir / "latest").read_text().strip(), map_location=self.device,
                           weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        self.step = int(state["step"])
        # metrics logged after the checkpoint belong to the lost part of the run: drop them
        mpath = self.run_dir / "metrics.jsonl"
        if self.rank == 0 and mpath.exists():
            keep = [ln for ln in mpath.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
            tmp = mpath.with_name("metrics.jsonl.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, mpath)

    # ------------------------------------------------------------------ one step
    def _micro_batch(self, full: Batch, micro: int) -> Batch:
        """This rank's ``micro``-th slice of the global batch (the same global batch on every rank)."""
        c = self.cfg
        per_rank = c.batch_size // self.world
        per_micro = per_rank // c.grad_accum
        start = self.rank * per_rank + micro * per_micro
        return full.slice(slice(start, start + per_micro))

    def _grads(self, batch: Batch, step: int, micro: int):
        c = self.cfg
        tok, tgt = batch.tokens.to(self.device), batch.targets.to(self.device)
        if c.mode == "dense":
            loss, grads = dense_grad(self.model, tok, tgt)
            chunks = c.num_chunks
        elif c.mode == "seco":
            loss, grads = seco_grad(self.model, tok, tgt, chunk_size=c.chunk_size)
            chunks = c.num_chunks
        else:
            rng = np.random.default_rng([c.seed, step, micro, self.rank])
            subset = self.scheme.sampler.draw(c.num_chunks, c.budget, rng)
            chunks = len(subset)
            if chunks:
                loss, grads = spaco_grad(self.model, tok, tgt, c.chunk_size, self.scheme, c.budget, subset=subset)
            else:  # an empty Bernoulli draw: forward only, zero gradient
                loss = self.forward_loss(tok, tgt)
                grads = {n: torch.zeros_like(p) for n, p in self.model.named_parameters() if p.requires_grad}
        return loss, grads, chunks

    @torch.no_grad()
    def forward_loss(self, tokens, targets) -> torch.Tensor:
        """Mean token loss, chunk by chunk without a graph (works at any length)."""
        batch = prepare(self.model, tokens, targets, self.cfg.chunk_size)
        return cache_leaves(self.model, batch)[1]

    def train_step(self) -> dict:
        c = self.cfg
        named = dict(self.model.named_parameters())
        for p in self.params:
            p.grad = None
        self._step_batch = self.data.batch("train", self.step, c.batch_size)  # built once per step
        t0 = time.perf_counter()
        loss_sum, chunks = 0.0, 0
        for micro in range(c.grad_accum):
            batch = self._micro_batch(self._step_batch, micro)
            loss, grads, n_chunks = self._grads(batch, self.step, micro)
            loss_sum += float(loss)
            chunks += n_chunks
            for name, g in grads.items():
                p = named[name]
                p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        # one all-reduce per optimizer step, over one flat buffer (gradients, then loss and chunk count)
        stats = torch.tensor([loss_sum, float(chunks)], dtype=self.params[0].dtype, device=self.device)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params] + [stats]) / (c.grad_accum * self.world)
        if self.world > 1:
            dist.all_reduce(flat)
            self.allreduce_calls += 1
        stats = flat[-2:].double()
        pos = 0
        for p in self.params:
            p.grad.copy_(flat[pos : pos + p.numel()].view_as(p))
            pos += p.numel()
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, c.clip if c.clip > 0 else float("inf")))
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        elapsed = time.perf_counter() - t0
        self.step += 1
        tokens = c.batch_size * c.seq_len
        return {
            "step": self.step,
            "loss": float(stats[0]),
            "lr": lr,
            "grad_norm": gnorm,
            "tokens_per_s": tokens / elapsed,
            "backprop_chunks": float(stats[1]),
            "seconds": elapsed,
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        c = self.cfg
        losses, far = [], []
        for i in range(c.eval_batches):
            b = self.data.batch("val", i, max(1, c.batch_size // self.world))
            tok, tgt = b.tokens.to(self.device), b.targets.to(self.device)
            losses.append(float(self.forward_loss(tok, tgt)))
            if b.far.any():
                far.append(float(self.forward_loss(tok, b.far_targets().to(self.device))))
        out = {"eval_loss": float(np.mean(losses))}
        if far:
            out["eval_far_loss"] = float(np.mean(far))
        return out

    def _far_train_loss(self) -> float | None:
        b = self._step_batch  # the global batch of the step just taken
        if not b.far.any():
            return None
        return float(self.forward_loss(b.tokens.to(self.device), b.far_targets().to(self.device)))

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict:
        c = self.cfg
        self.prepare()
        last = {}
        if self.step == 0 and self.rank == 0:
            self._log({"step": 0, **self.evaluate()})
        stop = c.stop_at or c.steps
        bar = tqdm(total=stop, initial=self.step, desc=f"{c.mode} train", unit="step",
                   disable=not c.progress or self.rank != 0)
        while self.step < stop:
            rec = self.train_step()
            far = self._far_train_loss()  # an extra no-grad forward, outside the timed step
            if far is not None:
                rec["far_loss"] = far
            if self.step % c.eval_every == 0 or self.step == c.steps:
                rec.update(self.evaluate())
            if self.rank == 0:
                self._log(rec)
            if self.step % c.ckpt_every == 0 or self.step == stop:
                self.save_checkpoint()
            bar.update()
            bar.set_postfix(loss=f"{rec['loss']:.3f}", **({"far": f"{far:.3f}"} if far is not None else {}))
            last = rec
        bar.close()
        self._barrier()
        if self.rank == 0 and self.step == c.steps:
            plot_run(self.run_dir)
            self.save_adapter()
        return last

    def _log(self, rec: dict) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def plot_run(run_dir) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    cfg = json.loads((Path(run_dir) / "config.json").read_text())
    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    tr = [r for r in rows if "loss" in r]
    ax.plot([r["step"] for r in tr], [r["loss"] for r in tr], lw=1, label="train loss")
    if any("far_loss" in r for r in tr):
        ax.plot([r["step"] for r in tr if "far_loss" in r], [r["far_loss"] for r in tr if "far_loss" in r],
                lw=1, label="train far-token loss")
    ev = [r for r in rows if "eval_loss" in r]
    ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", ms=3, label="eval loss")
    if any("eval_far_loss" in r for r in ev):
        ax.plot([r["step"] for r in ev], [r.get("eval_far_loss", np.nan) for r in ev], "s-", ms=3,
                label="eval far-token loss")
    mode = cfg["mode"] + (f" / {cfg['scheme']} t={cfg['budget']}" if cfg["mode"] == "spaco" else "")
    ax.set_title(f"{mode}, {cfg['data']} data, seq {cfg['seq_len']}, chunk {cfg['chunk_size']}", fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.legend(fontsize=8)
    out = Path(run_dir) / "loss.png"
    tmp = out.with_name("loss.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def init_distributed_from_env() -> bool:
    """Initialise torch.distributed when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return True
