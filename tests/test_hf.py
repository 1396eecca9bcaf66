"""Hugging Face transformers models through the chunk adapter, LoRA through peft (float64, random weights)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from seco_lab import dense_grad, enumerate_expectation, flatten, get_scheme, hop_strata, seco_grad
from seco_lab.models.hf import HFChunkModel, add_lora, build_hf_model
from seco_lab.training.trainer import RunControl, TrainConfig, Trainer

TOL = 1e-10
VOCAB = 64


def tokens(batch=2, length=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g), torch.randint(0, VOCAB, (batch, length), generator=g)


def hf_reference(model, tok, tgt):
    """The HF model's own full-sequence forward and backward, with seco_lab's loss normalisation."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    logits = model(input_ids=tok).logits
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum") / tgt.numel()
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return logits.detach(), {"model." + n: g for (n, _), g in zip(params, grads)}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager_exact", "eager"])
@pytest.mark.parametrize("chunk", [4, 7])
def test_chunked_forward_reproduces_hf_logits(arch, attn, chunk):
    model = build_hf_model(arch, attn_implementation=attn, dtype=torch.float64)
    adapter = HFChunkModel(model)
    tok, _ = tokens()
    with torch.no_grad():
        full = model(input_ids=tok).logits
        past, pieces = [], []
        for s in range(0, tok.shape[1], chunk):
            logits, cache = adapter.chunk_logits(tok[:, s : s + chunk], past, s)
            pieces.append(logits)
            past.append(cache)
    err = float((torch.cat(pieces, 1) - full).norm() / full.norm())
    # transformers' stock eager kernel computes the softmax in float32 even for float64
    # inputs, so it agrees with itself only to float32 rounding; eager_exact is the same
    # math kept in float64.
    assert err <= (1e-6 if attn == "eager" else TOL)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager_exact"])
@pytest.mark.parametrize("lora", [False, True])
def test_seco_through_adapter_equals_hf_backward(arch, attn, lora):
    model = build_hf_model(arch, attn_implementation=attn, dtype=torch.float64)
    if lora:
        # random B (peft's default is B = 0, which makes every gradient of A vanish)
        model = add_lora(model, r=4, alpha=8, init_lora_weights=False).double()
    adapter = HFChunkModel(model)
    tok, tgt = tokens()
    _, ref = hf_reference(model, tok, tgt)
    _, got = seco_grad(adapter, tok, tgt, chunk_size=4)
    assert set(got) == set(ref)
    if lora:
        assert got and all("lora_" in n for n in got)
    assert rel_err(got, ref) <= TOL


@pytest.mark.parametrize("scheme", ["paper", "falling-factorial"])
@pytest.mark.parametrize("budget", [2, 3])
def test_enumeration_equals_analytic_expectation_on_hf_llama(scheme, budget):
    model = build_hf_model("llama", {"num_hidden_layers": 2}, attn_implementation="sdpa", dtype=torch.float64)
    adapter = HFChunkModel(model)
    tok, tgt = tokens(batch=1, length=10)
    strata = hop_strata(adapter, tok, tgt, chunk_size=2)
    w = get_scheme(scheme).expected_weights(5, budget, 4)
    exact = enumerate_expectation(adapter, tok, tgt, chunk_size=2, scheme=scheme, budget=budget)
    analytic = flatten(strata.combine(w))
    assert float((flatten(exact.mean) - analytic).norm() / analytic.norm()) <= 1e-12
    assert rel_err(strata.total(), dense_grad(adapter, tok, tgt)[1]) <= 1e-12
    assert max(strata.norms()[3:]) <= 1e-13 * float(flatten(strata.total()).norm())


