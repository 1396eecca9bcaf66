"""One validator per concept, shared by every public function.

Each raises ``ValueError``/``TypeError`` with a message that names the argument,
what was given and what is allowed -- never a silent coercion (``2.5`` is not a
chunk size, ``(1.7, 3.2)`` is not a subset).
"""

from __future__ import annotations

import numbers

import numpy as np


def as_int(value, what: str, minimum: int | None = None) -> int:
    """``value`` as a Python int; bools, floats, strings and tensors of other kinds are refused."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value}")
    return value


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive integers: the number of chunks of size b covering a tokens."""
    return -(-a // b)


def check_chunk_size(chunk_size) -> int:
    try:
        return as_int(chunk_size, "chunk_size", 1)
    except (TypeError, ValueError):
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}") from None


def check_budget(num_chunks, budget) -> tuple[int, int]:
    """k >= 1 chunks and a budget 1 <= t <= k (the mean budget for Bernoulli sampling)."""
    k = as_int(num_chunks, "number of chunks k", 1)
    t = as_int(budget, "budget t", None)
    if t < 1:
        raise ValueError(f"budget t must be >= 1, got t={t}")
    if t > k:
        raise ValueError(f"budget t={t} exceeds the number of chunks k={k}")
    return k, t


def check_max_hops(max_hops) -> int:
    """P >= 0: the deepest hop stratum kept (a chain of p hops crosses p KV caches)."""
    try:
        return as_int(max_hops, "max_hops P", 0)
    except (TypeError, ValueError):
        raise ValueError(f"max_hops P must be an integer >= 0, got {max_hops!r}") from None


def check_subset(subset, num_chunks: int, size: int | None = None) -> tuple[int, ...]:
    """A drawn chunk set I: distinct integer indices in [0, k), sorted; exactly ``size`` of them if given."""
    if isinstance(subset, (str, bytes)) or not hasattr(subset, "__iter__"):
        raise TypeError(f"subset must be a sequence of chunk indices, got {subset!r}")
    items = list(subset)
    for j in items:
        if isinstance(j, bool) or not isinstance(j, (numbers.Integral, np.integer)):
            raise TypeError(f"subset {tuple(items)} holds {j!r}: chunk indices must be integers")
    s = tuple(sorted(int(j) for j in items))
    if len(set(s)) != len(s):
        raise ValueError(f"subset {tuple(items)} repeats a chunk")
    if s and (s[0] < 0 or s[-1] >= num_chunks):
        raise ValueError(f"subset {tuple(items)} has chunk indices outside [0, {num_chunks})")
    if size is not None and len(s) != size:
        raise ValueError(f"the sampler draws exactly t={size} chunks; the subset has {len(s)}")
    return s


def check_rng(generator) -> np.random.Generator:
    """A numpy Generator (used as is), an int seed or None (fresh entropy)."""
    if isinstance(generator, np.random.Generator):
        return generator
    if generator is None:
        return np.random.default_rng()
    if isinstance(generator, (numbers.Integral, np.integer)) and not isinstance(generator, bool):
        return np.random.default_rng(check_seed(generator, "generator seed"))
    raise TypeError(
        f"generator must be a numpy.random.Generator, an int seed or None, got {type(generator).__module__}."
        f"{type(generator).__name__}; SpaCO draws use numpy (e.g. numpy.random.default_rng(seed))"
    )


def as_float(value, what: str, *, finite: bool = True) -> float:
    """``value`` as a Python float: ints and floats (numpy's too); bools, strings and None are refused,
    and so are NaN and infinities unless ``finite=False``."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{what} must be a finite number, got an integer too large for a float") from None
    if finite and not np.isfinite(out):
        raise ValueError(f"{what} must be a finite number, got {out}")
    return out


def as_bool(value, what: str) -> bool:
    """``value`` as a bool: only True/False (numpy's too); ``'no'``, ``0`` and ``None`` are refused rather than
    read by their truthiness."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_seed(seed, what: str = "seed") -> int:
    """An integer seed >= 0: ``1.7`` and ``True`` are refused rather than truncated to 1."""
    return as_int(seed, what, 0)


#: work that grows exponentially or with the number of strata is refused above this many bytes unless forced
MEMORY_GUARD_BYTES = 8 << 30
#: longest weight vector (entries p = 0..P) a scheme computes; past k - 1 every entry is 0
MAX_WEIGHT_ENTRIES = 1 << 24


def guard_memory(what: str, nbytes: float, detail: str, fix: str, force: bool = False) -> None:
    """Refuse, before allocating, work that would hold more than :data:`MEMORY_GUARD_BYTES`: the message
    states the cost and how to lower it; ``force=True`` is the override for those who mean it."""
    if force or nbytes <= MEMORY_GUARD_BYTES:
        return
    raise MemoryError(f"{what} would hold {nbytes / 2**30:,.1f} GiB ({detail}), above the "
                      f"{MEMORY_GUARD_BYTES / 2**30:.0f} GiB guard; {fix}, or pass force=True if you mean it")
