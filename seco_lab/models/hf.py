"""Hugging Face ``transformers`` causal LMs as chunk models, LoRA through ``peft``.

:class:`HFChunkModel` wraps any decoder-only causal LM whose attention is full
causal attention over a key/value cache (Llama, Qwen2, Mistral without sliding
window, ...).  For chunk j it builds a :class:`~seco_lab.models.hf_attention.PrefixCache` from the
previous chunks' cache *leaves* (concatenated once per layer, inside the model's
cache update), passes global ``position_ids``, runs the model's own forward, and
returns the chunk's own keys/values -- the tensors the model computed, each
holding only its c positions -- with gradients flowing into the leaves.  An
``sdpa`` model is switched to ``seco_sdpa``, the same attention with the query
heads grouped per key/value head for the chunk pattern (no K/V repeat).  Only
public API is used: ``Cache``/``CacheLayerMixin``, ``AttentionInterface``,
``set_attn_implementation``, the model's forward, and its config.

What the trainer records and saves of such a model lives here too: :func:`config_record` (the HF
config in ``config.json``) and :func:`save_lora_adapter` (the LoRA adapter in peft's own format).

Install with ``pip install seco_lab[hf]`` (``make install`` does).
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import HF_ARCHITECTURE_DEFAULTS
from ..core.checks import as_bool, as_float, as_int, check_seed, first_non_finite, host_memory_bytes
from ..core.protocol import ChunkCache, ChunkOutput

__all__ = ["ARCHITECTURES", "HFChunkModel", "add_lora", "build_hf_model", "config_record", "exact_float64",
           "save_lora_adapter", "wrapped_lm"]

SUPPORTED_ATTENTION = ("eager", "sdpa", "eager_exact", "seco_sdpa")


def eager_exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention math with the softmax kept in the input dtype.

    The stock ``eager`` kernel computes the softmax in float32 even for float64
    inputs (~1e-8 relative error), which hides float64-level agreement; this
    kernel is registered as ``eager_exact`` through the public AttentionInterface.
    """
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = (query @ key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .hf_attention import register

    AttentionInterface.register("eager_exact", eager_exact_attention)
    AttentionMaskInterface.register("eager_exact", AttentionMaskInterface._global_mapping["eager"])
    register()


def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - the extra is installed by make install and CI
        raise ImportError("seco_lab.models.hf needs transformers: pip install 'seco_lab[hf]'") from e
    _register_attention()
    return transformers


def chunkable_reason(config) -> str | None:
    """Why a model cannot be driven chunk by chunk (None when it can)."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models are not causal decoders"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any("sliding" in str(t) or "chunked" in str(t) for t in layer_types):
        return (f"its layers use {sorted(set(map(str, layer_types)))} attention: a sliding or chunked window drops "
                "keys the chunk engine relays gradients through, so the gradient would be wrong")
    window = getattr(cfg, "sliding_window", None)
    # where the config lists its layers' types, they decide: a window no layer uses drops nothing (campaign 47 Q5)
    uses_window = getattr(cfg, "use_sliding_window", window is not None) and not layer_types
    if window is not None and uses_window:
        return (f"it uses sliding-window attention (window {window}): keys outside the window are dropped from the "
                "cache, so chunk-wise gradients would differ from full-sequence ones")
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        return f"attention implementation {impl!r} is not supported; use one of {', '.join(SUPPORTED_ATTENTION)}"
    return None


def length_dependent_rope(model: nn.Module) -> list[tuple[str, int, nn.Module, str]]:
    """``(rope type, positions, rotary module, buffer prefix)`` of each rotary embedding of ``model`` that picks its
    frequencies from the longest position of each forward (transformers' ``dynamic`` and ``longrope`` scaling: above
    ``positions`` it switches to scaled frequencies for *every* position), one per layer type where the rope type is
    given per layer type (Gemma3: prefix ``"full_attention_"``).  Chunk by chunk, a chunk ending within ``positions``
    would use other frequencies than a later chunk and than the whole sequence (campaign 34 X6: longrope Phi-3,
    3.6e-3; campaign 35: per layer type)."""
    found = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if isinstance(kinds, str):
            kinds = {None: kinds}
        if not isinstance(kinds, dict):
            continue
        params = getattr(getattr(module, "config", None), "rope_parameters", None)
        for layer_type, kind in kinds.items():
            prefix = f"{layer_type}_" if layer_type is not None else ""
            own = params.get(layer_type, {}) if layer_type is not None and isinstance(params, dict) else params
            if not isinstance(kind, str):
                continue
            if kind == "longrope":
                limit = own.get("original_max_position_embeddings") if isinstance(own, dict) else None
                limit = limit or getattr(getattr(module, "config", None), "original_max_position_embeddings", None)
            elif "dynamic" in kind:
                limit = getattr(module, f"{prefix}original_max_seq_len", getattr(module, "original_max_seq_len", None))
            else:
                continue
            if isinstance(limit, int):
                found.append((kind, limit, module, prefix))
    return found


_SOFTMAXES = (F.softmax, torch.softmax, torch.Tensor.softmax, F.log_softmax, torch.log_softmax)


class _KeepFloat64(torch.overrides.TorchFunctionMode):
    """While an RMSNorm runs on float64 activations: a cast of a float64 tensor to float32 (``x.float()``,
    ``x.to(torch.float32)``, ``x.to(dtype=torch.float32)``) is the identity, and a softmax asked in float32
    (transformers' eager attention) is computed in float64, so the norm's own formula -- whatever it is (Llama's
    ``weight * x``, Gemma's ``(1 + weight) * x``, one without weight) -- and the layer's are computed in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func is torch.Tensor.float and len(args) == 1 and not kwargs:
                return x
            if func is torch.Tensor.to and set(kwargs) <= {"dtype"}:
                asked = [*args[1:], *kwargs.values()]
                if asked == [torch.float32]:
                    return x
            if func in _SOFTMAXES and kwargs.get("dtype") == torch.float32:  # transformers' eager attention
                kwargs = {**kwargs, "dtype": None}
        return func(*args, **kwargs)


#: config fields (and module attributes) a modeling file draws randomness from in training: dropout applied as a
#: function (``F.dropout(h, p=config.hidden_dropout, training=self.training)``: OPT's ``dropout``, Bloom's and
#: Falcon's ``hidden_dropout``, no ``nn.Dropout`` module to find), layers skipped at random (OPT's ``layerdrop``) and
#: noise (Mixtral's ``router_jitter_noise``, PhiMoE's ``input_jitter_noise``); the heads a causal LM does not run
#: (``summary_*``, ``classifier_*``) aside.  The name ends so (``_rate``, ``_prob``, ``_p`` may follow:
#: ``hidden_dropout_prob``, ``dropout_rate``, ``drop_path_rate``): ``dropout_warmup_steps`` or
#: ``jitter_noise_warmup_steps`` count steps (campaign 38 B3)
_RANDOM_FIELD = re.compile(r"(dropout|pdrop|layerdrop|drop_path|jitter_noise|jitter_eps)(_rate|_prob|_p)?$")
_UNUSED_HEADS = ("summary_", "classifier_")


def _number(value) -> float | None:
    """``value`` as a float where it is a real number (a Python or numpy scalar, a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "size", None) == 1 and hasattr(value, "item"):
        value = value.item()  # a numpy array of one number (campaign 38 B2: np.array(0.5))
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def _random_values(items) -> dict[str, float]:
    """The dropout probabilities and jitter magnitudes among ``items`` (name, value): a name of
    :data:`_RANDOM_FIELD` and a dropout probability in (0, 1] or a jitter magnitude above 0 (campaign 37 A3: a
    ``jitter_noise`` of 2, or a tensor, draws noise too), read from a number or a one-element tensor or array -- a
    field merely mentioning noise (``denoise_steps=10``, ``jitter_seed``: campaign 36 Z1) is not one; randomness a
    name does not show is found by the first training forward (:class:`_NoRandomness`)."""
    out = {}
    for k, v in items:
        if isinstance(k, str) and _RANDOM_FIELD.search(k) and not k.startswith(_UNUSED_HEADS):
            x = _number(v)
            if x is not None and 0 < x and (x <= 1 or "jitter" in k):
                out[k] = v if isinstance(v, numbers.Real) else x  # as written; a tensor as its number
    return out


def random_fields(config) -> dict[str, float]:
    """The dropout- or noise-like fields of ``config`` (:data:`_RANDOM_FIELD`) set above 0: in training mode each
    makes the forward random, so a chunk rebuilt in pass 2 would not be the chunk of pass 1."""
    return _random_values(config.to_dict().items())


_DROPOUTS = {F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d,
             torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
             torch.native_dropout}
#: randomized leaky ReLU: a random slope in training (``training``, the fourth argument)
_RRELUS = {F.rrelu, F.rrelu_, torch.rrelu, torch.rrelu_}
#: functions that draw random numbers: in a training forward they make it random whatever they are called for
_SAMPLERS = {torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
             torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.Tensor.random_,
             torch.Tensor.bernoulli, torch.Tensor.multinomial, torch.bernoulli, torch.multinomial, torch.normal,
             torch.poisson, torch.rand_like, torch.randn_like, torch.randint_like}
#: random factories: a draw of one number is a decision (OPT draws its layerdrop coin even when layerdrop is 0, and
#: :func:`random_fields` refuses a layerdrop above 0); a draw of many is noise on activations
_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm}


def _rng_states(device: torch.device) -> tuple[bytes, ...]:
    """The state of the default random number generators a forward on ``device`` may draw from (the CPU one, and
    the device's)."""
    states = [torch.random.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return tuple(bytes(s.numpy()) for s in states)


class _NoRandomness(torch.overrides.TorchFunctionMode):
    """Raise on randomness in a forward: a dropout that would draw (a dropout function in training with p > 0, an
    attention with ``dropout_p > 0``), or a draw of random numbers (Mixtral's router jitter is
    ``torch.empty_like(h).uniform_(...)``).  Run around a training-mode forward, it finds what
    :attr:`HFChunkModel.deterministic` cannot read from modules, attributes and config fields."""

    def __init__(self):
        super().__init__()
        self.decisions = 0  # draws of one number (a coin: OPT's layerdrop), allowed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p, train = None, False
        if func in _DROPOUTS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            train = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        elif func is F.scaled_dot_product_attention:
            p, train = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0), True
        elif func in _RRELUS and kwargs.get("training", args[3] if len(args) > 3 else False):
            raise ValueError("the model is not deterministic: its forward applies a randomized leaky ReLU (rrelu) in "
                             "training mode, whose slopes are drawn at random, so a chunk rebuilt in pass 2 would not "
                             "be the chunk of pass 1 and the gradient would be wrong; call model.eval() or use a "
                             "fixed activation")
        if train and isinstance(p, numbers.Real) and p > 0:
            raise ValueError(f"the model is not deterministic: its forward applies dropout (p={p}, "
                             f"{getattr(func, '__name__', func)}) in training mode, so a chunk rebuilt in pass 2 "
                             "would not be the chunk of pass 1 and the gradient would be wrong; call model.eval() or "
                             "set that dropout to 0")
        out = func(*args, **kwargs)
        if func in _FACTORIES and isinstance(out, torch.Tensor) and out.numel() <= 1:
            self.decisions += 1
        elif func in _SAMPLERS or func in _FACTORIES:
            raise ValueError(f"the model is not deterministic: its forward draws random numbers "
                             f"({getattr(func, '__name__', func)}) in training mode (noise, jitter or a random "
                             "choice), so a chunk rebuilt in pass 2 would not be the chunk of pass 1 and the gradient "
                             "would be wrong; call model.eval() or set the noise to 0")
        return out


@functools.cache
def _casts_in_layers(module_name: str) -> bool:
    """Whether a transformers modeling module casts to float32 (``x.float()``, ``x.to(torch.float32)``) in its
    decoder layers' code -- its module-level functions (eager attention aside: not the attention seco_lab runs) or its
    attention, MLP and decoder-layer classes -- besides its norms (rebound on their own) and its rotary embedding (a
    constant of the positions, the same for every gradient path).  Cohere rotates its queries and keys in float32;
    Llama casts nowhere there, and its layers keep their own forward (no per-op dispatch cost)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return True  # unknown: keep float64 throughout
    scanned = [node for node in tree.body
               if (isinstance(node, ast.FunctionDef) and node.name != "eager_attention_forward")
               or (isinstance(node, ast.ClassDef) and node.name.endswith(("Attention", "MLP", "DecoderLayer",
                                                                          "Block", "Layer")))]
    for node in scanned:
        for call in ast.walk(node):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            if call.func.attr == "float" and not call.args:
                return True
            if call.func.attr == "to" and any(ast.unparse(a) == "torch.float32"
                                              for a in (*call.args, *(k.value for k in call.keywords))):
                return True
    return False


def _forward_in_float64(self, *args, **kwargs):
    x = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float64:  # half and single precision: transformers' own
        return type(self).forward(self, *args, **kwargs)
    with _KeepFloat64():
        return type(self).forward(self, *args, **kwargs)


def exact_float64(model: nn.Module) -> nn.Module:
    """Make an HF model compute its norms (and layers that cast) in float64 whenever its activations are float64.

    transformers' RMSNorms cast their input to float32 (meant for half precision), which rounds every gradient
    passing through it to float32.  Dense and SeCO round the same total gradient and still agree, but hop strata and
    sparse estimates split the gradient into parts rounded separately (~1e-8 relative).  This rebinds the forward of
    each norm (any transformers class named ``*Norm``: Llama's RMSNorm, Gemma's ``(1 + weight)`` form, Olmo's
    LayerNorm, ...) and of each decoder layer whose modeling code casts (:func:`_casts_in_layers`: Cohere's query
    and key rotation) to its own forward run with casts of float64 tensors to float32 made the identity
    (:class:`_KeepFloat64`), for float64 inputs only (other dtypes keep transformers' forward as it is); parameters
    and names are unchanged.  :class:`HFChunkModel` applies it to every model it drives, so a model cast with
    ``.double()`` after loading is exact too (campaign 29 S9; Gemma, Olmo and Cohere: campaign 31).
    """
    import types

    config = getattr(model, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"  # its float32 softmax
    layers = _decoder_layers(model, getattr(config, "num_hidden_layers", None))
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers.") or not callable(getattr(cls, "forward", None)):
            continue
        if cls.__name__.endswith("Norm") or (id(module) in layers  # Olmo's LayerNorm casts too
                                             and (eager or _casts_in_layers(cls.__module__))):  # Cohere's q/k
            module.forward = types.MethodType(_forward_in_float64, module)
    return model


def _decoder_layers(model: nn.Module, count) -> set[int]:
    """The ids of a model's decoder layers, whatever their class is called (``LlamaDecoderLayer``, ``GPT2Block``,
    ``BloomBlock``): the members of a ``ModuleList`` of ``count`` modules of one class (campaign 33 W7)."""
    out: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and len({type(m) for m in module}) == 1:
            out |= {id(m) for m in module}
    return out


class HFChunkModel(nn.Module):
    """Chunk-model protocol for a transformers causal LM (or a peft model wrapping one).

    ``chunk_attention=True`` switches an ``sdpa`` model to ``seco_sdpa`` (in place: the
    model's own full-sequence forward is unchanged, it delegates to transformers' sdpa).
    """

    # a sweep runs one backward product per relay label: vmap has no batching rule for the attention
    # kernels' backward on CPU and would loop over the labels anyway (seco_lab.core.engine.backward_sweep)
    batched_backward = False
    # the engine's pass 1 (no graph) forwards up to this many tokens at once, whole chunks, and splits their
    # keys/values, (B, H_kv, T, d), along the sequence axis into the chunks' leaves
    # (seco_lab.core.engine.pass1_span)
    pass1_tokens = 512
    cache_seq_dim = -2
    # SpaCO: how many drawn chunks (the last) pass 1 forwards with a graph that pass 2 backpropagates instead of
    # rebuilding them -- that many chunk forwards fewer, that many chunks' activations held meanwhile
    # (seco_lab.estimators.spaco.spaco_grad keep_graphs)
    keep_graphs = 0

    def __init__(self, model: nn.Module, chunk_attention: bool = True):
        super().__init__()
        transformers = _require_transformers()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not isinstance(base, transformers.PreTrainedModel):
            raise TypeError(f"HFChunkModel drives a transformers causal LM (or its peft wrapper), got "
                            f"{type(model).__name__}; a TinyTransformer is a chunk model already: use it directly")
        if base.get_output_embeddings() is None:  # a base model (LlamaModel) returns hidden states, no logits
            raise TypeError(f"HFChunkModel drives a causal LM with an LM head, got {type(base).__name__}, whose "
                            "get_output_embeddings() returns None (a base model such as LlamaModel returns hidden "
                            "states, not logits); pass its ...ForCausalLM class, e.g. "
                            "transformers.AutoModelForCausalLM, or make get_output_embeddings() return the output "
                            "layer that computes the logits")
        self.model = model
        self.train(model.training)  # the wrapper in the model's mode (campaign 33 W6: eval() called on the model
        # before wrapping was undone by the wrapper's own default, training)
        self.config = model.config
        reason = chunkable_reason(self.config)
        if reason:
            raise ValueError(f"{type(model).__name__} cannot be driven chunk by chunk: {reason}")
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        exact_float64(base)  # float64 RMSNorms in float64, whenever the model is cast (before or after wrapping)
        from .hf_attention import CHUNK_ATTENTION

        chunk_attention = as_bool(chunk_attention, "chunk_attention")  # "no" would read as True (campaign 29 S8)
        if chunk_attention and getattr(self.config, "_attn_implementation", None) == "sdpa":
            base.set_attn_implementation(CHUNK_ATTENTION)
        # seco_sdpa takes the prefix leaves and the own keys/values apart (no [prefix, own] concatenation)
        self._split = getattr(self.config, "_attn_implementation", None) == CHUNK_ATTENTION
        self._kv_buffer = None
        params = inspect.signature(base.forward).parameters
        # transformers renamed `past_key_values` to `cache`; accept either public name
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # without targets only the cache is wanted: the LM head runs on one position, not the chunk
        self._no_logits = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # the modules transformers' gradient_checkpointing_enable() switches (checked per chunk in training)
        self._rope_limits = length_dependent_rope(base)
        self._probed: set[int] = set()  # the forward signatures (modes, modules, hooks) probed by _NoRandomness
        self._modules_seen, self._children_seen = list(model.modules()), None  # _forward_signature's enumeration
        # a layerdrop field: the model draws a coin per layer even at layerdrop 0, which random_fields refuses above 0;
        # in another model a one-number draw is a random choice like any other (campaign 38: stochastic depth)
        self._layerdrop = any("layerdrop" in k for k in self.config.to_dict())
        self._checkpointing = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None),
                                                                        bool)]

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config.get_text_config(decoder=True), "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int:
        return self.config.get_text_config(decoder=True).vocab_size

    @property
    def deterministic(self) -> bool:
        """No randomness in the forward (:attr:`randomness`; the wrapped model's own modes decide, campaign 33 W6)."""
        return self.randomness is None

    @property
    def randomness(self) -> str | None:
        """What makes the forward random in training mode -- an ``nn.Dropout`` in training with p > 0, a dropout- or
        noise-like attribute above 0 of a module in training (OPT's layers keep ``dropout``, Mixtral's blocks
        ``jitter_noise``) or of the config (:func:`random_fields`) -- or None."""
        if not any(m.training for m in self.model.modules()):
            return None
        dropouts = sorted({n for n, m in self.model.named_modules() if m.training and (
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 or isinstance(m, nn.RReLU))})
        if dropouts:
            more = f" and {len(dropouts) - 1} more" if len(dropouts) > 1 else ""
            return f"dropout module {dropouts[0]}{more} {'are' if more else 'is'} active in training mode"
        fields = random_fields(self.config.get_text_config(decoder=True))
        if fields:
            named = ", ".join(f"{k}={v}" for k, v in fields.items())
            return f"its config's {named} draws dropout or noise in training mode"
        for name, module in self.model.named_modules():
            values = _random_values(vars(module).items()) if module.training else {}
            if values:
                key, value = next(iter(values.items()))
                return f"{name or 'the model'}.{key}={value} draws dropout or noise in training mode"
        return None

    def chunk_logits(self, tokens, past: Sequence[ChunkCache], start: int, all_logits: bool = True):
        """(logits, own cache) of one chunk after ``past``; own[l] = (keys, values) of this chunk only.
        ``all_logits=False`` may return the logits of the last position only."""
        from .hf_attention import PrefixCache

        if self.training and any(m.gradient_checkpointing for m in self._checkpointing):
            raise ValueError("gradient checkpointing is enabled on the model (gradient_checkpointing_enable() or "
                             "activation_checkpointing_enable()): "
                             "in training transformers then turns the KV cache off, which chunk-by-chunk training "
                             "needs (a recomputed layer would also update the chunk cache twice); SeCO already keeps "
                             "only one chunk's activations: call model.activation_checkpointing_disable() (or "
                             "gradient_checkpointing_disable())")
        b, t = tokens.shape
        if self._rope_limits:
            self._check_rope_switch(past, start + t)
        cache = PrefixCache(past, self.n_layers, split=self._split, buffer=self._kv_buffer)
        pos = torch.arange(start, start + t, device=tokens.device).unsqueeze(0).expand(b, t)
        extra = {} if all_logits else self._no_logits
        modes = self._forward_signature()
        if modes is not None and modes not in self._probed:  # once per set of modes, modules and hooks
            rng = _rng_states(tokens.device)
            with _NoRandomness() as probe:
                out = self.model(input_ids=tokens, position_ids=pos, use_cache=True, **{self._cache_arg: cache},
                                 **extra)
            coins = probe.decisions and self._layerdrop  # OPT's layerdrop coin (its layerdrop is 0, else refused)
            if not coins and _rng_states(tokens.device) != rng:  # a draw no list names, or a coin of another model
                raise ValueError("the model is not deterministic: its forward draws random numbers in training mode "
                                 "(the random number generator advanced), so a chunk rebuilt in pass 2 would not be "
                                 "the chunk of pass 1 and the gradient would be wrong; call model.eval() or remove "
                                 "the random draw")
            self._probed.add(modes)
        else:
            out = self.model(input_ids=tokens, position_ids=pos, use_cache=True, **{self._cache_arg: cache}, **extra)
        return out.logits, cache.own()

    def _forward_signature(self) -> int | None:
        """What decides whether the forward draws randomness beyond what :attr:`randomness` reads, as a hash, or None
        where no module is in training: each module (by identity: one swapped in later is new, campaign 38 B1), its
        training mode, a forward set on it, and the forward hooks registered on a module or globally (their handles'
        ids: a hook added after the first call may draw, campaign 38 B2; tensor and autograd-node hooks, which FSDP
        registers on every forward, do not count).  The modules are enumerated again only when a module's children
        change (~0.7 ms a call for 400 modules; a new enumeration costs ~1.3 ms more)."""
        from torch.nn.modules import module as torch_module

        children = tuple(id(c) for m in self._modules_seen for c in m._modules.values())
        if children != self._children_seen:
            self._modules_seen = list(self.model.modules())
            self._children_seen = children = tuple(id(c) for m in self._modules_seen for c in m._modules.values())
        training = tuple(m.training for m in self._modules_seen)
        if not any(training):
            return None
        hooks = tuple(k for m in self._modules_seen for d in (m._forward_hooks, m._forward_pre_hooks) for k in d)
        return hash((children, training, tuple(id(m.__dict__.get("forward")) for m in self._modules_seen), hooks,
                     tuple(torch_module._global_forward_hooks), tuple(torch_module._global_forward_pre_hooks)))

    def _check_rope_switch(self, past: Sequence[ChunkCache], end: int) -> None:
        """A length-dependent RoPE (:func:`length_dependent_rope`) gives every chunk the frequencies the whole
        sequence gets only when every chunk ends on the same side of its switch (longrope: two sets of frequencies),
        or (dynamic: frequencies computed from the longest position) when no chunk but a sequence's only one ends
        past it (:meth:`check_chunk_layout`, which every engine asks first; asked again here where the first chunk is
        known).  A dynamic rotary grown by an earlier, longer forward is reset for a chunk within its positions."""
        for kind, limit, rotary, prefix in self._rope_limits:
            grown = getattr(rotary, f"{prefix}max_seq_len_cached", getattr(rotary, "max_seq_len_cached", 0))
            original = getattr(rotary, f"{prefix}original_inv_freq", None)
            if "dynamic" in kind and end <= limit and original is not None and int(grown) > limit:  # int(): a tensor
                # transformers keeps the grown frequencies for a forward ending at the limit exactly, resets them
                # below it: every chunk takes the original ones
                rotary.register_buffer(f"{prefix}inv_freq", original.to(getattr(rotary, f"{prefix}inv_freq").device),
                                       persistent=False)
                setattr(rotary, f"{prefix}max_seq_len_cached", limit)
        if past and end > min(limit for _, limit, _, _ in self._rope_limits):
            self.check_chunk_layout(end, past[0][0][0].shape[-2])  # the first chunk's keys: (b, heads, positions, d)

    def check_chunk_layout(self, length: int, first_chunk: int) -> None:
        """Refuse (ValueError) sequences of ``length`` tokens cut into chunks whose first holds ``first_chunk``
        tokens where a length-dependent RoPE (:func:`length_dependent_rope`) would give the chunks other frequencies
        than the whole sequence: longrope, a first chunk ending within its switch and the sequence past it; dynamic,
        more than one chunk with the sequence past it.  Every engine asks (``seco_lab.core.checks.checked_batch``),
        and so does the trainer before its run folder is made."""
        for kind, limit, _, _ in self._rope_limits:
            if length <= limit or first_chunk >= length:
                continue
            if first_chunk <= limit or kind != "longrope":  # dynamic: the frequencies follow the longest position
                raise ValueError(f"{type(self.model).__name__}'s {kind} RoPE scaling picks its frequencies from the "
                                 f"longest position of each forward: past {limit} positions it switches every "
                                 f"position to scaled frequencies, so a chunk ending at {first_chunk} would use other "
                                 f"frequencies than the chunk ending at {length} (and than the whole sequence): the "
                                 f"gradient would be wrong; keep sequences within {limit} tokens"
                                 + (f", make the first chunk longer than {limit} tokens" if kind == "longrope" else "")
                                 + f", or use a model without {kind} RoPE scaling")

    @contextmanager
    def cache_buffer(self, batch_size: int, length: int):
        """Within: chunk forwards without a graph store their keys/values in one buffer per layer for the
        first ``length`` positions (:class:`~seco_lab.models.hf_attention.KVBuffer`), so a chunk's prefix is read
        as one view.  The engine's pass 1 opens it; the buffer lives on as the leaves' storage."""
        from .hf_attention import KVBuffer

        previous, self._kv_buffer = self._kv_buffer, KVBuffer(self.n_layers, batch_size, length)
        try:
            yield self._kv_buffer
        finally:
            self._kv_buffer = previous

    def stored_cache(self, cache, start: int):
        """A chunk's cache built with a graph (pass 1 keeping it for pass 2), its keys/values copied into the open
        cache buffer at ``start``: views of the buffer, so later chunks still read their prefix as one view; the
        cache as it is where no buffer is open or it does not fit."""
        if self._kv_buffer is None:
            return cache
        with torch.no_grad():
            stored = [self._kv_buffer.store(l, start, k.detach(), v.detach()) for l, (k, v) in enumerate(cache)]
        return cache if any(s is None for s in stored) else tuple(stored)

    def fused_grads(self, params):
        """The engine's pass 2 opens this around its chunk backwards: the model's linear and embedding
        layers whose parameters are all in ``params`` add their gradients into ``.grad`` in place
        (:func:`~seco_lab.models.fused_grads.fused_param_grads`)."""
        from .fused_grads import fused_param_grads

        return fused_param_grads(self.model, params)

    @property
    def n_layers(self) -> int:
        return self.config.get_text_config(decoder=True).num_hidden_layers

    def chunk_forward(self, tokens, targets, past: Sequence[ChunkCache] = (), start: int = 0,
                      ignore_index: int = -100) -> ChunkOutput:
        logits, cache = self.chunk_logits(tokens, past, start, all_logits=targets is not None)
        if targets is None:
            return ChunkOutput(logits.new_zeros(()), cache)
        if logits.dtype in (torch.float16, torch.bfloat16):  # as transformers' loss: a 16-bit sum of 64 token losses
            logits = logits.float()  # of ~5 is 1-5% off, and the chunks' sums add up (campaign 41 E3)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                               reduction="sum")
        return ChunkOutput(loss, cache)


ARCHITECTURES = HF_ARCHITECTURE_DEFAULTS  # small random-weight configs for tests and studies; override any field


#: config fields of the named architectures that are sizes or counts: integers >= 1 (0 or less builds a model
#: without layers or heads that trains and reports a loss, or fails deep inside transformers)
HF_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "head_dim", "max_window_layers", "sliding_window")


#: the most decoder layers a named architecture is built with (a config of 10**7 layers takes minutes to make)
MAX_HF_LAYERS = 100_000


def check_hf_sizes(config: dict, overrides: dict) -> None:
    """Range-check the sizes of a named architecture's config (its defaults with ``overrides``): each size or
    count an integer >= 1, hidden_size divisible by num_attention_heads (unless head_dim is set), and
    num_attention_heads by num_key_value_heads."""
    for key in HF_SIZE_FIELDS:
        value = overrides.get(key)
        if key not in overrides or (value is None and key in ("head_dim", "sliding_window", "num_key_value_heads")):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--hf-override {key}={json.dumps(value)}: {key} is a size or count and must be an "
                             "integer >= 1")
        if key == "num_hidden_layers" and value > MAX_HF_LAYERS:  # campaign 33 W8: 10**7 layers hung in the config
            raise ValueError(f"--hf-override num_hidden_layers={value}: more than {MAX_HF_LAYERS:,} layers is no model "
                             "this machine can build (the largest models have a few hundred)")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    hidden = config.get("hidden_size")
    if config.get("head_dim") is None and hidden % heads:
        raise ValueError(f"--hf-override: hidden_size={hidden} must be divisible by num_attention_heads={heads} "
                         "(each head gets hidden_size / num_attention_heads dimensions); change one of them")
    if kv is not None and heads % kv:
        raise ValueError(f"--hf-override: num_attention_heads={heads} must be divisible by num_key_value_heads={kv} "
                         "(grouped-query attention shares each key/value head among a whole group); change one "
                         "of them")


def check_hf_overrides(architecture: str, overrides: dict) -> None:
    """Refuse fields the architecture's transformers config does not have (it would store them unused)."""
    transformers = _require_transformers()
    conf_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[architecture]
    defaults = conf_cls().to_dict()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"--hf-override: {architecture} has no config field(s) {', '.join(unknown)}; e.g. "
                         "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size")
    for key, value in overrides.items():  # transformers' own type errors name no way out (campaign 32 V4)
        default = defaults[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            if key in CHECKPOINT_EPS_FIELDS and value < 0:  # the example would be refused next (campaign 34 N40)
                raise ValueError(f"--hf-override {key}={value}: {key} is a float >= 0 (the {architecture} default "
                                 f"is {default}), e.g. {key}={default}")
            raise ValueError(f"--hf-override {key}={value}: {key} is a float (the {architecture} default is "
                             f"{default}); write it as one, e.g. {key}={float(value)}")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity"):
                raise ValueError(f"--hf-override {key}={value}: {key} must be a finite number")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"--hf-override {key}={json.dumps(value)}: {key} is a number (the "
                                 f"{architecture} default is {default}); write it as one, e.g. {key}={default}")
            if not math.isfinite(value):
                raise ValueError(f"--hf-override {key}={value}: {key} must be a finite number")
    check_hf_sizes({**ARCHITECTURES[architecture], **overrides}, overrides)
    try:
        config = conf_cls(**{**ARCHITECTURES[architecture], **overrides})
    except Exception as e:  # noqa: BLE001 -- transformers' validation errors share no base class
        raise ValueError(f"--hf-override {overrides}: {str(e).splitlines()[-1].strip()}") from None
    problem = config_problem(config)
    if problem:
        raise ValueError(f"--hf-override {overrides}: {problem}")


#: the text config's fields that are sizes or counts, checked >= 1 in a checkpoint's config.json (a negative one fails
#: deep inside torch, 0 layers builds a model that trains without them)
CHECKPOINT_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads", "head_dim")
#: the norm epsilons of a checkpoint's config.json, checked >= 0 (a negative one makes a NaN of every forward)
CHECKPOINT_EPS_FIELDS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")
RESAVE = "re-save it with save_pretrained or copy it again"


def load_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a checkpoint it cannot build: a damaged safetensors header (SafetensorError), a
    config its validators refuse (huggingface_hub's StrictDataclassError; a ZeroDivisionError for 0 heads), a tensor
    of negative size or weights that do not fit the config (RuntimeError), an unknown ``hidden_act`` (KeyError), and
    its own ValueError / TypeError.  OSError (no permission, a missing or
    non-JSON file) is left out: transformers' and the OS's messages name the file already; so is
    ``torch.OutOfMemoryError`` (a RuntimeError), which :func:`is_load_error` tells apart."""
    errors: list[type[Exception]] = [RuntimeError, ValueError, TypeError, KeyError, ArithmeticError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors comes with transformers
        pass
    try:
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    except ImportError:  # pragma: no cover - older huggingface_hub: transformers validated with ValueError
        pass
    return tuple(errors)


def is_load_error(e: BaseException) -> bool:
    """``e`` is one of :func:`load_errors` (a fault of the files read), not running out of memory."""
    return isinstance(e, load_errors()) and not isinstance(e, torch.OutOfMemoryError)


def load_error_reason(e: BaseException) -> str:
    """One line of what went wrong: the validator's own error for a StrictDataclassError (its message is a
    header and that error), else the first line of the message, with the exception's class."""
    inner = e.__cause__ if type(e).__name__.startswith("StrictDataclass") and e.__cause__ is not None else e
    if "ignore_mismatched_sizes" in str(inner):  # transformers' pointer to the load report it logged
        return "the weights' shapes differ from the config's: transformers' load report above lists them"
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    text = f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _check_checkpoint_config(transformers, folder: Path) -> None:
    """config.json loads, passes transformers' validators, and its sizes are integers >= 1."""
    where = folder / "config.json"
    if not where.is_file():  # campaign 33 W10: an empty folder was told to fix a field of a file it lacks
        raise ValueError(f"{folder} holds no config.json: it is not a saved model folder; name the folder a model was "
                         "saved in with save_pretrained (its config.json, weights and tokenizer)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except load_errors() as e:
        if not is_load_error(e):
            raise
        raise ValueError(f"{where} is not a valid model config ({load_error_reason(e)}): fix that field or "
                         f"{RESAVE}") from None
    problem = config_problem(config)
    if problem:
        raise ValueError(f"{where}: {problem}: the config is damaged; fix it or {RESAVE}")


def config_problem(config) -> str | None:
    """What makes a transformers config unusable although its validators pass, or None: a size or count below 1 (a
    negative one fails deep inside torch, 0 layers builds a model that trains without them), a rope base <= 0 or a
    negative norm eps (NaN in every forward), an activation transformers does not know (a KeyError when built)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for key in CHECKPOINT_SIZE_FIELDS:
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            return f"{key} is {value}, but it is a size or count and must be an integer >= 1"
    rope = getattr(text, "rope_parameters", None)
    scales = {**({"rope_theta": rope.get("rope_theta")} if isinstance(rope, dict) else {}),
              **{k: getattr(text, k) for k in ("rope_theta", *CHECKPOINT_EPS_FIELDS) if hasattr(text, k)}}
    for key, value in scales.items():
        low = key == "rope_theta" and isinstance(value, (int, float)) and not value > 0
        if low or (isinstance(value, (int, float)) and not (value >= 0 and math.isfinite(value))):
            return f"{key} is {value}, but it must be {'> 0' if key == 'rope_theta' else '>= 0'} and finite"
    act = getattr(text, "hidden_act", None)
    if isinstance(act, str):
        from transformers.activations import ACT2FN

        if act not in ACT2FN:
            return f"hidden_act is {act!r}, an activation transformers does not know (e.g. 'silu', 'gelu')"
    return None


def _damaged_weights_file(folder: Path) -> Path | None:
    """The first safetensors file of ``folder`` whose header does not parse (None when all do)."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError):
            return path
    return None


def _weights_file(folder: Path, name: str) -> Path:
    """The file of a checkpoint folder that holds the tensor ``name`` (as far as the folder says; else the folder)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            continue
        hit = weight_map.get(name) or next((f for n, f in weight_map.items() if name.endswith("." + n)), None)
        if hit:
            return folder / hit
    return next((folder / f for f in ("model.safetensors", "pytorch_model.bin") if (folder / f).is_file()), folder)


def check_finite_weights(model: nn.Module, folder: Path) -> None:
    """Refuse a loaded checkpoint with a NaN or infinite weight (parameters and stored buffers): training would
    only report a NaN loss at its first step."""
    name = first_non_finite(model.state_dict())
    if name is not None:
        raise ValueError(f"{_weights_file(folder, name)} holds non-finite weights ({name}): the checkpoint is "
                         f"damaged (or was saved from a diverged model); {RESAVE}")


def load_checkpoint(folder: str | os.PathLike, attn_implementation: str = "sdpa") -> nn.Module:
    """A causal LM from a local checkpoint folder (nothing is downloaded).  A damaged or inconsistent folder -- a
    truncated or empty weights file, a config transformers' validators refuse or with impossible sizes, weights
    that do not fit the config, NaN weights -- is refused in one line (ValueError) naming the file, not with a
    traceback from safetensors, torch or transformers."""
    transformers = _require_transformers()
    folder = Path(folder)
    _check_checkpoint_config(transformers, folder)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), attn_implementation=attn_implementation, local_files_only=True, output_loading_info=True)
    except load_errors() as e:
        if not is_load_error(e):
            raise
        damaged = _damaged_weights_file(folder) if type(e).__name__ == "SafetensorError" else None
        if damaged is not None:
            raise ValueError(f"{damaged} is damaged or truncated ({load_error_reason(e)}); {RESAVE}") from None
        raise ValueError(f"{folder} does not load as a causal LM ({load_error_reason(e)}): the checkpoint is damaged "
                         f"or its weights do not fit its config.json; {RESAVE}") from None
    missing = sorted(info.get("missing_keys") or ()) if isinstance(info, dict) else []
    if missing:  # transformers initialises them at random: the model would be partly the checkpoint's, partly not
        raise ValueError(f"{_weights_file(folder, missing[0])} lacks {len(missing)} weight(s) the model needs "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): transformers would "
                         f"initialise them at random, so the model would not be the checkpoint's; the checkpoint is "
                         f"incomplete -- {RESAVE}")
    check_finite_weights(model, folder)
    return model


#: the dtypes build_hf_model builds a model in
MODEL_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_fits(transformers, config, dtype: torch.dtype) -> None:
    """Refuse, before allocating, weights larger than this machine's memory (built in float32, then cast): the model
    is first built on the meta device, which allocates nothing, to count its parameters; torch's allocator would
    otherwise fail deep inside an embedding (campaign 31: ``vocab_size`` 10**12).  Its decoder layers are alike, so
    it is built with one and with two layers, and the count extrapolated: building 10**6 layers, even on the meta
    device, would take hours (campaign 32 V11)."""
    import copy

    counts = []
    for n in (1, 2):
        small = copy.deepcopy(config)
        small.num_hidden_layers = n
        if isinstance(getattr(small, "layer_types", None), list):
            small.layer_types = small.layer_types[:n]
        with torch.device("meta"):
            shapes = transformers.AutoModelForCausalLM.from_config(small)
        counts.append(sum(p.numel() for p in shapes.parameters()))
    count = counts[0] + (config.num_hidden_layers - 1) * (counts[1] - counts[0])
    need, have = count * max(4, dtype.itemsize), host_memory_bytes()
    if have is not None and need > have:
        raise MemoryError(f"a {type(shapes).__name__} of {count:,} parameters needs {need / 2**30:,.1f} GiB for its "
                          f"weights alone, more than this machine's {have / 2**30:.1f} GiB: lower vocab_size, "
                          "hidden_size, intermediate_size or num_hidden_layers")


def build_hf_model(name_or_path: str, overrides: dict | None = None, attn_implementation: str = "sdpa",
                   dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A causal LM: a named architecture with random weights (``llama``, ``qwen2``) or a local checkpoint
    directory.  (Pretrained models shipped by a package or as ``.gguf`` files are built on this by
    :mod:`seco_lab.models.pretrained`; :func:`seco_lab.models.pretrained.build_causal_lm` takes any of the three.)"""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"name_or_path must name an architecture ({', '.join(ARCHITECTURES)}) or a local checkpoint "
                         f"directory, got {name_or_path!r}")
    if overrides is not None and not isinstance(overrides, dict):
        raise TypeError(f"overrides must be a dict of config field: value, got {type(overrides).__name__} "
                        f"{overrides!r:.80}")
    bad_keys = [k for k in overrides or {} if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"overrides must be a dict keyed by config field names (str), got the key {bad_keys[0]!r} "
                        f"({type(bad_keys[0]).__name__})")
    if not isinstance(dtype, torch.dtype) or dtype not in MODEL_DTYPES:  # float8 builds, then fails at a gradient
        raise TypeError(f"dtype must be one of {', '.join(map(str, MODEL_DTYPES))} (a dtype a model computes and "
                        f"trains in), got {dtype!r} ({type(dtype).__name__})")
    seed = check_seed(seed)  # 1.5 and True would build seed 1's weights
    transformers = _require_transformers()
    if not isinstance(attn_implementation, str) or attn_implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"attention implementation {attn_implementation!r}: use one of {SUPPORTED_ATTENTION}")
    torch.manual_seed(seed)
    if name_or_path in ARCHITECTURES:
        check_hf_overrides(name_or_path, overrides or {})
        conf_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[name_or_path]
        config = conf_cls(**{**ARCHITECTURES[name_or_path], **(overrides or {})})
        config._attn_implementation = attn_implementation
        _check_fits(transformers, config, dtype)
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        if not Path(name_or_path).is_dir():
            raise ValueError(f"{name_or_path!r} is neither a known architecture ({', '.join(ARCHITECTURES)}) nor a "
                             "local checkpoint directory (nothing is downloaded; pretrained models: "
                             "seco_lab.models.pretrained.build_causal_lm)")
        model = load_checkpoint(name_or_path, attn_implementation)
    model = model.to(dtype)
    return exact_float64(model) if dtype == torch.float64 else model


def checkpoint_tokenizer(path: str):
    """The tokenizer saved in a local checkpoint directory (nothing is downloaded).  Text for a checkpoint
    must go through its own tokenizer: byte values are not its token ids, and training on them would give
    a quietly wrong model and loss, so a directory without a tokenizer is refused."""
    transformers = _require_transformers()
    if not Path(path).is_dir():  # transformers would read the path as a Hub repo id (campaign 32 V7)
        kind = " (it is a file)" if Path(path).exists() else ""
        raise ValueError(f"--hf-model {path}: no such checkpoint folder{kind}; name the folder the model was saved "
                         "in (a resumed run reads the one it was trained on: put it back at that path)")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--hf-model {path} --data text: the checkpoint directory holds no tokenizer that loads "
                         f"offline ({reason[:200]}); text must be tokenized with the model's own tokenizer, not "
                         "fed as bytes. Save it beside the weights (tokenizer.save_pretrained(DIR)) or use --data "
                         "synthetic") from None


