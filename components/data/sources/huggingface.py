"""A Hugging Face dataset, streamed: datasets.load_dataset(..., streaming=True).

Logical shard s of S reads only its own data sources (files or parquet row groups):
  - when the dataset has a multiple of S sources: datasets.distributed.split_dataset_by_node(ds, s, S);
  - else, after splitting parquet files into row groups (IterableDataset.reshard, where available),
    when there are at least S sources: ds.shard(S, s, contiguous=False) (uneven but disjoint);
  - else every shard reads the whole stream and keeps one example in S (split_dataset_by_node's
    example strategy), which multiplies reading by S: a warning says so.
Order: the shard's stream is read in chunks of `shuffle_buffer` documents, and each chunk is shuffled
by a generator seeded by (seed, shard, epoch, chunk). The cursor holds the chunk's number, the
stream's position where the chunk starts (datasets' own state_dict, with the datasets version that
wrote it) and how many of its documents were yielded. A resume opens the stream at that position:
the data sources before it are not read; its own source (a parquet file, or a row group when files
were split) is read from its start up to the position, skipped without being decoded into texts;
then at most one chunk is read again. So a resume costs at most one data source and one chunk,
wherever it stopped in the epoch.
Cursors saved before chunks (a count of documents, from a shuffle buffer) still resume: they replay
the stream up to that count in the old order, until the epoch ends.
Validation: `validation_split` names a split of the dataset; when empty, a document is validation
iff unit_hash(its text) < validation_fraction.
Streaming over a network fails now and then; a read that fails is retried (read_retries times, with
growing pauses) by reopening the shard's stream at the last cursor, so the documents are the same as
without the failure. A builder over local files is not retried: its failure is a damaged file.
"""

from __future__ import annotations

import glob
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass, field

from components.data.workers import worker_died
from components.errors import UserError, first_line, read_from
from components.data.sources.base import ANOTHER_STREAM, order_rng, split_of
from components.data.sources.file_corpus import corpus_files, listing_digest, sampled_bytes_digest
from components.problems import Problem, problem, raise_problems

log = logging.getLogger(__name__)
_READ_BATCH = 64
_CHECKED_RECORDS = 10_000  # check() looks this far for a text: a stream of nulls is not read to its end
_LOCAL_BUILDERS = ("parquet", "json", "csv", "text", "arrow")


@dataclass
class HuggingFaceArgs:
    """A dataset on the Hugging Face Hub (or a local builder such as path='parquet' + data_files)."""

    path: str = field(
        default="HuggingFaceFW/fineweb-edu",
        metadata={"doc": "dataset id on the Hub, or a builder name such as 'parquet' with data_files",
                  "path": lambda args, folder: _names_local_folder(args.path, folder)},
    )
    name: str = field(default="sample-10BT", metadata={"doc": "dataset configuration name ('' for none)"})
    split: str = field(default="train", metadata={"doc": "the dataset split to train on"})
    validation_split: str = field(
        default="",
        metadata={"doc": "dataset split to validate on; '' holds out validation_fraction of `split` by hash",
                  "held_out": "split"},
    )
    validation_fraction: float = field(
        default=0.001,
        metadata={"doc": "share of `split` held out for validation when validation_split is ''", "ge": 0.0, "le": 0.5,
                  "held_out": "share"},
    )
    text_field: str = field(default="text", metadata={"doc": "the column holding each document's text"})
    data_files: list[str] = field(
        default_factory=list, metadata={"doc": "data files for builders such as 'parquet' (globs allowed)",
                                        # a Hub dataset's or a local folder's data_files name files inside it
                                        "path": lambda args, folder: args.path in _LOCAL_BUILDERS}
    )
    shuffle_buffer: int = field(
        default=512,
        metadata={"doc": "documents shuffled together: each logical shard reads its stream in chunks of this many "
                         "and shuffles each chunk (0 or 1: keep order); a resume re-reads at most one chunk", "ge": 0},
    )
    read_retries: int = field(
        default=6,
        metadata={"doc": "times a failed read of a remote stream is retried (pauses 2, 4, ... 60 s) before the run "
                         "stops", "ge": 0},
    )

    def check(self) -> list[Problem]:
        problems = []
        if self.validation_split and self.validation_split == self.split:
            problems.append(problem(
                "validation_split", self.validation_split,
                f"equals split {self.split!r}, so validation would repeat training data",
                "name another split or leave it '' to hold out validation_fraction by hash"))
        if self.path in _LOCAL_BUILDERS and not self.data_files:
            problems.append(problem("data_files", None, f"builder {self.path!r} needs data_files",
                                    "list the local files as paths or globs"))
        return problems

    def notes(self) -> list[str]:
        """A configuration name given to a local builder: datasets reads the same rows whatever it is. Said, not
        refused: it is the default's (a Hub dataset's), and runs saved with it keep it in their stream's id."""
        if self.path in _LOCAL_BUILDERS and self.name:
            return [f"name = {self.name!r} is not used: the local builder {self.path!r} has no configurations "
                    f"(a new run may set name = '')"]
        return []


