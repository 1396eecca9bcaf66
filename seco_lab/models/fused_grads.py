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
runs with no gradient): only callers that want parameter gradients summed into ``.grad`` may open it
(the engine's :func:`~seco_lab.core.engine.relay_sweep`), never a caller that collects gradients from
``torch.autograd.grad``.  A layer runs as it would without it under autocast, when one of its trainable
parameters is not named, is not a Parameter (``weight_norm``), carries a tensor hook, keeps its
gradient in another dtype (``grad_dtype``; float32 for a 16-bit weight is supported: the 16-bit product is added into
it), or has a ``.grad`` of another dtype or layout.  On CUDA,
``index_add_`` adds the embedding rows with atomics: not bit-reproducible unless
``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["fused_param_grads"]


def _grad_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype ``.grad`` is kept in: the parameter's, or float32 for a 16-bit one within the engine's
    :func:`~seco_lab.core.grads.float32_accumulation`."""
    return getattr(param, "grad_dtype", None) or param.dtype


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.to(_grad_dtype(param))
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
            w_param.grad = torch.mm(g2.t(), x2).to(_grad_dtype(w_param))
        elif w_param.grad.dtype == g2.dtype:
            w_param.grad.addmm_(g2.t(), x2)
        else:  # a 16-bit product summed in float32, as autograd's AccumulateGrad does
            w_param.grad.add_(torch.mm(g2.t(), x2))
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
            w.grad = torch.zeros_like(w, dtype=_grad_dtype(w))
        w.grad.index_add_(0, ids, g.to(w.grad.dtype))
        return None, None, None


def _plain_grad(p: torch.Tensor | None) -> bool:
    """A parameter whose gradient autograd would simply add into ``.grad``: a Parameter, no tensor hooks (they
    would see no gradient), gradients kept in its own dtype (or in float32 for a 16-bit one, the engine's
    float32 accumulation), and ``.grad`` absent or a dense tensor of that dtype."""
    kept_in = _grad_dtype(p)
    return (isinstance(p, nn.Parameter) and not getattr(p, "_backward_hooks", None)
            and not getattr(p, "_post_accumulate_grad_hooks", None)
            and (kept_in == p.dtype or (kept_in == torch.float32 and p.dtype in (torch.float16, torch.bfloat16)))
            and (p.grad is None or (p.grad.dtype == kept_in and p.grad.layout == torch.strided)))


def _fused_forward(module: nn.Module, names: set[int]):
    """The layer's forward within the context; whether it adds into .grad is decided at each call, from the
    parameters it holds then (a hook may swap them, as ``weight_norm`` does)."""
    plain = type(module).forward.__get__(module)

    def fused_now(x) -> tuple | None:
        if torch.is_autocast_enabled(x.device.type) or not torch.is_grad_enabled():
            return None
        ps = [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]
        trainable = [p for p in ps if p.requires_grad]
        if not module.weight.requires_grad or not all(id(p) in names and _plain_grad(p) for p in trainable):
            return None
        bias = getattr(module, "bias", None)
        return module.weight, bias if bias is not None and bias.requires_grad else None

    if isinstance(module, nn.Linear):
        def forward(x):
            params = fused_now(x)
            return plain(x) if params is None else _LinearIntoGrad.apply(x, module.weight, module.bias, params)
    else:
        def forward(ids):
            params = fused_now(module.weight)
            return plain(ids) if params is None else _EmbeddingIntoGrad.apply(ids, module.weight, module.padding_idx)
    forward.fused_into_grad = True
    return forward


def _fusable(module: nn.Module, names: set[int]) -> bool:
    """A plain nn.Linear / nn.Embedding (not a subclass, no forward of its own) whose weight is a named
    Parameter and whose every trainable parameter is named; an embedding only in its dense, unscaled form.
    The parameters are checked again at each call (:func:`_fused_forward`)."""
    if type(module) not in (nn.Linear, nn.Embedding) or "forward" in vars(module):
        return False
    if type(module) is nn.Embedding and (module.max_norm is not None or module.scale_grad_by_freq or module.sparse):
        return False
    if not isinstance(module.weight, nn.Parameter) or not module.weight.requires_grad:
        return False
    return all(id(p) in names for p in module.parameters(recurse=False) if p.requires_grad)


@contextmanager
def fused_param_grads(model: nn.Module, params: Iterable[torch.Tensor]) -> Iterator[int]:
    """Within: graphs built by ``model``'s linear and embedding layers whose trainable parameters are all in
    ``params`` add their parameter gradients straight into ``.grad`` on backward (module docstring).
    Yields how many layers are fused; every layer is restored on exit, also after an error.  Not nestable:
    an inner context would leave the outer one's wider parameter set in force."""
    if any(getattr(vars(m).get("forward"), "fused_into_grad", False) for m in model.modules()):
        raise RuntimeError("fused_param_grads is already open on this model (nested, or another thread's sweep); "
                           "run one sweep at a time per model")
    names = {id(p) for p in params}
    fused = [m for m in model.modules() if _fusable(m, names)]
    try:
        for m in fused:
            m.forward = _fused_forward(m, names)
        yield len(fused)
    finally:
        for m in fused:
            if getattr(vars(m).get("forward"), "fused_into_grad", False):
                del m.forward