def check_lora_rank(model: nn.Module, r: int, targets) -> None:
    """Refuse empty target names, and a rank above the smallest dimension of a targeted linear layer: LoRA's
    update ``B @ A`` of an ``out x in`` layer has rank at most ``min(in, out)``, so a larger r adds parameters
    (and compute) and nothing else."""
    targets = list(targets)
    if not targets or any(not isinstance(t, str) or not t.strip() for t in targets):
        raise ValueError(f"--lora-targets {targets!r} names no module (or an empty name); name the modules LoRA "
                         "wraps, e.g. --lora-targets q_proj,v_proj")
    shapes = [(name, m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]
    if not shapes:
        return  # peft names the targets it did not find
    name, fan_in, fan_out = min(shapes, key=lambda s: min(s[1], s[2]))
    limit = min(fan_in, fan_out)
    if r > limit:
        raise ValueError(f"--lora-r {r} is above {limit}, the smallest dimension of the targeted layers ({name}: "
                         f"{fan_in} -> {fan_out}), where a LoRA update has rank at most {limit}; pass --lora-r {limit} "
                         "or less")


def check_lora_targets(model: nn.Module, targets) -> None:
    """Every LoRA target names a module of ``model`` (peft's rule for a list: the module's name, or its last
    dotted parts); peft itself refuses only a list that matches nothing, so one misspelt name among good ones
    would train fewer adapters than asked without a word."""
    if isinstance(targets, str):  # peft reads a string as one regular expression: nothing to check by name
        return
    modules = list(model.named_modules())
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _ in modules)]
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules if isinstance(m, nn.Linear)})
    if missing:
        raise ValueError(f"--lora-targets: {', '.join(map(repr, missing))} match{'es' if len(missing) == 1 else ''} "
                         f"no module of the model; its linear layers are named {', '.join(linear)}")
    # peft wraps linear, embedding and convolution layers; a container (self_attn, mlp) fails deep inside peft
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    other = [(t, type(m).__name__) for t in targets for n, m in modules
             if (n == t or n.endswith("." + t)) and not isinstance(m, kinds)]
    if other:
        raise ValueError(f"--lora-targets: {other[0][0]!r} names a {other[0][1]}, which LoRA cannot wrap (it wraps "
                         f"linear, embedding and convolution layers); name the linear layers inside it, e.g. "
                         f"{', '.join(linear[:4])}")


