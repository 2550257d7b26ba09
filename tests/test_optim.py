"""AdamW's weight-decay groups."""

from __future__ import annotations

from components.models import NSAArgs, TransformerArgs, build_transformer
from components.optim import param_groups


def test_only_linear_weights_decay():
    model = build_transformer(TransformerArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=64,
                                              nsa=NSAArgs(block_size=8, block_stride=4, sel_block_size=8,
                                                          num_selected=2, window_size=8)), vocab_size=50)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "layers.0.attention.wq.weight" in decayed and "output.weight" in decayed
    assert "layers.0.attention.compress_k.fc1.weight" in decayed
    for name in ("tok_embeddings.weight", "norm.weight", "layers.0.attention.compress_k.pos_embed",
                 "layers.0.attention.compress_k.fc1.bias"):
        assert name in kept, name
    assert decayed.isdisjoint(kept) and decayed | kept == set(names.values())
