"""The Hugging Face `tokenizers` tokenizer, with a BPE trained here on the standard library's sources."""

from __future__ import annotations

import glob
import json
import math
import os
import pickle
import sysconfig

import pytest

from components.data import TOKENIZERS
from components.data.hf_tokenizer import HFTokenizer, HFTokenizerArgs
from components.errors import UserError
from nsa_titan import cli
from nsa_titan.config import RecipeError, resolve
from tests.launch import DEBUG, TINY, metrics

SAMPLES = ["", "def f(x):\n    return x", "naïve café — 日本語 🙂", "a <|endoftext|> b", "tabs\tand  spaces "]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A byte-level BPE of 600 tokens trained on some of the standard library, saved as a folder the way
    save_pretrained leaves it (tokenizer.json and tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<s>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|endoftext|>"}))
    return folder


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(trained, text):
    tok = HFTokenizer(HFTokenizerArgs(path=str(trained)))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert list(tok.encode_array(text)) == ids


def test_specials_from_the_config_and_as_plain_text(trained):
    tok = HFTokenizer(HFTokenizerArgs(path=str(trained / "tokenizer.json")))
    assert (tok.eos_id, tok.bos_id) == (0, 1) and tok.vocab_size == 600
    assert tok.eos_id not in tok.encode("x <|endoftext|> y")  # text never yields the end-of-document id
    assert tok.decode([5, tok.eos_id]).endswith("<|endoftext|>")
    named = HFTokenizer(HFTokenizerArgs(path=str(trained), eos_token="<s>", bos_token="<|endoftext|>"))
    assert (named.eos_id, named.bos_id) == (1, 0)


def test_pickles_and_names_its_content(trained, tmp_path):
    tok = HFTokenizer(HFTokenizerArgs(path=str(trained)))
    again = pickle.loads(pickle.dumps(tok))
    assert again.encode(SAMPLES[1]) == tok.encode(SAMPLES[1]) and again.name == tok.name
    moved = tmp_path / "elsewhere.json"
    moved.write_bytes((trained / "tokenizer.json").read_bytes())
    assert HFTokenizer(HFTokenizerArgs(path=str(moved))).name == tok.name  # the stream id follows the content


def test_a_lone_surrogate_from_json_encodes_as_tiktoken_reads_it(trained):
    """JSON may hold "\\ud800"; the tokenizers library refuses such a string (a TypeError deep in a run)."""
    tok = HFTokenizer(HFTokenizerArgs(path=str(trained)))
    assert tok.encode("x\ud800y") == tok.encode("x\ufffdy") and tok.encode("x\ufffdy")


@pytest.mark.parametrize("args, message", [
    (HFTokenizerArgs(), "needs a path"),
    (HFTokenizerArgs(path="/nonexistent/tokenizer.json"), "does not exist"),
    (HFTokenizerArgs(path="BROKEN"), "cannot read"),
    (HFTokenizerArgs(path="TRAINED", eos_token="<nope>"), "has no token '<nope>'"),
])
def test_bad_input_is_a_user_error(trained, tmp_path, args, message):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    args.path = {"BROKEN": str(broken), "TRAINED": str(trained)}.get(args.path, args.path)
    with pytest.raises(UserError, match=message):
        HFTokenizer(args)


@pytest.mark.parametrize("config", ["{bad json", "[1, 2]", b"\xff\xfe not utf-8"])
def test_a_tokenizer_config_that_cannot_be_read_is_an_error_not_a_guess(trained, tmp_path, config):
    """Its end-of-document token would otherwise silently fall back to a guessed one."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())
    data = config if isinstance(config, bytes) else config.encode()
    (folder / "tokenizer_config.json").write_bytes(data)
    # Every field the config would have given is named at once (a fix of eos_token alone met bos_token next).
    with pytest.raises(UserError, match="cannot read .*tokenizer_config.json.*set data.hf_tokenizer.eos_token and "
                                        "data.hf_tokenizer.bos_token to the tokens to use"):
        HFTokenizer(HFTokenizerArgs(path=str(folder)))
    # A recipe names bos_token only with data.add_bos (else it is refused as unused): so the fix says.
    with pytest.raises(UserError, match=r"set data.hf_tokenizer.bos_token to the token to use \(a recipe takes "
                                        r"bos_token only with data.add_bos = true; without it, repair or remove the "
                                        r"file\)\.$"):
        HFTokenizer(HFTokenizerArgs(path=str(folder), eos_token="<|endoftext|>"))
    flags = ["--data.tokenizer=hf_tokenizer", f"--data.hf_tokenizer.path={folder}",
             "--data.hf_tokenizer.eos_token=<|endoftext|>", "--data.hf_tokenizer.bos_token=<s>"]
    with pytest.raises(RecipeError, match="only names the token data.add_bos puts before each document"):
        resolve([DEBUG, *flags], world_size=1)
    resolve([DEBUG, *flags, "--data.add_bos=true"], world_size=1)
    named = HFTokenizer(HFTokenizerArgs(path=str(folder), eos_token="<|endoftext|>", bos_token="<s>"))
    assert named.eos_id == 0 and named.notes == []
    (folder / "tokenizer_config.json").unlink()  # no config at all: the usual end-of-document names are tried
    guessed = HFTokenizer(HFTokenizerArgs(path=str(folder)))
    assert guessed.eos_id == 0 and guessed.notes == [
        f"tokenizer hf_tokenizer: documents end with '<|endoftext|>' (the first of the usual end-of-text tokens "
        f"{str(folder / 'tokenizer.json')!r} holds; neither data.hf_tokenizer.eos_token nor a tokenizer_config.json "
        f"names one). Set data.hf_tokenizer.eos_token to choose."]


def test_an_ordinary_token_is_refused_as_the_end_or_start_of_a_document(trained):
    """Text yields an ordinary token's id too, so a document's end would not be told from the letter."""
    with pytest.raises(UserError, match=r"eos_token 'a' is an ordinary token of .*: text yields it too, so the end "
                                        r"of a document could not be told from text. Fix: set "
                                        r"data.hf_tokenizer.eos_token to a special token \(its special tokens: "
                                        r"'<\|endoftext\|>', '<s>'\)"):
        HFTokenizer(HFTokenizerArgs(path=str(trained), eos_token="a"))
    with pytest.raises(UserError, match="bos_token 'b' is an ordinary token .* the start of a document"):
        HFTokenizer(HFTokenizerArgs(path=str(trained), bos_token="b"))


def test_an_ordinary_bos_token_in_the_config_is_left_to_add_bos(trained, tmp_path):
    """A run without add_bos never puts the config's bos_token in: an ordinary one is no reason to refuse it."""
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "b"}))
    tok = HFTokenizer(HFTokenizerArgs(path=str(folder)))
    assert tok.eos_id == 0 and tok.bos_id == tok.encode("b")[0]


