"""How a sequence that opens with the end of text is read: as training read the document after it.

Without data.add_bos, training packs documents as `... end of text | document ...`: a document's first token is
predicted at the end of text before it, and under model.document_masking the document then runs alone from
position 0, never seeing that end of text. So an empty prompt, an empty lm-eval context and the first rolling
window, which start from the end of text, read it on its own and the document after it from position 0
(`sample`, the lm-eval model here; the --format hf folder's model does the same, told by `leading_eos_apart`).
With data.add_bos the token put first is the document's own BOS, which it sees (it may be the end-of-text id).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Documents = Callable[[torch.Tensor], Any]


def documents_of(part, model) -> Documents:
    """document_starts [B, T] bool (on the host) -> the forward's `documents=` argument, None where the model
    attends across documents (no documents hook, or its recipe does not mask them)."""
    device = next(model.parameters()).device
    return lambda starts: None if part.documents is None else part.documents(model, starts, device)


def leading_eos_apart(documents: Documents, add_bos: bool) -> bool:
    """Whether a sequence's leading end of text belongs to the document before it: no BOS opens documents, and the
    model attends to each document alone."""
    return not add_bos and documents(torch.ones(1, 2, dtype=torch.bool)) is not None


def opening_documents(documents: Documents, tokens: torch.Tensor, eos_id: int) -> Any:
    """The forward's `documents=` for rows `tokens` [B, T] whose leading end of text stands apart (leading_eos_apart):
    that token is a document of its own and the row's next token opens another; None when no row opens with it."""
    opens = tokens[:, 0] == eos_id
    if tokens.shape[1] < 2 or not bool(opens.any()):
        return None
    starts = torch.zeros(tokens.shape, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1] = opens.cpu()
    return documents(starts)


def generate_document(model, ids: list[int], new_tokens: int, eos_id: int, apart: bool, **draw) -> list[int]:
    """The tokens generate() draws after `ids`. With `apart` (leading_eos_apart) and `ids` opening with the end of
    text, the first token is drawn at that end of text alone and the document goes on from position 0 without it;
    the end of text still counts against max_seq_len, as it does in one call."""
    from components.models import generate
    from components.models.generate import check_decodes, check_room

    def drawn(prompt: list[int], count: int) -> list[int]:
        return generate(model, torch.tensor([prompt], dtype=torch.long), count, **draw)[0, len(prompt):].tolist()

    if not apart or ids[:1] != [eos_id] or (len(ids) == 1 and new_tokens < 2):
        return drawn(ids, new_tokens)
    check_decodes(model)
    check_room(model, len(ids), new_tokens)
    if len(ids) > 1:
        return drawn(ids[1:], new_tokens)
    first = drawn(ids, 1)
    return first if first == [eos_id] else first + drawn(first, new_tokens - 1)