#: the LoRA initialisations add_lora takes besides True (A Kaiming-uniform, B zero) and False (both random)
LORA_INITS = ("gaussian",)


def lora_target_names(targets) -> list[str]:
    """LoRA target module names as a list of non-empty strings: a string (peft would read it as a regular
    expression; ``list('q_proj')`` would be six one-letter names), bytes, None or a list holding anything but
    strings is refused."""
    if isinstance(targets, str):  # campaign 29 S6
        raise TypeError(f"targets must be a list of module names, got the string {targets!r} (use [{targets!r}])")
    if isinstance(targets, (bytes, bytearray, dict)) or not isinstance(targets, (list, tuple, set, frozenset)):
        raise TypeError(f"targets must be a list of module names (str), got {targets!r:.80} "
                        f"({type(targets).__name__})")
    targets = list(targets)
    bad = [t for t in targets if not isinstance(t, str) or not t.strip()]
    if not targets or bad:
        raise ValueError(f"targets {targets!r:.80} names no module ("
                         + (f"{bad[0]!r} is not a module name" if bad else "an empty list")
                         + "): pass module names (str), e.g. ['q_proj', 'v_proj']")
    return targets


def add_lora(model: nn.Module, r: int = 8, alpha: int = 16, targets=("q_proj", "v_proj"), dropout: float = 0.0,
             init_lora_weights=True) -> nn.Module:
    """Wrap with peft LoRA adapters on ``targets`` (default: attention q and v, as in the paper);
    only the adapter weights require grad."""
    from peft import LoraConfig, get_peft_model

    transformers = _require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):  # peft would fail deep inside, or wrap the wrong thing
        wrapped = " (add LoRA first: HFChunkModel(add_lora(model)))" if isinstance(model, HFChunkModel) else ""
        raise TypeError(f"add_lora wraps a transformers model (transformers.PreTrainedModel), got "
                        f"{type(model).__name__}{wrapped}")
    if model.get_output_embeddings() is None:  # peft's CAUSAL_LM wrapper needs the LM's generation methods
        raise TypeError(f"add_lora wraps a causal LM with an LM head, got {type(model).__name__}, which has none; pass "
                        "its ...ForCausalLM class, e.g. transformers.AutoModelForCausalLM")
    targets = lora_target_names(targets)
    r = as_int(r, "LoRA rank r", minimum=1)
    alpha = as_float(alpha, "LoRA alpha")
    if not alpha > 0:  # alpha 0 scales every adapter's output, and so its gradient, to 0 (campaign 29 S8)
        raise ValueError(f"LoRA alpha must be > 0, got {alpha} (the adapters' scale is alpha / r)")
    dropout = as_float(dropout, "LoRA dropout", allowed="a number in [0, 1)")  # NaN would build no dropout
    if not 0 <= dropout < 1:
        raise ValueError(f"LoRA dropout must be a number in [0, 1), got {dropout}")
    if not (isinstance(init_lora_weights, bool) or init_lora_weights in LORA_INITS):
        raise ValueError(f"init_lora_weights must be True, False or one of {', '.join(map(repr, LORA_INITS))}, got "
                         f"{init_lora_weights!r}; peft's other methods (pissa, olora, loftq, eva, corda, ...) change "
                         "the base weights or need data: build those with peft.get_peft_model directly")
    check_lora_targets(model, targets)
    check_lora_rank(model, r, targets)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=dropout, bias="none",
                     task_type="CAUSAL_LM", init_lora_weights=init_lora_weights)
    with warnings.catch_warnings():  # peft reads transformers' deprecated alias: a FutureWarning per model
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        # peft keeps the adapters of a float16/bfloat16 model in float32 by default: one model of two dtypes, which
        # the chunk engine refuses (campaign 37 A2); the adapters take the dtype of the layers they wrap
        return get_peft_model(model, cfg, autocast_adapter_dtype=False)


