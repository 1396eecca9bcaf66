"""One validator per concept, shared by every public function.

Each raises ``ValueError``/``TypeError`` with a message that names the argument,
what was given and what is allowed -- never a silent coercion (``2.5`` is not a
chunk size, ``(1.7, 3.2)`` is not a subset).  The engines' inputs (:func:`checked_batch`:
model, tokens, targets, chunk size) and outputs (:func:`checked_chunk`) are checked here too,
and so is every rebuilt chunk (:func:`check_recomputed`): SeCO's pass 2 trusts that
rebuilding chunk j reproduces its pass-1 cache m_j exactly, which holds for a deterministic
model.  Like ``torch.utils.checkpoint`` the rebuilt cache's metadata (shape, dtype, device) is compared
with the first pass, and by default (:func:`recompute_check` "values") so are its values, tensor by tensor:

    ||rebuilt - first||_2 <= r(dtype) * ||first||_2,    r = sqrt(eps), eps in 16-bit floats

(the dtype the cache was computed in: autocast's where autocast is on)
(:func:`rebuild_rounding`: 1.5e-8 in float64, 3.5e-4 in float32, 7.8e-3 in bfloat16, where pass 1 runs chunk
by chunk; the rounding differences between pass 1 and a chunk's rebuild are far below it; noise a forward draws
is not).  So a forward that is not
reproducible -- dropout, noise from any generator (torch's, numpy's, ``random``), hooks that draw in eval
mode, a draw that starts at some later call -- is caught with an error that names the chunk instead of giving a
silently wrong gradient, whenever its randomness reaches a cache that a later chunk reads.  Randomness that
reaches no such cache (noise on the last chunk, or on the logits only) leaves the gradient exact for the loss
the rebuilds compute, as dropout does in dense training.  The check costs a subtraction and two norms over a
chunk's own keys and values and one read back to the host a chunk (measured beside the metadata check:
``make bench-hf-values-check``).  "metadata" keeps the cheaper comparison; "none" switches it off.
"""

from __future__ import annotations

import contextlib
import itertools
import numbers
import operator
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

#: the most logits bytes a no-grad pass-1 span with a loss may hold (its cross-entropy adds about twice that);
#: a span is never cut below one chunk (seco_lab.core.engine.pass1_span)
PASS1_LOGITS_BYTES = 128 << 20

if TYPE_CHECKING:  # torch is imported by the functions that need it: the CLI's argument checks stay torch-free
    import torch

    from .protocol import ChunkOutput

__all__ = ["MAX_WEIGHT_ENTRIES", "MEMORY_GUARD_BYTES", "RECOMPUTE_CHECKS", "RECOMPUTE_ENV", "rebuild_rounding",
           "recompute_mode", "computed_dtype", "ChunkedBatch", "RecomputationError",
           "host_memory_bytes", "as_bool", "as_float", "as_int", "as_token_matrix", "ceil_div", "check_seed",
           "guard_memory",
           "check_budget", "check_chunk_size", "check_max_hops", "check_model", "check_recomputed", "check_rng",
           "check_key_value_task", "check_subset", "check_threads", "checked_batch", "checked_chunk", "recompute_check",
           "MAX_THREADS", "first_non_finite"]


