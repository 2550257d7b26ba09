"""Packed documents at the model level: a packed row's logits equal each document's own forward."""

from __future__ import annotations

import copy

import pytest
import torch

from components.models import build_transformer
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

# Two rows of 40 tokens; documents of 1, 3 (< l = 4), 6 (< l' = 8 and w = 5 < 6), 30 (several
# selection blocks), 25 and 15.
ROWS = [[1, 3, 6, 30], [25, 15]]
T = 40


def starts_of(rows, length):
    """document_starts [len(rows), length] for rows given as document lengths."""
    starts = torch.zeros(len(rows), length, dtype=torch.bool)
    for r, lengths in enumerate(rows):
        starts[r, torch.tensor([0, *lengths]).cumsum(0)[:-1]] = True
    return starts


@pytest.mark.parametrize("attention, kv_per_branch", [("nsa", False), ("nsa", True), ("dense", False)])
def test_packed_rows_give_each_documents_own_logits(attention, kv_per_branch):
    torch.manual_seed(0)
    nsa = small_nsa(kv_per_branch=kv_per_branch, compress="mlp", gate="mlp")
    model = build_transformer(tiny_args(attention, nsa=nsa), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (len(ROWS), T))
    lengths = [n for row in ROWS for n in row]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = model(tokens, starts_of(ROWS, T))
    flat_tokens, flat_logits = tokens.reshape(-1), packed.reshape(-1, VOCAB)
    for a, b in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]):
        alone = model(flat_tokens[a:b][None])[0]
        torch.testing.assert_close(flat_logits[a:b], alone, rtol=1e-9, atol=1e-9, msg=f"document [{a}, {b})")


def test_one_document_per_row_is_the_unpacked_model():
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa"), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (2, T))
    one_per_row = torch.zeros(2, T, dtype=torch.bool)  # the first token opens a row's document regardless
    torch.testing.assert_close(model(tokens, one_per_row), model(tokens), rtol=1e-9, atol=1e-9)


def test_document_starts_must_match_the_tokens():
    """A bool tensor or the layout built from it; either must cover the batch."""
    model = build_transformer(tiny_args("nsa"), VOCAB)
    tokens = torch.randint(0, VOCAB, (2, T))
    with pytest.raises(ValueError, match="covers 78 tokens but the batch"):
        model(tokens, torch.ones(2, T - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="must be a bool tensor"):
        model(tokens, torch.ones(2, T, dtype=torch.long))


def test_the_layout_form_is_the_starts_form():
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa"), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (len(ROWS), T))
    starts = starts_of(ROWS, T)
    assert torch.equal(model(tokens, model.document_layout(starts, tokens.device)), model(tokens, starts))


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_compiled_blocks_take_new_boundaries_without_recompiling(attention):
    """Blocks compiled as training compiles them (fullgraph, inductor) see batches whose documents and
    compressed-block counts differ; one graph serves them all, and it computes what eager computes."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = build_transformer(tiny_args(attention), VOCAB)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("inductor")
    for block in model.layers:
        block.compile(fullgraph=True, backend=counter)
    batches = [ROWS, [[40], [10, 10, 20]], [[20, 20], [5, 5, 5, 25]], [[2, 2, 36], [33, 7]]]
    torch._dynamo.reset()
    for rows in batches:
        tokens = torch.randint(0, VOCAB, (2, T))
        starts = starts_of(rows, T)
        outputs = [m(tokens, starts) for m in (model, eager)]
        for m, out in zip((model, eager), outputs):
            out.square().mean().backward()
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-6)
            p.grad = q.grad = None
    assert counter.frame_count == 1, f"{counter.frame_count} compiles over {len(batches)} batches"


def test_packed_rows_tell_the_op_that_no_document_is_longer_than_a_row(monkeypatch):
    """The B rows go to the op as one packed row; max_seqlen = T bounds its documents (the Triton backend's
    selected-branch layout reads it: a packed row of short rows is not one long row)."""
    from components.models import nsa_attention as layer_module

    seen = []
    real = layer_module.nsa_attention
    monkeypatch.setattr(layer_module, "nsa_attention",
                        lambda *args, **kwargs: seen.append(kwargs.get("max_seqlen")) or real(*args, **kwargs))
    model = build_transformer(tiny_args("nsa"), VOCAB)
    tokens = torch.randint(0, VOCAB, (len(ROWS), T))
    model(tokens, starts_of(ROWS, T))
    assert seen and set(seen) == {T}
