"""A corpus of local files cut into pieces that logical shards own.

File kinds: whole-file documents (.txt, .py, ...: one file is one document), .jsonl (one JSON
object per line, text in `text_field`) and .parquet (one row per document, text in column
`text_field`).

Pieces are the unit of ownership, so a shard opens only its own pieces and never reads the rest:
  - a whole-file document is one piece;
  - a .jsonl file is cut into byte ranges; a range owns the lines that start inside it;
  - a .parquet file is cut into row ranges that never cross a row group.
Ranges are sized from the corpus and the number of logical shards (about four pieces per shard,
at most 1 MiB or 1024 rows) so small corpora still spread over every shard. Piece p belongs to
logical shard p % num_shards.

Train/validation: a whole-file document is validation iff unit_hash(its path relative to the
corpus root) < validation_fraction, decided before pieces are dealt so both splits spread over all
shards. A .jsonl/.parquet record is validation iff unit_hash(its text) < validation_fraction, so
identical records always land in the same split.

Epoch order: the shard's pieces are permuted by (seed, shard, epoch), and the documents inside each
piece by (seed, shard, epoch, piece). The cursor is [piece position, document position].
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import NoReturn

from components.errors import UserError, read_from
from components.data.sources.base import ANOTHER_STREAM, digest, order_rng, split_of

MAX_PIECE_BYTES = 1 << 20
MAX_PIECE_ROWS = 1024
PIECES_PER_SHARD = 4
# A row group this many times a piece's rows (and MAX_PIECE_ROWS) is worth a note: each of its pieces decodes
# the group up to its own rows, so every row of it is decoded half that many times per epoch.
_NOTED_ROW_GROUP_FACTOR = 8
# A whole-file document this large is worth a note: it is read and tokenized at once (its tokens alone take 8
# bytes each as int64), at every epoch and again at every resume.
_NOTED_WHOLE_FILE_BYTES = 64 << 20
_CHECK_RECORD_BUDGET = 1000
# The bytes at each end of a file that a corpus's identity reads: a rewrite to the same size (an edited record, a
# parquet file written again with the same row groups: it ends in its footer, which holds each column's statistics)
# nearly always changes them, at two small reads a file, where hashing whole files would read the corpus at each start.
_SAMPLED_BYTES = 4096
# The parquet footers a corpus keeps parsed (per process): a piece's read would otherwise parse its file's footer
# again (milliseconds for a file of thousands of row groups, more than reading a small piece), while keeping every
# file's would hold a corpus of many files' metadata in memory.
_KEPT_FOOTERS = 8


@dataclass(frozen=True)
class CorpusFile:
    path: str
    kind: str  # "whole" | "jsonl" | "parquet"
    key: str  # path relative to the corpus root: stable when the corpus folder moves


def kind_of(path: str) -> str | None:
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".txt", ".text", ".md", ".py")):
        return "whole"
    return None


READABLE = ".txt, .text, .md, .py (a document per file), .jsonl or .parquet (a document per record)"


def _narrowed(entry: str, paths: list[str]) -> str:
    """A pattern for the entry's files of its most common readable kind: 'corpus/**/*.parquet'."""
    kinds = [os.path.splitext(p)[1].lower() for p in paths if kind_of(p) is not None]
    ext = max(sorted(set(kinds)), key=kinds.count) if kinds else ".jsonl"
    root = entry.rstrip("/")
    if glob.has_magic(root):  # the folder above the first part with a wildcard
        parts = root.split("/")
        root = "/".join(parts[:next(i for i, part in enumerate(parts) if glob.has_magic(part))]) or "."
    return f"{root}/**/*{ext}"


def _refuse_unsupported(paths: list[str], entry: str, what: str) -> None:
    """A folder or glob that also matches files this source cannot read is a mistake, not a filter; so is
    one that mixes record files (.jsonl, .parquet) with whole-file documents (a dataset folder's
    README.md would be trained on as a document)."""
    unsupported = sorted(p for p in paths if kind_of(p) is None)
    if unsupported:
        shown = ", ".join(os.path.basename(p) for p in unsupported[:5]) + (" ..." if len(unsupported) > 5 else "")
        if len(unsupported) == len(paths):  # nothing to narrow to: a pattern of a readable kind would match nothing
            raise UserError(
                f"{what}: {entry!r} holds no file this source reads: its {len(paths)} file(s) ({shown}) are not "
                f"{READABLE}. Fix: convert them to one of those kinds (decompress a compressed file, e.g. .jsonl.gz "
                "to .jsonl), or point paths at the files to train on"
            )
        raise UserError(
            f"{what}: {entry!r} also matches {len(unsupported)} file(s) that are not {READABLE} ({shown}); "
            f"narrow it to the files to train on, e.g. '{_narrowed(entry, paths)}'"
        )
    whole = sorted(p for p in paths if kind_of(p) == "whole")
    if whole and len(whole) < len(paths):
        shown = ", ".join(os.path.basename(p) for p in whole[:5]) + (" ..." if len(whole) > 5 else "")
        records = [p for p in paths if kind_of(p) != "whole"]
        raise UserError(
            f"{what}: {entry!r} matches record files (.jsonl, .parquet) and also {len(whole)} file(s) that would "
            f"each be trained on as one document ({shown}), such as a dataset's card. Fix: narrow it to the files "
            f"to train on, e.g. '{_narrowed(entry, records)}', or list both kinds as entries of their own"
        )


