"""Packed documents at the model level: a packed row's logits equal each document's own forward."""

from __future__ import annotations

import pytest
import torch

from components.models import build_transformer
from components.nsa.documents import document_layout
from tests.test_models_helpers import VOCAB, small_nsa, tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")

# Two rows of 40 tokens; documents of 1, 3 (< l = 4), 6 (< l' = 8 and w = 5 < 6), 30 (several
# selection blocks), and a document cut by the first row's end that continues in the second row.
ROWS = [[1, 3, 6, 30], [25, 15]]
T = 40


@pytest.mark.parametrize("attention, kv_per_branch", [("nsa", False), ("nsa", True), ("dense", False)])
def test_packed_rows_give_each_documents_own_logits(attention, kv_per_branch):
    torch.manual_seed(0)
    nsa = small_nsa(kv_per_branch=kv_per_branch, compress="mlp", gate="mlp")
    model = build_transformer(tiny_args(attention, nsa=nsa), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (len(ROWS), T))
    lengths = [n for row in ROWS for n in row]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = document_layout(cu_seqlens, len(ROWS) * T, 4, 2)
    packed = model(tokens, layout)
    flat_tokens, flat_logits = tokens.reshape(-1), packed.reshape(-1, VOCAB)
    for a, b in zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:]):
        alone = model(flat_tokens[a:b][None])[0]
        torch.testing.assert_close(flat_logits[a:b], alone, rtol=1e-9, atol=1e-9, msg=f"document [{a}, {b})")


def test_one_document_per_row_is_the_unpacked_model():
    torch.manual_seed(0)
    model = build_transformer(tiny_args("nsa"), VOCAB).double()
    tokens = torch.randint(0, VOCAB, (2, T))
    layout = document_layout(torch.tensor([0, T, 2 * T]), 2 * T, 4, 2)
    torch.testing.assert_close(model(tokens, layout), model(tokens), rtol=1e-9, atol=1e-9)
