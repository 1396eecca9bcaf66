"""Parameter gradients of linear and embedding layers accumulated straight into ``.grad``.

SeCO's pass 2 backpropagates k chunk graphs one after another and sums their parameter gradients in
``p.grad``.  Autograd does that in two steps per chunk and weight: the weight-gradient matmul writes a
new tensor, then ``AccumulateGrad`` adds it into ``.grad``.  At small chunks the second step costs as
much memory traffic as the first (a weight-sized read and write for a c-row product), and an embedding's
backward is worse: a dense zero-filled weight-sized gradient per chunk for c looked-up rows, added once
more where the embedding is tied to the LM head.  Within :func:`fused_param_grads` the layers whose
weights are named do both in one step, in place:

    y = x W^T + b:   dW += g^T x   (one ``addmm_``),   db += sum_rows g,   dx = g W
    y = W[ids]:      dW[ids] += g  (one ``index_add_`` over the looked-up rows; none for a padding id)

with g = dL/dy of the chunk, the same sums autograd forms, in another order (equal up to rounding: the
float64 tests hold SeCO to dense autograd at 1e-13).  This is Megatron-LM's "gradient accumulation
fusion" for the chunk loop.  The fused weights receive nothing through autograd (their ``AccumulateGrad``
is not reached, so hooks on them do not fire): only callers that want parameter gradients summed into
``.grad`` may open it (the engine's :func:`~seco_lab.core.engine.relay_sweep`), never a caller that
collects gradients from ``torch.autograd.grad``.  Under autocast, or for a module whose parameters are
not all named, the layer runs as it would without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["fused_param_grads"]


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _LinearIntoGrad(torch.autograd.Function):
    """F.linear whose backward adds dW = g^T x (and db) into ``.grad`` and returns only dx."""

    @staticmethod
    def forward(ctx, x, weight, bias, params):
        ctx.save_for_backward(x, weight)
        ctx.params = params  # (weight, bias) as the Parameters themselves: their .grad is written
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        w_param, b_param = ctx.params
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if w_param.grad is None:
            w_param.grad = torch.mm(g2.t(), x2)
        else:
            w_param.grad.addmm_(g2.t(), x2)
        if b_param is not None:
            _accumulate(b_param, g2.sum(0))
        dx = g @ weight if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class _EmbeddingIntoGrad(torch.autograd.Function):
    """F.embedding whose backward adds g into the looked-up rows of ``.grad`` (no dense gradient)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.param, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)  # _fusable: no max_norm, scale_grad_by_freq or sparse

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
        if ctx.padding_idx is not None:  # the padding row gets no gradient (as F.embedding's backward)
            keep = ids != ctx.padding_idx
            ids, g = ids[keep], g[keep]
        w = ctx.param
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad.index_add_(0, ids, g)
        return None, None, None


def _fused_forward(module: nn.Module):
    if isinstance(module, nn.Linear):
        bias = module.bias if module.bias is not None and module.bias.requires_grad else None
        plain, params = type(module).forward.__get__(module), (module.weight, bias)

        def forward(x):
            if torch.is_autocast_enabled(x.device.type) or not torch.is_grad_enabled():
                return plain(x)
            return _LinearIntoGrad.apply(x, module.weight, module.bias, params)
    else:
        plain = type(module).forward.__get__(module)

        def forward(ids):
            if torch.is_autocast_enabled(module.weight.device.type) or not torch.is_grad_enabled():
                return plain(ids)
            return _EmbeddingIntoGrad.apply(ids, module.weight, module.padding_idx)
    return forward


def _fusable(module: nn.Module, names: set[int]) -> bool:
    """A plain nn.Linear / nn.Embedding (not a subclass with its own forward) whose every trainable
    parameter is named, and at least one is; an embedding only in its dense, unscaled form."""
    if type(module) not in (nn.Linear, nn.Embedding) or "forward" in vars(module):
        return False
    if type(module) is nn.Embedding and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        return False
    trainable = [p for p in module.parameters(recurse=False) if p.requires_grad]
    if type(module) is nn.Linear and not module.weight.requires_grad:
        return False
    return bool(trainable) and all(id(p) in names for p in trainable)


@contextmanager
def fused_param_grads(model: nn.Module, params: Iterable[torch.Tensor]) -> Iterator[int]:
    """Within: graphs built by ``model``'s linear and embedding layers whose trainable parameters are all in
    ``params`` add their parameter gradients straight into ``.grad`` on backward (module docstring).
    Yields how many layers are fused; every layer is restored on exit, also after an error."""
    names = {id(p) for p in params}
    fused = [m for m in model.modules() if _fusable(m, names)]
    try:
        for m in fused:
            m.forward = _fused_forward(m)
        yield len(fused)
    finally:
        for m in fused:
            vars(m).pop("forward", None)