def expand_paths(entries: list[str], what: str) -> list[str]:
    """Files named by `entries` (files, folders searched recursively, or glob patterns), sorted."""
    if not entries:
        raise UserError(f"{what}: paths is empty; list files ({READABLE}), folders or globs")
    found: set[str] = set()
    for entry in entries:
        path = os.path.expanduser(entry)
        if glob.has_magic(path):
            # A folder the pattern matches is searched like a folder entry: 'corpus/*' is all of corpus.
            # A link whose target is gone is kept, so that reading it names it rather than passing over it.
            matches = sorted({os.path.abspath(f) for m in glob.glob(path, recursive=True)  # '**' repeats folders
                              for f in (_files_in(m, what) if os.path.isdir(m) else
                                        [m] if os.path.isfile(m) or _dangling_link(m) else _refuse_special(m, what))})
            if not matches:
                raise UserError(f"{what}: the pattern {entry!r} matches no file{read_from(entry)}; fix the pattern "
                                f"or the folder")
            _refuse_unsupported(matches, entry, what)
            found.update(matches)
        elif os.path.isdir(path):
            inside = _files_in(os.path.abspath(path), what)  # absolute and normalized as walked, not path by path
            if not inside:
                raise UserError(f"{what}: the folder {entry!r} holds no file; it should hold {READABLE} files")
            _refuse_unsupported(inside, entry, what)
            found.update(inside)
        elif os.path.isfile(path):
            if kind_of(path) is None:
                raise UserError(
                    f"{what}: {entry!r} is not a file this source reads ({READABLE}); convert it or remove it"
                )
            found.add(os.path.abspath(path))
        elif _dangling_link(path):
            raise UserError(f"{what}: {_dangling_link(path)}; fix the link or the path, or remove it")
        elif os.path.exists(path):
            _refuse_special(path, what)
        else:
            raise UserError(f"{what}: the path {entry!r} does not exist{read_from(entry)}; fix the path or remove it")
    return sorted(found)