def wrapped_lm(model) -> nn.Module | None:
    """The causal LM an :class:`HFChunkModel` wraps (a peft model under LoRA), or None for another chunk model."""
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "save_pretrained") else None


def config_record(model) -> dict | None:
    """What a run's ``config.json`` records of an :class:`HFChunkModel`: its HF config's ``to_diff_dict()``
    (the fields that differ from the architecture's defaults), or None when it has no HF config."""
    hf_config = getattr(getattr(model, "model", None), "config", None)
    return hf_config.to_diff_dict() if hasattr(hf_config, "to_diff_dict") else None


def save_lora_adapter(model, out, base_model: str, targets, state: dict | None = None):
    """Write the LoRA adapter of ``model`` (an :class:`HFChunkModel` around a peft model) in peft's own
    format to the folder ``out`` and return it; the adapter names ``base_model`` as its base where peft
    recorded none.  ``state``: the chunk model's full state dict (gathered from FSDP shards); None reads
    the model's own parameters."""
    inner = wrapped_lm(model)
    for peft_cfg in getattr(inner, "peft_config", {}).values():
        peft_cfg.base_model_name_or_path = peft_cfg.base_model_name_or_path or base_model
    if state is not None:
        state = {k.removeprefix("model."): v for k, v in state.items()}
    # peft's "auto" asks the Hub whether the base model's vocabulary changed; it never does here, so say
    # whether embeddings are adapted and stay offline
    from peft.utils.other import EMBEDDING_LAYER_NAMES

    embeddings = any(t in EMBEDDING_LAYER_NAMES for t in targets)
    inner.save_pretrained(str(out), save_embedding_layers=embeddings,
                          **({} if state is None else {"state_dict": state}))
    return out
