"""The iterable dataset of one data-parallel rank: its logical shards, packed and interleaved.

It runs inside each DataLoader worker (tokenization happens there) on that worker's shards, and its
state_dict()/load_state_dict() are what StatefulDataLoader snapshots per worker after every batch.
The stream never ends: shards restart in a new epoch with a new order when their documents run out
(unless `quotas` fix a set: each shard's first windows, at most one pass over its documents, after which the
stream ends; the last window of a pass is short, the rest of its row counting nothing). A worker's shards
keep in step: one that finished its epoch waits until the others have, so no document comes twice
before every document of those shards came once.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from components.errors import UserError
from components.data.packing import ShardPacker, document_tokens, fresh_shard_state
from components.data.part_failures import failures_named
from components.data.sharding import next_shard, shards_of_worker
from components.data.tokenizers import encode_array

IGNORED_TARGET = -100  # a target no loss counts (F.cross_entropy's ignore_index; the trainer's loss follows it)
_STATE_KEYS = ("epoch", "cursor", "skip", "windows", "empty")  # and epoch_start_windows, absent from older states


class DataStreamMismatch(UserError):
    """A saved data state belongs to another stream (other data settings): it cannot continue this one."""


class NoDocuments(UserError):
    """The logical shards a stream reads hold no document of its split (so it would wait forever for one)."""


class PackedShardsDataset(IterableDataset):
    def __init__(
        self,
        source,
        tokenizer,
        *,
        seq_len: int,
        rank_shards: list[int],
        logical_shards: int,
        split: str,
        seed: int,
        add_bos: bool,
        stream_id: str,
        min_document_tokens: int = 0,
        dp_rank: int,
        shard_states: dict[int, dict] | None = None,
        quotas: dict[int, int] | None = None,
    ):
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.rank_shards = list(rank_shards)
        self.logical_shards = logical_shards
        self.split = split
        self.seed = seed
        self.bos_id = tokenizer.bos_id if add_bos else None
        self.min_document_tokens = min_document_tokens
        self.stream_id = stream_id
        self.unchecked: list[str] = []  # parts of the stream's id that an adopted state was saved without
        self.dp_rank = dp_rank
        self._states: dict[int, dict] = {s: self._fresh_state(s) for s in self.rank_shards}
        if shard_states is not None:
            self._adopt(shard_states, require_all=True)
        self._packers: dict[int, ShardPacker] | None = None
        # Windows each shard gives before the stream ends (a fixed set, such as the held-out one); None: endless.
        self.quotas = quotas

    # ----- state ---------------------------------------------------------------------------------
    def _fresh_state(self, shard: int) -> dict:
        """A shard's state before its first window; a source that writes down how it chooses documents (a
        mixture's rule) gives the cursor to start from, in place of None."""
        state = fresh_shard_state()
        start = getattr(self.source, "start_cursor", None)
        if callable(start):
            state["cursor"] = start(shard, self.split)
        return state

    def _adopt(self, states: dict[int, dict], require_all: bool) -> None:
        # The stream first: a state of another stream (e.g. other logical_shards) also lacks shards, and
        # the mismatch is what the caller can act on (restart the data), not the missing shards.
        for state in states.values():
            self.check_stream(state.get("stream", self.stream_id))
        mine = [s for s in self.rank_shards if s in states]
        if require_all and len(mine) != len(self.rank_shards):
            missing = sorted(set(self.rank_shards) - set(states))
            raise UserError(
                f"the data state lacks logical shards {missing} of rank {self.dp_rank}; merge the states of "
                "every rank of the checkpoint (merge_shard_states) before rebuilding"
            )
        for s in mine:
            self._states[s] = {k: states[s][k] for k in _STATE_KEYS}
            if "epoch_start_windows" in states[s]:
                self._states[s]["epoch_start_windows"] = states[s]["epoch_start_windows"]

    def check_stream(self, saved: str) -> None:
        saved, unnamed = tokens_named_anew(saved, self.stream_id, self.tokenizer)
        if unnamed and unnamed not in self.unchecked:
            self.unchecked.append(unnamed)
        differences = stream_differences(saved, self.stream_id)
        if differences:
            raise DataStreamMismatch(
                f"the data state was written for another data stream and cannot continue this one: "
                f"{'; '.join(differences)}. Fix: restore those settings (or files, or library versions) of the run "
                f"that wrote it, or start the data from its beginning"
            )
        self.unchecked += [part for part in unchecked_parts(saved, self.stream_id) if part not in self.unchecked]

    def _my_shards(self) -> list[int]:
        info = get_worker_info()
        if info is None:
            return self.rank_shards
        return shards_of_worker(self.rank_shards, info.id, info.num_workers)

    def _sync_states(self) -> None:
        if self._packers is not None:
            for s, packer in self._packers.items():
                self._states[s] = packer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        self._sync_states()
        return {
            "stream": self.stream_id,
            "shards": {str(s): dict(self._states[s]) for s in self._my_shards()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        shards = {int(k): {**v, "stream": state["stream"]} for k, v in state["shards"].items()}
        self._adopt(shards, require_all=False)
        self._packers = None

    # ----- iteration -----------------------------------------------------------------------------
    def _prepare(self, doc) -> Any:
        """A source document as the stream's tokens, or None when it is too short to keep."""
        return self._prepare_taken([doc])

    def _prepare_taken(self, held: list) -> Any:
        """_prepare of the one document in `held`, taken out of it: a text held there alone is freed once encoded,
        before its ids are copied into the stream's tokens (text, ids and tokens at once took 3.7 times a long
        document's size with the byte tokenizer)."""
        doc = held.pop()
        encoded = isinstance(doc, str)
        if encoded:
            made_by = f"the tokenizer ({type(self.tokenizer).__name__})"
            ids = encode_document(self.tokenizer, doc)
        else:
            ids, made_by = doc, f"the data source ({type(self.source).__name__})"
        del doc
        self._check_ids(ids, made_by, encoded=encoded)
        tokens = document_tokens(ids, self.bos_id, self.tokenizer.eos_id, self.tokenizer.vocab_size)
        return tokens if len(tokens) >= self.min_document_tokens else None

    def _check_ids(self, ids, made_by: str, encoded: bool) -> None:
        """A document's token ids are whole numbers the model's embedding holds: a plugin's source or tokenizer
        that breaks this trained on float ids cast to 0, or died in an index error deep in the model."""
        if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind not in "iu" and encoded:
            first = f" (the first: {ids[:1].tolist()[0]!r})" if ids.size else ""
            raise UserError(f"{made_by} encoded a document as {ids.dtype} values{first}, not integer token ids. Fix: "
                            f"its encode() returns a list of int token ids, below its vocab_size")
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            what = (f"an array of {ids.dtype} with shape {list(ids.shape)}" if isinstance(ids, np.ndarray) else
                    f"a {type(ids).__name__}")
            raise UserError(f"{made_by} gave a document as {what}. Fix: a document is a str (which the tokenizer "
                            f"encodes) or a 1-D numpy array of integer token ids")
        vocab = self.tokenizer.vocab_size
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            odd = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise UserError(f"{made_by} gave token id {odd}, outside the tokenizer's vocabulary of {vocab} (ids 0 to "
                            f"{vocab - 1}). Fix: give ids below the tokenizer's vocab_size, or a tokenizer whose "
                            f"vocab_size covers them")

    def _open_documents(self, shard: int):
        def open_documents(epoch: int, cursor: Any):
            args = (shard, self.logical_shards, self.split, self.seed, epoch, cursor)
            if getattr(self.source, "prepares_documents", False):  # it skips and counts kept documents itself
                yield from read_plainly(self.source, args, prepare=self._prepare)
                return
            for item in read_plainly(self.source, args):
                if not (isinstance(item, (tuple, list)) and len(item) == 2):
                    raise UserError(f"the data source ({type(self.source).__name__}) yielded a "
                                    f"{type(item).__name__}, not a (document, cursor) pair. Fix: documents() yields "
                                    f"(document, cursor_after) pairs (see components/data/sources/base.py)")
                held, cursor_after = [item[0]], item[1]
                del item  # the text is not kept beside its tokens: freed once encoded
                tokens = self._prepare_taken(held)
                # A skipped document is read again on resume (cursors count source documents) and skipped again.
                if tokens is not None:
                    yield tokens, cursor_after

        return open_documents

    def __iter__(self):
        self._sync_states()  # iterating again continues where the last iteration stopped
        shards = self._my_shards()
        self._packers = {s: ShardPacker(self._open_documents(s), self.seq_len, self._states[s],
                                        one_pass=self.quotas is not None) for s in shards}
        return self._windows(self._packers)

    def _windows(self, packers: dict[int, ShardPacker]):
        quotas = self.quotas
        while True:
            live = {s: (p.epoch, p.windows - p.epoch_start_windows) for s, p in packers.items()
                    if not p.empty and not p.ended and (quotas is None or p.windows < quotas.get(s, 0))}
            if not live and quotas is not None:
                return  # every shard gave its share, ran out of documents, or holds none
            if not live:
                worker = torch.utils.data.get_worker_info()
                if worker is not None and worker.num_workers > 1:
                    # this worker's shards are empty; the rank's other workers go on (the loader checks the rank)
                    return
                raise no_documents_error(self.split, list(packers), self.dp_rank, self.logical_shards,
                                         self.min_document_tokens)
            window = packers[next_shard(live)].next_window_with_starts()
            if window is None:
                continue
            tokens = torch.from_numpy(window[0])
            inputs, targets = tokens[:-1], tokens[1:]
            if len(inputs) < self.seq_len:  # a fixed set's last, short window: the rest of the row counts nothing
                pad = self.seq_len - len(inputs)
                inputs = torch.cat([inputs, inputs.new_zeros(pad)])
                targets = torch.cat([targets, targets.new_full((pad,), IGNORED_TARGET)])
            yield {"input": inputs, "target": targets, "document_starts": row_document_starts(window[1], self.seq_len)}


def encode_document(tokenizer, text: str) -> np.ndarray:
    """encode_array(tokenizer, text); what a plugin's tokenizer raises there one message naming it and its line."""
    with failures_named(tokenizer, "tokenizer", "encoding a document",
                        "mend the tokenizer there, or the data it cannot encode"):
        return encode_array(tokenizer, text)


def read_plainly(source, args: tuple, **kwargs) -> Iterator:
    """source.documents(*args, **kwargs); what a plugin's source raises there one message naming the source, the
    shard it read and the line in the source's file."""
    shard, _, split, _, epoch, _ = args
    with failures_named(source, "data source", f"reading logical shard {shard} ({split} split, epoch {epoch})",
                        "mend the data it reads, or the source there; a rerun resumes from the last checkpoint"):
        yield from source.documents(*args, **kwargs)


def no_documents_error(split: str, shards: list[int], dp_rank: int | None, logical_shards: int,
                       min_document_tokens: int, without: str | None = None, instead: str | None = None,
                       source_fields: str | None = None) -> NoDocuments:
    """The stream of a rank whose logical shards hold no document (it would wait forever for one); dp_rank
    None: shards read by no one rank (every rank's share of the held-out set). without: the fix of a held-out
    set that needs no data, when not training's (validation.enable = false); instead: the whole fix, in place of the
    recipe fields named here (a caller that takes its settings otherwise, and knows which change works);
    source_fields: where the source's held-out fields sit in the recipe (data.text_files), where it has them."""
    shards = sorted(shards)
    which = (f"all {logical_shards} logical shards" if len(shards) == logical_shards else
             f"logical shards {shards}" if len(shards) <= 8 else
             f"logical shards {', '.join(map(str, shards[:8]))}, ... ({len(shards)} of {logical_shards})")
    at_least = f" of at least data.min_document_tokens = {min_document_tokens} tokens" if min_document_tokens else ""
    if split == "validation":
        what = "there is no held-out data to validate on"
        held_out = (f"{source_fields}.validation_fraction (or its validation_split)" if source_fields else
                    "the data source's validation_fraction (or its validation_split)")
        fix = (f"raise {held_out}, add data, lower data.logical_shards, or "
               f"{without or 'train without validation (validation.enable = false)'}")
    else:
        what = "this rank has nothing to train on"
        fix = "add data, or lower data.logical_shards or data.num_workers"
    if min_document_tokens:
        fix += ", or lower data.min_document_tokens"
    whose = "" if dp_rank is None else f" of data-parallel rank {dp_rank}"
    return NoDocuments(f"data split {split!r}: {which}{whose} hold no documents{at_least}, so {what}. Fix: "
                       f"{fix if instead is None else instead}.")


def row_document_starts(starts, seq_len: int) -> torch.Tensor:
    """BoolTensor [seq_len]: True where an input token opens a document. The row's first token always
    does (a row end is a boundary); offset seq_len is the target's last token, not an input."""
    mask = torch.zeros(seq_len, dtype=torch.bool)
    mask[0] = True
    mask[torch.from_numpy(starts[starts < seq_len])] = True
    return mask


# The recipe fields behind the parts of a stream id (loader.stream_id) after the source's fingerprint.
_STREAM_FIELDS = {"tokenizer": "data.tokenizer (name, for tiktoken a digest of its tokens: vocabulary size)",
                  "add_bos": "data.add_bos", "seed": "job.seed",
                  "logical_shards": "data.logical_shards", "split": "the split",
                  "min_document_tokens": "data.min_document_tokens",
                  "eos": "the tokenizer's end-of-document id (its eos_token)",
                  "bos": "the tokenizer's start-of-document id (its bos_token)",
                  "tokenizer_file": "the tokenizer file's content (digest)",
                  "files": "what the source reads beyond its settings (the files its paths, patterns or folder hold: "
                           "names, sizes and first and last bytes, digest; huggingface: the datasets version)",
                  "order": "numpy's random streams, which order the documents (digest: numpy versions may differ)"}
# Parts added to stream ids after states were saved without them: a state that lacks one is not asked it.
_ADDED_LATER = ("eos", "bos", "tokenizer_file", "files", "order")
# Those parts in a few words, for the note of a resume that could not check them.
_UNCHECKED = {"eos": "the tokenizer's end-of-document id", "bos": "the tokenizer's start-of-document id",
              "tokenizer_file": "the tokenizer file's content",
              "files": "the data files (names, sizes, first and last bytes; huggingface: the datasets version)",
              "order": "numpy's document order"}
# The model learned the ids of the saved run's tokenizer: going on with other ids is a new start for it.
_TOKENIZER_PARTS = ("tokenizer", "eos", "bos", "tokenizer_file")


def tokens_named_anew(saved: str, current: str, tokenizer) -> tuple[str, str | None]:
    """(the saved stream id with its tokenizer named as the current id names it, where an older id named the same
    tokens another way (by the encoding name that loaded them), what of them that id could not check, or None)."""
    former = getattr(tokenizer, "former_stream_name", None)
    before, _, rest = saved.rpartition("|tokenizer=")
    theirs, ours = rest.split("|", 1)[0], current.rpartition("|tokenizer=")[2].split("|", 1)[0]
    if former is None or not before or theirs == ours:
        return saved, None
    relation = former(theirs)
    if relation is None:
        return saved, None
    renamed = f"{before}|tokenizer={ours}{rest[len(theirs):]}"
    return renamed, ("the tiktoken encoding's tokens (it named the encoding only)" if relation == "unchecked" else None)


def unchecked_parts(saved: str, current: str) -> list[str]:
    """What the current stream's id holds that the saved one, older, lacks (so a resume could not check it), in a
    few words."""
    def keys(stream: str) -> set[str]:
        return {part.split("=", 1)[0] for part in stream.rpartition("|tokenizer=")[2].split("|")}

    theirs, ours = keys(saved), keys(current)
    return [_UNCHECKED[key] for key in _ADDED_LATER if key in ours and key not in theirs]


def stream_differences(saved: str, current: str) -> list[str]:
    """What differs between two stream ids, by recipe field: 'job.seed 0 there, 7 here'; [] when the saved
    state continues the current stream."""
    def parts(stream: str) -> dict[str, str]:
        source, _, rest = stream.rpartition("|tokenizer=")  # the source's fingerprint may hold '|' itself
        named = dict(part.split("=", 1) for part in f"tokenizer={rest}".split("|") if "=" in part)
        return {"source": source, "min_document_tokens": "0", **named}

    if saved == current:
        return []
    theirs, ours = parts(saved), parts(current)
    found = []
    for key in ["source", *_STREAM_FIELDS]:
        if key in _ADDED_LATER and key not in theirs:
            continue
        if theirs.get(key) != ours.get(key):
            if key == "source":
                found.append(f"the data source (data.source, its [data.<source>] settings or its files' contents): "
                             f"{theirs.get(key)} there, {ours.get(key)} here")
            else:
                found.append(f"{_STREAM_FIELDS[key]} {theirs.get(key, 'none')} there, {ours.get(key, 'none')} here")
    add_bos_changed = theirs.get("add_bos") != ours.get("add_bos")  # then a bos id comes or goes by itself
    if any(theirs.get(key) != ours.get(key) for key in _TOKENIZER_PARTS if key in theirs
           and not (key == "bos" and add_bos_changed)):
        found.append("the model learned the token ids of the tokenizer there")
    unknown = {k for k in {*theirs, *ours} - {"source", *_STREAM_FIELDS} if theirs.get(k) != ours.get(k)}
    return found or ([f"{saved} there, {current} here"] if unknown else [])
