"""data.source = "mixture": weighted interleaving of sources, exact resume, and its recipe tables."""

from __future__ import annotations

import itertools
import json

import pytest

from components.errors import UserError
from components.data.sources.mixture import MixtureArgs, MixtureEntry, MixtureSource, build_mixture_source
from nsa_titan import cli
from nsa_titan.config import resolve
from tests.launch import DEBUG, TINY, assert_resumed_at, losses, train


class Counting:
    """`per_shard[shard]` documents per epoch, named by source, shard, epoch and index; cursor = index + 1
    (or always None: a source may keep no position within an epoch)."""

    def __init__(self, name: str, per_shard: dict[int, int], validation: bool = True, cursors: bool = True):
        self.name, self.per_shard, self.validation, self.cursors = name, per_shard, validation, cursors

    def has_split(self, split):
        return split == "train" or self.validation

    def fingerprint(self):
        return f"counting({self.name},{sorted(self.per_shard.items())})"

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        for j in range(cursor or 0, self.per_shard.get(shard, 0)):
            yield f"{self.name}/{split}/{shard}/{epoch}/{j}", j + 1 if self.cursors else None


class Texts(Counting):
    """Text documents of `length` characters."""

    def __init__(self, name, length, count=40):
        super().__init__(name, {s: count for s in range(4)})
        self.length = length

    def documents(self, shard, num_shards, split, seed, epoch, cursor):
        for doc, after in super().documents(shard, num_shards, split, seed, epoch, cursor):
            yield (doc + " " * self.length)[: self.length], after


def take(source, n, shard=0, split="train", cursor=None, epoch=0, **prepare):
    return list(itertools.islice(source.documents(shard, 4, split, 7, epoch, cursor, **prepare), n))


def mixture(weights=(3.0, 1.0), sizes=(50, 20), by="documents", **kw):
    names = ["web", "code"][: len(weights)]
    return MixtureSource(names, list(weights), [Counting(n, {0: s, 1: s}, **kw) for n, s in zip(names, sizes)], by)