def test_sliding_window_models_are_refused():
    with pytest.raises(ValueError, match="sliding"):
        HFChunkModel(build_hf_model("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}))


def test_lora_training_saves_an_adapter_that_peft_loads_back(tmp_path):
    from peft import PeftModel

    cfg = TrainConfig(mode="seco", data="text", seq_len=64, chunk_size=16, batch_size=2, steps=3, lr=1e-2,
                      warmup=1, eval_every=3, eval_batches=1, ckpt_every=3, dtype="float64", hf_model="llama",
                      lora=True, lora_r=4)
    trainer = Trainer(cfg, RunControl(run_dir=str(tmp_path / "lora"), device="cpu", progress=False))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    last = trainer.fit()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n].detach()) for n in before if n not in trainable)  # base frozen
    assert any(not torch.equal(before[n], after[n].detach()) for n in trainable)
    assert (tmp_path / "lora" / "adapter" / "adapter_config.json").exists()

    base = build_hf_model("llama", {"vocab_size": 256, "max_position_embeddings": 64}, "sdpa", torch.float64, seed=0)
    loaded = HFChunkModel(PeftModel.from_pretrained(base, str(tmp_path / "lora" / "adapter"), is_trainable=True))
    again = Trainer(cfg, RunControl(run_dir=str(tmp_path / "eval"), device="cpu"), model=loaded.double())
    assert again.evaluate()["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-12)


def test_cache_leaves_hold_the_kv_cache_once():
    """Pass 1's leaves are views of their c positions in one buffer per layer and key/value: adjacent (a
    chunk reads its prefix as one view) and, all together, exactly the KV cache's bytes -- no leaf keeps
    a copy of its prefix alive."""
    from seco_lab.core.engine import cache_leaves, checked_batch
    from seco_lab.models.hf_attention import adjacent_view

    adapter = HFChunkModel(build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64))
    tok, tgt = tokens(batch=2, length=21)
    leaves, _ = cache_leaves(adapter, checked_batch(adapter, tok, tgt, chunk_size=4))
    storages = {}
    for j, cache in enumerate(leaves):
        for k, v in cache:
            for t in (k, v):
                assert t.shape[-2] == min(4, 21 - 4 * j)
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    for layer in range(adapter.n_layers):
        for kv in range(2):
            whole = adjacent_view([cache[layer][kv] for cache in leaves])
            assert whole is not None and whole.shape[-2] == 21
    cfg = adapter.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_bytes = 2 * cfg.num_hidden_layers * 2 * 21 * cfg.num_key_value_heads * head_dim * 8
    assert len(storages) == 2 * cfg.num_hidden_layers and sum(storages.values()) == kv_bytes


@pytest.mark.parametrize("with_loss", [False, True])
def test_pass1_in_spans_gives_the_chunk_by_chunk_leaves_with_fewer_forwards(with_loss):
    """Pass 1 forwards whole spans of chunks (HFChunkModel.pass1_tokens, split along cache_seq_dim): the
    leaves, and the loss, equal those of a chunk-by-chunk pass 1 to float64 rounding, keep each chunk's
    length, stay adjacent views of one buffer, and take ceil(k / span) forwards instead of k."""
    from seco_lab.core.engine import cache_leaves, checked_batch, pass1_span

    adapter = HFChunkModel(build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64))
    tok, tgt = tokens(batch=2, length=45)
    batch = checked_batch(adapter, tok, tgt, chunk_size=4)  # k = 12, the last chunk 1 token
    calls = []
    forward = adapter.chunk_forward
    adapter.chunk_forward = lambda tok, *a, **kw: calls.append(tok.shape[1]) or forward(tok, *a, **kw)
    adapter.pass1_tokens = 20  # spans of 5 chunks: 5 + 5 + 2
    assert pass1_span(adapter, 4) == 5
    spans, loss = cache_leaves(adapter, batch, with_loss=with_loss)
    assert calls == [20, 20, 5]
    adapter.pass1_tokens = None  # chunk by chunk
    calls.clear()
    single, ref = cache_leaves(adapter, batch, with_loss=with_loss)
    assert calls == [4] * 11 + [1]
    assert len(spans) == len(single) == 12
    for a, b in zip(spans, single):
        for (ka, va), (kb, vb) in zip(a, b):
            assert ka.shape == kb.shape and va.shape == vb.shape and ka.requires_grad and ka.is_leaf
            assert float((ka - kb).abs().max()) <= 1e-13 * float(kb.abs().max())
            assert float((va - vb).abs().max()) <= 1e-13 * float(vb.abs().max())
    if with_loss:
        assert abs(float(loss - ref)) <= 1e-13 * abs(float(ref))
    from seco_lab.models.hf_attention import adjacent_view

    for layer in range(adapter.n_layers):
        assert adjacent_view([cache[layer][0] for cache in spans]) is not None


COPYING_OPS = ("aten.cat", "aten.stack", "aten.copy_", "aten.clone", "aten._to_copy", "aten.contiguous")


