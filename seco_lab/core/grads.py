"""Gradient dictionaries: the small tree utilities every engine and recipe shares.

A gradient is a ``GradDict``: parameter name -> tensor, in the model's
``named_parameters()`` order, trainable parameters only.  These helpers play
the role of optax's tree utilities: flatten to one vector for linear algebra,
unflatten back, and add into ``.grad`` for an optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from .checks import as_float

__all__ = ["GradDict", "accumulate_grads", "flatten", "grads_in_isolation", "named_grads", "unflatten"]

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
