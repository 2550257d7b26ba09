"""Packing one logical shard's documents into training windows, resumably.

The shard's token stream is its documents in epoch order, each as [BOS]? + tokens + [EOS], epoch
after epoch without end. Window k is stream[k*L : k*L + L + 1] for seq_len L: the model reads
input = window[:-1] and predicts target = window[1:]. Consecutive windows share exactly one token
(the last of one is the first of the next), so the targets of one shard, concatenated, are the
stream itself from its second token: nothing is truncated, dropped or predicted twice. Documents
longer than a window simply continue in the next one.

Each window also says where documents start in it (`next_window_with_starts`): the offsets of the
first token of every document that begins inside it. A window's first token opens a document for
the model whatever the stream says (a row end is a boundary): a document cut by a window end
continues as a document of its own in the next window.

State is a position in the stream, independent of L: (epoch, cursor) of the first document not yet
fully consumed, `skip` tokens into it, plus the count of windows emitted (and that count when the
shard entered its epoch) and whether the shard turned out to hold no documents. Resuming re-reads
(and re-tokenizes) that one document. A shard's epoch is that of the document holding its next
window's first token.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator

import numpy as np

OpenDocuments = Callable[[int, Any], Iterator[tuple[np.ndarray, Any]]]


def fresh_shard_state() -> dict:
    return {"epoch": 0, "cursor": None, "skip": 0, "windows": 0, "epoch_start_windows": 0, "empty": False}


class ShardPacker:
    """Windows of seq_len + 1 tokens from one shard; `open_documents(epoch, cursor)` gives token arrays."""

    def __init__(self, open_documents: OpenDocuments, seq_len: int, state: dict | None = None,
                 one_pass: bool = False):
        state = dict(state or fresh_shard_state())
        self._open = open_documents
        self.seq_len = seq_len
        # One pass (a fixed set): the stream ends with its first epoch, its last window short, where an endless
        # stream would begin the documents again; `ended` then.
        self.one_pass = one_pass
        self.ended = False
        self.windows = int(state["windows"])
        # States saved before the count was kept: in the first epoch every window is in it; in a later one the
        # shard joins its epoch as if it had just begun it (not with all its windows, which would hold it back
        # until the others caught up).
        self.epoch_start_windows = int(state.get("epoch_start_windows", self.windows if state["epoch"] else 0))
        self.empty = bool(state["empty"])
        # Buffered documents: (tokens, epoch, cursor before the document).
        self._buffer: deque[tuple[np.ndarray, int, Any]] = deque()
        self._buffered = 0
        self._offset = int(state["skip"])
        self._read_epoch = int(state["epoch"])
        self._read_cursor = state["cursor"]
        self._reader: Iterator | None = None
        self._reader_from_start = False
        self._reader_count = 0

    @property
    def epoch(self) -> int:
        """The epoch of the first document not yet fully consumed (its next window starts in it)."""
        return self._buffer[0][1] if self._buffer else self._read_epoch

    def state_dict(self) -> dict:
        cursor = self._buffer[0][2] if self._buffer else self._read_cursor
        return {
            "epoch": self.epoch,
            "cursor": cursor,
            "skip": self._offset,
            "windows": self.windows,
            "epoch_start_windows": self.epoch_start_windows,
            "empty": self.empty,
        }

    def _read_document(self) -> bool:
        """Buffer the next document, crossing into the next epoch when one ends. False: no documents."""
        while True:
            if self._reader is None:
                self._reader = iter(self._open(self._read_epoch, self._read_cursor))
                self._reader_from_start = self._read_cursor is None
                self._reader_count = 0
            item = next(self._reader, None)
            if item is not None:
                break
            if self._reader_from_start and self._reader_count == 0:
                self.empty = True  # a whole epoch without documents: the shard owns none
                return False
            if self.one_pass:
                self.ended = True
                return False
            self._read_epoch += 1
            self._read_cursor = None
            self._reader = None
        tokens, cursor_after = item
        self._buffer.append((tokens, self._read_epoch, self._read_cursor))
        self._buffered += len(tokens)
        self._read_cursor = cursor_after
        self._reader_count += 1
        return True

    def next_window(self) -> np.ndarray | None:
        """The next window (int64, seq_len + 1 tokens), or None when the shard has no documents."""
        window = self.next_window_with_starts()
        return None if window is None else window[0]

    def next_window_with_starts(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(the next window, the offsets in it where a document of the stream starts, ascending int64),
        or None when the shard has no documents (or, one pass, no more). One pass: the last window holds what
        is left, two tokens or more, short of seq_len + 1."""
        need = self.seq_len + 1
        if self.empty:
            return None
        while self._buffered - self._offset < need:
            if not self._read_document():
                if self.ended and self._buffered - self._offset >= 2:
                    need = self._buffered - self._offset
                    break
                return None
        parts, starts = [], []
        start, remaining = self._offset, need
        for tokens, _, _ in self._buffer:
            if start == 0:
                starts.append(need - remaining)
            take = tokens[start : start + remaining]
            parts.append(take)
            remaining -= len(take)
            start = 0
            if remaining == 0:
                break
        window = (np.concatenate(parts) if len(parts) > 1 else parts[0]).astype(np.int64)
        # Advance by seq_len, keeping the window's last token as the next window's first.
        epoch = self.epoch
        self._offset += self.seq_len
        while self._buffer and self._offset >= len(self._buffer[0][0]):
            first = self._buffer.popleft()[0]
            self._offset -= len(first)
            self._buffered -= len(first)
        self.windows += 1
        if self.epoch != epoch:
            self.epoch_start_windows = self.windows
        return window, np.asarray(starts, dtype=np.int64)


def document_tokens(tokens: np.ndarray, bos_id: int | None, eos_id: int, vocab_size: int | None = None) -> np.ndarray:
    """One document's contribution to the stream: [BOS]? + tokens + [EOS], as uint16 for a vocabulary of at most 65,536
    ids, else int32 (ids are checked against the vocabulary first): each logical shard holds its whole current
    document, and over a long run that tends to be a long one, so 64 shards of a corpus with 1M-token files buffer
    256 MB where int64 would take 512 MB (128 MB with the byte tokenizer). Written into place with one copy, so a
    document of gigabytes is not held twice over. Windows are widened to int64 as they are handed out."""
    head = [] if bos_id is None else [bos_id]
    narrow = vocab_size is not None and vocab_size <= 1 << 16
    out = np.empty(len(head) + len(tokens) + 1, dtype=np.uint16 if narrow else np.int32)
    out[:len(head)] = head
    out[len(head):-1] = tokens
    out[-1] = eos_id
    return out