def as_int(value, what: str, minimum: int | None = None) -> int:
    """``value`` as a Python int; bools, floats, strings and tensors of other kinds are refused."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value}")
    return value


#: the most torch threads a study's process may ask for: more only slows it down, and OpenMP cannot start
#: 100,000 (``SystemError`` while torch imports)
MAX_THREADS = 256


def check_threads(value, what: str = "threads") -> int:
    """A thread count: an integer in [1, MAX_THREADS]."""
    value = as_int(value, what, 1)
    if value > MAX_THREADS:
        raise ValueError(f"{what} must be at most {MAX_THREADS}, got {value}: more threads than cores only slow a "
                         f"run down; give the number of cores to use (this machine has {os.cpu_count()})")
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
    if getattr(subset, "ndim", None) == 0:  # a 0-d tensor or array has __iter__ but cannot be iterated
        raise TypeError(f"subset must be a sequence of chunk indices (e.g. [3]), got the single value {subset!r}")
    try:  # an unsized iterable (a generator) is read up to k + 1 items: more cannot be distinct indices in [0, k)
        items = list(subset) if hasattr(subset, "__len__") else list(itertools.islice(subset, num_chunks + 1))
    except TypeError as e:
        raise TypeError(f"subset must be a sequence of chunk indices, got {subset!r:.80} ({e})") from None
    if len(items) > num_chunks and not hasattr(subset, "__len__"):
        raise ValueError(f"subset yields more than k={num_chunks} chunk indices: they cannot be distinct in "
                         f"[0, {num_chunks})")
    indices = []
    for j in items:  # ints, numpy integers, integer 0-d tensors (an integer tensor's elements): what has __index__
        try:
            if isinstance(j, bool) or str(getattr(j, "dtype", "")) in ("bool", "torch.bool"):
                raise TypeError
            indices.append(operator.index(j))
        except TypeError:
            raise TypeError(f"subset {tuple(items)} holds {j!r}: chunk indices must be integers") from None
    s = tuple(sorted(indices))
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


#: work that grows exponentially or with the number of strata is refused above this many bytes unless forced
MEMORY_GUARD_BYTES = 8 << 30
#: longest weight vector (entries p = 0..P) a scheme computes; past k - 1 every entry is 0
MAX_WEIGHT_ENTRIES = 1 << 24


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def guard_memory(what: str, nbytes: float, detail: str, fix: str, force: bool | None = False) -> None:
    """Refuse, before allocating, work that would hold more than :data:`MEMORY_GUARD_BYTES`: the message
    states the cost and how to lower it; ``force=True`` is the override for those who mean it (``None``:
    the caller has no override, and the message offers none)."""
    if force is not None:
        force = as_bool(force, "force")  # 'no' is truthy: read as True it would switch the guard off
    if force or nbytes <= MEMORY_GUARD_BYTES:
        return
    override = "" if force is None else ", or pass force=True if you mean it"
    raise MemoryError(f"{what} would hold {nbytes / 2**30:,.1f} GiB ({detail}), above the "
                      f"{MEMORY_GUARD_BYTES / 2**30:.0f} GiB guard; {fix}{override}")


# --------------------------------------------------------------------------- engine inputs and outputs


@dataclass
class ChunkedBatch:
    """Validated tokens/targets split into k chunks of ``chunk_size`` (last may be shorter)."""

    tokens: torch.Tensor  # (B, n) integer
    targets: torch.Tensor  # (B, n) integer, ignore_index allowed
    chunk_size: int
    ignore_index: int
    n_targets: int  # number of non-ignored targets: the loss normaliser

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_chunks(self) -> int:
        return ceil_div(self.length, self.chunk_size)

    def chunk(self, j: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.span(j, 1)

    def span(self, j: int, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens, targets, start) of the m chunks j..j+m-1 together (the last may be shorter)."""
        s = j * self.chunk_size
        e = min(s + m * self.chunk_size, self.length)
        return self.tokens[:, s:e], self.targets[:, s:e], s

    def chunk_lengths(self, j: int, m: int) -> list[int]:
        """Token counts of the chunks j..j+m-1."""
        return [min(self.chunk_size, self.length - i * self.chunk_size) for i in range(j, j + m)]