def _chunk_step_bytes(adapter, batch, leaves, j):
    """Bytes written by copying operators in chunk j's forward with a graph, in its backward, and in its
    forward without a graph; and the bytes its graph saves for backward outside the leaves and parameters."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopiedBytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args, kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket) in COPYING_OPS:
                outs = out if isinstance(out, (tuple, list)) else [out]
                self.total += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
            return out

    held = {p.untyped_storage().data_ptr() for p in adapter.parameters()}
    held |= {t.untyped_storage().data_ptr() for cache in leaves for kv in cache for t in kv}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in held:
            saved.append(t.untyped_storage())
        return t

    tok, tgt, start = batch.chunk(j)
    src = [t for cache in leaves[:j] for kv in cache for t in kv]
    with CopiedBytes() as forward, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = adapter.chunk_forward(tok, tgt, leaves[:j], start)
    with CopiedBytes() as backward:
        torch.autograd.backward([out.loss_sum], inputs=src)
    for t in src:
        t.grad = None
    with CopiedBytes() as no_grad, torch.no_grad():
        adapter.chunk_forward(tok, tgt, leaves[:j], start)
    saved_bytes = sum({s.data_ptr(): s.nbytes() for s in saved}.values())
    return forward.total, backward.total, no_grad.total, saved_bytes


def test_chunk_forward_copies_nothing_of_the_prefix():
    """The work and memory of a chunk do not grow with its prefix beyond attending to it: the bytes copied
    (cat, copy, clone, ...) in a chunk's forward with and without a graph and in its backward, and the bytes
    its graph saves for backward (outside the leaves and the parameters), are the same for chunk 1 as for
    chunk 5 (counted, not timed).  Concatenating [prefix, own] in every layer fails this."""
    from seco_lab.core.engine import cache_leaves, prepare

    adapter = HFChunkModel(build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64))
    tok, tgt = tokens(batch=1, length=24)
    batch = prepare(adapter, tok, tgt, chunk_size=4)
    leaves, _ = cache_leaves(adapter, batch)
    first, last = (_chunk_step_bytes(adapter, batch, leaves, j) for j in (1, 5))
    assert first == last
    # the counter sees a concatenated prefix: leaves that are not adjacent in memory are concatenated
    owned = [tuple((k.clone(), v.clone()) for k, v in cache) for cache in leaves]
    first, last = (_chunk_step_bytes(adapter, batch, owned, j) for j in (1, 5))
    assert last[0] > first[0] and last[2] > first[2]


@pytest.mark.parametrize("lora", [False, True])
def test_grad_accumulation_equals_returned_gradients(lora):
    """seco_step accumulates into .grad exactly what seco_grad returns (times scale, on top of what
    is there), seco_grad leaves .grad untouched, and both equal HF's own backward."""
    from seco_lab import seco_step

    model = build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64)
    if lora:
        model = add_lora(model, r=4, alpha=8, init_lora_weights=False).double()
    adapter = HFChunkModel(model)
    tok, tgt = tokens()
    _, ref = hf_reference(model, tok, tgt)
    params = {"model." + n: p for n, p in model.named_parameters() if p.requires_grad}
    prior = {n: torch.randn_like(p) for n, p in params.items()}
    for n, p in params.items():
        p.grad = prior[n].clone()
    _, got = seco_grad(adapter, tok, tgt, chunk_size=4)
    assert all(torch.equal(p.grad, prior[n]) for n, p in params.items())  # untouched
    assert rel_err(got, ref) <= TOL
    seco_step(adapter, tok, tgt, chunk_size=4, scale=0.5)
    accumulated = {n: (p.grad - prior[n]) / 0.5 for n, p in params.items()}
    assert rel_err(accumulated, got) <= TOL
    frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen)


