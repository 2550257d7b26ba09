"""NSA telemetry: ranges, agreement with a direct computation, compiled blocks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from components.models import build_transformer, collect_nsa_telemetry
from components.models.telemetry import distance_bucket_labels
from components.nsa import select_blocks
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

T = 45


def _model(gate="linear"):
    model = build_transformer(tiny_args(nsa=small_nsa(gate=gate), n_heads=4, n_kv_heads=2), VOCAB)
    with torch.no_grad():  # spread the gates so that some saturate
        last = model.layers[0].attention.gate if gate == "linear" else model.layers[0].attention.gate[-1]
        last.weight.mul_(60.0)
        last.bias.normal_(0.0, 2.0)
    return model


def _rotate(x, positions, theta, D):
    """RoPE written independently: half-split pairs as complex numbers."""
    freqs = torch.tensor([theta ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    phase = torch.polar(torch.ones(len(positions), D // 2, dtype=torch.float64), positions[:, None].double() * freqs)
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2:].double()) * phase[None, :, None, :]
    return torch.cat((z.real, z.imag), dim=-1).to(x.dtype)


def test_labels():
    assert distance_bucket_labels(8) == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64+"]
    assert distance_bucket_labels(2) == ["0", "1+"]


def test_telemetry_matches_direct_computation():
    model = _model()
    args = model.args
    tokens = torch.randint(0, VOCAB, (2, T))
    inputs = {}
    hooks = [
        layer.attention.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    stats = collect_nsa_telemetry(model, tokens)
    assert all(v.dim() == 0 for v in stats.values())

    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
    nsa = args.nsa
    labels = distance_bucket_labels(8)
    for i, layer in enumerate(model.layers):
        attn, x = layer.attention, inputs[i]
        g = torch.sigmoid(F.linear(x, attn.gate.weight, attn.gate.bias).double()).view(2, T, H, 3)
        for b, branch in enumerate(("cmp", "sel", "win")):
            gb = g[..., b]
            entropy = -(gb * torch.log2(gb) + (1 - gb) * torch.log2(1 - gb))
            collapse = ((gb < 0.05) | (gb > 0.95)).double().mean()
            prefix = f"nsa/layer{i}/{branch}/"
            torch.testing.assert_close(stats[prefix + "gate_mean"].double(), gb.mean(), atol=1e-6, rtol=0)
            torch.testing.assert_close(stats[prefix + "gate_entropy"].double(), entropy.mean(), atol=1e-5, rtol=0)
            torch.testing.assert_close(stats[prefix + "gate_collapse"].double(), collapse, atol=1e-6, rtol=0)
            assert 0 <= stats[prefix + "gate_entropy"] <= 1
        if i == 0:
            assert 0 < stats["nsa/layer0/cmp/gate_collapse"] < 1  # the spread gates do saturate sometimes

        # selection from independently rotated q and compressed keys
        with torch.no_grad():
            q = _rotate(F.linear(x, attn.wq.weight).view(2, T, H, D), torch.arange(T), args.rope_theta, D)
            k_raw = F.linear(x, attn.wkv.weight).view(2, T, 6, Hkv, D)[:, :, 0]
            k_cmp = attn.compress_k(k_raw)
            Tc = k_cmp.shape[1]
            k_cmp = _rotate(k_cmp, torch.arange(Tc) * nsa.block_stride + nsa.block_size - 1, args.rope_theta, D)
            chosen = select_blocks(q, k_cmp, block_size=nsa.block_size, block_stride=nsa.block_stride,
                                   sel_block_size=nsa.sel_block_size, num_selected=nsa.num_selected)
        counts = [0] * 8
        for (bi, t, hk, s) in torch.nonzero(chosen >= 0).tolist():
            dist = t // nsa.sel_block_size - chosen[bi, t, hk, s].item()
            counts[0 if dist == 0 else min(dist.bit_length(), 7)] += 1
        got = torch.stack([stats[f"nsa/layer{i}/sel_distance/{label}"] for label in labels])
        torch.testing.assert_close(got.double(), torch.tensor(counts, dtype=torch.float64) / sum(counts))
        assert counts[3] > 0  # blocks 4..7 behind the query are picked somewhere at T = 45, l' = 8


def test_dense_model_has_no_nsa_telemetry():
    model = build_transformer(tiny_args("dense"), VOCAB)
    assert collect_nsa_telemetry(model, torch.randint(0, VOCAB, (1, 9))) == {}


# The default backend, and the cheap one beside it: telemetry must not trace under either.
@pytest.mark.parametrize("backend", ["inductor", "eager"])
def test_telemetry_with_compiled_blocks_leaves_training_graph_alone(backend):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() leaves them: earlier tests' graphs would count
    model = _model(gate="mlp")
    tokens = torch.randint(0, VOCAB, (2, 21))
    eager = collect_nsa_telemetry(model, tokens)
    for layer in model.layers:
        layer.compile(backend=backend, fullgraph=False)
    model(tokens).sum().backward()  # the training forward compiles here
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    compiled = collect_nsa_telemetry(model, tokens)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing traced for telemetry
    assert compiled.keys() == eager.keys()
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key])
    model(tokens).sum().backward()
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation afterwards either
    torch._dynamo.reset()


def test_telemetry_under_fsdp_single_rank(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh process group")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = _model()
        tokens = torch.randint(0, VOCAB, (2, 17))
        plain = collect_nsa_telemetry(model, tokens)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        model(tokens).sum().backward()  # parameters are sharded again after this
        sharded = collect_nsa_telemetry(model, tokens)
        for key in plain:
            torch.testing.assert_close(sharded[key], plain[key])
        assert math.isfinite(model(tokens).sum().item())
    finally:
        dist.destroy_process_group()


def test_selection_distances_count_from_each_document_start():
    """Rows of 8-token documents (one selection block each): with their boundaries every query's only
    block is its document's block 0, at distance 0; read as whole rows, farther blocks appear."""
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa"), VOCAB).eval()
    tokens = torch.randint(0, VOCAB, (2, 40))
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, ::8] = True
    within = collect_nsa_telemetry(model, tokens, starts)
    across = collect_nsa_telemetry(model, tokens)
    for layer in range(2):
        assert within[f"nsa/layer{layer}/sel_distance/0"].item() == 1.0
        assert across[f"nsa/layer{layer}/sel_distance/0"].item() < 1.0
    layout = model.document_layout(starts, tokens.device)  # the trainer passes the layout: same numbers
    assert all(torch.equal(a, b) for a, b in zip(collect_nsa_telemetry(model, tokens, layout).values(),
                                                 within.values()))