def _dangling_link(path: str) -> str | None:
    """What is wrong with `path` when it is a symbolic link whose target is gone (a dataset cache's link to a
    deleted blob, say), else None: such a path is there, so 'does not exist' or 'No such file' misleads."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    return f"{path!r} is a link to {os.readlink(path)!r}, which does not exist"


def _files_in(folder: str, what: str) -> list[str]:
    """The files under `folder`, at any depth, hidden files and folders (.cache, .git) left out, as glob does;
    links to folders are not followed (as os.walk), links to gone files are kept (reading them names them). A
    named pipe, socket or device among them is refused: opening a pipe waits for a writer, forever."""
    found, pending = [], [folder]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:  # unreadable below the top: os.walk passes over it too; reading the files says more
            continue
        for entry in entries:  # the entry's type comes from the listing: no stat per file but for links
            if entry.name.startswith("."):
                continue
            kind = _kind_of_entry(entry)
            if kind == "folder":
                pending.append(entry.path)
            elif kind == "file" or _dangling_link(entry.path):
                found.append(entry.path)
            elif kind == "special":
                _refuse_special(entry.path, what)
    return found


def _kind_of_entry(entry: os.DirEntry) -> str:
    """'folder' (to walk), 'link to folder' (not followed, as os.walk), 'file', or 'special' (a pipe, a socket, a
    device, or a link to nothing)."""
    try:
        if entry.is_dir():
            return "link to folder" if entry.is_symlink() else "folder"
        return "file" if entry.is_file() else "special"
    except OSError:  # a link that cannot be followed (a loop, a folder it may not enter): kept, reading names it
        return "file"


_SPECIAL_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"))


def _refuse_special(path: str, what: str) -> NoReturn:
    """Refuse `path`, which exists but is neither a file nor a folder (reading a named pipe would wait forever)."""
    mode = os.stat(path).st_mode
    kind = next((name for test, name in _SPECIAL_KINDS if test(mode)), "not a regular file")
    raise UserError(f"{what}: {path!r} is {kind}, not a file of text to train on; remove it from the data folder "
                    f"or narrow the paths to the data files")


def corpus_files(paths: list[str]) -> list[CorpusFile]:
    """The files of `paths`, keyed by their path relative to the folder that holds them all. A path that is that
    folder and plain names below it (as expand_paths gives them) has the prefix cut off: relpath normalizes both
    paths again, seconds for 200,000 files."""
    root = os.path.commonpath(sorted({os.path.dirname(p) for p in paths}))
    prefix, absolute = root.rstrip(os.sep) + os.sep, os.path.isabs(root)

    def key(path: str) -> str:
        rest = path[len(prefix):]
        names = os.sep + rest  # plain names: no '.', '..' or empty one
        plain = absolute and path.startswith(prefix) and os.sep + "." not in names
        return rest if plain and os.sep * 2 not in names else os.path.relpath(path, root)

    return [CorpusFile(p, kind_of(p), key(p)) for p in paths]


_SCAN_CHUNK = 16 * 2**20
_LINE_PIECE = 1 << 20  # a .jsonl line is read and decoded this many bytes at a time
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _past_next_newline(f, end: int) -> bool:
    """Move `f` just past the next newline before `end`; False when there is none there. A range inside a long line
    (a record of hundreds of MB cut into 1 MiB ranges) then reads only itself, not the rest of the line: each of
    them read it whole, so the first batch of a corpus holding a 300 MB record took two minutes."""
    while (left := end - f.tell()) > 0:
        chunk = f.read(min(left, _SCAN_CHUNK))
        if not chunk:
            return False
        at = chunk.find(b"\n")
        if at >= 0:
            f.seek(at + 1 - len(chunk), os.SEEK_CUR)
            return True
    return False


def _without_mark(text: str, offset: int) -> str:
    """A file's first text without the byte-order mark some editors write first: no part of the JSON."""
    return text[1:] if offset == 0 and text.startswith("\ufeff") else text


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())  # Arrow's messages (thrift's) run over lines: the error stays one line


