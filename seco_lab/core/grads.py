"""Gradient dictionaries: the small tree utilities every engine and recipe shares.

A gradient is a ``GradDict``: parameter name -> tensor, in the model's
``named_parameters()`` order, trainable parameters only.  These helpers play
the role of optax's tree utilities: flatten to one vector for linear algebra,
unflatten back, and add into ``.grad`` for an optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from .checks import as_float

__all__ = ["GradDict", "accumulate_grads", "accumulation_dtype", "flatten", "float16_seed_scale",
           "float32_accumulation", "grads_in_isolation",
           "named_grads", "unflatten"]

GradDict = dict[str, torch.Tensor]


def named_grads(params: Sequence[tuple[str, torch.Tensor]], grads: Sequence[torch.Tensor]) -> GradDict:
    """Pair the gradients of ``params`` (a ``named_parameters()`` list) with their names."""
    return {name: g for (name, _), g in zip(params, grads)}


def flatten(grads: GradDict) -> torch.Tensor:
    """One vector: the parameters' gradients concatenated in dictionary order."""
    _check_grad_dict(grads, "flatten")
    return torch.cat([g.reshape(-1) for g in grads.values()])


def _check_grad_dict(grads, what: str) -> None:
    if not isinstance(grads, Mapping) or not all(isinstance(g, torch.Tensor) for g in grads.values()):
        raise TypeError(f"{what}: expected a dict of gradient tensors by parameter name (e.g. what seco_grad "
                        f"returns), got {type(grads).__name__}")
    if not grads:
        raise ValueError(f"{what}: the gradient dict is empty (no trainable parameters?)")


def unflatten(vec: torch.Tensor, like: GradDict) -> GradDict:
    """Inverse of :func:`flatten`: views of ``vec`` shaped like ``like``."""
    _check_grad_dict(like, "unflatten's like")
    total = sum(g.numel() for g in like.values())
    if vec.dim() != 1 or vec.numel() != total:
        raise ValueError(f"unflatten: expected a vector of {total} elements, got shape {tuple(vec.shape)}")
    out, pos = {}, 0
    for name, g in like.items():
        out[name] = vec[pos : pos + g.numel()].view_as(g)
        pos += g.numel()
    return out


def accumulate_grads(model, grads: GradDict, scale: float = 1.0) -> None:
    """``p.grad += scale * grads[name]`` for the named parameters (``p.grad`` created when absent).

    At ``scale == 1`` a fresh ``.grad`` takes the tensor itself (no copy): the caller hands it over.
    ``scale`` is checked as :func:`~seco_lab.core.engine.seco_step` checks it: a real, finite number.
    """
    scale = as_float(scale, "scale")  # NaN or inf would be written into every .grad
    params = dict(model.named_parameters())
    missing = set(grads) - set(params)
    if missing:
        raise KeyError(f"accumulate_grads: the model has no parameters named {sorted(missing)}")
    for name, g in grads.items():
        p = params[name]
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or not g.is_floating_point() or (
                p.grad is None and g.dtype != p.dtype):
            got = f"{tuple(g.shape)} {g.dtype}" if isinstance(g, torch.Tensor) else type(g).__name__
            raise ValueError(f"accumulate_grads: the gradient of {name} must be a tensor of {tuple(p.shape)} "
                             f"{p.dtype} (the parameter's), got {got}")
        if p.grad is None:
            p.grad = g if scale == 1.0 else g * scale
        else:
            p.grad.add_(g, alpha=scale)


def grads_in_isolation(tensors: Sequence[torch.Tensor], run: Callable):
    """``(run(), grads)``: ``run`` accumulates into fresh ``.grad`` of ``tensors`` (set to None first);
    ``grads`` are those tensors (zeros where nothing arrived), handed over without a copy, and every
    ``.grad`` is restored to what it was before -- also when ``run`` raises."""
    tensors = list(tensors)
    saved = [p.grad for p in tensors]
    for p in tensors:
        p.grad = None
    try:
        result = run()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in tensors]
    finally:
        for p, g in zip(tensors, saved):
            p.grad = g
    return result, grads


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype chunk gradients are summed in: float32 for a 16-bit parameter (bfloat16 keeps 8 bits: k chunk
    gradients added one by one into a bfloat16 sum lose ~eps * sqrt(k) of it, 2.9x the bfloat16 dense gradient's
    error at 256 chunks, campaign 42 F2), the parameter's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def float16_seed_scale(tensors: Sequence[torch.Tensor], num_chunks: int) -> float:
    """The factor a chunk sweep multiplies its seeds by when every tensor is float16 (1 otherwise): the power of two
    >= the chunk count, so that each chunk's backward sees the gradient scale of a mean loss over its own tokens, not
    over the whole sequence.  float16's range ends at 6e-8: a chunk's share of a value's gradient from a later chunk
    (an attention weight ~1/length times a per-token gradient ~1/N) underflows to 0 where the dense backward sums the
    pieces before rounding (3.8x the dense float16 gradient's error at 256 chunks unscaled, 0.07x scaled; bfloat16 has
    float32's range and needs none).  :func:`float32_accumulation` divides the float32 sums by it."""
    if num_chunks <= 1 or not tensors or any(t.dtype != torch.float16 for t in tensors) or any(
            getattr(t, "grad_dtype", None) != t.dtype for t in tensors):
        return 1.0
    return float(2 ** math.ceil(math.log2(num_chunks)))


@contextmanager
def float32_accumulation(tensors: Sequence[torch.Tensor], scale: float = 1.0) -> Iterator[None]:
    """Within: autograd sums the gradients of 16-bit ``tensors`` into a fresh float32 ``.grad`` (torch's
    ``grad_dtype``); on exit that sum, divided by ``scale`` (:func:`float16_seed_scale`), is added to the ``.grad``
    that was there before and rounded once to the parameter's dtype -- into that tensor, so its identity (a view into
    a flat buffer) is kept.  A sum of k chunk gradients is then rounded once, as the dense backward's one product is.
    Tensors whose ``grad_dtype`` the user set, and torch versions without ``grad_dtype`` (before 2.9), are left as
    they are (and ``scale`` must then be 1)."""
    widened = []
    for p in tensors:
        if accumulation_dtype(p.dtype) == p.dtype or getattr(p, "grad_dtype", None) != p.dtype:
            continue
        before, p.grad = p.grad, None
        p.grad_dtype = torch.float32
        widened.append((p, before))
    if scale != 1.0 and len(widened) != len(tensors):
        raise ValueError("float32_accumulation: a seed scale needs every tensor widened (all float16)")
    try:
        yield
    finally:
        for p, before in widened:
            wide, p.grad = p.grad, None
            p.grad_dtype = p.dtype
            if wide is None:
                p.grad = before
                continue
            if scale != 1.0:
                wide.div_(scale)
            if before is not None:
                p.grad = before.copy_(wide.add_(before))
            else:
                p.grad = wide.to(p.dtype)
