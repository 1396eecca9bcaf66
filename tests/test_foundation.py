"""Tier 1 (docs/estimators.md §5): the chunked forward and SeCO are exact in float64."""

import re
from pathlib import Path

import pytest
import torch
from helpers import random_batch, rel_err, tiny_model
from hypothesis import given
from hypothesis import strategies as st

from seco_lab import TinyConfig, TinyTransformer, dense_grad, seco_grad, seco_step

TOL = 1e-12


@pytest.mark.parametrize("chunk", [1, 3, 5, 16, 40])
@torch.no_grad()
def test_chunked_forward_matches_full_forward(chunk):
    model = tiny_model(n_layers=3)
    tok, tgt = random_batch(17, 2, 16, seed=1)
    full = model(tok)
    past, pieces, loss = [], [], 0.0
    for s in range(0, 16, chunk):
        h, cache = model.chunk_hidden(tok[:, s : s + chunk], past, s)
        pieces.append(model.logits_from_hidden(h))
        loss = loss + model.chunk_forward(tok[:, s : s + chunk], tgt[:, s : s + chunk], past, s).loss_sum
        past.append(cache)
    chunked = torch.cat(pieces, dim=1)
    assert float((chunked - full).norm() / full.norm()) <= TOL
    ref = torch.nn.functional.cross_entropy(full.reshape(-1, 17), tgt.reshape(-1), reduction="sum")
    assert abs(float(loss - ref)) <= TOL * float(ref)


def test_rotary_uses_global_positions():
    # Restarting positions at 0 in every chunk would change the logits of later chunks.
    model = tiny_model(n_layers=1)
    tok, _ = random_batch(17, 1, 8)
    _, cache = model.chunk_hidden(tok[:, :4], [], 0)
    right, _ = model.chunk_hidden(tok[:, 4:], [cache], 4)
    wrong, _ = model.chunk_hidden(tok[:, 4:], [cache], 0)
    full, _ = model.chunk_hidden(tok, [], 0)
    assert torch.allclose(right, full[:, 4:], rtol=0, atol=1e-12)
    assert not torch.allclose(wrong, full[:, 4:], rtol=0, atol=1e-6)


@st.composite
def configurations(draw):
    n_layers = draw(st.integers(1, 4))
    n_heads = draw(st.sampled_from([1, 2, 4]))
    n_kv = draw(st.sampled_from([h for h in (1, 2, 4) if n_heads % h == 0]))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 19))
    chunk = draw(st.integers(1, length))
    return dict(
        cfg=TinyConfig(vocab_size=draw(st.integers(3, 20)), d_model=n_heads * head_dim, n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=n_kv, d_ff=draw(st.sampled_from([4, 12, 20])),
                       tie_embeddings=draw(st.booleans())),
        seed=draw(st.integers(0, 1000)), batch=batch, length=length, chunk=chunk,
        frozen=draw(st.floats(0.0, 0.6)), ignore=draw(st.sampled_from([0.0, 0.3])),
    )


@given(configurations())
def test_seco_equals_dense_property(c):
    model = TinyTransformer(c["cfg"], seed=c["seed"], dtype=torch.float64)
    g = torch.Generator().manual_seed(c["seed"])
    params = list(model.named_parameters())
    frozen = torch.rand(len(params), generator=g) < c["frozen"]
    frozen[0] = False  # at least one trainable parameter
    for (_, p), f in zip(params, frozen):
        p.requires_grad_(not bool(f))
    tok, tgt = random_batch(c["cfg"].vocab_size, c["batch"], c["length"], seed=c["seed"], ignore_frac=c["ignore"])
    l_dense, g_dense = dense_grad(model, tok, tgt)
    l_seco, g_seco = seco_grad(model, tok, tgt, chunk_size=c["chunk"])
    assert set(g_seco) == {n for (n, _), f in zip(params, frozen) if not f}
    assert abs(float(l_seco - l_dense)) <= TOL * abs(float(l_dense))
    assert rel_err(g_seco, g_dense) <= TOL


def test_ignore_index_normalisation_matches_dense():
    model = tiny_model()
    tok, tgt = random_batch(17, 2, 11, ignore_frac=0.5)
    n = int((tgt != -100).sum())
    loss, _ = seco_grad(model, tok, tgt, chunk_size=4)
    logits = model(tok)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 17), tgt.reshape(-1), reduction="sum") / n
    assert abs(float(loss - ref)) <= TOL