def _line_number(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


class FileCorpus:
    """Pieces and documents of a list of local files. Picklable; caches metadata per process."""

    def __init__(self, files: list[CorpusFile], text_field: str, validation_fraction: float, what: str,
                 invalid_utf8: str = "error", fix: str = ""):
        """invalid_utf8: "error" stops at bytes that are not UTF-8 (naming the file and the `fix`),
        "replace" reads them as U+FFFD."""
        self.files = files
        self.invalid_utf8, self.fix = invalid_utf8, fix
        self.text_field = text_field
        self.validation_fraction = validation_fraction
        self.what = what
        self._meta: list[tuple] | None = None
        self._sampled: str | None = None
        self._pieces: dict[tuple[int, str], list[tuple[int, int, int, int]]] = {}
        self._footers: dict[str, object] = {}  # path -> pyarrow FileMetaData, the newest last

    def __getstate__(self):
        return {**self.__dict__, "_footers": {}}  # parsed metadata is this process's cache, not the corpus

    # ----- metadata and pieces -------------------------------------------------------------
    def meta(self) -> list[tuple]:
        """Per file: ("whole"|"jsonl", byte size) or ("parquet", rows per row group)."""
        if self._meta is None:
            self._meta = [self._file_meta(f) for f in self.files]
        return self._meta

    def _file_meta(self, f: CorpusFile) -> tuple:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if f.kind != "parquet":
                return (f.kind, os.path.getsize(f.path))
            parquet = pq.ParquetFile(f.path)
            md, schema = parquet.metadata, parquet.schema_arrow
        except (OSError, ValueError, pa.ArrowException) as e:
            if _dangling_link(f.path):
                raise UserError(f"{self.what}: {_dangling_link(f.path)}; fix the link, or remove it "
                                f"({ANOTHER_STREAM})") from None
            raise UserError(
                f"{self.what}: cannot read {f.path} ({type(e).__name__}: {_one_line(e)}); replace it with a sound "
                f"copy, or remove it ({ANOTHER_STREAM})"
            ) from e
        names = schema.names  # the top-level columns (the Parquet schema's names are its leaves: a struct's fields)
        if self.text_field not in names:
            raise UserError(
                f"{self.what}: {f.path} has no column {self.text_field!r}; its columns are {names}; "
                "set text_field to the column holding the text"
            )
        kind = schema.field(self.text_field).type
        if not _is_text(kind.value_type if pa.types.is_dictionary(kind) else kind):
            raise UserError(
                f"{self.what}: {f.path}'s column {self.text_field!r} holds {kind}, not text; set text_field to a "
                f"string column (its columns: {', '.join(f'{n} ({schema.field(n).type})' for n in names)})"
            )
        return ("parquet", [md.row_group(g).num_rows for g in range(md.num_row_groups)])

    def pieces(self, split: str, num_shards: int) -> list[tuple[int, int, int, int]]:
        cached = self._pieces.get((num_shards, split))
        if cached is not None:
            return cached
        meta = self.meta()
        jsonl_bytes = sum(m[1] for m in meta if m[0] == "jsonl")
        target = PIECES_PER_SHARD * num_shards
        chunk = min(MAX_PIECE_BYTES, max(1, jsonl_bytes // target))
        rows = self.piece_rows(num_shards)
        out: list[tuple[int, int, int, int]] = []
        for i, (f, m) in enumerate(zip(self.files, meta)):
            if f.kind == "whole":
                if split_of(f.key, self.validation_fraction) == split:
                    out.append((i, 0, 0, 0))
            elif f.kind == "jsonl":
                out.extend((i, a, min(a + chunk, m[1]), 0) for a in range(0, m[1], chunk))
            else:
                for g, n in enumerate(m[1]):
                    out.extend((i, g, a, min(a + rows, n)) for a in range(0, n, rows))
        self._pieces[(num_shards, split)] = out
        return out

    def piece_rows(self, num_shards: int) -> int:
        """The rows of a parquet piece over num_shards logical shards (a row group's last piece may hold fewer)."""
        parquet_rows = sum(sum(m[1]) for m in self.meta() if m[0] == "parquet")
        return min(MAX_PIECE_ROWS, max(1, math.ceil(parquet_rows / (PIECES_PER_SHARD * num_shards))))

    def row_group_notes(self, num_shards: int) -> list[str]:
        """A parquet file whose row groups are far larger than a piece is decoded many times over: each piece
        decodes its row group from the start to its own rows (Parquet cannot start inside one), so a file written
        with one huge row group (pyarrow's default holds a million rows) feeds training at a fraction of the rate.
        Said once."""
        rows = self.piece_rows(num_shards)
        large = [(f, max(m[1])) for f, m in zip(self.files, self.meta()) if m[0] == "parquet" and m[1]
                 and max(m[1]) >= _NOTED_ROW_GROUP_FACTOR * max(rows, MAX_PIECE_ROWS)]
        if not large:
            return []
        f, most, others = _largest(large)
        return [f"{self.what}: {f.path}{others} has row groups of up to {most:,} rows, and a piece a logical shard "
                f"reads holds {rows:,}: each piece decodes its row group from the start to its own rows, so every "
                f"row is decoded about {math.ceil(most / rows / 2)} times per epoch and reading may not keep up with "
                f"training. Fix: rewrite the file with smaller row groups, e.g. pyarrow.parquet.write_table(table, "
                f"path, row_group_size={MAX_PIECE_ROWS})"]

    def whole_file_notes(self) -> list[str]:
        """A whole-file document (.txt, .md, ...) far larger than a document should be, such as a corpus kept in
        one .txt file: it is one document, read and tokenized whole by one logical shard. Said once."""
        large = [(f, m[1]) for f, m in zip(self.files, self.meta())
                 if m[0] == "whole" and m[1] >= _NOTED_WHOLE_FILE_BYTES]
        if not large:
            return []
        f, most, others = _largest(large)
        return [f"{self.what}: {f.path}{others} is one document of {most / 2**20:,.0f} MiB: one logical shard reads "
                f"it, and reads and tokenizes it whole (memory many times its size) at every epoch and again at every "
                f"resume. Fix: cut it into its documents, e.g. a .jsonl file with one {{\"text\": ...}} line per "
                f"document"]

    def shard_bytes(self, split: str, num_shards: int) -> list[float]:
        """Each logical shard's share of the corpus in bytes, from the files' metadata (nothing is read): a
        whole file's size, a .jsonl range's bytes, a parquet row range's share of its row group's bytes."""
        import pyarrow.parquet as pq

        sizes = [0.0] * num_shards
        groups: dict[int, list[int]] = {}  # parquet files' row-group byte sizes, read once per file
        for p, (i, a, b, c) in enumerate(self.pieces(split, num_shards)):
            f, m = self.files[i], self.meta()[i]
            if f.kind == "whole":
                size = m[1]
            elif f.kind == "jsonl":
                size = b - a
            else:
                if i not in groups:
                    md = pq.ParquetFile(f.path).metadata
                    groups[i] = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
                size = groups[i][a] * (c - b) / max(m[1][a], 1)
            sizes[p % num_shards] += size
        return sizes

    # ----- reading ---------------------------------------------------------------------------
    def _unreadable(self, path: str, error: OSError) -> UserError:
        if isinstance(error, FileNotFoundError):  # it was there when the corpus was listed
            return UserError(f"{self.what}: {path} is gone (it was there when the run started). Fix: restore it; a "
                             "corpus without it is another data stream, which a resume starts from its beginning "
                             "(checkpoint.data_mismatch = 'restart')")
        return UserError(f"{self.what}: cannot read {path} ({error}); fix its permissions, or remove it "
                         f"({ANOTHER_STREAM})")

    def _text_of(self, record, path: str, offset: int) -> str:
        if isinstance(record, dict) and isinstance(record.get(self.text_field), str):
            return self._unicode(record[self.text_field], path, offset)
        where = f"line {_line_number(path, offset)}"  # counted only on the error path
        if not isinstance(record, dict):
            raise UserError(f"{self.what}: {path} {where} is {_json_kind(record)}, not a JSON object. Fix: write each "
                            f"line as an object holding the text in {self.text_field!r}, as "
                            f"{json.dumps({self.text_field: 'the document'})}")
        if self.text_field not in record:
            raise UserError(
                f"{self.what}: {path} {where} has no field {self.text_field!r}; its fields are "
                f"{sorted(record)}; set text_field to the field holding the text"
            )
        text = record[self.text_field]
        if text is None:
            return ""
        if not isinstance(text, str):
            raise UserError(
                f"{self.what}: {path} {where}: field {self.text_field!r} is {_json_kind(text)}, not a string. "
                f"Fix: set text_field to the field holding the text, or write the text as a string there"
            )
        return text

    def _unicode(self, text: str, path: str, offset: int) -> str:
        """JSON may escape a lone surrogate ("\\ud800"), which is no Unicode text (UTF-8 cannot encode it): with
        invalid_utf8 = "error" it stops the data as a bad byte does; with "replace" it reads as U+FFFD, as such a
        byte does (the byte tokenizer made it "?", tiktoken and Hugging Face tokenizers U+FFFD)."""
        if text.isascii():
            return text
        found = _LONE_SURROGATE.search(text)
        if found is None:
            return text
        if self.invalid_utf8 != "error":
            return _LONE_SURROGATE.sub("\ufffd", text)
        raise UserError(f"{self.what}: {path} line {_line_number(path, offset)}: field {self.text_field!r} holds a "
                        f"lone surrogate (\\u{ord(found.group()):04x}, at character {found.start()}), which is not "
                        f"Unicode text. Fix: mend or remove that line{self.fix}")

    def _jsonl_texts(self, path: str, start: int, end: int):
        """Texts of the lines that start in [start, end), with their byte offsets."""
        try:
            f = open(path, "rb")
        except OSError as e:
            raise self._unreadable(path, e) from e
        with f:
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n" and not _past_next_newline(f, end):
                    return  # the line in progress belongs to the previous range, and runs through this one
            while True:
                offset = f.tell()
                if offset >= end:
                    return
                text = self._jsonl_line(f, path, offset)
                if text is None:
                    return
                if not text:  # a blank line
                    continue
                try:
                    record = json.loads(text)
                except ValueError as e:
                    raise UserError(
                        f"{self.what}: {path} line {_line_number(path, offset)} is not valid JSON ({e}); "
                        f"fix or remove that line (the file's size changes, so {ANOTHER_STREAM})"
                    ) from e
                del text  # the document alone is held while it is read, not the JSON it came from
                document = self._text_of(record, path, offset)
                del record
                yield document, offset

    def _jsonl_line(self, f, path: str, offset: int) -> str | None:
        """The text of the line of `f` at `offset` ('' when its bytes are all whitespace), None at the file's end. A
        long line is read and decoded a piece at a time: its bytes held whole beside its text (and the text beside
        the string JSON parses from it) took three times a 100 MB record's size."""
        data = f.readline(_LINE_PIECE)
        if len(data) < _LINE_PIECE or data.endswith(b"\n"):  # the whole line (the file's last may end without one)
            if not data or data.isspace():
                return "" if data else None
            return _without_mark(self._decode(data, path, offset), offset)
        decoder = codecs.getincrementaldecoder("utf-8")("strict" if self.invalid_utf8 == "error" else "replace")
        pieces, read, blank = [], 0, True
        while data:
            ended = data.endswith(b"\n")  # a newline cuts no character: the line's decoding ends there
            blank = blank and data.isspace()
            pieces.append(self._decode(data, path, offset + read, final=ended, decoder=decoder))
            read += len(data)
            data = b"" if ended else f.readline(_LINE_PIECE)
        if not ended:  # the file's last line, which may end in a character cut short
            pieces.append(self._decode(b"", path, offset + read, decoder=decoder))
        if blank:
            return ""
        pieces[0] = _without_mark(pieces[0], offset)  # read whole in the first piece, of at least 3 bytes
        return "".join(pieces)

    def _parquet_texts(self, path: str, group: int, start: int, end: int) -> list:
        import pyarrow as pa

        # A large row group is decoded in batches up to the piece's end, never past it (a whole row group, when
        # pyarrow wrote one of a million rows, is gigabytes). Parquet cannot start inside a row group, so the rows
        # before the piece are decoded too: row groups much larger than a piece are slow (row_group_notes says so).
        try:
            parquet = self._parquet_file(path)
            if parquet.metadata.row_group(group).num_rows <= _NOTED_ROW_GROUP_FACTOR * MAX_PIECE_ROWS:
                rows = parquet.read_row_group(group, columns=[self.text_field]).column(0).slice(start, end - start)
            else:
                rows = self._parquet_rows_in_batches(parquet, group, start, end)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise self._unreadable_group(path, group, e) from e
        return self._values(rows, path, group, start)

    def _unreadable_group(self, path: str, group: int, e: Exception) -> UserError:
        return UserError(f"{self.what}: cannot read row group {group} of {path} ({type(e).__name__}: {_one_line(e)}); "
                         f"replace it with a sound copy, or remove it ({ANOTHER_STREAM})")

    def _values(self, rows, path: str, group: int, start: int) -> list:
        """A text column's rows (from row `start` of the group) as Python strings, checked as training reads them."""
        try:
            values = rows.to_pylist()
        except UnicodeDecodeError:  # Arrow does not check that a string column holds UTF-8
            values = self._decode_rows(rows, path, group, start)
        for v in values:
            if v is not None and not isinstance(v, str):
                raise UserError(
                    f"{self.what}: {path} column {self.text_field!r} holds {type(v).__name__} values, not strings; "
                    "set text_field to a text column"
                )
        return values

    def _parquet_file(self, path: str):
        """The parquet file at `path`, opened with its footer parsed once for the last few files read (no handle
        is kept: a loader worker forked from this process opens its own)."""
        import pyarrow.parquet as pq

        footer = self._footers.pop(path, None)
        parquet = pq.ParquetFile(path, metadata=footer)
        self._footers[path] = parquet.metadata
        while len(self._footers) > _KEPT_FOOTERS:
            del self._footers[next(iter(self._footers))]
        return parquet

    def _parquet_rows_in_batches(self, parquet, group: int, start: int, end: int):
        """Rows [start, end) of a row group's text column, decoded a batch at a time up to `end`."""
        import pyarrow as pa

        parts, seen = [], 0
        for batch in parquet.iter_batches(batch_size=MAX_PIECE_ROWS, row_groups=[group], columns=[self.text_field]):
            low, high = max(start, seen), min(end, seen + batch.num_rows)
            if high > low:
                parts.append(batch.column(0).slice(low - seen, high - low))
            seen += batch.num_rows
            if seen >= end:
                break
        return pa.chunked_array(parts, type=parquet.schema_arrow.field(self.text_field).type)

    def _decode_rows(self, rows, path: str, group: int, start: int) -> list:
        """A parquet text column's rows decoded as invalid_utf8 says, a bad row named with its place."""
        import pyarrow as pa

        if pa.types.is_dictionary(rows.type):
            rows = rows.cast(rows.type.value_type)
        errors = "strict" if self.invalid_utf8 == "error" else "replace"
        values = []
        for row, raw in enumerate(rows.cast(pa.large_binary()).to_pylist(), start):
            try:
                values.append(None if raw is None else raw.decode("utf-8", errors))
            except UnicodeDecodeError as e:
                raise UserError(f"{self.what}: {path} is not UTF-8 text (row {row} of row group {group}, column "
                                f"{self.text_field!r}, byte {e.start}: {e.reason}). Fix: convert it to UTF-8 or "
                                f"remove it{self.fix}") from None
        return values

    def _decode(self, data: bytes, path: str, offset: int = 0, final: bool = True, decoder=None) -> str:
        """UTF-8 text of bytes read from `path` at `offset`, as invalid_utf8 says; final=False: the bytes
        stop at a read limit, so a character cut there is not an error. `decoder`: the one that decoded the bytes
        before `offset`, holding a character they cut."""
        if decoder is None:
            decoder = codecs.getincrementaldecoder("utf-8")("strict" if self.invalid_utf8 == "error" else "replace")
        held = len(decoder.getstate()[0])
        try:
            return decoder.decode(data, final=final)
        except UnicodeDecodeError as e:
            at = offset - held + e.start
            raise UserError(f"{self.what}: {path} is not UTF-8 text (byte {at} of the file, line "
                            f"{_line_number(path, at)}: {e.reason}). Fix: convert it to UTF-8 or "
                            f"remove it{self.fix}") from None

    def scan(self) -> tuple[int, int]:
        """Read every record once, as training will: whole files decoded (in chunks), every .jsonl line
        decoded, parsed and its text field checked, every parquet row group's text column read. Damage
        deep in a corpus (a bad byte, a cut last line, a broken row group) is then found before a long
        run, with training's own message (check() reads only the start). Returns (the files' bytes,
        records read)."""
        total, records = 0, 0
        for f, m in zip(self.files, self.meta()):
            if f.kind == "whole":
                self._scan_whole(f.path)
                total, records = total + m[1], records + 1
            elif f.kind == "jsonl":
                records += sum(1 for _ in self._jsonl_texts(f.path, 0, m[1]))
                total += m[1]
            else:
                records += sum(self._scan_parquet_group(f.path, g, n) for g, n in enumerate(m[1]))
                total += os.path.getsize(f.path)
        return total, records

    def _scan_parquet_group(self, path: str, group: int, rows: int) -> int:
        """Check a row group's text column as training reads it, a batch at a time when it is large (read whole, it
        was held as Arrow and as Python strings at once: 1.5 GB for a row group of 500 MB). Returns its rows."""
        import pyarrow as pa

        if rows <= _NOTED_ROW_GROUP_FACTOR * MAX_PIECE_ROWS:
            return len(self._parquet_texts(path, group, 0, rows))
        seen = 0
        try:
            batches = self._parquet_file(path).iter_batches(batch_size=MAX_PIECE_ROWS, row_groups=[group],
                                                            columns=[self.text_field])
            for batch in batches:
                self._values(batch.column(0), path, group, seen)
                seen += batch.num_rows
        except (OSError, ValueError, pa.ArrowException) as e:
            raise self._unreadable_group(path, group, e) from e
        return seen

    def _scan_whole(self, path: str) -> None:
        """Decode one whole-file document in chunks (a bad byte is named with its place)."""
        if self.invalid_utf8 != "error":
            return  # replaced as read: nothing can fail
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset = 0
        try:
            with open(path, "rb") as fh:
                while chunk := fh.read(_SCAN_CHUNK):
                    pending = decoder.getstate()[0]  # a character cut by the last chunk's end
                    try:
                        decoder.decode(chunk)
                    except UnicodeDecodeError:  # decoded again from a character start: the message's place
                        self._decode(pending + chunk, path, offset - len(pending))
                    offset += len(chunk)
                pending = decoder.getstate()[0]
                self._decode(pending, path, offset - len(pending))  # a character cut by the file's end
        except OSError as e:
            raise self._unreadable(path, e) from e

    def _read_whole(self, path: str, limit: int = -1) -> str:
        try:
            with open(path, "rb") as fh:
                data = fh.read(limit)
        except OSError as e:
            raise self._unreadable(path, e) from e
        text = self._decode(data, path, final=not 0 < limit <= len(data))
        text = text[1:] if text.startswith("\ufeff") else text  # a byte-order mark some editors write: not text
        return text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as text-mode reading gave them

    def read_piece(self, piece: tuple[int, int, int, int], split: str) -> list[str]:
        """The non-empty documents of `split` in one piece, in file order."""
        i, a, b, c = piece
        f = self.files[i]
        if f.kind == "whole":
            text = self._read_whole(f.path)
            return [text] if text else []
        if f.kind == "jsonl":
            texts = [t for t, _ in self._jsonl_texts(f.path, a, b)]
        else:
            texts = [t for t in self._parquet_texts(f.path, a, b, c) if t]
        return [t for t in texts if t and split_of(t, self.validation_fraction) == split]

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        owned = self.pieces(split, num_shards)[shard::num_shards]
        order = order_rng(seed, shard, epoch).permutation(len(owned))
        piece_pos, doc_pos = (0, 0) if cursor is None else (int(cursor[0]), int(cursor[1]))
        for position in range(piece_pos, len(order)):
            piece_index = int(order[position])
            docs = self.read_piece(owned[piece_index], split)
            inner = order_rng(seed, shard, epoch, piece_index + 1).permutation(len(docs))
            first = doc_pos if position == piece_pos else 0
            for j in range(first, len(docs)):
                yield _taken(docs, int(inner[j])), [position, j + 1]

    # ----- checks -----------------------------------------------------------------------------
    def check(self) -> None:
        """Metadata of every file, then records in order until one non-empty document is seen."""
        meta = self.meta()
        budget = _CHECK_RECORD_BUDGET
        for f, m in zip(self.files, meta):
            if budget <= 0:
                return
            if f.kind == "whole":
                if m[1] > 0 and self._read_whole(f.path, 4096):
                    return
                budget -= 1
            elif f.kind == "jsonl":
                for text, _ in self._jsonl_texts(f.path, 0, m[1]):
                    if text:
                        return
                    budget -= 1
                    if budget <= 0:
                        return
            else:
                for g, n in enumerate(m[1]):
                    take = min(n, budget)
                    if take and any(self._parquet_texts(f.path, g, 0, take)):
                        return
                    budget -= take
                    if budget <= 0:
                        return
        raise UserError(
            f"{self.what}: the files hold no text (every document is empty), so the data yields no tokens; "
            "point paths at non-empty files"
        )

    def fingerprint(self) -> str:
        """Names and shapes (byte sizes, parquet row groups): pieces depend on both, so a saved position
        must never be applied to a corpus whose files grew, shrank or were cut otherwise. Contents are not read
        here: sampled_fingerprint() tells a file rewritten to the same size (or parquet row-group sizes) apart."""
        return listing_digest([f.key for f in self.files], self.meta())

    def sampled_fingerprint(self) -> str:
        """The files' first and last bytes (sampled_bytes_digest), which fingerprint() does not read."""
        if self._sampled is None:
            self._sampled = sampled_bytes_digest([f.path for f in self.files], self._unreadable)
        return self._sampled


def listing_digest(keys: list[str], shapes: list) -> str:
    """A list of files named by their keys (paths relative to the corpus root, so a moved corpus keeps it) and
    shapes (sizes), in the order they are read: another file, one fewer, a rename or a resize changes it."""
    return f"{len(keys)} files {digest(chr(10).join(f'{k} {m}' for k, m in zip(keys, shapes)))}"


def sampled_bytes_digest(paths: list[str], unreadable) -> str:
    """A digest of each file's first and last _SAMPLED_BYTES; unreadable(path, OSError) is the error to raise.
    Read with plain system calls, and the tail only of a file longer than its head: a corpus of 200,000 small files
    is read at every start, and a buffered file object per file took twice as long."""
    found = hashlib.blake2b(digest_size=8)
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                head = _read_at(fd, 0)
                tail = b""  # a file shorter than the sample is all in its head
                if len(head) == _SAMPLED_BYTES:
                    tail = _read_at(fd, max(len(head), os.fstat(fd).st_size - _SAMPLED_BYTES))
            finally:
                os.close(fd)
        except OSError as e:
            raise unreadable(path, e) from e
        found.update(b"%d %d\n" % (len(head), len(tail)) + head + tail)
    return found.hexdigest()


def _read_at(fd: int, offset: int) -> bytes:
    """Up to _SAMPLED_BYTES of the file from `offset`, fewer only at its end (a read may return less)."""
    data = b""
    while len(data) < _SAMPLED_BYTES:
        more = os.pread(fd, _SAMPLED_BYTES - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _taken(docs: list, k: int):
    """docs[k], no longer held by the list: once the loader has tokenized a document its text is freed, where the
    reader would keep it beside its tokens (a whole-file document of a gigabyte, as long as its windows last)."""
    document, docs[k] = docs[k], None
    return document


def member_documents(corpus: FileCorpus, split: str) -> list[str]:
    """Every document of `split`, read piece by piece (for tests and inspection; reads everything)."""
    return [d for piece in corpus.pieces(split, 1) for d in corpus.read_piece(piece, split)]


def _json_kind(value) -> str:
    """A parsed JSON value's kind as JSON names it: 'an array', 'a number', ..."""
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
             dict: "an object"}
    return "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")


def _is_text(kind) -> bool:
    """An Arrow type whose values read as Python strings (or an all-null column)."""
    import pyarrow as pa

    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
            or getattr(pa.types, "is_string_view", lambda _: False)(kind))


def _largest(found: list[tuple[CorpusFile, int]]) -> tuple[CorpusFile, int, str]:
    """The (file, size) of the largest, its size, and ' (and N more file(s))' naming the others for a note."""
    f, most = max(found, key=lambda pair: pair[1])
    return f, most, f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