def _explicit_chunk_attention(q, k, v, prefix, scale):
    """softmax(q k^T * scale + causal mask) v with keys/values repeated per head: (B, c, H, d)."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    c = q.shape[2]
    allowed = torch.arange(c)[:, None] + prefix >= torch.arange(prefix + c)
    scores = (q @ kk.transpose(2, 3)) * scale
    return (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vv).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_chunk_attention_equals_explicit_softmax(kv_heads):
    """seco_sdpa for the chunk pattern -- the split prefix/own attention (the prefix as separate leaves) and
    the grouped-mask kernel (the prefix concatenated) -- against softmax(q k^T / sqrt(d) + causal mask) v with
    keys/values repeated per head, in float64: outputs and the gradients of q, the own keys/values and
    every prefix leaf."""
    from transformers import LlamaConfig

    from seco_lab.models.hf_attention import ChunkCausal, PrefixLayer, chunk_sdpa_attention, chunk_sdpa_mask

    g = torch.Generator().manual_seed(3)
    heads, c, sizes, d = 6, 5, (3, 4), 4
    prefix = sum(sizes)
    cfg = LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=kv_heads)
    q = torch.randn(2, heads, c, d, generator=g, dtype=torch.float64, requires_grad=True)
    leaves = [torch.randn(2, kv_heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
              for n in (*sizes, *sizes)]
    own = [torch.randn(2, kv_heads, c, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    inputs = [q, *own, *leaves]
    seed = torch.randn(2, c, heads, d, generator=g, dtype=torch.float64)
    k = torch.cat([*leaves[: len(sizes)], own[0]], dim=-2)
    v = torch.cat([*leaves[len(sizes):], own[1]], dim=-2)
    ref = _explicit_chunk_attention(q, k, v, prefix, d**-0.5)
    ref_grads = torch.autograd.grad(ref, inputs, seed)
    mask = chunk_sdpa_mask(2, c, prefix + c, q_offset=prefix, dtype=torch.float64, config=cfg)
    assert isinstance(mask, ChunkCausal) and mask.numel() == 0  # a marker, not a dense mask
    assert mask.grouped_mask(heads // kv_heads).shape == (1, 1, heads // kv_heads * c, prefix + c)
    for split in (True, False):
        layer = PrefixLayer(leaves[: len(sizes)], leaves[len(sizes):], split=split)
        key, value = layer.update(*own)
        assert split == (key.shape[-2] == c)  # split: the own keys only, the prefix is not concatenated
        out, _ = chunk_sdpa_attention(torch.nn.Module(), q, key, value, mask, scaling=d**-0.5)
        assert float((out - ref).detach().abs().max()) <= 1e-14
        grads = torch.autograd.grad(out, inputs, seed)
        assert max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads)) <= 1e-13
    # a full-sequence or padded call is not the chunk pattern: transformers' own sdpa mask
    assert not isinstance(chunk_sdpa_mask(2, c, c, dtype=torch.float64, config=cfg), ChunkCausal)


def test_a_pass1_span_with_a_loss_keeps_its_logits_under_the_bound():
    """With a loss, a span's logits (span x batch x vocabulary, at >= 4 bytes) stay under PASS1_LOGITS_BYTES,
    and never below one chunk; without a loss only pass1_tokens counts; a model that does not declare its cache
    axis is forwarded chunk by chunk."""
    from types import SimpleNamespace

    from seco_lab.core.checks import PASS1_LOGITS_BYTES
    from seco_lab.core.engine import pass1_span

    param = torch.zeros(1)
    model = SimpleNamespace(pass1_tokens=512, cache_seq_dim=-2, vocab_size=49152, parameters=lambda: iter([param]))
    assert pass1_span(model, 64) == 8 and pass1_span(model, 64, with_loss=False, batch_size=8) == 8
    assert pass1_span(model, 64, with_loss=True, batch_size=2) == PASS1_LOGITS_BYTES // (64 * 2 * 49152 * 4) == 5
    assert pass1_span(model, 64, with_loss=True) == 8  # 10 chunks' logits fit: pass1_tokens bounds it
    assert pass1_span(model, 64, with_loss=True, batch_size=16) == 1  # one chunk's logits exceed the bound
    assert pass1_span(model, 1024, with_loss=True) == 1
    model.parameters = lambda: iter([torch.zeros(1, dtype=torch.float64)])
    assert pass1_span(model, 64, with_loss=True, batch_size=2) == PASS1_LOGITS_BYTES // (64 * 2 * 49152 * 8) == 2
    assert pass1_span(SimpleNamespace(pass1_tokens=512), 64) == 1


@pytest.mark.parametrize("arch, over", [("llama", {"tie_word_embeddings": True, "pad_token_id": 3}),
                                        ("qwen2", {})])  # tied head + padding row; q/k/v biases
@pytest.mark.parametrize("lora", [False, True])
def test_pass2_adds_layer_gradients_into_grad_in_place_and_equals_hf_backward(arch, over, lora, monkeypatch):
    """Within SeCO's pass 2 the linear and embedding layers add their gradients into .grad themselves
    (seco_lab.models.fused_grads): every such trainable weight gets them from the fused backward once per
    chunk, the result (on top of a prior .grad, times a scale) is still HF's own backward, and every layer
    is restored afterwards."""
    from seco_lab import seco_step

    calls = _spied_fused_calls(monkeypatch)
    model = build_hf_model(arch, over, attn_implementation="sdpa", dtype=torch.float64)
    if lora:
        model = add_lora(model, r=4, alpha=8, init_lora_weights=False).double()
    tok, tgt = tokens()
    tok[0, :3] = 3  # the padding id is looked up: with pad_token_id = 3 its row must receive nothing
    _, ref = hf_reference(model, tok, tgt)
    params = {"model." + n: p for n, p in model.named_parameters() if p.requires_grad}
    own_forward = [m for m in model.modules() if "forward" in vars(m)]  # exact_float64's norms

    def step(adapter):
        prior = {n: torch.randn_like(p) for n, p in params.items()}
        for n, p in params.items():
            p.grad = prior[n].clone()
        seco_step(adapter, tok, tgt, chunk_size=4, scale=0.5)
        return {n: (p.grad - prior[n]) / 0.5 for n, p in params.items()}

    adapter = HFChunkModel(model)
    assert rel_err(step(adapter), ref) <= TOL
    layers = [n for n in params if "norm" not in n]  # linear and embedding weights (and biases)
    weights = [n for n in layers if n.endswith("weight")]
    k = -(-tok.shape[1] // 4)
    uses = 2 if over.get("tie_word_embeddings") and not lora else 1  # a tied weight is the embedding and the head
    assert weights and all(calls[id(params[n])] == k * (uses if "embed" in n else 1) for n in weights), calls
    assert len(calls) == len(weights)
    assert [m for m in model.modules() if "forward" in vars(m)] == own_forward  # restored
    calls.clear()
    adapter.fused_grads = None  # the engine without it: every gradient through autograd, the same result
    assert rel_err(step(adapter), ref) <= TOL and not calls


def test_fused_layer_gradients_touch_only_the_named_parameters_and_restore_after_an_error():
    """A subset of the parameters (only the attention's query projections): those layers are fused and get HF's
    gradient; nothing else receives a gradient; an error inside the context still restores every layer."""
    from seco_lab.core.engine import cache_leaves, checked_batch, relay_sweep
    from seco_lab.models.fused_grads import fused_param_grads

    model = build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64)
    adapter = HFChunkModel(model)
    tok, tgt = tokens()
    _, ref = hf_reference(model, tok, tgt)
    named = {"model." + n: p for n, p in model.named_parameters() if "q_proj" in n}
    own_forward = [m for m in model.modules() if "forward" in vars(m)]  # exact_float64's norms
    batch = checked_batch(adapter, tok, tgt, 4, -100)
    leaves, _ = cache_leaves(adapter, batch, with_loss=False, include_last=False)
    relay_sweep(adapter, batch, leaves, list(named.values()), range(batch.num_chunks))
    assert rel_err({n: p.grad for n, p in named.items()}, {n: ref[n] for n in named}) <= TOL
    assert all(p.grad is None for n, p in model.named_parameters() if "q_proj" not in n)
    with pytest.raises(RuntimeError, match="inside"):
        with fused_param_grads(model, model.parameters()) as n_fused:
            assert n_fused == 2 * 7 + 2  # 7 projections per layer, the embedding and the head
            raise RuntimeError("inside")
    assert [m for m in model.modules() if "forward" in vars(m)] == own_forward


def _spied_fused_calls(monkeypatch):
    """Counts of the fused backward per parameter (id), for the module's two autograd Functions."""
    from collections import Counter

    from seco_lab.models import fused_grads as fg

    calls = Counter()
    spied = ((fg._LinearIntoGrad, lambda ctx: ctx.params[0]), (fg._EmbeddingIntoGrad, lambda ctx: ctx.param))
    for fn, param_of in spied:
        def spy(ctx, g, _orig=fn.backward, _param_of=param_of):
            calls[id(_param_of(ctx))] += 1
            return _orig(ctx, g)
        monkeypatch.setattr(fn, "backward", staticmethod(spy))
    return calls


@pytest.mark.parametrize("case", ["tensor_hook", "grad_dtype", "weight_norm", "weight_norm_one_chunk", "autocast",
                                  "frozen_bias", "bias_not_named"])
def test_a_layer_whose_gradient_autograd_must_see_is_not_fused(case, monkeypatch):
    """The fused path steps aside (that layer's gradients go through autograd as without it) where it would be
    wrong: a tensor hook on the weight (it would see no gradient), gradients kept in another dtype, a weight
    computed by a hook (weight_norm: the Parameters are weight_g/weight_v), autocast; a frozen bias receives
    nothing; a trainable bias the sweep does not name keeps its layer unfused.  Compared with the engine
    without fusion and with HF's own backward."""
    import warnings

    from seco_lab import seco_step
    from seco_lab.core.engine import cache_leaves, checked_batch, relay_sweep

    calls = _spied_fused_calls(monkeypatch)
    dtype = torch.float32 if case == "autocast" else torch.float64
    model = build_hf_model("qwen2", attn_implementation="sdpa", dtype=dtype)  # q/k/v carry biases
    q = model.model.layers[0].self_attn.q_proj
    seen = []
    if case == "tensor_hook":
        q.weight.register_hook(lambda g: seen.append(type(g).__name__) or g * 2.0)
    elif case == "grad_dtype":
        q.weight.grad_dtype = torch.float32
    elif case.startswith("weight_norm"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.nn.utils.weight_norm(q)
    elif case == "frozen_bias":
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.requires_grad_(False)
    tok, tgt = tokens()
    chunk = tok.shape[1] if case == "weight_norm_one_chunk" else 4
    adapter = HFChunkModel(model)
    named = [p for n, p in model.named_parameters() if p.requires_grad and not (case == "bias_not_named" and
                                                                                 n.endswith("q_proj.bias"))]

    def grads(fused: bool) -> dict:
        for p in model.parameters():
            p.grad = None
        if fused:
            vars(adapter).pop("fused_grads", None)
        else:
            adapter.fused_grads = None
        if case == "bias_not_named":
            batch = checked_batch(adapter, tok, tgt, chunk, -100)
            leaves, _ = cache_leaves(adapter, batch, with_loss=False, include_last=False)
            relay_sweep(adapter, batch, leaves, named, range(batch.num_chunks))
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
                hf_reference(model, tok, tgt)  # a forward with a graph just before (weight_norm's weight requires grad)
                seco_step(adapter, tok, tgt, chunk_size=chunk)
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain = grads(False)
    assert not calls
    fused = grads(True)
    assert set(fused) == set(plain) and rel_err(fused, plain) <= (1e-6 if case == "grad_dtype" else TOL)
    if case != "autocast":
        _, ref = hf_reference(model, tok, tgt)
        scale = {"model.model.layers.0.self_attn.q_proj.weight": 2.0} if case == "tensor_hook" else {}
        assert rel_err(plain, {n: ref["model." + n] * scale.get(n, 1.0) for n in plain}) <= 1e-6
    if case == "autocast":
        assert not calls
    elif case == "frozen_bias":
        assert calls[id(q.weight)] > 0 and not any(n.endswith("q_proj.bias") for n in fused)
    elif case == "bias_not_named":
        assert calls[id(q.weight)] == 0 and calls[id(model.model.layers[0].self_attn.o_proj.weight)] > 0
        assert not any(n.endswith("q_proj.bias") for n in fused)
    else:
        assert calls[id(getattr(q, "weight_v", q.weight))] == calls[id(q.weight)] == 0 and sum(calls.values()) > 0
    if case == "tensor_hook":
        assert seen and set(seen) == {"Tensor"}
    if case == "grad_dtype":
        assert fused["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32


def test_fused_layer_gradients_add_in_place_and_do_not_nest(monkeypatch):
    """A fused weight's .grad is added to where it is (the tensor a caller holds is the one updated), and a
    second context on the same model is refused instead of widening the first one's parameters."""
    from seco_lab import seco_step
    from seco_lab.models.fused_grads import fused_param_grads

    calls = _spied_fused_calls(monkeypatch)
    model = build_hf_model("llama", attn_implementation="sdpa", dtype=torch.float64)
    adapter = HFChunkModel(model)
    tok, tgt = tokens()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    held = {id(p): p.grad for p in params}
    seco_step(adapter, tok, tgt, chunk_size=4)
    w = model.model.layers[0].mlp.up_proj.weight
    assert calls[id(w)] > 0 and w.grad is held[id(w)] and float(held[id(w)].norm()) > 0
    with fused_param_grads(model, params):
        with pytest.raises(RuntimeError, match="already open"):
            with fused_param_grads(model, params[:1]):
                pass
    assert not any(getattr(vars(m).get("forward"), "fused_into_grad", False) for m in model.modules())