def test_seco_step_accumulates_into_grad_and_leaves_frozen_alone():
    model = tiny_model()
    model.embed.weight.requires_grad_(False)
    tok, tgt = random_batch(17, 1, 10)
    _, ref = dense_grad(model, tok, tgt)
    seco_step(model, tok, tgt, chunk_size=3)
    seco_step(model, tok, tgt, chunk_size=4)  # accumulates: twice the gradient
    assert model.embed.weight.grad is None
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert rel_err(got, {n: 2 * g for n, g in ref.items()}) <= TOL


def test_seco_forwards_k_minus_1_chunks_without_a_graph_and_k_with_one():
    """Pass 1 skips the last chunk (no chunk reads its cache); pass 2 rebuilds all k."""
    model = tiny_model()
    tok, tgt = random_batch(17, 2, 10)
    calls = []
    forward = model.chunk_forward

    def spy(tokens, targets, past=(), start=0, ignore_index=-100):
        calls.append((start, torch.is_grad_enabled(), targets is not None))
        return forward(tokens, targets, past, start, ignore_index)

    model.chunk_forward = spy
    _, got = seco_grad(model, tok, tgt, chunk_size=3)  # k = 4 chunks, the last one of 1 token
    del model.chunk_forward
    assert [c for c in calls if not c[1]] == [(0, False, False), (3, False, False), (6, False, False)]
    assert [c for c in calls if c[1]] == [(9, True, True), (6, True, True), (3, True, True), (0, True, True)]
    assert rel_err(got, dense_grad(model, tok, tgt)[1]) <= TOL


class NotAModel:
    pass


def _half_float32(model):
    model.blocks[0].float()
    return model


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x, y: seco_grad(m, x, y, chunk_size=0), "chunk_size must be an integer >= 1"),
        (lambda m, x, y: seco_grad(m, x, y, chunk_size=2.5), "chunk_size must be an integer >= 1"),
        (lambda m, x, y: seco_grad(m, x[:, :0], y[:, :0], chunk_size=2), "empty input"),
        (lambda m, x, y: seco_grad(m, torch.zeros(1, 70, dtype=torch.long), torch.zeros(1, 70, dtype=torch.long), 8),
         "exceeds the model's maximum positions 64"),
        (lambda m, x, y: seco_grad(m, x, y[:, :5], chunk_size=2), "does not match tokens shape"),
        (lambda m, x, y: seco_grad(m, x.double(), y, chunk_size=2), "must be an integer tensor"),
        (lambda m, x, y: seco_grad(m, x, y.float(), chunk_size=2), "must be an integer tensor"),
        (lambda m, x, y: seco_grad(m, x + 100, y, chunk_size=2), "token ids must lie in"),
        (lambda m, x, y: seco_grad(m, x, torch.full_like(y, -100), chunk_size=2), "no loss to differentiate"),
        (lambda m, x, y: seco_grad(NotAModel(), x, y, chunk_size=2), "does not implement the chunk-model protocol"),
        (lambda m, x, y: dense_grad(_half_float32(m), x, y), "mixed dtypes"),
    ],
)
def test_bad_input_raises_clear_error(call, message):
    model = tiny_model(max_positions=64)
    tok, tgt = random_batch(17, 1, 8)
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        call(model, tok, tgt)


def test_dropout_in_training_mode_is_refused():
    model = tiny_model(dropout=0.1)
    tok, tgt = random_batch(17, 1, 8)
    with pytest.raises(ValueError, match="not deterministic"):
        seco_grad(model, tok, tgt, chunk_size=2)
    model.eval()  # eval mode makes dropout the identity: allowed and exact
    assert rel_err(seco_grad(model, tok, tgt, 3)[1], dense_grad(model, tok, tgt)[1]) <= TOL


def test_readme_example_runs():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README.md must contain a python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_layer_checkpointing_changes_nothing_but_memory():
    model = tiny_model(n_layers=3)
    tok, tgt = random_batch(17, 2, 12)
    _, ref = dense_grad(model, tok, tgt)
    model.checkpoint_layers = True
    _, got = dense_grad(model, tok, tgt)
    assert rel_err(got, ref) <= TOL