def as_token_matrix(x, what: str) -> torch.Tensor:
    """``x`` as a (batch, length) int64 tensor of token ids; a 1-D sequence is one row."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"{what} must have shape (batch, length) or (length,), got {tuple(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor of token ids, got dtype {x.dtype}")
    if x.is_meta:
        raise ValueError(f"{what} are on the meta device (no data): make them on a real device (the CPU or the "
                         "model's device) with real token ids")
    # embeddings and cross-entropy index with int64; int8/int16/int32/uint8 ids are widened, not refused
    return x.long()


def check_model(model) -> None:
    """Raise unless ``model`` implements the chunk-model protocol with one floating dtype."""
    if not callable(getattr(model, "chunk_forward", None)) or not callable(getattr(model, "named_parameters", None)):
        raise TypeError(
            f"{type(model).__name__} does not implement the chunk-model protocol: it needs "
            "chunk_forward(tokens, targets, past, start, ignore_index) and named_parameters() "
            "(see seco_lab.core.protocol.ChunkModel)"
        )
    dtypes = {p.dtype for p in model.parameters()}
    if not dtypes:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to differentiate")
    if len(dtypes) > 1:
        raise TypeError(f"model parameters have mixed dtypes {sorted(map(str, dtypes))}; cast the model to one dtype")
    if dtypes and not next(iter(dtypes)).is_floating_point:
        raise TypeError(f"model parameters must be floating point, got {dtypes.pop()}")
    if not getattr(model, "deterministic", True):
        why = getattr(model, "randomness", None) or "dropout is active in training mode"
        raise ValueError(
            f"the model is not deterministic ({why}): a chunk rebuild "
            "would not reproduce its first pass and the gradient would be wrong; call model.eval() "
            "or set dropout=0"
        )


def checked_batch(model, tokens, targets, chunk_size: int | None = None, ignore_index: int = -100) -> ChunkedBatch:
    """The inputs of any engine, validated and split into chunks; every error says what was wrong."""
    check_model(model)
    ignore_index = as_int(ignore_index, "ignore_index")
    tokens = as_token_matrix(tokens, "tokens")
    targets = as_token_matrix(targets, "targets")
    if tokens.shape != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match tokens shape {tuple(tokens.shape)}")
    b, n = tokens.shape
    if b == 0 or n == 0:
        raise ValueError(f"empty input: tokens have shape {tuple(tokens.shape)}")
    chunk_size = n if chunk_size is None else check_chunk_size(chunk_size)
    max_pos = getattr(model, "max_positions", None)
    if max_pos is not None and n > max_pos:
        raise ValueError(f"sequence length {n} exceeds the model's maximum positions {max_pos}")
    layout = getattr(model, "check_chunk_layout", None)
    if callable(layout):  # a model whose chunks would compute otherwise than the whole sequence (length-dependent
        layout(n, min(chunk_size, n))  # RoPE: seco_lab.models.hf.HFChunkModel.check_chunk_layout)
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), got range [{lo}, {hi}]")
        valid = targets[targets != ignore_index]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
            raise ValueError(f"target ids must lie in [0, {vocab}) or equal ignore_index={ignore_index}")
    n_targets = int((targets != ignore_index).sum())
    if n_targets == 0:
        raise ValueError(f"every target equals ignore_index={ignore_index}: there is no loss to differentiate")
    device = next(iter(model.parameters())).device
    return ChunkedBatch(tokens.to(device), targets.to(device), chunk_size, ignore_index, n_targets)


def checked_chunk(out, j: int | str) -> ChunkOutput:
    """``out`` if it is a valid chunk output with a finite loss; otherwise a clear error naming chunk j (or the
    chunks ``"a..b"`` of a pass-1 span)."""
    import torch

    from .protocol import ChunkOutput

    if not isinstance(out, ChunkOutput):
        raise TypeError(
            f"chunk_forward must return seco_lab.core.protocol.ChunkOutput(loss_sum, cache), got {type(out).__name__}"
        )
    if not torch.isfinite(out.loss_sum).all():
        raise FloatingPointError(
            f"the loss of chunk{'s' if isinstance(j, str) else ''} {j} is {float(out.loss_sum.detach())}: the model's "
            "forward produced NaN/inf (non-finite weights, a negative or zero norm eps, or overflow in a low-precision "
            "dtype)"
        )
    return out


# --------------------------------------------------------------------------- rebuilt chunks

RECOMPUTE_CHECKS = ("values", "metadata", "none", "checksum")
#: the environment variable that sets the default check (for runs started from the command line or a Trainer)
RECOMPUTE_ENV = "SECO_LAB_RECOMPUTE_CHECK"
_recompute = {"mode": None}  # None: the environment's choice, else "values"


def recompute_mode() -> str:
    """The check pass 2 applies to rebuilt chunks: :func:`recompute_check`'s mode inside its block, else
    ``$SECO_LAB_RECOMPUTE_CHECK``, else "values"."""
    mode = _recompute["mode"] or os.environ.get(RECOMPUTE_ENV) or "values"
    if mode not in RECOMPUTE_CHECKS:
        raise ValueError(f"{RECOMPUTE_ENV}={mode!r} is not a recompute check: use one of {RECOMPUTE_CHECKS[:3]}")
    return mode


def rebuild_rounding(dtype) -> float:
    """The relative L2 difference between a chunk's first-pass cache and its rebuild that rounding may cause:
    sqrt(eps) of the dtype (1.5e-8 in float64, 3.5e-4 in float32), where pass 1 may run several chunks at once
    (measured on SmolLM2-135M, 30 layers, 1024 tokens in 64-token chunks, spans of 512: at most 1.6e-6 in float32);
    eps in 16-bit floats (7.8e-3 in bfloat16, 9.8e-4 in float16), where pass 1 runs chunk by chunk while this check
    is on (:func:`seco_lab.core.engine.pass1_span`) and a rebuild reproduces it exactly: spans would round 1-3% apart
    in bfloat16 (2.5e-2 on SmolLM2), hiding noise of that size (campaign 40 D2)."""
    import torch

    info = torch.finfo(dtype)
    return info.eps if info.bits <= 16 else info.eps ** 0.5


class RecomputationError(RuntimeError):
    """A chunk rebuilt in pass 2 does not reproduce the cache of its first pass."""


@contextlib.contextmanager
def recompute_check(mode: str) -> Iterator[None]:
    """Within the block, check rebuilt chunks by ``mode``: "values" (the default: shape, dtype, device and every
    value, see the module docstring), "metadata" (shape, dtype, device) or "none"; "checksum" is the name "values"
    had when it compared sums, kept for code written against it."""
    if mode not in RECOMPUTE_CHECKS:
        raise ValueError(f"recompute_check mode must be one of {RECOMPUTE_CHECKS}, got {mode!r}")
    saved = _recompute["mode"]
    _recompute["mode"] = mode
    try:
        yield
    finally:
        _recompute["mode"] = saved


def computed_dtype(t: torch.Tensor) -> torch.dtype:
    """The precision ``t`` was computed in: its dtype, or autocast's lower one when autocast is on for its device
    (a float32 key under bfloat16 autocast came out of bfloat16 products)."""
    import torch

    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        low = torch.get_autocast_dtype(kind)
        if low.is_floating_point and torch.finfo(low).bits < torch.finfo(t.dtype).bits:
            return low
    return t.dtype


def check_recomputed(first: Sequence[torch.Tensor], rebuilt: Sequence[torch.Tensor], j: int) -> None:
    """Raise :class:`RecomputationError` naming chunk ``j`` unless its rebuilt cache tensors match the
    first pass's (``first`` empty: no first-pass cache to compare, nothing to check)."""
    mode = recompute_mode()
    if mode == "none" or not first:
        return
    import torch

    hint = ("the model's chunk_forward is not reproducible (dropout active? randomness in the forward: a hook or "
            "layer drawing noise from torch, numpy or random, in training or eval mode?), so the gradient would be "
            "wrong; call model.eval() or make the forward deterministic")
    if len(first) != len(rebuilt):
        raise RecomputationError(f"chunk {j} rebuilt returned {len(rebuilt)} cache tensors, its first pass "
                                 f"{len(first)}: {hint}")
    for r, (a, b) in enumerate(zip(first, rebuilt)):
        if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device):
            raise RecomputationError(
                f"chunk {j}'s rebuilt cache tensor {r} is {tuple(b.shape)} {b.dtype} on {b.device}, its first pass "
                f"{tuple(a.shape)} {a.dtype} on {a.device}: {hint}")
    if mode not in ("values", "checksum"):
        return
    # ||b - a|| and ||a|| of every tensor (float64; an integer tensor: its count of differing entries, and 0), read
    # back to the host at once: one device sync a chunk, not two a tensor
    norm, f64 = torch.linalg.vector_norm, torch.float64
    pairs = [(a.detach(), b.detach()) for a, b in zip(first, rebuilt)]
    home = pairs[0][0].device if pairs else None  # layers on several devices (a device map): gathered on one
    sizes = torch.stack([(torch.stack([norm(b - a, dtype=f64), norm(a, dtype=f64)]) if a.is_floating_point() else
                          torch.stack([(b != a).sum().to(f64), torch.zeros((), dtype=f64, device=a.device)])).to(home)
                         for a, b in pairs]).tolist() if pairs else []
    for r, ((a, _), (diff, scale)) in enumerate(zip(pairs, sizes)):
        allowed = rebuild_rounding(computed_dtype(a)) if a.is_floating_point() else 0.0
        if a.numel() and not diff <= allowed * scale:  # a NaN difference is one too
            raise RecomputationError(
                f"chunk {j}'s rebuilt cache tensor {r} differs from its first pass (|rebuilt - first| = "
                f"{diff / scale if scale else float('inf'):.3g} |first|; rounding is allowed {allowed:.2g}): "
                f"{hint}; if the forward is deterministic and only rounds differently between a chunk's first "
                "pass and its rebuild, compare metadata only (seco_lab.core.checks.recompute_check('metadata'), "
                f"or the environment variable {RECOMPUTE_ENV}=metadata)")


