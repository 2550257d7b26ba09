"""What a tokenizer loses of the text it is given. One without tokens for some characters (a BPE with no unknown
token and no byte fallback) drops them in encode(), and a run trained on what was left without a word: the first
documents are read back through decode() once at start-up. Characters are compared as normalising tokenizers leave
them (compatibility forms, case, accents and whitespace set aside), so lowercasing or NFKC is no loss."""

from __future__ import annotations

import unicodedata
from collections import Counter

import numpy as np

from components.data.dataset import encode_document, read_plainly
from components.data.tokenizer_calls import decode_text

SAMPLE_DOCUMENTS = 8
SAMPLE_CHARACTERS = 10_000  # of each document: cheap for any tokenizer
LOST_SHARE = 0.01  # a larger share of the sample's characters lost is said


def first_texts(source, num_shards: int, seed: int) -> list[str]:
    """The first SAMPLE_DOCUMENTS text documents of the training split, from logical shard 0 on, as epoch 0
    reads them (documents of token ids are no text to compare)."""
    texts: list[str] = []
    # A source that prepares documents itself (a mixture) takes `prepare`: here the documents as they come.
    kwargs = {"prepare": lambda document: document} if getattr(source, "prepares_documents", False) else {}
    for shard in range(min(num_shards, SAMPLE_DOCUMENTS)):
        for item in read_plainly(source, (shard, num_shards, "train", seed, 0, None), **kwargs):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                break  # token ids hold no text to compare; what is no (document, cursor) pair the loader refuses
            texts.append(item[0][:SAMPLE_CHARACTERS])
            if len(texts) == SAMPLE_DOCUMENTS:
                return texts
    return texts


def _characters(text: str) -> Counter:
    folded = unicodedata.normalize("NFKD", text).casefold()
    return Counter(c for c in folded if not c.isspace() and not unicodedata.combining(c))


def lost_text_note(tokenizer, texts: list[str]) -> str | None:
    """A note when decode(encode(text)) of `texts` lacks more than LOST_SHARE of their characters; None otherwise."""
    given, lost = 0, 0
    for text in texts:
        characters = _characters(text)
        given += sum(characters.values())
        lost += sum((characters - _characters(_read_back(tokenizer, text))).values())
    if not given or lost <= LOST_SHARE * given:
        return None
    words = (word for text in texts for word in text.split()[:1000])
    example = next((f"; {word!r} reads back as {read!r}" for word in words
                    if _characters(word) - _characters(read := _read_back(tokenizer, word))), "")
    return (f"tokenizer {tokenizer.name!r} loses {lost / given:.0%} of the characters of the first {len(texts)} "
            f"training document{'s' if len(texts) != 1 else ''} (encoded and decoded again{example}): it drops or "
            f"replaces what its vocabulary lacks, so the model never sees that text. Fix: a tokenizer that covers "
            f"the data's characters (byte fallback or a byte-level BPE reads any text, as the byte tokenizer does), "
            f"or data it covers")


def _read_back(tokenizer, text: str) -> str:
    ids = encode_document(tokenizer, text)
    if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu"):
        return text  # no token ids: the loader refuses them, naming the tokenizer
    return decode_text(tokenizer, ids.tolist())
