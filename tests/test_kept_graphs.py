"""SpaCO with pass 1 keeping the graphs of the last drawn chunks (``spaco_grad(keep_graphs=n)``): the same
estimate as rebuilding them in pass 2 (float64, every scheme kind, the tiny transformer and an HF Llama),
n chunk forwards fewer (counted), and leaves that stay adjacent views of the model's cache buffer."""

import pytest
import torch

from seco_lab import spaco_grad
from seco_lab.core.engine import _pass1_pieces, cache_leaves, checked_batch
from seco_lab.models.hf import HFChunkModel, build_hf_model
from seco_lab.models.tiny import TinyConfig, TinyTransformer

VOCAB = 64


def tokens(batch=2, length=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g), torch.randint(0, VOCAB, (batch, length), generator=g)


def hf_adapter():
    return HFChunkModel(build_hf_model("llama", {"vocab_size": VOCAB}, attn_implementation="sdpa",
                                       dtype=torch.float64, seed=3))


def tiny_model():
    torch.manual_seed(0)
    return TinyTransformer(TinyConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, d_ff=32)).double()


def counted(model):
    """(model, list of the token counts of its chunk forwards, with a graph or not)."""
    calls = []
    forward = model.chunk_forward

    def chunk_forward(tok, *a, **kw):
        calls.append((tok.shape[1], torch.is_grad_enabled()))
        return forward(tok, *a, **kw)

    model.chunk_forward = chunk_forward
    return model, calls


def max_rel(a: dict, b: dict) -> float:
    num = max(float((a[n] - b[n]).abs().max()) for n in a)
    return num / max(float(b[n].abs().max()) for n in b)


@pytest.mark.parametrize("make", [hf_adapter, tiny_model], ids=["hf-llama", "tiny"])
@pytest.mark.parametrize("scheme", ["released-unbiased", "falling-factorial", "paper"])
@pytest.mark.parametrize("keep", [1, 2, 5])
def test_kept_graphs_give_the_rebuilt_estimate_with_fewer_forwards(make, scheme, keep):
    """keep_graphs = n: the loss and the gradient estimate equal those of keep_graphs = 0 to float64 rounding,
    for a constant relay (one buffer), a hop-dependent one (one buffer per hop count) and the paper's factor;
    pass 2 runs min(n, t) chunk forwards fewer, and pass 1 runs the kept chunks alone with a graph."""
    model, calls = counted(make())
    tok, tgt = tokens()
    subset = (1, 4, 6, 8)  # k = 10 chunks of 4 (the last 1 token)
    loss0, g0 = spaco_grad(model, tok, tgt, 4, scheme, 4, subset=subset, keep_graphs=0)
    rebuilt = [c for c in calls if c[1]]
    calls.clear()
    loss1, g1 = spaco_grad(model, tok, tgt, 4, scheme, 4, subset=subset, keep_graphs=keep)
    with_graph = [c for c in calls if c[1]]
    assert len(rebuilt) == 4 and len(with_graph) == 4  # every drawn chunk runs once with a graph either way
    assert sum(n for n, _ in with_graph) == 4 * 4
    assert abs(float(loss1 - loss0)) <= 1e-13 * abs(float(loss0))
    assert max_rel(g1, g0) <= 1e-12
    assert any(float(v.abs().max()) > 0 for v in g1.values())


def test_kept_graphs_save_forwards_counted():
    """The work saved is counted, not timed: with n kept graphs the step runs exactly n chunk forwards
    fewer than with none (pass 1's spans around a kept chunk are split, not lengthened)."""
    model, calls = counted(tiny_model())
    tok, tgt = tokens()
    spaco_grad(model, tok, tgt, 4, "released-unbiased", 4, subset=(1, 4, 6, 8), keep_graphs=0)
    none = len(calls)
    calls.clear()
    spaco_grad(model, tok, tgt, 4, "released-unbiased", 4, subset=(1, 4, 6, 8), keep_graphs=3)
    assert len(calls) == none - 3
    calls.clear()
    spaco_grad(model, tok, tgt, 4, "released-unbiased", 4, subset=(1, 4, 6, 8), keep_graphs=99)  # more than t
    assert len(calls) == none - 4


