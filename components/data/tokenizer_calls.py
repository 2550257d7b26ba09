"""A tokenizer's decode() as the commands call it (sample, eval's passkey probe, the lm-eval harness): what a
plugin's tokenizer raises there is one message naming it and its line, as for encode() in the data stream."""

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