def test_the_debug_recipe_trains_with_it(trained, tmp_path, monkeypatch):
    import torch

    from nsa_titan.trainer import Trainer

    assert TOKENIZERS["hf_tokenizer"][0] is HFTokenizerArgs
    tok = HFTokenizer(HFTokenizerArgs(path=str(trained)))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (600, 1, 0)  # unlike the byte tokenizer's 258, 256, 257
    seen = []  # what each training forward saw: the run's tokenizer, the model's tables, the batch, the logits
    forward = Trainer._forward

    def recording_forward(self, batch):
        logits, targets = forward(self, batch)
        seen.append((self.tokenizer, self.model.tok_embeddings.weight.shape, self.model.output.weight.shape,
                     batch.inputs.clone(), batch.document_starts.clone(), logits.shape))
        return logits, targets

    monkeypatch.setattr(Trainer, "_forward", recording_forward)
    out = tmp_path / "run"
    argv = [DEBUG, *TINY, "--training.steps=2", "--data.tokenizer=hf_tokenizer",
            f"--data.hf_tokenizer.path={trained}", "--data.add_bos=true", f"--job.dump_folder={out}"]
    assert cli.main(["train", *argv]) == 0
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2]
    assert len(seen) == 2  # one micro-batch per step
    for used, embedding, output, inputs, starts, logits in seen:
        assert isinstance(used, HFTokenizer) and used.name == tok.name and used.vocab_size == 600
        assert tuple(embedding) == (600, 32) and tuple(output) == (600, 32)  # the model's vocabulary is its
        assert tuple(logits) == (8, 64, 600)
        assert inputs.min() >= 0 and inputs.max() < 600
        # Every document opens with the BOS id after the previous one's EOS; the id appears nowhere else (a
        # row's first token opens a document too, though a document cut by the row end goes on there).
        inner = starts[:, 1:]
        assert torch.equal(inputs[:, 1:] == tok.bos_id, inner)
        assert (inputs[:, :-1][inner] == tok.eos_id).all()
    rows = torch.cat([inputs for *_, inputs, _, _ in seen])
    assert (rows >= 258).any()  # ids a byte tokenizer never gives
    # The first row of each of the 4 logical shards starts at its first document, so with its BOS.
    assert int((rows[:, 0] == tok.bos_id).sum()) >= 4
    # Its loss starts near ln(600), that of uniform guesses over 600 tokens (ln 258 = 5.55 for bytes).
    assert abs(metrics(out)[0]["loss"] - math.log(600)) < 0.1