def test_model_attribute_sets_the_default_and_bad_values_are_refused():
    model, calls = counted(tiny_model())
    tok, tgt = tokens()
    model.keep_graphs = 2
    spaco_grad(model, tok, tgt, 4, "released-unbiased", 4, subset=(1, 4, 6, 8))
    assert len(calls) == 10 + 4 - 2
    for bad, err in ((-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)):
        with pytest.raises(err, match="keep_graphs"):
            spaco_grad(model, tok, tgt, 4, "released-unbiased", 2, subset=(1, 4), keep_graphs=bad)


def test_kept_chunks_split_pass1_spans_and_their_leaves_stay_in_the_buffer():
    """With spans of 3 chunks a kept chunk runs alone with a graph and the spans around it are cut; every leaf,
    the kept chunks' too, is a view of the one buffer per layer (a later chunk reads its prefix as one view),
    and equals the leaves of a pass 1 without kept graphs."""
    from seco_lab.models.hf_attention import adjacent_view

    assert _pass1_pieces(10, 3, [4, 5, 9]) == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 3), (9, 1)]
    assert _pass1_pieces(10, 3, []) == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert _pass1_pieces(4, 8, [0]) == [(0, 1), (1, 3)]
    adapter, calls = counted(hf_adapter())
    adapter.pass1_tokens = 12
    tok, tgt = tokens()
    batch = checked_batch(adapter, tok, tgt, 4)
    kept = {}
    leaves, loss = cache_leaves(adapter, batch, keep=[4, 5, 9], kept=kept)
    assert calls == [(12, False), (4, False), (4, True), (4, True), (12, False), (1, True)]
    assert sorted(kept) == [4, 5, 9] and all(kept[j].loss_sum.requires_grad for j in kept)
    plain, ref = cache_leaves(adapter, batch)
    assert abs(float(loss - ref)) <= 1e-13 * abs(float(ref))
    for layer in range(adapter.n_layers):
        for kv in range(2):
            assert adjacent_view([cache[layer][kv] for cache in leaves[:9]]) is not None
            for a, b in zip(leaves, plain):
                assert a[layer][kv].is_leaf and a[layer][kv].requires_grad
                x, y = a[layer][kv].detach(), b[layer][kv].detach()
                assert float((x - y).abs().max()) <= 1e-13 * float(y.abs().max())
    with pytest.raises(ValueError, match="kept"):
        cache_leaves(adapter, batch, keep=[2])
    with pytest.raises(ValueError, match="chunks 0..9"):
        cache_leaves(adapter, batch, keep=[10], kept={})


def test_bench_times_spaco_with_and_without_kept_graphs_side_by_side():
    """experiments/bench_hf.py --keep-graphs N --compare keep: SpaCO's step with N kept graphs and the same step
    rebuilding every drawn chunk (the 'before'), SeCO unaffected; the kept step forwards t chunks' tokens fewer
    (counted), and the adapter's setting is restored after the variant."""
    from dataclasses import replace

    from experiments import bench_hf
    from seco_lab.report.bench_hf import ENGINE_VARIANTS

    cfg = replace(bench_hf.QUICK, lengths=(64,), chunk_sizes=(16,), methods=("forward", "seco", "spaco"),
                  schemes=("released-unbiased",), ratio=2, compare=("keep",), keep_graphs=2)
    spaco = "spaco released-unbiased t/k=1/2"
    assert [bench_hf.label(m) for m in bench_hf.methods(cfg, 64)] == ["forward", "seco", spaco,
                                                                      spaco + ENGINE_VARIANTS["keep"][0]]
    model, adapter, tok, tgt = bench_hf.build(cfg, 64, False)
    assert adapter.keep_graphs == 2
    tokens_run, forward = [], adapter.chunk_forward
    adapter.chunk_forward = lambda t, *a, **kw: tokens_run.append(t.shape[1]) or forward(t, *a, **kw)
    m = {"method": "spaco", "scheme": "released-unbiased", "budget": 2, "ratio": 2, "chunk_size": 16}
    bench_hf.step(cfg, m, model, adapter, tok, tgt)
    kept = sum(tokens_run)
    tokens_run.clear()
    bench_hf.step(cfg, {**m, "variant": "keep"}, model, adapter, tok, tgt)
    assert kept == 64 and sum(tokens_run) == 64 + 2 * 16 and adapter.keep_graphs == 2
