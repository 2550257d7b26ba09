"""Any of the package's tokenizers as Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json).

An exported model ships them so that `AutoTokenizer.from_pretrained(folder)` encodes text to the ids
the model was trained on. Byte and tiktoken tokenizers become byte-level BPE tokenizers of the
`tokenizers` library with every id kept (specials included); a Hugging Face tokenizer is copied.
The post-processor adds what training added to a document (BOS when data.add_bos, else nothing), so
the tokenizer called as usual gives training's ids. Plain text encodes the same; one difference is
documented: the Hugging Face tokenizer reads special-token text ("<|endoftext|>") as the special token,
where training read it as plain text.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from components.errors import UserError
from components.install_hint import install_extra

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: each byte as a printable character (printable bytes stand for
    themselves, the others take code points from 256 up), as byte-level BPE files spell tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(ranks: dict[bytes, int], specials: dict[str, int], split_pattern: str | None):
    """A tokenizers.Tokenizer for a byte-level BPE given by merge ranks (token bytes -> id), the
    special tokens at their own ids, and the pre-tokenizer's split pattern (None: no split)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    # A token of rank r is the merge of two shorter tokens; every such split is listed at rank r, so
    # the merge order is the ranks' order, as tiktoken merges.
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
    merges.sort()
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab.update(specials)  # at their own ids (tiktoken's leave gaps); only added-token matching yields them
    # ignore_merges takes a split piece found whole in the vocabulary as that token, as tiktoken does. Without a
    # split (bytes) a whole document is one piece: one that reads "<|endoftext|>" became the special token, so the
    # folder could not serve as data.hf_tokenizer (its end of text "an ordinary token"); bytes have no merges.
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False,
                               ignore_merges=split_pattern is not None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = byte_level if split_pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False), byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True) for name in specials])
    return tok


def hf_tokenizer_json(tokenizer) -> tuple[str, str, str]:
    """(tokenizer.json text, BOS token, EOS token) for one of the package's tokenizers."""
    from components.data.hf_tokenizer import HFTokenizer
    from components.data.tokenizers import ENDOFTEXT, ByteTokenizer, TiktokenTokenizer

    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UserError(f"writing Hugging Face tokenizer files needs the tokenizers package. Fix: "
                        f"{install_extra('hf')}.") from None
    if isinstance(tokenizer, HFTokenizer):
        from components.data.hf_tokenizer import _tokenizer_file

        with open(_tokenizer_file(tokenizer.args.path), encoding="utf-8") as fh:
            text = fh.read()
        return text, tokenizer._tok.id_to_token(tokenizer.bos_id), tokenizer._tok.id_to_token(tokenizer.eos_id)
    if isinstance(tokenizer, ByteTokenizer):
        specials = {"<|bos|>": tokenizer.bos_id, ENDOFTEXT: tokenizer.eos_id}
        tok = _byte_level_bpe({bytes([b]): b for b in range(256)}, specials, None)
        return tok.to_str(), "<|bos|>", ENDOFTEXT
    if isinstance(tokenizer, TiktokenTokenizer):
        enc = tokenizer._enc
        # tiktoken's regex engine reads "{1,3}+" as possessive; the tokenizers library's (Oniguruma) reads it
        # as a repetition of the group. The greedy "{1,3}" splits alike here: what follows can never match
        # what the repetition gave back.
        pattern = re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", enc._pat_str)
        tok = _byte_level_bpe(enc._mergeable_ranks, dict(enc._special_tokens), pattern)
        return tok.to_str(), ENDOFTEXT, ENDOFTEXT
    raise UserError(f"tokenizer {getattr(tokenizer, 'name', type(tokenizer).__name__)!r} has no Hugging Face "
                    f"form. Fix: train with data.tokenizer = 'byte', 'tiktoken' or 'hf_tokenizer' to export.")


def with_bos_rule(text: str, bos: str, bos_id: int, add_bos: bool) -> str:
    """tokenizer.json text whose post-processor adds what training added to a document: BOS before the
    text when add_bos, else nothing (a copied Hugging Face tokenizer's own template, say '<s> $A', is
    replaced: the loader encodes without it)."""
    from tokenizers import Tokenizer, processors

    if not add_bos:
        data = json.loads(text)
        data["post_processor"] = None
        return json.dumps(data, ensure_ascii=False)
    tok = Tokenizer.from_str(text)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, bos_id)])
    return tok.to_str()


def write_tokenizer_files(tokenizer, folder: str, model_max_length: int, add_bos: bool) -> None:
    """The tokenizer as Hugging Face files; `add_bos` as the run's data.add_bos, so that the folder's
    tokenizer, called as usual (special tokens added), gives the ids training gave."""
    text, bos, eos = hf_tokenizer_json(tokenizer)
    text = with_bos_rule(text, bos, tokenizer.bos_id, add_bos)
    with open(os.path.join(folder, TOKENIZER_FILE), "w", encoding="utf-8") as fh:
        fh.write(text)
    # The token a document starts after: its BOS with add_bos, else the previous document's end of text
    # (what lm-eval and generation put before an empty context).
    # Padding takes the end of text too (attention_mask keeps it out), so tokenizer(..., padding=True) works.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos if add_bos else eos, "eos_token": eos,
              "pad_token": eos, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)


def tokenizer_in_folder(name: str, args, folder: str) -> tuple[str, object]:
    """(tokenizer name, its arguments) for reading a folder these files were written into. A Hugging Face
    tokenizer reads the folder's own tokenizer.json and tokenizer_config.json (the file its recipe names
    may not exist where the folder was copied to; the shipped one encodes alike, as it is called without
    special tokens). So does a tiktoken encoding read from a .tiktoken file that is not here, or is named by a relative
    path (read from wherever the folder is used, it may be another file of that name): the folder's byte-level BPE
    holds its ranks and <|endoftext|>. Byte and named tiktoken encodings are built in."""
    from components.data.hf_tokenizer import HFTokenizerArgs
    from components.data.tokenizers import ENDOFTEXT, TiktokenArgs, encoding_file

    if isinstance(args, HFTokenizerArgs):
        return name, dataclasses.replace(args, path=folder)
    if isinstance(args, TiktokenArgs):
        file = encoding_file(args.encoding)
        if file is not None and (not os.path.isabs(os.path.expanduser(file)) or not os.path.isfile(file)):
            return "hf_tokenizer", HFTokenizerArgs(path=folder, eos_token=ENDOFTEXT, bos_token=ENDOFTEXT)
    return name, args