def test_documents_come_in_the_weights_proportions_and_each_source_in_its_own_order():
    docs = [d for d, _ in take(mixture(), 4000)]
    web = [d for d in docs if d.startswith("web")]
    assert abs(len(web) / len(docs) - 0.75) < 0.03
    # Each source's documents are its own stream, epoch after epoch (the small one repeats more often).
    for name, size in (("web", 50), ("code", 20)):
        own = [d for d in docs if d.startswith(name)]
        assert own == [f"{name}/train/0/{e}/{j}" for e in range(len(own) // size + 1) for j in range(size)][:len(own)]
    assert docs != [d for d, _ in take(mixture(), 4000, shard=1)][:4000]  # shards draw differently


def test_token_shares_follow_the_weights_within_one_document():
    """by = "tokens": long and short documents, weights 1 : 2 -> tokens 1 : 2, at every point of the stream."""
    source = MixtureSource(["long", "short"], [1.0, 2.0], [Texts("long", 100), Texts("short", 7)], "tokens")
    tokens = {"long": 0, "short": 0}
    for doc, _ in take(source, 3000):
        tokens[doc.split("/")[0]] += len(doc)
        assert abs(tokens["long"] - tokens["short"] / 2) <= 100
    assert tokens["long"] > 10_000
    # New weights count afresh from the resume: no burst of one source to make up the past.
    cursor = take(source, 3000)[-1][1]
    resumed = MixtureSource(["long", "short"], [1.0, 1.0], [Texts("long", 100), Texts("short", 7)], "tokens")
    after = {"long": 0, "short": 0}
    for doc, _ in take(resumed, 300, cursor=cursor):
        after[doc.split("/")[0]] += len(doc)
        assert abs(after["long"] - after["short"]) <= 100


@pytest.mark.parametrize("by", ["documents", "tokens"])
def test_a_cursor_resumes_exactly(by):
    source = mixture(by=by)
    run = take(source, 300)
    for stop in (0, 1, 49, 137, 299):
        resumed = take(source, 300 - stop - 1, cursor=run[stop][1])
        assert resumed == run[stop + 1:]
    json.dumps(run[-1][1])  # cursors are plain data, as checkpoints keep them


def test_new_weights_on_resume_continue_every_source_where_it_stopped():
    run = take(mixture(), 100)
    cursor = run[-1][1]
    after = [d for d, _ in take(mixture(weights=(1.0, 3.0)), 400, cursor=cursor)]
    assert abs(sum(d.startswith("code") for d in after) / 400 - 0.75) < 0.06
    last = {name: max((d for d, _ in run if d.startswith(name)), key=lambda d: (int(d.split("/")[3]),
                                                                               int(d.split("/")[4])))
            for name in ("web", "code")}
    for name, size in (("web", 50), ("code", 20)):
        epoch, j = map(int, last[name].split("/")[3:])
        following = f"{name}/train/0/{epoch + (j + 1) // size}/{(j + 1) % size}"
        assert next(d for d in after if d.startswith(name)) == following


@pytest.mark.parametrize("old,new", [(("documents", (3.0, 1.0)), ("documents", (1.0, 3.0))),
                                     (("tokens", (3.0, 1.0)), ("tokens", (1.0, 3.0))),
                                     (("tokens", (3.0, 1.0)), ("documents", (3.0, 1.0))),
                                     (("documents", (1.0, 1.0)), ("tokens", (1.0, 9.0)))])
def test_a_changed_rule_still_chooses_the_document_the_cursor_was_before(old, new):
    """The loader saves the position before the document it is in the middle of, so the first document
    after a resume must be that one whatever the new weights or `by` say; the new rule takes over after it."""
    run = take(mixture(weights=old[1], by=old[0]), 120)
    changed = 0
    for stop in range(0, 119, 7):
        resumed = take(mixture(weights=new[1], by=new[0]), 60, cursor=run[stop][1])
        assert resumed[0][0] == run[stop + 1][0]
        changed += [d for d, _ in resumed] != [d for d, _ in run[stop + 1:stop + 61]]
    assert changed  # and the new rule does choose differently afterwards


def test_new_weights_on_resume_finish_the_loaders_document_in_progress():
    """Through the loader: saved in the middle of a document, resumed with other weights, the first row
    goes on with the rest of that document, exactly as the run with the old weights does."""
    from components.data import ByteTokenizer, build_dataloader

    def loader(weights, state=None):
        built = build_dataloader(MixtureSource(["a", "b"], list(weights), [Texts("a", 29), Texts("b", 23)]),
                                 ByteTokenizer(), seq_len=16, batch_size=1, logical_shards=1, check_source=False)
        if state is not None:
            built.load_state_dict(state)
        return iter(built), built

    saved = 0
    for cut in range(1, 12):  # from the first batch on: the first document is chosen by the rule too
        batches, whole = loader((0.5, 0.5))
        for _ in range(cut):
            next(batches)
        state = whole.state_dict()
        going_on = next(batches)["input"][0].tolist()
        if 257 not in going_on:
            continue
        saved += 1
        rest = going_on[:going_on.index(257) + 1]  # up to the in-progress document's end of text
        resumed = next(loader((0.9, 0.1), state)[0])["input"][0].tolist()
        assert resumed[:len(rest)] == rest, (cut, rest, resumed)
    assert saved >= 5
    # A save in the middle of the shard's very first document (none finished yet): drawn by documents at
    # weights 0.02 : 0.98, it is b's; resumed by tokens (a tie at zero goes to a), it must still be b's.
    def built(weights, by):
        return build_dataloader(MixtureSource(["a", "b"], list(weights), [Texts("a", 29), Texts("b", 23)], by),
                                ByteTokenizer(), seq_len=16, batch_size=1, logical_shards=1, check_source=False)

    whole = built((0.02, 0.98), "documents")
    batches = iter(whole)
    first = bytes(t for t in next(batches)["input"][0].tolist() if t < 256).decode()
    assert first.startswith("b/train"), first
    state = whole.state_dict()
    going_on = next(batches)["input"][0].tolist()
    resumed_loader = built((0.98, 0.02), "tokens")
    resumed_loader.load_state_dict(state)
    resumed = next(iter(resumed_loader))["input"][0].tolist()
    rest = going_on[:going_on.index(257) + 1]
    assert resumed[:len(rest)] == rest, (rest, resumed)


def test_an_empty_shard_of_one_source_drops_it_there_and_all_empty_ends_the_stream():
    source = MixtureSource(["web", "code"], [1.0, 1.0], [Counting("web", {0: 5}), Counting("code", {0: 3, 1: 4})],
                           "documents")
    on_one = [d for d, _ in take(source, 50, shard=1)]
    assert len(on_one) == 50 and all(d.startswith("code") for d in on_one)
    assert take(source, 10, shard=2) == []  # the shard is empty in every source: the packer sees an empty epoch


def test_a_source_without_cursors_goes_on_epoch_after_epoch():
    source = MixtureSource(["a", "b"], [1.0, 1.0], [Counting("a", {0: 3}, cursors=False), Counting("b", {0: 3})],
                           "documents")
    docs = [d for d, _ in take(source, 200)]
    a = [d for d in docs if d.startswith("a")]
    assert 70 < len(a) < 130 and a[-1].split("/")[3] == str((len(a) - 1) // 3)


def test_the_weights_hold_for_the_documents_the_loader_keeps():
    """prepare (the loader's tokenization and length filter) skips a document: the draw goes on to the
    same source's next one, and a source that keeps none drops out instead of spinning."""
    source = mixture(weights=(1.0, 1.0))
    keep_odd_web = lambda d: None if d.startswith("web") and int(d.split("/")[4]) % 2 else d.upper()  # noqa: E731
    docs = [d for d, _ in take(source, 2000, prepare=keep_odd_web)]
    assert all(d.isupper() for d in docs) and abs(sum(d.startswith("WEB") for d in docs) / 2000 - 0.5) < 0.04
    assert all(int(d.split("/")[4]) % 2 == 0 for d in docs if d.startswith("WEB"))
    run = take(source, 300, prepare=keep_odd_web)
    assert take(source, 150, cursor=run[149][1], prepare=keep_odd_web) == run[150:]
    no_web = [d for d, _ in take(source, 100, prepare=lambda d: None if d.startswith("web") else d)]
    assert len(no_web) == 100 and all(d.startswith("code") for d in no_web)
    assert take(source, 10, prepare=lambda d: None) == []  # nothing kept anywhere: the stream ends


def test_the_order_of_the_tables_is_not_the_streams():
    build = lambda name, args: Counting(name, {0: 9})  # noqa: E731
    ab = build_mixture_source(MixtureArgs({"a": MixtureEntry(1.0, "a"), "b": MixtureEntry(2.0, "b")}), build)
    ba = build_mixture_source(MixtureArgs({"b": MixtureEntry(2.0, "b"), "a": MixtureEntry(1.0, "a")}), build)
    assert ab.fingerprint() == ba.fingerprint() and take(ab, 50) == take(ba, 50)


def test_validation_mixes_the_sources_that_hold_validation():
    source = MixtureSource(["web", "code"], [1.0, 1.0], [Counting("web", {0: 5}),
                                                         Counting("code", {0: 5}, validation=False)], "documents")
    assert source.has_split("validation")
    assert {d.split("/")[0] for d, _ in take(source, 20, split="validation")} == {"web"}
    assert not MixtureSource(["a"], [1.0], [Counting("a", {0: 1}, validation=False)]).has_split("validation")


def test_the_fingerprint_names_the_sources_not_the_weights():
    assert mixture().fingerprint() == mixture(weights=(1.0, 1.0)).fingerprint()
    assert mixture().fingerprint() != mixture(sizes=(50, 21)).fingerprint()


def test_the_builder_builds_each_source_and_refuses_a_mixture_of_one():
    built = []
    source = build_mixture_source(MixtureArgs({"a": MixtureEntry(1.0, "x", 1), "b": MixtureEntry(2.0, "y", 2)}),
                                  lambda name, args: built.append((name, args)) or Counting(name, {0: 1}))
    assert built == [("x", 1), ("y", 2)] and source.weights == [1.0, 2.0]
    with pytest.raises(UserError, match="at least two sources"):
        build_mixture_source(MixtureArgs({"a": MixtureEntry(1.0, "x")}), lambda name, args: None)



def test_a_source_that_fails_its_check_is_named_by_its_mixture_entry(tmp_path):
    """Two entries of one kind (text_files twice): the message says which entry's pattern matches nothing."""
    from components.data.sources import TextFilesArgs, TextFilesSource

    present = tmp_path / "a.txt"
    present.write_text("some text to train on " * 20)
    entries = {"web": MixtureEntry(1.0, "text_files", TextFilesArgs(paths=[str(present)])),
               "books": MixtureEntry(1.0, "text_files", TextFilesArgs(paths=[str(tmp_path / "books/*.txt")]))}
    source = build_mixture_source(MixtureArgs(entries), lambda name, args: TextFilesSource(args))
    with pytest.raises(UserError, match=r"^mixture source 'books' \(\[data.mixture.sources.books\]\): .*books/\*\.txt"):
        source.check()


def test_a_mixed_sources_fixes_name_the_fields_of_its_own_table(tmp_path):
    """They named data.text_files.invalid_utf8 and data.synthetic.vocab_size, which a mixture's recipe refuses (its
    source sets no [data.text_files]); each now names the field in its [data.mixture.sources.NAME], as on its own
    the source still names its [data.<source>]."""
    from components.data import SOURCES, ByteTokenizer
    from components.data.sources import SyntheticArgs, TextFilesArgs

    odd = tmp_path / "odd.txt"
    odd.write_bytes(b"latin-1 byte \xe9 here")
    entries = {"code": MixtureEntry(1.0, "text_files", TextFilesArgs(paths=[str(odd)])),
               "noise": MixtureEntry(1.0, "synthetic", SyntheticArgs(vocab_size=300))}
    source = build_mixture_source(MixtureArgs(entries), lambda name, args: SOURCES[name][1](args))
    with pytest.raises(UserError, match=r"from data\.mixture\.sources\.code\.paths \(either way .*\), or set "
                                        r"data\.mixture\.sources\.code\.invalid_utf8 = 'replace'"):
        source.check()
    with pytest.raises(UserError, match=r"Fix: set data\.mixture\.sources\.noise\.vocab_size <= 256"):
        source.check_tokenizer(ByteTokenizer())
    with pytest.raises(UserError, match=r"Fix: set data\.synthetic\.vocab_size <= 256"):
        SOURCES["synthetic"][1](SyntheticArgs(vocab_size=300)).check_tokenizer(ByteTokenizer())

    recipe = tmp_path / "mixed.toml"
    recipe.write_text(f'extends = "{DEBUG}"\n[data]\nsource = "mixture"\n'
                      f'[data.mixture.sources.code]\nweight = 1.0\nsource = "text_files"\npaths = ["{odd}"]\n'
                      f'[data.mixture.sources.noise]\nweight = 1.0\nsource = "synthetic"\nvocab_size = 300\n')
    fixed = resolve([str(recipe), "--data.mixture.sources.code.invalid_utf8=replace",
                     "--data.mixture.sources.noise.vocab_size=256"], world_size=1).recipe  # the fixes named
    mixed = build_mixture_source(fixed.data.source_args, lambda name, args: SOURCES[name][1](args))
    mixed.check()
    mixed.check_tokenizer(ByteTokenizer())


MIXED = """extends = "{debug}"
[data]
source = "mixture"
[data.mixture.sources.code]
weight = 1.0
source = "python_stdlib"
validation_fraction = 0.1
[data.mixture.sources.noise]
weight = 3.0
source = "synthetic"
max_length = 100
"""


def write_recipe(tmp_path, text=MIXED) -> str:
    path = tmp_path / "mixed.toml"
    path.write_text(text.format(debug=DEBUG))
    return str(path)


def test_the_recipe_takes_named_source_tables_and_prints_them_back(tmp_path):
    path = write_recipe(tmp_path)
    resolved = resolve([path, "--data.mixture.sources.noise.weight=2.5"])
    entries = resolved.recipe.data.source_args.sources
    assert list(entries) == ["code", "noise"]
    assert entries["noise"].weight == 2.5 and entries["noise"].args.max_length == 100
    assert entries["code"].args.validation_fraction == 0.1
    printed = tmp_path / "printed.toml"
    printed.write_text(resolved.toml)
    assert resolve([str(printed)]).hash == resolved.hash  # the printed recipe is the same recipe


@pytest.mark.parametrize("text, flags, expected", [
    (MIXED.replace("weight = 3.0\n", ""), [], ["data.mixture.sources.noise.weight", "is required"]),
    (MIXED, ["--data.mixture.sources.noise.weight=0"], ["data.mixture.sources.noise.weight", "greater than 0"]),
    (MIXED, ["--data.mixture.sources.noise.max_lenght=5"], ["data.mixture.sources.noise.max_lenght",
                                                             "did you mean 'max_length'"]),
    (MIXED, ["--data.mixture.sources.noise.source=synthetik"], ["data.mixture.sources.noise.source",
                                                                 "did you mean 'synthetic'"]),
    (MIXED, ["--data.mixture.sources.nosie.weight=2"], ["flag '--data.mixture.sources.nosie.weight=2'",
                                                          "is no table of the recipe (did you mean 'noise'?)",
                                                          "correct the name in the flag"]),
    (MIXED.split("[data.mixture.sources.noise]")[0], [], ["data.mixture.sources", "at least two sources"]),
    (MIXED, ["--data.mixture.sources.inner.weight=1", "--data.mixture.sources.inner.source=mixture"],
     ["data.mixture.sources.inner.source", "cannot hold a mixture"]),
    (MIXED, ["--data.source=synthetic", "--data.mixture.sources.noise.weight=2"],
     ["flag '--data.mixture.sources.noise.weight=2'", "remove that flag", "data.source = 'synthetic'"]),
    (MIXED + "[data.mixture.sources]\nweb = 3\n", [], ["data.mixture.sources.web = 3", "must be a table"]),
    (MIXED, ["--data.mixture.sources.web.weight=1", "--data.mixture.sources.web.source=huggingface",
             "--data.mixture.sources.web.validation_split=test", "--data.mixture.sources.web.validation_fraction=0.01"],
     ["data.mixture.sources.web.validation_fraction = 0.01", "is not used: validation_split = 'test'"]),
])
def test_a_wrong_mixture_is_a_recipe_error(tmp_path, capsys, text, flags, expected):
    code = cli.main(["train", write_recipe(tmp_path, text), *flags])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: the recipe has 1 problem:"), err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} missing from:\n{err}"


def test_a_mixed_run_resumes_to_the_bit(tmp_path):
    """Train with a mixture, die after a checkpoint, resume: the same losses as the run that went on."""
    argv = [write_recipe(tmp_path), *TINY, "--training.steps=4", "--checkpoint.enable=true",
            "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0", "--metrics.log_freq=1"]
    whole = tmp_path / "whole"
    assert train([*argv, f"--job.dump_folder={whole}"]).returncode == 0
    cut = tmp_path / "cut"
    first = train([*argv, f"--job.dump_folder={cut}", "--training.steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = train([*argv, f"--job.dump_folder={cut}"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert_resumed_at(second.stdout, cut, 2)
    assert losses(cut) == losses(whole)


def test_the_loader_skips_short_documents_before_the_weights_count(tmp_path):
    """data.min_document_tokens through the real loader: a source of short documents drops out, and
    when no source keeps any the run stops with the loader's message instead of spinning."""
    from components.data import ByteTokenizer, build_dataloader

    def first_batch(sources):
        source = MixtureSource([s.name for s in sources], [1.0] * len(sources), sources)
        loader = build_dataloader(source, ByteTokenizer(), seq_len=64, batch_size=2, logical_shards=4,
                                  min_document_tokens=20, check_source=False)
        return next(iter(loader))["input"]

    batch = first_batch([Texts("l", 30), Texts("s", 10)])
    text = bytes(t for t in batch.flatten().tolist() if t < 256).decode()
    assert "l/train" in text and "s/train" not in text
    with pytest.raises(UserError, match="hold no documents of at least data.min_document_tokens = 20"):
        first_batch([Texts("s", 10), Texts("t", 5)])


def test_a_source_argument_named_like_an_entry_field_is_refused(tmp_path, capsys):
    """Arguments sit beside weight and source: a plugin source's own `weight` could not be told apart."""
    from dataclasses import dataclass, field

    from nsa_titan import registry

    @dataclass
    class WeightedArgs:
        weight: float = field(default=1.0, metadata={"doc": "a weight of its own"})

    registry.register("data_source", "weighted", lambda args: Counting("w", {0: 1}), args=WeightedArgs)
    try:
        code = cli.main(["train", write_recipe(tmp_path), "--data.mixture.sources.noise.source=weighted"])
    finally:
        registry._PARTS["data_source"].pop("weighted")
    err = capsys.readouterr().err
    assert code == 2 and "data.mixture.sources.noise.weight" in err and "cannot be told apart" in err, err


def test_by_tokens_the_shards_open_with_the_sources_in_turn():
    """Ties at zero went to the first name in every shard: with long documents the run's first batches were all
    of one source. Shard s breaks ties from its s-th name; the shares still follow the weights."""
    names = ["a", "b", "c"]
    source = MixtureSource(names, [0.5, 0.3, 0.2], [Texts(n, 200) for n in names], "tokens")
    assert [take(source, 1, shard=s)[0][0][0] for s in range(4)] == ["a", "b", "c", "a"]
    tokens = {n: 0 for n in names}
    for doc, _ in take(source, 1000, shard=1):
        tokens[doc[0]] += len(doc)
    assert all(abs(tokens[n] / sum(tokens.values()) - w) < 0.01 for n, w in zip(names, [0.5, 0.3, 0.2])), tokens


def test_a_source_in_few_logical_shards_is_told(tmp_path):
    """A source of 3 documents (parquet rows) reaches 3 of 8 logical shards; the others mix without it, so it got
    3/8 of its weight's share in silence."""
    from components.data.sources import TextFilesArgs, TextFilesSource
    from tests.test_data_helpers import unique_texts, write_jsonl, write_parquet

    big = write_jsonl(str(tmp_path / "big.jsonl"), unique_texts(200, seed=1))
    small = write_parquet(str(tmp_path / "small.parquet"), unique_texts(3, seed=2))
    parts = [TextFilesSource(TextFilesArgs(paths=[p], validation_fraction=0)) for p in (big, small)]
    source = MixtureSource(["big", "small"], [1.0, 1.0], parts)
    notes = source.shard_notes(8)
    assert notes == ["mixture source 'small' holds training documents in 3 of the 8 logical shards "
                     "(data.logical_shards), and the other shards mix without it: it gets about 3/8 of its weight's "
                     "share. Fix: fewer logical shards (at most 3, a multiple of the data-parallel size), or its "
                     "documents in more files or lines (parquet: smaller row groups)"], notes
    assert source.shard_notes(2) == []
