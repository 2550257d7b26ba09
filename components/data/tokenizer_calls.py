"""A tokenizer's encode() and decode() as the commands call them (sample, plot, eval's passkey probe, the lm-eval
harness): what a plugin's tokenizer raises there is one message naming it and its line, as in the data stream."""

from __future__ import annotations

from components.data.dataset import raised_at
from components.errors import UserError, first_line


def decode_text(tokenizer, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids)
    except (UserError, MemoryError):
        raise
    except Exception as exc:
        raise UserError(f"the tokenizer ({type(tokenizer).__name__}) failed decoding {len(ids)} token ids: "
                        f"{type(exc).__name__}: {first_line(exc)}{raised_at(exc, tokenizer)}. Fix: mend its decode() "
                        f"there: any ids below its vocab_size, in any order, are some text (bytes that are no UTF-8 "
                        f"text decode with errors='replace', say)") from None


def encode_text(tokenizer, text: str, what: str) -> list[int]:
    """tokenizer.encode(text) of the text a command was given (`what`: '--prompt', say)."""
    try:
        return tokenizer.encode(text)
    except (UserError, MemoryError):
        raise
    except Exception as exc:
        raise UserError(f"the tokenizer ({type(tokenizer).__name__}) failed encoding {what}: {type(exc).__name__}: "
                        f"{first_line(exc)}{raised_at(exc, tokenizer)}. Fix: mend its encode() there, or give text "
                        f"it can encode") from None
