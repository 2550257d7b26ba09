"""The exported modeling file holds its own copy of the NSA math (transformers loads it without this package): it must
compute the trainer model's logits for every NSA setting, not only the debug recipe's. Random weights of a large scale
make attention sharp, so a wrong block choice, gate or compression shows; no training."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from components.models import build_transformer
from components.models.hf import MODELING_FILE, _config, _to_hf
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

T = 29  # several selection blocks of the small settings; decode starts past the first compression block
PROMPT = 9

# (NSA settings, (query heads, key/value heads)); None is dense attention.
CASES = {
    "defaults_gqa2": ({}, (4, 2)),
    "mean_compression_gqa3": ({"compress": "mean"}, (3, 1)),
    "shared_kv_linear_gate_mha": ({"kv_per_branch": False, "gate": "linear"}, (4, 4)),
    "one_selected_block": ({"num_selected": 1}, (4, 2)),
    "stride_3_of_6": ({"block_size": 6, "block_stride": 3, "sel_block_size": 6, "num_selected": 3,
                       "window_size": 7}, (3, 1)),
    "window_past_the_row": ({"block_size": 4, "block_stride": 4, "sel_block_size": 4, "num_selected": 5,
                             "window_size": 100}, (4, 2)),
    "dense": (None, (4, 2)),
}


@pytest.fixture(scope="module")
def modeling():
    spec = importlib.util.spec_from_file_location("modeling_nsa_titan_shapes", MODELING_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair(modeling, nsa, heads):
    attention = "dense" if nsa is None else "nsa"
    extra = {} if nsa is None else {"nsa": small_nsa(**nsa)}
    args = tiny_args(attention, n_heads=heads[0], n_kv_heads=heads[1], dim=48, **extra)
    model = build_transformer(args, VOCAB)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.4)
    hf = modeling.NSATitanForCausalLM(modeling.NSATitanConfig(**_config(args, VOCAB)))
    missing, unexpected = hf.model.load_state_dict(
        {k[len("model."):]: v for k, v in _to_hf(model.state_dict()).items()}, strict=False)
    assert not unexpected and all("rope" in name or "freqs" in name for name in missing), (missing, unexpected)
    return model.eval(), hf.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_full_and_cached_forwards_give_the_trainers_logits(modeling, monkeypatch, case):
    model, hf = _pair(modeling, *CASES[case])
    tokens = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        expected = model(tokens)
        assert expected.std() > 1.0  # sharp enough that a wrong key changes the logits
        whole = hf(input_ids=tokens, use_cache=False).logits
        monkeypatch.setattr(modeling, "QUERY_CHUNK", 4)  # the chunked path, as a row longer than a chunk takes it
        chunked = hf(input_ids=tokens, use_cache=False).logits
        out = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(PROMPT, T):
            out = hf(input_ids=tokens[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    for name, logits in (("whole", whole), ("chunked", chunked), ("decoded", torch.cat(steps, 1))):
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
