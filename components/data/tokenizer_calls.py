"""A tokenizer's encode() and decode() as the commands call them (sample, plot, eval's passkey probe, the lm-eval
harness): what a plugin's tokenizer raises there is one message naming it and its line, as in the data stream."""

from __future__ import annotations

from components.data.part_failures import failures_named


def decode_text(tokenizer, ids: list[int]) -> str:
    with failures_named(tokenizer, "tokenizer", f"decoding {len(ids)} token ids",
                        "mend its decode() there: any ids below its vocab_size, in any order, are some text (bytes "
                        "that are no UTF-8 text decode with errors='replace', say)"):
        return tokenizer.decode(ids)


def encode_text(tokenizer, text: str, what: str) -> list[int]:
    """tokenizer.encode(text) of the text a command was given (`what`: '--prompt', say)."""
    with failures_named(tokenizer, "tokenizer", f"encoding {what}", "mend its encode() there, or give text it can "
                        "encode"):
        return tokenizer.encode(text)