def test_a_run_is_told_the_end_of_document_token_it_guessed(trained, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())  # no tokenizer_config.json
    argv = [DEBUG, *TINY, "--training.steps=1", "--data.tokenizer=hf_tokenizer", f"--data.hf_tokenizer.path={bare}",
            f"--job.dump_folder={tmp_path / 'run'}"]
    assert cli.main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("note: tokenizer hf_tokenizer: documents end with '<|endoftext|>' (the first of the usual") == 1


def _ascii_bpe(folder, *normalizer) -> str:
    """A BPE with no unknown token and no byte fallback, trained on a few ASCII lines: encode() drops every
    character it has no token for."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if normalizer:
        tok.normalizer = normalizers.Sequence(list(normalizer))
    lines = ["the quick brown fox jumps over the lazy dog", "def f(x): return x + 1"] * 20
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=100, special_tokens=["<|endoftext|>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_a_tokenizer_that_drops_the_datas_text_is_said_at_start_up(tmp_path, capsys):
    """Training and doctor said nothing while a third of the text never reached the model."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Grüße aus Köln — 日本語 and the quick fox\n" * 50)
    argv = [DEBUG, *TINY, "--training.steps=1", "--data.tokenizer=hf_tokenizer", "--data.source=text_files",
            f"--data.text_files.paths={corpus}", f"--data.hf_tokenizer.path={_ascii_bpe(tmp_path / 'ascii')}"]
    note = "loses 32% of the characters of the first 1 training document (encoded and decoded again; 'Grüße' reads " \
           "back as 'r e'): it drops or replaces what its vocabulary lacks, so the model never sees that text. Fix: " \
           "a tokenizer that covers the data"
    assert cli.main(["train", *argv, f"--job.dump_folder={tmp_path / 'run'}"]) == 0
    assert capsys.readouterr().out.count(note) == 1
    assert cli.main(["doctor", *argv, f"--job.dump_folder={tmp_path / 'other'}"]) == 0
    data = next(line for line in capsys.readouterr().out.splitlines() if " data (" in line)
    assert data.startswith("warn ") and note in data, data


def test_a_normalising_or_whole_tokenizer_loses_no_text(trained, tmp_path):
    """Lowercasing and NFKC change the text, not what it says; a byte-level BPE reads any text back whole."""
    from tokenizers import normalizers

    from components.data import lost_text_note

    lowercasing = HFTokenizer(HFTokenizerArgs(path=_ascii_bpe(tmp_path / "lower", normalizers.NFKC(),
                                                              normalizers.Lowercase())))
    assert lost_text_note(lowercasing, ["THE QUICK ﬁx: DEF F(X): RETURN X + 1"]) is None
    assert lost_text_note(HFTokenizer(HFTokenizerArgs(path=str(trained))), SAMPLES) is None
    assert "loses 21% of the characters" in lost_text_note(lowercasing, ["THE QUICK ﬁx 日本語"])  # 3 of 14


def test_the_lost_text_check_reads_a_source_that_prepares_its_documents():
    """A source with prepares_documents (documents() takes the loader's `prepare`, a required argument of a
    plugin's) is read as it comes, not refused for a missing argument."""
    from components.data import first_texts

    class Preparing:
        prepares_documents = True

        def documents(self, shard, num_shards, split, seed, epoch, cursor, *, prepare):
            for j in range(3):
                yield prepare(f"document {shard}/{j}"), j + 1

    assert first_texts(Preparing(), 2, 0) == [f"document {s}/{j}" for s in range(2) for j in range(3)]


def test_a_tokenizer_under_the_home_folder_is_read_with_a_tilde(trained, tmp_path, monkeypatch):
    """data.hf_tokenizer.path = '~/tok' was "'~/tok' does not exist" (data sources read '~' as the home folder)."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(trained, tmp_path / "tok")
    tok = HFTokenizer(HFTokenizerArgs(path="~/tok"))
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
