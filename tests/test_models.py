"""Transformer with NSA or dense attention: arguments, shapes, init, causality, training."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from components.errors import UserError
from components.models import NSAArgs, Transformer, TransformerArgs, build_transformer, find_problems
from components.models.rope import RotaryEmbedding, apply_rope
from components.nsa import BACKENDS
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args


# ---- arguments ----------------------------------------------------------------------------------

def _all_fields(cls):
    for f in dataclasses.fields(cls):
        yield f
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _all_fields(type(default))


def test_every_field_has_a_doc_and_defaults_are_valid():
    for f in _all_fields(TransformerArgs):
        assert f.metadata.get("doc"), f.name
    assert find_problems(TransformerArgs()) == []
    assert find_problems(TransformerArgs(attention="dense")) == []
    assert tuple(dataclasses.fields(NSAArgs)[-1].metadata["choices"]()) == tuple(BACKENDS)


def test_nsa_paper_defaults():
    a = NSAArgs()
    assert (a.block_size, a.block_stride, a.sel_block_size, a.num_selected, a.window_size) == (32, 16, 64, 16, 512)
    assert (a.compress, a.kv_per_branch, a.gate, a.backend) == ("mlp", True, "mlp", "reference")


@pytest.mark.parametrize(
    "nsa, path, words",
    [
        (NSAArgs(block_size=32, block_stride=12, sel_block_size=48), "block_stride", "must divide block_size"),
        (NSAArgs(block_size=32, block_stride=16, sel_block_size=72), "block_stride", "must divide sel_block_size"),
        (NSAArgs(block_size=64, block_stride=16, sel_block_size=32), "sel_block_size", "must be >= block_size"),
    ],
)
def test_nsa_check_names_field_and_fix(nsa, path, words):
    problems = nsa.check()
    assert [p.field for p in problems] == [path]
    assert words in problems[0].why and problems[0].fix  # a record: why and fix apart
    assert problems[0].value == getattr(nsa, path)
    nested = find_problems(TransformerArgs(nsa=nsa))
    assert [p.field for p in nested] == [f"nsa.{path}"]


@pytest.mark.parametrize(
    "overrides, path",
    [
        (dict(dim=30, n_heads=4), "n_heads"),
        (dict(dim=12, n_heads=4), "n_heads"),  # head dim 3 is odd: RoPE needs pairs
        (dict(n_heads=4, n_kv_heads=3), "n_kv_heads"),
        (dict(attention="dense", nsa=NSAArgs(window_size=64)), "nsa"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(attention="sparse"), "attention"),
    ],
)
def test_transformer_problems(overrides, path):
    problems = find_problems(TransformerArgs(**overrides))
    assert [p.field for p in problems] == [path]
    with pytest.raises(UserError, match=path):
        build_transformer(TransformerArgs(**overrides), VOCAB)


def test_mlp_hidden_size_rounds_up():
    assert TransformerArgs(dim=256, mlp_ratio=4.0, multiple_of=64).mlp_hidden_dim() == 704  # 682 -> 704
    assert TransformerArgs(dim=768, mlp_ratio=4.0, multiple_of=256).mlp_hidden_dim() == 2048


# ---- shapes, GQA, NSA vs dense ------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("n_heads, n_kv_heads, dim", [(4, 4, 32), (4, 2, 32), (6, 1, 48), (16, 1, 64)])
def test_forward_shapes_gqa(attention, n_heads, n_kv_heads, dim):
    model = build_transformer(tiny_args(attention, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, n_layers=1), VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 19))
    logits = model(tokens)
    assert logits.shape == (2, 19, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("kv_per_branch", [True, False])
@pytest.mark.parametrize("compress, gate", [("mlp", "mlp"), ("mean", "linear")])
def test_nsa_variants_run(kv_per_branch, compress, gate):
    args = tiny_args(nsa=small_nsa(kv_per_branch=kv_per_branch, compress=compress, gate=gate))
    model = build_transformer(args, VOCAB)
    assert model(torch.randint(0, VOCAB, (1, 3))).shape == (1, 3, VOCAB)  # T < l: no compressed block yet
    assert model(torch.randint(0, VOCAB, (2, 23))).shape == (2, 23, VOCAB)
    wkv = model.layers[0].attention.wkv.weight
    assert wkv.shape[0] == (6 if kv_per_branch else 2) * args.n_kv_heads * args.head_dim


def test_more_selected_blocks_than_a_row_can_hold_change_nothing_and_cost_nothing():
    """n above ceil(max_seq_len / l') (8 blocks here) leaves the extra slots unused: the op is asked for no
    more slots than a row can fill, and the logits and gradients are those of the n asked for."""
    model = build_transformer(tiny_args(nsa=small_nsa(num_selected=1000)), VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 64))

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        logits.float().pow(2).mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    assert {layer.attention.hyper["num_selected"] for layer in model.layers} == {8}
    clamped = run()
    for layer in model.layers:  # the n asked for, as the op would take it
        layer.attention.hyper["num_selected"] = layer.attention.selection["num_selected"] = 1000
    asked = run()
    assert torch.equal(clamped[0], asked[0])
    assert all(torch.equal(a, b) for a, b in zip(clamped[1], asked[1]))


def test_nsa_and_dense_differ_only_in_attention():
    nsa = build_transformer(tiny_args("nsa"), VOCAB)
    dense = build_transformer(tiny_args("dense"), VOCAB)

    def outside_attention(model):
        return {n: p.shape for n, p in model.named_parameters() if ".attention." not in n}

    assert outside_attention(nsa) == outside_attention(dense)
    assert any(".attention.compress_k." in n for n, _ in nsa.named_parameters())
    assert not any(".attention.compress" in n for n, _ in dense.named_parameters())
    assert type(nsa.layers[0]) is type(dense.layers[0])
    assert isinstance(nsa.layers, torch.nn.ModuleList)


def test_too_long_sequence_is_a_user_error():
    model = build_transformer(tiny_args("dense", max_seq_len=16), VOCAB)
    with pytest.raises(UserError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


# ---- RoPE -------------------------------------------------------------------------------------------

def test_rope_matches_complex_rotation():
    D, L, theta = 8, 20, 500.0
    rope = RotaryEmbedding(D, L, theta)
    x = torch.randn(2, 5, 3, D, dtype=torch.float64)
    positions = torch.tensor([0, 3, 7, 11, 19])
    got = apply_rope(x, rope.cos.double(), rope.sin.double(), positions)
    freqs = torch.tensor([theta ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    phase = torch.polar(torch.ones(5, D // 2, dtype=torch.float64), positions[:, None].double() * freqs)
    z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * phase[None, :, None, :]
    want = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # tables are fp32


def test_rope_scores_depend_on_offset_only():
    rope = RotaryEmbedding(16, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j):
        qi = apply_rope(q, rope.cos, rope.sin, torch.tensor([i]))
        kj = apply_rope(k, rope.cos, rope.sin, torch.tensor([j]))
        return (qi * kj).sum()

    torch.testing.assert_close(score(10, 3), score(40, 33), atol=1e-5, rtol=1e-5)


# ---- init -------------------------------------------------------------------------------------------

def _meta_init(args, seed):
    with torch.device("meta"):
        model = Transformer(args, VOCAB)
    assert model.tok_embeddings.weight.is_meta
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


@pytest.mark.parametrize("attention", ["nsa", "dense"])
@pytest.mark.parametrize("tie", [False, True])
def test_meta_construction_and_deterministic_init(attention, tie):
    args = tiny_args(attention, tie_embeddings=tie)
    a, b, c = _meta_init(args, 1), _meta_init(args, 1), _meta_init(args, 2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert any(not torch.equal(sa[n], sc[n]) for n in sa)
    # constructing on the CPU and re-initialising with the same seed gives the same weights
    cpu = Transformer(args, VOCAB)
    torch.manual_seed(1)
    cpu.init_weights()
    for name, value in cpu.state_dict().items():
        assert torch.equal(value, sa[name]), name
    # RoPE tables are non-persistent and recomputed
    assert not any("rope" in n for n in sa)
    torch.testing.assert_close(a.rope.cos, cpu.rope.cos)
    assert (a.output.weight is a.tok_embeddings.weight) == tie
    tokens = torch.randint(0, VOCAB, (1, 11))
    torch.testing.assert_close(a(tokens), b(tokens), rtol=0, atol=0)


def test_init_scales():
    args = TransformerArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, max_seq_len=64, init_std=0.02)
    model = build_transformer(args, 1000)
    out_std = 0.02 / math.sqrt(16)
    attn, ffn = model.layers[3].attention, model.layers[3].feed_forward
    for weight, std in [
        (attn.wq.weight, 0.02), (attn.wkv.weight, 0.02), (ffn.w1.weight, 0.02),
        (model.tok_embeddings.weight, 0.02), (model.output.weight, 0.02),
        (attn.wo.weight, out_std), (ffn.w2.weight, out_std),
    ]:
        assert abs(weight.std().item() - std) < 0.05 * std
    assert torch.equal(model.norm.weight, torch.ones(256))
    assert torch.equal(model.layers[0].attention_norm.weight, torch.ones(256))
    assert torch.equal(attn.gate[-1].bias, torch.zeros_like(attn.gate[-1].bias))


def test_num_params_hand_count():
    # dense, dim 16, 2 layers, H 4, Hkv 2 (D 4), hidden round_up(int(2/3*4*16)=42, 16) = 48, V 61
    args = TransformerArgs(
        dim=16, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, attention="dense", max_seq_len=8
    )
    per_layer = 16 * 16 + 2 * (16 * 8) + 16 * 16 + 3 * 16 * 48 + 2 * 16  # q, k+v, o, SwiGLU, two norms
    total = 61 * 16 + 2 * per_layer + 16 + 16 * 61  # embedding, layers, final norm, output
    model = build_transformer(args, 61)
    assert model.num_params() == total
    assert model.num_params(exclude_embeddings=True) == total - 61 * 16
    tied = build_transformer(dataclasses.replace(args, tie_embeddings=True), 61)
    assert tied.num_params() == total - 16 * 61


# ---- causality ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_full_model_is_causal(attention):
    model = build_transformer(tiny_args(attention), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (2, 41))
    base = model(tokens)
    for t in (0, 6, 17, 30):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, VOCAB, changed[:, t + 1:].shape)
        out = model(changed)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-12)
        assert not torch.allclose(out[:, t + 1:], base[:, t + 1:])


# ---- training -----------------------------------------------------------------------------------------

def test_tiny_nsa_model_overfits_one_batch():
    model = build_transformer(tiny_args("nsa"), VOCAB)
    tokens = torch.randint(0, VOCAB, (4, 33))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(VOCAB)) < 0.1  # near-uniform predictions at init
    assert losses[-1] < 0.5 * losses[0], losses
