"""Sharded training with FSDP2: wrapping, the parameter-gather policy and the gradient reduction.

:func:`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to every decoder block
(the tiny transformer's ``blocks``, an HF model's decoder ``layers``, with or without peft
LoRA) and then to the root, and registers ``chunk_forward`` as an FSDP forward method so
that every chunk the engine runs gathers the parameters it needs.  The chunk engine stays
unaware of sharding: it is handed :attr:`ShardedModel.view`, the same chunk model whose
``named_parameters()`` are FSDP's *unsharded* parameters (the tensors autograd sees in a
chunk's graph), and returns full-size gradients as for a replicated model.

Communication per optimizer step, with G = FSDP groups (L blocks + the root), G_t = groups
holding trainable parameters (G; L with LoRA on the blocks), k = chunks per sequence and
t_m = chunks backpropagated in micro-batch m:

* parameters, ``gather="step"`` (default): every group is all-gathered once at the start
  of the step and kept unsharded through every micro-batch, the no-grad first pass and
  every chunk's rebuild and backward (FSDP's ``reshard_after_forward`` and
  ``reshard_after_backward`` off), then resharded:  **G all-gathers per step**, whatever
  k, t and ``grad_accum``.  Peak: all parameters unsharded on every rank during the step.
* parameters, ``gather="chunk"``: a group is gathered for each chunk forward the engine
  runs and again for each backward pass, and freed after each (FSDP's reshard after
  forward and backward):  **G * (F + B) all-gathers per step**, F = chunk forwards, B =
  backward passes (autograd calls).  Per micro-batch, SeCO: F = (k - 1) + k (the no-grad
  pass skips the last chunk, whose cache no chunk reads; k rebuilds), B = k, so G (3k - 1);
  constant-relay SpaCO: F = k + t_m, B = t_m; a hop-dependent scheme adds one backward per
  visited chunk that relays to an earlier visited chunk (its hop labels are batched into one
  product).  Every rank must run the same F and B: a Bernoulli sampler is refused
  (``seco_lab.training.builders.check_gather_policy``).  Peak: one block's parameters unsharded at a
  time -- but every rank still builds the whole model before sharding and sums full-size
  gradients during the step, so the model must fit one device.
* gradients: FSDP's own per-backward reduction stays off (``set_requires_gradient_sync
  (False)``).  The engine's gradients of all micro-batches are summed locally at full
  size, then each group's sum is reduce-scattered once, in one flat buffer laid out as
  FSDP's dim-0 shards, and divided by ``grad_accum * world`` (the mean over micro-batches
  and ranks, as the replicated path):  **G_t reduce-scatters per step**.
* relayed KV-cache gradients belong to a rank's own sequences: they never leave the rank.
* statistics (loss, chunks, stop flag): **1 all-reduce per step** (float64); gradient
  clipping's global norm: **1 more all-reduce** (the sharded norms' squares summed).

Forward-only passes (evaluation, the far-token loss) gather every group once per chunk, so every
rank runs them, as every rank joins the gather of the whole weights (``collective``).  Checkpoints are
sharded (:mod:`seco_lab.training.sharded_checkpoint`): every rank writes its shards; a replicated run's ``.pt``
state loads into the shards.  :class:`ShardedModel` has the interface of
:class:`seco_lab.training.replicated.ReplicatedModel`, the trainer's other strategy.
Only torch's public API is used: ``fully_shard``, ``register_fsdp_forward_method``,
``FSDPModule.unshard/reshard/set_*``, ``DTensor.from_local`` and c10d collectives.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..config import FSDP_NEEDS_TORCHRUN, GATHER_POLICIES
from . import sharded_checkpoint

__all__ = ["ShardedModel", "ShardingError", "clip_grad_norm", "count_collectives"]


class ShardingError(ValueError):
    """FSDP cannot be applied as asked (the message says why and what to do)."""


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks FSDP shards one by one: the tiny transformer's ``blocks``
    or an HF causal LM's decoder ``layers`` (found through a peft wrapper)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList) and len(blocks):
        return list(blocks)
    inner = getattr(model, "model", None)
    if inner is not None:
        for name, mod in inner.named_modules():
            if name.split(".")[-1] == "layers" and isinstance(mod, nn.ModuleList) and len(mod):
                return list(mod)
    raise ShardingError(f"{type(model).__name__}: no decoder blocks found to shard (expected a `blocks` ModuleList "
                        "or an HF model's decoder `layers`); --shard fsdp supports the tiny transformer and "
                        "HF Llama/Qwen2-style models")


class GatheredView:
    """The sharded chunk model as the engine sees it: ``chunk_forward`` runs the FSDP root
    (gathering as the policy says) and ``named_parameters()`` yields FSDP's unsharded
    parameters -- the leaves of every chunk's graph -- under the model's own names."""

    #: the engine runs each chunk graph's products fused (FSDP's backward hooks reshard after one)
    fused_products = True
    #: parameter gradients go through autograd (FSDP's post-backward hooks reduce them), never straight into .grad
    fused_grads = None

    def __init__(self, root: nn.Module, full: dict[str, nn.Parameter]):
        self._root, self._full = root, full

    def chunk_forward(self, *args, **kwargs):
        return self._root.chunk_forward(*args, **kwargs)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._full.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._full.values())

    def __getattr__(self, name):  # max_positions, vocab_size, deterministic, training, ...
        if name.startswith("_"):  # e.g. while copying, before _root exists
            raise AttributeError(name)
        return getattr(self._root, name)


class ShardedModel:
    """A chunk model sharded with FSDP2 (see the module docstring for the policy).

    ``view`` goes to the engine; ``step()`` is the context of one optimizer step (it gathers
    under ``gather="step"``); ``accumulate(grads)`` sums a micro-batch's gradients;
    ``reduce_mean(stats, count, world)`` reduce-scatters them into the sharded parameters'
    ``.grad`` and returns the mean statistics with the number of collectives issued;
    ``clip_grads(max_norm)`` clips them by their global norm.  Forward passes are collective.
    """

    #: running the model or reading its whole weights gathers shards: every rank must join (evaluation, adapter)
    collective = True

    def __init__(self, model: nn.Module, gather: str = "step", mesh=None):
        if gather not in GATHER_POLICIES:
            raise ShardingError(f"unknown gather policy {gather!r}; choose one of {', '.join(GATHER_POLICIES)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ShardingError(FSDP_NEEDS_TORCHRUN)
        try:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        except ImportError as e:
            raise ShardingError(f"--shard fsdp needs FSDP2 (torch >= 2.6; this is torch {torch.__version__}): "
                                "upgrade torch or train without --shard") from e

        self.gather = gather
        self.root = model
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.device = next(model.parameters()).device
        self.mesh = mesh or init_device_mesh(self.device.type, (self.world,))
        self.blocks = decoder_blocks(model)
        for block in self.blocks:
            fully_shard(block, mesh=self.mesh, reshard_after_forward=True)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=True)
        register_fsdp_forward_method(model, "chunk_forward")
        model.set_requires_gradient_sync(False)  # FSDP never reduces by itself: reduce_mean does, once per step
        # FSDP2 warns on every chunk that a block returns views (its keys/values) that an in-place op could
        # break; the engine never writes into a chunk's outputs, so the warning is noise here
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.modules = [model, *self.blocks]
        self.groups, full = self._record_unsharded()
        self.view = GatheredView(model, full)
        self.params = {n: p for n, p in model.named_parameters()}  # the sharded (DTensor) parameters
        self._acc: dict[str, torch.Tensor] = {}

    def _record_unsharded(self) -> tuple[list[list[str]], dict[str, nn.Parameter]]:
        """Gather each group once, group by group: its parameters' unsharded tensors and names.

        FSDP2 keeps one unsharded ``nn.Parameter`` per parameter for the module's lifetime
        (re-gathering refills its storage), so the engine can hold these across steps.
        """
        from torch.distributed.tensor import DTensor

        groups, full = [], {}
        for module in self.modules:
            module.unshard()
            names = [n for n, p in self.root.named_parameters() if not isinstance(p, DTensor) and n not in full]
            for n, p in self.root.named_parameters():
                if n in names:
                    full[n] = p
            module.reshard()
            groups.append(names)
        order = [n for n, _ in self.root.named_parameters()]
        if sorted(full) != sorted(order):
            missing = ", ".join(sorted(set(order) - set(full)))
            raise ShardingError(f"FSDP left parameters outside every group: {missing}")
        return groups, {n: full[n] for n in order}

    # ------------------------------------------------------------------ one optimizer step
    @contextlib.contextmanager
    def step(self):
        """One optimizer step.  ``gather="step"``: all-gather every group now (G collectives), keep it
        unsharded until the end, then free it.  ``gather="chunk"``: FSDP gathers per chunk."""
        self._acc = {}
        if self.gather == "chunk":
            yield
            return
        for m in self.modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        try:
            for m in self.modules:
                m.unshard()
            self._check_unsharded()
            yield
        finally:
            for m in self.modules:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)

    def _check_unsharded(self) -> None:
        """The engine differentiates w.r.t. the unsharded parameters recorded at wrapping time; FSDP2
        refills those same tensors on every gather (checked here, so a change of that behaviour in a
        later torch fails loudly instead of yielding zero gradients)."""
        now = dict(self.root.named_parameters())
        stale = [n for n, p in self.view.named_parameters() if now.get(n) is not p]
        if stale:
            raise ShardingError(f"FSDP2 replaced the unsharded parameters {stale[:3]} since wrapping; this torch "
                                f"({torch.__version__}) behaves differently from the one seco_lab.training.sharding "
                                "was built on")

    def accumulate(self, grads: dict[str, torch.Tensor]) -> None:
        """Sum one micro-batch's full-size gradients (by name) into this step's local buffer."""
        for name, g in grads.items():
            if name not in self._acc:
                self._acc[name] = g
            else:
                self._acc[name].add_(g)

    def reduce_mean(self, stats: dict[str, float], count: int, world: int) -> tuple[dict[str, float], int]:
        """Set each sharded trainable parameter's ``.grad`` to its shard of

            (1 / (count * world)) * sum over ranks of this rank's summed micro-batch gradients

        with one reduce-scatter per group, and return the same mean of ``stats`` (one
        float64 all-reduce) with the number of collectives issued."""
        from torch.distributed.tensor import DTensor, Shard

        denom = count * world
        calls = 0
        for names in self.groups:
            trainable = [(n, self.params[n]) for n in names if self.params[n].requires_grad]
            if not trainable:
                continue
            rows = []
            for name, p in trainable:
                if p.dim() == 0 or tuple(p.placements) != (Shard(0),):
                    raise ShardingError(f"parameter {name}: expected FSDP's dim-0 sharding, got {p.placements}")
                g = self._acc.pop(name, None)
                g = torch.zeros(p.shape, dtype=p.dtype, device=p.to_local().device) if g is None else g
                d0, c = p.shape[0], -(-p.shape[0] // world)
                flat = g.reshape(d0, -1)
                if c * world != d0:
                    flat = F.pad(flat, (0, 0, 0, c * world - d0))
                rows.append(flat.reshape(world, -1))
            send = torch.cat(rows, dim=1).div_(denom)
            recv = send.new_empty(send.shape[1])
            dist.reduce_scatter_tensor(recv, send.reshape(-1), group=self.mesh.get_group())
            calls += 1
            pos = 0
            for name, p in trainable:
                c, rest = -(-p.shape[0] // world), math.prod(p.shape[1:])
                local_shape = p.to_local().shape
                local = recv[pos : pos + c * rest].view(c, *p.shape[1:])[: local_shape[0]]
                pos += c * rest
                if local.shape != local_shape:
                    raise ShardingError(f"parameter {name}: FSDP's shard has shape {tuple(local_shape)}, the "
                                        f"reduce-scatter gave {tuple(local.shape)}")
                p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
        self._acc = {}
        names = list(stats)
        # on the parameters' device: NCCL reduces device tensors only
        buf = torch.tensor([float(stats[n]) for n in names], dtype=torch.float64, device=self.device) / denom
        dist.all_reduce(buf)
        return dict(zip(names, buf.cpu().tolist())), calls + 1


    def clip_grads(self, max_norm: float | None) -> float:
        """Clip the trainable parameters' sharded gradients by their global norm (:func:`clip_grad_norm`)."""
        return clip_grad_norm([p for p in self.params.values() if p.requires_grad], max_norm)

    # ------------------------------------------------------------------ checkpoints and whole weights
    def save_checkpoint(self, run_dir, optimizer, extra: dict) -> None:
        """Collective: every rank writes its shards of the model and ``optimizer`` (with ``extra``) as a
        sharded checkpoint of step ``extra["step"]`` in ``run_dir``; rank 0 points ``latest`` at it."""
        path = sharded_checkpoint.save(run_dir.checkpoints, extra["step"], self.root, optimizer,
                                       {**extra, "world_size": self.world})
        if self.rank == 0:
            run_dir.point_latest(path.name)

    def load_whole_state(self, state: dict, optimizer, where) -> None:
        """Load a replicated run's ``.pt`` state (whole model and optimizer) into this rank's shards."""
        sharded_checkpoint.load_replicated(state, self.root, optimizer)

    def full_state_dict(self) -> dict:
        """Collective: the model's whole state dict on every rank (on the CPU), gathered from the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def clip_grad_norm(params, max_norm: float | None) -> float:
    """Global gradient norm of sharded (DTensor) gradients, clipped like ``clip_grad_norm_``:

        norm = sqrt(sum over ranks and parameters of ||local shard of p.grad||^2)   (one all-reduce)
        p.grad *= min(1, max_norm / (norm + 1e-6))                                  (skipped when >= 1)

    computed in the gradients' dtype; the same number on every rank.  ``max_norm=None``: norm only."""
    from torch.distributed.tensor import DTensor

    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    sq = torch.stack([torch.linalg.vector_norm(g) ** 2 for g in local]).sum() if local else torch.zeros(())
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm is not None:
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in local:
                g.mul_(coef)
    return float(norm)


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Count the c10d collectives issued inside the block, by kind: ``all_gather``,
    ``reduce_scatter``, ``all_reduce``, ``broadcast`` (patches ``torch.distributed``'s
    functions, which FSDP2 and this module call; for tests and benchmarks)."""
    counts: collections.Counter = collections.Counter()
    kinds = {"all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "broadcast": "broadcast"}
    saved = {n: getattr(dist, n) for n in kinds if hasattr(dist, n)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[kinds[name]] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
