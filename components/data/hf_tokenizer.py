"""A Hugging Face `tokenizers` tokenizer (a tokenizer.json file, or a folder that holds one).

The `tokenizers` package is optional (the `hf` extra). Like the other tokenizers,
encode adds no special tokens and reads special-token strings in the text as plain text. Special
ids may lie anywhere in the vocabulary (unlike the byte and tiktoken tokenizers, whose specials sit
above every ordinary id).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from components.errors import UserError, read_from
from components.install_hint import install_extra

# Tried in order when neither the recipe nor tokenizer_config.json names the end-of-document token.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@dataclass
class HFTokenizerArgs:
    path: str = field(default="", metadata={"doc": "a tokenizer.json file, or a folder holding one (as "
                                                    "save_pretrained writes it)", "path": True})
    eos_token: str = field(default="", metadata={"doc": "the token that ends each document; empty: the "
                                                         "folder's tokenizer_config.json eos_token, else the first "
                                                         "known one (<|endoftext|>, </s>, <eos>, ...)"})
    bos_token: str = field(default="", metadata={"doc": "the token data.add_bos puts before each document; "
                                                         "empty: tokenizer_config.json's bos_token, else eos_token"})


def _tokenizer_file(path: str) -> str:
    if not path:
        raise UserError("tokenizer hf_tokenizer needs a path. Fix: set data.hf_tokenizer.path to a tokenizer.json "
                        "file or to a folder holding one.")
    path = os.path.expanduser(path)  # as the data sources' paths: a recipe's '~/tok' is the home folder's
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"tokenizer hf_tokenizer: {file!r} does not exist{read_from(file)}. Fix: point "
                        f"data.hf_tokenizer.path at a tokenizer.json file or a folder holding one.")
    return file


def _config_tokens(file: str, unset: list[str]) -> dict[str, str]:
    """The `unset` fields (eos_token, bos_token) as the tokenizer_config.json beside the file names them ('' for
    one it does not name, or with no such file). A file that is there but cannot be read is an error naming
    every field that would replace it, not a silent guess."""
    config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if not unset or not os.path.exists(config):
        return {key: "" for key in unset}
    try:
        with open(config, encoding="utf-8") as fh:
            table = json.load(fh)
        if not isinstance(table, dict):
            raise ValueError(f"it holds {type(table).__name__}, not a JSON object")
    except (OSError, ValueError) as exc:  # ValueError covers bad JSON and bad UTF-8
        fields = " and ".join(f"data.hf_tokenizer.{key}" for key in unset)
        # The recipe refuses a bos_token that data.add_bos does not use: without it, naming the tokens is no way out.
        only = (" (a recipe takes bos_token only with data.add_bos = true; without it, repair or remove the file)"
                if "bos_token" in unset else "")
        raise UserError(f"tokenizer hf_tokenizer: cannot read {config!r} ({exc}). Fix: repair or remove it, or set "
                        f"{fields} to the token{'s' if len(unset) > 1 else ''} to use{only}.") from None
    values = {key: table.get(key) or "" for key in unset}
    return {key: v.get("content", "") if isinstance(v, dict) else str(v) for key, v in values.items()}


class HFTokenizer:
    def __init__(self, args: HFTokenizerArgs):
        self.args = args
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError(f"tokenizer hf_tokenizer needs the tokenizers package. Fix: {install_extra('hf')} (or "
                            "pip install tokenizers).") from None
        file = _tokenizer_file(args.path)
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # the library raises a bare Exception for a malformed file
            raise UserError(f"tokenizer hf_tokenizer: cannot read {file!r} ({exc}). Fix: give a tokenizer.json that "
                            f"the tokenizers library wrote (Tokenizer.save or save_pretrained).") from None
        self._tok.encode_special_tokens = True  # special-token strings in documents are plain text
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        config = _config_tokens(file, [key for key in ("eos_token", "bos_token") if not getattr(args, key)])
        eos = args.eos_token or config["eos_token"]
        self.notes: list[str] = []  # what the run should be told at its start
        if not eos:
            eos = next((t for t in EOS_CANDIDATES if self._tok.token_to_id(t) is not None), "")
            if eos:
                self.notes.append(f"tokenizer hf_tokenizer: documents end with {eos!r} (the first of the usual "
                                  f"end-of-text tokens {file!r} holds; neither data.hf_tokenizer.eos_token nor a "
                                  f"tokenizer_config.json names one). Set data.hf_tokenizer.eos_token to choose.")
        self.eos_id = self._token_id(eos, "eos_token")
        bos = args.bos_token or config.get("bos_token", "")
        # A bos_token the recipe names is used (the recipe refuses it without add_bos); the config's may not be.
        self.bos_id = self._token_id(bos, "bos_token", plain_allowed=not args.bos_token) if bos else self.eos_id
        with open(file, "rb") as fh:  # the data stream's id follows the file's content, not where it lies
            self.name = f"hf_tokenizer:{hashlib.sha256(fh.read()).hexdigest()[:12]}"

    def _token_id(self, token: str, field_name: str, plain_allowed: bool = False) -> int:
        token_id = self._tok.token_to_id(token) if token else None
        if token_id is None:
            what = f"has no token {token!r}" if token else "names no end-of-document token"
            raise UserError(f"tokenizer hf_tokenizer: {self.args.path!r} {what}. Fix: set "
                            f"data.hf_tokenizer.{field_name} to one of its tokens.")
        if not plain_allowed and self._tok.encode(token, add_special_tokens=False).ids == [token_id]:
            specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
            where = "end" if field_name == "eos_token" else "start"
            choose = f" (its special tokens: {', '.join(map(repr, specials[:6]))})" if specials else ""
            raise UserError(f"tokenizer hf_tokenizer: {field_name} {token!r} is an ordinary token of "
                            f"{self.args.path!r}: text yields it too, so the {where} of a document could not be told "
                            f"from text. Fix: set data.hf_tokenizer.{field_name} to a special token{choose}.")
        return int(token_id)

    # Workers receive the arguments and load the file themselves.
    def __getstate__(self):
        return {"args": self.args}

    def __setstate__(self, state):
        self.__init__(state["args"])

    def encode(self, text: str) -> list[int]:
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except TypeError:  # JSON may hold lone surrogates ("\\ud800"), which the library cannot take
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")  # U+FFFD, as tiktoken does
            return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_hf_tokenizer(args: HFTokenizerArgs) -> HFTokenizer:
    return HFTokenizer(args)