def _names_local_folder(path: str, folder: str) -> bool:
    """Whether `path` names a dataset folder in `folder` (datasets reads one before asking the Hub), not a builder."""
    return path not in _LOCAL_BUILDERS and os.path.isdir(os.path.join(folder, os.path.expanduser(path)))


def _file_stamps(paths: list[str]) -> tuple:
    """(path, size, modification time) of each path, at one stat each: another list, or a file written again,
    gives other stamps. A path that cannot be looked at has none (its reader names the error)."""
    stamps = []
    for path in paths:
        try:
            found = os.stat(path)
            stamps.append((path, found.st_size, found.st_mtime_ns))
        except OSError:
            stamps.append((path, None, None))
    return tuple(stamps)


def buffered_shuffle(items, size: int, rng):
    """Stream shuffle: hold `size` items, emit a random one as each new item arrives."""
    buffer = []
    for item in items:
        if len(buffer) < size:
            buffer.append(item)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


class _ReadFailed(Exception):
    """A read of the stream failed in a way another attempt may not repeat (network, remote files)."""


class HuggingFaceSource:
    def __init__(self, args: HuggingFaceArgs | None = None):
        self.args = args or HuggingFaceArgs()
        self._loaded: dict[str, object] = {}
        self._null_heads: dict[str, int] = {}  # split -> records check() found only nulls in, as far as it looked
        self._files: tuple[tuple, str] | None = None  # (_file_stamps of _listed_files, files_fingerprint) last found

    def __getstate__(self):
        # Workers started by fork inherit the loaded streams; other start methods reload them.
        return {"args": self.args, "_loaded": {}, "_null_heads": dict(self._null_heads), "_files": None}

    def has_split(self, split: str) -> bool:
        return split == "train" or bool(self.args.validation_split) or self.args.validation_fraction > 0

    def _what(self) -> str:
        return f"data source huggingface ({self.args.path}{'/' + self.args.name if self.args.name else ''})"

    def _hf_split(self, split: str) -> str:
        return self.args.validation_split if split == "validation" and self.args.validation_split else self.args.split

    def _load(self, hf_split: str):
        if hf_split not in self._loaded:
            import datasets

            a = self.args
            counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
            try:
                # A builder over local files pings the Hub's download counter (a 3 s timeout offline) at every load.
                datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts and a.path not in _LOCAL_BUILDERS
                ds = datasets.load_dataset(
                    a.path, a.name or None, split=hf_split, streaming=True, data_files=list(a.data_files) or None
                )
            except Exception as e:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
                if worker_died(e):  # another process's death, raised in this frame: not this load's failure
                    raise
                why = first_line(e)
                named = self._local_file_problem()
                if named:  # an empty or unreadable file: datasets' own words ('StopIteration') do not name it
                    raise UserError(f"{self._what()}: cannot open split {hf_split!r}: {named}") from e
                if a.path in _LOCAL_BUILDERS:  # local files: no network involved; a list of data_files is one split
                    fix = ("check data_files; a list of files is the one split 'train' (set split = 'train', and "
                           "hold validation documents out with validation_fraction and validation_split = '')")
                elif os.path.isdir(a.path):  # a local folder, not a Hub id: no network involved either
                    fix = ("a folder that datasets' save_to_disk wrote streams only as files: write its split once "
                           "as parquet (datasets.load_from_disk(FOLDER)['train'].to_parquet('data/train.parquet')) and "
                           "use path = 'parquet' with data_files = ['data/*.parquet']")
                else:
                    fix = ("without network, download the parquet files once and use data source text_files with "
                           "paths = ['<folder>/*.parquet'] (or huggingface with path = 'parquet' and data_files)")
                raise UserError(f"{self._what()}: cannot open split {hf_split!r} ({type(e).__name__}: {why}). "
                                f"Fix: {fix}") from e
            finally:
                datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
            self._loaded[hf_split] = ds
        return self._loaded[hf_split]

    def _resharded(self, num_shards: int, hf_split: str):
        """The split's stream, split into one source per parquet row group when its files do not divide."""
        key = f"{hf_split}/resharded-for-{num_shards}"
        if key not in self._loaded:
            base = self._load(hf_split)
            if base.num_shards % num_shards and hasattr(base, "reshard"):
                try:
                    base = base.reshard()  # parquet: one source per row group (each file's footer is read)
                except Exception as e:
                    if worker_died(e):
                        raise
                    raise self._read_error(e) from e
            self._loaded[key] = base
        return self._loaded[key]

    def _shard_dataset(self, shard: int, num_shards: int, hf_split: str):
        from datasets.distributed import split_dataset_by_node

        base = self._resharded(num_shards, hf_split)
        if base.num_shards % num_shards and base.num_shards >= num_shards:
            return base.shard(num_shards=num_shards, index=shard, contiguous=False)
        # Divisible: whole sources per shard. Fewer sources than shards: every shard reads the whole stream and
        # keeps one example in num_shards (shard_notes says so once).
        return split_dataset_by_node(base, rank=shard, world_size=num_shards)

    def shard_notes(self, num_shards: int) -> list[str]:
        splits = [self.args.split] + ([self.args.validation_split] if self.args.validation_split else [])
        notes = [f"{self._what()}: field {self.args.text_field!r} is null in the first {records:,} records of split "
                 f"{hf_split!r}, as far as the check looks; reading on (null texts are skipped). If that column is "
                 f"not the text, stop the run and set text_field to the one holding it"
                 for hf_split, records in self._null_heads.items()]
        for hf_split in dict.fromkeys(splits):
            sources = self._resharded(num_shards, hf_split).num_shards
            if sources < num_shards:
                notes.append(f"{self._what()}, split {hf_split!r}, has {sources} data source(s), fewer than "
                             f"data.logical_shards = {num_shards}: every logical shard reads the whole stream and "
                             f"keeps one document in {num_shards}. Use text_files over local parquet files, or "
                             f"fewer logical shards, to read each file once")
        return notes

    def _texts(self, dataset, resumed: bool = False):
        field_name = self.args.text_field
        first = True
        try:
            for batch in dataset.iter(batch_size=_READ_BATCH):
                first = False
                if field_name not in batch:
                    raise UserError(
                        f"{self._what()}: no field {field_name!r}; the fields are {sorted(batch)}; "
                        "set text_field to the one holding the text"
                    )
                yield batch[field_name]
        except UserError:
            raise
        except Exception as e:  # network and decoding failures surface here during streaming
            if worker_died(e):  # another process's death, raised in this frame: not this stream's failure
                raise
            if (first and resumed and isinstance(e, (KeyError, TypeError, IndexError, AttributeError))
                    and not type(e).__module__.startswith("pyarrow")):  # pyarrow's errors are about the data read
                # datasets applies a loaded position at the first read: these mean the position does not fit
                raise UserError(f"{self._what()}: the saved position in the stream does not fit this dataset "
                                f"({type(e).__name__}: {e}); was the checkpoint written for other data files? Fix: "
                                "resume with the files that wrote it") from e
            if self._reads_local_files():  # no network to wait for: another attempt reads the same bytes
                raise self._read_error(e) from e
            raise _ReadFailed(f"{type(e).__name__}: {e}") from e

    def _read_error(self, e: Exception) -> Exception:
        """A failed read of local files (the same bytes at every attempt) as the user's error, naming the file
        when one is empty or unreadable; a remote stream's failure as one to retry."""
        if not self._reads_local_files():
            return _ReadFailed(f"{type(e).__name__}: {first_line(e)}")
        named = self._local_file_problem()
        if named:
            return UserError(f"{self._what()}: reading the data files failed: {named}")
        return UserError(
            f"{self._what()}: reading the data files failed ({type(e).__name__}: {first_line(e)}), so one of them "
            f"(data_files = {list(self.args.data_files)}) is damaged, unreadable, or not of builder "
            f"{self.args.path!r}'s format (or not the others' columns). Fix: find it "
            "(pyarrow.parquet.read_table(path) names a damaged parquet file) and replace it with a sound copy, then "
            "run again: training resumes from the last checkpoint; or remove it from data_files (a glob: list the "
            f"others; {ANOTHER_STREAM})")

    def _local_file_problem(self) -> str | None:
        """The first local data file that is empty or (parquet) not readable, with its fix; None when each opens."""
        if self.args.path not in _LOCAL_BUILDERS:
            return None
        for pattern in self.args.data_files:
            if "://" in pattern:
                continue
            for path in sorted(glob.glob(os.path.expanduser(pattern), recursive=True)):
                fix = ("Fix: remove it from data_files (a glob: list the other files instead), then run again; "
                       f"{ANOTHER_STREAM}")
                try:
                    if os.path.getsize(path) == 0:
                        return f"{path} is empty. {fix}"
                    if self.args.path == "parquet":
                        import pyarrow.parquet as pq

                        if pq.ParquetFile(path).metadata.num_rows == 0:
                            return f"{path} holds no rows, which datasets' parquet reader cannot stream. {fix}"
                except Exception as e:  # pyarrow's ArrowInvalid, OSError: the file named is the news
                    return f"{path} cannot be read as {self.args.path} ({type(e).__name__}: {first_line(e)}). {fix}"
        return None

    def _reads_local_files(self) -> bool:
        """A builder over files on this machine (path 'parquet' and local data_files), not a remote stream."""
        return self.args.path in _LOCAL_BUILDERS and not any("://" in f for f in self.args.data_files)

    def check(self) -> None:
        raise_problems(self._what(), self.args.check())
        # A builder's local pattern that matches nothing: datasets says only StopIteration. (With a Hub dataset
        # as path, data_files name files of its repository.)
        a = self.args
        for pattern in a.data_files if a.path in _LOCAL_BUILDERS else ():
            if "://" not in pattern and not glob.glob(os.path.expanduser(pattern), recursive=True):
                raise UserError(f"{self._what()}: data_files pattern {pattern!r} matches no file{read_from(pattern)}. "
                                f"Fix: give paths or globs of existing files")
        splits = [self.args.split] + ([self.args.validation_split] if self.args.validation_split else [])
        for hf_split in splits:
            records, first = 0, None
            try:
                for batch in self._texts(self._load(hf_split)):  # to the first text, within _CHECKED_RECORDS
                    records += len(batch)
                    first = next((t for t in batch if t is not None), None)
                    if first is not None or records >= _CHECKED_RECORDS:
                        break
            except _ReadFailed as e:
                raise UserError(f"{self._what()}: reading split {hf_split!r} failed ({e})") from e
            if first is None:
                if not records:
                    raise UserError(f"{self._what()}: split {hf_split!r} has no records, so it yields no tokens")
                if records >= _CHECKED_RECORDS:  # texts may follow: reading skips nulls, and shard_notes says it
                    self._null_heads[hf_split] = records
                    continue
                raise UserError(f"{self._what()}: field {self.args.text_field!r} is null in all {records:,} "
                                f"records of split {hf_split!r}. Fix: set text_field to the column holding the text")
            if not isinstance(first, str):
                raise UserError(
                    f"{self._what()}: field {self.args.text_field!r} holds {type(first).__name__} values, not text; "
                    "set text_field to a text column"
                )

    def fingerprint(self) -> str:
        a = self.args
        return (
            f"huggingface({a.path},{a.name},{a.split},{a.validation_split},{a.validation_fraction},"
            f"{a.text_field},{sorted(a.data_files)},buffer={a.shuffle_buffer})"
        )

    def files_fingerprint(self) -> str:
        """The datasets version, whose stream positions are its own (another version's are refused before any is
        read, so that checkpoint.data_mismatch = 'restart' can start the data afresh), and the local files the stream
        reads, in datasets' order, with their sizes and sampled bytes: a saved position belongs to those files, which
        the patterns or the folder's name alone do not name (a file moved into or out of a glob's folder, or
        rewritten). Found again only when the files as listed cheaply have changed: every loader built (training,
        the held-out set, the probe, resume checks) asks it, and datasets' resolution alone takes seconds over
        thousands of files."""
        stamps = _file_stamps(self._listed_files())
        if self._files is None or self._files[0] != stamps:
            self._files = (stamps, self._found_files_fingerprint())
        return self._files[1]

    def _listed_files(self) -> list[str]:
        """The local files (and folders) the patterns match and the dataset folder holds, as glob lists them: what
        datasets resolves the stream's files from, so any change to them changes their _file_stamps."""
        a = self.args
        patterns = [os.path.expanduser(p) for p in a.data_files if "://" not in p]
        if os.path.isdir(a.path):
            patterns = [os.path.join(a.path, "**"), *(os.path.join(a.path, p) for p in patterns)]
        return [path for pattern in patterns for path in sorted(glob.glob(pattern, recursive=True))]

    def _found_files_fingerprint(self) -> str:
        import datasets

        version = f"datasets {datasets.__version__}"
        paths = self._local_files()
        if not paths:
            return version
        try:
            sizes = [os.path.getsize(p) for p in paths]
        except OSError as e:
            raise self._unreadable(e.filename or str(paths), e) from e
        listing = listing_digest([f.key for f in corpus_files(paths)], sizes)
        return f"{version},{listing},{sampled_bytes_digest(paths, self._unreadable)}"

    def _local_files(self) -> list[str]:
        """The local files the stream reads (every split's), as datasets resolves them; [] for a remote stream."""
        a = self.args
        try:
            if self._reads_local_files():  # datasets' own resolution: its order, its hidden-file rule
                from datasets.data_files import DataFilesList

                return [str(p) for p in DataFilesList.from_patterns(list(a.data_files))]
            if os.path.isdir(a.path):  # a dataset folder: the files datasets takes from it (its card's or its layout)
                import datasets

                found = datasets.load_dataset_builder(a.path, a.name or None, data_files=list(a.data_files) or None)
                return [str(p) for split in (found.config.data_files or {}).values() for p in split if "://" not in p]
        except Exception as e:  # datasets raises many types; the load before this one read the same files
            if worker_died(e):
                raise
            raise UserError(f"{self._what()}: cannot list the data files ({type(e).__name__}: {first_line(e)}). Fix: "
                            "give paths or globs of existing files in data_files") from e
        return []

    def _unreadable(self, path: str, error: OSError) -> UserError:
        return UserError(f"{self._what()}: cannot read {path} ({error}). Fix: restore it or its permissions; or "
                         f"remove it from data_files or the dataset's folder ({ANOTHER_STREAM})")

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        failures = yielded = 0
        while True:
            try:
                # Only the first opening takes a position from a checkpoint; a retry's is one this run read.
                saved = failures == 0 and yielded == 0
                for text, cursor in self._documents_once(shard, num_shards, split, seed, epoch, cursor, saved):
                    failures, yielded = 0, yielded + 1
                    yield text, cursor
                return
            except _ReadFailed as e:
                failures += 1
                if failures > self.args.read_retries:
                    raise UserError(
                        f"{self._what()}: reading logical shard {shard} failed {failures} times in a row ({e}). "
                        "Fix: check the network and the dataset, then run again: training resumes from the "
                        "last checkpoint. Offline, use data source text_files over downloaded parquet files"
                    ) from e
                pause = min(60, 2**failures)
                log.warning("%s: reading logical shard %d failed (%s); retry %d of %d in %d s, after document %d",
                            self._what(), shard, e, failures, self.args.read_retries, pause, yielded)
                time.sleep(pause)

    def _documents_once(self, shard, num_shards, split, seed, epoch, cursor, saved: bool = True):
        if isinstance(cursor, int):
            yield from self._replayed_documents(shard, num_shards, split, seed, epoch, cursor)
            return
        chunk_no, state, skip, done = cursor if cursor is not None else (0, None, 0, 0)
        dataset = self._shard_dataset(shard, num_shards, self._hf_split(split))
        if state is not None:
            self._load_position(dataset, state, shard)
        addressed = self._addressed(self._kept_batches(dataset, split, resumed=saved and state is not None), state,
                                    skip)
        size = max(1, self.args.shuffle_buffer)
        while chunk := list(itertools.islice(addressed, size)):
            (_, start, _), (_, _, after) = chunk[0], chunk[-1]
            order = order_rng(seed, shard, epoch, chunk_no).permutation(len(chunk)) if size > 1 else range(len(chunk))
            for j in range(done, len(chunk)):
                # After a chunk's last document the cursor names the next chunk: a resume there reads nothing again.
                cursor_after = [chunk_no, *start, j + 1] if j + 1 < len(chunk) else [chunk_no + 1, *after, 0]
                yield chunk[order[j]][0], cursor_after
            chunk_no, done = chunk_no + 1, 0

    @staticmethod
    def _addressed(batches, state, skip):
        """(text, its address, the next text's address); an address is (the stream's state before the text's
        batch, the text's index among the batch's kept texts), which a resume can open."""
        for texts, after in batches:
            for i in range(skip, len(texts)):
                yield texts[i], (state, i), ((state, i + 1) if i + 1 < len(texts) else (after, 0))
            state, skip = after, 0

    def _kept_batches(self, dataset, split, resumed: bool = False):
        """(the texts of one read batch that belong to `split`, the stream's position after it as JSON)."""
        import datasets

        for texts in self._texts(dataset, resumed):
            kept = [t for t in texts if t]  # a null or empty text is no document
            odd = next((t for t in kept if not isinstance(t, str)), None)
            if odd is not None:
                raise UserError(f"{self._what()}: field {self.args.text_field!r} holds a value of type "
                                f"{type(odd).__name__} ({repr(odd)[:60]}) among its texts. Fix: give text_field a "
                                f"column of strings (nulls are skipped), or convert that column's values to text")
            if not self.args.validation_split:
                kept = [t for t in kept if split_of(t, self.args.validation_fraction) == split]
            yield kept, json.dumps({"datasets": datasets.__version__, "stream": dataset.state_dict()})

    def _load_position(self, dataset, state: str, shard: int) -> None:
        """Open `dataset` at a saved position (JSON): one from another datasets version may mean another place
        (its state's layout is the library's own), so it is refused rather than trusted."""
        import datasets

        try:
            saved = json.loads(state)
        except (TypeError, ValueError):
            saved = None
        if not isinstance(saved, dict) or not isinstance(saved.get("stream"), dict):
            raise UserError(f"{self._what()}: logical shard {shard}'s saved position in the stream is not one this "
                            "version writes. Fix: resume with the version of nsa_titan that wrote the checkpoint")
        if saved.get("datasets") != datasets.__version__:
            raise UserError(
                f"{self._what()}: logical shard {shard}'s position in the stream was saved by datasets "
                f"{saved.get('datasets')}, and this is datasets {datasets.__version__}, whose stream positions may "
                f"differ. Fix: pip install datasets=={saved.get('datasets')} to resume exactly (upgrade once the "
                "run is done)"
            )
        dataset.load_state_dict(saved["stream"])

    def _replayed_documents(self, shard, num_shards, split, seed, epoch, count):
        """The order of cursors saved before chunks: a shuffle buffer, resumed by replaying `count` documents."""
        dataset = self._shard_dataset(shard, num_shards, self._hf_split(split))
        texts = (t for batch, _ in self._kept_batches(dataset, split) for t in batch)
        if self.args.shuffle_buffer > 1:
            texts = buffered_shuffle(texts, self.args.shuffle_buffer, order_rng(seed, shard, epoch))
        for position, text in enumerate(texts):
            if position >= count:
                yield text, position + 1


def build_huggingface_source(args: HuggingFaceArgs) -> HuggingFaceSource:
    return HuggingFaceSource(args)
