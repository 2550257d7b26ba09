"""KV-cache decoding equals the full forward; generate."""

from __future__ import annotations

import pytest
import torch

from components.errors import UserError
from components.models import build_transformer, generate
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

T = 37  # odd, crosses many compression (d=2, l=4) and selection (l'=8) block boundaries


def _model(attention, **kw):
    nsa = kw.pop("nsa", None)
    model = build_transformer(tiny_args(attention, nsa=nsa, **kw), VOCAB).double()
    return model


def _decode(model, tokens, chunks):
    """Logits of tokens fed in the given chunk sizes (then one at a time for the rest)."""
    cache = model.new_kv_cache(tokens.shape[0], capacity=tokens.shape[1] + 3)
    outs, pos = [], 0
    for size in list(chunks) + [1] * tokens.shape[1]:
        if pos >= tokens.shape[1]:
            break
        outs.append(model.forward_step(tokens[:, pos:pos + size], cache))
        pos += size
    assert cache.length == tokens.shape[1]
    return torch.cat(outs, dim=1)


def _check_prefill_equals_decode(model):
    tokens = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        full = model(tokens)
    for chunks in ([], [13], [5, 6, 1, 9]):
        torch.testing.assert_close(_decode(model, tokens, chunks), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("kv_per_branch", [True, False])
@pytest.mark.parametrize("compress", ["mlp", "mean"])
def test_nsa_prefill_equals_decode(kv_per_branch, compress):
    _check_prefill_equals_decode(_model("nsa", nsa=small_nsa(kv_per_branch=kv_per_branch, compress=compress)))


@pytest.mark.parametrize("heads", [(4, 1), (4, 4)])
def test_nsa_prefill_equals_decode_gqa_and_other_blocks(heads):
    nsa = small_nsa(block_size=6, block_stride=3, sel_block_size=6, num_selected=3, window_size=7, gate="linear")
    _check_prefill_equals_decode(_model("nsa", nsa=nsa, n_heads=heads[0], n_kv_heads=heads[1]))


@pytest.mark.parametrize("heads", [(4, 2), (4, 4)])
def test_dense_prefill_equals_decode(heads):
    _check_prefill_equals_decode(_model("dense", n_heads=heads[0], n_kv_heads=heads[1]))


def test_decode_stays_within_the_cache():
    model = _model("nsa")
    cache = model.new_kv_cache(1, capacity=8)
    model.forward_step(torch.zeros(1, 6, dtype=torch.long), cache)
    with pytest.raises(UserError, match="capacity"):
        model.forward_step(torch.zeros(1, 3, dtype=torch.long), cache)
    with pytest.raises(UserError, match="batch size"):
        model.forward_step(torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(UserError, match="max_seq_len"):
        model.new_kv_cache(1, capacity=model.args.max_seq_len + 1)
    cache.reset()
    assert cache.length == 0 and all(layer.num_compressed == 0 for layer in cache.layers)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_greedy_generate_matches_argmax_of_full_forward(attention):
    model = _model(attention)
    prompt = torch.randint(0, VOCAB, (2, 5))
    out = generate(model, prompt, 12, temperature=0.0)
    assert out.shape == (2, 17) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, generate(model, prompt, 12, temperature=0.0))
    # independent: re-run the full forward on the growing sequence and take the argmax
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_sampling_is_reproducible_with_a_generator():
    model = _model("nsa")
    prompt = torch.randint(0, VOCAB, (3, 4))
    a = generate(model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    b = generate(model, prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (3, 14)
    assert torch.equal(generate(model, prompt, 6, top_k=1), generate(model, prompt, 6, temperature=0.0))
    assert torch.equal(generate(model, prompt, 0), prompt)


def test_top_k_limits_the_choices():
    model = _model("dense", n_layers=1)
    prompt = torch.randint(0, VOCAB, (1, 3))
    with torch.no_grad():
        allowed = model(prompt)[0, -1].topk(3).indices
    gen = torch.Generator().manual_seed(0)
    firsts = {int(generate(model, prompt, 1, temperature=5.0, top_k=3, generator=gen)[0, -1]) for _ in range(40)}
    assert firsts <= set(allowed.tolist()) and len(firsts) > 1


def test_a_tiny_temperature_samples_the_likeliest_token():
    """A temperature near 0 is nearly greedy: it overflowed the scaled logits to inf (NaN probabilities)."""
    from components.models.generate import sample_next

    logits = torch.tensor([[1.0, 3.0, -2.0, 3.0 - 1e-3], [0.5, -1.0, 0.2, 0.1]])
    for temperature in (1e-40, 1e-300, 1e-6):
        picked = sample_next(logits, temperature=temperature, top_k=None, generator=torch.Generator().manual_seed(0))
        assert picked.tolist() == [1, 0], temperature


def test_generate_rejects_bad_input():
    model = _model("dense", n_layers=1)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    for kwargs in (dict(temperature=-1.0), dict(top_k=0)):
        with pytest.raises(UserError):
            generate(model, prompt, 2, **kwargs)
    with pytest.raises(UserError, match=f"Fix: ask for at most {model.args.max_seq_len - 3} new tokens"):
        generate(model, prompt, model.args.max_seq_len)
    too_long = torch.zeros(1, model.args.max_seq_len + 5, dtype=torch.long)  # no room left: the prompt must shrink
    with pytest.raises(UserError, match=f"Fix: shorten the prompt to at most {model.args.max_seq_len - 4} tokens, "
                                        "leaving room for the 4 new ones"):
        generate(model, too_long, 4)
    with pytest.raises(UserError, match=f"Fix: ask for fewer than {model.args.max_seq_len} new tokens"):
        generate(model, too_long, model.args.max_seq_len)


def test_a_decoding_step_that_breaks_its_contract_is_refused():
    """forward_step must give the logits of every token it is given, [B, Tnew, V]: a model's last position only
    ([B, V]) was read as one number per row, and decoding went on with token 0 in silence."""
    class LastOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner, self.args = model, model.args

        def new_kv_cache(self, batch_size, capacity=None):
            return self.inner.new_kv_cache(batch_size, capacity)

        def forward_step(self, tokens, cache):
            return self.inner.forward_step(tokens, cache)[:, -1]

    model = LastOnly(_model("dense", n_layers=1))
    with pytest.raises(UserError, match=rf"LastOnly.forward_step returned shape \[1, {VOCAB}\] for tokens of shape "
                                        r"\[1, 3\]; decoding needs their logits \[batch, tokens, vocab\]"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, temperature=0)


def test_generation_stops_once_every_row_has_produced_the_stop_token():
    model = _model("nsa")
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    full = generate(model, prompt, 12, temperature=0)
    first = int(full[0, 5])
    stopped = generate(model, prompt[:1], 12, temperature=0, stop_id=first)
    assert stopped.shape == (1, 6) and torch.equal(stopped, full[:1, :6])
    # Two rows: the run goes on until the later one ends (or max_new_tokens); the earlier one carries on.
    later = [int(t) for t in full[1, 5:]]
    if first in later:
        end = 5 + later.index(first) + 1
        assert torch.equal(generate(model, prompt, 12, temperature=0, stop_id=first), full[:, :end])
    else:
        assert torch.equal(generate(model, prompt, 12, temperature=0, stop_id=first), full)


def test_generation_builds_no_autograd_graph():
    """generate() decodes under no_grad: a caller need not wrap it (a graph through the KV cache would hold every
    step's activations)."""
    import torch

    from components.models import Transformer, generate
    from tests.test_models_helpers import VOCAB, tiny_args

    model = Transformer(tiny_args(), VOCAB)
    model.init_weights()
    grad_modes = []
    step = model.forward_step

    def watched(*args, **kwargs):
        grad_modes.append(torch.is_grad_enabled())
        return step(*args, **kwargs)

    model.forward_step = watched
    out = generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)
    assert out.shape == (1, 7) and grad_modes == [False] * 4 and torch.is_grad_enabled()
