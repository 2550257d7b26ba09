"""Loss by context position on held-out data: does the model use far context?

A prediction's context position is how many tokens of context it had: those of its own document up
to the input token when the model masks documents (the document is all it sees), else those of the
row. The prediction made at a document's last token (its end of text) is of the next document's
first token, which no context in the finished document can tell: it is left out.
"""

from __future__ import annotations

import torch

from nsa_titan.loss import IGNORE_INDEX, token_cross_entropy


def context_positions(document_starts: torch.Tensor | None, shape: tuple[int, int], masked: bool) -> torch.Tensor:
    """[B, T] long: the tokens of context each input position's prediction has (1 at a document's first
    token under masking, t + 1 at row position t otherwise)."""
    B, T = shape
    positions = torch.arange(T).expand(B, T)
    if not masked or document_starts is None:
        return positions + 1
    starts = document_starts.clone()
    starts[:, 0] = True
    last_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
    return positions - last_start + 1


@torch.no_grad()
def loss_by_position(model, documents_of, batches, seq_len: int, progress, eos_id: int,
                     bos_id: int | None = None) -> dict:
    """Mean loss per context position 1 .. seq_len over `batches` (loader batches on the host), the
    predictions made at an end of text (eos_id) and ignored targets left out. bos_id: the BOS documents start
    with (the run's data.add_bos), None without. documents_of(document_starts) gives the forward's documents
    argument, or None."""
    total = torch.zeros(seq_len + 1, dtype=torch.float64)
    count = torch.zeros(seq_len + 1, dtype=torch.int64)
    device = next(model.parameters()).device
    for batch in progress(batches):
        inputs = batch["input"].to(device)
        documents = documents_of(batch["document_starts"])
        logits = model(inputs) if documents is None else model(inputs, documents=documents)
        loss = token_cross_entropy(logits, batch["target"].to(device)).flatten().double().cpu()
        positions = context_positions(batch["document_starts"], tuple(inputs.shape), documents is not None).flatten()
        # At a document's end of text the next token is another document's first (or its BOS). A tokenizer
        # whose BOS is its end of text (tiktoken) puts one at a document's start too: that one stays.
        at_end = batch["input"] == eos_id
        if bos_id == eos_id and batch["document_starts"] is not None:
            at_end &= ~batch["document_starts"]
        within = ~(at_end | (batch["target"] == IGNORE_INDEX)).flatten()  # nor the rest of a set's last short row
        total.index_add_(0, positions[within], loss[within])
        count.index_add_(0, positions[within], torch.ones_like(positions[within]))
    seen = count > 0
    mean = torch.where(seen, total / count.clamp(min=1), torch.full_like(total, float("nan")))
    return {"positions": torch.arange(seq_len + 1)[seen].tolist(), "mean_loss": mean[seen].tolist(),
            "tokens": count[seen].tolist()}