def as_float(value, what: str, *, finite: bool = True, allowed: str | None = None) -> float:
    """``value`` as a Python float: ints and floats (numpy's too); bools, strings and None are refused,
    and so are NaN and infinities unless ``finite=False``.  ``allowed`` says what the caller accepts in the
    messages (e.g. ``"a number in (0, 1]"``) instead of "a number"; the caller checks its range itself."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{what} must be {allowed or 'a number'}, got {value!r} ({type(value).__name__})")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{what} must be {allowed or 'a finite number'}, got an integer too large for a float"
                         ) from None
    if finite and not np.isfinite(out):
        raise ValueError(f"{what} must be {allowed or 'a finite number'}, got {out}")
    return out


def as_bool(value, what: str) -> bool:
    """``value`` as a bool: only True/False (numpy's too); ``'no'``, ``0`` and ``None`` are refused rather than
    read by their truthiness."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_seed(seed, what: str = "seed") -> int:
    """An integer seed in [0, 2**63): ``1.7`` and ``True`` are refused rather than truncated to 1, and a seed
    beyond what torch's generators take (a signed 64-bit integer) is refused naming its range."""
    seed = as_int(seed, what, 0)
    if seed >= 2**63:
        raise ValueError(f"{what} must be < 2**63 (a signed 64-bit integer), got {seed}")
    return seed


def check_key_value_task(seq_len: int, vocab_size: int, n_pairs: int) -> int:
    """The synthetic key-value task's sizes (:class:`seco_lab.data.sources.KeyValueTask`): a vocabulary of at least
    9 ids, 1 <= n_pairs <= (vocab_size - 1) // 4 keys, and 8 positions per pair; returns the number of keys."""
    if vocab_size < 9:
        raise ValueError(f"the key-value task needs vocab_size >= 9, got {vocab_size}")
    n_keys = (vocab_size - 1) // 4
    if not 1 <= n_pairs <= n_keys:
        raise ValueError(f"n_pairs={n_pairs} must lie in [1, {n_keys}] for vocab_size={vocab_size}")
    if seq_len < 8 * n_pairs:
        raise ValueError(f"seq_len={seq_len} is too short for {n_pairs} key-value pair(s) (need >= {8 * n_pairs})")
    return n_keys


def first_non_finite(state) -> str | None:
    """The name of the first floating-point tensor in ``state`` that holds a NaN or an infinity, or None: ``state``
    is a model's state dict (``{name: tensor}``), a list of ``(name, tensor)``, or an optimizer's state dict (its
    tensors named ``optimizer state of parameter i (exp_avg)``).  A sharded tensor (DTensor) is checked by this
    rank's shard.  A NaN or inf makes a tensor's sum non-finite, so a finite sum clears it (far faster than
    ``isfinite`` on every element); a sum that overflows (half precision) is settled by ``isfinite``."""
    import torch

    if isinstance(state, dict) and isinstance(state.get("state"), dict) and "param_groups" in state:
        state = [(f"optimizer state of parameter {i} ({key})", t) for i, per in state["state"].items()
                 if isinstance(per, dict) for key, t in per.items()]
    items = state.items() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    for item in items:  # anything else in a damaged file is left to loading it, which names it
        name, t = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta":
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if not bool(torch.isfinite(local.sum())) and not bool(torch.isfinite(local).all()):
            return str(name)
    return None
