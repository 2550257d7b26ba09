"""Loss by context position on held-out data: does the model use far context?

A token's context position is how many tokens of its own document precede it when the model masks
documents (the document is all it sees), else its position in the row.
"""

from __future__ import annotations

import torch

from nsa_titan.loss import token_cross_entropy


def context_positions(document_starts: torch.Tensor | None, shape: tuple[int, int], masked: bool) -> torch.Tensor:
    """[B, T] long: each token's context position (see the module docstring)."""
    B, T = shape
    positions = torch.arange(T).expand(B, T)
    if not masked or document_starts is None:
        return positions
    starts = document_starts.clone()
    starts[:, 0] = True
    last_start = torch.where(starts, positions, torch.zeros_like(positions)).cummax(dim=1).values
    return positions - last_start


@torch.no_grad()
def loss_by_position(model, documents_of, batches, seq_len: int, progress) -> dict:
    """Mean loss per context position 0 .. seq_len-1 over `batches` (loader batches on the host).
    documents_of(document_starts) gives the forward's documents argument, or None."""
    total = torch.zeros(seq_len, dtype=torch.float64)
    count = torch.zeros(seq_len, dtype=torch.int64)
    device = next(model.parameters()).device
    for batch in progress(batches):
        inputs = batch["input"].to(device)
        documents = documents_of(batch["document_starts"])
        logits = model(inputs) if documents is None else model(inputs, documents=documents)
        loss = token_cross_entropy(logits, batch["target"].to(device)).flatten()
        positions = context_positions(batch["document_starts"], tuple(inputs.shape), documents is not None).flatten()
        total.index_add_(0, positions, loss.double().cpu())
        count.index_add_(0, positions, torch.ones_like(positions))
    seen = count > 0
    mean = torch.where(seen, total / count.clamp(min=1), torch.full_like(total, float("nan")))
    return {"positions": torch.arange(seq_len)[seen].tolist(), "mean_loss": mean[seen].tolist(),
            "tokens": count[seen].tolist()}
